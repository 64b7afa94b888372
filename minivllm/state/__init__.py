"""Immutable pytrees: what the model is (config, params) and what it remembers (KV cache)."""

from .batch import Batch, DecodeChunks, SeqChunk, make_batch
from .cache import KVCache, check_cache_fits, init_cache
from .config import SHAPES, ModelConfig, config_for_shape, parse_dtype, parse_kv_cache_dtype
from .params import LayerParams, MoELayerParams, Params, check_params, expected_shapes, random_params
from .shard import ShardSpec

__all__ = ["Batch", "DecodeChunks", "SeqChunk", "make_batch", "KVCache", "check_cache_fits", "init_cache", "SHAPES",
           "ModelConfig", "config_for_shape", "parse_dtype", "parse_kv_cache_dtype", "LayerParams",
           "MoELayerParams", "Params", "check_params", "expected_shapes", "random_params", "ShardSpec"]
