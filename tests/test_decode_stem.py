"""The decode stem kernel (minivllm.kernels.decode_stem) against functional.model.stem: the same
embedding rows, a zero residual, and RoPE's cos and sin to fp32 rounding. Under Triton's
interpreter on CPU (fp32 and fp16: it computes bf16 wrongly), in bf16 too on a GPU."""

from __future__ import annotations

import pytest
import torch

import minivllm
from minivllm.functional.model import stem
from minivllm.functional.rope import rope_inv_freq
from minivllm.kernels.decode_stem import decode_stem, stem_for
from minivllm.state import ModelConfig, SeqChunk, make_batch

CONFIG = ModelConfig(vocab_size=100, hidden_size=96, intermediate_size=48, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def _dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])


@pytest.mark.parametrize("block_h", [32, 64, 1024])
def test_decode_stem_equals_the_functional_stem(device, block_h):
    for dtype in _dtypes(device):
        params = minivllm.random_params(CONFIG, seed=0, dtype=dtype, device=device)
        inv_freq = rope_inv_freq(CONFIG, device)
        for ids, positions in (([7], [0]), ([99, 0], [4095, 17]), ([3, 3, 50], [1, 600, 2])):
            chunks = [SeqChunk([t], p, list(range(p // 16 + 1))) for t, p in zip(ids, positions)]
            batch = make_batch(chunks, block_size=16, device=device)
            want = stem(params, batch)
            got = decode_stem(batch.input_ids, batch.positions, params.embed, inv_freq,
                              block_h=block_h)
            assert torch.equal(got[0], want[0]) and got[0].dtype == dtype  # the embedding rows
            assert torch.equal(got[1], torch.zeros_like(want[0])) and got[1].dtype == dtype
            for a, b in zip(got[2:], want[2:]):
                assert a.dtype == torch.float32 and a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_stem_for_takes_the_kernel_at_decode_steps_only(device):
    params = minivllm.random_params(CONFIG, seed=1, device=device)
    calls = []

    def fallback(p, batch):
        calls.append(batch.num_tokens)
        return stem(p, batch)

    fn = stem_for(params, fallback)
    decode = make_batch([SeqChunk([5], 9, [0]), SeqChunk([6], 3, [1])], block_size=16,
                        device=device)
    prefill = make_batch([SeqChunk([5, 6, 7], 0, [0])], block_size=16, device=device)
    for batch, want_calls in ((decode, []), (prefill, [3])):
        got, want = fn(params, batch), stem(params, batch)
        assert calls == want_calls
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_bad_inputs_are_clear_errors():
    embed = torch.zeros(10, 8)
    inv = torch.ones(4)
    with pytest.raises(ValueError, match="int64"):
        decode_stem(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), embed, inv)
    with pytest.raises(ValueError, match="power-of-two"):
        decode_stem(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), embed,
                    torch.ones(3))
