"""Linear weights a user already quantized with torchao's weight-only configs, taken into this
project's stored form without changing a value (design section 11, "Models quantized with torchao").

Why a module of its own: export quantizes float weights by the project's rule
(:mod:`~offgraph_export.reference.weight_quant`). A model that arrives quantized must keep the
values its user chose: dequantizing it and quantizing again would round twice and the artifact
would no longer compute what the user's model computes. Where torchao's tensor is the rule's
stored form written another way (int8 symmetric per output row; int4 symmetric per group, whose
zero point is 0 in either domain) its tensors are re-laid out here, and each conversion is verified:
the stored form's ``W'`` equals torchao's own ``dequantize()`` bit for bit. Anything else
(another granularity, a non-zero zero point, activation quantization, a packing only a CUDA
kernel reads, a scale the model's dtype does not hold) is refused with one line naming the weight,
torchao's class and config, and what is accepted.

Export then traces the model with each torchao weight replaced by its ``W'`` (:func:`float_stand_ins`)
and the quantize pass stores the converted tensors in their place
(:func:`~offgraph_export.passes.quantize_weights.quantize_weights`, ``stored=``). torchao stays
optional: nothing here imports it; a torchao tensor is recognized by its class's module, and only a
model that holds one reaches torchao's code (its tensors' own ``dequantize``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from offgraph_export.errors import ExportError, OffgraphError
from offgraph_export.reference.weight_quant import INT4_MID, QuantizedTensors, dequantize
from offgraph_export.specs.quantization import GROUP_SIZES, QuantizationSpec

__all__ = [
    "ACCEPTED",
    "TorchaoWeights",
    "is_torchao_tensor",
    "torchao_parameters",
    "convert_tensor",
    "convert_torchao_weights",
    "float_stand_ins",
    "export_scheme",
    "oracle_split",
]

#: what a refusal says is accepted (design section 11)
ACCEPTED = (
    "accepted are torchao's weight-only Int8WeightOnlyConfig() (per row, scales the model's dtype holds exactly) and "
    "IntxWeightOnlyConfig(weight_dtype=torch.int8) or IntxWeightOnlyConfig(weight_dtype=torch.int4, "
    f"granularity=PerGroup({'|'.join(map(str, GROUP_SIZES))})), symmetric"
)


#: the config each torchao class comes from, and why it is refused where it always is
_REFUSED_CLASSES = {
    "Int4Tensor": "Int4WeightOnlyConfig(int4_packing_format='plain'), mslk's CUDA packing",
    "Int4PreshuffledTensor": "Int4WeightOnlyConfig(int4_packing_format='preshuffled'), mslk's CUDA packing",
    "Int4TilePackedTo4dTensor": "Int4WeightOnlyConfig(int4_packing_format='tile_packed_to_4d'), tinygemm's CUDA packing",
    "Int4PlainInt32Tensor": "Int4WeightOnlyConfig(int4_packing_format='plain_int32'), an XPU/NPU packing",
    "IntxOpaqueTensor": "IntxWeightOnlyConfig with an opaque packing for torchao's CPU kernels",
    "Float8Tensor": "a float8 config",
    "NF4Tensor": "NF4 (QLoRA) quantization",
    "AffineQuantizedTensor": "a version-1 torchao config",
}


def is_torchao_tensor(value: object) -> bool:
    """Whether ``value`` is one of torchao's tensor subclasses (by its class's module: no import)."""
    return isinstance(value, torch.Tensor) and type(value).__module__.split(".", 1)[0] == "torchao"


def torchao_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers that are torchao tensors, by name (every name of a tied one)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: value for name, value in named if is_torchao_tensor(value)}


@dataclass(frozen=True)
class TorchaoWeights:
    """A model's torchao weights in the stored form, by parameter name, and the one scheme (and
    int4 group size) they share; ``described`` names one of them, for messages."""

    stored: dict[str, QuantizedTensors]
    scheme: str
    group_size: int | None
    described: str


def _refuse(name: str, value: torch.Tensor, config: str, why: str) -> ExportError:
    return ExportError(f"{name} is a torchao {type(value).__name__} ({config}): {why}; {ACCEPTED}")


def _exact_scales(name: str, value: torch.Tensor, config: str, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` in ``dtype``, refused unless every value survives the cast."""
    cast = scale.to(dtype, copy=True)  # the stored form owns its tensors, never the user's model's
    if not torch.equal(cast.to(torch.float32), scale.to(torch.float32)):
        raise _refuse(
            name, value, config,
            f"its {str(scale.dtype).removeprefix('torch.')} scales are not all exact in "
            f"{str(dtype).removeprefix('torch.')}, the dtype the stored form keeps them in (export the float "
            "model with --quantize, or quantize it with IntxWeightOnlyConfig, whose scales are in the model's dtype)",
        )
    return cast


def _zero_points_are_zero(zero_point: torch.Tensor | None) -> bool:
    return zero_point is None or not bool(zero_point.ne(0).any())


def _per_row(name: str, value: torch.Tensor, config: str, qdata: torch.Tensor, scale: torch.Tensor,
             block_size: list[int]) -> QuantizedTensors:
    """int8 per output row (or per tensor, each row taking the one scale)."""
    n, k = qdata.shape
    if list(block_size) == [n, k] and scale.numel() == 1:
        scale = scale.reshape(1).expand(n)
    elif list(block_size) == [1, k] and scale.numel() == n:
        scale = scale.reshape(n)
    else:
        raise _refuse(name, value, config, f"int8 in blocks of {list(block_size)} is not per output row")
    scales = _exact_scales(name, value, config, scale, value.dtype)
    return QuantizedTensors("int8", qdata.detach().clone().contiguous(), scales.contiguous())


def _int8_tensor(name: str, value: torch.Tensor) -> QuantizedTensors:
    """``Int8WeightOnlyConfig``'s ``Int8Tensor``: ``(qdata - zero_point) * scale``."""
    config = "Int8WeightOnlyConfig"
    if getattr(value, "act_quant_kwargs", None) is not None:
        raise _refuse(name, value, "Int8DynamicActivationInt8WeightConfig", "its activations are quantized too, not weight-only")
    if any(getattr(value, a, None) is not None for a in ("act_pre_scale", "act_quant_scale", "act_quant_zero_point")):
        raise _refuse(name, value, config, "it scales or quantizes its activations (an activation pre-scale or static activation scale)")
    qdata, scale = value.qdata, value.scale
    if qdata.dim() != 2 or qdata.dtype != torch.int8:
        raise _refuse(name, value, config, f"its data is a {qdata.dim()}-D {qdata.dtype} tensor, not a 2-D int8 weight")
    if not _zero_points_are_zero(value.zero_point):
        raise _refuse(name, value, config, "its zero points are not 0 (asymmetric), and int8 is stored symmetric")
    return _per_row(name, value, config, qdata, scale, list(value.block_size))


def _intx_tensor(name: str, value: torch.Tensor) -> QuantizedTensors:
    """``IntxWeightOnlyConfig``'s ``IntxUnpackedToInt8Tensor``: ``(qdata - zero_point) * scale``
    per block, ``qdata`` int8 holding ``target_dtype``'s range."""
    target = value.target_dtype
    bits = str(target).removeprefix("torch.")
    config = f"IntxWeightOnlyConfig(weight_dtype=torch.{bits})"
    if value.activation_quantization is not None:
        raise _refuse(name, value, "Int8DynamicActivationIntxWeightConfig", "its activations are quantized too, not weight-only")
    qdata, scale = value.qdata, value.scale
    if qdata.dim() != 2 or qdata.dtype != torch.int8:
        raise _refuse(name, value, config, f"its data is a {qdata.dim()}-D {qdata.dtype} tensor, not a 2-D weight")
    if not _zero_points_are_zero(value.zero_point):
        raise _refuse(
            name, value, config,
            "its zero points are not 0 (asymmetric mapping: (q - zero_point) * scale in the integer domain, which "
            "the stored (q - 8) * scale + zero does not hold exactly)",
        )
    block = list(value.block_size)
    n, k = qdata.shape
    if target == torch.int8:
        return _per_row(name, value, config, qdata, scale, block)
    if target != torch.int4:
        raise _refuse(name, value, config, f"{bits} weights are neither int8 nor int4")
    group = block[1]
    if block[0] != 1 or group not in GROUP_SIZES or k % group or scale.shape != (n, k // group):
        raise _refuse(name, value, config, f"int4 in blocks of {block} is not per group of {'|'.join(map(str, GROUP_SIZES))} input features")
    scales = _exact_scales(name, value, config, scale, value.dtype).contiguous()
    nibbles = (qdata.to(torch.int16) + INT4_MID).to(torch.uint8)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()
    return QuantizedTensors("int4", packed, scales, torch.zeros_like(scales), group)


_CONVERTERS = {"Int8Tensor": _int8_tensor, "IntxUnpackedToInt8Tensor": _intx_tensor}


def convert_tensor(name: str, value: torch.Tensor) -> QuantizedTensors:
    """One torchao weight ``value`` (parameter ``name``) in the stored form, verified against
    torchao's own ``dequantize()``; raises :class:`~offgraph_export.errors.ExportError` (one
    line) for a form that does not map exactly."""
    kind = type(value).__name__
    convert = _CONVERTERS.get(kind)
    if convert is None:
        config = _config_of(value)
        why = "a packing this project does not unpack" if kind.startswith("Int4") else "not a form this project stores"
        raise _refuse(name, value, config, why)
    stored = convert(name, value)
    theirs = value.dequantize()
    ours = dequantize(stored)
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape or not torch.equal(_bits(ours), _bits(theirs)):
        raise ExportError(
            f"{name}: the torchao {kind}'s values did not convert exactly to the {stored.scheme} stored form "
            "(its dequantized weight differs from torchao's); export refuses rather than change a value"
        )
    return stored


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (so that -0.0 and 0.0, or two NaNs, compare as what they are)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _config_of(value: torch.Tensor) -> str:
    """The torchao config a tensor's class comes from, as far as its class says."""
    kind = type(value).__name__
    if kind == "Int8Tensor":
        return "Int8WeightOnlyConfig"
    if kind == "IntxUnpackedToInt8Tensor":
        return f"IntxWeightOnlyConfig(weight_dtype=torch.{str(value.target_dtype).removeprefix('torch.')})"
    return _REFUSED_CLASSES.get(kind, "a torchao config")


def _linear_held(model: torch.nn.Module, value: torch.Tensor) -> bool:
    return any(isinstance(m, torch.nn.Linear) and m.weight is value for m in model.modules())


def convert_torchao_weights(model: torch.nn.Module) -> TorchaoWeights | None:
    """Every torchao tensor of ``model`` in the stored form (None: it holds none). Refuses one that
    is not an ``nn.Linear``'s weight, one that does not convert exactly, and weights of more than
    one scheme or group size (an artifact records one)."""
    found = torchao_parameters(model)
    if not found:
        return None
    stored: dict[str, QuantizedTensors] = {}
    converted: dict[int, QuantizedTensors] = {}
    first: tuple[str, QuantizedTensors] | None = None
    plain = {p.dtype for p in model.parameters() if not is_torchao_tensor(p) and p.is_floating_point()}
    for name, value in found.items():
        if not _linear_held(model, value):
            raise _refuse(name, value, _config_of(value), "it is not an nn.Linear's weight, and only linear weights are stored quantized")
        if len(plain) == 1 and value.dtype not in plain:
            model_dtype = str(next(iter(plain))).removeprefix("torch.")
            raise _refuse(
                name, value, _config_of(value),
                f"it computes in {str(value.dtype).removeprefix('torch.')} but the model's other weights are {model_dtype} "
                "(nn.Module.to does not cast torchao's tensors: cast the model before quantize_)",
            )
        if id(value) not in converted:
            converted[id(value)] = convert_tensor(name, value)
        stored[name] = converted[id(value)]
        if first is None:
            first = (name, stored[name])
        elif (stored[name].scheme, stored[name].group_size) != (first[1].scheme, first[1].group_size):
            raise ExportError(
                f"{first[0]} is torchao {_form(first[1])} but {name} is {_form(stored[name])}: an artifact holds one "
                "scheme and group size; quantize the model's linears alike"
            )
    assert first is not None
    name, one = first
    return TorchaoWeights(stored, one.scheme, one.group_size, f"{name} (torchao {type(found[name]).__name__}, {_form(one)})")


def _form(stored: QuantizedTensors) -> str:
    return f"int4 in groups of {stored.group_size}" if stored.group_size else stored.scheme


def export_scheme(
    weights: TorchaoWeights, quantize: str, group_size: int | None, pt2: bool, head_group: int | None = None,
) -> tuple[str, int | None, bool]:
    """What export quantizes with, for a model holding ``weights`` and the user's ``quantize`` /
    ``group_size`` (None: not given): ``(scheme, group size, quantize the other linears too)``.
    ``head_group``: the group size of an int4 lm_head (``--quantize-lm-head int4``), which an int8
    model's export takes as its group size. Refuses a ``.pte``, another scheme and another int4
    group size."""
    from offgraph_export.options import OptionError

    if not pt2:
        raise OptionError(
            f"{weights.described} is weight-only quantized, and a .pte takes no weight-only quantization "
            "(design section 11): export it with --format pt2",
            "--format",
        )
    if quantize == "none":
        return weights.scheme, weights.group_size, False
    if quantize != weights.scheme:
        raise OptionError(
            f"--quantize {quantize} would quantize the other linears as {quantize}, but the model's are already "
            f"{weights.described}: an artifact holds one scheme; drop --quantize or use --quantize {weights.scheme}",
            "--quantize",
        )
    if weights.group_size is None:  # int8: the only grouped weight is an int4 lm_head
        return weights.scheme, head_group, True
    if group_size is not None and group_size != weights.group_size:
        raise OptionError(
            f"--group-size {group_size} differs from the model's torchao groups, {weights.described}: an artifact "
            f"holds one group size; drop --group-size or use --group-size {weights.group_size}",
            "--group-size",
        )
    return weights.scheme, weights.group_size, True


@contextmanager
def float_stand_ins(model: torch.nn.Module, weights: TorchaoWeights) -> Iterator[None]:
    """``model`` for the ``with`` block with each torchao weight replaced by a float parameter
    holding its ``W'`` (the values torchao computes with), where every module that holds it (a tied
    one too) reads the same new parameter; every one is put back on exit."""
    undo: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    made: dict[int, torch.nn.Parameter] = {}
    try:
        for name, stored in weights.stored.items():
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            old = getattr(owner, attr)
            if id(old) not in made:
                made[id(old)] = torch.nn.Parameter(dequantize(stored), requires_grad=False)
            undo.append((owner, attr, old))
            if attr in owner._buffers:
                owner._buffers[attr] = made[id(old)]
            else:
                owner._parameters[attr] = made[id(old)]
        yield
    finally:
        for owner, attr, old in reversed(undo):
            if attr in owner._buffers:
                owner._buffers[attr] = old
            else:
                owner._parameters[attr] = old  # type: ignore[assignment]


def oracle_split(model: torch.nn.Module, spec: QuantizationSpec) -> tuple[int, QuantizationSpec | None]:
    """For ``check``'s oracle: how many of ``spec``'s weights ``model`` holds as torchao tensors
    (they compute as torchao computes them, left as they are), and the spec of the rest (None:
    none), which the oracle dequantizes by the rule. Refuses a weight made of torchao and float
    parts: the oracle would have to quantize a torchao weight again."""
    held = torchao_parameters(model)
    if not held:
        return 0, spec
    rest = []
    for entry in spec.weights:
        ours = [s for s in entry.sources if s in held]
        if ours and len(ours) != len(entry.sources):
            float_parts = [s for s in entry.sources if s not in held]
            raise OffgraphError(
                f"the artifact's {entry.name} is made of {', '.join(entry.sources)}; the model holds "
                f"{', '.join(ours)} as torchao tensors but {', '.join(float_parts)} as float: the oracle cannot "
                "quantize a torchao weight again"
            )
        if not ours:
            rest.append(entry)
    kept = len(spec.weights) - len(rest)
    return kept, (spec.model_copy(update={"weights": rest}) if rest else None)
