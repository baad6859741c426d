"""ninfer's inference engine: Qwen3 + MTP, paged KV, chunked prefill, speculative decoding. No gRPC.

Names are re-exported lazily: importing `engine` (or its pure-Python parts: config, scheduler,
kv_cache, request, sampling_params, stats, errors, tokenizer) loads no torch. `engine.LLM` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm", "CompletionOutput": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "EngineConfig": "engine.config", "ModelConfig": "engine.config",
    "RequestStats": "engine.request_stats", "FinishReason": "engine.request_stats",
    "EngineInfo": "engine.engine_info",
    "EngineError": "engine.errors", "InvalidArgumentError": "engine.errors", "CapacityError": "engine.errors",
    "ModelLoadError": "engine.errors", "QueueFullError": "engine.errors", "QueueTimeoutError": "engine.errors",
    "RequestNotFoundError": "engine.errors",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.errors import (CapacityError, EngineError, InvalidArgumentError, ModelLoadError, QueueFullError,
                               QueueTimeoutError, RequestNotFoundError)
    from engine.engine_info import EngineInfo
    from engine.llm import LLM, CompletionOutput
    from engine.sampling_params import SamplingParams
    from engine.request_stats import FinishReason, RequestStats


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
