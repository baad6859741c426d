"""The MTP hidden-state pool: one row per request holding KV, shared by the runner (prefill writes
row 0 of a request's slot), the decode round (reads and rewrites whole rows) and the graphed rounds
(pack the row index of each request). Row `max_batch` is scratch for the padded rows of a graph bucket.
"""

from __future__ import annotations

import torch


class HiddenStatePool:
    def __init__(self, max_batch: int, draft_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, extra_rows: int = 0):
        # [max_batch + 1 + extra_rows, k + 1, hidden]: the target hidden states of the positions whose
        # MTP entries the next round recomputes (see engine.worker.decode_round). Row max_batch is scratch;
        # the extra rows after it are for requests that hold KV without a decode seat (parked ones).
        self.states = torch.zeros(max_batch + 1 + extra_rows, draft_tokens + 1, hidden_size, dtype=dtype,
                                  device=device)
        self.scratch_row = max_batch
        self.rows: dict[str, int] = {}               # request id -> row
        self._free = [r for r in range(max_batch + extra_rows, -1, -1) if r != max_batch]

    def row_for(self, request_id: str) -> int:
        """The request's row, taken from the free list on first use."""
        row = self.rows.get(request_id)
        if row is None:
            row = self.rows[request_id] = self._free.pop()
        return row

    def take(self, request_id: str) -> int | None:
        """A row for a request that lands from another engine (its row's content is pulled), or None
        when every row is taken."""
        if request_id in self.rows or not self._free:
            return None
        return self.row_for(request_id)

    def rename(self, old: str, new: str) -> None:
        """The row held under `old` (a KV landing) is `new`'s from now on."""
        if new in self.rows:
            raise RuntimeError(f"request {new} already holds a hidden-state row")
        self.rows[new] = self.rows.pop(old)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self._free.append(row)
