"""Addressing the paged cache from inside a kernel: token positions of one sequence to element
offsets in a [num_blocks, PAGE, KV_HEADS, HEAD_DIM] cache (contiguous, head 0)."""

import triton
import triton.language as tl


@triton.jit
def page_rows(bt_row_ptr, n0, offs_n, mask_n, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
              ROW: tl.constexpr):
    """int64 offsets [BLOCK_N] of positions n0 + offs_n; ROW = KV_HEADS * HEAD_DIM elements per
    slot. Tiles start at multiples of BLOCK_N, so when PAGE is a multiple of BLOCK_N a tile lies in
    one page: one block-table read and contiguous rows instead of a per-row gather."""
    if PAGE % BLOCK_N == 0:
        blk = tl.load(bt_row_ptr + n0 // PAGE).to(tl.int64)
        return blk * (PAGE * ROW) + ((n0 % PAGE) + offs_n).to(tl.int64) * ROW
    else:
        pos = n0 + offs_n
        blk = tl.load(bt_row_ptr + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
        return blk * (PAGE * ROW) + (pos % PAGE).to(tl.int64) * ROW


@triton.jit
def load_rows(ptrs, row_mask, mask_d, ROW_MASKED: tl.constexpr, D_MASKED: tl.constexpr):
    """Load a [rows, BLOCK_D] tile, masking only what can be out of bounds, so that full tiles of
    a power-of-two head_dim load unpredicated and vectorised."""
    if ROW_MASKED:
        if D_MASKED:
            return tl.load(ptrs, mask=row_mask[:, None] & mask_d[None, :], other=0.0)
        else:
            return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        if D_MASKED:
            return tl.load(ptrs, mask=mask_d[None, :], other=0.0)
        else:
            return tl.load(ptrs)
