"""Shepherd Model Gateway (`smg launch`, PyPI `smg`) as a child process in front of ninfer engines,
and a small OpenAI-HTTP client of it. The router test (tests/services/smg/test_router.py) and
tools/serving/measure_smg.py use it.

    with SmgRouter.start([engine.address for engine in engines], model_dir) as router:
        router.wait_for_workers(2)
        router.completion({"prompt": "def f", "max_tokens": 8, "temperature": 0})
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def smg_command() -> list[str] | None:
    """How to run smg here, or None when it is not installed."""
    exe = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    if Path(exe).is_file():
        return [exe]
    try:
        import smg.cli  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "smg.cli"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SmgRouter:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, metrics_port: int | None = None):
        self.proc, self.port, self.log_path, self.metrics_port = proc, port, log_path, metrics_port
        self.host = "127.0.0.1"

    @classmethod
    def start(cls, engine_addresses: list[str], model_dir: str | None, log_path: Path, *extra: str,
              policy: str = "cache_aware") -> "SmgRouter":
        """`model_dir` None: smg fetches the tokenizer from the engines (GetTokenizer)."""
        return cls._launch(["--worker-urls", *[f"grpc://{a}" for a in engine_addresses]], model_dir, log_path,
                           "--policy", policy, *extra)

    @classmethod
    def start_pd(cls, prefill_addresses: list[str], decode_addresses: list[str], model_dir: str | None,
                 log_path: Path, *extra: str) -> "SmgRouter":
        """smg's prefill/decode disaggregation over ninfer producers (`--kv-role producer`) and consumers
        (`--kv-role consumer`): `smg launch --pd-disaggregation --prefill grpc://P --decode grpc://D`."""
        workers = ["--pd-disaggregation"]
        for a in prefill_addresses:
            workers += ["--prefill", f"grpc://{a}"]
        for a in decode_addresses:
            workers += ["--decode", f"grpc://{a}"]
        return cls._launch(workers, model_dir, log_path, *extra)

    @classmethod
    def _launch(cls, workers: list[str], model_dir: str | None, log_path: Path, *extra: str) -> "SmgRouter":
        command = smg_command()
        if command is None:
            raise RuntimeError("smg is not installed (pip install 'ninfer[test]')")
        port, metrics_port = free_port(), free_port()
        argv = [*command, "launch", "--host", "127.0.0.1", "--port", str(port), *workers,
                *(["--model-path", model_dir] if model_dir else []), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics_port), "--log-level", "info", *extra]
        log = open(log_path, "w")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return cls(proc, port, log_path, metrics_port)

    # -- HTTP -----------------------------------------------------------------------------------

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _json_call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
        """One HTTP request; its JSON answer, or RuntimeError with the status and the start of the body."""
        conn = self._connection(timeout)
        try:
            if body is None:
                conn.request(method, path)
            else:
                conn.request(method, path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            if response.status != 200:
                raise RuntimeError(f"{method} {path}: {response.status} {data[:500]!r}")
            return json.loads(data)
        finally:
            conn.close()

    def get_json(self, path: str, timeout: float = 5.0) -> Any:
        return self._json_call("GET", path, None, timeout)

    def metric(self, name: str, worker: str) -> float:
        """One sample of smg's Prometheus endpoint for a worker URL (0 when absent)."""
        conn = http.client.HTTPConnection(self.host, self.metrics_port, timeout=5)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        prefix = f'{name}{{worker="{worker}"}} '
        return next((float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), 0.0)

    def wait_for_workers(self, count: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Block until `count` workers are registered, healthy and know their model."""
        deadline = time.monotonic() + timeout_s
        last: Any = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                workers = self.get_json("/workers")["workers"]
                ready = [w for w in workers if w.get("is_healthy") and w.get("model_id") not in (None, "unknown")]
                if len(ready) >= count:
                    return ready
                last = workers
            except (OSError, RuntimeError, ValueError) as e:
                last = e
            time.sleep(0.1)
        raise TimeoutError(f"smg has not {count} ready workers after {timeout_s} s: {last}")

    def wait_until_ready(self, workers: int, model: str, timeout_s: float = 60.0) -> None:
        """Workers registered, and the model's tokenizer loaded (smg answers 503 until it is)."""
        deadline = time.monotonic() + timeout_s
        self.wait_for_workers(workers, timeout_s)
        while True:
            try:
                self.completion({"model": model, "prompt": "ready?", "max_tokens": 1, "temperature": 0})
                return
            except RuntimeError as e:
                if "503" not in str(e) or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def completion(self, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        return self._json_call("POST", "/v1/completions", body, timeout)

    def stream_completion(self, body: dict[str, Any], timeout: float = 60.0) -> Iterator[dict[str, Any]]:
        """The SSE events of a streamed completion as they arrive; closing the generator drops the
        connection (the way a client that goes away does)."""
        conn = self._connection(timeout)
        try:
            conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                         {"Content-Type": "application/json", "Accept": "text/event-stream"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"/v1/completions (stream): {response.status} {response.read()[:500]!r}")
            while True:
                line = response.readline()
                if not line:
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[len(b"data:"):].strip()
                if payload == b"[DONE]":
                    return
                yield json.loads(payload)
        finally:
            if conn.sock is not None:
                conn.sock.close()
            conn.close()

    # -- lifecycle ------------------------------------------------------------------------------

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "SmgRouter":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
