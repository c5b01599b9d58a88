"""The ``offgraph`` attention function and what a model passes to it.

transformers lets a model's attention modules call a function registered by name in its
``AttentionInterface``; registering one named ``offgraph`` (when a checkpoint is loaded, not at
import) is how this frontend reaches every layer without knowing the architecture. The function
has two modes, chosen by context variables so that the model's own code needs no arguments:

* during a probe forward (:func:`refusals`) it records what each layer's own code passes (window,
  soft-cap, sinks, mask, extra arguments, shapes, call count) and returns zeros; the features the neutral op
  cannot express are refused from that record and from the config, naming feature and layer;
* inside :func:`stepping` (the wrapper's forward) it calls the neutral op with the module's
  ``layer_idx``, its ``scaling``, the step's positions and, where the layer has them, its
  soft-cap (the ``softcap`` argument Gemma 2 passes) and sinks (the ``s_aux`` argument GPT-OSS
  passes, or the module's ``sinks`` parameter, which its eager attention reads): :func:`_extras`.

The function and the probe that reads it live together because the probe's record is only as
good as the function's view of each call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offgraph_export.errors import ExportError
from offgraph_export.ops import update_and_attend
from offgraph_export.reference.cache import sinks_problem, softcap_problem

__all__ = [
    "ATTENTION_NAME",
    "register_attention",
    "refusals",
    "stepping",
    "text_config",
    "using_attention",
]

ATTENTION_NAME = "offgraph"

# Keyword arguments an attention function may receive that change nothing for the neutral op, or
# that it takes by name (soft-capping and sinks: :func:`_extras`).
_NEUTRAL_KWARGS = frozenset({
    "position_ids", "sliding_window", "dropout", "scaling", "output_attentions", "use_cache",
    "softcap", "s_aux", "sinks", "is_causal", "output_router_logits",
})


# --- the attention function --------------------------------------------------------------------


@dataclass
class _Call:
    """What one layer's attention module passed to the attention function."""

    sliding_window: int | None
    softcap: object
    sinks: torch.Tensor | None
    causal: bool
    masked: bool
    q_heads: int
    q_tokens: int
    k_tokens: int
    extra: list[str]


@dataclass
class _Step:
    """The step being traced or run: the layers' windows (from the probe) and the positions."""

    windows: dict[int, int]
    position: torch.Tensor


_PROBE: contextvars.ContextVar[dict[int, list[_Call]] | None] = contextvars.ContextVar(
    "offgraph_hf_probe", default=None
)
_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("offgraph_hf_step", default=None)


def _extras(module: nn.Module, kwargs: dict[str, Any]) -> tuple[object, torch.Tensor | None]:
    """``(softcap, sinks)`` of a layer's call, None where it has none: ``softcap`` as the module
    passes it; the sinks it passes (``s_aux``, or ``sinks``), else the module's own ``sinks``
    tensor, which transformers' eager GPT-OSS attention reads whatever is passed."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    return kwargs.get("softcap"), sinks


def _offgraph_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature; returns ``(out [B,T,Hq,Dv], None)``."""
    layer = module.layer_idx
    softcap, sinks = _extras(module, kwargs)
    record = _PROBE.get()
    if record is not None:
        record.setdefault(layer, []).append(
            _Call(
                sliding_window=kwargs.get("sliding_window"),
                softcap=softcap,
                sinks=sinks,
                causal=bool(getattr(module, "is_causal", True)),
                masked=attention_mask is not None,
                q_heads=int(query.shape[1]),
                q_tokens=int(query.shape[2]),
                k_tokens=int(key.shape[2]),
                extra=sorted(set(kwargs) - _NEUTRAL_KWARGS),
            )
        )
        b, hq, t, _ = query.shape
        return query.new_zeros(b, t, hq, value.shape[-1]), None
    step = _STEP.get()
    if step is None:
        raise ExportError(
            f"layer {layer}: the '{ATTENTION_NAME}' attention ran outside an OffgraphCausalLM "
            "forward; call the wrapper, not the transformers model"
        )
    window = kwargs.get("sliding_window")
    if window != step.windows.get(layer):
        raise ExportError(
            f"layer {layer}: the model passes sliding_window={window} but its probe found "
            f"{step.windows.get(layer)}"
        )
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    softcap = float(softcap) if softcap is not None else None
    out = update_and_attend(
        query, key, value, step.position, layer, scale, query.dtype, softcap=softcap, sinks=sinks
    )
    return out.transpose(1, 2), None


def register_attention() -> None:
    """Register the ``offgraph`` attention function in transformers' ``AttentionInterface``
    (imports transformers: called when a checkpoint is loaded, never at import)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _offgraph_attention)


@contextlib.contextmanager
def stepping(windows: dict[int, int], position: torch.Tensor) -> Iterator[None]:
    """Inside the block the ``offgraph`` attention calls the neutral op at ``position`` ``[T]``,
    each layer expected to pass the sliding window ``windows`` gives it (none when absent)."""
    token = _STEP.set(_Step(windows, position))
    try:
        yield
    finally:
        _STEP.reset(token)


@contextlib.contextmanager
def using_attention(model: nn.Module, name: str) -> Iterator[None]:
    """Run ``model`` with attention implementation ``name`` inside the block."""
    before = model.config._attn_implementation
    if before == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


# --- what the op cannot express ----------------------------------------------------------------


def text_config(config: Any) -> Any:
    """The text model's config of ``config`` (itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _config_refusals(config) -> list[str]:
    """Whole-model features the neutral op cannot express, read from the config."""
    text = text_config(config)
    found = []
    if getattr(config, "is_encoder_decoder", False):
        found.append("encoder-decoder models (cross-attention over an encoder)")
    if getattr(text, "add_cross_attention", False):
        found.append("cross-attention (add_cross_attention=True)")
    attn_config = getattr(text, "attn_config", None)
    if (
        getattr(text, "alibi", False)
        or getattr(text, "position_embedding_type", None) == "alibi"
        or (isinstance(attn_config, dict) and attn_config.get("alibi"))
    ):
        found.append("ALiBi position bias")
    if getattr(text, "is_causal", True) is False:
        found.append("bidirectional (non-causal) attention")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    subs = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for sub in subs:
        kind = sub.get("rope_type", sub.get("type")) if isinstance(sub, dict) else None
        if kind in ("dynamic", "longrope"):
            found.append(f"length-dependent RoPE (rope_type={kind!r}): its frequencies depend on the sequence length")
    for layer, kind in enumerate(getattr(text, "layer_types", None) or []):
        if kind not in ("full_attention", "sliding_attention"):
            found.append(f"layer {layer}: layer type {kind!r} (only full_attention and sliding_attention)")
    return found


def _probe(model: nn.Module, n_tokens: int = 3) -> dict[int, list[_Call]]:
    """Each layer's calls to the attention function in one forward over ``n_tokens`` zeros."""
    record: dict[int, list[_Call]] = {}
    token = _PROBE.set(record)
    try:
        device = next(model.parameters()).device
        ids = torch.zeros(1, n_tokens, dtype=torch.long, device=device)
        with torch.no_grad(), using_attention(model, ATTENTION_NAME):
            model(input_ids=ids, position_ids=torch.arange(n_tokens, device=device)[None], use_cache=False)
    finally:
        _PROBE.reset(token)
    return record


def refusals(model: nn.Module) -> tuple[list[str], dict[int, int]]:
    """``(problems, windows)``: every feature of ``model`` the neutral op cannot express, each
    naming the feature (and the layer where it is one layer's), and the sliding window of each
    sliding-window layer."""
    problems = _config_refusals(model.config)
    if any("encoder-decoder" in p for p in problems):
        return problems, {}
    record = _probe(model)
    n_layers = getattr(text_config(model.config), "num_hidden_layers", None) or len(record)
    windows: dict[int, int] = {}
    for layer in range(n_layers):
        calls = record.get(layer, [])
        if len(calls) != 1:
            problems.append(
                f"layer {layer}: attention called {len(calls)} times through transformers' "
                "AttentionInterface (expected once: the architecture does not route attention "
                "through it, or shares it across layers)"
            )
            continue
        call = calls[0]
        problem = softcap_problem(call.softcap) or sinks_problem(call.sinks, call.q_heads)
        if problem:
            problems.append(f"layer {layer}: {problem}")
        if not call.causal:
            problems.append(f"layer {layer}: non-causal attention")
        if call.masked:
            problems.append(f"layer {layer}: a model-made attention mask (e.g. a position bias)")
        if call.q_tokens != call.k_tokens:
            problems.append(f"layer {layer}: keys from another sequence (cross-attention or shared KV)")
        if call.extra:
            problems.append(f"layer {layer}: attention arguments {call.extra} the op cannot honour")
        if call.sliding_window is not None:
            windows[layer] = int(call.sliding_window)
    layer_types = getattr(text_config(model.config), "layer_types", None)
    for layer, kind in enumerate(layer_types or []):
        if kind in ("full_attention", "sliding_attention") and (kind == "sliding_attention") != (layer in windows):
            problems.append(
                f"layer {layer}: config says {kind} but the module passes sliding_window="
                f"{windows.get(layer)}"
            )
    return list(dict.fromkeys(problems)), windows
