"""A config alone gets seeded random weights drawn once (frontends/hf/random_weights.py): the same
for a seed whatever the number of threads, other for another seed, with the distributions of the
model's own initialization, and torch's default layer initialization never drawn."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from offgraph_export.frontends.hf import random_weights  # noqa: E402
from offgraph_export.frontends.hf.random_weights import seeded_random_model  # noqa: E402


@pytest.fixture(scope="module")
def config():
    from transformers import LlamaConfig

    # vocab x hidden = 2 chunks and a part: the embedding and lm_head take the chunked draw
    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=2 * random_weights.NORMAL_CHUNK // 256 + 7,
                       tie_word_embeddings=False, initializer_range=0.02)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_weights_depend_on_the_seed_not_on_the_threads(config):
    one = _state(seeded_random_model(config, torch.float32, seed=0, workers=1))
    three = _state(seeded_random_model(config, torch.float32, seed=0, workers=3))
    other = _state(seeded_random_model(config, torch.float32, seed=1, workers=3))
    assert one.keys() == three.keys() and all(torch.equal(one[k], three[k]) for k in one)
    assert not torch.equal(one["lm_head.weight"], other["lm_head.weight"])
    assert not torch.equal(one["model.layers.0.self_attn.q_proj.weight"], other["model.layers.0.self_attn.q_proj.weight"])


def test_the_draws_follow_the_models_own_initialization_once(config, monkeypatch):
    """Linear and embedding weights ~ N(0, initializer_range) (chunks not repeated), norms ones;
    torch's default (kaiming-uniform) layer initialization is never drawn."""
    drawn, seeded = [], []
    uniform, normal = torch.Tensor.uniform_, torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: drawn.append(self.shape) or uniform(self, *a, **k))
    monkeypatch.setattr(torch.Tensor, "normal_",
                        lambda self, *a, **k: (k.get("generator") is not None and seeded.append(self.numel())) or normal(self, *a, **k))
    model = seeded_random_model(config, torch.float32, seed=0, workers=2)
    assert drawn == []
    # the chunked draw ran: the embedding and lm_head, 3 chunks each, from their own generators
    assert seeded.count(random_weights.NORMAL_CHUNK) == 4 and len(seeded) == 6
    head = model.lm_head.weight.detach().reshape(-1)
    assert head.numel() > 2 * random_weights.NORMAL_CHUNK
    assert abs(float(head.std()) - 0.02) < 2e-4 and abs(float(head.mean())) < 1e-4
    first, second = head[:random_weights.NORMAL_CHUNK], head[random_weights.NORMAL_CHUNK:2 * random_weights.NORMAL_CHUNK]
    assert not torch.equal(first, second) and abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 1e-2
    q = model.model.layers[1].self_attn.q_proj.weight
    assert abs(float(q.std()) - 0.02) < 1e-3
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert not torch.equal(model.model.embed_tokens.weight, model.lm_head.weight)


def test_a_parameter_the_models_initialization_leaves_unset_is_refused_by_name(config, monkeypatch):
    from transformers.models.llama import modeling_llama

    from offgraph_export.errors import ExportError

    init = modeling_llama.LlamaPreTrainedModel._init_weights

    def skipping_norms(self, module):
        if not isinstance(module, modeling_llama.LlamaRMSNorm):
            init(self, module)

    monkeypatch.setattr(modeling_llama.LlamaPreTrainedModel, "_init_weights", skipping_norms)
    with pytest.raises(ExportError, match=r"leaves model\.layers\.0\.input_layernorm\.weight unset"):
        seeded_random_model(config, torch.float32, seed=0, workers=1)
