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


MOE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, dtype=torch.float32, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, sparse_layers=(0, 2))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_mixture_of_experts_floor_reads_the_experts_its_tokens_route_to(world_size):
    """The bytes a MoE rank holds, counted from the config as from the params (a dense layer's
    MLP, two sparse layers' router and experts); a single stream's steps read each sparse
    layer's top-k experts of E, and many sequences' steps nearly all of them."""
    from minivllm.runtime.workload import (expert_bytes, held_expert_bytes, held_weight_bytes,
                                           weight_bytes)

    shard = ShardSpec(rank=0, world_size=world_size)
    params = minivllm.random_params(MOE, seed=0, shard=shard)
    held, experts = held_weight_bytes(params), held_expert_bytes(params)
    assert weight_bytes(MOE, 4, shard) == held
    assert expert_bytes(MOE, 4, shard) == experts
    leaves = torch.utils._pytree.tree_leaves
    assert experts == sum(4 * t.numel() for n in MOE.sparse_layers
                          for t in leaves((params.layers[n].experts_gate_up,
                                           params.layers[n].experts_down)))
    one = traffic_floor_bytes(MOE, [5], [6], dtype_bytes=4, tensor_parallel_size=world_size)
    assert one["weight_bytes"] == pytest.approx(6 * (held - experts + experts * 2 / 8))
    many = traffic_floor_bytes(MOE, [5] * 64, [6] * 64, dtype_bytes=4,
                               tensor_parallel_size=world_size)
    assert 6 * held * 0.99 < many["weight_bytes"] <= 6 * held
    # sequences that stop early leave later steps fewer tokens, so fewer experts to read
    tail = traffic_floor_bytes(MOE, [5] * 64, [1] * 63 + [6], dtype_bytes=4,
                               tensor_parallel_size=world_size)
    assert tail["weight_bytes"] == pytest.approx(
        held + 5 * (held - experts + experts * 2 / 8))


def test_expert_share_read_is_the_chance_an_expert_is_routed_to():
    """Against a simulation: tokens each pick k distinct experts of E at random."""
    from minivllm.runtime.workload import expert_share_read

    g = torch.Generator().manual_seed(0)
    trials, e, k = 20_000, MOE.num_experts, MOE.num_experts_per_tok
    for tokens in (1, 3, 10):
        picks = torch.rand(trials, tokens, e, generator=g).topk(k, dim=-1).indices
        hit = torch.zeros(trials, e, dtype=torch.bool)
        hit.scatter_(1, picks.reshape(trials, -1), True)
        assert hit.float().mean().item() == pytest.approx(expert_share_read(MOE, tokens),
                                                          abs=5e-3)
