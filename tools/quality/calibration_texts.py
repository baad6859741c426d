"""Calibration texts for the producers that calibrate (GPTQ, AWQ, ModelOpt's activation ranges) in the quality runs
of tools/quality/quant_quality.py: in the shared tiny model's domains -- the Python standard library's source
(code) and its modules' docstrings (prose), and seeded synthetic JSON records and enumerations -- and disjoint
from the held-out texts of quant_quality_texts.py (written for that file, not drawn from these sources).
Deterministic: the same 16 texts on every machine with the same Python (at most 256 tokens each in
calibration: 4k tokens, as much as a 2-core machine quantizes the shared models in minutes per layout)."""

from __future__ import annotations

import importlib
import inspect
import json
import random

# stdlib modules present in every CPython 3.11+ build
MODULES = ("argparse", "bisect", "calendar", "colorsys", "configparser", "csv", "dataclasses", "difflib", "enum",
           "fnmatch", "fractions", "functools", "glob", "gzip", "heapq", "hmac", "html", "ipaddress", "json",
           "keyword", "linecache", "locale", "mimetypes", "numbers", "operator", "optparse", "pathlib", "pprint",
           "queue", "random", "sched", "secrets", "shlex", "shutil", "statistics", "string", "textwrap", "timeit",
           "tokenize", "uuid")


def calibration_texts(n_code: int = 8, n_prose: int = 4, n_json: int = 2, n_enum: int = 2) -> list[str]:
    rng = random.Random(20261205)
    texts = []
    mods = [importlib.import_module(m) for m in MODULES]
    for m in mods[:n_code]:
        src = inspect.getsource(m)
        start = rng.randrange(0, max(1, len(src) - 2000))
        texts.append(src[start:start + 2000])
    docs = [inspect.getdoc(m) or "" for m in mods]
    texts += [d[:2000] for d in docs if len(d) > 200][:n_prose]
    cities = ["Lisbon", "Osaka", "Quito", "Tallinn", "Accra", "Perth", "Bergen", "Tucson"]
    for i in range(n_json):
        rows = [{"id": rng.randrange(10 ** 5, 10 ** 6), "city": rng.choice(cities), "score": round(rng.random() * 100, 2),
                 "active": rng.random() < 0.5, "tags": rng.sample(["alpha", "beta", "ops", "dev", "qa"], 2)}
                for _ in range(8)]
        texts.append(json.dumps(rows, indent=2 if i % 2 else None))
    words = ["apple", "river", "stone", "lamp", "cloud", "train", "paper", "garden"]
    for i in range(n_enum):
        item = rng.choice(["Step", "Item", "Row", "Entry"])
        texts.append("\n".join(f"{item} {j}: {' '.join(rng.sample(words, 4))}." for j in range(1, 25)))
    return texts
