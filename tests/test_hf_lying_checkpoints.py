"""Issue 25, a checkpoint that lies: an ``hf:DIR`` whose safetensors weights or config.json do not
describe the model is refused by name, never exported with random, cast or garbage values.

Tiny real checkpoints made by transformers itself (``save_pretrained``), then edited with
``safetensors.torch``: tensors taken out, added, retyped or reshaped; config sizes past their bounds.
A spy on ``AutoModelForCausalLM`` records every model built and the device it was built on, so each
refusal that comes before loading asserts that nothing real was built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from offgraph_export.errors import ExportError  # noqa: E402
from offgraph_export.frontends import load_bundle  # noqa: E402
from offgraph_export.frontends.hf import validate  # noqa: E402

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
LAYER_1 = [f"model.layers.1.{name}.weight" for name in (
    "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
    "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def _save(path: Path, **overrides) -> Path:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides})).save_pretrained(path)
    return path


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A correct tiny Llama checkpoint (config.json + model.safetensors)."""
    return _save(tmp_path / "ckpt")


def _edit(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def built(monkeypatch) -> dict[str, list]:
    """Every model ``AutoModelForCausalLM`` builds: from_config calls (with the device they built
    on: meta for sizing, allocating nothing) and from_pretrained calls; AutoConfig reads too."""
    calls: dict[str, list] = {"from_config": [], "from_pretrained": [], "config": []}
    auto, auto_config = transformers.AutoModelForCausalLM, transformers.AutoConfig
    from_config, from_pretrained, read_config = auto.from_config, auto.from_pretrained, auto_config.from_pretrained

    def spy_config(*args, **kwargs):
        calls["from_config"].append(str(torch.get_default_device()))
        return from_config(*args, **kwargs)

    def spy_pretrained(*args, **kwargs):
        calls["from_pretrained"].append(args)
        return from_pretrained(*args, **kwargs)

    def spy_read(*args, **kwargs):
        calls["config"].append(args)
        return read_config(*args, **kwargs)

    monkeypatch.setattr(auto, "from_config", spy_config)
    monkeypatch.setattr(auto, "from_pretrained", spy_pretrained)
    monkeypatch.setattr(auto_config, "from_pretrained", spy_read)
    return calls


def _refused(path: Path, message: str, **kwargs) -> str:
    with pytest.raises(ExportError) as info:
        load_bundle(f"hf:{path}", **kwargs)
    text = str(info.value)
    assert text == f"hf:{path}: {message}"
    assert "\n" not in text
    return text


# -- what still loads ----------------------------------------------------------------------------


def test_a_correct_checkpoint_loads_its_own_weights(ckpt, built):
    bundle = load_bundle(f"hf:{ckpt}")
    saved = load_file(ckpt / "model.safetensors")
    state = bundle.model.hf.state_dict()
    assert set(saved) == set(state)  # rotary inv_freq is a non-persistent buffer: not in either
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert len(built["from_pretrained"]) == 1


@pytest.mark.parametrize(("dtype", "expected"), [(None, torch.float32), ("bfloat16", torch.bfloat16)])
def test_a_bf16_checkpoint_is_cast_to_the_export_dtype(ckpt, dtype, expected):
    _edit(ckpt, lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    bundle = load_bundle(f"hf:{ckpt}", dtype=dtype)
    state = bundle.model.hf.state_dict()
    for name, tensor in load_file(ckpt / "model.safetensors").items():
        assert state[name].dtype == expected, name
        assert torch.equal(state[name], tensor.to(expected)), name


def test_a_tied_checkpoint_without_lm_head_loads(tmp_path):
    path = _save(tmp_path / "tied", tie_word_embeddings=True)
    saved = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in saved  # save_pretrained leaves the tied copy out
    hf = load_bundle(f"hf:{path}").model.hf
    assert torch.equal(hf.lm_head.weight, saved["model.embed_tokens.weight"])
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


# -- weights that lie ----------------------------------------------------------------------------


def test_missing_tensors_are_refused_by_name_not_filled_with_random_values(ckpt):
    _edit(ckpt, lambda t: [t.pop(name) for name in LAYER_1])
    shown = ", ".join(sorted(LAYER_1)[:5])
    _refused(ckpt, f"the safetensors weights lack 9 tensors of the model: {shown}, ... (9 in all) "
                   "(a checkpoint holds every weight but tied ones; refused rather than filled with random values)")


def test_one_missing_tensor_is_named(ckpt):
    _edit(ckpt, lambda t: t.pop("lm_head.weight"))  # not tied in this config: the head is missing
    _refused(ckpt, "the safetensors weights lack 1 tensor of the model: lm_head.weight "
                   "(a checkpoint holds every weight but tied ones; refused rather than filled with random values)")


def test_unexpected_tensors_are_refused_by_name(ckpt):
    extra = {"extra.weight": torch.zeros(3), "model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}
    _edit(ckpt, lambda t: t.update(extra))
    _refused(ckpt, "the safetensors weights hold 2 tensors the model does not have: "
                   "extra.weight, model.layers.2.mlp.up_proj.weight (is config.json the checkpoint's own?)")


@pytest.mark.parametrize(("dtype", "header"), [(torch.int32, "I32"), (torch.bool, "BOOL"), (torch.uint8, "U8"),
                                               (torch.int64, "I64")])
def test_a_mistyped_tensor_is_refused_by_name_not_cast(ckpt, built, dtype, header):
    _edit(ckpt, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=dtype)}))
    _refused(ckpt, f"1 tensor of the safetensors weights has a dtype the model's cannot be cast from: "
                   f"model.norm.weight is {header} in model.safetensors, the model's is float32 (floating-point "
                   "weights are cast to the export dtype; integer, bool and complex ones are not weights of this model)")
    assert built["from_pretrained"] == [] and built["from_config"] == ["meta"]  # refused before loading


def test_a_tensor_of_the_wrong_shape_is_refused_naming_both_shapes(ckpt, built):
    _edit(ckpt, lambda t: t.update({"model.norm.weight": torch.ones(65),
                                    "model.layers.0.mlp.up_proj.weight": torch.ones(64, 128)}))
    _refused(ckpt, "2 tensors of the safetensors weights have a shape other than the model's: "
                   "model.layers.0.mlp.up_proj.weight is [64, 128] in model.safetensors, the model's is [128, 64]; "
                   "model.norm.weight is [65] in model.safetensors, the model's is [64] "
                   "(is config.json the checkpoint's own?)")
    assert built["from_pretrained"] == [] and built["from_config"] == ["meta"]


def test_an_unreadable_safetensors_file_is_refused_naming_it(ckpt, built):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 16)
    text = str(pytest.raises(ExportError, load_bundle, f"hf:{ckpt}").value)
    assert text.startswith(f"hf:{ckpt}: model.safetensors is not a readable safetensors file: ") and "\n" not in text
    assert built["from_pretrained"] == []


# -- configs that lie ----------------------------------------------------------------------------


def test_a_million_layers_are_refused_before_anything_is_built(ckpt, built):
    _edit_config(ckpt, num_hidden_layers=1_000_000)
    _refused(ckpt, f"config.json: num_hidden_layers is 1000000, more than the {validate.MAX_LAYERS} a checkpoint "
                   "may have (the bound keeps a model under 80 billion parameters and in memory)")
    assert built == {"from_config": [], "from_pretrained": [], "config": []}  # not even the config class ran


def test_a_huge_hidden_size_is_refused_before_anything_is_built(tmp_path, built):
    path = tmp_path / "wide"
    transformers.LlamaConfig(**TINY).save_pretrained(path)  # config only: random weights would be made
    _edit_config(path, hidden_size=1 << 20)
    _refused(path, f"config.json: hidden_size is 1048576, more than the {validate.MAX_HIDDEN_SIZE} a checkpoint "
                   "may have (the bound keeps a model under 80 billion parameters and in memory)")
    assert built == {"from_config": [], "from_pretrained": [], "config": []}


@pytest.mark.parametrize(("field", "value", "bound"), [
    ("vocab_size", 1 << 24, validate.MAX_VOCAB_SIZE),
    ("intermediate_size", 1 << 30, validate.MAX_INTERMEDIATE_SIZE),
    ("num_local_experts", 10**9, validate.MAX_EXPERTS),
])
def test_other_sizes_are_bounded(ckpt, built, field, value, bound):
    _edit_config(ckpt, **{field: value})
    _refused(ckpt, f"config.json: {field} is {value}, more than the {bound} a checkpoint may have "
                   "(the bound keeps a model under 80 billion parameters and in memory)")
    assert built["from_config"] == [] and built["from_pretrained"] == []


def test_a_nested_text_config_is_bounded_too(ckpt, built):
    _edit_config(ckpt, text_config={"num_hidden_layers": 5000})
    _refused(ckpt, f"config.json: text_config.num_hidden_layers is 5000, more than the {validate.MAX_LAYERS} "
                   "a checkpoint may have (the bound keeps a model under 80 billion parameters and in memory)")


def test_a_model_past_the_parameter_bound_is_refused_before_loading(ckpt, built):
    """Every size within its own bound, together past MAX_PARAMETERS: counted on the meta device."""
    _edit_config(ckpt, num_hidden_layers=100, hidden_size=16384, intermediate_size=65536,
                 num_attention_heads=128, num_key_value_heads=8, head_dim=128)
    text = str(pytest.raises(ExportError, load_bundle, f"hf:{ckpt}").value)
    assert text.startswith(f"hf:{ckpt}: config.json describes a model of ")
    assert text.endswith(" billion parameters, more than the 80 billion a checkpoint may have")
    assert float(text.split("a model of ")[1].split()[0]) > 80
    assert built["from_pretrained"] == [] and built["from_config"] == ["meta"]


def test_the_real_sizes_of_large_decoders_are_within_the_bounds():
    """Llama 3.1 405B's sizes and Gemma 3's vocabulary pass the field bounds (the parameter bound
    is what refuses a model that large)."""
    big = dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, vocab_size=262144,
               num_local_experts=256)
    assert validate.size_problem(big) is None
