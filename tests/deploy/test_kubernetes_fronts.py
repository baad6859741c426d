"""deploy/helm/ninfer's fronts and plumbing against the engines they point at: smg's command as smg parses it,
ninfer's gateway as ninfer parses it, the OpenTelemetry collector, Prometheus scraping, the autoscaler's
metrics, the NetworkPolicy. Rendering and the engines themselves: test_kubernetes.py."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from prometheus_client import CollectorRegistry
from smg import launch_router                     # the router's own parser (smg, `test` extra)

from services.server.prometheus import EnginePrometheus
from tests.support.helm_chart import (
    NAMESPACE, REPO, VARIANTS, container, container_port, env_of, ninfer_args, overrides_of, pod_spec, port_of,
    render)


COMPOSE = REPO / "compose"
DOMAIN = f"{NAMESPACE}.svc.cluster.local"
ROUTED = [v for v in VARIANTS if overrides_of(v).get("router", {}).get("enabled", True)]


def router_of(variant: str):
    rendered = render(variant)
    if variant not in ROUTED:
        assert not rendered.has("Deployment", rendered.name("router"))
        return None, None
    deployment = rendered.get("Deployment", rendered.name("router"))
    c = container(deployment, "smg")
    assert c["args"][0] == "launch"
    return deployment, launch_router.parse_router_args(c["args"][1:])


def pods_of_mode(variant: str, mode: str) -> list[str]:
    """grpc://host:port of every engine pod of that mode, by its StatefulSet DNS name."""
    urls = []
    for sts in render(variant).of_kind("StatefulSet"):
        if sts["spec"]["template"]["metadata"]["labels"]["ninfer-mode"] == mode:
            port = port_of(ninfer_args(container(sts, "engine")).listen)
            name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
            urls += [f"grpc://{name}-{i}.{service}.{DOMAIN}:{port}" for i in range(sts["spec"]["replicas"])]
    return urls


def labels_of_mode(variant: str, mode: str) -> list[dict]:
    return [sts["spec"]["template"]["metadata"]["labels"] for sts in render(variant).of_kind("StatefulSet")
            if sts["spec"]["template"]["metadata"]["labels"]["ninfer-mode"] == mode]


@pytest.mark.parametrize("variant", ROUTED)
def test_the_router_fronts_exactly_the_engines(variant):
    rendered = render(variant)
    deployment, args = router_of(variant)
    pd = bool(labels_of_mode(variant, "prefill"))
    assert args.pd_disaggregation == pd and args.model_path is None      # the tokenizer comes from the engines
    if rendered.values["router"]["discovery"] == "static":
        if pd:
            assert [url for url, _ in args.prefill_urls] == pods_of_mode(variant, "prefill")
            assert args.decode_urls == pods_of_mode(variant, "decode")
        else:
            assert args.worker_urls == pods_of_mode(variant, "both")
        return
    assert args.service_discovery and args.service_discovery_namespace == NAMESPACE
    assert args.service_discovery_port == rendered.values["engine"]["grpcPort"]
    selectors = {"prefill": args.prefill_selector, "decode": args.decode_selector} if pd else {"both": args.selector}
    for mode, selector in selectors.items():
        for other in ("both", "prefill", "decode"):
            matched = [selector.items() <= labels.items() for labels in labels_of_mode(variant, other)]
            assert all(matched) if other == mode else not any(matched), (mode, other, selector)
    role = rendered.get("Role", rendered.name("router"))
    assert {"get", "list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    binding = rendered.get("RoleBinding", rendered.name("router"))
    assert binding["subjects"][0]["name"] == pod_spec(deployment)["serviceAccountName"]


@pytest.mark.parametrize("variant", ROUTED)
def test_the_router_s_probes_ports_and_drain_agree_with_its_flags(variant):
    deployment, args = router_of(variant)
    c = container(deployment, "smg")
    assert container_port(c, "http") == args.port and container_port(c, "health") == args.health_check_port
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == c["startupProbe"]["httpGet"] == {"path": "/liveness", "port": "health"}
    metrics = render(variant).values["metrics"]["enabled"]
    assert args.prometheus_host == ("0.0.0.0" if metrics else "127.0.0.1")
    assert container_port(c, "metrics") == (args.prometheus_port if metrics else None)
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] > pre_stop + args.shutdown_grace_period_secs


def test_the_router_image_runs_the_tested_smg():
    deployment, _ = router_of("default")
    tag = container(deployment, "smg")["image"].rsplit(":", 1)[1]
    pinned = re.search(r'"smg==([\d.]+)"', (COMPOSE / "smg.Dockerfile").read_text()).group(1)
    tested = re.search(r'"smg(>=[^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert tag == pinned and pinned in SpecifierSet(tested)


def test_the_engine_image_is_this_version_of_ninfer():
    chart = yaml.safe_load((REPO / "deploy/helm/ninfer/Chart.yaml").read_text())
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    sts = render("default").of_kind("StatefulSet")[0]
    assert chart["appVersion"] == version and container(sts, "engine")["image"] == f"ninfer:{version}"


def test_the_gateway_fronts_the_engines_with_their_key_and_its_own():
    rendered = render("gateway")
    deployment = rendered.get("Deployment", rendered.name("gateway"))
    c = container(deployment, "gateway")
    args = ninfer_args(c)
    assert args.command == "gateway" and args.log_json
    assert ["grpc://" + e for e in args.engine.split(",")] == pods_of_mode("gateway", "both")
    port = port_of(args.listen)
    assert c["readinessProbe"]["grpc"] == {"port": port} and container_port(c, "grpc") == port
    assert c["livenessProbe"]["tcpSocket"] == c["startupProbe"]["tcpSocket"] == {"port": port}
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] > (
        c["lifecycle"]["preStop"]["sleep"]["seconds"] + args.drain_timeout)
    env, engine_auth = env_of(c), rendered.values["engine"]["auth"]
    engine_env = env_of(container(rendered.of_kind("StatefulSet")[0], "engine"))
    assert engine_env["NINFER_API_KEY_FILE"].endswith("/" + engine_auth["key"])
    key_file = env["NINFER_ENGINE_API_KEY_FILE"]
    (mount,) = [m for m in c["volumeMounts"] if key_file.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == engine_auth["apiKeySecret"]
    service = rendered.get("Service", rendered.name("gateway"))
    smoke = rendered.get("Pod", rendered.name("smoke"))
    smoke_args = ninfer_args(container(smoke))
    assert smoke_args.command == "generate"
    assert smoke_args.gateway == f"{service['metadata']['name']}.{DOMAIN}:{service['spec']['ports'][0]['port']}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_traces_go_to_the_collector_that_listens_where_they_are_sent(variant):
    rendered = render(variant)
    collector = rendered.values["otel"]["collector"]
    config = yaml.safe_load(rendered.get("ConfigMap", rendered.name("otel-collector"))["data"]["config.yaml"])
    receiver_port = port_of(config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    service = rendered.get("Service", rendered.name("otel-collector"))
    assert service["spec"]["ports"][0]["port"] == receiver_port == collector["port"]
    health = port_of(config["extensions"]["health_check"]["endpoint"])
    deployment = rendered.get("Deployment", rendered.name("otel-collector"))
    assert container_port(container(deployment), "health") == health
    for name, pipeline in config["service"]["pipelines"].items():
        for part in ("receivers", "processors", "exporters"):
            assert set(pipeline[part]) <= set(config[part]), f"{name}: {part} not configured"
    where = f"{service['metadata']['name']}.{DOMAIN}:{receiver_port}"
    for workload in rendered.of_kind("StatefulSet") + rendered.of_kind("Deployment"):
        for c in pod_spec(workload)["containers"]:
            if c["image"].startswith(rendered.values["image"]["repository"] + ":"):
                endpoint = urlparse(env_of(c)["OTEL_EXPORTER_OTLP_ENDPOINT"])
                assert f"{endpoint.hostname}:{endpoint.port}" == where
                assert env_of(c)["OTEL_SERVICE_NAME"] == f"ninfer-{ninfer_args(c).command}"
    _, router = router_of(variant)
    if router is not None:
        assert router.enable_trace and router.otlp_traces_endpoint == where
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]["otel-collector"]
    image = collector["image"]
    assert compose["image"] == f"{image['repository']}:{image['tag']}", "compose and the chart run one collector"


@pytest.mark.parametrize("variant", VARIANTS)
def test_prometheus_scrapes_every_metrics_port(variant):
    rendered = render(variant)
    values = rendered.values["metrics"]
    workloads = rendered.of_kind("StatefulSet") + [d for d in rendered.of_kind("Deployment")
                                                   if "collector" not in d["metadata"]["name"]]
    for workload in workloads:
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        port = container_port(pod_spec(workload)["containers"][0], "metrics")
        if values["enabled"] and values["podAnnotations"]:
            assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(port)
        else:
            assert "prometheus.io/scrape" not in annotations
    monitors = rendered.of_kind("ServiceMonitor")
    if not values["serviceMonitor"]["enabled"]:
        assert not monitors
        return
    (monitor,) = monitors
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert monitor["metadata"]["labels"].items() >= values["serviceMonitor"]["labels"].items()
    selected = [s for s in rendered.of_kind("Service")
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == {
        w["metadata"]["name"] if w["kind"] == "Deployment" else w["spec"]["serviceName"] for w in workloads}
    for service in selected:
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
        assert port["targetPort"] == "metrics"


def _engine_gauges() -> set[str]:
    snapshot = {"queue": {"waiting": 0, "prefilling": 0, "running": 0, "parked": 0},
                "kv": {"usage": 0.0, "free_blocks": 1}, "performance": {"requests": {"length": 1}}}
    registry = CollectorRegistry()
    EnginePrometheus(registry, lambda: snapshot)
    return {family.name for family in registry.collect() if family.type == "gauge"}


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "autoscaling" in v])
def test_the_autoscaler_scales_each_role_on_gauges_the_engines_export(variant):
    rendered = render(variant)
    hpas = rendered.of_kind("HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {
        s["metadata"]["name"] for s in rendered.of_kind("StatefulSet")}
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    for hpa in hpas:
        sts = rendered.get("StatefulSet", hpa["spec"]["scaleTargetRef"]["name"])
        assert "replicas" not in sts["spec"], "the HPA owns the replica count"
        for metric in hpa["spec"]["metrics"]:
            name = metric["pods"]["metric"]["name"]
            assert name in _engine_gauges() and f"`{name}`" in docs


def test_the_autoscaling_metrics_the_docs_name_are_gauges_the_engines_export():
    """Every metric the "Autoscaling" table of docs/kubernetes.md offers is an engine gauge, under its name."""
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    section = docs[docs.index("\n## Autoscaling\n"):]
    section = section[:section.index("\n## ", 1)]
    named = re.findall(r"^\| `(ninfer_[a-z_]+)`", section, re.M)
    assert {"ninfer_engine_queue_length", "ninfer_engine_kv_cache_usage_ratio"} <= set(named)
    assert set(named) <= _engine_gauges(), sorted(set(named) - _engine_gauges())


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_network_policy_admits_the_fronts_to_the_engines_grpc_port(variant):
    rendered = render(variant)
    (policy,) = rendered.of_kind("NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for sts in rendered.of_kind("StatefulSet"):
        assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    grpc_rule = next(r for r in policy["spec"]["ingress"] if r.get("ports") == [{"port": "grpc", "protocol": "TCP"}])
    for front in ("router", "gateway"):
        if rendered.has("Deployment", rendered.name(front)):
            labels = rendered.get("Deployment", rendered.name(front))["spec"]["template"]["metadata"]["labels"]
            assert any(peer["podSelector"]["matchLabels"].items() <= labels.items() for peer in grpc_rule["from"])
