"""The client's call as the gateway's servicer sees it: what ends it, what it has left of its
deadline, and the callback that cancels the engine calls made on its behalf."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from services.server.errors import RpcAbort

NO_DEADLINE_S = 1e8           # grpc reports ~forever when the client set no deadline


class CallCanceller:
    """Done callback of the client's call (and the drain's cutter): cancels whichever engine call is in
    flight, and releases a prefilled handle the request still owns (no decode attached yet). Runs on
    the gateway's event loop, like the calls it cancels."""

    def __init__(self) -> None:
        self._call: grpc.aio.Call | None = None
        self._release: Callable[[], None] | None = None
        self._terminated = False

    def __call__(self, context: grpc.aio.ServicerContext | None = None) -> None:
        self._terminated = True
        if self._call is not None:
            self._call.cancel()
        self.release_owned()

    def watch(self, call: grpc.aio.Call) -> None:
        self._call = call
        if self._terminated:
            call.cancel()

    def own(self, release: Callable[[], None] | None) -> None:
        """`release` frees a handle the request owns now (None: it owns none any more)."""
        self._release = release
        if self._terminated:
            self.release_owned()

    def release_owned(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def time_left(context: grpc.aio.ServicerContext) -> float | None:
    """The client's remaining deadline in seconds, for the next engine call (None: no deadline)."""
    left = context.time_remaining()
    if left is None or left > NO_DEADLINE_S:
        return None
    if left <= 0:
        raise RpcAbort(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed")
    return left


# The client's deadline fires on the client, which cancels the call; the gateway's copy of the deadline started when
# the request's headers arrived, a little later. On a loaded machine that skew left a timed-out call counted as
# CANCELLED (a CI run with two test workers on two cores). A cancel this close to the deadline is taken as the deadline.
DEADLINE_SKEW_S = 0.25


def past_deadline(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call's deadline has passed, give or take the client-to-gateway skew (DEADLINE_SKEW_S)."""
    left = context.time_remaining()
    return left is not None and left <= DEADLINE_SKEW_S


def client_left(exc: BaseException, context: grpc.aio.ServicerContext) -> bool:
    """Whether `exc` ends the call because the client went away. A CancelledError while neither the
    call nor its task was cancelled comes from an engine call the gateway cancelled itself (the drain
    cut): the client is still there and gets a status."""
    if isinstance(exc, GeneratorExit):
        return True
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return context.done() or (task is not None and task.cancelling() > 0)
    return False
