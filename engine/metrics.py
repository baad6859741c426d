"""The engine snapshot (the seed's metrics contract), fed by steps and finished requests. No torch.

`history` holds raw counts per interval (tokens, seconds), never rates, so that any window can be
re-aggregated exactly; session peaks are copied from the request stats (`engine.request_stats`) they came from.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.request_stats import RequestStats


@dataclass
class _Interval:
    start: float
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cache_hit_tokens: int = 0


@dataclass
class EngineMetrics:
    """Counters the engine loop feeds; `snapshot()` may be called from any thread."""

    interval_s: float = 1.0
    history_len: int = 120
    _history: deque = field(default_factory=deque)
    _current: _Interval | None = None
    _last: dict[str, Any] | None = None
    _peak_prefill: float = 0.0
    _peak_decode: float = 0.0
    _requests_by_reason: dict[str, int] = field(default_factory=dict)
    _accepted_per_position: list[int] = field(default_factory=list)
    _rounds: int = 0
    _sum_prefill_rate: float = 0.0
    _sum_decode_rate: float = 0.0
    _rated: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record_step(self, now: float, prefill_tokens: int, decode_tokens: int, cache_hit_tokens: int = 0) -> None:
        with self._lock:
            cur = self._roll(now)
            cur.prefill_tokens += prefill_tokens
            cur.decode_tokens += decode_tokens
            cur.cache_hit_tokens += cache_hit_tokens

    def record_request(self, stats: RequestStats) -> None:
        with self._lock:
            reason = stats.finish_reason.value if stats.finish_reason else "unknown"
            self._requests_by_reason[reason] = self._requests_by_reason.get(reason, 0) + 1
            per_pos = stats.speculative.accepted_per_position
            if len(per_pos) > len(self._accepted_per_position):
                self._accepted_per_position += [0] * (len(per_pos) - len(self._accepted_per_position))
            for i, n in enumerate(per_pos):
                self._accepted_per_position[i] += n
            self._rounds += stats.speculative.rounds
            if stats.usage.completion_tokens < 1:
                return
            rates = stats.rates
            self._peak_prefill = max(self._peak_prefill, rates.prefill_tok_s)
            self._peak_decode = max(self._peak_decode, rates.decode_tok_s)
            self._sum_prefill_rate += rates.prefill_tok_s
            self._sum_decode_rate += rates.decode_tok_s
            self._rated += 1
            self._last = {
                "prompt_tokens": stats.usage.prompt_tokens,
                "computed_prefill_tokens": stats.usage.computed_prefill_tokens,
                "completion_tokens": stats.usage.completion_tokens,
                "prefill_tok_s": rates.prefill_tok_s,
                "decode_tok_s": rates.decode_tok_s,
                "ttft_s": stats.timings.ttft,
            }

    def snapshot(self, now: float, kv: dict[str, Any], queue: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._roll(now)
            history = list(self._history) + ([self._current] if self._current else [])
            rounds = self._rounds
            return {
                "history": {
                    "interval_seconds": [min(self.interval_s, now - i.start) for i in history],
                    "prefill_tokens": [i.prefill_tokens for i in history],
                    "decode_tokens": [i.decode_tokens for i in history],
                    "cache_hit_tokens": [i.cache_hit_tokens for i in history],
                },
                "last": {**(self._last or {}), "peak_prefill_tok_s": self._peak_prefill,
                         "peak_tok_s": self._peak_decode},
                "performance": {
                    "requests": dict(self._requests_by_reason),
                    "rounds": rounds,
                    "accepted_per_position": list(self._accepted_per_position),
                    "acceptance_per_position": [n / rounds for n in self._accepted_per_position] if rounds else [],
                    "mean_prefill_tok_s": self._sum_prefill_rate / self._rated if self._rated else 0.0,
                    "mean_decode_tok_s": self._sum_decode_rate / self._rated if self._rated else 0.0,
                },
                "kv": kv,
                "queue": queue,
            }

    def _roll(self, now: float) -> _Interval:
        cur = self._current
        if cur is None or now - cur.start >= self.interval_s:
            if cur is not None:
                self._history.append(cur)
                # idle intervals in between are recorded as zeros: the history is a time axis
                gap = int((now - cur.start) // self.interval_s) - 1
                for i in range(min(gap, self.history_len)):
                    self._history.append(_Interval(cur.start + (i + 1) * self.interval_s))
                start = cur.start + (gap + 1) * self.interval_s
            else:
                start = now
            while len(self._history) > self.history_len:
                self._history.popleft()
            cur = self._current = _Interval(start)
        return cur
