"""The CPU gated delta rule: the chunked form (prefill) against the recurrent form (decode), both
against transformers' torch reference, and a state carried across calls equal to one call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.gated_delta import reference as ref


def inputs(b=2, t=150, h=4, dk=16, dv=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(rnd(b, t, h, dk), dim=-1) * dk ** -0.5
    k = F.normalize(rnd(b, t, h, dk), dim=-1)
    v = rnd(b, t, h, dv)
    g = -torch.rand(b, t, h, generator=gen) * 0.7           # log decays <= 0
    beta = torch.rand(b, t, h, generator=gen)
    s0 = rnd(b, h, dk, dv) * 0.3
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("chunk", [16, 64, 37])
@pytest.mark.parametrize("t", [1, 15, 64, 150])
def test_chunked_equals_recurrent(chunk, t):
    q, k, v, g, beta, s0 = inputs(t=t)
    o_r, s_r = ref.recurrent(q, k, v, g, beta, s0)
    o_c, s_c = ref.chunked(q, k, v, g, beta, s0, chunk=chunk)
    assert o_c.shape == o_r.shape == (2, t, 4, 24) and s_c.shape == s0.shape
    torch.testing.assert_close(o_c, o_r, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(s_c, s_r, rtol=1e-5, atol=2e-5)


def test_state_carried_across_calls_equals_one_call():
    q, k, v, g, beta, s0 = inputs(t=100)
    o_full, s_full = ref.chunked(q, k, v, g, beta, s0)
    o1, s1 = ref.chunked(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], s0)
    o2, s2 = ref.recurrent(q[:, 40:43], k[:, 40:43], v[:, 40:43], g[:, 40:43], beta[:, 40:43], s1)
    o3, s3 = ref.chunked(q[:, 43:], k[:, 43:], v[:, 43:], g[:, 43:], beta[:, 43:], s2)
    torch.testing.assert_close(torch.cat([o1, o2, o3], 1), o_full, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(s3, s_full, rtol=1e-5, atol=2e-5)
    assert not torch.equal(s0, s_full)                     # the inputs did move the state


def test_masked_steps_leave_the_state_exactly():
    """beta = 0 and g = 0 make a step an exact no-op: how a verify round commits its accepted prefix."""
    q, k, v, g, beta, s0 = inputs(t=6)
    keep = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.float32).unsqueeze(-1)
    _, s_masked = ref.recurrent(q, k, v, g * keep, beta * keep, s0)
    _, s_a = ref.recurrent(q[:1, :2], k[:1, :2], v[:1, :2], g[:1, :2], beta[:1, :2], s0[:1])
    _, s_b = ref.recurrent(q[1:, :5], k[1:, :5], v[1:, :5], g[1:, :5], beta[1:, :5], s0[1:])
    assert torch.equal(s_masked[:1], s_a) and torch.equal(s_masked[1:], s_b)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_against_transformers_reference(form):
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta, s0 = inputs(t=90, seed=5)
    # transformers takes raw q, k (it L2-normalises and scales inside) and grouped key heads
    raw_q, raw_k = torch.randn(2, 90, 2, 16), torch.randn(2, 90, 2, 16)
    hf = mod.torch_chunk_gated_delta_rule if form == "chunked" else mod.torch_recurrent_gated_delta_rule
    o_hf, s_hf = hf(raw_q, raw_k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn = raw_q * torch.rsqrt(raw_q.pow(2).sum(-1, keepdim=True) + 1e-6) * 16 ** -0.5
    kn = raw_k * torch.rsqrt(raw_k.pow(2).sum(-1, keepdim=True) + 1e-6)            # grouped key heads
    o, s = getattr(ref, form)(qn, kn, v, g, beta, s0)
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(s, s_hf, rtol=1e-5, atol=2e-5)
