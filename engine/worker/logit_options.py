"""Per-request logit options on the device, with vLLM's semantics: presence, frequency and repetition
penalties, logit_bias, bad_words and min_tokens (docs/sampling.md).

Each is a function of the logits and the request's own history, never of the batch: a request
holding options has a slot in `LogitOptionPool`, written once when its prefill samples (prompt
tokens, outputs so far, its tables) and advanced on the device by every round with the tokens the
round kept (`advance`, inside the round and its CUDA graph: no host work per token). A row of
logits reads its slot plus the tokens its position adds to the history (`LogitOptionRows.extra`:
the drafts before a draft or verify position), so under speculation each verify position sees the
counts as of that position and greedy output with k drafts equals k = 0. Requests without options
read the scratch slot, which is neutral (zero counts, penalties off, no tables) and never advanced.

Order, as vLLM's sampler: bad words and min_tokens (-inf), logit_bias (+), then the repetition
penalty (prompt or output tokens: positive logits divided, negative multiplied), frequency
(x output count) and presence (once per output token) penalties.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

WILDCARD = -3                    # a bad word's prefix slot that matches anything (shorter prefixes)
MAX_BAD_SEQUENCES = 2 * MAX_BAD_WORDS          # each word with and without a leading space
TAIL = MAX_BAD_WORD_TOKENS - 1                 # output tokens a bad word's prefix can span
MAX_MIN_TOKEN_STOPS = MAX_STOP_TOKEN_IDS + 16  # stop token ids plus the model's EOS ids


def option_slots(max_batch: int) -> int:
    """Slots a runner keeps: one per decode seat and per parked request (at most max_batch each)."""
    return 2 * max_batch


class LogitOptionPool:
    """Slots of per-request option state, [rows + 1] (the last is the neutral scratch slot)."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device):
        n = rows + 1
        self.scratch = rows
        self.vocab_size = vocab_size
        self.device = device
        z = lambda *shape, dtype=torch.float32, value=0: torch.full(shape, value, dtype=dtype, device=device)  # noqa: E731
        self.counts = z(n, vocab_size)                                     # [S, V] float32: output-token counts
        self.prompt = z(n, vocab_size, dtype=torch.bool, value=False)      # [S, V] bool: tokens of the prompt
        self.penalties = torch.tensor([[0.0, 0.0, 1.0]], device=device).repeat(n, 1)   # [S, 3]: presence, frequency, repetition
        self.min_tokens = z(n, dtype=torch.int64)                          # [S]
        self.stop_ids = z(n, MAX_MIN_TOKEN_STOPS, dtype=torch.int64)       # [S, E] masked while output < min_tokens
        self.stop_on = z(n, MAX_MIN_TOKEN_STOPS)                           # [S, E] 1 = a real entry, 0 = padding
        self.bias_ids = z(n, MAX_LOGIT_BIAS, dtype=torch.int64)            # [S, NB]
        self.bias = z(n, MAX_LOGIT_BIAS)                                   # [S, NB] (padding adds 0)
        self.bad_prefix = z(n, MAX_BAD_SEQUENCES, TAIL, dtype=torch.int64, value=WILDCARD)  # [S, W, T] right-aligned
        self.bad_last = z(n, MAX_BAD_SEQUENCES, dtype=torch.int64, value=-1)               # [S, W]; -1 = unused
        self.tail = z(n, TAIL, dtype=torch.int64, value=-1)                # [S, T]: last output tokens, -1 = none
        self.slots: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    @staticmethod
    def bytes_for(rows: int, vocab_size: int) -> int:
        """Device bytes of a pool of `rows` slots (the memory plan counts them)."""
        per_slot = vocab_size * 5 + MAX_MIN_TOKEN_STOPS * 12 + MAX_LOGIT_BIAS * 12 + MAX_BAD_SEQUENCES * 8 * (TAIL + 1)
        return (rows + 1) * (per_slot + 8 * (TAIL + 4))

    # -- slots (host) -------------------------------------------------------------------------------

    def slot_of(self, request_id: str) -> int:
        return self.slots.get(request_id, self.scratch)

    def fill(self, request_id: str, prompt_ids: list[int], output_ids: list[int], params, stop_ids,
             bad_words: tuple[tuple[int, ...], ...]) -> int:
        """Take (or reuse) the request's slot and write its state: the history so far and its tables."""
        slot = self.slots.get(request_id)
        if slot is None:
            slot = self.slots[request_id] = self._free.pop()
        dev, i64 = self.device, torch.int64
        self.counts[slot].zero_()
        if output_ids:
            self.counts[slot].index_add_(0, torch.tensor(output_ids, dtype=i64, device=dev),
                                         torch.ones(len(output_ids), device=dev))
        self.prompt[slot].zero_()
        self.prompt[slot, torch.tensor(prompt_ids, dtype=i64, device=dev)] = True
        self.penalties[slot] = torch.tensor([params.presence_penalty, params.frequency_penalty,
                                             params.repetition_penalty], device=dev)
        self.min_tokens[slot] = params.min_tokens
        stops = sorted(stop_ids)[:MAX_MIN_TOKEN_STOPS] if params.min_tokens else []
        self.stop_ids[slot] = _padded(stops, MAX_MIN_TOKEN_STOPS, 0, dev)
        self.stop_on[slot] = _padded([1.0] * len(stops), MAX_MIN_TOKEN_STOPS, 0.0, dev)
        bias = params.logit_bias or {}
        self.bias_ids[slot] = _padded(list(bias), MAX_LOGIT_BIAS, 0, dev)
        self.bias[slot] = _padded(list(bias.values()), MAX_LOGIT_BIAS, 0.0, dev)
        prefix = torch.full((MAX_BAD_SEQUENCES, TAIL), WILDCARD, dtype=i64)
        last = torch.full((MAX_BAD_SEQUENCES,), -1, dtype=i64)
        for w, ids in enumerate(bad_words):
            last[w] = ids[-1]
            if len(ids) > 1:
                prefix[w, TAIL - (len(ids) - 1):] = torch.tensor(ids[:-1])
        self.bad_prefix[slot] = prefix.to(dev)
        self.bad_last[slot] = last.to(dev)
        tail = output_ids[-TAIL:]
        self.tail[slot] = _padded([-1] * (TAIL - len(tail)) + list(tail), TAIL, -1, dev)
        return slot

    def copy(self, src_request_id: str, dst_request_id: str) -> int:
        """A slot for `dst` holding what `src`'s holds (a forked sequence: the same history so far)."""
        src = self.slots[src_request_id]
        dst = self.slots.get(dst_request_id)
        if dst is None:
            dst = self.slots[dst_request_id] = self._free.pop()
        for t in (self.counts, self.prompt, self.penalties, self.min_tokens, self.stop_ids, self.stop_on,
                  self.bias_ids, self.bias, self.bad_prefix, self.bad_last, self.tail):
            t[dst] = t[src]
        return dst

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            slot = self.slots.pop(rid, None)
            if slot is not None:
                self._free.append(slot)

    # -- the device ------------------------------------------------------------------------------

    def advance(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add a round's kept tokens to the history of their slots (the scratch slot stays neutral).
        slots [B] int64; tokens [B, w] int64, -1 after each row's last."""
        live = slots != self.scratch                                               # [B]
        kept = (tokens >= 0) & live.unsqueeze(1)                                   # [B, w]
        rows = slots.unsqueeze(1).expand_as(tokens)
        self.counts.index_put_((rows, tokens.clamp(min=0)), kept.float(), accumulate=True)
        emitted = kept.sum(1)                                                      # [B]
        history = torch.cat([self.tail[slots], tokens.clamp(min=-1)], dim=1)       # [B, T + w]
        offsets = emitted.unsqueeze(1) + torch.arange(TAIL, device=slots.device)
        self.tail[slots] = torch.where(live.unsqueeze(1), history.gather(1, offsets), self.tail[slots])


def _padded(values: list, size: int, pad, device) -> torch.Tensor:
    dtype = torch.float32 if isinstance(pad, float) else torch.int64
    out = torch.full((size,), pad, dtype=dtype)
    if values:
        out[:len(values)] = torch.tensor(values, dtype=dtype)
    return out.to(device)


@dataclass
class LogitOptionRows:
    """Which slot each row of logits reads, and the tokens its position adds after the slot's state.

    extra [N, m] int64: the row's request's drafts (m may be 0); num_extra [N] int64: how many of
    them precede this row's position (draft or verify position j: j)."""

    pool: LogitOptionPool
    slots: torch.Tensor           # [N] int64
    extra: torch.Tensor           # [N, m] int64
    num_extra: torch.Tensor       # [N] int64

    @classmethod
    def at_slots(cls, pool: LogitOptionPool, slots: torch.Tensor) -> "LogitOptionRows":
        """Rows whose position follows the slot's history directly (a prefill's sample, k = 0)."""
        n = slots.shape[0]
        return cls(pool, slots, torch.zeros(n, 0, dtype=torch.int64, device=slots.device),
                   torch.zeros(n, dtype=torch.int64, device=slots.device))

    def with_drafts(self, drafts: torch.Tensor) -> "LogitOptionRows":
        """The same rows after all of `drafts` [N, j] (the position of draft j + 1)."""
        return replace(self, extra=drafts, num_extra=torch.full_like(self.num_extra, drafts.shape[1]))

    def verify_positions(self, drafts: torch.Tensor) -> "LogitOptionRows":
        """Rows [B] -> [B * (k+1)], row-major: position j of request b follows drafts[b, :j]."""
        k1 = drafts.shape[1] + 1
        rep = lambda x: x.repeat_interleave(k1, dim=0)  # noqa: E731
        steps = torch.arange(k1, device=drafts.device).repeat(self.slots.shape[0])
        return LogitOptionRows(self.pool, rep(self.slots), rep(drafts), steps)


def apply(logits: torch.Tensor, rows: LogitOptionRows, output_index: torch.Tensor) -> torch.Tensor:
    """logits [N, V'] float32 (V' <= vocab: a draft vocabulary is its first V' ids) -> adjusted logits.

    output_index [N]: the index among the request's outputs of the token this row picks."""
    pool, slots = rows.pool, rows.slots
    n, vocab = logits.shape
    dev = logits.device
    ids_in = lambda ids: ids < vocab  # noqa: E731
    # the history at each row: the slot's, then the row's first num_extra extra tokens
    counts = pool.counts[slots, :vocab]                                           # [N, V']
    tail = pool.tail[slots]                                                       # [N, T]
    m = rows.extra.shape[1]
    if m:
        use = (torch.arange(m, device=dev).unsqueeze(0) < rows.num_extra.unsqueeze(1)) & (rows.extra >= 0)
        use = use & ids_in(rows.extra)
        counts = counts.scatter_add(1, rows.extra.clamp(0, vocab - 1), use.float())
        history = torch.cat([tail, rows.extra], dim=1)                            # [N, T + m]
        tail = history.gather(1, rows.num_extra.unsqueeze(1) + torch.arange(pool.tail.shape[1], device=dev))
    # bad words: ban the last token of each word whose prefix the history ends with
    prefix, last = pool.bad_prefix[slots], pool.bad_last[slots]                   # [N, W, T], [N, W]
    hit = ((prefix == WILDCARD) | (prefix == tail.unsqueeze(1))).all(-1) & (last >= 0) & ids_in(last)
    banned = torch.zeros_like(logits).scatter_add_(1, last.clamp(0, vocab - 1), hit.float())
    # min_tokens: EOS and the stop token ids while the output is shorter
    stop_ids = pool.stop_ids[slots]
    short = (output_index < pool.min_tokens[slots]).unsqueeze(1)
    stop_on = pool.stop_on[slots] * (short & ids_in(stop_ids))
    banned = banned.scatter_add_(1, stop_ids.clamp(0, vocab - 1), stop_on)
    logits = logits.masked_fill(banned > 0, float("-inf"))
    # logit_bias (each id once: padding adds 0.0, so the sum is exact in any order)
    bias_ids = pool.bias_ids[slots]
    logits = logits.scatter_add(1, bias_ids.clamp(0, vocab - 1),
                                torch.where(ids_in(bias_ids), pool.bias[slots], 0.0))
    # penalties
    presence, frequency, repetition = pool.penalties[slots].unbind(-1)            # [N] each
    seen = counts > 0
    factor = torch.where(pool.prompt[slots, :vocab] | seen, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * seen.float()
