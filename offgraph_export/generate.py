"""Generation over the runtime: one session (chunked prefill, then one token per step, greedy) or
many through a batched runner (continuous batching, greedy or sampled per session)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from offgraph_export.errors import OffgraphError
from offgraph_export.runtime.session import Session

__all__ = ["GenerationResult", "Sampling", "generate", "generate_batch"]


@dataclass
class GenerationResult:
    new_tokens: list[int]
    step_ms: list[float] = field(default_factory=list)

    @property
    def decode_ms_median(self) -> float | None:
        """Median of ``step_ms``, ms; None when no decode step ran (one new token). For
        :func:`generate`, the time between consecutive tokens reaching the host (a decode step
        with the loop's own work around it: argmax, ``on_token``, the next step's preparation,
        which on cuda overlaps the step before); for :func:`generate_batch`, the batched steps'
        times."""
        return statistics.median(self.step_ms) if self.step_ms else None


def generate(
    session: Session,
    make_inputs: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]],
    prompt: Sequence[int],
    max_new_tokens: int,
    on_token: Callable[[int], None] | None = None,
) -> GenerationResult:
    """Feed ``prompt`` in chunks of at most ``max_write`` tokens, then decode greedily, each token
    fed back from the device with the next step queued before the token is read (design section
    5: the device never waits for the host between steps). Flat storage is reserved for the whole
    generation first (``Session.reserve``)."""
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
        logits = session.feed(make_inputs, ids[:, start : start + manifest.max_write])[0]
    result = GenerationResult(new_tokens=[])
    # Greedy tokens stay on the device and feed the next step directly; each is read on the host
    # (through a pinned buffer and an event) only after the step it feeds is queued, so the device
    # never idles while the host prepares a step (design section 5). ``step_ms``: the time between
    # consecutive tokens reaching the host, the cost of one decode step in this loop.
    cuda = device.type == "cuda"
    host = torch.empty(batch, dtype=torch.int64, pin_memory=cuda)
    ready = torch.cuda.Event() if cuda else None
    stream = torch.cuda.current_stream(device) if cuda else None
    last = 0.0
    for i in range(max_new_tokens):
        assert logits is not None
        next_id = logits[:, -1].argmax(dim=-1)
        host.copy_(next_id, non_blocking=cuda)
        if ready is not None:
            ready.record(stream)
        failure: BaseException | None = None
        if i + 1 < max_new_tokens:  # the last token is returned, not fed
            try:
                logits = session.feed(make_inputs, next_id.view(batch, 1))[0]
            except BaseException as exc:  # report the token already made, then raise
                failure = exc
        try:
            if ready is not None:
                ready.synchronize()
            token = int(host[0])
            now = time.perf_counter()
            if i:
                result.step_ms.append((now - last) * 1e3)
            last = now
            result.new_tokens.append(token)
            if on_token:
                on_token(token)
        except BaseException as exc:  # the step's own failure first, what followed from it chained
            if failure is not None:
                raise failure from exc
            raise
        if failure is not None:
            raise failure
    return result


@dataclass(frozen=True)
class Sampling:
    """How a session picks its next token: greedy at ``temperature`` 0, else sampled from the
    softmax at that temperature over the ``top_k`` most likely tokens (0: all), seeded."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise OffgraphError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise OffgraphError(f"top_k={self.top_k!r} must be an int >= 0")

    def picker(self) -> Callable[[torch.Tensor], int]:
        """A function from one row of logits to a token id (its own generator: per session)."""
        if self.temperature == 0:
            return lambda row: int(row.argmax())
        gen = torch.Generator().manual_seed(self.seed)

        def pick(row: torch.Tensor) -> int:
            logits = row.float().cpu() / self.temperature
            if self.top_k:
                kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
                logits = torch.where(logits < kth, float("-inf"), logits)
            return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))

        return pick


def generate_batch(
    runner: "BatchedRunner",  # noqa: F821
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sequence[Sampling] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[GenerationResult]:
    """Generate for every prompt together through a batched runner (continuous batching): a
    session joins when a slot is free, every step packs each running session's decode token first
    and then prefill chunks of the waiting prompts up to the step's token budget (``max_write``),
    and a session leaves (its slot and pages freed) when it has its ``max_new_tokens``. Returns
    one result per prompt, in order; ``step_ms`` holds the times of the steps each took part in
    after its prefill."""
    if not prompts or any(not p for p in prompts):
        raise OffgraphError("every prompt needs at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise OffgraphError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    manifest = runner.manifest
    for i, prompt in enumerate(prompts):
        need = len(prompt) + max_new_tokens - 1
        if manifest.has_flat and need > manifest.max_capacity:
            raise OffgraphError(
                f"prompt {i}: {len(prompt)} prompt tokens and {max_new_tokens} new ones need {need} tokens of cache; "
                f"the artifact holds at most {manifest.max_capacity}"
            )
    pickers = [(s or Sampling()).picker() for s in (sampling or [None] * len(prompts))]  # type: ignore[union-attr]
    results = [GenerationResult(new_tokens=[]) for _ in prompts]
    waiting = list(range(len(prompts)))
    running: dict[int, int] = {}  # runner session -> prompt
    fed: dict[int, int] = {}  # prompt -> prompt tokens fed
    pending: dict[int, int] = {}  # prompt -> its next token (decoding)
    steps = 0
    while waiting or running:
        while waiting and len(running) < runner.paging.max_sessions:
            i = waiting.pop(0)
            running[runner.open()] = i
            fed[i] = 0
        budget = manifest.max_write
        feeds: dict[int, list[int]] = {}
        for sid, i in running.items():  # decode tokens first
            if i in pending and budget:
                feeds[sid] = [pending[i]]
                budget -= 1
        for sid, i in running.items():  # then prefill chunks
            if i not in pending and budget:
                chunk = list(prompts[i][fed[i] : fed[i] + budget])
                feeds[sid] = chunk
                budget -= len(chunk)
        t0 = time.perf_counter()
        outputs = runner.step(feeds)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        steps += 1
        for sid, tokens in feeds.items():
            i = running[sid]
            if i in pending:
                results[i].step_ms.append(ms)
            else:
                fed[i] += len(tokens)
                if fed[i] < len(prompts[i]):
                    continue  # more prompt to feed
            token = pickers[i](outputs[sid][0][0, -1])
            results[i].new_tokens.append(token)
            pending[i] = token
            if len(results[i].new_tokens) == max_new_tokens:
                runner.close(sid)
                del running[sid]
                pending.pop(i)
        if on_step:
            on_step(steps)
    return results
