"""The TMA prefill attention kernel (engine/kernels/attention_prefill.py) against a float64 twin.

CPU, always: `gather_kv` (plain torch) against a per-token gather.
CPU under Triton's interpreter, opt-in as tests/test_kernels_interpret.py (the interpreter runs
tensor descriptors; it is slow and process-wide):
    NINFER_TRITON_INTERPRET_TESTS=1 pytest tests/test_kernels_prefill_tma.py      (~10 s)
GPU (CUDA present, interpreter off): the same cases at their tiny shapes plus qwen3-8b-sized ones,
every launch shape of the sweep in tools/prefill_attention_check.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

INTERPRET = os.environ.get("NINFER_TRITON_INTERPRET_TESTS") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
if INTERPRET and HAVE_TRITON:
    os.environ["TRITON_INTERPRET"] = "1"
CUDA = torch.cuda.is_available() and not INTERPRET
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
        name = "engine.kernels.attention_prefill"
        return importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    return importlib.import_module("engine.kernels.attention_prefill")


def _patch_interpreter() -> None:
    """tools.kernel_checks.patch_interpreter (bf16 rounding and dots), plus: its masked-load patch
    takes no keywords, which the interpreter's descriptor load passes (Triton 3.9)."""
    from triton.runtime import interpreter

    from tools.kernel_checks import patch_interpreter
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
    from tools.kernel_checks import attention_case, rel_err
    q, kv, ctx = attention_case([30, 9], [75, 9], 4, 2, 32, 16, torch.bfloat16, torch.bfloat16, "cpu", seed=4)
    out = P.prefill_from_pages(q, kv.k, kv.v, ctx.block_tables, [30, 9], [75, 9], 32 ** -0.5, config=_small(P))
    ref = paged_attention_reference(q.double(), kv, ctx, 32 ** -0.5)
    assert rel_err(out, ref) < TOL


def test_gather_kv():
    """Plain torch: whole pages, a cut last page, several sequences, into a preallocated buffer."""
    from engine.kv_pages import gather_kv
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

    from engine.forward_context import build_forward_context
    from engine.kv_pages import gather_kv
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
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tools.prefill_attention_check import sweep_configs
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
    from engine.kernels import attention as A
    from engine.layers.attention import paged_attention_reference
    from tools.kernel_checks import attention_case, rel_err
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
    q8, kv8, ctx8 = attention_case([500], [3000], 32, 8, 128, 16, torch.int8, torch.bfloat16, "cuda", seed=7)
    assert not A.takes_tma_prefill(q8, kv8, ctx8)
    qd, kvd, ctxd = attention_case([1, 1], [3000, 64], 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, "cuda", seed=8)
    assert not A.takes_tma_prefill(qd, kvd, ctxd)
    # float32 (the engine allows it on CUDA): the paged kernel, not an error
    q32, kv32, ctx32 = attention_case([300], [300], 32, 8, 128, 16, torch.float32, torch.float32, "cuda", seed=10)
    assert not A.takes_tma_prefill(q32, kv32, ctx32)
    assert rel_err(A.paged_attention(q32, kv32, ctx32, scale), paged_attention_reference(q32, kv32, ctx32, scale)) < TOL
    # a short chunk after a long context (a new turn over a cached prefix): too little attention for the gather
    qs, kvs, ctxs = attention_case([64], [30000], 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, "cuda", seed=11)
    assert not A.takes_tma_prefill(qs, kvs, ctxs)
