"""The compile matrix's representative launches (tests/support/compile_matrix.py compiles them): the engine's own
launch code at the shapes of the reference models, each tagged with the engine/platform.py family it proves and
the capabilities to compile it for."""

from __future__ import annotations

from typing import Callable


def scenarios(full: bool = False) -> dict[str, tuple[str, Callable[[], None], tuple[int, ...]]]:
    """name -> (the engine/platform.py family it belongs to, the launch code, the capabilities to compile for).
    The fast set (CI) compiles each family for every capability that may select it in the dtype that capability
    runs in (float16 below sm80, bfloat16 from sm80); `full` adds the prefill-shaped attention (sm70's alone takes
    ~100 s to compile) and every family in both dtypes on every capability."""
    import torch

    from tests.support import kernel_checks as kc
    from tests.support import quant_kernel_checks as qc

    f16, bf16, i8, cpu = torch.float16, torch.bfloat16, torch.int8, torch.device("cpu")
    old, new, every = (70, 75), (80, 89, 90), (70, 75, 80, 89, 90)
    dtypes = {70: f16, 75: f16, 80: bf16, 89: bf16, 90: bf16}

    def attention(query_lens, seq_lens, dtype, kv_dtype, kv_heads=2, head_dim=128):
        from engine.kernels.attention.paged import paged_attention
        q, kv, ctx = kc.attention_case(query_lens, seq_lens, 8, kv_heads, head_dim, 16, kv_dtype, dtype, cpu, 0)
        paged_attention(q, kv, ctx, head_dim ** -0.5)

    def rms_norm_pdl(dtype):
        # the decode kernels' PDL form: the real RMSNorm kernel launched with the attribute on
        from engine.kernels.elementwise.norm_rope import _rms_norm_kernel
        x = torch.randn(2, 1024, dtype=dtype)
        w = torch.ones(1024, dtype=dtype)
        _rms_norm_kernel[(2,)](x, x, w, x, x, 1024, 1024, 1024, 1024, 1024, 1e-6, BLOCK=1024, HAS_RESIDUAL=False,
                               ZERO_CENTRED=False, num_warps=2, USE_PDL=True, launch_pdl=True)

    def tma_prefill(dtype):
        from engine.kernels.attention.prefill_tma import prefill_attention
        q = torch.randn(200, 8, 128, dtype=dtype)
        k, v = torch.randn(300, 2, 128, dtype=dtype), torch.randn(300, 2, 128, dtype=dtype)
        prefill_attention(q, k, v, torch.tensor([0, 200], dtype=torch.int32), torch.tensor([0, 300], dtype=torch.int32),
                          200, 128 ** -0.5)

    def skinny_dense(dtype):
        from engine.kernels.linear.skinny_gemm import skinny_dense as run
        run(torch.randn(4, 512, dtype=dtype), torch.randn(1024, 512, dtype=dtype))

    def act_quant(dtype):
        from engine.kernels.linear.act_quant import quantize_activations_fused
        quantize_activations_fused(torch.randn(5, 256, dtype=dtype))

    def recurrent():
        from engine.kernels.gated_delta.decode_step import recurrent as run
        B, n, hk, hv, d = 2, 1, 2, 4, 128
        f = torch.float32
        run(torch.randn(B, n, hk, d), torch.randn(B, n, hk, d), torch.randn(B, n, hv, d), torch.randn(B, n, hv),
            torch.randn(B, n, hv), torch.randn(hv), torch.randn(hv), torch.zeros(3, hv, d, d, dtype=f),
            torch.tensor([0, 1], dtype=torch.int32))

    def moe_experts(fmt, dtype):
        # Qwen3-30B-A3B's router (128 experts, top 8); hidden and intermediate sized to the tiles its 2048 and
        # 768 (384 at TP=2) take, with the same divisibility. The weights are never read: nothing runs.
        from engine.distributed.tp_group import SINGLE_RANK
        from engine.layers.moe_experts import FusedExperts
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return FusedExperts(128, 256, 128, SINGLE_RANK, fmt)
        finally:
            torch.set_default_dtype(previous)

    def moe_decode(dtype):
        # one decode token: the one-launch route and sort, both grouped GEMMs (gate/up with SwiGLU; down), combine
        from engine.kernels.moe.fused_moe import sparse_moe
        x, shared = torch.randn(1, 256, dtype=dtype), torch.randn(1, 256, dtype=dtype)
        sparse_moe(x, torch.randn(1, 128, dtype=dtype), moe_experts(None, dtype), 8, True, shared,
                   torch.randn(1, 1, dtype=dtype))

    def moe_quantized(fmt, dtype):
        # the gate/up grouped GEMM of FP8 / NVFP4 experts (its route and sort: moe_decode's launch, a cache hit)
        from engine.kernels.moe.align import route_and_sort
        from engine.kernels.moe.fused_moe import block_m_for
        from engine.kernels.moe.grouped_gemm import moe_gemm
        experts = moe_experts(fmt, dtype)
        _, _, slots = route_and_sort(torch.randn(1, 128, dtype=dtype), 8, True, block_m_for(1))
        moe_gemm(torch.randn(1, 256, dtype=dtype), experts, "w13", slots,
                 torch.empty(8, experts.intermediate, dtype=dtype), a_div=8)

    def moe_sort_chunked(dtype):
        # a 512-token prefill chunk: [T, E] exceeds one program, so routing, count, offsets and placement
        from engine.kernels.moe.align import route_and_sort
        from engine.kernels.moe.fused_moe import block_m_for
        route_and_sort(torch.randn(512, 128, dtype=dtype), 8, True, block_m_for(512))

    def int_linear(dtype, rows, bits=4, act_order=False):
        # a GPTQ/AWQ layer in groups of 128: 1 row takes the FMA GEMV, 16 rows the tl.dot GEMM
        from engine.kernels.linear.int_gemm import int_matmul
        N, K = 512, 1024
        scales = torch.ones(N, K // 128)
        g_idx = torch.arange(K, dtype=torch.int32) // 128 if act_order else None
        int_matmul(torch.randn(rows, K, dtype=dtype), torch.zeros(N, K * bits // 32, dtype=torch.int32), scales,
                   scales, bits, 128, g_idx)

    table: dict[str, tuple[str, Callable[[], None], tuple[int, ...]]] = {}
    for dtype, caps in ((f16, old), (bf16, new)):
        tag = "f16" if dtype is f16 else "bf16"
        table |= {
            f"rms_norm_{tag}": ("elementwise", lambda d=dtype: kc.check_rms_norm(3, 1024, d, cpu, 0, True), caps),
            f"silu_and_mul_{tag}": ("elementwise", lambda d=dtype: kc.check_silu_and_mul(3, 1024, d, cpu, 0), caps),
            f"write_kv_int8_{tag}": ("elementwise", lambda d=dtype: kc.check_write_kv(5, 2, 128, 16, i8, d, cpu, 0),
                                     caps),
            f"split_merge_{tag}": ("attention", lambda d=dtype: kc.check_split_merge(3, 8, 4, 128, d, cpu, 0), caps),
            # the padded KV head count: 2 (27B at TP=2), 4 (8 KV heads at TP=2), 8 (TP=1)
            **{f"qk_norm_rope_kvh{h}_{tag}": ("elementwise", lambda d=dtype, h=h: kc.check_qk_norm_rope(
                3, 4 * h, h, 128, d, cpu, 0, kv_dtype=i8), caps) for h in (2, 4, 8)},
            f"attn_decode_int8_{tag}": ("attention", lambda d=dtype: attention([1, 1], [37, 300], d, i8), caps),
            f"attn_decode_{tag}": ("attention", lambda d=dtype: attention([1, 1], [37, 300], d, d),
                                   caps if full else caps[:1]),
            f"gemv_nvfp4_{tag}": ("nvfp4_linear", lambda d=dtype: qc.check_gemv("nvfp4", 1, 256, 512, cpu, dtype=d),
                                  every),
            f"gemv_dense_{tag}": ("dense_linear", lambda d=dtype: qc.check_gemv("bf16", 1, 256, 512, cpu, dtype=d),
                                  caps),
            f"skinny_dense_{tag}": ("dense_linear", lambda d=dtype: skinny_dense(d), caps),
            f"gemv_fp8_{tag}": ("fp8_linear", lambda d=dtype: qc.check_gemv("fp8", 1, 256, 512, cpu, dtype=d), every),
            f"act_quant_fp8_{tag}": ("fp8_activation_quant", lambda d=dtype: act_quant(d), every),
            f"pdl_{tag}": ("pdl", lambda d=dtype: rms_norm_pdl(d), every),
            f"moe_decode_{tag}": ("moe", lambda d=dtype: moe_decode(d), caps),
            # CI's time budget: quantized experts on sm80+ only in the fast set (sm70/75 add 5 s of CPU; they
            # compile, the full matrix shows it), and the chunked sort's four kernels (20 s of CPU on sm70/75,
            # 5 s on sm80+) on sm80 only
            f"moe_fp8_{tag}": ("moe_fp8", lambda d=dtype: moe_quantized("fp8", d),
                               caps if full or dtype is bf16 else ()),
            f"moe_nvfp4_{tag}": ("moe_nvfp4", lambda d=dtype: moe_quantized("nvfp4", d),
                                 caps if full or dtype is bf16 else ()),
            f"moe_sort_chunked_{tag}": ("moe", lambda d=dtype: moe_sort_chunked(d),
                                        caps if full else tuple(c for c in caps if c == 80)),
            f"int_gemv_{tag}": ("int_linear", lambda d=dtype: int_linear(d, 1), caps),
            f"int_gemm_{tag}": ("int_linear", lambda d=dtype: int_linear(d, 16), caps),
        }
        if full:
            table |= {f"int_gemv_8bit_{tag}": ("int_linear", lambda d=dtype: int_linear(d, 4, bits=8), caps),
                      f"int_gemm_act_order_{tag}": ("int_linear", lambda d=dtype: int_linear(d, 64, act_order=True),
                                                    caps)}
    table["tma_prefill_bf16"] = ("attention_tma", lambda: tma_prefill(bf16), (90,))
    table["gated_delta_recurrent"] = ("gated_delta", recurrent, every)
    table = {name: entry for name, entry in table.items() if entry[2]}
    if not full:
        # the capability-only families compile in the dtype their capability runs in
        for name in [n for n in table if n.startswith(("gemv_", "act_quant_", "pdl_"))]:
            family, run, _ = table[name]
            keep = tuple(c for c in every if (dtypes[c] is f16) == name.endswith("_f16"))
            table[name] = (family, run, keep)
        return table
    table |= {
        "attn_prefill_f16": ("attention", lambda: attention([60], [60], f16, f16), every),
        "attn_prefill_bf16": ("attention", lambda: attention([60], [60], bf16, bf16), new),
        "attn_verify_bf16": ("attention", lambda: attention([4, 4], [40, 90], bf16, bf16), new),
    }
    return {name: (family, run, every if family not in ("attention_tma",) else caps)
            for name, (family, run, caps) in table.items()}
