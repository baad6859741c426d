"""The registry of ninfer's environment switches: every `NINFER_*` variable the product reads.

Each switch is typed and documented in one line, and read here and nowhere else: product code asks
`envs.NAME.read()` (usually once, at import of the module it steers, so that one process runs one
setting and an A/B runs two processes). `docs/switches.md` is generated from this table
(`python -m engine.envs > docs/switches.md`), and tests/test_envs.py fails when the two drift or when a
product file reads a `NINFER_*` variable outside this module. No torch here: the gateway imports it.

Kinds:
- kill switch: turns off a change that won its measurement (the default is the winner);
- setting: a deployment choice with a documented default (credentials, limits);
- development: read by tests and development tools only (`NINFER_TEST_WORKERS` by `.ci/run`, a shell script).
What was tried and lost is not a switch: docs/tried-and-lost.md lists it, one line each. Values a measurement
chose among alternatives that lost are named constants beside the code they steer, with their reason.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

KINDS = ("kill switch", "setting", "development")
_HEADINGS = {"kill switch": "Kill switches", "setting": "Settings", "development": "Development"}


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


def parse_count(raw: str) -> int:
    """A non-negative integer (a size in bytes, a count; 0 usually turns the thing off)."""
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError("takes a non-negative integer")
    return value


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

    def raw(self) -> str | None:
        """The variable as set in this process's environment, unparsed (None: unset), for a run's record."""
        return os.environ.get(self.name)


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


# --- kill switches: each turns off a change that won its measurement (the folder under bench/results) --------

PDL = _register(
    "NINFER_PDL", True, parse_bool, "kill switch",
    "Programmatic dependent launch of the decode step's kernels on sm90+; 0 launches each kernel only after the one "
    "before it finished (bench/results/2026-11-30-h200-pdl/).")
FUSED_ROUND_PREP = _register(
    "NINFER_FUSED_ROUND_PREP", True, parse_bool, "kill switch",
    "A decode round's bookkeeping on CUDA in one launch each; 0 restores the torch ops "
    "(bench/results/2026-12-01-h200-gemv-tiles/).")
SKINNY_DENSE = _register(
    "NINFER_SKINNY_DENSE", True, parse_bool, "kill switch",
    "bf16 layers with 3-16 decode rows on the tensor-core skinny GEMM; 0 gives them back to cuBLAS "
    "(bench/results/2026-12-01-h200-decode-variants-prefill-tma/).")
GEMV_PAIRS = _register(
    "NINFER_GEMV_PAIRS", True, parse_bool, "kill switch",
    "The bf16 decode GEMV reads weights and activations as 32-bit words of two values; 0 restores the plain bf16 "
    "code (bench/results/2026-12-01-h200-gemv-pairs/).")
GEMV_PRELOAD = _register(
    "NINFER_GEMV_PRELOAD", True, parse_bool, "kill switch",
    "The one-row bf16 decode GEMV reads its first weight tile before it waits for the kernel ahead; 0 restores the "
    "plain loop (bench/results/2026-12-02-h200-preload-quant-8b/).")
QUANT_MMA_GEMV = _register(
    "NINFER_QUANT_MMA_GEMV", True, parse_bool, "kill switch",
    "Quantized decode rows (NVFP4 1-8, FP8 2-8) on the tensor-core CUDA C GEMV (needs CuPy); 0 leaves them to the "
    "Triton kernels (bench/results/2026-12-01-h200-quant-gemv-mma/).")
QUANT_MMA_CONTIG = _register(
    "NINFER_QUANT_MMA_CONTIG", True, parse_bool, "kill switch",
    "The tensor-core quantized GEMV reads a warp's batch of chunks from adjacent row bytes; 0 restores chunks "
    "interleaved across the warps (bench/results/2026-12-02-h200-mma-chunks-fp8-tiles/).")
ATTN_FUSED_MERGE = _register(
    "NINFER_ATTN_FUSED_MERGE", True, parse_bool, "kill switch",
    "Split decode attention merges its splits in the last split to finish; 0 restores the separate merge kernel "
    "(bench/results/2026-12-02-h200-fused-merge-kv-32b/).")
ATTN_INT8_LONG = _register(
    "NINFER_ATTN_INT8_LONG", True, parse_bool, "kill switch",
    "Decode over int8 KV pages at long contexts reads 128-key tiles with the next K loaded ahead, at most 2 programs "
    "an SM; 0 restores the 64-key plan (bench/results/2026-12-02-h200-kv-int8-long/).")
ATTN_BF16_LONG = _register(
    "NINFER_ATTN_BF16_LONG", True, parse_bool, "kill switch",
    "Decode over 16-bit KV pages split 32 ways or more loads the next K ahead with registers capped at 128; 0 "
    "restores the cp.async pipeline (bench/results/2026-12-02-h200-long-prefill-seed/).")
PREFILL_TMA = _register(
    "NINFER_PREFILL_TMA", True, parse_bool, "kill switch",
    "Prefill attention on sm90 gathers the keys and runs the TMA FlashAttention kernel; 0 keeps every prefill on "
    "the paged kernel (bench/results/2026-12-01-h200-decode-variants-prefill-tma/).")
PREFILL_TMA_INT8 = _register(
    "NINFER_PREFILL_TMA_INT8", True, parse_bool, "kill switch",
    "int8 KV pages take the TMA prefill routes through the one-pass dequantizing gather; 0 keeps them on the paged "
    "kernel (bench/results/2026-12-02-h200-long-prefill-seed/).")
PREFILL_TMA_HD256 = _register(
    "NINFER_PREFILL_TMA_HD256", True, parse_bool, "kill switch",
    "head_dim 256 (Qwen3.5's gated attention) takes the TMA prefill routes; 0 keeps it on the paged kernel "
    "(bench/results/2026-12-02-h200-long-prefill-seed/, 2026-12-02-h200-hybrid-hd256/).")
TP_FUSED_NORM = _register(
    "NINFER_TP_FUSED_NORM", True, parse_bool, "kill switch",
    "With TP > 1 the peer-to-peer all-reduce adds the residual and applies the next RMSNorm in the same launch; 0 "
    "restores the all-reduce, the add and the norm as separate ops (bench/results/2026-11-30-h200-tpfuse/).")
P2P_PUSH_MAX_BYTES = _register(
    "NINFER_P2P_PUSH_MAX_BYTES", 64 * 1024, parse_count, "kill switch",
    "16-bit all-reduces up to this many bytes take the push variant (one NVLink crossing); 0 restores the pull "
    "kernel for every size (bench/results/2026-12-01-h200-fold/).")

# --- development: tests and measurement tools --------------------------------------------------------------

TRITON_INTERPRET_TESTS = _register(
    "NINFER_TRITON_INTERPRET_TESTS", False, parse_bool, "development",
    "1 runs the Triton kernel tests under Triton's interpreter on the CPU (slow; needs triton installed).")
TEST_WORKERS = _register(
    "NINFER_TEST_WORKERS", 2, parse_count, "development",
    "The pytest-xdist workers .ci/run spreads the suite over (a file stays on one worker); 0 runs it in one process.")
COMMIT = _register(
    "NINFER_COMMIT", "", parse_str, "development",
    "The commit a bench or tuner run records, for a copy of the tree whose .git is stale or missing.")

COMPILE_MATRIX_FULL = _register(
    "NINFER_COMPILE_MATRIX_FULL", False, parse_bool, "development",
    "1 makes tests/engine/kernels/test_compile_matrix.py compile every kernel in both dtypes for every capability, "
    "prefill attention and the MoE chunked sort included (tens of minutes of ptxas), not CI's representative set.")
NVRTC_LIB = _register(
    "NINFER_NVRTC_LIB", "", parse_str, "development",
    "Path of a libnvrtc.so for the compile matrix's NVRTC compiles of the CUDA C kernels (default: the test extra's "
    "nvidia-cuda-nvrtc wheel; without one those tests skip).")
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
        lines += [f"## {_HEADINGS[kind]}", "",
                  "| variable | default | what it does |", "|---|---|---|"]
        for s in rows:
            default = int(s.default) if isinstance(s.default, bool) else s.default
            shown = f"`{default}`" if default != "" else "unset"
            lines.append(f"| `{s.name}` | {shown} | {s.doc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
