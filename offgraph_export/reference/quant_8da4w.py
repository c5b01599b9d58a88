"""``8da4w``, the rule (design section 11, "8da4w for .pte"): torchao's int8 dynamic activation +
int4 weight quantization of a linear, the form ExecuTorch's XNNPACK delegate runs as a
dynamically quantized fully-connected layer.

Defined once here, on torchao's own code, so that the program and ``check``'s oracle compute the
same thing: :func:`quantized_weight` turns a float ``[N, K]`` weight into torchao's
``IntxUnpackedToInt8Tensor`` with ``Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
weight_granularity=PerGroup(G))`` (ExecuTorch's own llama recipe for ``8da4w``):

* weights: symmetric int4 per group of ``G`` consecutive input features, one scale per
  row and group (rounded to bfloat16, as XNNPACK stores them), ``scale = max|W| / 7.5`` over the group, ``q = clamp(round(W / scale), -8, 7)``
  (stored one value per int8), zero points 0;
* activations: at every call, asymmetric int8 per token (per row of the input), scale and zero
  point chosen from that row's min and max, ``x' = (clamp(round(x / s) + z, -128, 127) - z) * s``;
* the linear: ``linear(x', W')`` with ``W' = q * scale``, in float32.

``passes/quantize_8da4w.py`` puts a module holding that tensor in the program (export turns it into
torchao's ``choose_qparams_affine`` / ``quantize_affine`` / ``dequantize_affine`` calls around
``aten.linear``, the pattern XNNPACK's partitioner takes); ``check`` builds its oracle with
:func:`quantized_8da4w_weights`, the eager model whose linears hold the same tensors, run by
torchao in PyTorch. Per-row quantization of the weights and per-token quantization of the
activations make a fused linear (q|k|v) compute exactly what its parts would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from offgraph_export.errors import OffgraphError
from offgraph_export.reference.weight_quant import replaced_weights
from offgraph_export.specs.quantization import QuantizationSpec, group_problem

__all__ = ["SCHEME", "WEIGHT_DTYPE", "torchao_config", "quantized_weight", "quantized_8da4w_weights", "DynamicQuantLinear"]

SCHEME = "8da4w"
#: the only dtype 8da4w takes: XNNPACK delegates no other dynamically quantized linears (bf16 ones
#: are left to ExecuTorch's portable kernels, which have no out-variants for torchao's ops)
WEIGHT_DTYPE = torch.float32


def _torchao():
    try:
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerGroup
        from torchao.quantization.quant_primitives import MappingType
    except ImportError as exc:
        raise OffgraphError(f"--quantize 8da4w needs torchao (pip install 'offgraph-export[executorch]'): {exc}") from exc
    return Int8DynamicActivationIntxWeightConfig, quantize_, PerGroup, MappingType


def torchao_config(group_size: int) -> object:
    """torchao's config for 8da4w in groups of ``group_size``, every choice said aloud (they are
    torchao's defaults for this config and ExecuTorch's llama recipe)."""
    config, _, per_group, mapping = _torchao()
    return config(
        weight_dtype=torch.int4,
        weight_granularity=per_group(group_size),
        weight_mapping_type=mapping.SYMMETRIC,
        act_mapping_type=mapping.ASYMMETRIC,
        intx_packing_format="unpacked_to_int8",
        weight_scale_dtype=torch.bfloat16,
    )


def quantized_weight(weight: torch.Tensor, group_size: int, name: str = "weight") -> torch.Tensor:
    """``weight`` (float32 ``[N, K]``) as torchao's 8da4w tensor: its linears quantize their
    input per token and compute with the int4 weights (module docstring). Raises
    :class:`OffgraphError` for a weight 8da4w cannot take, naming it."""
    if weight.dim() != 2 or weight.dtype != WEIGHT_DTYPE:
        raise OffgraphError(
            f"8da4w takes float32 [N, K] weights; {name} is {weight.dtype} {list(weight.shape)} "
            "(export a float32 model: --dtype float32)"
        )
    problem = group_problem(name, weight.shape[1], group_size, SCHEME)
    if problem:
        raise OffgraphError(problem)
    _, quantize_, _, _ = _torchao()
    holder = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        holder.weight.copy_(weight.detach())
    holder.requires_grad_(False)
    quantize_(holder, torchao_config(group_size))
    return holder.weight.data if isinstance(holder.weight, torch.nn.Parameter) else holder.weight


class DynamicQuantLinear(torch.nn.Module):
    """A linear over one 8da4w weight: ``forward(x, bias=None)`` is ``F.linear(x, W, bias)``,
    which torchao computes (and export traces) as the dynamically quantized linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, bias)


@contextmanager
def quantized_8da4w_weights(model: torch.nn.Module, spec: QuantizationSpec) -> Iterator[int]:
    """``model`` as the oracle of an artifact quantized as ``spec`` (scheme ``8da4w``), for the
    ``with`` block: every source weight replaced by :func:`quantized_weight` of it
    (``weight_quant.replaced_weights``: the same holders, tied tables and restores as the
    weight-only oracle). The linears then run torchao's 8da4w in PyTorch. Yields how many weights
    it replaced. Raises :class:`OffgraphError` naming a source the model lacks or cannot take."""
    if spec.scheme != SCHEME or spec.group_size is None:
        raise OffgraphError(f"quantized_8da4w_weights takes an 8da4w spec, not {spec.scheme}")
    group_size = spec.group_size

    with replaced_weights(model, spec, lambda weight, source: quantized_weight(weight, group_size, source)) as replaced:
        yield replaced
