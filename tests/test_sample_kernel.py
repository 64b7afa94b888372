"""The Gumbel-max / greedy sampling kernel (minivllm.kernels.sample_kernel) against its torch
reference (minivllm.functional.sampling.gumbel_argmax_reference): the same hashes bit for bit, the
same noise to rounding, the same token ids, whatever the tiling. On CPU it runs under Triton's
interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from minivllm.functional.sampling import (SamplingRow, counter_bits, counter_key, gumbel_argmax_reference,
                                          gumbel_from_bits, make_sampling_batch, sample)
from minivllm.kernels.sample_kernel import chunk_size, greedy_argmax, gumbel_argmax, gumbel_noise

SEEDS = [0, 1, 7, 2**63 - 1, -(2**63), -1, 123456789012345, 42]
STEPS = [0, 3, 2**31, 1, 2**32 - 1, 9, 0, 100]


def _rows(b: int, device):
    seeds = torch.tensor((SEEDS * b)[:b], dtype=torch.int64, device=device)
    steps = torch.tensor((STEPS * b)[:b], dtype=torch.int64, device=device)
    # Mixed: greedy rows (0) among sampled ones, low and high temperatures.
    temps = torch.tensor(([0.6, 0.0, 1.0, 2.0, 0.0, 0.05, 1.3] * b)[:b], dtype=torch.float32, device=device)
    return temps, seeds, steps


def test_hashes_are_bit_identical_and_noise_matches(device):
    temps, seeds, steps = _rows(8, device)
    bits, noise = gumbel_noise(seeds, steps, 1003)
    ref_bits = counter_bits(counter_key(seeds, steps), 1003)
    assert torch.equal(bits, ref_bits)
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**32
    # The logs may round differently (numpy's or CUDA's log against torch's, fused multiply-adds
    # on the GPU): a few ulps at most.
    torch.testing.assert_close(noise, gumbel_from_bits(ref_bits), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b, v, tiling", [(1, 1000, None), (3, 5003, None), (8, 5003, (128, 512)),
                                          (5, 1000, (256, 256)), (2, 77, (64, 128))])
def test_kernel_tokens_equal_the_reference(device, dtype, b, v, tiling):
    gen = torch.Generator().manual_seed(b * 1000 + v)
    logits = (torch.randn(b, v, generator=gen) * 3).to(dtype).to(device)
    temps, seeds, steps = _rows(b, device)
    block, chunk = tiling or (1024, None)
    got = gumbel_argmax(logits, temps, seeds, steps, block=block, chunk=chunk)
    want = gumbel_argmax_reference(logits, temps, seeds, steps)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    greedy = temps == 0
    assert got[greedy].tolist() == logits.float().argmax(-1)[greedy].tolist()


@pytest.mark.parametrize("tiling", [(64, 64), (64, 256), (1024, None)])
def test_greedy_ties_go_to_the_first_max_across_lanes_and_chunks(device, tiling):
    v = 700
    logits = torch.zeros(6, v)
    logits[0, [5, 300, 699]] = 4.0          # the first of three maxima, in different chunks
    logits[1, [600, 64, 128]] = 4.0         # same lane of different blocks
    logits[2] = torch.round(torch.randn(v, generator=torch.Generator().manual_seed(0)))  # many ties
    logits[3] = float("-inf")               # all banned: id 0, as torch.argmax
    logits[4, :] = float("-inf")
    logits[4, [650, 699]] = -1.0            # only the last chunk has finite values
    logits[5] = 1.0                          # all equal: id 0
    logits = logits.to(device)
    temps = torch.zeros(6, device=device)
    seeds = torch.arange(6, device=device)
    block, chunk = tiling
    got = gumbel_argmax(logits, temps, seeds, seeds, block=block, chunk=chunk)
    assert got.tolist() == logits.argmax(-1).tolist() == [5, 64, got[2].item(), 0, 650, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiling", [(64, 64), (64, 256), (1024, None)])
def test_greedy_argmax_equals_torch_argmax_with_ties(device, dtype, tiling):
    """The noiseless variant (no per-row parameters), on random rows and on the tie rows above."""
    v = 700
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, v, generator=gen) * 3
    logits[0, [5, 300, 699]] = 40.0          # three maxima in different chunks
    logits[1, [600, 64, 128]] = 40.0         # the same lane of different blocks
    logits[2] = torch.round(torch.randn(v, generator=gen))  # many ties
    logits[3] = float("-inf")                # all banned: id 0
    logits[4, :] = float("-inf")
    logits[4, [650, 699]] = -1.0             # only the last chunk has finite values
    logits[5] = 1.0                           # all equal: id 0
    logits = logits.to(dtype).to(device)
    block, chunk = tiling
    want = logits.float().argmax(-1)
    assert greedy_argmax(logits, block=block, chunk=chunk).tolist() == want.tolist()
    out = torch.full((9,), -7, dtype=torch.int64, device=device)
    copy = torch.full((9,), -7, dtype=torch.int64, device=device)
    assert greedy_argmax(logits[:, :650], out=out, copy_to=copy, block=block, chunk=chunk) is out
    assert out.tolist() == copy.tolist() == logits[:, :650].float().argmax(-1).tolist()  # strided
    with pytest.raises(ValueError, match="out must be a contiguous int64"):
        greedy_argmax(logits, out=out[:3])
    with pytest.raises(ValueError, match="copy_to must be a contiguous int64"):
        greedy_argmax(logits, copy_to=copy.to(torch.int32))


def test_strided_logits_and_banned_ids(device):
    wide = torch.randn(4, 1500, generator=torch.Generator().manual_seed(1)).to(device)
    logits = wide[:, :1200]  # a row stride larger than the vocabulary
    logits[:, :600] = float("-inf")
    temps, seeds, steps = _rows(4, device)
    got = gumbel_argmax(logits, temps, seeds, steps, block=128, chunk=256)
    assert got.tolist() == gumbel_argmax_reference(logits, temps, seeds, steps).tolist()
    assert bool((got >= 600).all())


def test_chunks_depend_on_shapes_only():
    cpu = torch.device("cpu")
    assert chunk_size(256, 151936, cpu) == 8192
    assert 1024 <= chunk_size(1, 151936, cpu) <= 8192
    assert chunk_size(1, 100, cpu, block=64) == 64


def test_sample_with_the_kernel_equals_sample_with_the_reference(device):
    """The whole sampler, kernel or not, on a batch mixing plain, greedy, truncated and penalised
    rows."""
    v = 900
    logits = (torch.randn(7, v, generator=torch.Generator().manual_seed(5)) * 2).to(device)
    rows = [SamplingRow(temperature=0.6, seed=1, step=2),
            SamplingRow(temperature=0.0),
            SamplingRow(temperature=0.9, top_p=0.8, seed=3),
            SamplingRow(temperature=1.1, seed=4, step=7, presence_penalty=0.5, output_ids=(1, 2, 3)),
            SamplingRow(temperature=1.0, seed=5, banned_ids=tuple(range(0, v, 2))),
            SamplingRow(temperature=0.0, repetition_penalty=1.5, output_ids=(9,), prompt_ids=(4,)),
            SamplingRow(temperature=0.7, top_k=10, seed=6, step=1)]
    sb = make_sampling_batch(rows, vocab_size=v, device=device)
    with_kernel = sample(logits, sb, kernel=True).token_ids
    without = sample(logits, sb, kernel=False).token_ids
    assert with_kernel.tolist() == without.tolist()
    assert with_kernel[4].item() % 2 == 1


def test_fast_log_off_the_gpu_is_a_clear_error():
    logits = torch.zeros(1, 10)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="fast_log needs a CUDA GPU"):
        gumbel_argmax(logits, torch.ones(1), one, one, fast_log=True)
    with pytest.raises(ValueError, match="fast_log needs a CUDA GPU"):
        gumbel_noise(one, one, 10, fast_log=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the approximate log is a PTX instruction")
def test_fast_log_draws_the_reference_tokens_at_qwen3_vocab():
    """The engine's default on the GPU: where the approximate logs pick another token than the
    reference, the reference's two best candidates must be closer than the logs' error."""
    b, v = 64, 151936
    logits = (torch.randn(b, v, generator=torch.Generator().manual_seed(7)) * 3).cuda()
    temps = torch.full((b,), 0.6, device="cuda")
    seeds = torch.arange(b, dtype=torch.int64, device="cuda") * 7919
    steps = torch.arange(b, dtype=torch.int64, device="cuda") % 5
    want = gumbel_argmax_reference(logits, temps, seeds, steps)
    assert gumbel_argmax(logits, temps, seeds, steps, fast_log=False).tolist() == want.tolist()
    got = gumbel_argmax(logits, temps, seeds, steps, fast_log=True)
    x = logits + temps[:, None] * gumbel_from_bits(counter_bits(counter_key(seeds, steps), v))
    top2 = x.topk(2, dim=-1).values
    differ = got != want
    assert int(differ.sum()) <= 1
    assert bool((top2[differ, 0] - top2[differ, 1] < 1e-4).all())
    _, fast_noise = gumbel_noise(seeds[:4], steps[:4], v, fast_log=True)
    _, noise = gumbel_noise(seeds[:4], steps[:4], v, fast_log=False)
    torch.testing.assert_close(fast_noise, noise, rtol=1e-5, atol=1e-5)
