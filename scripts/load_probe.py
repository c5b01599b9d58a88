"""Time the first load of a package in a fresh process (design: the loader's first-load cost).

    python scripts/load_probe.py ART.pt2 ours    # Artifact.load, its stages (load_seconds)
    python scripts/load_probe.py ART.pt2 torch   # torch's load_pt2 alone (with its device-information probe)

Prints one JSON line. Run each in its own process: the probe torch's ``load_pt2`` runs is cached
per process, so only a process's first load pays it.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    path, which = sys.argv[1], sys.argv[2]
    started = time.perf_counter()
    import torch

    imported = time.perf_counter() - started
    if torch.cuda.is_available():
        torch.cuda.init()
    t0 = time.perf_counter()
    if which == "ours":
        from offgraph_export.runtime.artifact import Artifact

        stages = Artifact.load(path).load_seconds
    else:
        from torch.export.pt2_archive._package import load_pt2

        load_pt2(path)
        stages = {}
    print(json.dumps({"which": which, "import_torch_s": round(imported, 2), "load_s": round(time.perf_counter() - t0, 2),
                      "stages": {k: round(v, 2) for k, v in stages.items()}}))


if __name__ == "__main__":
    main()
