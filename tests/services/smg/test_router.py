"""The real Shepherd Model Gateway (`smg launch`, PyPI smg) in front of two `ninfer engine`
processes over smg's gRPC engine protocol, with `--policy cache_aware`: OpenAI completions give the
text ninfer's own gateway gives, stream, land on the engine that holds their prefix, survive an
engine's death, and a client that drops its HTTP request aborts the engine request."""

from __future__ import annotations

import os
import time

import pytest

from gateway.client import GatewayClient, SamplingParams
from tools.serving.server_process import ServerProcess
from services.engine_client import EngineClient
from tools.serving.smg_stack import SmgRouter, smg_command

pytestmark = pytest.mark.skipif(smg_command() is None, reason="smg is not installed (the `test` extra installs it)")

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}     # two engines share the CI machine's two cores
MODEL = "tiny-qwen3-mtp"
PREFIX = "The Python standard library is very extensive, offering a wide range of facilities. " * 6


@pytest.fixture(scope="module")
def stack(shared_model, tmp_path_factory):
    args = ("--model", shared_model, "--kv-capacity", "4096", "--draft-tokens", "2")
    engines = [ServerProcess.start("engine", *args, env=CHILD_ENV) for _ in range(2)]
    clients = [EngineClient(e.address) for e in engines]
    gateway = router = None
    try:
        for c in clients:
            c.wait_until_serving(timeout_s=60)
        gateway = ServerProcess.start("gateway", "--engine", ",".join(e.address for e in engines), env=CHILD_ENV)
        router = SmgRouter.start([e.address for e in engines], shared_model,
                                 tmp_path_factory.mktemp("smg") / "smg.log")
        router.wait_until_ready(workers=2, model=MODEL, timeout_s=60)
        yield engines, clients, gateway, router
    finally:
        if router is not None:
            router.stop()
        for p in [gateway, *engines]:
            if p is not None and p.proc.poll() is None:
                p.terminate()
                p.wait(30)
        for c in clients:
            c.close()


def finished_counts(clients) -> list[int]:
    return [sum(c.metrics().performance.requests.values()) for c in clients]


def served_by(clients, before: list[int]) -> int:
    grew = [i for i, (a, b) in enumerate(zip(finished_counts(clients), before)) if a > b]
    assert len(grew) == 1, f"finished counts {before} -> {finished_counts(clients)}"
    return grew[0]


def test_greedy_completion_matches_ninfer_gateway_with_and_without_a_stop_string_and_streams(stack):
    _, _, gateway, router = stack
    prompt = "def fibonacci(n):"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    via_smg = router.completion(body)
    assert via_smg["usage"]["completion_tokens"] == 24
    with GatewayClient(gateway.address) as client:
        client.wait_until_serving(timeout_s=30)
        msgs = list(client.generate(prompt, sampling=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                    timeout=60))
    via_ninfer = "".join(m.text for m in msgs)
    assert via_smg["choices"][0]["text"] == via_ninfer and via_ninfer

    stopped = router.completion({**body, "stop": ["\n\n"], "ignore_eos": False})
    with GatewayClient(gateway.address) as client:
        cut = "".join(m.text for m in client.generate(prompt, sampling=SamplingParams(
            max_tokens=24, temperature=0.0, stop=["\n\n"]), timeout=60))
    assert stopped["choices"][0]["text"] == cut and len(cut) < len(via_ninfer)

    events = list(router.stream_completion(body))
    texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
    assert sum(1 for t in texts if t) > 1, "the text arrives in several events"
    assert "".join(texts) == via_ninfer


def test_requests_sharing_a_long_prefix_land_on_the_engine_that_holds_it(stack):
    engines, clients, _, router = stack
    before = finished_counts(clients)
    first = router.completion({"model": MODEL, "prompt": PREFIX + "alpha", "max_tokens": 4, "temperature": 0})
    holder = served_by(clients, before)
    # an unrelated long prompt, to give the other engine something of its own
    router.completion({"model": MODEL, "prompt": "import json\n" * 40, "max_tokens": 4, "temperature": 0})
    before = finished_counts(clients)
    second = router.completion({"model": MODEL, "prompt": PREFIX + "beta", "max_tokens": 4, "temperature": 0})
    assert served_by(clients, before) == holder
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # smg's event-driven index took the holder's KV events (SubscribeKvEvents)
    assert router.metric("smg_kv_event_apply_seconds_count", f"grpc://{engines[holder].address}") >= 1


def test_a_client_that_drops_its_request_aborts_the_engine_request(stack):
    _, clients, _, router = stack
    aborted = [c.metrics().performance.requests.get("abort", 0) for c in clients]
    events = router.stream_completion({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000,
                                       "temperature": 0, "ignore_eos": True})
    next(events), next(events)
    events.close()                                  # the HTTP connection goes away mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = [c.metrics().performance.requests.get("abort", 0) for c in clients]
        if sum(now) > sum(aborted):
            break
        time.sleep(0.05)
    assert sum(now) == sum(aborted) + 1
    for c in clients:
        m = c.wait_idle(timeout_s=10)
        assert m.kv.free_blocks == m.kv.num_blocks and m.kv.refs_taken == m.kv.refs_dropped
        assert m.queue.running == 0 and m.queue.waiting == 0


def test_when_an_engine_dies_requests_go_to_the_other(stack):
    engines, clients, _, router = stack
    engines[0].kill()
    survivor = clients[1]
    before = sum(survivor.metrics().performance.requests.values())
    for i in range(4):
        out = router.completion({"model": MODEL, "prompt": f"after the crash {i}", "max_tokens": 4, "temperature": 0},
                                timeout=30)
        assert out["usage"]["completion_tokens"] == 4
    assert sum(survivor.metrics().performance.requests.values()) == before + 4


def test_without_a_model_path_smg_takes_the_tokenizer_from_the_engine(tmp_path):
    """The embedded model has no directory: smg loads the tokenizer the engine serves (GetTokenizer)."""
    with ServerProcess.start("engine", "--kv-capacity", "2048", env=CHILD_ENV) as engine, \
            EngineClient(engine.address) as client:
        client.wait_until_serving(timeout_s=60)
        name = client.model_info().model
        with SmgRouter.start([engine.address], None, tmp_path / "smg.log") as router:
            router.wait_until_ready(workers=1, model=name, timeout_s=60)
            out = router.completion({"model": name, "prompt": "Hello", "max_tokens": 6, "temperature": 0,
                                     "ignore_eos": True})
            assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["text"]
            assert "Fetching tokenizer from worker" in router.log_path.read_text(errors="replace")
