"""The engine loop: one thread owns the `EngineCore` and steps it; other threads talk to it through
the typed front door below and read per-request streams. Services and tools use this and nothing
behind it: every method runs its work on the engine thread, between steps.

    loop = EngineLoop(EngineCore(config)).start()
    loop.warmup()                                              # before serving: graphs captured
    stream = loop.submit(prompt_ids, SamplingParams(...))      # validated at once, then queued
    for out in stream: ...                                     # RequestOutput deltas, last one finished
    loop.abort(stream.request_id)                              # from any thread

A prefill/decode split: `submit(..., park_after_prefill=True)`; its first output carries the first
token and the prefill's stats (taken on the engine thread when it parked); later `resume(request_id)`
returns the same stream, now decoding, or `release(request_id)` drops it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import structlog

from engine.core import EngineCore, RequestOutput
from engine.errors import EngineDeadError, QueueTimeoutError, RequestNotFoundError
from engine.engine_info import EngineInfo, WarmupReport
from engine.sampling_params import SamplingParams
from engine.request_stats import FinishReason

log = structlog.get_logger(__name__)
IDLE_TICK_S = 0.02            # how often an idle loop with queued or parked requests checks timeouts


class RequestStream:
    """Outputs of one request, in order. Iterating blocks; the final output has `finished` set."""

    def __init__(self, request_id: str, loop: "EngineLoop"):
        self.request_id = request_id
        self._loop = loop
        self._outputs: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._outputs.put(item)

    def next(self, timeout: float | None = None) -> RequestOutput:
        """The next output; raises `queue.Empty` after `timeout`, the engine's error if it died,
        `QueueTimeoutError` if the request timed out in the queue."""
        item = self._outputs.get(timeout=timeout)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.finish_reason is FinishReason.QUEUE_TIMEOUT:
                raise QueueTimeoutError(
                    f"request waited longer than pending_timeout_ms={self._loop.core.config.pending_timeout_ms}")
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.next()

    def abort(self) -> None:
        self._loop.abort(self.request_id)


class EngineLoop:
    def __init__(self, core: EngineCore, clock: Callable[[], float] = time.monotonic):
        self.core = core
        self.clock = clock
        # (work, future of its result or None): run on the engine thread between steps
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future | None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self.steps = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; once it is out of its step, free the model, KV and graphs on every rank."""
        self._stop.set()
        self._commands.put((lambda: None, None))
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.core.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    # -- commands (any thread) ------------------------------------------------------------------

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
               park_after_prefill: bool = False) -> RequestStream:
        """Admit a request; raises the engine's validation and queue errors synchronously. A request for
        structured output waits for its grammar's compile here, on the caller's thread: the engine thread
        keeps stepping the other streams meanwhile."""
        arrival = self.clock()
        grammar = self.core.compile_grammar(params)

        def add() -> RequestStream:
            req = self.core.add_request(prompt, params, request_id, park_after_prefill, arrival, grammar=grammar)
            stream = self._streams[req.request_id] = RequestStream(req.request_id, self)
            return stream
        return self._call(add)

    def embed(self, prompt: str | list[int], request_id: str | None = None) -> RequestStream:
        """An embedding request (embedding checkpoints only; UnsupportedError at once otherwise): its
        stream's final output carries `embedding`."""
        self.core.check_embedding()
        arrival = self.clock()

        def add() -> RequestStream:
            req = self.core.add_embedding(prompt, request_id, arrival)
            stream = self._streams[req.request_id] = RequestStream(req.request_id, self)
            return stream
        return self._call(add)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request wherever it is; its stream gets a final output. Unknown ids are ignored."""
        def do() -> None:
            try:
                self._deliver(self.core.abort(request_id, reason))
            except RequestNotFoundError:
                pass
        self._commands.put((do, None))

    def resume(self, request_id: str) -> RequestStream:
        """Attach to a parked (prefilled) request: it joins the decode batch; returns its stream."""
        return self.resume_all([request_id])[0]

    def resume_all(self, request_ids: list[str]) -> list[RequestStream]:
        """Attach several parked requests in one command: they join the decode batch in the same step."""
        def do() -> list[RequestStream]:
            for rid in request_ids:
                self.core.resume(rid)
            return [self._streams[rid] for rid in request_ids]
        return self._call(do)

    @property
    def tokenizer(self):
        """The model's tokenizer (`engine.tokenizer.Tokenizer`; safe to use from any thread)."""
        return self.core.tokenizer

    def release(self, request_id: str) -> None:
        """Drop a split request no decode attached to (parked, or still on its way to park) and its KV,
        before the next step; NOT_FOUND when there is none (unknown, attached, expired or finished)."""
        def do() -> None:
            if not self.core.scheduler.is_unclaimed(request_id):
                raise RequestNotFoundError(f"no prefilled handle {request_id!r} (unknown, attached, expired or finished)")
            self._deliver(self.core.abort(request_id, FinishReason.ABORT))
        self._call(do)

    def warmup(self) -> WarmupReport:
        """Compile every kernel a request takes and capture the CUDA graphs (see `EngineCore.warmup`)."""
        return self._call(self.core.warmup)

    def info(self) -> EngineInfo:
        return self._call(self.core.info)

    def metrics(self) -> dict[str, Any]:
        """The metrics snapshot: history / last / performance, KV (block reference counters too), queue."""
        return self._call(self.core.snapshot)

    def num_unfinished(self) -> int:
        """Requests admitted and not finished (queued, prefilling, parked or decoding)."""
        return self._call(lambda: self.core.scheduler.num_unfinished)

    def add_kv_listener(self, listener) -> None:
        """From now on the KV manager tells `listener` (`engine.cache.block_manager.KVEventListener`, called on the
        engine thread) about blocks that become reusable and blocks evicted (the router's KV events)."""
        self._call(lambda: self.core.kv.listeners.append(listener))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (requests in flight keep theirs; evictions are announced)."""
        self._call(self.core.kv.reset_prefix_cache)

    def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run `fn(core)` on the engine thread between steps: for tests and diagnostics only; the
        services use the typed methods above."""
        return self._call(lambda: fn(self.core))

    def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.alive:
            raise EngineDeadError(f"the engine loop is not running ({self.dead or 'stopped'})")
        done: Future = Future()
        self._commands.put((fn, done))
        return done.result()

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # block for commands when there is nothing to do, or when the last step could not run
                # anything (e.g. the queue waits for KV held by parked requests): no busy spin
                self._drain(block=not self.core.has_work or self.core.last_step_idle)
                if self.core.has_work:
                    for out in self.core.step():
                        self._deliver(out)
                    self.steps += 1
        except BaseException as e:  # noqa: BLE001 - the engine is dead; every stream learns why
            log.exception("engine_loop_died")
            self.dead = e
            for stream in list(self._streams.values()):
                stream._put(EngineDeadError(f"engine stopped: {e!r}"))
            self._streams.clear()
            self._fail_pending_commands(e)

    def _drain(self, block: bool) -> None:
        timeout = IDLE_TICK_S if self.core.scheduler.has_timeouts else 0.5
        try:
            item = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            if block:
                for out in self.core.expire():
                    self._deliver(out)
            return
        while True:
            fn, done = item
            try:
                result = fn()
                if done is not None:
                    done.set_result(result)
            except Exception as e:  # noqa: BLE001 - a caller's error goes back to that caller
                if done is None:
                    raise
                done.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, out: RequestOutput) -> None:
        if out.finish_reason is FinishReason.LEASE_EXPIRED:        # a handle no decode came for
            log.warning("lease_expired", request_id=out.request_id,
                        lease_seconds=self.core.config.lease_seconds)
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        stream._put(out)
        if out.finished:
            del self._streams[out.request_id]

    def _fail_pending_commands(self, error: BaseException) -> None:
        while True:
            try:
                _, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if done is not None:
                done.set_exception(EngineDeadError(f"engine stopped: {error!r}"))
