"""What export, check and run need from a model: :class:`ModelBundle`, the type every model
source (:mod:`offgraph_export.frontends`) produces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import get_args

import torch

from offgraph_export.errors import OffgraphError
from offgraph_export.reference.oracle import Oracle, ReferenceOracle
from offgraph_export.specs.cache_config import CacheConfig
from offgraph_export.specs.manifest import CacheManifest, StorageDtype

__all__ = ["ModelBundle", "cast_bundle", "model_dtype"]


def model_dtype(name: object, error: type[OffgraphError] = OffgraphError) -> torch.dtype:
    """The torch dtype a model may be exported in (the storage dtypes the manifest allows), or
    ``error`` naming the value."""
    allowed = get_args(StorageDtype)
    if not isinstance(name, str) or name not in allowed:
        raise error(f"dtype {name!r} is not one a model is exported in ({', '.join(allowed)})")
    return getattr(torch, name)


@dataclass
class ModelBundle:
    """Everything export, check and run need from a model.

    ``token_dims[i]`` names the dim of ``example_inputs[i]`` that grows with the step's token
    count (``None`` for inputs of fixed shape). ``make_inputs(token_ids [B,T], start)`` builds a
    step's inputs for tokens that start at absolute position ``start``. ``make_oracle(manifest)``
    returns the eager oracle ``check`` compares against; without it the oracle is ``model`` itself
    over reference caches (:class:`~offgraph_export.reference.oracle.ReferenceOracle`).
    """

    model: torch.nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    token_dims: tuple[int | None, ...]
    cache_config: CacheConfig
    make_inputs: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]
    vocab_size: int
    encode: Callable[[str], list[int]] | None = None
    decode: Callable[[list[int]], str] | None = None
    make_oracle: Callable[[CacheManifest], Oracle] | None = None

    def __post_init__(self) -> None:
        """What a factory returns is user code: its fields are checked here, each refusal naming
        the field, rather than failing deep inside export."""
        if not isinstance(self.model, torch.nn.Module):
            raise OffgraphError(f"ModelBundle.model is a {type(self.model).__name__}, not a torch.nn.Module")
        if not isinstance(self.cache_config, CacheConfig):
            raise OffgraphError(f"ModelBundle.cache_config is a {type(self.cache_config).__name__}, not a CacheConfig")
        if not all(isinstance(x, torch.Tensor) for x in self.example_inputs):
            kinds = [type(x).__name__ for x in self.example_inputs]
            raise OffgraphError(f"ModelBundle.example_inputs must all be tensors, got {kinds}")
        if len(self.token_dims) != len(self.example_inputs):
            raise OffgraphError(
                f"token_dims has {len(self.token_dims)} entries but there are "
                f"{len(self.example_inputs)} example inputs"
            )
        for i, (x, d) in enumerate(zip(self.example_inputs, self.token_dims)):
            if d is not None and (type(d) is not int or not 0 <= d < x.dim()):
                raise OffgraphError(f"token_dims[{i}] = {d!r} is not a dim of example input {i} (rank {x.dim()})")
        if all(d is None for d in self.token_dims):
            raise OffgraphError("token_dims names no input dim that carries the step's tokens")
        if type(self.vocab_size) is not int or self.vocab_size < 1:
            raise OffgraphError(f"ModelBundle.vocab_size must be a positive int, got {self.vocab_size!r}")

    def oracle(self, manifest: CacheManifest) -> Oracle:
        if self.make_oracle is not None:
            return self.make_oracle(manifest)
        return ReferenceOracle(self.model, manifest)


def cast_bundle(bundle: ModelBundle, dtype: str | None) -> ModelBundle:
    """A bundle whose model computes in ``dtype`` and stores its cache in it too. The bundle
    given is left as it was, but its module is cast in place (``nn.Module.to``): copying the
    weights first would double a large model's memory."""
    if dtype is None:
        return bundle
    torch_dtype = model_dtype(dtype)
    cache_config = bundle.cache_config.with_overrides(storage_dtype=dtype)  # refused before any cast
    return replace(bundle, model=bundle.model.to(torch_dtype), cache_config=cache_config)
