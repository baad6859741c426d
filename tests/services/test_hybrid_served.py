"""The trained hybrid served end to end: `ninfer serve --model <tiny-qwen3_5-mtp> --draft-tokens 3` as a
real child process (gateway + engine, gRPC on 127.0.0.1). Greedy streams of several workloads come
back token for token as the offline engine without speculation produces them, with MTP rounds that
accepted drafts; the engine ends idle (KV and state slots) and the server drains on SIGTERM."""

from __future__ import annotations

import time

import os

import pytest

from tests.conftest import WORKLOADS, make_llm
from engine import SamplingParams as EngineSamplingParams
from ninfer.v1 import gateway_pb2
from gateway.client import GatewayClient, SamplingParams
from tools.serving.server_process import ServerProcess
from tests.support.hybrid import require_shared_hybrid
from services.convert import stats_from_proto

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PROMPTS = [WORKLOADS["json"][0], WORKLOADS["code"][1], WORKLOADS["prose"][0]]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def offline_k0():
    llm = make_llm(require_shared_hybrid())
    outs = llm.generate(PROMPTS, EngineSamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))
    return [o.token_ids for o in outs]


def engine_kv(client: GatewayClient):
    reply = client.stub.GetEngineMetrics(gateway_pb2.GetEngineMetricsRequest(), timeout=10, metadata=client.metadata)
    return reply.engines[0].metrics.kv


def test_serve_hybrid_with_mtp_end_to_end(offline_k0):
    model = require_shared_hybrid()
    with ServerProcess.start("serve", "--model", model, "--draft-tokens", "3", "--kv-capacity", "4096",
                             "--dtype", "float32", "--drain-timeout", "60", env=CHILD_ENV) as serve:
        with GatewayClient(serve.address) as client:
            client.wait_until_serving(timeout_s=120)
            for prompt, want in zip(PROMPTS, offline_k0):
                tokens, last = [], None
                for msg in client.generate(prompt, sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                           include_token_ids=True, timeout=120):
                    tokens.extend(msg.token_ids)
                    last = msg
                stats = stats_from_proto(last.result.stats)
                assert tokens == want, prompt
                assert stats.finish_reason == "length" and stats.usage.completion_tokens == MAX_TOKENS
                spec = stats.speculative
                assert spec.draft_tokens == 3 and spec.accepted > 0 and len(spec.accepted_per_position) == 3
            call = client.generate(PROMPTS[0], sampling=SamplingParams(max_tokens=4000, ignore_eos=True), timeout=120)
            next(call)                                   # one request holds a linear-attention state slot
            kv = engine_kv(client)
            assert kv.state_slots > 0 and kv.state_slots_used == 1, kv
            call.cancel()
            deadline = time.monotonic() + 30
            while engine_kv(client).state_slots_used and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine_kv(client).state_slots_used == 0
        serve.terminate()
        assert serve.wait(60) == 0
    plans = [e for e in serve.events if e.get("event") == "memory_plan"]
    assert plans and "state slots" in plans[0]["plan"]
