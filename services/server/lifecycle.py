"""Health and drain of one gRPC server: NOT_SERVING until warm, SERVING, NOT_SERVING again on drain.

    state = ServingState(service_names, runtime) # registers grpc.health.v1 on a server via `health`
    state.set_serving()                          # after the warm-up
    with state.admit():  ...                     # UNAVAILABLE while not ready or draining; counts in-flight
    state.drain(); state.wait_idle(grace_s)      # SIGTERM: new calls refused, streams in flight finish
    with state.on_cut(cancel_fn): ...            # a call in flight that `cut()` ends (drain timeout)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2

from services.server.errors import RpcAbort
from services.server.event_loop import EventLoopThread

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServingState:
    """Thread-safe: the engine's loader, the gateway's router and a drain call it from their threads,
    the servicers from the server's event loop. The health servicer (grpc's asyncio one) is updated on
    that loop; a caller on another thread waits until it is, so health says what was just set."""

    def __init__(self, service_names: list[str], runtime: EventLoopThread, not_ready_reason: str = "warming up"):
        self.health = health.aio.HealthServicer()
        self._runtime = runtime
        self.service_names = ["", *service_names]        # "" = the server as a whole
        self._cond = threading.Condition()
        self._ready = False
        self._draining = False
        self._in_flight = 0
        self._not_ready_reason = not_ready_reason
        self._cutters: dict[int, Callable[[], None]] = {}
        self._next_cutter = 0
        self.shut_down = False                          # cut(): the drain timeout passed
        self._publish()

    @property
    def serving(self) -> bool:
        return self._ready and not self._draining

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def set_serving(self, ready: bool = True, reason: str = "warming up") -> None:
        """Ready (or not, and why) to take new calls; ignored once draining."""
        with self._cond:
            self._ready, self._not_ready_reason = ready, reason
        self._publish()

    def drain(self) -> None:
        """Refuse new calls from now on (UNAVAILABLE) and report NOT_SERVING."""
        with self._cond:
            self._draining = True
        self._on_loop(self.health.enter_graceful_shutdown)

    def check_admission(self, during_drain: bool = False) -> None:
        if self._draining and not during_drain:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, "the server is draining (shutting down)")
        if not self._ready:
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE, f"not serving: {self._not_ready_reason}")

    @contextmanager
    def on_cut(self, cancel: Callable[[], None]) -> Iterator[None]:
        """While the block runs, `cut()` calls `cancel` (it ends the call's work; the call then ends
        UNAVAILABLE, see services.server.errors.SHUT_DOWN_DETAILS)."""
        with self._cond:
            key = self._next_cutter
            self._next_cutter += 1
            self._cutters[key] = cancel
            cut = self.shut_down
        if cut:
            cancel()
        try:
            yield
        finally:
            with self._cond:
                self._cutters.pop(key, None)

    def cut(self) -> None:
        """The drain timeout passed: end every call still in flight (each `cancel` runs on the server's
        event loop, where the calls live)."""
        with self._cond:
            self.shut_down = True
            cutters = list(self._cutters.values())
        for cancel in cutters:
            self._runtime.call_soon(cancel)

    @contextmanager
    def admit(self, during_drain: bool = False) -> Iterator[None]:
        """Count a call in flight for `wait_idle`; refuse it when not serving (`during_drain`: a call
        that finishes work already admitted, such as a decode of a prefilled handle, still passes)."""
        with self._cond:
            self.check_admission(during_drain)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def wait_idle(self, timeout_s: float, busy: Callable[[], bool] = lambda: False, poll_s: float = 0.05) -> bool:
        """Block until no call is in flight and `busy()` is false, or `timeout_s` passed; True when idle."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                if self._in_flight == 0 and not busy():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, poll_s))

    def _publish(self) -> None:
        """Health := the state as it is when this runs on the loop (so concurrent setters end with the latest)."""
        async def publish() -> None:
            status = SERVING if self._ready else NOT_SERVING
            for name in self.service_names:
                await self.health.set(name, status)         # ignored by the servicer once draining
        self._on_loop(publish)

    def _on_loop(self, make_coroutine: Callable) -> None:
        if self._runtime.on_loop:
            self._runtime.loop.create_task(make_coroutine())
        elif not self._runtime.loop.is_closed():
            self._runtime.run(make_coroutine(), timeout_s=10.0)
