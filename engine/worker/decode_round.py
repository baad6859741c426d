"""One decode round as a pure device function: no host reads, fixed shapes, so it can be captured
in a CUDA graph per batch-size bucket and replayed (`engine.worker.cuda_graphs`). The CPU runs the very
same function eagerly.

With k drafts (MTP formulas in `engine.models.qwen3.MTPModule`):
  1. MTP step 1 recomputes from real target hidden states the MTP entries of positions
     m0 .. n-2 that the last target forward finalised (1 to k+1 of them, padded to k+1 so the shape
     is fixed; padded rows write slots that later steps overwrite before anything reads them) and
     drafts d_1 from the last real one;
  2. MTP steps 2..k feed (g, d_{j-1}) at positions n-1, n, ... and draft d_j;
  3. the target verifies [x_{n-1}, d_1 .. d_k] at positions n-1 .. n-1+k in one forward, and
     `sampler.verify` keeps the accepted drafts plus one bonus token;
  4. that forward's hidden states go back to the request's row of the hidden pool for the next
     round's step 1.
With k = 0 a round is one target forward and one sample.

Carried rows (async scheduling, engine.worker.async_rounds): the host packs round N+1 before it has read round
N's tokens. What N+1 needs from N is a function of N's tokens alone: a row that continues row r of
round N emitted `e = accepted + 1` tokens there (tokens [r, :e], -1 after), so x_{n-1} = tokens[r, e-1]
(the bonus token), n = n_N + e (the host packs n_N), the output index advances by e, and step 1's
MTP window is those e tokens (m0 = n_N - 1 is known on the host). Every round keeps its tokens in a
persistent buffer (`keep_last_tokens`) and the next round's carried rows read it (`carry_forward`),
both inside the round's CUDA graph: no extra launch, no host read. Rows packed whole (carry row -1)
pass unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine import envs
from engine.sched.scheduler import DecodeWork, ModelOutput
from engine.worker import logprobs as engine_logprobs
from engine.worker.logprobs import as_token_logprobs, rows_to_host
from engine.worker import sampler
from engine.worker.forward_context import ForwardContext, forward_context
from engine.worker.logit_options import LogitOptionPool, LogitOptionRows
from engine.worker.mtp_hidden_pool import HiddenStatePool
from engine.models.qwen3 import Qwen3ForCausalLM

# int64 rows per request at the head of a round's packed ints, float32 rows (RoundInputs.from_packed)
ROWS = 12
FLOAT_ROWS = 3
# the round's bookkeeping on CUDA in one launch each (engine.kernels.elementwise.round_prep): the served qwen3-8b bf16
# step 4.427 -> 4.393 ms (bench/results/2026-12-01-h200-gemv-tiles/b-ab-small-kernels-bf16-tiles); NINFER_FUSED_ROUND_PREP=0
# restores the torch ops
FUSED_ROUND_PREP = envs.FUSED_ROUND_PREP.read()


def sampling_variant(works: list) -> sampler.SamplingVariant:
    """Which sampling code a round's graph runs, from its requests' settings."""
    return sampler.SamplingVariant.of([w.sampling for w in works])


@dataclass
class RoundOutput:
    """What a round leaves on the device: tokens [B, drafts+1] (accepted drafts, the bonus, then -1),
    num_accepted [B], and with a logprobs variant the logprobs at each emitted position."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    logprobs: engine_logprobs.RoundLogprobs | None = None

    def rows(self, n: int) -> "RoundOutput":
        """The first n rows (a graph bucket's padding dropped)."""
        lp = self.logprobs
        return RoundOutput(self.tokens[:n], self.num_accepted[:n], None if lp is None else
                           engine_logprobs.RoundLogprobs(*(t[:n] for t in lp.tensors())))


@dataclass(frozen=True)
class RoundSetup:
    """What every decode round of one rank needs besides its inputs. The runner builds it once and
    hands it to the eager rounds and to the graphed ones (`engine.worker.cuda_graphs`)."""

    model: Qwen3ForCausalLM
    hidden: HiddenStatePool | None    # None without MTP (k = 0)
    k: int                            # draft tokens per round
    block_size: int
    max_blocks: int                   # block-table width of a graphed round (the context limit's blocks)
    max_seq_len: int                  # the context limit plus draft slots, in positions
    null_block: int                   # scratch KV block the padded rows of a bucket write
    max_batch: int                    # scratch hidden-pool row of padded rows
    draft_vocab: int | None           # draft over the first N token ids; None = all
    device: torch.device
    scratch_slot: int = 0             # hybrids: the state slot padded rows step (engine.worker.state_pool)
    adaptive: bool = False            # rounds draft fewer than k when the scheduler says (round_drafts)
    # [max_batch, k+1] int64: the last round's tokens (-1 padded), read by the next round's carried
    # rows (carry_forward); None: no round carries (rows are packed from the host only)
    last_tokens: torch.Tensor | None = None
    # per-request logit options (penalties, bias, bad words, min_tokens): the slots rounds read and advance
    options: LogitOptionPool | None = None
    # [max_batch, k+1, ceil(V/32)] int32: grammar masks of a constrained round (structured output), row j
    # for the logits after the request's j-th draft; all ones for unconstrained rows. Filled on the host
    # (engine.structured.round_masks) and copied in before the round; a captured round reads it in place.
    token_masks: torch.Tensor | None = None

    @property
    def pool_rows(self) -> dict[str, int]:
        return self.hidden.rows if self.hidden is not None else {}


def round_drafts(setup: RoundSetup, works: list) -> int:
    """Draft steps of this round: k, or with an adaptive draft length the most any request drafts
    (the MTP window of step 1 stays k + 1 whatever the round drafts: see run_round)."""
    return max(w.draft_tokens for w in works) if setup.adaptive else setup.k


@dataclass
class RoundInputs:
    """Device tensors of one round for B requests (a graph's static buffers when graphed)."""

    last_ids: torch.Tensor        # [B] int64: x_{n-1}, the token whose target KV is not written yet
    num_tokens: torch.Tensor      # [B] int64: n
    mtp_start: torch.Tensor       # [B] int64: m0, first position whose MTP entry step 1 recomputes
    mtp_counts: torch.Tensor      # [B] int64: n - 1 - m0, in 1 .. k+1
    mtp_ids: torch.Tensor         # [B, k+1] int64: x_{m0+1} .. x_{n-1}, zero-padded
    pool_rows: torch.Tensor       # [B] int64: each request's row in the hidden-state pool
    block_tables: torch.Tensor    # [B, W] int32
    temperature: torch.Tensor     # [B] float32
    top_k: torch.Tensor           # [B] int64
    top_p: torch.Tensor           # [B] float32
    min_p: torch.Tensor           # [B] float32
    seeds: torch.Tensor           # [B] int64
    output_index: torch.Tensor    # [B] int64: index of x_n among the request's outputs
    num_drafts: torch.Tensor      # [B] int64: each request's own k (<= k)
    state_slots: torch.Tensor     # [B] int64: linear-attention state slot (hybrids; scratch otherwise)
    carry_rows: torch.Tensor      # [B] int64: row of the last round this row continues; -1 = packed whole
    option_slots: torch.Tensor    # [B] int64: the request's slot of logit options (the neutral scratch slot: none)

    @classmethod
    def from_packed(cls, ints: torch.Tensor, floats: torch.Tensor, tables: torch.Tensor, k: int) -> "RoundInputs":
        """Views into three flat buffers (one host-to-device copy each):
        ints [ROWS * B + B * (k+1)] int64, floats [FLOAT_ROWS * B] float32, tables [B, W] int32."""
        bsz = tables.shape[0]
        i = ints[:ROWS * bsz].view(ROWS, bsz)
        f = floats.view(FLOAT_ROWS, bsz)
        return cls(last_ids=i[0], num_tokens=i[1], mtp_start=i[2], mtp_counts=i[3],
                   mtp_ids=ints[ROWS * bsz:].view(bsz, k + 1), pool_rows=i[4], block_tables=tables,
                   temperature=f[0], top_k=i[5], top_p=f[1], min_p=f[2], seeds=i[6], output_index=i[7],
                   num_drafts=i[8], state_slots=i[9], carry_rows=i[10], option_slots=i[11])

    def sampling(self, variant: sampler.SamplingVariant, options: LogitOptionPool | None) -> sampler.SamplingBatch:
        rows = (LogitOptionRows.at_slots(options, self.option_slots)
                if variant.any_options and options is not None else None)
        return sampler.SamplingBatch(self.temperature, self.top_k, self.top_p, self.seeds, self.output_index,
                                     all_greedy=variant.all_greedy, any_filter=variant.any_filter,
                                     min_p=self.min_p, options=rows)


def uniform_context(start: torch.Tensor, query_len: int, block_tables: torch.Tensor, block_size: int,
                    max_seq_len: int, state_slots: torch.Tensor | None = None,
                    defer_state_commit: bool = False) -> tuple[torch.Tensor, ForwardContext]:
    """B sequences each adding `query_len` tokens at positions start .. start+query_len-1.

    start: [B] int64 -> positions [B * query_len] and the context, computed on the device (on CUDA in one
    launch: engine.kernels.elementwise.round_prep; these torch ops are its reference)."""
    if start.is_cuda and FUSED_ROUND_PREP:
        from engine.kernels.elementwise import round_prep
        positions, slot_mapping, seq_lens, query_start_loc = round_prep.uniform_context(
            start, query_len, block_tables, block_size)
    else:
        bsz = start.shape[0]
        offsets = torch.arange(query_len, device=start.device)
        positions = (start.unsqueeze(1) + offsets).flatten()                            # [B * q]
        rows = torch.arange(bsz, device=start.device).repeat_interleave(query_len)
        blocks = block_tables[rows, positions // block_size].to(torch.int64)
        slot_mapping = blocks * block_size + positions % block_size
        query_start_loc = (torch.arange(bsz + 1, device=start.device) * query_len).to(torch.int32)
        seq_lens = (start + query_len).to(torch.int32)
    ctx = ForwardContext(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=query_len,
        max_seq_len=max_seq_len,
        uniform_query_len=query_len,
        state_slots=state_slots,
        defer_state_commit=defer_state_commit,
    )
    return positions, ctx


DraftHook = Callable[[int, torch.Tensor], None]   # (j, drafts [B] of step j): token_masks[:, j + 1] filled


def masked(logits: torch.Tensor, setup: RoundSetup, rows: slice | int, draft: bool = False) -> torch.Tensor:
    """Structured output: logits [B, w, V] (or [B, V] for one row) under token_masks[:B, rows]."""
    from engine.structured.bitmask import apply_token_mask
    bsz = logits.shape[0]
    mask = setup.token_masks[:bsz, rows]
    return apply_token_mask(logits.reshape(-1, logits.shape[-1]), mask.reshape(-1, mask.shape[-1]),
                            keep_empty_rows=draft).view(logits.shape)


@torch.inference_mode()
def run_round(setup: RoundSetup, inp: RoundInputs, max_seq_len: int, variant: sampler.SamplingVariant,
              drafts: int | None = None, on_draft: DraftHook | None = None) -> RoundOutput:
    """-> tokens [B, drafts+1] (accepted drafts, bonus, then -1), num_accepted [B] and (a logprobs
    variant) each emitted token's raw logprob and the top alternatives at its position.

    `drafts` (default k) is the round's number of draft steps (an adaptive draft length runs fewer).
    Step 1 still recomputes a window of k + 1 MTP entries (the previous round may have accepted k),
    so a round of 0 drafts keeps the MTP layer's KV current and verifies x_{n-1} alone.

    The hidden pool's rows ([rows, k+1, hidden]) are updated in place with this round's target hidden
    states. `max_seq_len` bounds the round's longest context (the attention kernel plans its split by it).

    A constrained variant (structured output) masks every logits row it samples from by
    `setup.token_masks` -- the target's at verify position j and the draft of step j + 1 by row j --
    before the logit options, the sampler and the logprobs see them (the logprobs are the model's
    distribution over the tokens the grammar allows, as vLLM reports them). Row 0 is filled before the
    round; with drafts, `on_draft(j, d)` fills row j + 1 from draft j on the host (the matcher advanced by
    the drafts so far), so a round of a constrained batch with k > 0 runs eagerly."""
    if setup.last_tokens is not None:
        inp = carry_forward(inp, setup.last_tokens)
    out = _run_round(setup, inp, max_seq_len, variant, drafts, on_draft)
    if setup.last_tokens is not None:
        keep_last_tokens(setup.last_tokens, out.tokens)
    if variant.any_options and setup.options is not None:
        setup.options.advance(inp.option_slots, out.tokens)   # the next round's history includes these
    return out


def _run_round(setup: RoundSetup, inp: RoundInputs, max_seq_len: int, variant: sampler.SamplingVariant,
               drafts: int | None, on_draft: DraftHook | None = None) -> RoundOutput:
    model, k, block_size, draft_vocab = setup.model, setup.k, setup.block_size, setup.draft_vocab
    hidden_pool = setup.hidden.states if setup.hidden is not None else None
    drafts = k if drafts is None else drafts
    all_greedy, constrained = variant.all_greedy, variant.constrained
    s = inp.sampling(variant, setup.options)
    tables = inp.block_tables
    if k == 0:
        positions, ctx = uniform_context(inp.num_tokens - 1, 1, tables, block_size, max_seq_len, inp.state_slots)
        with forward_context(ctx):
            logits = model.compute_logits(model(inp.last_ids, positions))
        if constrained:
            logits = masked(logits, setup, 0)
        tokens = sampler.sample(logits, s).unsqueeze(1)
        return RoundOutput(tokens, torch.zeros_like(inp.num_tokens),
                           engine_logprobs.compute(logits.unsqueeze(1), tokens) if variant.logprobs else None)

    bsz = inp.last_ids.shape[0]
    rows = torch.arange(bsz, device=inp.last_ids.device)
    vocab = model.cfg.vocab_size
    positions, ctx = uniform_context(inp.mtp_start, k + 1, tables, block_size, max_seq_len)
    with forward_context(ctx):
        g = model.draft_hidden(inp.mtp_ids.flatten(), hidden_pool[inp.pool_rows].flatten(0, 1), positions)
    g = g.view(bsz, k + 1, -1)[rows, inp.mtp_counts - 1]                                # [B, hidden]

    draft_list, draft_probs = [], []
    for j in range(drafts):
        so_far = torch.stack(draft_list, dim=1) if draft_list else inp.mtp_ids[:, :0]      # [B, j]
        draft_logits = model.compute_logits(g, draft_vocab)
        if constrained:
            draft_logits = masked(draft_logits, setup, j, draft=True)
        d, q = sampler.draft(draft_logits, s.shifted(j, so_far), vocab)
        if on_draft is not None:
            on_draft(j, d)
        draft_list.append(d)
        draft_probs.append(q)
        if j + 1 < drafts:
            positions, ctx = uniform_context(inp.num_tokens - 1 + j, 1, tables, block_size, max_seq_len)
            with forward_context(ctx):
                g = model.draft_hidden(d, g, positions)

    width = drafts + 1
    verify_ids = torch.stack([inp.last_ids, *draft_list], dim=1)                         # [B, drafts+1]
    hybrid = hasattr(model, "commit_linear_states")
    positions, ctx = uniform_context(inp.num_tokens - 1, width, tables, block_size, max_seq_len, inp.state_slots,
                                     defer_state_commit=hybrid)
    with forward_context(ctx):
        hidden = model(verify_ids.flatten(), positions)                                  # [B(drafts+1), hidden]
    logits = model.compute_logits(hidden).view(bsz, width, -1)
    if constrained:
        logits = masked(logits, setup, slice(0, width))
    if drafts == 0:
        tokens, num_accepted = sampler.sample(logits[:, 0], s).unsqueeze(1), torch.zeros_like(inp.num_tokens)
    else:
        q = None if all_greedy else torch.stack(draft_probs, dim=1)
        tokens, num_accepted = sampler.verify(logits, verify_ids[:, 1:], q, inp.num_drafts, s)
    if hybrid:          # linear layers keep the state after x_{n-1} and the accepted drafts only
        model.commit_linear_states(num_accepted + 1)
    # rows 0 .. drafts of each request's pool slot: the next round's step 1 reads accepted + 1 of them
    hidden_pool[inp.pool_rows, :width] = hidden.view(bsz, width, -1)
    # the verify pass's logits at position j are the target's after x_{n-1}, d_1 .. d_j: the same
    # distribution k = 0 would report for the token emitted there
    return RoundOutput(tokens, num_accepted, engine_logprobs.compute(logits, tokens) if variant.logprobs else None)


def carry_forward(inp: RoundInputs, last_tokens: torch.Tensor) -> RoundInputs:
    """The round's inputs with its carried rows completed from the last round's tokens.

    last_tokens: [max_batch, k+1] int64, the last round's tokens (-1 after each row's last). On CUDA one
    launch (engine.kernels.elementwise.round_prep); these torch ops are its reference."""
    if last_tokens.is_cuda and FUSED_ROUND_PREP:
        from engine.kernels.elementwise import round_prep
        last_ids, num_tokens, mtp_counts, mtp_ids, output_index = round_prep.carry_forward(
            inp.carry_rows, last_tokens, inp.last_ids, inp.num_tokens, inp.mtp_counts, inp.mtp_ids, inp.output_index)
        return replace(inp, last_ids=last_ids, num_tokens=num_tokens, mtp_counts=mtp_counts, mtp_ids=mtp_ids,
                       output_index=output_index)
    carried = inp.carry_rows >= 0                                                   # [B]
    prev = last_tokens[inp.carry_rows.clamp(min=0)]                                  # [B, k+1]
    emitted = (prev >= 0).sum(1)                                                     # [B]: accepted + 1
    added = torch.where(carried, emitted, 0)
    bonus = prev.gather(1, (emitted - 1).clamp(min=0).unsqueeze(1)).squeeze(1)      # [B]
    return replace(
        inp,
        last_ids=torch.where(carried, bonus, inp.last_ids),
        num_tokens=inp.num_tokens + added,
        mtp_counts=torch.where(carried, emitted, inp.mtp_counts),
        mtp_ids=torch.where(carried.unsqueeze(1), prev.clamp(min=0), inp.mtp_ids),
        output_index=inp.output_index + added)


def keep_last_tokens(last_tokens: torch.Tensor, tokens: torch.Tensor) -> None:
    """Store a round's tokens [B, drafts+1] in rows :B of last_tokens [max_batch, k+1] (-1 padded)."""
    bsz, width = tokens.shape
    if width < last_tokens.shape[1]:                  # an adaptive round that drafted fewer than k
        tokens = torch.nn.functional.pad(tokens, (0, last_tokens.shape[1] - width), value=-1)
    last_tokens[:bsz].copy_(tokens)


def pack_round(setup: RoundSetup, works: list, batch: int, width: int,
               out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None):
    """Host arrays of a round for `batch` rows (rows past len(works) are padding that writes only
    the scratch block and the scratch pool row). `out` reuses (pinned) staging arrays."""
    k, null_block, scratch_row, pool_row = setup.k, setup.null_block, setup.max_batch, setup.pool_rows
    scratch_slot = setup.scratch_slot
    options = setup.options
    scratch_options = options.scratch if options is not None else 0
    ints, floats, tables = out if out is not None else (
        np.zeros(ROWS * batch + batch * (k + 1), np.int64), np.zeros(FLOAT_ROWS * batch, np.float32),
        np.zeros((batch, width), np.int32))
    i = ints[:ROWS * batch].reshape(ROWS, batch)
    mtp = ints[ROWS * batch:].reshape(batch, k + 1)
    f = floats.reshape(FLOAT_ROWS, batch)
    i[:] = 0
    i[1], i[3], i[4] = 1, 1, scratch_row            # padding: n = 1, one MTP row, scratch pool row
    i[9] = scratch_slot                             # and the scratch state slot
    i[10] = -1                                      # nothing carried from the last round
    i[11] = scratch_options                         # and the neutral option slot
    mtp[:] = 0
    f[0], f[1], f[2] = 0.0, 1.0, 0.0
    tables[:] = null_block
    for r, w in enumerate(works):
        i[:, r] = (w.last_token_id, w.num_tokens, w.num_mtp_computed, w.num_tokens - 1 - w.num_mtp_computed,
                   pool_row.get(w.request_id, scratch_row), w.sampling.top_k, w.seed, w.output_index,
                   w.draft_tokens, w.state_slot if w.state_slot >= 0 else scratch_slot, w.carry_row,
                   options.slot_of(w.request_id) if options is not None else 0)
        f[:, r] = (w.sampling.temperature, w.sampling.top_p, w.sampling.min_p)
        if k > 0:
            mtp[r, :len(w.mtp_token_ids)] = w.mtp_token_ids
        tables[r, :len(w.block_ids)] = w.block_ids
    return ints, floats, tables


def read_round(works: list[DecodeWork], out: RoundOutput, result: ModelOutput) -> None:
    """The round's device-to-host read: tokens [>= len(works), k+1] (-1 after the last kept), and the
    logprobs of the rows that asked for them."""
    wanted = [(r, w) for r, w in enumerate(works) if w.sampling.logprobs is not None]
    for w, row in zip(works, out.tokens.tolist()):
        result.sampled[w.request_id] = [t for t in row if t >= 0]
    if wanted and out.logprobs is not None:
        rows = rows_to_host(out.logprobs, [r for r, _ in wanted],
                            [len(result.sampled[w.request_id]) for _, w in wanted],
                            [w.sampling.logprobs for _, w in wanted])
        for (_, w), host in zip(wanted, rows):
            result.logprobs[w.request_id] = as_token_logprobs(result.sampled[w.request_id], host)
