"""The hybrid on CUDA: fla-core's gated delta rule kernels against the CPU reference, and the engine
on the trained hybrid (bf16): graphs equal eager, MTP against k = 0, TP = 2 against TP = 1, prompt
logits against the float32 CPU engine. Marked `gpu`; skipped where CUDA (or fla-core) is absent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.kernels.gated_delta import reference as ref

MODEL = Path(__file__).resolve().parents[3] / ".models" / "tiny-qwen3_5-mtp"
if not MODEL.exists():
    MODEL = Path(__file__).resolve().parents[4] / "shared" / "models" / "tiny-qwen3_5-mtp"

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")]

PROMPTS = ['[{"id": 133630, "name": "Omar Sato", "age": 67, "city": "Denver", "email": "',
           "def _parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=__doc__)\n",
           "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:", "He who laughs last"]
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def inputs(b, t, hk, hv, d, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q = (F.normalize(rnd(b, t, hk, d), dim=-1) * d ** -0.5).to(dtype)
    k = F.normalize(rnd(b, t, hk, d), dim=-1).to(dtype)
    v = rnd(b, t, hv, d).to(dtype)
    g = -torch.rand(b, t, hv, generator=gen, device="cuda") * 0.5
    beta = torch.rand(b, t, hv, generator=gen, device="cuda").to(dtype)
    return q, k, v, g, beta, rnd(b, hv, d, d) * 0.1


@pytest.mark.parametrize("form, b, t", [("recurrent", 8, 1), ("recurrent", 8, 4), ("recurrent", 2, 9),
                                        ("chunked", 1, 300), ("chunked", 2, 64), ("chunked", 1, 4096)])
def test_fla_kernels_match_the_reference(form, b, t):
    from engine.kernels.gated_delta import fla as gated_delta_fla
    q, k, v, g, beta, s0 = inputs(b, t, 8, 24, 128, torch.bfloat16, seed=b * 1000 + t)   # a 27B rank's heads
    o, s = getattr(gated_delta_fla, form)(q, k, v, g, beta, s0)
    o_ref, s_ref = ref.recurrent(q, k, v, g, beta, s0) if t <= 64 else ref.chunked(q, k, v, g, beta, s0)
    print(f"\n{form} B={b} T={t}: output rel err {rel(o, o_ref):.2e}, state rel err {rel(s, s_ref):.2e}")
    assert o.shape == o_ref.shape and s.shape == s_ref.shape and s.dtype == torch.float32
    assert rel(o, o_ref) < 2e-2 and rel(s, s_ref) < 2e-2


def test_fla_masked_steps_commit_the_kept_prefix():
    from engine.kernels.gated_delta import fla as gated_delta_fla
    q, k, v, g, beta, s0 = inputs(4, 5, 8, 24, 128, torch.bfloat16, seed=7)
    kept = torch.tensor([1, 2, 4, 5], device="cuda")
    mask = (torch.arange(5, device="cuda") < kept[:, None]).unsqueeze(-1)
    _, s = gated_delta_fla.recurrent(q, k, v, g * mask, beta * mask, s0)
    for r, n in enumerate(kept.tolist()):
        _, want = gated_delta_fla.recurrent(q[r:r + 1, :n], k[r:r + 1, :n], v[r:r + 1, :n], g[r:r + 1, :n],
                                            beta[r:r + 1, :n], s0[r:r + 1])
        assert rel(s[r:r + 1], want) < 1e-5


def generate(**kw) -> tuple[list[list[int]], dict]:
    llm = LLM(str(MODEL), device="cuda", kv_capacity=8192, max_batch=8, **kw)      # warms up (graphs)
    outs = llm.generate(PROMPTS, GREEDY)
    spec = [o.stats.speculative for o in outs]
    llm.engine.executor.shutdown()
    return [o.token_ids for o in outs], {"accepted": sum(s.accepted for s in spec)}


@pytest.fixture(scope="module")
def eager_k0():
    if not MODEL.exists():
        pytest.skip(f"the trained hybrid is not at {MODEL} (copy ../shared/models/tiny-qwen3_5-mtp to .models/)")
    return generate(enforce_eager=True)[0]


def agreement(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens before the first difference, summed over prompts."""
    n = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            n += 1
    return n


def test_graphs_equal_eager(eager_k0):
    graphed, _ = generate()
    print(f"\ngraphs vs eager: {agreement(graphed, eager_k0)} of {48 * len(PROMPTS)} tokens agree")
    assert graphed == eager_k0


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_on_gpu_is_lossless(eager_k0, k):
    got, stats = generate(draft_tokens=k)
    same = agreement(got, eager_k0)
    print(f"\nk={k} vs k=0 (bf16, graphs): {same} of {48 * len(PROMPTS)} tokens agree, {stats['accepted']} accepted")
    assert stats["accepted"] > 0
    # bf16 verify and decode kernels round differently: demand the first 16 tokens of every prompt
    assert all(g[:16] == w[:16] for g, w in zip(got, eager_k0))


def test_async_scheduling_equals_synchronous(eager_k0):
    check_async_scheduling_equals_synchronous(tp=1)


def check_async_scheduling_equals_synchronous(tp: int) -> None:
    # the round planned ahead steps the states the last one left (a verify round commits on the device)
    sync, _ = generate(tensor_parallel_size=tp, draft_tokens=3, async_scheduling=False)
    assert generate(tensor_parallel_size=tp, draft_tokens=3)[0] == sync


def test_packed_prefill_equals_prompts_alone_fp32():
    # every prompt's linear-attention layers run from its own slot inside one packed forward. In float32:
    # in bf16 the packed prompts' GEMMs (other row counts, other cuBLAS kernels) round differently, and
    # on the H200 pair 150 of 192 greedy tokens agreed, one prompt parting before its 16th token
    llm = LLM(str(MODEL), device="cuda", dtype="float32", kv_capacity=8192, max_batch=8, prefill_chunk=256,
              prefix_reuse=False)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    together = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.engine.executor.shutdown()
    print(f"\npacked vs alone (fp32, graphs): {agreement(together, alone)} of {48 * len(PROMPTS)} tokens agree")
    assert together == alone


def test_prompt_logits_near_the_float32_cpu_engine():
    if not MODEL.exists():
        pytest.skip(f"the trained hybrid is not at {MODEL}")
    cpu = LLM(str(MODEL), kv_capacity=4096, dtype="float32")
    gpu = LLM(str(MODEL), device="cuda", kv_capacity=4096, dtype="float32", enforce_eager=True, prefill_chunk=64)
    ids = cpu.tokenizer.encode("\n".join(PROMPTS) * 3)
    a, b = cpu.prompt_logits(ids), gpu.prompt_logits(ids).cpu()
    print(f"\nCUDA float32 (fla, chunks of 64) vs CPU float32 over {len(ids)} positions: "
          f"max abs {float((a - b).abs().max()):.2e}, rel {rel(b, a):.2e}")
    assert rel(b, a) < 1e-2
    gpu.engine.executor.shutdown()
