"""Host time of one BatchedRunner step, the compiled program left out: admission, packing the step's
inputs (ids, positions, slots, rows, page tables, lengths) into the staging buffers and copying
them, and cutting the outputs per session. On the H200 (2026-12-02, Llama-3.2-1B shape, B=16) a
batched step took 617 us more than its kernels; this measures the runtime's share of that on any
machine, for a batched artifact of any model (the program's run is replaced by returning a
preallocated output of the right shape, so only the runner's own work is timed).

    python scripts/bench_runner_host.py ARTIFACT.pt2 [--batches 1 16 64] [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offgraph_export.runtime import load_artifact  # noqa: E402
from offgraph_export.runtime.batched import BatchedRunner  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--vocab-out", type=int, default=128256, help="width of the stand-in logits")
    args = p.parse_args()
    program = load_artifact(args.artifact)
    runner = BatchedRunner(program)
    logits = torch.zeros(1, runner.manifest.max_write, args.vocab_out)
    runner._launch = lambda width, one_row_per_session=False: [logits[:, :width]]  # the program left out: host work only
    for b in args.batches:
        sids = [runner.open() for _ in range(b)]
        runner.step({sid: [1] for sid in sids})
        feeds = {sid: [7] for sid in sids}
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            runner.step(feeds)
            times.append(time.perf_counter() - t0)
            if runner.length(sids[0]) + 2 > runner.manifest.max_capacity:
                break
        print(f"B={b}: {statistics.median(times) * 1e6:.1f} us per step (median of {len(times)}), "
              f"{statistics.median(times) * 1e6 / b:.2f} us per session")
        for sid in sids:
            runner.close(sid)


if __name__ == "__main__":
    main()
