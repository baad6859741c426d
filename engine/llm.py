"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]            # generated ids only
    text: str
    finish_reason: str              # "stop" | "length"
    stats: dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "auto",
                 kv_dtype: str = "auto", prefill_chunk: int = 2048, kv_capacity: int | None = None,
                 draft_tokens: int = 0, **engine_args: Any):
        self.config = EngineConfig(model=model, device=device, dtype=dtype, kv_dtype=kv_dtype,
                                   prefill_chunk=prefill_chunk, kv_capacity=kv_capacity,
                                   draft_tokens=draft_tokens, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run every prompt to completion through the engine's scheduler (batched, chunked)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        reqs = [self.engine.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
        results: dict[str, Any] = {}
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

    def prompt_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """Logits [P, vocab] at every prompt position, computed by the engine's chunked prefill."""
        from engine.runner import PromptLogits
        req = self.engine.add_request(prompt, SamplingParams(max_tokens=1))
        runners = self.engine.executor.runners         # every rank runs the same collectives
        collectors = [PromptLogits([]) for _ in runners]
        for runner, c in zip(runners, collectors):
            runner.prompt_logits[req.request_id] = c
        # a cached prefix would skip the logits of its positions: compute every position
        kv = self.engine.kv
        reuse, kv.prefix_reuse = kv.prefix_reuse, False
        try:
            while not req.finished:
                self.engine.step()
        finally:
            kv.prefix_reuse = reuse
            for runner in runners:
                runner.prompt_logits.pop(req.request_id, None)
        return torch.cat(collectors[0].chunks)[-len(req.prompt_token_ids):]
