"""The push variant of the one-shot all-reduce for decode-size messages (16-bit dtypes): data as flags.

The pull protocol (engine.distributed.cuda_communicator) stages x locally, fences system-wide, stores a flag in
every peer, waits for the peers' flags and reads their stages over NVLink: a fence and two link
crossings before the sum. Here each rank stores its x straight into every peer's receive buffer,
and a receiver knows a word has arrived when it no longer holds the sentinel -- the idea of NCCL's
LL protocol and of TensorRT-LLM's Lamport all-reduce, written anew here. One crossing, no fence, no
flag.

  receive buffers per rank:  recv[3][MAX_RANKS][cap]  (bytes), all words the sentinel when idle
  sentinel:                  0x80008000 per 32-bit lane: two 16-bit -0.0; senders write -0.0 as
                             +0.0, so a sent lane never equals it (the sum is the same number)
  state per rank:            {u64 count of finished push calls, u32 blocks done, u32 last units}

  Call p on rank r (p = count + 1, read on the device so a CUDA graph replays it; b = p % 3):
  1. every word i of x goes to recv_q[b][r][i] of each peer q (16-byte volatile stores over
     NVLink); the thread keeps it
     (with -0.0 made +0.0 as sent, so that every rank sums the same numbers: equal bits on all);
  2. the thread polls recv_r[b][q][i] of each peer q until no 32-bit lane is the sentinel;
  3. sums the ranks in rank order in fp32 and rounds as the pull kernels do (same numbers, same
     order: the same bits as the pull protocol, bar the sign of a zero sum);
  4. resets to the sentinel the words of buffer (p - 1) % 3 that call p - 1 used (its size is in
     the state), so that every buffer is clean again before any peer can write it: a peer writes
     buffer (p - 1) % 3 again at call p + 2, which needs this rank's data of call p + 1, which this
     rank sends only after call p has finished (calls are ordered on its stream);
  5. the last block to finish publishes count = p and the call's size.
The push and pull protocols keep separate buffers and counters, so calls of the two may interleave
as long as every rank makes the same calls in the same order (the engine's layers do).

A thread keeps its own words in registers between steps 1 and 3, so the fused kernel takes rows
of at most 1024 words (16 KB: hidden 8192 in bf16); the plain kernel rereads x (each word belongs
to one thread, which reads it before it writes the sum).
"""

from __future__ import annotations

from engine.kernels.cuda_source import read_cuda_source

PUSH_MAX_ROW_UNITS = 1024
SENTINEL_WORD = 0x80008000

PUSH_SOURCE = read_cuda_source(__file__, "push_allreduce.cu")

PUSH_KERNEL_NAMES = {("push", kind): f"ninfer_push_ar_{kind}" for kind in ("bf16", "f16")}
PUSH_KERNEL_NAMES.update({("push_add_norm", kind): f"ninfer_push_ar_add_norm_{kind}" for kind in ("bf16", "f16")})


def recv_bytes(cap: int, max_ranks: int) -> int:
    """A rank's receive area: three buffers of one `cap`-byte slot per rank."""
    return 3 * max_ranks * cap
