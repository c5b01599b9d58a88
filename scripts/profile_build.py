"""Where a cuda export's C++ stage goes (issue 27: the general method's ``cpp`` stage took 58.7 s
of a 1B build, the decode method's 11.6 s, and an 8B build's about the same 50.6 s).

Runs ``offgraph_export export ... --json`` in this process with two probes around AOTInductor's C++
stage, neither of which changes what is built: every compiler or linker process it starts (its
first words, output file and seconds) and a cProfile of each ``AotCodeCompiler.compile`` call (the
25 functions of most cumulative time). Writes ``--out`` (JSON: the export's own timings, the
processes, the profiles, and every Inductor timer by name). The probes are this script's own: the
package it writes is the one ``export`` writes.

    python scripts/profile_build.py --out build_profile.json -- hf:benchmarks/configs/llama-3.2-1b \\
        -o /tmp/p/1b.pt2 --device cuda --dtype bfloat16 --max-capacity 8384 --initial-capacity 1024 --max-write 1024
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import cProfile
import io
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _describe(cmd: Any) -> dict[str, Any]:
    """A started process's first words and its output file (``-o X``), not its whole command line."""
    words = cmd.split() if isinstance(cmd, str) else [str(w) for w in cmd]
    out = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "-o"), "")
    sources = [w for w in words if w.endswith((".cpp", ".S", ".s", ".o", ".cubin"))][:4]
    return {"head": " ".join(Path(w).name if i == 0 else w for i, w in enumerate(words[:2])), "out": Path(out).name,
            "sources": [Path(s).name for s in sources],
            "opt": [w for w in words if w.startswith("-O")], "n_words": len(words)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="a torch._inductor.config setting for this run (a Python literal), e.g. aot_inductor.precompile_headers=False")
    parser.add_argument("export_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    export_args = [a for a in args.export_args if a != "--"]
    import torch._inductor.config as inductor_config

    settings = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--config {item!r}: expected KEY=VALUE")
        settings[key] = ast.literal_eval(value)
    inductor_config.patch(settings).__enter__()  # for the whole run; export's own options override per compile

    processes: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []

    def timed(original):
        def run(cmd, *a, **kw):
            t0 = time.perf_counter()
            try:
                return original(cmd, *a, **kw)
            finally:
                processes.append({**_describe(cmd), "s": round(time.perf_counter() - t0, 3), "at": round(t0 - started, 1)})
        return run

    from torch._inductor import codecache

    for name in ("run", "check_output", "check_call"):  # what torch._inductor.cpp_builder starts compilers with
        setattr(subprocess, name, timed(getattr(subprocess, name)))
    original_compile = codecache.AotCodeCompiler.compile.__func__

    def profiled_compile(cls, *a, **kw):
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        first = len(processes)
        try:
            return profile.runcall(original_compile, cls, *a, **kw)
        finally:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
            profiles.append({"s": round(time.perf_counter() - t0, 3), "at": round(t0 - started, 1),
                             "processes": processes[first:], "top": text.getvalue().splitlines()[:60]})

    codecache.AotCodeCompiler.compile = classmethod(profiled_compile)

    from offgraph_export.cli.main import cli

    started = time.perf_counter()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        try:
            cli.main(["export", *export_args, "--json"])
        except SystemExit as exc:
            if exc.code:
                raise
    wall = time.perf_counter() - started
    lines = [line for line in stdout.getvalue().splitlines() if line.startswith("{")]
    summary = json.loads(lines[-1]) if lines else {}
    from torch._dynamo import utils as dynamo_utils

    metrics = {k: [round(sum(v), 3), len(v)] for k, v in getattr(dynamo_utils, "compilation_time_metrics", {}).items()}
    configs = "".join(f" --config {item}" for item in args.config)
    record = {"command": f"python scripts/profile_build.py --out OUT{configs} -- " + " ".join(export_args), "config": settings, "wall_s": round(wall, 1),
              "export": summary, "aoti_compile_calls": profiles, "processes": processes,
              "inductor_timers": dict(sorted(metrics.items(), key=lambda kv: -kv[1][0]))}
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wall {wall:.1f}s; compile {summary.get('compile_s')}; cpp stages "
          f"{ {k: v for k, v in summary.items() if k.endswith('_cpp_s')} }", file=sys.stderr)
    for i, p in enumerate(profiles):
        slow = sorted(p["processes"], key=lambda q: -q["s"])[:6]
        print(f"AotCodeCompiler.compile #{i}: {p['s']}s; slowest processes: {slow}", file=sys.stderr)


if __name__ == "__main__":
    main()
