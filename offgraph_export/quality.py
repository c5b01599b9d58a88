"""How far an artifact's logits are from its float model's (design section 11): the quality
report of a quantized artifact, kept apart from ``check``.

``check`` asks whether the compiled step computes what the eager model with the artifact's own
(dequantized) weights computes, within the dtype's tolerance; that says nothing of what
quantization cost. This report feeds the same text, teacher-forced, through the artifact and
through the eager model with its float weights, chunk by chunk as a session would, and compares
the logits at every position: the largest and mean absolute difference, how often the two pick
the same next token (top-1 agreement), and each one's perplexity on the text. Any artifact can be
scored (a float one measures the compiler's own error). By default the text is the one the
package ships (``data/quality_text.txt``), tokenized by the model's own tokenizer.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import torch
from pydantic import AliasChoices, BaseModel, Field

from offgraph_export.errors import OffgraphError
from offgraph_export.frontends import load_bundle
from offgraph_export.models import ModelBundle
from offgraph_export.runtime import load_artifact
from offgraph_export.runtime.program import LoadedProgram
from offgraph_export.runtime.session import Session

__all__ = ["QualityReport", "quality_report", "default_text", "DEFAULT_TOKENS"]

#: teacher-forced positions scored by default
DEFAULT_TOKENS = 256


def default_text() -> str:
    """The text shipped with the package for quality reports (about 480 words of plain English)."""
    return resources.files("offgraph_export").joinpath("data/quality_text.txt").read_text(encoding="utf-8")


class QualityReport(BaseModel):
    """Logits of ``artifact`` against a reference over ``tokens`` teacher-forced positions: its
    float model, or another artifact of the same model (``reference``)."""

    artifact: str
    model: str
    device: str
    #: the artifact's quantization (``int8``, ``int4/128``, ``int4/32+lm_head:int8``), or ``float``
    weights: str
    #: what it is scored against: ``"float model"`` or another artifact's path
    reference: str = "float model"
    #: that artifact's weights (as ``weights``); None against the float model
    reference_weights: str | None = None
    tokens: int
    max_logit_error: float
    mean_logit_error: float
    #: fraction of positions where both pick the same most likely next token
    top1_agreement: float
    #: perplexity of the text's next tokens under each (positions 1..tokens)
    perplexity: float
    #: the reference's perplexity (reports written before ``--against`` named it ``float_perplexity``)
    reference_perplexity: float = Field(validation_alias=AliasChoices("reference_perplexity", "float_perplexity"))

    def render(self) -> str:
        change = (self.perplexity / self.reference_perplexity - 1) * 100
        against = (f"the float {self.model}" if self.reference_weights is None
                   else f"{self.reference} ({self.reference_weights} weights)")
        short = "float" if self.reference_weights is None else "reference"
        return "\n".join([
            f"quality of {self.artifact} ({self.weights} weights) against {against} on {self.device}",
            f"  teacher-forced tokens  {self.tokens}",
            f"  top-1 agreement        {self.top1_agreement * 100:.1f}%",
            f"  logit error            max {self.max_logit_error:.3g}, mean {self.mean_logit_error:.3g}",
            f"  perplexity             {self.perplexity:.3f} ({short} {self.reference_perplexity:.3f}, {change:+.2f}%)",
        ])


def _weights(program: LoadedProgram) -> str:
    q = program.specs.quantization
    if q is None:
        return "float"
    return q.label()


def _chunks(total: int, width: int) -> list[tuple[int, int]]:
    return [(start, min(width, total - start)) for start in range(0, total, width)]


def _artifact_logits(program: LoadedProgram, bundle: ModelBundle, ids: torch.Tensor) -> torch.Tensor:
    """The artifact's first output at every position of ``ids`` ``[1, n]``, fed as one session in
    chunks of at most ``max_write`` tokens (a batched artifact: one session of its runner)."""
    manifest = program.specs.manifest
    outs: list[torch.Tensor] = []
    if manifest.paging is not None:
        from offgraph_export.runtime.batched import BatchedRunner

        runner = BatchedRunner(program)
        sid = runner.open()
        try:
            for start, width in _chunks(ids.shape[1], manifest.max_write):
                outs.append(runner.step({sid: ids[0, start:start + width].tolist()})[sid][0])
        finally:
            runner.close(sid)
    else:
        session = Session(program)
        try:
            for start, width in _chunks(ids.shape[1], manifest.max_write):
                outs.append(session.feed(bundle.make_inputs, ids[:, start:start + width].to(program.device))[0])
        finally:
            session.close()
    return torch.cat([o.float().cpu() for o in outs], dim=1)[0]


def _float_logits(program: LoadedProgram, bundle: ModelBundle, ids: torch.Tensor) -> torch.Tensor:
    """The eager model's first output, with its own float weights, in the same chunks."""
    manifest = program.specs.manifest
    bundle.model.to(program.device)
    oracle = bundle.oracle(manifest)
    outs = []
    with torch.no_grad():
        for start, width in _chunks(ids.shape[1], manifest.max_write):
            chunk = ids[:, start:start + width].to(program.device)
            outs.append(oracle.step(tuple(bundle.make_inputs(chunk, start)))[0])
    return torch.cat([o.float().cpu() for o in outs], dim=1)[0]


def _perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="mean")
    return math.exp(float(nll))


def quality_report(
    artifact: LoadedProgram | str | Path,
    bundle: ModelBundle | str,
    text: str | None = None,
    tokens: int = DEFAULT_TOKENS,
    against: LoadedProgram | str | Path | None = None,
) -> QualityReport:
    """Score ``artifact`` against ``bundle``'s float model, or against the artifact ``against`` (of
    the same model: a quantized artifact against its bf16 one), on ``text`` (default:
    :func:`default_text`) over its first ``tokens`` positions (fewer where the text or either
    artifact's capacity is shorter; at least 8). Raises
    :class:`~offgraph_export.errors.OffgraphError` for a model without a tokenizer, a text too short
    to score, or a reference whose logits do not compare position by position."""
    model_name = bundle if isinstance(bundle, str) else ""
    if isinstance(bundle, str):
        bundle = load_bundle(bundle)
    program = load_artifact(artifact) if isinstance(artifact, (str, Path)) else artifact
    other = load_artifact(against) if isinstance(against, (str, Path)) else against
    if bundle.encode is None:
        raise OffgraphError("the model has no tokenizer to encode the quality text: use hf:DIR, gguf:FILE or a factory with encode")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 8:
        raise OffgraphError(f"tokens={tokens!r} must be an int >= 8")
    ids = list(bundle.encode(default_text() if text is None else text))
    n = min(tokens, len(ids) - 1, *(p.specs.manifest.max_capacity for p in (program, other)
                                   if p is not None and p.specs.manifest.has_flat))
    if n < 8:
        raise OffgraphError(f"the text encodes to {len(ids)} tokens; the report needs at least 9")
    if any(not 0 <= i < bundle.vocab_size for i in ids[: n + 1]):
        raise OffgraphError("the tokenizer produced ids outside the model's vocabulary")
    feed = torch.tensor([ids[:n]], dtype=torch.long)
    targets = torch.tensor(ids[1 : n + 1], dtype=torch.long)
    got = _artifact_logits(program, bundle, feed)
    want = _float_logits(program, bundle, feed) if other is None else _artifact_logits(other, bundle, feed)
    if got.shape != want.shape or got.dim() != 2:
        theirs = "the model's" if other is None else f"{other.path}'s"
        raise OffgraphError(f"the artifact's logits {tuple(got.shape)} and {theirs} {tuple(want.shape)} do not compare per position")
    diff = (got - want).abs()
    return QualityReport(
        artifact=str(program.path), model=model_name or program.specs.model, device=str(program.device),
        weights=_weights(program), tokens=n,
        reference="float model" if other is None else str(other.path),
        reference_weights=None if other is None else _weights(other),
        max_logit_error=float(diff.max()), mean_logit_error=float(diff.mean()),
        top1_agreement=float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        perplexity=_perplexity(got, targets), reference_perplexity=_perplexity(want, targets),
    )
