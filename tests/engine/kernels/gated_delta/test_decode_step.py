"""The hybrid's CUDA kernels against their torch twins: the fused Gated DeltaNet step
(engine.kernels.gated_delta.decode_step) against the layer's general path, the hybrid norms
(engine.kernels.elementwise.norm_rope.rms_norm zero-centred, engine.kernels.elementwise.gated_rms_norm) and gated attention's norm + partial RoPE + gate
(engine.kernels.elementwise.gated_attention_prep) against the torch lines they replace.

On a GPU these run as they are; without one, under Triton's interpreter when the interpreter tests
are enabled (NINFER_TRITON_INTERPRET_TESTS=1, as tests/engine/kernels/test_interpret.py). The general
path is the torch reference (engine.kernels.gated_delta.reference) on the CPU and fla-core on CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.kernel_backend import CUDA, DEV, INTERPRET, needs_a_backend

pytestmark = [needs_a_backend]


@pytest.fixture(scope="module", autouse=True)
def _interpreter_rounding():
    if INTERPRET:                    # round bf16 casts to nearest even, as the GPU does
        from tests.support.kernel_checks import patch_interpreter
        patch_interpreter()


def _layer(dtype, tp_heads=(4, 8), dk=32, dv=32, slots=6, seed=0):
    from engine.layers.gated_delta import GatedDeltaNet
    from engine.loading.presets import preset
    from engine.worker.state_pool import LayerState
    hk, hv = tp_heads
    cfg = dataclasses.replace(preset("tiny-hybrid"), linear_num_key_heads=hk, linear_num_value_heads=hv,
                              linear_key_head_dim=dk, linear_value_head_dim=dv)
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(cfg)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.3).to(dtype)
    layer.A_log.data = torch.rand(hv, generator=gen).log().to(dtype)
    layer.to(DEV)
    layer.state = LayerState(
        conv=(torch.randn(slots, layer.conv_channels, 3, generator=gen) * 0.5).to(dtype).to(DEV),
        ssm=(torch.randn(slots, hv, dk, dv, generator=gen) * 0.1).to(DEV))
    return layer, cfg


def _inputs(layer, B, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    C, hv = layer.conv_channels, layer.num_v_heads
    mixed = torch.randn(B, n, C, generator=gen).to(dtype).to(DEV)
    a = torch.randn(B, n, hv, generator=gen).to(dtype).to(DEV)
    b = torch.randn(B, n, hv, generator=gen).to(dtype).to(DEV)
    return mixed, a, b


def _general(layer, mixed, a, b, slots, defer):
    import torch.nn.functional as F
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    return layer._run(mixed, beta, g, slots, defer)


def rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3])
def test_step_equals_the_general_path(dtype, n):
    """Output, recurrent state and conv window of each slot, after a decode step (n = 1) or a short run."""
    layer, _ = _layer(dtype)
    slots = torch.tensor([4, 0, 2], device=DEV)
    mixed, a, b = _inputs(layer, 3, n, dtype, seed=n)
    before = (layer.state.conv.clone(), layer.state.ssm.clone())
    want = _general(layer, mixed, a, b, slots, False)
    want_state = (layer.state.conv.clone(), layer.state.ssm.clone())
    layer.state.conv.copy_(before[0])
    layer.state.ssm.copy_(before[1])
    got = layer._step(mixed, a, b, slots, False)
    tol = 1e-5 if dtype == torch.float32 and not CUDA else 2e-2
    assert rel(got, want) < tol
    assert rel(layer.state.ssm, want_state[1]) < tol
    assert torch.equal(layer.state.conv, want_state[0])             # copies of inputs: exact
    untouched = [s for s in range(layer.state.ssm.shape[0]) if s not in slots.tolist()]
    assert torch.equal(layer.state.ssm[untouched], before[1][untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_then_commit_keeps_the_accepted_prefix(dtype):
    """A verify pass writes nothing; its commit leaves exactly the state after each row's kept prefix."""
    layer, _ = _layer(dtype, slots=5, seed=3)
    slots = torch.tensor([1, 3, 0], device=DEV)
    n = 4
    mixed, a, b = _inputs(layer, 3, n, dtype, seed=7)
    kept = torch.tensor([1, 3, 4], device=DEV)
    start = (layer.state.conv.clone(), layer.state.ssm.clone())
    o = layer._step(mixed, a, b, slots, True)
    assert torch.equal(layer.state.ssm, start[1]) and torch.equal(layer.state.conv, start[0])
    layer.commit(kept)
    got = (layer.state.conv.clone(), layer.state.ssm.clone())
    tol = 1e-5 if dtype == torch.float32 and not CUDA else 2e-2
    for row in range(3):                      # the reference: a plain run of the kept tokens alone
        layer.state.conv.copy_(start[0])
        layer.state.ssm.copy_(start[1])
        m = int(kept[row])
        one = slots[row:row + 1]
        ref_o = _general(layer, mixed[row:row + 1, :m], a[row:row + 1, :m], b[row:row + 1, :m], one, False)
        s = int(one)
        assert rel(got[1][s], layer.state.ssm[s]) < tol, row
        assert torch.equal(got[0][s], layer.state.conv[s]), row
        assert rel(o[row, :m], ref_o[0]) < tol, row


@pytest.mark.parametrize("with_residual", [False, True])
def test_zero_centred_rms_norm_matches_its_twin(with_residual):
    from engine.kernels.elementwise.norm_rope import rms_norm
    from engine.layers.hybrid_norm import _rms
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 384, generator=gen).to(torch.bfloat16).to(DEV)
    r = torch.randn(5, 384, generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.randn(384, generator=gen) * 0.1).to(torch.bfloat16).to(DEV)
    got = rms_norm(x, w, 1e-6, r if with_residual else None, zero_centred=True)
    s = (x + r) if with_residual else x
    want = (_rms(s, 1e-6) * (1.0 + w.float())).to(torch.bfloat16)
    if with_residual:
        got, res = got
        assert torch.equal(res, s)
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()


def test_gated_rms_norm_matches_its_twin():
    from engine.kernels.elementwise.gated_rms_norm import gated_rms_norm
    from engine.layers.hybrid_norm import GatedRMSNorm
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, 48, generator=gen).to(DEV)                         # float32, as the step returns
    z = torch.randn(3, 8, 48, generator=gen).to(torch.bfloat16).to(DEV)
    norm = GatedRMSNorm(48).to(torch.bfloat16)
    norm.weight.data = (torch.randn(48, generator=gen) * 0.5 + 1).to(torch.bfloat16)
    norm.to(DEV)
    got = gated_rms_norm(x, z, norm.weight, norm.eps)
    want = _twin(norm, x, z)
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()


def _twin(norm, x, z):
    import torch.nn.functional as F

    from engine.layers.hybrid_norm import _rms
    normed = norm.weight * _rms(x, norm.eps).to(z.dtype)
    return (normed * F.silu(z.float())).to(z.dtype)


@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(3, 6, 2, 64), (2, 12, 2, 256)])
def test_gated_attention_prep_matches_the_twin(tokens, heads, kv_heads, head_dim):
    """Zero-centred q/k norms + RoPE on the first quarter of each head, and o * sigmoid(gate), against
    the torch lines of GatedAttention.forward (q and gate read out of the fused projection's rows)."""
    from engine.kernels.elementwise.gated_attention_prep import qk_norm_partial_rope, sigmoid_gate_mul
    from engine.layers.hybrid_norm import ZeroCentredRMSNorm
    from engine.layers.rotary import RotaryEmbedding
    gen = torch.Generator().manual_seed(head_dim)
    d, r = head_dim, head_dim // 4
    rotary = RotaryEmbedding(r, 4096, 1e7).to(DEV)
    qn, kn = ZeroCentredRMSNorm(d), ZeroCentredRMSNorm(d)
    for n in (qn, kn):
        n.weight.data = (torch.randn(d, generator=gen) * 0.2).to(torch.bfloat16)
        n.to(DEV)
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * d, generator=gen).to(torch.bfloat16).to(DEV)
    qg, k, _ = qkv.split([2 * heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, gate = qg.view(-1, heads, 2 * d).split([d, d], dim=-1)
    positions = torch.tensor([5, 1000, 3][:tokens], device=DEV)
    got_q, got_k = qk_norm_partial_rope(q, k.view(-1, kv_heads, d), qn.weight, kn.weight, qn.eps, rotary.cos_sin,
                                        positions)
    tq, tk = _zc(qn, q), _zc(kn, k.view(-1, kv_heads, d))
    rq, rk = rotary(positions, tq[..., :r], tk[..., :r])
    want_q, want_k = torch.cat([rq, tq[..., r:]], -1), torch.cat([rk, tk[..., r:]], -1)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.shape == want.shape
        assert (got.float() - want.float()).abs().max().item() <= 2 ** -6 * want.float().abs().max().item()
    o = torch.randn(tokens, heads, d, generator=gen).to(torch.bfloat16).to(DEV)
    want = o.flatten(1) * torch.sigmoid(gate.flatten(1))
    assert torch.equal(sigmoid_gate_mul(o, gate), want)


def _zc(norm, x):
    from engine.layers.hybrid_norm import _rms
    return (_rms(x, norm.eps) * (1.0 + norm.weight.float())).to(x.dtype)
