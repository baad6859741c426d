"""A mixture-of-experts hybrid served: `ninfer engine` (a tiny random Qwen3.5-MoE checkpoint written by
transformers, tests/support/moe.py, with its MTP layer and k = 3 drafts) as a real child process behind the
real Shepherd Model Gateway (`smg launch`, smg's gRPC engine protocol, the tokenizer fetched from the engine).
Greedy OpenAI completions come back as the offline engine without speculation writes them, and a prompt sent again
takes its prefix from the cache (the engine's `engine_request_done` log counts the cached tokens)."""

from __future__ import annotations

import os

import pytest

from engine import SamplingParams
from tests.conftest import make_llm
from tests.support.moe import build_reference, write_checkpoint
from tools.serving.server_process import ServerProcess
from tools.serving.smg_stack import SmgRouter, smg_command

pytestmark = pytest.mark.skipif(smg_command() is None, reason="smg is not installed (the `test` extra installs it)")
pytest.importorskip("transformers")

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MODEL = "tiny-qwen3_5-moe"
LONG = "A mixture of experts routes every token to a few of its experts. " * 4
PROMPTS = ["def fibonacci(n):", "The experts of a mixture", LONG]
MAX_TOKENS = 24


def printable_model(path):
    """A random Qwen3.5-MoE whose lm_head rows of tokens that do not decode to printable text are zero, so greedy
    text is whole characters (the two detokenizers then agree on every byte) and equal text means equal tokens."""
    import torch
    from engine.loading.embedded_model import build_default_tokenizer
    model, mtp = build_reference("qwen3_5_moe", seed=9, echo_mtp=1.2)
    tok = build_default_tokenizer()
    with torch.no_grad():
        for i in range(model.config.vocab_size):
            text = tok.decode([i])
            if not text or not text.isprintable() or "\ufffd" in text:
                model.lm_head.weight[i].zero_()
    write_checkpoint(model, mtp, path)


def test_moe_engine_behind_smg_with_mtp(tmp_path):
    path = tmp_path / MODEL
    printable_model(path)
    llm = make_llm(str(path))
    want = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))]
    assert all(len(t) >= MAX_TOKENS // 2 for t in want), want
    engine = ServerProcess.start("engine", "--model", str(path), "--draft-tokens", "3", "--kv-capacity", "4096",
                                 "--dtype", "float32", env=CHILD_ENV)
    router = None
    try:
        router = SmgRouter.start([engine.address], None, tmp_path / "smg.log")
        router.wait_until_ready(workers=1, model=MODEL, timeout_s=90)
        # the long prompt twice: the second time its prefix comes from the cache (KV blocks up to a state snapshot)
        for prompt, text in zip(PROMPTS + [LONG], want + [want[-1]]):
            got = router.completion({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                     "ignore_eos": True}, timeout=120)
            assert got["usage"]["completion_tokens"] == MAX_TOKENS
            assert got["choices"][0]["text"] == text, prompt
    finally:
        if router is not None:
            router.stop()
        engine.terminate()
        engine.wait(60)
    plans = [e for e in engine.events if e.get("event") == "memory_plan"]
    assert plans and "state slots" in plans[0]["plan"] and plans[0]["draft_tokens"] == 3
    done = [e for e in engine.events if e.get("event") == "engine_request_done"]
    cached = [e["ninfer.cached_tokens"] for e in done]
    assert len(cached) >= len(PROMPTS) + 1, cached                  # (smg may send its own requests first)
    assert cached[-2] == 0 and cached[-1] >= 32, cached             # the first and the second run of LONG
