"""Linear-layer kernels: the decode GEMV, skinny tensor-core GEMMs, quantized GEMV/GEMM, FP8 block GEMM."""
