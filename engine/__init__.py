"""ninfer's inference engine: Qwen3 + MTP, paged KV, chunked prefill, speculative decoding. No gRPC."""

from engine.config import EngineConfig, ModelConfig
from engine.errors import (CapacityError, EngineError, InvalidArgumentError, ModelLoadError, QueueFullError,
                           QueueTimeoutError, RequestNotFoundError)
from engine.llm import LLM, CompletionOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "EngineConfig", "ModelConfig", "EngineError",
           "InvalidArgumentError", "CapacityError", "ModelLoadError", "QueueFullError", "QueueTimeoutError",
           "RequestNotFoundError"]
