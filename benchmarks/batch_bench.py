"""Aggregate decode throughput of B concurrent sessions, side by side, in one run
(``benchmarks/run_batch.sh`` drives it; ``report_batch.py`` renders its JSON).

Contenders (the model of ``benchmarks/configs/llama-3.2-1b``, random bf16 weights, as
``decode_bench.py``):

* ``single``: this project's single-session artifact (``export hf:CONFIG --device cuda --dtype
  bfloat16`` with the defaults, ``--max-capacity`` >= the longest history + the decode steps + a
  margin), B sessions stepped in turn, each replaying its own CUDA-graph decode step
  (``Session.feed``, ``cuda_graphs=True``; each session reserves its rows first, as
  ``decode_bench.py`` and ``generate`` do). One step of the table is one round: B tokens.
* ``hf-static``: transformers' static cache at batch B (``TorchExportableModuleWithStaticCache``)
  under ``torch.compile(mode="max-autotune-no-cudagraphs", dynamic=False)`` and captured by hand as
  one CUDA graph (``decode_bench.py``'s hf-compile recipe at batch B). One compile per B, its cache
  fixed at ``max(--history) + --steps`` rows for every history: every step attends over the whole
  cache, whatever the history. The rows time the graph replayed alone (inputs set once), as
  ``decode_bench.py``'s static-cache rows do.
* ``batched``: this project's batched artifact (``export ... --max-sessions 64 --page-size 16
  --max-capacity C --max-write 512``) run by ``BatchedRunner(cuda_graphs=True)``: B sessions
  prefilled to the history (chunks of up to ``max_write`` tokens, several sessions a step), then
  one ``runner.step({sid: [token], ...})`` per timed step, every session one decode token. The
  step includes the runtime's host work (admission, packing, page tables, input copies, the
  graph replay, the outputs' copy).

Per contender, B and history: ms per step (median of ``--steps``, CUDA events around each step,
``decode_bench.time_steps``), aggregate tokens/s (B / step), % of the memory floor (weights + every
session's live K/V, read once at the copy rate measured in the same run), KV bytes allocated and
live. Also: prefill time of the sessions; the time to first token of a session joining while a
batch of 16 decodes (batched: its prompt packed beside the 16 decode tokens; single: one round of
the 16 then its prefill); the GPU time of one step at B=16 by kernel class
(``decode_bench.kernel_breakdown``); build and compile times.

Session reuse: the sessions of B=1, 4 and 16 are disjoint (0, 1-4, 5-20); B=64 takes all 64 (the
first 21 have decoded their own group's steps: each row records the mean context it ran at).
Longer histories extend the same sessions. Histories after the first are measured while the time
budget (``--deadline``) allows: whatever does not fit is listed under ``skipped``.

    python benchmarks/batch_bench.py {build-single,build-batched,build-hf,build-summary,measure} --out DIR [...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_bench as db  # noqa: E402  (the single-session benchmark's helpers)
from decode_bench import (  # noqa: E402
    copy_bandwidth,
    graph_step,
    kernel_breakdown,
    kernel_sequence,
    log,
    run_export,
    save,
    sync,
    time_steps,
)

CONFIG = db.CONFIG
#: the single-session artifact's widest step (decode_bench's prefill chunk)
SINGLE_MAX_WRITE = db.PREFILL
WARMUP = 5
TTFT_REPEATS = 5
#: seconds kept back at the end of the budget (saving, the report)
MARGIN_S = 20.0
CONTENDERS = ("batched", "single", "hf-static")


def decode_budget(steps: int) -> int:
    """Decode tokens one session may take at one history beyond its prefill: its own group's run
    and the B=64 run (warm-up + steps each), the time-to-first-token rounds, the kernel breakdown,
    and a margin."""
    return 2 * (steps + WARMUP) + 3 * (TTFT_REPEATS + 1) + 12 + 32


def default_capacity(args) -> int:
    need = max(args.history) + decode_budget(args.steps)
    return -(-need // 64) * 64


def cuda() -> bool:
    return torch.cuda.is_available()


def groups(batches: list[int], max_sessions: int) -> dict[int, list[int]]:
    """Which sessions each B uses: disjoint while they fit, else the first B."""
    out, offset = {}, 0
    for b in sorted(batches):
        if offset + b <= max_sessions:
            out[b] = list(range(offset, offset + b))
            offset += b
        else:
            out[b] = list(range(b))
    return out


def pick_batch(batches: list[int], wanted: int) -> int:
    """``wanted`` if measured, else the largest B below it (else the smallest)."""
    below = [b for b in batches if b <= wanted]
    return max(below) if below else min(batches)


# -- builds ---------------------------------------------------------------------------------------


def _export(args, name: str, extra: list[str]) -> None:
    """This project's artifact through the CLI (as ``decode_bench.build_offgraph``); skipped when
    the artifacts folder already holds it with the same command (a re-run build phase)."""
    out, art = Path(args.out), Path(args.artifacts)
    path = art / f"{name}.pt2"
    cmd = [
        sys.executable, "-m", "offgraph_export", "export", f"hf:{args.config}", "-o", str(path),
        "--device", args.device, "--dtype", "bfloat16", "--max-capacity", str(args.max_capacity), *extra, "--json",
    ]
    record = art / f"{name}_build.json"
    if path.exists() and record.exists() and json.loads(record.read_text()).get("command") == " ".join(cmd[2:]):
        log(f"{name}: {path} is built already (same command): kept")
        (out / record.name).write_text(record.read_text())
        return
    summary = run_export(cmd, out, name)
    record.write_text(json.dumps(summary, indent=2))


def build_single(args) -> None:
    initial = min(1024, args.max_capacity)
    _export(args, "single", ["--initial-capacity", str(initial), "--max-write", str(args.single_max_write), *args.single_export_args])


def build_batched(args) -> None:
    _export(args, "batched", ["--max-sessions", str(args.max_sessions), "--page-size", str(args.page_size),
                              "--max-write", str(args.max_write), *args.batched_export_args])


def hf_cache_len(args, history: int | None = None) -> int:
    """hf-static's cache rows: sized for ``history`` (``--hf-cache per-history``, the strongest
    form of that baseline: it attends over every row) or for the largest history (``largest``:
    the one cache a server admitting every history would compile)."""
    if history is None or args.hf_cache == "largest":
        return max(args.history) + args.steps
    return history + args.steps


def hf_cache_lens(args) -> list[int]:
    """Every cache size hf-static is compiled for, one compile each per B."""
    return sorted({hf_cache_len(args, h) for h in args.history})


def static_module(model, batch: int, max_cache_len: int):
    """``decode_bench.static_cache_module`` at batch ``batch``; its cache filled with random
    values (nothing is timed on zeros)."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    module = TorchExportableModuleWithStaticCache(model, batch_size=batch, max_cache_len=max_cache_len, device=db.device())
    gen = torch.Generator(device=db.device()).manual_seed(batch)
    for name, buf in module.named_buffers():
        if "cache" in name and buf.dim() == 4 and buf.is_floating_point():
            buf.normal_(0.0, 1.0, generator=gen)
    return module


def hf_compiled(args, model, batch: int, length: int):
    """(module, callable, compile seconds): compiled at its first call (cpu: eager, no compile)."""
    module = static_module(model, batch, length)
    ids = torch.full((batch, 1), 7, dtype=torch.long, device=db.device())
    pos = torch.full((1,), args.history[0], dtype=torch.long, device=db.device())
    fn = module if args.hf_mode == "eager" else torch.compile(module, mode=args.hf_mode, dynamic=False)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(input_ids=ids, cache_position=pos)
        sync()
    return module, fn, ids, pos, time.perf_counter() - t0


def _raise_recompile_limit() -> None:
    for name in ("recompile_limit", "cache_size_limit"):  # one compile per B of one forward
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))


def build_hf(args) -> None:
    """Compile the static-cache module at batch ``--batch`` once (filling the inductor caches
    that the measure phase compiles from)."""
    out, art = Path(args.out), Path(args.artifacts)
    _raise_recompile_limit()
    model = db.load_hf_uninitialized(args.config)
    compile_s = 0.0
    lengths = hf_cache_lens(args)
    for length in lengths:
        *_, seconds = hf_compiled(args, model, args.batch, length)
        log(f"hf-static B={args.batch}, cache {length} rows: compiled in {seconds:.0f} s")
        compile_s += seconds
    data = {"batch": args.batch, "compile_s": compile_s, "mode": args.hf_mode, "max_cache_len": max(lengths),
            "cache_lens": lengths, "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    log(f"hf-static B={args.batch}: compiled in {compile_s:.0f} s")
    save(out, f"hf_static_b{args.batch}_build", data)
    (art / f"hf_static_b{args.batch}_build.json").write_text(json.dumps(data, indent=2))


def build_summary(args) -> None:
    """Every build record of the artifacts folder in one file (the build phase's JSON)."""
    art = Path(args.artifacts)
    records = {p.name[: -len("_build.json")]: json.loads(p.read_text()) for p in sorted(art.glob("*_build.json"))}
    save(Path(args.out), "batch_build", {"builds": records, "env": env_info(), "args": _args_record(args)})


# -- measurements ---------------------------------------------------------------------------------


class Skip(Exception):
    """A measurement left out for the time budget."""


def env_info() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if cuda() else platform.processor() or "cpu"}
    for mod in ("transformers", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 (absent or broken: recorded as such)
            info[mod] = None
    return info


def _args_record(args) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, type(None)))}


def inputs_builder(specs, device: torch.device):
    """``make_inputs(tokens, start)`` of an hf bundle (token ids, positions) from the specs alone:
    the runtime supplies the positions anyway (``Session.feed``)."""
    tokens_at = [i for i, s in enumerate(specs.inputs) if s.index_bound is not None]
    if len(specs.inputs) != 2 or len(tokens_at) != 1 or specs.positions_input is None:
        from offgraph_export.frontends import load_bundle

        return load_bundle(f"hf:{specs.model.removeprefix('hf:')}", dtype="bfloat16").make_inputs  # pragma: no cover

    def make(tokens: torch.Tensor, start: int):
        inputs = [None, None]
        inputs[tokens_at[0]] = tokens
        inputs[specs.positions_input] = torch.arange(start, start + tokens.shape[1], dtype=torch.int64, device=device)
        return inputs

    return make


class Bench:
    """What the contenders share: the arguments, the floor, the rows, the budget."""

    def __init__(self, args) -> None:
        self.args = args
        self.out = Path(args.out)
        self.deadline = args.deadline or float("inf")
        self.groups = groups(args.batches, args.max_sessions)
        self.results: dict = {"env": env_info(), "args": _args_record(args), "rows": [], "prefill": [], "ttft": [],
                              "breakdown": {}, "loads": {}, "hf_compile": {}, "skipped": [], "notes": [], "errors": []}
        self.tokens = torch.randint(0, min(1000, db.vocab_size(args.config)), (max(args.history) + decode_budget(args.steps) + 4096,),
                                    generator=torch.Generator().manual_seed(0)).tolist()

    def remaining(self) -> float:
        return self.deadline - time.time()

    def setup_floor(self) -> None:
        from transformers import AutoModelForCausalLM

        bw = copy_bandwidth(self.out)["bytes_per_s"]
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(db.hf_config(self.args.config), dtype=torch.bfloat16)
        self.weights, self.kv_token = db.weight_bytes(meta), db.kv_bytes_per_token(meta.config)
        self.bw = bw
        self.results["floor"] = {"weight_bytes": self.weights, "kv_bytes_per_token": self.kv_token, "copy_bytes_per_s": bw}
        log(f"copy rate {bw / 1e12:.2f} TB/s; weights {self.weights / 1e9:.2f} GB; K/V {self.kv_token} bytes/token")

    def row(self, contender: str, batch: int, history: int, timing: dict, contexts: list[float], **extra) -> dict:
        """One table row; ``contexts``: every session's mean context over the timed steps (the
        live K/V a step reads)."""
        moved = self.weights + self.kv_token * sum(contexts)
        floor_ms = 1e3 * moved / self.bw
        ms = timing["median_ms"]
        row = {"contender": contender, "batch": batch, "history": history, **timing,
               "tokens_per_s": batch * 1e3 / ms, "floor_ms": floor_ms, "pct_of_floor": 100 * floor_ms / ms,
               "gb_per_s": moved / (ms * 1e-3) / 1e9, "context_mean": sum(contexts) / len(contexts), **extra}
        self.results["rows"].append(row)
        log(f"{contender:9s} B={batch:3d} history {history:6d}: {ms:8.3f} ms/step, {row['tokens_per_s']:9.0f} tokens/s, "
            f"{row['pct_of_floor']:3.0f}% of floor")
        self.flush()
        return row

    def skip(self, what: str, why: str) -> None:
        self.results["skipped"].append({"what": what, "why": why})
        log(f"skipped {what}: {why}")
        self.flush()

    def flush(self) -> None:
        (self.out / "batch_measure.json").write_text(json.dumps(self.results, indent=2))

    def prefill_rate(self, contender: str, history: int) -> float | None:
        """Tokens/s of this contender's last prefill up to ``history`` (None: none yet)."""
        done = [p for p in self.results["prefill"] if p["contender"] == contender and p["history"] == history and p["seconds"] > 0]
        return done[-1]["tokens_per_s"] if done else None

    def estimate_prefill_s(self, contender: str, history: int, tokens: int) -> float:
        rate = self.prefill_rate(contender, history)
        if rate is None:  # none at this history yet: the first history's rate, scaled by the context
            first = self.prefill_rate(contender, self.args.history[0])
            if first is None:
                return 0.0
            rate = first * self.args.history[0] / history * 2  # attention grows with the context; GEMMs do not
        return tokens / rate


def _timed(step, steps: int) -> dict:
    return time_steps(step, steps, warmup=WARMUP)


class BatchedContender:
    name = "batched"

    def __init__(self, bench: Bench) -> None:
        from offgraph_export.runtime import load_artifact
        from offgraph_export.runtime.batched import BatchedRunner

        self.bench = bench
        args = bench.args
        path = Path(args.artifacts) / "batched.pt2"
        t0 = time.perf_counter()
        self.program = load_artifact(path, single_threaded=cuda())
        t1 = time.perf_counter()
        self.runner = BatchedRunner(self.program, cuda_graphs=cuda())
        sync()
        bench.results["loads"][self.name] = {"seconds": time.perf_counter() - t0, "runner": time.perf_counter() - t1,
                                             "stages": dict(getattr(self.program, "load_seconds", {}))}
        self.manifest = self.runner.manifest
        self.max_write = self.manifest.max_write
        self.page_bytes = bench.kv_token * self.runner.paging.page_size
        self.sessions: list[int | None] = [None] * args.max_sessions
        self.token = bench.tokens[0]
        self.check_capacity()

    def check_capacity(self) -> None:
        args = self.bench.args
        need = max(args.history) + decode_budget(args.steps)
        if self.manifest.max_capacity < need or self.runner.paging.max_sessions < max(args.batches):
            raise RuntimeError(f"batched.pt2 holds {self.manifest.max_capacity} tokens x {self.runner.paging.max_sessions} sessions; "
                             f"this run needs {need} x {max(args.batches)}: build it again with these options")

    def length(self, i: int) -> int:
        sid = self.sessions[i]
        return 0 if sid is None else self.runner.length(sid)

    def tokens_to(self, idxs: list[int], history: int) -> int:
        return sum(max(0, history - self.length(i)) for i in idxs)

    def ensure(self, idxs: list[int], history: int, stop_at: float) -> None:
        """Sessions ``idxs`` open and prefilled to ``history`` tokens: chunks of up to max_write
        tokens, several sessions a step. Raises Skip past ``stop_at``."""
        runner = self.runner
        for i in idxs:
            if self.sessions[i] is None:
                self.sessions[i] = runner.open()
        queue = [i for i in idxs if self.length(i) < history]
        total = sum(history - self.length(i) for i in queue)
        if not total:
            return
        t0 = last = time.perf_counter()
        steps = done = 0
        while queue:
            if time.time() > stop_at:
                raise Skip(f"prefill stopped at {done}/{total} tokens by the time budget")
            budget, feeds = self.max_write, {}
            for i in queue:
                if not budget:
                    break
                start = self.length(i)
                n = min(history - start, budget)
                feeds[self.sessions[i]] = self.bench.tokens[start : start + n]
                budget -= n
            runner.step(feeds)
            steps += 1
            done += self.max_write - budget
            queue = [i for i in queue if self.length(i) < history]
            if time.perf_counter() - last > 10:
                sync()
                last = time.perf_counter()
                log(f"batched prefill to {history}: {done}/{total} tokens, {last - t0:.0f} s")
        sync()
        seconds = time.perf_counter() - t0
        self.bench.results["prefill"].append({"contender": self.name, "history": history, "sessions": len(idxs), "tokens": total,
                                              "steps": steps, "seconds": seconds, "tokens_per_s": total / seconds})
        log(f"batched prefill: {total} tokens of {len(idxs)} sessions to {history} in {seconds:.1f} s ({steps} steps)")

    def feeds(self, idxs: list[int]) -> dict[int, list[int]]:
        return {self.sessions[i]: [self.token] for i in idxs}

    def measure(self, batch: int, idxs: list[int], history: int) -> dict:
        feeds = self.feeds(idxs)
        runner = self.runner
        before = [self.length(i) for i in idxs]
        timing = _timed(lambda: runner.step(feeds), self.bench.args.steps)
        m = runner.metrics()
        contexts = [b + WARMUP + (self.bench.args.steps + 1) / 2 for b in before]
        pages = sum(len(runner.pages(self.sessions[i])) for i in idxs)
        return self.bench.row(self.name, batch, history, timing, contexts,
                              kv_allocated_bytes=m.allocated_bytes, kv_live_bytes=int(self.bench.kv_token * sum(contexts)),
                              kv_pages_bytes=pages * self.page_bytes, runner_live_bytes=m.live_bytes,
                              runner_sessions=m.sessions, graph_captures=m.graph_captures, padded_tokens=m.padded_tokens)

    def free_slot(self, keep: list[int]) -> None:
        """Close the highest open session outside ``keep`` when every slot is taken (it is opened
        and prefilled again when a group needs it)."""
        if self.runner.paging.max_sessions - len(self.runner.sessions) > 0:
            return
        i = max(j for j, sid in enumerate(self.sessions) if sid is not None and j not in keep)
        self.runner.close(self.sessions[i])
        self.sessions[i] = None

    def ttft(self, batch: int, idxs: list[int], history: int, prompt: int) -> dict:
        """A new session joins while ``idxs`` decode: every step packs their decode tokens, then a
        chunk of its prompt up to max_write; its first token is the last chunk's argmax."""
        runner = self.runner
        self.free_slot(idxs)
        decode = self.feeds(idxs)
        chunk = self.max_write - len(idxs)
        if chunk < 1:
            raise Skip(f"max_write {self.max_write} leaves no room beside {len(idxs)} decode tokens")
        times, step_ms, n_steps = [], [], 0
        for r in range(TTFT_REPEATS + 1):  # the first: warm-up (captures)
            sync()
            t0 = time.perf_counter()
            sid = runner.open()
            fed, steps = 0, []
            while fed < prompt:
                n = min(chunk, prompt - fed)
                s0 = time.perf_counter()
                outputs = runner.step({**decode, sid: self.bench.tokens[fed : fed + n]})
                fed += n
                if fed < prompt:
                    sync()
                    steps.append((time.perf_counter() - s0) * 1e3)
            first = int(outputs[sid][0][0, -1].argmax())  # reads the device: the first token is there
            ms = (time.perf_counter() - t0) * 1e3
            steps.append((time.perf_counter() - s0) * 1e3)
            runner.close(sid)
            if r:
                times.append(ms)
                step_ms += steps
                n_steps = len(steps)
        del first
        data = {"contender": self.name, "batch": batch, "history": history, "prompt": prompt, "ttft_ms": statistics.median(times),
                "ttft_ms_all": times, "steps": n_steps, "mixed_step_ms": statistics.median(step_ms), "chunk": chunk}
        self.bench.results["ttft"].append(data)
        log(f"batched ttft: {prompt} tokens joining {batch} decoding sessions at {history}: {data['ttft_ms']:.1f} ms "
            f"({n_steps} steps of {data['mixed_step_ms']:.2f} ms)")
        self.bench.flush()
        return data

    def breakdown(self, idxs: list[int]):
        """The kernel classes of a step of ``idxs``, its kernel sequence and that of a B=1 step,
        and the step's CUDA graph replayed alone (the runner's host work and input copies left
        out: the step's median minus this is their share)."""
        feeds = self.feeds(idxs)
        step = lambda: self.runner.step(feeds)  # noqa: E731
        data = kernel_breakdown(step)
        data["sequence"] = kernel_sequence(step)
        one = self.feeds(idxs[:1])
        data["sequence_b1"] = kernel_sequence(lambda: self.runner.step(one))
        graphs = self.runner._graphs  # the replay alone: bench-only access to the runner's graphs
        if graphs:
            width = self.runner._width(len(idxs))
            step()  # the staging buffers hold this step's inputs again
            sync()
            key = (width, self.runner.last_method)
            data["replay_only"] = {"width": width, "method": key[1], **time_steps(graphs[key].graph.replay, self.bench.args.steps)}
        return data


class SingleContender:
    name = "single"

    def __init__(self, bench: Bench) -> None:
        from offgraph_export.runtime import load_artifact

        self.bench = bench
        args = bench.args
        t0 = time.perf_counter()
        self.artifact = load_artifact(Path(args.artifacts) / "single.pt2", single_threaded=cuda())
        sync()
        bench.results["loads"][self.name] = {"seconds": time.perf_counter() - t0,
                                             "stages": dict(getattr(self.artifact, "load_seconds", {}))}
        self.dev = self.artifact.device
        self.manifest = self.artifact.specs.manifest
        self.make_inputs = inputs_builder(self.artifact.specs, self.dev)
        self.prompt = torch.tensor([bench.tokens], dtype=torch.int64, device=self.dev)
        self.sessions: list = [None] * (1 + max(i for g in bench.groups.values() for i in g))
        self.steps: dict[int, object] = {}
        self.growth: dict[int, int] = {}
        need = max(args.history) + decode_budget(args.steps)
        if self.manifest.max_capacity < need:
            raise RuntimeError(f"single.pt2 holds {self.manifest.max_capacity} tokens; this run needs {need}: build it again")

    def length(self, i: int) -> int:
        s = self.sessions[i]
        return 0 if s is None else s.committed_length

    def tokens_to(self, idxs: list[int], history: int) -> int:
        return sum(max(0, history - self.length(i)) for i in idxs)

    def ensure(self, idxs: list[int], history: int, stop_at: float) -> None:
        """Sessions ``idxs`` reserved for ``history`` + the decode budget and prefilled to it, in
        chunks of max_write (one session a step: this artifact serves one)."""
        total = self.tokens_to(idxs, history)
        t0 = last = time.perf_counter()
        done = steps = 0
        for i in idxs:
            s = self.sessions[i]
            if s is None:
                s = self.sessions[i] = self.artifact.new_session(cuda_graphs=cuda())
            if s.committed_length >= history:
                continue
            s.reserve(history + decode_budget(self.bench.args.steps))
            while s.committed_length < history:
                if time.time() > stop_at:
                    raise Skip(f"prefill stopped at {done}/{total} tokens by the time budget")
                start = s.committed_length
                end = min(history, start + self.manifest.max_write)
                s.feed(self.make_inputs, self.prompt[:, start:end])
                done += end - start
                steps += 1
                if time.perf_counter() - last > 10:
                    sync()
                    last = time.perf_counter()
                    log(f"single prefill to {history}: {done}/{total} tokens, {last - t0:.0f} s")
            self.growth[i] = s.metrics().growth_count
            token = self.prompt[:, :1]
            inputs = self.make_inputs(token, s.committed_length)  # built once: a decode loop hands the same token

            def step(s=s, inputs=inputs, token=token):
                s.feed(lambda _tokens, _start: inputs, token)  # the runtime supplies the positions

            self.steps[i] = step
        sync()
        if total:
            seconds = time.perf_counter() - t0
            self.bench.results["prefill"].append({"contender": self.name, "history": history, "sessions": len(idxs), "tokens": total,
                                                  "steps": steps, "seconds": seconds, "tokens_per_s": total / seconds})
            log(f"single prefill: {total} tokens of {len(idxs)} sessions to {history} in {seconds:.1f} s ({steps} steps)")

    def round(self, idxs: list[int]):
        steps = [self.steps[i] for i in idxs]

        def run():
            for step in steps:
                step()
        return run

    def measure(self, batch: int, idxs: list[int], history: int) -> dict:
        before = [self.length(i) for i in idxs]
        timing = _timed(self.round(idxs), self.bench.args.steps)
        for i in idxs:
            if self.sessions[i].metrics().growth_count != self.growth[i]:
                raise RuntimeError(f"session {i}'s storage grew while it was measured: raise decode_budget()")
        metrics = [self.sessions[i].metrics() for i in idxs]
        contexts = [b + WARMUP + (self.bench.args.steps + 1) / 2 for b in before]
        return self.bench.row(self.name, batch, history, timing, contexts,
                              kv_allocated_bytes=sum(m.allocated_bytes for m in metrics),
                              kv_live_bytes=int(self.bench.kv_token * sum(contexts)),
                              graph_captures=sum(m.graph_captures for m in metrics),
                              decode_method_steps=sum(m.decode_method_steps for m in metrics))

    def ttft(self, batch: int, idxs: list[int], history: int, prompt: int) -> dict:
        """A new session while ``idxs`` decode in turn: one round of theirs, then its prefill
        (chunks of max_write), its first token the argmax of the last chunk."""
        decode = self.round(idxs)
        times, prefill_ms = [], []
        for r in range(TTFT_REPEATS + 1):
            s = self.artifact.new_session(cuda_graphs=cuda())
            s.reserve(prompt + 1)
            sync()
            t0 = time.perf_counter()
            decode()
            p0 = time.perf_counter()
            for start in range(0, prompt, self.manifest.max_write):
                logits = s.feed(self.make_inputs, self.prompt[:, start : min(prompt, start + self.manifest.max_write)])[0]
            int(logits[0, -1].argmax())
            t1 = time.perf_counter()
            s.close()
            if r:
                times.append((t1 - t0) * 1e3)
                prefill_ms.append((t1 - p0) * 1e3)
        data = {"contender": self.name, "batch": batch, "history": history, "prompt": prompt, "ttft_ms": statistics.median(times),
                "ttft_ms_all": times, "prefill_ms": statistics.median(prefill_ms), "steps": 1 + batch}
        self.bench.results["ttft"].append(data)
        log(f"single ttft: {prompt} tokens after a round of {batch} sessions at {history}: {data['ttft_ms']:.1f} ms "
            f"(its prefill {data['prefill_ms']:.1f} ms)")
        self.bench.flush()
        return data

    def breakdown(self, idxs: list[int]):
        data = kernel_breakdown(self.round(idxs))
        data["sequence_b1"] = kernel_sequence(self.round(idxs[:1]))
        return data


def timed_what(args) -> str:
    return "graph replay alone" if cuda() and args.hf_mode != "eager" else f"one call ({args.hf_mode})"


def measure_hf(bench: Bench) -> None:
    """hf-static at every B: one compile per cache size (from the inductor caches of the build
    phase), a CUDA graph, each history by its cache position (the whole cache is read at each)."""
    args = bench.args
    _raise_recompile_limit()
    model = db.load_hf_uninitialized(args.config)
    estimate = None
    for batch in sorted(args.batches):
        for length in hf_cache_lens(args):
            histories = [h for h in args.history if hf_cache_len(args, h) == length]
            cold = bench.results["builds"].get(f"hf_static_b{batch}", {}).get("compile_s")
            est = estimate if estimate is not None else (5.0 if args.hf_mode == "eager" else 0.5 * cold if cold else 90.0)
            if bench.remaining() < est + MARGIN_S:
                bench.skip(f"hf-static B={batch} cache {length} (histories {histories})",
                           f"{bench.remaining():.0f} s left, its compile takes about {est:.0f} s")
                continue
            log(f"hf-static B={batch}: compiling ({args.hf_mode}, cache {length} rows)")
            module, fn, ids, pos, compile_s = hf_compiled(args, model, batch, length)
            estimate = max(estimate or 0.0, compile_s * 1.3)
            bench.results["hf_compile"][f"{batch}x{length}"] = compile_s
            log(f"hf-static B={batch}: compiled in {compile_s:.1f} s")
            with torch.no_grad():
                if cuda() and args.hf_mode != "eager":
                    replay, _ = graph_step(lambda a, b: fn(input_ids=a, cache_position=b), [ids, pos])
                else:
                    def replay():
                        fn(input_ids=ids, cache_position=pos)
                kv = db.cache_bytes(module)
                for history in histories:
                    if history >= length:
                        bench.skip(f"hf-static B={batch} history {history}", f"the cache holds {length} rows")
                        continue
                    pos.fill_(history)
                    timing = _timed(replay, args.steps)
                    bench.row("hf-static", batch, history, timing, [history + 1.0] * batch, kv_allocated_bytes=kv,
                              kv_live_bytes=bench.kv_token * (history + 1) * batch, cache_rows=length, compile_s=compile_s,
                              timed=timed_what(args))
                if batch == pick_batch(args.batches, args.breakdown_batch) and args.history[0] in histories:
                    pos.fill_(args.history[0])
                    bench.results["breakdown"]["hf-static"] = {"batch": batch, "history": args.history[0], **kernel_breakdown(replay)}
            del module, fn, replay
            if cuda():
                torch.cuda.empty_cache()
    del model


def measure(args) -> None:
    bench = Bench(args)
    out = bench.out
    bench.results["builds"] = {}
    for record in sorted(Path(args.artifacts).glob("*_build.json")):  # the builds' records travel with the results
        bench.results["builds"][record.name[: -len("_build.json")]] = json.loads(record.read_text())
        if record.parent.resolve() != out.resolve():
            (out / record.name).write_text(record.read_text())
    bench.results["groups"] = {str(b): [g[0], g[-1]] for b, g in bench.groups.items()}
    timed = ("the CUDA graph replayed alone (inputs set once)" if cuda() and args.hf_mode != "eager"
             else f"one call of the module ({args.hf_mode}, no CUDA graph)")  # cf. timed_what
    bench.results["notes"] += [
        f"hf-static compiles once per B and cache size ({args.hf_mode if args.hf_mode == 'eager' else args.hf_mode + ', dynamic=False'}), "
        + (f"its cache sized for each history (history + {args.steps} rows: {', '.join(map(str, hf_cache_lens(args)))})"
           if args.hf_cache == "per-history" else f"its cache fixed at {hf_cache_len(args)} rows for every history")
        + f": every step attends over all of them; its rows time {timed}. It has no time-to-first-token "
        "row: a static batch takes no joining session without a serving engine.",
        "single: one step is a round of B sessions stepped in turn through Session.feed"
        + (", each replaying its own CUDA-graph decode step." if cuda() else " (cpu: ordinary launches)."),
        "batched: one step is one BatchedRunner.step of B decode tokens (the runtime's host work included).",
        "floor = (weights + every session's live K/V at its mean context over the timed steps) / copy rate, per step of B tokens.",
    ]
    with torch.no_grad():
        bench.setup_floor()
        contenders = []
        # single first: its load then tells whether the batched package's 46.6 s in load_pt2
        # (2026-12-03, loaded first) belonged to the paged program or to a process's first load
        for cls in (SingleContender, BatchedContender):
            if cls.name in args.skip:
                bench.skip(cls.name, "--skip")
                continue
            if not (Path(args.artifacts) / f"{cls.name}.pt2").exists():
                bench.skip(cls.name, f"no {cls.name}.pt2 in {args.artifacts}: build it first")
                continue
            try:
                contenders.append(cls(bench))
            except Exception as exc:  # noqa: BLE001 (recorded; the other contenders go on)
                bench.results["errors"].append({"what": f"loading {cls.name}", "error": f"{type(exc).__name__}: {exc}"[:2000]})
                log(f"loading {cls.name} failed: {type(exc).__name__}: {exc}")
            if cuda():
                torch.cuda.empty_cache()
        ttft_b = pick_batch(args.batches, args.ttft_batch)
        breakdown_b = pick_batch(args.batches, args.breakdown_batch)
        first = args.history[0]
        # the first history, whole: every contender, every B
        for c in contenders:
            for batch in sorted(args.batches):
                idxs = bench.groups[batch]
                run_one(bench, c, batch, idxs, first)
                if batch == ttft_b:
                    guarded(bench, f"{c.name} ttft at {first}", lambda: c.ttft(batch, idxs, first, args.ttft_prompt))
                if batch == breakdown_b:
                    guarded(bench, f"{c.name} breakdown", lambda: bench.results["breakdown"].__setitem__(
                        c.name, {"batch": batch, "history": first, **c.breakdown(idxs)}))
                elif c.name == "batched" and batch == max(args.batches) and batch > breakdown_b:
                    # the widest batch too: where its step goes differs from B=16's (attention grows with B)
                    guarded(bench, f"{c.name} breakdown at B={batch}", lambda: bench.results["breakdown"].__setitem__(
                        f"{c.name}:B{batch}", {"batch": batch, "history": first, **c.breakdown(idxs)}))
        if "hf-static" in args.skip:
            bench.skip("hf-static", "--skip")
        else:
            guarded(bench, "hf-static", lambda: measure_hf(bench))
        # later histories: B by B, each contender, while the budget allows
        for history in args.history[1:]:
            for batch in sorted(args.batches):
                idxs = bench.groups[batch]
                for c in contenders:
                    if history + decode_budget(args.steps) > c.manifest.max_capacity:
                        bench.skip(f"{c.name} B={batch} history {history}", "past the artifact's max capacity")
                        continue
                    run_one(bench, c, batch, idxs, history)
                    if batch == ttft_b:
                        guarded(bench, f"{c.name} ttft at {history}", lambda: c.ttft(batch, idxs, history, args.ttft_prompt))
                    if batch == breakdown_b and c.name == "batched":
                        guarded(bench, f"{c.name} breakdown at {history}", lambda: bench.results["breakdown"].__setitem__(
                            f"{c.name}@{history}", {"batch": batch, "history": history, **c.breakdown(idxs)}))
    if cuda():
        bench.results["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    bench.flush()
    log(f"measured; {len(bench.results['rows'])} rows, {len(bench.results['skipped'])} skipped")


def guarded(bench: Bench, what: str, fn) -> None:
    """Run one optional measurement; the budget or a failure skips it (recorded), not the run."""
    if bench.remaining() < MARGIN_S:
        bench.skip(what, "the time budget")
        return
    try:
        fn()
    except Skip as exc:
        bench.skip(what, str(exc))
    except Exception as exc:  # noqa: BLE001 (recorded; the other measurements go on)
        bench.results["errors"].append({"what": what, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        log(f"{what} failed: {type(exc).__name__}: {exc}")
        bench.flush()


def run_one(bench: Bench, c, batch: int, idxs: list[int], history: int) -> None:
    """Prefill (what is missing) then time one row, if the budget allows."""
    what = f"{c.name} B={batch} history {history}"
    tokens = c.tokens_to(idxs, history)
    est = bench.estimate_prefill_s(c.name, history, tokens)
    earlier = [r for r in bench.results["rows"] if r["contender"] == c.name and r["batch"] == batch]
    step_ms = 50.0
    if earlier:  # the same B at a shorter history, scaled: by the floor where one step reads every session's K/V
        r = earlier[-1]
        ratio = (bench.weights + bench.kv_token * batch * history) / (bench.weights + bench.kv_token * batch * r["history"])
        step_ms = r["median_ms"] * (ratio if c.name == "batched" else 1.5)
    est += (bench.args.steps + WARMUP) * step_ms / 1e3
    left = bench.remaining() - MARGIN_S
    if est > left:
        bench.skip(what, f"needs about {est:.0f} s ({tokens} prefill tokens), {max(0, left):.0f} s left")
        return
    try:
        c.ensure(idxs, history, stop_at=bench.deadline - MARGIN_S - (bench.args.steps + WARMUP) * step_ms / 1e3)
        c.measure(batch, idxs, history)
    except Skip as exc:
        bench.skip(what, str(exc))
    except Exception as exc:  # noqa: BLE001 (recorded; the other rows go on)
        bench.results["errors"].append({"what": what, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        log(f"{what} failed: {type(exc).__name__}: {exc}")
        bench.flush()


# -- entry point -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["build-single", "build-batched", "build-hf", "build-summary", "measure"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--artifacts", help="where the packages and build records go (default: --out)")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--history", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per row (after %d warm-up steps)" % WARMUP)
    parser.add_argument("--hf-cache", choices=["per-history", "largest"], default="per-history",
                        help="hf-static's static cache: sized for each history (one compile each; the baseline at its "
                             "fastest) or once for the largest (what one server build admitting all of them runs)")
    parser.add_argument("--max-sessions", type=int, default=64, help="the batched artifact's session slots")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-write", type=int, default=512, help="the batched artifact's widest step")
    parser.add_argument("--single-max-write", type=int, default=SINGLE_MAX_WRITE, help="the single-session artifact's widest step")
    parser.add_argument("--max-capacity", type=int, help="both artifacts' --max-capacity (default: the longest history + "
                        "the decode budget, rounded up to 64)")
    parser.add_argument("--ttft-batch", type=int, default=16, help="how many sessions decode while one joins")
    parser.add_argument("--ttft-prompt", type=int, default=1024, help="the joining session's prompt")
    parser.add_argument("--breakdown-batch", type=int, default=16)
    parser.add_argument("--hf-mode", default=None, help="torch.compile mode of hf-static, or 'eager' (default: "
                        "max-autotune-no-cudagraphs on cuda, eager on cpu)")
    parser.add_argument("--batch", type=int, help="build-hf: the batch to compile")
    parser.add_argument("--deadline", type=float, default=0.0, help="measure: stop starting measurements past this "
                        "time.time() (0: none); what does not fit is listed under 'skipped'")
    parser.add_argument("--skip", nargs="*", default=[], choices=CONTENDERS, help="measure: leave contenders out")
    parser.add_argument("--single-export-arg", dest="single_export_args", action="append", default=[])
    parser.add_argument("--batched-export-arg", dest="batched_export_args", action="append", default=[])
    args = parser.parse_args()
    if args.device == "cpu" and cuda():
        parser.error("--device cpu on a machine with CUDA: run with CUDA_VISIBLE_DEVICES= instead")
    if args.device == "cuda" and not cuda():
        parser.error("--device cuda: no CUDA device here")
    args.hf_mode = args.hf_mode or ("max-autotune-no-cudagraphs" if cuda() else "eager")
    args.max_capacity = args.max_capacity or default_capacity(args)
    args.max_write = min(args.max_write, args.max_capacity)  # a small smoke run's capacity bounds the widest step
    args.single_max_write = min(args.single_max_write, args.max_capacity)
    args.artifacts = args.artifacts or args.out
    if max(args.batches) > args.max_sessions:
        parser.error(f"--batches {max(args.batches)} > --max-sessions {args.max_sessions}")
    if args.what == "build-hf" and args.batch is None:
        parser.error("build-hf needs --batch")
    for d in (args.out, args.artifacts):
        Path(d).mkdir(parents=True, exist_ok=True)
    {"build-single": build_single, "build-batched": build_batched, "build-hf": build_hf, "build-summary": build_summary,
     "measure": measure}[args.what](args)


if __name__ == "__main__":
    main()
