"""A prompt is refused on a cheap bound before the tokenizer's full cost (issue 39, item 6): 131,072
emoji passed the characters-per-token bound, tokenized to 524,288 tokens and lifted the gateway to a
720 MiB peak before the token count refused them. Now the UTF-8 bytes refuse it: at least
bytes / (the vocabulary's longest token in bytes) tokens cannot fit the context. Measured in a
fresh process: its peak memory barely grows, and the refusal takes milliseconds."""

from __future__ import annotations

import json
import subprocess
import sys

from engine.loading.embedded_model import build_default_tokenizer

PROBE = """
import json, resource, sys, time
from engine.errors import InvalidArgumentError
from gateway.client import generate_request
from gateway.prepare import prepare
from gateway.router import ServedModel
from ninfer.v1 import engine_info_pb2
given = json.loads(sys.stdin.read())
model = ServedModel(engine_info_pb2.ModelInfo(model="m", tokenizer_json=given["tokenizer"], max_model_len=4096,
                                              vocab_size=1 << 20))
request = generate_request(**given["request"])
del given
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    prepare(request, model)
    outcome = "accepted"
except InvalidArgumentError as e:
    outcome = str(e)
print(json.dumps({"outcome": outcome, "seconds": time.perf_counter() - start,
                  "peak_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
"""


def probe(**request) -> dict:
    given = json.dumps({"tokenizer": build_default_tokenizer().inner.to_str(), "request": request})
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, input=given,
                          timeout=120, check=True)
    return json.loads(done.stdout)


def test_131072_emoji_are_refused_on_their_bytes_without_a_memory_peak():
    emoji = "\U0001F642" * 131_072              # 32 characters per token of a 4096-token context
    for request in (dict(prompt=emoji), dict(messages=[("user", emoji[:65_000]), ("user", emoji[65_000:130_000])])):
        result = probe(**request)
        assert "UTF-8 bytes make at least" in result["outcome"] and "context limit of 4096" in result["outcome"]
        assert result["peak_growth_mib"] < 16, result
        assert result["seconds"] < 0.5, result


def test_a_long_prompt_that_fits_is_still_tokenized():
    result = probe(prompt="the quick brown fox " * 150)      # 3000 characters, well under 4096 tokens
    assert result["outcome"] == "accepted", result
