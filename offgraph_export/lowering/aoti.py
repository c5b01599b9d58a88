"""Lower a stripped program through AOTInductor to a ``.pt2`` package with the specs embedded.

The specs go in twice: as AOTI metadata (``loader.get_metadata()`` returns them next to the code
they describe) and as a JSON entry of the archive (readable with ``zipfile``, without loading the
compiled code). The package is built under a temporary name and moved into place only when
complete, so a failed compile never leaves a half-written artifact at the requested path.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from torch.export import ExportedProgram

from offgraph_export.errors import ExportError
from offgraph_export.specs.artifact import PROGRAM_KEY, ArtifactSpecs, write_artifact_specs
from offgraph_export.specs.manifest import MANIFEST_KEY
from offgraph_export.specs.step_width import STEP_WIDTH_KEY

__all__ = ["compile_package", "aoti_metadata"]


def aoti_metadata(specs: ArtifactSpecs) -> dict[str, str]:
    return {
        STEP_WIDTH_KEY: specs.step_width.format(),
        MANIFEST_KEY: specs.manifest.to_json(),
        PROGRAM_KEY: specs.program_description(),
    }


def compile_package(ep: ExportedProgram, path: str | os.PathLike, specs: ArtifactSpecs) -> Path:
    """AOT-compile ``ep`` for ``specs.device`` into ``path`` (a ``.pt2``)."""
    from torch._inductor import aoti_compile_and_package

    target = Path(path)
    if target.suffix != ".pt2":
        raise ExportError(f"artifact path {str(target)!r} must end in .pt2")
    target.parent.mkdir(parents=True, exist_ok=True)
    # The archive's root folder is named after the file stem, so keep the stem.
    tmp_dir = Path(tempfile.mkdtemp(prefix=".offgraph-", dir=target.parent))
    tmp = tmp_dir / target.name
    try:
        try:
            aoti_compile_and_package(
                ep,
                package_path=str(tmp),
                inductor_configs={"aot_inductor.metadata": aoti_metadata(specs)},
            )
        except Exception as exc:  # inductor raises many types; keep the cause chained
            raise ExportError(f"AOTInductor compile for {specs.device} failed: {exc}") from exc
        write_artifact_specs(tmp, specs)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
        tmp_dir.rmdir()
    return target
