"""GGUF frontend: ``gguf:FILE`` (or ``gguf:pkg:PACKAGE``) -> a :class:`~offgraph_export.models.ModelBundle`.

A GGUF file (llama.cpp's format: metadata, tokenizer and quantized weights in one file) is read by
transformers' own GGUF loader, dequantized into a plain transformers model with the tokenizer the
file carries, and from there goes exactly the way of an ``hf:DIR`` checkpoint: the same wrapper,
refusals, cache defaults and oracle (transformers' eager attention over its ``DynamicCache``).

One module per concern: :mod:`.header` (the 24-byte header, bounded before any reader sees the
file), :mod:`.reference` (what ``gguf:FILE`` and ``gguf:pkg:PACKAGE`` name) and :mod:`.loader`
(transformers' loading, in the order of the hf frontend's checks). Importing this package imports
neither transformers nor gguf; loading a file does (``pip install 'offgraph-export[gguf]'``).
"""

from __future__ import annotations

from offgraph_export.frontends.gguf.loader import INSTALL_HINT, load_gguf_bundle, load_gguf_model
from offgraph_export.frontends.gguf.reference import PACKAGE_PREFIX, GGUFFile, canonical_gguf, resolve_gguf

__all__ = [
    "INSTALL_HINT",
    "PACKAGE_PREFIX",
    "GGUFFile",
    "canonical_gguf",
    "load_gguf_bundle",
    "load_gguf_model",
    "resolve_gguf",
]
