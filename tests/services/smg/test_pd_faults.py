"""Prefill/decode faults on real processes (docs/disaggregation.md, "Faults"): `ninfer engine --kv-role
producer|consumer` processes moving the KV with NIXL, a producer SIGSTOPped (its agent stops answering) or
SIGKILLed mid-transfer, a consumer SIGKILLed mid-stream behind the real smg router. After each fault every
surviving engine holds nothing: no KV block, no parked request (a lease), no running or queued request.

One fleet for the module, cheap on purpose (CI's time budget): a producer with a 1 s lease, a consumer with
a 1 s pull timeout and room for one request's KV only, a second producer that is killed; smg only for the
last case, which kills the consumer."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2 as pb, vllm_engine_pb2_grpc

from services.engine_client import EngineClient
from tests.support import pd
from tests.support.pd import PROMPT, REMOTE_DECODE, leases_expired
from tests.support.polling import wait_for
from tools.serving.server_process import ServerProcess
from tools.serving.smg_stack import SmgRouter, smg_command

pytest.importorskip("nixl_cu12", reason="NIXL is not installed (the `test` extra installs nixl-cu12)")

MODEL = "tiny-qwen3-mtp"
LEASE_S = 1.0
PULL_TIMEOUT_S = 1.0


class Engine:
    """An engine process with its gRPC stubs."""

    def __init__(self, proc: ServerProcess):
        self.proc = proc
        self.channel = grpc.insecure_channel(proc.address)
        self.stub = vllm_engine_pb2_grpc.VllmEngineStub(self.channel)
        self.client = EngineClient(proc.address)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.proc.pid, sig)

    def events(self, name: str) -> list[dict]:
        return [e for e in self.proc.events if e.get("event") == name]

    def close(self) -> None:
        self.client.close()
        self.channel.close()
        if self.proc.proc.poll() is None:
            self.proc.kill()


def start(model: str, role: str, *flags: str) -> Engine:
    proc = ServerProcess.start("engine", "--model", model, "--dtype", "float32",
                               "--kv-role", role, *flags, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with EngineClient(proc.address) as client:
        client.wait_until_serving(timeout_s=120)
    return Engine(proc)


@pytest.fixture(scope="module")
def fleet(shared_model):
    # the producer: room for two parked prompts (10 blocks), so that one long prompt reuses every block
    specs = {"producer": ("producer", "--kv-capacity", "160", "--lease-seconds", str(LEASE_S)),
             # room for one request of PROMPT (6 blocks): a landing of 5 blocks leaves too little for another
             "consumer": ("consumer", "--kv-capacity", "96", "--kv-pull-timeout", str(PULL_TIMEOUT_S)),
             "doomed_producer": ("producer", "--kv-capacity", "1024", "--lease-seconds", str(LEASE_S))}
    with ThreadPoolExecutor(len(specs)) as pool:                 # the three start side by side
        futures = {name: pool.submit(start, shared_model, *spec) for name, spec in specs.items()}
        engines = {}
        try:
            for name, f in futures.items():
                engines[name] = f.result()
            yield engines
        finally:
            for f in futures.values():
                if f.exception() is None:
                    f.result().close()


def generate(engine: Engine, **leg) -> pb.GenerateComplete:
    return pd.generate(engine.stub, **{"max_tokens": 8, "timeout_s": 30, **leg})


def lend(producer: Engine, request_id: str, prompt=PROMPT) -> str:
    """The producer's prefill leg: its hand-off (the request stays parked under a lease)."""
    handoff = generate(producer, kv=REMOTE_DECODE, max_tokens=1, request_id=request_id,
                       prompt=prompt).kv_transfer_params_json
    assert json.loads(handoff)["remote_block_ids"], handoff
    return handoff


@pytest.fixture
def stopped(fleet):
    """SIGSTOP a process for the test's body (its NIXL agent stops answering READs); SIGCONT after."""
    held: list[Engine] = []

    def stop(engine: Engine) -> None:
        engine.signal(signal.SIGSTOP)
        held.append(engine)
    yield stop
    for engine in held:
        if engine.proc.proc.poll() is None:
            engine.signal(signal.SIGCONT)


def test_a_pull_after_the_lease_ended_recomputes_the_prompt_instead_of_decoding_reused_blocks(fleet):
    producer, consumer = fleet["producer"], fleet["consumer"]
    alone = generate(producer, request_id="f-alone")              # untagged: the producer serves it whole
    expired_before = leases_expired(producer.client)
    handoff = lend(producer, "f-late")
    assert wait_for(lambda: producer.client.metrics().queue.parked == 0, LEASE_S + 5), "the lease ended"
    assert wait_for(lambda: leases_expired(producer.client) == expired_before + 1), "counted as an expiry"
    # every block of the pool goes to another prompt: a pull now reads its KV under the old prompt's name
    generate(producer, prompt=list(range(900, 1050)), request_id="f-reuse")
    consumer.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
    stale_before = len(consumer.events("kv_pull_stale"))
    decode = generate(consumer, kv=handoff, request_id="f-late")
    assert list(decode.output_ids) == list(alone.output_ids)
    assert decode.cached_tokens == 0                  # recomputed: nothing of the pulled blocks was taken
    assert wait_for(lambda: len(consumer.events("kv_pull_stale")) == stale_before + 1)
    for engine in (producer, consumer):
        pd.assert_nothing_held(engine.client, LEASE_S)


def test_a_stalled_pull_times_out_unavailable_and_a_consumer_without_room_queues_and_recomputes(fleet, stopped):
    """The producer stops answering (SIGSTOP) under a pull: it is cancelled after --kv-pull-timeout and the
    leg answers UNAVAILABLE. Meanwhile its landing holds the consumer's room: the next decode leg cannot
    reserve blocks for its pull, so it recomputes the prompt, queued until the room comes back."""
    producer, consumer = fleet["producer"], fleet["consumer"]
    alone = generate(producer, request_id="f-alone2")
    stalled, queued = lend(producer, "f-stalled"), lend(producer, "f-queued")
    consumer.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
    stopped(producer)
    results: dict[str, object] = {}

    def leg(name: str, handoff: str) -> None:
        started = time.monotonic()
        try:
            results[name] = generate(consumer, kv=handoff, request_id=name)
        except grpc.RpcError as e:
            results[name] = e
        results[name + ".seconds"] = time.monotonic() - started
    first = threading.Thread(target=leg, args=("f-stalled", stalled))
    first.start()
    num_blocks = consumer.client.metrics().kv.num_blocks
    assert wait_for(lambda: consumer.client.metrics().kv.free_blocks <= num_blocks - 5), "the landing is reserved"
    leg("f-queued", queued)
    first.join(30)
    error = results["f-stalled"]
    assert isinstance(error, grpc.RpcError) and error.code() is grpc.StatusCode.UNAVAILABLE, error
    assert "timed out" in error.details() and "pulling the prompt's KV from producer" in error.details()
    assert PULL_TIMEOUT_S <= results["f-stalled.seconds"] < PULL_TIMEOUT_S + 5
    done = results["f-queued"]
    assert isinstance(done, pb.GenerateComplete), done
    assert list(done.output_ids) == list(alone.output_ids) and done.cached_tokens == 0
    assert any(e.get("request_id", "").startswith("f-queued") for e in consumer.events("kv_pull_skipped_no_room"))
    producer.signal(signal.SIGCONT)
    for engine in (consumer, producer):                # the producer's two leases end by expiry
        pd.assert_nothing_held(engine.client, LEASE_S)


def test_a_producer_killed_mid_transfer_fails_the_leg_unavailable_and_the_consumer_holds_nothing(fleet, stopped):
    doomed, consumer = fleet["doomed_producer"], fleet["consumer"]
    handoff = lend(doomed, "f-doomed")
    stopped(doomed)                                    # the READ starts and stalls ...
    results: dict[str, object] = {}

    def leg() -> None:
        try:
            results["leg"] = generate(consumer, kv=handoff, request_id="f-doomed")
        except grpc.RpcError as e:
            results["leg"] = e
    thread = threading.Thread(target=leg)
    thread.start()
    num_blocks = consumer.client.metrics().kv.num_blocks
    assert wait_for(lambda: consumer.client.metrics().kv.free_blocks < num_blocks), "the pull has begun"
    doomed.proc.kill()                                 # ... and its producer dies under it
    thread.join(30)
    error = results["leg"]
    assert isinstance(error, grpc.RpcError) and error.code() is grpc.StatusCode.UNAVAILABLE, error
    assert "pulling the prompt's KV from producer" in error.details()
    print(f"producer killed mid-transfer: {error.details()}")
    pd.assert_nothing_held(consumer.client, LEASE_S)


@pytest.mark.skipif(smg_command() is None, reason="smg is not installed (the `test` extra installs it)")
def test_a_consumer_killed_mid_stream_behind_smg_ends_the_client_s_stream_and_the_producer_holds_nothing(
        fleet, shared_model, tmp_path):
    """smg 1.13 does not retry a decode leg that dies after it has streamed: the client's stream gets an
    error event (`stream_error`) after the tokens it had, and ends (docs/disaggregation.md). The producer was
    notified by the pull, so it holds nothing at once (no lease to wait out)."""
    producer, consumer = fleet["producer"], fleet["consumer"]
    expired_before = leases_expired(producer.client)
    router = SmgRouter.start_pd([producer.proc.address], [consumer.proc.address], shared_model, tmp_path / "smg.log")
    try:
        router.wait_until_ready(workers=2, model=MODEL, timeout_s=60)
        body = {"model": MODEL, "prompt": "The Python standard library is very extensive, offering a wide range",
                "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        assert router.completion({**body, "max_tokens": 4})["usage"]["completion_tokens"] == 4
        events, error = [], None
        try:
            for event in router.stream_completion(body, timeout=30):
                events.append(event)
                if len(events) == 2:
                    consumer.proc.kill()
        except Exception as e:  # noqa: BLE001 - what the client sees is what this test records
            error = e
        texts = [e for e in events if e.get("choices")]
        assert error is None and 2 <= len(texts) < 64, (len(texts), error)
        assert events[-1].get("error", {}).get("type") == "stream_error", events[-1]
        assert producer.client.metrics().queue.parked == 0
        assert leases_expired(producer.client) == expired_before    # released on the pull: no lease ran out
    finally:
        router.proc.kill()                 # not its graceful stop: smg 1.13 waits 5 s for load balancers there
        router.stop()
    pd.assert_nothing_held(producer.client, LEASE_S)
