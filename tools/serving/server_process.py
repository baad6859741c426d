"""Run `ninfer engine|gateway|serve` as a child process and learn its address from its JSON logs.

    with ServerProcess.start("engine", "--kv-capacity", "4096") as engine:
        engine.address                    # from the `engine_listening` event (--listen 127.0.0.1:0)
        engine.terminate(); engine.wait() # SIGTERM: drain, then exit 0

The tools and the multi-process tests use it; every line the child logs is kept in `events` (so the
child must log at info level: that is where it says where it listens). A thread reads those lines, so
`events` can lag behind what the child has already done (it answers RPCs the moment it turns SERVING,
before its `engine_serving` line is read here): wait for an event with `wait_for_event`, or `wait()`
for the exit, before reading `events`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

LISTENING_EVENTS = {"engine": "engine_listening", "gateway": "gateway_listening", "serve": "gateway_listening"}


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, command: str):
        self.proc = proc
        self.command = command
        self.events: list[dict[str, Any]] = []
        self.other_lines: list[str] = []
        self.address: str | None = None
        self.metrics_port: int | None = None
        self._new_event = threading.Condition()
        self._stream_ended = False
        self._reader = threading.Thread(target=self._read, name=f"ninfer-{command}-stderr", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, command: str, *args: str, env: dict[str, str] | None = None,
              timeout_s: float = 120.0) -> "ServerProcess":
        argv = [sys.executable, "-m", "ninfer", command, "--listen", "127.0.0.1:0", "--metrics-listen", "off",
                "--log-json", *args]
        server = cls(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, env=env), command)
        try:
            listening = server.wait_for_event(LISTENING_EVENTS[command], timeout_s)
        except (TimeoutError, RuntimeError):
            server.kill()
            raise RuntimeError(f"`ninfer {command}` did not start listening within {timeout_s} s: "
                               f"{server.other_lines[-20:]}") from None
        server.address, server.metrics_port = listening["address"], listening.get("metrics_port")
        return server

    def _read(self) -> None:
        for line in self.proc.stderr:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                self.other_lines.append(line.rstrip())
                continue
            with self._new_event:
                self.events.append(event)
                self._new_event.notify_all()
        with self._new_event:
            self._stream_ended = True
            self._new_event.notify_all()            # the stream ended: no event waited for will come

    def wait_for_event(self, name: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """The first event called `name` the child logged, waiting for the reader to get to it."""
        def found() -> dict[str, Any] | None:
            return next((e for e in self.events if e.get("event") == name), None)
        with self._new_event:
            if not self._new_event.wait_for(lambda: found() is not None or self._stream_ended, timeout_s):
                raise TimeoutError(f"`ninfer {self.command}` did not log {name!r} within {timeout_s} s")
            event = found()
        if event is None:
            raise RuntimeError(f"`ninfer {self.command}` exited without logging {name!r}: {self.other_lines[-20:]}")
        return event

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def wait(self, timeout_s: float = 60.0) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(timeout=5)
        return code

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
