"""A tiny Llama-style decoder whose attention calls the neutral KV op.

RMSNorm, RoPE, grouped-query attention, SwiGLU. Inputs per step: ``tokens [B, T]`` int64 and
``position [T]`` int64 (absolute positions of the step's tokens). Byte-level vocabulary (256), so
``offgraph-export run --prompt`` works without a tokenizer. Weights are random but seeded.

``build()`` is the model factory the CLI names as ``examples/tiny_llama.py:build``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from offgraph_export.models import ModelBundle
from offgraph_export.ops import update_and_attend
from offgraph_export.specs import CacheConfig


@dataclass
class TinyLlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    ring_windows: dict[int, int] = field(default_factory=dict)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope(x: torch.Tensor, position: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x [B,H,T,D]`` by the angles of ``position [T]`` (half-split layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = position.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q = self.wq(x).view(b, t, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, position, c.rope_theta), rope(k, position, c.rope_theta)
        out = update_and_attend(q, k, v, position, self.layer_id, 1.0 / math.sqrt(c.head_dim), x.dtype)
        return self.wo(out.transpose(1, 2).reshape(b, t, c.n_heads * c.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), position)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, position)
        return self.output(self.norm(x)).float()


def _encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _decode(ids: list[int]) -> str:
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def build(
    n_layers: int = 2,
    ring_window: int | None = 16,
    dtype: str = "float32",
    max_capacity: int = 256,
    initial_capacity: int = 16,
    max_write: int = 32,
    batch_size: int = 1,
    head_dim: int = 16,
    seed: int = 0,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    hidden_dim: int = 128,
    vocab_size: int = 256,
    device: str = "cpu",
) -> ModelBundle:
    """The bundled example: by default two layers, layer 0 flat and the last layer a ring of
    ``ring_window`` (pass ``ring_window=None`` for all-flat). The size arguments scale it up to
    real shapes for benchmarks, e.g. Llama-3.2-1B: ``n_layers=16 dim=2048 n_heads=32
    n_kv_heads=8 head_dim=64 hidden_dim=8192 vocab_size=128256`` (random weights)."""
    ring = {n_layers - 1: ring_window} if ring_window else {}
    cfg = TinyLlamaConfig(
        n_layers=n_layers, ring_windows=ring, head_dim=head_dim, dim=dim, n_heads=n_heads,
        n_kv_heads=n_kv_heads, hidden_dim=hidden_dim, vocab_size=vocab_size,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = TinyLlama(cfg)
    std = 0.2 if dim <= 256 else dim**-0.5  # above default init so attention is not uniform
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=std)
    model = model.to(getattr(torch, dtype)).eval()
    t = 4
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, t))
    position = torch.arange(t)

    def make_inputs(token_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
        width = token_ids.shape[-1]
        return token_ids, torch.arange(start, start + width, device=token_ids.device)

    cache = CacheConfig(
        max_capacity=max_capacity,
        initial_capacity=initial_capacity,
        max_write=max_write,
        storage_dtype=dtype,
        ring_windows=ring,
    )
    return ModelBundle(
        model=model,
        example_inputs=(tokens, position),
        token_dims=(1, 0),
        cache_config=cache,
        make_inputs=make_inputs,
        vocab_size=cfg.vocab_size,
        encode=_encode,
        decode=_decode,
    )
