"""The Triton kernel of engine/kernels/l2_prefetch.py: ask the L2 for a byte range, 16 KB per instruction.

`cp.async.bulk.prefetch.L2` (sm_90) hands a range to the SM's bulk-copy engine and returns: the
program exits at once and holds no registers or shared memory while the bytes arrive. The address
is a uniform operand, so the compiler issues a lane's request at a time (UBLKPF.L2 in a loop over
the warp's lanes).
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK_BYTES = 16384          # bytes per prefetch instruction
LANES = 32                   # chunks per program (one warp, one chunk per lane)


@triton.jit
def _prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    # base: the first byte's address (16-byte aligned); nbytes: a multiple of 16
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = lane.to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [base + start, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_bytes(address: int, nbytes: int) -> None:
    """Prefetch [address, address + nbytes) into L2 on the current stream (16-byte aligned, nbytes % 16 == 0)."""
    grid = (triton.cdiv(nbytes, CHUNK_BYTES * LANES),)
    _prefetch_kernel[grid](address, nbytes, CHUNK=CHUNK_BYTES, LANES=LANES, num_warps=1)
