"""Model factories: what export needs from a model, and resolving ``FILE.py:FUNCTION`` /
``package.module:FUNCTION`` names given on the command line."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from offgraph_export.errors import OffgraphError
from offgraph_export.specs.cache_config import CacheConfig

__all__ = ["ModelBundle", "resolve_factory", "load_bundle", "parse_factory_args", "cast_bundle"]


@dataclass
class ModelBundle:
    """Everything export, check and run need from a model.

    ``token_dims[i]`` names the dim of ``example_inputs[i]`` that grows with the step's token
    count (``None`` for inputs of fixed shape). ``make_inputs(token_ids [B,T], start)`` builds a
    step's inputs for tokens that start at absolute position ``start``.
    """

    model: torch.nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    token_dims: tuple[int | None, ...]
    cache_config: CacheConfig
    make_inputs: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]
    vocab_size: int
    encode: Callable[[str], list[int]] | None = None
    decode: Callable[[list[int]], str] | None = None

    def __post_init__(self) -> None:
        if len(self.token_dims) != len(self.example_inputs):
            raise OffgraphError(
                f"token_dims has {len(self.token_dims)} entries but there are "
                f"{len(self.example_inputs)} example inputs"
            )


def resolve_factory(spec: str) -> Callable[..., ModelBundle]:
    """``path/to/file.py:build`` or ``package.module:build`` -> the callable."""
    module_part, sep, func_name = spec.rpartition(":")
    if not sep or not module_part or not func_name:
        raise OffgraphError(
            f"model factory {spec!r} must look like FILE.py:FUNCTION or package.module:FUNCTION"
        )
    if module_part.endswith(".py"):
        path = Path(module_part)
        if not path.is_file():
            raise OffgraphError(f"model factory file {str(path)!r} does not exist")
        name = f"_offgraph_model_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise OffgraphError(f"model factory file {str(path)!r} cannot be loaded as a module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise OffgraphError(f"cannot import model module {module_part!r}: {exc}") from exc
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise OffgraphError(f"{module_part!r} has no callable {func_name!r}")
    return factory


def parse_factory_args(pairs: list[str] | tuple[str, ...]) -> dict[str, object]:
    """``["n_layers=3", "ring_window=None"]`` -> ``{"n_layers": 3, "ring_window": None}``."""
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise OffgraphError(f"factory argument {pair!r} must look like NAME=VALUE")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def cast_bundle(bundle: ModelBundle, dtype: str | None) -> ModelBundle:
    """A bundle whose model computes in ``dtype`` and stores its cache in it too. The bundle
    given is left as it was, but its module is cast in place (``nn.Module.to``): copying the
    weights first would double a large model's memory."""
    if dtype is None:
        return bundle
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise OffgraphError(f"dtype {dtype!r} is not a floating torch dtype (float32, float16, bfloat16)")
    return replace(
        bundle,
        model=bundle.model.to(torch_dtype),
        cache_config=bundle.cache_config.with_overrides(storage_dtype=dtype),  # type: ignore[arg-type]
    )


def load_bundle(spec: str, **kwargs) -> ModelBundle:
    bundle = resolve_factory(spec)(**kwargs)
    if not isinstance(bundle, ModelBundle):
        raise OffgraphError(
            f"model factory {spec!r} returned {type(bundle).__name__}; expected a ModelBundle"
        )
    return bundle
