"""The prefill and decode servicers (services/prefill.py, services/decode.py) on mixtures of experts, called over
the real gRPC servers on 127.0.0.1 (EngineHost, in this process): tiny random Qwen3-MoE and Qwen3.5-MoE
checkpoints written with real safetensors (tests/support/moe.py). A prompt prefilled through PrefillService and
streamed through DecodeService comes back, greedy, token for token as the in-process LLM without speculation writes
it -- with MTP k = 3 on the hybrid, whose drafts are accepted and rejected -- and afterwards the engine holds
nothing: every KV block, reference, state slot and request is back."""

from __future__ import annotations

import pytest

from engine import SamplingParams as EngineSamplingParams
from engine.config import EngineConfig
from gateway.client import SamplingParams
from services.convert import stats_from_proto
from services.engine_client import EngineClient
from services.engine_host import EngineHost
from services.server.grpc_server import ServerOptions
from tests.conftest import assert_kv_idle, make_llm
from tests.engine.models.test_qwen3_vs_transformers import random_prompts
from tests.support.moe import build_random_moe

pytest.importorskip("transformers")

PROMPTS = random_prompts(384, [7, 29], seed=4)
MAX_TOKENS = 12


@pytest.mark.parametrize("arch, draft_tokens", [("qwen3_moe", 0), ("qwen3_5_moe", 3)])
def test_prefill_then_decode_equals_the_in_process_engine(arch, draft_tokens, tmp_path):
    path = tmp_path / arch
    build_random_moe(path, arch, seed=3, echo_mtp=1.2)
    greedy = EngineSamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    want = [o.token_ids for o in make_llm(str(path)).generate(PROMPTS, greedy)]
    host = EngineHost(EngineConfig(model=str(path), kv_capacity=2048, max_batch=4, draft_tokens=draft_tokens,
                                   dtype="float32"),
                      ServerOptions(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")).start().load()
    try:
        assert host.loop.core.draft_tokens == draft_tokens
        accepted = 0
        with EngineClient(host.address) as engine:
            for prompt, tokens in zip(PROMPTS, want):
                first = engine.prefill(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                assert first.handle and not first.finished and len(first.token_ids) == 1
                msgs = list(engine.decode(first.handle, timeout=120))
                got = list(first.token_ids) + [t for m in msgs for t in m.token_ids]
                assert got == tokens, prompt
                stats = stats_from_proto(msgs[-1].stats)
                assert stats.finish_reason == "length" and stats.usage.completion_tokens == MAX_TOKENS
                if draft_tokens:
                    assert stats.speculative.draft_tokens == draft_tokens
                    accepted += stats.speculative.accepted
            if draft_tokens:
                assert accepted > 0, "no draft was accepted: the k = 3 path was not exercised"
            m = engine.wait_idle()
            assert (m.queue.waiting, m.queue.prefilling, m.queue.running, m.queue.parked) == (0, 0, 0, 0)
            assert m.kv.state_slots_used == 0
        assert_kv_idle(host.loop.core)
    finally:
        host.stop()
