"""The float32 reference of half-precision checks (reference/upcast.py): the twin swaps in exact
float32 copies and restores the model's own tensors bit for bit; the rule passes what is as close
to the reference as eager is, and fails what is further."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offgraph_export.reference.upcast import REFERENCE_MULTIPLIER, Float32Twin, reference_errors


def _deep_mlp(depth: int = 24, width: int = 256, dtype=torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    model = nn.Sequential(*layers).to(dtype)
    model.register_buffer("half_buffer", torch.randn(width, dtype=dtype))
    model.register_buffer("float_buffer", torch.randn(width))
    return model


def test_twin_runs_in_float32_and_restores_every_tensor_bitwise():
    model = _deep_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids_before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    twin = Float32Twin(model)
    assert twin.tensors == 2 * 24 * 2 + 1  # weights, biases, norm scales and shifts, the half buffer
    x = torch.randn(4, 256)
    with twin.active():
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert model.half_buffer.dtype == torch.float32
        out = model(x)
        # the upcast is exact: the float32 copies hold the half-precision values
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name].float())
    assert out.dtype == torch.float32
    for name, value in model.state_dict().items():
        assert value.dtype == before[name].dtype and torch.equal(value, before[name])
        assert value.data_ptr() == ids_before[name]


def test_twin_is_closer_to_float64_than_bf16_eager():
    """The point of the reference: float32 from the same weights is far nearer a float64 recompute
    than the bf16 run is."""
    model = _deep_mlp()
    x = torch.randn(4, 256)
    with torch.no_grad():
        eager = model(x.bfloat16()).double()
        with Float32Twin(model).active():
            ref32 = model(x).double()
        want = model.double()(x.double())
    assert (ref32 - want).abs().max() < (eager - want).abs().max() / 100


def test_rule_passes_what_is_as_close_as_eager_and_fails_what_is_further():
    model = _deep_mlp()
    x = torch.randn(8, 256)
    with torch.no_grad():
        eager = model(x.bfloat16()).float()
        with Float32Twin(model).active():
            ref = model(x)
        # another bf16 computation of the same model: the float32 result rounded once (closer than eager)
        rounded = ref.bfloat16().float()
    tight = (1e-4, 1e-4)  # a tolerance the eager bf16 model itself misses against float32: drift shown
    assert (eager - ref).abs().max() > 1e-4 + 1e-4 * ref.abs().max()
    assert reference_errors(eager, eager, ref, tight).ok
    near = reference_errors(rounded, eager, ref, tight)
    assert near.ok and near.artifact_rms < near.eager_rms
    # a wrong row (one token's output off by 30 times the eager error's mean) fails
    wrong = eager.clone()
    wrong[3] += 30 * (eager - ref).abs().mean()
    far = reference_errors(wrong, eager, ref, tight)
    assert not far.ok and far.allowed_rms == REFERENCE_MULTIPLIER * far.eager_rms + 1e-5
    # one value far off is not averaged away: the largest difference is bounded too
    spike = eager.clone()
    spike[0, 0] += 10 * (eager - ref).abs().max()
    one = reference_errors(spike, eager, ref, tight)
    assert one.artifact_rms <= one.allowed_rms and not one.ok and "further from the float32 run" in one.problem
    # where the eager model meets the tolerance against float32 (no drift), only an artifact that meets
    # it too gets the second chance: the two half-precision results on either side of the float32 one
    # (8B shape, layer 16's K at the first step: artifact 0.25 and eager 0.41 from float32, 0.46 apart)
    spread = float((eager - ref).abs().max())
    loose = (spread * 1.05, 0.0)  # eager within it against float32
    assert not reference_errors(eager, eager, ref, loose).eager_drifts
    mirrored = ref - 0.6 * (eager - ref)  # on the other side of float32, closer than eager
    assert float((mirrored - eager).abs().max()) > loose[0]  # over the fixed tolerance against eager
    other_side = reference_errors(mirrored, eager, ref, loose)
    assert other_side.ok and "within it against the float32 run" in other_side.why_ok
    beyond = ref - 1.2 * (eager - ref)  # as far on the other side as eager: over the tolerance against float32
    assert "no drift to allow for" in reference_errors(beyond, eager, ref, loose).problem
    # a shallow model (no drift) whose artifact meets the tolerance against float32 but is far further
    # from it than the eager model: the 3x bound keeps the fixed rule (the two may be up to 2x the
    # tolerance apart only where each is as near float32 as that bound allows)
    wide = (0.0, 40 * spread / float(ref.abs().max()))  # F = 40x the eager model's largest error
    far_but_within = ref + 20 * (eager - ref)
    assert float((far_but_within - ref).abs().max()) <= 40 * spread
    shallow = reference_errors(far_but_within, eager, ref, wide)
    assert not shallow.eager_drifts and not shallow.ok and "further from the float32 run" in shallow.problem
    # without a finite reference there is no second chance
    nan_ref = ref.clone()
    nan_ref[0, 0] = float("nan")
    assert "not finite" in reference_errors(eager, eager, nan_ref, tight).problem
    nan = eager.clone()
    nan[0, 0] = float("nan")
    assert not reference_errors(nan, eager, ref, tight).ok


def test_twin_refuses_a_model_that_replaces_a_buffer_during_the_block():
    from offgraph_export.errors import OffgraphError

    model = _deep_mlp(depth=1)
    original = model.half_buffer
    twin = Float32Twin(model)
    with pytest.raises(OffgraphError, match="replaced its buffer Sequential.half_buffer"):
        with twin.active():
            model.register_buffer("half_buffer", model.half_buffer * 2)  # a table grown in float32
    assert model.half_buffer is original and model.half_buffer.dtype == torch.bfloat16
