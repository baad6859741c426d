"""Metrics of the gRPC server itself, beside the engine's and the gateway's own: the concurrency
limiter's occupancy, the calls waiting for their request message, the connections' limits.

`ninfer serve` puts the engine's and the gateway's servers on one registry: every series is
labelled `server` (the server's name: ninfer-engine-rpc, ninfer-gateway-rpc), and the metric
objects are made once per registry.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

_by_registry: "weakref.WeakKeyDictionary[CollectorRegistry, _ServerFamilies]" = weakref.WeakKeyDictionary()


class _ServerFamilies:
    def __init__(self, r: CollectorRegistry):
        self.active = Gauge("ninfer_rpc_active_calls", "Calls holding a concurrency seat now", ["server"], registry=r)
        self.limit = Gauge("ninfer_rpc_concurrency_limit", "Calls served at once at most (--max-concurrent-rpcs)",
                           ["server"], registry=r)
        self.refused = Counter("ninfer_rpc_refused_at_limit", "Calls refused at the concurrency limit "
                               "(RESOURCE_EXHAUSTED)", ["server"], registry=r)
        self.awaiting = Gauge("ninfer_rpc_awaiting_message", "Calls whose request message has not arrived yet",
                              ["server"], registry=r)
        self.receive_timeouts = Counter("ninfer_rpc_receive_timeouts", "Calls ended because their request "
                                        "message did not arrive within --receive-timeout", ["server"], registry=r)


class ServerMetrics:
    """One server's series; the gauges read the live values when Prometheus scrapes."""

    def __init__(self, registry: CollectorRegistry, server: str):
        families = _by_registry.get(registry)
        if families is None:
            families = _by_registry[registry] = _ServerFamilies(registry)
        self._families = families
        self.server = server
        self.receive_timeouts = families.receive_timeouts.labels(server=server)
        self.refused = families.refused.labels(server=server)

    def watch(self, active: Callable[[], float], limit: Callable[[], float], awaiting: Callable[[], float]) -> None:
        f, s = self._families, self.server
        f.active.labels(server=s).set_function(active)
        f.limit.labels(server=s).set_function(limit)
        f.awaiting.labels(server=s).set_function(awaiting)
