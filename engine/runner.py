"""Turns scheduler output into tensors, runs the model, samples and verifies. One host read per step.

A decode round with k drafts (see `engine.models.qwen3.MTPModule` for the MTP formulas):
  1. MTP step 1 recomputes, from the target's real hidden states, the MTP entries of the positions
     m0 .. n-2 that the last target forward finalised (1 to k+1 of them; padded to k+1 so the
     shape is fixed) and drafts d_1 from the last of them;
  2. MTP steps 2..k each feed (g, d_{j-1}) at the next position and draft d_j;
  3. the target verifies [x_{n-1}, d_1 .. d_k] in one forward, and `sampler.verify` keeps the
     accepted drafts plus one bonus token.
The target hidden states of that forward are kept per request for the next round's step 1.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import structlog
import torch

from engine.config import EngineConfig, ModelConfig
from engine.forward_context import build_forward_context, forward_context
from engine.layers.attention import LayerKV
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.parallel import SINGLE_RANK, TPGroup
from engine import sampler
from engine.scheduler import DecodeWork, ModelOutput, PrefillWork, SchedulerOutput

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
    """Logits at every prompt position, collected chunk by chunk (for scoring and tests)."""

    chunks: list[torch.Tensor]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights, num_blocks: int,
                 draft_tokens: int, max_model_len: int, tp: TPGroup = SINGLE_RANK):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.block_size = config.block_size
        self.k = draft_tokens
        self.vocab_size = model_config.vocab_size
        self.draft_vocab = config.draft_vocab or None
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = Qwen3ForCausalLM(model_config, tp, with_mtp=draft_tokens > 0,
                                          max_position=max_model_len + draft_tokens + 1)
        self.model.load_weights(weights)
        self.model.eval()
        kv_dtype = torch.int8 if config.kv_dtype_name == "int8" else getattr(torch, config.kv_dtype_name)
        layers = self.model.attention_layers()
        attn = layers[0]
        self.kv = allocate_kv(len(layers), num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim,
                              kv_dtype, self.device)
        for layer, kv in zip(layers, self.kv):
            layer.kv = kv
        # request id -> target hidden states [k+1, hidden] of the positions MTP step 1 recomputes
        self._mtp_hidden: dict[str, torch.Tensor] = {}
        # request id -> prompt logits being collected
        self.prompt_logits: dict[str, PromptLogits] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        for rid in out.finished_request_ids:
            self._mtp_hidden.pop(rid, None)
        result = ModelOutput()
        if out.prefill is not None:
            self._prefill(out.prefill, result)
        if out.decode:
            (self._decode_speculative if self.k > 0 else self._decode)(out.decode, result)
        return result

    # -- prefill --------------------------------------------------------------------------------

    def _prefill(self, w: PrefillWork, result: ModelOutput) -> None:
        n = len(w.token_ids)
        positions, ctx = build_forward_context([n], [w.start + n], [w.block_ids], self.block_size, self.device)
        ids = torch.tensor(w.token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        with forward_context(ctx):
            hidden = self.model(ids, positions)                                      # [n, hidden]
            if self.k > 0:
                # MTP entries of this chunk's positions; the last prompt position waits for the
                # sampled token (round 1, step 1). Its slot gets a placeholder that step 1 overwrites.
                nxt = torch.zeros(n, dtype=torch.int64)
                nxt[:len(w.next_token_ids)] = torch.tensor(w.next_token_ids, dtype=torch.int64)
                self.model.draft_hidden(nxt.to(self.device), hidden, positions)
        collect = self.prompt_logits.get(w.request_id)
        if collect is not None:
            collect.chunks.append(self.model.compute_logits(hidden).float().cpu())
        if w.sample:
            s = sampler.SamplingBatch.build([w.sampling], [w.seed], [w.output_index], self.device)
            token = sampler.sample(self.model.compute_logits(hidden[-1:]), s)
            if self.k > 0:
                rows = torch.zeros(self.k + 1, hidden.shape[-1], dtype=hidden.dtype, device=self.device)
                rows[0] = hidden[-1]
                self._mtp_hidden[w.request_id] = rows
            result.sampled[w.request_id] = token.tolist()

    # -- decode ---------------------------------------------------------------------------------

    def _sampling(self, works: list[DecodeWork]) -> sampler.SamplingBatch:
        return sampler.SamplingBatch.build([w.sampling for w in works], [w.seed for w in works],
                                           [w.output_index for w in works], self.device)

    def _decode(self, works: list[DecodeWork], result: ModelOutput) -> None:
        positions, ctx = build_forward_context([1] * len(works), [w.num_tokens for w in works],
                                               [w.block_ids for w in works], self.block_size, self.device)
        ids = torch.tensor([w.last_token_id for w in works], dtype=torch.int64).to(self.device)
        with forward_context(ctx):
            logits = self.model.compute_logits(self.model(ids, positions))
        tokens = sampler.sample(logits, self._sampling(works)).tolist()
        for w, t in zip(works, tokens):
            result.sampled[w.request_id] = [t]

    def _decode_speculative(self, works: list[DecodeWork], result: ModelOutput) -> None:
        k, bsz, dev = self.k, len(works), self.device
        tables = [w.block_ids for w in works]
        s = self._sampling(works)
        draft_tokens, draft_probs = [], []

        # Step 1: k+1 slots per request at positions m0 .. m0+k; the first `count` are real.
        counts = [w.num_tokens - 1 - w.num_mtp_computed for w in works]
        step1_ids = torch.zeros(bsz, k + 1, dtype=torch.int64)
        for i, w in enumerate(works):
            step1_ids[i, :counts[i]] = torch.tensor(w.mtp_token_ids, dtype=torch.int64)
        hidden_in = torch.stack([self._mtp_hidden[w.request_id] for w in works])          # [B, k+1, H]
        positions, ctx = build_forward_context([k + 1] * bsz, [w.num_mtp_computed + k + 1 for w in works],
                                               tables, self.block_size, dev)
        with forward_context(ctx):
            g = self.model.draft_hidden(step1_ids.to(dev).flatten(), hidden_in.flatten(0, 1), positions)
        last = torch.tensor(counts, device=dev) - 1
        g = g.view(bsz, k + 1, -1)[torch.arange(bsz, device=dev), last]                   # [B, H]

        # Steps 1..k: draft from g, then feed (g, d_j) at the next position.
        for j in range(k):
            d, q = sampler.draft(self.model.compute_logits(g, self.draft_vocab), s.shifted(j), self.vocab_size)
            draft_tokens.append(d)
            draft_probs.append(q)
            if j == k - 1:
                break
            positions, ctx = build_forward_context([1] * bsz, [w.num_tokens + j for w in works], tables,
                                                   self.block_size, dev)
            with forward_context(ctx):
                g = self.model.draft_hidden(d, g, positions)

        # Verify [x_{n-1}, d_1 .. d_k] at positions n-1 .. n-1+k.
        drafts = torch.stack(draft_tokens, dim=1)                                           # [B, k]
        last_ids = torch.tensor([w.last_token_id for w in works], dtype=torch.int64).to(dev)
        verify_ids = torch.cat([last_ids.unsqueeze(1), drafts], dim=1)                       # [B, k+1]
        positions, ctx = build_forward_context([k + 1] * bsz, [w.num_tokens + k for w in works], tables,
                                               self.block_size, dev)
        with forward_context(ctx):
            hidden = self.model(verify_ids.flatten(), positions)                             # [B(k+1), H]
        logits = self.model.compute_logits(hidden).view(bsz, k + 1, -1)
        q = None if s.all_greedy else torch.stack(draft_probs, dim=1)
        num_drafts = torch.tensor([w.draft_tokens for w in works], device=dev)
        out, _ = sampler.verify(logits, drafts, q, num_drafts, s)
        hidden = hidden.view(bsz, k + 1, -1)
        for i, w in enumerate(works):
            self._mtp_hidden[w.request_id] = hidden[i]
        for w, row in zip(works, out.tolist()):
            result.sampled[w.request_id] = [t for t in row if t >= 0]

