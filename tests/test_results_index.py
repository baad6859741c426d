"""bench/results is data that backs the docs: every results path the repository cites exists, every folder is in
bench/results/INDEX.md (with the runs INDEX.md names), and no code sits among the data."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "INDEX.md"
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".scratch"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".txt", ".proto"}
# bench/results/<folder>[/<run or file>]: a run may be cited by its letter alone ("s16/b")
CITED = re.compile(r"bench/results/(20\d\d-\d\d-\d\d-[A-Za-z0-9-]*[A-Za-z0-9])(?:/([A-Za-z0-9._-]+))?")


def _text_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
                       and here / d != RESULTS]
        for name in filenames:
            if Path(name).suffix in TEXT_SUFFIXES:
                yield here / name


def _exists(folder: str, part: str | None) -> bool:
    base = RESULTS / folder
    if not base.is_dir():
        return False
    if part is None or (base / part).exists():
        return True
    return len(part) == 1 and any(p.name.startswith(part + "-") for p in base.iterdir())


def test_every_cited_results_path_exists():
    missing = []
    for path in _text_files():
        for m in CITED.finditer(path.read_text(errors="replace")):
            if not _exists(m.group(1), m.group(2)):
                missing.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "cited results that are not in bench/results:\n" + "\n".join(sorted(set(missing)))


def test_every_folder_is_in_the_index_and_every_run_it_names_exists():
    index = INDEX.read_text()
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    unlisted = [f for f in folders if f"`{f}" not in index]
    assert not unlisted, f"folders missing from bench/results/INDEX.md: {unlisted}"
    runs = {p.name for f in folders for p in (RESULTS / f).iterdir() if p.is_dir()}
    named = set(re.findall(r"`([a-i]-[0-9a-f]{7}-[A-Za-z0-9-]+|[a-i]-ab-[A-Za-z0-9-]+)`", index))
    named |= {m.split("/", 1)[1] for m in re.findall(r"`(20\d\d-[^`/]+/[^`/]+)`", index) if "." not in m.split("/", 1)[1]}
    assert named and named <= runs, f"INDEX.md names runs that do not exist: {sorted(named - runs)}"


def test_results_hold_data_not_code():
    code = [str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.suffix in (".py", ".sh")]
    assert not code, f"scripts among the results (they belong in tools/): {code}"
