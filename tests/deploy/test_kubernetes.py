"""deploy/helm/ninfer without a cluster: every variant rendered by Helm's engine, every object validated against
the Kubernetes schemas (strict: an unknown field fails), and the engines checked against the CLI that runs in
them: ports, probes, drain, GPUs, keys, the prefill/decode flags. The fronts: test_kubernetes_fronts.py."""

from __future__ import annotations

import copy
import json

import helm_python
import kubernetes_validate
import pytest
import yaml

from ninfer.cli.flags import engine_config_from_args
from services.server.tls import is_loopback
from tests.support.helm_chart import (
    CHART, PD_FLAGS, VALUES, VARIANTS, container, container_port, engine_option_strings, env_of, host_of, ninfer_args,
    overrides_of, pod_spec, port_of, render, render_manifests, split_pd_flags)

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: the preStop sleep action) and the newest
# the validator ships
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
# Kinds of CRDs that are no part of Kubernetes' schemas; test_kubernetes_fronts.py checks what they point at
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
ENGINE_CONTAINER = "engine"
# Connections the kubelet's gRPC probes (startup, readiness, liveness) may hold open on one engine at once
PROBE_CONNECTIONS = 3


def engines(variant: str) -> list[dict]:
    return render(variant).of_kind("StatefulSet")


def test_every_values_file_is_a_rendered_variant():
    used = {name for files in VARIANTS.values() for name in files}
    assert used == {p.name for p in VALUES.glob("*.yaml")}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_values_meet_the_chart_schema_and_helm_lint(variant):
    helm_python.Chart.load(CHART).validate_schema(overrides_of(variant))
    report = helm_python.lint(CHART, overrides_of(variant), strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] > 1], report


@pytest.mark.parametrize("bad, field", [({"engine": {"drainTimout": 30}}, "/engine"),
                                        ({"engine": {"grpcPort": 70000}}, "/engine/grpcPort"),
                                        ({"roles": {"Prefill_1": {"enabled": True}}}, "/roles"),
                                        ({"router": {"discovery": "dns"}}, "/router/discovery")])
def test_a_bad_value_is_refused_naming_it(bad, field):
    with pytest.raises(helm_python.HelmValuesError, match=f"at '{field}'"):
        render_manifests(bad)


# Objects (as canonical JSON) already validated by an earlier variant: half the variants' objects are the same,
# and the validator reads its schema files again on every call
_VALIDATED: set[str] = set()


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates_against_the_kubernetes_schemas(variant):
    objects = render(variant).objects
    assert {o["kind"] for o in objects} >= {"StatefulSet", "Service", "PodDisruptionBudget"}
    for obj in objects:
        canonical = json.dumps(obj, sort_keys=True)
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS or canonical in _VALIDATED:
            continue
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
        _VALIDATED.add(canonical)


def test_the_validator_refuses_a_misspelt_field_and_a_wrong_type():
    engine = copy.deepcopy(engines("default")[0])
    container(engine, ENGINE_CONTAINER)["readinessProbe"]["grpc"]["prot"] = 50052
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(engine, KUBERNETES_VERSIONS[0], strict=True)
    engine = copy.deepcopy(engines("default")[0])
    pod_spec(engine)["terminationGracePeriodSeconds"] = "55s"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(engine, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_ports_and_probes_agree_with_the_cli(variant):
    rendered = render(variant)
    for sts in engines(variant):
        c = container(sts, ENGINE_CONTAINER)
        args = ninfer_args(c)
        assert args.command == "engine" and args.log_json
        grpc_port = port_of(args.listen)
        assert container_port(c, "grpc") == grpc_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": grpc_port}, f"{probe}: the grpc health probe of the whole server"
        if rendered.values["metrics"]["enabled"]:
            assert container_port(c, "metrics") == port_of(args.metrics_listen)
        else:
            assert args.metrics_listen == "off" and container_port(c, "metrics") is None
        service = rendered.get("Service", sts["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"] == grpc_port


def most_pods(rendered, workload: dict) -> int:
    """The most pods a workload may run: its HPA's maximum, else its replicas."""
    hpas = [h["spec"]["maxReplicas"] for h in rendered.of_kind("HorizontalPodAutoscaler")
            if h["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]]
    return hpas[0] if hpas else workload["spec"]["replicas"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_flags_build_an_engine_config_and_leave_the_probes_a_connection(variant):
    """Past argparse: the flags make an EngineConfig (its own checks), and --max-connections (a new connection
    past it is closed at once, a kubelet probe's too) admits every front, every peer engine and the probes."""
    rendered = render(variant)
    fronts = sum(most_pods(rendered, d) for d in rendered.of_kind("Deployment")
                 if d["metadata"]["name"] in (rendered.name("router"), rendered.name("gateway")))
    assert fronts >= 1
    engine_pods = sum(most_pods(rendered, sts) for sts in engines(variant))
    for sts in engines(variant):
        args = ninfer_args(container(sts, ENGINE_CONTAINER))
        config = engine_config_from_args(args)
        assert config.tensor_parallel_size == args.tensor_parallel_size and config.model == (args.model or None)
        assert args.max_connections >= fronts + engine_pods - 1 + PROBE_CONNECTIONS, args.max_connections


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_grace_period_outlasts_prestop_and_drain_and_the_probes_allow_a_warm_up(variant):
    for sts in engines(variant):
        spec, c = pod_spec(sts), container(sts, ENGINE_CONTAINER)
        drain = ninfer_args(c).drain_timeout
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace = spec["terminationGracePeriodSeconds"]
        assert grace > drain and grace > pre_stop + drain, (grace, pre_stop, drain)
        startup, liveness = c["startupProbe"], c["livenessProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "a warm-up needs minutes"
        # health says NOT_SERVING while draining: the liveness probe must not kill a drain
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_engine_requests_the_gpus_its_tensor_parallelism_uses(variant):
    rendered = render(variant)
    gpu = rendered.values["engine"]["gpu"]
    for sts in engines(variant):
        c = container(sts, ENGINE_CONTAINER)
        args = ninfer_args(c)
        limits = c["resources"].get("limits", {})
        if gpu["enabled"]:
            assert args.device != "cpu" and limits[gpu["resourceName"]] == args.tensor_parallel_size
        else:
            assert args.device == "cpu" and gpu["resourceName"] not in limits


def test_the_model_directory_is_on_its_read_only_volume():
    overrides = {"model": {"path": "/models/qwen3-8b",
                           "volume": {"persistentVolumeClaim": {"claimName": "qwen3-8b", "readOnly": True}}}}
    (sts,) = [o for o in yaml.safe_load_all(render_manifests(overrides)["ninfer/templates/engine-statefulset.yaml"])
              if o]
    c = container(sts, ENGINE_CONTAINER)
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "model"]
    assert mount["readOnly"] and ninfer_args(c).model.startswith(mount["mountPath"] + "/")
    (volume,) = [v for v in pod_spec(sts)["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"]["claimName"] == "qwen3-8b"
    kubernetes_validate.validate(sts, KUBERNETES_VERSIONS[0], strict=True)


def _key_file_is_a_mounted_secret(workload: dict, c: dict, path: str, secret: str, key: str) -> bool:
    mounts = [m for m in c.get("volumeMounts", []) if path == f"{m['mountPath']}/{key}"]
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    return any(volumes[m["name"]]["secret"]["secretName"] == secret and
               volumes[m["name"]]["secret"]["items"] == [{"key": key, "path": key}] for m in mounts)


@pytest.mark.parametrize("variant", VARIANTS)
def test_nothing_listens_beyond_loopback_without_a_key_unless_the_values_say_so(variant):
    rendered = render(variant)
    servers = [(sts, container(sts, ENGINE_CONTAINER), rendered.values["engine"]["auth"]) for sts in engines(variant)]
    if rendered.has("Deployment", rendered.name("gateway")):
        gateway = rendered.get("Deployment", rendered.name("gateway"))
        servers.append((gateway, container(gateway, "gateway"), rendered.values["gateway"]["auth"]))
    for workload, c, auth in servers:
        args, env = ninfer_args(c), env_of(c)
        if not is_loopback(host_of(args.listen)) and not args.tls_cert:
            if "NINFER_API_KEY_FILE" in env:
                assert _key_file_is_a_mounted_secret(workload, c, env["NINFER_API_KEY_FILE"], auth["apiKeySecret"],
                                                     auth["key"])
            else:
                assert auth["allowUnauthenticated"], f"{c['name']} listens on {args.listen} with no key nor TLS"
                assert "NINFER_API_KEY" not in env and not args.api_key
        if args.metrics_listen != "off" and not is_loopback(host_of(args.metrics_listen)):
            assert rendered.values["metrics"]["enabled"]


@pytest.mark.parametrize("overrides, message", [
    ({"engine": {"auth": {"allowUnauthenticated": False}}}, "engine.auth"),
    ({"engine": {"auth": {"apiKeySecret": "k"}}}, "engine.auth.apiKeySecret: smg"),
    ({"router": {"enabled": False}, "gateway": {"enabled": True}}, "gateway.auth"),
    ({"engine": {"autoscaling": {"enabled": True}}}, "router.discovery=static"),
    ({"roles": {"decode": {"enabled": True, "mode": "decode"}}}, "one deployment is either disaggregated"),
    ({"roles": {"engine": {"enabled": False}}}, "no engine role"),
])
def test_unsafe_or_incoherent_values_are_refused_naming_the_value(overrides, message):
    with pytest.raises(helm_python.HelmRenderError, match=message.replace(".", r"\.")):
        render_manifests(overrides)


def test_pd_roles_are_refused_behind_ninfer_s_gateway():
    overrides = overrides_of("pd") | {"router": {"enabled": False}, "gateway": {"enabled": True,
                                                                               "auth": {"apiKeySecret": "g"}}}
    with pytest.raises(helm_python.HelmRenderError, match="gateway.enabled"):
        render_manifests(overrides)


def test_the_pd_roles_carry_their_kv_flags_and_they_parse_once_the_engine_has_them():
    roles = {sts["spec"]["template"]["metadata"]["labels"]["ninfer-mode"]: container(sts, ENGINE_CONTAINER)
             for sts in engines("pd")}
    assert set(roles) == {"prefill", "decode"}
    expected = {"prefill": "producer", "decode": "consumer"}
    for mode, c in roles.items():
        ninfer_args(c)                               # everything but the PD flags parses today
        assert "--kv-role" in c["args"] and c["args"][c["args"].index("--kv-role") + 1] == expected[mode]
    known = engine_option_strings() & set(PD_FLAGS)
    if not known:
        pytest.skip("`ninfer engine` has no --kv-role yet (issue 40, items 1-4): the PD flags are not parsed")
    assert "--kv-role" in known, (f"`ninfer engine` now spells the PD flags {sorted(known)}: update "
                                  "deploy/helm/values/pd.yaml and this test")
    for mode, c in roles.items():
        assert split_pd_flags(c["args"])[1] == []
        assert ninfer_args(c).kv_role == expected[mode]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_notes_warn_of_pd_roles_while_the_engine_lacks_their_flags(variant):
    """The chart's install notes say that prefill/decode engines cannot start, exactly while `ninfer engine`
    has no --kv-role: the day it has them this fails, to take the warning (and pd.yaml's) away."""
    notes = render_manifests(overrides_of(variant))["ninfer/templates/NOTES.txt"]
    modes = {sts["spec"]["template"]["metadata"]["labels"]["ninfer-mode"] for sts in engines(variant)}
    warned = "does not have yet" in notes and "usage error" in notes
    assert warned == ("prefill" in modes and "--kv-role" not in engine_option_strings()), notes


def test_pd_flags_the_parser_does_not_know_are_set_aside_and_nothing_else():
    known = engine_option_strings()
    kv_role, kv_config = ["--kv-role", "producer"], ["--kv-transfer-config={}"]
    kept, set_aside = split_pd_flags(["engine", "--listen", "0.0.0.0:1", *kv_role, *kv_config, "--log-json"])
    assert kept == ["engine", "--listen", "0.0.0.0:1", *(kv_role if "--kv-role" in known else []),
                    *(kv_config if "--kv-transfer-config" in known else []), "--log-json"]
    assert set_aside == [*(kv_role if "--kv-role" not in known else []),
                         *(kv_config if "--kv-transfer-config" not in known else [])]
