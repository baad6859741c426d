"""The one place a step's grammar masks are filled: on the host, once per step for every TP rank.

A step's masks live in a host array [max_batch, k+1, W] int32 (pinned on CUDA); row j of a request is
the mask after its accepted tokens and its first j drafts of the round. Unconstrained requests keep
rows of all ones, so the device code masks every row of a constrained round with fixed shapes.

    begin(decode_states, prefill_states)   # engine thread, before the step is enqueued: row 0 of
                                           # every constrained request, from its matcher
    draft_row(j, drafts)                   # inside the round, after draft j: advance the constrained
                                           # requests' matchers by it, fill row j + 1 (computed once;
                                           # every rank's call returns the same host rows)
    end()                                  # after the step: roll the matchers back to their
                                           # accepted tokens (the engine then accepts the real ones)

Each rank copies the host rows into its own device buffer (`engine.worker.decode_round` reads it), so
at TP = 2 one mask covers the gathered logits every rank samples from. On CUDA those copies leave the
pinned host array asynchronously: `begin` first waits for the last ones (with async scheduling they
belong to the round the host has just read, so the wait is over before it starts).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.structured.bitmask import ALL_ALLOWED

if TYPE_CHECKING:                  # xgrammar is imported only where a grammar is compiled
    from engine.structured.matcher import GrammarState


class RoundMasks:
    def __init__(self, max_batch: int, draft_tokens: int, words: int, pin_memory: bool = False):
        self.words = words
        self.host = torch.full((max_batch, draft_tokens + 1, words), ALL_ALLOWED, dtype=torch.int32,
                               pin_memory=pin_memory)                                  # [max_batch, k+1, W]
        self.prefill_host = torch.full((max_batch, words), ALL_ALLOWED, dtype=torch.int32)
        self._lock = threading.Lock()
        self._states: list[GrammarState | None] = []
        self._refused: list[bool] = []       # a row whose draft the grammar refused: later rows copy
        self._filled = 0                     # rows 0 .. _filled - 1 of this round are final
        self._dirty = 0                      # host rows that may differ from all ones
        self._uploads: list[torch.cuda.Event] = []
        self.active = False                  # the step's decode round has a constrained request
        self.prefill_active = False          # a sampled prefill piece of the step has one

    def note_upload(self, event: torch.cuda.Event) -> None:
        """A rank's asynchronous copy out of `host`: the next `begin` waits for it."""
        self._uploads.append(event)

    def begin(self, decode: Sequence[GrammarState | None], prefill: Sequence[GrammarState | None] = ()) -> None:
        """Row 0 of each decode request's mask, and the mask of each sampled prefill piece."""
        with self._lock:
            for event in self._uploads:
                event.synchronize()
            self._uploads = []
            self._states = list(decode)
            self._refused = [False] * len(decode)
            self._filled = 1
            self.active = any(s is not None for s in self._states)
            self.prefill_active = any(s is not None for s in prefill)
            self.host[:self._dirty].fill_(ALL_ALLOWED)
            self._dirty = len(self._states) if self.active else 0
            if self.active:
                for r, state in enumerate(self._states):
                    if state is not None:
                        state.fill(self.host[r, 0])
            for r, state in enumerate(prefill):
                if state is None:
                    self.prefill_host[r].fill_(ALL_ALLOWED)
                else:
                    state.fill(self.prefill_host[r])

    def draft_row(self, j: int, drafts: torch.Tensor) -> torch.Tensor:
        """Row j + 1 after the round's draft j (drafts [>= B] int64, any device) -> host rows [B, W]."""
        with self._lock:
            bsz = len(self._states)
            if self._filled <= j + 1:
                tokens = drafts[:bsz].tolist()
                for r, state in enumerate(self._states):
                    if state is None:
                        continue
                    if not self._refused[r] and state.push_draft(tokens[r]):
                        state.fill(self.host[r, j + 1])
                    else:                   # verification cannot get past a refused draft: any mask will do
                        self._refused[r] = True
                        self.host[r, j + 1].copy_(self.host[r, j])
                self._filled = j + 2
            return self.host[:bsz, j + 1]

    def end(self) -> None:
        with self._lock:
            for state in self._states:
                if state is not None:
                    state.pop_drafts()
            self._states = []
            self.active = self.prefill_active = False
