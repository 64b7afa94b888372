"""The whole model against transformers' Qwen3ForCausalLM: prefill and decode logits, greedy
generation, paged layouts, gradients and compilation."""

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings, strategies as st
from transformers import DynamicCache

import minivllm
from minivllm.state import SeqChunk, make_batch
from hf_tiny import DEVICE, contiguous_tables, make_hf_model, save_checkpoint

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 10000.0}

CONFIGS = {
    "gqa1-untied-v5": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa2-tied-v4": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa4-headdim24-v5": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24),
    "gqa2-llama3-v4": dict(rope_parameters=LLAMA3),
    "gqa4-llama3-tied-headdim12-v5": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12,
                                          rope_parameters=LLAMA3, tie_word_embeddings=True),
}

PROMPTS = [[3, 17, 25, 4, 99, 60, 12, 8, 41], [7, 1, 55], [90, 34, 2, 2, 18, 76, 43, 21, 9, 10, 64, 5,
           30, 31, 77, 50, 19, 88, 6, 14, 23, 45, 67, 81, 11, 39, 57, 100, 0, 36, 48]]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, minivllm params loaded from its checkpoint)."""
    name = request.param
    model = make_hf_model(seed=len(name), std=0.3, **CONFIGS[name])
    path = save_checkpoint(model, tmp_path_factory.mktemp(name), layout=name.rsplit("-", 1)[1])
    return model, minivllm.load(path, device=DEVICE)


def test_prefill_logits_equal_transformers(pair):
    model, params = pair
    tables, n = contiguous_tables(PROMPTS, 4)
    cache = minivllm.init_cache(params, num_blocks=n, block_size=4)
    batch = make_batch([SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)], block_size=4,
                       device=DEVICE, every_row=True)
    logits, cache = minivllm.forward(params, cache, batch)
    logits = logits.cpu()
    with torch.no_grad():
        expected = torch.cat([model(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert (logits - expected).abs().max().item() <= 1e-4


def test_prefill_returns_only_last_rows(pair):
    model, params = pair
    tables, n = contiguous_tables(PROMPTS, 8)
    cache = minivllm.init_cache(params, num_blocks=n, block_size=8)
    logits, _ = minivllm.forward(params, cache, make_batch([SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)],
                                                           block_size=8, device=DEVICE))
    logits = logits.cpu()
    assert logits.shape == (len(PROMPTS), params.config.vocab_size)
    with torch.no_grad():
        expected = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    assert (logits - expected).abs().max().item() <= 1e-4


def test_every_decode_step_equals_transformers_with_cache(pair):
    model, params = pair
    steps, bs = 6, 4
    tables, n = contiguous_tables(PROMPTS, bs, extra=steps)
    cache = minivllm.init_cache(params, num_blocks=n, block_size=bs)
    logits, cache = minivllm.forward(params, cache, make_batch(
        [SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)], block_size=bs, device=DEVICE))
    hf_caches, hf_logits = [], []
    with torch.no_grad():
        for p in PROMPTS:
            out = model(torch.tensor([p]), past_key_values=DynamicCache(config=model.config), use_cache=True)
            hf_caches.append(out.past_key_values)
            hf_logits.append(out.logits[0, -1])
    lengths = [len(p) for p in PROMPTS]
    for step in range(steps):
        next_ids = logits.argmax(-1).tolist()
        # feed transformers the same tokens (ours), so both see identical histories
        with torch.no_grad():
            expected = []
            for i, tok in enumerate(next_ids):
                out = model(torch.tensor([[tok]]), past_key_values=hf_caches[i], use_cache=True)
                hf_caches[i] = out.past_key_values
                expected.append(out.logits[0, -1])
        batch = make_batch([SeqChunk([tok], lengths[i], tables[i]) for i, tok in enumerate(next_ids)],
                           block_size=bs, device=DEVICE)
        assert batch.is_decode
        logits, cache = minivllm.forward(params, cache, batch)
        lengths = [n + 1 for n in lengths]
        assert (logits.cpu() - torch.stack(expected)).abs().max().item() <= 1e-4, f"step {step}"


def test_generate_greedy_equals_transformers(pair):
    model, params = pair
    cache = minivllm.init_cache(params, num_blocks=64, block_size=4)
    ours, cache = minivllm.generate(params, cache, PROMPTS, max_new_tokens=40)
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # (an explicit mask: prompt 3 holds id 0, the pad id)
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref
        assert len(set(got)) > 5, "weights too small: outputs do not vary"


@settings(max_examples=10)
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 2, 4, 8]))
def test_paged_cache_equals_contiguous(seed, block_size):
    """Prefill in two chunks then decode, with blocks scattered at random over a larger cache:
    the logits equal those with each sequence's blocks laid out contiguously."""
    params = _shared_params()
    gen = torch.Generator().manual_seed(seed)
    prompts = [PROMPTS[0], PROMPTS[2][:13]]
    steps = 3
    need = [-(-(len(p) + steps) // block_size) for p in prompts]
    contiguous = [list(range(sum(need[:i]), sum(need[: i + 1]))) for i in range(len(need))]
    perm = torch.randperm(2 * sum(need), generator=gen).tolist()
    scattered = [perm[sum(need[:i]): sum(need[: i + 1])] for i in range(len(need))]
    results = []
    for tables, num_blocks in ((contiguous, sum(need)), (scattered, 2 * sum(need))):
        cache = minivllm.init_cache(params, num_blocks=num_blocks, block_size=block_size)
        split = [len(p) // 2 for p in prompts]
        _, cache = minivllm.forward(params, cache, make_batch(
            [SeqChunk(p[:s], 0, t) for p, s, t in zip(prompts, split, tables)], block_size=block_size, device=DEVICE))
        logits, cache = minivllm.forward(params, cache, make_batch(
            [SeqChunk(p[s:], s, t) for p, s, t in zip(prompts, split, tables)], block_size=block_size, device=DEVICE))
        out = [logits]
        lengths = [len(p) for p in prompts]
        for _ in range(steps):
            toks = logits.argmax(-1).tolist()
            logits, cache = minivllm.forward(params, cache, make_batch(
                [SeqChunk([t], n, tab) for t, n, tab in zip(toks, lengths, tables)], block_size=block_size, device=DEVICE))
            lengths = [n + 1 for n in lengths]
            out.append(logits)
        results.append(torch.cat(out))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


_PARAMS = {}


def _shared_params():
    if "p" not in _PARAMS:
        _PARAMS["p"] = minivllm.random_params(minivllm.ModelConfig(
            vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, dtype=torch.float32), seed=5, std=0.1, device=DEVICE)
    return _PARAMS["p"]


def _hf_grads_as_params(model, params):
    """transformers' parameter gradients laid out as a minivllm Params pytree."""
    g = {n: p.grad for n, p in model.named_parameters()}
    layers = []
    for i, lp in enumerate(params.layers):
        p = f"model.layers.{i}."
        layers.append(type(lp)(
            input_norm=g[p + "input_layernorm.weight"],
            qkv=torch.cat([g[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            q_norm=g[p + "self_attn.q_norm.weight"], k_norm=g[p + "self_attn.k_norm.weight"],
            o_proj=g[p + "self_attn.o_proj.weight"], post_norm=g[p + "post_attention_layernorm.weight"],
            gate_up=torch.cat([g[p + "mlp.gate_proj.weight"], g[p + "mlp.up_proj.weight"]]),
            down=g[p + "mlp.down_proj.weight"]))
    return type(params)(embed=g["model.embed_tokens.weight"], layers=tuple(layers),
                        final_norm=g["model.norm.weight"],
                        lm_head=None if params.lm_head is None else g["lm_head.weight"],
                        config=params.config, shard=params.shard)


def test_grad_of_prefill_loss_equals_transformers_autograd(pair):
    model, params = pair
    prompts = PROMPTS[:2]
    tables, n = contiguous_tables(prompts, 4)
    batch = make_batch([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], block_size=4,
                       device=DEVICE, every_row=True)
    targets = torch.tensor(sum((p[1:] + [p[0]] for p in prompts), []), device=DEVICE)

    def loss(p):
        cache = minivllm.init_cache(p, num_blocks=n, block_size=4)
        logits, _ = minivllm.forward(p, cache, batch)
        return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")

    grads = torch.func.grad(loss)(params)
    model.zero_grad()
    total = 0
    for p in prompts:
        logits = model(torch.tensor([p])).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits, torch.tensor(p[1:] + [p[0]]), reduction="sum")
    total.backward()
    expected = _hf_grads_as_params(model, params)
    for (path, got), want in zip(pytree.tree_flatten_with_path(grads)[0], pytree.tree_leaves(expected)):
        assert got.shape == want.shape, path
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{path}: {m}")


def test_compiled_forward_equals_eager():
    params = _shared_params()
    compiled = torch.compile(minivllm.forward, fullgraph=True)
    tables, n = contiguous_tables(PROMPTS, 4, extra=2)
    caches = [minivllm.init_cache(params, num_blocks=n, block_size=4) for _ in range(2)]
    prefill = make_batch([SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)], block_size=4, device=DEVICE)
    eager_logits, caches[0] = minivllm.forward(params, caches[0], prefill)
    comp_logits, caches[1] = compiled(params, caches[1], prefill)
    torch.testing.assert_close(comp_logits, eager_logits, rtol=1e-5, atol=1e-5)
    decode = make_batch([SeqChunk([t], len(p), tab) for t, p, tab in
                         zip(eager_logits.argmax(-1).tolist(), PROMPTS, tables)], block_size=4, device=DEVICE)
    eager_logits, caches[0] = minivllm.forward(params, caches[0], decode)
    comp_logits, caches[1] = compiled(params, caches[1], decode)
    torch.testing.assert_close(comp_logits, eager_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(pytree.tree_leaves(caches[0]), pytree.tree_leaves(caches[1])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
