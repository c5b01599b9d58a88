"""CUDA-graph decode must give the same outputs as eager-launch decode, bit for bit, and
re-capture at most ceil(log2(max_capacity / initial_capacity)) times per session.

    python scripts/compare_graph_decode.py ARTIFACT [--steps 300]

Two sessions over one loaded artifact are fed the same greedy token stream (prefill, then
``--steps`` decode steps crossing several growth boundaries); every step's logits are compared
with torch.equal. Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from offgraph_export.frontends import load_bundle
from offgraph_export.runtime import Artifact
from offgraph_export.specs import read_artifact_specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    specs = read_artifact_specs(args.artifact)
    bundle = load_bundle(specs.model, **specs.model_args)
    artifact = Artifact.load(args.artifact, single_threaded=True)
    plain = artifact.new_session()
    graphed = artifact.new_session(cuda_graphs=True)
    prompt = torch.arange(7, device="cuda").view(1, 7) % 256
    a = plain.step(*bundle.make_inputs(prompt, 0))[0]
    b = graphed.step(*bundle.make_inputs(prompt, 0))[0]
    mismatches = 0 if torch.equal(a, b) else 1
    token = a[:, -1:].argmax(-1)
    for _ in range(args.steps):
        a = plain.step(*bundle.make_inputs(token, plain.committed_length))[0]
        b = graphed.step(*bundle.make_inputs(token, graphed.committed_length))[0]
        mismatches += 0 if torch.equal(a, b) else 1
        token = a[:, -1:].argmax(-1)
    m = graphed.metrics()
    manifest = specs.manifest
    bound = math.ceil(math.log2(manifest.max_capacity / manifest.initial_capacity))
    result = {
        "steps": args.steps,
        "mismatching_steps": mismatches,
        "captures": m.graph_captures,
        "recaptures": m.graph_captures - 1,
        "recapture_bound": bound,
        "growths": m.growth_count,
        "replays": m.graph_replays,
    }
    print(json.dumps(result))
    sys.exit(0 if mismatches == 0 and m.graph_captures - 1 <= bound and m.graph_replays > 0 else 1)


if __name__ == "__main__":
    main()
