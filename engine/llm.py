"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`.

The engine warms up in the constructor exactly as a served one does (`EngineCore.warmup`: kernels
compiled, CUDA graphs captured), so that what this API measures is what `ninfer serve` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.core import EngineCore, RequestOutput
from engine.sampling_params import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.request_stats import FinishReason, RequestStats


@dataclass(frozen=True)
class Logprob:
    """vLLM's shape of one alternative at one position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one position: token id -> its Logprob (the chosen token, then the top-N), as vLLM's `outputs[j].logprobs[i]`
PositionLogprobs = dict[int, Logprob]


@dataclass
class SequenceOutput:
    """One generated sequence (vLLM's `CompletionOutput`): `index` among the request's n."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[PositionLogprobs] | None = None      # one per token (SamplingParams.logprobs set)
    cumulative_logprob: float | None = None
    stats: RequestStats | None = None


@dataclass
class CompletionOutput:
    """One request's result: vLLM's shape (`outputs[j].text`, `.token_ids`, `.logprobs`,
    `prompt_logprobs`) and ninfer's flat fields of its first sequence (`token_ids`, `text`, `stats`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]            # generated ids only (sequence 0)
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    outputs: list[SequenceOutput] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = True


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
        pending = [self.engine.grammar_future(sp) for sp in per_prompt]
        grammars = [f.result() if f is not None else None for f in pending]
        reqs = [self.engine.add_request(p, sp, grammar=g) for p, sp, g in zip(prompts, per_prompt, grammars)]
        sequences = {(req.request_id, i): _Collected() for req in reqs for i in range(req.sampling.n)}
        remaining = len(sequences)
        while remaining:
            for out in self.engine.step():
                seq = sequences.get((out.request_id, out.index))
                if seq is None:
                    continue
                seq.add(out)
                remaining -= out.finished
        return [self._result(req, [sequences[(req.request_id, i)] for i in range(req.sampling.n)]) for req in reqs]

    def _result(self, req, collected: list["_Collected"]) -> CompletionOutput:
        p = req.sampling
        outputs = []
        for i, seq in enumerate(collected):
            text = seq.text if seq.text is not None else self.tokenizer.decode(
                seq.token_ids, p.skip_special_tokens, p.spaces_between_special_tokens)
            logprobs = [self._position(lp) for lp in seq.logprobs] if p.logprobs is not None else None
            outputs.append(SequenceOutput(i, text, seq.token_ids, seq.finish_reason, logprobs,
                                          sum(lp.logprob for lp in seq.logprobs) if p.logprobs is not None else None,
                                          seq.stats))
        first = collected[0]
        prompt_lp = ([None if lp is None else self._position(lp) for lp in first.prompt_logprobs]
                     if first.prompt_logprobs is not None else None)
        return CompletionOutput(req.request_id, req.prompt_token_ids, first.token_ids, outputs[0].text,
                                first.finish_reason, first.stats, outputs=outputs, prompt_logprobs=prompt_lp)

    def _position(self, lp: TokenLogprob) -> PositionLogprobs:
        """vLLM's dict for one position: the chosen token first, then the top-N (ranks 1..N)."""
        decode = lambda t: self.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        out = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id))}
        for rank, (tid, value) in enumerate(lp.top, start=1):
            out.setdefault(tid, Logprob(value, rank, decode(tid)))
        return out

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


@dataclass
class _Collected:
    """One sequence's outputs as the steps deliver them."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text: str | None = None
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.text, self.finish_reason, self.stats = out.text, out.finish_reason, out.stats
