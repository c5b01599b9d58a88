"""``hf:DIR`` -> a :class:`~offgraph_export.models.ModelBundle`: the checkpoint's model wrapped so
that its attention runs through the neutral op, with the cache configuration its layers call for.

The wrapper (:class:`OffgraphCausalLM`) is what is exported: ``(tokens [B,T], position [T]) ->
logits``, the transformers model called with ``use_cache=False`` and no cache object inside
:func:`~offgraph_export.frontends.hf.attention.stepping`, so the neutral op is the only cache and
the traced graph holds no cache state. Every layer the probe finds with a sliding window becomes a
ring of it, unless the window is at least the cache's capacity (then it never excludes a key).
:func:`checkpoint_bundle` makes the bundle of a loaded model however it was read, so ``gguf:FILE``
(:mod:`offgraph_export.frontends.gguf`) goes the same way.
"""

from __future__ import annotations

import torch
from pydantic import ValidationError
from torch import nn

from offgraph_export.errors import ExportError, first_line
from offgraph_export.frontends.hf.attention import (
    ATTENTION_NAME,
    refusals,
    register_attention,
    stepping,
    text_config,
    using_attention,
)
from offgraph_export.frontends.hf.checkpoint import HFCheckpoint, load_hf_model
from offgraph_export.frontends.hf.oracle import TransformersOracle
from offgraph_export.models import ModelBundle
from offgraph_export.specs.cache_config import CacheConfig

__all__ = ["OffgraphCausalLM", "check_bundle_options", "checkpoint_bundle", "load_hf_bundle", "step_inputs", "wrap_model"]


class OffgraphCausalLM(nn.Module):
    """``(tokens [B,T] int64, position [T] int64) -> logits [B,T,V]``: the transformers model with
    its attention through the neutral op."""

    def __init__(self, hf_model: nn.Module, windows: dict[int, int]) -> None:
        super().__init__()
        self.hf = hf_model
        self.windows = dict(windows)

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        with stepping(self.windows, position), using_attention(self.hf, ATTENTION_NAME):
            out = self.hf(input_ids=tokens, position_ids=position.unsqueeze(0), use_cache=False)
        return out.logits


def step_inputs(tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers model's step inputs for ``tokens`` ``[B, T]`` starting at position ``start``:
    the ids and their positions (what every ``hf:`` bundle's ``make_inputs`` is; a benchmark that
    needs no weights takes it from here)."""
    return tokens, torch.arange(start, start + tokens.shape[1], dtype=torch.int64, device=tokens.device)


def wrap_model(hf_model: nn.Module, source: str = "model") -> tuple[OffgraphCausalLM, dict[int, int]]:
    """The wrapper and its layers' windows; raises :class:`ExportError` listing every refusal."""
    register_attention()
    hf_model.eval()
    try:
        problems, windows = refusals(hf_model)
    except ExportError:
        raise
    except Exception as exc:  # the probe runs the model once on 3 tokens: a broken config fails here
        raise ExportError(f"{source}: running the model once on 3 tokens failed: {first_line(exc)}") from exc
    if problems:
        raise ExportError(
            f"{source}: not supported by the neutral KV op: " + "; ".join(problems)
        )
    return OffgraphCausalLM(hf_model, windows), windows


def check_bundle_options(source: str, **values: object) -> None:
    """Every size a bundle is asked for is a positive integer (``seed`` may be 0), checked before
    anything is loaded; ``source`` (``hf:DIR``, ``gguf:FILE``) names the model in the error."""
    for name, value in values.items():
        if value is not None and (type(value) is not int or (value < 1 and name != "seed")):
            raise ExportError(f"{source}: {name} must be a positive integer, got {value!r}")


def load_hf_bundle(
    directory: str,
    dtype: str | None = None,
    seed: int = 0,
    max_capacity: int | None = None,
    initial_capacity: int | None = None,
    max_write: int | None = None,
    batch_size: int = 1,
) -> ModelBundle:
    """The bundle of ``hf:DIR``. The cache defaults to the model's context length (at most 8192
    tokens), 64 tokens up front and up to 128 tokens a step; every layer the model runs with a
    sliding window becomes a ring of that window."""
    check_bundle_options(f"hf:{directory}", seed=seed, max_capacity=max_capacity,
                         initial_capacity=initial_capacity, max_write=max_write, batch_size=batch_size)
    return checkpoint_bundle(load_hf_model(directory, dtype, seed), f"hf:{directory}", max_capacity=max_capacity,
                             initial_capacity=initial_capacity, max_write=max_write, batch_size=batch_size)


def checkpoint_bundle(
    checkpoint: HFCheckpoint,
    source: str,
    max_capacity: int | None = None,
    initial_capacity: int | None = None,
    max_write: int | None = None,
    batch_size: int = 1,
) -> ModelBundle:
    """The bundle of a loaded transformers model, however it was read (``hf:DIR``, ``gguf:FILE``):
    one wrapper, cache rule, tokenizer and oracle for every source; ``source`` names the model in
    errors."""
    model = checkpoint.model
    wrapped, windows = wrap_model(model, source)
    context = getattr(text_config(model.config), "max_position_embeddings", None)
    if context is not None and (type(context) is not int or context < 1):
        raise ExportError(f"{source}: max_position_embeddings must be a positive integer, got {context!r}")
    if max_capacity is not None and context is not None and max_capacity > context:
        raise ExportError(
            f"{source}: max_capacity {max_capacity} is more than the {context} positions the model "
            "is defined for (max_position_embeddings); a larger cache would hold positions it cannot embed"
        )
    capacity = max_capacity or min(context or 8192, 8192)
    # a window at least as long as the cache never excludes a key: such a layer is flat (a ring
    # would hold its window's rows, more than the cache ever fills)
    rings = {layer: window for layer, window in windows.items() if window < capacity}
    try:
        config = CacheConfig(
            max_capacity=capacity,
            initial_capacity=initial_capacity if initial_capacity is not None else min(64, capacity),
            max_write=max_write if max_write is not None else min(128, capacity),
            storage_dtype=str(next(model.parameters()).dtype).removeprefix("torch."),  # type: ignore[arg-type]
            ring_windows=rings,
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise ExportError(f"{source}: invalid cache configuration: {problems}") from None
    if config.max_write < 2:
        raise ExportError(f"{source}: max_write must be at least 2 to export a dynamic token width")

    make_inputs = step_inputs
    tokenizer = checkpoint.tokenizer
    return ModelBundle(
        model=wrapped,
        example_inputs=make_inputs(torch.zeros(batch_size, min(4, config.max_write), dtype=torch.int64), 0),
        token_dims=(1, 0),
        cache_config=config,
        make_inputs=make_inputs,
        vocab_size=int(text_config(model.config).vocab_size),
        encode=(lambda text: list(tokenizer(text).input_ids)) if tokenizer is not None else None,  # type: ignore[operator]
        decode=(lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None,  # type: ignore[attr-defined]
        make_oracle=lambda manifest: TransformersOracle(model),
    )
