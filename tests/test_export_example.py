"""``torch.export`` of the example model with a dynamic token width keeps exactly one neutral-op
node per layer, with layer ids 0..n-1, and the exported program still runs every width eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.export import Dim

from offgraph_export.frontends import load_bundle
from offgraph_export.reference import ReferenceCaches

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama.py"
MAX_T = 32


def _dynamic_shapes(bundle):
    return tuple(
        None if dim is None else {dim: Dim.DYNAMIC(min=1, max=MAX_T)} for dim in bundle.token_dims
    )


def _neutral_nodes(graph):
    return [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target._schema.name == "offgraph::update_and_attend"
    ]


def _layer_id(node):
    if len(node.args) > 4:
        return node.args[4]
    return node.kwargs["layer_id"]


@pytest.fixture(scope="module", params=[2, 3], ids=["2-layers", "3-layers"])
def exported(request):
    bundle = load_bundle(f"{EXAMPLE}:build", n_layers=request.param)
    assert bundle.token_dims == (1, 0)  # tokens [B, T] along dim 1, position [T] along dim 0
    ep = torch.export.export(bundle.model, bundle.example_inputs, dynamic_shapes=_dynamic_shapes(bundle))
    return request.param, bundle, ep


def test_one_neutral_node_per_layer(exported):
    n_layers, _, ep = exported
    nodes = _neutral_nodes(ep.graph)
    assert len(nodes) == n_layers, [str(n.target) for n in nodes]
    assert sorted(_layer_id(n) for n in nodes) == list(range(n_layers))
    # The op is functional to the tracer: its overload is the default one, not an inplace variant.
    assert all(str(n.target) == "offgraph.update_and_attend.default" for n in nodes)


def test_token_width_is_symbolic_and_shared(exported):
    _, _, ep = exported
    user_names = {
        spec.arg.name
        for spec in ep.graph_signature.input_specs
        if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT
    }
    user_inputs = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in user_names]
    tokens, position = user_inputs
    t_tokens = tokens.meta["val"].shape[1]
    t_position = position.meta["val"].shape[0]
    assert isinstance(t_tokens, torch.SymInt)
    assert isinstance(t_position, torch.SymInt)
    # One symbol for both: the width of the tokens is the width of the positions.
    assert str(t_tokens) == str(t_position)
    # Every neutral op writes that same width.
    for node in _neutral_nodes(ep.graph):
        k = node.args[1].meta["val"]
        assert str(k.shape[2]) == str(t_tokens)
    (constraint,) = ep.range_constraints.values()
    assert constraint.upper == MAX_T


def test_exported_program_runs_every_width_like_eager(exported):
    n_layers, bundle, ep = exported
    module = ep.module()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, bundle.vocab_size, (1, 12), generator=g)
    chunks = [5, 1, 4, 1, 1]  # a prefill, then widths 1 and >1

    def run(fn):
        outs, start = [], 0
        with ReferenceCaches(bundle.cache_config, range(n_layers)).activate(), torch.no_grad():
            for width in chunks:
                outs.append(fn(*bundle.make_inputs(tokens[:, start : start + width], start)))
                start += width
        return torch.cat(outs, dim=1)

    torch.testing.assert_close(run(module), run(bundle.model), atol=1e-5, rtol=1e-5)
