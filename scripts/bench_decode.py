"""Decode-step latency of an artifact at several history lengths, with and without CUDA graphs.

    python scripts/bench_decode.py ARTIFACT [ARTIFACT ...] [--history 1024 16384] [--steps 200] [--out FILE]

Several artifacts are measured side by side in one run (for each history, each artifact in turn).
For each history length: a fresh session is prefilled to that length in max_write chunks (not
timed), then ``--steps`` decode steps are timed one by one with CUDA events (GPU) or perf_counter
(CPU) around ``session.step``; the median and p90 are reported in ms, next to the session's metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from offgraph_export.frontends import load_bundle
from offgraph_export.runtime import Artifact
from offgraph_export.specs import read_artifact_specs


def bench(artifact: Artifact, make_inputs, history: int, steps: int, graphs: bool) -> dict:
    session = artifact.new_session(cuda_graphs=graphs)
    device = artifact.device
    max_write = artifact.specs.manifest.max_write
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (1, history), generator=gen).to(device)
    for start in range(0, history, max_write):
        session.step(*make_inputs(prompt[:, start : start + max_write], start))
    token = torch.zeros(1, 1, dtype=torch.int64, device=device)
    times = []
    cuda = device.type == "cuda"
    for i in range(steps + 5):
        inputs = make_inputs(token, session.committed_length)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = session.step(*inputs)[0]
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            logits = session.step(*inputs)[0]
            elapsed = (time.perf_counter() - t0) * 1e3
        token = logits[:, -1:].argmax(-1)
        if i >= 5:  # the first steps include capture / warm-up
            times.append(elapsed)
    times.sort()
    metrics = session.metrics().model_dump()
    session.close()
    return {
        "history": history,
        "cuda_graphs": graphs,
        "steps": steps,
        "median_ms": statistics.median(times),
        "p10_ms": times[int(0.1 * len(times))],
        "p90_ms": times[int(0.9 * len(times))],
        "metrics": metrics,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--history", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    loaded = []
    for path in args.artifacts:
        specs = read_artifact_specs(path)
        bundle = load_bundle(specs.model, **specs.model_args)  # for its input builder
        loaded.append((path, Artifact.load(path, single_threaded=specs.device == "cuda"), bundle.make_inputs))
        del bundle
    results = []
    for history in args.history:
        for path, artifact, make_inputs in loaded:
            for graphs in ([False, True] if artifact.specs.device == "cuda" else [False]):
                results.append({"artifact": path, **bench(artifact, make_inputs, history, args.steps, graphs)})
                print(json.dumps(results[-1]), flush=True)
    report = {"artifacts": args.artifacts, "torch": torch.__version__, "results": results}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
