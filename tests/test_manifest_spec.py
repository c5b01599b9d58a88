"""The cache manifest compile spec and the user's CacheConfig: valid ones round-trip, every
inconsistency is rejected with a message that names it."""

from __future__ import annotations

import copy
import json

import pytest
from pydantic import ValidationError

from offgraph_export.errors import SpecError
from offgraph_export.specs import (
    MANIFEST_KEY,
    MANIFEST_VERSION,
    CacheConfig,
    CacheManifest,
    StorageInput,
    parse_manifest,
    ring_rows,
    row_position,
    storage_index,
    storage_names,
    storage_row,
)
from offgraph_export.specs.limits import MAX_SPEC_ITEMS, MAX_SPEC_VALUES, loads_limited


def _layer(layer_id: int, policy: str = "flat", window: int | None = None, first_index: int = 2):
    return {
        "layer_id": layer_id,
        "policy": policy,
        "window": window,
        "kv_heads": 2,
        "head_dim": 16,
        "v_head_dim": 8,
        "k": {"name": storage_names(layer_id)[0], "index": first_index + 2 * layer_id},
        "v": {"name": storage_names(layer_id)[1], "index": first_index + 2 * layer_id + 1},
    }


def _manifest(**overrides) -> dict:
    data = {
        "version": MANIFEST_VERSION,
        "storage_dtype": "bfloat16",
        "batch_size": 1,
        "max_capacity": 256,
        "initial_capacity": 16,
        "max_write": 32,
        "layers": [_layer(0), _layer(1, "ring", 16)],
    }
    data.update(overrides)
    return data


def _rejected(data, *fragments: str) -> str:
    text = data if isinstance(data, (str, bytes)) else json.dumps(data)
    with pytest.raises(SpecError) as info:
        parse_manifest(text)
    message = str(info.value)
    assert MANIFEST_KEY in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# --- valid manifests -------------------------------------------------------------------------


def test_key_and_version():
    assert MANIFEST_KEY == "offgraph_kv_manifest"
    assert MANIFEST_VERSION == 1


def test_round_trip_through_json():
    data = _manifest()
    manifest = parse_manifest(json.dumps(data))
    assert isinstance(manifest, CacheManifest)
    assert manifest.layer_ids == [0, 1]
    assert manifest.layer(1).policy == "ring" and manifest.layer(1).window == 16
    assert manifest.layer(0).window is None
    assert manifest.layer(0).v_head_dim == 8
    assert manifest.has_flat
    # to_json -> parse gives an equal manifest, and the same JSON data as went in.
    text = manifest.to_json()
    again = parse_manifest(text)
    assert again == manifest
    assert json.loads(text) == data
    assert again.to_json() == text


def test_parse_accepts_bytes():
    assert parse_manifest(json.dumps(_manifest()).encode()) == parse_manifest(json.dumps(_manifest()))


def test_storage_inputs_in_index_order_and_rows():
    data = _manifest(layers=[_layer(1, "ring", 16), _layer(0)])
    manifest = parse_manifest(json.dumps(data))
    assert [s.index for s in manifest.storage_inputs()] == [2, 3, 4, 5]
    assert [s.name for s in manifest.storage_inputs()] == ["k_cache_0", "v_cache_0", "k_cache_1", "v_cache_1"]
    assert manifest.layer(0).rows(capacity=64, max_write=32) == 64
    assert manifest.layer(1).rows(capacity=64, max_write=32) == 16 + 32 - 1


def test_all_ring_manifest():
    manifest = parse_manifest(json.dumps(_manifest(layers=[_layer(0, "ring", 4)])))
    assert not manifest.has_flat


def test_max_write_equal_to_capacity_is_fine():
    parse_manifest(json.dumps(_manifest(max_write=256, initial_capacity=256)))


def test_unknown_layer_lookup():
    manifest = parse_manifest(json.dumps(_manifest()))
    with pytest.raises(SpecError, match="layer 7"):
        manifest.layer(7)


def test_manifest_is_frozen():
    manifest = parse_manifest(json.dumps(_manifest()))
    with pytest.raises(ValidationError, match="frozen"):
        manifest.max_capacity = 3  # type: ignore[misc]


# --- rejections ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 2, "1", True, 1.0, None, -1])
def test_unknown_version(version):
    _rejected(_manifest(version=version), "version", repr(version))


@pytest.mark.parametrize("version", [0, 2, "1"])
def test_unknown_version_rejected_by_model_too(version):
    with pytest.raises(ValueError):
        CacheManifest.model_validate(_manifest(version=version))


def test_missing_version():
    data = _manifest()
    del data["version"]
    _rejected(data, "version")


def test_duplicate_layer_ids():
    layers = [_layer(0), _layer(1)]
    layers[1]["layer_id"] = 0
    layers[1]["k"]["name"], layers[1]["v"]["name"] = storage_names(0)  # named as its id says
    _rejected(_manifest(layers=layers), "duplicate layer id 0")


@pytest.mark.parametrize("window", [None, 0, -3])
def test_ring_layer_needs_positive_window(window):
    _rejected(
        _manifest(layers=[_layer(0), _layer(1, "ring", window)]),
        "layer 1",
        "ring layer needs a positive window",
        repr(window),
    )


def test_ring_layer_without_window_key():
    layer = _layer(0, "ring")
    del layer["window"]
    _rejected(_manifest(layers=[layer]), "ring layer needs a positive window")


def test_flat_layer_with_window():
    _rejected(_manifest(layers=[_layer(0, "flat", 8)]), "layer 0", "flat layer", "window=8")


def test_unknown_policy():
    _rejected(_manifest(layers=[_layer(0, "paged")]), "policy", "paged")


@pytest.mark.parametrize("max_write", [0, -1])
def test_max_write_not_positive(max_write):
    _rejected(_manifest(max_write=max_write), "max_write")


def test_max_write_beyond_capacity():
    _rejected(_manifest(max_write=257), "max_write=257", "max_capacity=256")


def test_initial_capacity_beyond_max():
    _rejected(_manifest(initial_capacity=512), "initial_capacity=512", "max_capacity=256")


@pytest.mark.parametrize("field", ["batch_size", "max_capacity", "initial_capacity"])
def test_non_positive_sizes(field):
    _rejected(_manifest(**{field: 0}), field)


def test_storage_names_are_fixed_by_the_layer_id():
    assert storage_names(0) == ("k_cache_0", "v_cache_0")
    assert storage_names(12) == ("k_cache_12", "v_cache_12")


@pytest.mark.parametrize(("layer", "which", "name", "expected"), [
    (1, "v", "k_cache_0", "v_cache_1"),  # another layer's name: used twice
    (0, "v", "k_cache_0", "v_cache_0"),  # K's name for V: used twice within the layer
    (0, "k", "v_cache_0", "k_cache_0"),
    (1, "k", "k_cache_0", "k_cache_1"),
    (0, "k", "kv_k_0", "k_cache_0"),
    (1, "v", "v_cache_1 ", "v_cache_1"),
    (0, "k", "k_cache_00", "k_cache_0"),
], ids=["other-layers-name", "k-name-for-v", "v-name-for-k", "names-swapped-across-layers", "other-scheme",
        "trailing-space", "leading-zero"])
def test_storage_names_must_follow_their_layer(layer, which, name, expected):
    """A storage input is named ``storage_names(layer_id)``: the name a runtime or tool binds by must
    say which layer (and K or V) the tensor is, so a manifest saying otherwise is refused."""
    layers = [_layer(0), _layer(1, "ring", 16)]
    layers[layer][which]["name"] = name
    _rejected(
        _manifest(layers=layers),
        f"layer {layer}: its {which.upper()} storage input is named {name!r}; expected {expected!r}",
    )


def test_storage_names_follow_the_layer_when_built_directly():
    layer = _layer(3)
    layer["k"]["name"] = "k_cache_4"
    with pytest.raises(ValidationError, match="layer 3: its K storage input is named 'k_cache_4'; expected 'k_cache_3'"):
        CacheManifest.model_validate(_manifest(layers=[layer]))


def test_duplicate_storage_indices():
    layers = [_layer(0), _layer(1)]
    layers[1]["k"]["index"] = layers[0]["v"]["index"]
    _rejected(_manifest(layers=layers), "storage input index 3 used twice")


@pytest.mark.parametrize("bad", [{"name": "", "index": 2}, {"name": "k", "index": -1}])
def test_bad_storage_input(bad):
    layer = _layer(0)
    layer["k"] = bad
    _rejected(_manifest(layers=[layer]), "layers.0.k")


@pytest.mark.parametrize("field", ["kv_heads", "head_dim", "v_head_dim"])
def test_non_positive_layer_dims(field):
    layer = _layer(0)
    layer[field] = 0
    _rejected(_manifest(layers=[layer]), field)


def test_no_layers():
    _rejected(_manifest(layers=[]), "layers")


def test_bad_storage_dtype():
    _rejected(_manifest(storage_dtype="int8"), "storage_dtype")


@pytest.mark.parametrize("text", ["", "{", "not json", "{'version': 1}", b"\xff\xfe\x00"])
def test_invalid_json(text):
    _rejected(text, "not valid JSON")


@pytest.mark.parametrize("value", [[], 1, "manifest", None])
def test_json_that_is_not_an_object(value):
    _rejected(value)


def test_unknown_top_level_field():
    _rejected(_manifest(max_capacty=5), "max_capacty")


def test_unknown_layer_field():
    layer = _layer(0)
    layer["rope"] = "yes"
    _rejected(_manifest(layers=[layer]), "rope")


def test_unknown_storage_field():
    layer = _layer(0)
    layer["k"] = dict(layer["k"], dtype="float32")
    _rejected(_manifest(layers=[layer]), "dtype")


def test_missing_required_field():
    data = _manifest()
    del data["max_write"]
    _rejected(data, "max_write")


def test_rejection_does_not_mutate_input():
    data = _manifest(max_write=0)
    before = copy.deepcopy(data)
    _rejected(data)
    assert data == before


# --- CacheConfig -----------------------------------------------------------------------------


def test_cache_config_defaults_and_windows():
    config = CacheConfig()
    assert config.storage_dtype == "float32"
    assert config.initial_capacity <= config.max_capacity
    assert config.max_write <= config.max_capacity
    assert config.window(0) is None

    config = CacheConfig(max_capacity=64, initial_capacity=8, max_write=16, ring_windows={1: 4})
    assert config.window(0) is None and config.window(1) == 4


def test_cache_config_round_trip():
    config = CacheConfig(
        max_capacity=64, initial_capacity=8, max_write=16, storage_dtype="bfloat16", ring_windows={1: 4}
    )
    assert CacheConfig.model_validate_json(config.model_dump_json()) == config


def test_cache_config_is_frozen():
    config = CacheConfig()
    with pytest.raises(ValidationError, match="frozen"):
        config.max_capacity = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"max_capacity": 8, "initial_capacity": 16, "max_write": 4}, ["initial_capacity=16", "max_capacity=8"]),
        ({"max_capacity": 8, "initial_capacity": 4, "max_write": 9}, ["max_write=9", "max_capacity=8"]),
        ({"ring_windows": {0: 0}}, ["ring layer 0", "positive window", "0"]),
        ({"ring_windows": {2: -4}}, ["ring layer 2", "positive window", "-4"]),
        ({"max_capacity": 0}, ["max_capacity"]),
        ({"initial_capacity": 0}, ["initial_capacity"]),
        ({"max_write": 0}, ["max_write"]),
        ({"storage_dtype": "int8"}, ["storage_dtype"]),
        ({"max_capcity": 5}, ["max_capcity"]),
    ],
)
def test_cache_config_rejections(kwargs, fragments):
    with pytest.raises(ValueError) as info:
        CacheConfig(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# --- the storage rules -----------------------------------------------------------------------


def test_policy_is_derived_from_window_and_may_be_omitted():
    data = _manifest()
    for layer in data["layers"]:
        del layer["policy"]
    manifest = parse_manifest(json.dumps(data))
    assert [l.policy for l in manifest.layers] == ["flat", "ring"]
    assert json.loads(manifest.to_json()) == _manifest()  # serialized with its policy


def test_storage_shape_and_owner_follow_the_layer():
    manifest = parse_manifest(json.dumps(_manifest()))
    flat, ring = manifest.layers
    assert manifest.owner(flat.k) == (flat, "k") and manifest.owner(ring.v) == (ring, "v")
    assert manifest.storage_shape(flat.k, 40) == (1, 2, 40, 16)
    assert manifest.storage_shape(flat.v, 40) == (1, 2, 40, 8)  # value head dim
    assert manifest.storage_shape(ring.k, 40) == (1, 2, ring_rows(16, 32), 16)  # fixed, not 40
    with pytest.raises(SpecError, match="in no layer"):
        manifest.owner(StorageInput(name="stray", index=99))


def test_ring_rows_leave_room_for_a_whole_step():
    # the oldest query of a max_write step still sees window - 1 older positions
    assert ring_rows(16, 32) == 47 and ring_rows(1, 1) == 1


@pytest.mark.parametrize("rows", [1, 5, 47])
def test_storage_row_and_row_position_are_inverse(rows):
    """Write positions 0..n in order into ``rows`` rows; every row then holds the newest position
    that maps to it, and row_position names exactly that position (negative: never written)."""
    for last in range(0, 3 * rows):
        held = {}
        for p in range(last + 1):
            held[storage_row(p, rows)] = p
        for row in range(rows):
            if row in held:
                assert row_position(row, last, rows) == held[row]
            else:
                assert row_position(row, last, rows) < 0
        # flat: a layer whose rows exceed every position is the identity
        assert [storage_row(p, 10 * rows) for p in range(last + 1)] == list(range(last + 1))


def test_storage_row_on_tensors_matches_ints():
    import torch

    pos = torch.arange(0, 100)
    assert storage_row(pos, 7).tolist() == [storage_row(int(p), 7) for p in pos]
    assert row_position(torch.arange(7), 30, 7).tolist() == [row_position(r, 30, 7) for r in range(7)]


def test_storage_indices_follow_the_model_inputs():
    assert [storage_index(3, i, w) for i in range(2) for w in ("k", "v")] == [3, 4, 5, 6]
    manifest = parse_manifest(json.dumps(_manifest()))
    manifest.check_follows(2)
    with pytest.raises(SpecError, match=r"must follow the 3 model inputs"):
        manifest.check_follows(3)


def test_cache_config_overrides_return_a_new_validated_config():
    config = CacheConfig(max_capacity=64, initial_capacity=8, max_write=16, ring_windows={1: 4})
    new = config.with_overrides(max_capacity=128, rings=[(2, 8)])
    assert (new.max_capacity, new.initial_capacity, new.ring_windows) == (128, 8, {1: 4, 2: 8})
    assert config.max_capacity == 64  # unchanged
    assert config.with_overrides(all_flat=True, rings={3: 2}).ring_windows == {3: 2}
    with pytest.raises(SpecError, match="initial_capacity=100 exceeds max_capacity=64"):
        config.with_overrides(initial_capacity=100)


def test_cache_config_of_manifest_round_trips_the_policies():
    manifest = parse_manifest(json.dumps(_manifest()))
    config = CacheConfig.of_manifest(manifest)
    assert config.ring_windows == {1: 16} and config.window(0) is None
    assert (config.max_capacity, config.initial_capacity, config.max_write) == (256, 16, 32)


@pytest.mark.parametrize("depth", [17, 100_000])
def test_deeply_nested_json_is_refused_without_recursion(depth):
    _rejected("[" * depth + "]" * depth, "nests deeper than")


def test_brackets_inside_strings_do_not_count_as_nesting():
    data = _manifest()
    data["layers"][0]["k"]["name"] = "[" * 100
    data["layers"][0]["v"]["name"] = '\\"[{' * 30
    text = json.dumps(data)
    assert loads_limited(text, MANIFEST_KEY)["layers"][0]["k"]["name"] == "[" * 100
    _rejected(text, "its K storage input is named '[[[")  # refused for its name, not its nesting


def _minimal_layers(n: int) -> list[dict]:
    return [
        {"layer_id": i, "window": None, "kv_heads": 1, "head_dim": 1, "v_head_dim": 1,
         "k": {"name": storage_names(i)[0], "index": 2 + 2 * i}, "v": {"name": storage_names(i)[1], "index": 3 + 2 * i}}
        for i in range(n)
    ]


def test_layer_count_is_bounded():
    """The layer count sizes every session's storage (two tensors per layer): bounded by the
    spec limit, however few bytes a layer takes."""
    manifest = parse_manifest(json.dumps(_manifest(layers=_minimal_layers(MAX_SPEC_ITEMS)), separators=(",", ":")))
    assert len(manifest.layers) == MAX_SPEC_ITEMS
    _rejected(
        json.dumps(_manifest(layers=_minimal_layers(MAX_SPEC_ITEMS + 1)), separators=(",", ":")),
        "layers", f"{MAX_SPEC_ITEMS + 1} entries", f"holds at most {MAX_SPEC_ITEMS}",
    )


def test_a_hostile_layer_count_is_refused_before_any_layer_is_validated():
    """Twenty thousand ``{}`` fit in 60 kB, inside the JSON size limit and the value limit;
    validated one by one they cost eight errors each (a hundred thousand: a 97 MB message, 190 MiB
    and seconds before the refusal). The count is refused first, in a message of ordinary length;
    a hundred thousand pass the value limit first."""
    def text(n: int) -> str:
        return json.dumps(_manifest(layers=[]))[: -len("[]}")] + "[" + ",".join(["{}"] * n) + "]}"

    message = _rejected(text(20_000), "layers", "20000 entries", f"holds at most {MAX_SPEC_ITEMS}")
    assert len(message) < 2000, len(message)
    message = _rejected(text(100_000), f"holds more than {MAX_SPEC_VALUES} values")
    assert len(message) < 500, len(message)


def test_oversized_json_is_refused():
    _rejected(" " * (5 << 20) + "{}", "bytes")


def test_storage_indices_must_be_k_then_v_in_layer_order():
    layer = _layer(0)
    layer["k"]["index"], layer["v"]["index"] = layer["v"]["index"], layer["k"]["index"]
    with pytest.raises(SpecError, match="K then V per layer"):
        parse_manifest(json.dumps(_manifest(layers=[layer]))).check_follows(2)


# --- sizes past what the kernels and torch can index; loose types; JSON Python takes and JSON does not


@pytest.mark.parametrize(("change", "fragment"), [
    (lambda m: m["layers"][1].update(window=2**70), "less than or equal to 2147483647"),
    (lambda m: m["layers"][1].update(window=2**31 - 1), "storage rows; at most 2147483647"),  # + max_write - 1
    (lambda m: m["layers"][0].update(kv_heads=2**40), "less than or equal to 2147483647"),
    (lambda m: m.update(batch_size=2**64), "less than or equal to 2147483647"),
    (lambda m: m.update(max_capacity=2**31), "less than or equal to 2147483647"),
    (lambda m: m.update(batch_size=2**20, max_capacity=2**30), "elements at max_capacity"),
], ids=["huge-window", "ring-rows-past-int32", "huge-heads", "huge-batch", "capacity-past-int32", "huge-tensor"])
def test_sizes_beyond_int32_or_torch_are_refused(change, fragment):
    data = _manifest()
    change(data)
    _rejected(data, fragment)


@pytest.mark.parametrize("change", [
    lambda m: m.update(max_capacity="256"),
    lambda m: m.update(batch_size=1.0),
    lambda m: m["layers"][0].update(kv_heads=True),
    lambda m: m["layers"][0].update(layer_id="0"),
    lambda m: m["layers"][0]["k"].update(index="2"),
], ids=["string-int", "float-int", "bool-int", "string-layer-id", "string-index"])
def test_integers_must_be_json_integers(change):
    """A reader written against the contract would refuse (or misread) these; this one coerced
    them, so the archive-vs-metadata comparison could not notice either."""
    data = _manifest()
    change(data)
    _rejected(data, "valid integer")


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"version": 1, "version": 1}', "key 'version' appears twice"),
    ('{"version": NaN}', "NaN is not a JSON number"),
    ('{"version": Infinity}', "Infinity is not a JSON number"),
])
def test_json_that_python_reads_but_json_does_not_is_refused(text, fragment):
    _rejected(text, "not valid JSON", fragment)


def test_loads_limited_refuses_what_is_not_text():
    from offgraph_export.specs.limits import loads_limited

    with pytest.raises(SpecError, match="is a NoneType, not JSON text"):
        loads_limited(None, "x")  # type: ignore[arg-type]
