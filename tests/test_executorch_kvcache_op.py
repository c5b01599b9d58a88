"""A model written against ExecuTorch's own ``kvcache::update_and_attend`` (the real op of the
installed executorch, not a stand-in) goes through the passes, both formats and the check, against
ExecuTorch's own reference cache as the oracle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("executorch")

from executorch.extension.llm.cache import update_and_attend as _et_op  # noqa: E402,F401  (defines the op)

from offgraph_export.check import check_artifact  # noqa: E402
from offgraph_export.models import ModelBundle  # noqa: E402
from offgraph_export.passes.kv_sites import find_kv_sites  # noqa: E402
from offgraph_export.pipeline import export_and_lower  # noqa: E402
from offgraph_export.reference.executorch_oracle import ExecuTorchCacheOracle  # noqa: E402
from offgraph_export.specs import CacheConfig  # noqa: E402


class KvcacheStack(nn.Module):
    """Token embedding, two attention layers calling ``torch.ops.kvcache.update_and_attend`` with
    ``[T, 1]`` positions (ExecuTorch's layout), GQA."""

    def __init__(self, vocab: int = 64, dim: int = 32, hq: int = 4, hkv: int = 2, d: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.hq, self.hkv, self.d = hq, hkv, d
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.ModuleDict({
            "q": nn.Linear(dim, hq * d, bias=False), "k": nn.Linear(dim, hkv * d, bias=False),
            "v": nn.Linear(dim, hkv * d, bias=False), "o": nn.Linear(hq * d, dim, bias=False),
        }) for _ in range(2))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        # ExecuTorch's fake impl does not tie the positions' extent to the tokens'; the model says
        # it (export then knows both carry the one token width, which validation requires).
        torch._check(position.shape[0] == tokens.shape[1])
        x = self.emb(tokens)
        b, t, _ = x.shape
        for layer_id, p in enumerate(self.qkv):
            q = p["q"](x).view(b, t, self.hq, self.d).transpose(1, 2)
            k = p["k"](x).view(b, t, self.hkv, self.d).transpose(1, 2)
            v = p["v"](x).view(b, t, self.hkv, self.d).transpose(1, 2)
            a = torch.ops.kvcache.update_and_attend(q, k, v, position, layer_id, self.d**-0.5, x.dtype)
            x = x + p["o"](a.transpose(1, 2).reshape(b, t, self.hq * self.d))
        return self.out(x)


def _bundle() -> ModelBundle:
    model = KvcacheStack().eval()

    def make_inputs(tokens, start):
        return tokens, torch.arange(start, start + tokens.shape[1]).view(-1, 1)

    return ModelBundle(
        model=model, example_inputs=make_inputs(torch.zeros(1, 4, dtype=torch.int64), 0), token_dims=(1, 0),
        cache_config=CacheConfig(max_capacity=64, initial_capacity=8, max_write=16, ring_windows={1: 6}),
        make_inputs=make_inputs, vocab_size=64,
        make_oracle=lambda manifest: ExecuTorchCacheOracle(model, manifest),
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["pt2", "executorch"])
def test_real_kvcache_op_through_export_and_check(fmt, tmp_path):
    bundle = _bundle()
    path, program, _ = export_and_lower(bundle, tmp_path / f"kv.{'pte' if fmt == 'executorch' else 'pt2'}", format=fmt)
    sites = find_kv_sites(program.exported.graph)
    assert [s.node.target.name() for s in sites] == ["kvcache::update_and_attend"] * 2
    assert find_kv_sites(program.stripped.graph) == []
    assert program.positions_input == 1
    report = check_artifact(path, _bundle())
    assert report.passed, report.render()
    assert report.growths >= 2 and report.ring_wraps == {"1": True}


def test_the_executorch_oracle_refuses_sparse_layer_ids():
    """Its cache numbers layers 0..n-1: a manifest (from an archive) with a layer id of 2**31 - 1
    would have made it build two billion layer caches."""
    from offgraph_export.errors import OffgraphError
    from offgraph_export.specs.manifest import parse_manifest

    manifest = parse_manifest(
        '{"version": 1, "storage_dtype": "float32", "batch_size": 1, "max_capacity": 16, "initial_capacity": 4,'
        ' "max_write": 4, "layers": [{"layer_id": 2147483647, "window": null, "kv_heads": 1, "head_dim": 4,'
        ' "v_head_dim": 4, "k": {"name": "k_cache_2147483647", "index": 2},'
        ' "v": {"name": "v_cache_2147483647", "index": 3}}]}'
    )
    with pytest.raises(OffgraphError, match=r"numbers layers 0..n-1; the manifest has layer ids \[2147483647\]"):
        ExecuTorchCacheOracle(torch.nn.Identity(), manifest)
