"""The Triton kernels against their torch twins at real shapes, on a CUDA device.

Each case draws fresh random inputs, poisons the outputs with NaN and requires every element
written; attention must be within 1e-2 relative error of the float32 twin (bf16 inputs land near
2e-3), KV writes bit-exact. The same checks run at tiny shapes under Triton's interpreter in
tests/engine/kernels/test_interpret.py; tests.support.kernel_checks holds them.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import kernel_checks as testing


BF16, FP16, I8 = torch.bfloat16, torch.float16, torch.int8
TOL = 1e-2
DEV = "cuda"

# (query_lens, seq_lens, heads, kv_heads, head_dim, page, kv_dtype); 32/8 and 64/8 are qwen3-8b and
# -32b, 16/4 and 32/4 their TP=2 shards
ATTENTION = {
    "prefill_aligned": ([512], [512], 32, 8, 128, 16, BF16),
    "prefill_unaligned_int8": ([1000], [1000], 32, 8, 128, 16, I8),
    "chunk_after_context_g8": ([300], [2385], 64, 8, 128, 16, BF16),
    "chunk_after_context_int8_d64": ([777], [2277], 16, 4, 64, 16, I8),
    "chunk_4096_after_6k_page64": ([4096], [10240], 32, 8, 128, 64, BF16),
    "short_chunk_long_context_splits": ([256], [20256], 32, 8, 128, 16, BF16),
    "decode_1_17_1000_33000": ([1] * 4, [1, 17, 1000, 33000], 32, 8, 128, 16, BF16),
    "decode_1_17_1000_33000_int8_g8": ([1] * 4, [1, 17, 1000, 33000], 64, 8, 128, 16, I8),
    "decode_d64_g8": ([1] * 3, [5, 700, 5000], 16, 2, 64, 16, BF16),
    "decode_batch1_131k_tp2": ([1], [131072], 16, 4, 128, 16, BF16),
    "verify_q4": ([4] * 4, [4, 100, 2000, 9000], 32, 8, 128, 16, BF16),
    "verify_q4_int8_d64": ([4] * 4, [4, 100, 2000, 9000], 16, 4, 64, 16, I8),
    "verify_q6_g8_int8": ([6] * 3, [6, 513, 12000], 64, 8, 128, 16, I8),
    "verify_q9_g8": ([9] * 2, [9, 4000], 32, 4, 128, 32, BF16),
    "non_uniform_batch": ([1, 7, 300, 2], [1000, 7, 800, 66], 32, 8, 128, 16, BF16),
    "tile_edges": ([1] * 5, [63, 64, 65, 128, 129], 32, 8, 128, 16, BF16),
    "tile_edges_verify": ([3] * 3, [64, 65, 66], 32, 8, 128, 16, I8),
    # head_dim 256: Qwen3.5-27B's gated attention (24 heads over 4 KV heads; 12 / 2 per TP=2 rank)
    "prefill_d256_g6": ([1500], [1500], 24, 4, 256, 16, BF16),
    "chunk_after_context_d256_int8_tp2": ([700], [5000], 12, 2, 256, 16, I8),
    "decode_d256_g6": ([1] * 3, [1, 900, 20000], 24, 4, 256, 16, BF16),
    "verify_q4_d256_int8": ([4] * 2, [4, 3000], 12, 2, 256, 16, I8),
    "decode_d256_131k_tp2_int8": ([1], [131072], 12, 2, 256, 16, I8),      # 256 key splits
}


@pytest.mark.parametrize("tma", ["1", "0"], ids=["tma_route", "paged_only"])
@pytest.mark.parametrize("case", list(ATTENTION), ids=list(ATTENTION))
def test_paged_attention(case, tma, monkeypatch):
    # prefill shapes over 16-bit pages take the TMA kernel unless NINFER_PREFILL_TMA=0: both routes held to the twin
    monkeypatch.setenv("NINFER_PREFILL_TMA", tma)
    q, kv, ctx = testing.attention_case(*ATTENTION[case], BF16, DEV, sum(map(ord, case)))
    r = testing.check_attention(q, kv, ctx)
    assert r["unwritten"] == 0, r
    assert r["rel_err"] < TOL, r


@pytest.mark.parametrize("case", ["prefill_aligned", "prefill_unaligned_int8", "chunk_after_context_g8",
                                  "chunk_4096_after_6k_page64"])
def test_sdpa_prefill(case):
    """The optional gather + torch SDPA route for one-sequence prefill (attention.PREFILL_VIA_SDPA)."""
    q, kv, ctx = testing.attention_case(*ATTENTION[case], BF16, DEV, 7)
    r = testing.check_attention(q, kv, ctx, via_sdpa=True)
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


def test_paged_attention_fp16():
    q, kv, ctx = testing.attention_case([200, 1], [900, 50], 32, 8, 128, 16, FP16, FP16, DEV, 31)
    r = testing.check_attention(q, kv, ctx)
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


@pytest.mark.parametrize("kv_dtype", [BF16, I8], ids=["bf16", "int8"])
@pytest.mark.parametrize("query_len", [1, 4])
def test_decode_cuda_graph_replay(kv_dtype, query_len):
    """Captured once, replayed after seq_lens, tables, slots and inputs changed in the static
    buffers: equals an eager run on the new values bit for bit, and the reference."""
    r = testing.check_decode_graph(32, 8, 128, 16, kv_dtype, BF16, seed=41 + query_len, batch=4,
                                   query_len=query_len, max_blocks=2100)
    assert r["unwritten"] == 0 and r["rel_err"] < TOL and r["max_diff_vs_eager"] == 0.0, r


# (tokens, heads, splits, head_dim): qwen3-8b's batch-1 split counts (16 and 32: one block, one load trip;
# 64: two blocks of 32), batch 4, and the 27B's 256 splits of head_dim 256 (16 blocks)
@pytest.mark.parametrize("shape", [(1, 32, 16, 128), (1, 32, 32, 128), (1, 32, 64, 128), (4, 32, 16, 128),
                                   (1, 12, 256, 256)], ids=str)
def test_split_merge_drops_empty_splits(shape):
    """Empty splits' never-written accumulator rows hold NaN and infinities (a reused workspace may): the
    merge drops them by a select, so none reaches the output."""
    r = testing.check_split_merge(*shape, BF16, DEV, seed=sum(shape))
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


@pytest.mark.parametrize("kv_dtype", [BF16, I8, FP16], ids=["bf16", "int8", "fp16"])
@pytest.mark.parametrize("tokens", [7, 4096])
def test_write_kv(kv_dtype, tokens):
    for kv_heads, head_dim, page in ((8, 128, 16), (4, 64, 64)):
        r = testing.check_write_kv(tokens, kv_heads, head_dim, page, kv_dtype, BF16, DEV, seed=tokens + head_dim)
        assert testing.pages_agree(r), r


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 4096])
def test_rms_norm(rows, with_residual):
    for hidden in (4096, 5120):
        r = testing.check_rms_norm(rows, hidden, BF16, DEV, rows + hidden, with_residual)
        assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


@pytest.mark.parametrize("kv_dtype", [None, BF16, I8], ids=["no_kv", "kv_bf16", "kv_int8"])
@pytest.mark.parametrize("tokens", [1, 333])
def test_qk_norm_rope(tokens, kv_dtype):
    for heads, kv_heads in ((32, 8), (64, 8)):
        r = testing.check_qk_norm_rope(tokens, heads, kv_heads, 128, BF16, DEV, tokens + heads, kv_dtype=kv_dtype)
        assert r["unwritten"] == 0 and r["rel_err"] < TOL and testing.pages_agree(r.get("pages", {"mismatches": 0})), r
        assert r.get("mismatches_no_k", 0) == 0, r


@pytest.mark.parametrize("rows", [1, 512])
def test_silu_and_mul(rows):
    for ffn in (12288, 25600 // 2):
        r = testing.check_silu_and_mul(rows, ffn, BF16, DEV, rows + ffn)
        assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


# -- the decode switches of the attention kernel (AttnConfig.prefetch, max_regs), the
# twins of tests/engine/kernels/test_interpret.py's at real shapes -----------------------------------------------

def _decode_config(query_len: int, kv_dtype, **kw):
    from engine.kernels.attention.paged import AttnConfig
    base = {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 1, "num_splits": 16, "min_tiles": 1,
            "int8_upcast": kv_dtype == I8}
    return AttnConfig(**{**base, **kw})


DECODE_VARIANTS = {
    "prefetch1": {"prefetch": 1},
    "prefetch2": {"prefetch": 2},
    "prefetch1_r128": {"prefetch": 1, "max_regs": 128},
    "prefetch1_bn128": {"prefetch": 1, "block_n": 128},
    "prefetch1_64_splits": {"prefetch": 1, "num_splits": 64},
    "prefetch1_one_split": {"prefetch": 1, "num_splits": 1},           # no split: no merge kernel
    "prefetch1_fused_merge": {"prefetch": 1, "fused_merge": True},     # the last split merges: no merge kernel
    "prefetch1_64_splits_fused_merge": {"prefetch": 1, "num_splits": 64, "fused_merge": True},
}


@pytest.mark.parametrize("kv_dtype", [BF16, I8], ids=["bf16", "int8"])
@pytest.mark.parametrize("query_len", [1, 4])
@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
def test_decode_variants(variant, query_len, kv_dtype):
    """Batch 3 of unequal lengths, none a multiple of the key tile (qwen3-8b heads), and batch 1."""
    for lens, seed in (([query_len, 1000, 33001], 51), ([8191], 52)):
        q, kv, ctx = testing.attention_case([query_len] * len(lens), lens, 32, 8, 128, 16, kv_dtype, BF16, DEV,
                                            seed + query_len)
        cfg = _decode_config(query_len, kv_dtype, **DECODE_VARIANTS[variant])
        r = testing.check_attention(q, kv, ctx, config=cfg)
        assert r["unwritten"] == 0 and r["rel_err"] < TOL, (variant, lens, r)


@pytest.mark.parametrize("fused_merge", [False, True], ids=["merge_kernel", "fused_merge"])
@pytest.mark.parametrize("kv_dtype", [BF16, I8], ids=["bf16", "int8"])
def test_decode_variants_graph_replays(kv_dtype, fused_merge):
    """The prefetching loop and its merge, captured once and replayed over changed seq_lens: each replay right and
    equal to an eager run bit for bit (the fused merge's counters re-armed by every launch)."""
    from engine.worker.forward_context import build_forward_context
    from engine.kernels.attention import paged as A
    from engine.layers.attention import paged_attention_reference
    cap = 6000
    q, kv, ctx = testing.attention_case([1] * 3, [cap] * 3, 32, 8, 128, 16, kv_dtype, BF16, DEV, 71)
    tables = [row.tolist() for row in ctx.block_tables.cpu()]
    cfg = _decode_config(1, kv_dtype, prefetch=1, num_splits=32, fused_merge=fused_merge)
    scale = 128 ** -0.5
    out = torch.full_like(q, float("nan"))
    A.paged_attention(q, kv, ctx, scale, out=out, config=cfg)          # compiles outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        A.paged_attention(q, kv, ctx, scale, out=out, config=cfg)
    for lens in ([cap, 300, 17], [17, cap - 1, 4097], [1, 1, 1], [cap, 300, 17]):
        _, new = build_forward_context([1] * 3, lens, tables, 16, torch.device(DEV))
        ctx.seq_lens.copy_(new.seq_lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = A.paged_attention(q, kv, new, scale, config=cfg)
        ref = paged_attention_reference(q.float(), kv, new, scale)
        assert testing.unwritten(out) == 0 and testing.rel_err(out, ref) < TOL, lens
        assert torch.equal(out, eager), lens
