"""Hostile ``.pte`` files (issue 25): no corrupted, edited or oversized program reaches ExecuTorch's
runtime, and reading one costs bounded time and memory.

Every file here is derived from ONE real ``.pte`` (the example through XNNPACK, built once per
session and shared with ``tests/test_executorch.py``) or built by hand as a flatbuffer a few KB
long. Each is refused with one :class:`ArtifactError` line naming the file and what is wrong,
within a second and a few MiB of Python allocations, before ExecuTorch's runtime is called (a spy
stands in for it) and, for ``inspect``, with no torch or executorch imported. Edits are tried twice
where it matters: as they are (the digest refuses them) and with the digest recomputed the way
``docs/design.md`` describes it, as an editor who knows the scheme would (the cross-checks refuse
them). The untouched file, and the scheme recomputed over it, still load and pass the check.
"""

from __future__ import annotations

import copy
import hashlib
import io
import random
import re
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

pytest.importorskip("executorch")

from offgraph_export.errors import ArtifactError  # noqa: E402
from offgraph_export.runtime.pte_artifact import PteArtifact  # noqa: E402
from offgraph_export.specs.artifact import parse_artifact_specs  # noqa: E402
from offgraph_export.specs.limits import MAX_PTE_COMPILE_SPECS, MAX_PTE_DELEGATES, MAX_PTE_METHODS  # noqa: E402
from offgraph_export.specs.manifest import MANIFEST_KEY  # noqa: E402
from offgraph_export.specs.pte import (  # noqa: E402
    DATA_DIGEST_METHOD,
    DIGEST_METHOD,
    SPECS_METHOD,
    digest_placeholders,
    file_digest,
    load_pte,
    read_pte_specs,
    seal_pte,
)
from offgraph_export.specs.pte_reader import PteLayout, read_pte_layout  # noqa: E402
from offgraph_export.specs.step_width import STEP_WIDTH_KEY  # noqa: E402
from tests.conftest import ROOT, cli  # noqa: E402
from tests.test_executorch import example_pte_path  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    return example_pte_path(tmp_path_factory).read_bytes()


@pytest.fixture
def runtime_calls(monkeypatch) -> list:
    """ExecuTorch's runtime, replaced by a spy: a refused file must never reach it."""
    from executorch.runtime import Runtime

    calls: list = []
    monkeypatch.setattr(Runtime, "get", staticmethod(lambda: calls.append("Runtime.get") or pytest.fail("reached the runtime")))
    return calls


def layout(data: bytes) -> PteLayout:
    return read_pte_layout(io.BytesIO(data), len(data), "test.pte")


def write(tmp_path: Path, data: bytes, name: str = "hostile.pte") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def refused(call, message: str, seconds: float = 1.0, mebibytes: int = 64) -> str:
    """``call()`` raises a one-line ArtifactError matching ``message`` within ``seconds`` and (run
    again under tracemalloc, which slows Python several times) ``mebibytes`` of Python allocations."""
    start = time.perf_counter()
    with pytest.raises(ArtifactError, match=message) as info:
        call()
    elapsed = time.perf_counter() - start
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactError, match=message):
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    text = str(info.value)
    assert "\n" not in text, text
    assert elapsed < seconds, f"refused after {elapsed:.2f}s: {text}"
    assert peak < mebibytes << 20, f"refusing took {peak >> 20} MiB: {text}"
    return text


def refused_before_runtime(path: Path, message: str, runtime_calls: list) -> str:
    """Refused by the reader (``inspect``'s path) and by the runtime's loader, which never calls
    ExecuTorch's runtime for it; both messages name the file."""
    text = refused(lambda: read_pte_specs(path), message)
    assert str(path) in text, text
    refused(lambda: PteArtifact.load(path), message, seconds=2.0)
    assert runtime_calls == []
    return text


# -- the digest as docs/design.md describes it, written independently of specs/pte.py ------------

_PREFIX = b"sha256:tables="
_BETWEEN = b",segments="


def reseal(data: bytes) -> bytes:
    """``data`` with its digest recomputed: what an editor who knows the scheme does after an edit.
    ``segments`` is the SHA-256 of the bytes from the segment base on; ``tables`` that of the bytes
    before it, its own 64 digits read as ``0``."""
    where = layout(data)
    slot = where.constants[DIGEST_METHOD]
    out = bytearray(data)
    tables_at = slot.offset + len(_PREFIX)
    segments_at = tables_at + 64 + len(_BETWEEN)
    out[segments_at : segments_at + 64] = hashlib.sha256(data[where.segment_base :]).hexdigest().encode()
    out[tables_at : tables_at + 64] = b"0" * 64
    out[tables_at : tables_at + 64] = hashlib.sha256(bytes(out[: where.segment_base])).hexdigest().encode()
    return bytes(out)


# -- where things lie in the real file (a walk of its own, not the reader's) ----------------------


def _u32(buf: bytes, at: int) -> int:
    return struct.unpack_from("<I", buf, at)[0]


def _target(buf: bytes, at: int) -> int:
    return at + _u32(buf, at)


def _field_at(buf: bytes, table: int, slot: int) -> int:
    """Where field ``slot`` of the table at ``table`` is stored."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    return table + struct.unpack_from("<H", buf, vtable + 4 + 2 * slot)[0]


def _field(buf: bytes, table: int, slot: int) -> int:
    return _target(buf, _field_at(buf, table, slot))


def _entries(buf: bytes, vector: int) -> list[int]:
    return [_target(buf, vector + 4 + 4 * i) for i in range(_u32(buf, vector))]


class Places:
    """Positions in the real file: the program's vectors, the forward method's, and each
    delegate's compile-spec keys and values (``(delegate, key) -> (key string, value vector)``)."""

    def __init__(self, buf: bytes) -> None:
        self.root = _target(buf, 0)
        self.plans = _field(buf, self.root, 1)
        self.segments = _field(buf, self.root, 4)
        self.forward = _entries(buf, self.plans)[0]
        name = _field(buf, self.forward, 0)
        assert buf[name + 4 : name + 4 + _u32(buf, name)] == b"forward"
        self.name = name
        self.values = _field(buf, self.forward, 2)
        self.delegates = _field(buf, self.forward, 7)
        self.specs: dict[tuple[int, str], tuple[int, int]] = {}
        for index, delegate in enumerate(_entries(buf, self.delegates)):
            for spec in _entries(buf, _field(buf, delegate, 2)):
                key, value = _field(buf, spec, 0), _field(buf, spec, 1)
                self.specs[(index, buf[key + 4 : key + 4 + _u32(buf, key)].decode())] = (key, value)

    def value(self, buf: bytes, delegate: int, key: str) -> tuple[int, int]:
        """``(start, end)`` of the bytes of a delegate's compile spec value."""
        vector = self.specs[(delegate, key)][1]
        return vector + 4, vector + 4 + _u32(buf, vector)


def edited(data: bytes, start: int, end: int, old: bytes, new: bytes) -> bytes:
    """``data`` with ``old`` replaced by ``new`` (the same length) inside ``data[start:end]``."""
    assert len(old) == len(new)
    part = data[start:end]
    assert old in part, (old, part[:80])
    return data[:start] + part.replace(old, new) + data[end:]


def set_u32(data: bytes, at: int, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<I", out, at, value)
    return bytes(out)


def set_u64(data: bytes, at: int, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<Q", out, at, value)
    return bytes(out)


# -- the untouched file ----------------------------------------------------------------------------


def test_the_scheme_in_the_docs_is_the_one_written(good):
    assert reseal(good) == good
    text = layout(good).constants[DIGEST_METHOD].text
    assert re.fullmatch(r"sha256:tables=[0-9a-f]{64},segments=[0-9a-f]{64}", text)


def test_the_untouched_file_loads_and_passes_the_check(good, tmp_path, example_bundle):
    from offgraph_export.check import check_artifact

    path = write(tmp_path, good, "untouched.pte")
    read_pte_specs(path)
    artifact = PteArtifact.load(path)
    report = check_artifact(artifact, example_bundle, decode_steps=2, prefill_chunks=1)
    assert report.passed, report.render()


# -- corruption: single flipped bytes ----------------------------------------------------------------


def test_a_flipped_byte_in_delegate_data_is_refused(good, tmp_path, runtime_calls):
    where = layout(good)
    delegate = where.delegates[0]
    assert delegate.data[0] == "segment"
    segment = where.segments[delegate.data[1]]
    out = bytearray(good)
    out[segment.offset + segment.size // 2] ^= 0x01
    text = refused_before_runtime(write(tmp_path, bytes(out)), r"its segment data \(bytes \d+\.\.\d+: the delegates' compiled data", runtime_calls)
    assert DIGEST_METHOD in text


def test_a_flipped_byte_in_the_program_tables_is_refused(good, tmp_path, runtime_calls):
    """In the manifest's text, where the flatbuffer stays readable: only the digest sees it."""
    manifest = layout(good).constants[MANIFEST_KEY]
    out = edited(good, manifest.offset, manifest.offset + manifest.size, b'"max_capacity":256', b'"max_capacity":257')
    refused_before_runtime(write(tmp_path, out), r"its program tables \(bytes 0\.\.\d+: methods, values, instructions, specs\) do not match the digest", runtime_calls)


def test_no_single_flipped_byte_anywhere_reaches_the_runtime(good, tmp_path, runtime_calls):
    """Every part of the file: the header, the root and vtables, the digest's own digits, the
    padding before the segments, each segment, the last byte, and a seeded sample of the rest."""
    where = layout(good)
    digest = where.constants[DIGEST_METHOD]
    positions = {0, 4, 8, 12, 20, 28, 36, where.program_size - 1, where.segment_base - 1, len(good) - 1,
                 digest.offset + len(_PREFIX), digest.offset + digest.size - 1}
    positions |= {segment.offset for segment in where.segments}
    positions |= set(random.Random(25).sample(range(len(good)), 120))
    path = tmp_path / "flipped.pte"
    start = time.perf_counter()
    for position in sorted(positions):
        out = bytearray(good)
        out[position] ^= 0x01
        path.write_bytes(bytes(out))
        with pytest.raises(ArtifactError) as info:
            PteArtifact.load(path)
        assert "\n" not in str(info.value) and str(path) in str(info.value), (position, str(info.value))
    assert runtime_calls == []
    assert time.perf_counter() - start < 30


# -- edits the digest is recomputed for: the cross-checks ------------------------------------------


def test_a_delegate_manifest_edited_is_refused_by_name(good, tmp_path, runtime_calls):
    places = Places(good)
    start, end = places.value(good, 5, MANIFEST_KEY)
    out = edited(good, start, end, b'"max_capacity":256', b'"max_capacity":512')
    refused_before_runtime(write(tmp_path, out, "raw.pte"), "its program tables .* do not match the digest", runtime_calls)
    refused_before_runtime(
        write(tmp_path, reseal(out)),
        r"delegate 5 \(XnnpackBackend\) of method 'forward': its offgraph_kv_manifest disagrees with the "
        r"program's \(offgraph_kv_manifest constant method\) at max_capacity \(512, not 256\)",
        runtime_calls,
    )


def test_a_delegate_width_edited_is_refused_by_name(good, tmp_path, runtime_calls):
    places = Places(good)
    delegate = min(d for d, key in places.specs if key == STEP_WIDTH_KEY)
    start, end = places.value(good, delegate, STEP_WIDTH_KEY)
    width = good[start:end]
    out = good[: end - 1] + b"9" + good[end:]  # the dim: 9, past every argument's rank
    refused_before_runtime(
        write(tmp_path, reseal(out)),
        rf"delegate {delegate} \(XnnpackBackend\) of method 'forward': its offgraph_kv_step_width "
        rf"'{width[:-1].decode()}9' names argument \d+ \(planned sizes \[.*\] of the \d+ the delegate is called with\), "
        r"not one of token width up to 32 along dim 9",
        runtime_calls,
    )
    out = good[: end - 1] + b"x" + good[end:]
    refused_before_runtime(write(tmp_path, reseal(out)), r"its offgraph_kv_step_width b'\d:x' is not 'input_index:dim'", runtime_calls)


def test_an_unknown_offgraph_compile_spec_is_refused(good, tmp_path, runtime_calls):
    places = Places(good)
    key = places.specs[(2, MANIFEST_KEY)][0]
    out = edited(good, key + 4, key + 4 + len(MANIFEST_KEY), b"manifest", b"manifesX")
    refused_before_runtime(
        write(tmp_path, reseal(out)),
        r"delegate 2 \(XnnpackBackend\) of method 'forward' carries compile spec 'offgraph_kv_manifesX', "
        "which offgraph-export does not write",
        runtime_calls,
    )


def test_constant_specs_edited_consistently_but_not_the_delegates_are_refused(good, tmp_path, runtime_calls):
    """The manifest constant and the whole specs agree with each other (and the digest is
    recomputed): every delegate still carries the manifest it was compiled with."""
    where = layout(good)
    out = good
    for name in (MANIFEST_KEY, SPECS_METHOD):
        constant = where.constants[name]
        out = edited(out, constant.offset, constant.offset + constant.size, b'"max_capacity":256', b'"max_capacity":512')
    out = reseal(out)
    edited_specs = parse_artifact_specs(layout(out).constants[SPECS_METHOD].text)
    assert edited_specs.manifest.to_json() == layout(out).constants[MANIFEST_KEY].text  # consistent
    refused_before_runtime(
        write(tmp_path, out),
        r"delegate 0 \(XnnpackBackend\) of method 'forward': its offgraph_kv_manifest disagrees with the "
        r"program's \(offgraph_kv_manifest constant method\) at max_capacity \(256, not 512\)",
        runtime_calls,
    )


def test_the_specs_edited_alone_are_refused_by_name(good, tmp_path, runtime_calls):
    constant = layout(good).constants[SPECS_METHOD]
    out = edited(good, constant.offset, constant.offset + constant.size, b'"max_capacity":256', b'"max_capacity":512')
    refused_before_runtime(
        write(tmp_path, reseal(out)),
        r"its specs \(offgraph_specs\) disagree with the \['offgraph_kv_manifest'\] it carries",
        runtime_calls,
    )


def test_a_digest_that_is_not_one_is_refused(good, tmp_path, runtime_calls):
    digest = layout(good).constants[DIGEST_METHOD]
    out = edited(good, digest.offset, digest.offset + digest.size, b"sha256:tables=", b"sha257:tables=")
    refused_before_runtime(write(tmp_path, out), r"its offgraph_digest 'sha257:tables=.*' is not 'sha256:tables=", runtime_calls)


# -- truncated, extended, and huge declared sizes and counts ---------------------------------------


def _truncations(good: bytes) -> list[tuple[str, bytes, str]]:
    where = layout(good)
    return [
        ("empty", b"", "it is 0 bytes, shorter than a flatbuffer's header"),
        ("identifier only", good[:7], "shorter than a flatbuffer's header"),
        ("half a header", good[:30], "shorter than its extended header"),
        ("inside the tables", good[: where.program_size - 1], r"its header gives the flatbuffer \d+ bytes; the file has \d+"),
        ("no segments", good[: where.segment_base], r"places \d+ bytes of segments at byte \d+"),
        ("last byte cut", good[:-1], "segments must run from the first to the last"),
        ("a byte appended", good + b"\0", "segments must run from the first to the last"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_a_truncated_or_extended_file_is_refused(case, good, tmp_path, runtime_calls):
    what, data, message = _truncations(good)[case]
    refused_before_runtime(write(tmp_path, data), message, runtime_calls)


def _huge(good: bytes) -> list[tuple[str, bytes, str]]:
    places = Places(good)
    spec_value = places.specs[(0, MANIFEST_KEY)][1]
    return [
        ("methods", set_u32(good, places.plans, 0xFFFFFFFF),
         rf"the program's methods declares 4294967295 entries; at most {MAX_PTE_METHODS} are read"),
        ("delegates", set_u32(good, places.delegates, 1 << 20),
         rf"the delegates of method 'forward' declares 1048576 entries; at most {MAX_PTE_DELEGATES} are read"),
        ("values", set_u32(good, places.values, 1 << 28), r"the values of method 'forward' declares 268435456 entries"),
        ("segments", set_u32(good, places.segments, 1 << 30), r"the program's segments declares 1073741824 entries"),
        ("compile spec bytes", set_u32(good, spec_value, 1 << 31),
         r"the value of compile spec 0 of delegate 0 of method 'forward' declares 2147483648 bytes"),
        ("name bytes", set_u32(good, places.name, 1 << 31), r"method 0's name declares 2147483648 bytes; at most 1024"),
        ("flatbuffer size", set_u64(good, 16, 1 << 40), r"its header gives the flatbuffer 1099511627776 bytes"),
        ("segment data size", set_u64(good, 32, 1 << 40), r"its header places 1099511627776 bytes of segments"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_huge_declared_counts_and_sizes_are_refused_unread(case, good, tmp_path, runtime_calls):
    what, data, message = _huge(good)[case]
    refused_before_runtime(write(tmp_path, data), message, runtime_calls)


def test_a_file_or_flatbuffer_past_its_bound_is_refused_before_it_is_read(good, tmp_path, monkeypatch, runtime_calls):
    """The bounds are checked from the file's size and header, before the bytes they bound are read
    (lowered here: a real file past 64 GiB or a flatbuffer past 64 MiB is costly to make)."""
    from offgraph_export.specs import pte as pte_specs
    from offgraph_export.specs import pte_reader

    path = write(tmp_path, good)
    monkeypatch.setattr(pte_reader, "MAX_PTE_PROGRAM_BYTES", 1000)
    refused_before_runtime(path, r"its flatbuffer is \d+ bytes; at most 1000 are read", runtime_calls)
    monkeypatch.setattr(pte_reader, "MAX_PTE_PROGRAM_BYTES", pte_reader.MAX_PTE_BYTES)
    monkeypatch.setattr(pte_specs, "MAX_PTE_BYTES", 1000)
    refused_before_runtime(path, rf"is {len(good)} bytes; a .pte read here holds at most 1000", runtime_calls)


# -- flatbuffers built by hand: shared and overlapping targets --------------------------------------


class Builder:
    """A flatbuffer written front to back: offsets point forward, so a field or a vector entry is
    pointed at its target (:meth:`point`) once the target is written; any number may share one."""

    def __init__(self) -> None:
        self.buf = bytearray(b"\0\0\0\0" + b"ET12")

    def _pad(self) -> None:
        self.buf += b"\0" * (-len(self.buf) % 8)

    def table(self, scalars: dict[int, tuple[str, int]] | None = None, refs: tuple[int, ...] = ()) -> tuple[int, dict[int, int]]:
        """A table of ``scalars`` (slot -> (struct format, value)) and offset fields ``refs``: its
        position and, per ref slot, where its offset is stored."""
        scalars = scalars or {}
        slots = sorted(set(scalars) | set(refs))
        n = max(slots) + 1 if slots else 0
        field = {s: 4 + 8 * i for i, s in enumerate(slots)}
        self._pad()
        vtable = len(self.buf)
        self.buf += struct.pack(f"<HH{n}H", 4 + 2 * n, 4 + 8 * len(slots), *[field.get(s, 0) for s in range(n)])
        self._pad()
        pos = len(self.buf)
        self.buf += struct.pack("<i", pos - vtable) + b"\0" * (8 * len(slots))
        for s, (fmt, value) in scalars.items():
            struct.pack_into("<" + fmt, self.buf, pos + field[s], value)
        return pos, {s: pos + field[s] for s in refs}

    def vector(self, count: int) -> tuple[int, list[int]]:
        """A vector of ``count`` offsets: its position and where each entry is stored."""
        self._pad()
        pos = len(self.buf)
        self.buf += struct.pack("<I", count) + b"\0" * (4 * count)
        return pos, [pos + 4 + 4 * i for i in range(count)]

    def string(self, data: bytes) -> int:
        self._pad()
        pos = len(self.buf)
        self.buf += struct.pack("<I", len(data)) + data + b"\0"
        return pos

    def point(self, at: int, target: int) -> None:
        assert target > at
        struct.pack_into("<I", self.buf, at, target - at)

    def program(self, plans: int) -> tuple[int, list[int]]:
        """A program of ``plans`` method entries (to be pointed) and one inline data entry."""
        root, fields = self.table(refs=(1, 3))
        self.point(0, root)
        vector, entries = self.vector(plans)
        self.point(fields[1], vector)
        inline, inline_entries = self.vector(1)
        self.point(fields[3], inline)
        self.point(inline_entries[0], self.table()[0])
        return root, entries

    def delegate(self, specs: int) -> tuple[int, list[int]]:
        """A delegate with ``specs`` compile-spec entries (to be pointed)."""
        table, fields = self.table(refs=(0, 1, 2))
        self.point(fields[0], self.string(b"XnnpackBackend"))
        self.point(fields[1], self.table({0: ("B", 0), 1: ("I", 0)})[0])
        vector, entries = self.vector(specs)
        self.point(fields[2], vector)
        return table, entries


def shared_chains_bomb(plans: int = MAX_PTE_METHODS, chains: int = 4000, instructions: int = 4000) -> bytes:
    """``plans`` methods that are one method, whose ``chains`` chains are one chain, whose
    ``instructions`` instructions are one delegate call: about 40 KB that ExecuTorch's
    deserializer unpacks into plans x chains x instructions (10**9) objects."""
    b = Builder()
    _, plan_entries = b.program(plans)
    plan, fields = b.table(refs=(0, 5, 7))
    for entry in plan_entries:
        b.point(entry, plan)
    b.point(fields[0], b.string(b"forward"))
    chain_vector, chain_entries = b.vector(chains)
    b.point(fields[5], chain_vector)
    chain, chain_fields = b.table(refs=(2,))
    for entry in chain_entries:
        b.point(entry, chain)
    instruction_vector, instruction_entries = b.vector(instructions)
    b.point(chain_fields[2], instruction_vector)
    instruction, instruction_fields = b.table({0: ("B", 2)}, refs=(1,))
    for entry in instruction_entries:
        b.point(entry, instruction)
    call, call_fields = b.table({0: ("i", 0)}, refs=(1,))
    b.point(instruction_fields[1], call)
    b.point(call_fields[1], b.vector(0)[0])
    delegates, delegate_entries = b.vector(1)
    b.point(fields[7], delegates)
    b.point(delegate_entries[0], b.delegate(0)[0])
    return bytes(b.buf)


def overlapping_values_bomb(delegates: int = 2000, specs: int = MAX_PTE_COMPILE_SPECS, value: int = 12 << 10) -> bytes:
    """``delegates`` delegates that are one delegate, whose ``specs`` compile specs have values
    that start 4 bytes apart in one region and each run ``value`` bytes on: ExecuTorch's deserializer
    copies delegates x specs x 12 KB (6 GB) out of a file of some 30 KB."""
    b = Builder()
    _, plan_entries = b.program(1)
    plan, fields = b.table(refs=(0, 7))
    b.point(plan_entries[0], plan)
    b.point(fields[0], b.string(b"forward"))
    vector, entries = b.vector(delegates)
    b.point(fields[7], vector)
    delegate, spec_entries = b.delegate(specs)
    for entry in entries:
        b.point(entry, delegate)
    spec_fields = []
    for entry in spec_entries:
        spec, spec_field = b.table(refs=(0, 1))
        b.point(entry, spec)
        spec_fields.append(spec_field)
    key = b.string(b"offgraph_kv_manifest")
    for spec_field in spec_fields:
        b.point(spec_field[0], key)
    b._pad()
    region = len(b.buf)
    b.buf += struct.pack("<I", value) * (specs + value // 4 + 1)
    for i, spec_field in enumerate(spec_fields):
        b.point(spec_field[1], region + 4 * i)
    return bytes(b.buf)


def _bombs() -> list[tuple[str, bytes, str]]:
    return [
        ("shared chains", shared_chains_bomb(), r"reading it visits more than \d+ tables and vector entries \(its vectors share or overlap"),
        ("too many methods", shared_chains_bomb(plans=10_000, chains=1, instructions=1),
         rf"the program's methods declares 10000 entries; at most {MAX_PTE_METHODS} are read"),
        ("overlapping values", overlapping_values_bomb(),
         r"its strings and byte vectors add up to more than the flatbuffer's \d+ bytes \(they overlap\)"),
    ]


def test_the_bombs_are_small_and_well_formed():
    """The hand-built flatbuffers are what they claim: small, and (shrunk) readable."""
    for _, data, _ in _bombs():
        assert len(data) < 64 << 10
    small = shared_chains_bomb(plans=1, chains=2, instructions=3)
    (delegate,) = layout(small).delegates
    assert len(delegate.calls) == 6 and delegate.backend == "XnnpackBackend"
    small = overlapping_values_bomb(delegates=1, specs=2, value=64)
    (delegate,) = layout(small).delegates
    assert [len(value) for _, value in delegate.compile_specs] == [64, 64]


@pytest.mark.parametrize("case", range(3))
def test_shared_and_overlapping_targets_are_refused_in_bounded_time(case, tmp_path, runtime_calls):
    what, data, message = _bombs()[case]
    refused_before_runtime(write(tmp_path, data), message, runtime_calls)


# -- the external data file (a cuda program, rebuilt here with ExecuTorch's own serializer) ---------


def _rebuilt(good: bytes, edit) -> bytes:
    """``good`` deserialized, edited and serialized again (segments extracted, as export does)."""
    from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary

    pte = deserialize_pte_binary(good)
    edit(pte.program)
    return bytes(serialize_pte_binary(pte, extract_delegate_segments=True))


def _plan(program, name: str):
    return next(p for p in program.execution_plan if p.name == name)


def _with_data_digest(device: str):
    def edit(program) -> None:
        specs = _plan(program, SPECS_METHOD).values[0].val
        specs.string_val = parse_artifact_specs(specs.string_val).model_copy(update={"device": device}).model_dump_json()
        placeholders = digest_placeholders(data_file=True)
        digest = _plan(program, DIGEST_METHOD)
        digest.values[0].val.string_val = placeholders[DIGEST_METHOD]
        data = copy.deepcopy(digest)
        data.name = DATA_DIGEST_METHOD
        data.values[0].val.string_val = placeholders[DATA_DIGEST_METHOD]
        program.execution_plan.append(data)

    return edit


@pytest.fixture(scope="module")
def cuda_pte(good, tmp_path_factory) -> Path:
    """The example as a cuda program would be written: specs for cuda, ``<stem>.ptd`` beside it
    and its digest recorded (the data are bytes of no meaning; the digest is what is checked)."""
    folder = tmp_path_factory.mktemp("cuda_pte")
    data = folder / "model.ptd"
    data.write_bytes(random.Random(25).randbytes(40_000))
    path = folder / "model.pte"
    path.write_bytes(seal_pte(_rebuilt(good, _with_data_digest("cuda")), file_digest(data)))
    return path


def test_a_cuda_program_with_its_data_file_reads_and_is_refused_by_the_cpu_runtime(cuda_pte, runtime_calls):
    assert read_pte_specs(cuda_pte).device == "cuda"
    refused(lambda: PteArtifact.load(cuda_pte), "was lowered for cuda", seconds=2.0)
    assert runtime_calls == []


def test_a_data_file_flipped_missing_or_swapped_is_refused(cuda_pte, tmp_path, runtime_calls):
    data = cuda_pte.with_suffix(".ptd").read_bytes()
    path = write(tmp_path, cuda_pte.read_bytes(), "model.pte")
    ptd = tmp_path / "model.ptd"
    refused_before_runtime(path, r"its data file .*model\.ptd is missing", runtime_calls)
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0x80
    ptd.write_bytes(bytes(flipped))
    refused_before_runtime(path, r"its data file .*model\.ptd does not match the digest in its offgraph_data_digest", runtime_calls)
    ptd.write_bytes(random.Random(26).randbytes(len(data)))  # another export's data
    refused_before_runtime(path, r"does not match the digest in its offgraph_data_digest", runtime_calls)


def test_a_cpu_program_recording_a_data_file_is_refused(good, tmp_path, runtime_calls):
    (tmp_path / "model.ptd").write_bytes(b"data")
    out = seal_pte(_rebuilt(good, _with_data_digest("cpu")), file_digest(tmp_path / "model.ptd"))
    refused_before_runtime(write(tmp_path, out, "model.pte"), "a cpu program records an external data file digest", runtime_calls)


def test_a_program_without_a_digest_is_refused(good, tmp_path, runtime_calls):
    def drop(program) -> None:
        program.execution_plan.remove(_plan(program, DIGEST_METHOD))

    refused_before_runtime(write(tmp_path, _rebuilt(good, drop)), "has no offgraph_digest constant method", runtime_calls)


# -- the CLI, and no native code -----------------------------------------------------------------------


def test_cli_inspect_refuses_in_one_line_with_status_2(good, tmp_path):
    where = layout(good)
    flipped = bytearray(good)
    flipped[where.segments[-1].offset] ^= 0x01
    for name, data, message in [("flipped.pte", bytes(flipped), "its segment data"),
                                ("bomb.pte", shared_chains_bomb(), "visits more than")]:
        path = write(tmp_path, data, name)
        proc = cli("inspect", str(path), check=False)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and name in lines[0], proc.stderr
        assert proc.stdout == ""


def test_reading_hostile_files_imports_neither_torch_nor_executorch(good, tmp_path):
    where = layout(good)
    flipped = bytearray(good)
    flipped[where.segments[0].offset + 1] ^= 0x01
    paths = [write(tmp_path, bytes(flipped), "flipped.pte"), write(tmp_path, shared_chains_bomb(), "bomb.pte"),
             write(tmp_path, good[:-1], "cut.pte"), write(tmp_path, good, "good.pte")]
    script = (
        "import sys\n"
        "from offgraph_export.errors import ArtifactError\n"
        "from offgraph_export.specs.pte import read_pte_specs\n"
        f"paths = {[str(p) for p in paths]!r}\n"
        "for path in paths[:-1]:\n"
        "    try:\n"
        "        read_pte_specs(path)\n"
        "    except ArtifactError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit(f'{path} was not refused')\n"
        "read_pte_specs(paths[-1])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'executorch')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_runtime_is_handed_the_checked_bytes_not_the_path(good, tmp_path, monkeypatch):
    """The file is read once: what was checked is what ExecuTorch's runtime loads (a file swapped
    after the checks is never read)."""
    from executorch.runtime import Runtime

    real = Runtime.get()
    handed: list = []

    class Spy:
        def load_program(self, data, **kwargs):
            handed.append(data)
            return real.load_program(data, **kwargs)

    monkeypatch.setattr(Runtime, "get", staticmethod(Spy))
    path = write(tmp_path, good, "checked.pte")
    specs, data = load_pte(path)
    assert data == good and specs.device == "cpu"
    PteArtifact.load(path)
    assert len(handed) == 1 and isinstance(handed[0], bytes) and handed[0] == good
