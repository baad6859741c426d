"""`ninfer generate` end to end on the embedded default model, as a subprocess: JSON lines (one per
delta, then the final stats) whose tokens equal the Python API's; stop strings cut the printed text;
a bad argument exits non-zero with a message on stderr and nothing on stdout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_llm
from engine import SamplingParams

PROMPT = "Hello, world"


def ninfer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("ninfer")
    cmd = [str(script)] if script.exists() else ([shutil.which("ninfer")] if shutil.which("ninfer") else
                                                 [sys.executable, "-m", "ninfer"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=Path(__file__).resolve().parents[2])


def parse(stdout: str) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    assert lines, "no output"
    return lines[:-1], lines[-1]


@pytest.fixture(scope="module")
def api_tokens() -> list[int]:
    llm = make_llm(None, kv_capacity=1024)
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))[0].token_ids


def test_generate_json_lines_and_final_stats(api_tokens):
    r = ninfer("generate", "--prompt", PROMPT, "--max-tokens", "8", "--json", "--ignore-eos", "--kv-capacity", "1024")
    assert r.returncode == 0, r.stderr
    deltas, final = parse(r.stdout)
    assert deltas and all(set(d) == {"text", "token_ids"} for d in deltas)
    tokens = [t for d in deltas for t in d["token_ids"]]
    assert tokens == api_tokens                                   # the same engine, the same greedy tokens
    assert final["finish_reason"] == "length"
    stats = final["stats"]
    assert stats["usage"]["completion_tokens"] == 8 and stats["usage"]["prompt_tokens"] == len(PROMPT.encode())
    assert stats["usage"]["computed_prefill_tokens"] == stats["usage"]["prompt_tokens"]
    assert set(stats["timings"]) == {"queue", "prefill", "decode", "total", "ttft"}
    assert "".join(d["text"] for d in deltas) == make_llm(None, kv_capacity=256).tokenizer.decode(tokens)


def test_generate_with_draft_tokens_is_lossless(api_tokens):
    r = ninfer("generate", "--prompt", PROMPT, "--max-tokens", "8", "--json", "--ignore-eos", "--draft-tokens", "2",
               "--kv-capacity", "1024")
    assert r.returncode == 0, r.stderr
    deltas, final = parse(r.stdout)
    assert [t for d in deltas for t in d["token_ids"]] == api_tokens
    assert final["stats"]["speculative"]["draft_tokens"] == 2 and final["stats"]["speculative"]["rounds"] >= 1


def run_with_stop(stop: str) -> str:
    r = ninfer("generate", "--prompt", PROMPT, "--max-tokens", "8", "--ignore-eos", "--stop", stop,
               "--kv-capacity", "1024")
    assert r.returncode == 0, r.stderr
    return r.stdout.rstrip("\n")


def test_stop_string_completed_by_one_token_cuts_the_printed_text(api_tokens):
    full = make_llm(None, kv_capacity=256).tokenizer.decode(api_tokens)
    stop = full[1]
    assert run_with_stop(stop) == full[:full.index(stop)]


def test_stop_string_spanning_tokens_cuts_the_printed_text(api_tokens):
    full = make_llm(None, kv_capacity=256).tokenizer.decode(api_tokens)
    stop = full[3:5]
    assert len(stop) == 2 and stop in full
    assert run_with_stop(stop) == full[:full.index(stop)]


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["--prefill-chunk", "4"], "--prefill-chunk: must be in [16, "),
    (["--kv-capacity", "1000000000000"], "does not fit"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
])
def test_bad_argument_exits_nonzero_with_a_message(args, message):
    r = ninfer("generate", "--prompt", PROMPT, *args)
    assert r.returncode != 0
    assert message in r.stderr
    assert r.stdout == ""
