"""Model sources: where a :class:`~offgraph_export.models.ModelBundle` comes from.

A model reference is one of

* ``hf:DIR``: a local transformers checkpoint directory (:mod:`offgraph_export.frontends.hf`);
* ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``: a factory written against the neutral op
  (:mod:`offgraph_export.frontends.factory`).

Importing this package imports neither transformers nor any user code.
"""

from __future__ import annotations

import inspect
import os

from offgraph_export.errors import OffgraphError
from offgraph_export.models import ModelBundle

__all__ = ["HF_PREFIX", "load_bundle", "canonical_reference"]

HF_PREFIX = "hf:"


def load_bundle(reference: str, **kwargs: object) -> ModelBundle:
    """The bundle a model reference names; ``kwargs`` go to the factory or the hf loader."""
    if reference.startswith(HF_PREFIX):
        from offgraph_export.frontends.hf import load_hf_bundle

        if not reference[len(HF_PREFIX) :].strip():
            raise OffgraphError("hf: needs a checkpoint directory: hf:DIR (hf:. for the current one)")
        try:
            inspect.signature(load_hf_bundle).bind(reference[len(HF_PREFIX) :], **kwargs)
        except TypeError as exc:
            raise OffgraphError(f"{reference}: {exc} (hf: takes {_hf_options()})") from None
        return load_hf_bundle(reference[len(HF_PREFIX) :], **kwargs)  # type: ignore[arg-type]
    from offgraph_export.frontends.factory import load_factory_bundle

    return load_factory_bundle(reference, **kwargs)


def _hf_options() -> str:
    from offgraph_export.frontends.hf import load_hf_bundle

    return ", ".join(list(inspect.signature(load_hf_bundle).parameters)[1:])


def canonical_reference(reference: str) -> str:
    """The reference with its file or directory made absolute, so that it resolves from any
    working directory (``package.module:FUNCTION`` is left as it is)."""
    if reference.startswith(HF_PREFIX):
        return HF_PREFIX + os.path.abspath(reference[len(HF_PREFIX) :])
    module_part, sep, func = reference.rpartition(":")
    if sep and module_part.endswith(".py"):
        return f"{os.path.abspath(module_part)}:{func}"
    return reference
