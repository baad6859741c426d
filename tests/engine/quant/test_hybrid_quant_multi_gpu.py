"""The quantized shared hybrid at TP = 2 with MTP k = 3 on two CUDA devices, against its k = 0 run on one.
Marked `multi_gpu` by tests/conftest.py."""

from __future__ import annotations

from tests.engine.quant.test_hybrid_quant_gpu import check_agrees_with_k0, pytestmark, quantized  # noqa: F401


def test_quantized_hybrid_tp2_mtp_agrees_with_k0(quantized):
    check_agrees_with_k0(quantized, draft_tokens=3, tensor_parallel_size=2)
