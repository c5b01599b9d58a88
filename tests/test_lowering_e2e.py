"""End to end on CPU: the example exports and lowers; the package runs without this project."""

import json
import subprocess
import sys
import textwrap

import torch

from offgraph_export.reference import ReferenceCaches
from offgraph_export.specs import read_artifact_specs
from tests.conftest import cli

# Runs in a fresh interpreter with only torch: no offgraph_export import is needed to run a step.
# The weights live beside the compiled code (data/weights), so torch's own loader is asked to load
# them (``aoti_load_package`` alone would leave them unset).
STANDALONE = textwrap.dedent(
    """
    import sys, torch
    from torch.export.pt2_archive._package import load_pt2
    path, out = sys.argv[1], sys.argv[2]
    model = load_pt2(path, load_weights_from_disk=True).aoti_runners["model"]
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (1, 40))
    # layer 0 flat (rows = capacity), layer 1 ring of 16 with max_write 32 -> 47 rows
    def storage(cap):
        return [torch.full((1, 2, r, 16), float("nan")) for r in (cap, cap, 47, 47)]
    results, used, store = [], 0, storage(16)
    for width, capacity in [(5, 16), (1, 16), (3, 16), (12, 24), (1, 24), (2, 40), (16, 40)]:
        if store[0].shape[2] != capacity:  # grow: new allocation + copy of the live rows
            new = storage(capacity)
            for n, o in zip(new[:2], store[:2]):
                n[:, :, :used] = o[:, :, :used]
            store = new[:2] + store[2:]
        logits = model(tokens[:, used:used + width], torch.arange(used, used + width), *store)
        used += width
        assert torch.isfinite(store[0][:, :, :used]).all(), "rows [0, used) must be written in place"
        assert torch.isnan(store[0][:, :, used:]).all(), "rows past the history must stay untouched"
        results.append(logits)
    torch.save({"results": results, "tokens": tokens, "k0": store[0][:, :, :used].clone()}, out)
    print("imported offgraph_export:", any(m.startswith("offgraph_export") for m in sys.modules))
    """
)


def test_package_runs_in_fresh_process_without_offgraph_export(example_artifact, example_bundle, tmp_path):
    out = tmp_path / "results.pt"
    proc = subprocess.run(
        [sys.executable, "-c", STANDALONE, str(example_artifact), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "imported offgraph_export: False" in proc.stdout
    saved = torch.load(out)
    ref = ReferenceCaches(example_bundle.cache_config, [0, 1])
    used = 0
    for logits in saved["results"]:
        width = logits.shape[1]
        with ref.activate():
            want = example_bundle.model(saved["tokens"][:, used : used + width], torch.arange(used, used + width))
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        used += width
    torch.testing.assert_close(saved["k0"], ref[0].keys, atol=1e-5, rtol=1e-5)


def test_specs_read_without_loading_code_or_torch(example_artifact):
    script = (
        "import sys; from offgraph_export.specs import read_artifact_specs; "
        f"s = read_artifact_specs({str(example_artifact)!r}); "
        "print(s.step_width, 'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0:1", "False"]


def test_specs_embedded_in_aoti_metadata_too(loaded_example):
    metadata = loaded_example.compiled.get_metadata()
    assert metadata["offgraph_kv_step_width"] == "0:1"
    assert json.loads(metadata["offgraph_kv_manifest"]) == json.loads(loaded_example.specs.manifest.to_json())


def test_inspect_table_and_json(example_artifact):
    text = cli("inspect", str(example_artifact)).stdout
    assert "step width    0:1  (input 0 'tokens', dim 1)" in text
    assert "ring" in text and "flat" in text and "k_cache_1" in text
    assert "methods       model  (one-token steps: the general program at width 2, the token repeated)" in text
    data = json.loads(cli("inspect", str(example_artifact), "--json").stdout)
    assert data["output_width_dims"] == [1]  # logits [1, T, vocab]
    assert data["step_width"] == "0:1"
    assert [l["policy"] for l in data["manifest"]["layers"]] == ["flat", "ring"]
    assert data["model"].endswith("tiny_llama.py:build")
    assert any(e["name"].endswith("extra/offgraph_specs.json") for e in data["archive"])
    specs = read_artifact_specs(example_artifact)
    assert specs.symbols[specs.width_symbol].min == 1 and specs.symbols[specs.width_symbol].max == 32


def test_export_rejects_bad_options(tmp_path, example_factory):
    proc = cli("export", example_factory, "-o", str(tmp_path / "x.pt2"), "--max-write", "999", check=False)
    assert proc.returncode == 2 and "max_write=999" in proc.stderr
    proc = cli("export", example_factory, "-o", str(tmp_path / "x.pt2"), "--ring", "abc", check=False)
    assert proc.returncode == 2 and "LAYER=WINDOW" in proc.stderr
    proc = cli("export", "examples/nope.py:build", "-o", str(tmp_path / "x.pt2"), check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert not (tmp_path / "x.pt2").exists()
