"""The model zoo: every architecture the README lists as supported has a test here or elsewhere in
the suite that exports a tiny random-weight config of it for cpu and passes ``check`` against
transformers, and every feature the README lists as refused has a test that asserts its named
reason. The compiled packages are shared with those tests (each compiles once in the suite), so
this module holds the registry, reads the README against it, and runs what no other test runs:
the mixture-of-experts models the README says export.

The registry is the source: a README entry without a test, or a test without its README entry,
fails here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[1] / "README.md"

#: README name (the "Tested on CPU" list) -> (test module, test function, parameter id or None):
#: the test that exports it for cpu and passes check against transformers
SUPPORTED = {
    "Llama": ("tests.test_frontend_hf", "test_check_against_transformers_passes", "llama"),
    "Qwen2": ("tests.test_frontend_hf", "test_check_against_transformers_passes", "qwen2"),
    "Mistral": ("tests.test_frontend_hf", "test_check_against_transformers_passes", "mistral_sliding"),
    "Qwen2 mixing sliding and full layers": ("tests.test_frontend_hf", "test_check_against_transformers_passes", "qwen2_mixed"),
    "Phi-3": ("tests.test_any_strides", "test_tiny_phi3_exports_for_cpu_and_passes_check", None),
    "DeepSeek-V3": ("tests.test_mla_check", "test_mla_artifact_passes_check_against_transformers_with_the_form_noted", None),
    "Gemma 2": ("tests.test_softcap_sinks", "test_hf_export_checks_against_transformers", "gemma2"),
    "GPT-OSS": ("tests.test_softcap_sinks", "test_hf_export_checks_against_transformers", "gpt_oss"),
}

#: a phrase of the README's refused list -> the test asserting that refusal by name
REFUSED = {
    "in a batched export": ("tests.test_softcap_sinks", "test_batched_export_is_refused_by_name", None),
    "ALiBi": ("tests.test_frontend_hf", "test_other_features_are_refused", "alibi"),
    "cross-attention": ("tests.test_frontend_hf", "test_cross_attention_is_refused", None),
    "encoder-decoder models": ("tests.test_frontend_hf", "test_encoder_decoder_is_refused", None),
    "chunked layers of Llama 4": ("tests.test_frontend_hf", "test_other_features_are_refused", "chunked-layers"),
    "length-dependent RoPE": ("tests.test_frontend_hf", "test_length_dependent_rope_is_refused", None),
    "(Bloom)": ("tests.test_frontend_hf", "test_other_features_are_refused", "no-attention-interface"),
    "DBRX": ("tests.test_frontend_hf", "test_experts_looping_over_the_chosen_experts_are_refused_at_export_naming_the_code", None),
    "`aten._grouped_mm` for cuda": ("tests.test_aoti_shim", "test_a_program_calling_an_op_the_shim_lacks_is_refused_by_name", None),
}


def _table_row(label: str) -> str:
    """The README's supported/refused table cell of ``label``."""
    for line in README.read_text().splitlines():
        if line.startswith(f"| {label} |"):
            return line
    raise AssertionError(f"README has no table row {label!r}")


def _top_level_items(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses, each item's name before its first '('."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.split("(")[0].strip() for item in items if item.strip()]


def _readme_supported() -> list[str]:
    row = _table_row("supported")
    tested = re.search(r"Tested on CPU: (.*?); on the H200", row)
    assert tested, "the supported row lost its 'Tested on CPU: ...; on the H200' list"
    return _top_level_items(tested.group(1))


def _has_test(module: str, function: str, param: str | None) -> bool:
    fn = getattr(importlib.import_module(module), function, None)
    if fn is None:
        return False
    if param is None:
        return True
    ids = [i for mark in getattr(fn, "pytestmark", []) if mark.name == "parametrize"
           for i in (mark.kwargs.get("ids") or [str(v) for v in mark.args[1]])]
    return param in ids


def test_the_readme_lists_exactly_the_registrys_architectures():
    assert sorted(_readme_supported()) == sorted(SUPPORTED)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_each_supported_architecture_has_its_export_and_check_test(name):
    assert _has_test(*SUPPORTED[name]), f"{name}: no test {SUPPORTED[name]}"


@pytest.mark.parametrize("phrase", sorted(REFUSED))
def test_each_refusal_the_readme_lists_has_its_test(phrase):
    assert phrase in _table_row("refused at export, naming the feature (and the layer)")
    assert _has_test(*REFUSED[phrase]), f"{phrase}: no test {REFUSED[phrase]}"


# ---------------------------------------------------------------------------------------------
# The mixture-of-experts models whose experts run batched export (the README's refused row says so)
# ---------------------------------------------------------------------------------------------

_MOE_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)


def _moe_configs():
    T = transformers
    return {
        "Mixtral": T.MixtralConfig(**_MOE_COMMON, num_local_experts=4, num_experts_per_tok=2),
        "Qwen2-MoE": T.Qwen2MoeConfig(**_MOE_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                      shared_expert_intermediate_size=64),
    }


@pytest.mark.parametrize("name", ["Mixtral", "Qwen2-MoE"])
def test_batched_experts_export(name, tmp_path):
    """torch.export records their experts (no data-dependent branch) and the passes strip every
    layer's op; the stripped program matches the eager model on a prefill (no compile)."""
    from offgraph_export.frontends import load_bundle
    from offgraph_export.pipeline import export_model, run_passes
    from offgraph_export.reference.oracle import ReferenceOracle
    from offgraph_export.runtime.storage import SessionStorage

    assert name in _table_row("refused at export, naming the feature (and the layer)")
    _moe_configs()[name].save_pretrained(tmp_path)
    bundle = load_bundle(f"hf:{tmp_path}", max_capacity=64, initial_capacity=16, max_write=16)
    ep = export_model(bundle.model, bundle.example_inputs, bundle.token_dims, 16)
    program = run_passes(ep, bundle.example_inputs, bundle.cache_config)
    stripped = program.stripped.module()
    storage = SessionStorage(program.manifest, "cpu", poison=True)
    storage.ensure(7, 0)
    step = (torch.arange(1, 8)[None], torch.arange(7))
    with torch.no_grad():
        (want,) = ReferenceOracle(bundle.model, program.manifest).step(step)
        got = stripped(*step, *storage.bound())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
