"""Load a ``.pt2`` artifact: the archive's entries first (names, links, checksums: nothing is
extracted from a bad archive), then its specs (no code), then the compiled program, then
cross-check the two before any step runs.

Loading a compiled package runs native code: load only artifacts you trust. These checks refuse
corrupt, inconsistent or path-traversing archives; they cannot make a malicious library safe."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from offgraph_export.errors import ArtifactError, SpecError
from offgraph_export.specs.artifact import PROGRAM_KEY, ArtifactSpecs, read_artifact_specs
from offgraph_export.specs.manifest import MANIFEST_KEY, parse_manifest
from offgraph_export.specs.step_width import STEP_WIDTH_KEY, parse_step_width

__all__ = ["Artifact"]


class Artifact:
    """A loaded program and its specs. One artifact serves many sessions (weights loaded once)."""

    def __init__(self, path: Path, specs: ArtifactSpecs, compiled: object) -> None:
        self.path = path
        self.specs = specs
        self.compiled = compiled
        self._run = compiled.loader.run  # type: ignore[attr-defined]  # no pytree work per call

    @property
    def device(self) -> torch.device:
        """The device the program runs on, with its index (``cuda:0``, as tensors report it)."""
        if self.specs.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.specs.device)

    @classmethod
    def load(cls, path: str | os.PathLike, single_threaded: bool = False) -> "Artifact":
        """``single_threaded=True`` loads for CUDA graph capture."""
        path = Path(path)
        specs = read_artifact_specs(path, verify_crc=True)
        if specs.device == "cuda" and not torch.cuda.is_available():
            raise ArtifactError(f"{path} was compiled for cuda but no CUDA device is available")
        try:
            from torch._inductor import aoti_load_package

            compiled = aoti_load_package(str(path), run_single_threaded=single_threaded)
        except Exception as exc:  # loader raises RuntimeError/others from C++
            raise ArtifactError(f"cannot load the compiled program in {path}: {exc}") from exc
        cls._cross_check(path, specs, compiled)
        return cls(path, specs, compiled)

    @staticmethod
    def _cross_check(path: Path, specs: ArtifactSpecs, compiled: object) -> None:
        metadata = compiled.get_metadata()  # type: ignore[attr-defined]
        missing = [k for k in (STEP_WIDTH_KEY, MANIFEST_KEY, PROGRAM_KEY) if k not in metadata]
        if missing:
            raise ArtifactError(
                f"{path}: the compiled program's metadata lacks {missing}; re-export it with this "
                "version of offgraph-export"
            )
        try:
            width, manifest = parse_step_width(metadata[STEP_WIDTH_KEY]), parse_manifest(metadata[MANIFEST_KEY])
        except SpecError as exc:
            raise ArtifactError(f"{path}: the compiled program's own specs are invalid: {exc}") from exc
        if width != specs.step_width:
            raise ArtifactError(
                f"{path}: step width in the archive ({specs.step_width.format()!r}) disagrees with the "
                f"compiled program's ({metadata[STEP_WIDTH_KEY]!r})"
            )
        if manifest != specs.manifest:
            raise ArtifactError(f"{path}: manifest in the archive disagrees with the compiled program's")
        if metadata[PROGRAM_KEY] != specs.program_description():
            raise ArtifactError(
                f"{path}: the inputs the archive's specs describe (dtypes, dynamic dims, ranges, "
                "positions) disagree with the compiled program's own"
            )
        in_spec, _ = compiled.loader.get_call_spec()  # type: ignore[attr-defined]
        n_inputs = torch.utils._pytree.treespec_loads(in_spec).num_leaves
        want = len(specs.inputs) + 2 * len(specs.manifest.layers)
        if n_inputs != want:
            raise ArtifactError(
                f"{path}: compiled program takes {n_inputs} inputs but the specs describe {want} "
                f"({len(specs.inputs)} model inputs + {2 * len(specs.manifest.layers)} storage)"
            )

    def run(self, flat_inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Call the compiled program on model inputs followed by storage, as a flat list."""
        return self._run(list(flat_inputs))

    def new_session(self, **kwargs) -> "Session":  # noqa: F821
        from offgraph_export.runtime.session import Session

        return Session(self, **kwargs)
