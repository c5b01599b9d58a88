"""Load an ExecuTorch ``.pte`` artifact and run it through ``executorch.runtime``, with the same
sessions, storage manager and checks as a ``.pt2``.

The file is read once and checked before any native code sees it (:func:`~offgraph_export.specs.pte.load_pte`:
its layout with the bounded reader, its digest, its constant methods and every delegate's specs);
ExecuTorch's runtime is then handed those bytes, not the path, so it loads exactly what was
checked, and the program keeps them alive as long as it runs. Its ``forward`` is then checked
against the specs: input count and, per input, dtype and rank. The
method returns the mutated storage as its leading outputs (ExecuTorch plans graph inputs into its
own memory), so :meth:`PteArtifact.run` copies them back into the storage it was given and returns
the model's own outputs, as the ``.pt2`` runner does. Loading a program runs native kernels: load
only artifacts you trust.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from offgraph_export.errors import ArtifactError
from offgraph_export.specs.artifact import STEP_METHOD, ArtifactSpecs

__all__ = ["PteArtifact"]

#: ExecuTorch's ScalarType codes (as torch's c10::ScalarType) -> dtype names of the specs.
_DTYPES = {0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16", 6: "float32",
           7: "float64", 11: "bool", 15: "bfloat16"}


class PteArtifact:
    """A loaded ``.pte`` program and its specs; one serves many sessions."""

    def __init__(self, path: Path, specs: ArtifactSpecs, method: object, program: object | None = None) -> None:
        self.path = path
        self.specs = specs
        self.method = method
        #: the loaded program (it holds the checked bytes the method runs from)
        self.program = program
        self.n_storage = 2 * len(specs.manifest.layers)
        #: ExecuTorch's runner is not captured into CUDA graphs
        self.single_threaded = False

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def load(cls, path: str | os.PathLike, single_threaded: bool = False) -> "PteArtifact":
        from offgraph_export.specs.pte import load_pte

        path = Path(path)
        specs, data = load_pte(path)
        if specs.device != "cpu":
            raise ArtifactError(
                f"{path} was lowered for {specs.device} (the CUDA delegate); this runtime runs cpu "
                "programs only (ExecuTorch's pip runtime has no CUDA backend): run it with a "
                "CUDA-enabled ExecuTorch build, giving it the .pte and its .ptd data file"
            )
        try:
            from executorch.runtime import Runtime

            program = Runtime.get().load_program(data)  # the bytes checked, not the path again
            method = program.load_method("forward")
        except Exception as exc:  # the runtime raises RuntimeError/others from C++
            raise ArtifactError(f"cannot load the program in {path}: {exc}") from exc
        cls._cross_check(path, specs, method)
        return cls(path, specs, method, program)

    @staticmethod
    def _cross_check(path: Path, specs: ArtifactSpecs, method: object) -> None:
        meta = method.metadata  # type: ignore[attr-defined]
        n_storage = 2 * len(specs.manifest.layers)
        want = len(specs.inputs) + n_storage
        if meta.num_inputs() != want:
            raise ArtifactError(f"{path}: program takes {meta.num_inputs()} inputs but the specs describe {want}")
        if meta.num_outputs() < n_storage + 1:
            raise ArtifactError(f"{path}: program returns {meta.num_outputs()} outputs; expected the {n_storage} storage tensors and the model's")
        for i, spec in enumerate(specs.inputs):
            info = meta.input_tensor_meta(i)
            dtype = _DTYPES.get(int(info.dtype()), f"scalar type {info.dtype()}")
            if dtype != spec.dtype or len(info.sizes()) != len(spec.shape):
                raise ArtifactError(
                    f"{path}: input {i} is {dtype} of rank {len(info.sizes())} in the program but "
                    f"{spec.dtype} of rank {len(spec.shape)} in the specs"
                )

    def method_for(self, width: int | None, one_row_per_session: bool = False) -> str:
        """A ``.pte`` holds one method (``forward``), which serves every width."""
        return STEP_METHOD

    @property
    def general_min_width(self) -> int:
        """ExecuTorch runs the method at any width of the range its program records."""
        return 1

    def run(
        self, flat_inputs: Sequence[torch.Tensor], width: int | None = None, one_row_per_session: bool = False,
    ) -> list[torch.Tensor]:
        """Run ``forward`` on model inputs followed by storage; write the updated storage back into
        the storage tensors given and return the model's outputs."""
        outputs = self.method.execute(list(flat_inputs))  # type: ignore[attr-defined]
        storage = flat_inputs[len(flat_inputs) - self.n_storage :]
        for tensor, updated in zip(storage, outputs[: self.n_storage]):
            tensor.copy_(updated)
        return list(outputs[self.n_storage :])

    def new_session(self, **kwargs) -> "Session":  # noqa: F821
        from offgraph_export.runtime.session import Session

        return Session(self, **kwargs)
