"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) against transformers itself.

transformers 5 caches MLA's compressed latent (one ``kv_lora_rank`` "key" and one rotary "value"
per position, a single head) and expands it into per-head K/V every step; the artifact stores the
expanded K/V its attention receives. Until 2026-12-02 ``check`` compared those stored rows with
the latent cache and failed at the first prefill ("stored rows hold other non-finite values")
while every output matched: the comparison was wrong, not the compiled step. Now the rows of a
layer whose eager cache holds another form are left uncompared, with a note naming both forms,
and the outputs (which depend on every stored row) are compared at every step.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import cli

transformers = pytest.importorskip("transformers")


def _deepseek_v3(path) -> None:
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, n_group=1, topk_group=1,
    )
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(path)


def test_mla_artifact_passes_check_against_transformers_with_the_form_noted(tmp_path):
    model = tmp_path / "ds3"
    _deepseek_v3(model)
    artifact = tmp_path / "ds3.pt2"
    cli("export", f"hf:{model}", "-o", str(artifact), "--max-capacity", "64", "--max-write", "16")
    result = cli("check", str(artifact), "--model", f"hf:{model}", "--json", check=False)
    import json

    report = json.loads(result.stdout)
    assert report["passed"] is True, report["problems"] or [s["problems"] for s in report["steps"] if s["problems"]]
    form = [n for n in report["notes"] if "another form than the K/V its attention receives" in n]
    assert len(form) == 2 and "(1, 16, 8)" in form[0] and "(4, 24, 16)" in form[0], report["notes"]
    assert all(s["max_abs_err"] <= s["tolerance"] for s in report["steps"]) and len(report["steps"]) > 4


def test_another_cache_form_is_a_note_only_where_the_oracle_says_so():
    """A cache in another form than the manifest's is a note (rows uncompared) only for an oracle
    that caches another form (transformers' MLA); for any other it stays a problem naming the
    layer, and a cache in the manifest's form is compared row by row."""
    from offgraph_export.check import _check_manifest_model, _other_form, _rows_comparable
    from offgraph_export.specs.manifest import LayerManifest

    layer = LayerManifest.model_construct(layer_id=0, kv_heads=2, head_dim=16, v_head_dim=16, window=None)
    same = ([0, 1], torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16))
    latent = ([0, 1], torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 4))
    assert _other_form(same, layer) is None and _other_form(latent, layer) == (1, 8, 4)

    class Held:
        def __init__(self, held, other_form):
            self._held, self.caches_other_form = held, other_form

        def held(self, layer_id):
            return self._held

    manifest = type("M", (), {"layers": [layer]})()
    for other_form in (False, True):
        assert _check_manifest_model(Held(same, other_form), manifest) == ([], [])
        assert _rows_comparable(Held(same, other_form), same, layer)
    problems, notes = _check_manifest_model(Held(latent, True), manifest)
    assert problems == [] and len(notes) == 1 and "(1, 8, 4)" in notes[0]
    assert not _rows_comparable(Held(latent, True), latent, layer)
    problems, notes = _check_manifest_model(Held(latent, False), manifest)
    assert notes == [] and problems == ["layer 0: eager model writes (kv_heads, head_dim, v_head_dim)=(1, 8, 4), manifest says (2, 16, 16)"]
    assert _rows_comparable(Held(latent, False), latent, layer)  # compared, and reported as differing
    assert _check_manifest_model(Held(None, True), manifest)[0] == ["manifest layer 0: the eager model never wrote this layer"]
