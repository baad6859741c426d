"""Fused elementwise kernels: RMSNorm (+ residual), qk-norm + RoPE, gated norms, the decode round's bookkeeping."""
