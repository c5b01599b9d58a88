"""Bounded JSON reading for specs that come from untrusted archives.

``json.loads`` recurses once per nesting level, so a few thousand ``[`` raise ``RecursionError``,
and it reads any size it is handed. Specs are small and shallow (the manifest nests four levels),
so anything deeper than :data:`MAX_JSON_DEPTH` or larger than :data:`MAX_JSON_BYTES` is refused
before parsing, with the same error type as any other malformed spec. Two things Python's parser
takes and JSON does not are refused too: ``NaN``/``Infinity`` (they would be written back as
``null``) and a key given twice in one object (other readers may keep the first).

Within that size, a list or object of a spec (the manifest's layers, the model's inputs, an input's
dims, the symbols, model arguments, options) holds at most :data:`MAX_SPEC_ITEMS` entries, checked
(:data:`LimitedItems`) before any entry is validated.

The archive itself is bounded the same way (``specs/archive.py`` checks these before it reads what
they bound, and again while reading): the count of its entries (:data:`MAX_ARCHIVE_MEMBERS`), the
length of a name and the size of the central directory, what one member and all members declare
uncompressed (:data:`MAX_MEMBER_BYTES`, :data:`MAX_ARCHIVE_BYTES`), how far a deflated member
inflates per byte stored (:data:`MAX_COMPRESSION_RATIO`), and a weight file's size beyond the bytes
its views take (:data:`MAX_TENSOR_FILE_OVERHEAD`, ``runtime/weights.py``). Each value admits a real
package of a large model (a 16 GB 8B model, one weight file of several GB) with room to spare.

A ``.pte`` is read the same way (``specs/pte_reader.py`` reads the few flatbuffer tables it needs
with these bounds, checked before what they bound is read): the file's size
(:data:`MAX_PTE_BYTES`), its flatbuffer part, which is read whole (:data:`MAX_PTE_PROGRAM_BYTES`),
the methods, delegates, compile specs per delegate and segments it may declare, the longest name,
and how many tables and vector entries the reader visits in all (:data:`MAX_PTE_VISITS`): vectors
of a flatbuffer may share offsets, so a file of 40 KB can declare tens of millions of entries.
"""

from __future__ import annotations

import json

from pydantic import BeforeValidator

from offgraph_export.errors import SpecError

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_SPEC_ITEMS",
    "MAX_SPEC_VALUES",
    "MAX_ARCHIVE_MEMBERS",
    "MAX_ENTRY_NAME_BYTES",
    "MAX_CENTRAL_DIRECTORY_BYTES",
    "MAX_MEMBER_BYTES",
    "MAX_ARCHIVE_BYTES",
    "MAX_COMPRESSION_RATIO",
    "MAX_TENSOR_FILE_OVERHEAD",
    "MAX_PTE_BYTES",
    "MAX_PTE_PROGRAM_BYTES",
    "MAX_PTE_METHODS",
    "MAX_PTE_DELEGATES",
    "MAX_PTE_COMPILE_SPECS",
    "MAX_PTE_SEGMENTS",
    "MAX_PTE_NAME_BYTES",
    "MAX_PTE_VISITS",
    "LimitedItems",
    "loads_limited",
]

MAX_JSON_BYTES = 4 << 20
MAX_JSON_DEPTH = 16
#: The most entries one list or object of a spec may hold. :data:`MAX_JSON_BYTES` alone lets a
#: manifest hold a million layers ``{}`` of three bytes each: validated one by one, each costs
#: several errors (gigabytes of them, and a message as long, before the manifest is refused), and a
#: valid layer count sizes every session's storage (two tensors per layer). Real models have a few
#: hundred layers at most, and a handful of inputs of a few dims each.
MAX_SPEC_ITEMS = 4096
#: The most values (object keys plus list items, at any depth) the specs entry or the manifest may
#: hold, counted after parsing and before any validation: the per-collection bound above leaves
#: objects of fixed fields open to thousands of unknown keys, each one validation error. The largest
#: valid manifest (MAX_SPEC_ITEMS layers of 11 values each) holds about 45,000.
MAX_SPEC_VALUES = 16 * MAX_SPEC_ITEMS

#: The most entries a ``.pt2`` archive may hold, read from its end record before its central
#: directory is. A package holds a dozen bookkeeping files, a handful per compiled method and one
#: weight file per stored tensor: an 8B model about 300 entries, the largest manifest
#: (MAX_SPEC_ITEMS layers of a dozen tensors each) about 50,000. 300,000 entries made every check
#: (and torch's loader) parse 300,000 directory records before anything was refused.
MAX_ARCHIVE_MEMBERS = 1 << 16
#: The longest entry name, in bytes: the package's folder (the file's stem, a file name: at most
#: 255 bytes on common file systems) plus torch's paths inside it (under 120 bytes, e.g.
#: ``data/aotinductor/<method>/<52-character hash>.wrapper_metadata.json``).
MAX_ENTRY_NAME_BYTES = 512
#: The largest central directory, read whole once its size is known: MAX_ARCHIVE_MEMBERS records
#: (46 bytes each) of the longest name with a zip64 field (28 bytes), about 38 MB.
MAX_CENTRAL_DIRECTORY_BYTES = MAX_ARCHIVE_MEMBERS * (46 + MAX_ENTRY_NAME_BYTES + 28)
#: The most one member may declare uncompressed. The largest member of a real package is one weight
#: file holding one tensor: an 8B model's embedding is 1 GB in bfloat16 (128256 x 4096 x 2 bytes), a
#: 70B model's 2.1 GB (4.2 GB in float32); 64 GiB admits any one tensor a single accelerator holds.
MAX_MEMBER_BYTES = 1 << 36
#: The most all members together may declare uncompressed. A 16 GB 8B-model package declares 16 GB;
#: 1 TiB admits any package whose weights fit one host's memory, and bounds the work of verifying
#: the checksums and of torch's loader.
MAX_ARCHIVE_BYTES = 1 << 40
#: The most a deflated member may declare per byte it stores. torch's writer (``PyTorchFileWriter``,
#: which writes every member of a ``.pt2`` and of a ``torch.save`` tensor file) has no compression
#: option and stores every member, zero-filled buffers included, and so does this project's specs
#: entry: their ratio is 1, and a stored member's two sizes must be equal. Only another zip writer
#: deflates, getting 2-10x on code, JSON and libraries and ~1.1x on float weights; long runs of one
#: byte or phrase (zero-filled buffers, padding) reach hundreds to deflate's ceiling of about 1032:1,
#: as a bomb does (3 MiB declaring 3 GiB). 64 admits what such a writer makes of a package's files
#: but those runs, and bounds what a deflated archive inflates to at 64 times its size.
MAX_COMPRESSION_RATIO = 64
#: The most a weight file (one ``torch.save``'d tensor) may hold beyond the bytes its views take
#: (checked before it is read): the file is the tensor's storage plus about 1.6 KB of its own (the
#: pickle, five small records, each record's header, 64-byte alignment padding and data
#: descriptor, the directory and zip64 end records); 64 KiB admits any rank and record name.
MAX_TENSOR_FILE_OVERHEAD = 64 << 10

#: The largest ``.pte`` read. A ``.pte`` holds its weights in its segments (a cpu program of an 8B
#: model in float32 is about 32 GB); 64 GiB, the bound on one ``.pt2`` member, admits it.
MAX_PTE_BYTES = MAX_MEMBER_BYTES
#: The largest flatbuffer part of a ``.pte`` (the program tables before its segments), read whole
#: into memory. The writer moves constants and delegate data into segments, so the flatbuffer holds
#: the method tables only: the example's is 58 KB (574 values, 181 instructions, 26 delegates), an
#: LLM's of some thousand instructions per ten layers a few MB; 64 MiB admits ten times the largest.
MAX_PTE_PROGRAM_BYTES = 1 << 26
#: The most methods (execution plans) a ``.pte`` may declare: ``forward`` and this project's four
#: constant methods plus two digests (``specs/pte.py``); 64 leaves room for other writers' extras.
MAX_PTE_METHODS = 64
#: The most delegates one method may declare: an XNNPACK program has a few per layer (the example's
#: 2 layers 26), the largest manifest (MAX_SPEC_ITEMS layers) some 50,000.
MAX_PTE_DELEGATES = 1 << 16
#: The most compile specs one delegate may carry: the backend's own (XNNPACK none, the CUDA backend
#: a few) and this project's two.
MAX_PTE_COMPILE_SPECS = 256
#: The most data segments: one per delegate, plus the constant and named-data segments.
MAX_PTE_SEGMENTS = 2 * MAX_PTE_DELEGATES
#: The longest method name, delegate id or compile-spec key, in bytes (real ones are under 40).
MAX_PTE_NAME_BYTES = 1024
#: The most tables and vector entries the reader visits in one file (each costs a few ``struct``
#: reads, some microseconds): a real program's methods, delegates and their specs, the forward
#: method's instructions and the values its delegate calls name. The example's 58 KB flatbuffer
#: takes 1,069 visits, one per 54 bytes; an LLM of a hundred layers some 10,000 instructions and
#: as many values. At the example's density the largest flatbuffer (MAX_PTE_PROGRAM_BYTES) takes
#: 1.2 million; two million take some seconds. The reader also stops at a quarter of the
#: flatbuffer's bytes (plus 4096), which a file whose targets are not shared cannot reach.
MAX_PTE_VISITS = 1 << 21


def _limit_items(value: object) -> object:
    """``value`` unchanged, or ``ValueError`` when it is a list or object of more than
    :data:`MAX_SPEC_ITEMS` entries."""
    if isinstance(value, (list, dict)) and len(value) > MAX_SPEC_ITEMS:
        raise ValueError(f"{len(value)} entries; a spec's list or object holds at most {MAX_SPEC_ITEMS}")
    return value


#: Annotate a list or dict field of a spec with this (``Annotated[list[X], LimitedItems]``): its
#: entry count is checked before any entry is validated.
LimitedItems = BeforeValidator(_limit_items)


def _depth(text: str) -> int:
    """Deepest ``{``/``[`` nesting of ``text``, ignoring brackets inside strings."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                break
        elif ch in "]}":
            depth -= 1
    return deepest


class _NotJson(ValueError):
    pass


def _no_constant(name: str) -> object:
    raise _NotJson(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _NotJson(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def _count_values(data: object, limit: int) -> int:
    """Object keys plus list items in ``data`` at any depth, counting stopped past ``limit``."""
    count, stack = 0, [data]
    while stack and count <= limit:
        node = stack.pop()
        if isinstance(node, dict):
            count += len(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            count += len(node)
            stack.extend(node)
    return count


def loads_limited(
    text: str | bytes, what: str, error: type[Exception] = SpecError, max_values: int | None = None
) -> object:
    """Parse JSON ``text`` describing ``what``; raise ``error`` naming ``what`` when it is not
    valid JSON, larger than :data:`MAX_JSON_BYTES`, nested deeper than :data:`MAX_JSON_DEPTH`, or
    (given ``max_values``, e.g. :data:`MAX_SPEC_VALUES`) holding more values than that."""
    if not isinstance(text, (str, bytes)):
        raise error(f"{what} is a {type(text).__name__}, not JSON text")
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_JSON_BYTES:
        raise error(f"{what} is {size} bytes; more than the {MAX_JSON_BYTES} a spec may hold")
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if _depth(text) > MAX_JSON_DEPTH:
            raise error(f"{what} nests deeper than {MAX_JSON_DEPTH} levels; not a valid spec")
        data = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not valid JSON: {exc}") from exc
    except _NotJson as exc:
        raise error(f"{what} is not valid JSON: {exc}") from exc
    except ValueError as exc:  # e.g. an integer longer than Python converts (sys.get_int_max_str_digits)
        raise error(f"{what} is not a valid spec: {exc}") from exc
    if max_values is not None and _count_values(data, max_values) > max_values:
        raise error(f"{what} holds more than {max_values} values (keys and list items); not a valid spec")
    return data
