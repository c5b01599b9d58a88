"""Attention logit soft-capping (Gemma 2) and attention sinks (GPT-OSS), design section 2.

* the eager math (the reference cache, the oracle) against a full recompute written here, and the
  portable step against the reference cache over NaN-poisoned storage;
* the passes: a neutral-op model with both, traced and stripped, its stripped program run eagerly
  against the oracle (no compile), and the batched export's refusal by name;
* tiny random-weight Gemma 2 and GPT-OSS ``hf:`` checkpoints, each exported for CPU once and
  checked against transformers' own forward;
* ``test_interp_*``: the Triton step's kernels in the interpreter (a child process, see
  ``tests/triton_testing.py``) against the portable step: one-token and multi-token steps, split
  and tiled, flat and ring.

Every comparison also checks that the feature changes the answer, so that a step ignoring it fails.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from offgraph_export.errors import ExportError, OffgraphError
from offgraph_export.kernels.portable import portable_update_and_attend
from offgraph_export.ops import update_and_attend
from offgraph_export.passes.kv_sites import find_kv_sites
from offgraph_export.pipeline import export_model, run_passes
from offgraph_export.reference import ReferenceCaches
from offgraph_export.reference.cache import ReferenceLayerCache
from offgraph_export.reference.oracle import ReferenceOracle
from offgraph_export.runtime.storage import SessionStorage
from offgraph_export.specs import CacheConfig
from tests.triton_testing import HAVE_TRITON, interpreter_only, needs_cuda, needs_triton, run_interpreter_cases

HQ, HKV, D = 4, 2, 16
SCALE = D**-0.5
SOFTCAP = 1.5


def _sinks(seed: int = 7) -> torch.Tensor:
    return torch.randn(HQ, generator=torch.Generator().manual_seed(seed)) * 2


# ---------------------------------------------------------------------------------------------
# (a) the eager math
# ---------------------------------------------------------------------------------------------


def _plain_attention(q, k, v, scale, window, softcap, sinks):
    """The whole sequence at once, one query and head at a time: scores, ``tanh(s / c) * c``,
    the sink appended to the visible scores, softmax, the sink's share dropped."""
    _, hq, n, _ = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(1, hq, n, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        for i in range(n):
            lo = 0 if window is None else max(0, i - window + 1)
            s = (k[0, h // group, lo : i + 1].double() @ q[0, h, i].double()) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            if sinks is not None:
                s = torch.cat([s, sinks[h : h + 1].double()])
            p = torch.softmax(s, dim=0)[: i + 1 - lo]
            out[0, h, i] = p @ v[0, h // group, lo : i + 1].double()
    return out


def _session(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HQ, n, D, generator=gen) * 3  # large scores, so the cap bites
    return q, torch.randn(1, HKV, n, D, generator=gen), torch.randn(1, HKV, n, D, generator=gen)


WIDTHS = (3, 1, 4, 1, 6)


@pytest.mark.parametrize("window", [None, 4], ids=["flat", "ring"])
@pytest.mark.parametrize(
    ("softcap", "sinks"), [(SOFTCAP, None), (None, "sinks"), (SOFTCAP, "sinks")], ids=["softcap", "sinks", "both"]
)
def test_reference_cache_and_portable_step_match_a_full_recompute(window, softcap, sinks):
    sinks = _sinks() if sinks else None
    n = sum(WIDTHS)
    q, k, v = _session(n)
    want = _plain_attention(q, k, v, SCALE, window, softcap, sinks).float()
    plain = _plain_attention(q, k, v, SCALE, window, None, None).float()
    assert (want - plain).abs().max() > 1e-2, "the feature must change the answer"

    cache = ReferenceLayerCache(0, capacity=64, window=window)
    rows = 64 if window is None else window + max(WIDTHS) - 1
    k_store = torch.full((1, HKV, rows, D), float("nan"))
    v_store = torch.full((1, HKV, rows, D), float("nan"))
    start = 0
    for t in WIDTHS:
        sl = slice(start, start + t)
        pos = torch.arange(start, start + t)
        args = (q[:, :, sl], k[:, :, sl], v[:, :, sl], pos)
        got_ref = cache.update_and_attend(*args, SCALE, torch.float32, softcap=softcap, sinks=sinks)
        got_port = portable_update_and_attend(
            *args, k_store, v_store, window, SCALE, torch.float32, softcap=softcap, sinks=sinks
        )
        torch.testing.assert_close(got_ref, want[:, :, sl], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got_port, want[:, :, sl], atol=2e-5, rtol=2e-5)
        start += t


def test_neutral_op_takes_both_eagerly_and_leaves_them_optional():
    q, k, v = _session(3)
    pos = torch.arange(3)
    config = CacheConfig(max_capacity=16, initial_capacity=4, max_write=4)
    outs = []
    for extras in ({}, {"softcap": SOFTCAP, "sinks": _sinks()}):
        with ReferenceCaches(config, [0]).activate():
            outs.append(update_and_attend(q, k, v, pos, 0, SCALE, torch.float32, **extras))
    want = _plain_attention(q, k, v, SCALE, None, SOFTCAP, _sinks()).float()
    torch.testing.assert_close(outs[1], want, atol=2e-5, rtol=2e-5)
    assert (outs[0] - outs[1]).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("extras", "message"),
    [
        ({"softcap": 0.0}, "softcap must be None or a finite positive float, got 0.0"),
        ({"softcap": float("nan")}, "softcap must be None or a finite positive float, got nan"),
        ({"sinks": torch.zeros(HQ + 1)}, r"sinks must have shape \[Hq\] = \[4\], got \(5,\)"),
        ({"sinks": torch.zeros(HQ, dtype=torch.int64)}, "sinks must be None or a floating tensor"),
    ],
    ids=["zero-cap", "nan-cap", "sinks-shape", "sinks-dtype"],
)
def test_bad_values_are_one_line_errors(extras, message):
    q, k, v = _session(2)
    with pytest.raises(OffgraphError, match=message):
        ReferenceLayerCache(3, 8).update_and_attend(q, k, v, torch.arange(2), SCALE, torch.float32, **extras)


# ---------------------------------------------------------------------------------------------
# (b) the passes, without compiling
# ---------------------------------------------------------------------------------------------


class _CappedSinkAttn(torch.nn.Module):
    """One attention site with a soft-cap and a sink parameter, on ``x [1,T,32]``."""

    def __init__(self, layer_id: int, softcap: float | None, with_sinks: bool) -> None:
        super().__init__()
        self.layer_id, self.softcap = layer_id, softcap
        self.qkv = torch.nn.Linear(32, (HQ + 2 * HKV) * D, bias=False)
        self.sinks = torch.nn.Parameter(_sinks(layer_id)) if with_sinks else None

    def forward(self, x, position):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, HQ + 2 * HKV, D).transpose(1, 2) * 3
        q, k, v = qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
        out = update_and_attend(q, k, v, position, self.layer_id, SCALE, x.dtype, softcap=self.softcap, sinks=self.sinks)
        return out.transpose(1, 2).reshape(b, t, HQ * D)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # a soft-capped flat layer, a ring with sinks, a plain layer (the kvcache:: form)
        self.layers = torch.nn.ModuleList(
            [_CappedSinkAttn(0, SOFTCAP, False), _CappedSinkAttn(1, SOFTCAP, True), _CappedSinkAttn(2, None, False)]
        )
        self.proj = torch.nn.Linear(HQ * D, 32, bias=False)

    def forward(self, x, position):
        for layer in self.layers:
            x = x + self.proj(layer(x, position))
        return x


CONFIG = CacheConfig(max_capacity=32, initial_capacity=8, max_write=8, ring_windows={1: 4})


@pytest.fixture(scope="module")
def stripped_model():
    model = _Model().eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    ep = export_model(model, inputs, (1, 0), CONFIG.max_write)
    return model, ep, inputs


def test_sites_carry_softcap_and_sinks(stripped_model):
    _, ep, _ = stripped_model
    sites = {s.layer_id: s for s in find_kv_sites(ep.graph)}
    assert [sites[i].softcap for i in range(3)] == [SOFTCAP, SOFTCAP, None]
    assert sites[0].sinks is None and sites[2].sinks is None
    assert sites[1].val("sinks").shape == (HQ,)


def test_stripped_program_applies_both(stripped_model):
    model, ep, inputs = stripped_model
    program = run_passes(ep, inputs, CONFIG)
    stripped = program.stripped.module()
    oracle = ReferenceOracle(model, program.manifest)
    storage = SessionStorage(program.manifest, "cpu", poison=True)
    x = torch.randn(1, 14, 32)
    used = 0
    for width in (5, 1, 1, 7):
        storage.ensure(used + width, used)
        step = (x[:, used : used + width], torch.arange(used, used + width))
        with torch.no_grad():
            (want,) = oracle.step(step)
            got = stripped(*step, *storage.bound())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        used += width
    # the same model without the features gives another answer
    with torch.no_grad(), _without_features(model):
        (plain,) = ReferenceOracle(model, program.manifest).step((x[:, :5], torch.arange(5)))
        first = stripped(x[:, :5], torch.arange(5), *SessionStorage(program.manifest, "cpu").bound())
    assert (plain - first).abs().max() > 1e-3


@contextlib.contextmanager
def _without_features(model):
    saved = [(layer.softcap, layer.sinks) for layer in model.layers]
    for layer in model.layers:
        layer.softcap, layer.sinks = None, None
    try:
        yield
    finally:
        for layer, (softcap, sinks) in zip(model.layers, saved):
            layer.softcap, layer.sinks = softcap, sinks


# ---------------------------------------------------------------------------------------------
# (c) tiny Gemma 2 and GPT-OSS checkpoints, against transformers
# ---------------------------------------------------------------------------------------------

HF_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=512,
    initializer_range=0.1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    sliding_window=8, layer_types=["sliding_attention", "full_attention"],
)
HF_CACHE = dict(max_capacity=128, initial_capacity=16, max_write=32)


def _hf_configs(transformers):
    return {
        # a cap small enough to bite on tiny random weights (Gemma 2's own is 50), and the final
        # logit soft-capping of the lm_head, which is ordinary graph code
        "gemma2": transformers.Gemma2Config(**HF_COMMON, attn_logit_softcapping=0.3, final_logit_softcapping=5.0),
        "gpt_oss": transformers.GptOssConfig(
            **HF_COMMON, num_local_experts=2, num_experts_per_tok=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    }


class _HfExported:
    """``(bundle, artifact, program)`` of each tiny checkpoint, exported for CPU on first use."""

    def __init__(self, root) -> None:
        self.transformers = pytest.importorskip("transformers")
        self.root, self.cache = root, {}

    def ref(self, name: str) -> str:
        path = self.root / name
        if not path.exists():
            _hf_configs(self.transformers)[name].save_pretrained(path)
        return f"hf:{path}"

    def __call__(self, name: str):
        if name not in self.cache:
            from offgraph_export.frontends import load_bundle
            from offgraph_export.pipeline import export_and_lower
            from offgraph_export.runtime import Artifact

            ref = self.ref(name)
            bundle = load_bundle(ref, **HF_CACHE)
            path, program, _ = export_and_lower(bundle, self.root / f"{name}.pt2", model=ref)
            self.cache[name] = (bundle, Artifact.load(path), program)
        return self.cache[name]


@pytest.fixture(scope="module")
def hf_exported(tmp_path_factory):
    return _HfExported(tmp_path_factory.mktemp("softcap_sinks_hf"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_hf_export_checks_against_transformers(name, hf_exported):
    from offgraph_export.check import check_artifact

    bundle, artifact, program = hf_exported(name)
    sites = {s.layer_id: s for s in find_kv_sites(program.exported.graph)}
    if name == "gemma2":
        assert [sites[i].softcap for i in (0, 1)] == [0.3, 0.3] and sites[0].sinks is None
    else:
        assert sites[0].softcap is None and sites[0].val("sinks").shape == (HQ,)
    assert {layer.layer_id: layer.window for layer in program.manifest.layers} == {0: 8, 1: None}
    report = check_artifact(artifact, bundle)
    assert report.passed, report.render()
    assert max(s.max_abs_err for s in report.steps) < 1e-4


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_the_feature_changes_transformers_logits(name, hf_exported):
    """Without the feature the model's logits move by far more than ``check``'s tolerance, so a
    step that ignored it would fail the check above."""
    from offgraph_export.frontends import load_bundle

    bundle = load_bundle(hf_exported.ref(name), **HF_CACHE)
    hf = bundle.model.hf
    tokens = torch.arange(1, 13)[None]
    attn = [layer.self_attn for layer in hf.model.layers]
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
        if name == "gemma2":
            for a in attn:
                a.attn_logit_softcapping = None
        else:
            for a in attn:
                a.sinks.fill_(-1e4)  # exp(sink - m) == 0: no sink at all
        other = hf(input_ids=tokens).logits
    assert (want - other).abs().max() > 1e-2


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_cuda_export_checks_against_transformers(name, hf_exported, tmp_path):
    """Each tiny checkpoint in bf16 through the Triton step (its soft-capping and sink kernels
    compiled by AOTInductor), checked against transformers on cuda, with ordinary launches and
    with the CUDA-graph decode step."""
    from offgraph_export.check import check_artifact
    from offgraph_export.frontends import load_bundle
    from offgraph_export.pipeline import export_and_lower
    from offgraph_export.runtime import Artifact

    ref = hf_exported.ref(name)

    def bundle():
        made = load_bundle(ref, dtype="bfloat16", **HF_CACHE)
        if name == "gpt_oss":  # torch 2.11's AOTInductor cannot compile its experts' _grouped_mm for cuda
            made.model.hf.set_experts_implementation("batched_mm")
        return made

    path, _, _ = export_and_lower(bundle(), tmp_path / f"{name}.pt2", model=ref, device="cuda")
    artifact = Artifact.load(path, single_threaded=True)
    for graphs in (False, True):
        report = check_artifact(artifact, bundle(), cuda_graphs=graphs)
        assert report.passed, report.render()


def test_batched_export_is_refused_by_name(hf_exported, tmp_path):
    from offgraph_export.frontends import load_bundle
    from offgraph_export.pipeline import export_and_lower

    ref = hf_exported.ref("gpt_oss")
    bundle = load_bundle(ref, **HF_CACHE)
    batched = dataclasses.replace(bundle, cache_config=bundle.cache_config.with_overrides(max_sessions=2))
    with pytest.raises(ExportError) as info:
        export_and_lower(batched, tmp_path / "b.pt2", model=ref)
    message = str(info.value)
    assert "\n" not in message
    assert "a batched export (--max-sessions) does not support attention sinks (layers [0, 1])" in message
    assert "export without --max-sessions" in message
    assert not (tmp_path / "b.pt2").exists()


# ---------------------------------------------------------------------------------------------
# (d) the Triton step in the interpreter, against the portable step
# ---------------------------------------------------------------------------------------------

if HAVE_TRITON:
    from offgraph_export.kernels.triton_attend import triton_update_and_attend

#: (id, window, rows, history, width): one-token steps with one and several splits (decode: 128
#: keys a split at least), multi-token steps on the split variant (several splits: 256 keys) and
#: on the tiled one, flat and ring
INTERP_CASES = [
    ("decode-one-split", None, 64, 20, 1),
    ("decode-splits", None, 512, 300, 1),
    ("decode-ring", 8, 8, 30, 1),
    ("small-splits", None, 1024, 600, 2),
    ("tiled-flat", None, 64, 10, 40),
    ("tiled-ring", 8, 8 + 40 - 1, 30, 40),
]
#: the cases that also run each feature alone: one-token and multi-token, several splits
ALONE_CASES = ("decode-splits", "small-splits", "tiled-ring")


def _storage(rows: int, history: int, window, gen):
    """K and V storage holding the ``history`` positions in their rows, NaN elsewhere."""
    k_store = torch.full((1, HKV, rows, D), float("nan"))
    v_store = torch.full((1, HKV, rows, D), float("nan"))
    first = 0 if window is None else max(0, history - rows)
    held = torch.arange(first, history) % rows
    k_store[:, :, held] = torch.randn(1, HKV, len(held), D, generator=gen)
    v_store[:, :, held] = torch.randn(1, HKV, len(held), D, generator=gen)
    return k_store, v_store


@needs_triton
def test_interpreter_suite():
    run_interpreter_cases(__file__)


@interpreter_only
@pytest.mark.parametrize(("case", "window", "rows", "history", "width"), INTERP_CASES, ids=[c[0] for c in INTERP_CASES])
def test_interp_softcap_and_sinks_match_portable(case, window, rows, history, width):
    gen = torch.Generator().manual_seed(rows + history + width)
    k_store, v_store = _storage(rows, history, window, gen)
    q = torch.randn(1, width, HQ, D, generator=gen).transpose(1, 2) * 3
    k = torch.randn(1, width, HKV, D, generator=gen).transpose(1, 2)
    v = torch.randn(1, width, HKV, D, generator=gen).transpose(1, 2)
    pos = torch.arange(history, history + width)
    variants = {"both": {"softcap": SOFTCAP, "sinks": _sinks()}, "none": {}}
    if case in ALONE_CASES:  # each feature alone too (each launch costs seconds in the interpreter)
        variants.update({"softcap": {"softcap": SOFTCAP}, "sinks": {"sinks": _sinks()}})
    outs = {}
    for name, extras in variants.items():
        ks_t, vs_t, ks_p, vs_p = k_store.clone(), v_store.clone(), k_store.clone(), v_store.clone()
        got = triton_update_and_attend(q, k, v, pos, ks_t, vs_t, window, SCALE, torch.float32, **extras)
        want = portable_update_and_attend(q, k, v, pos, ks_p, vs_p, window, SCALE, torch.float32, **extras)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{case}, {name}: {m}")
        torch.testing.assert_close(ks_t, ks_p, equal_nan=True, atol=0, rtol=0)
        outs[name] = got
    for name in set(variants) - {"both"}:
        assert (outs["both"] - outs[name]).abs().max() > 1e-4  # 5x the tolerance, f"{case}: {name} alone gives the same answer"


@needs_triton
def test_triton_step_nodes_carry_softcap_and_sinks(stripped_model):
    """Traced with the Triton step (no kernel runs), both methods' op nodes take the soft-cap
    as a constant and the sinks as the program's parameter; the plain layer's node is as before."""
    from offgraph_export.kernels.triton_attend import OP_NAME
    from offgraph_export.passes.graph_utils import op_arguments

    _, ep, inputs = stripped_model
    program = run_passes(ep, inputs, CONFIG, "triton", decode_method=True)
    for name in ("strip_kv_cache", "specialize_width"):
        graph = program.pass_results[name].program
        sinks = {s.arg.name for s in graph.graph_signature.input_specs if s.target and s.target.endswith("sinks")}
        nodes = [n for n in graph.graph.nodes if n.op == "call_function" and OP_NAME.replace("::", ".") in str(n.target)]
        args = [op_arguments(n) for n in nodes]
        assert [a.get("softcap") for a in args] == [SOFTCAP, SOFTCAP, None], name
        assert [str(a.get("sinks")) if a.get("sinks") is not None else None for a in args] == [None, *sinks, None], name
