"""The RMSNorm kernel with float16 activations and a float32 residual stream (engine.layers.norm): the sum is
kept in float32, the normed output rounded to float16, as the torch twins (RMSNorm, ZeroCentredRMSNorm) do.
On a GPU as it is; on the CPU under Triton's interpreter (NINFER_TRITON_INTERPRET_TESTS=1)."""

from __future__ import annotations

import pytest
import torch

from tests.support.kernel_backend import DEV, needs_a_backend

pytestmark = [needs_a_backend]

F16, F32 = torch.float16, torch.float32


def _inputs(rows: int, hidden: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(F16)
    # a massive activation: one channel of the stream far beyond float16's range, as a float32 stream holds it
    residual = torch.randn(rows, hidden, generator=gen)
    residual[:, 7] = 3.0e5
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(F16)
    return x, residual, weight


@pytest.mark.parametrize("zero_centred", [False, True], ids=["rmsnorm", "zero_centred"])
def test_float16_activations_add_into_a_float32_stream(zero_centred):
    from engine.kernels.elementwise.norm_rope import rms_norm
    from engine.layers.hybrid_norm import ZeroCentredRMSNorm
    from engine.layers.norm import RMSNorm
    x, residual, weight = _inputs(5, 384, seed=3)
    norm = (ZeroCentredRMSNorm if zero_centred else RMSNorm)(384)
    norm.weight.data = weight.clone()
    want, want_stream = norm(x, residual)                       # the CPU twin
    assert want.dtype == F16 and want_stream.dtype == F32 and torch.isfinite(want).all()
    assert torch.equal(want_stream, x.float() + residual)

    got, stream = rms_norm(x.to(DEV), weight.to(DEV), norm.eps, residual.to(DEV), zero_centred=zero_centred)
    assert got.dtype == F16 and stream.dtype == F32
    assert torch.equal(stream.cpu(), want_stream)               # the float32 sum, not rounded to float16
    err = (got.float().cpu() - want.float()).abs().max().item()
    assert err <= 2 ** -9 * want.float().abs().max().item(), err


def test_the_float32_stream_gives_what_float32_gives():
    """Rounded to float16 only at the normed output: within float16's rounding of the float32 computation."""
    from engine.kernels.elementwise.norm_rope import rms_norm
    x, residual, weight = _inputs(4, 256, seed=4)
    got, _ = rms_norm(x.to(DEV), weight.to(DEV), 1e-6, residual.to(DEV))
    h = x.float() + residual
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    rel = ((got.float().cpu() - want).abs() / want.abs().clamp_min(1e-3)).max().item()
    assert rel <= 2 ** -9, rel
