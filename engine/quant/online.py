"""`--quantization fp8` / `ptpc_fp8`: a bf16 (or fp16/fp32) checkpoint quantized to FP8 while it loads; nothing
is written to disk. Every linear layer is quantized (the MTP layer's too: the draft runs k times a round);
the embeddings and lm_head stay in the model dtype, as `ninfer quantize` and the published FP8 checkpoints
keep them.

    fp8       e4m3 weights with one float32 scale per 128x128 block (the default, as Qwen's FP8 releases)
    ptpc_fp8  e4m3 weights with one float32 scale per output row ("per-token, per-channel" in vLLM's naming:
              the activations are quantized per token where FP8 activations are used)

Why blocks are the default (by arithmetic; the GPU run measures both): the two hold the same bytes (1 per
weight, plus 4 per 16,384 weights or 4 per row), and round alike -- e4m3 keeps 3 mantissa bits at any
magnitude within 2^14.8 of its scale's range, so a weight row or block with an outlier loses the same
relative precision either way -- but the engine's tuned FP8 kernels take blocks: the decode GEMVs
(engine/kernels/linear/gemv.py, quant_gemv_mma.py: 0.71-0.85 of copy bandwidth on the H200) and the
block-scaled cuBLAS prefill (1.41x bf16 at 4k). Per-channel scales would take the tensor-core skinny kernel
at decode (0.43 of copy when it was measured against blocks) and torch's row-wise scaled GEMM at prefill
(measured faster than block-wise in an early kernel run, ~1.6x bf16); until the per-channel GEMV is
measured, blocks win on the step that dominates serving.
"""

from __future__ import annotations

from engine.errors import InvalidArgumentError, ModelLoadError
from engine.quant.layouts.base import FP8, FP8_CHANNEL, Layout, LinearQuant

METHODS = {"fp8": FP8, "ptpc_fp8": FP8_CHANNEL}


class OnlineFP8(Layout):
    """A bf16 checkpoint's `X.weight` becomes the FP8 layer's tensors as it is read."""

    markers = ()

    def __init__(self, method: str):
        self.name, self.kind = f"--quantization {method}", METHODS[method]

    def linear_quant(self, module: str) -> LinearQuant:
        return LinearQuant(self.kind)

    def disk_shapes(self, module, spec, out, inp):
        return {f"{module}.weight": (out, inp)}

    def disk_dtypes(self, spec):
        return {"weight": ("BF16", "F16", "F32")}

    def convert(self, module, suffix, tensor, spec):
        import torch

        from engine.quant import formats
        if suffix != "weight":
            raise ModelLoadError(f"{module}.{suffix}: --quantization needs an unquantized checkpoint")
        if self.kind == FP8:
            q, scale_inv = formats.quantize_fp8_block(tensor.float())
            return [("weight", q), ("weight_scale_inv", scale_inv)]
        w = tensor.float()
        amax = w.abs().amax(dim=1)                                               # [out]
        scale = torch.where(amax > 0, amax / formats.FP8_MAX, torch.ones_like(amax))
        return [("weight", (w / scale[:, None]).clamp(-formats.FP8_MAX, formats.FP8_MAX).to(formats.FP8)),
                ("weight_scale", scale)]


def online_scheme(method: str, model_config, shapes: dict[str, tuple[int, ...]]):
    """The scheme quantizing every linear layer of an unquantized checkpoint's `shapes` at load."""
    from engine.quant.scheme import QuantScheme
    if method not in METHODS:
        raise InvalidArgumentError("quantization", f"must be one of {', '.join(METHODS)}, got {method!r}")
    if model_config.quant is not None:
        raise ModelLoadError(f"--quantization {method}: the checkpoint is already quantized "
                             f"({model_config.quant.format}); drop --quantization to load it as it is")
    return QuantScheme(method, layout=OnlineFP8(method)).over_linears(shapes)
