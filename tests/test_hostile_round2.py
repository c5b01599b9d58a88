"""Hostile archives, round 2 (issue 25): what torch's loader reads is what was checked, and no read
is unbounded.

The checks read a ``.pt2`` with Python's ``zipfile``, the loader with torch's own zip reader
(miniz); each archive here is laid out so that they could read it differently (a second central
directory behind a zip64 locator, bytes before, between or after the entries, records that disagree
with their local headers), or costs far more to read than it stores (a deflate bomb, 300,000
records, a weight file far larger than its views). Each is refused with one line naming the entry
or value, before torch's loader or ``torch.load`` sees it, within a second and a few MiB, with
nothing written outside a temp folder and no command the archive names run. A real package, and
the forms torch's writer and Python's ``zipfile`` write, pass the same checks (no false refusal).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import struct
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from offgraph_export.errors import ArtifactError
from offgraph_export.runtime import Artifact
from offgraph_export.specs import archive as archive_checks
from offgraph_export.specs.archive import ALIGNMENT, check_archive, check_layout
from offgraph_export.specs.artifact import SPECS_ENTRY, read_artifact_specs
from offgraph_export.specs.limits import (
    MAX_ARCHIVE_MEMBERS,
    MAX_COMPRESSION_RATIO,
    MAX_MEMBER_BYTES,
    MAX_TENSOR_FILE_OVERHEAD,
)
from tests.archive_tools import rewrite
from tests.conftest import EXAMPLE, cli
from tests.test_hostile_archives import MARK, _written_outside, root_of

# -- a zip writer that writes what it is told (zipfile would correct the layout) ------------------

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_END = struct.Struct("<4sHHHHIIH")
_REGULAR = 0o100644 << 16


class Member:
    """One entry as it is to be written: ``data`` as stored, ``size`` and ``crc`` as declared."""

    def __init__(self, name: str, data: bytes, size: int | None = None, crc: int | None = None, method: int = 0):
        self.name, self.data, self.method = name.encode(), data, method
        self.size = len(data) if size is None else size
        self.crc = zlib.crc32(data) if crc is None else crc

    def local(self, extra: bytes = b"") -> bytes:
        header = _LOCAL.pack(b"PK\x03\x04", 20, 0, self.method, 0, 0x21, self.crc, len(self.data), self.size,
                             len(self.name), len(extra))
        return header + self.name + extra + self.data

    def central(self, offset: int, name: bytes | None = None, extra: bytes = b"") -> bytes:
        name = self.name if name is None else name
        return _CENTRAL.pack(b"PK\x01\x02", 20, 20, 0, self.method, 0, 0x21, self.crc, len(self.data), self.size,
                             len(name), len(extra), 0, 0, 0, _REGULAR, offset) + name + extra


def members_of(path: Path | io.BytesIO) -> list[Member]:
    """Each member's name and bytes (the checksums recomputed when written again). A weight
    file's own records carry no CRC-32 (``lowering/aoti.py``), so none is compared here."""
    members = []
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            info.CRC = None  # zipfile then skips its check
            members.append(Member(info.filename, z.read(info)))
    return members


def end_record(count: int, size: int, offset: int, comment: bytes = b"") -> bytes:
    return _END.pack(b"PK\x05\x06", 0, 0, count, count, size, offset, len(comment)) + comment


def write_zip(path: Path, members: list[Member], prefix: bytes = b"", gap_after: int | None = None,
              gap: bytes = b"", extra_records=(), count: int | None = None) -> Path:
    """``members`` back to back after ``prefix`` (offsets counted from the file's start, as a
    self-extractor's are), ``gap`` after member ``gap_after``, then the directory (plus raw
    ``extra_records``) and an end record counting ``count`` records."""
    body, offsets = bytearray(prefix), []
    for index, member in enumerate(members):
        offsets.append(len(body))
        body += member.local()
        if index == gap_after:
            body += gap
    directory = b"".join(m.central(o) for m, o in zip(members, offsets)) + b"".join(extra_records)
    total = len(members) + len(extra_records) if count is None else count
    if total <= 0xFFFF:
        path.write_bytes(bytes(body) + directory + end_record(total, len(directory), len(body)))
        return path
    # zip64 end records, as zipfile writes them for more than 65,535 entries
    record = len(body) + len(directory)
    end64 = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, total, total, len(directory), len(body))
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, record, 1)
    path.write_bytes(bytes(body) + directory + end64 + locator + end_record(0xFFFF, len(directory), len(body)))
    return path


def zeros_deflated(n: int) -> bytes:
    """A raw deflate stream of ``n`` zero bytes (a multiple of 1 MiB) without inflating or deflating
    them all: one 1 MiB block, fully flushed so it stands alone, repeated, then an empty last block."""
    unit = 1 << 20
    assert n % unit == 0
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = deflate.compress(b"\0" * unit) + deflate.flush(zlib.Z_FULL_FLUSH)
    return block * (n // unit) + zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS).flush()


def refused(call, message: str, seconds: float = 1.0, mebibytes: int = 64) -> str:
    """``call()`` raises a one-line ArtifactError matching ``message`` within ``seconds`` and
    ``mebibytes`` of Python allocations."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ArtifactError, match=message) as info:
            call()
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    text = str(info.value)
    assert "\n" not in text, text
    assert elapsed < seconds, f"refused after {elapsed:.2f}s: {text}"
    assert peak < mebibytes << 20, f"refusing took {peak >> 20} MiB: {text}"
    return text


# -- the checked archive is the loaded archive ---------------------------------------------------


def _hidden_names(good: Path, tmp: Path) -> list[tuple[str, bytes]]:
    """What an attacker shows the loader alone: a file its extractor writes outside its folder,
    and a build-flags file whose command it runs through a shell when a method has no library."""
    method = root_of(good) + "data/aotinductor/model/"
    flags = json.dumps({"compiler": f"touch {tmp / MARK}_ran; g++", "compile_only": True})
    return [(method + f"../../../../../../{MARK}.txt", b"escaped"),
            (method + "hidden_compile_flags.json", flags.encode())]


def _second_directory(good, tmp):
    """A zip64 locator naming a second end record (miniz follows the locator's offset) while the
    record right before the locator names the real directory (where zipfile looks): the loader
    sees the hidden entries, every check the real ones."""
    members = members_of(good)
    hidden = [Member(name, data) for name, data in _hidden_names(good, tmp)]
    body, offsets = bytearray(), []
    for member in members + hidden:
        offsets.append(len(body))
        body += member.local()
    real = b"".join(m.central(o) for m, o in zip(members, offsets))
    both = real + b"".join(m.central(o) for m, o in zip(hidden, offsets[len(members):]))

    def end64(count, size, offset):
        return struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, offset)

    loader_directory = len(body)
    loader_record = loader_directory + len(both)
    checked_directory = loader_record + 56
    tail = (both + end64(len(members) + len(hidden), len(both), loader_directory) + real
            + end64(len(members), len(real), checked_directory))
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, loader_record, 1)
    path = tmp / "second_directory.pt2"
    path.write_bytes(bytes(body) + tail + locator + _END.pack(b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                                                                0xFFFFFFFF, 0))
    return path


def _appended_archive(good, tmp):
    """A whole second archive after the package: both readers now take its end record."""
    hidden = tmp / "hidden.zip"
    with zipfile.ZipFile(hidden, "w") as z:
        for name, data in _hidden_names(good, tmp):
            z.writestr(name, data)
    path = tmp / "appended.pt2"
    path.write_bytes(good.read_bytes() + hidden.read_bytes())
    return path


def _appended_bytes(good, tmp):
    path = tmp / "trailing.pt2"
    path.write_bytes(good.read_bytes() + b"PK\x03\x04 not part of the package")
    return path


def _archive_comment(good, tmp):
    data = bytearray(good.read_bytes())
    data[-2:] = struct.pack("<H", 12)
    path = tmp / "comment.pt2"
    path.write_bytes(bytes(data) + b"hello there!")
    return path


def _prepended_archive(good, tmp):
    """An archive before the package, its offsets left as they were: zipfile shifts every offset by
    the prefix's length, miniz reads them as written."""
    hidden = tmp / "hidden.zip"
    with zipfile.ZipFile(hidden, "w") as z:
        for name, data in _hidden_names(good, tmp):
            z.writestr(name, data)
    path = tmp / "prepended.pt2"
    path.write_bytes(hidden.read_bytes() + good.read_bytes())
    return path


def _self_extractor(good, tmp):
    """Bytes before the first entry, every offset counting them (a self-extracting archive)."""
    return write_zip(tmp / "prefixed.pt2", members_of(good), prefix=b"#!/bin/sh\necho hi\n")


def _gap(good, tmp):
    """A local entry no directory record names, between two that are (only a reader that scans the
    local headers sees it)."""
    hidden = Member(*_hidden_names(good, tmp)[0]).local()
    return write_zip(tmp / "gap.pt2", members_of(good), gap_after=2, gap=hidden)


def _overlap(good, tmp):
    """A second directory record naming the local entry of the library under a name of its own: two
    members, one set of bytes."""
    members = members_of(good)
    offsets, at = [], 0
    for member in members:
        offsets.append(at)
        at += len(member.local())
    library = next(i for i, m in enumerate(members) if m.name.endswith(b".so"))
    alias = members[library].central(offsets[library], name=root_of(good).encode() + b"data/weights/weight_99")
    return write_zip(tmp / "overlap.pt2", members, extra_records=[alias])


def _uncounted_record(good, tmp):
    """The end record counts one record fewer than the directory holds: zipfile reads the
    directory's bytes to the end, miniz stops at the count."""
    return write_zip(tmp / "uncounted.pt2", members_of(good), count=len(members_of(good)) - 1)


def _patch_local(good, tmp, name_suffix: str, patch, dst: str) -> Path:
    """``good`` rewritten by zipfile, then ``patch(data, offset)`` applied at the local header of the
    entry whose name ends in ``name_suffix``."""
    plain = rewrite(good, tmp / "plain.pt2")
    data = bytearray(plain.read_bytes())
    with zipfile.ZipFile(plain) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(name_suffix))
    patch(data, info.header_offset)
    (tmp / dst).write_bytes(bytes(data))
    return tmp / dst


def _local_name_differs(good, tmp):
    """The specs entry's local header names another file: miniz extracts by the directory's name
    and never compares."""
    def patch(data, at):
        data[at + 30 + len(root_of(good)) : at + 30 + len(root_of(good)) + 5] = b"EXTRA"

    return _patch_local(good, tmp, SPECS_ENTRY, patch, "local_name.pt2")


def _local_size_differs(good, tmp):
    def patch(data, at):
        data[at + 22 : at + 26] = struct.pack("<I", 7)

    return _patch_local(good, tmp, SPECS_ENTRY, patch, "local_size.pt2")


def _unknown_extra_field(good, tmp):
    """An extended-timestamp field (0x5455) in every directory record: extra data neither writer puts
    there."""
    members = members_of(good)
    offsets, at = [], 0
    for member in members:
        offsets.append(at)
        at += len(member.local())
    stamp = struct.pack("<HHBI", 0x5455, 5, 1, 0)
    directory = b"".join(m.central(o, extra=stamp) for m, o in zip(members, offsets))
    path = tmp / "extra_field.pt2"
    path.write_bytes(b"".join(m.local() for m in members) + directory + end_record(len(members), len(directory), at))
    return path


def _misaligned_padding(good, tmp):
    """torch's padding field on the first entry, three bytes long: its data no longer starts at a
    multiple of 64, as torch's writer starts it."""
    members = members_of(good)
    padding = struct.pack("<HH", 0x4246, 3) + b"ZZZ"
    first = members[0].local(extra=padding)
    rest = b"".join(m.local() for m in members[1:])
    offsets, at = [0], len(first)
    for member in members[1:]:
        offsets.append(at)
        at += len(member.local())
    directory = b"".join(m.central(o) for m, o in zip(members, offsets))
    path = tmp / "padding.pt2"
    path.write_bytes(first + rest + directory + end_record(len(members), len(directory), at))
    return path


LAYOUTS = [
    pytest.param(_second_directory, r"its zip64 locator names a zip64 end record at offset \d+ \(disk 0 of 1\); the "
                 r"record lies right before the locator, at \d+", id="second-directory-behind-zip64-locator"),
    pytest.param(_appended_archive, r"its central directory \(offset \d+, \d+ bytes\) does not end where its end "
                 r"records begin", id="appended-archive"),
    pytest.param(_appended_bytes, r"is not a readable .pt2 archive: 28 bytes \(an archive comment or appended data\) "
                 r"follow its last zip end record, at offset \d+", id="appended-bytes"),
    pytest.param(_archive_comment, r"12 bytes \(an archive comment or appended data\) follow its last zip end record",
                 id="archive-comment"),
    pytest.param(_prepended_archive, r"its central directory \(offset \d+, \d+ bytes\) does not end where its end "
                 r"records begin \(offset \d+\)", id="prepended-archive"),
    pytest.param(_self_extractor, r"archive entry '[^']+' starts at offset 18, where the file begins at 0",
                 id="bytes-before-the-first-entry"),
    pytest.param(_gap, r"archive entry '[^']+' starts at offset \d+, where the previous entry ends at \d+",
                 id="unlisted-entry-between-entries"),
    pytest.param(_overlap, r"archive entry '[^']+/weight_99' starts at offset \d+, where the previous entry ends",
                 id="two-records-one-entry"),
    pytest.param(_uncounted_record, r"its central directory holds \d+ bytes after its \d+ records",
                 id="record-beyond-the-count"),
    pytest.param(_local_name_differs, r"offgraph_specs.json' is named '[^']*EXTRA[^']*' by its local header",
                 id="local-header-names-another-file"),
    pytest.param(_local_size_differs, r"offgraph_specs.json' has CRC \d+ and sizes \d+ and 7 in its local header",
                 id="local-header-sizes-differ"),
    pytest.param(_unknown_extra_field,
                 r"archive entry '[^']+' has an extra field 0x5455 in its directory record; expected only a zip64 field",
                 id="unknown-extra-field"),
    pytest.param(_misaligned_padding, r"has 3 bytes of alignment padding starting its data at offset \d+",
                 id="misaligned-torch-padding"),
]


@pytest.mark.parametrize(("make", "message"), LAYOUTS)
def test_an_archive_not_in_the_one_layout_is_refused_before_the_loader(make, message, example_artifact, tmp_path):
    path = make(example_artifact, tmp_path)
    text = refused(lambda: check_archive(path, verify_crc=False), message)
    assert text.startswith(str(path))
    refused(lambda: read_artifact_specs(path), message)  # inspect's path: no checksums read
    with pytest.raises(ArtifactError, match=message):
        Artifact.load(path)
    assert not _written_outside(tmp_path)
    assert not (tmp_path / f"{MARK}_ran").exists()


def test_the_second_directory_is_one_only_the_loader_reads(example_artifact, tmp_path):
    """The premise of the case above: torch's reader lists the hidden entries, zipfile does not (so
    no check that reads the archive with zipfile alone could see them)."""
    path = _second_directory(example_artifact, tmp_path)
    hidden = {name[len(root_of(example_artifact)):] for name, _ in _hidden_names(example_artifact, tmp_path)}
    with zipfile.ZipFile(path) as z:
        assert not hidden & {n[len(root_of(example_artifact)):] for n in z.namelist()}
    assert hidden <= set(torch._C.PyTorchFileReader(str(path)).get_all_records())


@pytest.mark.parametrize("make", [_second_directory, _overlap], ids=["second-directory", "overlap"])
def test_cli_refuses_a_non_canonical_archive_in_one_line(make, example_artifact, tmp_path):
    path = make(example_artifact, tmp_path)
    for command in (["check", str(path), "--model", EXAMPLE, "--steps", "1"], ["inspect", str(path)]):
        proc = cli(*command, check=False)
        assert proc.returncode == 2, proc.stdout
        assert "Traceback" not in proc.stderr and proc.stderr.splitlines()[-1].startswith("error: ")
    assert not _written_outside(tmp_path) and not (tmp_path / f"{MARK}_ran").exists()


# -- no false refusal ----------------------------------------------------------------------------


def test_a_real_package_is_in_the_one_layout(example_artifact):
    """torch's entries (data descriptor, "FB" padding to 64 bytes) and the specs entry appended by
    zipfile, back to back up to the directory."""
    with open(example_artifact, "rb") as f:
        members = check_layout(f, str(example_artifact))
    with zipfile.ZipFile(example_artifact) as z:
        assert [m.name for m in members] == z.namelist()
    torch_written = [m for m in members if not m.name.endswith(SPECS_ENTRY)]
    assert all(m.data_offset % ALIGNMENT == 0 and m.method == zipfile.ZIP_STORED for m in torch_written)
    assert check_archive(example_artifact)  # and every checksum


def test_the_forms_torch_and_zipfile_write_are_in_the_one_layout(example_artifact, tmp_path):
    """A package rewritten by zipfile; a tensor file as torch.save writes it (zip64 end records);
    zipfile's zip64 local field and deflated members; an archive from torch's writer alone."""
    plain = rewrite(example_artifact, tmp_path / "plain.pt2")
    assert len(check_archive(plain)) == len(members_of(example_artifact))
    buffer = io.BytesIO()
    torch.save(torch.zeros(3, 5), buffer)
    assert [m.name for m in check_layout(buffer, "tensor", "tensor file")][0] == "archive/data.pkl"
    forced = tmp_path / "zip64.zip"
    with zipfile.ZipFile(forced, "w") as z:
        with z.open("pkg/a", "w", force_zip64=True) as out:
            out.write(b"x" * 1000)
        z.writestr("pkg/b", _text(10_000), compress_type=zipfile.ZIP_DEFLATED)
    with open(forced, "rb") as f:
        assert [m.size for m in check_layout(f, str(forced))] == [1000, 10_000]
    writer = torch._C.PyTorchFileWriter(str(tmp_path / "written.pt2"))
    writer.write_record("archive_format", b"pt2", 3)
    writer.write_record("data/weights/weight_0", bytes(1000), 1000)
    writer.write_end_of_file()
    del writer
    assert [i.filename for i in check_archive(tmp_path / "written.pt2")][:2] == [
        "written/archive_format", "written/data/weights/weight_0"]


# -- bounded reads ---------------------------------------------------------------------------------

GIB = 1 << 30


def _text(n: int) -> bytes:
    """``n`` bytes of hex text: deflates about 2:1, as code and JSON do (a repeated word would reach
    hundreds to one)."""
    return random.Random(0).randbytes(n // 2).hex().encode()


def _with_member(good, tmp, member: Member, name: str) -> Path:
    return write_zip(tmp / name, members_of(good) + [member])


def test_a_deflate_bomb_is_refused_from_its_sizes_without_inflating(example_artifact, tmp_path):
    """3 GiB of zeros in 3 MiB: refused from the ratio its record declares."""
    stream = zeros_deflated(3 * GIB)
    assert len(stream) < 4 << 20
    name = root_of(example_artifact) + "data/weights/weight_99"
    path = _with_member(example_artifact, tmp_path, Member(name, stream, size=3 * GIB, crc=0, method=8), "bomb.pt2")
    message = (rf"archive entry '{name}' declares {3 * GIB} bytes from {len(stream)} compressed "
               rf"\(\d+:1\); a member inflates at most {MAX_COMPRESSION_RATIO}:1")
    refused(lambda: check_archive(path), message)
    refused(lambda: Artifact.load(path), message)
    assert not _written_outside(tmp_path)


def test_a_member_that_inflates_past_its_declared_size_stops_there(example_artifact, tmp_path):
    """The same 3 MiB stream declaring 1 MiB (a ratio the limit admits): verifying inflates one chunk
    past the declared size, not 3 GiB."""
    stream = zeros_deflated(3 * GIB)
    name = root_of(example_artifact) + "data/weights/weight_99"
    path = _with_member(example_artifact, tmp_path, Member(name, stream, size=1 << 20, crc=0, method=8), "liar.pt2")
    message = rf"archive entry '{name}' inflates past its declared {1 << 20} bytes"
    refused(lambda: check_archive(path), message)
    refused(lambda: Artifact.load(path), message)


def test_a_deflated_member_with_a_bad_checksum_is_refused(example_artifact, tmp_path):
    data = _text(90_000)
    name = root_of(example_artifact) + "data/weights/weight_99"
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    member = Member(name, deflate.compress(data) + deflate.flush(), len(data), zlib.crc32(data) ^ 1, method=8)
    path = _with_member(example_artifact, tmp_path, member, "crc.pt2")
    check_archive(path, verify_crc=False)  # its layout is fine
    refused(lambda: check_archive(path), rf"'{name}' is corrupt: its data's CRC-32 is 0x[0-9a-f]{{8}}")


def test_300000_records_are_refused_from_the_end_record(example_artifact, tmp_path):
    """300,000 records naming one local entry: refused by count before zipfile (or torch's reader)
    parses any of them."""
    members, root = members_of(example_artifact), root_of(example_artifact).encode()
    records = [members[0].central(0, name=root + b"data/weights/weight_%d" % i) for i in range(300_000)]
    path = write_zip(tmp_path / "many.pt2", members, extra_records=records)
    message = rf"the archive holds 300\d\d\d entries; a package holds at most {MAX_ARCHIVE_MEMBERS}"
    refused(lambda: check_archive(path), message)
    refused(lambda: read_artifact_specs(path), message)
    proc = cli("check", str(path), "--model", EXAMPLE, "--steps", "1", check=False)
    assert proc.returncode == 2 and re.search(message, proc.stderr.splitlines()[-1]), proc.stderr


def test_a_member_larger_than_any_package_holds_is_refused_unread(tmp_path):
    """A stored member declaring more than MAX_MEMBER_BYTES, in zipfile's zip64 form (a sparse file:
    its data is never written, nor read)."""
    size = MAX_MEMBER_BYTES + 1
    name = b"pkg/data/weights/weight_0"
    zip64 = struct.pack("<HHQQ", 1, 16, size, size)
    local = _LOCAL.pack(b"PK\x03\x04", 45, 0, 0, 0, 0x21, 0, 0xFFFFFFFF, 0xFFFFFFFF, len(name), len(zip64))
    central_offset = len(local) + len(name) + len(zip64) + size
    central = _CENTRAL.pack(b"PK\x01\x02", 45, 45, 0, 0, 0, 0x21, 0, 0xFFFFFFFF, 0xFFFFFFFF, len(name), len(zip64),
                            0, 0, 0, _REGULAR, 0) + name + zip64
    end64 = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, 1, 1, len(central), central_offset)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, central_offset + len(central), 1)
    path = tmp_path / "sparse.pt2"
    with open(path, "wb") as f:
        f.write(local + name + zip64)
        f.seek(central_offset)
        f.write(central + end64 + locator + end_record(1, len(central), 0xFFFFFFFF))
    if path.stat().st_blocks * 512 > 64 << 20:
        pytest.skip("this file system does not keep sparse files sparse")
    with open(path, "rb") as f:
        refused(lambda: check_layout(f, str(path)),
                rf"'pkg/data/weights/weight_0' declares {size} bytes; a member of a package holds at most "
                rf"{MAX_MEMBER_BYTES}")


def test_what_all_members_declare_is_bounded(example_artifact, monkeypatch):
    total = sum(i.file_size for i in zipfile.ZipFile(example_artifact).infolist())
    monkeypatch.setattr(archive_checks, "MAX_ARCHIVE_BYTES", total - 1)
    refused(lambda: check_archive(example_artifact, verify_crc=False),
            rf"brings what the members declare to {total} bytes; an archive holds at most {total - 1}")


def _smallest_weight(good: Path) -> tuple[str, int]:
    """The weight file whose views reach the fewest bytes (the example's are float32), and those bytes."""
    with zipfile.ZipFile(good) as z:
        config = json.loads(z.read(root_of(good) + "data/aotinductor/model/weights_config.json"))
    reach: dict[str, int] = {}
    for file, shape, stride, offset in config.values():
        extent = offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1
        reach[file] = max(reach.get(file, 0), 4 * extent)
    return min(reach.items(), key=lambda item: item[1])


@pytest.fixture
def spied_reads(monkeypatch):
    """Digests of the buffers torch.load is handed, and the names of the members the weight reader
    reads (``read_member``, which reads each once, checksum and all)."""
    from offgraph_export.runtime import weights as weights_module

    loads, reads = [], []
    real_load, real_read = torch.load, weights_module.read_member

    def load(f, *args, **kwargs):
        loads.append(hashlib.sha256(f.getbuffer()).hexdigest() if isinstance(f, io.BytesIO) else None)
        return real_load(f, *args, **kwargs)

    def read(file, member, source):
        reads.append(member.name)
        return real_read(file, member, source)

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(weights_module, "read_member", read)
    return loads, reads


def test_a_weight_file_larger_than_its_views_is_refused_before_it_is_read(example_artifact, tmp_path, spied_reads):
    """A 64-element norm weight stored as a 16 MB tensor file: refused from its declared size,
    against what its views take at the dtype the program was compiled for, before any weight file
    is read."""
    file, reach = _smallest_weight(example_artifact)
    buffer = io.BytesIO()
    torch.save(torch.zeros(4 << 20), buffer)
    entry = root_of(example_artifact) + "data/weights/" + file
    path = rewrite(example_artifact, tmp_path / "huge_weight.pt2", lambda n, d: buffer.getvalue() if n == entry else d)
    loads, reads = spied_reads
    loads.clear(), reads.clear()  # what building the archive read
    with pytest.raises(ArtifactError, match=(
        rf"{entry} is {len(buffer.getvalue())} bytes; the views the weights configs take from it reach {reach} "
        rf"bytes, so its file holds at most {reach + MAX_TENSOR_FILE_OVERHEAD}$"
    )):
        Artifact.load(path)
    assert not loads and not [n for n in reads if "/data/weights/" in n]


def test_a_tensor_file_that_would_inflate_is_refused_before_torch_reads_it(example_artifact, tmp_path, spied_reads):
    """The weight file is small, but its own storage record is deflated, declaring 32 MiB: torch's
    reader would allocate and inflate it; the same layout check refuses it before torch.load."""
    file, reach = _smallest_weight(example_artifact)
    entry = root_of(example_artifact) + "data/weights/" + file
    with zipfile.ZipFile(example_artifact) as z:
        records = members_of(io.BytesIO(z.read(entry)))
    bomb = zeros_deflated(32 << 20)
    inner = write_zip(tmp_path / "inner.zip", [
        Member(m.name.decode(), bomb, size=32 << 20, crc=0, method=8) if m.name.endswith(b"data/0") else m
        for m in records])
    assert inner.stat().st_size < reach + MAX_TENSOR_FILE_OVERHEAD  # passes the size check above
    path = rewrite(example_artifact, tmp_path / "inner_bomb.pt2", lambda n, d: inner.read_bytes() if n == entry else d)
    loads, _ = spied_reads
    with pytest.raises(ArtifactError, match=(
        rf"{entry}: archive entry '[^']*data/0' declares {32 << 20} bytes from \d+ compressed"
    )) as info:
        Artifact.load(path)
    assert "\n" not in str(info.value)
    assert hashlib.sha256(inner.read_bytes()).hexdigest() not in loads


# -- the file checked is the file loaded -----------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="pinning by descriptor needs /proc/self/fd (Linux)")
def test_a_file_renamed_over_the_package_after_its_checks_is_not_what_loads(example_artifact, tmp_path, monkeypatch):
    """Between the checks and torch's loader (and the weight reader) another file is renamed over
    the package's path: the loader still reads the file that was checked, through the descriptor
    opened first (``runtime/artifact.py:_pinned``), and the file now at the path is never opened.
    The swapped-in file is the package cut in half, which torch's loader (or the weight reader)
    would fail on, so reading it anywhere would show."""
    from offgraph_export.runtime import artifact as artifact_module

    path = tmp_path / "tiny.pt2"
    data = example_artifact.read_bytes()
    path.write_bytes(data)
    other = tmp_path / "other.pt2"
    other.write_bytes(data[: len(data) // 2])
    checked = artifact_module.check_pt2_layout
    swaps = []

    def check_then_swap(*args, **kwargs):
        checked(*args, **kwargs)
        other.replace(path)  # after the last check, before torch's loader opens anything
        swaps.append(path)

    monkeypatch.setattr(artifact_module, "check_pt2_layout", check_then_swap)
    loaded = Artifact.load(path)
    assert swaps == [path]
    assert loaded.specs.model.endswith("tiny_llama.py:build") and loaded.path == path
    assert path.stat().st_size == len(data) // 2  # the path now names the other file
    with pytest.raises(ArtifactError):
        Artifact.load(path)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="pinning by descriptor needs /proc/self/fd (Linux)")
def test_torchs_loader_gets_a_link_to_the_pinned_file_not_a_copy(example_artifact, monkeypatch):
    """torch's package loader gets a ``.pt2`` name, a link to the pinned descriptor, which reaches
    the checked file and is gone after the load (``load_pt2`` given a file object reads the whole
    archive into memory and writes it to a temporary file: 2.5 GB for a 1B package); each method
    is loaded by its own name, and ``load_pt2``'s device-information probe (a test library built
    and loaded in a fresh Python process per CPU vector ISA) never runs (a guard: it fails if the
    load goes through ``load_pt2`` again)."""
    import torch
    import torch._inductor.codecache as codecache

    real = torch._C._aoti.AOTIModelPackageLoader
    given = []

    def spy(name, method, *args):
        given.append((name, method, os.path.realpath(name), os.path.islink(name)))
        return real(name, method, *args)

    def probe(*args):
        raise AssertionError("the device-information probe ran")

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", spy)
    monkeypatch.setattr(codecache, "get_device_information", probe)
    loaded = Artifact.load(example_artifact)
    assert [g[1] for g in given] == list(loaded.specs.methods)
    for name, _, target, is_link in given:
        assert name.endswith(".pt2") and is_link, given
        assert target == os.path.realpath(example_artifact)
        assert not os.path.exists(os.path.dirname(name))  # the private folder went with the load


def test_a_fresh_process_loads_and_runs_without_importing_torch_dynamo(example_artifact):
    """The loader keeps torch's compiler stack out of a serving process: nothing of ``Artifact.load``
    or a step imports ``torch._dynamo`` (1.1-1.7 s of a fresh process's first load on the dev CPU,
    through ``AOTICompiledModel`` and ``torch.export.pt2_archive``). A child process, so what the
    test session imported does not count."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from offgraph_export.runtime import Artifact\n"
        f"artifact = Artifact.load({str(example_artifact)!r})\n"
        "from tests.conftest import first_step_logits\n"
        "make = lambda ids, start: (ids, torch.arange(start, start + ids.shape[-1]))\n"
        "assert torch.isfinite(first_step_logits(artifact, make, torch.tensor([[1, 2, 3]]))).all()\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_load_errors_name_the_path_not_the_descriptor(tmp_path):
    bad = tmp_path / "broken.pt2"
    bad.write_bytes(b"PK\x05\x06" + b"\x00" * 18)
    with pytest.raises(ArtifactError) as info:
        Artifact.load(bad)
    assert str(bad) in str(info.value) and "/proc/self/fd" not in str(info.value)


@pytest.mark.parametrize("version", [b"99", None])
def test_an_archive_version_torch_does_not_read_is_refused(example_artifact, tmp_path, version):
    """torch's ``load_pt2`` refused an ``archive_version`` other than its own; the project's loader,
    which no longer calls it, keeps that refusal (a missing one too)."""
    from tests.archive_tools import rewrite

    bad = rewrite(example_artifact, tmp_path / "version.pt2",
                  edit=lambda name, data: (version if name.endswith("/archive_version") else data))
    with pytest.raises(ArtifactError, match=r"archive_version is .* this torch reads '0'"):
        Artifact.load(bad)


def test_kernels_run_on_their_own_major_version_at_the_same_or_a_later_minor():
    from offgraph_export.runtime.artifact import runs_on

    assert runs_on("80", "86") and runs_on("90", "90") and runs_on("100", "103")
    assert not runs_on("86", "80") and not runs_on("90", "100") and not runs_on("100", "90") and not runs_on("103", "100")
    assert runs_on("gfx90a", "gfx90a") and not runs_on("gfx90a", "gfx942")


@pytest.mark.cuda
def test_a_cuda_method_for_another_compute_capability_is_refused_by_name(tmp_path):
    """The one device comparison the load keeps from ``load_pt2``'s probe: the compute capability a
    method was compiled for (its metadata) against this device's; none recorded: nothing to compare."""
    import torch

    from offgraph_export.runtime.artifact import _check_compute_capability

    major, minor = torch.cuda.get_device_capability()
    here = str(major * 10 + minor)
    _check_compute_capability({"AOTI_COMPUTE_CAPABILITY": here}, "decode", tmp_path / "a.pt2")
    _check_compute_capability({}, "decode", tmp_path / "a.pt2")
    other = str((major + 1) * 10)  # the next major version: its kernels do not run here
    with pytest.raises(ArtifactError, match=rf"method 'decode' was compiled for cuda compute capability {other}, this device is {here}"):
        _check_compute_capability({"AOTI_COMPUTE_CAPABILITY": other}, "decode", tmp_path / "a.pt2")
