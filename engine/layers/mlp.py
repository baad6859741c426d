"""The dense SwiGLU MLP of Qwen3-family layers (also the shared expert of a sparse MoE block):
down(silu(gate(x)) * up(x)), gate and up fused into one column-parallel matmul, down row-parallel.

Under float16 the SwiGLU product is where bfloat16-trained checkpoints leave float16's range first: a few
neurons of a few layers carry products in the tens or hundreds of thousands, and rounding them to float16
for down_proj gives inf (llama.cpp found this on V100s: ggml-org/llama.cpp PR 27016). So in float16 the
product is computed in float32 and each row whose largest value exceeds ROW_LIMIT is divided by a power of
two before down_proj; the output is multiplied back in float32 and handed on in float32 (the residual
stream's dtype under float16, engine.layers.norm). A power of two changes no bit of a normal float16 value,
and rows within the limit (all of them, in most models) are not scaled at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.distributed.tp_group import TPGroup
from engine.layers.activation import SiluAndMul
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear, quant_format


# the largest |value| a row of the float16 SwiGLU product keeps unscaled: 2^12 leaves down_proj's sums a factor
# of 16 below float16's 65504
ROW_LIMIT = 2.0 ** 12


def rescaled_swiglu(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up: [T, 2 * f] float16 (gate then up) -> (silu(gate) * up / s as float16 [T, f], s float32 [T, 1]):
    s per row, the least power of two >= 1 that brings the row's largest |value| to ROW_LIMIT or below."""
    gate, up = gate_up.chunk(2, dim=-1)
    product = F.silu(gate.float(), inplace=True).mul_(up)                         # [T, f] float32, one buffer
    amax = torch.maximum(product.amax(-1, keepdim=True), product.amin(-1, keepdim=True).neg_())   # [T, 1]
    scale = torch.exp2(torch.ceil(torch.log2(amax / ROW_LIMIT))).clamp_min_(1.0)  # 0 -> log2 -inf -> 1
    return product.div_(scale).to(torch.float16), scale


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, prefix: str = "", intermediate_size: int | None = None):
        super().__init__()
        f = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [f] * 2, tp,
                                                       quant_format(cfg, prefix, ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(f, cfg.hidden_size, tp, quant_format(cfg, prefix, ["down_proj"]))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]; float16 x -> float32 (rescaled rows: module docstring)
        if x.dtype == torch.float16:
            act, scale = rescaled_swiglu(self.gate_up_proj(x))
            return self.down_proj(act).float().mul_(scale)      # a partial sum under TP: scaled by this rank's s
        if x.is_cuda:
            from engine.kernels.linear import gemv
            if gemv.takes_gate_up_silu(x, self.gate_up_proj):       # one decode row: SwiGLU in the GEMV's epilogue
                return self.down_proj(gemv.layer_gate_up_silu(x, self.gate_up_proj))
        return self.down_proj(self.act(self.gate_up_proj(x)))
