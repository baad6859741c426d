"""Regenerate the committed protobuf code: `python tools/dev/gen_protos.py` (needs grpcio-tools 1.84.*).

protos/ninfer/v1/*.proto -> ninfer/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py, so that
`from ninfer.v1 import gateway_pb2` matches the proto package `ninfer.v1`. Only ninfer/v1 is generated:
the rest of the `ninfer` package (the command line) is written by hand. The GPU machine has grpcio
and protobuf but no grpcio-tools, hence committed code; tests/ninfer/test_protos_generated.py regenerates
into a temporary directory and fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata, resources
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
PACKAGE_DIR = Path("ninfer") / "v1"
REQUIRED_TOOLS = "1.84.0"
PACKAGE_INIT = '"""Generated protobuf code for the ninfer.v1 API (tools/dev/gen_protos.py); do not edit."""\n'


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the generated package under `out_dir`; return the files written."""
    from grpc_tools import protoc

    version = metadata.version("grpcio-tools")
    if version != REQUIRED_TOOLS:
        raise SystemExit(f"grpcio-tools {REQUIRED_TOOLS} is required (found {version}; it writes its own "
                         f"version into the code): pip install 'grpcio-tools=={REQUIRED_TOOLS}'")
    (out_dir / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out_dir / PACKAGE_DIR / "__init__.py").write_text(PACKAGE_INIT)
    return sorted(p for p in (out_dir / PACKAGE_DIR).rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO, help="directory that receives the ninfer/ package")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
