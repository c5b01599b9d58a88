"""Greedy generation over a runtime session: chunked prefill, then one token per step."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from offgraph_export.errors import OffgraphError
from offgraph_export.runtime.session import Session

__all__ = ["GenerationResult", "generate"]


@dataclass
class GenerationResult:
    new_tokens: list[int]
    step_ms: list[float] = field(default_factory=list)

    @property
    def decode_ms_median(self) -> float | None:
        """Median time of the decode steps, ms; None when none ran (one new token)."""
        return statistics.median(self.step_ms) if self.step_ms else None


def generate(
    session: Session,
    make_inputs: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]],
    prompt: Sequence[int],
    max_new_tokens: int,
    on_token: Callable[[int], None] | None = None,
) -> GenerationResult:
    """Feed ``prompt`` in chunks of at most ``max_write`` tokens, then decode greedily. Flat
    storage is reserved for the whole generation first (``Session.reserve``)."""
    if not prompt:
        raise OffgraphError("the prompt is empty: give at least one token")
    manifest = session.specs.manifest
    written = session.committed_length + len(prompt) + max_new_tokens - 1  # the last token is not fed back
    if manifest.has_flat and written > manifest.max_capacity:
        raise OffgraphError(
            f"{len(prompt)} prompt tokens and {max_new_tokens} new ones need {written} tokens of cache; "
            f"the artifact holds at most {manifest.max_capacity}: shorten them or export with a larger --max-capacity"
        )
    if manifest.has_flat:  # what the whole generation needs, allocated once: no growth midway
        session.reserve(written)
    device = session.artifact.device
    batch = manifest.batch_size
    ids = torch.tensor([list(prompt)] * batch, dtype=torch.int64, device=device)
    logits = None
    for start in range(0, ids.shape[1], manifest.max_write):
        chunk = ids[:, start : start + manifest.max_write]
        logits = session.step(*make_inputs(chunk, session.committed_length))[0]
    result = GenerationResult(new_tokens=[])
    for _ in range(max_new_tokens):
        assert logits is not None
        next_id = logits[:, -1].argmax(dim=-1)
        token = int(next_id[0])
        result.new_tokens.append(token)
        if on_token:
            on_token(token)
        if len(result.new_tokens) == max_new_tokens:
            break
        t0 = time.perf_counter()
        logits = session.step(*make_inputs(next_id.view(batch, 1), session.committed_length))[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        result.step_ms.append((time.perf_counter() - t0) * 1e3)
    return result
