"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`.

The engine warms up in the constructor exactly as a served one does (`EngineCore.warmup`: kernels
compiled, CUDA graphs captured), so that what this API measures is what `ninfer serve` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.core import EngineCore, RequestOutput
from engine.sampling_params import SamplingParams
from engine.request_stats import FinishReason, RequestStats


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]            # generated ids only
    text: str
    finish_reason: FinishReason
    stats: RequestStats


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


class LLM:
    def __init__(self, model: str | None = None, device: str = "auto", dtype: str = "auto",
                 kv_dtype: str = "auto", prefill_chunk: int = 2048, kv_capacity: int | None = None,
                 draft_tokens: int = 0, **engine_args):
        self.config = EngineConfig(model=model, device=device, dtype=dtype, kv_dtype=kv_dtype,
                                   prefill_chunk=prefill_chunk, kv_capacity=kv_capacity,
                                   draft_tokens=draft_tokens, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self.warmup = self.engine.warmup()

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run every prompt to completion through the engine's scheduler (batched, chunked)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        # structured output: every distinct grammar compiles at once on the compiler's pool
        pending = [self.engine.grammars.compile(sp.structured_output) if sp.structured_output is not None else None
                   for sp in per_prompt]
        grammars = [f.result() if f is not None else None for f in pending]
        reqs = [self.engine.add_request(p, sp, grammar=g) for p, sp, g in zip(prompts, per_prompt, grammars)]
        results: dict[str, RequestOutput] = {}
        while len(results) < len(reqs):
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        outputs = []
        for req in reqs:
            out = results[req.request_id]
            text = out.text if out.text is not None else self.tokenizer.decode(req.output_token_ids)
            outputs.append(CompletionOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                                            text, out.finish_reason, out.stats))
        return outputs

    def embed(self, prompts: str | list[int] | list[str | list[int]]) -> list[EmbeddingRequestOutput]:
        """Embeddings of an embedding checkpoint (Qwen3-Embedding: last-token pooling, L2-normalised), as
        vLLM's `LLM.embed` answers them: `out[i].outputs.embedding`. UnsupportedError for a generative model."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        self.engine.check_embedding()
        reqs = [self.engine.add_embedding(p) for p in prompts]
        vectors: dict[str, list[float]] = {}
        while len(vectors) < len(reqs):
            for out in self.engine.step():
                if out.finished:
                    vectors[out.request_id] = out.embedding
        return [EmbeddingRequestOutput(r.request_id, r.prompt_token_ids, EmbeddingOutput(vectors[r.request_id]))
                for r in reqs]

    def prompt_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """Logits [P, vocab] at every prompt position, computed by the engine's chunked prefill."""
        return self.engine.prompt_logits(prompt)
