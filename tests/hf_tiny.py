"""Tiny random Qwen3 checkpoints written by transformers: the numerical oracle for the tests."""

from __future__ import annotations

import json
import os

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

# Where minivllm runs in the tests: the GPU when there is one (the suite's GPU run), else the CPU.
# transformers, the oracle, always runs on the CPU in fp32.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_config(**overrides) -> Qwen3Config:
    kwargs = dict(TINY)
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def make_hf_model(seed: int = 0, std: float = 0.1, **overrides) -> Qwen3ForCausalLM:
    """A tiny fp32 Qwen3ForCausalLM with random weights. `std` sets the linear weights' scale:
    large enough (~0.1 at hidden 64) that greedy outputs vary from token to token."""
    torch.manual_seed(seed)
    return draw_weights(Qwen3ForCausalLM(hf_config(**overrides)).float().eval(), std)


def draw_weights(model, std: float):
    """`model` with every weight drawn from N(0, std), its norms' from N(1, 0.1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return model


# A Qwen3-MoE of 8 experts, 2 per token, every layer sparse unless mlp_only_layers says otherwise.
MOE_TINY = dict(TINY, num_hidden_layers=3, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True)


def make_hf_moe_model(seed: int = 0, std: float = 0.1, **overrides) -> Qwen3MoeForCausalLM:
    """make_hf_model's Qwen3MoeForCausalLM: every weight drawn (router and experts too), norms
    near 1. Its experts run transformers' eager loop (expert by expert, index_add_ of each
    one's rows), not its default grouped_mm path, which is minivllm's own algorithm (sort by
    expert, torch._grouped_mm): an oracle must not share the code's method."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**dict(MOE_TINY, **overrides))
    config._experts_implementation = "eager"
    return draw_weights(Qwen3MoeForCausalLM(config).float().eval(), std)


def contiguous_tables(prompts, block_size: int, extra: int = 0) -> tuple[list[list[int]], int]:
    """Block tables for `prompts` laid out one after another (each with room for `extra` more
    tokens), and the blocks they take."""
    tables, start = [], 0
    for p in prompts:
        n = -(-(len(p) + extra) // block_size)
        tables.append(list(range(start, start + n)))
        start += n
    return tables, start


def save_checkpoint(model: Qwen3ForCausalLM, path, *, layout: str = "v5", max_shard_size=None) -> str:
    """Write `model` as a HF checkpoint. layout "v4" rewrites config.json the way transformers 4
    (and real Qwen3 checkpoints) write it: top-level rope_theta / rope_scaling and torch_dtype,
    and a MoE's num_experts where transformers 5 writes num_local_experts."""
    path = os.fspath(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if layout == "v4":
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            d = json.load(f)
        rope = dict(d.pop("rope_parameters", None) or {})
        d["rope_theta"] = rope.pop("rope_theta", 10000.0)
        if rope.get("rope_type", "default") != "default":
            d["rope_scaling"] = rope
        d["torch_dtype"] = d.pop("dtype", None) or "float32"
        if "num_local_experts" in d:
            d["num_experts"] = d.pop("num_local_experts")
        with open(cfg_path, "w") as f:
            json.dump(d, f)
    return path


def hf_greedy(model, prompt, n: int) -> list[int]:
    """transformers' n greedy tokens after `prompt`, the whole sequence recomputed every step
    (no cache of its own: the oracle shares nothing with the engine's paths)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].float().argmax()))
    return ids[len(prompt):]
