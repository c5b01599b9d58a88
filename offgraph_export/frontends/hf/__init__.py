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

One module per concern: :mod:`.attention` (the attention function, the probe and the refusals),
:mod:`.checkpoint` (reading the directory), :mod:`.oracle` and :mod:`.bundle` (the wrapper and
the :class:`~offgraph_export.models.ModelBundle`). Importing this package does not import
transformers; loading a checkpoint does.
"""

from __future__ import annotations

# HFCheckpoint and ORACLE_ATTENTION are outside __all__ but importable from here, as they were
# from the single module this package replaced.
from offgraph_export.frontends.hf.attention import ATTENTION_NAME, refusals
from offgraph_export.frontends.hf.bundle import OffgraphCausalLM, load_hf_bundle, wrap_model
from offgraph_export.frontends.hf.checkpoint import HFCheckpoint, load_hf_model
from offgraph_export.frontends.hf.oracle import ORACLE_ATTENTION, TransformersOracle

__all__ = [
    "ATTENTION_NAME",
    "OffgraphCausalLM",
    "TransformersOracle",
    "load_hf_bundle",
    "load_hf_model",
    "refusals",
    "wrap_model",
]
