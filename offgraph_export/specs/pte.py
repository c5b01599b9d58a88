"""The specs a ``.pte`` carries, and reading them back.

``lowering/executorch.py`` writes them as constant methods of the program (ExecuTorch's own way to
attach values to a ``.pte``): ``offgraph_kv_step_width``, ``offgraph_kv_manifest``,
``offgraph_program`` and ``offgraph_specs`` (the whole :class:`ArtifactSpecs` JSON). The runtime and
``inspect`` read them here with ExecuTorch's flatbuffer deserializer, which is plain Python: no
native code is loaded, and executorch is imported only when a ``.pte`` is read.
"""

from __future__ import annotations

import os

from offgraph_export.errors import ArtifactError
from offgraph_export.specs.archive import regular_file
from offgraph_export.specs.artifact import PROGRAM_KEY, ArtifactSpecs, parse_artifact_specs
from offgraph_export.specs.manifest import MANIFEST_KEY
from offgraph_export.specs.step_width import STEP_WIDTH_KEY

__all__ = ["SPECS_METHOD", "spec_constants", "read_pte_constants", "read_pte_specs"]

#: Constant method holding the whole ArtifactSpecs JSON.
SPECS_METHOD = "offgraph_specs"


def spec_constants(specs: ArtifactSpecs) -> dict[str, str]:
    """The constant methods a ``.pte`` of ``specs`` carries, by name."""
    return {
        STEP_WIDTH_KEY: specs.step_width.format(),
        MANIFEST_KEY: specs.manifest.to_json(),
        PROGRAM_KEY: specs.program_description(),
        SPECS_METHOD: specs.model_dump_json(),
    }


def read_pte_constants(path: str | os.PathLike) -> dict[str, str]:
    """The string constant methods of a ``.pte``, read from its flatbuffer (no native code)."""
    source = str(path)
    target = regular_file(path)
    try:
        from executorch.exir._serialize._program import deserialize_pte_binary
    except ImportError as exc:
        raise ArtifactError(f"reading {source} needs executorch (pip install 'offgraph-export[executorch]')") from exc
    try:
        program = deserialize_pte_binary(target.read_bytes())
    except Exception as exc:  # a malformed flatbuffer raises anything
        raise ArtifactError(f"{source} is not a readable .pte program: {type(exc).__name__}: {exc}") from exc
    program = getattr(program, "program", program)
    constants = {}
    for plan in program.execution_plan:
        values = getattr(plan, "values", [])
        if len(values) == 1 and hasattr(values[0].val, "string_val"):
            constants[plan.name] = values[0].val.string_val
    return constants


def read_pte_specs(path: str | os.PathLike) -> ArtifactSpecs:
    """The specs of a ``.pte``, checked against its separately stored width, manifest and
    program description."""
    source = str(path)
    constants = read_pte_constants(path)
    missing = [k for k in (SPECS_METHOD, STEP_WIDTH_KEY, MANIFEST_KEY, PROGRAM_KEY) if k not in constants]
    if missing:
        raise ArtifactError(f"{source} has no offgraph specs ({missing}); was it built by `offgraph-export export`?")
    specs = parse_artifact_specs(constants[SPECS_METHOD], source)
    if spec_constants(specs) != {k: constants[k] for k in spec_constants(specs)}:
        raise ArtifactError(f"{source}: its specs disagree with the width, manifest or program it carries")
    return specs
