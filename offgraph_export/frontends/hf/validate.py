"""Checks of an ``hf:DIR`` checkpoint against the model its config describes: a checkpoint that
lies is refused by name, never loaded with random or cast values.

* Size (:func:`size_problem`, :func:`parameter_problem`): the fields that set how much is built
  are bounded before anything is built (in config.json as written, before transformers reads it,
  and again on the config it makes), and the model's parameter count, counted on the meta device,
  is at most :data:`MAX_PARAMETERS`.
* Headers (:func:`header_problems`): the safetensors headers (read without reading any tensor
  data) against the model built on the meta device: a tensor whose shape differs from the
  model's, or whose dtype is not a floating type where the model's is (an int32 weight cast to
  float32 is not the checkpoint's model), is refused before the weights are loaded. Casting
  between floating types (a bf16 checkpoint into a float32 model) is normal and kept.
* Loading report (:func:`loading_problems`): what transformers reports once the weights are in:
  tensors the model has that the checkpoint lacks (transformers would fill them with random
  values), tensors the checkpoint has that the model does not, and mismatched shapes. Tied weights
  (``lm_head`` tied to the embedding) and non-persistent buffers (rotary ``inv_freq``) are not
  missing: transformers, which knows its own tying, key renames and fused experts, leaves them
  out of its report.

Every function returns a one-line problem (or ``None``); the caller names the directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from offgraph_export.errors import first_line

__all__ = [
    "memory_shortfall",
    "MAX_LAYERS",
    "MAX_HIDDEN_SIZE",
    "MAX_INTERMEDIATE_SIZE",
    "MAX_VOCAB_SIZE",
    "MAX_EXPERTS",
    "MAX_PARAMETERS",
    "SIZE_FIELDS",
    "Header",
    "size_problem",
    "parameter_problem",
    "read_headers",
    "header_problems",
    "loading_problems",
]

#: The most decoder layers (the largest real decoders have a few hundred at most: Llama 3.1 405B has 126).
MAX_LAYERS = 1024
#: The widest hidden size (real decoders: at most about 16-25k).
MAX_HIDDEN_SIZE = 65536
#: The widest MLP (real dense decoders: at most about 53k, Llama 3.1 405B).
MAX_INTERMEDIATE_SIZE = 262144
#: The largest vocabulary (real decoders: at most about 260k).
MAX_VOCAB_SIZE = 1 << 20
#: The most experts of a mixture-of-experts layer (real ones: a few hundred).
MAX_EXPERTS = 1024
#: The most parameters a checkpoint's model may have, counted on the meta device before anything
#: is allocated: 80 billion admits the 70B class (Llama 3 70B, Qwen2 72B).
MAX_PARAMETERS = 80_000_000_000

#: Each config field that sizes what is built (transformers' names and the aliases configs of other
#: architectures use for them) and its bound.
SIZE_FIELDS: dict[str, int] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers"), MAX_LAYERS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), MAX_HIDDEN_SIZE),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "moe_intermediate_size",
                     "shared_expert_intermediate_size"), MAX_INTERMEDIATE_SIZE),
    "vocab_size": MAX_VOCAB_SIZE,
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), MAX_EXPERTS),
}

#: How many names a refusal lists before it gives only the count.
_SHOWN = 5


def _names(names: Iterable[str]) -> str:
    """The first few of ``names`` (sorted), with the count when there are more."""
    names = sorted(names)
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown}, ... ({len(names)} in all)"


def _tensors(count: int) -> str:
    return f"{count} tensor{'s' if count != 1 else ''}"


def _too_large(field: str, value: object, bound: int, source: str = "config.json") -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= bound:
        return None
    return (f"{source}: {field} is {value}, more than the {bound} a checkpoint may have "
            f"(the bound keeps a model under {MAX_PARAMETERS // 10**9} billion parameters and in memory)")


def size_problem(config_json: object, config: object | None = None, source: str = "config.json") -> str | None:
    """The first field of ``config_json`` (config.json as parsed, nested configs included) or of
    ``config`` (the transformers config made from it, and its text config) past its bound in
    :data:`SIZE_FIELDS`; checked before anything is built. ``source`` names where the fields were
    read (a GGUF file's metadata is read into the same fields)."""

    def walk(data: object, prefix: str) -> str | None:
        if isinstance(data, Mapping):
            for key, value in data.items():
                path = f"{prefix}{key}"
                if key in SIZE_FIELDS and (problem := _too_large(path, value, SIZE_FIELDS[key], source)):
                    return problem
                if isinstance(value, (Mapping, list)) and (problem := walk(value, f"{path}.")):
                    return problem
        elif isinstance(data, list):
            for i, value in enumerate(data):
                if problem := walk(value, f"{prefix.removesuffix('.')}[{i}]."):
                    return problem
        return None

    if problem := walk(config_json, ""):
        return problem
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for owner in (config,) if text is config else (config, text):
        for field, bound in SIZE_FIELDS.items():
            try:
                value = getattr(owner, field, None)
            except Exception:  # a config property that cannot be computed: not a size
                continue
            if problem := _too_large(field, value, bound, source):
                return problem
    return None


def parameter_problem(shell: nn.Module, source: str = "config.json") -> str | None:
    """Whether the model (built on the meta device) has more than :data:`MAX_PARAMETERS` parameters."""
    count = sum(p.numel() for p in shell.parameters())
    if count <= MAX_PARAMETERS:
        return None
    return (f"{source} describes a model of {count / 1e9:.1f} billion parameters, more than the "
            f"{MAX_PARAMETERS // 10**9} billion a checkpoint may have")


#: A safetensors header entry: (file name, dtype as safetensors writes it, shape).
Header = tuple[str, str, tuple[int, ...]]


def read_headers(path: Path, files: list[str]) -> tuple[dict[str, Header], str | None]:
    """Every tensor the safetensors ``files`` of ``path`` declare, from their headers alone (no
    tensor data is read), or a problem naming the file that cannot be read."""
    from safetensors import safe_open

    headers: dict[str, Header] = {}
    for name in files:
        try:
            with safe_open(path / name, framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_slice(key)
                    headers[key] = (name, str(tensor.get_dtype()), tuple(int(d) for d in tensor.get_shape()))
        except Exception as exc:  # a corrupt header, a truncated file
            return headers, f"{name} is not a readable safetensors file: {first_line(exc)}"
    return headers, None


def _is_floating(safetensors_dtype: str) -> bool:
    """F64, F32, F16, BF16 and the float8 kinds (F8_E4M3, ...) are floating; integers, BOOL and
    complex are not."""
    return safetensors_dtype.startswith(("F", "BF"))


def _model_name(key: str, expected: Mapping[str, torch.Tensor], prefix: str) -> str | None:
    """The model's name for checkpoint tensor ``key`` when it is the same one (a checkpoint of
    the base model lacks the ``model.`` prefix, one of the head model may have it for a base
    model); ``None`` when the model names it otherwise (renamed or fused by transformers) or not
    at all."""
    for name in (key, f"{prefix}.{key}" if prefix else None, key.removeprefix(f"{prefix}.") if prefix else None):
        if name is not None and name in expected:
            return name
    return None


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def header_problems(headers: Mapping[str, Header], shell: nn.Module) -> str | None:
    """Tensors of the checkpoint whose dtype the model's cannot honestly be cast from, or whose
    shape is not the model's (``shell`` is the model on the meta device): a problem naming them,
    mistyped ones first."""
    expected = shell.state_dict()
    prefix = getattr(shell, "base_model_prefix", "") or ""
    all_floating = all(p.is_floating_point() for p in shell.parameters())
    mistyped, misshapen = [], []
    for key, (file, dtype, shape) in headers.items():
        name = _model_name(key, expected, prefix)
        if name is None:  # renamed or fused by transformers (or unexpected: the loading report names it)
            if not _is_floating(dtype) and all_floating:
                mistyped.append((key, f"{key} is {dtype} in {file}, where every parameter of the model is floating point"))
            continue
        target = expected[name]
        if target.is_floating_point() and not _is_floating(dtype):
            mistyped.append((key, f"{key} is {dtype} in {file}, the model's is {_torch_name(target.dtype)}"))
        elif not target.is_floating_point() and _is_floating(dtype):
            mistyped.append((key, f"{key} is {dtype} in {file}, the model's is {_torch_name(target.dtype)}"))
        if tuple(target.shape) != shape:
            misshapen.append((key, f"{key} is {list(shape)} in {file}, the model's is {list(target.shape)}"))
    if mistyped:
        return (f"{_tensors(len(mistyped))} of the safetensors weights {'have' if len(mistyped) != 1 else 'has'} "
                f"a dtype the model's cannot be cast from: {_details(mistyped)} (floating-point weights "
                "are cast to the export dtype; integer, bool and complex ones are not weights of this model)")
    if misshapen:
        return (f"{_tensors(len(misshapen))} of the safetensors weights {'have' if len(misshapen) != 1 else 'has'} "
                f"a shape other than the model's: {_details(misshapen)} (is config.json the checkpoint's own?)")
    return None


def _details(items: list[tuple[str, str]]) -> str:
    items = sorted(items)
    shown = "; ".join(detail for _, detail in items[:_SHOWN])
    return shown if len(items) <= _SHOWN else f"{shown}; ... ({len(items)} in all)"


def loading_problems(info: Mapping[str, object], weights: str = "the safetensors weights") -> str | None:
    """The problems of transformers' loading report ``info`` (``output_loading_info``): tensors
    missing from the checkpoint, tensors the model does not have, mismatched shapes (of tensors
    transformers renamed or fused, which :func:`header_problems` cannot match by name) and load
    errors. ``weights`` names what the weights were read from."""
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    mismatched = list(info.get("mismatched_keys") or ())
    errors = list(info.get("error_msgs") or ())
    problems = []
    if missing:
        problems.append(f"{weights} lack {_tensors(len(missing))} of the model: {_names(missing)} "
                        "(a checkpoint holds every weight but tied ones; refused rather than filled with random values)")
    if unexpected:
        problems.append(f"{weights} hold {_tensors(len(unexpected))} the model does not have: "
                        f"{_names(unexpected)} (is config.json the checkpoint's own?)")
    if mismatched:
        details = []
        for entry in mismatched:
            if isinstance(entry, (tuple, list)) and len(entry) == 3:
                key, ckpt, model = entry
                details.append((str(key), f"{key} is {list(ckpt)} in the checkpoint, the model's is {list(model)}"))
            else:
                details.append((str(entry), str(entry)))
        problems.append(f"{_tensors(len(details))} of {weights} "
                        f"{'have' if len(details) != 1 else 'has'} a shape other than the model's: {_details(details)}")
    if errors:
        problems.append(f"loading the weights failed: {first_line(RuntimeError(errors[0]))}")
    if problems:
        return "; ".join(problems)
    return None


def memory_shortfall(shell: nn.Module) -> tuple[int, int] | None:
    """``(bytes needed, bytes of memory)`` when the parameters and buffers of ``shell`` (built on
    the meta device, nothing allocated) would not fit this machine's memory; None when they fit or
    the platform has no such counter."""
    needed = sum(t.numel() * t.element_size() for t in (*shell.parameters(), *shell.buffers()))
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such counter on this platform
        return None
    return (needed, memory) if needed > memory else None
