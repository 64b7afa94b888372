"""The decode head kernel (minivllm.kernels.decode_head) against functional.model.head: the
final add + RMSNorm and the LM head's logits to the GEMV's rounding, and each vocabulary tile's
(max, first id of it) exactly as read off those logits; argmax_of_tiles then gives
torch.argmax's ids. Under Triton's interpreter on CPU (fp32 and fp16), bf16 too on a GPU."""

from __future__ import annotations

import pytest
import torch

import minivllm
from minivllm.functional.model import head
from minivllm.kernels.decode_head import BLOCK_N, decode_head
from minivllm.kernels.sample_kernel import argmax_of_tiles
from minivllm.state import ModelConfig

# vocab 300: four full tiles and a partial one; hidden 256: two of fp16's 128-column chunks
CONFIG = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=64, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _dtypes(device):
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])


@pytest.mark.parametrize("m,programs", [(1, None), (2, None), (5, None), (1, 2), (2, 4)])
def test_decode_head_equals_the_functional_head(device, m, programs):
    """programs: the default (two an SM, at most one a tile: one a tile for these 5 tiles), or
    fewer programs than the tiles, each taking every programs-th tile (unevenly: 3 and 2 tiles,
    or 2, 1, 1, 1)."""
    for dtype in _dtypes(device):
        params = minivllm.random_params(CONFIG, seed=m, dtype=dtype, device=device, std=0.5)
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, CONFIG.hidden_size, generator=g).to(dtype).to(device)
        residual = (3 * torch.randn(m, CONFIG.hidden_size, generator=g)).to(dtype).to(device)
        want = head(params, x, residual, torch.arange(m, device=device))
        logits, tile_max, tile_argmax = decode_head(
            x, residual, params.final_norm, params.head_weight,
            vocab_size=CONFIG.vocab_size, eps=CONFIG.rms_norm_eps, programs=programs)
        assert logits.dtype == torch.float32 and logits.shape == want.shape
        scale = want.abs().max()
        assert (logits - want).abs().max() <= TOL[dtype] * scale, dtype
        # The tiles' maxima are read off the kernel's own logits: exact.
        tiles = -(-CONFIG.vocab_size // BLOCK_N)
        assert tile_max.shape == tile_argmax.shape == (m, tiles)
        for t in range(tiles):
            chunk = logits[:, t * BLOCK_N:(t + 1) * BLOCK_N]
            assert torch.equal(tile_max[:, t], chunk.max(-1).values)
            assert torch.equal(tile_argmax[:, t].long(), t * BLOCK_N + chunk.argmax(-1))
        out, copy = (torch.full((m,), -1, dtype=torch.int64, device=device) for _ in range(2))
        argmax_of_tiles(tile_max, tile_argmax, out=out, copy_to=copy)
        assert out.tolist() == copy.tolist() == logits.argmax(-1).tolist()


def test_x_as_split_partials(device):
    """x as fp32 split-K partials, summed first as functional.model.head sums them. (Ties across
    tiles: test_sample_kernel's tie tests run argmax_of_tiles' kernel.)"""
    params = minivllm.random_params(CONFIG, seed=0, device=device)
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(3, 2, CONFIG.hidden_size, generator=g).to(device)
    residual = torch.randn(2, CONFIG.hidden_size, generator=g).to(device)
    want = head(params, parts, residual, torch.arange(2, device=device))
    logits, tile_max, tile_argmax = decode_head(parts, residual, params.final_norm,
                                                params.head_weight, vocab_size=CONFIG.vocab_size,
                                                eps=CONFIG.rms_norm_eps)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_clear_errors(device):
    params = minivllm.random_params(CONFIG, seed=0, device=device)
    x = torch.zeros(1, CONFIG.hidden_size, device=device)
    kw = dict(vocab_size=CONFIG.vocab_size, eps=1e-6)
    with pytest.raises(ValueError, match="rows of x"):
        decode_head(torch.zeros(17, CONFIG.hidden_size, device=device),
                    torch.zeros(17, CONFIG.hidden_size, device=device), params.final_norm,
                    params.head_weight, **kw)
    with pytest.raises(ValueError, match="head weight"):
        decode_head(x, x, params.final_norm, params.head_weight[:, :128], **kw)
    for programs in (0, 6):  # 5 tiles
        with pytest.raises(ValueError, match="1-5 programs"):
            decode_head(x, x, params.final_norm, params.head_weight, programs=programs, **kw)
    with pytest.raises(ValueError, match="contiguous int64"):
        argmax_of_tiles(torch.zeros(2, 3, device=device), torch.zeros(2, 3, dtype=torch.int32,
                                                                       device=device),
                        out=torch.zeros(3, dtype=torch.int64, device=device))


def test_argmax_of_qwen3s_2374_tiles(device):
    """The head's tile count at Qwen3's vocabulary (151,936 / 64): the first id of each row's
    max, ties between tiles included (tile maxima drawn from few values)."""
    g = torch.Generator().manual_seed(0)
    tile_max = torch.randint(0, 4, (2, 2374), generator=g).float().to(device)
    tile_argmax = (torch.arange(2374) * 64 + torch.randint(0, 64, (2, 2374), generator=g)).to(
        torch.int32).to(device)
    first = tile_max.argmax(-1)  # torch.argmax: the first tile of the max
    want = tile_argmax.gather(1, first[:, None]).squeeze(1).long()
    assert argmax_of_tiles(tile_max, tile_argmax).tolist() == want.tolist()
