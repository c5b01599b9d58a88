"""A gpt-fast-style contender (issues 26 and 27): a static-cache Llama written here, the way
gpt-fast writes one, under ``torch.compile(mode="max-autotune-no-cudagraphs", fullgraph=True)``
and replayed as one CUDA graph per step; weights bf16, int8 or int4 (tinygemm).

What a user who hand-writes a fast decoder gets without this project:

* the model: RMSNorm, fused q|k|v, rotary (the checkpoint's own frequencies, read from transformers'
  rotary module, so llama3 scaling is the checkpoint's), grouped-query attention through SDPA over
  the whole static cache with a boolean mask (the cache is sized to the run: ``history + steps``),
  SiLU-gated MLP, the lm_head;
* the cache: ``[1, Hkv, S, D]`` per layer, written with ``index_copy_`` at the step's positions;
* ``--quantize int8``: ``F.linear(x, w_int8.to(x.dtype)) * scales`` (gpt-fast's
  ``WeightOnlyInt8Linear``); ``--quantize int4``: ``aten._weight_int4pack_mm`` (tinygemm, gpt-fast's
  ``WeightOnlyInt4Linear``) over this project's int4 rule (``reference/weight_quant.py``:
  ``(q - 8) * scale + zero`` per group, tinygemm's own form), packed for the kernel.

Before timing, each contender checks itself against transformers' eager model (float) or against
the same model with ``W'`` swapped in (quantized) on a short prompt: a wrong packing is refused, not
timed. ``decode_bench.py``'s helpers time it (CUDA events around each replay, median), so its rows
sit beside the other contenders' in ``report.py``.

    python benchmarks/gptfast.py --out DIR [--config benchmarks/configs/llama-3.2-1b]
        [--quantize none|int8|int4] [--history 1024 16384] [--steps 50] [--random-on-device]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode_bench, beside this file

import decode_bench as db  # noqa: E402

from offgraph_export.reference.weight_quant import dequantize, quantize  # noqa: E402

GROUP = 128
INNER_K_TILES = 8


# -- the model --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Int8Linear(nn.Module):
    """gpt-fast's weight-only int8: the int8 weight cast in the matmul, then the per-row scales."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        stored = quantize(weight, "int8")
        self.register_buffer("weight", stored.qweight)
        self.register_buffer("scales", stored.scales)
        self.w_prime = dequantize(stored)  # what the oracle computes with (for the self-check only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype)) * self.scales


class Int4Linear(nn.Module):
    """gpt-fast's weight-only int4 through tinygemm, over this project's int4 rule."""

    def __init__(self, weight: torch.Tensor, group: int = GROUP) -> None:
        super().__init__()
        stored = quantize(weight, "int4", group)
        self.group = group
        self.out_features = weight.shape[0]
        low, high = stored.qweight & 15, stored.qweight >> 4  # ours: even k in the low nibble
        if weight.is_cuda:  # tinygemm on cuda takes [N, K/2] bytes, even k in the high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack((low << 4) | high, INNER_K_TILES)
        else:  # its cpu form takes the values, int32 [N, K]
            values = torch.stack([low, high], -1).reshape(weight.shape[0], -1).to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, INNER_K_TILES)
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", torch.stack([stored.scales.t(), stored.zeros.t()], -1).contiguous())
        self.w_prime = dequantize(stored)  # what the oracle computes with (for the self-check only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        mm = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x2, self.weight, self.group, self.scales_and_zeros).reshape(*lead, self.out_features)


def _linear(weight: torch.Tensor, quant: str) -> nn.Module:
    if quant == "int8":
        return Int8Linear(weight)
    if quant == "int4":
        return Int4Linear(weight)
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Block(nn.Module):
    def __init__(self, layer, cfg, quant: str) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_norm.weight = nn.Parameter(layer.input_layernorm.weight.detach(), requires_grad=False)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm.weight = nn.Parameter(layer.post_attention_layernorm.weight.detach(), requires_grad=False)
        w = lambda m: m.weight.detach()  # noqa: E731
        self.wqkv = _linear(torch.cat([w(attn.q_proj), w(attn.k_proj), w(attn.v_proj)]), quant)
        self.wo = _linear(w(attn.o_proj), quant)
        self.w1, self.w3, self.w2 = _linear(w(mlp.gate_proj), quant), _linear(w(mlp.up_proj), quant), _linear(w(mlp.down_proj), quant)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def setup_cache(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (1, self.n_kv, length, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x, cos, sin, mask, input_pos):
        t = x.shape[1]
        h = self.attention_norm(x)
        q, k, v = self.wqkv(h).split([self.n_head * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], -1)
        q = q.view(1, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(1, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(1, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = (q * cos + _rotate_half(q) * sin).to(x.dtype)
        k = (k * cos + _rotate_half(k) * sin).to(x.dtype)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        rep = self.n_head // self.n_kv
        keys = self.k_cache.repeat_interleave(rep, dim=1)
        values = self.v_cache.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.wo(y.transpose(1, 2).reshape(1, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    """The decoder of a transformers Llama (its weights, not copies where float), gpt-fast style."""

    def __init__(self, hf_model, quant: str = "none") -> None:
        super().__init__()
        cfg = hf_model.config
        inner = hf_model.model
        self.tok_embeddings = inner.embed_tokens
        self.layers = nn.ModuleList(Block(layer, cfg, quant) for layer in inner.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm.weight = nn.Parameter(inner.norm.weight.detach(), requires_grad=False)
        self.output = _linear(hf_model.lm_head.weight.detach(), quant)
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.mask: torch.Tensor | None = None

    def setup_caches(self, length: int) -> None:
        ref = self.tok_embeddings.weight
        for layer in self.layers:
            layer.setup_cache(length, ref.dtype, ref.device)
        self.mask = torch.tril(torch.ones(length, length, dtype=torch.bool, device=ref.device))
        pos = torch.arange(length, device=ref.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq.to(ref.device))
        emb = torch.cat((angles, angles), dim=-1)
        self.cos_table = (emb.cos() * self.rope_scale).to(ref.dtype)
        self.sin_table = (emb.sin() * self.rope_scale).to(ref.dtype)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        cos, sin = self.cos_table[input_pos][None, None], self.sin_table[input_pos][None, None]
        mask = self.mask[None, None, input_pos]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))

    def cache_bytes(self) -> int:
        return sum(2 * layer.k_cache.numel() * layer.k_cache.element_size() for layer in self.layers)


# -- self-check and measurement -----------------------------------------------------------------


@torch.no_grad()
def self_check(model: Transformer, hf_model, quant: str, tokens: int = 12, layers: int = 2) -> float:
    """The contender's logits over a short prompt (a prefill of ``tokens - 4``, then 4 one-token
    steps) against transformers' eager model with the same weights (``W'`` where quantized), both
    cut to their first ``layers`` layers (every layer runs the same code; a deep bf16 stack drifts
    past any fixed bound by itself: design section 6); returns the largest difference relative to
    the largest logit, raises past 1%."""
    full, hf_full = model.layers, hf_model.model.layers
    model.layers, hf_model.model.layers = full[:layers], hf_full[:layers]
    try:
        return _self_check(model, hf_model, quant, tokens)
    finally:
        model.layers, hf_model.model.layers = full, hf_full
        for mod in model.modules():  # the oracle's weights are no longer needed
            if hasattr(mod, "w_prime"):
                del mod.w_prime


def _self_check(model: Transformer, hf_model, quant: str, tokens: int) -> float:
    from transformers import DynamicCache

    dev = model.tok_embeddings.weight.device
    ids = torch.randint(0, min(1000, hf_model.config.vocab_size), (1, tokens), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    model.setup_caches(tokens)
    n0 = tokens - 4
    got = [model(ids[:, :n0], torch.arange(n0, device=dev))]
    got += [model(ids[:, i : i + 1], torch.arange(i, i + 1, device=dev)) for i in range(n0, tokens)]
    got = torch.cat(got, 1).float()
    swapped = []
    if quant != "none":  # the oracle computes with the quantized values
        for block, layer in zip(model.layers, hf_model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = block.wqkv.w_prime.split([attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]])
            for mod, wp in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v), (attn.o_proj, block.wo.w_prime),
                            (mlp.gate_proj, block.w1.w_prime), (mlp.up_proj, block.w3.w_prime), (mlp.down_proj, block.w2.w_prime)):
                swapped.append((mod, mod.weight.data))
                mod.weight.data = wp
    head = hf_model.lm_head.weight  # a Parameter the embedding may share (tied): replaced, not written
    if quant != "none":
        hf_model.lm_head.weight = nn.Parameter(model.output.w_prime, requires_grad=False)
    try:
        want = hf_model(input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=hf_model.config)).logits.float()
    finally:
        hf_model.lm_head.weight = head
        for mod, data in reversed(swapped):
            mod.weight.data = data
    rel = ((got - want).abs().max() / want.abs().max()).item()
    if not rel <= 0.01:
        raise RuntimeError(f"gpt-fast contender ({quant}) differs from the eager model by {rel:.3f} of the largest logit")
    return rel


def measure(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gptfast" if args.quantize == "none" else f"gptfast-{args.quantize}"
    hf_model = (db.load_hf_uninitialized if args.random_on_device else db.load_hf)(args.config)
    t0 = time.perf_counter()
    model = Transformer(hf_model, args.quantize).eval()
    convert_s = time.perf_counter() - t0
    rel = self_check(model, hf_model, args.quantize)
    db.log(f"{name}: converted in {convert_s:.1f} s; self-check {rel:.2e} of the largest logit")
    kv_per_token, vocab = db.kv_bytes_per_token(hf_model.config), hf_model.config.vocab_size
    weights = _weight_bytes(model)
    del hf_model.model.layers  # the contender holds what it needs
    decode = torch.compile(lambda idx, pos: model(idx, pos), mode="max-autotune-no-cudagraphs", fullgraph=True)
    dev = db.device()
    rows, compile_s, breakdown = [], {}, {}
    with db.measuring(out), torch.no_grad():  # one contender measures at a time (run.sh runs several)
        bw_file = out / "copy_bandwidth.json"
        bw = json.loads(bw_file.read_text()) if bw_file.exists() else db.copy_bandwidth(out)
        floor = db.floor_fn(bw["bytes_per_s"], weights, kv_per_token)
        for history in args.history:
            length = history + args.steps + 16  # gpt-fast sizes its cache to the run
            model.setup_caches(length)
            ids = torch.randint(0, min(1000, vocab), (1, history + 1), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
            for start in range(0, history, 1024):  # the prefill, eager (not timed)
                end = min(start + 1024, history)
                model(ids[:, start:end], torch.arange(start, end, device=dev))
            idx, pos = ids[:, history : history + 1].clone(), torch.tensor([history], device=dev)
            t0 = time.perf_counter()
            decode(idx, pos)
            db.sync()
            compile_s[history] = time.perf_counter() - t0
            db.log(f"{name}: compiled for a cache of {length} rows in {compile_s[history]:.0f} s")
            if torch.cuda.is_available():
                replay, _ = db.graph_step(decode, [idx, pos])
            else:
                def replay(idx=idx, pos=pos):
                    decode(idx, pos)
            rows += db.decode_rows(name, "graph", lambda h, r=replay, m=model: (r, m.cache_bytes()), [history], args.steps, floor)
            if history == args.history[0] and torch.cuda.is_available():
                breakdown = {"graph": db.kernel_breakdown(replay)}
    db.save(out, name.replace("-", "_"), {
        "quantize": args.quantize, "convert_s": convert_s, "compile_s": compile_s, "self_check_rel": rel,
        "weight_bytes": weights, "rows": rows, "breakdown_1k": breakdown,
    })


def _weight_bytes(model: Transformer) -> int:
    """The bytes a decode step reads of weights: every linear's stored form, the norms, the lm_head
    (the embedding table: one row a token)."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            total += mod.weight.numel() * mod.weight.element_size()
        elif isinstance(mod, Int8Linear):
            total += mod.weight.numel() + mod.scales.numel() * mod.scales.element_size()
        elif isinstance(mod, Int4Linear):
            total += mod.weight.numel() * mod.weight.element_size() + mod.scales_and_zeros.numel() * mod.scales_and_zeros.element_size()
        elif isinstance(mod, RMSNorm):
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=db.CONFIG)
    parser.add_argument("--quantize", choices=("none", "int8", "int4"), default="none")
    parser.add_argument("--history", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--random-on-device", action="store_true",
                        help="draw the random weights on the device (an 8B model: no minute of host init); "
                             "the timing does not depend on the values")
    args, _ = parser.parse_known_args()  # benchmarks/run.sh passes decode_bench's options along
    measure(args)


if __name__ == "__main__":
    main()
