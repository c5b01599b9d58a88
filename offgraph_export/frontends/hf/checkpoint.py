"""Reading a local transformers checkpoint directory: ``config.json``, safetensors weights (one
file, or the shards a ``model.safetensors.index.json`` names), the dtype and the tokenizer.

The directory is untrusted input: its JSON files are read bounded before transformers sees them,
nothing is downloaded (``local_files_only`` with the hub offline), no remote code runs, and only
safetensors weights are read; a directory holding weights in another format is refused rather
than mistaken for a config-only one (which gets seeded random weights, if they fit in memory).

A checkpoint that lies is refused by name (:mod:`.validate`): a config whose sizes are past their
bounds (or whose model has more than ``MAX_PARAMETERS`` parameters) before anything is built; a
safetensors tensor of the wrong shape, or of an integer/bool dtype where the model's is floating,
before any weight is read; and tensors missing from the checkpoint (which transformers would fill
with random values) or not in the model, from transformers' own loading report. Tied weights and
non-persistent buffers are not missing; casting between floating types is normal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from offgraph_export.errors import ExportError, first_line
from offgraph_export.frontends.hf.random_weights import seeded_random_model
from offgraph_export.frontends.hf.validate import (
    header_problems,
    loading_problems,
    memory_shortfall,
    parameter_problem,
    read_headers,
    size_problem,
)
from offgraph_export.models import model_dtype
from offgraph_export.specs.limits import loads_limited

__all__ = ["HFCheckpoint", "load_hf_model"]


def _fail(directory: Path, what: str) -> ExportError:
    """The error for a bad checkpoint directory: ``hf:DIR: what``."""
    return ExportError(f"hf:{directory}: {what}")


#: The largest JSON file of a checkpoint read (config.json, the safetensors index; real ones are KBs to a few hundred KB).
_MAX_CONFIG_BYTES = 1 << 20
#: Weight files transformers could read that this frontend does not: their presence without
#: safetensors weights is refused rather than mistaken for a config-only directory.
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".index.json")


def _safetensors_files(path: Path) -> list[str]:
    """The safetensors weights of ``path``: ``model.safetensors``, or every shard its index
    names (each a plain file inside ``path``); [] when there are none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(path, index.name)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise _fail(path, f"{index.name} has no weight_map of tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if Path(shard).name != shard or not (path / shard).is_file():
                raise _fail(path, f"{index.name} names the shard {shard!r}, which is not a file in the directory")
        return shards
    return ["model.safetensors"] if (path / "model.safetensors").is_file() else []


def _meta_shell(path: Path, auto_model: object, config: object, dtype: torch.dtype) -> nn.Module:
    """The model of ``config`` on the meta device, where nothing is allocated: sized and compared
    with the checkpoint's headers before anything real is built."""
    try:
        with torch.device("meta"):
            return auto_model.from_config(config, dtype=dtype, trust_remote_code=False)  # type: ignore[attr-defined]
    except Exception as exc:  # unknown architectures, inconsistent configs, ...
        raise _fail(path, f"cannot build the model: {first_line(exc)}") from exc


def _check_random_weights_fit(path: Path, shell: nn.Module, dtype: torch.dtype) -> None:
    """A config.json alone gets random weights made in memory: refuse one whose weights would not
    fit this machine's memory (a 200-byte config can ask for terabytes), sized on the meta device
    (``shell``) first, where nothing is allocated."""
    short = memory_shortfall(shell)
    if short is not None:
        needed, memory = short
        raise _fail(
            path,
            f"config.json describes {needed / 1e9:.1f} GB of {str(dtype).removeprefix('torch.')} weights, "
            f"more than this machine's {memory / 1e9:.1f} GB of memory (random weights are made in memory)",
        )


def _read_json(path: Path, name: str) -> object:
    """``path / name`` as untrusted input: a regular file of bounded size, bounded JSON."""
    file = path / name
    if not file.is_file():
        raise _fail(path, f"{name} is not a regular file")
    if file.stat().st_size > _MAX_CONFIG_BYTES:
        raise _fail(path, f"{name} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        return loads_limited(file.read_bytes(), name, ExportError)
    except OSError as exc:
        raise _fail(path, f"{name} is unreadable: {exc}") from exc
    except ExportError as exc:
        raise _fail(path, str(exc)) from None


@dataclass
class HFCheckpoint:
    """A loaded checkpoint: the causal LM (in eval mode) and its tokenizer, if the directory has one."""

    model: nn.Module
    tokenizer: object | None


def load_hf_model(directory: str | os.PathLike, dtype: str | None = None, seed: int = 0) -> HFCheckpoint:
    """The causal LM (and tokenizer, when the directory has one) of a local checkpoint."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(directory)
    if not path.is_dir():
        raise _fail(path, "no such checkpoint directory")
    if not (path / "config.json").exists():
        raise _fail(path, "config.json is missing")
    config_json = _read_json(path, "config.json")
    # before transformers reads it: a config class may build a list per layer in its __init__
    if problem := size_problem(config_json):
        raise _fail(path, problem)
    torch_dtype = model_dtype(dtype, ExportError) if dtype is not None else torch.float32
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ExportError(
            f"hf: references need transformers (pip install 'offgraph-export[hf]'): {exc}"
        ) from exc
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError for bad configs
        raise _fail(path, f"config.json cannot be read as a transformers config: {first_line(exc)}") from exc
    if problem := size_problem({}, config):  # the sizes as the config class made them (defaults, aliases)
        raise _fail(path, problem)
    if getattr(config, "is_encoder_decoder", False):
        raise _fail(path, f"not supported by the neutral KV op: encoder-decoder model ({config.model_type})")
    weights = _safetensors_files(path)
    others = sorted(p.name for p in path.iterdir() if p.name.endswith(_OTHER_WEIGHTS) or p.suffix == ".safetensors")
    if not weights and others:  # random weights only for a directory that holds none at all
        raise _fail(path, f"only safetensors weights (model.safetensors, or shards named by "
                          f"model.safetensors.index.json) are read; found {others}")
    shell = _meta_shell(path, AutoModelForCausalLM, config, torch_dtype)
    if not weights:
        _check_random_weights_fit(path, shell, torch_dtype)
    if problem := parameter_problem(shell):
        raise _fail(path, problem)
    if weights:  # the headers against the model before any weight is read
        headers, problem = read_headers(path, weights)
        if problem := problem or header_problems(headers, shell):
            raise _fail(path, problem)
    del shell
    try:
        if weights:
            # mismatched shapes are reported (and refused below by name), not raised as a generic error
            model, info = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, use_safetensors=True, trust_remote_code=False,
                dtype=torch_dtype, output_loading_info=True, ignore_mismatched_sizes=True,
            )
        else:
            model = seeded_random_model(config, torch_dtype, seed)
    except Exception as exc:  # missing shards, unknown architectures, ...
        raise _fail(path, f"cannot build the model: {first_line(exc)}") from exc
    if weights and (problem := loading_problems(info)):
        raise _fail(path, problem)
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception as exc:
            raise _fail(path, f"cannot load the tokenizer: {first_line(exc)}") from exc
    return HFCheckpoint(model.eval(), tokenizer)
