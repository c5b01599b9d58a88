"""A GGUF file -> the transformers model it holds, dequantized, and its tokenizer; then the same
bundle as ``hf:DIR`` (:func:`~offgraph_export.frontends.hf.bundle.checkpoint_bundle`).

transformers reads GGUF itself (``from_pretrained(..., gguf_file=...)``): the metadata becomes a
config, the tokenizer is rebuilt from the file's vocabulary, and the quantized tensors are
dequantized into a plain dense model, so everything after loading is the ``hf:`` path (its attention
routing, refusals, oracle and cache rule). What this module adds is the order of the checks, as for a
checkpoint directory: the file's header (:mod:`.reference`), then the sizes its metadata declares
(:func:`~offgraph_export.frontends.hf.validate.size_problem`) before the config is built, the
parameter count and the dequantized size on the meta device before anything is allocated, then
transformers' loading report. transformers is handed an empty folder and the file's absolute path,
so files lying beside the ``.gguf`` (a stray ``tokenizer_config.json``) are never read.
"""

from __future__ import annotations

import importlib
import os
import tempfile

import torch
from torch import nn

from offgraph_export.errors import ExportError, first_line
from offgraph_export.frontends.gguf.reference import GGUFFile, resolve_gguf
from offgraph_export.frontends.hf.bundle import check_bundle_options, checkpoint_bundle
from offgraph_export.frontends.hf.checkpoint import HFCheckpoint
from offgraph_export.frontends.hf.validate import loading_problems, memory_shortfall, parameter_problem, size_problem
from offgraph_export.models import ModelBundle, model_dtype

__all__ = ["INSTALL_HINT", "load_gguf_model", "load_gguf_bundle"]

#: What to install for ``gguf:`` references (the extra brings gguf, transformers and accelerate,
#: which transformers requires to load a GGUF).
INSTALL_HINT = "pip install 'offgraph-export[gguf]'"
#: Where the size checks say the fields were read.
_METADATA = "the GGUF metadata"


def _require_packages(spec: str) -> None:
    """gguf (the reader), transformers and accelerate are importable, or one error saying what to install."""
    for package, pin in (("gguf", "gguf==0.19.0"), ("transformers", "transformers==5.24.0"), ("accelerate", "accelerate")):
        try:
            importlib.import_module(package)
        except ImportError as exc:
            raise ExportError(
                f"gguf:{spec}: reading a GGUF file needs the {package} package: {INSTALL_HINT} "
                f"(or pip install {pin}): {first_line(exc)}"
            ) from exc


def _fits_in_memory(spec: str, shell: nn.Module, dtype: torch.dtype) -> None:
    """The dequantized weights fit this machine's memory: a 4-bit file unpacks to 8 times its
    size in float32, so its size says little; counted on the meta device (``shell``)."""
    short = memory_shortfall(shell)
    if short is not None:
        needed, memory = short
        raise ExportError(
            f"gguf:{spec}: the model dequantizes to {needed / 1e9:.1f} GB of {str(dtype).removeprefix('torch.')} "
            f"weights, more than this machine's {memory / 1e9:.1f} GB of memory"
        )


def _config(spec: str, file: GGUFFile, empty: str) -> object:
    """The transformers config of the file's metadata, its sizes bounded before it is built."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_dict, _ = PreTrainedConfig.get_config_dict(empty, gguf_file=str(file.path), local_files_only=True)
    except Exception as exc:  # unsupported architectures, truncated arrays, bad types: transformers' words
        raise ExportError(f"gguf:{spec}: transformers cannot read the file (truncated, corrupt, or of an architecture "
                          f"it does not load from GGUF): {first_line(exc)}") from exc
    if problem := size_problem(config_dict, source=_METADATA):
        raise ExportError(f"gguf:{spec}: {problem}")
    model_type = config_dict.get("model_type") if isinstance(config_dict, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise ExportError(f"gguf:{spec}: the GGUF metadata names the architecture {model_type!r}, which transformers has no config for")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(config_dict)
    except Exception as exc:
        raise ExportError(f"gguf:{spec}: the GGUF metadata is not a valid {model_type} config: {first_line(exc)}") from exc
    if problem := size_problem({}, config, source=_METADATA):
        raise ExportError(f"gguf:{spec}: {problem}")
    if getattr(config, "is_encoder_decoder", False):
        raise ExportError(f"gguf:{spec}: not supported by the neutral KV op: encoder-decoder model ({model_type})")
    return config


def load_gguf_model(spec: str, dtype: str | None = None) -> HFCheckpoint:
    """The causal LM of the GGUF file ``spec`` names (dequantized, in eval mode) and its tokenizer."""
    file = resolve_gguf(spec)
    torch_dtype = model_dtype(dtype, ExportError) if dtype is not None else torch.float32
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: it reads it once
    _require_packages(spec)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with tempfile.TemporaryDirectory(prefix="offgraph-gguf-") as empty:
        config = _config(spec, file, empty)
        try:
            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=False)
        except Exception as exc:
            raise ExportError(f"gguf:{spec}: cannot build the model: {first_line(exc)}") from exc
        if problem := parameter_problem(shell, source=_METADATA):
            raise ExportError(f"gguf:{spec}: {problem}")
        _fits_in_memory(spec, shell, torch_dtype)
        del shell
        common = dict(gguf_file=str(file.path), local_files_only=True, trust_remote_code=False)
        try:
            # dequantize=True: every weight a plain dense tensor (never left packed in GGUF blocks
            # behind a kernel fetched from a hub); mismatched shapes reported, refused below by name
            model, info = AutoModelForCausalLM.from_pretrained(
                empty, config=config, dtype=torch_dtype, output_loading_info=True, ignore_mismatched_sizes=True,
                quantization_config=GgufConfig(dequantize=True), **common,
            )
        except Exception as exc:  # tensors past the end of the file, unknown quantization types, ...
            raise ExportError(f"gguf:{spec}: cannot load the weights: {first_line(exc)}") from exc
        if problem := loading_problems(info, weights="the GGUF tensors"):
            raise ExportError(f"gguf:{spec}: {problem}")
        if packed := sorted(name for name, p in model.named_parameters() if not p.is_floating_point()):
            raise ExportError(f"gguf:{spec}: {len(packed)} weights stayed quantized ({packed[0]}, ...); "
                              "expected every weight dequantized to a floating-point tensor")
        try:
            tokenizer = AutoTokenizer.from_pretrained(empty, **common)
        except Exception as exc:
            raise ExportError(f"gguf:{spec}: cannot load the tokenizer from the GGUF metadata: {first_line(exc)}") from exc
    return HFCheckpoint(model.eval(), tokenizer)


def load_gguf_bundle(
    spec: str,
    dtype: str | None = None,
    max_capacity: int | None = None,
    initial_capacity: int | None = None,
    max_write: int | None = None,
    batch_size: int = 1,
) -> ModelBundle:
    """The bundle of ``gguf:SPEC``: the model and tokenizer the file holds, made into a bundle
    exactly as an ``hf:DIR`` checkpoint is (same cache defaults, refusals and oracle)."""
    source = f"gguf:{spec}"
    check_bundle_options(source, max_capacity=max_capacity, initial_capacity=initial_capacity,
                         max_write=max_write, batch_size=batch_size)
    return checkpoint_bundle(load_gguf_model(spec, dtype), source, max_capacity=max_capacity,
                             initial_capacity=initial_capacity, max_write=max_write, batch_size=batch_size)
