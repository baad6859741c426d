"""GetTokenizer: the model's tokenizer files as one zip, streamed in chunks, its SHA-256 on the last.

smg unpacks the zip into a directory and loads it like a Hugging Face model directory (files at the
root, at most 50 entries; lightseekorg/smg crates/grpc_client/src/tokenizer_bundle.rs)."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

CHUNK_BYTES = 1 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "config.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                   "added_tokens.json")
# zip entries carry a timestamp: a fixed one keeps the bundle (and its SHA-256) the same on every engine
_FIXED_TIME = (2020, 1, 1, 0, 0, 0)


def tokenizer_zip(model_dir: str | None, tokenizer_json: str) -> bytes:
    """The tokenizer files of `model_dir`; for a built-in model (no directory) the engine's tokenizer.json."""
    files: dict[str, bytes] = {}
    if model_dir and Path(model_dir).is_dir():
        for name in TOKENIZER_FILES:
            path = Path(model_dir) / name
            if path.is_file():
                files[name] = path.read_bytes()
    files.setdefault("tokenizer.json", tokenizer_json.encode())
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in sorted(files.items()):
            archive.writestr(zipfile.ZipInfo(name, _FIXED_TIME), data, zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def tokenizer_chunks(bundle: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[common_pb2.GetTokenizerChunk]:
    digest = hashlib.sha256(bundle).hexdigest()
    starts = range(0, len(bundle), chunk_bytes)
    for start in starts:
        last = start + chunk_bytes >= len(bundle)
        yield common_pb2.GetTokenizerChunk(data=bundle[start:start + chunk_bytes], sha256=digest if last else "")
