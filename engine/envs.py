"""The registry of ninfer's environment switches: every `NINFER_*` variable the product reads.

Each switch is typed and documented in one line, and read here and nowhere else: product code asks
`envs.NAME.read()` (usually once, at import of the module it steers, so that one process runs one
setting and an A/B runs two processes). `docs/switches.md` is generated from this table
(`python -m engine.envs > docs/switches.md`), and tests/test_envs.py fails when the two drift or when a
product file reads a `NINFER_*` variable outside this module. No torch here: the gateway imports it.

Kinds:
- kill switch: turns off a change that won its measurement (the default is the winner);
- setting: a deployment choice with a documented default (credentials, limits);
- development: read by tests and development tools only.
What was tried and lost is not a switch: docs/performance.md lists it, one line each.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

KINDS = ("kill switch", "setting", "development")


def parse_bool(raw: str) -> bool:
    """'1'/'0' (also true/false, on/off, yes/no, any case)."""
    value = raw.strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no", ""):
        return False
    raise ValueError("takes 1 or 0")


def parse_int(raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError("takes an integer") from None


def parse_str(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Switch(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    doc: str
    kind: str

    def read(self) -> T:
        """The value in this process's environment, or the default; a malformed value stops the caller
        with the variable, its value and what it takes."""
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None

    def is_set(self) -> bool:
        return self.name in os.environ


SWITCHES: dict[str, Switch] = {}


def _register(name: str, default: T, parse: Callable[[str], T], kind: str, doc: str) -> Switch[T]:
    if not name.startswith("NINFER_") or name in SWITCHES or kind not in KINDS:
        raise ValueError(f"bad switch registration: {name} ({kind})")
    switch = Switch(name, default, parse, doc, kind)
    SWITCHES[name] = switch
    return switch


# --- credentials and deployment settings -------------------------------------------------------------------

API_KEY = _register(
    "NINFER_API_KEY", "", parse_str, "setting",
    "Bearer token a server requires (a key file is safer: NINFER_API_KEY_FILE or --api-key-file).")
API_KEY_FILE = _register(
    "NINFER_API_KEY_FILE", "", parse_str, "setting",
    "File holding the bearer token a server requires (same as --api-key-file).")
ENGINE_API_KEY = _register(
    "NINFER_ENGINE_API_KEY", "", parse_str, "setting",
    "Bearer token the gateway sends to its engines (or NINFER_ENGINE_API_KEY_FILE / --engine-api-key-file).")
ENGINE_API_KEY_FILE = _register(
    "NINFER_ENGINE_API_KEY_FILE", "", parse_str, "setting",
    "File holding the bearer token the gateway sends to its engines (same as --engine-api-key-file).")


# --- development --------------------------------------------------------------------------------------------

KERNEL_CAPABILITY = _register(
    "NINFER_KERNEL_CAPABILITY", "", parse_str, "development",
    "Choose kernel paths as if the GPU were this older compute capability (\"7.0\", \"8.0\", \"8.9\"): runs the "
    "sm70/sm80/sm89 paths on a newer GPU (engine/platform.py); a newer one than the device's is refused.")


def markdown() -> str:
    """docs/switches.md: one table row per switch, grouped by kind, in registration order."""
    lines = ["# Environment switches", "",
             "Generated from `engine/envs.py` by `python -m engine.envs > docs/switches.md`; "
             "tests/test_envs.py fails when this page and the registry drift.", ""]
    for kind in KINDS:
        rows = [s for s in SWITCHES.values() if s.kind == kind]
        if not rows:
            continue
        lines += [f"## {kind[0].upper()}{kind[1:]}{'es' if kind.endswith('switch') else 's'}", "",
                  "| variable | default | what it does |", "|---|---|---|"]
        for s in rows:
            default = int(s.default) if isinstance(s.default, bool) else s.default
            shown = f"`{default}`" if default != "" else "unset"
            lines.append(f"| `{s.name}` | {shown} | {s.doc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
