"""``lowering/output_files.py``: a failed export leaves no staging folder and no parent folders it
created; a multi-file artifact is published all or none (a target replaced before a later move
failed has its old bytes back)."""

from __future__ import annotations

import re

import pytest

from offgraph_export.errors import ExportError
from offgraph_export.lowering.output_files import publish, staging


def test_a_failure_removes_the_staging_folder_and_the_parents_it_created(tmp_path):
    target = tmp_path / "a" / "b" / "model.pt2"
    with pytest.raises(RuntimeError, match="compile failed"):
        with staging(target) as tmp_dir:
            assert tmp_dir.parent == target.parent and tmp_dir.is_dir()
            (tmp_dir / "partial.so").write_bytes(b"x")
            raise RuntimeError("compile failed")
    assert list(tmp_path.iterdir()) == []


def test_a_failure_keeps_folders_that_existed_or_gained_other_files(tmp_path):
    (tmp_path / "a").mkdir()
    target = tmp_path / "a" / "b" / "c" / "model.pt2"
    with pytest.raises(RuntimeError):
        with staging(target):
            (tmp_path / "a" / "b" / "other.txt").write_text("not ours")
            raise RuntimeError("boom")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/b", "a/b/other.txt"]


def test_success_publishes_and_keeps_the_parents(tmp_path):
    target = tmp_path / "new" / "model.pt2"
    with staging(target) as tmp_dir:
        (tmp_dir / "model.pt2").write_bytes(b"program")
        publish([(tmp_dir / "model.pt2", target)], tmp_dir)
    assert target.read_bytes() == b"program"
    assert [p.name for p in target.parent.iterdir()] == ["model.pt2"]  # no staging folder left


def test_publish_is_all_or_none(tmp_path):
    """The data file moves first; the program's move fails (its staged file is gone): the old data
    file is back, the old program untouched, and nothing new is left beside them."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.ptd").write_bytes(b"old data")
    (out / "model.pte").write_bytes(b"old program")
    with pytest.raises(FileNotFoundError):
        with staging(out / "model.pte") as tmp_dir:
            (tmp_dir / "model.ptd").write_bytes(b"new data")
            publish([(tmp_dir / "model.ptd", out / "model.ptd"), (tmp_dir / "model.pte", out / "model.pte")], tmp_dir)
    assert (out / "model.ptd").read_bytes() == b"old data"
    assert (out / "model.pte").read_bytes() == b"old program"
    assert sorted(p.name for p in out.iterdir()) == ["model.ptd", "model.pte"]


def test_publish_removes_a_new_file_that_had_no_predecessor(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError):
        with staging(out / "model.pte") as tmp_dir:
            (tmp_dir / "d").write_bytes(b"new data")
            publish([(tmp_dir / "d", out / "model.ptd"), (tmp_dir / "p", out / "model.pte")], tmp_dir)
    assert not out.exists()  # the file put there taken back, then the folder created for it


def test_a_directory_at_a_target_is_refused_and_kept(tmp_path):
    """A folder where the .ptd (or .pte) goes was moved aside into the staging folder and removed
    with it, contents and all."""
    out = tmp_path / "out"
    (out / "model.ptd").mkdir(parents=True)
    (out / "model.ptd" / "notes.txt").write_text("important")
    with pytest.raises(ExportError, match="model.ptd' : it is a directory|model.ptd': it is a directory"):
        with staging(out / "model.pte") as tmp_dir:
            (tmp_dir / "d").write_bytes(b"data")
            (tmp_dir / "p").write_bytes(b"program")
            publish([(tmp_dir / "d", out / "model.ptd"), (tmp_dir / "p", out / "model.pte")], tmp_dir)
    assert (out / "model.ptd" / "notes.txt").read_text() == "important"
    assert sorted(p.name for p in out.iterdir()) == ["model.ptd"]


@pytest.mark.parametrize("name", ["..pt2", "a\\b.pt2"])
def test_compile_package_refuses_a_file_name_its_loader_would_refuse_before_compiling(tmp_path, name):
    """torch names the archive's root folder after the stem: ``..pt2`` gives entries ``./...``,
    which loading refuses, so the export would compile for minutes and write a package no one can
    load. Refused first (nothing compiled: the programs and specs are not even looked at)."""
    from offgraph_export.lowering.aoti import compile_package

    with pytest.raises(ExportError, match=re.escape(f"artifact file name {name!r} cannot name the package's folder")):
        compile_package({}, tmp_path / name, specs=None)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
