"""What split-K kernels share on a device: an fp32 workspace for partial outputs, arrival counters, and the
SM count that sizes their splits.

The last program of an output block to arrive (an atomic counter) sums the partials in split order and
re-arms its counter, so the counters are zero between launches and a CUDA graph replays right. The
tensors are made once per device, on the first call: the engine's warm-up runs every round eagerly before
it captures one, so they never come from a capture's memory pool. Users: the GEMV (gemv.py) and the
bf16 skinny GEMM (skinny_dense.py).
"""

from __future__ import annotations

import torch

WORKSPACE_FLOATS = 1 << 20      # SPLIT * M * N fp32 partials at most (4 MiB)
COUNTERS = 1 << 16              # output blocks at most
_WORK: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_SMS: dict[int, int] = {}


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [WORKSPACE_FLOATS], int32 counters [COUNTERS]) of this device."""
    key = (device.type, device.index)
    if key not in _WORK:
        # zeroed once; every launch that counts re-arms its counters, so they stay zero between launches
        _WORK[key] = (torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                      torch.zeros(COUNTERS, dtype=torch.int32, device=device))
    return _WORK[key]


def num_sms(device: torch.device) -> int:
    """The SMs a split is sized for; 4 under Triton's interpreter (tests on a CPU), so splits happen there."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]
