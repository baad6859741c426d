"""The engine command line deploy/helm/ninfer renders (the CPU variant: the embedded tiny model), run as a real
`ninfer engine` process with the pod's environment: the kubelet's gRPC health check turns SERVING, the
metrics the autoscaler reads are served, and SIGTERM (what follows the preStop sleep) drains and exits 0
within --drain-timeout, inside the grace period. Rendering and the static checks: test_kubernetes.py.

Two things differ from the pod, and only these: the addresses bind 127.0.0.1 on free ports (tests never
listen beyond loopback; the ports are checked against the probes statically), and no OTLP endpoint is
set (there is no collector here)."""

from __future__ import annotations

import os
import re
import time
import urllib.request

import pytest
from grpc_health.v1 import health_pb2

from services.engine_client import EngineClient
from tests.support.helm_chart import NAMESPACE, container, pod_spec, render
from tools.serving.server_process import ServerProcess

VARIANT = "cpu-smoke"
LOOPBACK_ANY_PORT = "127.0.0.1:0"
HPA_METRICS = ("ninfer_engine_queue_length", "ninfer_engine_kv_cache_usage_ratio")


def pod_env(c: dict, pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet sets it: fieldRefs resolved, $(VAR) of earlier entries
    expanded; the OTLP endpoint left out (no collector here)."""
    fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE}
    env: dict[str, str] = {}
    for entry in c.get("env", []):
        if "valueFrom" in entry:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), entry["value"])
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT")
    return env


def loopback(args: list[str]) -> list[str]:
    """The args with the values of --listen and --metrics-listen bound to 127.0.0.1 on a free port."""
    out = list(args)
    for flag in ("--listen", "--metrics-listen"):
        out[out.index(flag) + 1] = LOOPBACK_ANY_PORT
    return out


@pytest.fixture(scope="module")
def pod():
    sts = render(VARIANT).of_kind("StatefulSet")[0]
    c = container(sts, "engine")
    assert c["args"][0] == "engine"
    env = {**os.environ, **pod_env(c, f"{sts['metadata']['name']}-0")}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    engine = ServerProcess.start("engine", *loopback(c["args"][1:]), env=env)
    try:
        yield sts, c, engine
    finally:
        if engine.proc.poll() is None:
            engine.kill()


def test_the_rendered_engine_turns_serving_for_the_kubelet_and_serves_the_autoscaler_s_metrics(pod):
    sts, c, engine = pod
    startup = c["startupProbe"]
    with EngineClient(engine.address) as client:
        client.wait_until_serving(timeout_s=startup["periodSeconds"] * startup["failureThreshold"])
        assert client.serving_status() == health_pb2.HealthCheckResponse.SERVING
    assert engine.metrics_port, "the chart's --metrics-listen is on: the engine must serve /metrics"
    text = urllib.request.urlopen(f"http://127.0.0.1:{engine.metrics_port}/metrics", timeout=10).read().decode()
    for name in HPA_METRICS:
        assert re.search(rf"^{name} [0-9.e+-]+$", text, re.M), f"{name} not served"


def test_sigterm_drains_and_exits_0_within_the_drain_timeout_and_the_grace_period(pod):
    sts, c, engine = pod
    drain = float(c["args"][c["args"].index("--drain-timeout") + 1])
    grace = pod_spec(sts)["terminationGracePeriodSeconds"] - c["lifecycle"]["preStop"]["sleep"]["seconds"]
    with EngineClient(engine.address) as client:
        client.wait_until_serving(timeout_s=120)
    start = time.monotonic()
    engine.terminate()
    assert engine.wait(timeout_s=grace) == 0
    assert time.monotonic() - start < drain
