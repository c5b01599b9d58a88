"""Model sources: where a :class:`~offgraph_export.models.ModelBundle` comes from.

A model reference is one of

* ``hf:DIR``: a local transformers checkpoint directory (:mod:`offgraph_export.frontends.hf`);
* ``gguf:FILE`` or ``gguf:pkg:PACKAGE``: a GGUF file (or the one an installed package ships), read
  by transformers and then made into a bundle as ``hf:`` is (:mod:`offgraph_export.frontends.gguf`);
* ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``: a factory written against the neutral op
  (:mod:`offgraph_export.frontends.factory`).

Importing this package imports neither transformers, gguf nor any user code.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

from offgraph_export.errors import OffgraphError
from offgraph_export.models import ModelBundle

__all__ = ["HF_PREFIX", "GGUF_PREFIX", "load_bundle", "canonical_reference"]

HF_PREFIX = "hf:"
GGUF_PREFIX = "gguf:"


def load_bundle(reference: str, **kwargs: object) -> ModelBundle:
    """The bundle a model reference names; ``kwargs`` go to the factory or the hf/gguf loader."""
    if reference.startswith(HF_PREFIX):
        from offgraph_export.frontends.hf import load_hf_bundle

        if not reference[len(HF_PREFIX) :].strip():
            raise OffgraphError("hf: needs a checkpoint directory: hf:DIR (hf:. for the current one)")
        return _load_prefixed(reference, HF_PREFIX, load_hf_bundle, kwargs)
    if reference.startswith(GGUF_PREFIX):
        from offgraph_export.frontends.gguf import load_gguf_bundle

        if not reference[len(GGUF_PREFIX) :].strip():
            raise OffgraphError("gguf: needs a file: gguf:FILE.gguf, or gguf:pkg:PACKAGE for the .gguf an installed package ships")
        return _load_prefixed(reference, GGUF_PREFIX, load_gguf_bundle, kwargs)
    from offgraph_export.frontends.factory import load_factory_bundle

    return load_factory_bundle(reference, **kwargs)


def _load_prefixed(reference: str, prefix: str, loader: Callable[..., ModelBundle], kwargs: dict[str, object]) -> ModelBundle:
    """``loader(rest, **kwargs)`` for ``prefix + rest``, arguments it does not take refused by name first."""
    try:
        inspect.signature(loader).bind(reference[len(prefix) :], **kwargs)
    except TypeError as exc:
        options = ", ".join(list(inspect.signature(loader).parameters)[1:])
        raise OffgraphError(f"{reference}: {exc} ({prefix} takes {options})") from None
    return loader(reference[len(prefix) :], **kwargs)


def canonical_reference(reference: str) -> str:
    """The reference with its file or directory made absolute, so that it resolves from any
    working directory (``package.module:FUNCTION`` and ``gguf:pkg:PACKAGE`` are left as they are)."""
    if reference.startswith(HF_PREFIX):
        return HF_PREFIX + os.path.abspath(reference[len(HF_PREFIX) :])
    if reference.startswith(GGUF_PREFIX):
        from offgraph_export.frontends.gguf.reference import canonical_gguf

        return GGUF_PREFIX + canonical_gguf(reference[len(GGUF_PREFIX) :])
    module_part, sep, func = reference.rpartition(":")
    if sep and module_part.endswith(".py"):
        return f"{os.path.abspath(module_part)}:{func}"
    return reference
