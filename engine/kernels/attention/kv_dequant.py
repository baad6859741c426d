"""int8 KV pages to contiguous 16-bit K or V in one pass: the gather of engine/worker/paged_kv.py for int8 pools.

The torch gather dequantizes through float32 temporaries (index_select, a float32 copy, the product, the cast):
four passes and twice the output's bytes held at once. This kernel reads each kept page row and its scales once
and writes the 16-bit row: value = int8 * scale in float32, rounded to the output dtype, the same arithmetic as
the torch path, so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_rows_kernel(pages_ptr, scales_ptr, page_ids_ptr, out_ptr, n_rows,
                         stride_pb, stride_pt, stride_sb, stride_st, stride_ot,
                         PAGE: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    # one program per output row (a key: all its KV heads); rows in page order
    r = tl.program_id(0)
    if r >= n_rows:
        return
    page = tl.load(page_ids_ptr + r // PAGE).to(tl.int64)
    slot = r % PAGE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    cell = offs_h[:, None] * HEAD_DIM + offs_d[None, :]                                 # [HEADS_PAD, HEAD_DIM]
    live = (offs_h < KV_HEADS)[:, None]
    x = tl.load(pages_ptr + page * stride_pb + slot * stride_pt + cell, mask=live, other=0)
    scale = tl.load(scales_ptr + page * stride_sb + slot * stride_st + offs_h, mask=offs_h < KV_HEADS, other=0.0)
    y = x.to(tl.float32) * scale[:, None]
    tl.store(out_ptr + r.to(tl.int64) * stride_ot + cell, y.to(out_ptr.dtype.element_ty), mask=live)


def dequant_rows(pages: torch.Tensor, scales: torch.Tensor, page_ids: torch.Tensor, n_rows: int,
                 out: torch.Tensor) -> torch.Tensor:
    """pages: int8 [num_blocks, page, kv_heads, D] (each token's heads contiguous); scales: float32
    [num_blocks, page, kv_heads]; page_ids: [n] int64 pages in sequence order; out: [>= n_rows, kv_heads, D]
    16-bit, rows contiguous. Writes the first n_rows keys of those pages (n_rows <= n * page) into out."""
    _, page, kvh, d = pages.shape
    if (pages.stride(3) != 1 or pages.stride(2) != d or out.stride(2) != 1 or out.stride(1) != d
            or scales.stride(2) != 1):
        raise ValueError("dequant_rows needs contiguous (kv_heads, head_dim) rows in the pages and the output, "
                         "and contiguous kv_heads in the scales")
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two")
    if n_rows > page_ids.shape[0] * page:
        raise ValueError(f"{n_rows} rows from {page_ids.shape[0]} pages of {page}")
    if n_rows:
        _dequant_rows_kernel[(n_rows,)](pages, scales, page_ids, out, n_rows, pages.stride(0), pages.stride(1),
                                        scales.stride(0), scales.stride(1), out.stride(0),
                                        PAGE=page, KV_HEADS=kvh, HEADS_PAD=triton.next_power_of_2(kvh),
                                        HEAD_DIM=d, num_warps=4)
    return out
