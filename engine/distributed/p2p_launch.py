"""Launching the one-shot P2P kernels with little host time (engine.distributed.cuda_communicator, engine.distributed.fused_allreduce).

CuPy's generic kernel call converts every argument on every launch (a 160-byte struct by value
among them). In eager tensor-parallel runs each rank's thread launches ~74 all-reduces per forward,
the two threads share the GIL, and the P2P call measured ~87 µs of host time per call on 2 x H200
(bench/results/2026-11-30-h200-tp2). `RankLaunch` packs one rank's kernel parameters once (the
struct as bytes, ctypes slots for the per-call pointers and sizes), updates the slots in place per
call and hands the parameter array to `cupy.cuda.driver.launchKernel` (cuLaunchKernel). The
driver copies the parameters at launch (also into a graph node during capture), so the slots are
free for the next call as soon as the launch returns; one rank makes one call at a time.
"""

from __future__ import annotations

import ctypes


class RankLaunch:
    def __init__(self, driver, rank_args: bytes):
        self._driver = driver
        self.args = ctypes.create_string_buffer(rank_args, len(rank_args))
        self._ptrs = [ctypes.c_uint64() for _ in range(5)]
        self._ints = [ctypes.c_int32() for _ in range(3)]
        self._eps = ctypes.c_float()
        at = ctypes.addressof
        # ninfer_ar_*(RankArgs a, void* x, int units)
        self._plain = (ctypes.c_void_p * 3)(at(self.args), at(self._ptrs[0]), at(self._ints[0]))
        # ninfer_ar_add_norm_*(RankArgs a, x, residual, weight, out, residual_out, int rows,
        #                      int row_units, float eps, int zero_centred)
        self._add_norm = (ctypes.c_void_p * 10)(at(self.args), *(at(p) for p in self._ptrs), at(self._ints[0]),
                                                at(self._ints[1]), at(self._eps), at(self._ints[2]))

    def all_reduce(self, function: int, blocks: int, threads: int, stream: int, x: int, units: int) -> None:
        self._ptrs[0].value = x
        self._ints[0].value = units
        self._driver.launchKernel(function, blocks, 1, 1, threads, 1, 1, 0, stream,
                                  ctypes.addressof(self._plain), 0)

    def add_norm(self, function: int, blocks: int, threads: int, stream: int, pointers: tuple[int, ...],
                 rows: int, row_units: int, eps: float, zero_centred: bool) -> None:
        for slot, p in zip(self._ptrs, pointers):      # x, residual, weight, out, residual_out
            slot.value = p
        self._ints[0].value, self._ints[1].value, self._ints[2].value = rows, row_units, int(zero_centred)
        self._eps.value = eps
        self._driver.launchKernel(function, blocks, 1, 1, threads, 1, 1, 0, stream,
                                  ctypes.addressof(self._add_norm), 0)
