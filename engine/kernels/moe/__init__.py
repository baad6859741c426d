"""Mixture-of-experts kernels (docs/moe.md): routing (softmax over all experts in float32, top k,
renormalisation) with the token-to-expert counting sort, the grouped GEMM over expert-sorted rows
(gate/up with SiLU·mul in its epilogue, then down), and the weighted combine with the shared expert.
`reference` is the plain-torch twin: the CPU path and what every Triton kernel is held to."""
