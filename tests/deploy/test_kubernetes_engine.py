"""The command lines deploy/helm/ninfer renders for its CPU variant (the embedded tiny model), run as real
processes: `ninfer engine` with the pod's environment (the kubelet's gRPC health check turns SERVING, the
metrics the autoscaler reads are served, SIGTERM, which follows the preStop sleep, drains and exits 0 within
--drain-timeout), smg's `launch` in front of it (its readiness and liveness probes answer on its health
port) and `helm test`'s smoke script (one generation through smg). Rendering and the static checks:
test_kubernetes.py, test_kubernetes_fronts.py.

What differs from the pods, and only that: addresses bind 127.0.0.1 on free ports and name the local
processes instead of cluster DNS names (tests never listen beyond loopback; the ports are checked against
the probes statically), and no trace exporter is set (there is no collector here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from grpc_health.v1 import health_pb2

from services.engine_client import EngineClient
from tests.support.helm_chart import NAMESPACE, container, pod_spec, render
from tools.serving.server_process import ServerProcess
from tools.serving.smg_stack import free_port, smg_command

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


def with_values(args: list[str], values: dict[str, str], drop: dict[str, int] | None = None) -> list[str]:
    """The args with each flag of `values` given that value (the flag must be there), and each flag of `drop`
    removed with its n values."""
    out = list(args)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    for flag, width in (drop or {}).items():
        i = out.index(flag)
        del out[i:i + 1 + width]
    return out


def http_status(url: str) -> int:
    """The HTTP status, 0 while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError:
        return 0


@pytest.fixture(scope="module")
def pod():
    sts = render(VARIANT).of_kind("StatefulSet")[0]
    c = container(sts, "engine")
    assert c["args"][0] == "engine"
    env = {**os.environ, **pod_env(c, f"{sts['metadata']['name']}-0")}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    args = with_values(c["args"][1:], {"--listen": LOOPBACK_ANY_PORT, "--metrics-listen": LOOPBACK_ANY_PORT})
    engine = ServerProcess.start("engine", *args, env=env)
    try:
        yield sts, c, engine
    finally:
        if engine.proc.poll() is None:
            engine.kill()


@pytest.fixture(scope="module")
def router(pod, tmp_path_factory):
    """smg with the router Deployment's args; the engine's address in --worker-urls."""
    if smg_command() is None:
        pytest.skip("smg is not installed (the `test` extra installs it)")
    _, _, engine = pod
    rendered = render(VARIANT)
    c = container(rendered.get("Deployment", rendered.name("router")), "smg")
    assert c["args"][0] == "launch" and c["args"].count("--worker-urls") == 1
    ports = {name: free_port() for name in ("--port", "--health-check-port", "--prometheus-port")}
    args = with_values(c["args"], {"--host": "127.0.0.1", "--prometheus-host": "127.0.0.1",
                                   "--worker-urls": f"grpc://{engine.address}", **{f: str(p) for f, p in ports.items()}},
                       drop={"--enable-trace": 0, "--otlp-traces-endpoint": 1})
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*smg_command(), *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield c, ports, proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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


def test_the_router_s_probes_answer_and_helm_test_s_smoke_generates_through_it(pod, router):
    c, ports, proc, log = router
    health = f"http://127.0.0.1:{ports['--health-check-port']}"
    deadline = time.monotonic() + 60
    while http_status(health + c["readinessProbe"]["httpGet"]["path"]) != 200:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    assert c["readinessProbe"]["httpGet"]["port"] == c["livenessProbe"]["httpGet"]["port"] == "health"
    assert http_status(health + c["livenessProbe"]["httpGet"]["path"]) == 200

    rendered = render(VARIANT)
    (script,) = container(rendered.get("Pod", rendered.name("smoke")), "completion")["args"]
    service = rendered.get("Service", rendered.name("router"))
    in_cluster = (f"http://{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:"
                  f"{service['spec']['ports'][0]['port']}")
    assert f'"{in_cluster}"' in script
    local = script.replace(f'"{in_cluster}"', f'"http://127.0.0.1:{ports["--port"]}"')
    done = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr + log.read_text()[-3000:]
    assert '"completion_tokens": 8' in done.stdout.splitlines()[-1]


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
