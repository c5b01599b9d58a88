"""The strip pass: neutral ops become in-place row writes and attention over storage inputs."""

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.export.graph_signature import InputKind, OutputKind

from offgraph_export.errors import ExportError
from offgraph_export.passes.kv_sites import find_kv_sites
from offgraph_export.pipeline import run_passes
from offgraph_export.passes.build_manifest import build_manifest
from offgraph_export.passes.strip_kv_cache import strip_kv_cache
from offgraph_export.reference import ReferenceCaches, ReferenceOracle, active_caches
from offgraph_export.runtime import SessionStorage
from offgraph_export.specs import CacheConfig
from tests import tiny_models as tm

CONFIG = CacheConfig(max_capacity=64, initial_capacity=8, max_write=16, ring_windows={1: 5})


def _lower(model, inputs, token_dims, config=CONFIG):
    ep = tm.export(model, inputs, token_dims, config.max_write)
    return ep, run_passes(ep, inputs, config)


@pytest.fixture(scope="module")
def gqa_stack():
    model = tm.Stack(3, hq=8, hkv=2, d=16, dv=8).eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    ep, program = _lower(model, inputs, (1, 0))
    return model, ep, program


def test_what_fired(gqa_stack):
    _, ep, program = gqa_stack
    assert len(find_kv_sites(ep.graph)) == 3
    assert find_kv_sites(program.stripped.graph) == []
    fired = {name: result.modified for name, result in program.pass_results.items()}
    assert fired == {
        "validate_kv_sites": False, "record_step_width": False, "record_positions": False,
        "bound_table_indices": False,  # embeddings come in: no table lookup to bound
        "fuse_projections": True,  # q/k/v of every layer
        "build_manifest": False, "strip_kv_cache": True, "functionalize": True,
    }
    assert program.pass_results["record_positions"].produced == 1
    assert program.pass_results["bound_table_indices"].produced == {}
    assert program.pass_results["strip_kv_cache"].produced == [0, 1, 2]
    assert program.pass_results["build_manifest"].produced is program.manifest
    targets = [str(n.target) for n in program.stripped.graph.nodes if n.op == "call_function"]
    assert sum("index_copy" in t for t in targets) == 6  # one K and one V write per layer


def test_signature_after(gqa_stack):
    _, _, program = gqa_stack
    sig = program.stripped.graph_signature
    names = ["x", "position", "k_cache_0", "v_cache_0", "k_cache_1", "v_cache_1", "k_cache_2", "v_cache_2"]
    assert list(sig.user_inputs) == names
    assert [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT] == names
    mutated = [s.target for s in sig.output_specs if s.kind == OutputKind.USER_INPUT_MUTATION]
    assert mutated == names[2:]
    assert sum(s.kind == OutputKind.USER_OUTPUT for s in sig.output_specs) == 1
    placeholders = {n.name: n for n in program.stripped.graph.nodes if n.op == "placeholder"}
    flat_rows = placeholders["k_cache_0"].meta["val"].shape[2]
    ring_rows = placeholders["k_cache_1"].meta["val"].shape[2]
    assert isinstance(flat_rows, torch.SymInt), "flat storage rows must be a dynamic dimension"
    assert placeholders["v_cache_2"].meta["val"].shape[2].node.expr == flat_rows.node.expr
    assert ring_rows == 5 + 16 - 1
    rng = program.stripped.range_constraints[flat_rows.node.expr]
    assert int(rng.upper) == 64


def test_stripped_program_matches_eager_across_widths_and_capacities(gqa_stack):
    model, _, program = gqa_stack
    m = program.manifest
    stripped = program.stripped.module()
    ref = ReferenceCaches(CONFIG, m.layer_ids)
    torch.manual_seed(3)
    xs = torch.randn(1, 40, 32)
    storage = SessionStorage(m, "cpu", poison=True)  # the runtime's storage, grown by its rule
    used = 0
    for width in [3, 1, 9, 1, 1, 16, 1, 2]:
        storage.ensure(used + width, used)
        x, pos = xs[:, used : used + width], torch.arange(used, used + width)
        with ref.activate():
            want = model(x, pos)
        got = stripped(x, pos, *storage.bound())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        used += width
        # flat storage: rows [0, used) written, the rest still NaN
        flat = storage.bound()[0]
        assert torch.isfinite(flat[:, :, :used]).all() and torch.isnan(flat[:, :, used:]).all()
    assert storage.capacity == 64 and storage.growth_count == 3


def test_kvcache_namespace_op_is_stripped_too():
    if not hasattr(torch.ops.kvcache, "update_and_attend"):
        @torch.library.custom_op("kvcache::update_and_attend", mutates_args=())
        def _kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, layer_id: int,
                scale: float, out_dtype: torch.dtype) -> torch.Tensor:
            return active_caches()[layer_id].update_and_attend(q, k, v, position, scale, out_dtype)

        @_kv.register_fake
        def _(q, k, v, position, layer_id, scale, out_dtype):
            torch._check(position.shape[0] == k.shape[2])
            return q.new_empty((*q.shape[:3], v.shape[-1]), dtype=out_dtype)

    class ExecuTorchStyle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = tm.Attn(0)

        def forward(self, x, position):
            # ExecuTorch's own fake impl (used when executorch defined the op) does not tie the
            # positions' extent to the tokens'; the model says it.
            torch._check(position.shape[0] == x.shape[1])
            b, t, _ = x.shape
            a = self.a
            q = a.q(x).view(b, t, a.hq, a.d).transpose(1, 2)
            k = a.k(x).view(b, t, a.hkv, a.d).transpose(1, 2)
            v = a.v(x).view(b, t, a.hkv, a.dv).transpose(1, 2)
            return torch.ops.kvcache.update_and_attend(q, k, v, position, 0, a.d**-0.5, x.dtype)

    model = ExecuTorchStyle().eval()
    config = CacheConfig(max_capacity=32, initial_capacity=8, max_write=8)
    ep, program = _lower(model, (torch.randn(1, 4, 32), torch.arange(4)), (1, 0), config)
    assert find_kv_sites(ep.graph)[0].node.target.name() == "kvcache::update_and_attend"
    assert find_kv_sites(program.stripped.graph) == []
    if "executorch.extension.llm.cache.update_and_attend" in sys.modules:
        # executorch defined the op (another test imported it): eagerly it runs over its own cache
        from offgraph_export.reference.executorch_oracle import ExecuTorchCacheOracle

        oracle = ExecuTorchCacheOracle(model, program.manifest)
    else:
        oracle = ReferenceOracle(model, program.manifest)
    storage = SessionStorage(program.manifest, "cpu", poison=True)
    x = torch.randn(1, 6, 32)
    for lo, hi in [(0, 4), (4, 5), (5, 6)]:
        with torch.no_grad():
            (want,) = oracle.step((x[:, lo:hi], torch.arange(lo, hi)))
        got = program.stripped.module()(x[:, lo:hi], torch.arange(lo, hi), *storage.bound())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unknown_step_impl_rejected(gqa_stack):
    _, ep, _ = gqa_stack
    with pytest.raises(ExportError, match="unknown step implementation 'magic'"):
        run_passes(ep, (torch.randn(1, 5, 32), torch.arange(5)), CONFIG, step_impl="magic")


X = (torch.randn(1, 5, 32), torch.arange(5))


def test_manifest_coverage_checked_both_ways():
    ep2 = tm.export(tm.Stack(2), X, (1, 0))
    ep3 = tm.export(tm.Stack(3), X, (1, 0))
    manifest2 = build_manifest(ep2, CacheConfig()).produced
    with pytest.raises(ExportError, match=r"layers \[2\] are in the graph but not in the manifest"):
        strip_kv_cache(ep3, manifest2, X)
    manifest3 = build_manifest(ep3, CacheConfig()).produced
    with pytest.raises(ExportError, match=r"layers \[2\] are in the manifest but have no op"):
        strip_kv_cache(ep2, manifest3, X)


def test_manifest_head_dims_checked():
    ep_small = tm.export(tm.Stack(1, d=16), X, (1, 0))
    ep_big = tm.export(tm.Stack(1, d=32, dv=32), X, (1, 0))
    with pytest.raises(ExportError, match="head_dim"):
        strip_kv_cache(ep_big, build_manifest(ep_small, CacheConfig()).produced, X)


# -- the rewritten code, pinned -----------------------------------------------------------------

EXPECTED = Path(__file__).parent / "expected"


def _pinned_path() -> Path:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return EXPECTED / f"stripped_one_layer.torch-{major}.{minor}.txt"


def test_stripped_graph_of_one_layer_is_pinned():
    """The whole stripped (and functionalized) program of a one-layer model, as code plus its
    signature: an unintended change of the rewrite shows here as a diff. After an intended change,
    regenerate with OFFGRAPH_REGEN_EXPECTED=1 and review the diff."""
    model = tm.Stack(1, hq=4, hkv=2, d=8, dv=8, hidden=16).eval()
    inputs = (torch.randn(1, 5, 16), torch.arange(5))
    config = CacheConfig(max_capacity=32, initial_capacity=8, max_write=8)
    program = run_passes(tm.export(model, inputs, (1, 0), config.max_write), inputs, config)
    got = f"{program.stripped.graph_module.code.strip()}\n\n{program.stripped.graph_signature}".strip() + "\n"
    path = _pinned_path()
    if os.environ.get("OFFGRAPH_REGEN_EXPECTED") == "1":
        path.write_text(got)
    if not path.exists():
        pytest.skip(f"no pinned graph for torch {torch.__version__} (CI pins 2.13); regenerate to add one")
    assert got == path.read_text()
