"""Checks of the quantized matmul kernels against the reference dequantizer (`engine.quant.formats`),
shared by the GPU tests, the interpreter tests and tools/dev/quant_kernel_suite.py.

Weights are drawn, quantized by the reference quantizer, and the kernel's output compared with
x @ dequantize(W)^T in float32 (for W8A8: with the activations quantized the same way first), as a
relative error against the largest output. Outputs are poisoned with NaN first by the kernel's own
`torch.empty` (an unwritten element shows as NaN or garbage; `unwritten` counts the NaNs)."""

from __future__ import annotations

import torch

from engine.quant import formats as F


def make_weights(fmt: str, N: int, K: int, device, seed: int, block: tuple[int, int] = (128, 128)) -> dict:
    """Reference-quantized weights as a layer holds them, with the float32 dequantized twin."""
    # drawn on the CPU (the same values everywhere), quantized and dequantized on the device: the
    # reference is plain torch and the CPU would take most of a GPU run's time at the large shapes
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(device)
    if fmt == "nvfp4":
        p, s, s2 = F.quantize_nvfp4(w)
        # a different tensor scale per half of the rows, as a fused gate/up layer holds them
        rs = torch.full((N,), float(s2), device=device)
        rs[N // 2:] *= 0.5
        ref = F.dequantize_nvfp4(p, s, 1.0) * rs[:, None]
        return {"weight": p, "scale": s, "row_scale": rs, "ref": ref, "block": (128, 128)}
    q, si = F.quantize_fp8_block(w, block)
    return {"weight": q, "scale": si, "row_scale": None, "ref": F.dequantize_fp8_block(q, si, block), "block": block}


def _report(y: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"unwritten": int(torch.isnan(y).sum()),
            "rel_err": float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))}


def check_skinny(fmt: str, M: int, N: int, K: int, device, seed: int = 0, config=None, dtype=torch.bfloat16,
                 block: tuple[int, int] = (128, 128)) -> dict:
    from engine.kernels.linear.quant_gemm import skinny
    wt = make_weights(fmt, N, K, device, seed, block)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    y = skinny(x, fmt, wt["weight"], wt["scale"], wt["row_scale"], N, wt["block"], config)
    return _report(y, x.float() @ wt["ref"].T)


def check_gemv(fmt: str, M: int, N: int, K: int, device, seed: int = 0, config=None, dtype=torch.bfloat16,
               block: tuple[int, int] = (128, 128)) -> dict:
    """The decode GEMV (engine.kernels.linear.gemv) against x @ dequantize(W)^T; fmt bf16 takes the weight as is."""
    from engine.kernels.linear.gemv import gemv
    if fmt == "bf16":
        gen = torch.Generator().manual_seed(seed)
        w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(device=device, dtype=dtype)
        wt = {"weight": w, "scale": None, "row_scale": None, "ref": w.float(), "block": block}
    else:
        wt = make_weights(fmt, N, K, device, seed, block)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    y = gemv(x, fmt, wt["weight"], wt["scale"], wt["row_scale"], N, wt["block"], config)
    return _report(y, x.float() @ wt["ref"].T)


def check_dequantize(fmt: str, N: int, K: int, device, seed: int = 0, block: tuple[int, int] = (128, 128)) -> dict:
    """The whole-weight dequantizer (prefill) against the reference: bf16 rounding of each value."""
    from engine.kernels.linear.quant_gemm import dequantize
    wt = make_weights(fmt, N, K, device, seed, block)
    w = dequantize(fmt, wt["weight"], wt["scale"], wt["row_scale"], N, K, torch.bfloat16, wt["block"])
    return {"unwritten": int(torch.isnan(w).sum()),
            "exact_in_bf16": bool(torch.equal(w, wt["ref"].to(torch.bfloat16))),
            "rel_err": float((w.float() - wt["ref"]).abs().max() / wt["ref"].abs().max())}


def check_w8a8(M: int, N: int, K: int, device, seed: int = 0, block: tuple[int, int] = (128, 128)) -> dict:
    """torch's block-scaled FP8 GEMM as the layer calls it (activations quantized by the fused kernel
    on CUDA), against the reference fed the same quantized activations, dequantized."""
    from engine.kernels.linear.quant_gemm import _scaled_mm_blockwise, quantize_activations
    wt = make_weights("fp8", N, K, device, seed, block)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=torch.bfloat16)
    y = _scaled_mm_blockwise(x, wt["weight"], wt["scale"])
    if x.is_cuda:
        from engine.kernels.linear.act_quant import quantize_activations_fused
        a, sa = quantize_activations_fused(x)
        a, sa = a[:M], sa[:M]
    else:
        a, sa = quantize_activations(x)
    x_ref = F.dequantize_fp8_block(a, sa.contiguous(), (1, 128))   # the GEMM's own activations, dequantized
    r = _report(y, x_ref @ wt["ref"].T)
    r["activation_rel_err"] = float((x_ref - x.float()).norm() / x.float().norm())
    return r
