"""Programmatic dependent launch (Hopper): a kernel may start while the one before it finishes.

A decode step of a few sequences is a chain of ~200 small kernels, each paying its launch and
its first DRAM round trip before any byte streams. Launched with the PDL attribute
(`pdl_launch`), a kernel's programs start as soon as every program of the kernel before it has
called `gdc_launch_dependents` (ours do so first thing) or exited; they may then read what does
not depend on that kernel (the weights: `pdl_prologue` pulls this program's weight range into L2)
and must `gdc_wait` before reading anything it wrote. gdc_wait returns at once when the kernel was
launched without the attribute, so the kernels stay correct after any predecessor.

pdl: 0 off, 1 wait only (overlaps the launch), 2 also prefetch the weights into L2 first.
Under the interpreter both stay off: it has no griddepcontrol.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LINE = tl.constexpr(128)  # bytes of an L2 line: one prefetch each

__all__ = ["gdc_launch_dependents", "gdc_wait", "pdl_launch", "pdl_prologue"]


def pdl_launch(pdl: int) -> dict:
    """Launch options for a kernel called with PDL=pdl."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_prologue(w_ptr, rows, stride_wn, k_start, k_end, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Let the next kernel launch, prefetch rows x [k_start, k_end) of w into L2 (PDL >= 2),
    then wait for the previous kernel's writes to be visible."""
    gdc_launch_dependents()
    if PDL >= 2:
        STEP: tl.constexpr = LINE // w_ptr.dtype.element_ty.primitive_bitwidth * 8
        LINES: tl.constexpr = max(1, BLOCK_K // STEP)
        offs = tl.arange(0, LINES) * STEP
        base = w_ptr + rows[:, None].to(tl.int64) * stride_wn
        for k0 in range(k_start, k_end, BLOCK_K):
            k = tl.minimum(k0 + offs, k_end - 1)
            _prefetch_l2(base + k[None, :])
    gdc_wait()
