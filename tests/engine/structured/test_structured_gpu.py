"""Structured output on CUDA (marked `gpu` by tests/conftest.py, skipped without a device): k = 0 rounds
replay the captured constrained twin of their variant (the mask read from the persistent buffer) and
equal eager rounds token for token; k = 3 (constrained rounds eager between captured unconstrained
ones) equals k = 0; with logprobs and penalties on, and seeded sampling, too. float32 for exactness."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (the gpu extra, or .ci/run's --no-deps line)")

from engine import LLM, SamplingParams  # noqa: E402
from engine.request_stats import FinishReason  # noqa: E402
from tests.engine.structured.test_structured_generate import CONSTRAINTS, PROMPTS, obeys  # noqa: E402
from tests.engine.test_engine_gpu import MODEL  # noqa: E402

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"shared test model not found at {MODEL}")
DEVICE = "cuda"

FREE = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return", "The interpreter reads the source file and"]
CASES = {
    "greedy": dict(temperature=0.0),
    "options": dict(temperature=0.0, logprobs=3, repetition_penalty=1.3, presence_penalty=0.4, logit_bias={13: 2.0}),
    "sampled": dict(temperature=1.0, top_p=0.95, seed=7),
}


def _run(case: str, **engine) -> list:
    llm = LLM(str(MODEL), device=DEVICE, dtype="float32", kv_capacity=8192, max_batch=16, **engine)
    constrained = [SamplingParams(max_tokens=120, structured_output=so, **CASES[case]) for so in CONSTRAINTS]
    free = [SamplingParams(max_tokens=60, ignore_eos=True, **CASES[case])] * len(FREE)
    outs = llm.generate(PROMPTS + FREE, constrained + free)          # a mixed batch: constrained and not
    graphs = llm.engine.warmup_report.cuda_graphs
    llm.engine.executor.shutdown()
    return outs, graphs


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module", params=list(CASES))
def eager_k0(request):
    outs, graphs = _run(request.param, draft_tokens=0, enforce_eager=True)
    assert not graphs
    return request.param, outs


def test_captured_constrained_rounds_equal_eager(eager_k0):
    case, eager = eager_k0
    graphed, graphs = _run(case, draft_tokens=0)
    assert graphs
    assert _tokens(graphed) == _tokens(eager)
    for so, out in zip(CONSTRAINTS, graphed):
        if out.finish_reason is FinishReason.STOP:
            assert obeys(so, out.text), (so, out.text)
    if case == "options":
        for a, b in zip(graphed, eager):
            for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                fa = {t: lp.logprob for t, lp in pa.items() if lp.logprob > float("-inf")}
                fb = {t: lp.logprob for t, lp in pb.items() if lp.logprob > float("-inf")}
                assert fa.keys() == fb.keys() and all(abs(fa[t] - fb[t]) < 1e-4 for t in fa)


def test_k3_equals_k0(eager_k0):
    case, eager = eager_k0
    if case == "sampled":
        pytest.skip("sampled k = 3 is lossless in distribution, not token for token")
    k3, _ = _run(case, draft_tokens=3)
    assert _tokens(k3) == _tokens(eager)
