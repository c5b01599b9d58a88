"""Tiny modules that call the neutral op in different ways, for the pass tests."""

from __future__ import annotations

import torch
from torch import nn

from offgraph_export.ops import update_and_attend


class Attn(nn.Module):
    """One attention site over ``x [B,T,H]``; GQA and a separate value head dim."""

    def __init__(self, layer_id: int, hidden: int = 32, hq: int = 4, hkv: int = 2, d: int = 16, dv: int = 16):
        super().__init__()
        self.layer_id, self.hq, self.hkv, self.d, self.dv = layer_id, hq, hkv, d, dv
        self.q = nn.Linear(hidden, hq * d, bias=False)
        self.k = nn.Linear(hidden, hkv * d, bias=False)
        self.v = nn.Linear(hidden, hkv * dv, bias=False)
        self.o = nn.Linear(hq * dv, hidden, bias=False)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.hq, self.d).transpose(1, 2)
        k = self.k(x).view(b, t, self.hkv, self.d).transpose(1, 2)
        v = self.v(x).view(b, t, self.hkv, self.dv).transpose(1, 2)
        out = update_and_attend(q, k, v, position, self.layer_id, self.d**-0.5, x.dtype)
        return self.o(out.transpose(1, 2).reshape(b, t, self.hq * self.dv))


class Stack(nn.Module):
    """Embeddings ``[B,T,H]`` and positions ``[T]`` in; layers of :class:`Attn`."""

    def __init__(self, n_layers: int = 2, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Attn(i, **kw) for i in range(n_layers))

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, position)
        return x


class TokensModel(nn.Module):
    """Tokens ``[1,T]`` and positions ``[T]``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 32)
        self.body = Stack(2)

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.body(self.emb(tokens), position)


class PositionsOnly(nn.Module):
    """A fixed-shape conditioning input, then positions ``[T]``: only the positions carry T."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos_emb = nn.Embedding(512, 32)
        self.body = Stack(1)

    def forward(self, cond: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        x = self.pos_emb(position)[None] + cond[:, None, :]
        return self.body(x, position)


class ChannelsFirst(nn.Module):
    """Embeddings laid out ``[B,H,T]``: the width is dim 2 of input 0."""

    def __init__(self):
        super().__init__()
        self.body = Stack(1)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.body(x.transpose(1, 2), position)


class UnevenWidths(nn.Module):
    """Layer 1 writes one token fewer than layer 0: rejected by the width pass."""

    def __init__(self):
        super().__init__()
        self.a = Attn(0)
        self.b = Attn(1)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        y = self.a(x, position)
        return self.b(y[:, 1:], position[1:])


class DoubledWidth(nn.Module):
    """Writes 2T tokens per step: no input carries that extent."""

    def __init__(self):
        super().__init__()
        self.a = Attn(0)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        t = position.shape[0]
        return self.a(torch.cat([x, x], dim=1), torch.cat([position, position + t]))


class SameLayerTwice(nn.Module):
    """Two sites with layer id 0: rejected by validation."""

    def __init__(self):
        super().__init__()
        self.a = Attn(0)
        self.b = Attn(0)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x, position), position)


class BadHeads(nn.Module):
    """Query heads not a multiple of KV heads (3 vs 2)."""

    def __init__(self):
        super().__init__()
        self.a = Attn(0, hq=3, hkv=2)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.a(x, position)


def export(model: nn.Module, inputs: tuple, token_dims: tuple, max_width: int = 16):
    from offgraph_export.pipeline import export_model

    return export_model(model, inputs, token_dims, max_width)


#: the cache of :func:`quantizable_program`'s stacks: flat and ring layers
QUANT_CACHE = dict(max_capacity=64, initial_capacity=8, max_write=16, ring_windows={1: 5})


def quantizable_program(dtype: torch.dtype):
    """``(exported program, inputs)`` of a two-layer :class:`Stack` in ``dtype`` whose linears a
    quantize pass takes (every output width a multiple of 16), over five tokens; the cpu
    quantized-kernel pass tests' model."""
    model = Stack(2, hq=8, hkv=2, d=16, dv=8).eval().to(dtype)
    inputs = (torch.randn(1, 5, 32, dtype=dtype), torch.arange(5))
    return export(model, inputs, (1, 0), QUANT_CACHE["max_write"]), inputs


def count_calls(ep, target: str) -> int:
    """How many nodes of ``ep`` call ``target`` (its string form, ``aten.linear.default``)."""
    return sum(str(n.target) == target for n in ep.graph.nodes)


def replay_stripped(programs: dict, widths: list[int], seed: int, dtype: torch.dtype = torch.float32, hidden: int = 32):
    """Step each of ``programs`` (name -> a ``run_passes`` result of one model) over the same seeded
    inputs, ``widths`` tokens at a time, each with storage of its own from the first program's
    manifest; yields ``(width, outputs by name, storages by name)`` after every step."""
    from offgraph_export.runtime import SessionStorage

    manifest = next(iter(programs.values())).manifest
    stores = {name: SessionStorage(manifest, "cpu", poison=True) for name in programs}
    modules = {name: program.stripped.module() for name, program in programs.items()}
    torch.manual_seed(seed)
    xs = torch.randn(1, sum(widths), hidden, dtype=dtype)
    used = 0
    for width in widths:
        outs = {}
        for name, module in modules.items():
            stores[name].ensure(used + width, used)
            outs[name] = module(xs[:, used:used + width], torch.arange(used, used + width), *stores[name].bound())
        yield width, outs, stores
        used += width


class Guarded(nn.Module):
    """:class:`Stack` behind a runtime assert on a third input: a step with ``fail`` != 0 raises
    inside the compiled program (export keeps ``torch._check`` on a data-dependent value as a
    runtime assert), the one way to make a real compiled step fail on purpose."""

    def __init__(self):
        super().__init__()
        self.body = Stack(2)

    def forward(self, x: torch.Tensor, position: torch.Tensor, fail: torch.Tensor) -> torch.Tensor:
        torch._check(fail.max().item() == 0)
        return self.body(x, position)


class GuardedTokens(TokensModel):
    """:class:`TokensModel` behind a runtime assert on the token ids: a step carrying an id of 60
    or more (inside the embedding's 64 rows, so admission lets it through) raises inside the
    compiled program, the way to make a batched step fail on purpose."""

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        torch._check(tokens.max().item() < 60)
        return super().forward(tokens, position)
