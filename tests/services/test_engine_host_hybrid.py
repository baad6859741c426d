"""The engine process's state-slot gauge on a hybrid model (the trained tiny Qwen3.5 beside the checkout):
`ninfer_engine_state_slots{state}` counts a parked request's slot as used and gives it back on release."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from gateway.client import SamplingParams
from services.engine_client import EngineClient
from services.engine_host import EngineHost
from services.server.grpc_server import ServerOptions
from tests.support.hybrid import require_shared_hybrid


@pytest.fixture(scope="module")
def host():
    h = EngineHost(EngineConfig(model=require_shared_hybrid(), kv_capacity=2048, max_batch=4, draft_tokens=0),
                   ServerOptions(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")).start().load()
    yield h
    h.stop()


def slots(host: EngineHost) -> tuple[float, float]:
    sample = host.registry.get_sample_value
    return sample("ninfer_engine_state_slots", {"state": "used"}), sample("ninfer_engine_state_slots", {"state": "free"})


def test_a_parked_request_holds_a_state_slot_until_released(host):
    with EngineClient(host.address) as engine:
        engine.wait_idle()
        used, free = slots(host)
        assert used == 0 and free > 0
        kv = host.loop.metrics()["kv"]
        assert free == kv["state_slots"]
        first = engine.prefill([5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
        assert slots(host) == (1, free - 1)                   # the parked handle keeps its state
        engine.release(first.handle)
        engine.wait_idle()
        assert slots(host) == (0, free)
