"""Weight-only quantization, the rule (design section 11): quantize a float ``[N, K]`` weight to
the stored form, and dequantize it back to the values the compiled step and the oracle both use.

Defined once here: ``passes/quantize_weights.py`` stores :func:`quantize`'s tensors and puts
:func:`dequantize_graph` in the program; ``check`` builds its oracle with :func:`dequantize`
(through :func:`dequantized_weights`); the tests compare both with a plain recompute. Everything is
computed in fp32 from the float weight and rounded to the model's dtype once at the end, so the
result is deterministic and the same on every device.

``int8``: symmetric per output channel. ``int4``: asymmetric per group of ``group_size`` input
features, two values a byte (low nibble: even ``k``), ``(q - 8) * scale + zero``: the form
tinygemm (``aten._weight_int4pack_mm``) and torchao's weight-only int4 take.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from offgraph_export.errors import OffgraphError
from offgraph_export.specs.quantization import QuantizationSpec, QuantizedWeight, group_problem

__all__ = ["INT4_MID", "QuantizedTensors", "quantize", "dequantize", "dequantize_graph", "dequantized_weights", "replaced_weights"]

_INT8_MAX = 127
_INT4_MAX = 15
#: the int4 zero level: ``(q - INT4_MID) * scale + zero``
INT4_MID = 8
#: the smallest step a scale takes (a constant row or group would otherwise divide by zero)
_EPS = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class QuantizedTensors:
    """The stored form of one weight: ``qweight`` (int8 ``[N, K]`` or uint8 ``[N, K/2]``),
    ``scales`` (``[N]`` or ``[N, K/G]``) and, for int4, ``zeros`` (``[N, K/G]``), in the float
    weight's dtype."""

    scheme: str
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    group_size: int | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The constants the program stores, by suffix."""
        out = {"qweight": self.qweight, "scales": self.scales}
        if self.zeros is not None:
            out["zeros"] = self.zeros
        return out


def quantize(weight: torch.Tensor, scheme: str, group_size: int | None = None, name: str = "weight") -> QuantizedTensors:
    """``weight`` ``[N, K]`` (floating) in the stored form of ``scheme``; ``name`` is for errors."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise OffgraphError(f"{name} is a {weight.dim()}-D {weight.dtype} tensor; quantization takes a 2-D floating weight")
    w = weight.detach().float()
    if scheme == "int8":
        scales = (w.abs().amax(dim=1) / _INT8_MAX).clamp_min(_EPS)
        q = torch.round(w / scales[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        return QuantizedTensors("int8", q, scales.to(weight.dtype))
    if scheme == "int4":
        if group_size is None:
            raise OffgraphError("int4 quantization needs a group size")
        problem = group_problem(name, int(w.shape[1]), group_size)
        if problem:
            raise OffgraphError(problem)
        n, k = w.shape
        groups = w.reshape(n, k // group_size, group_size)
        lo, hi = groups.amin(dim=2), groups.amax(dim=2)
        scales = ((hi - lo) / _INT4_MAX).clamp_min(_EPS)
        q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp_(0, _INT4_MAX).to(torch.uint8).reshape(n, k)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        zeros = lo + INT4_MID * scales
        return QuantizedTensors("int4", packed.contiguous(), scales.to(weight.dtype), zeros.to(weight.dtype), group_size)
    raise OffgraphError(f"unknown quantization scheme {scheme!r}; expected int8 or int4")


def dequantize_graph(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int | None, dtype: torch.dtype,
) -> torch.Tensor:
    """The float weight ``W'`` of the stored form, in ``dtype``, written with aten ops only (what
    the quantize pass traces into the program; :func:`dequantize` is the same computation)."""
    if zeros is None:
        return (qweight.to(torch.float32) * scales.to(torch.float32)[:, None]).to(dtype)
    n = qweight.shape[0]
    low = torch.bitwise_and(qweight, 15)
    high = torch.bitwise_right_shift(qweight, 4)
    q = torch.stack([low, high], dim=-1).reshape(n, -1, group_size).to(torch.float32)
    w = (q - INT4_MID) * scales.to(torch.float32)[..., None] + zeros.to(torch.float32)[..., None]
    return w.reshape(n, -1).to(dtype)


def dequantize(stored: QuantizedTensors) -> torch.Tensor:
    """``W'``: the values a quantized linear computes with, in the float weight's dtype."""
    return dequantize_graph(stored.qweight, stored.scales, stored.zeros, stored.group_size, stored.scales.dtype)


def _holders(model: torch.nn.Module, param: torch.Tensor) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is param]


@contextmanager
def dequantized_weights(model: torch.nn.Module, spec: QuantizationSpec) -> Iterator[int]:
    """``model`` as the oracle of an artifact quantized as ``spec``, for the ``with`` block: every
    source weight replaced by ``dequantize(quantize(W))`` in its own scheme (:func:`replaced_weights`).
    Yields how many weights it replaced."""
    entry_of = {source: entry for entry in spec.weights for source in entry.sources}

    def value(weight: torch.Tensor, source: str) -> torch.Tensor:
        entry = entry_of[source]
        return dequantize(quantize(weight, spec.scheme_of(entry), spec.group_of(entry), source))

    with replaced_weights(model, spec, value) as replaced:
        yield replaced


@contextmanager
def replaced_weights(
    model: torch.nn.Module, spec: QuantizationSpec, value: Callable[[torch.Tensor, str], torch.Tensor],
) -> Iterator[int]:
    """``model`` with every source weight of ``spec`` replaced by ``value(W, source)`` for the
    ``with`` block (the oracle of a quantized artifact: the scheme's rule decides the value), as a
    new parameter of the ``nn.Linear`` modules that hold it (a tied table keeps its float values for
    its other readers), or by name where no ``nn.Linear`` holds it and nothing else reads it (a
    buffer keeps its persistence). Yields how many attributes it replaced; every one is put back
    on exit. Raises :class:`~offgraph_export.errors.OffgraphError` naming a source the model lacks
    or cannot take."""
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    undo: list[tuple[torch.nn.Module, str, object]] = []
    try:
        with torch.no_grad():
            for entry in spec.weights:
                for source in entry.sources:
                    _replace(model, params, source, entry, value, undo)
        yield len(undo)
    finally:
        for module, attr, old in reversed(undo):
            if isinstance(old, torch.nn.Parameter) or old is None:
                setattr(module, attr, old)
            else:
                module.register_buffer(attr, old, persistent=attr not in module._non_persistent_buffers_set)  # type: ignore[arg-type]


def _replace(
    model: torch.nn.Module, params: dict[str, torch.Tensor], source: str, entry: QuantizedWeight,
    value_of: Callable[[torch.Tensor, str], torch.Tensor], undo: list[tuple[torch.nn.Module, str, object]],
) -> None:
    weight = params.get(source)
    if weight is None:
        raise OffgraphError(f"the artifact quantized {source}, which the model has no parameter or buffer named")
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] != entry.shape[1]:
        raise OffgraphError(
            f"the artifact quantized {source} as [*, {entry.shape[1]}], but the model's is {list(weight.shape)} {weight.dtype}"
        )
    param = torch.nn.Parameter(value_of(weight, source), requires_grad=False)
    holders = _holders(model, weight)
    if not holders and entry.shared:
        raise OffgraphError(
            f"{source} is read by a linear and by other nodes, and no nn.Linear holds it: the oracle cannot "
            "replace it for the linear alone"
        )
    if holders:
        for module in holders:
            undo.append((module, "weight", module.weight))
            module.weight = param
        return
    owner_name, _, attr = source.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    old = getattr(owner, attr)
    undo.append((owner, attr, old))
    if isinstance(old, torch.nn.Parameter):
        setattr(owner, attr, param)
    else:
        owner.register_buffer(attr, param.data, persistent=attr not in owner._non_persistent_buffers_set)
