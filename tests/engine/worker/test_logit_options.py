"""The device implementation of the logit options (engine.worker.logit_options through
sampler.adjust_logits) against the formula written token by token (tests/support/sampling_reference):
at a prefill's sample, at every draft and verify position (the history as of that position), after
a round advanced the slots, over a reduced draft vocabulary, and with neutral rows beside."""

from __future__ import annotations

import random

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker import sampler
from engine.worker.logit_options import LogitOptionPool, LogitOptionRows
from tests.support.sampling_reference import reference_adjust

VOCAB = 64


def random_case(rng: random.Random, with_options: bool = True):
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
    if not with_options:
        return prompt, output, SamplingParams(temperature=0.0), frozenset(), ()
    params = SamplingParams(
        temperature=0.0, presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.choice([0.7, 1.0, 1.3, 2.0]), min_tokens=rng.randrange(0, 12), max_tokens=20,
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(0, 6))} or None)
    stops = frozenset(rng.randrange(VOCAB) for _ in range(3))
    words = tuple(tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 4)))
    if output and rng.random() < 0.7:                 # a word whose prefix the history ends with
        words += (tuple(output[-2:]) + (rng.randrange(VOCAB),),)
    return prompt, output, params, stops, words


def reference(logits, prompt, output, params, stops, words):
    return reference_adjust(logits, prompt, output, presence=params.presence_penalty,
                            frequency=params.frequency_penalty, repetition=params.repetition_penalty,
                            min_tokens=params.min_tokens, stop_ids=set(stops), logit_bias=params.logit_bias,
                            bad_words=[list(w) for w in words])


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)


def batch(params: list[SamplingParams], output_index: list[int], options) -> sampler.SamplingBatch:
    return sampler.SamplingBatch.build(params, [0] * len(params), output_index, "cpu", options=options)


@pytest.mark.parametrize("seed", range(6))
def test_a_prefill_sample_sees_the_formula(seed):
    rng = random.Random(seed)
    pool = LogitOptionPool(8, VOCAB, torch.device("cpu"))
    cases = [random_case(rng, with_options=i != 2) for i in range(5)]       # row 2: no options (scratch)
    slots = []
    for i, (prompt, output, params, stops, words) in enumerate(cases):
        slots.append(pool.fill(f"r{i}", prompt, output, params, stops, words) if params.adjusts_logits
                     else pool.scratch)
    logits = torch.randn(len(cases), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    s = batch([c[2] for c in cases], [len(c[1]) for c in cases],
              LogitOptionRows.at_slots(pool, torch.tensor(slots)))
    got = sampler.adjust_logits(logits, s)
    for i, case in enumerate(cases):
        assert_same_logits(got[i], reference(logits[i], *case))
    assert torch.equal(got[2], logits[2])                  # the scratch slot is neutral


@pytest.mark.parametrize("seed", range(6))
def test_every_verify_and_draft_position_sees_the_history_as_of_that_position(seed):
    rng = random.Random(100 + seed)
    k = 3
    pool = LogitOptionPool(4, VOCAB, torch.device("cpu"))
    cases = [random_case(rng) for _ in range(3)]
    slots = torch.tensor([pool.fill(f"r{i}", *c[:2], c[2], *c[3:]) for i, c in enumerate(cases)])
    drafts = torch.randint(0, VOCAB, (3, k), generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 7)
    s = batch([c[2] for c in cases], [len(c[1]) for c in cases], LogitOptionRows.at_slots(pool, slots))
    # verify: [B * (k+1)] rows, position j after drafts[:, :j]
    flat = s.repeat(k + 1, drafts)
    logits = torch.randn(3 * (k + 1), VOCAB, generator=gen) * 3
    got = sampler.adjust_logits(logits, flat)
    for b, (prompt, output, params, stops, words) in enumerate(cases):
        for j in range(k + 1):
            row = b * (k + 1) + j
            want = reference(logits[row], prompt, output + drafts[b, :j].tolist(), params, stops, words)
            assert_same_logits(got[row], want)
    # draft step j over a draft vocabulary of the first 40 ids, after drafts[:, :j]
    for j in range(k):
        logits = torch.randn(3, 40, generator=gen) * 3
        got = sampler.adjust_logits(logits, s.shifted(j, drafts[:, :j] % 40))
        for b, (prompt, output, params, stops, words) in enumerate(cases):
            want = reference(torch.nn.functional.pad(logits[b], (0, VOCAB - 40)), prompt,
                             output + (drafts[b, :j] % 40).tolist(), params, stops, words)[:40]
            assert_same_logits(got[b], want)


def test_advance_adds_a_rounds_kept_tokens_and_leaves_the_scratch_slot_neutral():
    rng = random.Random(7)
    pool = LogitOptionPool(4, VOCAB, torch.device("cpu"))
    cases = [random_case(rng) for _ in range(2)]
    slots = torch.tensor([pool.fill(f"r{i}", *c[:2], c[2], *c[3:]) for i, c in enumerate(cases)] + [pool.scratch])
    tokens = torch.tensor([[5, 9, -1, -1], [3, 3, 3, 8], [1, 2, -1, -1]])   # row 2: a padded row
    pool.advance(slots, tokens)
    assert pool.counts[pool.scratch].sum() == 0 and (pool.tail[pool.scratch] == -1).all()
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    emitted = [[5, 9], [3, 3, 3, 8]]
    s = batch([c[2] for c in cases], [len(c[1]) + len(e) for c, e in zip(cases, emitted)],
              LogitOptionRows.at_slots(pool, slots[:2]))
    got = sampler.adjust_logits(logits, s)
    for b, (prompt, output, params, stops, words) in enumerate(cases):
        assert_same_logits(got[b], reference(logits[b], prompt, output + emitted[b], params, stops, words))


def test_greedy_and_sampled_picks_follow_the_adjusted_logits():
    pool = LogitOptionPool(2, VOCAB, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, logit_bias={17: 100.0})
    slot = pool.fill("r", [1, 2], [], params, frozenset(), ())
    logits = torch.randn(1, VOCAB)
    rows = LogitOptionRows.at_slots(pool, torch.tensor([slot]))
    assert sampler.sample(logits, batch([params], [0], rows)).item() == 17
    hot = SamplingParams(temperature=1.0, logit_bias={17: -100.0, 3: 100.0}, top_k=5)
    slot = pool.fill("r", [1, 2], [], hot, frozenset(), ())
    got = sampler.sample(logits.repeat(64, 1), sampler.SamplingBatch.build(
        [hot] * 64, list(range(64)), [0] * 64, "cpu", options=LogitOptionRows.at_slots(pool, torch.tensor([slot] * 64))))
    assert (got == 3).all()
