"""Weight prefetch into L2 across the small kernels of a captured decode round.

At batch 1 a decode step streams every weight once, and between two GEMVs run kernels that read
almost nothing from HBM: the norms, q/k norm and RoPE, attention over a short context and its split
merge, SiLU. On qwen3-8b that is ~19 µs per layer, 0.69 ms of a 4.6 ms step (profile, session 14),
during which the memory system idles. Here a linear layer that has just enqueued its GEMV forks, on a
side stream, a kernel that asks the L2 for the first bytes of the *next* linear layer's weights
(`cp.async.bulk.prefetch.L2`: one instruction per chunk, handed to the SM's bulk-copy engine, no
registers or shared memory held). The small kernels run beside it on the main stream, and the next
GEMV finds its first rows in L2. Prefetching a GEMM's weights into L2 while the kernel ahead of it
runs is the idea of CUTLASS's Hopper example "GEMM with L2 weight prefetch", which does it inside the
GEMM before its programmatic-launch wait; here the window spans every kernel between two GEMVs.

Only during CUDA-graph capture (the decode rounds): there the fork and the join are graph edges that
cost nothing at replay, and eager calls (prefill, warm-up) are untouched. `join` must run before the
capture ends (`engine.cuda_graphs.capture_graph` calls it). Which linear follows which is set once
per model by `link` (the order the decode round calls them); each fork prefetches at most
`NINFER_L2_PREFETCH_MB` MB (0 turns the feature off), the same leading fraction of each of the next
layer's tensors (weights and their scales, so the first rows of both are resident).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

DEFAULT_MAX_MB = 24.0        # below half of the H200's 60 MB L2: the next GEMV's first wave reads it first

_streams: dict[int, torch.cuda.Stream] = {}
_forked: dict[int, bool] = {}
_max_bytes: list[int] = []


def max_bytes() -> int:
    """The cap per fork, from NINFER_L2_PREFETCH_MB (read once per process)."""
    if not _max_bytes:
        mb = float(os.environ.get("NINFER_L2_PREFETCH_MB", DEFAULT_MAX_MB))
        _max_bytes.append(int(mb * 2 ** 20) // 16 * 16)
    return _max_bytes[0]


def supported(device: torch.device) -> bool:
    """sm_90+ (the bulk prefetch instruction), not under the Triton interpreter."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def prefix_bytes(sizes: Sequence[int], limit: int) -> list[int]:
    """Bytes to prefetch from the start of each tensor: all of them if they fit in `limit`, else the
    same fraction of each, rounded down to 16 bytes."""
    total = sum(sizes)
    if total <= limit:
        return [s // 16 * 16 for s in sizes]
    return [int(s * limit / total) // 16 * 16 for s in sizes]


def prefetch(tensors: Sequence[torch.Tensor], limit: int) -> None:
    """Fork the current stream and prefetch the leading bytes of `tensors` (on one CUDA device)."""
    device = tensors[0].device
    idx = device.index if device.index is not None else torch.cuda.current_device()
    side = _streams.get(idx)
    if side is None:
        side = _streams[idx] = torch.cuda.Stream(device)
    from engine.kernels.l2_prefetch_kernel import prefetch_bytes
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for t, n in zip(tensors, prefix_bytes([t.numel() * t.element_size() for t in tensors], limit)):
            if n and t.data_ptr() % 16 == 0:
                prefetch_bytes(t.data_ptr(), n)
    _forked[idx] = True


def join(device: torch.device | None = None) -> None:
    """Make the current stream wait for every prefetch forked since the last join (capture needs it)."""
    idx = torch.cuda.current_device() if device is None or device.index is None else device.index
    if _forked.pop(idx, False):
        torch.cuda.current_stream(idx).wait_stream(_streams[idx])


def link(order: Sequence[torch.nn.Module]) -> None:
    """Give each module in `order` (the linear layers in the order a decode round calls them) the
    tensors of the one after it to prefetch. A module keeps its first successor if it appears twice."""
    for module, successor in zip(order, order[1:]):
        if getattr(module, "prefetch_next", None) is None and successor is not module:
            module.prefetch_next = list(successor.parameters(recurse=False))


def after_gemv(module: torch.nn.Module, x: torch.Tensor) -> None:
    """Called by a linear layer right after it enqueued its matmul on x."""
    nxt = getattr(module, "prefetch_next", None)
    if not nxt or not x.is_cuda or not torch.cuda.is_current_stream_capturing():
        return
    limit = max_bytes()
    if limit > 0 and supported(x.device):
        prefetch(nxt, limit)
