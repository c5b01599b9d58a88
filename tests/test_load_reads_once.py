"""Loading reads a package once (issue 27): the checks before torch's loader verify the checksum of
every member but the weight files, and the weight reader verifies each weight file over the very
bytes it loads. Reads are counted through real files, each read as the reader asked for it."""

from __future__ import annotations

import io
import re

import pytest

from offgraph_export.errors import ArtifactError
from offgraph_export.runtime import Artifact
from offgraph_export.runtime import weights as weights_module
from offgraph_export.specs import archive as archive_module
from offgraph_export.specs.archive import check_archive, check_layout, is_weight_member
from tests.test_hostile_archives import flip_byte_in, root_of


class _CountingFile(io.FileIO):
    """A real file, unbuffered, that records ``(offset, bytes)`` of every read made of it: what is
    recorded is exactly what its reader asked for (no read-ahead of a buffer)."""

    def __init__(self, name, log: list[tuple[int, int]]) -> None:
        super().__init__(name, "r")
        self._log = log

    def read(self, size=-1):
        at = self.tell()
        data = super().read(size)
        self._log.append((at, len(data)))
        return data

    def readinto(self, buffer):
        at = self.tell()
        n = super().readinto(buffer)
        self._log.append((at, n or 0))
        return n


def _counted(monkeypatch, module) -> list[tuple[int, int]]:
    """The reads of every file ``module`` opens from now on (its ``open``, not the builtin), and
    its positional reads (``_pread``, where it has one: the weight reader's threads)."""
    log: list[tuple[int, int]] = []
    monkeypatch.setattr(module, "open", lambda name, mode="rb", *a, **k: _CountingFile(name, log), raising=False)
    if hasattr(module, "_pread"):
        pread = module._pread

        def counted_pread(fd, size, offset):
            data = pread(fd, size, offset)
            log.append((offset, len(data)))
            return data

        monkeypatch.setattr(module, "_pread", counted_pread)
    return log


def _within(log: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """Bytes of ``[lo, hi)`` the reads in ``log`` took: in all (a byte read twice counts twice),
    and distinct ones."""
    spans = sorted((max(at, lo), min(at + n, hi)) for at, n in log if at < hi and at + n > lo)
    total = sum(b - a for a, b in spans)
    distinct, reach = 0, lo
    for a, b in spans:
        distinct += max(0, b - max(a, reach))
        reach = max(reach, b)
    return total, distinct


def test_each_weight_byte_is_read_once_and_by_the_weight_reader_only(example_artifact, monkeypatch):
    with open(example_artifact, "rb") as file:
        members = check_layout(file, str(example_artifact))
    weights = [m for m in members if is_weight_member(m.name)]
    assert weights and len(weights) < len(members)
    checks, reader = _counted(monkeypatch, archive_module), _counted(monkeypatch, weights_module)
    loaded = Artifact.load(example_artifact)
    assert loaded.load_s > 0 and list(loaded.load_seconds)[0] == "archive"
    for m in members:
        data = (m.data_offset, m.data_offset + m.compressed_size)
        if is_weight_member(m.name):
            assert _within(checks, *data) == (0, 0), m.name  # not one byte of it before the loader
            assert _within(reader, *data) == (m.compressed_size, m.compressed_size), m.name  # every byte, once
        else:
            assert _within(checks, *data)[1] == m.compressed_size, m.name  # checksummed up front


def test_a_flipped_byte_in_a_weight_is_refused_by_the_read_that_loads_it(example_artifact, tmp_path):
    """The checks before the loader pass it (they no longer read weights); the weight reader,
    checksumming what it reads, refuses the load in one line naming the member and both CRCs."""
    entry = root_of(example_artifact) + "data/weights/weight_1"
    path = flip_byte_in(example_artifact, tmp_path / "flipped.pt2", "/weight_1")
    check_archive(path, defer_weights=True)
    message = (rf"^{re.escape(str(path))}: archive entry {re.escape(repr(entry))} is corrupt: its data's "
               r"CRC-32 is 0x[0-9a-f]{8}, the directory records 0x[0-9a-f]{8}$")
    with pytest.raises(ArtifactError, match=message):
        check_archive(path)  # a full check still reads it
    with pytest.raises(ArtifactError, match=message):
        Artifact.load(path)


def test_once_a_weight_file_fails_no_further_file_is_started(example_artifact, monkeypatch):
    """Two readers: the first file is slow, the second fails; the third waits for a free reader and
    is then not started, and the load raises the failure."""
    import time

    started: list[str] = []
    read = weights_module._read_tensor_file

    def slow_then_failing(reader, member, bound, source):
        started.append(member.name)
        if len(started) == 1:
            time.sleep(0.5)
        elif len(started) == 2:
            raise ArtifactError(f"{source}: {member.name}: refused here")
        return read(reader, member, bound, source)

    monkeypatch.setattr(weights_module, "_read_tensor_file", slow_then_failing)
    monkeypatch.setattr(weights_module, "LOAD_WORKERS", 2)
    monkeypatch.setattr(weights_module.os, "cpu_count", lambda: 2)
    with pytest.raises(ArtifactError, match="refused here"):
        Artifact.load(example_artifact)
    with open(example_artifact, "rb") as file:
        assert sum(is_weight_member(m.name) for m in check_layout(file, str(example_artifact))) > 3
    assert len(started) == 2
