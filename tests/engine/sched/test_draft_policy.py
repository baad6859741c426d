"""Adaptive draft length (engine.sched.draft_policy, `--num-speculative-tokens auto`): the choice of k from
acceptance and batch, the running estimate, the flag, losslessness on real engines (greedy output of
`auto` equal to k = 0), and the replay of the trained model's workloads against every fixed k."""

from __future__ import annotations

import argparse

import pytest

from tests.conftest import WORKLOADS, assert_kv_idle, make_llm
from engine import EngineConfig, InvalidArgumentError, SamplingParams
from engine.sched.draft_policy import DraftPolicy, RoundCost, best_k, expected_tokens
from ninfer.cli.flags import AUTO_MAX_DRAFT_TOKENS, draft_tokens_flag, engine_config_from_args, add_engine_args


def test_expected_tokens_is_one_plus_the_sum_of_running_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0


def test_cost_model_reproduces_the_h200_sweep_it_was_seeded_from():
    cost = RoundCost()
    for k, ms in {0: 5.408, 1: 5.988, 2: 6.305, 3: 6.951, 5: 7.943}.items():   # batch 1, context 512
        assert cost(k, 1) == pytest.approx(ms, abs=1e-3)
    assert cost(0, 8) == pytest.approx(1e3 / 170.7, rel=0.01)                 # 8 streams, k = 0
    assert cost(2, 1) < cost(4, 1) < cost(5, 1)                               # k = 4: interpolated


def test_choice_follows_acceptance_and_batch():
    cost = RoundCost()
    assert best_k([0.95] * 5, 1, 5, cost) == 5             # drafts nearly free at batch 1, nearly always kept
    assert best_k([0.02] * 5, 1, 5, cost) == 0             # drafts always rejected: do not draft
    assert best_k([0.9, 0.9, 0.1, 0.9], 1, 4, cost) == 2   # a weak third position stops the run
    # the same acceptance at a large batch: verify rows cost compute, fewer drafts pay
    ks = [best_k([0.7] * 4, b, 4, cost) for b in (1, 8, 64, 256)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]


def test_estimate_tracks_observed_acceptance_and_forgets():
    policy = DraftPolicy(k_max=3)
    for _ in range(400):
        policy.observe(3, 1)                               # position 1 kept, position 2 rejected, 3 unseen
    a = policy.acceptance
    assert a[0] > 0.97 and a[1] < 0.03
    assert a[2] == pytest.approx(0.6)                      # never reached: the prior
    for _ in range(400):
        policy.observe(3, 3)
    assert all(x > 0.95 for x in policy.acceptance)        # decayed: the recent text decides


def test_exploration_probes_one_position_beyond_the_choice():
    policy = DraftPolicy(k_max=4, explore_every=4)
    policy.tried, policy.accepted = [100.0] * 4, [1.0] * 4          # acceptance 0.01: choose 0
    picks = [policy.choose(1) for _ in range(8)]
    assert picks == [0, 0, 0, 1, 0, 0, 0, 1]


def test_the_flag_and_the_config():
    assert draft_tokens_flag("3") == 3
    assert int(draft_tokens_flag("auto")) == AUTO_MAX_DRAFT_TOKENS
    assert int(draft_tokens_flag("auto:2")) == 2
    with pytest.raises(argparse.ArgumentTypeError):
        draft_tokens_flag("auto:0")
    with pytest.raises(argparse.ArgumentTypeError):
        draft_tokens_flag("many")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--num-speculative-tokens", "auto:3", "--device", "cpu"]))
    assert cfg.draft_tokens == 3 and cfg.adaptive_draft
    cfg = engine_config_from_args(p.parse_args(["--num-speculative-tokens", "3", "--device", "cpu"]))
    assert cfg.draft_tokens == 3 and not cfg.adaptive_draft
    cfg = engine_config_from_args(p.parse_args(["--num-speculative-tokens", "2", "--adaptive-draft", "--device", "cpu"]))
    assert cfg.draft_tokens == 2 and cfg.adaptive_draft
    with pytest.raises(InvalidArgumentError, match="draft_tokens"):
        EngineConfig(device="cpu", draft_tokens=0, adaptive_draft=True)


# -- real engines ------------------------------------------------------------------------------------

PARAMS = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)]


@pytest.mark.parametrize("model", ["embedded", "shared"])
def test_greedy_auto_equals_k0(model, request):
    path = None if model == "embedded" else request.getfixturevalue("shared_model")
    prompts = [p for ps in WORKLOADS.values() for p in ps[:2]] if path else [[5, 6, 7, 8] * 9, [40, 41] * 20]
    want = [o.token_ids for o in make_llm(path).generate(prompts, PARAMS * len(prompts))]
    auto = make_llm(path, draft_tokens=4, adaptive_draft=True)
    got = auto.generate(prompts, PARAMS * len(prompts))
    assert [o.token_ids for o in got] == want
    policy = auto.engine.scheduler.draft_policy
    assert policy is not None and policy.rounds > 0
    drafted = sum(o.stats.speculative.drafted for o in got)
    rounds = sum(o.stats.speculative.rounds for o in got)
    assert 0 < drafted <= 4 * rounds                       # each round drafted what the policy chose
    assert_kv_idle(auto.engine)


def test_the_replay_never_trails_the_best_fixed_k_by_more_than_five_percent(shared_model):
    """The trained model's workloads (and random ids, where drafts fail) replayed at batch 1 .. 64:
    the policy's throughput against the best fixed k of each row (tools.bench.adaptive_k)."""
    from tools.bench import adaptive_k
    traces = adaptive_k.record_traces(shared_model, temperatures=(0.0,), max_tokens=48)
    rows = adaptive_k.compare(traces, batches=(1, 64), rounds=400)
    print("\n" + adaptive_k.table(rows))
    assert {r["workload"] for r in rows} == {"prose", "code", "json", "enumeration", "random_ids"}
    for r in rows:
        assert r["adaptive_over_best"] >= 0.95, r
    # the workloads differ enough that no single fixed k is best everywhere
    assert len({r["best_fixed_k"] for r in rows}) > 1
