"""kernels.memory_read: the read-only kernel behind bench's floor at the read rate reads every
element once (its per-program sums add up to the buffer's): on the GPU, or on the CPU under
Triton's interpreter."""

import pytest
import torch

from minivllm.kernels.memory_read import stream_read
from minivllm.runtime.bench import copy_bandwidth, read_bandwidth


@pytest.mark.parametrize("programs", [1, 3, 8])
def test_stream_read_reads_every_element_once(programs, device):
    g = torch.Generator().manual_seed(programs)
    src = torch.randn(5 * 256, generator=g).to(device, torch.bfloat16)
    out = torch.zeros(programs, device=device)
    stream_read(src, out, block=256, warps=1)
    torch.testing.assert_close(out.sum(), src.float().sum(), rtol=1e-5, atol=1e-4)
    # each program's share: tiles p, p + P, ...
    tiles = src.float().view(5, 256).sum(1)
    want = torch.stack([tiles[p::programs].sum() for p in range(programs)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def test_stream_read_rejects_a_partial_tile():
    with pytest.raises(ValueError, match="multiple of 256"):
        stream_read(torch.zeros(300, dtype=torch.bfloat16), torch.zeros(2), block=256)


def test_bandwidths_are_for_cuda_only():
    assert read_bandwidth(torch.device("cpu")) is None
    assert copy_bandwidth(torch.device("cpu")) is None
