"""Writing an artifact's files so that a failed export leaves nothing behind.

Both output formats build their files in a staging folder beside the target (same file system, so
the final moves are renames) and publish them at the end. A failure anywhere removes the staging
folder and the parent folders the export created for ``-o``; a format of several files (a ``.pte``
and its ``.ptd``) is published all or none: a target replaced before a later move failed gets its
old file back, so a reader never finds a new data file beside an old program.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from offgraph_export.errors import ExportError

__all__ = ["staging", "publish"]


def _missing_parents(target: Path) -> list[Path]:
    """The folders above ``target`` that do not exist yet, deepest first."""
    missing = []
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return missing


@contextmanager
def staging(target: Path) -> Iterator[Path]:
    """A fresh folder beside ``target`` (its missing parents created) to build the files in;
    removed on exit. When the block raises, the parents created for it are removed too (each only
    if still empty)."""
    created = _missing_parents(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=".offgraph-", dir=target.parent))
    done = False
    try:
        yield tmp_dir
        done = True
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not done:
            for folder in created:
                try:
                    folder.rmdir()
                except OSError:  # something else was put there meanwhile: leave it
                    break


def publish(moves: Sequence[tuple[Path, Path]], backup_dir: Path) -> None:
    """Move each staged file onto its target, in order, all or none: a target that existed is
    first moved into ``backup_dir`` (the staging folder), and when a later move fails every
    target already moved is put back as it was before the error propagates. A target that is a
    directory is refused before anything moves (:class:`ExportError`)."""
    for _, target in moves:  # a folder there would be moved aside and removed with the staging
        if os.path.isdir(target) and not os.path.islink(target):
            raise ExportError(f"cannot write {str(target)!r}: it is a directory")
    done: list[tuple[Path, Path | None]] = []
    try:
        for i, (source, target) in enumerate(moves):
            backup = None
            if os.path.lexists(target):
                backup = backup_dir / f".previous-{i}"
                os.replace(target, backup)
            done.append((target, backup))
            os.replace(source, target)
    except BaseException:
        for target, backup in reversed(done):
            if backup is not None:
                os.replace(backup, target)
            elif os.path.lexists(target):
                os.unlink(target)
        raise
