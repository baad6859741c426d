"""Turns scheduler output into tensors, runs the model, samples and verifies. One host read per step.

Prefill chunks run eagerly (one packed chunk of the lane's prompts per step). Decode rounds run through
`engine.worker.decode_round.run_round`, replayed from a CUDA graph of the smallest batch bucket that
fits when graphs are captured (`engine.worker.cuda_graphs`), eagerly otherwise.

Each request holding KV also holds a row of the hidden-state pool (`engine.worker.mtp_hidden_pool`). The extra
KV block at the end of the pool is scratch for the padded rows of a graph bucket.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import structlog
import torch

from engine.worker import sampler
from engine.config import EngineConfig, ModelConfig
from engine.worker.decode_round import (RoundInputs, RoundOutput, RoundSetup, pack_round, read_round, round_drafts,
                                        run_round, sampling_variant)
from engine.worker.logprobs import as_token_logprobs, prompt_logprobs, rows_to_host
from engine.worker import logprobs as engine_logprobs
from engine.worker.forward_context import build_forward_context, forward_context
from engine.worker.logit_options import LogitOptionPool, LogitOptionRows, option_slots
from engine.worker.mtp_hidden_pool import HiddenStatePool
from engine.worker.async_rounds import why_synchronous
from engine.worker.paged_kv import LayerKV
from engine.models.registry import model_class
from engine.distributed.tp_group import SINGLE_RANK, TPGroup
from engine.sched.scheduler import DecodeWork, ModelOutput, PrefillWork, SchedulerOutput
from engine.loading.hybrid_config import state_slot_counts
from engine.worker.state_pool import StateCache
from engine.structured.bitmask import apply_token_mask
from engine.structured.round_masks import RoundMasks

log = structlog.get_logger(__name__)


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def allocate_kv(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device) -> list[LayerKV]:
    """One pool for all layers (main then MTP): [layers, 2, blocks, block_size, kv_heads, head_dim]."""
    quantized = dtype == torch.int8
    pages = torch.zeros(num_layers, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    scales = (torch.ones(num_layers, 2, num_blocks, block_size, kv_heads, dtype=torch.float32, device=device)
              if quantized else None)
    return [LayerKV(pages[i, 0], pages[i, 1], scales[i, 0] if quantized else None,
                    scales[i, 1] if quantized else None) for i in range(num_layers)]


@dataclass
class PromptLogits:
    """Logits at every prompt position, collected chunk by chunk (scoring and tests)."""

    chunks: list[torch.Tensor]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights, num_blocks: int,
                 draft_tokens: int, max_model_len: int, tp: TPGroup = SINGLE_RANK,
                 device: torch.device | None = None, masks: RoundMasks | None = None):
        self.config = config
        self.tp = tp
        self.device = device or torch.device(config.device)
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.block_size = config.block_size
        self.k = draft_tokens
        self.max_batch = config.max_batch
        self.draft_vocab = config.draft_vocab or None
        # the context limit plus draft slots, in positions and in blocks per sequence
        self.max_seq_len = max_model_len + draft_tokens + 1
        self.max_blocks = -(-self.max_seq_len // self.block_size)
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = model_class(model_config)(model_config, tp, with_mtp=draft_tokens > 0,
                                          max_position=self.max_seq_len)
        stream = weights.on(self.device) if hasattr(weights, "on") else weights
        if self.dtype == torch.float16:
            from engine.loading.checkpoint import checked_for_float16
            stream = checked_for_float16(stream)      # a bf16 weight beyond float16's range is refused by name
        self.model.load_weights(stream)
        self.model.eval()
        kv_dtype = torch.int8 if config.kv_dtype_name == "int8" else getattr(torch, config.kv_dtype_name)
        layers = self.model.attention_layers()
        self.null_block = num_blocks                     # scratch block for padded rows
        self.kv = allocate_kv(len(layers), num_blocks + 1, self.block_size, layers[0].num_kv_heads,
                              layers[0].head_dim, kv_dtype, self.device)
        for layer, kv in zip(layers, self.kv):
            layer.kv = kv
        # hybrids: a linear-attention state slot per request seat (engine.worker.state_pool), plus scratch
        linear = self.model.linear_layers() if hasattr(self.model, "linear_layers") else []
        seats, snapshots = state_slot_counts(config, model_config)
        self.states = StateCache(linear, seats + snapshots, self.dtype, self.device) if linear else None
        self.scratch_slot = self.states.scratch_slot if self.states is not None else 0
        if linear and self.device.type == "cuda":
            from engine.kernels.gated_delta.fla import compile_for
            d = linear[0]
            compile_for(d.num_k_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim, self.dtype, self.device)
        # rows beyond the batch: parked requests (the scheduler's max_parked = max_batch) and the prefill lane
        self.hidden = (HiddenStatePool(self.max_batch, draft_tokens, model_config.hidden_size, self.dtype,
                                       self.device, extra_rows=self.max_batch + 1) if draft_tokens > 0 else None)
        # logit options of the requests that hold them: a slot per running or parked request, like the hidden pool
        self.options = LogitOptionPool(option_slots(self.max_batch), model_config.vocab_size, self.device)
        self.round_setup = RoundSetup(
            model=self.model, hidden=self.hidden, k=draft_tokens, block_size=self.block_size,
            max_blocks=self.max_blocks, max_seq_len=self.max_seq_len, null_block=self.null_block,
            max_batch=self.max_batch, draft_vocab=self.draft_vocab, device=self.device,
            scratch_slot=self.scratch_slot, adaptive=config.adaptive_draft and draft_tokens > 0,
            last_tokens=(torch.zeros(self.max_batch, draft_tokens + 1, dtype=torch.int64, device=self.device)
                         if not why_synchronous(config) else None),
            options=self.options,
            token_masks=(torch.full(masks.host.shape, -1, dtype=torch.int32, device=self.device)
                         if masks is not None else None))
        # structured output: the step's grammar masks, filled once on the host for every rank
        self.masks = masks
        self.graphs = None                               # engine.worker.cuda_graphs.GraphedRounds once captured
        self.prompt_logits: dict[str, PromptLogits] = {}
        # embeddings: request id -> list the final hidden state of its last prompt token is appended to
        self.last_hidden: dict[str, list[torch.Tensor]] = {}

    def capture_graphs(self, buckets: list[int]) -> float:
        from engine.worker.cuda_graphs import GraphedRounds
        graphs = GraphedRounds(self.round_setup, buckets, thread_local=self.tp.size > 1)
        seconds = graphs.capture()
        self.graphs = graphs                             # only a complete set is ever replayed
        return seconds

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, with_decode: bool = True) -> ModelOutput:
        """The step's prefill chunk, then (unless the executor replays it itself) its decode round."""
        self.release_rows(out.finished_request_ids)
        result = ModelOutput()
        if out.prefills:
            self._prefill(out.prefills, result)
        if out.decode and with_decode:
            self._decode(out.decode, result)
        return result

    def release_rows(self, request_ids: list[str]) -> None:
        if self.hidden is not None:
            self.hidden.release(request_ids)
        self.options.release(request_ids)

    def graphed(self, works: list[DecodeWork], variant: sampler.SamplingVariant | None = None) -> bool:
        # a constrained round with drafts fills its masks between the draft steps: eager
        variant = variant or sampling_variant(works)
        return (self.graphs is not None and self.graphs.fits(len(works))
                and not (self.k > 0 and variant.constrained))

    def upload_masks(self, rows: int) -> None:
        """Copy the first `rows` rows of the step's host masks into this rank's device buffer."""
        self.round_setup.token_masks[:rows].copy_(self.masks.host[:rows], non_blocking=True)
        if self.device.type == "cuda":
            self.masks.note_upload(torch.cuda.current_stream().record_event())

    def _draft_hook(self, rows: int):
        """Fills mask row j + 1 of every constrained request from its draft j (host, then this rank)."""
        def after_draft(j: int, drafts: torch.Tensor) -> None:
            self.round_setup.token_masks[:rows, j + 1].copy_(self.masks.draft_row(j, drafts))
        return after_draft

    # -- prefill --------------------------------------------------------------------------------

    def _prefill(self, pieces: list[PrefillWork], result: ModelOutput) -> None:
        """One forward over the step's packed chunk: each piece is a run of one prompt's tokens."""
        lens = [len(w.token_ids) for w in pieces]
        slots = None
        if self.states is not None:
            # hybrids: each piece runs from its request's state slot; every restore before the forward
            slots = [w.state_slot for w in pieces]
            for w in pieces:
                if w.restore_slot >= 0:                  # a prefix hit: its end's state snapshot
                    self.states.copy(w.restore_slot, w.state_slot)
                elif w.start == 0:
                    self.states.reset(w.state_slot)
        positions, ctx = build_forward_context(lens, [w.start + n for w, n in zip(pieces, lens)],
                                               [w.block_ids for w in pieces], self.block_size, self.device,
                                               state_slots=slots)
        ids = torch.tensor([t for w in pieces for t in w.token_ids], dtype=torch.int64)
        ends = list(accumulate(lens))                           # piece i holds rows [ends[i] - lens[i], ends[i])
        with forward_context(ctx):
            hidden = self.model(ids.to(self.device, non_blocking=True), positions)   # [T, hidden]
            if self.k > 0:
                # MTP entries of the chunk's positions; a prompt's last position waits for the sampled
                # token (round 1, step 1), which overwrites the placeholder written here.
                nxt = torch.zeros(len(ids), dtype=torch.int64)
                for w, end, n in zip(pieces, ends, lens):
                    nxt[end - n:end - n + len(w.next_token_ids)] = torch.tensor(w.next_token_ids, dtype=torch.int64)
                self.model.draft_hidden(nxt.to(self.device, non_blocking=True), hidden, positions)
        for w, end, n in zip(pieces, ends, lens):
            if w.snapshot_slot >= 0:
                self.states.copy(w.state_slot, w.snapshot_slot)
            collect = self.prompt_logits.get(w.request_id)
            if collect is not None or w.prompt_logprobs is not None:
                chunk_logits = self.model.compute_logits(hidden[end - n:end])            # [n, V]
                if collect is not None:
                    collect.chunks.append(chunk_logits.float().cpu())
                if w.prompt_logprobs is not None:       # each next prompt token, given what precedes it
                    result.prompt_logprobs[w.request_id] = prompt_logprobs(
                        chunk_logits, w.next_token_ids, w.prompt_logprobs)
        done = [(w, end - 1) for w, end in zip(pieces, ends) if w.sample]
        for w, row in done:
            pooled = self.last_hidden.get(w.request_id)
            if pooled is not None:
                pooled.append(hidden[row].float().cpu())                                 # [hidden]
        if not done:
            return
        for w, _ in done:
            self._fork(w)
        # one row per sequence: a sampling piece, then the sequences it forks (the same hidden state and
        # option slot -- their history is the prompt alone --, each with its own seed)
        parent_slots = [self._fill_options(w) for w, _ in done]
        rows = [(w.request_id, w, w.seed, i, parent_slots[i]) for i, (w, _) in enumerate(done)]
        rows += [(f.request_id, w, f.seed, i, parent_slots[i]) for i, (w, _) in enumerate(done) for f in w.forks]
        for rid, w, _, _, slot in rows:
            if rid != w.request_id and slot != self.options.scratch:
                self.options.copy(w.request_id, rid)
        last = hidden[[row for _, row in done]]                                          # [S, hidden]
        index = torch.tensor([i for _, _, _, i, _ in rows], dtype=torch.int64, device=self.device)
        slots = torch.tensor([slot for *_, slot in rows], dtype=torch.int64, device=self.device)
        s = sampler.SamplingBatch.build([w.sampling for _, w, *_ in rows], [seed for _, _, seed, *_ in rows],
                                        [w.output_index for _, w, *_ in rows], self.device,
                                        options=LogitOptionRows.at_slots(self.options, slots))
        logits = self.model.compute_logits(last).index_select(0, index)                 # [R, V]
        if self.masks is not None and self.masks.prefill_active:
            # structured output: a piece's mask (its sequences' grammars all start where it ends)
            mask = self.masks.prefill_host[:len(done)].to(self.device).index_select(0, index)   # [R, W]
            logits = apply_token_mask(logits, mask)
        sampled = sampler.sample(logits, s)                                              # [R]
        if s.options is not None:
            own = torch.tensor([self.options.slot_of(rid) for rid, *_ in rows], dtype=torch.int64, device=self.device)
            self.options.advance(own, sampled.unsqueeze(1))
        tokens = sampled.tolist()
        wanted = [r for r, (_, w, *_) in enumerate(rows) if w.sampling.logprobs is not None]
        if wanted:
            lp = engine_logprobs.compute(logits.unsqueeze(1), sampled.unsqueeze(1))
            host = rows_to_host(lp, wanted, [1] * len(wanted), [rows[r][1].sampling.logprobs for r in wanted])
            for r, row_lp in zip(wanted, host):
                result.logprobs[rows[r][0]] = as_token_logprobs([tokens[r]], row_lp)
        for r, (rid, _, _, i, _) in enumerate(rows):
            if self.hidden is not None:
                self.hidden.states[self.hidden.row_for(rid), 0] = last[i]
            result.sampled[rid] = [tokens[r]]

    def _fork(self, w: PrefillWork) -> None:
        """Device state of the sequences a sampling piece forks: the prompt's partial last block and the
        linear-attention state copied (the full blocks are shared by reference)."""
        for f in w.forks:
            if f.copy_block is not None:
                src, dst = f.copy_block
                for kv in self.kv:
                    for pages in (kv.k, kv.v, kv.k_scale, kv.v_scale):
                        if pages is not None:
                            pages[dst].copy_(pages[src])
            if self.states is not None and f.state_slot >= 0:
                self.states.copy(w.state_slot, f.state_slot)

    def _fill_options(self, w: PrefillWork) -> int:
        """The slot of a sampling piece's logit options, written from its history (scratch: none)."""
        h = w.history
        if h is None:
            return self.options.scratch
        return self.options.fill(w.request_id, h.prompt_token_ids, h.output_token_ids, w.sampling,
                                 h.stop_token_ids, h.bad_words_token_ids)

    # -- decode ---------------------------------------------------------------------------------

    def _decode(self, works: list[DecodeWork], result: ModelOutput) -> None:
        read_round(works, self.launch_decode(works), result)

    @torch.inference_mode()
    def launch_decode(self, works: list[DecodeWork]) -> RoundOutput:
        """Enqueue the round; no host read. -> its outputs on the device: tokens [>= len(works), k+1], ..."""
        variant = sampling_variant(works)
        if self.graphed(works, variant):
            if variant.constrained:
                self.upload_masks(self.graphs.bucket_for(len(works)))
            return self.graphs.replay(works, variant)
        width = max(len(w.block_ids) for w in works)
        packed = pack_round(self.round_setup, works, len(works), width)
        inp = RoundInputs.from_packed(*(torch.from_numpy(a).to(self.device) for a in packed), k=self.k)
        max_len = max(w.max_num_tokens for w in works) + self.k
        if variant.constrained:
            self.upload_masks(len(works))
        return run_round(self.round_setup, inp, max_len, variant, round_drafts(self.round_setup, works),
                         self._draft_hook(len(works)) if variant.constrained and self.k > 0 else None)
