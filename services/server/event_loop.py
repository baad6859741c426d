"""The asyncio event loop a gRPC server runs on, on a thread of its own.

The servers are `grpc.aio` servers: a call is a coroutine, not a pool thread, so a call that waits
(for its request message, for an engine step, for a client that reads slowly) costs a few kilobytes
and no thread. Their public API stays synchronous (start, load, drain, stop from the main thread or
a test); this class carries those calls onto the loop.

    runtime = EventLoopThread("ninfer-engine-rpc")
    server = runtime.run(make_server())          # a coroutine, run on the loop; its result here
    runtime.call_soon(fn, arg)                   # from any thread, without waiting
    runtime.close()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
RUN_TIMEOUT_S = 120.0             # a coroutine run from another thread that takes longer is a bug


class EventLoopThread:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    @property
    def on_loop(self) -> bool:
        """Whether the caller runs on this loop's thread (where it must not block on the loop)."""
        return threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = RUN_TIMEOUT_S) -> T:
        """Run `coro` on the loop and return its result; from any thread but the loop's own."""
        if self.on_loop:
            coro.close()
            raise RuntimeError("EventLoopThread.run() called on its own loop (it would wait for itself)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call `fn(*args)` on the loop (at once when already on it); ignored once the loop is closed."""
        if self.on_loop:
            fn(*args)
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:                   # the loop is closed: nothing is left to act on
            pass

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop (its remaining tasks are cancelled) and join its thread."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            async def cancel_the_rest() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            try:
                self.run(cancel_the_rest(), timeout_s)
            except Exception:  # noqa: BLE001 - best effort: the loop stops below either way
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
