"""Validation at the edge: bad sampling fields, bad prompts, requests that cannot fit the context or the
KV pool, and bad engine settings all raise InvalidArgumentError naming the field, and nothing is
enqueued; an impossible KV capacity raises CapacityError with the numbers before any weight loads.
Runs on the embedded default model (no shared model needed)."""

from __future__ import annotations

import math

import pytest

from tests.conftest import make_llm
from engine import CapacityError, EngineConfig, InvalidArgumentError, SamplingParams
from engine.loading.embedded_model import DEFAULT_CONFIG


@pytest.fixture(scope="module")
def llm():
    return make_llm(None, kv_capacity=1024, max_model_len=512, draft_tokens=2)


@pytest.mark.parametrize("field, kwargs", [
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": -0.5}),
    ("top_p", {"top_p": math.nan}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -3}),
    ("max_tokens", {"max_tokens": 2.5}),
    ("max_tokens", {"max_tokens": True}),
    ("top_k", {"top_k": -2}),
    ("seed", {"seed": -1}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ["x"] * 17}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("draft_tokens", {"draft_tokens": 9}),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")


def test_good_sampling_params_pass():
    p = SamplingParams(max_tokens=1, temperature=0, top_p=1, top_k=0, seed=0)
    assert p.greedy and isinstance(p.temperature, float)
    assert not SamplingParams(temperature=1e-3, top_p=1e-3).greedy


def assert_refused(llm, prompt, params, field, *fragments, request_id=None):
    core = llm.engine
    waiting, known = len(core.scheduler.waiting), set(core.scheduler.requests)
    with pytest.raises(InvalidArgumentError) as e:
        core.add_request(prompt, params, request_id=request_id)
    assert e.value.field == field, str(e.value)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)
    # never enqueued
    assert len(core.scheduler.waiting) == waiting and set(core.scheduler.requests) == known


def test_empty_prompt(llm):
    assert_refused(llm, "", SamplingParams(), "prompt", "must not be empty")
    assert_refused(llm, [], SamplingParams(), "prompt", "must not be empty")


def test_token_ids_outside_the_vocabulary(llm):
    vocab = DEFAULT_CONFIG.vocab_size
    assert_refused(llm, [1, 2, vocab], SamplingParams(), "prompt_token_ids", f"token id {vocab} ", f"[0, {vocab})")
    assert_refused(llm, [1, -1], SamplingParams(), "prompt_token_ids", "token id -1 ")
    assert_refused(llm, [1, 2.0], SamplingParams(), "prompt_token_ids", "token id 2.0 ")


def test_prompt_plus_max_tokens_beyond_the_context(llm):
    assert_refused(llm, list(range(1, 101)), SamplingParams(max_tokens=413), "max_tokens",
                   "prompt (100 tokens) + max_tokens (413) = 513", "context limit of 512 tokens")
    # exactly at the limit is admitted
    req = llm.engine.add_request(list(range(1, 101)), SamplingParams(max_tokens=412))
    llm.engine.abort(req.request_id)


def test_prompt_plus_max_tokens_beyond_the_kv_capacity():
    llm = make_llm(None, kv_capacity=256, draft_tokens=2)          # context 4096, KV 256 tokens
    assert_refused(llm, list(range(1, 101)), SamplingParams(max_tokens=155), "max_tokens",
                   "draft slots (2)", "KV capacity of 256 tokens")
    req = llm.engine.add_request(list(range(1, 101)), SamplingParams(max_tokens=154))
    llm.engine.abort(req.request_id)


def test_duplicate_request_id(llm):
    req = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="same")
    try:
        assert_refused(llm, [4, 5], SamplingParams(), "request_id", "'same' is already in use", request_id="same")
    finally:
        llm.engine.abort(req.request_id)


@pytest.mark.parametrize("field, kwargs", [
    ("prefill_chunk", {"prefill_chunk": 8}),
    ("block_size", {"block_size": 24}),
    ("block_size", {"block_size": 0}),
    ("kv_dtype", {"kv_dtype": "fp8"}),
    ("dtype", {"dtype": "float64"}),
    ("draft_tokens", {"draft_tokens": 9}),
    ("draft_tokens", {"draft_tokens": -1}),
    ("device", {"device": "tpu"}),
    ("memory_utilization", {"memory_utilization": 0.0}),
    ("kv_capacity", {"kv_capacity": 0}),
    ("max_model_len", {"max_model_len": 0}),
    ("max_batch", {"max_batch": 0}),
    ("pending_timeout_ms", {"pending_timeout_ms": 0}),
    ("stats_interval_s", {"stats_interval_s": math.nan}),
    ("tp_comm", {"tp_comm": "mpi"}),
])
def test_bad_engine_config_names_the_field(field, kwargs):
    with pytest.raises(InvalidArgumentError) as e:
        EngineConfig(**kwargs)
    assert e.value.field == field


def test_draft_vocab_beyond_the_vocabulary():
    with pytest.raises(InvalidArgumentError) as e:
        make_llm(None, draft_tokens=1, draft_vocab=DEFAULT_CONFIG.vocab_size + 1, kv_capacity=256)
    assert e.value.field == "draft_vocab"


@pytest.mark.parametrize("kv_dtype, draft_tokens", [("auto", 0), ("int8", 2)])
def test_impossible_kv_capacity_fails_with_the_numbers_before_loading(monkeypatch, kv_dtype, draft_tokens):
    import engine.core
    built = []
    real_executor = engine.core.Executor
    monkeypatch.setattr(engine.core, "Executor", lambda *a, **kw: built.append(1) or real_executor(*a, **kw))
    cfg = DEFAULT_CONFIG
    layers = cfg.num_hidden_layers + (cfg.mtp_num_hidden_layers if draft_tokens else 0)
    per_token = layers * 2 * cfg.num_key_value_heads * cfg.head_dim * (1 if kv_dtype == "int8" else 4)
    if kv_dtype == "int8":
        per_token += layers * 2 * cfg.num_key_value_heads * 4          # a float32 scale per token and head
    with pytest.raises(CapacityError) as e:
        make_llm(None, kv_capacity=10**9, kv_dtype=kv_dtype, draft_tokens=draft_tokens)
    msg = str(e.value)
    assert "kv_capacity=1000000000 does not fit" in msg
    assert f"KV 1000000000 tokens x {per_token} B = {10**9 * per_token / 2**30:.2f} GiB" in msg
    assert "GiB short" in msg and "available" in msg
    assert built == []                                  # refused before any weight was loaded
