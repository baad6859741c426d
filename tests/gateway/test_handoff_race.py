"""The prefill -> decode handoff under cancels and short deadlines (issue 12, item 1).

A request through the gateway is a Prefill call (the engine parks the prefilled request under a
handle) and then a Decode call that attaches to it. A client that cancels or runs out of deadline
anywhere in between must leave nothing parked: the handle is released within one engine step, not
when its lease expires. Seeded: each batch draws its cancel or deadline times across that window
(the first token, the first milliseconds, deadlines of 0.5-30 ms). After each batch: no handle
parked, no lease expired, every KV block free and every block reference dropped, the gateway's
in-flight counts (per engine and in total) back at 0.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import grpc
import pytest

from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from gateway.serve import ServeStack
from services.engine_client import EngineClient
from services.server.grpc_server import ServerOptions

SEED = 12
LEASE_S = 30.0                  # far longer than a batch: a leaked handle cannot expire unseen
SETTLE_S = 2.0                  # a released handle is gone within one engine step; this is slack
BATCH = 52
CONCURRENCY = 8
# (what the client does, how many batches): cancels right after the first token, cancels 0-20 ms after
# the call starts, deadlines of 3-30 ms, deadlines of 0.5-4 ms; each batch also has normal requests.
PLANS = [("cancel_after_first_token", 3), ("cancel_0_20ms", 3), ("deadline_3_30ms", 2), ("deadline_05_4ms", 2)]
SAMPLING = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def stack():
    s = ServeStack(EngineConfig(kv_capacity=4096, max_batch=8, max_pending=64, pending_timeout_ms=3000,
                                lease_seconds=LEASE_S),
                   ServerOptions(listen="127.0.0.1:0")).start()
    yield s
    s.stop()


def one_request(client: GatewayClient, plan: str, rng: random.Random) -> str:
    """Run one Generate call as `plan` says; returns its final status name."""
    normal = rng.random() < 0.15
    timeout = None
    if not normal and plan == "deadline_3_30ms":
        timeout = rng.uniform(0.003, 0.030)
    elif not normal and plan == "deadline_05_4ms":
        timeout = rng.uniform(0.0005, 0.004)
    call = client.generate(f"race {rng.random():.6f}", sampling=SAMPLING, timeout=timeout)
    timer = None
    if not normal and plan == "cancel_0_20ms":
        timer = threading.Timer(rng.uniform(0.0, 0.020), call.cancel)
        timer.start()
    try:
        for _ in call:
            if not normal and plan == "cancel_after_first_token":
                call.cancel()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name
    finally:
        if timer is not None:
            timer.join()


def settled_leftovers(stack: ServeStack, engine: EngineClient) -> list[str]:
    """Wait up to SETTLE_S for the engine to hold nothing; returns the handles still parked (and
    releases them, so that the next batch starts clean and the count says what this batch left)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        q = engine.metrics().queue
        if not (q.waiting or q.prefilling or q.running or q.parked):
            return []
        time.sleep(0.01)
    parked = stack.engine.loop.call(lambda core: list(core.scheduler.parked))
    for handle in parked:
        engine.release(handle)
    return parked


def test_cancels_and_deadlines_across_the_handoff_leave_nothing_parked(stack):
    rng = random.Random(SEED)
    leaked: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    total = 0
    with GatewayClient(stack.address) as client, EngineClient(stack.engine.address, stack.engine_api_key) as engine:
        client.wait_until_serving(timeout_s=60)
        for plan, batches in PLANS:
            for _ in range(batches):
                seeds = [rng.randrange(1 << 30) for _ in range(BATCH)]
                results: list[str] = []
                lock = threading.Lock()

                def worker(chunk: list[int]) -> None:
                    for s in chunk:
                        status = one_request(client, plan, random.Random(s))
                        with lock:
                            results.append(status)

                threads = [threading.Thread(target=worker, args=(seeds[i::CONCURRENCY],)) for i in range(CONCURRENCY)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
                assert len(results) == BATCH
                statuses.update(results)
                total += BATCH
                leaked[plan] += len(settled_leftovers(stack, engine))
                m = engine.metrics()
                assert m.performance.requests.get("lease_expired", 0) == 0
                assert m.kv.free_blocks == m.kv.num_blocks and m.kv.refs_taken == m.kv.refs_dropped
                deadline = time.monotonic() + SETTLE_S
                while stack.gateway.state.in_flight and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert [n for _, _, n in stack.gateway.router.loads()] == [0], "gateway per-engine in-flight"
                assert stack.gateway.state.in_flight == 0
    assert total >= 500
    assert set(statuses) <= {"OK", "CANCELLED", "DEADLINE_EXCEEDED"}, statuses
    assert statuses["CANCELLED"] and statuses["DEADLINE_EXCEEDED"] and statuses["OK"], statuses
    assert sum(leaked.values()) == 0, f"handles left parked after {total} requests: {dict(leaked)} ({dict(statuses)})"
