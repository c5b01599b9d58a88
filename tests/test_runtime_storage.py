"""Per-session KV storage without a compiled program: geometric growth, history kept bit-exactly,
ring layers fixed, transactional failure through an injectable allocator, poison, metrics."""

from __future__ import annotations

import pytest
import torch

from offgraph_export.errors import CacheOverflowError, OffgraphError
from offgraph_export.runtime import SessionStorage, default_allocator, grown_capacity
from offgraph_export.specs import CacheManifest

MAX_WRITE = 8


def _layer(layer_id, index, policy="flat", window=None, kv_heads=2, head_dim=4, v_head_dim=4):
    return {
        "layer_id": layer_id,
        "policy": policy,
        "window": window,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "v_head_dim": v_head_dim,
        "k": {"name": f"k_cache_{layer_id}", "index": index},
        "v": {"name": f"v_cache_{layer_id}", "index": index + 1},
    }


def make_manifest(
    layers=None, initial=16, maximum=256, max_write=MAX_WRITE, dtype="float32", batch=1
) -> CacheManifest:
    """Three layers by default: 0 flat, 1 ring of 5, 2 flat with a different value head dim.
    Storage inputs start at index 2 (after two model inputs)."""
    if layers is None:
        layers = [
            _layer(0, 2),
            _layer(1, 4, "ring", window=5, kv_heads=1),
            _layer(2, 6, head_dim=4, v_head_dim=6),
        ]
    return CacheManifest.model_validate(
        {
            "version": 1,
            "storage_dtype": dtype,
            "batch_size": batch,
            "max_capacity": maximum,
            "initial_capacity": initial,
            "max_write": max_write,
            "layers": layers,
        }
    )


def flat_keys(storage: SessionStorage) -> list[tuple[int, str]]:
    return [(l.layer_id, w) for l in storage.manifest.layers if l.policy == "flat" for w in ("k", "v")]


def ring_keys(storage: SessionStorage) -> list[tuple[int, str]]:
    return [(l.layer_id, w) for l in storage.manifest.layers if l.policy == "ring" for w in ("k", "v")]


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the same bytes: equality is bit equality, NaN included."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def fill_rows(storage: SessionStorage, start: int, stop: int, gen: torch.Generator) -> None:
    """Random data into flat rows ``[start, stop)`` (what a step would write)."""
    for key in flat_keys(storage):
        t = storage.tensors[key]
        t[:, :, start:stop] = torch.randn(t[:, :, start:stop].shape, generator=gen).to(t.dtype)


class FailingAllocator:
    """Allocates normally, but the ``fail_on``-th call (1-based, counted from construction)
    raises a real error from inside the allocation."""

    def __init__(self, fail_on: int | None = None, error: str = "oom") -> None:
        self.fail_on = fail_on
        self.error = error
        self.calls: list[tuple[tuple[int, ...], torch.dtype, torch.device]] = []

    def __call__(self, shape, dtype, device):
        self.calls.append((shape, dtype, device))
        if len(self.calls) == self.fail_on:
            if self.error == "oom":
                # torch's own out-of-memory failure (a RuntimeError from DefaultCPUAllocator):
                # 2**62 bytes cannot be allocated.
                torch.empty(2**60, dtype=torch.float32, device=device)
                raise AssertionError("allocating 2**62 bytes unexpectedly succeeded")
            if self.error == "memory":
                # A real MemoryError: a host staging buffer that cannot be allocated.
                bytearray(2**62)
                raise AssertionError("allocating 2**62 bytes unexpectedly succeeded")
            if self.error == "runtime":
                # Another real RuntimeError raised by torch from inside the allocator.
                torch.empty(shape, dtype=dtype, device=device).view(-1, 7, 11, 13)
                raise AssertionError("invalid view unexpectedly succeeded")
            if self.error == "copy":
                # Allocation succeeds, but the copy of live rows into it fails (in-place write
                # into a leaf that requires grad): the copy phase must be transactional too.
                return torch.empty(shape, dtype=dtype, device=device, requires_grad=True)
        return default_allocator(shape, dtype, device)


# -- the growth rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "current,required,maximum,expected",
    [
        (16, 17, 256, 32),  # doubling covers the request
        (16, 32, 256, 32),
        (16, 33, 256, 33),  # the request is more than double
        (16, 50, 256, 50),
        (32, 33, 256, 64),
        (200, 201, 256, 256),  # doubling is capped at the maximum
        (128, 256, 256, 256),
        (1, 2, 3, 2),
        (2, 3, 3, 3),
    ],
)
def test_grown_capacity_rule(current, required, maximum, expected):
    assert grown_capacity(current, required, maximum) == expected
    assert expected == min(maximum, max(required, 2 * current))


def test_initial_allocation_shapes_dtype_and_order():
    alloc = FailingAllocator()
    m = make_manifest()
    s = SessionStorage(m, "cpu", allocator=alloc)
    assert s.capacity == 16 and s.growth_count == 0
    assert s.tensors[(0, "k")].shape == (1, 2, 16, 4)
    assert s.tensors[(1, "k")].shape == (1, 1, 5 + MAX_WRITE - 1, 4)
    assert s.tensors[(2, "v")].shape == (1, 2, 16, 6)
    assert all(dtype == torch.float32 and device == torch.device("cpu") for _, dtype, device in alloc.calls)
    assert len(alloc.calls) == 6
    # bound() follows the storage inputs' indices
    assert [t.data_ptr() for t in s.bound()] == [
        s.tensors[(lid, w)].data_ptr() for lid in (0, 1, 2) for w in ("k", "v")
    ]


def test_bound_order_follows_indices_not_layer_order():
    m = make_manifest(layers=[_layer(0, 4), _layer(1, 2, "ring", window=3)])
    s = SessionStorage(m, "cpu")
    order = [s.tensors[(1, "k")], s.tensors[(1, "v")], s.tensors[(0, "k")], s.tensors[(0, "v")]]
    assert all(a is b for a, b in zip(s.bound(), order))


def test_geometric_growth_sequence():
    s = SessionStorage(make_manifest(initial=16, maximum=256), "cpu")
    seen = []
    for required in (1, 16, 17, 20, 32, 33, 64, 65, 200, 255, 256):
        moved = s.ensure(required, committed_length=min(required - 1, s.capacity))
        seen.append((required, moved, s.capacity))
    assert seen == [
        (1, False, 16),
        (16, False, 16),
        (17, True, 32),
        (20, False, 32),
        (32, False, 32),
        (33, True, 64),
        (64, False, 64),
        (65, True, 128),
        (200, True, 256),  # min(256, max(200, 256))
        (255, False, 256),
        (256, False, 256),
    ]
    assert s.growth_count == 4
    for key in flat_keys(s):
        assert s.tensors[key].shape[2] == 256


def test_growth_to_more_than_double():
    s = SessionStorage(make_manifest(initial=16, maximum=256), "cpu")
    assert s.ensure(100, committed_length=0)
    assert s.capacity == 100 and s.growth_count == 1


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_history_preserved_bit_exactly_across_growth(dtype):
    gen = torch.Generator().manual_seed(0)
    s = SessionStorage(make_manifest(dtype=dtype, initial=16, maximum=256), "cpu")
    fill_rows(s, 0, 16, gen)
    ring_before = {k: s.tensors[k] for k in ring_keys(s)}
    ring_bytes = {k: s.tensors[k].clone() for k in ring_keys(s)}
    live_before = {k: s.tensors[k][:, :, :16].clone() for k in flat_keys(s)}

    assert s.ensure(20, committed_length=16)  # 16 -> 32
    assert s.capacity == 32
    fill_rows(s, 16, 30, gen)
    live_mid = {k: s.tensors[k][:, :, :30].clone() for k in flat_keys(s)}
    for k in flat_keys(s):
        assert bit_equal(s.tensors[k][:, :, :16], live_before[k])

    assert s.ensure(40, committed_length=30)  # 32 -> 64
    assert s.capacity == 64 and s.growth_count == 2
    for k in flat_keys(s):
        t = s.tensors[k]
        assert t.dtype == getattr(torch, dtype) and t.is_contiguous()
        assert t.shape[2] == 64
        assert torch.equal(t[:, :, :30], live_mid[k])
        assert bit_equal(t[:, :, :16], live_before[k])
    # ring layers never moved and were never touched
    for k in ring_keys(s):
        assert s.tensors[k] is ring_before[k]
        assert bit_equal(s.tensors[k], ring_bytes[k])


def test_growth_copies_only_live_rows():
    s = SessionStorage(make_manifest(initial=16), "cpu", poison=True)
    gen = torch.Generator().manual_seed(1)
    fill_rows(s, 0, 16, gen)
    assert s.ensure(17, committed_length=10)
    for k in flat_keys(s):
        t = s.tensors[k]
        assert not torch.isnan(t[:, :, :10]).any()
        assert torch.isnan(t[:, :, 10:]).all()  # rows past live were not copied: still poisoned


def test_ring_layers_fixed_and_never_move():
    m = make_manifest(maximum=256)
    s = SessionStorage(m, "cpu")
    ring = {k: s.tensors[k] for k in ring_keys(s)}
    ptrs = {k: t.data_ptr() for k, t in ring.items()}
    for required in (17, 33, 65, 129, 256):
        s.ensure(required, committed_length=0)
        for k in ring_keys(s):
            assert s.tensors[k] is ring[k] and s.tensors[k].data_ptr() == ptrs[k]
            assert s.tensors[k].shape[2] == 5 + MAX_WRITE - 1
    assert s.capacity == 256


def test_ring_only_manifest_never_grows():
    m = make_manifest(layers=[_layer(0, 2, "ring", window=4), _layer(1, 4, "ring", window=9)], max_write=3)
    s = SessionStorage(m, "cpu")
    before = dict(s.tensors)
    assert s.capacity == 0
    assert s.tensors[(0, "k")].shape[2] == 4 + 3 - 1
    assert s.tensors[(1, "v")].shape[2] == 9 + 3 - 1
    assert s.ensure(10_000, committed_length=50) is False  # no flat layer: nothing to grow, no overflow
    assert s.growth_count == 0 and all(s.tensors[k] is before[k] for k in before)


@pytest.mark.parametrize(
    "fail_on,error",
    [
        (7, "oom"),  # the first allocation of the growth (6 at construction)
        (8, "oom"),
        (10, "oom"),  # the last one: every other new tensor was already allocated and copied
        (9, "memory"),
        (10, "memory"),
        (9, "runtime"),
        (8, "copy"),
        (10, "copy"),
    ],
    ids=lambda v: str(v),
)
def test_growth_failure_is_transactional(fail_on, error):
    gen = torch.Generator().manual_seed(2)
    alloc = FailingAllocator(fail_on, error)
    s = SessionStorage(make_manifest(initial=16), "cpu", allocator=alloc)
    assert len(alloc.calls) == 6
    fill_rows(s, 0, 16, gen)
    objects = dict(s.tensors)
    contents = {k: t.clone() for k, t in s.tensors.items()}
    bound = list(s.bound())

    expected = {"oom": "can't allocate memory", "memory": None, "runtime": "is invalid", "copy": "leaf Variable"}
    with pytest.raises(MemoryError if error == "memory" else RuntimeError, match=expected[error]):
        s.ensure(20, committed_length=16)
    assert len(alloc.calls) == fail_on  # the failure really happened inside this growth
    assert s.capacity == 16 and s.growth_count == 0
    assert s.tensors.keys() == objects.keys()
    for k, t in s.tensors.items():
        assert t is objects[k]
        assert bit_equal(t, contents[k])
    assert all(a is b for a, b in zip(s.bound(), bound)) and len(s.bound()) == len(bound)
    assert s.allocated_bytes() == sum(t.numel() * t.element_size() for t in objects.values())

    # the allocator recovers: the next growth succeeds and keeps the history
    assert s.ensure(20, committed_length=16)
    assert s.capacity == 32 and s.growth_count == 1
    for k in flat_keys(s):
        assert bit_equal(s.tensors[k][:, :, :16], contents[k][:, :, :16])


def test_allocator_failure_at_construction_propagates():
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        SessionStorage(make_manifest(), "cpu", allocator=FailingAllocator(3, "oom"))


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda shape, dtype, device: torch.empty((*shape[:2], shape[2] + 1, shape[3]), dtype=dtype), id="one-row-too-many"),
        pytest.param(lambda shape, dtype, device: torch.empty((*shape[:2], shape[2] - 1, shape[3]), dtype=dtype), id="one-row-short"),
        pytest.param(lambda shape, dtype, device: torch.empty(shape[::-1], dtype=dtype), id="transposed-shape"),
        pytest.param(lambda shape, dtype, device: torch.empty(shape, dtype=torch.float16), id="wrong-dtype"),
        pytest.param(lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device="meta"), id="wrong-device"),
        pytest.param(
            lambda shape, dtype, device: torch.empty((shape[0], shape[1], shape[3], shape[2]), dtype=dtype).transpose(2, 3),
            id="non-contiguous",
        ),
    ],
)
def test_allocator_returning_wrong_tensor_is_rejected(bad):
    calls = {"n": 0}

    def allocator(shape, dtype, device):
        calls["n"] += 1
        if calls["n"] == 8:  # the second tensor of the first growth
            return bad(shape, dtype, device)
        return default_allocator(shape, dtype, device)

    s = SessionStorage(make_manifest(initial=16), "cpu", allocator=allocator)
    objects = dict(s.tensors)
    with pytest.raises(OffgraphError, match="allocator returned"):
        s.ensure(17, committed_length=4)
    assert s.capacity == 16 and s.growth_count == 0
    assert all(s.tensors[k] is objects[k] for k in objects)
    # also at construction
    with pytest.raises(OffgraphError, match="allocator returned"):
        SessionStorage(make_manifest(initial=16), "cpu", allocator=lambda *a: bad(*a))


def test_over_max_capacity_raises_cache_overflow_and_changes_nothing():
    alloc = FailingAllocator()
    s = SessionStorage(make_manifest(initial=16, maximum=100), "cpu", allocator=alloc)
    assert s.ensure(60, committed_length=0)  # 16 -> 60
    objects = dict(s.tensors)
    n_calls = len(alloc.calls)
    with pytest.raises(CacheOverflowError, match="max capacity of 100"):
        s.ensure(101, committed_length=60)
    assert len(alloc.calls) == n_calls  # refused before allocating anything
    assert s.capacity == 60 and s.growth_count == 1
    assert all(s.tensors[k] is objects[k] for k in objects)
    assert s.ensure(100, committed_length=60) and s.capacity == 100  # min(100, max(100, 120))
    with pytest.raises(CacheOverflowError):
        s.ensure(101, committed_length=100)


def test_poison_fills_nan_at_allocation_growth_and_poison_from():
    s = SessionStorage(make_manifest(initial=16), "cpu", poison=True)
    assert all(torch.isnan(t).all() for t in s.tensors.values())
    fill_rows(s, 0, 12, torch.Generator().manual_seed(3))
    s.poison_from(8)
    for k in flat_keys(s):
        assert not torch.isnan(s.tensors[k][:, :, :8]).any()
        assert torch.isnan(s.tensors[k][:, :, 8:]).all()
    s.ensure(17, committed_length=8)
    for k in flat_keys(s):
        assert not torch.isnan(s.tensors[k][:, :, :8]).any()
        assert torch.isnan(s.tensors[k][:, :, 8:]).all()
    # without poison nothing is filled: what the allocator returned is kept as is
    plain = SessionStorage(
        make_manifest(initial=16), "cpu", allocator=lambda shape, dtype, device: torch.zeros(shape, dtype=dtype)
    )
    assert not any(torch.isnan(t).any() for t in plain.tensors.values())
    plain.ensure(17, committed_length=0)
    assert not any(torch.isnan(t).any() for t in plain.tensors.values())


@pytest.mark.parametrize("dtype,size", [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_allocated_bytes(dtype, size):
    m = make_manifest(dtype=dtype, initial=16, batch=2)
    s = SessionStorage(m, "cpu")
    ring_rows = 5 + MAX_WRITE - 1

    def expected(cap):
        # layer 0: k,v [2,2,cap,4]; layer 1 ring: k,v [2,1,ring_rows,4]; layer 2: k [2,2,cap,4], v [2,2,cap,6]
        return size * (2 * (2 * 2 * cap * 4) + 2 * (2 * 1 * ring_rows * 4) + 2 * 2 * cap * 4 + 2 * 2 * cap * 6)

    assert s.dtype == getattr(torch, dtype)
    assert s.allocated_bytes() == expected(16)
    s.ensure(40, committed_length=0)
    assert s.allocated_bytes() == expected(40)
    s.release()
    assert s.allocated_bytes() == 0 and s.bound() == []


# -- reserving a known length ---------------------------------------------------------------------


def test_reserve_grows_to_exactly_the_tokens_asked_and_keeps_the_history():
    gen = torch.Generator().manual_seed(5)
    s = SessionStorage(make_manifest(initial=16, maximum=256), "cpu")
    fill_rows(s, 0, 16, gen)
    before = {k: s.tensors[k][:, :, :16].clone() for k in flat_keys(s)}
    rings = {k: t for k, t in s.tensors.items() if k not in flat_keys(s)}
    assert s.reserve(37, committed_length=16)  # not doubled to 32 or 74: exactly 37 rows
    assert s.capacity == 37 and s.growth_count == 1
    for k in flat_keys(s):
        assert s.tensors[k].shape[2] == 37
        assert bit_equal(s.tensors[k][:, :, :16], before[k])
    assert all(s.tensors[k] is t for k, t in rings.items())  # rings never move
    assert not s.reserve(20, committed_length=16) and s.capacity == 37  # already holds it
    assert not s.ensure(37, committed_length=16) and s.growth_count == 1  # steps up to it never grow


def test_reserve_past_the_max_capacity_raises_and_changes_nothing():
    s = SessionStorage(make_manifest(initial=16, maximum=100), "cpu")
    tensors = dict(s.tensors)
    with pytest.raises(CacheOverflowError, match="101 tokens exceed the session's max capacity of 100"):
        s.reserve(101, committed_length=0)
    assert s.capacity == 16 and s.tensors == tensors and s.growth_count == 0


def test_reserve_failure_is_transactional():
    alloc = FailingAllocator(8, "oom")
    s = SessionStorage(make_manifest(initial=16), "cpu", allocator=alloc)
    tensors = dict(s.tensors)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        s.reserve(64, committed_length=0)
    assert s.capacity == 16 and s.growth_count == 0
    assert all(s.tensors[k] is t for k, t in tensors.items())
