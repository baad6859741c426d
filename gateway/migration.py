"""Streams that outlive their engine: when the engine under a stream dies or stops answering, the
gateway resumes the stream on another engine (docs/serving-edge.md, "Streams outlive engines").

When an engine is lost:
    - its decode stream fails UNAVAILABLE (the process died: the connection broke; or it drained
      and cut the stream at its drain timeout), or
    - no message came for `stall_s` and the engine's health does not answer within `probe_s`
      (a hung or SIGSTOPped process; an engine that answers health is slow, not lost: keep waiting),
    - or it ends the stream without its final message, or finds no decode seat in time.
A Prefill is watched the same way (a request sent to an engine just before it hung is retried
elsewhere: nothing was sent to the client yet).

How a stream resumes: a Prefill on another engine with the prompt and `output_token_ids` = every
token the client has been sent, the same seed (the engine's, from the first PrefillResponse, when
the request set none) and the same sampling; the engine prefills prompt + those tokens, samples
nothing, and decodes on with the same output counters (EngineCore.add_request's output_token_ids),
so a greedy or seeded stream continues token for token as the unbroken run would, MTP included.
The gateway's detokenizer and stop-string state go on across the seam (the client's text is one).
Attempts are bounded (`max_migrations`); past them, or with no other engine serving, the stream
ends with the error that lost it. The final message's `result.migrations` and the metric
`ninfer_gateway_stream_migrations_total{reason}` say that a stream moved.

smg (the router of the vLLM protocol) cannot do this from our side: it retries a request whose
engine failed before the first token by re-running the whole pipeline on another worker, and after
the first streamed token it ends the SSE stream with a `stream_error` and aborts the request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from gateway.router import Engine

MIGRATING_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class MigrationPolicy:
    max_migrations: int = 2        # resumes per stream; then the error that lost it
    stall_s: float = 2.0           # no message this long: probe the engine's health
    probe_s: float = 2.0           # a health probe unanswered this long: the engine is lost


class EngineLost(Exception):
    """The engine under a call is gone; `error` is what the client gets if the call cannot move."""

    def __init__(self, reason: str, error: BaseException):
        super().__init__(reason)
        self.reason = reason
        self.error = error


@dataclass
class StreamProgress:
    """What a resume needs: the prompt, every token sent to the client, the seed."""

    prompt_ids: list[int]
    sent: list[int] = field(default_factory=list)
    seed: int | None = None
    migrations: int = 0
    lost_engines: list[Engine] = field(default_factory=list)


def lost_by_status(error: grpc.RpcError) -> str | None:
    """The reason an engine call's error means its engine is lost (None: a real answer to pass on)."""
    code = error.code()
    if code is grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "decode seat" in (error.details() or ""):
        return "no_seat"
    return None


class StallWatch:
    """Watches one engine call: `beat()` at every message; after `stall_s` without one, probes the
    engine's health; no answer within `probe_s`: cancels the call and sets `lost`. One task per call,
    nothing per message but a clock read."""

    def __init__(self, engine: Engine, policy: MigrationPolicy, call: grpc.aio.Call):
        self.engine, self.policy, self.call = engine, policy, call
        self.lost: str | None = None
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._task = self._loop.create_task(self._watch())

    def beat(self) -> None:
        self._last = self._loop.time()

    def stop(self) -> None:
        self._task.cancel()

    async def _watch(self) -> None:
        while True:
            idle = self._loop.time() - self._last
            if idle < self.policy.stall_s:
                await asyncio.sleep(self.policy.stall_s - idle)
                continue
            if await self.engine.probe(self.policy.probe_s) is None:
                self.lost = "stalled"
                self.call.cancel()
                return
            self._last = self._loop.time()       # it answers: slow, not lost; look again later

    def __enter__(self) -> "StallWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
