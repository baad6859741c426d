"""Log-probabilities as the engine reports them (no torch): per generated token, and per prompt token
for scoring (`SamplingParams.logprobs`, `prompt_logprobs`).

Every value is from the model's raw distribution: log_softmax of the target model's logits at that
position, before temperature, penalties, bias or filters (vLLM's default, `raw_logprobs`). That
makes them a property of the model and the text alone -- what scoring (lm-evaluation-harness'
loglikelihood) needs, equal for greedy and sampled requests, and under speculation exactly the
verify pass's logits at each position, which are the target's (docs/sampling.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability and rank, and the most likely tokens."""

    token_id: int
    logprob: float
    rank: int                                   # 1 = the most likely token at this position
    top: tuple[tuple[int, float], ...] = ()     # (token id, logprob), most likely first; len = the N asked for
