"""16 requests submitted from 16 threads to one EngineLoop -- different prompt lengths, greedy and
seeded sampling with temperature / top-k / top-p, different max_tokens, some ending at EOS -- all
finish with the tokens each produces alone, their streams deliver every token exactly once and in
order, and the KV pool is empty afterwards; with k = 0 and with k = 2 MTP drafts."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import WORKLOADS, assert_kv_idle, make_llm
from engine import SamplingParams
from engine.core import EngineCore
from engine.loop import EngineLoop

PROMPTS = [p for w in WORKLOADS.values() for p in w]
assert len(PROMPTS) == 16


def params(i: int) -> SamplingParams:
    kinds = [dict(), dict(temperature=0.8, seed=100 + i), dict(temperature=1.0, top_k=40, seed=100 + i),
             dict(temperature=0.7, top_p=0.9, seed=100 + i)]
    return SamplingParams(max_tokens=8 + (i * 5) % 29, ignore_eos=i % 5 != 0, **{"temperature": 0.0, **kinds[i % 4]})


def run_alone(core: EngineCore, prompt, sp) -> list[int]:
    req = core.add_request(prompt, sp)
    while not req.finished:
        core.step()
    return list(req.output_token_ids)


@pytest.mark.parametrize("k", [0, 2])
def test_sixteen_threads_get_their_solo_outputs(shared_model, k):
    llm = make_llm(shared_model, draft_tokens=k, max_batch=16, prefix_reuse=False)
    core = llm.engine
    alone = [run_alone(core, p, params(i)) for i, p in enumerate(PROMPTS)]
    assert len({tuple(a) for a in alone}) == 16
    loop = EngineLoop(core).start()
    results: dict[int, tuple[list[int], list]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def client(i: int) -> None:
        try:
            barrier.wait()
            stream = loop.submit(PROMPTS[i], params(i))
            outs = list(stream)
            results[i] = ([t for o in outs for t in o.new_token_ids], outs)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert not errors, errors
        assert len(results) == 16
        max_running = loop.call(lambda c: c.snapshot())["queue"]
        for i in range(16):
            tokens, outs = results[i]
            assert tokens == alone[i], f"request {i} ({params(i)})"
            assert outs[-1].finished and all(not o.finished for o in outs[:-1])
            assert outs[-1].stats.usage.completion_tokens == len(tokens)
            assert outs[-1].finish_reason in ("length", "stop")
        assert max_running["running"] == 0 and max_running["waiting"] == 0
        assert loop.call(lambda c: (c.kv.num_free_blocks, c.kv.refs_taken - c.kv.refs_dropped)) == (
            core.kv.num_blocks, 0)
        # they did run together: some step decoded more than one request
        assert loop.steps < sum(len(a) for a in alone)
    finally:
        loop.shutdown()
    assert_kv_idle(core)
