"""Structured output and forced tool calls through the real smg router (`smg launch`, PyPI smg) in front
of two `ninfer engine` processes (k = 2) on the shared tiny model, driven by the official `openai` SDK:
a json_schema chat response validates against its schema (jsonschema), json_object is an object, a
regex answer fullmatches, an EBNF alternation answers from its set (smg 1.13 drops `choice`), and with
`tools`, `tool_choice: "required"` and a named function produce tool_calls whose arguments validate
against the tool's parameters; a json_schema request with n = 2, logprobs and a penalty gets two
choices that validate, each with its token logprobs. smg turns each into the engine protocol's
constraint fields (docs/structured-output.md, "Through smg")."""

from __future__ import annotations

import json
import os
import re
import shutil

import jsonschema
import pytest

from tests.support.smg_fleet import engines_behind_smg
from tools.serving.smg_stack import smg_command

openai = pytest.importorskip("openai", reason="the test extra installs the openai SDK")
pytestmark = pytest.mark.skipif(smg_command() is None, reason="smg is not installed (the `test` extra installs it)")

MODEL = "tiny-qwen3-mtp"
# ChatML with tools, as Qwen's templates lay them out (the shared model's tokenizer_config has no template)
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Denver", "Oslo", "Nairobi"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                        "required": ["zone"], "additionalProperties": False}}}
TOOLS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def model_dir(shared_model, tmp_path_factory):
    """The shared model with a chat template in its tokenizer_config.json (files linked, not copied)."""
    path = tmp_path_factory.mktemp("smg-model") / MODEL
    path.mkdir()
    for f in os.listdir(shared_model):
        if f != "tokenizer_config.json":
            os.symlink(os.path.join(shared_model, f), path / f)
    config = json.loads(open(os.path.join(shared_model, "tokenizer_config.json")).read())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    yield str(path)
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    args = ("--model", model_dir, "--kv-capacity", "4096", "--draft-tokens", "2")
    with engines_behind_smg(args, model_dir, MODEL, tmp_path_factory.mktemp("smg") / "smg.log") as (_, router):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0,
                            timeout=120)


def chat(client, content: str, max_tokens: int = 160, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=max_tokens, **kw)


def test_json_schema_response_validates(client):
    r = chat(client, "Describe a person as JSON.", response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_response_is_an_object(client):
    r = chat(client, 'Answer with a JSON object like {"ok": true}.', response_format={"type": "json_object"},
             max_tokens=300)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:                            # the tiny model may keep writing members: a prefix of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_regex_answer_fullmatches(client):
    pattern = r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)"
    r = client.completions.create(model=MODEL, prompt="Contact: ", max_tokens=40, temperature=0,
                                  extra_body={"regex": pattern})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, r.choices[0].text), r


def test_an_ebnf_alternation_answers_from_its_set(client):
    choices = ["positive", "negative", "neutral"]
    r = chat(client, "Is this review positive? 'Great phone.'",
             extra_body={"ebnf": "root ::= " + " | ".join(f'"{c}"' for c in choices)})
    assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"


def _validate_calls(calls, allowed: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        name = call.function.name
        assert name in allowed
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[name]["function"]["parameters"])


def test_tool_choice_required_calls_a_tool_whose_arguments_validate(client):
    # the tiny model, greedy, ends its array after one call for this message (for others it keeps adding
    # calls, or whitespace, until max_tokens: the model's habit, not the grammar's)
    r = chat(client, "Use one tool.", tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=300)
    assert r.choices[0].finish_reason == "tool_calls", (r.choices[0].message.content, r.usage)
    _validate_calls(r.choices[0].message.tool_calls, {"get_weather", "get_time"})


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_a_named_tool_choice_calls_that_tool(client, name):
    r = chat(client, "Help me plan the day.", tools=[WEATHER, CLOCK],
             tool_choice={"type": "function", "function": {"name": name}})
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == name, r
    _validate_calls(calls, {name})


def test_a_bad_schema_is_a_client_error_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "x", response_format={"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "string", "maxLength": 10**7}}})
    assert "json_schema" in str(e.value) and "maxLength" in str(e.value)


def test_json_schema_with_n_logprobs_and_a_penalty(client):
    """The sampling fields and the grammar together: two seeded choices, each one valid JSON of the
    schema (or cut by max_tokens), each with a logprob per token and its top alternatives."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], n=2, temperature=1.0,
        seed=11, max_tokens=160, logprobs=True, top_logprobs=2, presence_penalty=0.5, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), PERSON)
        else:
            assert c.finish_reason == "length" and c.message.content.lstrip().startswith("{")
        tokens = c.logprobs.content
        assert tokens and "".join(t.token for t in tokens) == c.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0.0 for t in tokens)
    assert any(c.finish_reason == "stop" for c in r.choices), [c.message.content for c in r.choices]
