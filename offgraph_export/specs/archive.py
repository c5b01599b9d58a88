"""Reading a ``.pt2`` archive as untrusted input.

Before anything in an archive is extracted or loaded, every entry is checked: its name must be a
plain relative path inside the package's one root folder (no absolute path, no drive, no ``..``
after normalization, no backslash, no NUL, no empty or ``.`` segment), it must be a regular file (no
symbolic link or other special file, and no directory entry, whether named with a trailing ``/`` or
marked as one by its attributes), names must be unique, and with ``verify_crc`` every member is read
and its CRC-32 compared with the directory's (or every member but the weight files, which the
loader verifies over the very bytes it loads, :func:`read_member`: a load reads each of their bytes
once). A bad archive is refused with an :class:`ArtifactError` naming the entry. Nothing here
imports torch.

Directory entries are refused rather than skipped: a package needs none (folders are implied by the
files' names; neither torch's writer nor this project writes one, and this project extracts nothing),
so one only adds a name that the checks here and torch's loader could read differently. Its
extractor (miniz) takes an entry with the MS-DOS directory attribute for a folder whatever its name:
a ``.so`` so marked would pass here as the method's library, and torch fails to extract it.

**One canonical layout.** The checks above read the archive with Python's ``zipfile``; torch's
loader reads it with its own zip reader (miniz), and two readers of one file agree only where the
file leaves nothing to interpret: ``zipfile`` takes the zip64 end record found just before the
locator where miniz follows the locator's offset, shifts every offset when bytes precede the
archive, stops at the directory's byte size where miniz counts entries, and ignores bytes after the
end record. So :func:`check_layout` parses the bytes itself (``struct``, not ``zipfile``) and refuses
any archive that is not laid out as torch's writer and Python's ``zipfile`` lay one out: one end
record, the file's last 22 bytes (no comment, nothing after it; a zip64 end record and locator right
before it, the locator naming that record, and the 32-bit fields holding each value or, when it
does not fit, the 0xFFFF.. marker), the central directory right before them and exactly filled by
its records, and the entries back to back from offset 0 up to the directory, in its order, with no
gap, overlap or unreferenced byte. Each directory record must match its local header (name,
flags, method, CRC and sizes, read from the header, its zip64 field or the data descriptor that
follows the data) and carry no comment and no extra field but a zip64 one holding exactly the
values its header marks; a local header may carry a zip64 field and torch's alignment field
(``"FB"``: ``"Z"`` padding that starts the data at a multiple of 64 bytes, as ``PyTorchFileWriter``
writes it), nothing else. What ``zipfile`` reads then is what the loader reads:
:func:`check_archive` also compares the two readings entry by entry.

**Bounded reads.** The entry count and the directory's size are checked from the end record before
the directory is read; each member's declared size, its ratio to the bytes it stores and the total
before any member is read (:mod:`~offgraph_export.specs.limits`); and the CRC verification streams
each member in chunks from the offsets checked here, inflating a deflated one no further than one
chunk past its declared size.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import stat
import struct
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from offgraph_export.errors import ArtifactError
from offgraph_export.specs.limits import (
    MAX_ARCHIVE_BYTES,
    MAX_ARCHIVE_MEMBERS,
    MAX_CENTRAL_DIRECTORY_BYTES,
    MAX_COMPRESSION_RATIO,
    MAX_ENTRY_NAME_BYTES,
    MAX_MEMBER_BYTES,
)

__all__ = [
    "ROOT_MARKER",
    "WEIGHTS_DIR",
    "AOTI_DIR",
    "WEIGHT_FILE",
    "check_archive",
    "checked_members",
    "read_member",
    "verify_member",
    "is_weight_member",
    "check_package_stem",
    "archive_root",
    "regular_file",
    "check_pt2_layout",
    "check_layout",
    "ArchiveMember",
    "ALIGNMENT",
    "UNREADABLE_MEMBER",
]

#: The entry that marks a PT2 archive's root folder (``<root>/archive_format``).
ROOT_MARKER = "archive_format"

_CHUNK = 1 << 20


def _check_name(name: str, source: str) -> None:
    def bad(why: str) -> ArtifactError:
        return ArtifactError(f"{source}: archive entry {name!r} {why}; refusing to load it")

    if not name or "\x00" in name:
        raise bad("has an empty or NUL-containing name")
    if "\\" in name:
        raise bad("contains a backslash")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise bad("is an absolute path")
    normalized = posixpath.normpath(name)
    if normalized.startswith("../") or normalized == ".." or "/../" in f"/{normalized}/":
        raise bad("climbs out of the package folder")
    if any(part == ".." for part in name.split("/")):
        raise bad("contains a '..' segment")
    if name.endswith("/"):
        raise bad("is a directory entry; a package holds only files")
    if any(part in ("", ".") for part in name.split("/")):
        raise bad("has an empty or '.' segment; expected a plain path to a file")


def check_package_stem(stem: str, source: str) -> None:
    """Raise :class:`ArtifactError` when ``stem`` (a ``.pt2`` file's name without the suffix, which
    torch's writer makes the archive's root folder) would give entries the checks above refuse,
    e.g. ``..pt2``: its entries would start with ``./``."""
    _check_name(f"{stem}/{ROOT_MARKER}", source)


#: The MS-DOS directory attribute (low byte of a zip entry's external attributes).
_DOS_DIRECTORY = 0x10


def _is_directory(info: zipfile.ZipInfo) -> bool:
    """Marked as a folder by its attributes: the Unix mode (high bits) or the MS-DOS attribute,
    which torch's extractor honours whatever the name (a trailing ``/`` is :func:`_check_name`'s)."""
    return stat.S_ISDIR(info.external_attr >> 16) or bool(info.external_attr & _DOS_DIRECTORY)


def _is_special(info: zipfile.ZipInfo) -> bool:
    """A symbolic link or another non-regular file (the Unix mode in the high external bits;
    :func:`check_archive` reports a directory first, as one)."""
    kind = stat.S_IFMT(info.external_attr >> 16)  # 0 when the archiver recorded no type
    return kind not in (0, stat.S_IFREG)


def archive_root(names: list[str], source: str) -> str:
    """The package's root folder (``"<stem>/"``), from the one ``archive_format`` entry."""
    roots = [n[: -len(ROOT_MARKER)] for n in names if n == ROOT_MARKER or n.endswith("/" + ROOT_MARKER)]
    if not roots:
        raise ArtifactError(f"{source} is not a PT2 archive (no {ROOT_MARKER} entry)")
    if len(roots) > 1:
        raise ArtifactError(f"{source} has {len(roots)} {ROOT_MARKER} entries ({roots}); expected one")
    if roots[0].count("/") != 1:  # "" (no folder) or "a/b/": a package is one folder at the top
        raise ArtifactError(
            f"{source}: its {ROOT_MARKER} lies at {roots[0] + ROOT_MARKER!r}; a package holds it in one "
            "folder at the top of the archive"
        )
    return roots[0]


def regular_file(path: str | os.PathLike) -> Path:
    """``path`` as a Path, or :class:`ArtifactError` unless it names an existing regular file."""
    target = Path(path)
    if not target.exists():
        raise ArtifactError(f"artifact {str(path)!r} does not exist")
    if not target.is_file():
        raise ArtifactError(f"artifact {str(path)!r} is not a regular file")
    return target


#: What opening or reading a damaged or hostile archive raises besides OSError: BadZipFile, a
#: corrupt deflate stream (zlib.error), a compression method or zip version zipfile lacks
#: (NotImplementedError), a truncated member (EOFError), an encrypted one (RuntimeError), a name
#: flagged UTF-8 that is not (UnicodeDecodeError, a ValueError). A block catching these must let
#: the project's own ArtifactError (a RuntimeError) through first.
UNREADABLE_MEMBER = (zipfile.BadZipFile, zlib.error, NotImplementedError, EOFError, RuntimeError, ValueError)


# -- the canonical layout (see the module docstring) ---------------------------------------------

#: The data alignment of torch's writer (``PyTorchFileWriter``'s ``storage_alignment``, 64 unless
#: told otherwise; the packager and ``torch.save`` keep it).
ALIGNMENT = 64

_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory record, 46 bytes
_END = struct.Struct("<4sHHHHIIH")  # end of central directory record, 22 bytes
_LOCATOR = struct.Struct("<4sIQI")  # zip64 end record locator, 20 bytes
_END64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory record, 56 bytes
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"
_LOCATOR_SIG, _END64_SIG, _DESCRIPTOR_SIG = b"PK\x06\x07", b"PK\x06\x06", b"PK\x07\x08"
_ZIP64_FIELD = 0x0001
_PADDING_FIELD = 0x4246  # "FB", PyTorchFileWriter's alignment padding
_FIELD_NAMES = {_ZIP64_FIELD: "a zip64 field (0x0001)", _PADDING_FIELD: "torch's padding field (0x4246)"}
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_STORED, _DEFLATED = zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED
_DATA_DESCRIPTOR = 0x0008  # general purpose flag: CRC and sizes follow the data
_UTF8 = 0x0800  # general purpose flag: the name is UTF-8
_FLAG_NAMES = {0x0001: "encrypted", 0x0040: "strongly encrypted", 0x2000: "masked directory"}


class _Refused(Exception):
    """What is wrong with one entry, said after its name (``archive entry 'x' <message>``)."""


@dataclass(frozen=True)
class ArchiveMember:
    """One entry of an archive as :func:`check_layout` read it: where its data lies and what the
    directory declares for it."""

    name: str
    header_offset: int
    data_offset: int
    compressed_size: int
    size: int
    crc: int
    method: int


def _read_at(file: BinaryIO, offset: int, n: int) -> bytes:
    file.seek(offset)
    data = file.read(n)
    if len(data) != n:  # the file shrank under us
        raise EOFError(f"{n} bytes at offset {offset} are past the file's end")
    return data


@dataclass(frozen=True)
class _End:
    count: int
    directory_offset: int
    directory_size: int


def _read_end(file: BinaryIO, size: int, source: str, kind: str) -> _End:
    """The end records: the file's last 22 bytes, and a zip64 record and locator right before them
    when the locator's signature is there (as both readers decide). Bounds the entry count and
    the directory's size before anything reads the directory."""
    if size < _END.size:
        raise ArtifactError(f"{source} is not a readable {kind}: it is {size} bytes, shorter than a zip end record")
    sig, disk, directory_disk, on_disk, count, directory_size, directory_offset, comment = _END.unpack(
        _read_at(file, size - _END.size, _END.size)
    )
    if sig != _END_SIG:
        window = min(size, _END.size + _U16)
        found = _read_at(file, size - window, window).rfind(_END_SIG)
        if found < 0:
            raise ArtifactError(f"{source} is not a readable {kind}: it does not end with a zip end record")
        at = size - window + found
        raise ArtifactError(
            f"{source} is not a readable {kind}: {size - at - _END.size} bytes (an archive comment or appended "
            f"data) follow its last zip end record, at offset {at}; a package ends with its end record"
        )
    if comment:
        raise ArtifactError(
            f"{source}: its zip end record declares a {comment}-byte comment the file does not hold; a package "
            "has no archive comment"
        )
    if disk or directory_disk or on_disk != count:
        raise ArtifactError(f"{source}: its zip end record describes an archive of several disks; refusing to load it")
    directory_end = size - _END.size
    if size >= _END.size + _LOCATOR.size + _END64.size and (
        _read_at(file, size - _END.size - _LOCATOR.size, 4) == _LOCATOR_SIG
    ):
        _, record_disk, record_offset, disks = _LOCATOR.unpack(
            _read_at(file, size - _END.size - _LOCATOR.size, _LOCATOR.size)
        )
        directory_end = size - _END.size - _LOCATOR.size - _END64.size
        if record_disk or disks != 1 or record_offset != directory_end:
            # zipfile reads the record right before the locator, miniz the one the locator names
            raise ArtifactError(
                f"{source}: its zip64 locator names a zip64 end record at offset {record_offset} (disk "
                f"{record_disk} of {disks}); the record lies right before the locator, at {directory_end}"
            )
        sig64, record_size, _, _, disk64, directory_disk64, on_disk64, count64, size64, offset64 = _END64.unpack(
            _read_at(file, directory_end, _END64.size)
        )
        if sig64 != _END64_SIG or record_size != _END64.size - 12:
            raise ArtifactError(
                f"{source}: the 56 bytes its zip64 locator names are not a plain zip64 end record "
                f"(signature {sig64!r}, record size {record_size}; expected {_END64_SIG!r} and 44)"
            )
        if disk64 or directory_disk64 or on_disk64 != count64:
            raise ArtifactError(f"{source}: its zip64 end record describes an archive of several disks; refusing to load it")
        # both writers put each value in the 32-bit field, or its marker when it does not fit
        for what, short, full, marker in (
            ("entry count", count, count64, _U16),
            ("directory size", directory_size, size64, _U32),
            ("directory offset", directory_offset, offset64, _U32),
        ):
            if short != min(full, marker):
                raise ArtifactError(
                    f"{source}: its zip end record gives the {what} as {short} and its zip64 record as {full}; "
                    f"expected {min(full, marker)} in the end record"
                )
        count, directory_size, directory_offset = count64, size64, offset64
    if count > MAX_ARCHIVE_MEMBERS:
        raise ArtifactError(
            f"{source}: the archive holds {count} entries; a package holds at most {MAX_ARCHIVE_MEMBERS}"
        )
    if directory_size > MAX_CENTRAL_DIRECTORY_BYTES:
        raise ArtifactError(
            f"{source}: its central directory is {directory_size} bytes; a package's is at most "
            f"{MAX_CENTRAL_DIRECTORY_BYTES}"
        )
    if directory_offset + directory_size != directory_end:
        # zipfile would shift every offset by the difference; miniz would not
        raise ArtifactError(
            f"{source}: its central directory (offset {directory_offset}, {directory_size} bytes) does not end "
            f"where its end records begin (offset {directory_end})"
        )
    return _End(count, directory_offset, directory_size)


def _fields(extra: bytes, where: str, allowed: tuple[int, ...]) -> dict[int, bytes]:
    """The extra fields of a header by id: each of ``allowed`` at most once, nothing else, and
    exactly filling ``extra``; ``where`` says which header, in messages."""
    fields: dict[int, bytes] = {}
    pos = 0
    while pos < len(extra):
        if pos + 4 > len(extra):
            raise _Refused(f"has extra data {where} that ends inside a field's header")
        kind, length = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + length > len(extra):
            raise _Refused(f"has an extra field 0x{kind:04x} {where} that runs past the extra data")
        if kind not in allowed:
            expected = " and ".join(_FIELD_NAMES[a] for a in allowed)
            raise _Refused(f"has an extra field 0x{kind:04x} {where}; expected only {expected}")
        if kind in fields:
            raise _Refused(f"has extra field 0x{kind:04x} twice {where}")
        fields[kind] = extra[pos + 4 : pos + 4 + length]
        pos += 4 + length
    return fields


def _zip64_values(field: bytes, where: str) -> list[int]:
    if len(field) % 8 or not 8 <= len(field) <= 24:
        raise _Refused(f"has a {len(field)}-byte zip64 field {where}; expected 8, 16 or 24 bytes")
    return list(struct.unpack(f"<{len(field) // 8}Q", field))


def _central_sizes(fields: dict[int, bytes], size: int, compressed: int, offset: int) -> tuple[int, int, int]:
    """The directory record's sizes and offset, each taken from its zip64 field where the header
    holds the 0xFFFFFFFF marker, in the order both readers take them, the field holding exactly those."""
    marked = [v == _U32 for v in (size, compressed, offset)]
    if _ZIP64_FIELD not in fields:
        if any(marked):
            raise _Refused("marks a value as held in a zip64 field but has none")
        return size, compressed, offset
    values = _zip64_values(fields[_ZIP64_FIELD], "in its directory record")
    if len(values) != sum(marked):
        raise _Refused(
            f"has {len(values)} values in its directory record's zip64 field where the record marks {sum(marked)}"
        )
    it = iter(values)
    size, compressed, offset = (next(it) if m else v for m, v in zip(marked, (size, compressed, offset)))
    return size, compressed, offset


def _decode_name(raw: bytes, flags: int) -> str:
    if flags & _UTF8:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Refused("has a name flagged UTF-8 that is not") from None
    if not raw.isascii():  # zipfile would read it as cp437, torch's reader as raw bytes
        raise _Refused("has a name that is not ASCII yet lacks the UTF-8 flag")
    return raw.decode("ascii")


def _read_entries(file: BinaryIO, end: _End, source: str, max_total: int) -> list[ArchiveMember]:
    """Every directory record, matched with its local header, the entries back to back (see the
    module docstring); sizes, ratios and the total bounded before any data is read."""
    directory = _read_at(file, end.directory_offset, end.directory_size)
    members: list[ArchiveMember] = []
    pos = cursor = total = 0
    for index in range(end.count):
        if pos + _CENTRAL.size > len(directory) or directory[pos : pos + 4] != _CENTRAL_SIG:
            raise ArtifactError(
                f"{source}: its central directory holds no record {index} at byte {pos}; the end record "
                f"counts {end.count}"
            )
        (_, _, _, flags, method, _, _, crc, compressed, size, name_len, extra_len, comment_len, disk, _, _,
         offset) = _CENTRAL.unpack_from(directory, pos)
        record_end = pos + _CENTRAL.size + name_len + extra_len + comment_len
        if record_end > len(directory):
            raise ArtifactError(f"{source}: central directory record {index} runs past the directory's end")
        raw = directory[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len]
        label = f"{source}: archive entry {raw.decode('utf-8', 'replace')!r}"
        try:
            name = _decode_name(raw, flags)
            label = f"{source}: archive entry {name!r}"
            if not raw or b"\x00" in raw:
                raise _Refused("has an empty or NUL-containing name")
            if name_len > MAX_ENTRY_NAME_BYTES:
                raise _Refused(f"has a {name_len}-byte name; a package's names are at most {MAX_ENTRY_NAME_BYTES}")
            if comment_len:
                raise _Refused(f"has a {comment_len}-byte comment; a package's entries have none")
            fields = _fields(directory[pos + _CENTRAL.size + name_len : record_end - comment_len],
                             "in its directory record", (_ZIP64_FIELD,))
            if disk == _U16:
                raise _Refused("keeps its disk number in a zip64 field; a package is one disk")
            size, compressed, offset = _central_sizes(fields, size, compressed, offset)
            if disk:
                raise _Refused(f"starts on disk {disk}; a package is one disk")
            odd = flags & ~(_DATA_DESCRIPTOR | _UTF8)
            if odd:
                names = [n for bit, n in _FLAG_NAMES.items() if odd & bit] or ["unknown"]
                raise _Refused(f"has general purpose flags 0x{flags:04x} ({', '.join(names)}); expected only "
                                 "the data descriptor and UTF-8 flags")
            if method not in (_STORED, _DEFLATED):
                raise _Refused(f"uses compression method {method}; expected 0 (stored) or 8 (deflated)")
            if method == _STORED and compressed != size:
                raise _Refused(f"is stored, yet declares {size} bytes from {compressed} stored")
            if size > MAX_MEMBER_BYTES:
                raise _Refused(f"declares {size} bytes; a member of a package holds at most {MAX_MEMBER_BYTES}")
            if method == _DEFLATED and size > compressed * MAX_COMPRESSION_RATIO:
                raise _Refused(
                    f"declares {size} bytes from {compressed} compressed ({size // max(compressed, 1)}:1); a "
                    f"member inflates at most {MAX_COMPRESSION_RATIO}:1"
                )
            total += size
            if total > max_total:
                raise _Refused(
                    f"brings what the members declare to {total} bytes; an archive holds at most {max_total}"
                )
            if offset != cursor:
                raise _Refused(
                    f"starts at offset {offset}, where {'the previous entry ends' if index else 'the file begins'} at "
                    f"{cursor}; entries lie back to back from offset 0, none overlapping, nothing between them"
                )
            data_offset, descriptor = _check_local(
                file, offset, raw, flags, method, crc, compressed, size, end.directory_offset
            )
        except ArtifactError:
            raise
        except (_Refused, EOFError) as exc:
            raise ArtifactError(f"{label} {exc}; refusing to load it") from exc
        cursor = data_offset + compressed + descriptor
        if cursor > end.directory_offset:
            raise ArtifactError(f"{label} runs into the central directory (to offset {cursor}); refusing to load it")
        members.append(ArchiveMember(name, offset, data_offset, compressed, size, crc, method))
        pos = record_end
    if pos != end.directory_size:
        raise ArtifactError(
            f"{source}: its central directory holds {end.directory_size - pos} bytes after its "
            f"{end.count} records; refusing to load it"
        )
    if cursor != end.directory_offset:
        raise ArtifactError(
            f"{source}: {end.directory_offset - cursor} bytes at offset {cursor}, before its central directory, "
            "belong to no entry; refusing to load it"
        )
    return members


def _check_local(
    file: BinaryIO, offset: int, raw: bytes, flags: int, method: int, crc: int, compressed: int, size: int,
    limit: int,
) -> tuple[int, int]:
    """The local header at ``offset`` matches its directory record; ``(data offset, descriptor
    length)``. Either torch's form (CRC and sizes 0 in the header, a data descriptor after the data,
    an ``"FB"`` padding field) or ``zipfile``'s (CRC and sizes in the header, or the sizes in its
    zip64 field behind 0xFFFFFFFF markers)."""
    (sig, _, local_flags, local_method, _, _, local_crc, local_compressed, local_size, name_len,
     extra_len) = _LOCAL.unpack(_read_at(file, offset, _LOCAL.size))
    if sig != _LOCAL_SIG:
        raise _Refused(f"has no local header at offset {offset}")
    tail = _read_at(file, offset + _LOCAL.size, name_len + extra_len)
    if tail[:name_len] != raw:
        raise _Refused(f"is named {tail[:name_len].decode('utf-8', 'replace')!r} by its local header")
    if (local_flags, local_method) != (flags, method):
        raise _Refused(
            f"has flags 0x{local_flags:04x} and method {local_method} in its local header but 0x{flags:04x} and "
            f"{method} in the directory"
        )
    fields = _fields(tail[name_len:], "in its local header", (_ZIP64_FIELD, _PADDING_FIELD))
    data_offset = offset + _LOCAL.size + name_len + extra_len
    if data_offset + compressed > limit:
        raise _Refused(f"declares {compressed} bytes stored from offset {data_offset}, past the central "
                         f"directory at {limit}")
    if _PADDING_FIELD in fields:
        padding = fields[_PADDING_FIELD]
        if data_offset % ALIGNMENT or len(padding) >= ALIGNMENT or padding.strip(b"Z"):
            raise _Refused(
                f"has {len(padding)} bytes of alignment padding starting its data at offset {data_offset}; torch's "
                f"writer pads with 'Z' to the next multiple of {ALIGNMENT}"
            )
    if _ZIP64_FIELD in fields:  # [size, compressed size] and/or the header's offset, as either writer puts them
        values = _zip64_values(fields[_ZIP64_FIELD], "in its local header")
        sizes, rest = (values[:2], values[2:]) if len(values) >= 2 else ([], values)
        zero_ok = bool(flags & _DATA_DESCRIPTOR)
        if any(v != want and not (zero_ok and v == 0) for v, want in zip(sizes, (size, compressed))) or any(
            v != offset for v in rest
        ):
            raise _Refused(f"has zip64 values {values} in its local header; the directory gives size {size}, "
                             f"compressed size {compressed}, offset {offset}")
    if flags & _DATA_DESCRIPTOR:
        if (local_crc, local_compressed, local_size) != (0, 0, 0):
            raise _Refused("has a data descriptor, yet a CRC or sizes in its local header")
        wide = _ZIP64_FIELD in fields
        layout = struct.Struct("<4sIQQ" if wide else "<4sIII")
        got = layout.unpack(_read_at(file, data_offset + compressed, layout.size))
        if got != (_DESCRIPTOR_SIG, crc, compressed, size):
            raise _Refused(
                f"has a data descriptor {got[1:]} (signature {got[0]!r}) after its data; the directory gives "
                f"CRC {crc}, sizes {compressed} and {size}"
            )
        return data_offset, layout.size
    header = (local_crc, local_compressed, local_size)
    if header != (crc, compressed, size) and not (
        local_crc == crc and (local_compressed, local_size) == (_U32, _U32) and _ZIP64_FIELD in fields
        and len(fields[_ZIP64_FIELD]) >= 16
    ):
        raise _Refused(
            f"has CRC {local_crc} and sizes {local_compressed} and {local_size} in its local header; the directory "
            f"gives {crc}, {compressed} and {size}"
        )
    return data_offset, 0


def check_layout(
    file: BinaryIO, source: str, kind: str = ".pt2 archive", max_total: int = MAX_ARCHIVE_BYTES
) -> list[ArchiveMember]:
    """The entries of the zip archive in the open, seekable binary ``file``, once its bytes are
    found laid out in the one canonical form (module docstring) with its count and sizes within
    the limits (``max_total``: the most its members may declare together); raise
    :class:`ArtifactError` naming the entry or value otherwise. Reads the end records, the directory
    and each local header, no member's data. ``kind`` names what the file should be, in messages."""
    try:
        size = file.seek(0, os.SEEK_END)
        return _read_entries(file, _read_end(file, size, source, kind), source, max_total)
    except EOFError as exc:
        raise ArtifactError(f"{source} is not a readable {kind}: {exc}") from exc


def _agree(members: list[ArchiveMember], infos: list[zipfile.ZipInfo], source: str) -> None:
    """``zipfile``'s reading of the archive is this module's, entry by entry."""
    ours = [(m.name, m.header_offset, m.compressed_size, m.size, m.crc, m.method) for m in members]
    theirs = [(i.filename, i.header_offset, i.compress_size, i.file_size, i.CRC, i.compress_type) for i in infos]
    if ours != theirs:
        at = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise ArtifactError(
            f"{source}: Python's zipfile reads {len(theirs)} entries and this check {len(ours)}, differing at "
            f"entry {at}; refusing to load it"
        )


def _data(file: BinaryIO, member: ArchiveMember, source: str, read_size: int = _CHUNK) -> Iterator[bytes]:
    """``member``'s data in chunks (of ``read_size`` stored bytes), from the offsets
    :func:`check_layout` checked, its CRC-32 computed over the very bytes handed out; after the
    last chunk, :class:`ArtifactError` unless they are what the directory declares (CRC-32 and
    size). A deflated member is inflated at most one chunk past its declared size, so no member
    costs more than it declares. Each read seeks first, so the caller may use ``file`` between
    chunks."""
    label = f"{source}: archive entry {member.name!r}"
    offset, crc, produced, left = member.data_offset, 0, 0, member.compressed_size
    inflater = zlib.decompressobj(-zlib.MAX_WBITS) if member.method == _DEFLATED else None
    while inflater is None or not inflater.eof:
        if inflater is not None and inflater.unconsumed_tail:
            chunk = inflater.unconsumed_tail
        elif left:
            file.seek(offset)
            chunk = file.read(min(read_size, left))
            if not chunk:
                raise ArtifactError(f"{label} ends {left} bytes early: the file shrank while it was read")
            left -= len(chunk)
            offset += len(chunk)
        elif inflater is None:
            break
        else:
            chunk = b""
        out = chunk if inflater is None else inflater.decompress(chunk, _CHUNK)
        produced += len(out)
        if produced > member.size:
            raise ArtifactError(f"{label} inflates past its declared {member.size} bytes; refusing to load it")
        crc = zlib.crc32(out, crc)
        if out:
            yield out
        if inflater is not None and not chunk and not out:
            break  # no input left and nothing more comes out
    if inflater is not None and (not inflater.eof or inflater.unused_data or left):
        raise ArtifactError(
            f"{label} is corrupt: its deflate stream {'does not end' if not inflater.eof else 'ends'} before its "
            f"{member.compressed_size} stored bytes do"
        )
    if produced != member.size:
        raise ArtifactError(f"{label} is corrupt: it inflates to {produced} bytes; the directory declares {member.size}")
    if crc != member.crc:
        raise ArtifactError(
            f"{label} is corrupt: its data's CRC-32 is 0x{crc:08x}, the directory records 0x{member.crc:08x}"
        )


def verify_member(file: BinaryIO, member: ArchiveMember, source: str) -> None:
    """Read ``member`` of the open archive ``file`` in chunks and compare its CRC-32 with the
    directory's (:class:`ArtifactError` naming it and both values otherwise); nothing is kept."""
    for _ in _data(file, member, source):
        pass


def read_member(file: BinaryIO, member: ArchiveMember, source: str) -> bytes:
    """``member``'s data, read once: its CRC-32 is computed over these bytes as they are read and
    compared before any is returned (:class:`ArtifactError` naming it and both values otherwise),
    so a reader needs no checksum pass of its own. ``member`` comes from :func:`checked_members`
    (or :func:`check_layout`) of the same file; bound its size before calling. A stored member (as
    torch's writer stores every one) is read in one read and not copied again."""
    whole = member.compressed_size if member.method == _STORED else _CHUNK
    return b"".join(_data(file, member, source, whole))  # one chunk: join returns it as it is


@contextlib.contextmanager
def _refusing(source: str) -> Iterator[None]:
    """An unreadable file or member (OSError, :data:`UNREADABLE_MEMBER`) as one :class:`ArtifactError`
    naming ``source``; the project's own errors pass as they are."""
    try:
        yield
    except ArtifactError:
        raise
    except OSError as exc:
        raise ArtifactError(f"{source} cannot be read: {exc}") from exc
    except UNREADABLE_MEMBER as exc:
        raise ArtifactError(f"{source} is not a readable .pt2 archive: {type(exc).__name__}: {exc}") from exc


def _checked(file: BinaryIO, source: str) -> tuple[list[zipfile.ZipInfo], list[ArchiveMember]]:
    """Every check of :func:`check_archive` but the checksums, on the open ``file``: ``zipfile``'s
    entries and this module's reading of them."""
    size = file.seek(0, os.SEEK_END)
    end = _read_end(file, size, source, ".pt2 archive")
    with zipfile.ZipFile(file) as archive:
        infos = archive.infolist()
        names = [info.filename for info in infos]
        for info in infos:
            _check_name(info.filename, source)
            if _is_directory(info):
                raise ArtifactError(
                    f"{source}: archive entry {info.filename!r} is marked as a directory; a package "
                    "holds only files; refusing to load it"
                )
            if _is_special(info):
                raise ArtifactError(
                    f"{source}: archive entry {info.filename!r} is a link or special file; "
                    "refusing to load it"
                )
            if info.flag_bits & 0x1:
                archive.open(info).close()  # zipfile refuses it: encrypted, password required
        duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
        if duplicates:
            raise ArtifactError(f"{source}: archive entries {duplicates} appear more than once")
        root = archive_root(names, source)
        outside = [n for n in names if not n.startswith(root)]
        if outside:
            raise ArtifactError(
                f"{source}: archive entry {outside[0]!r} lies outside the package folder {root!r}"
            )
    members = _read_entries(file, end, source, MAX_ARCHIVE_BYTES)
    _agree(members, infos, source)
    return infos, members


def check_archive(
    path: str | os.PathLike, verify_crc: bool = True, defer_weights: bool = False
) -> list[zipfile.ZipInfo]:
    """Validate every entry of the archive at ``path`` (see the module docstring); return them.

    In this order, on one open file: the end records, bounding the entry count and the directory's
    size (before ``zipfile`` parses the directory); every name and file type as ``zipfile`` reads
    them; the canonical layout (:func:`check_layout`), compared with ``zipfile``'s reading; and with
    ``verify_crc`` every member's CRC-32, streamed from the offsets checked. ``defer_weights``
    leaves out the weight files' (:func:`is_weight_member`, nearly all of a package's bytes): the
    loader verifies each over the bytes it loads (:func:`read_member`), so a load reads them once,
    not once here and again there."""
    source = str(path)
    target = regular_file(path)
    with _refusing(source), open(target, "rb") as file:
        infos, members = _checked(file, source)
        if verify_crc:
            for member in members:
                if not (defer_weights and is_weight_member(member.name)):
                    verify_member(file, member, source)
    return infos


def checked_members(file: BinaryIO, source: str) -> list[ArchiveMember]:
    """The entries of the open archive ``file`` once they pass every check of :func:`check_archive`
    but the checksums, for a reader that verifies each member it reads as it reads it
    (:func:`read_member`)."""
    with _refusing(source):
        return _checked(file, source)[1]


#: Entries a package of this project holds besides its methods' folders, relative to the root.
_PT2_FILES = frozenset(
    {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
     "extra/offgraph_specs.json"}
)
#: Where a package keeps its weight files and its methods' folders, relative to the root.
WEIGHTS_DIR = "data/weights/"
AOTI_DIR = "data/aotinductor/"
#: The name of a weight file (in :data:`WEIGHTS_DIR`).
WEIGHT_FILE = r"weight_[0-9]{1,9}"
_WEIGHT_ENTRY = re.compile(re.escape(WEIGHTS_DIR) + WEIGHT_FILE)
_METHOD_ENTRY = re.compile(re.escape(AOTI_DIR) + r"([A-Za-z0-9_]+)/[A-Za-z0-9_.\-]+")
_WEIGHT_MEMBER = re.compile(r"[^/]+/" + _WEIGHT_ENTRY.pattern)


def is_weight_member(name: str) -> bool:
    """Whether archive entry ``name`` is a weight file, ``<root>/data/weights/weight_<n>`` (of an
    archive whose names passed :func:`check_archive`: every name lies in its one root folder)."""
    return _WEIGHT_MEMBER.fullmatch(name) is not None


#: Files of a method's folder that only serve to build its library from source: torch's loader
#: compiles the ``.cpp`` with the commands these name (through a shell) when the folder has no
#: ``.so``; a package of this project always holds the built library, so they are refused.
_BUILD_FILES = re.compile(r".*(_compile_flags\.json|_linker_flags\.json|\.o|CMakeLists\.txt)")


def check_pt2_layout(names: list[str], source: str, methods: list[str]) -> None:
    """Every entry of a ``.pt2`` is one this project writes: the archive's bookkeeping files, the
    specs, ``data/weights/weight_<n>`` and the files of the named ``methods`` (one folder each
    under ``data/aotinductor/``, all present, each with exactly one built library ``.so`` and no
    build files). Anything else, exported programs or pickled constants above all (torch's loader
    would unpickle them), or the makings of a build (torch's loader runs the compile command a
    flags file names when a method has no library), is refused before any is read. Every name is
    checked as :func:`check_archive` checks it, so the layout holds for names from anywhere, and a
    directory entry (a name ending in ``/``) is refused here too (see the module docstring)."""
    for name in names:
        _check_name(name, source)
    root = archive_root(names, source)
    libraries: dict[str, int] = {method: 0 for method in methods}
    held = set()
    for name in names:
        rel = name[len(root):]
        if rel in _PT2_FILES or _WEIGHT_ENTRY.fullmatch(rel):
            continue
        match = _METHOD_ENTRY.fullmatch(rel)
        if match and match.group(1) in methods and not _BUILD_FILES.fullmatch(rel):
            held.add(match.group(1))
            libraries[match.group(1)] += rel.endswith(".so")
            continue
        raise ArtifactError(f"{source}: archive entry {name!r} is not part of an offgraph package; refusing to load it")
    if held != set(methods):
        raise ArtifactError(
            f"{source}: the package holds compiled methods {sorted(held)} but its specs name {methods}"
        )
    wrong = {m: n for m, n in libraries.items() if n != 1}
    if wrong:
        method, count = next(iter(wrong.items()))
        raise ArtifactError(
            f"{source}: method {method!r} holds {count} compiled libraries (.so); a package holds "
            "exactly one per method (it is never built from sources at load)"
        )
