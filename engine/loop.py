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

asyncio callers (the grpc.aio servers) use the `*_async` twins and `await stream.next_async()`:
nothing blocks their event loop. The engine thread wakes each event loop once per step for all of
that loop's streams that got an output (one `call_soon_threadsafe`, not one per stream).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

import structlog

from engine.cache import kv_landing
from engine.cache.kv_leases import KVLease
from engine.core import EngineCore, RequestOutput
from engine.errors import EngineDeadError, QueueTimeoutError, RequestNotFoundError
from engine.engine_info import EngineInfo, WarmupReport
from engine.sampling_params import SamplingParams
from engine.request_stats import FinishReason
from engine.worker.kv_regions import KVPoolLayout, kv_pool_layout

log = structlog.get_logger(__name__)
IDLE_TICK_S = 0.02            # how often an idle loop with queued or parked requests checks timeouts


class RequestStream:
    """Outputs of one request, in order. Iterating blocks. With n sequences, outputs carry their
    `index` and each sequence's last has `finished` set; the stream ends after n of those."""

    def __init__(self, request_id: str, loop: "EngineLoop", n: int = 1):
        self.request_id = request_id
        self.n = n
        self._loop = loop
        self._outputs: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self._unfinished = n
        self.finished = False
        self.attached = False                            # resumed (a decode attached to it)
        self.seed = 0                                    # the request's seed (the caller's or a drawn one)
        self._waiter: asyncio.Future | None = None       # an asyncio reader waiting for the next output
        self._waiter_lock = threading.Lock()
        self.delivered_finals = 0         # the loop's count (its thread), apart from the reader's

    def _put(self, item: RequestOutput | BaseException) -> None:
        """On the engine thread: queue an output and wake an asyncio reader waiting for it."""
        self._outputs.put(item)
        with self._waiter_lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop._wake(waiter)

    def next(self, timeout: float | None = None) -> RequestOutput:
        """The next output; raises `queue.Empty` after `timeout`, the engine's error if it died,
        `QueueTimeoutError` if the request timed out in the queue."""
        return self._unwrap(self._outputs.get(timeout=timeout))

    async def next_async(self) -> RequestOutput:
        """`next()` for an asyncio caller: waits without blocking the event loop (cancel it freely)."""
        while True:
            try:
                return self._unwrap(self._outputs.get_nowait())
            except queue.Empty:
                pass
            waiter = asyncio.get_running_loop().create_future()
            with self._waiter_lock:
                if not self._outputs.empty():       # an output came in between: no wait
                    continue
                self._waiter = waiter
            try:
                await waiter
            finally:
                with self._waiter_lock:
                    if self._waiter is waiter:
                        self._waiter = None

    def _unwrap(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self._unfinished -= 1
            self.finished = self._unfinished == 0
            if item.finish_reason is FinishReason.QUEUE_TIMEOUT:       # the request never started: all n end so
                self.finished = True
                config = self._loop.core.config
                if self.attached:             # prefilled and attached: it waited for a decode seat
                    raise QueueTimeoutError(f"no decode seat within seat_timeout_seconds="
                                            f"{config.seat_timeout_seconds:g} (the decode batch stayed full)")
                raise QueueTimeoutError(f"request waited longer than pending_timeout_ms={config.pending_timeout_ms}")
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.next()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.next_async()

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
        self._wakes: list[asyncio.Future] = []            # asyncio readers to wake after this step (engine thread)

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
        future = self.core.grammar_future(params)
        grammar = future.result() if future is not None else None
        return self._call(self._add(prompt, params, request_id, park_after_prefill, grammar=grammar, arrival=arrival))

    async def submit_async(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                           park_after_prefill: bool = False,
                           output_token_ids: list[int] | None = None) -> RequestStream:
        """`submit` for an asyncio caller; a caller cancelled while the request is being admitted leaves
        nothing behind (the request is aborted once admitted). `output_token_ids`: a resumed stream
        (EngineCore.add_request). A grammar compiles on the compiler's threads, awaited here: neither
        the event loop nor the engine thread waits for it."""
        arrival = self.clock()
        future = self.core.grammar_future(params)
        grammar = await asyncio.wrap_future(future) if future is not None else None
        return await self._call_async(self._add(prompt, params, request_id, park_after_prefill, output_token_ids,
                                                grammar, arrival),
                                      orphaned=lambda stream: self.abort(stream.request_id))

    def _add(self, prompt, params: SamplingParams, request_id: str | None, park_after_prefill: bool,
             output_token_ids: list[int] | None = None, grammar=None,
             arrival: float | None = None) -> Callable[[], RequestStream]:
        arrival = self.clock() if arrival is None else arrival

        def add() -> RequestStream:
            req = self.core.add_request(prompt, params, request_id, park_after_prefill, arrival,
                                        output_token_ids=output_token_ids, grammar=grammar)
            stream = self._streams[req.request_id] = RequestStream(req.request_id, self, params.n)
            stream.seed = req.seed
            return stream
        return add

    def embed(self, prompt: str | list[int], request_id: str | None = None) -> RequestStream:
        """An embedding request (embedding checkpoints only; UnsupportedError at once otherwise): its
        stream's final output carries `embedding`."""
        self.core.check_embedding()
        return self._call(self._embed(prompt, request_id))

    async def embed_async(self, prompt: str | list[int], request_id: str | None = None) -> RequestStream:
        """`embed` for an asyncio caller (a caller cancelled while it is admitted aborts it)."""
        self.core.check_embedding()
        return await self._call_async(self._embed(prompt, request_id),
                                      orphaned=lambda stream: self.abort(stream.request_id))

    def _embed(self, prompt: str | list[int], request_id: str | None) -> Callable[[], RequestStream]:
        arrival = self.clock()

        def add() -> RequestStream:
            req = self.core.add_embedding(prompt, request_id, arrival)
            stream = self._streams[req.request_id] = RequestStream(req.request_id, self)
            return stream
        return add

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request wherever it is; its stream gets a final output. Unknown ids are ignored."""
        def do() -> None:
            try:
                for out in self.core.abort_all(request_id, reason):
                    self._deliver(out)
            except RequestNotFoundError:
                pass
        self._commands.put((do, None))

    def resume(self, request_id: str) -> RequestStream:
        """Attach to a parked (prefilled) request: it joins the decode batch; returns its stream."""
        return self.resume_all([request_id])[0]

    def resume_all(self, request_ids: list[str]) -> list[RequestStream]:
        """Attach several parked requests in one command: they join the decode batch in the same step."""
        return self._call(self._resume(request_ids))

    async def resume_async(self, request_id: str) -> RequestStream:
        """`resume` for an asyncio caller; a caller cancelled while attaching aborts the request."""
        return (await self._call_async(self._resume([request_id]),
                                       orphaned=lambda streams: self.abort(request_id)))[0]

    def _resume(self, request_ids: list[str]) -> Callable[[], list[RequestStream]]:
        def do() -> list[RequestStream]:
            for rid in request_ids:
                self.core.resume(rid)
                self._streams[rid].attached = True
            return [self._streams[rid] for rid in request_ids]
        return do

    @property
    def tokenizer(self):
        """The model's tokenizer (`engine.tokenizer.Tokenizer`; safe to use from any thread)."""
        return self.core.tokenizer

    def release(self, request_id: str) -> None:
        """Drop a split request no decode attached to (parked, or still on its way to park) and its KV,
        before the next step; NOT_FOUND when there is none (unknown, attached, expired or finished)."""
        self._call(self._release(request_id))

    async def release_async(self, request_id: str) -> None:
        await self._call_async(self._release(request_id))

    def _release(self, request_id: str) -> Callable[[], None]:
        def do() -> None:
            if not self.core.is_unclaimed(request_id):
                raise RequestNotFoundError(f"no prefilled handle {request_id!r} (unknown, attached, expired or finished)")
            for out in self.core.abort_all(request_id, FinishReason.ABORT):
                self._deliver(out)
        return do

    # -- KV lent across engines (prefill/decode disaggregation; engine.cache.kv_landing) ----------

    def kv_pool_layout(self) -> KVPoolLayout:
        """Where the KV pool's blocks sit, with the state slots' and hidden rows' pools (one rank: a producer
        or consumer runs tensor_parallel_size 1)."""
        def do() -> KVPoolLayout:
            runner = self.core.executor.driver
            states = [t for s in runner.states.layers for t in (s.conv, s.ssm)] if runner.states is not None else []
            hidden = runner.hidden.states if runner.hidden is not None else None
            return kv_pool_layout(runner.kv, states, hidden)
        return self._call(do)

    def kv_lease_region(self) -> tuple[int, int]:
        """(address, bytes) of a producer's lease table (engine.cache.kv_leases), to register for READs."""
        leases = self.core.kv_leases
        if leases is None:
            raise RuntimeError("only a producer (kv_role producer) keeps KV leases")
        return leases.region

    async def lent_async(self, request_id: str) -> tuple[kv_landing.Lent, int, KVLease | None]:
        """What a parked request lends a consumer, its hidden-state row (-1 without MTP) and the lease it is
        all lent under (opened in the same engine command, so that it ends no earlier than the blocks, slot
        and row are freed; None when no lease word is free). NOT_FOUND when it is not parked (any more)."""
        return await self._call_async(lambda: self.core.lent(request_id))

    async def reserve_landing_async(self, request_id: str, token_ids: list[int], num_blocks: int,
                                    whole: bool = False) -> kv_landing.KVLanding | None:
        """Room for KV pulled from a producer (whole: and for its state slot and hidden row), or None when
        the engine has no room now."""
        return await self._call_async(lambda: self.core.reserve_landing(request_id, token_ids, num_blocks, whole),
                                      orphaned=lambda landing: landing and self.drop_landing(landing))

    def drop_landing(self, landing: kv_landing.KVLanding) -> None:
        """A pull that failed or was abandoned: what it held goes back (from any thread, before the next step)."""
        self._commands.put((lambda: self.core.drop_landing(landing), None))

    async def submit_landed_async(self, landing: kv_landing.KVLanding, prompt: list[int], params: SamplingParams,
                                  request_id: str | None, first_token_id: int | None = None) -> RequestStream:
        """Admit a request over KV that landed. Whole (`first_token_id` given): the request takes the landed
        blocks, state and hidden row and decodes from them (nothing recomputed; its stream starts with the
        producer's first token). Otherwise the blocks join the prefix cache and the request, admitted in the
        same command, takes them as a prefix hit (it recomputes only the rest of the prompt). A request
        refused at admission leaves the landing's room released."""
        if landing.whole:
            arrival = self.clock()
            future = self.core.grammar_future(params)
            grammar = await asyncio.wrap_future(future) if future is not None else None

            def do() -> RequestStream:
                try:
                    req, outputs = self.core.add_pulled(landing, prompt, params, first_token_id, request_id,
                                                        arrival, grammar)
                except BaseException:
                    self.core.drop_landing(landing)
                    raise
                stream = self._streams[req.request_id] = RequestStream(req.request_id, self, params.n)
                stream.seed = req.seed
                for out in outputs:
                    self._deliver(out)
                return stream
            return await self._call_async(do, orphaned=lambda stream: self.abort(stream.request_id))
        add = self._add(prompt, params, request_id, False)

        def do() -> RequestStream:
            kv_landing.land(self.core.kv, landing)
            return add()
        return await self._call_async(do, orphaned=lambda stream: self.abort(stream.request_id))

    def warmup(self) -> WarmupReport:
        """Compile every kernel a request takes and capture the CUDA graphs (see `EngineCore.warmup`)."""
        return self._call(self.core.warmup)

    def info(self) -> EngineInfo:
        return self._call(self.core.info)

    def metrics(self) -> dict[str, Any]:
        """The metrics snapshot: history / last / performance, KV (block reference counters too), queue."""
        return self._call(self.core.snapshot)

    async def metrics_async(self) -> dict[str, Any]:
        return await self._call_async(self.core.snapshot)

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
        return self._post(fn).result()

    async def _call_async(self, fn: Callable[[], Any], orphaned: Callable[[Any], None] | None = None) -> Any:
        """Run `fn` on the engine thread. Cancelled before it runs: it never runs. Cancelled while it
        runs: `orphaned(result)` is called with what it returned (the caller will not see it)."""
        done = self._post(fn)
        try:
            return await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            if orphaned is not None:
                def settle(f: Future) -> None:
                    if not f.cancelled() and f.exception() is None:
                        orphaned(f.result())
                done.add_done_callback(settle)
            raise

    def _post(self, fn: Callable[[], Any]) -> Future:
        if not self.alive:
            raise EngineDeadError(f"the engine loop is not running ({self.dead or 'stopped'})")
        done: Future = Future()
        self._commands.put((fn, done))
        return done

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
                self._flush_wakes()
        except BaseException as e:  # noqa: BLE001 - the engine is dead; every stream learns why
            log.exception("engine_loop_died")
            self.dead = e
            for stream in list(self._streams.values()):
                stream._put(EngineDeadError(f"engine stopped: {e!r}"))
            self._streams.clear()
            self._flush_wakes()
            self._fail_pending_commands(e)

    def _wake(self, waiter: asyncio.Future) -> None:
        """Engine thread: wake this asyncio reader once the step's outputs are all queued."""
        self._wakes.append(waiter)

    def _flush_wakes(self) -> None:
        """One call_soon_threadsafe per event loop for every reader that got an output this step."""
        if not self._wakes:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
        for waiter in self._wakes:
            by_loop.setdefault(waiter.get_loop(), []).append(waiter)
        self._wakes = []
        for event_loop, waiters in by_loop.items():
            try:
                event_loop.call_soon_threadsafe(_resolve_all, waiters)
            except RuntimeError:             # that loop is closed: no reader is left on it
                pass

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
            if done is not None and not done.set_running_or_notify_cancel():
                item = self._next_command()        # its caller gave up before it ran: it never happens
                if item is None:
                    return
                continue
            try:
                result = fn()
                if done is not None:
                    done.set_result(result)
            except Exception as e:  # noqa: BLE001 - a caller's error goes back to that caller
                if done is None:
                    raise
                done.set_exception(e)
            item = self._next_command()
            if item is None:
                return

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _deliver(self, out: RequestOutput) -> None:
        if out.finish_reason is FinishReason.LEASE_EXPIRED:        # a handle no decode came for
            log.warning("lease_expired", request_id=out.request_id,
                        lease_seconds=self.core.config.lease_seconds)
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        stream._put(out)
        if out.finished:
            stream.delivered_finals += 1
            if stream.delivered_finals == stream.n:
                del self._streams[out.request_id]

    def _fail_pending_commands(self, error: BaseException) -> None:
        while True:
            try:
                _, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if done is not None and done.set_running_or_notify_cancel():
                done.set_exception(EngineDeadError(f"engine stopped: {error!r}"))


def _resolve_all(waiters: list[asyncio.Future]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
