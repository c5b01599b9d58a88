"""Per-step host overhead of the runtime: prepare (admission, input values, growth check) + commit,
excluding the compiled program, over N decode steps of the bundled example. The input-value part
(positions owned, table indices bounded; ``runtime/input_values.py``) is also timed on its own.

    python scripts/bench_host_overhead.py [ARTIFACT] [--steps 1000]

Exports the example to a temporary file when no artifact is given. Prints medians in microseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from offgraph_export.frontends import load_bundle
from offgraph_export.runtime import Artifact
from offgraph_export.runtime.input_values import InputValues

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "tiny_llama.py") + ":build"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?")
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    bundle = load_bundle(EXAMPLE, max_capacity=2048)
    path = args.artifact
    if path is None:
        from offgraph_export.pipeline import export_and_lower

        path = Path(tempfile.mkdtemp()) / "tiny.pt2"
        export_and_lower(bundle, path)
    artifact = Artifact.load(path)
    session = artifact.new_session()
    device = artifact.device
    tokens = torch.zeros(1, 1, dtype=torch.int64, device=device)
    session.step(*bundle.make_inputs(torch.zeros(1, 8, dtype=torch.int64, device=device), 0))
    prepare_ns, commit_ns, program_ns, values_ns = [], [], [], []
    values = InputValues(artifact.specs, device)
    for _ in range(args.steps):
        inputs = bundle.make_inputs(tokens, session.committed_length)
        t0 = time.perf_counter_ns()
        values.apply(inputs, 1, session.committed_length)
        values_ns.append(time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        prepared = session.prepare(inputs)
        t1 = time.perf_counter_ns()
        session.run(prepared)
        t2 = time.perf_counter_ns()
        session.commit(prepared)
        t3 = time.perf_counter_ns()
        prepare_ns.append(t1 - t0)
        program_ns.append(t2 - t1)
        commit_ns.append(t3 - t2)
    overhead = [p + c for p, c in zip(prepare_ns, commit_ns)]
    result = {
        "steps": args.steps,
        "prepare_us_median": statistics.median(prepare_ns) / 1e3,
        "commit_us_median": statistics.median(commit_ns) / 1e3,
        "input_values_us_median": statistics.median(values_ns) / 1e3,
        "host_overhead_us_median": statistics.median(overhead) / 1e3,
        "host_overhead_us_p90": sorted(overhead)[int(0.9 * len(overhead))] / 1e3,
        "compiled_step_us_median": statistics.median(program_ns) / 1e3,
        "growths": session.storage.growth_count,
        "torch": torch.__version__,
        "device": str(device),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
