"""CUDA graphs of the decode round, one per (batch bucket, context class, sampling variant) -- and per
round length (0 .. k drafts) with an adaptive draft length -- captured at warm-up.

A replay costs three host-to-device copies (packed inputs from pinned staging buffers), one
graph launch and the one device-to-host read of the tokens. Variants exist because the sampling
code differs in shape of work, not in values: all-greedy rounds skip probabilities entirely, and
only rounds with a top-k/top-p row sort the vocabulary. Context classes exist because the
attention kernel sizes its split along the keys from an upper bound of the context: a round whose
longest sequence is short replays a graph planned for short sequences.

Structured output: without drafts (k = 0) a round whose batch has a request under a grammar replays a
"constrained" twin of its variant's graph, which masks the sampled logits by the persistent
`RoundSetup.token_masks` buffer (filled on the host and copied in before the replay). With drafts, the
masks of verify positions past the first depend on the drafts of the round itself: such a round runs
eagerly (engine.worker.model_runner.graphed; docs/structured-output.md).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import structlog
import torch

from engine.worker.decode_round import (FLOAT_ROWS, ROWS, RoundInputs, RoundOutput, RoundSetup, pack_round,
                                        round_drafts, run_round)
from engine.worker.sampler import SamplingVariant

log = structlog.get_logger(__name__)

# Every sampling variant a round may need, each captured: greedy, sampled, sampled with filters, and
# each of those with logit options (penalties, bias, bad words, min_tokens) and with logprobs.
VARIANTS = tuple(SamplingVariant(greedy, filt, opts, lp) for lp in (False, True) for opts in (False, True)
                 for greedy, filt in ((True, False), (False, False), (False, True)))
# upper bounds of a round's longest context (positions, drafts included); the last is the limit
CONTEXT_CLASSES = (2048, 16384)


def default_buckets(max_batch: int) -> list[int]:
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch]


class _Captured:
    def __init__(self, batch: int, setup: RoundSetup):
        k, dev = setup.k, setup.device
        self.batch = batch
        self.setup = setup
        pin = dict(pin_memory=True)
        # Two sets of pinned staging arrays, used in turn: with async scheduling the host packs the
        # next round while this one's copies may still wait in the stream behind the round before.
        self._staging = [(torch.zeros(ROWS * batch + batch * (k + 1), dtype=torch.int64, **pin).numpy(),
                          torch.zeros(FLOAT_ROWS * batch, dtype=torch.float32, **pin).numpy(),
                          torch.zeros(batch, setup.max_blocks, dtype=torch.int32, **pin).numpy())
                         for _ in range(2)]
        self._copied: list[list[torch.cuda.Event]] = [[], []]    # each set's last uploads (every rank's)
        self._turn = 0
        self.device = tuple(torch.from_numpy(h).to(dev) for h in self.host)
        self.inputs = RoundInputs.from_packed(*self.device, k=k)
        # (context class, variant, draft steps) -> (graph, its outputs)
        self.graphs: dict[tuple[int, SamplingVariant, int], tuple[torch.cuda.CUDAGraph, RoundOutput]] = {}

    @property
    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The staging arrays of the current turn."""
        return self._staging[self._turn]

    def pack(self, works) -> None:
        """Pack into the next turn's staging arrays, once the copies that last read them are done."""
        self._turn ^= 1
        for copied in self._copied[self._turn]:
            copied.synchronize()
        self._copied[self._turn] = []
        pack_round(self.setup, works, self.batch, self.setup.max_blocks, out=self.host)

    def upload(self, host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """Copy packed inputs (this bucket's own staging arrays, or another rank's) to the device."""
        for dst, src in zip(self.device, host or self.host):
            dst.copy_(torch.from_numpy(src), non_blocking=True)
        if host is None or host is self.host:
            self.note_copy(torch.cuda.current_stream().record_event())

    def note_copy(self, event: torch.cuda.Event) -> None:
        """A copy out of this turn's staging arrays (another rank's upload): the next pack into them waits for it."""
        self._copied[self._turn].append(event)


def capture_graph(graph: torch.cuda.CUDAGraph, fn, pool=None, mode: str = "global",
                  stream: torch.cuda.Stream | None = None):
    """Capture fn() into `graph` on `stream` (a fresh one by default) and return its result.

    Unlike `torch.cuda.graph` this neither synchronizes nor empties the allocator's cache on entry:
    emptying it frees cached blocks on every device, and a cudaFree on a device whose all-reduce
    kernel is waiting for this very rank never returns (seen as a deadlock on two H200s)."""
    with torch.cuda.stream(stream or torch.cuda.Stream()):
        graph.capture_begin(pool=pool, capture_error_mode=mode)
        try:
            return fn()
        finally:
            graph.capture_end()


class GraphedRounds:
    def __init__(self, setup: RoundSetup, buckets: list[int], thread_local: bool = False):
        self.setup = setup
        self.buckets = sorted(buckets)
        # ranks of one process capture at once, each on its own thread
        self.capture_mode = "thread_local" if thread_local else "global"
        self._by_batch: dict[int, _Captured] = {}
        # an adaptive draft length replays a graph per round length: k + 1 times the captures
        self.draft_counts = list(range(setup.k + 1)) if setup.adaptive else [setup.k]
        # structured output: k = 0 rounds of a constrained batch replay a masking twin of each variant
        self.variants = VARIANTS + (tuple(replace(v, constrained=True) for v in VARIANTS)
                                    if setup.k == 0 and setup.token_masks is not None else ())

    def fits(self, n: int) -> bool:
        return n <= self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, class, variant and round length (largest first, one memory pool). -> seconds."""
        start = time.perf_counter()
        setup = self.setup
        self.classes = [c for c in CONTEXT_CLASSES if c < setup.max_seq_len] + [setup.max_seq_len]
        pool = torch.cuda.graph_pool_handle()
        # One side stream for every warm-up and capture: the caching allocator keeps freed blocks per
        # stream (and cuBLAS a workspace per stream), so a fresh stream per capture left the warm-up
        # memory of all 45 captures cached apart -- 11.7 GiB beyond the memory plan at qwen3-8b,
        # batch 16, k = 3 on an H200 (tests/engine/test_engine_gpu.py, automatic capacity).
        side = torch.cuda.Stream()
        for batch in reversed(self.buckets):
            cap = self._by_batch[batch] = _Captured(batch, setup)
            cap.pack([])                                         # all rows padding
            cap.upload()
            for cls, variant, drafts in ((c, v, d) for c in self.classes for v in self.variants
                                         for d in self.draft_counts):
                args = (setup, cap.inputs, cls, variant, drafts)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        run_round(*args)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # the ranks of a TP group capture at the same time, each on its own thread: NCCL
                # may talk to its peers while a collective is captured
                out = capture_graph(graph, lambda a=args: run_round(*a), pool, self.capture_mode, side)
                cap.graphs[(cls, variant, drafts)] = (graph, out)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        log.info("cuda_graphs_captured", buckets=self.buckets, context_classes=self.classes,
                 variants=len(self.variants), seconds=round(seconds, 2))
        return seconds

    def bucket(self, batch: int) -> _Captured:
        """The captured bucket of exactly this batch size (every rank captures the same buckets)."""
        return self._by_batch[batch]

    def bucket_for(self, batch: int) -> int:
        """The batch size of the bucket a round of `batch` requests replays."""
        return next(b for b in self.buckets if b >= batch)

    def select(self, works, variant: SamplingVariant) -> tuple[_Captured, tuple]:
        """The bucket for len(works) and the key of its graph for this round's contexts and sampling."""
        cap = self._by_batch[self.bucket_for(len(works))]
        longest = max(w.max_num_tokens for w in works) + self.setup.k
        cls = next(c for c in self.classes if c >= longest)
        return cap, (cls, variant, round_drafts(self.setup, works))

    @staticmethod
    def launch(cap: _Captured, key: tuple) -> RoundOutput:
        """Replay (inputs uploaded). -> the graph's outputs: tokens [bucket, k+1] (device), ..."""
        graph, out = cap.graphs[key]
        graph.replay()
        return out

    def replay(self, works, variant: SamplingVariant) -> RoundOutput:
        cap, key = self.select(works, variant)
        cap.pack(works)
        cap.upload()
        return self.launch(cap, key)
