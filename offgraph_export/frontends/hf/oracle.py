"""The oracle of ``check`` for ``hf:`` models: transformers itself.

The same weights (the same module objects) run by transformers' own eager attention over its own
``DynamicCache``, so an ``hf:`` artifact is checked against the library's math and cache rather
than against a second implementation of ours.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from offgraph_export.frontends.hf.attention import text_config, using_attention
from offgraph_export.reference.oracle import HeldRows

__all__ = ["ORACLE_ATTENTION", "TransformersOracle"]

#: The attention implementation the oracle runs: transformers' plain eager math.
ORACLE_ATTENTION = "eager"


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
        #: transformers caches multi-head latent attention's compressed latent (DeepSeek-V2/V3,
        #: MiniCPM3: a ``kv_lora_rank`` config), not the per-head K/V its attention receives and
        #: the artifact stores: ``check`` then compares outputs, not stored rows
        self.caches_other_form = getattr(text_config(hf_model.config), "kv_lora_rank", None) is not None

    def step(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, position = inputs
        with using_attention(self.model, ORACLE_ATTENTION):
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
