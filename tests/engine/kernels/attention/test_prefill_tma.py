"""The TMA prefill attention kernel (engine/kernels/attention/prefill_tma.py) against a float64 twin.

CPU, always: `gather_kv` (plain torch) against a per-token gather.
CPU under Triton's interpreter, opt-in as tests/engine/kernels/test_interpret.py (the interpreter runs
tensor descriptors; it is slow and process-wide):
    NINFER_TRITON_INTERPRET_TESTS=1 pytest tests/engine/kernels/attention/test_prefill_tma.py      (~10 s)
GPU (CUDA present, interpreter off): the same cases at their tiny shapes plus qwen3-8b-sized ones,
every launch shape of the sweep in tools/dev/prefill_attention_check.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

from engine import envs
from tests.support.kernel_backend import CUDA as HAVE_CUDA

INTERPRET = envs.TRITON_INTERPRET_TESTS.read()
HAVE_TRITON = importlib.util.find_spec("triton") is not None
if INTERPRET and HAVE_TRITON:
    os.environ["TRITON_INTERPRET"] = "1"
CUDA = HAVE_CUDA and not INTERPRET
TOL = 1e-2                                   # relative L2 error, as the other kernel tests

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")


def _interpreter_version_ok() -> bool:
    from importlib.metadata import version
    return tuple(int(p) for p in version("triton").split(".")[:2] if p.isdigit()) >= (3, 9)


@pytest.fixture(scope="module")
def P():
    """The kernel module, (re)defined under the interpreter when the CPU tests are on."""
    if INTERPRET:
        if not _interpreter_version_ok():
            pytest.skip("needs the interpreter of Triton >= 3.9")
        _patch_interpreter()
        name = "engine.kernels.attention.prefill_tma"
        return importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    return importlib.import_module("engine.kernels.attention.prefill_tma")


def _patch_interpreter() -> None:
    """tests.support.kernel_checks.patch_interpreter (bf16 rounding and dots), plus: its masked-load patch
    takes no keywords, which the interpreter's descriptor load passes (Triton 3.9)."""
    from triton.runtime import interpreter

    from tests.support.kernel_checks import patch_interpreter
    patch_interpreter()
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_prefill_tma_patched", False):
        return
    load = builder.create_masked_load
    builder.create_masked_load = (lambda self, ptrs, mask, other=None, cache_policy=None, is_volatile=False:
                                  load(self, ptrs, mask, other, cache_policy, is_volatile))
    builder._prefill_tma_patched = True


def reference(q, k, v, qlens, klens, scale):
    """float64 causal attention, query i of a sequence at position k_len - q_len + i.
    q: [Tq, H, D]; k, v: [Tk, KVH, D] -> [Tq, H, D] float64."""
    out, aq, ak = [], 0, 0
    g = q.shape[1] // k.shape[1]
    for a, b in zip(qlens, klens):
        qq = q[aq:aq + a].double().transpose(0, 1)                                  # [H, a, D]
        kk = k[ak:ak + b].double().repeat_interleave(g, 1).transpose(0, 1)         # [H, b, D]
        vv = v[ak:ak + b].double().repeat_interleave(g, 1).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) * scale
        visible = torch.arange(b)[None, :] <= (torch.arange(a) + b - a)[:, None]
        s = s.masked_fill(~visible.to(s.device), float("-inf"))
        out.append((s.softmax(-1) @ vv).transpose(0, 1))
        aq, ak = aq + a, ak + b
    return torch.cat(out)


def _cu(lens, device):
    c = torch.zeros(len(lens) + 1, dtype=torch.int32)
    c[1:] = torch.cumsum(torch.tensor(lens), 0)
    return c.to(device)


def _run(P, qlens, klens, heads, kv_heads, head_dim, device, seed, config=None, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    # q ~ N(0, 4^2): a peaked softmax, so a wrong key range or mask shows
    q = (torch.randn(sum(qlens), heads, head_dim, generator=gen) * 4).to(dtype).to(device)
    k = torch.randn(sum(klens), kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(sum(klens), kv_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    P.prefill_attention(q, k, v, _cu(qlens, device), _cu(klens, device), max(qlens), scale, out=out, config=config)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), qlens, klens, scale)
    assert not torch.isnan(out).any(), "rows left unwritten (or NaN)"
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert err < TOL, err


def _small(P, **kw):
    # tiny tiles, so the tiny cases cross several tiles, the diagonal and sequence ends
    return P.PrefillConfig(**dict(dict(block_m=16, block_n=16, num_warps=4, num_stages=2), **kw))


# (query_lens, key_lens, heads, kv_heads, head_dim)
CASES = {
    "no_context_aligned": ([64], [64], 4, 2, 32),
    "chunk_after_context": ([37], [100], 4, 2, 32),            # 37, 100: not multiples of 16
    "chunk_after_context_g8": ([21], [66], 8, 1, 64),
    "packed_varlen": ([45, 16, 29], [110, 16, 79], 4, 2, 32),   # a prompt's tail, a whole prompt, a chunk
    "packed_with_single_queries": ([1, 33, 1], [50, 33, 17], 4, 2, 32),
    "head_dim_128": ([19, 40], [60, 40], 4, 2, 128),
}


def _cpu_only():
    if not (INTERPRET and HAVE_TRITON):
        pytest.skip("interpreter tests are opt-in: NINFER_TRITON_INTERPRET_TESTS=1")


@needs_triton
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_interpreted(P, case):
    _cpu_only()
    _run(P, *CASES[case], "cpu", seed=sum(map(ord, case)), config=_small(P))


@needs_triton
@pytest.mark.parametrize("shape", [dict(block_m=32, block_n=16), dict(block_m=32, block_n=16, tma_store=False)],
                         ids=["bm32_bn16", "masked_store"])
def test_interpreted_shapes(P, shape):
    """BLOCK_M > BLOCK_N (several diagonal tiles), the pointer store."""
    _cpu_only()
    _run(P, [45, 16, 29], [110, 16, 79], 4, 2, 32, "cpu", seed=5, config=_small(P, **shape))


@needs_triton
def test_interpreted_head_dim_256(P):
    _cpu_only()
    _run(P, [20], [45], 6, 1, 256, "cpu", seed=9, config=_small(P))


@needs_triton
def test_interpreted_from_pages(P):
    """gather_kv + kernel against the engine's paged-attention twin on shuffled pages."""
    _cpu_only()
    from engine.layers.attention import paged_attention_reference
    from tests.support.kernel_checks import attention_case, rel_err
    q, kv, ctx = attention_case([30, 9], [75, 9], 4, 2, 32, 16, torch.bfloat16, torch.bfloat16, "cpu", seed=4)
    out = P.prefill_from_pages(q, kv.k, kv.v, ctx.block_tables, [30, 9], [75, 9], 32 ** -0.5, config=_small(P))
    ref = paged_attention_reference(q.double(), kv, ctx, 32 ** -0.5)
    assert rel_err(out, ref) < TOL


@needs_triton
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("lens", [([40], [200]), ([40], [72]), ([64], [64])], ids=["segments", "two", "one"])
def test_interpreted_segments(P, kv_dtype, lens):
    """prefill_segments: keys in segments of 32 (the last from the boundary before the chunk to its end), the
    float32 state carried across launches, against the twin. 200 keys after 160: segments [0,32) .. [128,160)
    then [160,200); 72 after 32: [0,32) then [32,72); 64 of 64: one causal segment."""
    _cpu_only()
    from engine.layers.attention import paged_attention_reference
    from tests.support.kernel_checks import attention_case, rel_err
    q, kv, ctx = attention_case(*lens, 4, 2, 32, 16, kv_dtype, torch.bfloat16, "cpu", seed=12)
    q = (q.float() * 4).to(torch.bfloat16)                        # a peaked softmax: a wrong key range shows
    out = torch.full_like(q, float("nan"))
    P.prefill_segments(q, kv, ctx, 32 ** -0.5, 32, out=out, config=_small(P))
    ref = paged_attention_reference(q.double(), kv, ctx, 32 ** -0.5)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL
    seg = ctx.segment_plan(16, 32)
    assert seg.bounds[-1][1] == lens[1][0] and all(hi - lo == 32 for lo, hi in seg.bounds[:-1])


@needs_triton
def test_interpreted_segments_head_dim_256(P):
    """Qwen3.5's gated attention shape (group 4, head_dim 256) through the segments."""
    _cpu_only()
    from engine.layers.attention import paged_attention_reference
    from tests.support.kernel_checks import attention_case, rel_err
    q, kv, ctx = attention_case([20], [90], 4, 1, 256, 16, torch.bfloat16, torch.bfloat16, "cpu", seed=16)
    out = P.prefill_segments(q, kv, ctx, 256 ** -0.5, 32, config=_small(P))
    assert rel_err(out, paged_attention_reference(q.double(), kv, ctx, 256 ** -0.5)) < TOL


def test_segment_plan():
    """Segments of segment_keys up to the chunk's first token, then one to the end; each gathers its own pages."""
    from engine.worker.paged_kv import gather_kv, segment_plan
    gen = torch.Generator().manual_seed(3)
    page, kvh, d = 4, 2, 8
    pk = torch.randn(40, page, kvh, d, generator=gen)
    table = torch.randperm(40, generator=gen).int()[None, :]
    for seq_len, q_len, seg_keys, want in [(50, 10, 8, [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 50)]),
                                           (50, 11, 8, [(0, 8), (8, 16), (16, 24), (24, 32), (32, 50)]),
                                           (12, 12, 8, [(0, 12)]), (17, 1, 16, [(0, 16), (16, 17)])]:
        plan = segment_plan(table, seq_len, q_len, page, seg_keys)
        assert list(plan.bounds) == want
        whole = pk[table[0].long()].flatten(0, 1)                 # [keys, kvh, d] in position order
        for (lo, hi), g in zip(plan.bounds, plan.gathers):
            k, _, cu = gather_kv(pk, pk, table, [hi - lo], plan=g)
            assert torch.equal(k, whole[lo:hi]) and cu.tolist() == [0, hi - lo]
    with pytest.raises(ValueError, match="multiple of the page"):
        segment_plan(table, 50, 10, page, 6)


@needs_triton
def test_interpreted_dequant_rows(P):
    """The int8 gather kernel equals the torch gather bit for bit (same float32 product, same rounding),
    a cut last page and 3 KV heads (not a power of two) included."""
    _cpu_only()
    from engine.kernels.attention.kv_dequant import dequant_rows
    gen = torch.Generator().manual_seed(4)
    blocks, page, kvh, d = 9, 4, 3, 16
    pages = torch.randint(-127, 128, (blocks, page, kvh, d), generator=gen, dtype=torch.int8)
    scales = torch.rand(blocks, page, kvh, generator=gen) * 0.03
    ids = torch.tensor([5, 0, 7, 2])
    for rows in (16, 13):
        out = torch.full((rows, kvh, d), float("nan"), dtype=torch.bfloat16)
        dequant_rows(pages, scales, ids, rows, out)
        want = (pages[ids].float() * scales[ids].unsqueeze(-1)).flatten(0, 1)[:rows].to(torch.bfloat16)
        assert torch.equal(out, want)
    with pytest.raises(ValueError, match="rows from"):
        dequant_rows(pages, scales, ids, 17, torch.empty(17, kvh, d, dtype=torch.bfloat16))


def test_gather_kv():
    """Plain torch: whole pages, a cut last page, several sequences, into a preallocated buffer."""
    from engine.worker.paged_kv import gather_kv
    gen = torch.Generator().manual_seed(1)
    page, kvh, d = 4, 2, 8
    lens = [9, 4, 1]
    blocks = 10
    pk = torch.randn(blocks, page, kvh, d, generator=gen)
    pv = torch.randn(blocks, page, kvh, d, generator=gen)
    perm = torch.randperm(blocks, generator=gen)
    tables = torch.zeros(3, 4, dtype=torch.int32)
    tables[0, :3], tables[1, :1], tables[2, :1] = perm[:3].int(), perm[3:4].int(), perm[4:5].int()

    def want(pages, ls):                     # token by token through the table
        return torch.cat([torch.stack([pages[tables[b, t // page], t % page] for t in range(n)])
                          for b, n in enumerate(ls)])

    for ls in (lens, lens[:1], [8], [8, 4]):
        k, v, cu = gather_kv(pk, pv, tables[:len(ls)], ls)
        assert torch.equal(k, want(pk, ls)) and torch.equal(v, want(pv, ls))
        assert cu.tolist() == [0] + torch.tensor(ls).cumsum(0).tolist()
    buf = (torch.empty(20, kvh, d), torch.empty(20, kvh, d))
    k, v, _ = gather_kv(pk, pv, tables, lens, out=buf)
    assert k.data_ptr() == buf[0].data_ptr() and v.data_ptr() == buf[1].data_ptr()
    assert torch.equal(k, want(pk, lens)) and torch.equal(v, want(pv, lens))
    # int8 pages with per-token scales: dequantized as the engine's twin does
    qk = torch.randint(-127, 128, pk.shape, generator=gen, dtype=torch.int8)
    sk = torch.rand(pk.shape[:3], generator=gen) * 0.02
    k, v, _ = gather_kv(qk, qk, tables, lens, scales_k=sk, scales_v=sk, dtype=torch.float32)
    assert torch.allclose(k, want(qk.float() * sk.unsqueeze(-1), lens)) and k.dtype == torch.float32


def test_a_forward_builds_its_gather_plan_once():
    """Every layer of a prefill forward gathers by the same pages: the context builds the plan for the first
    layer and hands the same one to the rest, and a gather by it equals one that builds its own."""
    from dataclasses import replace

    from engine.worker.forward_context import build_forward_context
    from engine.worker.paged_kv import gather_kv
    gen = torch.Generator().manual_seed(2)
    page, kvh, d = 4, 2, 8
    pk, pv = torch.randn(12, page, kvh, d, generator=gen), torch.randn(12, page, kvh, d, generator=gen)
    _, ctx = build_forward_context([3, 2], [9, 6], [[5, 0, 7], [2, 11]], page, torch.device("cpu"))
    plan = ctx.gather_plan(page)
    assert ctx.gather_plan(page) is plan
    k, v, cu = gather_kv(pk, pv, ctx.block_tables, [9, 6], plan=plan)
    k2, v2, cu2 = gather_kv(pk, pv, ctx.block_tables, [9, 6])
    assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(cu, cu2) and k.shape[0] == 15
    # a context made from another (dataclasses.replace) starts with no plan of its own
    other = replace(ctx, host_seq_lens=(8, 6))
    assert other.gather_plan(page) is not plan and other.gather_plan(page).total == 14


# -- GPU ---------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs CUDA (and the interpreter off)")


@needs_cuda
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_gpu_small(P, case):
    _run(P, *CASES[case], "cuda", seed=sum(map(ord, case)))
    _run(P, *CASES[case], "cuda", seed=1, config=P.PrefillConfig(block_m=64, block_n=64, num_warps=4))


def _sweep():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
    from tools.dev.prefill_attention_check import sweep_configs
    return sweep_configs()


@needs_cuda
@pytest.mark.parametrize("name", list(_sweep()) if CUDA and HAVE_TRITON else ["none"])
def test_gpu_qwen3_shapes(P, name):
    """Packed varlen at qwen3-8b heads, every launch shape of the sweep."""
    _run(P, [300, 1000, 77], [1000, 1000, 2077], 32, 8, 128, "cuda", seed=2, config=_sweep()[name])


@needs_cuda
def test_gpu_head_dim_256(P):
    _run(P, [700, 33], [1200, 33], 24, 4, 256, "cuda", seed=3)


@needs_cuda
def test_gpu_paged_attention_routes_prefill_to_tma(P, monkeypatch):
    """The engine's entry (`paged_attention`) sends a bf16 prefill with host lengths to gather + the
    TMA kernel; its output matches the paged kernel (forced by an explicit plan) and the twin. Decode
    shapes, int8 pages, a context without host lengths and NINFER_PREFILL_TMA=0 stay on the paged kernel."""
    import dataclasses
    from engine.kernels.attention import paged as A
    from engine.layers.attention import paged_attention_reference
    from tests.support.kernel_checks import attention_case, rel_err
    scale = 128 ** -0.5
    q, kv, ctx = attention_case([500, 64], [3000, 64], 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, "cuda", seed=6)
    assert A.takes_tma_prefill(q, kv, ctx)
    routed = A.paged_attention(q, kv, ctx, scale)
    paged = A.paged_attention(q, kv, ctx, scale, config=A.plan(q, kv, ctx))
    twin = paged_attention_reference(q.float(), kv, ctx, scale)
    assert rel_err(routed, paged) < TOL and rel_err(routed, twin) < TOL
    assert not A.takes_tma_prefill(q, kv, dataclasses.replace(ctx, host_seq_lens=None))
    monkeypatch.setenv("NINFER_PREFILL_TMA", "0")
    assert not A.takes_tma_prefill(q, kv, ctx)
    monkeypatch.delenv("NINFER_PREFILL_TMA")
    # int8 pages: dequantized by the gather (engine/kernels/attention/kv_dequant.py), then the same kernel
    q8, kv8, ctx8 = attention_case([500], [3000], 32, 8, 128, 16, torch.int8, torch.bfloat16, "cuda", seed=7)
    assert A.takes_tma_prefill(q8, kv8, ctx8)
    routed8 = A.paged_attention(q8, kv8, ctx8, scale)
    assert rel_err(routed8, paged_attention_reference(q8.float(), kv8, ctx8, scale)) < TOL
    assert rel_err(routed8, A.paged_attention(q8, kv8, ctx8, scale, config=A.plan(q8, kv8, ctx8))) < TOL
    monkeypatch.setattr(A, "PREFILL_TMA_INT8", False)
    assert not A.takes_tma_prefill(q8, kv8, ctx8)
    monkeypatch.undo()
    qd, kvd, ctxd = attention_case([1, 1], [3000, 64], 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, "cuda", seed=8)
    assert not A.takes_tma_prefill(qd, kvd, ctxd)
    # float32 (the engine allows it on CUDA): the paged kernel, not an error
    q32, kv32, ctx32 = attention_case([300], [300], 32, 8, 128, 16, torch.float32, torch.float32, "cuda", seed=10)
    assert not A.takes_tma_prefill(q32, kv32, ctx32)
    assert rel_err(A.paged_attention(q32, kv32, ctx32, scale), paged_attention_reference(q32, kv32, ctx32, scale)) < TOL
    # a short chunk after a long context (a new turn over a cached prefix): too little attention for the gather
    qs, kvs, ctxs = attention_case([64], [30000], 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, "cuda", seed=11)
    assert not A.takes_tma_prefill(qs, kvs, ctxs) and not A.prefill_segment_keys(qs, kvs, ctxs)
    # one sequence with PREFILL_SEGMENT_MIN_QUERIES new tokens after a long prefix: too few queries per key for
    # the per-key rule, but the query-count rule gathers it (one segment: its keys fit one gather)
    ql, kvl, ctxl = attention_case([1024], [39000], 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, "cuda", seed=19)
    keys = A.prefill_segment_keys(ql, kvl, ctxl)
    assert not A.takes_tma_prefill(ql, kvl, ctxl) and keys and len(ctxl.segment_plan(16, keys).bounds) == 1
    assert rel_err(A.paged_attention(ql, kvl, ctxl, scale), paged_attention_reference(ql.float(), kvl, ctxl, scale)) < TOL


@needs_cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_gpu_long_prefill_takes_segments(P, monkeypatch, kv_dtype):
    """One sequence past the gather bound takes the kernel segment by segment: equal to the paged kernel and the
    twin; several sequences, fewer than PREFILL_SEGMENT_MIN_QUERIES new tokens, and NINFER_PREFILL_TMA=0 stay on
    the paged kernel. The bound shrunk to 22 MB: 1.5 x 22 MB less the 18.3 MB float32 state of 1,100 tokens x 32
    heads leaves 3,979 keys of 4 KB, less the 1,100 new ones: segments of 2,816, three of them over 9,000 keys."""
    from engine.kernels.attention import paged as A
    from engine.layers.attention import paged_attention_reference
    from tests.support.kernel_checks import attention_case, rel_err
    scale = 128 ** -0.5
    monkeypatch.setattr(A, "PREFILL_GATHER_MAX_BYTES", 22 << 20)
    monkeypatch.setattr(A, "SEGMENT_MIN_KEYS", 256)
    q, kv, ctx = attention_case([1100], [9000], 32, 8, 128, 16, kv_dtype, torch.bfloat16, "cuda", seed=13)
    assert not A.takes_tma_prefill(q, kv, ctx)
    keys = A.prefill_segment_keys(q, kv, ctx)
    assert keys == 2816 and len(ctx.segment_plan(16, keys).bounds) == 3
    routed = A.paged_attention(q, kv, ctx, scale)
    twin = paged_attention_reference(q.float(), kv, ctx, scale)
    assert rel_err(routed, twin) < TOL
    assert rel_err(routed, A.paged_attention(q, kv, ctx, scale, config=A.plan(q, kv, ctx))) < TOL
    qb, kvb, ctxb = attention_case([1100, 64], [9000, 64], 32, 8, 128, 16, kv_dtype, torch.bfloat16, "cuda", seed=14)
    assert not A.prefill_segment_keys(qb, kvb, ctxb)
    qs, kvs, ctxs = attention_case([1000], [9000], 32, 8, 128, 16, kv_dtype, torch.bfloat16, "cuda", seed=15)
    assert not A.prefill_segment_keys(qs, kvs, ctxs)
    monkeypatch.setenv("NINFER_PREFILL_TMA", "0")
    assert not A.prefill_segment_keys(q, kv, ctx)


@needs_cuda
def test_gpu_head_dim_256_takes_tma_routes(P, monkeypatch):
    """head_dim 256 (qwen3.5-27b's gated attention at TP=1: 24 q heads, 4 KV heads) takes the TMA routes while
    PREFILL_TMA_HEAD_DIMS holds it (the default; NINFER_PREFILL_TMA_HD256=0 takes it out): the whole gather and
    the segments match the paged kernel and the twin, bf16 and int8 pages."""
    from engine.kernels.attention import paged as A
    from engine.layers.attention import paged_attention_reference
    from tests.support.kernel_checks import attention_case, rel_err
    scale = 256 ** -0.5
    for kv_dtype, seed in ((torch.bfloat16, 17), (torch.int8, 18)):
        q, kv, ctx = attention_case([1200], [7000], 24, 4, 256, 16, kv_dtype, torch.bfloat16, "cuda", seed=seed)
        monkeypatch.setattr(A, "PREFILL_TMA_HEAD_DIMS", (128,))
        assert not A.takes_tma_prefill(q, kv, ctx) and not A.prefill_segment_keys(q, kv, ctx)
        monkeypatch.setattr(A, "PREFILL_TMA_HEAD_DIMS", (128, 256))
        twin = paged_attention_reference(q.float(), kv, ctx, scale)
        paged = A.paged_attention(q, kv, ctx, scale, config=A.plan(q, kv, ctx))
        assert A.takes_tma_prefill(q, kv, ctx)
        assert rel_err(A.paged_attention(q, kv, ctx, scale), twin) < TOL
        # 26 MiB < 7,000 keys of 4,096 B (28.7 MB); 1.5 x 26 MiB less the 29.7 MB state leaves 2,727 keys, less
        # the 1,200 new ones: segments of 1,280
        monkeypatch.setattr(A, "PREFILL_GATHER_MAX_BYTES", 26 << 20)
        monkeypatch.setattr(A, "SEGMENT_MIN_KEYS", 256)
        assert not A.takes_tma_prefill(q, kv, ctx) and A.prefill_segment_keys(q, kv, ctx) == 1280
        routed = A.paged_attention(q, kv, ctx, scale)
        assert rel_err(routed, twin) < TOL and rel_err(routed, paged) < TOL
        monkeypatch.undo()


@needs_cuda
def test_gpu_int8_gather_equals_the_torch_gather():
    """On CUDA gather_kv dequantizes int8 pages with kv_dequant.py; the CPU's torch path gives the same bits, for
    one sequence and for several with cut last pages (the packed `keep` path)."""
    from engine.worker.paged_kv import gather_kv
    from tests.support.kernel_checks import attention_case
    for qlens, klens in (([1], [1000]), ([1, 1, 1], [37, 300, 129])):
        _, kv, ctx = attention_case(qlens, klens, 32, 8, 128, 16, torch.int8, torch.bfloat16, "cuda", seed=20)
        k, v, cu = gather_kv(kv.k, kv.v, ctx.block_tables, klens, scales_k=kv.k_scale, scales_v=kv.v_scale,
                             dtype=torch.bfloat16)
        kc, vc, cuc = gather_kv(kv.k.cpu(), kv.v.cpu(), ctx.block_tables.cpu(), klens, scales_k=kv.k_scale.cpu(),
                                scales_v=kv.v_scale.cpu(), dtype=torch.bfloat16)
        assert torch.equal(k.cpu(), kc) and torch.equal(v.cpu(), vc) and torch.equal(cu.cpu(), cuc.to(cu.dtype))
