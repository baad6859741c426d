"""Launch values that a tuner in tools/dev measured, kept as data beside the kernels that read them.

A kernel family keeps them in `<its package>/tuned/<device>.json`, named for the device they were measured on
(`h200`; they serve every device until another's file exists and a kernel chooses it). One section per kernel,
which its tuner rewrites alone (`write_tuned`, the tuner's `--write`), naming the run behind the values under
"source". A kernel module reads its section once, at import (`load_tuned`). Where the file or the section is
missing or unreadable it gets the fallback its caller names (the kernel's untuned defaults), with a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog

TUNED_DEVICE = "h200"


def tuned_path(anchor: str, device: str = TUNED_DEVICE) -> Path:
    """The data file of the kernel family whose module file is `anchor` (`__file__`)."""
    return Path(anchor).resolve().parent / "tuned" / f"{device}.json"


def load_tuned(anchor: str, section: str, fallback: dict, device: str = TUNED_DEVICE) -> dict:
    """The section `section` of the family's data file, or `fallback` (logged) where it cannot be read."""
    path = tuned_path(anchor, device)
    try:
        values = json.loads(path.read_text())[section]
        if not isinstance(values, dict):
            raise TypeError(f"section {section!r} is {type(values).__name__}, not an object")
        return values
    except (OSError, ValueError, KeyError, TypeError) as error:
        structlog.get_logger(__name__).warning("tuned_values_missing", path=str(path), section=section,
                                               error=f"{type(error).__name__}: {error}", using="untuned defaults")
        return fallback


def write_tuned(path: Path, section: str, values: dict, source: str, device_name: str) -> None:
    """Replace `section` of the data file at `path` (other sections kept), naming its run and device."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data[section] = {"source": source, "device": device_name, **values}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
