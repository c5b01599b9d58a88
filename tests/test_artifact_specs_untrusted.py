"""``ArtifactSpecs`` read from an untrusted specs entry (``parse_artifact_specs``, no archive, no
compile): input names, symbol ranges and entry counts are refused with an error naming the bad
value and what was expected."""

from __future__ import annotations

import copy
import json

import pytest

from offgraph_export.errors import ArtifactError
from offgraph_export.specs import SymbolRange, parse_artifact_specs
from offgraph_export.specs.limits import MAX_SPEC_ITEMS, MAX_SPEC_VALUES

#: the specs of the bundled example, as exported (`examples/tiny_llama.py:build`, defaults)
SPECS = {
    "version": 1,
    "step_width": "0:1",
    "manifest": {
        "version": 1, "storage_dtype": "float32", "batch_size": 1, "max_capacity": 256,
        "initial_capacity": 16, "max_write": 32,
        "layers": [
            {"layer_id": 0, "window": None, "kv_heads": 2, "head_dim": 16, "v_head_dim": 16,
             "k": {"name": "k_cache_0", "index": 2}, "v": {"name": "v_cache_0", "index": 3}, "policy": "flat"},
            {"layer_id": 1, "window": 16, "kv_heads": 2, "head_dim": 16, "v_head_dim": 16,
             "k": {"name": "k_cache_1", "index": 4}, "v": {"name": "v_cache_1", "index": 5}, "policy": "ring"},
        ],
    },
    "device": "cpu",
    "step_impl": "portable",
    "inputs": [
        {"name": "tokens", "dtype": "int64", "shape": [1, "s27"], "index_bound": 256},
        {"name": "position", "dtype": "int64", "shape": ["s27"], "index_bound": None},
    ],
    "symbols": {"s27": {"min": 1, "max": 32}},
    "torch_version": "2.13.0+cpu",
    "model": "/work/examples/tiny_llama.py:build",
    "model_args": {},
    "model_dtype": None,
    "positions_input": 1,
    "options": {"fuse_projections": True, "max_autotune": "none"},
    "decode_method": False,
}


def _specs(change=None) -> dict:
    data = copy.deepcopy(SPECS)
    if change is not None:
        change(data)
    return data


def _refused(data, *fragments: str) -> str:
    text = data if isinstance(data, str) else json.dumps(data)
    with pytest.raises(ArtifactError) as info:
        parse_artifact_specs(text, "p.pt2")
    message = str(info.value)
    assert message.startswith("p.pt2: ")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_control_the_example_specs_parse_and_round_trip():
    specs = parse_artifact_specs(json.dumps(SPECS))
    assert [i.name for i in specs.inputs] == ["tokens", "position"]
    assert parse_artifact_specs(specs.model_dump_json()) == specs


# -- input names ------------------------------------------------------------------------------


def test_duplicate_input_names_are_refused():
    _refused(
        _specs(lambda s: s["inputs"][1].update(name="tokens")),
        "input 1 is named 'tokens', the name of input 0; every input of the program needs a name of its own",
    )


@pytest.mark.parametrize("name", ["k_cache_0", "v_cache_1"])
def test_a_model_input_named_like_a_storage_input_is_refused(name):
    """Model inputs and storage inputs are the inputs of one program: one namespace."""
    _refused(
        _specs(lambda s: s["inputs"][0].update(name=name)),
        f"input 0 is named {name!r}, the name of a storage input",
    )


# -- symbol ranges ----------------------------------------------------------------------------


def _with_batch_symbol(rng: dict):
    def change(s):
        s["inputs"][0]["shape"][0] = "batch"
        s["symbols"]["batch"] = rng

    return change


def test_a_bounded_symbol_besides_the_width_is_taken():
    specs = parse_artifact_specs(json.dumps(_specs(_with_batch_symbol({"min": 1, "max": 8}))))
    assert specs.symbols["batch"] == SymbolRange(min=1, max=8)


def test_a_null_max_on_a_symbol_other_than_the_width_is_refused():
    """docs/design.md 4.3: every symbol's range is ``0 <= min <= max``; a null max would let
    admission take any size along that dim."""
    _refused(
        _specs(_with_batch_symbol({"min": 1, "max": None})),
        "symbol 'batch' has max null; a symbol's range must be bounded: an integer max >= min=1",
    )


def test_a_null_max_on_an_unused_symbol_is_refused():
    _refused(
        _specs(lambda s: s["symbols"].update(other={"min": 0, "max": None})),
        "symbol 'other' has max null",
    )


def test_a_null_max_on_the_width_symbol_is_refused_like_any_other():
    _refused(
        _specs(lambda s: s["symbols"]["s27"].update(max=None)),
        "symbol 's27' has max null; a symbol's range must be bounded: an integer max >= min=1",
    )


# -- entry counts -----------------------------------------------------------------------------


N = 20_000  # entries of two or three bytes: 60 kB, inside the JSON size limit and MAX_SPEC_VALUES

HOSTILE_COUNTS = [
    pytest.param(lambda s: s["manifest"].update(layers=[{}] * N), "manifest.layers", id="layers"),
    pytest.param(lambda s: s.update(inputs=[{}] * N), "inputs", id="inputs"),
    pytest.param(lambda s: s["inputs"][0].update(shape=[None] * N), "inputs.0.shape", id="shape"),
    pytest.param(lambda s: s.update(symbols={f"s{i}": {} for i in range(N)}), "symbols", id="symbols"),
    pytest.param(lambda s: s.update(model_args={f"a{i}": [] for i in range(N)}), "model_args", id="model-args"),
    pytest.param(lambda s: s.update(options={f"o{i}": None for i in range(N)}), "options", id="options"),
]


@pytest.mark.parametrize(("change", "where"), HOSTILE_COUNTS)
def test_hostile_entry_counts_are_refused_before_the_entries_are_validated(change, where):
    """Validated one by one, each bad entry costs one or more errors: a message of tens of
    megabytes, and memory and seconds to match, before the refusal. The count is refused first."""
    message = _refused(_specs(change), where, f"{N} entries", f"holds at most {MAX_SPEC_ITEMS}")
    assert len(message) < 2000, len(message)


def test_entry_counts_up_to_the_limit_are_taken():
    def change(s):
        s["model_args"] = {f"a{i}": i for i in range(MAX_SPEC_ITEMS)}

    assert len(parse_artifact_specs(json.dumps(_specs(change))).model_args) == MAX_SPEC_ITEMS
    _refused(
        _specs(lambda s: s.update(model_args={f"a{i}": i for i in range(MAX_SPEC_ITEMS + 1)})),
        f"{MAX_SPEC_ITEMS + 1} entries",
    )


# -- values in all ------------------------------------------------------------------------------


def _extra_keys(where):
    def change(s):
        target = {"top": s, "input": s["inputs"][0], "storage": s["manifest"]["layers"][0]["k"]}[where]
        target.update({f"x{i}": 0 for i in range(300_000)})
    return change


@pytest.mark.parametrize("where", ["top", "input", "storage"])
def test_unknown_keys_past_the_value_limit_are_refused_before_validation(where):
    """Objects of fixed fields take no per-collection count; 300,000 unknown keys (3.5 MB, inside
    the size limit) were one validation error each: a 55-60 MB message before the refusal."""
    message = _refused(_specs(_extra_keys(where)), f"holds more than {MAX_SPEC_VALUES} values")
    assert len(message) < 500, len(message)


def test_unknown_keys_below_the_value_limit_are_refused_by_name():
    _refused(_specs(lambda s: s.update(surprise=1)), "surprise")
