"""Triton kernels for the CUDA path.

`attention`: KV writes and paged attention (prefill, decode, verify); `fused`: RMSNorm with the
residual add, q/k RMSNorm + RoPE, SiLU·mul. Each kernel has a torch twin in `engine.layers`
that the tests hold it to; `tests/support/kernel_checks.py` builds those checks (GPU tests, interpreter tests and the
GPU check script share it). docs/kernels.md says how each kernel works and what it measured.
`quant_gemm`: matmuls of FP8-block and NVFP4 linear layers, held to `engine.quant.formats` by
`tests/support/quant_kernel_checks.py` (docs/kernels.md, "Linear layers"); `linear/int_gemm` (INT4/INT8
weight-only: GPTQ, AWQ, compressed-tensors) and `linear/fp8_channel` (FP8 per output channel), held to
`engine.quant.int_formats` and the FP8 reference by tests/engine/kernels/linear/test_int_kernels.py
(docs/quantization.md).
`moe`: routing, the token->expert sort, the grouped expert GEMM and the combine of sparse MoE blocks, held to
`engine.kernels.moe.reference` (docs/moe.md).

Nothing here is imported on the CPU path: importing these modules needs Triton.
"""
