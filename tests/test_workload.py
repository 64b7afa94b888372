"""The memory-traffic floor `minivllm bench` reports, against a count made from the parameters a
rank actually holds and the contexts each output token attends over."""

import pytest
import torch

import minivllm
from minivllm.runtime.workload import traffic_floor_bytes
from minivllm.state import ModelConfig, ShardSpec

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, dtype=torch.float32, tie_word_embeddings=True)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_floor_counts_what_each_rank_reads(world_size):
    prompt_lens, max_tokens = [5, 9, 3], [4, 2, 7]
    params = minivllm.random_params(CONFIG, seed=0, shard=ShardSpec(rank=0, world_size=world_size))
    # a decode step reads every weight of the rank except the embedding rows it gathers (a tied
    # head reads the embedding as the head)
    layer_bytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(params.layers))
    step_bytes = (layer_bytes + params.head_weight.numel() * 4 + params.final_norm.numel() * 4)
    kv_heads = max(CONFIG.num_kv_heads // world_size, 1)
    token_bytes = 4 * 2 * CONFIG.num_layers * kv_heads * CONFIG.head_dim  # K and V of one position
    kv_bytes = sum(token_bytes * (p + j) for p, n in zip(prompt_lens, max_tokens) for j in range(n))
    floor = traffic_floor_bytes(CONFIG, prompt_lens, max_tokens, dtype_bytes=4,
                                tensor_parallel_size=world_size)
    assert floor["kv_bytes"] == kv_bytes
    assert floor["weight_bytes"] == pytest.approx(step_bytes * max(max_tokens), rel=1e-12)
