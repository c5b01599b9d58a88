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

import itertools
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import nn

from offgraph_export.errors import ExportError

__all__ = ["NORMAL_CHUNK", "seeded_random_model"]

#: values per independently seeded chunk of a normal draw; tensors below two chunks are drawn whole
NORMAL_CHUNK = 1 << 22


def seeded_random_model(config: object, dtype: torch.dtype, seed: int, workers: int | None = None) -> nn.Module:
    """The causal LM of ``config`` in ``dtype``, its weights drawn from ``seed`` once, on
    ``workers`` threads (default: the cores, at most 16; the weights do not depend on it). Every
    floating parameter starts as NaN, so one the model's initialization leaves unset is refused by
    name rather than left holding whatever memory held."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    torch.manual_seed(seed)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.fill_(float("nan"))
    with _chunked_normal(workers or min(16, os.cpu_count() or 1)):
        model.init_weights()
    unset = [name for name, param in model.named_parameters() if param.is_floating_point() and bool(param.isnan().any())]
    if unset:
        raise ExportError(
            f"{type(model).__name__}'s own initialization leaves {unset[0]} unset, so a config alone cannot give "
            "it seeded random weights; export a checkpoint that holds its weights"
        )
    return model


@contextmanager
def _chunked_normal(workers: int) -> Iterator[None]:
    """While open, transformers' initialization draws each large contiguous normal tensor in
    :data:`NORMAL_CHUNK` chunks on ``workers`` threads (torch releases the GIL inside ``normal_``).
    Chunk ``k`` of the whole model (counted across its tensors in the order they are drawn) gets a
    generator seeded ``(base + k) mod 2**32``, ``base`` one draw of the seeded global generator:
    seeds distinct across the model (a CPU generator takes 32 bits). A draw given its own
    generator, a strided tensor or a small one goes to torch's as before."""
    from transformers import initialization

    table = getattr(initialization, "TORCH_INIT_FUNCTIONS", None)
    if not isinstance(table, dict) or "normal_" not in table:  # a transformers without the hook
        yield
        return
    whole = table["normal_"]
    base = int(torch.randint(0, 1 << 32, (1,)))
    counter = itertools.count()

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="offgraph-init") as pool:

        def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
            if generator is not None or not tensor.is_contiguous() or tensor.numel() < 2 * NORMAL_CHUNK:
                return whole(tensor, mean=mean, std=std, generator=generator)
            flat = tensor.detach().view(-1)
            chunks = [(index, (base + next(counter)) % (1 << 32)) for index in range(math.ceil(flat.numel() / NORMAL_CHUNK))]

            def fill(chunk: tuple[int, int]) -> None:
                index, seed = chunk
                part = flat[index * NORMAL_CHUNK:(index + 1) * NORMAL_CHUNK]
                part.normal_(mean, std, generator=torch.Generator().manual_seed(seed))

            list(pool.map(fill, chunks))
            return tensor

        table["normal_"] = normal_
        try:
            yield
        finally:
            table["normal_"] = whole
