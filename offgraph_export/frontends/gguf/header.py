"""The fixed header of a GGUF file, read and bounded before any GGUF reader sees the file.

A GGUF file starts with the magic ``GGUF``, a format version, the count of its tensors and the
count of its metadata entries (24 bytes, little-endian; big-endian files exist too, and are told
apart by the version). A file is untrusted: these counts decide how long a reader loops and what it
allocates before it finds anything wrong, so a file that is not a GGUF, of a version the ``gguf``
package does not read, or declaring more tensors or metadata than any model file holds is refused
here by name, from 24 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from offgraph_export.frontends.hf.validate import MAX_LAYERS
from offgraph_export.specs.limits import MAX_SPEC_ITEMS

__all__ = ["GGUF_MAGIC", "HEADER_BYTES", "MAX_TENSORS", "MAX_METADATA", "VERSIONS", "GGUFHeader", "header_problem"]

GGUF_MAGIC = b"GGUF"
#: magic, version (uint32), tensor count (uint64), metadata count (uint64)
HEADER_BYTES = 24
#: The format versions the ``gguf`` package reads (1 was superseded in 2023).
VERSIONS = (2, 3)
#: The most tensors a file may declare: a decoder layer stores 9-20 (a mixture of experts merges
#: its experts into one tensor per projection), so 64 per layer of the most layers a checkpoint may have.
MAX_TENSORS = 64 * MAX_LAYERS
#: The most metadata entries a file may declare (real files hold 30-60: the architecture's sizes,
#: the tokenizer's arrays, a chat template), as many as a spec's object may hold.
MAX_METADATA = MAX_SPEC_ITEMS


@dataclass(frozen=True)
class GGUFHeader:
    """What the first 24 bytes of a GGUF file declare."""

    version: int
    tensors: int
    metadata: int
    byte_order: str  # "<" little-endian, ">" big-endian


def _read(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(HEADER_BYTES)


def header_problem(path: Path) -> tuple[GGUFHeader | None, str | None]:
    """The header of ``path`` (a regular file), or a one-line problem saying what is wrong with it
    and what was expected."""
    try:
        head = _read(path)
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror or exc}"
    if head[:4] != GGUF_MAGIC:
        return None, f"not a GGUF file: it starts with {head[:4]!r}, not the magic {GGUF_MAGIC!r}"
    if len(head) < HEADER_BYTES:
        return None, f"not a GGUF file: {len(head)} bytes, shorter than the {HEADER_BYTES}-byte header"
    for order in "<>":
        version, tensors, metadata = struct.unpack(f"{order}IQQ", head[4:])
        if version in VERSIONS:
            break
    else:
        version = struct.unpack("<I", head[4:8])[0]
        return None, f"GGUF version {version} is not read (versions {' and '.join(map(str, VERSIONS))} are)"
    if tensors > MAX_TENSORS:
        return None, f"declares {tensors} tensors, more than the {MAX_TENSORS} a model file may hold"
    if tensors == 0:
        return None, "declares no tensors: a GGUF holding only metadata has no weights to load"
    if metadata > MAX_METADATA:
        return None, f"declares {metadata} metadata entries, more than the {MAX_METADATA} a model file may hold"
    return GGUFHeader(version, tensors, metadata, order), None
