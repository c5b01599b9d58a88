"""Eager reference KV caches: the oracle behind the neutral op.

Plain, obviously-correct code: each layer keeps its history as tensors with the absolute position
of every row, and attention masks by positions (causal, and for ring layers the sliding window).
A :class:`ReferenceCaches` set holds one cache per layer for one session; ``activate()`` makes it
the set the neutral op uses in the current context, so several sessions can live in one process.

The two optional features of the op (docs/design.md section 2) are written here once and imported
by the portable step: :func:`soft_cap` (Gemma 2's logit soft-capping) and :func:`attention_probs`
(the softmax, with GPT-OSS's per-head sink logit joining each row and its probability dropped).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator

import torch

from offgraph_export.errors import CacheOverflowError, OffgraphError
from offgraph_export.specs.cache_config import CacheConfig

__all__ = [
    "ReferenceLayerCache",
    "ReferenceCaches",
    "active_caches",
    "attend_by_position",
    "attention_probs",
    "normalize_position",
    "sinks_problem",
    "soft_cap",
    "softcap_problem",
]

_ACTIVE: contextvars.ContextVar["ReferenceCaches | None"] = contextvars.ContextVar(
    "offgraph_active_reference_caches", default=None
)


def normalize_position(position: torch.Tensor, width: int) -> torch.Tensor:
    """Accept ``[T]`` or ``[T, 1]`` int64 positions; return ``[T]``."""
    if position.dtype != torch.int64:
        raise OffgraphError(f"position must be int64, got {position.dtype}")
    if position.dim() == 2 and position.shape[1] == 1:
        position = position[:, 0]
    if position.dim() != 1 or position.shape[0] != width:
        raise OffgraphError(
            f"position must have shape [T] or [T, 1] with T={width}, got {tuple(position.shape)}"
        )
    return position


def softcap_problem(softcap: object) -> str | None:
    """What is wrong with a ``softcap`` argument (None: nothing): it must be None or a finite
    positive constant float (an int is taken as one; a bool is not)."""
    if softcap is None:
        return None
    if (not isinstance(softcap, (int, float)) or isinstance(softcap, bool)
            or not math.isfinite(softcap) or softcap <= 0):
        return f"softcap must be None or a finite positive float, got {softcap!r}"
    return None


def sinks_problem(sinks: object, query_heads: object) -> str | None:
    """What is wrong with a ``sinks`` argument (None: nothing): None, or a floating tensor of one
    logit per query head, ``[Hq]``."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        return f"sinks must be None or a floating tensor [Hq], got {getattr(sinks, 'dtype', type(sinks).__name__)}"
    if sinks.dim() != 1 or str(sinks.shape[0]) != str(query_heads):
        return f"sinks must have shape [Hq] = [{query_heads}], got {tuple(sinks.shape)}"
    return None


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logit soft-capping of (fp32) ``scores``: ``tanh(scores / softcap) * softcap``, the three
    ops in that order as transformers' Gemma 2 writes them; ``scores`` unchanged for None."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def attention_probs(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax over the last dim of masked fp32 ``scores [B, Hkv, group, T, L]`` (-inf where
    unseen). With ``sinks [Hq]`` (query head ``h = kv_head * group + g``) each row's softmax also
    runs over its head's sink logit (cast to fp32), whose probability is then dropped:
    ``p_j = exp(s_j - m) / (sum_i exp(s_i - m) + exp(sink - m))``, ``m`` the row's max over its
    scores and the sink."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    b, hkv, group, t = scores.shape[:4]
    sink = sinks.float().reshape(1, hkv, group, 1, 1).expand(b, hkv, group, t, 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def attend_by_position(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    window: int | None,
    out_dtype: torch.dtype,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B,Hq,T,D]`` over ``keys [B,Hkv,L,D]``/``values [B,Hkv,L,Dv]`` whose rows
    sit at absolute positions ``k_pos [L]``. Query i sees key j iff ``k_pos[j] <= q_pos[i]`` and,
    with a window, ``k_pos[j] > q_pos[i] - window``. Scores are soft-capped (:func:`soft_cap`)
    before masking, and the softmax takes the sinks (:func:`attention_probs`). Computed in
    float32."""
    b, hq, t, d = q.shape
    hkv = keys.shape[1]
    group = hq // hkv
    qf = q.float().reshape(b, hkv, group, t, d)
    scores = soft_cap(torch.einsum("bhgtd,bhld->bhgtl", qf, keys.float()) * scale, softcap)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = attention_probs(scores, sinks)
    out = torch.einsum("bhgtl,bhld->bhgtd", probs, values.float())
    return out.reshape(b, hq, t, values.shape[-1]).to(out_dtype)


class ReferenceLayerCache:
    """History of one layer. Flat keeps every row up to ``capacity``; ring keeps the newest
    ``window`` rows before each step (all that step's queries can see) plus the step's own rows.
    Rows are kept in ``storage_dtype`` (as the runtime's storage holds them) and attended in
    float32."""

    def __init__(
        self, layer_id: int, capacity: int, window: int | None = None, storage_dtype: torch.dtype | None = None
    ) -> None:
        if window is not None and (type(window) is not int or window < 1):
            raise OffgraphError(f"layer {layer_id}: a ring layer needs a positive window, got {window!r}")
        self.layer_id = layer_id
        self.capacity = capacity
        self.window = window  # None: flat (all history)
        #: rows are kept as the storage holds them (None: in k's and v's own dtype)
        self.storage_dtype = storage_dtype
        self.committed_length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def reset(self) -> None:
        self.committed_length = 0
        self.keys = self.values = self.positions = None

    def update_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        position: torch.Tensor,
        scale: float,
        out_dtype: torch.dtype,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._check_shapes(q, k, v)
        problem = softcap_problem(softcap) or sinks_problem(sinks, q.shape[1])
        if problem:
            raise OffgraphError(f"layer {self.layer_id}: {problem}")
        width = k.shape[2]
        pos = normalize_position(position, width)
        start = self.committed_length
        expected = torch.arange(start, start + width, device=pos.device)
        if not torch.equal(pos, expected):
            raise OffgraphError(
                f"layer {self.layer_id}: positions must continue the history at {start} "
                f"(expected {start}..{start + width - 1}), got {pos.tolist()}"
            )
        if self.window is None and start + width > self.capacity:
            raise CacheOverflowError(
                f"layer {self.layer_id}: writing {width} tokens at length {start} exceeds the "
                f"cache capacity of {self.capacity} tokens"
            )
        keys, values, positions = self.keys, self.values, self.positions
        if self.window is not None and keys is not None and keys.shape[2] > self.window:
            # Older rows are invisible to every later query; the last step's rows stay whole
            # until the next step so that they can be inspected (``rows_at``).
            keys, values, positions = keys[:, :, -self.window :], values[:, :, -self.window :], positions[-self.window :]  # type: ignore[index]
        # the rows as stored: in the storage dtype, and copies (the caller may reuse k and v)
        k_rows = k.detach().to(self.storage_dtype or k.dtype, copy=True)
        v_rows = v.detach().to(self.storage_dtype or v.dtype, copy=True)
        if keys is None:
            keys, values, positions = k_rows, v_rows, pos.clone()
        else:
            keys = torch.cat([keys, k_rows], dim=2)
            values = torch.cat([values, v_rows], dim=2)  # type: ignore[list-item]
            positions = torch.cat([positions, pos])  # type: ignore[list-item]
        out = attend_by_position(
            q, keys, values, pos, positions, scale, self.window, out_dtype, softcap, sinks
        )
        # committed only once the step computed: a failure leaves the history as it was
        self.keys, self.values, self.positions = keys, values, positions
        self.committed_length += width
        return out

    def _check_shapes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The op's contract on q ``[B,Hq,T,D]``, k ``[B,Hkv,T,D]``, v ``[B,Hkv,T,Dv]`` (and, once
        rows are held, the same batch, heads and dims as before), as one-line errors."""
        where = f"layer {self.layer_id}"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise OffgraphError(f"{where}: q, k, v must be rank-4 BHSD, got ranks {q.dim()}, {k.dim()}, {v.dim()}")
        if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[2] == k.shape[2] == v.shape[2]):
            raise OffgraphError(f"{where}: q, k, v disagree on batch or width: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if q.shape[3] != k.shape[3] or k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
            raise OffgraphError(
                f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k need one head "
                "dim, k and v one head count, and the query heads a multiple of it"
            )
        if self.keys is not None and self.values is not None and (
            self.keys.shape[:2] != k.shape[:2] or self.keys.shape[3] != k.shape[3] or self.values.shape[3] != v.shape[3]
        ):
            raise OffgraphError(
                f"{where}: k {tuple(k.shape)}, v {tuple(v.shape)} disagree with the rows held "
                f"{tuple(self.keys.shape)}, {tuple(self.values.shape)}"
            )

    def rows_at(self, positions: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows (``[B,H,n,D]``) that this cache holds for the given absolute positions."""
        if self.positions is None or self.keys is None or self.values is None:
            raise OffgraphError(f"layer {self.layer_id} holds no history yet")
        wanted = torch.tensor(list(positions), dtype=torch.int64, device=self.positions.device)
        idx = torch.searchsorted(self.positions, wanted)
        if idx.numel() and (
            int(idx.max()) >= self.positions.numel() or not torch.equal(self.positions[idx], wanted)
        ):
            raise OffgraphError(f"layer {self.layer_id} no longer holds positions {wanted.tolist()}")
        return self.keys[:, :, idx], self.values[:, :, idx]


class ReferenceCaches:
    """The reference caches of one session, one per layer id."""

    def __init__(self, config: CacheConfig, layer_ids: Iterable[int]) -> None:
        self.config = config
        self.layers = {
            lid: ReferenceLayerCache(lid, config.max_capacity, config.window(lid), getattr(torch, config.storage_dtype))
            for lid in layer_ids
        }

    def __getitem__(self, layer_id: int) -> ReferenceLayerCache:
        try:
            return self.layers[layer_id]
        except KeyError:
            raise OffgraphError(
                f"no reference cache for layer {layer_id}; this set has layers {sorted(self.layers)}"
            ) from None

    @property
    def committed_length(self) -> int:
        """Tokens every layer holds (-1 if the layers disagree, which a correct model never does)."""
        lengths = {c.committed_length for c in self.layers.values()}
        return lengths.pop() if len(lengths) == 1 else -1

    def reset(self) -> None:
        for cache in self.layers.values():
            cache.reset()

    @contextlib.contextmanager
    def activate(self) -> Iterator["ReferenceCaches"]:
        """Make this the set the neutral op appends to, for the ``with`` block."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


def active_caches() -> ReferenceCaches:
    caches = _ACTIVE.get()
    if caches is None:
        raise OffgraphError(
            "offgraph::update_and_attend ran eagerly with no active reference cache; run the model "
            "inside `with ReferenceCaches(config, layer_ids).activate():`"
        )
    return caches
