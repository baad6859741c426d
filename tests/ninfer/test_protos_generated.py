"""The committed ninfer/v1 package is exactly what tools/dev/gen_protos.py makes from protos/, for
grpcio 1.84; every rpc, message, field and enum value in the protos has a doc comment."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "protos" / "ninfer" / "v1"
DECLARATION = re.compile(r"^\s*(service|rpc|message|enum|oneof)\s+\w+"          # blocks and rpcs
                         r"|^\s*(optional\s+|repeated\s+)?[\w.<>, ]+\s+\w+\s*=\s*\d+\s*;"  # fields
                         r"|^\s*[A-Z][A-Z0-9_]*\s*=\s*\d+\s*;")                   # enum values


def test_committed_code_is_what_the_generator_makes(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test dependency (pip install -e .[test])")
    # in a fresh interpreter: grpc_tools' protoc crashes (SIGSEGV) in a process that has loaded NIXL, whose
    # wheel bundles its own gRPC and protobuf (tests/services/smg/test_pd.py runs it in the xdist worker)
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from tools.dev.gen_protos "
                    "import generate; generate(Path(sys.argv[1]))", str(tmp_path)], cwd=REPO, check=True, timeout=120)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in written}
    committed = {p.relative_to(REPO): p.read_bytes() for p in (REPO / "ninfer" / "v1").rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    assert sorted(fresh) == sorted(committed), "files differ: run python tools/dev/gen_protos.py"
    stale = [str(name) for name, data in fresh.items() if committed[name] != data]
    assert not stale, f"stale generated code in {stale}: run python tools/dev/gen_protos.py and commit"


def test_generated_code_targets_grpc_1_84():
    for path in (REPO / "ninfer" / "v1").glob("*_pb2_grpc.py"):
        assert "GRPC_GENERATED_VERSION = '1.84." in path.read_text(), path.name


def test_every_declaration_has_a_doc_comment():
    undocumented = []
    for proto in sorted(PROTO_DIR.glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if DECLARATION.match(line) and not lines[i - 1].strip().startswith("//"):
                undocumented.append(f"{proto.name}:{i + 1}: {line.strip()}")
    assert not undocumented, "declarations without a // comment above:\n" + "\n".join(undocumented)


def test_the_declaration_pattern_sees_fields_and_rpcs():
    """Guards the check above against a pattern that matches nothing."""
    text = (PROTO_DIR / "gateway.proto").read_text()
    matched = [line for line in text.splitlines() if DECLARATION.match(line)]
    assert any("rpc Generate" in line for line in matched)
    assert any("string prompt = 1;" in line for line in matched)
    common = (PROTO_DIR / "common.proto").read_text().splitlines()
    assert any("FINISH_REASON_STOP = 1;" in line for line in common if DECLARATION.match(line))
    assert len(matched) > 30
