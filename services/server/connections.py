"""Limits on the HTTP/2 connections of a server (grpc core channel arguments).

    max_streams_per_connection  grpc.max_concurrent_streams: streams one connection may have open
                                (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; past it the client queues)
    max_connections             grpc.max_allowed_incoming_connections: connections at once; a new one
                                past it is closed as soon as it is accepted
    idle_timeout_s              grpc.max_connection_idle_ms: a connection with no call for this long is
                                closed (GOAWAY; a client reconnects for its next call)
    max_age_s, age_grace_s      grpc.max_connection_age_ms / _grace_ms: a connection older than this is
                                asked to go away (GOAWAY: no new calls on it); the calls on it then have
                                `age_grace_s` to finish (0: all the time they need)

The stream cap defaults to the server's concurrency limit plus headroom: one client (a gateway in
front of an engine) must be able to fill the limit over one connection and still probe health.
"""

from __future__ import annotations

from dataclasses import dataclass

STREAM_HEADROOM = 32              # streams per connection beyond the concurrency limit (health, Release)
FOREVER_MS = 2**31 - 1            # grpc's "infinite" for the millisecond arguments


@dataclass(frozen=True)
class ConnectionLimits:
    max_streams_per_connection: int | None = None   # None: the concurrency limit + STREAM_HEADROOM
    max_connections: int = 1000
    idle_timeout_s: float = 300.0                   # 0: never closed for idleness
    max_age_s: float = 0.0                          # 0: no age limit
    age_grace_s: float = 0.0                        # 0: calls on an aged connection finish however long


def channel_options(limits: ConnectionLimits, max_concurrent_rpcs: int) -> list[tuple[str, int]]:
    streams = limits.max_streams_per_connection or max_concurrent_rpcs + STREAM_HEADROOM
    return [("grpc.max_concurrent_streams", streams),
            ("grpc.max_allowed_incoming_connections", limits.max_connections),
            ("grpc.max_connection_idle_ms", _ms(limits.idle_timeout_s)),
            ("grpc.max_connection_age_ms", _ms(limits.max_age_s)),
            ("grpc.max_connection_age_grace_ms", _ms(limits.age_grace_s))]


def _ms(seconds: float) -> int:
    return FOREVER_MS if seconds <= 0 else min(FOREVER_MS, max(1, round(seconds * 1000)))
