"""docs/serving.md against the code it documents: the flag tables against the `ninfer` parser and its
--help, the metric tables against the Prometheus registries of an engine and a gateway."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry

from ninfer.cli.main import build_parser
from services.server.prometheus import EnginePrometheus, GatewayPrometheus
from tools.dev import cli_reference

PAGE = cli_reference.PAGE


def test_the_flag_tables_are_generated_from_the_current_parser():
    page = PAGE.read_text()
    assert cli_reference.render(page) == page, "docs/serving.md is stale: run python tools/dev/cli_reference.py"


def _section(page: str, command: str) -> str:
    start = page.index(f"### `ninfer {command}`")
    end = page.find("### `ninfer ", start + 1)
    return page[start:end if end > 0 else len(page)]


def test_every_flag_that_help_shows_is_in_its_command_s_table(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")            # no wrapping inside a flag's name
    page = PAGE.read_text()
    subs = cli_reference._subparsers(build_parser())
    for command in cli_reference.COMMANDS:
        invocations = [m.group(1) for line in subs[command].format_help().splitlines()
                       if (m := re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line))]      # the option column only
        shown = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", " ".join(invocations))) - {"-h", "--help"}
        documented = set(re.findall(r"`(--?[a-z][a-z0-9-]*)`", _section(page, command)))
        assert shown <= documented, f"ninfer {command}: {sorted(shown - documented)} not in docs/serving.md"
        assert documented <= shown, f"ninfer {command}: {sorted(documented - shown)} documented but not a flag"


def _exposed_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_the_metric_tables_name_exactly_what_the_servers_export():
    snapshot = {"queue": {"waiting": 0, "prefilling": 0, "running": 0, "parked": 0},
                "kv": {"usage": 0.0, "free_blocks": 1}, "performance": {"requests": {"length": 1}}}
    engine, gateway = CollectorRegistry(), CollectorRegistry()
    EnginePrometheus(engine, lambda: snapshot)
    GatewayPrometheus(gateway, lambda: [("127.0.0.1:50052", True, 0)])
    exported = _exposed_names(engine) | _exposed_names(gateway)
    page = PAGE.read_text()
    metrics = page[page.index("**Metrics**"):page.index("## Deployment")]
    documented = set(re.findall(r"`(ninfer_(?:engine|gateway)_\w+)`", metrics))
    assert exported == documented, (f"exported, not documented: {sorted(exported - documented)}; "
                                    f"documented, not exported: {sorted(documented - exported)}")
