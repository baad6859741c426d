"""The one module of services/smg that talks to the engine, through the loop's front door
(`EngineContext.loop`: submit, abort, metrics, add_kv_listener, reset_prefix_cache, the KV lent across
engines; `ctx.info` for
what it serves). Kept thin on purpose.

The request and snapshot calls are coroutines for the server's event loop; the rest is safe from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.engine_info import EngineInfo
from engine.cache.block_manager import KVEventListener
from engine.cache.kv_landing import KVLanding, Lent
from engine.cache.kv_leases import KVLease
from engine.loop import EngineLoop, RequestStream
from engine.loading.presets import PREFIX as PRESET_PREFIX
from engine.sampling_params import SamplingParams
from engine.worker.kv_regions import KVPoolLayout
from services.engine_context import EngineContext


@dataclass(frozen=True)
class EngineFacts:
    """What does not change while the engine serves: its `EngineInfo` and the flags it was started with."""

    info: EngineInfo
    model_dir: str | None                # the model directory (None: the embedded model or a preset)
    max_batch: int                       # the decode batch: most requests running at once


class EnginePort:
    def __init__(self, ctx: EngineContext, config: EngineConfig):
        self._ctx = ctx
        self._config = config

    @property
    def loaded(self) -> bool:
        loop = self._ctx.loop
        return loop is not None and loop.alive

    def _loop(self) -> EngineLoop:
        loop = self._ctx.loop
        if loop is None or not loop.alive:
            raise EngineDeadError("the engine is not running")
        return loop

    # -- requests -------------------------------------------------------------------------------

    async def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None,
                     park_after_prefill: bool = False) -> RequestStream:
        """Admit one request (validated at once; raises the engine's errors). `park_after_prefill`: a
        producer's prefill leg, whose KV stays parked for a consumer (`release` ends it)."""
        return await self._loop().submit_async(prompt, params, request_id or None, park_after_prefill)

    # -- KV lent across engines (services/kv_transfer) ------------------------------------------

    def kv_pool_layout(self) -> KVPoolLayout:
        return self._loop().kv_pool_layout()

    def kv_lease_region(self) -> tuple[int, int]:
        """A producer's lease table (engine.cache.kv_leases): registered with the pool for consumers' READs."""
        return self._loop().kv_lease_region()

    async def lent(self, request_id: str) -> tuple[Lent, int, KVLease | None]:
        """What a parked prefill leg lends (blocks, state slot, first token), its hidden-state row and the
        lease it is all lent under (None: no lease word free, nothing to lend)."""
        return await self._loop().lent_async(request_id)

    def release(self, request_id: str) -> None:
        """Free a parked prefill leg (its consumer pulled the KV); NOT_FOUND when it is not parked."""
        self._loop().release(request_id)

    async def reserve_landing(self, request_id: str, prompt: list[int], num_blocks: int,
                              whole: bool = False) -> KVLanding | None:
        return await self._loop().reserve_landing_async(request_id, prompt, num_blocks, whole)

    def drop_landing(self, landing: KVLanding) -> None:
        if self.loaded:
            self._loop().drop_landing(landing)

    async def submit_landed(self, landing: KVLanding, prompt: list[int], params: SamplingParams,
                            request_id: str | None, first_token_id: int | None = None) -> RequestStream:
        """Admit a request over what landed (whole: decoding from the producer's first token)."""
        return await self._loop().submit_landed_async(landing, prompt, params, request_id or None, first_token_id)

    async def embed(self, prompt: list[int], request_id: str | None) -> RequestStream:
        """An embedding request (UnsupportedError at once for a generative model); its final output carries it."""
        return await self._loop().embed_async(prompt, request_id or None)

    def abort(self, request_id: str) -> None:
        """End a request wherever it is (unknown ids are ignored)."""
        if self.loaded:
            self._loop().abort(request_id)

    # -- state ----------------------------------------------------------------------------------

    async def metrics(self) -> dict[str, Any]:
        """The engine's metrics snapshot (history, last, performance, kv, queue)."""
        return await self._loop().metrics_async()

    def facts(self) -> EngineFacts:
        info = self._ctx.info
        if info is None:
            raise EngineDeadError("the engine is not warm yet")
        model = self._config.model
        return EngineFacts(info=info, model_dir=model if model and not model.startswith(PRESET_PREFIX) else None,
                           max_batch=self._config.max_batch)

    # -- the prefix cache ------------------------------------------------------------------------

    def add_kv_listener(self, listener: KVEventListener) -> None:
        """Register a prefix-cache listener on the KV manager (called on the engine thread from now on)."""
        self._loop().add_kv_listener(listener)

    def flush_prefix_cache(self) -> None:
        """Forget every cached block no request holds (requests in flight keep theirs)."""
        self._loop().reset_prefix_cache()
