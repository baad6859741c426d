"""The engine on CUDA: speculative decoding stays lossless, graphs equal eager, int8 KV, TP=2.

Marked `gpu` by tests/conftest.py and skipped without a CUDA device (CI); TP=2: test_engine_multi_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

# the repository's .models/, the one beside a copy of it (the GPU machine), or the shared folder
_CANDIDATES = [Path(__file__).resolve().parents[2] / ".models", Path(__file__).resolve().parents[3] / ".models",
               Path(__file__).resolve().parents[3] / "shared" / "models"]
MODEL = next((c / "tiny-qwen3-mtp" for c in _CANDIDATES if (c / "tiny-qwen3-mtp").exists()),
             _CANDIDATES[-1] / "tiny-qwen3-mtp")

needs_model = pytest.mark.skipif(not MODEL.exists(), reason=f"shared test model not found at {MODEL}")
pytestmark = [needs_model]

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    '{"order_id": "ORD-381901", "item": "printer", "quantity": 8}, {"order_id": "ORD-381902",',
    "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:",
    "The interpreter reads the source file and",
]
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)


def _generate(prompts: list[str] | None = None, **kw) -> list[list[int]]:
    llm = LLM(str(MODEL), device="cuda", kv_capacity=8192, max_batch=8, **kw)
    outs = [o.token_ids for o in llm.generate(prompts or PROMPTS, GREEDY)]
    llm.engine.executor.shutdown()
    return outs


@pytest.fixture(scope="module")
def fp32_k0():
    return _generate(dtype="float32", draft_tokens=0)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_k0_fp32(fp32_k0, k):
    assert _generate(dtype="float32", draft_tokens=k) == fp32_k0


def test_packed_prefill_equals_prompts_prefilled_alone_fp32(fp32_k0):
    # fp32_k0 prefilled its four prompts packed in one chunk (engine.sched.prefill_lane); here one at a time
    llm = LLM(str(MODEL), device="cuda", dtype="float32", kv_capacity=8192, max_batch=8)
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    llm.engine.executor.shutdown()
    assert alone == fp32_k0


def test_adaptive_draft_length_with_graphs_equals_k0_fp32(fp32_k0):
    # one graph per round length (0 .. 3 drafts) replayed as the policy picks (engine.sched.draft_policy)
    assert _generate(dtype="float32", draft_tokens=3, adaptive_draft=True) == fp32_k0
    assert _generate(dtype="float32", draft_tokens=3, adaptive_draft=True, enforce_eager=True) == fp32_k0


def test_cuda_graphs_equal_eager_fp32(fp32_k0):
    assert _generate(dtype="float32", draft_tokens=0, enforce_eager=True) == fp32_k0


# different lengths, a stop token, a seeded sampled row: async scheduling must change nothing
MIXED = [SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0), SamplingParams(max_tokens=40, stop_token_ids=[13], temperature=0.0),
         SamplingParams(max_tokens=31, temperature=0.8, top_p=0.9, seed=7), SamplingParams(max_tokens=64, temperature=0.0)]


def _generate_mixed(**kw) -> list[tuple[list[int], str]]:
    llm = LLM(str(MODEL), device="cuda", kv_capacity=8192, max_batch=8, **kw)
    outs = [(o.token_ids, o.finish_reason.value) for o in llm.generate(PROMPTS, MIXED)]
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.refs_taken == kv.refs_dropped
    assert llm.engine.async_scheduling == kw.get("async_scheduling", True)
    llm.engine.executor.shutdown()
    return outs


@pytest.mark.parametrize("k", [0, 3])
def test_async_scheduling_equals_synchronous_with_graphs_fp32(fp32_k0, k):
    # greedy, equal lengths: the overlapped loop (the default) against every round waiting for the last
    assert _generate(dtype="float32", draft_tokens=k, async_scheduling=False) == fp32_k0
    mixed = _generate_mixed(dtype="float32", draft_tokens=k, async_scheduling=False)
    assert _generate_mixed(dtype="float32", draft_tokens=k) == mixed


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of tokens equal up to each pair's first divergence, over all tokens."""
    same = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        same += n
    return same / sum(len(x) for x in a)


def test_bf16_speculative_agrees_with_k0():
    base = _generate(dtype="bfloat16", draft_tokens=0)
    spec = _generate(dtype="bfloat16", draft_tokens=3)
    rate = _agreement(base, spec)
    print(f"bf16 k=3 vs k=0 agreement before first divergence: {rate:.3f}")
    assert rate >= 0.9


def test_int8_kv_agrees_with_bf16_kv():
    base = _generate(dtype="bfloat16", draft_tokens=0)
    int8 = _generate(dtype="bfloat16", kv_dtype="int8", draft_tokens=0)
    rate = _agreement(base, int8)
    print(f"int8 KV vs bf16 KV agreement before first divergence: {rate:.3f}")
    assert rate >= 0.7


def test_sampled_decoding_is_reproducible_on_gpu():
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)] * 2
    llm = LLM(str(MODEL), device="cuda", kv_capacity=8192, max_batch=8, draft_tokens=3)
    first = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
    second = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
    assert first == second


def test_automatic_kv_capacity_fits_the_device():
    check_automatic_kv_capacity(tp=1)


def check_automatic_kv_capacity(tp: int) -> None:
    """kv_capacity=None sizes the KV pool from free memory; with MTP KV, graphs of every bucket, a
    full prefill chunk and a full decode batch in flight, no device may go past memory_utilization."""
    import random
    utilization, slack = 0.9, 1 << 30              # slack: rank 1's CUDA context, the allocator's rounding
    llm = LLM("preset:qwen3-8b", device="cuda", tensor_parallel_size=tp, draft_tokens=3, prefill_chunk=4096,
              max_batch=16, memory_utilization=utilization, max_model_len=16384)
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 100000) for _ in range(8192)]] + \
                  [[rng.randrange(1000, 100000) for _ in range(64)] for _ in range(15)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
        assert all(len(o.token_ids) == 16 for o in outs)
        assert llm.engine.kv.capacity_tokens > 100_000       # the pool took the room there was
        for device in llm.engine.executor.devices:
            torch.cuda.synchronize(device)
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            print(f"TP={tp} {device}: {used / 2**30:.1f} of {total / 2**30:.1f} GiB used, "
                  f"KV {llm.engine.kv.capacity_tokens} tokens; plan: {llm.engine.memory.describe()}")
            assert used <= utilization * total + slack, f"{device}: {used / 2**30:.1f} GiB used"
    finally:
        llm.engine.executor.shutdown()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_long_prompts_through_the_tma_prefill_routes_agree_with_the_paged_kernel(monkeypatch, kv_dtype):
    """The engine's prefill of 2.5k-3.5k-token prompts in chunks of 512, through the gather route and, once a chunk's
    keys pass the (shrunk) gather bound, through prefill_segments, against the same prompts on the paged kernel
    (NINFER_PREFILL_TMA=0). The trained model's head_dim 64 is let onto the TMA routes for the test; bounds shrunk
    so 1 MiB holds 2,048 keys and segments hold 768."""
    from engine.kernels.attention import paged as A
    from engine.kernels.attention import prefill_tma as P
    monkeypatch.setattr(A, "PREFILL_TMA_HEAD_DIMS", (64, 128, 256))
    monkeypatch.setattr(A, "PREFILL_GATHER_MAX_BYTES", 1 << 20)
    monkeypatch.setattr(A, "PREFILL_SEGMENT_MIN_QUERIES", 256)
    monkeypatch.setattr(A, "SEGMENT_MIN_KEYS", 256)
    calls = {"segments": 0, "gather": 0}
    segments, gather = P.prefill_segments, P.prefill_attention

    def counted_segments(*a, **kw):
        calls["segments"] += 1
        return segments(*a, **kw)

    def counted_gather(*a, **kw):
        calls["gather"] += 1
        return gather(*a, **kw)
    monkeypatch.setattr(P, "prefill_segments", counted_segments)
    monkeypatch.setattr(P, "prefill_attention", counted_gather)
    prompts = [PROMPTS[1] * 100, PROMPTS[2] * 150]                # 3,500 and 2,550 tokens
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)

    def run() -> list[list[int]]:
        llm = LLM(str(MODEL), device="cuda", kv_capacity=16384, max_batch=8, prefill_chunk=512, kv_dtype=kv_dtype,
                  draft_tokens=0)
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        llm.engine.executor.shutdown()
        return outs

    routed = run()
    assert calls["segments"] > 0 and calls["gather"] > 0, calls
    monkeypatch.setenv("NINFER_PREFILL_TMA", "0")
    before = dict(calls)
    paged = run()
    assert calls == before                        # the switch keeps every call on the paged kernel
    rate = _agreement(paged, routed)
    print(f"{kv_dtype} KV: TMA prefill routes vs paged kernel agreement before first divergence: {rate:.3f}")
    assert rate >= 0.9
