"""One layer's paged KV cache: the tensors the attention layer writes and the kernels read, and the gather of
a batch's pages into contiguous K/V (the TMA prefill kernel's input, engine/kernels/attention/prefill_tma.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import envs

# A gather's output (K and V together) is bounded by this per call; past it one sequence is gathered segment by
# segment (engine.kernels.attention.prefill_tma.prefill_segments) and anything else reads the pages in place. A packed
# gather holds a page-rounded copy beside the packed one, and a segment (up to the segment keys plus the chunk's)
# sits beside its float32 softmax state, so the memory plan (engine/worker/memory_plan.py) counts 1.5 times it
PREFILL_GATHER_MAX_BYTES = 256 << 20
# head_dims whose prefill takes the gather and the TMA kernel (engine.kernels.attention.paged). H200, one layer, chunk
# 4096 (bench/results/2026-12-02-h200-long-prefill-seed/): 128 at 1.4-2.5x the paged kernel (qwen3-8b/32b, 32k-196k keys, bf16
# and int8 pages); 256, Qwen3.5-27B's gated attention (24 heads over 4 KV heads), at 3.1-4.1x (32k and 128k keys),
# and the served hybrid's 196k-token prefill 2.0-2.1x (bench/results/2026-12-02-h200-hybrid-hd256/c-49d7006-hybrid-hd256-ab).
# NINFER_PREFILL_TMA_HD256=0 keeps 256 on the paged kernel.
PREFILL_TMA_HEAD_DIMS = (128, 256) if envs.PREFILL_TMA_HD256.read() else (128,)


@dataclass
class LayerKV:
    """One layer's KV pages. int8 pages carry a float32 scale per token and KV head."""

    k: torch.Tensor                        # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor                        # [num_blocks, block_size, kv_heads, head_dim]
    k_scale: torch.Tensor | None = None    # [num_blocks, block_size, kv_heads] when int8
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k.dtype == torch.int8


@dataclass(frozen=True)
class GatherPlan:
    """Where a batch's keys sit in the page pool: the same for every layer of one forward, so a prefill
    chunk builds it once (`ForwardContext.gather_plan`) rather than per layer."""

    pages: torch.Tensor                    # [sum(n_pages)] int64: page ids in sequence order, on the device
    keep: torch.Tensor | None              # rows of the gathered pages to keep (several sequences, ragged ends)
    total: int                             # sum(seq_lens)
    cu_seqlens: torch.Tensor               # [B + 1] int32 on the device


def gather_plan(block_tables: torch.Tensor, seq_lens: list[int], page: int) -> GatherPlan:
    """block_tables: [B, max_blocks] int (row b: sequence b's pages in position order); seq_lens: host ints,
    keys of each sequence (the engine knows them on the host when eager); page: keys per page."""
    dev = block_tables.device
    n_pages = [-(-s // page) for s in seq_lens]
    # page ids in sequence order, sliced from the table on the device (no host read of the table)
    pages = (torch.cat([block_tables[b, :n].long() for b, n in enumerate(n_pages)]) if seq_lens
             else torch.empty(0, dtype=torch.long, device=dev))
    keep = None
    if any(s != n * page for s, n in zip(seq_lens, n_pages)) and len(seq_lens) > 1:
        keep = torch.cat([torch.arange(s, device=dev) + sum(n_pages[:b]) * page for b, s in enumerate(seq_lens)])
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int64), 0).to(torch.int32)
    return GatherPlan(pages, keep, sum(seq_lens), cu.to(dev, non_blocking=True))


@dataclass(frozen=True)
class SegmentPlan:
    """One sequence's keys in segments that are gathered and attended one after another (prefill past the
    gather bound: engine/kernels/attention/prefill_tma.py `prefill_segments`). Every segment but the last ends at or
    before the sequence's first new token, so all of its keys are visible to every query."""

    bounds: tuple[tuple[int, int], ...]    # key ranges [lo, hi); lo a multiple of segment_keys
    gathers: tuple[GatherPlan, ...]        # each range's gather (cu_seqlens [0, hi - lo])


def segment_plan(block_tables: torch.Tensor, seq_len: int, query_len: int, page: int,
                 segment_keys: int) -> SegmentPlan:
    """block_tables: [1, max_blocks] (one sequence); seq_len keys once the chunk's query_len are written;
    segment_keys a multiple of page. Segments of segment_keys up to the first new token, then one segment from
    there to seq_len (at most segment_keys + query_len - 1 keys)."""
    if segment_keys <= 0 or segment_keys % page:
        raise ValueError(f"segment_keys {segment_keys} must be a positive multiple of the page size {page}")
    last = (seq_len - query_len) // segment_keys * segment_keys
    bounds = [(lo, lo + segment_keys) for lo in range(0, last, segment_keys)] + [(last, seq_len)]
    gathers = [gather_plan(block_tables[:1, lo // page:-(-hi // page)], [hi - lo], page) for lo, hi in bounds]
    return SegmentPlan(tuple(bounds), tuple(gathers))


def gather_kv(pages_k: torch.Tensor, pages_v: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: list[int], *, scales_k: torch.Tensor | None = None, scales_v: torch.Tensor | None = None,
              dtype: torch.dtype | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
              plan: GatherPlan | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each sequence's keys out of the page pool into contiguous K/V.

    pages_k, pages_v: [num_blocks, page, kv_heads, D] (bf16/fp16, or int8 with scales_k/scales_v
    [num_blocks, page, kv_heads] float32: dequantized here, as engine.layers.attention._gather_pages does, into `dtype`);
    block_tables, seq_lens: as `gather_plan` takes them, or `plan` already made from them.
    Returns (k [sum(seq_lens), kv_heads, D], v [same], cu_seqlens_k [B + 1] int32 on the device).

    One index_select over whole pages per tensor (a page is page * kv_heads * D contiguous elements,
    32 KB at qwen3-8b), then the tail of each sequence's last page is cut off; int8 pages on CUDA are
    gathered and dequantized in one pass instead (engine/kernels/attention/kv_dequant.py, same rounding). With a
    single sequence the result is a view of the gathered pages; with several, one more copy packs them
    (small next to the attention it feeds). `out`: buffers to receive k and v (their first rows).
    """
    plan = plan or gather_plan(block_tables, seq_lens, pages_k.shape[1])
    dtype = dtype or (torch.bfloat16 if pages_k.dtype == torch.int8 else pages_k.dtype)

    def one(pages, scales):
        if scales is not None and pages.is_cuda:
            # one pass, no float32 temporaries (engine/kernels/attention/kv_dequant.py); same rounding as below
            from engine.kernels.attention.kv_dequant import dequant_rows
            rows = plan.pages.shape[0] * pages.shape[1] if plan.keep is not None else plan.total
            x = dequant_rows(pages, scales, plan.pages, rows, pages.new_empty((rows, *pages.shape[2:]), dtype=dtype))
            return x.index_select(0, plan.keep) if plan.keep is not None else x
        x = pages.index_select(0, plan.pages).flatten(0, 1)        # [sum(n_pages) * page, kv_heads, D]
        if scales is not None:
            x = x.float() * scales.index_select(0, plan.pages).flatten(0, 1).unsqueeze(-1)
        x = x.index_select(0, plan.keep) if plan.keep is not None else x[:plan.total]
        return x.to(dtype)

    k, v = one(pages_k, scales_k), one(pages_v, scales_v)
    if out is not None:
        out[0][:plan.total].copy_(k)
        out[1][:plan.total].copy_(v)
        k, v = out[0][:plan.total], out[1][:plan.total]
    return k, v, plan.cu_seqlens
