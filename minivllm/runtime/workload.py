"""The benchmark workloads, and the memory traffic that bounds them.

`throughput_workload` is nano-vllm's bench.py workload exactly: `random.seed(0)`, 256 prompts of
ids `randint(0, 10000)` with lengths `randint(100, 1024)` drawn first, then one
`max_tokens = randint(100, 1024)` per sequence (142,827 prompt and 133,966 output tokens).
"""

from __future__ import annotations

import bisect
import math
import random

import attrs

from ..state.config import ModelConfig
from ..state.params import (AWQ_FIELDS, RANDOM_AWQ_GROUP, RANDOM_FP8_BLOCK, RANDOM_QUANTIZATIONS,
                            MoELayerParams, expected_shapes, layer_class)
from ..state.shard import ShardSpec


MIN_LEN = 100  # nano-vllm's least prompt and output length
MAX_PROMPT_ID = 10000  # nano-vllm's prompt ids: randint(0, MAX_PROMPT_ID)
EXPERT_FIELDS = ("experts_gate_up", "experts_down")  # a sparse layer's weights read by routing


def check_throughput_workload(num_seqs: int, max_input_len: int, max_output_len: int) -> None:
    """ValueError, naming the argument, where throughput_workload could not draw the workload
    (bench calls it before starting an engine)."""
    if num_seqs < 1:
        raise ValueError(f"the throughput workload needs at least one sequence, got num_seqs "
                         f"{num_seqs}")
    for name, value in (("max_input_len", max_input_len), ("max_output_len", max_output_len)):
        if value < MIN_LEN:
            raise ValueError(f"{name} must be at least {MIN_LEN} (the workload draws lengths "
                             f"from randint({MIN_LEN}, {name}), as nano-vllm's does), got {value}")


def check_vocabulary(vocab_size: int) -> None:
    """ValueError unless a model of `vocab_size` ids can take the workload's prompt ids."""
    if vocab_size <= MAX_PROMPT_ID:
        raise ValueError(f"the throughput workload's prompt ids go up to {MAX_PROMPT_ID} (as "
                         f"nano-vllm's do); this model's vocabulary has {vocab_size}")


def throughput_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                        seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, max_tokens per sequence), drawn in nano-vllm's order."""
    check_throughput_workload(num_seqs, max_input_len, max_output_len)
    rng = random.Random(seed)
    prompts = [[rng.randint(0, MAX_PROMPT_ID) for _ in range(rng.randint(MIN_LEN, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(MIN_LEN, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def quantized_linear_bytes(quantization: str, out_features: int, in_features: int) -> int:
    """Bytes of an [out, in] linear as random_params(quantization=...) holds it (the layout of a
    Qwen3 AWQ or block-fp8 checkpoint's): "awq" half a byte a weight, plus int32-packed 4-bit
    zero points and fp16 scales per group of RANDOM_AWQ_GROUP inputs; "fp8" a byte a weight plus
    a float32 scale per RANDOM_FP8_BLOCK block."""
    if quantization == "awq":
        groups = in_features // RANDOM_AWQ_GROUP
        # qweight: 8 4-bit values an int32; qzeros the same per group; scales fp16 per group
        return (in_features * out_features // 2 + groups * out_features // 2
                + groups * out_features * 2)
    if quantization == "fp8":
        bn, bk = RANDOM_FP8_BLOCK
        scales = math.ceil(out_features / bn) * math.ceil(in_features / bk)
        return out_features * in_features + 4 * scales
    raise ValueError(f"quantization {quantization!r} is not one of {RANDOM_QUANTIZATIONS}")


def weight_bytes(config: ModelConfig, dtype_bytes: int = 2, shard: ShardSpec | None = None,
                 quantization: str | None = None) -> int:
    """Bytes of the weights on one rank of `shard` (default: the whole model) that a decode step
    may read: all but the embedding, of which a step gathers only a few rows (a tied head reads
    it as the head); every expert of a sparse layer (expert_bytes: the part a step's routing
    picks from). quantization "awq" or "fp8": the decoder linears (qkv, o_proj, gate_up, down)
    count as random_params(quantization=...) holds them (quantized_linear_bytes); the rest in
    the model's dtype."""
    shapes = expected_shapes(config, shard or ShardSpec())
    linears = set(AWQ_FIELDS) if quantization is not None else set()
    total = dtype_bytes * (math.prod(shapes["lm_head"]) + math.prod(shapes["final_norm"]))
    for n in range(config.num_layers):
        for name in attrs.fields_dict(layer_class(config, n)):
            total += (quantized_linear_bytes(quantization, *shapes[name]) if name in linears
                      else dtype_bytes * math.prod(shapes[name]))
    return total


def expert_bytes(config: ModelConfig, dtype_bytes: int = 2, shard: ShardSpec | None = None) -> int:
    """Bytes of all the sparse layers' experts on one rank of `shard` (0 for a dense model)."""
    shapes = expected_shapes(config, shard or ShardSpec())
    per_layer = dtype_bytes * sum(math.prod(shapes[name]) for name in EXPERT_FIELDS)
    return per_layer * len(config.sparse_layers)


def expert_share_read(config: ModelConfig, tokens: int) -> float:
    """The expected share of a sparse layer's experts that `tokens` tokens route to, each to
    num_experts_per_tok distinct ones of num_experts, uniformly and independently (as random
    weights route, near enough; a trained router's preferences read fewer): 1 - (1 - k/E)^T."""
    k, e = config.num_experts_per_tok, config.num_experts
    return 1.0 - (1.0 - k / e) ** tokens


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2, shard: ShardSpec | None = None) -> int:
    """K and V of one position over all layers, as one rank of `shard` stores them."""
    kv_heads = (shard or ShardSpec()).num_kv_heads(config)
    return dtype_bytes * 2 * config.num_layers * kv_heads * config.head_dim


def held_weight_bytes(params) -> int:
    """Bytes of weights one decode step of `params` (a state.params.Params, one rank's shard)
    reads, counted from the tensors it holds: the decoder layers, the final norm and the head
    (the embedding when tied), whatever form a checkpoint's linears load in (dense, AWQ packed,
    block fp8); not the embedding's other rows, nor LoRA slots. For random weights it equals
    weight_bytes (tests/test_bench_quantization.py)."""
    import torch.utils._pytree as pytree

    leaves = pytree.tree_leaves((params.layers, params.final_norm, params.head_weight))
    return sum(t.numel() * t.element_size() for t in leaves)


def held_expert_bytes(params) -> int:
    """The sparse layers' experts' part of held_weight_bytes(params)."""
    return sum(getattr(layer, name).numel() * getattr(layer, name).element_size()
               for layer in params.layers if isinstance(layer, MoELayerParams)
               for name in EXPERT_FIELDS)


def traffic_floor_bytes(config: ModelConfig, prompt_lens: list[int], max_tokens: list[int],
                        dtype_bytes: int = 2, tensor_parallel_size: int = 1,
                        kv_dtype_bytes: int | None = None,
                        quantization: str | None = None,
                        step_weight_bytes: int | None = None,
                        step_expert_bytes: int | None = None) -> dict[str, float]:
    """The bytes a perfect engine must move for the decode of this workload, per GPU: every
    output token reads its sequence's whole KV context once, and every decode step reads the
    weights once (at least max(max_tokens) steps, since each sequence decodes one token a step),
    a sparse layer's experts only in the share its step's tokens route to (expert_share_read
    of the sequences still decoding at that step: a single stream reads num_experts_per_tok).
    At tensor_parallel_size N every GPU reads its own shard, all at once: the floor is one
    rank's bytes (rank 0's; KV heads past their count are replicated, norms always are).
    dtype_bytes: the weights' element size; kv_dtype_bytes: the cache's (default the same);
    quantization: "awq" or "fp8" for random_params' quantized linears (weight_bytes);
    step_weight_bytes, step_expert_bytes: all the weights' bytes and the experts' part of them
    as counted from the params held (held_weight_bytes, held_expert_bytes), in place of
    weight_bytes' and expert_bytes' counts from the config."""
    shard = ShardSpec(rank=0, world_size=tensor_parallel_size)
    per_token = kv_bytes_per_token(config, kv_dtype_bytes or dtype_bytes, shard)
    kv = 0
    for p, n in zip(prompt_lens, max_tokens):
        # the j-th output token (j = 0 .. n-1) is computed over a context of p + j tokens
        kv += per_token * (n * p + n * (n - 1) // 2)
    if step_weight_bytes is None:
        step_weight_bytes = weight_bytes(config, dtype_bytes, shard, quantization)
    if step_expert_bytes is None:
        step_expert_bytes = expert_bytes(config, dtype_bytes, shard)
    steps = max(max_tokens)
    weights = (step_weight_bytes - step_expert_bytes) * steps
    if step_expert_bytes:
        ends = sorted(max_tokens)  # step j decodes the sequences whose max_tokens exceed j
        weights += step_expert_bytes * sum(
            expert_share_read(config, len(ends) - bisect.bisect_right(ends, j))
            for j in range(steps))
    return {"kv_bytes": float(kv), "weight_bytes": float(weights), "total_bytes": float(kv + weights)}
