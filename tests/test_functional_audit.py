"""What mutating functional/ let through (session 49): each test fails on its mutant, against
transformers or a first-principles reference."""

import math

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")
import torch
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

import minivllm
from minivllm import functional as fn
from minivllm.functional.layer import attention_half, decoder_layer
from minivllm.functional.linear import row_linear
from minivllm.functional.model import stem
from minivllm.state import ModelConfig, SeqChunk, ShardSpec, make_batch
from hf_tiny import DEVICE, make_hf_model, save_checkpoint

PROMPT = [3, 17, 25, 4, 99, 60, 12, 8, 41, 7, 1, 55]


def _hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def _prefill_logits(params, prompt, block_size=4):
    n = -(-len(prompt) // block_size)
    cache = minivllm.init_cache(params, num_blocks=n, block_size=block_size)
    batch = make_batch([SeqChunk(prompt, 0, list(range(n)))], block_size=block_size, device=DEVICE,
                       every_row=True)
    logits, _ = minivllm.forward(params, cache, batch)
    return logits


def test_a_large_rms_norm_eps_reaches_every_norm(tmp_path):
    """Every tiny checkpoint of the suite says rms_norm_eps 1e-6, where dropping or hard-coding
    the eps changes nothing visible; at 0.5 each norm (input, post-attention, q/k, final)
    depends on it, and the logits still equal transformers'."""
    model = make_hf_model(seed=7, std=0.3, rms_norm_eps=0.5)
    params = minivllm.load(save_checkpoint(model, tmp_path), device=DEVICE)
    assert params.config.rms_norm_eps == 0.5
    logits = _prefill_logits(params, PROMPT).cpu()
    assert (logits - _hf_logits(model, PROMPT)).abs().max().item() <= 1e-4


def test_bf16_forward_gives_fp32_logits_near_transformers_bf16(tmp_path):
    """A bf16 model on the reference backend (the CPU suite otherwise runs fp32 only): every
    activation stays bf16 between the layers (attention's output and the residual stream are
    cast back: fp32 would meet a bf16 weight in the next matmul), the logits come back fp32 as
    forward documents, and they are transformers' bf16 logits within bf16 rounding."""
    model = make_hf_model(seed=4, std=0.3)
    params = minivllm.load(save_checkpoint(model, tmp_path), dtype="bfloat16", device=DEVICE)
    assert params.dtype == torch.bfloat16
    logits = _prefill_logits(params, PROMPT)
    assert logits.dtype == torch.float32
    want = _hf_logits(model.to(torch.bfloat16), PROMPT)
    # fp32 vs bf16 transformers differ by ~0.13 here; a real error is of the logits' scale (~8)
    assert (logits.cpu() - want).abs().max().item() <= 0.25


def test_apply_rope_in_bf16_equals_transformers_bit_for_bit():
    """transformers casts cos / sin to the activations' dtype and rotates in it; so does
    apply_rope (fp32 math would round otherwise and return fp32)."""
    config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0)
    positions = torch.tensor([0, 1, 5, 33, 300, 4095])
    cos, sin = fn.rope_cos_sin(config, positions)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 16, generator=gen).to(torch.bfloat16)
    k = torch.randn(6, 2, 16, generator=gen).to(torch.bfloat16)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos.to(torch.bfloat16)[None], sin.to(torch.bfloat16)[None])
    got_q, got_k = fn.apply_rope(q, cos, sin), fn.apply_rope(k, cos, sin)
    assert got_q.dtype == got_k.dtype == torch.bfloat16
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


def test_attention_half_uses_the_configs_eps():
    """attention_half (the fused-MLP decode path's first half) then o_proj and the MLP block is
    decoder_layer, at an eps where the eps matters."""
    config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                         rms_norm_eps=0.5)
    params = minivllm.random_params(config, seed=3, std=0.3)
    lp, shard = params.layers[0], ShardSpec()
    batch = make_batch([SeqChunk([1, 2, 3], 2, [0, 1]), SeqChunk([4], 6, [2, 3])], block_size=4)
    x, residual, cos, sin = stem(params, batch)
    x, residual = x * 3, residual + 0.1  # a later layer's entry: both terms of the stream
    kw = dict(config=config, shard=shard, backend=fn.REFERENCE)
    gen = torch.Generator().manual_seed(1)
    cache = [torch.randn(4, 4, 2, 8, generator=gen) for _ in range(2)]
    want_out, want_res = decoder_layer(lp, x, residual, cos, sin, cache[0].clone(), cache[1].clone(),
                                       batch, **kw)
    attn, res = attention_half(lp, x, residual, cos, sin, cache[0].clone(), cache[1].clone(),
                               batch, **kw)
    got_out, got_res = fn.mlp_block(lp, row_linear(attn, lp.o_proj, shard), res, shard,
                                    config.rms_norm_eps)
    torch.testing.assert_close(got_res, want_res)
    torch.testing.assert_close(got_out, want_out)


def test_hidden_states_refuses_a_batch_made_for_another_block_size():
    """hidden_states runs forward's step check too: a batch whose slots count in blocks of 8
    would write other tokens' K/V in a cache of blocks of 4."""
    config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    params = minivllm.random_params(config, seed=0)
    cache = minivllm.init_cache(params, num_blocks=4, block_size=4)
    batch = make_batch([SeqChunk([1, 2, 3], 0, [1])], block_size=8)
    with pytest.raises(ValueError, match="blocks of 8 tokens"):
        fn.hidden_states(params, cache, batch)
    assert all(not t.any() for t in cache.k + cache.v)  # nothing written


def test_hidden_states_at_rows_equal_transformers_last_hidden_state(tmp_path):
    """hidden_states(rows=...) gives the final-normed hidden state of exactly those tokens (of
    every token without rows): transformers' Qwen3Model last_hidden_state at them."""
    model = make_hf_model(seed=2, std=0.3)
    params = minivllm.load(save_checkpoint(model, tmp_path), device=DEVICE)
    with torch.no_grad():
        want = model.model(torch.tensor([PROMPT])).last_hidden_state[0]
    rows = torch.tensor([2, 5, 11], device=DEVICE)
    for r in (rows, None):
        cache = minivllm.init_cache(params, num_blocks=3, block_size=4)
        batch = make_batch([SeqChunk(PROMPT, 0, [0, 1, 2])], block_size=4, device=DEVICE)
        got = fn.hidden_states(params, cache, batch, rows=r).cpu()
        expected = want if r is None else want[r.cpu()]
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_embedding_owns_each_id_on_exactly_one_rank(monkeypatch, world_size):
    """Each rank embeds the ids of its row range [start, end) of the padded vocabulary and gives
    zeros for the others; the all-reduce's sum is then the plain embedding. The ranks' edges
    (start, end - 1, end) are the ids to get right. The all-reduce is replaced by the identity
    and the ranks' parts summed here."""
    from minivllm.functional import embedding

    monkeypatch.setattr(embedding, "all_reduce", lambda x, shard: x)
    config = ModelConfig(vocab_size=101, hidden_size=8, intermediate_size=8, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    full = torch.randn(101, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(101)
    total = torch.zeros(101, 8)
    for rank in range(world_size):
        shard = ShardSpec(rank=rank, world_size=world_size)
        v0, v1 = shard.vocab_range(config)
        padded = torch.zeros(shard.padded_vocab(config), 8)
        padded[:101] = full
        total += fn.embed(ids, padded[v0:v1], config, shard)
    assert torch.equal(total, full)


@pytest.mark.parametrize("low, high, old", [
    (64 / (2 * math.pi), 20.0, 64),  # the highest frequency's wavelength (2 pi) is low_freq_wavelen
    (1.0, 4.0, 32),
    (2.0, 8.0, 8192),
])
def test_llama3_inv_freq_equals_transformers_bit_for_bit(low, high, old):
    """Llama-3 scaling against transformers' own rope init, band edges included: a wavelength
    equal to low_freq_wavelen is in the smoothed band (both edges inclusive, as transformers'
    ~(wavelen < high) & ~(wavelen > low)), where smoothing at its low edge divides by factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from hf_tiny import hf_config

    hf = hf_config(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                    "low_freq_factor": low, "high_freq_factor": high,
                                    "original_max_position_embeddings": old})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    got = fn.rope_inv_freq(ModelConfig.from_dict(hf.to_dict()))
    assert torch.equal(got, want.float())
