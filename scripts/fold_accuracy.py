"""How far each decode fold moves the step from an fp32 oracle, on cuda.

For a few weight seeds of a small transformers Llama (the tests' ``COMMON`` config), builds the
decode method four ways in bf16 (both folds, GEMV folds only, rotary fold only, none) and once
without folds in fp32 with the same bf16-rounded weights (the oracle), runs each eagerly on the
same random inputs and storage at a position with stored history, and prints each one's relative
logits error against the oracle. ``tests/test_decode_method.py`` bounds the folded error by the
unfolded one's; this prints the distribution that bound was set from.

Usage (GPU machine, repo root): ``source scripts/gpu_env.sh && python3 scripts/fold_accuracy.py [SEEDS]``
"""

from __future__ import annotations

import sys
import tempfile

import torch

sys.path.insert(0, ".")

from offgraph_export.frontends import load_bundle  # noqa: E402
from offgraph_export.passes.decode_gemv import decode_gemv  # noqa: E402
from offgraph_export.passes.decode_rope import decode_rope  # noqa: E402
from offgraph_export.pipeline import export_model, run_passes  # noqa: E402
from tests.test_frontend_hf import COMMON  # noqa: E402

DEVICE = "cuda"


def build(bundle, folds: str, round_weights: bool = False):
    model = bundle.model.requires_grad_(False).to(DEVICE)
    if round_weights:
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(torch.bfloat16).to(t.dtype)
    inputs = tuple(x.to(DEVICE) for x in bundle.example_inputs)
    ep = export_model(model, inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config, "triton", decode_method=True)
    program = program.pass_results["specialize_width"].program
    if folds in ("both", "gemv"):
        program = decode_gemv(program).program
    if folds in ("both", "rope"):
        program = decode_rope(program).program
    return program


def logits(program, args) -> torch.Tensor:
    out = program.module()(*args)
    return (out[0] if isinstance(out, (tuple, list)) else out).double()


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).norm() / y.norm()).item()


def main(seeds: int) -> None:
    import transformers

    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as d:
            torch.manual_seed(seed)
            transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(d)
            b16 = load_bundle(f"hf:{d}", dtype="bfloat16", initial_capacity=64)
            b32 = load_bundle(f"hf:{d}", dtype="float32", initial_capacity=64)
            programs = {n: build(b16, n) for n in ("both", "gemv", "rope", "none")}
            oracle = build(b32, "none", round_weights=True)
        args, _ = programs["none"].example_inputs
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        args = [a.normal_(generator=gen) if a.is_floating_point() else a for a in (x.clone() for x in args)]
        args[1] = torch.full_like(args[1], args[2].shape[2] - 7)
        exact = logits(oracle, [x.float() if x.is_floating_point() else x.clone() for x in args])
        outs = {n: logits(p, [x.clone() for x in args]) for n, p in programs.items()}
        print(f"seed {seed}: vs fp32 " + " ".join(f"{n} {rel(o, exact):.4f}" for n, o in outs.items())
              + f" | both-vs-none {rel(outs['both'], outs['none']):.4f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
