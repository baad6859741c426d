"""compose/ cannot run here (no Docker): check instead that its commands parse with the real CLI, and
that ports, scrape targets and OTLP endpoints agree with each other and with the flags."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest

from ninfer.cli.main import build_parser

yaml = pytest.importorskip("yaml", reason="PyYAML reads the compose file (it comes with transformers)")

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
NINFER_SERVICES = ("engine", "gateway")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]


def args_of(service: dict):
    """The service's command as `ninfer` parses it (argparse exits on an unknown flag)."""
    return build_parser().parse_args(service["command"])


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def reachable_ports(service: dict) -> set[int]:
    published = {int(str(p).split(":")[-1]) for p in service.get("ports", [])}
    return published | {int(p) for p in service.get("expose", [])}


def test_the_image_runs_ninfer_from_the_repository_sources():
    text = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["ninfer"\]', text, re.M)
    repo = COMPOSE.parent
    for source in re.findall(r"^COPY (\S+)", text, re.M):
        assert (repo / source).exists(), f"COPY {source}: not in the repository"
    packages = re.search(r"include = \[(.*?)\]", (repo / "pyproject.toml").read_text()).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert re.search(rf"^COPY {package} ", text, re.M), f"package {package} is not copied into the image"


@pytest.mark.parametrize("name", NINFER_SERVICES)
def test_commands_parse_with_the_cli_and_listen_where_they_are_reachable(compose, name):
    service = compose[name]
    args = args_of(service)
    assert args.command == name
    for flag in (args.listen, args.metrics_listen):
        assert flag.startswith("0.0.0.0:"), f"{name}: {flag} is unreachable from other containers"
        assert port(flag) in reachable_ports(service), f"{name}: port of {flag} is neither exposed nor published"
    assert args.log_json


def test_the_gateway_routes_to_the_engine_service(compose):
    engine = args_of(compose["engine"])
    targets = args_of(compose["gateway"]).engine.split(",")
    assert targets == [f"engine:{port(engine.listen)}"]
    assert "engine" in compose["gateway"]["depends_on"]


def router_args(service: dict):
    """The router's command as smg itself parses it (argparse exits on an unknown flag)."""
    launch_router = pytest.importorskip("smg.launch_router", reason="smg parses the router's command (`test` extra)")
    assert service["command"][0] == "launch"
    return launch_router.parse_router_args(service["command"][1:])


def test_prometheus_scrapes_the_metrics_ports(compose):
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = {f"{name}:{port(args_of(compose[name]).metrics_listen)}" for name in NINFER_SERVICES}
    router_port = int(compose["router"]["command"][compose["router"]["command"].index("--prometheus-port") + 1])
    assert targets == expected | {f"router:{router_port}"}
    assert router_port in reachable_ports(compose["router"])
    mount = compose["prometheus"]["volumes"][0].split(":")
    assert mount[0] == "./prometheus.yml" and mount[1] in compose["prometheus"]["command"][0]


def test_traces_go_to_the_collector_then_to_jaeger(compose):
    collector = yaml.safe_load((COMPOSE / "otel-collector.yaml").read_text())
    receiver_port = port(collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert receiver_port in reachable_ports(compose["otel-collector"])
    for name in NINFER_SERVICES:
        env = compose[name]["environment"]
        endpoint = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (endpoint.hostname, endpoint.port) == ("otel-collector", receiver_port)
        assert env["OTEL_SERVICE_NAME"] == f"ninfer-{name}"
    (exporter,) = collector["service"]["pipelines"]["traces"]["exporters"]
    jaeger = urlparse("//" + collector["exporters"][exporter]["endpoint"])
    assert jaeger.hostname == "jaeger" and jaeger.port in reachable_ports(compose["jaeger"])
    assert compose["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    mount = compose["otel-collector"]["volumes"][0].split(":")
    assert (COMPOSE / mount[0]).is_file() and compose["otel-collector"]["command"] == [f"--config={mount[1]}"]


def test_the_stop_grace_outlasts_the_drain(compose):
    for name in NINFER_SERVICES:
        grace = int(compose[name]["stop_grace_period"].rstrip("s"))
        assert grace > args_of(compose[name]).drain_timeout


def test_the_router_fronts_the_engine_over_grpc_with_the_tested_smg(compose):
    service = compose["router"]
    args = router_args(service)
    engine = args_of(compose["engine"])
    assert args.worker_urls == [f"grpc://engine:{port(engine.listen)}"] and "engine" in service["depends_on"]
    assert args.host == "0.0.0.0" and args.port in reachable_ports(service) and args.prometheus_host == "0.0.0.0"
    assert args.policy == "cache_aware" and args.model_path is None     # the tokenizer comes from the engine
    collector = yaml.safe_load((COMPOSE / "otel-collector.yaml").read_text())
    receiver_port = port(collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert args.enable_trace and args.otlp_traces_endpoint == f"otel-collector:{receiver_port}"
    dockerfile = (COMPOSE / service["build"]["dockerfile"]).read_text()
    pinned = re.search(r'"smg==([\d.]+)"', dockerfile).group(1)
    tested = re.search(r'"smg(>=[^"]+)"', (COMPOSE.parent / "pyproject.toml").read_text()).group(1)
    from packaging.specifiers import SpecifierSet
    assert pinned in SpecifierSet(tested), f"the image's smg {pinned} is not the tested range {tested}"
