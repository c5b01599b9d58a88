"""Model factories named ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``: a function that
returns a :class:`~offgraph_export.models.ModelBundle`, written against the neutral op."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from offgraph_export.errors import OffgraphError
from offgraph_export.models import ModelBundle

__all__ = ["resolve_factory", "parse_factory_args", "load_factory_bundle"]


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


def load_factory_bundle(spec: str, **kwargs) -> ModelBundle:
    bundle = resolve_factory(spec)(**kwargs)
    if not isinstance(bundle, ModelBundle):
        raise OffgraphError(
            f"model factory {spec!r} returned {type(bundle).__name__}; expected a ModelBundle"
        )
    return bundle
