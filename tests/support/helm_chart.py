"""deploy/helm/ninfer rendered offline, variant by variant, by Helm's own Go engine (helm-python-sdk, a
binding of the Helm SDK: the templates run exactly as `helm template` runs them), and the lookups the
Kubernetes tests share: objects by kind, containers, ports, the engine's arguments as ninfer parses them."""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path

import helm_python
import yaml

from ninfer.cli.main import build_parser
from services.server.address import split_host_port

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "ninfer"
VALUES = REPO / "deploy" / "helm" / "values"
RELEASE, NAMESPACE = "prod", "inference"

# Each variant: the values files layered in order, as `helm install -f a.yaml -f b.yaml` layers them
VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "pd": ("pd.yaml",),
    "gateway": ("gateway.yaml",),
    "autoscaling": ("autoscaling.yaml",),
    "service-monitor": ("service-monitor.yaml",),
    "cpu-smoke": ("cpu-smoke.yaml",),
    "pd+autoscaling": ("pd.yaml", "autoscaling.yaml"),
}

# Engine flags of prefill/decode disaggregation (issue 40): the PD variant passes them before `ninfer engine`
# has them. Arguments of a flag the parser does not know yet are set aside, not parsed.
PD_FLAGS = ("--kv-role", "--kv-transfer-config")


def deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def overrides_of(variant: str) -> dict:
    merged: dict = {}
    for name in VARIANTS[variant]:
        merged = deep_merge(merged, yaml.safe_load((VALUES / name).read_text()) or {})
    return merged


@functools.cache
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def render_manifests(overrides: dict) -> dict[str, str]:
    """Template path -> rendered text; raises helm_python's HelmRenderError (a `fail` of the chart) or
    HelmValuesError (values.schema.json)."""
    return chart().render(overrides, name=RELEASE, namespace=NAMESPACE, is_install=True)


@dataclass(frozen=True)
class Rendered:
    values: dict                    # the chart's defaults with the variant's files over them
    objects: tuple[dict, ...]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        (found,) = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        return found

    def has(self, kind: str, name: str) -> bool:
        return any(o["metadata"]["name"] == name for o in self.of_kind(kind))

    def name(self, component: str) -> str:
        return f"{RELEASE}-ninfer-{component}"


@functools.cache
def render(variant: str) -> Rendered:
    overrides = overrides_of(variant)
    manifests = render_manifests(overrides)
    objects = tuple(doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
                    for doc in yaml.safe_load_all(text) if doc)
    return Rendered(chart().merge_values(overrides), objects)


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"] if "template" in workload["spec"] else workload["spec"]


def container(workload: dict, name: str | None = None) -> dict:
    containers = pod_spec(workload)["containers"]
    if name is None:
        (only,) = containers
        return only
    (found,) = [c for c in containers if c["name"] == name]
    return found


def container_port(container_: dict, name: str) -> int | None:
    ports = [p["containerPort"] for p in container_.get("ports", []) if p["name"] == name]
    return ports[0] if ports else None


def env_of(container_: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container_.get("env", [])}


def port_of(address: str) -> int:
    return split_host_port(address)[1]


def host_of(address: str) -> str:
    return split_host_port(address)[0]


def _subparser(command: str) -> argparse.ArgumentParser:
    return next(a for a in build_parser()._subparsers._group_actions if a.dest == "command").choices[command]


def engine_option_strings() -> set[str]:
    return set(_subparser("engine")._option_string_actions)


def split_pd_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """(args without the PD flags the engine parser does not know yet, those flags with their values)."""
    known = engine_option_strings()
    kept, set_aside = [], []
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        if flag in PD_FLAGS and flag not in known:
            width = 1 if "=" in args[i] else 2
            set_aside += args[i:i + width]
            i += width
        else:
            kept.append(args[i])
            i += 1
    return kept, set_aside


def ninfer_args(container_: dict) -> argparse.Namespace:
    """The container's command line as `ninfer` parses it (argparse exits on an unknown flag or value)."""
    args, _ = split_pd_flags(container_["args"])
    return build_parser().parse_args(args)
