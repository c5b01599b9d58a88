"""What each compiled method was built for, besides its inputs: its constants (weights) by name,
with dtype, shape and strides. Compiled into every method's AOTI metadata (:data:`CONSTANTS_KEY`) at export
and compared with the weights handed to the method at load: the compiled code reads them in place
and checks nothing itself, so a weights config that shrinks a view or a weight file of another
dtype, or a view whose strides differ from the compiled ones (a zero stride where the program reads
rows densely), would otherwise be read past its end. Works on anything with ``dtype``, ``shape`` and
``stride()`` (no torch import here)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from offgraph_export.errors import ArtifactError
from offgraph_export.specs.limits import loads_limited

__all__ = ["CONSTANTS_KEY", "SCALARS_KEY", "describe_constants", "check_constants"]

#: AOTI metadata key of a method's constants description.
CONSTANTS_KEY = "offgraph_constants"
#: The description's entry listing the values of the int64 scalars AOTInductor adds as constants
#: of its own while lowering (``_weight_int4pack_mm_for_cpu``'s group size, named ``constantN`` by
#: the compiler, so not known before the compile): such a constant is accepted only as a 0-dim
#: int64 tensor holding one of these values (a group size that disagrees with the scales' shape
#: would make the kernel read past them; it checks nothing itself).
SCALARS_KEY = "*int64 scalars*"


def check_constants(weights: Mapping[str, Any], description: str, method: str, source: str) -> None:
    """Every weight handed to ``method`` must be one of the constants its compiled program was
    built for, with that constant's dtype and shape (``description``: the program's own metadata,
    see :func:`describe_constants`), or a 0-dim int64 holding a value the description lists under
    :data:`SCALARS_KEY`: the compiled code reads them in place, unchecked. A described
    constant may be absent (the compiler folds some, e.g. RoPE frequency buffers, into code); one
    the program needs and lacks is refused by the loader's full-update check."""
    data = loads_limited(description, f"{source}: method {method!r} constants", ArtifactError)
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: method {method!r}: the compiled constants description is not an object")
    scalars = data.pop(SCALARS_KEY, [])
    if not isinstance(scalars, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in scalars):
        raise ArtifactError(f"{source}: method {method!r}: the description's {SCALARS_KEY!r} is not a list of integers")
    extra = sorted(name for name in set(weights) - set(data) if not _allowed_scalar(weights[name], scalars))
    if extra:
        raise ArtifactError(
            f"{source}: method {method!r}: the weights config names {extra[:3]}, which are not "
            "constants the program was compiled for"
        )
    for name, tensor in weights.items():
        if name not in data:  # an allowed scalar
            continue
        want, got = data[name], _describe(tensor)
        if not isinstance(want, list) or len(want) not in (2, 3):
            raise ArtifactError(f"{source}: method {method!r}: the description of constant {name!r} is malformed")
        if len(want) == 2:  # a package of an earlier version: no strides recorded, so dense ones only
            got = got[:2]
            if not _dense(tensor.shape, tensor.stride()):
                raise ArtifactError(
                    f"{source}: method {method!r}: weight {name!r} has strides {list(tensor.stride())}, which "
                    "a package without recorded strides cannot vouch for; re-export it with this version"
                )
        if want != got:
            raise ArtifactError(
                f"{source}: method {method!r}: weight {name!r} is {got[0]} {got[1]}"
                + (f" strides {got[2]}" if len(got) > 2 else "")
                + f" but the program was compiled for {want}"
            )


def _allowed_scalar(tensor: Any, values: list[int]) -> bool:
    """Whether ``tensor`` is a 0-dim int64 holding one of ``values`` (:data:`SCALARS_KEY`)."""
    if not values or str(tensor.dtype).removeprefix("torch.") != "int64" or list(tensor.shape) != []:
        return False
    return int(tensor.item()) in values


def _describe(tensor: Any) -> list[Any]:
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), list(tensor.stride())]


def _dense(shape: Any, stride: Any) -> bool:
    """Whether a view of ``shape``/``stride`` covers each of its elements once, with no gaps."""
    expected = 1
    for size, step in sorted((p for p in zip(shape, stride) if p[0] != 1), key=lambda p: p[1]):
        if size == 0:
            return True
        if step != expected:
            return False
        expected *= size
    return True


def describe_constants(constants: Mapping[str, Any], scalars: Sequence[int] = ()) -> str:
    """Canonical JSON ``{name: [dtype, shape, stride]}`` of a program's constants (compiled into each
    method's metadata at export, compared by :func:`check_constants` at load); ``scalars``: the
    values of the int64 scalars the compiler will add (:data:`SCALARS_KEY`)."""
    data: dict[str, Any] = {name: _describe(t) for name, t in constants.items()}
    if scalars:
        data[SCALARS_KEY] = sorted(set(int(v) for v in scalars))
    return json.dumps(data, sort_keys=True, separators=(",", ":"))
