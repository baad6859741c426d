"""The dense SwiGLU MLP of Qwen3-family layers (also the shared expert of a sparse MoE block):
down(silu(gate(x)) * up(x)), gate and up fused into one column-parallel matmul, down row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.tp_group import TPGroup
from engine.layers.activation import SiluAndMul
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear, quant_format


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, prefix: str = "", intermediate_size: int | None = None):
        super().__init__()
        f = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [f] * 2, tp,
                                                       quant_format(cfg, prefix, ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(f, cfg.hidden_size, tp, quant_format(cfg, prefix, ["down_proj"]))
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        if x.is_cuda:
            from engine.kernels.linear import gemv
            if gemv.takes_gate_up_silu(x, self.gate_up_proj):       # one decode row: SwiGLU in the GEMV's epilogue
                return self.down_proj(gemv.layer_gate_up_silu(x, self.gate_up_proj))
        return self.down_proj(self.act(self.gate_up_proj(x)))
