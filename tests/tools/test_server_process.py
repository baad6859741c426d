"""The child-process helper the multi-process tests stand on: its reader thread lags behind the child,
so a test waits for the event it needs instead of reading `events` at an arbitrary moment."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tools.serving.server_process import ServerProcess

LOGS_LATE = """
import json, sys, time
print(json.dumps({"event": "engine_listening", "address": "127.0.0.1:1"}), file=sys.stderr, flush=True)
time.sleep(0.5)
print("not json", file=sys.stderr, flush=True)
print(json.dumps({"event": "engine_serving", "cuda_graphs": False}), file=sys.stderr, flush=True)
time.sleep(30)
"""

EXITS_EARLY = """
import json, sys
print(json.dumps({"event": "engine_listening", "address": "127.0.0.1:1"}), file=sys.stderr, flush=True)
print("Traceback: boom", file=sys.stderr, flush=True)
"""


def child(script: str) -> ServerProcess:
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    return ServerProcess(proc, "engine")


def test_wait_for_event_returns_an_event_logged_after_the_call():
    with child(LOGS_LATE) as server:
        started = time.monotonic()
        assert server.wait_for_event("engine_listening", timeout_s=30)["address"] == "127.0.0.1:1"
        serving = server.wait_for_event("engine_serving", timeout_s=30)
        assert serving["cuda_graphs"] is False and time.monotonic() - started >= 0.4
        assert [e["event"] for e in server.events] == ["engine_listening", "engine_serving"]
        assert server.other_lines == ["not json"]


def test_wait_for_event_times_out_on_a_child_that_is_still_running():
    with child(LOGS_LATE) as server:
        with pytest.raises(TimeoutError, match="'engine_drained' within 0.2 s"):
            server.wait_for_event("engine_drained", timeout_s=0.2)


def test_wait_for_event_on_a_child_that_exited_says_so_at_once_with_its_last_lines():
    with child(EXITS_EARLY) as server:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="exited without logging 'engine_serving'.*boom"):
            server.wait_for_event("engine_serving", timeout_s=30)
        assert time.monotonic() - started < 10       # not the whole timeout
