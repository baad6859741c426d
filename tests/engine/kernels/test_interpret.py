"""The Triton kernels at tiny shapes under Triton's interpreter, on the CPU.

Opt-in, because CI has no Triton and the interpreter is slow (about a minute here): run with
    NINFER_TRITON_INTERPRET_TESTS=1 pytest tests/engine/kernels/test_interpret.py
The same checks run at real shapes on the GPU in tests/engine/kernels/attention/test_paged_gpu.py (tests.support.kernel_checks
holds them). Enabling this module sets TRITON_INTERPRET=1 for the process before the kernels are
defined (Triton reads it when a kernel is decorated), so run it apart from GPU tests.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys

import pytest
import torch

from engine import envs

ENABLED = envs.TRITON_INTERPRET_TESTS.read()
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _triton_version() -> tuple[int, ...]:
    from importlib.metadata import version
    return tuple(int(p) for p in version("triton").split(".")[:2] if p.isdigit())


pytestmark = [
    pytest.mark.skipif(not (ENABLED and HAVE_TRITON),
                       reason="Triton interpreter tests are opt-in: need triton importable and "
                              "NINFER_TRITON_INTERPRET_TESTS=1"),
    # 3.6's interpreter turns scalar loop bounds into 1-element arrays and fails; 3.9's runs them
    pytest.mark.skipif(ENABLED and HAVE_TRITON and _triton_version() < (3, 9),
                       reason="needs the interpreter of Triton >= 3.9"),
]
if ENABLED and HAVE_TRITON:
    os.environ["TRITON_INTERPRET"] = "1"

BF16, I8 = torch.bfloat16, torch.int8
TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels():
    """Define (or redefine) the kernels in interpreter mode and patch two interpreter gaps."""
    from tests.support import kernel_checks as testing
    for name in ("engine.kernels.attention.tiles", "engine.kernels.attention.paged", "engine.kernels.elementwise.norm_rope"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)
    testing.patch_interpreter()
    return testing


def _attention(testing, query_lens, seq_lens, heads, kv_heads, head_dim, page, kv_dtype, seed, config=None,
               dtype=BF16):
    q, kv, ctx = testing.attention_case(query_lens, seq_lens, heads, kv_heads, head_dim, page, kv_dtype, dtype,
                                        "cpu", seed)
    r = testing.check_attention(q, kv, ctx, config=config)
    assert r["unwritten"] == 0, r
    assert r["rel_err"] < TOL, r


# (query_lens, seq_lens, heads, kv_heads, head_dim, page, kv_dtype)
ATTENTION = {
    "prefill_aligned": ([32], [32], 8, 2, 32, 16, BF16),
    "prefill_unaligned": ([37], [37], 8, 2, 32, 4, I8),
    "chunk_after_context": ([21], [66], 8, 1, 64, 8, BF16),
    "chunk_after_context_int8_g8": ([40], [103], 16, 2, 32, 16, I8),
    "decode_mixed_lengths": ([1] * 4, [1, 17, 100, 300], 8, 2, 32, 16, BF16),
    "decode_mixed_lengths_int8_g8": ([1] * 4, [1, 17, 100, 300], 8, 1, 64, 4, I8),
    "verify_q4": ([4] * 3, [4, 50, 200], 8, 2, 32, 16, BF16),
    "verify_q6_g8_int8": ([6] * 2, [6, 130], 16, 2, 32, 8, I8),
    "non_uniform_batch": ([1, 5, 30, 2], [10, 5, 90, 70], 8, 2, 32, 4, BF16),
    # a packed prefill chunk (engine.sched.prefill_lane): a prompt's tail, a whole prompt, a prompt's head
    "packed_prefill": ([45, 70, 29], [110, 70, 29], 8, 2, 32, 16, BF16),
    "head_dim_128": ([3, 1], [40, 77], 8, 2, 128, 16, BF16),
    # head_dim 256 (Qwen3.5's gated attention) takes its own prefill tiles; group 6 as in the 27B
    "head_dim_256_prefill_g6": ([70], [90], 6, 1, 256, 16, BF16),
    # queries and keys on tile edges: the unmasked/masked split must be exact there
    "tile_edges_prefill": ([40], [134], 8, 2, 32, 16, BF16),
    "tile_edges_decode": ([1] * 5, [63, 64, 65, 128, 129], 8, 2, 32, 16, BF16),
    "tile_edges_verify": ([3] * 3, [64, 65, 66], 8, 2, 32, 16, I8),
}


@pytest.mark.parametrize("case", list(ATTENTION), ids=list(ATTENTION))
def test_paged_attention(interpreted_kernels, case):
    _attention(interpreted_kernels, *ATTENTION[case], seed=sum(map(ord, case)))


def test_paged_attention_fp16_and_fp32(interpreted_kernels):
    _attention(interpreted_kernels, [9], [30], 8, 2, 32, 16, torch.float16, 11, dtype=torch.float16)
    _attention(interpreted_kernels, [1, 1], [30, 7], 8, 2, 32, 16, torch.float32, 12, dtype=torch.float32)


def test_paged_attention_forced_splits(interpreted_kernels):
    """Small key tiles and many splits: masked and unmasked loops, empty splits, the merge kernel."""
    from engine.kernels.attention.paged import AttnConfig
    prefill = AttnConfig(block_m=64, block_n=16, num_warps=4, num_stages=2, num_splits=4, min_tiles=1)
    _attention(interpreted_kernels, [50], [130], 8, 2, 32, 8, BF16, 21, config=prefill)
    _attention(interpreted_kernels, [50, 7], [130, 60], 8, 2, 32, 8, I8, 22, config=prefill)
    decode = AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, num_splits=8, min_tiles=1)
    _attention(interpreted_kernels, [2] * 3, [2, 33, 150], 8, 2, 32, 4, BF16, 23, config=decode)
    # 64 splits of head_dim 256: the merge sums its partials 16 splits at a time
    many = AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, num_splits=64, min_tiles=1)
    _attention(interpreted_kernels, [1, 1], [1000, 90], 6, 1, 256, 16, I8, 24, config=many)
    # the same splits merged by the last split of each tile (fused_merge): 64 splits of head_dim 256 take
    # 2 splits a trip; a non-uniform batch merges BLOCK_M rows, programs past a sequence's tiles never arrive
    fused = dataclasses.replace(decode, fused_merge=True)
    _attention(interpreted_kernels, [2] * 3, [2, 33, 150], 8, 2, 32, 4, BF16, 23, config=fused)
    _attention(interpreted_kernels, [1, 1], [1000, 90], 6, 1, 256, 16, I8, 24,
               config=dataclasses.replace(many, fused_merge=True))
    _attention(interpreted_kernels, [1, 5, 2], [10, 90, 70], 8, 2, 32, 4, BF16, 25, config=fused)


def test_fused_merge_agrees_with_the_merge_kernel_and_rearms(interpreted_kernels):
    """The fused merge sums the same partials as _merge_kernel in another order (fp32 rounding apart), leaves
    every arrival counter at zero (a replayed graph finds them armed), and repeats itself exactly."""
    from engine.kernels.attention import paged as A
    q, kv, ctx = interpreted_kernels.attention_case([4, 4], [75, 200], 8, 2, 32, 8, BF16, BF16, "cpu", seed=31)
    two_kernels = _decode_config(4, 4, num_splits=8)
    a = A.paged_attention(q, kv, ctx, 0.2, config=two_kernels)
    fused = dataclasses.replace(two_kernels, fused_merge=True)
    b = A.paged_attention(q, kv, ctx, 0.2, config=fused)
    assert int(A.merge_counters(q.device).abs().sum()) == 0
    assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-3)
    assert torch.equal(b, A.paged_attention(q, kv, ctx, 0.2, config=fused))


# (tokens, heads, splits, head_dim): all splits in one block (8 x 32, 5 x 64: the one-trip load), and 64 x 256
# summed 16 splits at a time (the loop)
@pytest.mark.parametrize("shape", [(2, 4, 8, 32), (3, 2, 5, 64), (1, 2, 64, 256)], ids=str)
def test_split_merge_drops_empty_splits(interpreted_kernels, shape):
    """Empty splits' never-written accumulator rows hold NaN and infinities: the merge must drop them."""
    r = interpreted_kernels.check_split_merge(*shape, BF16, "cpu", seed=sum(shape))
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


@pytest.mark.parametrize("case", ["prefill_aligned", "prefill_unaligned", "chunk_after_context",
                                  "chunk_after_context_int8_g8", "tile_edges_prefill"])
def test_sdpa_prefill(interpreted_kernels, case):
    """The optional torch route for one-sequence prefill (plain torch: runs as is on the CPU)."""
    query_lens, seq_lens, heads, kv_heads, head_dim, page, kv_dtype = ATTENTION[case]
    q, kv, ctx = interpreted_kernels.attention_case(query_lens, seq_lens, heads, kv_heads, head_dim, page, kv_dtype,
                                                    BF16, "cpu", 3)
    r = interpreted_kernels.check_attention(q, kv, ctx, via_sdpa=True)
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


@pytest.mark.parametrize("kv_dtype", [BF16, I8, torch.float16], ids=["bf16", "int8", "fp16"])
def test_write_kv(interpreted_kernels, kv_dtype):
    for kv_heads, head_dim, page in ((2, 32, 4), (3, 64, 16)):
        r = interpreted_kernels.check_write_kv(23, kv_heads, head_dim, page, kv_dtype, BF16, "cpu", seed=5)
        assert interpreted_kernels.pages_agree(r), r


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(interpreted_kernels, with_residual):
    for hidden in (96, 256):
        r = interpreted_kernels.check_rms_norm(5, hidden, BF16, "cpu", 7, with_residual)
        assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


@pytest.mark.parametrize("kv_dtype", [None, BF16, I8], ids=["no_kv", "kv_bf16", "kv_int8"])
def test_qk_norm_rope(interpreted_kernels, kv_dtype):
    # 8 query heads: one query program per token; 20: three, the last one part masked
    for heads in (8, 20):
        r = interpreted_kernels.check_qk_norm_rope(9, heads, 2, 32, BF16, "cpu", heads, kv_dtype=kv_dtype, page=4)
        assert r["unwritten"] == 0 and r["rel_err"] < TOL and interpreted_kernels.pages_agree(
            r.get("pages", {"mismatches": 0})), r
        assert r.get("mismatches_no_k", 0) == 0, r


def test_silu_and_mul(interpreted_kernels):
    for ffn in (100, 256):
        r = interpreted_kernels.check_silu_and_mul(4, ffn, BF16, "cpu", 9)
        assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


# -- the decode/verify switches of the attention kernel (AttnConfig.prefetch, split counts and key tiles
# off the plan); their twins at real shapes, and inside a replayed CUDA graph, are in test_kernels_gpu.py

def _decode_config(query_len: int, group: int, **kw):
    from engine.kernels.attention.paged import AttnConfig
    block_m = max(16, 1 << (query_len * group - 1).bit_length())
    base = {"block_m": block_m, "block_n": 16, "num_warps": 4, "num_stages": 1, "num_splits": 1, "min_tiles": 1}
    return AttnConfig(**{**base, **kw})


# (query_lens, seq_lens): batch 1 and 3, unequal lengths, none a multiple of the 16-key tile but one;
# 8 heads over 2 KV heads (group 4), head_dim 32, pages of 8 (a tile spans two pages)
DECODE_SHAPES = {
    "decode_b1": ([1], [83]),
    "decode_b3": ([1] * 3, [1, 40, 117]),
    "verify_q4_b1": ([4], [70]),
    "verify_q4_b3": ([4] * 3, [4, 33, 96]),
}
DECODE_VARIANTS = {
    "prefetch1": {"prefetch": 1},
    "prefetch2": {"prefetch": 2},
    "prefetch1_splits4": {"prefetch": 1, "num_splits": 4},
    "prefetch2_splits4_bn32": {"prefetch": 2, "num_splits": 4, "block_n": 32},
    "prefetch1_splits8": {"prefetch": 1, "num_splits": 8},
    "fused_merge_splits8": {"num_splits": 8, "fused_merge": True},
    "prefetch2_fused_merge_splits4_bn32": {"prefetch": 2, "num_splits": 4, "block_n": 32, "fused_merge": True},
}


# every variant over batch 3 (decode and verify) in both page dtypes; batch 1 for a few
DECODE_CASES = [(shape, variant) for variant in DECODE_VARIANTS for shape in ("decode_b3", "verify_q4_b3")] + \
    [("decode_b1", "prefetch1_splits8"), ("verify_q4_b1", "prefetch2")]


@pytest.mark.parametrize("kv_dtype", [BF16, I8], ids=["bf16", "int8"])
@pytest.mark.parametrize("shape,variant", DECODE_CASES, ids=[f"{a}-{b}" for a, b in DECODE_CASES])
def test_decode_variants_match_twin(interpreted_kernels, shape, variant, kv_dtype):
    query_lens, seq_lens = DECODE_SHAPES[shape]
    q, kv, ctx = interpreted_kernels.attention_case(query_lens, seq_lens, 8, 2, 32, 8, kv_dtype, BF16, "cpu",
                                                    seed=sum(map(ord, shape + variant)))
    cfg = _decode_config(query_lens[0], 4, **DECODE_VARIANTS[variant])
    r = interpreted_kernels.check_attention(q, kv, ctx, config=cfg)
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, (cfg, r)


def test_prefetch_with_non_uniform_batch(interpreted_kernels):
    """Mixed query lengths take the bisection map (tiles_per_seq 0), where programs past a sequence's
    tiles return early."""
    q, kv, ctx = interpreted_kernels.attention_case([1, 3, 2], [50, 21, 90], 8, 2, 32, 8, I8, BF16, "cpu", seed=5)
    cfg = dataclasses.replace(_decode_config(3, 4), prefetch=1, num_splits=4)
    r = interpreted_kernels.check_attention(q, kv, ctx, config=cfg)
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, r


def test_prefetch_matches_the_plain_loop(interpreted_kernels):
    """The pipelined loop does the same arithmetic as the plain one, tile by tile."""
    from engine.kernels.attention import paged as A
    q, kv, ctx = interpreted_kernels.attention_case([1, 1], [75, 200], 8, 2, 32, 8, I8, BF16, "cpu", seed=9)
    plain = _decode_config(1, 4, num_splits=2)
    a = A.paged_attention(q, kv, ctx, 0.2, config=plain)
    for depth in (1, 2):
        b = A.paged_attention(q, kv, ctx, 0.2, config=dataclasses.replace(plain, prefetch=depth))
        assert torch.equal(a, b), depth


def test_bf16_long_context_plan_matches_twin(interpreted_kernels):
    """The plan's shape at a small scale: prefetch 1 over splits of several 64-key tiles, bf16 pages."""
    q, kv, ctx = interpreted_kernels.attention_case([1, 1], [700, 300], 8, 2, 32, 16, BF16, BF16, "cpu", seed=11)
    cfg = _decode_config(1, 4, num_splits=2, prefetch=1, num_stages=1, max_regs=128)
    r = interpreted_kernels.check_attention(q, kv, ctx, config=cfg)
    assert r["unwritten"] == 0 and r["rel_err"] < TOL, r
