"""The one module of services/smg that talks to the engine, through EngineLoop's public methods only
(submit, abort, snapshot, call). Kept thin on purpose: when the loop's typed front door lands, this
file is all that changes.

Everything here is safe to call from any gRPC thread; `call` runs its function on the engine thread
between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import EngineDeadError
from engine.kv_cache import KVEventListener
from engine.loop import RequestStream
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine_host import EngineHost


@dataclass(frozen=True)
class EngineFacts:
    """What does not change while the engine runs (read once, after it loaded)."""

    model_name: str                      # the served model name (the model directory's name)
    model_path: str                      # the model directory, or the model name for built-in models
    model_type: str
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int
    max_batch: int
    draft_tokens: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    kv_dtype: str
    tokenizer_json: str                  # the tokenizer the engine runs (for built-in models: no files)


class EnginePort:
    def __init__(self, host: "EngineHost"):
        self._host = host
        self._facts: EngineFacts | None = None

    @property
    def loaded(self) -> bool:
        loop = self._host.loop
        return loop is not None and loop.alive

    def _loop(self):
        loop = self._host.loop
        if loop is None or not loop.alive:
            raise EngineDeadError("the engine is not running")
        return loop

    # -- requests -------------------------------------------------------------------------------

    def submit(self, prompt: list[int] | str, params: SamplingParams, request_id: str | None) -> RequestStream:
        """Admit one request (validated at once; raises the engine's errors); no prefill/decode split."""
        return self._loop().submit(prompt, params, request_id or None)

    def abort(self, request_id: str) -> None:
        """End a request wherever it is (unknown ids are ignored)."""
        if self.loaded:
            self._loop().abort(request_id)

    # -- state ----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return self._loop().snapshot()

    def facts(self) -> EngineFacts:
        if self._facts is None:
            self._facts = self._loop().call(_read_facts)
        return self._facts

    def flush_prefix_cache(self) -> None:
        """Forget every cached block no request holds (requests in flight keep theirs)."""
        self._loop().call(lambda core: core.kv.reset_prefix_cache())

    def add_kv_listener(self, listener: KVEventListener) -> None:
        """Register a prefix-cache listener on the KV manager (called on the engine thread from now on)."""
        self._loop().call(lambda core: core.kv.listeners.append(listener))


def _read_facts(core) -> EngineFacts:
    d = core.describe()
    config = core.config
    return EngineFacts(
        model_name=d["model"], model_path=config.model or d["model"], model_type=core.model_config.model_type,
        vocab_size=core.model_config.vocab_size, max_model_len=d["max_model_len"],
        kv_capacity_tokens=d["kv_capacity_tokens"], block_size=d["block_size"], max_batch=config.max_batch,
        draft_tokens=d["draft_tokens"], eos_token_ids=tuple(core.model_config.eos_token_ids), dtype=d["dtype"],
        kv_dtype=d["kv_dtype"], tokenizer_json=core.tokenizer.inner.to_str())
