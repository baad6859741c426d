"""The MoE Triton kernels against their torch twins (engine.kernels.moe.reference): on a CUDA device, or under
Triton's interpreter on the CPU when NINFER_TRITON_INTERPRET_TESTS=1 (tests/support/kernel_backend.py).

- routing: the top-k sets, their order and the (renormalised) float32 weights, for expert counts that are and
  are not powers of two;
- the sort: both paths (one launch for few tokens, count/offsets/place for many) give the reference's
  sorted slots, block -> expert table and used length, and -1 past it;
- the grouped GEMMs and combine (bf16 / float32 / FP8-block / NVFP4 experts, with and without a shared expert)
  equal the reference's expert outputs at decode rows (one row block per chosen expert) and prefill rows
  (BLOCK_M 64), FP8 at shapes of several scale blocks and a TP rank's 32-row granules;
- a decode round reads each chosen expert's weights once: the used row blocks are exactly the distinct experts.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.kernel_backend import CUDA, DEV, INTERPRET, needs_a_backend  # noqa: F401 (sets TRITON_INTERPRET first)

pytestmark = needs_a_backend


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    if not CUDA:
        from tests.support.kernel_checks import patch_interpreter
        patch_interpreter()


def _logits(T, E, seed, dtype=torch.float32):
    return (torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype).to(DEV)


@pytest.mark.parametrize("T, E, k", [(1, 8, 2), (5, 60, 8), (70, 128, 8), (3, 512, 10)])
@pytest.mark.parametrize("renorm", [True, False])
def test_routing_matches_the_reference(T, E, k, renorm):
    from engine.kernels.moe import reference, routing
    logits = _logits(T, E, T + E)
    ids, w = routing.route(logits, k, renorm)
    ref_ids, ref_w = reference.route(logits.cpu(), k, renorm)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-6, atol=1e-7)


def _check_sorted(slots, ids, E, block_m):
    from engine.kernels.moe import reference
    ref_sorted, ref_experts, used = reference.align(ids.cpu(), E, block_m)
    assert int(slots.num_post.item()) == used
    assert torch.equal(slots.sorted_ids[:used].cpu(), ref_sorted)
    blocks = used // block_m
    assert torch.equal(slots.expert_ids[:blocks].cpu(), ref_experts)
    assert bool((slots.expert_ids[blocks:] == -1).all())
    assert slots.sorted_ids.numel() >= used


@pytest.mark.parametrize("T, E, k, block_m", [(1, 8, 2, 16), (9, 128, 8, 16), (200, 60, 4, 64), (300, 512, 10, 64)])
def test_general_sort_matches_the_reference(T, E, k, block_m):
    from engine.kernels.moe import align, reference
    ids, _ = reference.route(_logits(T, E, 7 * T), k, True)
    _check_sorted(align.sort_slots(ids.to(DEV), E, block_m), ids, E, block_m)


@pytest.mark.parametrize("T, E, k", [(1, 8, 2), (7, 128, 8), (64, 128, 8), (16, 512, 10)])
def test_fused_route_and_sort_of_few_tokens(T, E, k):
    from engine.kernels.moe import align, fused_moe, reference
    logits = _logits(T, E, 11 * T + E)
    block_m = fused_moe.block_m_for(T)
    ids, w, slots = align.route_and_sort(logits, k, True, block_m)
    ref_ids, ref_w = reference.route(logits.cpu(), k, True)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-6, atol=1e-7)
    _check_sorted(slots, ref_ids, E, block_m)
    # every chosen expert is exactly one row block: its weights are read once for the round
    used_blocks = int(slots.num_post.item()) // block_m
    assert used_blocks == len(set(ref_ids.flatten().tolist()))


def _experts(fmt, E, H, I, dtype, seed, tp=(0, 1)):
    """A FusedExperts of random weights in `fmt`, loaded through its checkpoint loader."""
    from engine.distributed.tp_group import TPGroup
    from engine.layers.moe_experts import FusedExperts
    from engine.quant.random_weights import quantize_tensor
    from engine.quant.scheme import QuantScheme
    gen = torch.Generator().manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = FusedExperts(E, H, I, TPGroup(rank=tp[0], size=tp[1]), fmt)
    finally:
        torch.set_default_dtype(prev)
    params = dict(layer.named_parameters())
    for e in range(E):
        for part, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w = torch.randn(shape, generator=gen) * shape[1] ** -0.5
            tensors = {f"x.weight": w} if fmt is None else quantize_tensor("x.weight", w, QuantScheme(fmt))
            for name, t in tensors.items():
                pname = ("w2_" if part == "down_proj" else "w13_") + name[2:]
                p = params[pname]
                p.weight_loader(p, t.to(p.dtype) if not getattr(p, "quantized", False) else t, (e, part))
    return layer.to(DEV)


CASES = [  # fmt, dtype, T, E, k, H, I, shared
    (None, torch.float32, 1, 8, 2, 64, 32, False),
    (None, torch.float32, 5, 8, 2, 64, 32, True),
    (None, torch.float32, 70, 8, 2, 64, 48, True),
    (None, torch.bfloat16, 3, 16, 4, 64, 32, True),
    ("fp8", torch.bfloat16, 2, 8, 2, 256, 256, False),
    ("fp8", torch.float32, 66, 8, 2, 128, 64, True),
    ("nvfp4", torch.bfloat16, 4, 8, 2, 128, 64, True),
    ("nvfp4", torch.float32, 70, 8, 3, 64, 32, False),
]


@pytest.mark.parametrize("fmt, dtype, T, E, k, H, I, shared", CASES,
                         ids=[f"{c[0] or 'float'}-{str(c[1])[6:]}-T{c[2]}" for c in CASES])
def test_sparse_moe_matches_the_reference(fmt, dtype, T, E, k, H, I, shared):
    from engine.kernels.moe import fused_moe, reference
    experts = _experts(fmt, E, H, I, dtype, seed=T + E)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    logits = _logits(T, E, 3 * T, dtype)
    s = torch.randn(T, H, generator=gen).to(dtype).to(DEV) if shared else None
    g = torch.randn(T, 1, generator=gen).to(dtype).to(DEV) if shared else None
    out = fused_moe.sparse_moe(x, logits, experts, k, True, s, g)
    ids, w = reference.route(logits.cpu(), k, True)
    cpu = experts.to("cpu")
    ref = reference.experts(x.cpu(), ids, w, cpu.expert_weights, None if s is None else s.cpu(),
                            None if g is None else g.cpu())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = float((out.cpu().float() - ref.float()).abs().max() / ref.float().abs().max())
    print(f"\n{fmt} {dtype} T={T}: relative error {err:.2e}")
    assert err < tol, err


def test_tp_rank_of_fp8_experts_inside_scale_blocks():
    """I = 192 over two ranks: each rank's 96 rows start inside a 128-row scale block (32-row granules)."""
    from engine.kernels.moe import fused_moe, reference
    for rank in range(2):
        experts = _experts("fp8", 4, 128, 192, torch.bfloat16, seed=rank, tp=(rank, 2))
        x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEV)
        logits = _logits(3, 4, 5)
        out = fused_moe.sparse_moe(x, logits, experts, 2, True)
        ids, w = reference.route(logits.cpu(), 2, True)
        ref = reference.experts(x.cpu(), ids, w, experts.to("cpu").expert_weights)
        assert float((out.cpu().float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2
