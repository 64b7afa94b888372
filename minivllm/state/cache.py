"""KVCache: the paged key/value cache as an immutable pytree of donated buffers.

Per layer, K and V are `[num_blocks, block_size, num_kv_heads, head_dim]`. Token slot `s` is
block `s // block_size`, offset `s % block_size`.

Donation contract (as with JAX's donated buffers): a forward call writes the new tokens' K/V into
these buffers *in place* and returns the cache. The caller hands its cache in and must use the one
that comes back; the one handed in must be treated as consumed. Copying the cache each step is not
an option: it is gigabytes.
"""

from __future__ import annotations

import torch

from .config import FP8_DTYPES, parse_kv_cache_dtype
from .params import Params
from .pytree import pytree_class


@pytree_class
class KVCache:
    k: tuple  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    v: tuple

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device


def cache_shape(params: Params, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    config = params.config
    return (num_blocks, block_size, params.shard.num_kv_heads(config), config.head_dim)


def init_cache(params: Params, *, num_blocks: int, block_size: int = 16, dtype=None,
               device=None) -> KVCache:
    """An empty (zeroed) paged cache fitting `params`: `num_blocks` blocks of `block_size` tokens.
    dtype: the params' (None, "auto"), another float dtype, or "fp8" (see parse_kv_cache_dtype)."""
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    dtype = parse_kv_cache_dtype(dtype, params.dtype)
    device = params.device if device is None else torch.device(device)
    shape = cache_shape(params, num_blocks, block_size)
    layers = params.config.num_layers
    k = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers))
    v = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers))
    return KVCache(k=k, v=v)


def check_cache_fits(params: Params, cache: KVCache, *, whole: bool = True) -> None:
    """TypeError/ValueError naming the mismatch when `cache` was not made for `params`.
    whole=False checks only what a step can check for free (~2 us, against ~50 for every layer
    at 28): the layer count and layer 0's shape and device, not the dtype (init_cache makes
    caches of other float dtypes, which forward computes with; generate takes the params'
    dtype or fp8)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
    if cache.num_layers != params.config.num_layers or len(cache.v) != cache.num_layers:
        raise ValueError(f"cache has {cache.num_layers} layers, the model has {params.config.num_layers}")
    expected = cache_shape(params, cache.num_blocks, cache.block_size)
    for name, tensors in (("k", cache.k), ("v", cache.v)):
        for i, t in enumerate(tensors if whole else tensors[:1]):
            if tuple(t.shape) != expected:
                raise ValueError(f"cache.{name}[{i}] has shape {tuple(t.shape)}, expected {expected} "
                                 f"(num_blocks, block_size, num_kv_heads, head_dim)")
            if whole and t.dtype != params.dtype and t.dtype not in FP8_DTYPES:
                raise ValueError(f"cache.{name}[{i}] dtype {t.dtype} differs from the params' {params.dtype} "
                                 f"(a cache is in the params' dtype or in fp8)")
            if t.device != params.device:
                raise ValueError(f"cache.{name}[{i}] is on {t.device}, the params on {params.device}")
    if whole:
        _check_no_shared_memory(cache)


def _check_no_shared_memory(cache: KVCache) -> None:
    """ValueError when two of the cache's buffers overlap in memory (say, every layer given the
    same tensor): each layer's writes would overwrite another's K/V and every later token would
    be silently wrong. Not in forward's per-step check, since data_ptr breaks a fullgraph
    compile; generate checks once (the engine makes its own cache)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), f"cache.{name}[{i}]")
                   for name, tensors in (("k", cache.k), ("v", cache.v))
                   for i, t in enumerate(tensors))
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{first} and {second} share memory; each layer's K and V need "
                             f"buffers of their own (init_cache makes them)")
