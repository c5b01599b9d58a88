"""The gpt-fast-style benchmark contender (benchmarks/gptfast.py) computes what transformers'
eager Llama computes, float and with int8 / int4 (tinygemm's cpu kernel) weights against the same
model carrying ``W'``; its self-check refuses a wrongly packed weight. On cpu, no compile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gptfast  # noqa: E402


def _llama(tied: bool, dtype=torch.float32, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=tied,
                      rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 64, "rope_theta": 500000.0})
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("tied", [False, True])
def test_float_contender_matches_transformers_eager(tied):
    hf = _llama(tied)
    model = gptfast.Transformer(hf, "none")
    assert gptfast.self_check(model, hf, "none", layers=2) < 1e-5  # float32: the same math in another order


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_contender_matches_the_eager_model_over_w_prime(quant):
    hf = _llama(tied=True, layers=3)
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    model = gptfast.Transformer(hf, quant)
    assert gptfast.self_check(model, hf, quant) < 1e-3  # its first 2 layers
    # both models have all their layers back, and the oracle's weights are dropped
    assert len(model.layers) == len(hf.model.layers) == 3
    assert not any(hasattr(m, "w_prime") for m in model.modules())
    # the eager model got its own weights (and its tied table) back
    assert all(torch.equal(v, before[k]) for k, v in hf.state_dict().items())
    assert hf.lm_head.weight is hf.model.embed_tokens.weight


def test_self_check_refuses_a_wrongly_packed_int4_weight():
    hf = _llama(tied=False)
    model = gptfast.Transformer(hf, "int4")
    # every projection packed with its nibbles the other way round (even k in the high nibble: the
    # order tinygemm's cuda packing takes, a mix-up the cpu path must not hide)
    for mod in model.modules():
        if isinstance(mod, gptfast.Int4Linear):
            n, k = mod.w_prime.shape
            stored = gptfast.quantize(mod.w_prime, "int4", mod.group)
            swapped = torch.stack([stored.qweight >> 4, stored.qweight & 15], -1).reshape(n, k).to(torch.int32)
            mod.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(swapped, gptfast.INNER_K_TILES)
    with pytest.raises(RuntimeError, match="differs from the eager model"):
        gptfast.self_check(model, hf, "int4")


@pytest.mark.parametrize("tied", [False, True])
def test_the_floor_counts_the_weights_a_step_reads_as_the_contender_does(tied):
    """decode_bench's floor (every parameter, an untied input embedding table left out: a step
    reads one row of it) and the contender's own count (its linears, norms and lm_head) agree."""
    import decode_bench

    hf = _llama(tied)
    table = hf.get_input_embeddings().weight
    assert decode_bench.weight_bytes(hf) == gptfast._weight_bytes(gptfast.Transformer(hf, "none"))
    every = sum(p.numel() * p.element_size() for p in hf.parameters())
    assert decode_bench.weight_bytes(hf) == every - (0 if tied else table.numel() * table.element_size())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_floor_counts_the_bytes_the_contender_stores(tied, quant):
    """decode_bench's floor for a quantized build (the stored form's bytes, from the model's shapes)
    equals the bytes the gpt-fast-style contender's quantized modules actually hold."""
    import decode_bench  # noqa: E402 - benchmarks/, on the path above

    hf = _llama(tied, dtype=torch.bfloat16)
    model = gptfast.Transformer(hf, quant)
    expected = gptfast._weight_bytes(model)
    assert decode_bench.quantized_weight_bytes(hf, quant, gptfast.GROUP if quant == "int4" else None) == expected
    assert expected < decode_bench.weight_bytes(hf)
