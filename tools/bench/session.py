"""One engine under test, driven through the public API the services use (`EngineCore` + `EngineLoop`).

The bench never reaches inside the engine: it builds an `EngineConfig`, submits token-id prompts
with `SamplingParams`, and reads each request's own `stats` (phase timings, speculative counts).
A request that outlives its timeout is aborted, so a stuck engine cannot eat the whole run.

`EnginePool` keeps the last engine alive so that sections asking for the same configuration
(prefill's chunk-4096 engine, concurrency, decode at k=0) share one build and one warm-up; an
interleaved comparison keeps both of its engines.
"""

from __future__ import annotations

import gc
import itertools
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loop import EngineLoop, RequestStream
from engine.sampling_params import SamplingParams
from engine.request_stats import RequestStats

FIRST_TOKEN_ID = 3                 # below: the byte-level tokenizer's special tokens
_nonce = itertools.count(1)


def random_prompt(length: int, vocab: int, seed: int | None = None) -> list[int]:
    """A fresh random prompt: a new nonce each call keeps the prefix cache out of the measurement."""
    gen = torch.Generator().manual_seed(next(_nonce) * 1_000_003 if seed is None else seed)
    return torch.randint(FIRST_TOKEN_ID, vocab, (length,), generator=gen).tolist()


class RequestTimeout(Exception):
    pass


def compact(stats: RequestStats) -> dict[str, Any]:
    """The per-request numbers a figure keeps (the engine's stats, minus nothing the bench derives from)."""
    t = stats.timings
    spec = stats.speculative
    return {
        "prompt_tokens": stats.usage.prompt_tokens, "computed_prefill_tokens": stats.usage.computed_prefill_tokens,
        "cached_tokens": stats.usage.cached_tokens, "completion_tokens": stats.usage.completion_tokens,
        "prefill_chunk": stats.prefill_chunk, "preemptions": stats.preemptions,
        "finish_reason": stats.finish_reason.value if stats.finish_reason else None,
        "prefill_s": t.prefill, "decode_s": t.decode, "queue_s": t.queue, "ttft_s": t.ttft,
        "prefill_tok_s": stats.rates.prefill_tok_s, "decode_tok_s": stats.rates.decode_tok_s,
        "draft_tokens": spec.draft_tokens, "rounds": spec.rounds, "accepted": spec.accepted,
        "accepted_per_position": list(spec.accepted_per_position),
    }


@dataclass(frozen=True)
class EngineSpec:
    """What distinguishes one engine build from another in this tool."""

    model: str
    device: str
    prefill_chunk: int
    draft_tokens: int = 0
    kv_dtype: str = "auto"
    draft_vocab: int = 0
    tensor_parallel_size: int = 1
    kv_capacity: int | None = None
    max_model_len: int | None = None
    max_batch: int = 16                        # 8 streams at most here: fewer graph buckets to capture
    extra: tuple = field(default=())           # (name, value) pairs of further EngineConfig fields

    def config(self) -> EngineConfig:
        return EngineConfig(model=self.model, device=self.device, prefill_chunk=self.prefill_chunk,
                            draft_tokens=self.draft_tokens, kv_dtype=self.kv_dtype, draft_vocab=self.draft_vocab,
                            tensor_parallel_size=self.tensor_parallel_size, kv_capacity=self.kv_capacity,
                            max_model_len=self.max_model_len, max_batch=self.max_batch, **dict(self.extra))


class EngineSession:
    """An engine built the way every entry point builds it: the core, the loop, then the one warm-up
    (`EngineLoop.warmup`: kernels compiled, CUDA graphs captured) before any request is measured."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.config = spec.config()
        t0 = time.perf_counter()
        self.loop: EngineLoop | None = EngineLoop(EngineCore(self.config)).start()
        self.build_s = time.perf_counter() - t0
        try:
            self.engine_warmup = self.loop.warmup()
            info = self.loop.info()
        except BaseException:
            self.close()
            raise
        self.vocab = info.vocab_size
        c = self.config
        self.describe = {**info.log_fields(), "draft_vocab": c.draft_vocab, "enforce_eager": c.enforce_eager,
                         "prefix_reuse": c.prefix_reuse, "max_batch": c.max_batch,
                         "build_s": round(self.build_s, 2), "engine_warmup_s": round(self.engine_warmup.seconds, 2)}
        self.warm_s = 0.0
        self.warm_stats: RequestStats | None = None

    # -- requests -------------------------------------------------------------------------------

    def submit(self, prompt: list[int] | str, params: SamplingParams, park: bool = False) -> RequestStream:
        return self.loop.submit(prompt, params, park_after_prefill=park)

    def wait(self, stream: RequestStream, timeout: float, on_output=None) -> RequestStats:
        """Read a stream to its end; returns the final stats. `on_output(t, out)` sees every output."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                out = stream.next(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.loop.abort(stream.request_id)
                raise RequestTimeout(f"request did not finish within {timeout:.0f} s (aborted)") from None
            if on_output is not None:
                on_output(time.monotonic(), out)
            if out.finished:
                return out.stats

    def generate(self, prompt: list[int] | str, params: SamplingParams, timeout: float = 300.0) -> RequestStats:
        return self.wait(self.submit(prompt, params), timeout)

    def generate_many(self, prompts: list, params: list[SamplingParams], timeout: float = 300.0) -> list[RequestStats]:
        """Submit all at once (they batch in the engine), then collect each one's stats."""
        streams = [self.submit(p, sp) for p, sp in zip(prompts, params)]
        deadline = time.monotonic() + timeout
        return [self.wait(s, max(0.01, deadline - time.monotonic())) for s in streams]

    def warm_up(self, prompt_tokens: int, decode_tokens: int = 16) -> RequestStats:
        """One request through prefill (two chunks where it can) and a few decode rounds, so that
        compilation and first-use costs stay out of the figures. Returns its stats."""
        t0 = time.perf_counter()
        stats = self.generate(random_prompt(prompt_tokens, self.vocab),
                              SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=0.0), timeout=600)
        self.warm_s = time.perf_counter() - t0
        self.describe["warm_s"] = round(self.warm_s, 2)
        self.warm_stats = stats
        return stats

    @property
    def setup_text(self) -> str:
        return (f"built in {self.build_s:.1f} s, engine warm-up {self.engine_warmup.seconds:.1f} s, "
                f"first request {self.warm_s:.1f} s")

    @property
    def alive(self) -> bool:
        return self.loop is not None and self.loop.alive

    def close(self) -> None:
        if self.loop is not None:
            self.loop.shutdown(timeout=30)      # frees every rank's shard, KV and graphs
        self.loop = None
        free_memory()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class EnginePool:
    """Holds the engines the current measurement needs: `get(spec)` reuses a held engine of that spec
    and closes every other one, except those named in `keep` -- an interleaved comparison holds both
    its sides (A, B, A, B, ...), everything else holds one engine at a time."""

    def __init__(self):
        self.sessions: dict[EngineSpec, EngineSession] = {}
        self.builds = 0
        self.last_setup_s: float | None = None      # build + warm-ups of the last engine built

    @property
    def session(self) -> EngineSession | None:
        """The engine built or reused last."""
        return next(reversed(self.sessions.values()), None)

    def holds(self, spec: EngineSpec) -> bool:
        s = self.sessions.get(spec)
        return s is not None and s.alive

    def get(self, spec: EngineSpec, warm_prompt: int, warm_decode: int = 16,
            keep: tuple[EngineSpec, ...] = ()) -> tuple[EngineSession, bool]:
        """(session, reused). A new engine is warmed up before it is returned."""
        for other in [s for s in self.sessions if s != spec and s not in keep]:
            self.sessions.pop(other).close()
        if self.holds(spec):
            self.sessions[spec] = self.sessions.pop(spec)          # the latest at the end
            return self.sessions[spec], True
        stale = self.sessions.pop(spec, None)
        if stale is not None:
            stale.close()
        free_memory()                           # what earlier sections left in the allocator's cache
        t0 = time.perf_counter()
        session = EngineSession(spec)
        self.builds += 1
        try:
            session.warm_up(warm_prompt, warm_decode)
        except BaseException:
            session.close()
            raise
        self.sessions[spec] = session
        self.last_setup_s = time.perf_counter() - t0
        return session, False

    def close(self) -> None:
        while self.sessions:
            _, session = self.sessions.popitem()
            session.close()
