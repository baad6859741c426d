"""Runs every step on all tensor-parallel ranks of this process.

With one rank the executor calls its runner directly. With several, each rank's `ModelRunner`
(its model shard, its KV pages and graphs on its own device) lives on its own thread: eager work
(prefill chunks, ungraphed rounds) is handed to every thread, the ranks meet in their collectives,
and rank 0's result is returned (all ranks sample the same tokens from the same gathered logits).
CUDA graphs are captured by every rank's thread at once, with thread-local capture so that ranks
do not disturb each other.

A graphed decode round skips the threads: this thread packs the inputs once, copies them to every
device, replays each rank's graph (one launch per GPU; the ranks meet on the devices) and reads
rank 0's tokens -- one host read per round, no thread hand-offs on the path the GPUs wait for.
With async scheduling (engine.worker.async_rounds) `launch` does the same without the read: the next round is
packed while this one runs, into the other of the two staging sets.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import torch

from engine.config import EngineConfig, ModelConfig
from engine.distributed.tp_group import SINGLE_RANK, LocalCommunicator, TPGroup
from engine.worker.decode_round import sampling_variant
from engine.worker.decode_round import RoundOutput, read_round
from engine.worker.model_runner import ModelRunner, PromptLogits
from engine.sched.scheduler import ModelOutput, SchedulerOutput
from engine.structured.bitmask import words_for
from engine.structured.round_masks import RoundMasks

log = structlog.get_logger(__name__)


# With tp_comm p2p/auto, messages up to the P2P limit take the one-shot peer-to-peer all-reduce:
# at least this much (a 4096-token prefill chunk of hidden 8192 in bf16), more when the gathered
# verify logits of the largest decode bucket are larger, up to P2P_MAX_BYTES_CAP (each rank stages
# twice the limit). Within the limit a decode graph holds no NCCL call.
P2P_MIN_BYTES = 64 << 20
P2P_MAX_BYTES_CAP = 256 << 20


def p2p_limit(config: EngineConfig, model_config: ModelConfig, draft_tokens: int) -> int:
    itemsize = 4 if config.torch_dtype_name == "float32" else 2
    logits = config.max_batch * (draft_tokens + 1) * model_config.vocab_size * itemsize
    return min(P2P_MAX_BYTES_CAP, max(P2P_MIN_BYTES, -(-logits // (1 << 20)) << 20))


def rank_devices(config: EngineConfig) -> list[torch.device]:
    tp = config.tensor_parallel_size
    if config.device == "cpu":
        return [torch.device("cpu")] * tp
    first = torch.device(config.device).index or 0
    if tp > 1 and torch.cuda.device_count() < first + tp:
        from engine.errors import InvalidArgumentError
        raise InvalidArgumentError("tensor_parallel_size",
                                   f"{tp} ranks need cuda:{first}..cuda:{first + tp - 1}, "
                                   f"but {torch.cuda.device_count()} GPUs are visible")
    return [torch.device("cuda", first + r) for r in range(tp)]


def make_groups(config: EngineConfig, devices: list[torch.device], p2p_max_bytes: int) -> list[TPGroup]:
    if len(devices) == 1:
        return [SINGLE_RANK]
    if devices[0].type == "cpu":
        return LocalCommunicator(len(devices)).groups()
    from engine.distributed.cuda_communicator import make_communicator
    kind = config.tp_comm
    options = {} if kind == "nccl" else {"max_bytes": p2p_max_bytes}
    comm = make_communicator(kind, [d.index for d in devices], **options)
    if comm.kind == "nccl" and not config.enforce_eager:
        log.warning("nccl_in_cuda_graphs", requested=kind,
                    detail="a graph of 100 NCCL all-reduces never finished on 2 x H200 "
                           "(bench/results/2026-11-30-h200-tp2); graphs of 8-10 did")
    return comm.groups()


class Executor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights, num_blocks: int,
                 draft_tokens: int, max_model_len: int):
        self.devices = rank_devices(config)
        groups = make_groups(config, self.devices, p2p_limit(config, model_config, draft_tokens))
        self._comm = groups[0].comm                      # closed at shutdown (CUDA: buffers, NCCL)
        # structured output: a step's grammar masks, filled once on the host, copied to every rank
        self.masks = RoundMasks(config.max_batch, draft_tokens, words_for(model_config.vocab_size),
                                pin_memory=self.devices[0].type == "cuda")
        # built one after the other on this thread: construction touches process-wide defaults
        self.runners = [ModelRunner(config, model_config, weights, num_blocks, draft_tokens, max_model_len,
                                    tp=g, device=d, masks=self.masks) for g, d in zip(groups, self.devices)]
        self._workers = [_RankThread(r, d) for r, d in enumerate(self.devices)] if len(self.runners) > 1 else []

    @property
    def num_ranks(self) -> int:
        return len(self.runners)

    @property
    def driver(self) -> ModelRunner:
        """Rank 0: its results are the step's results."""
        return self.runners[0]

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        lockstep = self._lockstep(out)
        if not out.prefills and lockstep:
            for runner in self.runners:
                runner.release_rows(out.finished_request_ids)
            result = ModelOutput()
        else:
            result = self.run_all(lambda runner: runner.execute(out, with_decode=not lockstep))[0]
        if lockstep:
            read_round(out.decode, self._launch_lockstep(out.decode), result)
        return result

    def launch(self, out: SchedulerOutput) -> RoundOutput:
        """Enqueue a decode-only round on every rank without reading it (async scheduling).
        -> rank 0's outputs (its rows :len(out.decode)) on its device."""
        if out.prefills:
            raise RuntimeError("only a decode round is launched without a read")
        for runner in self.runners:
            runner.release_rows(out.finished_request_ids)
        if self._lockstep(out):
            round_out = self._launch_lockstep(out.decode)
        else:                      # eager rounds: each rank's thread enqueues its own (they meet in collectives)
            round_out = self.run_all(lambda runner: runner.launch_decode(out.decode))[0]
        return round_out.rows(len(out.decode))

    def _lockstep(self, out: SchedulerOutput) -> bool:
        return bool(self._workers and out.decode and self.driver.graphed(out.decode))

    @torch.inference_mode()
    def _launch_lockstep(self, works) -> RoundOutput:
        """Pack once, copy rank 0's staging arrays to every rank, replay every rank's graph.
        -> rank 0's outputs (tokens [bucket, drafts+1], ...) on its device, not read."""
        driver = self.driver
        rows, slots = driver.round_setup.pool_rows, driver.options.slots
        for runner in self.runners[1:]:
            # every rank assigns hidden-pool rows and option slots in the same order
            if runner.round_setup.pool_rows != rows or runner.options.slots != slots:
                raise RuntimeError("hidden-pool rows or option slots differ between ranks")
        variant = sampling_variant(works)
        cap, key = driver.graphs.select(works, variant)
        cap.pack(works)              # once every rank's copy out of this turn's staging arrays is done
        caps = [cap] + [runner.graphs.bucket(cap.batch) for runner in self.runners[1:]]
        for runner, mine in zip(self.runners, caps):
            with _on(runner.device):
                mine.upload(cap.host)
                if variant.constrained:
                    runner.upload_masks(cap.batch)
                if mine is not cap and runner.device.type == "cuda":
                    cap.note_copy(torch.cuda.current_stream().record_event())
        # the launches back to back: a rank launched early waits in its first collective for the rest
        # (launching from the rank threads at once measured slower: bench/results/2026-11-30-h200-pdl)
        return [runner.graphs.launch(mine, key) for runner, mine in zip(self.runners, caps)][0]

    def run_all(self, fn: Callable[[ModelRunner], Any]) -> list[Any]:
        """fn(runner) on every rank at once (each on its thread); results in rank order."""
        if not self._workers:
            return [fn(self.runners[0])]
        for worker, runner in zip(self._workers, self.runners):
            worker.submit(lambda r=runner: fn(r))
        outcomes = [worker.outcome() for worker in self._workers]   # every rank's, so none is left queued
        for ok, value in outcomes:
            if not ok:
                raise value
        return [value for _, value in outcomes]

    @contextlib.contextmanager
    def collect_prompt_logits(self, request_id: str) -> Iterator[list[torch.Tensor]]:
        """While open, the request's prefill chunks append their logits [n, vocab] (float32, host) to
        the yielded list. Every rank computes them (the same collectives run everywhere); rank 0's count."""
        collectors = [PromptLogits([]) for _ in self.runners]
        for runner, c in zip(self.runners, collectors):
            runner.prompt_logits[request_id] = c
        try:
            yield collectors[0].chunks
        finally:
            for runner in self.runners:
                runner.prompt_logits.pop(request_id, None)

    def collect_last_hidden(self, request_id: str) -> list[torch.Tensor]:
        """From now on the request's prefill appends its last prompt token's final hidden state [hidden]
        (host) to the returned list (embeddings; every rank computes it, rank 0's is kept)."""
        rows: list[torch.Tensor] = []
        self.driver.last_hidden[request_id] = rows
        return rows

    def stop_collecting(self, request_id: str) -> None:
        self.driver.last_hidden.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop the rank threads and drop the shards (weights, KV, graphs), returning device memory."""
        for w in self._workers:
            w.stop()
        for w in self._workers:
            w.join()
        self._workers = []
        on_cuda = any(d.type == "cuda" for d in self.devices)
        self.runners = []
        if on_cuda:
            import gc
            gc.collect()                                 # the graphs go before the buffers they use
            close = getattr(self._comm, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as e:  # noqa: BLE001 - shutting down: report, free the rest
                    log.warning("communicator_close_failed", error=repr(e))
            torch.cuda.empty_cache()
        self._comm = None


def _on(device: torch.device):
    """The device as current for CUDA work; nothing on the CPU (tests run the lockstep path there)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _RankThread:
    """A thread bound to one device that runs the calls it is given, one at a time."""

    def __init__(self, rank: int, device: torch.device):
        self.device = device
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"ninfer-rank{rank}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> None:
        self._calls.put(fn)

    def outcome(self) -> tuple[bool, Any]:
        """(True, result) or (False, the exception) of the oldest call not yet collected."""
        return self._results.get()

    def stop(self) -> None:
        self._calls.put(None)

    def join(self, timeout: float = 30.0) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while (fn := self._calls.get()) is not None:
            try:
                self._results.put((True, fn()))
            except BaseException as e:  # noqa: BLE001 - re-raised on the engine thread
                self._results.put((False, e))
