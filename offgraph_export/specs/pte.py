"""The specs and the digest a ``.pte`` carries, and reading them back as untrusted input.

``lowering/executorch.py`` writes the specs as constant methods of the program (ExecuTorch's own
way to attach values to a ``.pte``): ``offgraph_kv_step_width``, ``offgraph_kv_manifest``,
``offgraph_program`` and ``offgraph_specs`` (the whole :class:`ArtifactSpecs` JSON); every delegate
also carries the manifest (and, where one of its inputs carries the token width, its own width
spec) as CompileSpecs. The file is read with :mod:`offgraph_export.specs.pte_reader` (bounded,
``struct`` only: no executorch, torch or native code), and what it says is checked:

- **Digest.** Nothing else detects a flipped byte: ExecuTorch's runtime loads and runs a program
  whose delegate data or weights were corrupted. So export records a digest in one more constant
  method, ``offgraph_digest``: ``sha256:tables=<hex>,segments=<hex>``, the SHA-256 of the file's
  bytes before its segment data (the flatbuffer, whose tables hold every method, value and
  instruction and the specs, and its padding) with the 64 hex digits of the ``tables`` digest itself
  read as ``0``, and of its segment data (the delegates' compiled data and the constants), which
  together are every byte of the file. A program with external data (the cuda backend's
  ``<stem>.ptd``) records that file's digest in ``offgraph_data_digest``, ``sha256:<hex>``, itself
  covered by the ``tables`` digest. Export writes placeholders of the same length, serializes, and
  writes the digests into them; a reader finds the digest's text through the flatbuffer, never by
  searching for it, and compares before anything is loaded: a mismatch is refused naming the file
  and the part (the tables, the segment data or the data file). The digest lives inside what it
  covers, so it detects corruption, not an edit: whoever rewrites the file can rewrite the digest
  too. What catches an edit that recomputes it is the cross-checks below, which every part of the
  specs must pass with every other.
- **Specs.** ``offgraph_specs`` must agree with the other three constant methods, and every
  delegate's CompileSpecs with them: exactly one ``offgraph_kv_manifest``, byte for byte the
  program's own, at most one ``offgraph_kv_step_width``, whose argument has the width's planned
  upper bound along its dim in every call of the delegate, and no other ``offgraph_*`` key. A
  disagreement is refused naming the delegate, the key and (for the manifest) the first field
  that differs.

The runtime gets the bytes that were checked (:func:`load_pte`), never the path again.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from offgraph_export.errors import ArtifactError, SpecError, first_line
from offgraph_export.specs.archive import regular_file
from offgraph_export.specs.artifact import PROGRAM_KEY, ArtifactSpecs, parse_artifact_specs
from offgraph_export.specs.limits import MAX_PTE_BYTES
from offgraph_export.specs.manifest import MANIFEST_KEY, parse_manifest
from offgraph_export.specs.pte_reader import PteLayout, StringConstant, read_pte_layout
from offgraph_export.specs.step_width import STEP_WIDTH_KEY, parse_step_width
from offgraph_export.specs.text import safe_text

__all__ = [
    "SPECS_METHOD",
    "DIGEST_METHOD",
    "DATA_DIGEST_METHOD",
    "spec_constants",
    "digest_placeholders",
    "data_file_path",
    "file_digest",
    "seal_pte",
    "check_pte",
    "check_delegate_specs",
    "read_pte_constants",
    "read_pte_specs",
    "load_pte",
]

#: Constant method holding the whole ArtifactSpecs JSON.
SPECS_METHOD = "offgraph_specs"
#: Constant method holding the digest of the file (``sha256:tables=<hex>,segments=<hex>``).
DIGEST_METHOD = "offgraph_digest"
#: Constant method holding the digest of the external data file (``sha256:<hex>``), when there is one.
DATA_DIGEST_METHOD = "offgraph_data_digest"

_HEX = 64
_TABLES_PREFIX = "sha256:tables="
_DIGEST_RE = re.compile(r"sha256:tables=([0-9a-f]{64}),segments=([0-9a-f]{64})")
_DATA_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
#: What the ``tables`` digest's own digits are read as (and what export writes before it knows them).
_ZEROS = b"0" * _HEX
_DIGEST_PLACEHOLDER = f"{_TABLES_PREFIX}{'0' * _HEX},segments={'0' * _HEX}"
#: Unlike the one above, so that a writer that shares equal strings cannot give both one place.
_DATA_PLACEHOLDER = f"sha256:{'f' * _HEX}"
_CHUNK = 1 << 20
_REQUIRED = (SPECS_METHOD, STEP_WIDTH_KEY, MANIFEST_KEY, PROGRAM_KEY)
_OWN_PREFIX = "offgraph_"


def spec_constants(specs: ArtifactSpecs) -> dict[str, str]:
    """The constant methods a ``.pte`` of ``specs`` carries, by name."""
    return {
        STEP_WIDTH_KEY: specs.step_width.format(),
        MANIFEST_KEY: specs.manifest.to_json(),
        PROGRAM_KEY: specs.program_description(),
        SPECS_METHOD: specs.model_dump_json(),
    }


def digest_placeholders(data_file: bool) -> dict[str, str]:
    """The digest constant methods as export first writes them (:func:`seal_pte` fills them in);
    ``data_file``: the program has an external data file."""
    placeholders = {DIGEST_METHOD: _DIGEST_PLACEHOLDER}
    if data_file:
        placeholders[DATA_DIGEST_METHOD] = _DATA_PLACEHOLDER
    return placeholders


def data_file_path(path: str | os.PathLike) -> Path:
    """Where the external data of the ``.pte`` at ``path`` lies (``<stem>.ptd``, cuda backend)."""
    return Path(path).with_suffix(".ptd")


def _chunks(file: BinaryIO, start: int, end: int) -> Iterator[bytes]:
    file.seek(start)
    at = start
    while at < end:
        chunk = file.read(min(_CHUNK, end - at))
        if not chunk:
            raise OSError(f"the file ended at byte {at} of {end}")
        at += len(chunk)
        yield chunk


def file_digest(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of the file at ``path``, read in chunks."""
    target = Path(path)
    digest = hashlib.sha256()
    with target.open("rb") as file:
        for chunk in _chunks(file, 0, target.stat().st_size):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _digests(file: BinaryIO, layout: PteLayout, region: int) -> tuple[str, str]:
    """The ``tables`` and ``segments`` digests of the file, the 64 bytes at ``region`` read as ``0``."""
    tables = hashlib.sha256()
    at = 0
    for chunk in _chunks(file, 0, layout.segment_base):
        lo, hi = max(region - at, 0), min(region + _HEX - at, len(chunk))
        if lo < hi:
            chunk = chunk[:lo] + _ZEROS[lo + at - region : hi + at - region] + chunk[hi:]
        tables.update(chunk)
        at += len(chunk)
    segments = hashlib.sha256()
    for chunk in _chunks(file, layout.segment_base, layout.file_size):
        segments.update(chunk)
    return tables.hexdigest(), segments.hexdigest()


def _constant(layout: PteLayout, name: str, source: str) -> StringConstant:
    if name not in layout.constants:
        raise ArtifactError(f"{source} has no {name} constant method; was it built by `offgraph-export export` (of this version)?")
    return layout.constants[name]


def seal_pte(buffer: bytes, data_digest: str | None = None, source: str = "the .pte") -> bytes:
    """``buffer`` (a serialized program with :func:`digest_placeholders`) with its digests written
    in: ``data_digest`` (:func:`file_digest` of the external data file) first, then the file's."""
    layout = read_pte_layout(io.BytesIO(buffer), len(buffer), source)
    out = bytearray(buffer)
    if data_digest is not None:
        slot = _constant(layout, DATA_DIGEST_METHOD, source)
        if slot.text != _DATA_PLACEHOLDER or not _DATA_DIGEST_RE.fullmatch(data_digest):
            raise ArtifactError(f"{source}: cannot write the data digest {data_digest!r} into {DATA_DIGEST_METHOD} {slot.text!r}")
        out[slot.offset : slot.offset + slot.size] = data_digest.encode()
    slot = _constant(layout, DIGEST_METHOD, source)
    if slot.text != _DIGEST_PLACEHOLDER:
        raise ArtifactError(f"{source}: its {DIGEST_METHOD} is not the placeholder export writes; it is sealed once")
    region = slot.offset + len(_TABLES_PREFIX)
    # the segments' digest first: it lies in the tables, which the tables' digest covers
    _, segments = _digests(io.BytesIO(bytes(out)), layout, region)
    out[slot.offset : slot.offset + slot.size] = f"{_TABLES_PREFIX}{'0' * _HEX},segments={segments}".encode()
    tables, _ = _digests(io.BytesIO(bytes(out)), layout, region)
    out[region : region + _HEX] = tables.encode()
    return bytes(out)


def _verify_digest(file: BinaryIO, layout: PteLayout, source: str) -> None:
    slot = _constant(layout, DIGEST_METHOD, source)
    match = _DIGEST_RE.fullmatch(slot.text)
    if match is None:
        raise ArtifactError(
            f"{source}: its {DIGEST_METHOD} {safe_text(repr(slot.text[:200]))} is not "
            "'sha256:tables=<64 hex digits>,segments=<64 hex digits>'"
        )
    tables, segments = _digests(file, layout, slot.offset + len(_TABLES_PREFIX))
    if tables != match.group(1):
        raise ArtifactError(
            f"{source}: its program tables (bytes 0..{layout.segment_base}: methods, values, "
            f"instructions, specs) do not match the digest in its {DIGEST_METHOD}; the file is "
            "corrupt or was edited: export it again"
        )
    if segments != match.group(2):
        raise ArtifactError(
            f"{source}: its segment data (bytes {layout.segment_base}..{layout.file_size}: the "
            f"delegates' compiled data and the constants) does not match the digest in its "
            f"{DIGEST_METHOD}; the file is corrupt or was edited: export it again"
        )


def _verify_data_file(layout: PteLayout, specs: ArtifactSpecs, data_file: Path | None, source: str) -> None:
    """A cuda program records its external data file's digest, and ``data_file`` (where that file
    lies; None: the caller has it elsewhere) matches it; no other program records one."""
    if specs.device != "cuda":
        if DATA_DIGEST_METHOD in layout.constants:
            raise ArtifactError(f"{source}: a {specs.device} program records an external data file digest ({DATA_DIGEST_METHOD}); only the cuda backend writes one")
        return
    slot = _constant(layout, DATA_DIGEST_METHOD, source)
    if _DATA_DIGEST_RE.fullmatch(slot.text) is None:
        raise ArtifactError(f"{source}: its {DATA_DIGEST_METHOD} {safe_text(repr(slot.text[:200]))} is not 'sha256:<64 hex digits>'")
    if data_file is None:
        return
    if not data_file.is_file():
        raise ArtifactError(f"{source}: its data file {data_file} is missing (a cuda .pte is used with the .ptd written beside it)")
    if data_file.stat().st_size > MAX_PTE_BYTES:
        raise ArtifactError(f"{source}: its data file {data_file} is {data_file.stat().st_size} bytes; at most {MAX_PTE_BYTES} are read")
    if file_digest(data_file) != slot.text:
        raise ArtifactError(
            f"{source}: its data file {data_file} does not match the digest in its "
            f"{DATA_DIGEST_METHOD}; one of them is corrupt or from another export"
        )


def _first_difference(mine: object, theirs: object, path: str = "") -> str | None:
    """Where two parsed JSON values first differ (``layers[1].window``), or None when equal."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in list(mine) + [k for k in theirs if k not in mine]:
            found = _first_difference(mine.get(key), theirs.get(key), f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None
    if isinstance(mine, list) and isinstance(theirs, list):
        if len(mine) != len(theirs):
            return f"{path or 'the manifest'} ({len(mine)} entries, not {len(theirs)})"
        for i, (a, b) in enumerate(zip(mine, theirs)):
            found = _first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    if mine != theirs or type(mine) is not type(theirs):
        return f"{path or 'the manifest'} ({safe_text(repr(mine))[:80]}, not {safe_text(repr(theirs))[:80]})"
    return None


def check_delegate_specs(layout: PteLayout, specs: ArtifactSpecs, source: str) -> None:
    """Every delegate's CompileSpecs agree with the specs (see the module docstring)."""
    manifest = specs.manifest.to_json().encode()
    bound = specs.symbols[specs.width_symbol].max
    for delegate in layout.delegates:
        name = f"{source}: delegate {delegate.index} ({safe_text(delegate.backend)}) of method {safe_text(delegate.method)!r}"
        keys = [key for key, _ in delegate.compile_specs]
        for key in sorted(set(keys)):
            if key.startswith(_OWN_PREFIX) and key not in (MANIFEST_KEY, STEP_WIDTH_KEY):
                raise ArtifactError(f"{name} carries compile spec {safe_text(key)!r}, which offgraph-export does not write")
            if key in (MANIFEST_KEY, STEP_WIDTH_KEY) and keys.count(key) > 1:
                raise ArtifactError(f"{name} carries {key} {keys.count(key)} times; a delegate carries one")
        own = dict(delegate.compile_specs)
        if MANIFEST_KEY not in own:
            raise ArtifactError(f"{name} carries no {MANIFEST_KEY}; every delegate carries the program's")
        if own[MANIFEST_KEY] != manifest:
            try:
                where = _first_difference(parse_manifest(own[MANIFEST_KEY]).model_dump(), specs.manifest.model_dump())
            except SpecError as exc:
                where = f"it is not a valid manifest ({str(exc).splitlines()[0][:200]})"
            raise ArtifactError(
                f"{name}: its {MANIFEST_KEY} disagrees with the program's ({MANIFEST_KEY} constant "
                f"method) at {where or 'its bytes (the same manifest, written differently)'}"
            )
        if STEP_WIDTH_KEY not in own:
            continue
        raw = own[STEP_WIDTH_KEY]
        try:
            if len(raw) > 19:  # two numbers of at most 9 digits and a ':'
                raise SpecError("too long")
            width = parse_step_width(raw.decode("ascii"))
        except (UnicodeDecodeError, SpecError):
            raise ArtifactError(f"{name}: its {STEP_WIDTH_KEY} {safe_text(repr(raw[:40]))} is not 'input_index:dim'") from None
        for call in delegate.calls:
            sizes = call[width.input_index] if width.input_index < len(call) else None
            if sizes is None or width.dim >= len(sizes) or sizes[width.dim] != bound:
                arg = "no tensor" if sizes is None else f"planned sizes {list(sizes)}"
                raise ArtifactError(
                    f"{name}: its {STEP_WIDTH_KEY} {width.format()!r} names argument "
                    f"{width.input_index} ({arg} of the {len(call)} the delegate is called with), "
                    f"not one of token width up to {bound} along dim {width.dim}"
                )


def _parse_specs(text: str, source: str) -> ArtifactSpecs:
    """:func:`parse_artifact_specs`, its error in one line (pydantic lists every problem on lines
    of their own): the first problem, where it is, and how many more there are."""
    try:
        return parse_artifact_specs(text, source)
    except ArtifactError as exc:
        cause = exc.__cause__
        if isinstance(cause, ValidationError) and cause.errors():
            errors = cause.errors()
            where = ".".join(str(part) for part in errors[0]["loc"]) or "the specs"
            more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
            message = f"{source}: invalid offgraph specs ({SPECS_METHOD}): {safe_text(where)}: {safe_text(errors[0]['msg'])}{more}"
        else:
            message = first_line(exc)
        raise ArtifactError(message[:1000]) from exc


def check_pte(file: BinaryIO, size: int, source: str, data_file: Path | None) -> tuple[ArtifactSpecs, PteLayout]:
    """The specs of the ``.pte`` of ``size`` bytes open as ``file``, after every check: its layout
    (bounded), its digest, its constant methods with one another, its delegates' specs with them,
    and (a cuda program, given ``data_file``) its data file's digest."""
    layout = read_pte_layout(file, size, source)
    try:
        _verify_digest(file, layout, source)  # first: a corrupt file is refused as one
    except OSError as exc:
        raise ArtifactError(f"{source}: cannot read it: {exc}") from exc
    missing = [k for k in _REQUIRED if k not in layout.constants]
    if missing:
        raise ArtifactError(f"{source} has no offgraph specs ({missing}); was it built by `offgraph-export export`?")
    constants = {name: c.text for name, c in layout.constants.items()}
    specs = _parse_specs(constants[SPECS_METHOD], source)
    if spec_constants(specs) != {k: constants[k] for k in spec_constants(specs)}:
        differ = sorted(k for k, v in spec_constants(specs).items() if constants[k] != v)
        raise ArtifactError(f"{source}: its specs ({SPECS_METHOD}) disagree with the {differ} it carries")
    try:
        _verify_data_file(layout, specs, data_file, source)
    except OSError as exc:
        raise ArtifactError(f"{source}: cannot read its data file {data_file}: {exc}") from exc
    check_delegate_specs(layout, specs, source)
    return specs, layout


def _open(path: str | os.PathLike) -> tuple[Path, int]:
    target = regular_file(path)
    size = target.stat().st_size
    if size > MAX_PTE_BYTES:
        raise ArtifactError(f"{path} is {size} bytes; a .pte read here holds at most {MAX_PTE_BYTES}")
    return target, size


def read_pte_constants(path: str | os.PathLike) -> dict[str, str]:
    """The string constant methods of a ``.pte``, read with the bounded reader (the layout only:
    no digest or spec is checked; :func:`read_pte_specs` checks them)."""
    target, size = _open(path)
    try:
        with target.open("rb") as file:
            layout = read_pte_layout(file, size, str(path))
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read it: {exc}") from exc
    return {name: c.text for name, c in layout.constants.items()}


def read_pte_specs(path: str | os.PathLike) -> ArtifactSpecs:
    """The specs of a ``.pte``, after every check of :func:`check_pte` (its data file too, when it
    has one), reading the file in chunks: the flatbuffer whole, the segments only to digest them."""
    target, size = _open(path)
    try:
        with target.open("rb") as file:
            specs, _ = check_pte(file, size, str(path), data_file_path(target))
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read it: {exc}") from exc
    return specs


def load_pte(path: str | os.PathLike) -> tuple[ArtifactSpecs, bytes]:
    """The specs and the bytes of a ``.pte``, read once and checked (:func:`check_pte`): hand the
    runtime these bytes, not the path, so it loads exactly what was checked."""
    target, size = _open(path)
    try:
        data = target.read_bytes()
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read it: {exc}") from exc
    specs, _ = check_pte(io.BytesIO(data), len(data), str(path), data_file_path(target))
    return specs, data
