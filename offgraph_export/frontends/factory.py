"""Model factories named ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``: a function that
returns a :class:`~offgraph_export.models.ModelBundle`, written against the neutral op."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Iterator
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
        with _user_code(f"model factory file {str(path)!r}"):
            module_spec.loader.exec_module(module)
    else:
        with _user_code(f"model module {module_part!r}"):
            module = importlib.import_module(module_part)
    factory = getattr(module, func_name, None)
    if factory is None:
        raise OffgraphError(f"{module_part!r} has no function {func_name!r}")
    if not inspect.isfunction(factory):  # not a builtin (os:system), class or other callable
        raise OffgraphError(
            f"{spec!r} is a {type(factory).__name__}, not a Python function returning a ModelBundle"
        )
    return factory


def parse_factory_args(pairs: list[str] | tuple[str, ...]) -> dict[str, object]:
    """``["n_layers=3", "ring_window=None"]`` -> ``{"n_layers": 3, "ring_window": None}``. A value
    is a Python literal of a kind the artifact can record (int, finite float, bool, None, str) or,
    when it is not a literal, the text itself; a name given twice, or a container, is refused."""
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise OffgraphError(f"factory argument {pair!r} must look like NAME=VALUE")
        if key in out:
            raise OffgraphError(f"factory argument {key!r} is given twice")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        except (MemoryError, RecursionError):
            raise OffgraphError(f"factory argument {key!r}: the value is nested too deeply to read") from None
        if value is not None and not isinstance(value, (str, int, float)):
            raise OffgraphError(
                f"factory argument {key!r}: {type(value).__name__} values are not taken "
                "(int, float, bool, None or text; quote text that looks like a literal)"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise OffgraphError(f"factory argument {key!r}: {raw!r} is not a finite number")
        out[key] = value
    return out


@contextlib.contextmanager
def _user_code(what: str) -> Iterator[None]:
    """Run user code; anything it raises, or an exit it asks for, becomes one
    :class:`OffgraphError` naming ``what`` (the original exception is chained)."""
    try:
        yield
    except OffgraphError:
        raise
    except SystemExit as exc:
        raise OffgraphError(f"{what} called exit({exc.code!r}) instead of returning") from exc
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        text = str(exc).strip().splitlines()
        raise OffgraphError(f"{what} raised {type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")) from exc


def load_factory_bundle(spec: str, **kwargs) -> ModelBundle:
    factory = resolve_factory(spec)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise OffgraphError(f"model factory {spec!r} does not take these arguments: {exc}") from None
    with _user_code(f"model factory {spec!r}"):
        bundle = factory(**kwargs)
    if not isinstance(bundle, ModelBundle):
        raise OffgraphError(
            f"model factory {spec!r} returned {type(bundle).__name__}; expected a ModelBundle"
        )
    return bundle
