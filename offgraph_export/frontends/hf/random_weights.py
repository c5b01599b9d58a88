"""Seeded random weights for a transformers config alone (a directory holding ``config.json`` and
no weights), drawn once and on every core.

transformers builds a model from a config by making each layer (torch draws its default
initialization) and then drawing the model's own (``init_weights``): every weight drawn twice, the
first draw thrown away, each on one core. For the Llama-3.1-8B shape that was 111 s of a 494 s export
on the GPU machine's host. Here the model is built under transformers' ``no_init_weights`` and
``init_weights`` runs once, its normal draws of large tensors split into fixed chunks that threads
fill at once, each chunk from a generator seeded from one draw of the global generator: the same
weights for the same seed whatever the number of cores, with the distributions the model's own
initialization asks for (norms still ones, biases still zeros).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["NORMAL_CHUNK", "seeded_random_model"]

#: values per independently seeded chunk of a normal draw; tensors below two chunks are drawn whole
NORMAL_CHUNK = 1 << 22


def seeded_random_model(config: object, dtype: torch.dtype, seed: int, workers: int | None = None) -> nn.Module:
    """The causal LM of ``config`` in ``dtype``, its weights drawn from ``seed`` once, on
    ``workers`` threads (default: the cores, at most 16; the weights do not depend on it)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    torch.manual_seed(seed)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    with _chunked_normal(workers or min(16, os.cpu_count() or 1)):
        model.init_weights()
    return model


@contextmanager
def _chunked_normal(workers: int) -> Iterator[None]:
    """While open, transformers' initialization draws each large contiguous normal tensor in
    :data:`NORMAL_CHUNK` chunks on ``workers`` threads (torch releases the GIL inside ``normal_``).
    A draw given its own generator, a strided tensor or a small one goes to torch's as before."""
    from transformers import initialization

    table = getattr(initialization, "TORCH_INIT_FUNCTIONS", None)
    if not isinstance(table, dict) or "normal_" not in table:  # a transformers without the hook
        yield
        return
    whole = table["normal_"]

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="offgraph-init") as pool:

        def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
            if generator is not None or not tensor.is_contiguous() or tensor.numel() < 2 * NORMAL_CHUNK:
                return whole(tensor, mean=mean, std=std, generator=generator)
            base = int(torch.randint(0, 1 << 62, (1,)))  # one draw of the seeded global generator
            flat = tensor.detach().view(-1)

            def fill(index: int) -> None:
                chunk = flat[index * NORMAL_CHUNK:(index + 1) * NORMAL_CHUNK]
                chunk.normal_(mean, std, generator=torch.Generator().manual_seed(base + index))

            list(pool.map(fill, range(math.ceil(flat.numel() / NORMAL_CHUNK))))
            return tensor

        table["normal_"] = normal_
        try:
            yield
        finally:
            table["normal_"] = whole
