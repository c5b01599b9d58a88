"""Decode at the memory floor, side by side: this project's artifact against the static-cache paths a
transformers user would otherwise pick, on one model, in one run (``benchmarks/run.sh`` drives it).

Contenders (all the same Llama-3.2-1B-shaped model: ``benchmarks/configs/llama-3.2-1b``, random
bf16 weights from seed 0, batch 1):

* ``offgraph``: ``offgraph-export export hf:CONFIG`` for cuda with the defaults (decode method,
  max-autotune on it, GEMV projections with their folds, rotary fold), run by the bundled runtime,
  ordinary launches and CUDA-graph decode; ``offgraph-gemv`` (``--no-decode-rope``) and
  ``offgraph-unfused`` (``--no-decode-gemv --no-decode-rope``) take folds away (``VARIANTS``);
  ``offgraph-int8`` and ``offgraph-int4`` (``--quantize int8``, ``--quantize int4 --group-size
  128``) store every linear quantized, and their floor counts the stored bytes
  (:func:`quantized_weight_bytes`). This project's CUDA-graph rows also time the captured graph
  replayed alone (``replay_ms``), and its ``loop`` rows ``generate``'s greedy loop (the next step
  queued before the token is read, so the host's work overlaps the step before: :func:`loop_rows`).
* ``hf-aoti``: transformers' static cache (``TorchExportableModuleWithStaticCache``), exported
  with one token per step and compiled by AOTInductor, ordinary launches and replayed as a CUDA
  graph. Its cache holds ``--max-cache-len`` rows and every step attends over all of them.
* ``hf-compile``: the same static-cache module under ``torch.compile(mode=
  "max-autotune-no-cudagraphs")`` replayed as a CUDA graph (the gpt-fast recipe).
* ``hf-eager``: transformers eager with its static cache, for the prefill of a 1024-token prompt.
* ``gptfast`` (``benchmarks/gptfast.py``, run by ``run.sh`` after these): a static-cache Llama written
  the gpt-fast way under torch.compile, replayed as a CUDA graph; ``gptfast-int8``/``-int4`` too.

Per contender and history: decode ms/token (median of ``--steps`` steps, CUDA events around each
step, host work included), tokens/s, the floor (the weights a step reads, an untied embedding table
left out, + the history's K/V bytes, read once at the measured copy rate) and the share of it achieved, KV bytes allocated; per contender: export +
compile seconds, package bytes, prefill of 1024 tokens, and the GPU time of one decode step by
kernel class (torch.profiler). This project's sessions reserve the rows they will use first
(``Session.reserve(history + decode steps)``, as ``generate`` does for a prompt and its new
tokens), so their KV bytes are the rows a session of that length needs, not a doubling's. Subcommands write JSON into ``--out``; ``report.py`` renders them.

    python benchmarks/decode_bench.py {build-offgraph,build-hf-aoti,hf-compile,measure} --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import fcntl
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "benchmarks" / "configs" / "llama-3.2-1b")
PREFILL = 1024
#: Decode steps a measuring session takes beyond ``--steps``: the first (the capture), the timing
#: warm-up (5) and a kernel breakdown (7), with room to spare; reserved up front.
EXTRA_DECODE_STEPS = 32


# -- shared helpers ------------------------------------------------------------------------------


def run_export(cmd: list[str], out: Path, name: str) -> dict:
    """Run an ``offgraph-export export ... --json`` command, keep its log as ``NAME_export.log``,
    and save its summary (with the wall time and the command) as ``NAME_build.json``."""
    log(f"building {name}:", " ".join(cmd[2:]))
    t0 = time.perf_counter()
    log_path = out / f"{name}_export.log"
    # the export's stage lines go to the log as they are printed, so a build stopped by a time
    # limit still shows the stage it was in (a Qwen2.5-7B build's log was lost so, 2026-12-07)
    with open(log_path, "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} export failed:\n{log_path.read_text()[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    summary["wall_s"] = time.perf_counter() - t0
    summary["command"] = " ".join(cmd[2:])
    save(out, f"{name}_build", summary)
    return summary


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def save(out: Path, name: str, data: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    log("wrote", out / f"{name}.json")


@contextlib.contextmanager
def measuring(out: Path):
    """One contender measures at a time (builds may overlap): an exclusive lock on a file."""
    with open(out / ".measure.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step, n: int, warmup: int = 5) -> dict:
    """Median/p10/p90 ms of ``step()`` over ``n`` calls after ``warmup``, one CUDA-event pair per
    call (perf_counter on cpu)."""
    times = []
    for i in range(n + warmup):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            step()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    times.sort()
    return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10],
            "p90_ms": times[(9 * len(times)) // 10], "steps": n}


def kernel_class(name: str) -> str:
    """A kernel's class by its name: the kernel's own kind first (an inductor template is a GEMM
    whatever it fused), then what it computes."""
    n = name.lower()
    if n.startswith("triton_tem") or any(k in n for k in ("gemm", "gemv", "cublas", "cutlass", "nvjet", "splitk")):
        return "gemm"
    if any(k in n for k in ("_decode_attend", "_attend_kernel", "_combine", "_write_rows", "flash", "fmha", "sdpa", "attention")):
        return "attention"
    if n.startswith(("triton_poi", "triton_red", "triton_per")) and "mm" in n.split("fused_")[-1].split("_"):
        return "gemm"  # a reduction inductor generated for a matmul (no template)
    if n.startswith(("memcpy", "memset")) or "memcpy" in n or "memset" in n:
        return "copy"
    if n.startswith("triton_") or "elementwise" in n or "reduce" in n or "vectorized" in n:
        return "pointwise/norm"
    return "other"


def kernel_breakdown(step, steps: int = 5, trace: Path | None = None) -> dict:
    """GPU time of one ``step()`` by kernel class, from torch.profiler over ``steps`` calls.
    ``trace``: also write a chrome trace (host and device) of one more step there, gzipped; its
    host times are inflated by the profiler (a per-step GPU span measured that way came out
    longer than the unprofiled step, so the idle time between kernels is taken from the replay
    timing instead, ``report.py``)."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    by_class: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    top: dict[str, float] = defaultdict(float)
    for event in _device_events(prof):
        us = event.device_time if hasattr(event, "device_time") else event.cuda_time
        cls = kernel_class(event.name)
        by_class[cls] += us / steps
        counts[cls] += 1
        top[event.name[:80]] += us / steps
    if trace is not None:
        import gzip

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as one:
            step()
            sync()
        raw = trace.with_suffix("")
        one.export_chrome_trace(str(raw))
        trace.write_bytes(gzip.compress(raw.read_bytes()))
        raw.unlink()
    total = sum(by_class.values())
    return {
        "us_per_step": {k: round(v, 1) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "kernels_per_step": {k: v // steps for k, v in counts.items()},
        "total_us": round(total, 1),
        "top_kernels_us": {k: round(v, 1) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]},
    }


def kernel_sequence(step, top: int = 12) -> dict:
    """The kernels of one ``step()`` in launch order (torch.profiler): how many, the sum of the gaps
    between one kernel's end and the next one's start (time the GPU sat idle inside the step:
    launch gaps between graph nodes, host work between launches), the largest gaps with the
    kernels around them, and each kernel's name, us and the gap before it. Read with
    ``kernel_breakdown``: its ``idle`` is the unprofiled step minus the kernels' time."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    events = sorted(_device_events(prof), key=lambda e: e.time_range.start)
    kernels, gaps = [], []
    for i, e in enumerate(events):
        gap = 0.0 if i == 0 else max(0.0, e.time_range.start - events[i - 1].time_range.end)
        kernels.append({"name": e.name[:80], "us": round(e.time_range.end - e.time_range.start, 2), "gap_us": round(gap, 2)})
        if i:
            gaps.append((gap, events[i - 1].name[:60], e.name[:60]))
    gaps.sort(key=lambda g: -g[0])
    span = events[-1].time_range.end - events[0].time_range.start if events else 0.0
    return {
        "kernels": len(events),
        "span_us": round(span, 1),
        "busy_us": round(sum(k["us"] for k in kernels), 1),
        "gaps_us": round(sum(g[0] for g in gaps), 1),
        "median_gap_us": round(statistics.median([g[0] for g in gaps]), 2) if gaps else 0.0,
        "largest_gaps": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in gaps[:top]],
        "sequence": kernels,
    }


def _device_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: the parameters, a tied matrix counted once
    (``parameters()`` yields it once), less an input embedding table that is not also the lm_head
    (a step reads one row of it a token; the Llama-3.1-8B shape's is 1.05 GB of its 16.06)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.get_input_embeddings().weight
    if table is not getattr(model.get_output_embeddings(), "weight", None):
        total -= table.numel() * table.element_size()
    return total


def quantized_weight_bytes(model: torch.nn.Module, scheme: str, group: int | None) -> int:
    """What :func:`weight_bytes` counts when every linear (the lm_head included) is stored as
    ``scheme``: the stored tensors the quantization rule makes of each weight (``quantize``, run on
    meta copies: shapes and dtypes only), biases and every other weight as they are (the input
    embedding table, one row a token, left out)."""
    from offgraph_export.reference.weight_quant import quantize

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = {id(m.weight) for m in linears}
    table = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in quantized and p is not table)
    for m in linears:
        stored = quantize(torch.empty(m.weight.shape, dtype=m.weight.dtype, device="meta"), scheme, group)
        total += sum(t.numel() * t.element_size() for t in stored.tensors().values())
    return total


def kv_bytes_per_token(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # K+V, bf16


def vocab_size(config_dir: str) -> int:
    return int(json.loads((Path(config_dir) / "config.json").read_text())["vocab_size"])


def hf_config(config_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config_dir, local_files_only=True)


def load_hf_uninitialized(config_dir: str):
    """The model with weights drawn on the device (no CPU init): for timings that do not depend
    on the weights' values (the prefill of the eager baseline) and for counting weight bytes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config_dir), dtype=torch.bfloat16)
    model = model.to_empty(device=device()).requires_grad_(False)
    gen = torch.Generator(device=device()).manual_seed(0)
    for p in model.parameters():
        p.normal_(0.0, 0.02, generator=gen)
    model.generation_config.cache_implementation = "static"
    model.generation_config.use_cache = True
    return model.eval()


def load_hf(config_dir: str):
    from offgraph_export.frontends.hf import load_hf_model

    model = load_hf_model(config_dir, "bfloat16", seed=0).model.to(device()).requires_grad_(False)
    model.generation_config.cache_implementation = "static"
    model.generation_config.use_cache = True
    return model


def static_cache_module(model, max_cache_len: int):
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    return TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=max_cache_len, device=device())


def cache_bytes(module) -> int:
    return sum(b.numel() * b.element_size() for n, b in module.named_buffers() if "cache" in n and b.dim() == 4)


def graph_step(fn, static_inputs: list[torch.Tensor]):
    """``fn(*static_inputs)`` captured as a CUDA graph; returns (replay, static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*static_inputs)
    return graph.replay, outputs


# -- builds ---------------------------------------------------------------------------------------


#: this project's variants: contender name -> extra export arguments
VARIANTS = {
    "offgraph": [],  # the cuda defaults: decode method, GEMV projections with their folds, rotary fold
    "offgraph-gemv": ["--no-decode-rope"],
    "offgraph-unfused": ["--no-decode-gemv", "--no-decode-rope"],  # the compiler's GEMMs
    # weight-only quantization (design section 11): every linear, the lm_head included
    "offgraph-int8": ["--quantize", "int8"],
    "offgraph-int4": ["--quantize", "int4", "--group-size", "128"],
}
#: the quantized variants: (scheme, group size), for the bytes their steps read
QUANTIZED = {"offgraph-int8": ("int8", None), "offgraph-int4": ("int4", 128)}


def build_offgraph(args) -> None:
    out = Path(args.out)
    name = args.variant
    art = Path(args.artifacts) / f"{name}.pt2"
    cmd = [
        sys.executable, "-m", "offgraph_export", "export", f"hf:{args.config}", "-o", str(art),
        "--device", "cuda" if torch.cuda.is_available() else "cpu", "--dtype", "bfloat16",
        "--max-capacity", str(args.max_capacity), "--initial-capacity", "1024", "--max-write", str(PREFILL),
        "--json", *VARIANTS[name], *args.export_args,
    ]
    run_export(cmd, out, name)


def build_hf_aoti(args) -> None:
    out = Path(args.out)
    model = load_hf(args.config)
    module = static_cache_module(model, args.max_cache_len)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device())
    pos = torch.zeros(1, dtype=torch.long, device=device())
    t0 = time.perf_counter()
    # strict=True: dynamo sees that the cache layers' tensors are the module's registered buffers.
    # Non-strict export lifts the layers' own references (e.g. ``cumulative_length``) as constants
    # and AOTInductor then refuses to mutate them (seen with torch 2.13 + transformers 5.24 on cpu,
    # torch 2.11 + transformers 5.17 on the H200); strict export compiles and matches eager on cpu.
    ep = torch.export.export(module, args=(), kwargs={"input_ids": ids, "cache_position": pos}, strict=True)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    from offgraph_export.compat import fresh_int_array_names  # torch 2.11's wrapper names (DEVICE.md)

    with fresh_int_array_names():
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(Path(args.artifacts) / "hf_aoti.pt2"))
    compile_s = time.perf_counter() - t0
    save(out, "hf_aoti_build", {
        "artifact": path, "export_s": export_s, "compile_s": compile_s, "bytes": os.path.getsize(path),
        "kv_bytes": cache_bytes(module), "max_cache_len": args.max_cache_len,
    })


# -- measurements ---------------------------------------------------------------------------------


def decode_rows(name: str, mode: str, step_at, histories, steps: int, floor) -> list[dict]:
    """``step_at(history)`` -> (a step callable at that history, KV bytes allocated)."""
    rows = []
    for history in histories:
        step, kv_bytes = step_at(history)
        timing = time_steps(step, steps)
        ms = timing["median_ms"]
        floor_ms, floor_bytes = floor(history)
        rows.append({
            "contender": name, "mode": mode, "history": history, **timing,
            "tokens_per_s": 1e3 / ms, "gb_per_s": floor_bytes / (ms * 1e-3) / 1e9,
            "floor_ms": floor_ms, "pct_of_floor": 100 * floor_ms / ms, "kv_bytes": kv_bytes,
        })
        log(f"{name:10s} {mode:8s} history {history:6d}: {ms:.3f} ms ({rows[-1]['pct_of_floor']:.0f}% of floor)")
    return rows


def loop_rows(name: str, artifact, make_inputs, prompt, histories, steps: int, floor) -> list[dict]:
    """``generate``'s greedy loop with CUDA-graph decode on a session prefilled to each history:
    ms/token = the median time between consecutive tokens reaching the host (its ``step_ms``),
    after 5 warm-up tokens; the host's work for a step overlaps the step before it."""
    from offgraph_export.generate import generate

    rows = []
    for history in histories:
        session = artifact.new_session(cuda_graphs=True)
        session.reserve(history + steps + EXTRA_DECODE_STEPS)
        for start in range(0, history, PREFILL):
            session.feed(make_inputs, prompt[:, start : min(start + PREFILL, history)])
        kv_bytes, growths_before = session.metrics().allocated_bytes, session.metrics().growth_count
        result = generate(session, make_inputs, [int(prompt[0, history])], steps + 6)
        if session.metrics().growth_count != growths_before:
            raise RuntimeError("a session's storage grew while its loop was timed: raise EXTRA_DECODE_STEPS")
        times = sorted(result.step_ms[5:])
        ms = statistics.median(times)
        floor_ms, floor_bytes = floor(history)
        rows.append({
            "contender": name, "mode": "loop", "history": history, "median_ms": ms,
            "p10_ms": times[len(times) // 10], "p90_ms": times[(9 * len(times)) // 10], "steps": len(times),
            "tokens_per_s": 1e3 / ms, "gb_per_s": floor_bytes / (ms * 1e-3) / 1e9,
            "floor_ms": floor_ms, "pct_of_floor": 100 * floor_ms / ms, "kv_bytes": kv_bytes,
        })
        log(f"{name:10s} loop     history {history:6d}: {ms:.3f} ms ({rows[-1]['pct_of_floor']:.0f}% of floor)")
        session.close()
    return rows


def measure_offgraph(args, floor, name: str) -> dict:
    from offgraph_export.frontends.hf.bundle import step_inputs as make_inputs  # no model built (8B: ~70 s on the host)
    from offgraph_export.runtime import Artifact

    art = Path(args.artifacts) / f"{name}.pt2"
    sync()
    if torch.cuda.is_available():  # blocks the allocator caches (the copy-rate buffers) would hide the weights in
        torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    if args.profile_load:  # where a load's seconds go (torch's loader took 34-58 s on the GPU machine, unexplained)
        profiler = cProfile.Profile()
        artifact = profiler.runcall(Artifact.load, art, single_threaded=torch.cuda.is_available())
        with open(Path(args.out) / f"{name}_load_profile.txt", "w") as fh:
            pstats.Stats(profiler, stream=fh).sort_stats("cumulative").print_stats(40)
    else:
        artifact = Artifact.load(art, single_threaded=torch.cuda.is_available())
    loaded_bytes = free0 - torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    log(f"{name} loaded in {artifact.load_s:.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in artifact.load_seconds.items())}), "
        f"{loaded_bytes / 1e9:.2f} GB on the device")
    dev = artifact.device
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(1000, vocab_size(args.config)), (1, max(args.history) + PREFILL), generator=gen).to(dev)
    sessions = []

    growths: dict[int, int] = {}  # session -> its growth count after the first decode step

    def close_sessions() -> None:
        for s in sessions:
            if s.metrics().growth_count != growths.get(id(s), s.metrics().growth_count):
                raise RuntimeError("a session's storage grew while it was measured: raise EXTRA_DECODE_STEPS")
            s.close()
        sessions.clear()

    def step_at_mode(graphs: bool):
        def step_at(history: int):
            session = artifact.new_session(cuda_graphs=graphs)
            sessions.append(session)
            session.reserve(history + args.steps + EXTRA_DECODE_STEPS)
            for start in range(0, history, PREFILL):
                session.feed(make_inputs, prompt[:, start : min(start + PREFILL, history)])
            token = prompt[:, history : history + 1]
            inputs = make_inputs(token, history)  # built once: a decode loop hands the same token

            def step():
                session.feed(lambda _tokens, _start: inputs, token)  # the runtime supplies positions

            step()  # first decode step (capture with graphs)
            growths[id(session)] = session.metrics().growth_count
            return step, session.metrics().allocated_bytes
        return step_at

    rows = []
    for graphs in ([False, True] if dev.type == "cuda" else [False]):
        rows += decode_rows(name, "graph" if graphs else "ordinary", step_at_mode(graphs), args.history, args.steps, floor)
        if graphs:
            # the captured graph replayed alone (the same step again: no input copies, no runtime
            # work before it), what the static-cache contenders' graph rows time; the difference
            # to the full step is this runtime's host work before the replay
            for session, row in zip(sessions, rows[-len(sessions):]):
                row["replay_ms"] = time_steps(session.replay_graph, args.steps)["median_ms"]
                log(f"{name:10s} replay   history {row['history']:6d}: {row['replay_ms']:.3f} ms")
        close_sessions()
    if dev.type == "cuda":  # the greedy loop a user runs (`generate`: the next step queued before a token is read)
        rows += loop_rows(name, artifact, make_inputs, prompt, args.history, args.steps, floor)
    # prefill of 1024 tokens from an empty cache, the general method
    session = artifact.new_session()

    def prefill():
        session.reset()
        session.feed(make_inputs, prompt[:, :PREFILL])

    prefill_t = time_steps(prefill, 10, warmup=2)
    breakdown, breakdown_last = {}, {}
    for graphs in ([False, True] if dev.type == "cuda" else []):
        mode = "graph" if graphs else "ordinary"
        step, _ = step_at_mode(graphs)(args.history[0])
        trace = Path(args.out) / f"trace_{name}_{mode}_{args.history[0]}.json.gz" if name == "offgraph" else None
        breakdown[mode] = kernel_breakdown(step, trace=trace)
        close_sessions()
        if len(args.history) > 1:
            step, _ = step_at_mode(graphs)(args.history[-1])
            breakdown_last[mode] = kernel_breakdown(step)
            close_sessions()
    return {"rows": rows, "prefill_1024": prefill_t, "breakdown_1k": breakdown,
            "breakdown_last": {"history": args.history[-1], **breakdown_last},
            "device_bytes_after_load": loaded_bytes, "specs_options": artifact.specs.options,
            "methods": artifact.specs.methods}


def measure_hf_aoti(args, floor) -> dict:
    out = Path(args.out)
    build = json.loads((out / "hf_aoti_build.json").read_text())
    from torch._inductor import aoti_load_package

    compiled = aoti_load_package(build["artifact"], run_single_threaded=True)
    run = compiled.loader.run
    ids = torch.zeros(1, 1, dtype=torch.long, device=device())
    pos = torch.zeros(1, dtype=torch.long, device=device())
    rows = []

    def ordinary_at(history: int):
        pos.fill_(history)
        return (lambda: run([ids, pos])), build["kv_bytes"]

    rows += decode_rows("hf-aoti", "ordinary", ordinary_at, args.history, args.steps, floor)
    if not torch.cuda.is_available():
        return {"rows": rows, "breakdown_1k": {}}
    replay, _ = graph_step(lambda a, b: run([a, b]), [ids, pos])

    def graph_at(history: int):
        pos.fill_(history)
        return replay, build["kv_bytes"]

    rows += decode_rows("hf-aoti", "graph", graph_at, args.history, args.steps, floor)
    pos.fill_(args.history[0])
    breakdown = {"ordinary": kernel_breakdown(lambda: run([ids, pos])), "graph": kernel_breakdown(replay)}
    return {"rows": rows, "breakdown_1k": breakdown}


def measure_hf_eager_prefill(args) -> dict:
    model = load_hf_uninitialized(args.config)
    module = static_cache_module(model, args.max_cache_len)
    ids = torch.randint(0, min(1000, vocab_size(args.config)), (1, PREFILL), device=device())
    pos = torch.arange(PREFILL, device=device())
    with torch.no_grad():
        t = time_steps(lambda: module(input_ids=ids, cache_position=pos), 10, warmup=2)
    del module, model
    torch.cuda.empty_cache()
    return t


def hf_compile(args) -> None:
    """Build (torch.compile max-autotune, compiled at the first call) and measure in one process."""
    out = Path(args.out)
    model = load_hf(args.config)
    module = static_cache_module(model, args.max_cache_len)
    wb = weight_bytes(model)
    compiled = torch.compile(module, mode="max-autotune-no-cudagraphs")
    ids = torch.zeros(1, 1, dtype=torch.long, device=device())
    pos = torch.full((1,), args.history[0], dtype=torch.long, device=device())
    # compiling (from the inductor caches in a measure call, still tens of seconds of CPU and
    # autotuning on the GPU) holds the measuring lock unless it only fills the caches: no other
    # contender's timing overlaps it
    with (contextlib.nullcontext() if args.compile_only else measuring(out)), torch.no_grad():
        t0 = time.perf_counter()
        compiled(input_ids=ids, cache_position=pos)
        sync()
        compile_s = time.perf_counter() - t0
    if args.compile_only:  # BENCH_PHASE=build: warm the inductor caches for a later measure call
        log(f"hf-compile compiled in {compile_s:.0f} s (compile only)")
        save(out, "hf_compile_build", {"compile_s": compile_s})
        return
    log(f"hf-compile compiled in {compile_s:.0f} s; waiting for the other builds to finish")
    deadline = time.time() + 1200
    while not (out / ".builds_done").exists() and time.time() < deadline:
        time.sleep(1)  # measuring while another process autotunes on the GPU would skew both
    with measuring(out), torch.no_grad():
        floor = floor_fn(json.loads((out / "copy_bandwidth.json").read_text())["bytes_per_s"], wb, kv_bytes_per_token(model.config)) \
            if (out / "copy_bandwidth.json").exists() else floor_fn(copy_bandwidth(out)["bytes_per_s"], wb, kv_bytes_per_token(model.config))
        if torch.cuda.is_available():
            replay, _ = graph_step(lambda a, b: compiled(input_ids=a, cache_position=b), [ids, pos])
        else:  # a smoke run on cpu: no graphs
            def replay():
                compiled(input_ids=ids, cache_position=pos)

        def graph_at(history: int):
            pos.fill_(history)
            return replay, cache_bytes(module)

        rows = decode_rows("hf-compile", "graph", graph_at, args.history, args.steps, floor)
        pos.fill_(args.history[0])
        breakdown = {"graph": kernel_breakdown(replay)}
    save(out, "hf_compile", {"compile_s": compile_s, "rows": rows, "breakdown_1k": breakdown,
                             "kv_bytes": cache_bytes(module), "max_cache_len": args.max_cache_len})


def copy_bandwidth(out: Path) -> dict:
    """Device-to-device copy of 1 GiB: (read + written bytes) / median time."""
    n = 1 << 29  # bf16 elements: 1 GiB
    src = torch.empty(n, dtype=torch.bfloat16, device=device())
    dst = torch.empty_like(src)
    t = time_steps(lambda: dst.copy_(src), 20, warmup=3)
    bw = 2 * src.numel() * src.element_size() / (t["median_ms"] * 1e-3)
    data = {"bytes_per_s": bw, **t}
    save(out, "copy_bandwidth", data)
    del src, dst
    return data


def floor_fn(bytes_per_s: float, weights: int, kv_per_token: int):
    def floor(history: int) -> tuple[float, int]:
        moved = weights + kv_per_token * (history + 1)
        return 1e3 * moved / bytes_per_s, moved
    return floor


def measure(args) -> None:
    out = Path(args.out)
    with measuring(out):
        bw = copy_bandwidth(out)
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(hf_config(args.config), dtype=torch.bfloat16)
        wb, kvt = weight_bytes(meta), kv_bytes_per_token(meta.config)
        # a quantized variant's floor is the bytes its step reads (its weights' stored form)
        variant_wb = {name: quantized_weight_bytes(meta, *form) for name, form in QUANTIZED.items()}
        del meta
        floor = floor_fn(bw["bytes_per_s"], wb, kvt)
        save(out, "floor", {"weight_bytes": wb, "kv_bytes_per_token": kvt, "copy_bytes_per_s": bw["bytes_per_s"],
                            "floor_ms": {h: floor(h)[0] for h in args.history}, "variant_weight_bytes": variant_wb})
        with torch.no_grad():
            for name in VARIANTS:
                if (out / f"{name}_build.json").exists():
                    own = floor_fn(bw["bytes_per_s"], variant_wb[name], kvt) if name in variant_wb else floor
                    save(out, name, measure_offgraph(args, own, name))
                torch.cuda.empty_cache()
            if (out / "hf_aoti_build.json").exists():
                save(out, "hf_aoti", measure_hf_aoti(args, floor))
            torch.cuda.empty_cache()
            save(out, "hf_eager_prefill", measure_hf_eager_prefill(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["build-offgraph", "build-hf-aoti", "hf-compile", "measure"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--artifacts", help="where the compiled packages go (default: --out)")
    parser.add_argument("--history", type=int, nargs="+", default=[1024, 8192, 16384])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--profile-load", action="store_true",
                        help="write a cProfile of each artifact's load (the calling thread's: the weight reader's threads show as waits)")
    parser.add_argument("--max-capacity", type=int, default=32768)
    parser.add_argument("--max-cache-len", type=int, default=16384 + 128)
    parser.add_argument("--compile-only", action="store_true", help="hf-compile: compile (filling the inductor caches) and stop")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="offgraph", help="build-offgraph: which variant")
    parser.add_argument("--export-arg", dest="export_args", action="append", default=[],
                        help="extra argument for offgraph-export export (repeatable)")
    args = parser.parse_args()
    args.artifacts = args.artifacts or args.out
    for d in (args.out, args.artifacts):
        Path(d).mkdir(parents=True, exist_ok=True)
    {"build-offgraph": build_offgraph, "build-hf-aoti": build_hf_aoti, "hf-compile": hf_compile,
     "measure": measure}[args.what](args)


if __name__ == "__main__":
    main()
