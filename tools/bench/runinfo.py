"""What a run records about where it ran: device, library versions, date, commit."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from engine import envs

REPO = Path(__file__).resolve().parents[2]


# the engine's kill switches (engine/envs.py): a run records how it set them (unset: the engine's default)
ENGINE_SWITCHES = tuple(name for name, s in envs.SWITCHES.items() if s.kind == "kill switch")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> dict:
    """The checkout's commit; tolerates a copy of the tree without `.git` (the device machine's)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None
    copied = envs.COMMIT.read()                     # set by whoever copied the tree (its .git may be stale)
    if copied:
        return {"commit": copied, "dirty": None}
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def device_info(device: str) -> dict:
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        return {"kind": "cuda", "name": props.name, "count": torch.cuda.device_count(),
                "memory_bytes": props.total_memory, "sms": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}
    return {"kind": "cpu", "name": platform.processor() or platform.machine(), "count": 0,
            "threads": torch.get_num_threads()}


def collect(device: str) -> dict:
    now = dt.datetime.now(dt.timezone.utc)
    return {
        "date": now.isoformat(timespec="seconds"),
        "device": device_info(device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": _version("triton"), "transformers": _version("transformers"),
                     "ninfer": _version("ninfer")},
        "git": git_commit(),
        "host": platform.node(),
        # the engine's kill switches as this run set them (unset: the engine's default)
        "switches": {name: envs.SWITCHES[name].raw() for name in ENGINE_SWITCHES},
    }


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def default_out_dir(info: dict) -> Path:
    """$OUT where the device tool provides one, else bench/results/<date>-<device>-<commit>/."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    dev = info["device"]
    name = slug(dev["name"]) if dev["kind"] == "cuda" else "cpu"
    if dev["kind"] == "cuda" and dev["count"] > 1:
        name += f"-x{dev['count']}"
    commit = (info["git"]["commit"] or "nogit")[:8]
    return REPO / "bench" / "results" / f"{info['date'][:10]}-{name}-{commit}"
