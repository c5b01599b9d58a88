"""A bounded reader of the few tables of an ExecuTorch ``.pte`` that this project needs.

ExecuTorch's own Python deserializer (``deserialize_pte_binary``) unpacks the whole flatbuffer
into Python objects, one per table and vector entry, following every offset it finds. Offsets of
a flatbuffer may point anywhere, so entries may share one target: a 40 KB file whose vectors of
methods, values and lists all point at the same few tables unpacks into tens of millions of
objects. A ``.pte`` is untrusted input, so ``inspect``, the runtime and ``check`` read it here
instead, with ``struct`` and nothing else (no executorch, no torch, no native code), and read only:

- the file header: the flatbuffer's file identifier (``ET12``, the schema this reader follows) and
  ExecuTorch's extended header (``eh00``: the flatbuffer's size, where the segments start and their
  total size), which must describe the file exactly: segments right after the flatbuffer's padding
  and ending at the file's end;
- ``Program.segments`` (each inside the segment data, in order, not overlapping), and the segment
  indices of the constant segment, the mutable data segments and the named data;
- per method (``ExecutionPlan``): its name; its value when it is a constant method (one ``String``
  value: where this project keeps its specs), with the file offset of the text, so a digest
  written into it can be found again; its delegates (backend id, where the delegate's data is,
  compile specs); and its delegate calls (``DelegateCall`` instructions): the delegate each calls
  and, per argument, the planned sizes of the tensor it names.

Every read is bounded before it is made (:mod:`offgraph_export.specs.limits`): the file's and the
flatbuffer's sizes, the count of methods, delegates, compile specs and segments, the length of a
name, the rank of a tensor; every table, vector and string must lie inside the flatbuffer (a
table's vtable too, and each field inside the table's inline size); every index must name an
entry that exists. Because targets may be shared, two budgets bound the work whatever the layout:
the tables and vector entries visited (:data:`~offgraph_export.specs.limits.MAX_PTE_VISITS`, and at
most a quarter of the flatbuffer's bytes plus a constant: each entry of a file that shares nothing
takes four bytes or more) and the bytes of strings and byte vectors returned (at most the
flatbuffer's size; a shared target is returned once). The reader does not recurse: the tables it
reads are a fixed path down from the root. A file outside any bound is refused with one
:class:`~offgraph_export.errors.ArtifactError` line naming the file and the bound.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO, NoReturn

from offgraph_export.errors import ArtifactError
from offgraph_export.specs.limits import (
    MAX_PTE_BYTES,
    MAX_PTE_COMPILE_SPECS,
    MAX_PTE_DELEGATES,
    MAX_PTE_METHODS,
    MAX_PTE_NAME_BYTES,
    MAX_PTE_PROGRAM_BYTES,
    MAX_PTE_SEGMENTS,
    MAX_PTE_VISITS,
)
from offgraph_export.specs.text import safe_text

__all__ = [
    "FILE_IDENTIFIER",
    "MAX_TENSOR_RANK",
    "StringConstant",
    "Delegate",
    "Segment",
    "PteLayout",
    "read_pte_head",
    "parse_pte",
    "read_pte_layout",
]

#: The flatbuffer file identifier of the schema this reader follows (``schema/program.fbs`` of
#: executorch 1.x: ``file_identifier "ET12"``).
FILE_IDENTIFIER = b"ET12"
_EXTENDED_MAGIC = b"eh00"
_EXTENDED_MIN = 24  # magic, length, program size, segment base offset
_EXTENDED_FULL = 32  # ... and the segment data's size
#: The bytes of the head that hold the identifier and the extended header (ExecuTorch's
#: ``NUM_HEAD_BYTES``).
_HEAD_BYTES = 64
#: The highest rank of a tensor whose sizes are read (a decoder's tensors have rank 4 or 5).
MAX_TENSOR_RANK = 64

# Field slots (vtable index) of the tables read, from program.fbs; a union takes two slots, its
# type then its value.
_PROGRAM_PLANS, _PROGRAM_INLINE_DATA, _PROGRAM_SEGMENTS = 1, 3, 4
_PROGRAM_CONSTANT_SEGMENT, _PROGRAM_MUTABLE_SEGMENTS, _PROGRAM_NAMED_DATA = 5, 6, 7
_PLAN_NAME, _PLAN_VALUES, _PLAN_CHAINS, _PLAN_DELEGATES = 0, 2, 5, 7
_CHAIN_INSTRUCTIONS = 2
_INSTRUCTION_TYPE, _INSTRUCTION_ARGS = 0, 1
_DELEGATE_CALL = 2  # InstructionArguments.DelegateCall
_CALL_DELEGATE, _CALL_ARGS = 0, 1
_EVALUE_TYPE, _EVALUE_VAL = 0, 1
_TENSOR_TYPE, _STRING_TYPE = 5, 6  # KernelTypes.Tensor, KernelTypes.String
_TENSOR_SIZES = 2
_STRING_VAL = 0
_DELEGATE_ID, _DELEGATE_PROCESSED, _DELEGATE_SPECS = 0, 1, 2
_REFERENCE_LOCATION, _REFERENCE_INDEX = 0, 1
_INLINE, _SEGMENT = 0, 1  # DataLocation
_SPEC_KEY, _SPEC_VALUE = 0, 1
_SEGMENT_OFFSET, _SEGMENT_SIZE = 0, 1
_SUBSEGMENT_INDEX, _SUBSEGMENT_OFFSETS = 0, 1
_NAMED_SEGMENT = 1

_U8, _U16, _I32, _U32, _U64 = (struct.Struct(f) for f in ("<B", "<H", "<i", "<I", "<Q"))


@dataclass(frozen=True)
class StringConstant:
    """A constant method's string: its text, and where its UTF-8 bytes lie in the file."""

    name: str
    text: str
    offset: int
    size: int


@dataclass(frozen=True)
class Delegate:
    """One delegate of a method, as far as this project reads it."""

    method: str
    index: int
    backend: str
    #: ``(key, value)`` in the file's order; a key may repeat (the checks refuse that by name)
    compile_specs: tuple[tuple[str, bytes], ...]
    #: ``("segment" | "inline", index)``: where the delegate's processed data is
    data: tuple[str, int]
    #: per call of the delegate: per argument, the planned sizes of the tensor it names, or None
    #: for an argument that is not a tensor
    calls: tuple[tuple[tuple[int, ...] | None, ...], ...]


@dataclass(frozen=True)
class Segment:
    """A data segment: where it lies in the file (absolute offset) and its size."""

    offset: int
    size: int


@dataclass(frozen=True)
class PteLayout:
    """What :func:`parse_pte` read: the file's parts, its methods, its constant methods' strings,
    its delegates and its segments."""

    file_size: int
    #: bytes of the flatbuffer, header included (the file's size when there are no segments)
    program_size: int
    #: where the segment data starts (``file_size`` when there is none) and its size
    segment_base: int
    segment_data_size: int
    methods: tuple[str, ...]
    constants: Mapping[str, StringConstant]
    delegates: tuple[Delegate, ...]
    segments: tuple[Segment, ...]


class _Malformed(Exception):
    """Internal: why the flatbuffer cannot be read; :func:`parse_pte` words the ArtifactError."""


class _Flatbuffer:
    """Bounded reads from one flatbuffer: every offset is checked against the buffer, every
    count against its bound, and the visits and bytes returned against the two budgets."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.n = len(buf)
        self.visits = 0
        self.max_visits = min(MAX_PTE_VISITS, self.n // 4 + 4096)
        self.bytes_left = self.n
        self._returned: dict[int, bytes] = {}

    def fail(self, why: str) -> NoReturn:
        raise _Malformed(why)

    def visit(self, count: int = 1) -> None:
        self.visits += count
        if self.visits > self.max_visits:
            self.fail(
                f"reading it visits more than {self.max_visits} tables and vector entries (its "
                f"vectors share or overlap their targets; a {self.n}-byte flatbuffer that shares "
                "nothing has fewer)"
            )

    def unpack(self, fmt: struct.Struct, pos: int, what: str) -> int:
        if pos < 0 or pos + fmt.size > self.n:
            self.fail(f"{what} at byte {pos} lies outside the {self.n}-byte flatbuffer")
        return fmt.unpack_from(self.buf, pos)[0]

    def target(self, pos: int, what: str) -> int:
        """Where the offset stored at ``pos`` points (offsets point forward, within the buffer)."""
        to = pos + self.unpack(_U32, pos, what)
        if to >= self.n:
            self.fail(f"{what} points to byte {to}, outside the {self.n}-byte flatbuffer")
        return to

    def table(self, pos: int, what: str) -> "_Table":
        self.visit()
        vtable = pos - self.unpack(_I32, pos, what)
        vt_size = self.unpack(_U16, vtable, f"the vtable of {what}")
        inline = self.unpack(_U16, vtable + 2, f"the vtable of {what}")
        if vt_size < 4 or vt_size % 2 or vtable + vt_size > self.n:
            self.fail(f"the vtable of {what} declares {vt_size} bytes at byte {vtable}; not a vtable")
        if inline < 4 or pos + inline > self.n:
            self.fail(f"{what} declares {inline} inline bytes at byte {pos}, past the flatbuffer's end")
        return _Table(self, pos, vtable, vt_size, inline, what)

    def vector(self, pos: int, elem: int, limit: int, what: str) -> tuple[int, int]:
        """``(first element's position, count)`` of the vector at ``pos``."""
        count = self.unpack(_U32, pos, f"the length of {what}")
        if count > limit:
            self.fail(f"{what} declares {count} entries; at most {limit} are read")
        if pos + 4 + count * elem > self.n:
            self.fail(f"{what} declares {count} entries, past the flatbuffer's end")
        return pos + 4, count

    def data(self, pos: int, limit: int, what: str, string: bool) -> bytes:
        """The bytes of the string or byte vector at ``pos`` (a shared target is charged once)."""
        if pos in self._returned:
            return self._returned[pos]
        size = self.unpack(_U32, pos, f"the length of {what}")
        if size > limit:
            self.fail(f"{what} declares {size} bytes; at most {limit} are read")
        end = pos + 4 + size
        if end + (1 if string else 0) > self.n:  # a string is followed by its NUL
            self.fail(f"{what} declares {size} bytes, past the flatbuffer's end")
        self.bytes_left -= size
        if self.bytes_left < 0:
            self.fail(f"its strings and byte vectors add up to more than the flatbuffer's {self.n} bytes (they overlap)")
        value = self._returned[pos] = self.buf[pos + 4 : end]
        return value


class _Table:
    """One table: its fields, found through its vtable."""

    def __init__(self, fb: _Flatbuffer, pos: int, vtable: int, vt_size: int, inline: int, what: str) -> None:
        self.fb, self.pos, self.vtable, self.vt_size, self.inline, self.what = fb, pos, vtable, vt_size, inline, what

    def field(self, slot: int, size: int) -> int | None:
        """Position of field ``slot`` (``size`` bytes inline), or None when it is absent."""
        entry = 4 + 2 * slot
        if entry + 2 > self.vt_size:
            return None
        offset = self.fb.unpack(_U16, self.vtable + entry, f"the vtable of {self.what}")
        if offset == 0:
            return None
        if offset + size > self.inline:
            self.fb.fail(f"field {slot} of {self.what} lies outside the table's {self.inline} inline bytes")
        return self.pos + offset

    def scalar(self, slot: int, fmt: struct.Struct, default: int = 0) -> int:
        at = self.field(slot, fmt.size)
        return default if at is None else self.fb.unpack(fmt, at, f"field {slot} of {self.what}")

    def ref(self, slot: int, what: str) -> int | None:
        at = self.field(slot, 4)
        return None if at is None else self.fb.target(at, what)

    def table(self, slot: int, what: str) -> "_Table | None":
        to = self.ref(slot, what)
        return None if to is None else self.fb.table(to, what)

    def string(self, slot: int, limit: int, what: str) -> tuple[bytes, int] | None:
        """``(bytes, file position of the first byte)`` of a string field, or None."""
        to = self.ref(slot, what)
        return None if to is None else (self.fb.data(to, limit, what, string=True), to + 4)

    def vector(self, slot: int, elem: int, limit: int, what: str) -> tuple[int, int]:
        to = self.ref(slot, what)
        return (0, 0) if to is None else self.fb.vector(to, elem, limit, what)

    def tables(self, slot: int, limit: int, what: str) -> list["_Table"]:
        start, count = self.vector(slot, 4, limit, what)
        return [self.fb.table(self.fb.target(start + 4 * i, f"{what}[{i}]"), f"{what}[{i}]") for i in range(count)]


def _name(raw: tuple[bytes, int] | None, what: str, fb: _Flatbuffer) -> str:
    if raw is None:
        fb.fail(f"{what} has no name")
    try:
        return raw[0].decode("utf-8")
    except UnicodeDecodeError:
        fb.fail(f"{what} is not UTF-8")


def _ints(fb: _Flatbuffer, start: int, count: int, fmt: struct.Struct, what: str) -> list[int]:
    fb.visit(count)
    return [fb.unpack(fmt, start + fmt.size * i, what) for i in range(count)]


class _Method:
    """The parts of one ExecutionPlan read: name, constant string, delegates and their calls."""

    def __init__(self, fb: _Flatbuffer, plan: _Table, index: int, n_segments: int, n_inline: int) -> None:
        self.fb, self.plan = fb, plan
        self.name = _name(plan.string(_PLAN_NAME, MAX_PTE_NAME_BYTES, f"method {index}'s name"), f"method {index}", fb)
        self.label = f"method {safe_text(self.name)!r}"
        self.values_start, self.n_values = plan.vector(_PLAN_VALUES, 4, fb.n // 4, f"the values of {self.label}")
        self._sizes: dict[int, tuple[int, ...] | None] = {}
        self.constant = self._constant()
        self.delegates = self._delegates(n_segments, n_inline)

    def _value(self, index: int) -> _Table:
        what = f"value {index} of {self.label}"
        return self.fb.table(self.fb.target(self.values_start + 4 * index, what), what)

    def _constant(self) -> tuple[str, int, int] | None:
        """``(text, position, size)`` when the method is a constant method returning a string."""
        if self.n_values != 1:
            return None
        value = self._value(0)
        if value.scalar(_EVALUE_TYPE, _U8) != _STRING_TYPE:
            return None
        string = value.table(_EVALUE_VAL, f"the string of {self.label}")
        raw = None if string is None else string.string(_STRING_VAL, self.fb.n, f"the string of {self.label}")
        if raw is None:
            self.fb.fail(f"the string of {self.label} has no value")
        try:
            return raw[0].decode("utf-8"), raw[1], len(raw[0])
        except UnicodeDecodeError:
            self.fb.fail(f"the string of {self.label} is not UTF-8")

    def _sizes_of(self, index: int, what: str) -> tuple[int, ...] | None:
        """The planned sizes of value ``index`` when it is a tensor (read once per value)."""
        if index in self._sizes:
            return self._sizes[index]
        if not 0 <= index < self.n_values:
            self.fb.fail(f"{what} names value {index}; {self.label} has {self.n_values}")
        value = self._value(index)
        sizes = None
        if value.scalar(_EVALUE_TYPE, _U8) == _TENSOR_TYPE:
            tensor = value.table(_EVALUE_VAL, f"tensor {index} of {self.label}")
            if tensor is None:
                self.fb.fail(f"value {index} of {self.label} is a tensor with no table")
            start, rank = tensor.vector(_TENSOR_SIZES, 4, MAX_TENSOR_RANK, f"the sizes of tensor {index} of {self.label}")
            sizes = tuple(_ints(self.fb, start, rank, _I32, f"the sizes of tensor {index}"))
        self._sizes[index] = sizes
        return sizes

    def _delegates(self, n_segments: int, n_inline: int) -> list[Delegate]:
        fb, label = self.fb, self.label
        found = []
        for index, table in enumerate(self.plan.tables(_PLAN_DELEGATES, MAX_PTE_DELEGATES, f"the delegates of {label}")):
            what = f"delegate {index} of {label}"
            backend = _name(table.string(_DELEGATE_ID, MAX_PTE_NAME_BYTES, f"the id of {what}"), f"{what}'s id", fb)
            reference = table.table(_DELEGATE_PROCESSED, f"the data reference of {what}")
            if reference is None:
                fb.fail(f"{what} has no data reference")
            location = reference.scalar(_REFERENCE_LOCATION, _U8)
            data_index = reference.scalar(_REFERENCE_INDEX, _U32)
            if location not in (_INLINE, _SEGMENT):
                fb.fail(f"{what} keeps its data at location {location}; neither inline (0) nor a segment (1)")
            n_data, kind = (n_segments, "segment") if location == _SEGMENT else (n_inline, "inline")
            if data_index >= n_data:
                fb.fail(f"{what} names {kind} data {data_index}; the program has {n_data}")
            specs = []
            for s, spec in enumerate(table.tables(_DELEGATE_SPECS, MAX_PTE_COMPILE_SPECS, f"the compile specs of {what}")):
                spec_what = f"compile spec {s} of {what}"
                key = _name(spec.string(_SPEC_KEY, MAX_PTE_NAME_BYTES, f"the key of {spec_what}"), f"{spec_what}'s key", fb)
                value_at = spec.ref(_SPEC_VALUE, f"the value of {spec_what}")
                value = b"" if value_at is None else fb.data(value_at, fb.n, f"the value of {spec_what}", string=False)
                specs.append((key, value))
            found.append(Delegate(self.name, index, backend, tuple(specs), (kind, data_index), ()))
        calls: list[list[tuple[tuple[int, ...] | None, ...]]] = [[] for _ in found]
        for c, chain in enumerate(self.plan.tables(_PLAN_CHAINS, fb.n // 4, f"the chains of {label}")):
            start, count = chain.vector(_CHAIN_INSTRUCTIONS, 4, fb.n // 4, f"the instructions of chain {c} of {label}")
            for i in range(count):
                what = f"instruction {i} of chain {c} of {label}"
                instruction = fb.table(fb.target(start + 4 * i, what), what)
                if instruction.scalar(_INSTRUCTION_TYPE, _U8) != _DELEGATE_CALL:
                    continue
                call = instruction.table(_INSTRUCTION_ARGS, f"the delegate call of {what}")
                if call is None:
                    fb.fail(f"{what} is a delegate call with no arguments table")
                delegate = call.scalar(_CALL_DELEGATE, _I32)
                if not 0 <= delegate < len(found):
                    fb.fail(f"{what} calls delegate {delegate}; {label} has {len(found)}")
                args_start, n_args = call.vector(_CALL_ARGS, 4, fb.n // 4, f"the arguments of {what}")
                args = _ints(fb, args_start, n_args, _I32, f"the arguments of {what}")
                calls[delegate].append(tuple(self._sizes_of(a, f"{what}") for a in args))
        return [
            Delegate(d.method, d.index, d.backend, d.compile_specs, d.data, tuple(calls[d.index])) for d in found
        ]


def _refused(source: str, why: str) -> ArtifactError:
    return ArtifactError(f"{source} is not a readable .pte program: {why}")


def read_pte_head(file: BinaryIO, size: int, source: str) -> tuple[bytes, int, int, int]:
    """``(flatbuffer bytes, program size, segment base, segment data size)`` of the ``.pte`` of
    ``size`` bytes open as ``file``: the header is checked and only the flatbuffer is read."""
    if size > MAX_PTE_BYTES:
        raise _refused(source, f"it is {size} bytes; at most {MAX_PTE_BYTES} are read")
    file.seek(0)
    head = file.read(_HEAD_BYTES)
    if len(head) < 8:
        raise _refused(source, f"it is {len(head)} bytes, shorter than a flatbuffer's header")
    if head[4:8] != FILE_IDENTIFIER:
        raise _refused(source, f"its file identifier is {safe_text(repr(head[4:8]))}, not {FILE_IDENTIFIER!r} (an ExecuTorch program of the schema this reader knows)")
    program_size, base, data_size = size, size, 0
    if head[8:12] == _EXTENDED_MAGIC:
        if len(head) < 8 + _EXTENDED_FULL:
            raise _refused(source, f"it is {size} bytes, shorter than its extended header")
        length, program_size, base, data_size = struct.unpack_from("<IQQQ", head, 12)
        if length < _EXTENDED_FULL:
            raise _refused(source, f"its extended header is {length} bytes; this reader needs the {_EXTENDED_FULL} that give the segment data's size")
        if not 8 + _EXTENDED_FULL <= program_size <= size:
            raise _refused(source, f"its header gives the flatbuffer {program_size} bytes; the file has {size}")
        if base == 0 and data_size == 0:
            base = size
            if program_size != size:
                raise _refused(source, f"it has {size - program_size} bytes after its {program_size}-byte flatbuffer and no segments")
        elif not program_size <= base <= size or base + data_size != size:
            raise _refused(
                source,
                f"its header places {data_size} bytes of segments at byte {base}; the flatbuffer ends at "
                f"byte {program_size} and the file at byte {size} (segments must run from the first to the last)",
            )
    if program_size > MAX_PTE_PROGRAM_BYTES:
        raise _refused(source, f"its flatbuffer is {program_size} bytes; at most {MAX_PTE_PROGRAM_BYTES} are read")
    file.seek(0)
    buf = file.read(program_size)
    if len(buf) != program_size:
        raise _refused(source, f"it ended after {len(buf)} of its flatbuffer's {program_size} bytes")
    return buf, program_size, base, data_size


def parse_pte(buf: bytes, file_size: int, segment_base: int, segment_data_size: int, source: str) -> PteLayout:
    """Read the tables this project needs from the flatbuffer ``buf`` (see the module docstring)."""
    fb = _Flatbuffer(buf)
    try:
        program = fb.table(fb.target(0, "the root offset"), "the program")
        start, n_segments = program.vector(_PROGRAM_SEGMENTS, 4, MAX_PTE_SEGMENTS, "the program's segments")
        segments = []
        end = 0
        for i in range(n_segments):
            what = f"segment {i}"
            table = fb.table(fb.target(start + 4 * i, what), what)
            offset, size = table.scalar(_SEGMENT_OFFSET, _U64), table.scalar(_SEGMENT_SIZE, _U64)
            if offset < end or offset + size > segment_data_size:
                fb.fail(
                    f"{what} spans bytes {offset}..{offset + size} of the segment data; segments lie "
                    f"in order, apart, within its {segment_data_size} bytes"
                )
            end = offset + size
            segments.append(Segment(segment_base + offset, size))
        _, n_inline = program.vector(_PROGRAM_INLINE_DATA, 4, MAX_PTE_DELEGATES, "the program's inline delegate data")
        constant = program.table(_PROGRAM_CONSTANT_SEGMENT, "the constant segment")
        subsegments = [("the constant segment", constant)] if constant is not None else []
        subsegments += [
            (f"mutable data segment {i}", t)
            for i, t in enumerate(program.tables(_PROGRAM_MUTABLE_SEGMENTS, MAX_PTE_SEGMENTS, "the mutable data segments"))
        ]
        for what, table in subsegments:
            offsets_start, n_offsets = table.vector(_SUBSEGMENT_OFFSETS, 8, fb.n // 8, f"the offsets of {what}")
            if n_offsets == 0:
                continue
            index = table.scalar(_SUBSEGMENT_INDEX, _U32)
            if index >= n_segments:
                fb.fail(f"{what} names segment {index}; the program has {n_segments}")
            for offset in _ints(fb, offsets_start, n_offsets, _U64, f"the offsets of {what}"):
                if offset > segments[index].size:
                    fb.fail(f"{what} has an offset {offset} past its segment's {segments[index].size} bytes")
        for i, named in enumerate(program.tables(_PROGRAM_NAMED_DATA, MAX_PTE_SEGMENTS, "the named data")):
            index = named.scalar(_NAMED_SEGMENT, _U32)
            if index >= n_segments:
                fb.fail(f"named data {i} names segment {index}; the program has {n_segments}")
        plans = program.tables(_PROGRAM_PLANS, MAX_PTE_METHODS, "the program's methods")
        if not plans:
            fb.fail("it declares no method")
        methods = [_Method(fb, plan, i, n_segments, n_inline) for i, plan in enumerate(plans)]
    except _Malformed as exc:
        raise _refused(source, str(exc)) from None
    names = [m.name for m in methods]
    twice = sorted({safe_text(n) for n in names if names.count(n) > 1})
    if twice:
        raise _refused(source, f"it declares methods {twice} more than once")
    constants = {
        m.name: StringConstant(m.name, m.constant[0], m.constant[1], m.constant[2])
        for m in methods
        if m.constant is not None
    }
    return PteLayout(
        file_size=file_size,
        program_size=len(buf),
        segment_base=segment_base,
        segment_data_size=segment_data_size,
        methods=tuple(names),
        constants=constants,
        delegates=tuple(d for m in methods for d in m.delegates),
        segments=tuple(segments),
    )


def read_pte_layout(file: BinaryIO, size: int, source: str) -> PteLayout:
    """:func:`read_pte_head` then :func:`parse_pte`: the layout of the ``.pte`` open as ``file``."""
    buf, _, base, data_size = read_pte_head(file, size, source)
    return parse_pte(buf, size, base, data_size, source)
