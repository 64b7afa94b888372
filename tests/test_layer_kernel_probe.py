"""benchmarks/layer_kernel_probe.py's GEMVs compute W @ x (BENCHMARKS.md session 15's persistent
layer figures come from them). On the CPU the kernels run without their grid barriers: the
interpreter runs programs one after another, so a spin barrier could never return there."""

import pytest
import torch
import triton
import triton.language as tl

from benchmarks.layer_kernel_probe import _layer_gemvs_kernel, _rows_gemv, _rows_load, block_n_for
from minivllm.kernels.launch import triton_usable


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


SHAPES = [(64, 32), (16, 64), (96, 32), (16, 96)]  # four phases, like qkv, o_proj, gate_up, down


def test_round_robin_tiles_compute_each_gemv(device):
    programs = 5
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g).to(device) for n, k in SHAPES]
    xs = [torch.randn(k, generator=g).to(device) for _, k in SHAPES]
    ys = [torch.full((n,), float("nan"), device=device) for n, _ in SHAPES]
    args, consts = [], {}
    for j, ((n, k), w, x, y) in enumerate(zip(SHAPES, ws, xs, ys)):
        args += [w, x, y]
        consts |= {f"N{j}": n, f"K{j}": k, f"BN{j}": block_n_for(n, programs)}
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    _layer_gemvs_kernel[(programs,)](counter, *args, **consts, BLOCK_K=16, BARRIERS=False)
    for w, x, y in zip(ws, xs, ys):
        torch.testing.assert_close(y, w @ x, rtol=1e-4, atol=1e-4)


@triton.jit
def _one_phase(w_ptr, x_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
               BN: tl.constexpr, BLOCK_K: tl.constexpr):
    first = _rows_load(w_ptr, 0, N, K, R, BN, BLOCK_K)  # as the probe loads it before a barrier
    _rows_gemv(first, w_ptr, x_ptr, y_ptr, N, K, R, BN, BLOCK_K)


@pytest.mark.parametrize("n,k,programs,block_k", [(64, 32, 5, 16), (30, 64, 4, 16),
                                                 (100, 48, 7, 16), (8, 16, 8, 16), (20, 48, 3, 64)])
def test_row_blocks_cover_every_row_once(device, n, k, programs, block_k):
    """One block of ceil(n / programs) rows a program, masked past n (the last programs may get
    fewer rows or none); columns in BLOCK_K chunks, or one chunk wider than the row (masked)."""
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=g).to(device), torch.randn(k, generator=g).to(device)
    y = torch.full((n,), float("nan"), device=device)
    rows = -(-n // programs)
    _one_phase[(programs,)](w, x, y, n, k, rows, triton.next_power_of_2(rows), block_k)
    torch.testing.assert_close(y, w @ x, rtol=1e-4, atol=1e-4)


def test_tiles_give_every_program_work_when_they_can():
    assert block_n_for(4096, 132) == 16  # 256 tiles: 4096 / 32 = 128 would leave 4 SMs idle
    assert block_n_for(1024, 132) == 4
    assert block_n_for(64, 5) == 8


def test_the_barrier_kernel_counts_each_programs_arrivals(device):
    """The probe's barrier kernel through decode_layer's grid barrier: one program (which the
    interpreter's one-after-another programs can pass) arrives once a round."""
    from benchmarks.layer_kernel_probe import _barriers_kernel

    counter = torch.zeros(1, dtype=torch.int32, device=device)
    _barriers_kernel[(1,)](counter, 3)
    _barriers_kernel[(1,)](counter, 2)  # a later launch starts from the count it finds
    assert counter.item() == 5
