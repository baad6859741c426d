"""Structured output at the engine's front door (EngineLoop, what the servicers call): a slow compile
holds only its caller's thread, never the other streams; bad constraints are INVALID_ARGUMENT naming the
field; a fuzz of bad and huge schemas, regexes, grammars and choices (hypothesis) leaks nothing."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import InvalidArgumentError
from engine.loop import EngineLoop
from engine.sampling_params import SamplingParams, StructuredOutput
from tests.conftest import KV_CAPACITY, assert_kv_idle

SLOW_REGEX = "[a-z0-9]{1,2000}x[a-z]{1,2000}"        # about 1.5 s to compile at the test model's 8192 tokens


@pytest.fixture(scope="module")
def loop(shared_model):
    lp = EngineLoop(EngineCore(EngineConfig(model=shared_model, dtype="float32", kv_capacity=KV_CAPACITY,
                                            draft_tokens=2))).start()
    lp.warmup()
    yield lp
    lp.shutdown()


def test_a_slow_compile_never_stalls_other_streams(loop, monkeypatch):
    # xgrammar compiles SLOW_REGEX in 0.2-1.5 s depending on the machine's load; 1.5 s more on the compiler's
    # thread after the real compile make it slow everywhere (the engine thread must not notice either way)
    from engine.structured.compiler import GrammarCompiler
    real = GrammarCompiler._compile_now

    def slow_compile(self, spec):
        handle = real(self, spec)
        if SLOW_REGEX in spec.key[1]:
            time.sleep(1.5)
        return handle

    monkeypatch.setattr(GrammarCompiler, "_compile_now", slow_compile)
    running = loop.submit("def f(x):\n    return", SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0))
    first = running.next(timeout=30)
    arrivals: list[float] = []
    compiled: dict = {}

    def slow():
        t0 = time.monotonic()
        stream = loop.submit("Code: ", SamplingParams(max_tokens=12, temperature=0.0, structured_output=StructuredOutput(
            regex=SLOW_REGEX)))
        compiled["window"] = (t0, time.monotonic())
        compiled["tokens"] = [t for out in stream for t in out.new_token_ids]

    waiter = threading.Thread(target=slow)
    waiter.start()
    for out in running:
        arrivals.append(time.monotonic())
    waiter.join(60)
    start, end = compiled["window"]
    assert end - start > 0.5, "the compile was not slow: the test proves nothing"
    during = [t for t in arrivals if start < t < end]
    # the stream kept going while the other request compiled: outputs kept arriving, and no gap between
    # them came near the compile's length (a stall would show as one gap as long as the compile; on an
    # idle machine a CPU round of the tiny model takes ~10 ms, on a loaded one far longer)
    gaps = [b - a for a, b in zip([start, *during], [*during, end])]
    assert len(during) >= 2 and max(gaps) < 0.5 * (end - start), (len(during), end - start, max(gaps))
    text = loop.tokenizer.decode([t for t in compiled["tokens"] if t != 0])
    assert re.fullmatch(r"[a-z0-9]{1,2000}(x[a-z]{0,2000})?", text), text
    assert first.new_token_ids and len(arrivals) > 10
    assert loop.num_unfinished() == 0
    loop.call(assert_kv_idle)


def test_a_bad_grammar_is_refused_before_it_is_queued(loop):
    with pytest.raises(InvalidArgumentError) as e:
        loop.submit("x", SamplingParams(max_tokens=4, structured_output=StructuredOutput(json_schema='{"type": 5}')))
    assert e.value.field == "structured_output.json_schema"
    assert loop.num_unfinished() == 0


# -- fuzz ----------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**9, 10**9) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "properties", "items", "required", "enum", "const", "anyOf", "oneOf", "allOf",
                         "$ref", "pattern", "format", "minimum", "maxLength", "maxItems", "additionalProperties",
                         "prefixItems", "$defs", "minLength", "x"]), inner, max_size=5),
    max_leaves=20)


def _deep(depth: int, huge: int) -> str:
    node: dict = {"type": "string", "maxLength": huge}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return json.dumps(node)


# the fields of a StructuredOutput (constructed in the test: its own checks refuse some shapes at once)
constraints = st.one_of(
    json_values.map(lambda v: {"json_schema": json.dumps(v)}),
    st.builds(_deep, st.integers(0, 200), st.sampled_from([5, 2048, 10**6, 10**12])).map(
        lambda s: {"json_schema": s}),
    st.text(max_size=40).map(lambda s: {"json_schema": s}),
    st.text(alphabet="ab()[]{}*+?|^$\\.-,0123456789", max_size=24).map(lambda s: {"regex": s}),
    st.text(alphabet='root ::="ab|()*+?[]-xyz\n', max_size=40).map(lambda s: {"grammar": s}),
    st.lists(st.text(max_size=6), max_size=5).map(lambda c: {"choice": tuple(c)}),
    st.text(max_size=40).map(lambda s: {"structural_tag": s}),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(fields=constraints)
def test_fuzzed_constraints_are_served_or_refused_naming_the_field(llm_k0, fields):
    try:
        so = StructuredOutput(**fields)
        out = llm_k0.generate(["{"], SamplingParams(max_tokens=3, structured_output=so))[0]
    except InvalidArgumentError as e:
        assert e.field.startswith("structured_output"), e.field
        assert "Check failed" not in str(e) and ".cc:" not in str(e)
    else:
        assert 1 <= len(out.token_ids) <= 3
    assert_kv_idle(llm_k0.engine)
