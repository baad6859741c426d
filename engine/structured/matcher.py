"""One request's grammar matcher: which tokens may come next, given the tokens so far.

Owned by the engine thread (not thread-safe). Termination: once the grammar may end, a row allows the
request's stop tokens (EOS and its stop_token_ids) besides whatever may continue it; accepting one
terminates the matcher, after which a row allows the stop tokens only (a request that ignores EOS
keeps emitting them until max_tokens).

Speculation: `push_draft` advances through a round's draft tokens to fill the mask of each verify
position, `pop_drafts` rolls them all back before the round's real tokens are accepted -- xgrammar
keeps the history a rollback needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr

from engine.structured.compiler import CompiledGrammar


def pack_ids(ids: Iterable[int], words: int) -> torch.Tensor:
    """An int32 bitmask row [words] with exactly `ids` set (bit t % 32 of word t // 32)."""
    row = torch.zeros(words, dtype=torch.int64)
    for t in ids:
        row[t // 32] |= 1 << (t % 32)
    return torch.where(row >= 1 << 31, row - (1 << 32), row).to(torch.int32)


class GrammarState:
    def __init__(self, grammar: CompiledGrammar, stop_token_ids: Sequence[int], words: int):
        self.grammar = grammar
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self._m = xgr.GrammarMatcher(grammar.handle, override_stop_tokens=sorted(self.stop_token_ids))
        self._stop_row = pack_ids(self.stop_token_ids, words)        # [words] int32
        self._drafts: list[bool] = []       # per pushed draft: did the matcher move (False: a stop after the end)
        self.num_accepted = 0

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())

    @property
    def completed(self) -> bool:
        """The text so far is a complete match: a stop token may come next."""
        return bool(self._m.is_completed())

    def fill(self, row: torch.Tensor) -> None:
        """Write the next-token mask into `row` ([words] int32, CPU, contiguous)."""
        if self._m.is_terminated():
            row.copy_(self._stop_row)
        else:
            self._m.fill_next_token_bitmask(row.unsqueeze(0), 0)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) when the grammar forbids it. A stop token after
        termination is accepted and changes nothing."""
        if self._m.is_terminated():
            return int(token) in self.stop_token_ids
        if not self._m.accept_token(int(token)):
            return False
        self.num_accepted += 1
        return True

    def accept_tokens(self, tokens: Iterable[int]) -> int:
        """Accept in order until one is refused; -> how many were accepted."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.num_accepted:
            raise ValueError(f"cannot roll back {n} tokens: {self.num_accepted} accepted")
        if n:
            self._m.rollback(n)
            self.num_accepted -= n

    # -- speculation ------------------------------------------------------------------------------

    def push_draft(self, token: int) -> bool:
        """Advance by a draft token for the masks of later verify positions; False if the grammar
        refuses it (nothing after it can be accepted this round)."""
        terminated = self._m.is_terminated()
        if not self.accept(token):
            return False
        self._drafts.append(not terminated)
        return True

    def pop_drafts(self) -> None:
        """Roll back every draft pushed since the last pop."""
        self.rollback(sum(self._drafts))
        self._drafts.clear()
