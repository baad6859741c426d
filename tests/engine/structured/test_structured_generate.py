"""Structured output through the engine (LLM.generate on the shared model, CPU): outputs obey their
constraint (checked by jsonschema, re, the choice set, Python's parser), EOS only where the grammar may
end, greedy k = 3 equals k = 0 token for token (drafts masked, matchers advanced per draft and rolled
back), drafts stay useful, unconstrained rows of the same batch are untouched, async scheduling and
TP = 2 equal the plain engine, bad grammars are INVALID_ARGUMENT naming the field with nothing leaked."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from engine.errors import InvalidArgumentError
from engine.request_stats import FinishReason
from engine.sampling_params import SamplingParams, StructuredOutput
from tests.conftest import WORKLOADS, assert_kv_idle, make_llm
from tests.engine.structured.helpers import CHOICES, EBNF, REGEX, SCHEMA

PROMPTS = ['Return the record as JSON: {"name": "Omar Sato", "age": 67',
           '[{"id": 133630, "name": "Omar Sato", "age": 67, "city": "Denver"}, ',
           "Email: ", "The answer is", "2+2=", WORKLOADS["json"][2]]
CONSTRAINTS = [StructuredOutput(json_schema=json.dumps(SCHEMA)), StructuredOutput(json_object=True),
               StructuredOutput(regex=REGEX), StructuredOutput(choice=tuple(CHOICES)),
               StructuredOutput(grammar=EBNF), StructuredOutput(json_schema=json.dumps(
                   {"type": "array", "items": {"type": "integer"}, "maxItems": 3}))]


def obeys(so: StructuredOutput, text: str) -> bool:
    if so.json_schema is not None:
        jsonschema.validate(json.loads(text), json.loads(so.json_schema))
        return True
    if so.json_object:
        return isinstance(json.loads(text), dict)
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    if so.choice is not None:
        return text in so.choice
    ast.parse(re.sub(r"\b0+(?=\d)", "", text), mode="eval")      # the arithmetic grammar
    return re.fullmatch(r"[0-9+\-*/()]+", text) is not None


def params_for(max_tokens=120, **kw) -> list[SamplingParams]:
    kw.setdefault("temperature", 0.0)
    return [SamplingParams(max_tokens=max_tokens, structured_output=so, **kw) for so in CONSTRAINTS]


@pytest.fixture(scope="module")
def greedy_k0(llm_k0):
    return llm_k0.generate(PROMPTS, params_for())


def test_outputs_obey_their_constraint(greedy_k0):
    for so, out in zip(CONSTRAINTS, greedy_k0):
        if out.finish_reason is FinishReason.STOP:
            assert obeys(so, out.text), (so, out.text)
            assert out.token_ids[-1] == 0                     # ended by EOS, where the grammar may end
    stopped = [out for out in greedy_k0 if out.finish_reason is FinishReason.STOP]
    assert len(stopped) >= 5, [(o.text, o.finish_reason) for o in greedy_k0]


@pytest.mark.parametrize("k,seed", [(0, 0), (0, 1), (0, 2), (3, 0), (3, 1)])
def test_sampled_outputs_obey_their_constraint(llm_k0, llm_k3, k, seed):
    """Sampled (with k = 3: masked draft distributions q, rejection sampling against masked p)."""
    llm = llm_k3 if k else llm_k0
    outs = llm.generate(PROMPTS, params_for(max_tokens=150, temperature=1.0, seed=seed))
    for so, out in zip(CONSTRAINTS, outs):
        if out.finish_reason is FinishReason.STOP:
            assert obeys(so, out.text), (so, out.text)
        else:                                                 # cut by max_tokens: a prefix of a match
            assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 150


def test_greedy_k3_equals_k0_and_drafts_stay_useful(llm_k3, greedy_k0):
    outs = llm_k3.generate(PROMPTS, params_for())
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy_k0]
    drafted = sum(o.stats.speculative.drafted for o in outs)
    accepted = sum(o.stats.speculative.accepted for o in outs)
    assert accepted / drafted > 0.4, (accepted, drafted)    # 0.65 on this model (masked drafts)


def test_k3_with_a_reduced_draft_vocabulary_equals_k0(shared_model, greedy_k0):
    """Drafts over the first 3000 ids: a draft row whose allowed tokens all lie past them is left
    unmasked, refused by the grammar and by verification -- still lossless."""
    llm = make_llm(shared_model, draft_tokens=3, draft_vocab=3000)
    assert [o.token_ids for o in llm.generate(PROMPTS, params_for())] == [o.token_ids for o in greedy_k0]


def test_unconstrained_rows_of_a_constrained_batch_are_untouched(llm_k0, llm_k3):
    plain = [WORKLOADS["code"][0], WORKLOADS["prose"][1]]
    free = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    for llm in (llm_k0, llm_k3):
        alone = [o.token_ids for o in llm.generate(plain, free)]
        mixed = llm.generate(plain + PROMPTS[:3], [free, free] + params_for()[:3])
        assert [o.token_ids for o in mixed[:2]] == alone


@pytest.mark.parametrize("kw", [{"async_scheduling": False}, {"tensor_parallel_size": 2},
                                {"tensor_parallel_size": 2, "draft_tokens": 2}])
def test_sync_scheduling_and_tp2_equal_the_plain_engine(shared_model, greedy_k0, kw):
    llm = make_llm(shared_model, **kw)
    assert [o.token_ids for o in llm.generate(PROMPTS, params_for())] == [o.token_ids for o in greedy_k0]
    assert_kv_idle(llm.engine)


def test_a_preempted_constrained_request_resumes_its_grammar(shared_model, greedy_k0):
    """KV for one or two requests at once: requests are preempted and recomputed from prompt + outputs;
    their matchers keep every accepted token, so the outputs are those of the roomy engine."""
    llm = make_llm(shared_model, kv_capacity=176)
    outs = llm.generate(PROMPTS, params_for())
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy_k0]
    assert sum(o.stats.preemptions for o in outs) > 0
    assert_kv_idle(llm.engine)


def test_ignore_eos_after_the_grammar_ends_emits_stop_tokens_only(llm_k0):
    out = llm_k0.generate(["The answer is"], SamplingParams(
        max_tokens=12, ignore_eos=True, temperature=0.0, structured_output=StructuredOutput(choice=("yes", "no"))))[0]
    text_ids = [t for t in out.token_ids if t != 0]
    assert llm_k0.tokenizer.decode(text_ids) in ("yes", "no")
    assert out.finish_reason is FinishReason.LENGTH and out.token_ids[len(text_ids):] == [0] * (12 - len(text_ids))


@pytest.mark.parametrize("fields,field", [
    ({"json_schema": '{"type": "objekt"}'}, "structured_output.json_schema"),
    ({"regex": "([a-z"}, "structured_output.regex"),
    ({"grammar": 'root ::= "a" missing'}, "structured_output.grammar"),
    ({"regex": "[a-z]{1,100000}"}, "structured_output.regex"),
    ({"choice": ()}, "structured_output.choice"),                     # refused when constructed
    ({"regex": "a", "json_object": True}, "structured_output"),       # refused when constructed
])
def test_bad_constraints_are_refused_naming_the_field_and_leak_nothing(llm_k0, fields, field):
    with pytest.raises(InvalidArgumentError) as e:
        llm_k0.generate(["Hello", "World"], [SamplingParams(max_tokens=4), SamplingParams(
            max_tokens=4, structured_output=StructuredOutput(**fields))])
    assert e.value.field == field
    assert_kv_idle(llm_k0.engine)
    assert llm_k0.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids


class _GraphLike:
    """What ModelRunner.launch_decode needs of engine.worker.cuda_graphs.GraphedRounds, without CUDA: a
    replay packs the bucket's rows (padding past the batch) and runs the round from them as a capture
    would -- no draft hook, the masks read in place from the persistent buffer uploaded before it."""

    def __init__(self, runner, buckets):
        self.runner, self.buckets, self.replays, self.constrained = runner, buckets, 0, 0

    def fits(self, n):
        return n <= self.buckets[-1]

    def bucket_for(self, n):
        return next(b for b in self.buckets if b >= n)

    def replay(self, works, variant):
        import torch
        from engine.worker.decode_round import RoundInputs, pack_round, run_round
        r = self.runner
        batch = self.bucket_for(len(works))
        packed = pack_round(r.round_setup, works, batch, r.max_blocks)
        inp = RoundInputs.from_packed(*(torch.from_numpy(a) for a in packed), k=r.k)
        self.replays += 1
        self.constrained += variant.constrained
        return run_round(r.round_setup, inp, r.max_seq_len, variant)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_graph_path_reads_the_persistent_mask_buffer(shared_model, greedy_k0, async_scheduling):
    """k = 0: rounds go through the graphed branch (buckets 1, 2, 4, 8; rows past the batch padded) and
    mask from RoundSetup.token_masks as uploaded for the bucket: same tokens as the eager engine."""
    llm = make_llm(shared_model, max_batch=8, async_scheduling=async_scheduling)
    runner = llm.engine.executor.driver
    runner.graphs = graphs = _GraphLike(runner, [1, 2, 4, 8])
    mixed = PROMPTS + [WORKLOADS["code"][0]]
    outs = llm.generate(mixed, params_for() + [SamplingParams(max_tokens=160, ignore_eos=True, temperature=0.0)])
    assert [o.token_ids for o in outs[:-1]] == [o.token_ids for o in greedy_k0]
    assert graphs.constrained > 10 and graphs.replays > graphs.constrained     # the last rounds: unconstrained only
    assert_kv_idle(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_lockstep_rounds_mask_on_every_rank(shared_model, greedy_k0, async_scheduling):
    """The executor packs once and uploads the step's host masks to every rank's buffer (TP = 2, k = 0,
    the lockstep path of captured rounds run by stand-ins): same tokens as TP = 1."""
    from tests.support.graph_standin import StandInRounds
    llm = make_llm(shared_model, tensor_parallel_size=2, max_batch=8, async_scheduling=async_scheduling)
    ex = llm.engine.executor
    for runner in ex.runners:
        runner.graphs = StandInRounds(ex, runner, [2, 4, 8])
    assert [o.token_ids for o in llm.generate(PROMPTS, params_for())] == [o.token_ids for o in greedy_k0]
    assert ex.runners[0].graphs.launches > 0
    assert_kv_idle(llm.engine)
