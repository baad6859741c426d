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
from engine.worker.decode_round import RoundInputs, RoundSetup, pack_round, round_drafts, run_round, sampling_variant
from engine.worker.forward_context import build_forward_context, forward_context
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
        self.model.load_weights(weights.on(self.device) if hasattr(weights, "on") else weights)
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
        self.round_setup = RoundSetup(
            model=self.model, hidden=self.hidden, k=draft_tokens, block_size=self.block_size,
            max_blocks=self.max_blocks, max_seq_len=self.max_seq_len, null_block=self.null_block,
            max_batch=self.max_batch, draft_vocab=self.draft_vocab, device=self.device,
            scratch_slot=self.scratch_slot, adaptive=config.adaptive_draft and draft_tokens > 0,
            last_tokens=(torch.zeros(self.max_batch, draft_tokens + 1, dtype=torch.int64, device=self.device)
                         if not why_synchronous(config) else None),
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

    def graphed(self, works: list[DecodeWork]) -> bool:
        # a constrained round with drafts fills its masks between the draft steps: eager
        return (self.graphs is not None and self.graphs.fits(len(works))
                and not (self.k > 0 and self.constrained))

    @property
    def constrained(self) -> bool:
        """The step's decode round has a request under a grammar (structured output)."""
        return self.masks is not None and self.masks.active

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
            if collect is not None:
                collect.chunks.append(self.model.compute_logits(hidden[end - n:end]).float().cpu())
        done = [(w, end - 1) for w, end in zip(pieces, ends) if w.sample]
        for w, row in done:
            pooled = self.last_hidden.get(w.request_id)
            if pooled is not None:
                pooled.append(hidden[row].float().cpu())                                 # [hidden]
        if not done:
            return
        last = hidden[[row for _, row in done]]                                          # [S, hidden]
        s = sampler.SamplingBatch.build([w.sampling for w, _ in done], [w.seed for w, _ in done],
                                        [w.output_index for w, _ in done], self.device)
        logits = self.model.compute_logits(last)                                        # [S, vocab]
        if self.masks is not None and self.masks.prefill_active:
            logits = apply_token_mask(logits, self.masks.prefill_host[:len(done)].to(self.device))
        tokens = sampler.sample(logits, s).tolist()
        for i, (w, _) in enumerate(done):
            if self.hidden is not None:
                self.hidden.states[self.hidden.row_for(w.request_id), 0] = last[i]
            result.sampled[w.request_id] = [tokens[i]]

    # -- decode ---------------------------------------------------------------------------------

    def _decode(self, works: list[DecodeWork], result: ModelOutput) -> None:
        read_tokens(works, self.launch_decode(works), result)

    @torch.inference_mode()
    def launch_decode(self, works: list[DecodeWork]) -> torch.Tensor:
        """Enqueue the round; no host read. -> its tokens [>= len(works), k+1] on the device."""
        all_greedy, any_filter = sampling_variant(works)
        constrained = self.constrained
        if self.graphed(works):
            if constrained:
                self.upload_masks(self.graphs.bucket_for(len(works)))
            return self.graphs.replay(works, all_greedy, any_filter, constrained)
        width = max(len(w.block_ids) for w in works)
        packed = pack_round(self.round_setup, works, len(works), width)
        inp = RoundInputs.from_packed(*(torch.from_numpy(a).to(self.device) for a in packed), k=self.k)
        max_len = max(w.max_num_tokens for w in works) + self.k
        if constrained:
            self.upload_masks(len(works))
        tokens, _ = run_round(self.round_setup, inp, max_len, all_greedy, any_filter,
                              round_drafts(self.round_setup, works), constrained,
                              self._draft_hook(len(works)) if constrained and self.k > 0 else None)
        return tokens


def read_tokens(works: list[DecodeWork], tokens: torch.Tensor, result: ModelOutput) -> None:
    """The round's one device-to-host read. tokens: [>= len(works), k+1], -1 after the last kept."""
    for w, row in zip(works, tokens.tolist()):
        result.sampled[w.request_id] = [t for t in row if t >= 0]
