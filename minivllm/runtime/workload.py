"""The benchmark workloads, and the memory traffic that bounds them.

`throughput_workload` is nano-vllm's bench.py workload exactly: `random.seed(0)`, 256 prompts of
ids `randint(0, 10000)` with lengths `randint(100, 1024)` drawn first, then one
`max_tokens = randint(100, 1024)` per sequence (142,827 prompt and 133,966 output tokens).
"""

from __future__ import annotations

import random

from ..state.config import ModelConfig


def throughput_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                        seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, max_tokens per sequence), drawn in nano-vllm's order."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def weight_bytes(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of weights one decode step reads (the tied head reads the embedding once)."""
    h, d, i, v = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    per_layer = (h * (config.num_heads + 2 * config.num_kv_heads) * d + config.num_heads * d * h
                 + 3 * h * i + 2 * h + 2 * d)
    head = v * h  # the LM head; a decode step gathers only a few embedding rows
    return dtype_bytes * (config.num_layers * per_layer + head + h)


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    return dtype_bytes * 2 * config.num_layers * config.num_kv_heads * config.head_dim


def traffic_floor_bytes(config: ModelConfig, prompt_lens: list[int], max_tokens: list[int],
                        dtype_bytes: int = 2) -> dict[str, float]:
    """The bytes a perfect engine must move for the decode of this workload: every output token
    reads its sequence's whole KV context once, and every decode step reads the weights once
    (at least max(max_tokens) steps, since each sequence decodes one token a step)."""
    per_token = kv_bytes_per_token(config, dtype_bytes)
    kv = 0
    for p, n in zip(prompt_lens, max_tokens):
        # the j-th output token (j = 0 .. n-1) is computed over a context of p + j tokens
        kv += per_token * (n * p + n * (n - 1) // 2)
    weights = weight_bytes(config, dtype_bytes) * max(max_tokens)
    return {"kv_bytes": float(kv), "weight_bytes": float(weights), "total_bytes": float(kv + weights)}
