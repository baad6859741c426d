"""One owner of the command line: vLLM's spellings beside ours, every flag documented with its default,
every engine setting a typed field of EngineConfig, and `generate --gateway` refusing engine flags."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from ninfer.cli.flags import engine_config_from_args, listen_address
from ninfer.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
VLLM_AND_OURS = [
    (["--max-num-seqs", "7"], ["--max-batch", "7"], "max_batch", 7),
    (["--gpu-memory-utilization", "0.5"], ["--memory-utilization", "0.5"], "memory_utilization", 0.5),
    (["--kv-cache-dtype", "int8"], ["--kv-dtype", "int8"], "kv_dtype", "int8"),
    (["--num-speculative-tokens", "3"], ["--draft-tokens", "3"], "draft_tokens", 3),
    (["--no-enable-prefix-caching"], ["--no-prefix-reuse"], "prefix_reuse", False),
    (["--enable-prefix-caching"], [], "prefix_reuse", True),
    (["--served-model-name", "my-model"], ["--served-model-name=my-model"], "served_model_name", "my-model"),
    (["-tp", "2"], ["--tp", "2"], "tensor_parallel_size", 2),
    (["--tensor-parallel-size", "2"], ["--tp", "2"], "tensor_parallel_size", 2),
    (["--max-model-len", "512"], ["--max-model-len", "512"], "max_model_len", 512),
]


@pytest.mark.parametrize("command", ["engine", "serve"])
@pytest.mark.parametrize("vllm, ours, field, value", VLLM_AND_OURS)
def test_vllm_spellings_and_ours_build_the_same_config(command, vllm, ours, field, value):
    a = build_parser().parse_args([command, "--device", "cpu", *vllm])
    b = build_parser().parse_args([command, "--device", "cpu", *ours])
    ca, cb = engine_config_from_args(a), engine_config_from_args(b)
    assert getattr(ca, field) == getattr(cb, field) == value
    assert ca == cb


def test_every_engine_config_field_has_a_flag():
    args = build_parser().parse_args(["engine", "--device", "cpu", "--lease-seconds", "7"])
    config = engine_config_from_args(args)
    assert config.lease_seconds == 7.0                     # the lease is a typed engine setting
    settable = set(EngineConfig.__dataclass_fields__) - {"stats_interval_s"}
    assert settable <= set(vars(args)), settable - set(vars(args))


def test_host_and_port_override_listen():
    args = build_parser().parse_args(["gateway", "--engine", "e:1", "--host", "0.0.0.0", "--port", "6000"])
    assert listen_address(args) == "0.0.0.0:6000"
    args = build_parser().parse_args(["gateway", "--engine", "e:1", "--port", "6001"])
    assert listen_address(args) == "127.0.0.1:6001"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", ["generate", "engine", "gateway", "serve"])
def test_every_flag_has_help_and_help_shows_the_defaults(name):
    sub = _subcommands(build_parser())[name]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{name} {action.option_strings} has no help text"
    text = sub.format_help()
    for action in sub._actions:
        default = action.default
        if action.option_strings and default not in (None, False, argparse.SUPPRESS) and \
                not isinstance(action, argparse._StoreFalseAction) and default != []:
            assert f"(default: {default})" in " ".join(text.split()), (name, action.option_strings)


def test_generate_through_a_gateway_refuses_engine_flags():
    done = subprocess.run([sys.executable, "-m", "ninfer", "generate", "--gateway", "127.0.0.1:9", "--prompt", "x",
                           "--num-speculative-tokens", "3", "--max-num-seqs=4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--num-speculative-tokens, --max-num-seqs: engine flags do not apply with --gateway" in done.stderr


def test_bad_flag_values_end_in_a_message_not_a_traceback():
    done = subprocess.run([sys.executable, "-m", "ninfer", "engine", "--device", "cpu", "--lease-seconds", "-1",
                           "--listen", "127.0.0.1:0", "--metrics-listen", "off"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    # the flag as the user typed it, not the engine's field behind it
    assert "--lease-seconds: must be in (0, 86400]" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "ninfer", "engine", "--log-level", "bogus"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'bogus'" in done.stderr


@pytest.mark.parametrize("command", [["gateway", "--engine", "127.0.0.1:1"], ["engine", "--device", "cpu"]])
def test_a_busy_metrics_port_ends_in_a_message_not_a_traceback(command):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        done = subprocess.run([sys.executable, "-m", "ninfer", *command, "--listen", "127.0.0.1:0",
                               "--metrics-listen", f"127.0.0.1:{busy.getsockname()[1]}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "cannot serve metrics on" in done.stderr and "--metrics-listen" in done.stderr


@pytest.mark.parametrize("flag, value", [("--max-concurrent-rpcs", "0"), ("--drain-timeout", "-1"),
                                         ("--max-message-bytes", "0")])
def test_server_limits_must_be_positive(flag, value):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["gateway", "--engine", "127.0.0.1:1", flag, value])
    assert e.value.code == 2


def test_an_fp8_kv_cache_is_answered_naming_the_flag():
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["engine", "--kv-cache-dtype", "fp8"])
    assert e.value.code == 2
    done = subprocess.run([sys.executable, "-m", "ninfer", "engine", "--kv-cache-dtype", "fp8_e4m3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--kv-cache-dtype" in done.stderr and "FP8 KV cache is not implemented" in done.stderr, done.stderr


def test_a_context_beyond_the_models_positions_is_refused_naming_the_flag(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ninfer", "generate", "--device", "cpu", "--prompt", "x",
                           "--max-model-len", "100000"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and not done.stdout
    assert "--max-model-len: 100000 exceeds the model's max_position_embeddings 4096" in done.stderr, done.stderr
