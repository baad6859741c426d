"""The grammar backend on the shared model's vocabulary (8192 tokens, EOS 0, specials 0..2): specs and
their errors, limits, the compile cache and its time bound, generation under the mask checked by an
independent validator (jsonschema, re, Python's parser), termination, speculation (push/pop), and
the device bitmask."""

from __future__ import annotations

import ast
import json
import re
import time

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from engine.errors import InvalidArgumentError
from engine.sampling_params import StructuredOutput
from engine.structured.bitmask import apply_token_mask, unpack
from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarState, pack_ids
from engine.structured.spec import GrammarError, GrammarLimits, GrammarSpec
from tests.engine.structured.helpers import (CHOICES, EBNF, REGEX, SCHEMA, STRUCTURAL_TAG, TOOL_SCHEMA,
                                             compile_sync, end_bias, vocabulary, walk)


@pytest.fixture(scope="module")
def vocab(shared_model):
    return vocabulary(shared_model)


@pytest.fixture(scope="module")
def hf(shared_model):
    return Tokenizer.from_file(f"{shared_model}/tokenizer.json")


@pytest.fixture(scope="module")
def compiler(vocab):
    c = GrammarCompiler(vocab)
    yield c
    c.shutdown()


def state_for(compiler, vocab, spec, stops=(0,)):
    return GrammarState(compile_sync(compiler, spec), stops, vocab.words)


def allowed(state, vocab) -> list[bool]:
    row = torch.empty(1, vocab.words, dtype=torch.int32)
    state.fill(row[0])
    return unpack(row, vocab.vocab_size)[0].tolist()


# -- vocabulary ---------------------------------------------------------------------------------------

def test_special_tokens_are_never_text(compiler, vocab, hf):
    s = state_for(compiler, vocab, GrammarSpec("json_object"))
    prefix = hf.encode('{"a": "').ids
    assert s.accept_tokens(prefix) == len(prefix)
    bits = allowed(s, vocab)
    assert not any(bits[t] for t in (0, 1, 2)) and sum(bits) > 1000
    assert not s.accept(1)


@pytest.mark.parametrize("spec,prefix", [
    (GrammarSpec("json_schema", json.dumps({"type": "string", "maxLength": 20})), '"'),
    (GrammarSpec("structural_tag", json.dumps(STRUCTURAL_TAG)), '<tool_call>\n{"city": "'),
])
def test_bounded_strings_admit_no_raw_control_characters(compiler, vocab, hf, spec, prefix):
    """xgrammar 0.2.9 lets a bounded JSON string hold raw \\x00-\\x1f (json.loads refuses it); fixed."""
    s = state_for(compiler, vocab, spec)
    ids = hf.encode(prefix).ids
    assert s.accept_tokens(ids) == len(ids)
    bits = allowed(s, vocab)
    words = vocab.info.decoded_vocab
    control = [i for i, b in enumerate(words) if b and any(c < 0x20 for c in b)]
    assert len(control) > 10 and not any(bits[i] for i in control)
    assert bits[words.index(b"a")]


def test_logits_past_the_tokenizer_are_never_allowed(shared_model):
    padded = vocabulary(shared_model, vocab_size=8192 + 100)
    assert padded.words == (8292 + 31) // 32
    c = GrammarCompiler(padded)
    s = state_for(c, padded, GrammarSpec("json_object"))
    s.accept(padded.info.decoded_vocab.index(b"{"))
    bits = allowed(s, padded)
    assert any(bits[:8192]) and not any(bits[8192:])
    c.shutdown()


# -- specs, errors, limits ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind,text,needle", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be an object"),
    ("regex", "   ", "must not be empty"),
    ("choice", "[]", "non-empty list"),
    ("choice", '["a", 3]', "choice 1"),
    ("structural_tag", '{"type": "structural_tag"}', "'format'"),
])
def test_spec_shape_errors_name_the_field(kind, text, needle):
    with pytest.raises(GrammarError) as e:
        GrammarSpec(kind, text)
    assert isinstance(e.value, InvalidArgumentError)
    assert e.value.field == f"structured_output.{kind}" and needle in str(e.value)


@pytest.mark.parametrize("fields,needle", [
    ({}, "got none"),
    ({"regex": "a", "json_object": True}, "got regex, json_object"),
])
def test_exactly_one_constraint(fields, needle):
    with pytest.raises(InvalidArgumentError) as e:        # StructuredOutput checks it when constructed
        GrammarSpec.from_structured_output(StructuredOutput(**fields))
    assert e.value.field == "structured_output" and needle in str(e.value)


def test_spec_from_structured_output():
    assert GrammarSpec.from_structured_output(StructuredOutput(choice=("a", "b"))) == GrammarSpec("choice", '["a", "b"]')
    assert GrammarSpec.from_structured_output(StructuredOutput(json_object=True)).key == ("json_object", "")
    assert GrammarSpec.from_structured_output(StructuredOutput(grammar=EBNF)).kind == "grammar"


@pytest.mark.parametrize("spec,needle", [
    (GrammarSpec("json_schema", '{"type": "objekt"}'), "objekt"),
    (GrammarSpec("json_schema", '{"$ref": "#/defs/x"}'), ""),
    (GrammarSpec("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'), "minLength"),
    (GrammarSpec("regex", "([a-z"), ""),
    (GrammarSpec("regex", "(?<=a)b"), ""),
    (GrammarSpec("grammar", 'root ::= "a" missing'), "missing"),
    (GrammarSpec("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}'), ""),
])
def test_compile_errors_name_the_field_without_internals(compiler, spec, needle):
    with pytest.raises(GrammarError) as e:
        compile_sync(compiler, spec)
    assert e.value.field == f"structured_output.{spec.kind}"
    assert needle in e.value.message and e.value.message
    assert ".cc:" not in e.value.message and "Check failed" not in e.value.message


def _nested(depth: int) -> dict:
    node: dict = {"type": "integer"}
    for _ in range(depth):
        node = {"type": "array", "items": node}
    return node


@pytest.mark.parametrize("spec,needle", [
    (GrammarSpec("regex", "[a-z]{1,100000}"), "repetition bound 100000"),
    (GrammarSpec("grammar", 'root ::= "a"{3,99999}'), "repetition bound 99999"),
    (GrammarSpec("json_schema", json.dumps({"type": "string", "maxLength": 10**6})), "maxLength 1000000"),
    (GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "string", "pattern": "x{5000}"}}})), "in pattern"),
    (GrammarSpec("json_schema", json.dumps(_nested(40))), "nested deeper"),
    (GrammarSpec("regex", "a" * 300_000), "bytes is over the limit"),
])
def test_limits_refuse_before_compiling(vocab, spec, needle):
    c = GrammarCompiler(vocab, GrammarLimits(max_json_depth=32))
    with pytest.raises(GrammarError) as e:
        compile_sync(c, spec)
    assert e.value.field == f"structured_output.{spec.kind}" and needle in e.value.message
    c.shutdown()


def test_a_compile_past_the_time_bound_fails_and_is_remembered(vocab):
    c = GrammarCompiler(vocab, GrammarLimits(max_repeat=10**6, compile_timeout_s=0.005))
    spec = GrammarSpec("regex", "[a-z]{1,20000}")
    with pytest.raises(GrammarError, match=r"longer than the limit of 0.005 s"):
        compile_sync(c, spec)
    assert c.compile(spec) is c.compile(spec) and c.cache_info()["hits"] == 2
    c.shutdown()


def test_cache_shares_and_evicts(vocab):
    c = GrammarCompiler(vocab, cache_entries=2)
    a, b, d = (GrammarSpec("regex", r) for r in ("a+", "b+", "d+"))
    fa = c.compile(a)
    assert c.compile(a) is fa
    fa.result()
    c.compile(b).result()
    c.compile(a)                                   # a is now the most recent
    c.compile(d).result()                          # evicts b
    assert c.compile(a) is fa and c.cache_info()["entries"] == 2
    misses = c.cache_info()["misses"]
    c.compile(b).result()
    assert c.cache_info()["misses"] == misses + 1
    c.shutdown()


def test_matchers_keep_filling_while_a_slow_compile_runs(vocab, compiler, hf):
    """The native compile releases the GIL: a thread filling masks is not held up by it."""
    slow = GrammarCompiler(vocab, GrammarLimits(max_repeat=10**5))
    s = state_for(compiler, vocab, GrammarSpec("json_object"))
    s.accept_tokens(hf.encode('{"a": "').ids)
    row = torch.empty(vocab.words, dtype=torch.int32)
    fut = slow.compile(GrammarSpec("regex", "[a-z]{1,3000}"))
    fills, start = 0, time.perf_counter()
    while not fut.done():
        s.fill(row)
        fills += 1
    elapsed = time.perf_counter() - start
    assert fut.result().memory_bytes > 0
    assert elapsed > 0.05 and fills > 10 * elapsed / 0.05      # a fill is ~0.1 ms; far more than one per 5 ms
    slow.shutdown()


# -- generation under the mask ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_validates(compiler, vocab, hf, seed):
    toks, stopped = walk(state_for(compiler, vocab, GrammarSpec("json_schema", json.dumps(SCHEMA))), vocab, seed)
    assert stopped
    jsonschema.validate(json.loads(hf.decode(toks, skip_special_tokens=False)), SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_json_object_output_is_an_object(compiler, vocab, hf, seed):
    toks, stopped = walk(state_for(compiler, vocab, GrammarSpec("json_object")), vocab, seed,
                         bias=end_bias(vocab), max_tokens=600)
    text = hf.decode(toks, skip_special_tokens=False)
    assert stopped and isinstance(json.loads(text), dict)
    assert not re.search(r"\s{17}", text)


@pytest.mark.parametrize("seed", range(4))
def test_regex_output_fullmatches(compiler, vocab, hf, seed):
    toks, stopped = walk(state_for(compiler, vocab, GrammarSpec("regex", REGEX)), vocab, seed, bias=end_bias(vocab))
    assert stopped and re.fullmatch(REGEX, hf.decode(toks, skip_special_tokens=False))


@pytest.mark.parametrize("seed", range(4))
def test_choice_output_is_one_of_the_set(compiler, vocab, hf, seed):
    toks, stopped = walk(state_for(compiler, vocab, GrammarSpec.from_choices(CHOICES)), vocab, seed)
    assert stopped and hf.decode(toks, skip_special_tokens=False) in CHOICES


@pytest.mark.parametrize("seed", range(4))
def test_ebnf_output_parses(compiler, vocab, hf, seed):
    toks, stopped = walk(state_for(compiler, vocab, GrammarSpec("grammar", EBNF)), vocab, seed, bias=end_bias(vocab))
    text = hf.decode(toks, skip_special_tokens=False)
    assert stopped and re.fullmatch(r"[0-9+\-*/()]+", text)
    ast.parse(re.sub(r"\b0+(?=\d)", "", text), mode="eval")


@pytest.mark.parametrize("seed", range(3))
def test_structural_tag_calls_validate(compiler, vocab, hf, seed):
    s = state_for(compiler, vocab, GrammarSpec("structural_tag", json.dumps(STRUCTURAL_TAG)))
    toks, stopped = walk(s, vocab, seed, bias=end_bias(vocab), prefix=hf.encode("Let me see. <tool_call>").ids,
                         max_tokens=600)
    text = hf.decode(toks, skip_special_tokens=False)
    calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, flags=re.S)
    assert stopped and len(calls) == text.count("<tool_call>") >= 1
    for call in calls:
        jsonschema.validate(json.loads(call), TOOL_SCHEMA)


def test_legacy_structural_tag_form(compiler, vocab, hf):
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=x>", "schema": TOOL_SCHEMA, "end": "</f>"}]}
    spec = GrammarSpec("structural_tag", json.dumps(legacy))
    good = hf.encode('hi <f=x>{"city": "Oslo", "days": 2}</f> bye').ids
    assert state_for(compiler, vocab, spec).accept_tokens(good) == len(good)
    bad = hf.encode('hi <f=x>{"town"').ids
    assert state_for(compiler, vocab, spec).accept_tokens(bad) < len(bad)


# -- termination and speculation ---------------------------------------------------------------------------

def test_stop_tokens_only_where_the_grammar_ends(compiler, vocab, hf):
    s = state_for(compiler, vocab, GrammarSpec.from_choices(["yes", "no"]), stops=(0, 2))
    assert not allowed(s, vocab)[0]                       # nothing yet: no stop
    yes = hf.encode("yes").ids
    assert s.accept_tokens(yes) == len(yes) and s.completed and not s.terminated
    assert [i for i, b in enumerate(allowed(s, vocab)) if b] == [0, 2]
    assert s.accept(2) and s.terminated
    assert [i for i, b in enumerate(allowed(s, vocab)) if b] == [0, 2]      # after the end: stops only
    assert s.accept(0) and not s.accept(5)                                  # ignore_eos: stops go on


def test_push_and_pop_drafts_restore_the_state(compiler, vocab, hf):
    s = state_for(compiler, vocab, GrammarSpec("json_schema", json.dumps(SCHEMA)))
    toks, _ = walk(state_for(compiler, vocab, GrammarSpec("json_schema", json.dumps(SCHEMA))), vocab, 3)
    s.accept_tokens(toks[:5])
    before = allowed(s, vocab)
    masks = []
    for t in toks[5:9]:
        assert s.push_draft(t)
        masks.append(allowed(s, vocab))
    assert not s.push_draft(1)                              # <|im_start|>: refused, state unchanged
    s.pop_drafts()
    assert allowed(s, vocab) == before and s.num_accepted == 5
    ref = state_for(compiler, vocab, GrammarSpec("json_schema", json.dumps(SCHEMA)))
    ref.accept_tokens(toks[:5])
    for t, mask in zip(toks[5:9], masks):                   # the same masks a token-by-token walk sees
        ref.accept(t)
        assert allowed(ref, vocab) == mask


def test_pushing_a_stop_after_the_end_is_undone_too(compiler, vocab, hf):
    s = state_for(compiler, vocab, GrammarSpec.from_choices(["ok"]))
    s.accept_tokens(hf.encode("ok").ids)
    assert s.push_draft(0) and s.terminated and s.push_draft(0)
    s.pop_drafts()
    assert not s.terminated and s.completed


# -- the device bitmask --------------------------------------------------------------------------------

def test_apply_token_mask_matches_a_reference_unpacking():
    g = torch.Generator().manual_seed(0)
    allow = torch.rand(3, 70, generator=g) < 0.3
    allow[:, 31] = True                                      # the sign bit of a word
    mask = torch.stack([pack_ids(torch.nonzero(r).flatten().tolist(), 3) for r in allow])
    assert torch.equal(unpack(mask, 70), allow)
    logits = torch.randn(3, 70, generator=g)
    out = apply_token_mask(logits, mask)
    assert torch.equal(out[allow], logits[allow]) and torch.all(out[~allow] == float("-inf"))
    narrow = apply_token_mask(logits[:, :40], mask)          # a reduced draft vocabulary
    assert torch.equal(narrow, out[:, :40])


def test_apply_token_mask_keeps_rows_with_nothing_allowed_when_asked():
    mask = torch.stack([pack_ids([50], 2), pack_ids([3], 2)])
    logits = torch.zeros(2, 40)
    kept = apply_token_mask(logits, mask, keep_empty_rows=True)
    assert torch.equal(kept[0], logits[0]) and kept[1, 3] == 0 and torch.isinf(kept[1, 4])
    assert torch.all(torch.isinf(apply_token_mask(logits, mask)[0]))
