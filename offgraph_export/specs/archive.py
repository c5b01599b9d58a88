"""Reading a ``.pt2`` archive as untrusted input.

Before anything in an archive is extracted or loaded, every entry is checked: its name must be a
plain relative path inside the package's one root folder (no absolute path, no drive, no ``..``
after normalization, no backslash, no NUL, no empty or ``.`` segment), it must be a regular file (no
symbolic link or other special file, and no directory entry, whether named with a trailing ``/`` or
marked as one by its attributes), names must be unique, and with ``verify_crc`` every member is read
and its CRC-32 compared with the directory's. A bad archive is refused with an
:class:`ArtifactError` naming the entry. Nothing here imports torch.

Directory entries are refused rather than skipped: a package needs none (folders are implied by the
files' names; neither torch's writer nor this project writes one, and this project extracts nothing),
so one only adds a name that the checks here and torch's loader could read differently. Its
extractor (miniz) takes an entry with the MS-DOS directory attribute for a folder whatever its name:
a ``.so`` so marked would pass here as the method's library, and torch fails to extract it.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
import zipfile
import zlib
from collections import Counter
from pathlib import Path

from offgraph_export.errors import ArtifactError

__all__ = [
    "ROOT_MARKER",
    "WEIGHTS_DIR",
    "AOTI_DIR",
    "WEIGHT_FILE",
    "check_archive",
    "check_package_stem",
    "archive_root",
    "regular_file",
    "check_pt2_layout",
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


def check_archive(path: str | os.PathLike, verify_crc: bool = True) -> list[zipfile.ZipInfo]:
    """Validate every entry of the archive at ``path`` (see the module docstring); return them."""
    source = str(path)
    target = regular_file(path)
    try:
        with zipfile.ZipFile(target) as archive:
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
            duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
            if duplicates:
                raise ArtifactError(f"{source}: archive entries {duplicates} appear more than once")
            root = archive_root(names, source)
            outside = [n for n in names if not n.startswith(root)]
            if outside:
                raise ArtifactError(
                    f"{source}: archive entry {outside[0]!r} lies outside the package folder {root!r}"
                )
            if verify_crc:
                for info in infos:
                    try:
                        with archive.open(info) as member:
                            while member.read(_CHUNK):
                                pass
                    except UNREADABLE_MEMBER as exc:
                        raise ArtifactError(
                            f"{source}: archive entry {info.filename!r} is corrupt ({type(exc).__name__}: {exc})"
                        ) from exc
    except ArtifactError:
        raise
    except OSError as exc:
        raise ArtifactError(f"{source} cannot be read: {exc}") from exc
    except UNREADABLE_MEMBER as exc:
        raise ArtifactError(f"{source} is not a readable .pt2 archive: {type(exc).__name__}: {exc}") from exc
    return infos


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
