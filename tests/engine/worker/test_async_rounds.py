"""Async scheduling (engine.worker.async_rounds): round N+1 is planned and enqueued before round N's tokens are
read. On the CPU the rounds run one after the other, but the loop is the same one the GPU runs: the
next round's carried rows are resolved from the last round's tokens on the device
(engine.worker.decode_round.carry_forward), and its bookkeeping happens one round late. These tests hold it
to the synchronous loop's tokens."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from engine.request_stats import FinishReason
from ninfer.cli.flags import engine_config_from_args
from ninfer.cli.main import build_parser
from tests.conftest import assert_kv_idle

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    '{"order_id": "ORD-381901", "item": "printer", "quantity": 8}, {"order_id": "ORD-381902",',
    "Line 1: the quick brown fox jumps over the lazy dog.\nLine 2:",
    "The interpreter reads the source file and",
    "import os\nimport sys\n\n\nclass",
    "Beware of the",
]


def make_core(model: str, **kw) -> EngineCore:
    kw = {"device": "cpu", "dtype": "float32", "kv_capacity": 4096, "max_batch": 8, **kw}
    return EngineCore(EngineConfig(model=model, **kw))


def workload(core: EngineCore) -> list[SamplingParams]:
    """Different lengths and stop conditions: length, EOS, a stop token id, a stop string, sampling."""
    newline = core.tokenizer.encode("\n")[-1]
    return [SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0),
            SamplingParams(max_tokens=40, stop_token_ids=[newline], temperature=0.0),
            SamplingParams(max_tokens=37, ignore_eos=True, stop=["Line 4"], temperature=0.0),
            SamplingParams(max_tokens=31, temperature=0.8, top_p=0.9, seed=7),
            SamplingParams(max_tokens=64, temperature=0.0),
            SamplingParams(max_tokens=25, temperature=1.0, top_k=20, seed=3)]


class LaunchLog:
    """Records the rounds launched without a read (the real executor runs them)."""

    def __init__(self, core: EngineCore):
        self.rounds: list[list[int]] = []          # each launched round's carry rows
        launch = core.executor.launch

        def logged(sched):
            self.rounds.append([w.carry_row for w in sched.decode])
            return launch(sched)
        core.executor.launch = logged

    @property
    def carried(self) -> int:
        return sum(1 for rows in self.rounds if rows and all(r >= 0 for r in rows))

    @property
    def mixed(self) -> int:
        """Rounds planned ahead that also pack a row whole (a request that sat the round before out)."""
        return sum(1 for rows in self.rounds if any(r >= 0 for r in rows) and any(r < 0 for r in rows))


def run(core: EngineCore, jobs: list[tuple[str, SamplingParams]], arrivals: dict[int, list[int]] | None = None,
        abort_at: dict[int, str] | None = None):
    """Step to idle; job i is added at the step arrivals says (0 by default), with id `r{i}`.
    -> {request id: (delivered tokens, finish reason, finished outputs)} and each request's own tokens."""
    arrivals = arrivals or {0: list(range(len(jobs)))}
    abort_at = abort_at or {}
    delivered: dict[str, list[int]] = {}
    finished: dict[str, list[str]] = {}
    reqs = {}
    step = 0
    while core.has_work or any(s >= step for s in arrivals):
        for i in arrivals.get(step, []):
            prompt, params = jobs[i]
            reqs[f"r{i}"] = core.add_request(prompt, params, request_id=f"r{i}")
        outs = core.step()
        if step in abort_at and core.scheduler.requests.get(abort_at[step]) is not None:
            outs.append(core.abort(abort_at[step]))
        for out in outs:
            assert not finished.get(out.request_id), f"output for {out.request_id} after its final one"
            delivered.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.setdefault(out.request_id, []).append(out.finish_reason.value)
        step += 1
        assert step < 5000
    assert_kv_idle(core)
    return {rid: (delivered.get(rid, []), finished.get(rid)) for rid in reqs}, reqs


@pytest.mark.parametrize("k", [0, 3])
def test_overlapped_loop_gives_the_synchronous_tokens(shared_model, k):
    sync = make_core(shared_model, draft_tokens=k, async_scheduling=False)
    fast = make_core(shared_model, draft_tokens=k)
    assert not sync.async_scheduling and fast.async_scheduling
    jobs = list(zip(PROMPTS, workload(sync)))
    arrivals = {0: [0, 1, 2, 3], 6: [4], 13: [5]}      # two arrive while rounds are in flight
    log, never = LaunchLog(fast), LaunchLog(sync)
    want, want_reqs = run(sync, jobs, arrivals)
    got, got_reqs = run(fast, jobs, arrivals)
    assert got == want
    reasons = {r[1][0] for r in want.values()}
    assert {"length", "stop"} <= reasons
    for rid, req in got_reqs.items():
        assert got[rid][0] == req.output_token_ids == want_reqs[rid].output_token_ids
    assert log.carried >= 10, log.rounds                    # most decode rounds were planned ahead
    if k:
        assert log.mixed > 0, log.rounds                    # near max_tokens a request sits one round out
    assert not never.rounds


def test_adaptive_draft_length_overlapped_equals_k0(shared_model):
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in (12, 30, 47, 21)]
    jobs = list(zip(PROMPTS, greedy))
    want, _ = run(make_core(shared_model, async_scheduling=False), jobs)
    core = make_core(shared_model, draft_tokens=3, adaptive_draft=True)
    log = LaunchLog(core)
    got, _ = run(core, jobs)
    assert got == want
    assert log.carried > 0


@pytest.mark.parametrize("k", [0, 3])
def test_abort_while_its_round_is_in_flight(shared_model, k):
    jobs = list(zip(PROMPTS, [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)] * 4))
    want, _ = run(make_core(shared_model, draft_tokens=k, async_scheduling=False), jobs)
    core = make_core(shared_model, draft_tokens=k)
    for i, (prompt, params) in enumerate(jobs):
        core.add_request(prompt, params, request_id=f"r{i}")
    outs = []
    # until a round planned ahead of r1's last one (a carried row) is on the device
    while not (core._inflight and any(w.request_id == "r1" and w.carry_row >= 0 for w in core._inflight.sched.decode)):
        outs += core.step()
    outs.append(core.abort("r1"))
    while core.has_work:
        outs += core.step()
    got: dict[str, list[int]] = {}
    for out in outs:
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    final = [o for o in outs if o.finished]
    assert sorted(o.request_id for o in final) == ["r0", "r1", "r2", "r3"]    # one final output each
    assert outs.index(next(o for o in final if o.request_id == "r1")) == max(
        i for i, o in enumerate(outs) if o.request_id == "r1")                 # nothing after the abort
    assert next(o for o in final if o.request_id == "r1").finish_reason is FinishReason.ABORT
    assert 0 < len(got["r1"]) < 40 and got["r1"] == want["r1"][0][:len(got["r1"])]
    for rid in ("r0", "r2", "r3"):
        assert got[rid] == want[rid][0]
    assert_kv_idle(core)


def test_abort_then_reuse_the_id_while_the_old_round_is_in_flight(shared_model):
    core = make_core(shared_model, draft_tokens=3)
    first = core.add_request(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0), request_id="x")
    while core._inflight is None or "x" not in [w.request_id for w in core._inflight.sched.decode]:
        core.step()
    core.step()                                              # a round planned ahead is in flight
    assert core._inflight is not None and core._inflight.sched.decode[0].carry_row == 0
    assert core.abort("x").finish_reason is FinishReason.ABORT
    second = core.add_request(PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0), request_id="x")
    outs = []
    while core.has_work:
        outs += core.step()
    assert [o.finished for o in outs].count(True) == 1        # the old round's tokens went nowhere
    assert sum((o.new_token_ids for o in outs), []) == second.output_token_ids
    alone, _ = run(make_core(shared_model, draft_tokens=3, async_scheduling=False),
                   [(PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0))])
    assert second.output_token_ids == alone["r0"][0]
    assert first.finish_reason is FinishReason.ABORT
    assert_kv_idle(core)


@pytest.mark.parametrize("k", [0, 3])
def test_preemption_and_the_context_limit_fall_back_to_synchronous_rounds(shared_model, k):
    # 12 blocks of 16 for four requests that need 6 each: decode preempts; the last one ends at the limit
    kw = dict(draft_tokens=k, kv_capacity=192, max_model_len=96)
    params = [SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)] * 3 + [SamplingParams(max_tokens=80, ignore_eos=True, temperature=0.0)]
    prompts = PROMPTS[:3] + ["Beware"]
    jobs = list(zip(prompts, params))
    sync, fast = make_core(shared_model, async_scheduling=False, **kw), make_core(shared_model, **kw)
    want, _ = run(sync, jobs)
    got, reqs = run(fast, jobs)
    assert got == want
    assert any(r.num_preemptions for r in reqs.values())
    assert all(v[1] == ["length"] for v in got.values())


def test_only_the_flag_keeps_rounds_synchronous(shared_model):
    assert make_core(shared_model, async_scheduling=False).sync_reason == "--no-async-scheduling"
    tp2 = make_core(shared_model, tensor_parallel_size=2)
    assert tp2.async_scheduling and not tp2.sync_reason
    tp2.shutdown()


def _same_tokens_overlapped(model: str, k: int, **kw) -> None:
    sync = make_core(model, draft_tokens=k, async_scheduling=False, **kw)
    fast = make_core(model, draft_tokens=k, **kw)
    assert fast.async_scheduling
    jobs = list(zip(PROMPTS, workload(sync)))
    arrivals = {0: [0, 1, 2, 3], 6: [4], 13: [5]}
    log = LaunchLog(fast)
    want, _ = run(sync, jobs, arrivals)
    got, got_reqs = run(fast, jobs, arrivals)
    assert got == want
    for rid, req in got_reqs.items():
        assert got[rid][0] == req.output_token_ids
    assert log.carried >= 10, log.rounds
    sync.shutdown()
    fast.shutdown()


def test_tp2_overlapped_loop_gives_the_synchronous_tokens(shared_model):
    """Every rank's round enqueued, rank 0's tokens read one round late; each rank carries the next
    round's rows from its own last tokens (eager rounds on the CPU: each rank's thread enqueues)."""
    _same_tokens_overlapped(shared_model, 3, tensor_parallel_size=2)


@pytest.mark.parametrize("k", [0, 3])
def test_hybrid_overlapped_loop_gives_the_synchronous_tokens(k):
    """A hybrid's round steps each row's linear-attention state in its slot (a verify round commits the
    accepted prefix on the device), so the round planned ahead reads the state the last one left."""
    from tests.support.hybrid import require_shared_hybrid
    _same_tokens_overlapped(require_shared_hybrid(), k)


def test_the_flag_and_its_default():
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["engine", "--device", "cpu"])).async_scheduling is True
    off = engine_config_from_args(parse(["engine", "--device", "cpu", "--no-async-scheduling"]))
    assert off.async_scheduling is False
