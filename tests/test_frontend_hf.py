"""The transformers frontend: ``hf:DIR`` checkpoints in, off-graph artifacts out, checked against
transformers itself (its own eager attention and DynamicCache) and against its own ``generate``.

Tiny random-weight models built from configs (Llama; Qwen2; Mistral whose every layer slides;
Qwen2 mixing sliding and full layers), one of them saved with ``save_pretrained`` beside a
tokenizer trained here with the ``tokenizers`` package, so weight and tokenizer loading are real.
Every model is exported for CPU once (AOTInductor compiles are shared across the tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offgraph_export.check import check_artifact  # noqa: E402
from offgraph_export.errors import ExportError  # noqa: E402
from offgraph_export.frontends import load_bundle  # noqa: E402
from offgraph_export.frontends.hf import TransformersOracle  # noqa: E402
from offgraph_export.generate import generate  # noqa: E402
from offgraph_export.pipeline import export_and_lower  # noqa: E402
from offgraph_export.runtime import Artifact  # noqa: E402
from tests.conftest import cli  # noqa: E402

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    initializer_range=0.1,  # far from uniform attention, so greedy tokens are well separated
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
WINDOW = 8
CACHE = dict(max_capacity=128, initial_capacity=16, max_write=32)


def _configs():
    T = transformers
    return {
        "llama": T.LlamaConfig(**COMMON),
        "qwen2": T.Qwen2Config(**COMMON),
        "mistral_sliding": T.MistralConfig(**COMMON, sliding_window=WINDOW),
        "qwen2_mixed": T.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED),
    }


EXPECTED_WINDOWS = {
    "llama": {},
    "qwen2": {},
    "mistral_sliding": {0: WINDOW, 1: WINDOW, 2: WINDOW},
    "qwen2_mixed": {0: WINDOW, 2: WINDOW},
}
#: the model saved as a real checkpoint (safetensors + a trained tokenizer)
CHECKPOINT = "qwen2_mixed"

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "offgraph export keeps the kv cache outside the graph",
    "a ring buffer holds the last window of keys and values",
] * 40


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """One directory per model: config.json only (random seeded weights), except CHECKPOINT,
    which holds safetensors weights and a tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name, config in _configs().items():
        path = root / name
        if name == CHECKPOINT:
            tokenizer = _train_tokenizer()
            tokenizer.save_pretrained(path)
            reloaded = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
            config.vocab_size = len(reloaded) + 8  # AutoTokenizer may add a token or two
            torch.manual_seed(1)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        else:
            config.save_pretrained(path)
        dirs[name] = path
    return dirs


class _Exported:
    def __init__(self, dirs: dict[str, Path], out: Path) -> None:
        self.dirs, self.out, self.cache = dirs, out, {}

    def __call__(self, name: str):
        """(bundle, artifact) of a model, exported for CPU on first use."""
        if name not in self.cache:
            ref = f"hf:{self.dirs[name]}"
            bundle = load_bundle(ref, **CACHE)
            path, program, _ = export_and_lower(bundle, self.out / f"{name}.pt2", model=ref)
            self.cache[name] = (bundle, Artifact.load(path), program)
        return self.cache[name]


@pytest.fixture(scope="session")
def exported(hf_dirs, tmp_path_factory):
    return _Exported(hf_dirs, tmp_path_factory.mktemp("hf_artifacts"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_configs()))
def test_check_against_transformers_passes(name, exported):
    bundle, artifact, program = exported(name)
    assert program.manifest.layer_ids == [0, 1, 2]
    assert {l.layer_id: l.window for l in program.manifest.layers if l.window} == EXPECTED_WINDOWS[name]
    assert isinstance(bundle.oracle(program.manifest), TransformersOracle)
    report = check_artifact(artifact, bundle)
    assert report.passed, report.render()
    assert report.growths >= 2 if program.manifest.has_flat else report.growths == 0
    assert all(report.ring_wraps.values()) and len(report.ring_wraps) == len(EXPECTED_WINDOWS[name])
    assert max(s.max_abs_err for s in report.steps) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_configs()))
def test_greedy_generation_matches_transformers_generate(name, exported):
    bundle, artifact, _ = exported(name)
    hf_model = bundle.model.hf
    vocab = bundle.vocab_size
    prompt = torch.randint(0, vocab, (1, 10), generator=torch.Generator().manual_seed(7))
    new = 40
    with torch.no_grad():
        want = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, prompt.shape[1]:].tolist()
    got = generate(artifact.new_session(), bundle.make_inputs, prompt[0].tolist(), new).new_tokens
    assert len(want) == new and got == want
    assert len(set(got)) > 3, "degenerate generation proves little"


@pytest.mark.slow
def test_cli_runs_a_checkpoint_with_its_tokenizer(exported, hf_dirs):
    _, artifact, _ = exported(CHECKPOINT)
    proc = cli("run", str(artifact.path), "--model", f"hf:{hf_dirs[CHECKPOINT]}", "--prompt",
               "the quick brown fox", "--max-new-tokens", "8", "--json")
    out = json.loads(proc.stdout)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dirs[CHECKPOINT], local_files_only=True)
    assert out["prompt_tokens"] == tokenizer("the quick brown fox").input_ids
    assert len(out["new_tokens"]) == 8 and out["text"] == tokenizer.decode(out["new_tokens"])


def test_checkpoint_weights_and_tokenizer_load_from_disk(hf_dirs):
    bundle = load_bundle(f"hf:{hf_dirs[CHECKPOINT]}")
    saved = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[CHECKPOINT], local_files_only=True)
    for (name, a), b in zip(bundle.model.hf.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(a, b), name
    assert bundle.decode(bundle.encode("the lazy fox")) == "the lazy fox"


def test_config_only_weights_are_seeded(hf_dirs):
    a = load_bundle(f"hf:{hf_dirs['llama']}", seed=3).model.hf.state_dict()
    b = load_bundle(f"hf:{hf_dirs['llama']}", seed=3).model.hf.state_dict()
    c = load_bundle(f"hf:{hf_dirs['llama']}", seed=4).model.hf.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_traced_graph_holds_one_op_per_layer_and_no_cache(exported):
    _, _, program = exported("qwen2_mixed")
    graph = program.exported.graph
    ops = [n for n in graph.nodes if n.op == "call_function" and "update_and_attend" in str(n.target)]
    assert len(ops) == 3
    assert not program.exported.graph_signature.buffers_to_mutate  # no cache state in the graph
    assert list(program.exported.graph_signature.user_inputs) == ["tokens", "position"]


# -- refusals and bad directories --------------------------------------------------------------


def _save(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return f"hf:{tmp_path}"


def test_cross_attention_is_refused(tmp_path):
    ref = _save(tmp_path, transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, add_cross_attention=True))
    with pytest.raises(ExportError, match="cross-attention"):
        load_bundle(ref)


def test_encoder_decoder_is_refused(tmp_path):
    ref = _save(tmp_path, transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2))
    with pytest.raises(ExportError, match="encoder-decoder"):
        load_bundle(ref)


# soft-capping (Gemma 2) and sinks (GPT-OSS) are supported: tests/test_softcap_sinks.py


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: transformers.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True), "ALiBi"),
        (lambda: transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4), "layer 0: attention called 0 times"),
        (lambda: transformers.Llama4TextConfig(**{**COMMON, "intermediate_size_mlp": 128, "num_local_experts": 2}, attention_chunk_size=8), "chunked_attention"),
    ],
    ids=["alibi", "no-attention-interface", "chunked-layers"],
)
def test_other_features_are_refused(tmp_path, make, message):
    with pytest.raises(ExportError, match=message):
        load_bundle(_save(tmp_path, make()))


def test_experts_looping_over_the_chosen_experts_are_refused_at_export_naming_the_code(tmp_path):
    """DBRX's experts loop over the experts its tokens hit (``nonzero``): torch.export cannot record
    that in one graph. The refusal is one line naming the model's line, before anything compiles."""
    from offgraph_export.pipeline import export_and_lower

    config = transformers.DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    )
    ref = _save(tmp_path, config)
    bundle = load_bundle(ref, max_capacity=64, initial_capacity=16, max_write=16)
    with pytest.raises(ExportError) as info:
        export_and_lower(bundle, tmp_path / "dbrx.pt2", model=ref)
    message = str(info.value)
    assert "\n" not in message
    assert "modeling_dbrx.py:" in message and "branches on the values of a tensor" in message
    assert "cannot be exported" in message
    assert not (tmp_path / "dbrx.pt2").exists()


def test_length_dependent_rope_is_refused(tmp_path):
    config = transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ExportError, match="length-dependent RoPE"):
        load_bundle(_save(tmp_path, config))


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "no such checkpoint directory"),
        (lambda d: d.mkdir(), "config.json is missing"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{not json")), "config.json is not valid JSON"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "no-such-arch"}')), "cannot be read as a transformers config"),
        (lambda d: (d.mkdir(), (d / "config.json").mkdir()), "config.json is not a regular file"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text('{"a": ' + " " * (1 << 20) + "1}")), "config.json is larger than"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("[" * 100_000)), "nests deeper than"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text('{"a": ' + "9" * 5000 + "}")), "config.json is not a valid spec"),
    ],
    ids=["missing-dir", "missing-config", "bad-json", "unknown-arch", "config-not-a-file", "config-too-large",
         "config-too-deep", "config-huge-integer"],
)
def test_bad_directories_are_one_line_errors_naming_the_file(tmp_path, setup, message):
    path = tmp_path / "ckpt"
    setup(path)
    with pytest.raises(ExportError, match=message) as info:
        load_bundle(f"hf:{path}")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("weights", ["tf_model.h5", "flax_model.msgpack", "model.gguf",
                                     "model.safetensors.index.json", "model-00001-of-00002.safetensors"])
def test_weights_in_a_form_not_read_are_refused_not_replaced_by_random_ones(tmp_path, weights):
    """Only a directory with no weights at all gets seeded random ones: beside other weight files
    the export would silently not be the user's model."""
    transformers.LlamaConfig(**COMMON).save_pretrained(tmp_path)
    (tmp_path / weights).write_text('{"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(ExportError, match="only safetensors weights|names the shard"):
        load_bundle(f"hf:{tmp_path}")


def test_an_index_naming_a_shard_outside_the_directory_is_refused(tmp_path):
    real, ckpt = tmp_path / "real", tmp_path / "ckpt"
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    model.save_pretrained(real)
    model.config.save_pretrained(ckpt)
    (ckpt / "decoy.safetensors").write_bytes(b"")
    index = {"metadata": {}, "weight_map": {name: "../real/model.safetensors" for name in model.state_dict()}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ExportError, match=r"names the shard '../real/model.safetensors', which is not a file in the directory"):
        load_bundle(f"hf:{ckpt}")


def test_a_cache_past_the_models_positions_is_refused(tmp_path):
    ref = _save(tmp_path, transformers.LlamaConfig(**COMMON))  # max_position_embeddings 512
    with pytest.raises(ExportError, match="max_capacity 1024 is more than the 512 positions the model is defined for"):
        load_bundle(ref, max_capacity=1024)
    assert load_bundle(ref, max_capacity=512).cache_config.max_capacity == 512


def test_a_window_as_long_as_the_cache_is_flat(tmp_path):
    """A sliding window at least the capacity never excludes a key: the layer is flat (a ring
    would hold window + max_write rows, more than the cache ever fills)."""
    config = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED)
    ref = _save(tmp_path, config)
    assert load_bundle(ref, max_capacity=64).cache_config.ring_windows == {0: WINDOW, 2: WINDOW}
    assert load_bundle(ref, max_capacity=WINDOW).cache_config.ring_windows == {}


def test_inconsistent_cache_arguments_are_refused_not_clamped(tmp_path):
    ref = _save(tmp_path, transformers.LlamaConfig(**COMMON))
    with pytest.raises(ExportError, match="invalid cache configuration: .*max_write"):
        load_bundle(ref, max_capacity=100, max_write=500)


def test_pickled_weights_are_not_loaded(tmp_path):
    transformers.LlamaConfig(**COMMON).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(ExportError, match=r"only safetensors weights .* are read; found \[.pytorch_model.bin.\]"):
        load_bundle(f"hf:{tmp_path}")


def test_a_config_whose_random_weights_would_not_fit_in_memory_is_refused(tmp_path):
    """A 200-byte config.json alone asked for terabytes of random weights (the OOM killer ended
    the process); sized on the meta device first, it is refused naming the size."""
    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 65536, "intermediate_size": 262144,
                                         "num_hidden_layers": 64, "num_attention_heads": 64, "head_dim": 1024})
    with pytest.raises(ExportError, match=r"config.json describes \d+\.\d GB of float32 weights, more than this machine's"):
        load_bundle(_save(tmp_path, config))
