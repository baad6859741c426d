"""Sampling and speculative verification, batched, on the device, one host read per step.

Randomness is counter-based: the uniform for (request seed, output index, purpose, token id) is a
hash of those four numbers. A seeded request therefore draws the same numbers whatever batch it
runs in, after a preemption, and on any device, and no generator state is carried between steps
(which also keeps the whole step capturable in a CUDA graph).

A sample from `probs` is the exponential race `argmax(probs / E)`, `E = -log(u)`, u uniform: token
v wins with probability probs[v]. Greedy rows use one-hot probabilities, so greedy decoding and
greedy verification are the same code as sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.worker import logit_options
from engine.worker.logit_options import LogitOptionRows

MASK32 = 0xFFFFFFFF
# Purposes of a random draw; each gets an independent stream.
STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT = 0x1B873593, 0x68E31DA4, 0x2F7AC3E1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift-multiply; constants from Wellons' hash-prospector)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x735A2D97)
    return x ^ (x >> 15)


def stream_keys(seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """[N] int64 seeds and counters -> [N] keys (uint32 values in int64)."""
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    key = hash32(lo ^ hash32(hi ^ stream))
    return hash32(key ^ hash32(counters & MASK32))


_column_hash: dict[tuple[torch.device, int], torch.Tensor] = {}


def uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """[N] keys -> [N, n] float32 uniforms in (0, 1), a fixed function of (key, column)."""
    cols = _column_hash.get((keys.device, n))
    if cols is None:
        cols = hash32(torch.arange(n, dtype=torch.int64, device=keys.device) ^ 0x5BD1E995)
        _column_hash[(keys.device, n)] = cols
    h = hash32(keys.unsqueeze(1) ^ cols.unsqueeze(0))
    # (2^24 - 1 + 0.5) * 2^-24 rounds to 1.0 in float32, and -log(1) = 0 would make `race` divide by
    # zero (NaN / inf win the argmax): keep the top value just below 1
    return (((h >> 8).to(torch.float32) + 0.5) * (2.0 ** -24)).clamp_(max=1.0 - 2.0 ** -24)


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Sample one token per row: probs [N, V], keys [N] -> [N] int64."""
    exp_noise = -torch.log(uniforms(keys, probs.shape[-1]))
    return torch.argmax(probs / exp_noise, dim=-1)


@dataclass(frozen=True)
class SamplingVariant:
    """Which sampling code a round runs (its CUDA graph is captured per variant): the shape of the
    work differs, never the values. `any_filter`: some row has top-k, top-p or min_p (the vocabulary
    is sorted); `any_options`: some row has logit options (engine.worker.logit_options);
    `logprobs`: the round also computes the logprobs of what it emits; `constrained`: some row is under
    a grammar (structured output): the round masks its logits (engine.worker.decode_round)."""

    all_greedy: bool = True
    any_filter: bool = False
    any_options: bool = False
    logprobs: bool = False           # some row reports logprobs (engine.worker.logprobs)
    constrained: bool = False        # some row has structured_output (engine.structured)

    @classmethod
    def of(cls, params: list) -> "SamplingVariant":
        greedy = all(p.greedy for p in params)
        return cls(greedy, not greedy and any(p.filters for p in params), any(p.adjusts_logits for p in params),
                   any(p.logprobs is not None for p in params),
                   any(p.structured_output is not None for p in params))


@dataclass
class SamplingBatch:
    """Per-row sampling settings on the device. Rows are requests (or request x draft position).

    The one structure a row's sampling reads: its temperature and filters, its random stream and, with
    logit options, where its option state lives (`options`). Everything that changes the logits
    before a token is picked is applied by `adjust_logits`."""

    temperature: torch.Tensor        # [N] float32; 0 = greedy
    top_k: torch.Tensor              # [N] int64; 0 = off
    top_p: torch.Tensor              # [N] float32; 1 = off
    seeds: torch.Tensor              # [N] int64
    output_index: torch.Tensor       # [N] int64: index of the row's next token among its outputs
    all_greedy: bool
    any_filter: bool
    min_p: torch.Tensor | None = None            # [N] float32; 0 = off (None: every row off)
    options: LogitOptionRows | None = None       # logit options; None: no row has any

    @classmethod
    def build(cls, params: list, seeds: list[int], output_index: list[int], device,
              options: LogitOptionRows | None = None) -> "SamplingBatch":
        t = [float(p.temperature) for p in params]
        k = [int(p.top_k) for p in params]
        p_ = [float(p.top_p) for p in params]
        mk = lambda v, dt: torch.tensor(v, dtype=dt).to(device, non_blocking=True)  # noqa: E731
        variant = SamplingVariant.of(params)
        return cls(mk(t, torch.float32), mk(k, torch.int64), mk(p_, torch.float32),
                   mk(seeds, torch.int64), mk(output_index, torch.int64),
                   all_greedy=variant.all_greedy, any_filter=variant.any_filter,
                   min_p=mk([float(p.min_p) for p in params], torch.float32),
                   options=options if variant.any_options else None)

    def shifted(self, j: int, drafts: torch.Tensor | None = None) -> "SamplingBatch":
        """The same rows for the token j places further on (draft position j), after `drafts` [N, j]."""
        options = self.options.with_drafts(drafts) if self.options is not None and drafts is not None else self.options
        return replace(self, output_index=self.output_index + j, options=options)

    def repeat(self, n: int, drafts: torch.Tensor | None = None) -> "SamplingBatch":
        """Each row n times (row-major), output indices advancing by one: for [B, n] verify positions,
        position j after drafts[:, :j] (drafts [B, n-1])."""
        rep = lambda x: None if x is None else x.repeat_interleave(n)  # noqa: E731
        steps = torch.arange(n, device=self.seeds.device).repeat(self.seeds.shape[0])
        options = self.options.verify_positions(drafts) if self.options is not None else None
        return SamplingBatch(rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.seeds),
                             rep(self.output_index) + steps, self.all_greedy, self.any_filter,
                             rep(self.min_p), options)


def adjust_logits(logits: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """logits [N, V] -> the logits a token is picked from: every per-request change before
    temperature and filters, in one place: the logit options (penalties, bias, bad words, min_tokens).

    A structured-output mask is already in `logits` (-inf where the grammar refuses: every option keeps
    -inf at -inf). Where the options would leave a row nothing to pick -- the grammar allows only tokens
    they ban (EOS under min_tokens, a bad word) -- the row keeps its logits before them: the grammar wins."""
    if s.options is not None:
        adjusted = logit_options.apply(logits.float(), s.options, s.output_index)   # [N, V] float32
        logits = torch.where(torch.isfinite(adjusted).any(-1, keepdim=True), adjusted, logits.float())
    return logits


def probabilities(logits: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """logits [N, V] (adjusted) -> probs [N, V] after temperature, min-p, top-k then top-p; one-hot for
    greedy rows."""
    # one-hot of the argmax (scatter, not F.one_hot: that one validates its input on the host)
    greedy_rows = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
        -1, logits.argmax(-1, keepdim=True), 1.0)
    if s.all_greedy:
        return greedy_rows
    greedy = s.temperature == 0
    x = logits.float() / torch.where(greedy, 1.0, s.temperature).unsqueeze(1)
    if s.any_filter:
        if s.min_p is not None:
            # drop tokens less likely than min_p x the most likely one (vLLM: after temperature)
            p = x.softmax(-1)
            x = x.masked_fill(p < s.min_p.unsqueeze(1) * p.amax(-1, keepdim=True), float("-inf"))
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(x.shape[-1], device=x.device).unsqueeze(0)
        beyond_k = (s.top_k.unsqueeze(1) > 0) & (ranks >= s.top_k.unsqueeze(1))
        sorted_x = sorted_x.masked_fill(beyond_k, float("-inf"))
        p_sorted = sorted_x.softmax(-1)
        # keep the smallest head whose mass reaches top_p: a token stays if the mass before it is short
        beyond_p = ((p_sorted.cumsum(-1) - p_sorted) >= s.top_p.unsqueeze(1)) & (s.top_p.unsqueeze(1) < 1.0)
        sorted_x = sorted_x.masked_fill(beyond_p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return torch.where(greedy.unsqueeze(1), greedy_rows, x.softmax(-1))


def sample(logits: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """logits [N, V] (raw) -> next tokens [N] int64."""
    logits = adjust_logits(logits, s)
    if s.all_greedy:
        return logits.argmax(-1)
    keys = stream_keys(s.seeds, s.output_index, STREAM_TARGET)
    return race(probabilities(logits, s), keys)


def draft(logits: torch.Tensor, s: SamplingBatch, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft one token per row from draft logits [N, V'] (V' <= vocab_size: a reduced draft vocabulary).

    Returns tokens [N] and the draft distribution q over the full vocabulary [N, vocab_size]
    (None when every row is greedy: verification then needs only the tokens)."""
    logits = adjust_logits(logits, s)
    if s.all_greedy:
        return logits.argmax(-1), None
    q = probabilities(logits, s)
    if q.shape[-1] < vocab_size:
        q = torch.nn.functional.pad(q, (0, vocab_size - q.shape[-1]))
    return race(q, stream_keys(s.seeds, s.output_index, STREAM_DRAFT)), q


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           num_drafts: torch.Tensor, s: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verification by rejection sampling; lossless for any draft distribution.

    Shapes: target_logits [B, k+1, V] (the target's raw logits after x_{n-1}, d_1, ..., d_k);
    draft_tokens [B, k]; draft_probs [B, k, V] (q_i, None if every row is greedy); num_drafts [B],
    each row's own k_r <= k. `s` holds one row per request, its output_index that of x_n.

    Definitions used in every statistic of this project:
    - *drafted*: the k_r draft tokens a round proposes for one request.
    - *accepted*: the leading drafts the target keeps. Draft d_i survives with probability
      min(1, p_i(d_i) / q_i(d_i)), tested only while all before it survived.
    - *bonus*: the one target token every round adds after its accepted drafts: sampled from
      p_{k_r} when all k_r drafts were accepted, else from the residual max(0, p_j - q_j)
      (renormalised) at the first rejected position j. A round thus emits accepted + 1 tokens,
      distributed exactly as sampling from the target token by token (Leviathan et al., 2023;
      Chen et al., 2023). With one-hot p and q (greedy) it keeps d_i iff d_i = argmax p_i and the
      bonus is argmax p_j: output identical to k = 0.

    Returns tokens [B, k+1] (accepted drafts, the bonus, then -1) and num_accepted [B].
    """
    bsz, k1, vocab = target_logits.shape
    k = k1 - 1
    rows = torch.arange(bsz, device=target_logits.device)
    positions = torch.arange(k, device=target_logits.device).unsqueeze(0)
    flat = s.repeat(k1, draft_tokens) if s.options is not None or not s.all_greedy else None
    if s.options is not None:           # each position's options see the history up to it
        target_logits = adjust_logits(target_logits.reshape(bsz * k1, vocab), flat).view(bsz, k1, vocab)
    if s.all_greedy:
        target_top = target_logits.argmax(-1)                                     # [B, k+1]
        keep = (draft_tokens == target_top[:, :k]) & (positions < num_drafts.unsqueeze(1))
        num_accepted = keep.int().cumprod(-1).sum(-1)
        bonus = target_top[rows, num_accepted]
    else:
        p = probabilities(target_logits.reshape(bsz * k1, vocab), flat).view(bsz, k1, vocab)
        if draft_probs is None:   # cannot happen with a sampled row; kept for type clarity
            raise ValueError("draft_probs is required when a row samples")
        p_d = p[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)         # [B, k]
        q_d = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        u = uniforms(stream_keys(flat.seeds.view(bsz, k1)[:, :k].reshape(-1),
                                 flat.output_index.view(bsz, k1)[:, :k].reshape(-1), STREAM_ACCEPT), 1)
        keep = (u.view(bsz, k) * q_d < p_d) & (positions < num_drafts.unsqueeze(1))
        num_accepted = keep.int().cumprod(-1).sum(-1)
        p_j = p[rows, num_accepted]                                                # [B, V]
        q_j = draft_probs[rows, num_accepted.clamp(max=k - 1)]
        residual = (p_j - q_j).clamp(min=0)
        rejected = (num_accepted < num_drafts).unsqueeze(1)
        usable = residual.sum(-1, keepdim=True) > 0
        final_dist = torch.where(rejected & usable, residual, p_j)
        keys = stream_keys(s.seeds, s.output_index + num_accepted, STREAM_TARGET)
        bonus = race(final_dist, keys)
    out = torch.where(torch.arange(k1, device=rows.device).unsqueeze(0) < num_accepted.unsqueeze(1),
                      torch.nn.functional.pad(draft_tokens, (0, 1)), -1)
    out[rows, num_accepted] = bonus
    return out, num_accepted
