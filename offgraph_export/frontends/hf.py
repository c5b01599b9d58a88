"""transformers frontend: ``hf:DIR`` -> a :class:`~offgraph_export.models.ModelBundle`.

DIR is a local checkpoint directory: ``config.json`` plus safetensors weights (and optionally
tokenizer files), or ``config.json`` alone (weights then random, seeded; a directory holding
weights in another format is refused, not mistaken for a config-only one). Nothing is downloaded:
every load is ``local_files_only`` with the hub offline, no remote code runs, and only safetensors
weights are read (a pickled ``.bin`` is refused).

Generic by design, one mechanism for every decoder-only architecture that routes attention through
transformers' attention-function registry (``AttentionInterface``):

* An attention function named ``offgraph`` is registered (when a checkpoint is loaded, not at
  import) and the model is switched to it. The model's own attention module computes q, k, v (its
  projections, q/k norms and RoPE) and calls the function with BHSD tensors, K/V not repeated for
  GQA, its ``scaling`` and, on sliding-window layers, its ``sliding_window``. The function calls
  the neutral op with the module's ``layer_idx`` and the step's positions.
* No mask function is registered under that name, so transformers builds no attention mask, and
  the model is called with ``use_cache=False`` and no cache object: the neutral op is the only
  cache, and the traced graph holds no cache state. Positions are the wrapper's ``[T]`` input.
* A probe forward records what each layer's own code passes (window, soft-cap, sinks, scaling,
  shapes, call count). Full layers become flat, sliding-window layers rings of their window (flat
  when the window is at least the cache's capacity: it then never excludes a key).
  Features the op cannot express are refused, naming the feature and the layer
  (:func:`refusals`), never exported wrong.

The oracle of ``check`` is transformers itself: the same weights run by the model's own eager
attention with its own ``DynamicCache`` (:class:`TransformersOracle`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import nn

from offgraph_export.errors import ExportError
from offgraph_export.models import ModelBundle, model_dtype
from offgraph_export.ops import update_and_attend
from offgraph_export.reference.oracle import HeldRows
from offgraph_export.specs.cache_config import CacheConfig
from offgraph_export.specs.limits import loads_limited

__all__ = [
    "ATTENTION_NAME",
    "OffgraphCausalLM",
    "TransformersOracle",
    "load_hf_bundle",
    "load_hf_model",
    "refusals",
    "wrap_model",
]

ATTENTION_NAME = "offgraph"
#: The attention implementation the oracle runs: transformers' plain eager math.
ORACLE_ATTENTION = "eager"

# Keyword arguments an attention function may receive that change nothing for the neutral op
# (the features that do, soft-capping and sinks, are checked by name).
_NEUTRAL_KWARGS = frozenset({
    "position_ids", "sliding_window", "dropout", "scaling", "output_attentions", "use_cache",
    "softcap", "s_aux", "sinks", "is_causal", "output_router_logits",
})


# --- the attention function --------------------------------------------------------------------


@dataclass
class _Call:
    """What one layer's attention module passed to the attention function."""

    sliding_window: int | None
    softcap: float | None
    sinks: bool
    causal: bool
    masked: bool
    q_tokens: int
    k_tokens: int
    extra: list[str]


@dataclass
class _Step:
    """The step being traced or run: the layers' windows (from the probe) and the positions."""

    windows: dict[int, int]
    position: torch.Tensor


_PROBE: contextvars.ContextVar[dict[int, list[_Call]] | None] = contextvars.ContextVar(
    "offgraph_hf_probe", default=None
)
_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("offgraph_hf_step", default=None)


def _offgraph_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature; returns ``(out [B,T,Hq,Dv], None)``."""
    layer = module.layer_idx
    record = _PROBE.get()
    if record is not None:
        record.setdefault(layer, []).append(
            _Call(
                sliding_window=kwargs.get("sliding_window"),
                softcap=kwargs.get("softcap"),
                sinks=kwargs.get("s_aux", kwargs.get("sinks")) is not None or hasattr(module, "sinks"),
                causal=bool(getattr(module, "is_causal", True)),
                masked=attention_mask is not None,
                q_tokens=int(query.shape[2]),
                k_tokens=int(key.shape[2]),
                extra=sorted(set(kwargs) - _NEUTRAL_KWARGS),
            )
        )
        b, hq, t, _ = query.shape
        return query.new_zeros(b, t, hq, value.shape[-1]), None
    step = _STEP.get()
    if step is None:
        raise ExportError(
            f"layer {layer}: the '{ATTENTION_NAME}' attention ran outside an OffgraphCausalLM "
            "forward; call the wrapper, not the transformers model"
        )
    window = kwargs.get("sliding_window")
    if window != step.windows.get(layer):
        raise ExportError(
            f"layer {layer}: the model passes sliding_window={window} but its probe found "
            f"{step.windows.get(layer)}"
        )
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = update_and_attend(query, key, value, step.position, layer, scale, query.dtype)
    return out.transpose(1, 2), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _offgraph_attention)


@contextlib.contextmanager
def _attention(model: nn.Module, name: str) -> Iterator[None]:
    """Run ``model`` with attention implementation ``name`` inside the block."""
    before = model.config._attn_implementation
    if before == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


# --- what the op cannot express ----------------------------------------------------------------


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _config_refusals(config) -> list[str]:
    """Whole-model features the neutral op cannot express, read from the config."""
    text = _text_config(config)
    found = []
    if getattr(config, "is_encoder_decoder", False):
        found.append("encoder-decoder models (cross-attention over an encoder)")
    if getattr(text, "add_cross_attention", False):
        found.append("cross-attention (add_cross_attention=True)")
    if getattr(text, "attn_logit_softcapping", None):
        found.append(f"attention logit soft-capping (attn_logit_softcapping={text.attn_logit_softcapping})")
    attn_config = getattr(text, "attn_config", None)
    if (
        getattr(text, "alibi", False)
        or getattr(text, "position_embedding_type", None) == "alibi"
        or (isinstance(attn_config, dict) and attn_config.get("alibi"))
    ):
        found.append("ALiBi position bias")
    if getattr(text, "is_causal", True) is False:
        found.append("bidirectional (non-causal) attention")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    subs = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for sub in subs:
        kind = sub.get("rope_type", sub.get("type")) if isinstance(sub, dict) else None
        if kind in ("dynamic", "longrope"):
            found.append(f"length-dependent RoPE (rope_type={kind!r}): its frequencies depend on the sequence length")
    for layer, kind in enumerate(getattr(text, "layer_types", None) or []):
        if kind not in ("full_attention", "sliding_attention"):
            found.append(f"layer {layer}: layer type {kind!r} (only full_attention and sliding_attention)")
    return found


def _probe(model: nn.Module, n_tokens: int = 3) -> dict[int, list[_Call]]:
    record: dict[int, list[_Call]] = {}
    token = _PROBE.set(record)
    try:
        device = next(model.parameters()).device
        ids = torch.zeros(1, n_tokens, dtype=torch.long, device=device)
        with torch.no_grad(), _attention(model, ATTENTION_NAME):
            model(input_ids=ids, position_ids=torch.arange(n_tokens, device=device)[None], use_cache=False)
    finally:
        _PROBE.reset(token)
    return record


def refusals(model: nn.Module) -> tuple[list[str], dict[int, int]]:
    """``(problems, windows)``: every feature of ``model`` the neutral op cannot express, each
    naming the feature (and the layer where it is one layer's), and the sliding window of each
    sliding-window layer."""
    problems = _config_refusals(model.config)
    if any("encoder-decoder" in p for p in problems):
        return problems, {}
    record = _probe(model)
    n_layers = getattr(_text_config(model.config), "num_hidden_layers", None) or len(record)
    windows: dict[int, int] = {}
    for layer in range(n_layers):
        calls = record.get(layer, [])
        if len(calls) != 1:
            problems.append(
                f"layer {layer}: attention called {len(calls)} times through transformers' "
                "AttentionInterface (expected once: the architecture does not route attention "
                "through it, or shares it across layers)"
            )
            continue
        call = calls[0]
        if call.softcap is not None:
            problems.append(f"layer {layer}: attention logit soft-capping (softcap={call.softcap})")
        if call.sinks:
            problems.append(f"layer {layer}: attention sinks")
        if not call.causal:
            problems.append(f"layer {layer}: non-causal attention")
        if call.masked:
            problems.append(f"layer {layer}: a model-made attention mask (e.g. a position bias)")
        if call.q_tokens != call.k_tokens:
            problems.append(f"layer {layer}: keys from another sequence (cross-attention or shared KV)")
        if call.extra:
            problems.append(f"layer {layer}: attention arguments {call.extra} the op cannot honour")
        if call.sliding_window is not None:
            windows[layer] = int(call.sliding_window)
    layer_types = getattr(_text_config(model.config), "layer_types", None)
    for layer, kind in enumerate(layer_types or []):
        if kind in ("full_attention", "sliding_attention") and (kind == "sliding_attention") != (layer in windows):
            problems.append(
                f"layer {layer}: config says {kind} but the module passes sliding_window="
                f"{windows.get(layer)}"
            )
    return list(dict.fromkeys(problems)), windows


# --- the wrapped model -------------------------------------------------------------------------


class OffgraphCausalLM(nn.Module):
    """``(tokens [B,T] int64, position [T] int64) -> logits [B,T,V]``: the transformers model with
    its attention through the neutral op."""

    def __init__(self, hf_model: nn.Module, windows: dict[int, int]) -> None:
        super().__init__()
        self.hf = hf_model
        self.windows = dict(windows)

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        token = _STEP.set(_Step(self.windows, position))
        try:
            with _attention(self.hf, ATTENTION_NAME):
                out = self.hf(input_ids=tokens, position_ids=position.unsqueeze(0), use_cache=False)
        finally:
            _STEP.reset(token)
        return out.logits


def wrap_model(hf_model: nn.Module, source: str = "model") -> tuple[OffgraphCausalLM, dict[int, int]]:
    """The wrapper and its layers' windows; raises :class:`ExportError` listing every refusal."""
    _register_attention()
    hf_model.eval()
    try:
        problems, windows = refusals(hf_model)
    except ExportError:
        raise
    except Exception as exc:  # the probe runs the model once on 3 tokens: a broken config fails here
        raise ExportError(f"{source}: running the model once on 3 tokens failed: {_first_line(exc)}") from exc
    if problems:
        raise ExportError(
            f"{source}: not supported by the neutral KV op: " + "; ".join(problems)
        )
    return OffgraphCausalLM(hf_model, windows), windows


# --- the oracle: transformers' own attention and cache -----------------------------------------


class TransformersOracle:
    """The same weights run by transformers' eager attention over its own ``DynamicCache``."""

    def __init__(self, hf_model: nn.Module) -> None:
        from transformers import DynamicCache

        self.model = hf_model
        self.cache = DynamicCache(config=hf_model.config)
        params = inspect.signature(hf_model.forward).parameters
        # transformers 5.24 renamed past_key_values to cache (the old name is deprecated)
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.committed_length = 0

    def step(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, position = inputs
        with _attention(self.model, ORACLE_ATTENTION):
            out = self.model(
                input_ids=tokens, position_ids=position.unsqueeze(0), use_cache=True,
                **{self._cache_kwarg: self.cache},
            )
        self.committed_length += tokens.shape[1]
        return (out.logits,)

    def held(self, layer_id: int) -> HeldRows | None:
        if layer_id >= len(self.cache.layers):
            return None
        layer = self.cache.layers[layer_id]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.dim() != 4:
            return None
        n = keys.shape[2]  # the newest n positions (a sliding layer keeps only its window)
        return list(range(self.committed_length - n, self.committed_length)), keys, values


# --- loading a checkpoint directory ------------------------------------------------------------


def _fail(directory: Path, what: str) -> ExportError:
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


def _check_random_weights_fit(path: Path, auto_model: object, config: object, dtype: torch.dtype) -> None:
    """A config.json alone gets random weights made in memory: refuse one whose weights would not
    fit this machine's memory (a 200-byte config can ask for terabytes), sized on the meta device
    first, where nothing is allocated."""
    with torch.device("meta"):
        shell = auto_model.from_config(config, dtype=dtype, trust_remote_code=False)  # type: ignore[attr-defined]
    needed = sum(t.numel() * t.element_size() for t in (*shell.parameters(), *shell.buffers()))
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such counter on this platform
        return
    if needed > memory:
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
    _read_json(path, "config.json")
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
        raise _fail(path, f"config.json cannot be read as a transformers config: {_first_line(exc)}") from exc
    if getattr(config, "is_encoder_decoder", False):
        raise _fail(path, f"not supported by the neutral KV op: encoder-decoder model ({config.model_type})")
    weights = _safetensors_files(path)
    others = sorted(p.name for p in path.iterdir() if p.name.endswith(_OTHER_WEIGHTS) or p.suffix == ".safetensors")
    if not weights and others:  # random weights only for a directory that holds none at all
        raise _fail(path, f"only safetensors weights (model.safetensors, or shards named by "
                          f"model.safetensors.index.json) are read; found {others}")
    try:
        if weights:
            model = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, use_safetensors=True, trust_remote_code=False,
                dtype=torch_dtype,
            )
        else:
            _check_random_weights_fit(path, AutoModelForCausalLM, config, torch_dtype)
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=False)
    except Exception as exc:  # missing shards, shape mismatches, unknown architectures, ...
        raise _fail(path, f"cannot build the model: {_first_line(exc)}") from exc
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception as exc:
            raise _fail(path, f"cannot load the tokenizer: {_first_line(exc)}") from exc
    return HFCheckpoint(model.eval(), tokenizer)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_hf_bundle(
    directory: str,
    dtype: str | None = None,
    seed: int = 0,
    max_capacity: int | None = None,
    initial_capacity: int | None = None,
    max_write: int | None = None,
    batch_size: int = 1,
) -> ModelBundle:
    """The bundle of ``hf:DIR``. The cache defaults to the model's context length (at most 8192
    tokens), 64 tokens up front and up to 128 tokens a step; every layer the model runs with a
    sliding window becomes a ring of that window."""
    for name, value in dict(seed=seed, max_capacity=max_capacity, initial_capacity=initial_capacity,
                            max_write=max_write, batch_size=batch_size).items():
        if value is not None and (type(value) is not int or (value < 1 and name != "seed")):
            raise ExportError(f"hf:{directory}: {name} must be a positive integer, got {value!r}")
    checkpoint = load_hf_model(directory, dtype, seed)
    model = checkpoint.model
    wrapped, windows = wrap_model(model, f"hf:{directory}")
    context = getattr(_text_config(model.config), "max_position_embeddings", None)
    if context is not None and (type(context) is not int or context < 1):
        raise ExportError(f"hf:{directory}: max_position_embeddings must be a positive integer, got {context!r}")
    if max_capacity is not None and context is not None and max_capacity > context:
        raise ExportError(
            f"hf:{directory}: max_capacity {max_capacity} is more than the {context} positions the model "
            "is defined for (max_position_embeddings); a larger cache would hold positions it cannot embed"
        )
    capacity = max_capacity or min(context or 8192, 8192)
    # a window at least as long as the cache never excludes a key: such a layer is flat (a ring
    # would hold its window's rows, more than the cache ever fills)
    rings = {layer: window for layer, window in windows.items() if window < capacity}
    try:
        config = CacheConfig(
            max_capacity=capacity,
            initial_capacity=initial_capacity if initial_capacity is not None else min(64, capacity),
            max_write=max_write if max_write is not None else min(128, capacity),
            storage_dtype=str(next(model.parameters()).dtype).removeprefix("torch."),  # type: ignore[arg-type]
            ring_windows=rings,
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise ExportError(f"hf:{directory}: invalid cache configuration: {problems}") from None
    if config.max_write < 2:
        raise ExportError(f"hf:{directory}: max_write must be at least 2 to export a dynamic token width")

    def make_inputs(tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tokens, torch.arange(start, start + tokens.shape[1], dtype=torch.int64, device=tokens.device)

    tokenizer = checkpoint.tokenizer
    return ModelBundle(
        model=wrapped,
        example_inputs=make_inputs(torch.zeros(batch_size, min(4, config.max_write), dtype=torch.int64), 0),
        token_dims=(1, 0),
        cache_config=config,
        make_inputs=make_inputs,
        vocab_size=int(_text_config(model.config).vocab_size),
        encode=(lambda text: list(tokenizer(text).input_ids)) if tokenizer is not None else None,  # type: ignore[operator]
        decode=(lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None,  # type: ignore[attr-defined]
        make_oracle=lambda manifest: TransformersOracle(model),
    )
