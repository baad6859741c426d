"""Checks of the kernels against their torch twins, shared by tests/engine/kernels/attention/test_paged_gpu.py, the
interpreter tests and tools/dev/gpu_kernel_suite.py.

Every check draws fresh random inputs (never zeros), poisons the kernel's outputs with NaN before
the run, and reports the relative error ||out - ref|| / ||ref|| against the twin evaluated in
float64 (attention) or in the model dtype (the elementwise kernels, whose twins round in bf16 at the
same points), plus how many output elements were left unwritten.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.worker.forward_context import ForwardContext, build_forward_context
from engine.worker.paged_kv import LayerKV
from engine.layers.attention import paged_attention_reference, write_kv_reference


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def unwritten(out: torch.Tensor) -> int:
    return int(torch.isnan(out.float()).sum())


def patch_interpreter() -> None:
    """Fixes to Triton's interpreter (3.9) that the compiled path does not need:
    - float32 -> bf16 casts truncate; the GPU rounds to nearest even: round here too;
    - int -> bf16 casts store the integer as raw bits: go through float32;
    - a dot of bf16 operands multiplies their raw uint16 bits: widen them to float32 first;
    - a comparison of a scalar yields int64 data, which a load/store mask then rejects: cast to bool;
    - (3.6) a scalar argument is a 1-element array, which `int()` refuses under numpy 2 when it bounds a
      `range` loop: take its one element.
    Only for TRITON_INTERPRET=1 runs (tests on a CPU).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_ninfer_patched", False):
        return
    cast, dot = builder.cast_impl, builder.create_dot
    load, store = builder.create_masked_load, builder.create_masked_store
    Handle = interpreter.TensorHandle

    def to_f32(h):
        if h.dtype.scalar == tl.bfloat16:
            return Handle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return Handle(h.data.astype(np.float32), tl.float32)

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar != tl.bfloat16:
            bits = to_f32(src).data.astype(np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(to_f32(src).data)
            return Handle(np.where(nan, np.uint16(0x7FC0), rounded), tl.bfloat16)
        return cast(self, src, dst_type)

    def widen(h):
        return to_f32(h) if h.dtype.scalar == tl.bfloat16 else h

    def as_bool(m):
        if isinstance(m, np.ndarray):           # a descriptor load's mask comes as a bare array
            return Handle(m.astype(np.bool_), tl.int1)
        return m if m.data.dtype == np.bool_ else Handle(m.data.astype(np.bool_), tl.int1)

    builder.cast_impl = cast_impl
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_trunc"):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    builder.create_dot = lambda self, a, b, d, *args: dot(self, widen(a), widen(b), d, *args)
    # (the descriptor loads pass their trailing arguments by keyword)
    builder.create_masked_load = lambda self, ptrs, mask, *args, **kw: load(self, ptrs, as_bool(mask), *args, **kw)
    builder.create_masked_store = lambda self, ptrs, value, mask, *args, **kw: store(self, ptrs, value, as_bool(mask),
                                                                                     *args, **kw)
    patch_lang_tensor = interpreter._patch_lang_tensor

    def scalar_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    interpreter._patch_lang_tensor = scalar_index
    builder._ninfer_patched = True


# -- attention -----------------------------------------------------------------------------------

def random_kv(num_blocks: int, page: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
              device, gen: torch.Generator) -> LayerKV:
    """Pages full of random values (stale data in unused slots is random too, as in a live pool),
    drawn on the device from a generator seeded by `gen`."""
    shape = (num_blocks, page, kv_heads, head_dim)
    g = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    if kv_dtype == torch.int8:
        k, v = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8, device=device) for _ in range(2))
        ks, vs = (torch.rand(shape[:3], generator=g, device=device) * 0.02 + 0.004 for _ in range(2))
        return LayerKV(k, v, ks, vs)
    k, v = (torch.randn(shape, generator=g, device=device).to(kv_dtype) for _ in range(2))
    return LayerKV(k, v)


def attention_case(query_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                   page: int, kv_dtype: torch.dtype, dtype: torch.dtype, device, seed: int,
                   spare_blocks: int = 3) -> tuple[torch.Tensor, LayerKV, ForwardContext]:
    """q [T, heads, head_dim] and a KV pool whose pages sit at shuffled block ids per sequence."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // page) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    kv = random_kv(num_blocks, page, kv_heads, head_dim, kv_dtype, device, gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    _, ctx = build_forward_context(query_lens, seq_lens, tables, page, torch.device(device))
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype).to(device)
    return q, kv, ctx


def check_attention(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext, scale: float | None = None,
                    config=None, via_sdpa: bool = False) -> dict:
    """paged_attention (or, with via_sdpa, the gather + torch SDPA prefill path) against the twin."""
    from engine.kernels.attention.paged import paged_attention
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.full_like(q, float("nan"))
    if via_sdpa:
        sdpa_prefill(q, kv, ctx, scale, out=out)
    else:
        paged_attention(q, kv, ctx, scale, out=out, config=config)
    # float64 on the CPU; on CUDA float32 (SDPA's memory-efficient kernel: no [T, keys] matrix per head)
    ref = paged_attention_reference(q.double() if q.device.type == "cpu" else q.float(), kv, ctx, scale)
    return {"rel_err": rel_err(out, ref), "unwritten": unwritten(out)}


def check_split_merge(tokens: int, heads: int, splits: int, head_dim: int, dtype: torch.dtype, device,
                      seed: int) -> dict:
    """The split-K merge alone, against a float64 twin, over partial states where about 40 % of the splits
    are empty (m = -1e30, l = 0) and their never-written accumulator rows hold NaN and infinities, as a
    reused workspace may: none of it may reach the output. Every (token, head) keeps one live split."""
    from engine.kernels.attention.paged import merge_splits
    gen = torch.Generator().manual_seed(seed)
    pm = torch.randn(tokens, heads, splits, generator=gen) * 8
    pl = torch.rand(tokens, heads, splits, generator=gen) * 50 + 0.1
    pacc = torch.randn(tokens, heads, splits, head_dim, generator=gen) * 30
    empty = torch.rand(tokens, heads, splits, generator=gen) < 0.4
    empty[..., torch.randint(0, splits, (), generator=gen)] = False
    pm[empty], pl[empty] = -1.0e30, 0.0
    m_ref = torch.where(empty, float("-inf"), pm).double().amax(-1, keepdim=True)
    w = torch.where(empty, 0.0, torch.exp2(pm.double() - m_ref))
    ref = (w[..., None] * pacc.double()).sum(2) / (w * pl.double()).sum(-1, keepdim=True)
    pacc[empty] = float("nan")
    pacc[..., 0][empty] = float("inf")
    pacc[..., -1][empty] = -float("inf")
    out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype, device=device)
    merge_splits(pacc.to(device), pm.to(device), pl.to(device), out)
    return {"rel_err": rel_err(out, ref.to(device)), "unwritten": unwritten(out)}


def check_write_kv(num_tokens: int, kv_heads: int, head_dim: int, page: int, kv_dtype: torch.dtype,
                   dtype: torch.dtype, device, seed: int, skip_every: int = 3) -> dict:
    """Random K/V written to shuffled slots, every `skip_every`-th slot -1; the whole pool (slots
    not written must keep their old random contents) has to equal the twin's result exactly."""
    from engine.kernels.attention.paged import write_kv
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // page) + 2
    kv = random_kv(num_blocks, page, kv_heads, head_dim, kv_dtype, device, gen)
    ref = LayerKV(*(t.clone() if t is not None else None for t in (kv.k, kv.v, kv.k_scale, kv.v_scale)))
    # k, v as views with a row stride, like the qkv projection's split output
    qkv = (torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen) * 3).to(dtype).to(device)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slots[::skip_every] = -1
    slots = slots.to(device)
    write_kv(kv, k, v, slots)
    write_kv_reference(ref, k, v, slots)
    return compare_pages(kv, ref)


def compare_pages(kv: LayerKV, ref: LayerKV) -> dict:
    """Pages against the twin's. Float pages must match bit for bit. int8 pages may differ by one
    quantum where torch's CUDA division and Triton's div_rn round a quotient near .5 apart (seen
    on the H200: 2,872 of 8.4M bytes); scales must match to float32 rounding."""
    bad = int((kv.k != ref.k).sum() + (kv.v != ref.v).sum())
    out = {"mismatches": bad}
    if kv.quantized:
        step = max(int((kv.k.int() - ref.k.int()).abs().max()), int((kv.v.int() - ref.v.int()).abs().max()))
        scale_rel = max(float(((kv.k_scale - ref.k_scale).abs() / ref.k_scale.abs().clamp(min=1e-30)).max()),
                        float(((kv.v_scale - ref.v_scale).abs() / ref.v_scale.abs().clamp(min=1e-30)).max()))
        out.update(max_step=step, mismatch_fraction=bad / (kv.k.numel() + kv.v.numel()), scale_rel=scale_rel)
    return out


def pages_agree(r: dict) -> bool:
    if "max_step" not in r:
        return r["mismatches"] == 0
    return r["max_step"] <= 1 and r["mismatch_fraction"] <= 1e-3 and r["scale_rel"] <= 1e-6


def check_decode_graph(heads: int, kv_heads: int, head_dim: int, page: int, kv_dtype: torch.dtype,
                       dtype: torch.dtype, seed: int, batch: int = 4, query_len: int = 1, max_blocks: int = 64) -> dict:
    """Capture write_kv + paged_attention for a decode batch once, then change q, K/V, slots,
    seq_lens and block tables in the static buffers and replay: the replay must equal an eager run
    on the new values (bit for bit: same kernels, same plan) and the reference."""
    from engine.kernels.attention.paged import paged_attention, write_kv
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max_blocks * batch + 8
    kv = random_kv(num_blocks, page, kv_heads, head_dim, kv_dtype, dev, gen)
    T = batch * query_len
    scale = head_dim ** -0.5

    def draw(lens: list[int]):
        perm = torch.randperm(num_blocks, generator=gen)
        tables = [perm[i * max_blocks:(i + 1) * max_blocks].tolist() for i in range(batch)]
        _, ctx = build_forward_context([query_len] * batch, lens, tables, page, dev)
        q = torch.randn(T, heads, head_dim, generator=gen).to(dtype).to(dev)
        kvn = torch.randn(2, T, kv_heads, head_dim, generator=gen).to(dtype).to(dev)
        return q, kvn, ctx

    cap = max_blocks * page
    q, kvn, ctx = draw([min(cap, 40 + 7 * i) for i in range(batch)])
    static = ForwardContext(ctx.slot_mapping.clone(), ctx.query_start_loc.clone(), ctx.seq_lens.clone(),
                            ctx.block_tables.clone(), query_len, cap, query_len)   # as the runner: limit, not lens
    sq, skvn = q.clone(), kvn.clone()
    out = torch.full_like(q, float("nan"))

    def step():
        write_kv(kv, skvn[0], skvn[1], static.slot_mapping)
        paged_attention(sq, kv, static, scale, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                          # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # new lengths, far apart (one long enough to use every split), new tables and inputs
    lens = [cap - 3 - 13 * i if i % 2 == 0 else 1 + 29 * i for i in range(batch)]
    lens = [max(query_len, min(cap, n)) for n in lens]
    q, kvn, ctx = draw(lens)
    for dst, src in ((static.slot_mapping, ctx.slot_mapping), (static.seq_lens, ctx.seq_lens),
                     (static.block_tables, ctx.block_tables), (sq, q), (skvn, kvn)):
        dst.copy_(src)
    snapshot = [t.clone() if t is not None else None for t in (kv.k, kv.v, kv.k_scale, kv.v_scale)]
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    for t, s in zip((kv.k, kv.v, kv.k_scale, kv.v_scale), snapshot):
        if t is not None:
            t.copy_(s)
    write_kv(kv, kvn[0], kvn[1], ctx.slot_mapping)
    eager = paged_attention(q, kv, ctx, scale)
    ref = paged_attention_reference(q.float(), kv, ctx, scale)
    return {"rel_err": rel_err(replayed, ref), "unwritten": unwritten(replayed),
            "max_diff_vs_eager": float((replayed.float() - eager.float()).abs().max())}


# -- fused elementwise ---------------------------------------------------------------------------

def check_rms_norm(rows: int, hidden: int, dtype: torch.dtype, device, seed: int, with_residual: bool) -> dict:
    from engine.kernels.elementwise.norm_rope import rms_norm
    from engine.layers.norm import RMSNorm
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-6).to(device=device, dtype=dtype)
    norm.weight.data.copy_(torch.rand(hidden, generator=gen) + 0.5)
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    res = torch.randn(rows, hidden, generator=gen).to(dtype).to(device) if with_residual else None
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan")) if with_residual else None
    rms_norm(x, norm.weight, norm.eps, res, out=out, residual_out=res_out)
    if not with_residual:
        return {"rel_err": rel_err(out, norm(x)), "unwritten": unwritten(out)}
    ref, ref_res = norm(x, res)
    return {"rel_err": max(rel_err(out, ref), rel_err(res_out, ref_res)), "unwritten": unwritten(out) + unwritten(res_out)}


def check_qk_norm_rope(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                       seed: int, kv_dtype: torch.dtype | None = None, page: int = 16) -> dict:
    """q/k views into one qkv row (as the projection gives them); with kv_dtype, also the fused
    KV write, which must store exactly what write_kv_reference stores for the rotated k."""
    from engine.kernels.elementwise.norm_rope import qk_norm_rope
    from engine.layers.norm import RMSNorm
    from engine.layers.rotary import RotaryEmbedding
    gen = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(head_dim, 4096, 1_000_000.0).to(device)
    q_norm = RMSNorm(head_dim).to(device=device, dtype=dtype)
    k_norm = RMSNorm(head_dim).to(device=device, dtype=dtype)
    q_norm.weight.data.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    k_norm.weight.data.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    q_out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype, device=device)
    k_out = torch.full((tokens, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    kv = slots = ref_kv = None
    if kv_dtype is not None:
        num_blocks = -(-tokens // page) + 2
        kv = random_kv(num_blocks, page, kv_heads, head_dim, kv_dtype, device, gen)
        ref_kv = LayerKV(*(t.clone() if t is not None else None for t in (kv.k, kv.v, kv.k_scale, kv.v_scale)))
        slots = torch.randperm(num_blocks * page, generator=gen)[:tokens]
        slots[::4] = -1
        slots = slots.to(device)
    qk_norm_rope(q, k, q_norm.weight, k_norm.weight, q_norm.eps, rotary.cos_sin, positions,
                 q_out=q_out, k_out=k_out, kv=kv, v=v if kv is not None else None, slot_mapping=slots)
    ref_q, ref_k = rotary(positions, q_norm(q), k_norm(k))
    result = {"rel_err": max(rel_err(q_out, ref_q), rel_err(k_out, ref_k)),
              "unwritten": unwritten(q_out) + unwritten(k_out)}
    if kv is not None:
        # return_k=False (the engine's call) must write the same pages and the same q
        kv2 = LayerKV(*(t.clone() if t is not None else None for t in (ref_kv.k, ref_kv.v, ref_kv.k_scale, ref_kv.v_scale)))
        q2, k2 = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, q_norm.eps, rotary.cos_sin, positions,
                              kv=kv2, v=v, slot_mapping=slots, return_k=False)
        result["mismatches_no_k"] = int((kv2.k != kv.k).sum() + (kv2.v != kv.v).sum() + (q2 != q_out).sum()) + (k2 is not None)
        write_kv_reference(ref_kv, k_out, v, slots)     # the fused write must store the kernel's own k
        result["pages"] = compare_pages(kv, ref_kv)
    return result


def check_silu_and_mul(rows: int, ffn: int, dtype: torch.dtype, device, seed: int) -> dict:
    from engine.kernels.elementwise.norm_rope import silu_and_mul
    from engine.layers.activation import SiluAndMul
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * ffn, generator=gen) * 2).to(dtype).to(device)
    out = torch.full((rows, ffn), float("nan"), dtype=dtype, device=device)
    silu_and_mul(x, out=out)
    return {"rel_err": rel_err(out, SiluAndMul()(x)), "unwritten": unwritten(out)}


# A comparison route for single-sequence prefill chunks: torch SDPA (gather + flash/cuDNN) instead of
# the Triton kernel. Not in the engine; tools/dev/gpu_kernel_suite.py times it ("[gather+sdpa]" rows).
def sdpa_prefill(q: torch.Tensor, kv: LayerKV, ctx: ForwardContext, scale: float, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's prefill chunk through torch's SDPA: gather its pages into contiguous K/V
    [kv_heads, S, head_dim] (one copy, dequantizing int8), then causal attention aligned to the
    bottom right (query j at position S - T + j). q: [T, heads, head_dim] -> same shape.

    Needs ctx.max_seq_len exact (true when eager: prefill is never graph-captured) and one sequence.
    """
    from torch.nn.attention.bias import causal_lower_right
    T, H, d = q.shape
    if ctx.num_seqs != 1:
        raise ValueError("sdpa_prefill takes one sequence")
    S, page = ctx.max_seq_len, kv.k.shape[1]
    table = ctx.block_tables[0, :-(-S // page)].long()

    def gather(pages, scales):
        x = pages[table].flatten(0, 1)[:S]                                      # [S, kv_heads, d]
        if scales is not None:
            x = x.float() * scales[table].flatten(0, 1)[:S].unsqueeze(-1)
        return x.to(q.dtype).transpose(0, 1).unsqueeze(0)                      # [1, kv_heads, S, d]

    k, v = gather(kv.k, kv.k_scale), gather(kv.v, kv.v_scale)
    qq = q.transpose(0, 1).unsqueeze(0)                                          # [1, heads, T, d]
    kw = dict(is_causal=True) if T == S else dict(attn_mask=causal_lower_right(T, S))
    try:
        o = F.scaled_dot_product_attention(qq, k, v, scale=scale, enable_gqa=True, **kw)
    except (TypeError, RuntimeError):                       # a backend without GQA: expand the heads
        g = H // k.shape[1]
        o = F.scaled_dot_product_attention(qq, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), scale=scale, **kw)
    out = torch.empty_like(q) if out is None else out
    out.copy_(o[0].transpose(0, 1))
    return out
