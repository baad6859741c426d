"""The engine snapshot agrees with the per-request stats it was built from: `last` is the last finished
request's, the session peaks are the max over the requests' own rates (exactly), the history's raw
counts add up to the prefill tokens computed, the decode tokens delivered and the cached tokens, and
the speculative totals are the sums of the requests'."""

from __future__ import annotations

from tests.conftest import WORKLOADS, assert_kv_idle, make_llm, run_to_idle
from engine import SamplingParams


def drive(core, requests) -> list:
    for prompt, params in requests:
        core.add_request(prompt, params)
    return [o for o in run_to_idle(core) if o.finished]


def check_snapshot(core, finished) -> dict:
    snap = core.snapshot()
    stats = [o.stats for o in finished]
    rated = [s for s in stats if s.usage.completion_tokens >= 1]
    last = rated[-1]
    assert snap["last"] == {
        "prompt_tokens": last.usage.prompt_tokens, "computed_prefill_tokens": last.usage.computed_prefill_tokens,
        "completion_tokens": last.usage.completion_tokens, "prefill_tok_s": last.rates.prefill_tok_s,
        "decode_tok_s": last.rates.decode_tok_s, "ttft_s": last.timings.ttft,
        "peak_prefill_tok_s": max(s.rates.prefill_tok_s for s in rated),
        "peak_tok_s": max(s.rates.decode_tok_s for s in rated),
    }
    h = snap["history"]
    assert len(h["prefill_tokens"]) == len(h["decode_tokens"]) == len(h["cache_hit_tokens"]) == len(h["interval_seconds"])
    assert sum(h["prefill_tokens"]) == sum(s.usage.computed_prefill_tokens for s in stats)
    assert sum(h["decode_tokens"]) == sum(max(0, s.usage.completion_tokens - 1) for s in stats)
    assert sum(h["cache_hit_tokens"]) == sum(s.usage.cached_tokens for s in stats)
    perf = snap["performance"]
    reasons = {}
    for s in stats:
        reasons[s.finish_reason.value] = reasons.get(s.finish_reason.value, 0) + 1
    assert perf["requests"] == reasons
    rounds = sum(s.speculative.rounds for s in stats)
    per_pos = [0] * max(len(s.speculative.accepted_per_position) for s in stats)
    for s in stats:                        # a request's own k may be below the engine's
        for i, n in enumerate(s.speculative.accepted_per_position):
            per_pos[i] += n
    assert perf["rounds"] == rounds and perf["accepted_per_position"] == per_pos
    assert perf["acceptance_per_position"] == ([n / rounds for n in per_pos] if rounds else [])
    assert perf["mean_decode_tok_s"] == sum(s.rates.decode_tok_s for s in rated) / len(rated)
    assert perf["mean_prefill_tok_s"] == sum(s.rates.prefill_tok_s for s in rated) / len(rated)
    assert snap["kv"]["free_blocks"] == snap["kv"]["num_blocks"]
    assert snap["queue"] == {"waiting": 0, "prefilling": 0, "running": 0, "parked": 0, "awaiting_seat": 0,
                             "oldest_parked_s": 0.0, "oldest_awaiting_seat_s": 0.0}
    return snap


def test_snapshot_agrees_with_request_stats():
    llm = make_llm(None, kv_capacity=4096, prefill_chunk=32, draft_tokens=2)
    core = llm.engine
    shared = list(range(5, 75))
    requests = [
        (shared, SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.0)),
        (list(range(100, 105)), SamplingParams(max_tokens=1, temperature=0.0)),
        (list(range(3, 120)), SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=3)),
        (shared, SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)),            # cache hit on `shared`
        (shared + [9, 9, 9], SamplingParams(max_tokens=11, ignore_eos=True, draft_tokens=1, temperature=0.0)),
    ]
    finished = drive(core, requests)
    aborted = core.add_request([7, 8, 9], SamplingParams(max_tokens=4, temperature=0.0))
    finished.append(core.abort(aborted.request_id))                           # never ran: no rates
    assert len(finished) == len(requests) + 1
    assert sum(o.stats.usage.cached_tokens for o in finished) >= 2 * 64
    snap = check_snapshot(core, finished)
    assert snap["performance"]["requests"] == {"length": 5, "abort": 1}
    # a second wave: `last` moves to it, peaks stay the max over everything
    finished += drive(core, [(list(range(200, 260)), SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))])
    check_snapshot(core, finished)
    assert_kv_idle(core)


def test_history_counts_delivered_tokens_when_a_stop_string_ends_a_round(shared_model):
    """With k = 3 a round can emit tokens past a stop string; those are cut from the output and must
    not be counted as decoded either."""
    llm = make_llm(shared_model, draft_tokens=3)
    core = llm.engine
    enum = WORKLOADS["enumeration"][0]
    finished = drive(core, [(enum, SamplingParams(max_tokens=60, ignore_eos=True, stop=[stop], temperature=0.0))
                            for stop in ("Line 5:", "Line 6: the quick", "jumps over the lazy")])
    assert all(o.finish_reason == "stop" for o in finished)
    check_snapshot(core, finished)
