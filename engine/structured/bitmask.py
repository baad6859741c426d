"""Packed token bitmasks on the device: int32 [rows, ceil(V / 32)], token t allowed in a row when bit
t % 32 of word t // 32 is set (xgrammar's layout). A row of all ones (-1) allows everything: the rows
of unconstrained requests, so one masked call covers a mixed batch with fixed shapes (capturable)."""

from __future__ import annotations

import torch

ALL_ALLOWED = -1
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return s


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack(mask: torch.Tensor, width: int) -> torch.Tensor:
    """mask [N, W] int32 -> allowed [N, width] bool (width <= 32 * W)."""
    bits = (mask.unsqueeze(-1) >> _shifts(mask.device)) & 1                     # [N, W, 32]
    return bits.view(mask.shape[0], -1)[:, :width].bool()


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor, keep_empty_rows: bool = False) -> torch.Tensor:
    """logits [N, V'] with mask [N, W] (V' <= 32 * W) -> logits [N, V'], disallowed tokens at -inf.

    `keep_empty_rows`: a row that allows none of its V' tokens is left as it was (a draft over a
    reduced vocabulary whose allowed tokens all lie past V': its draft is then refused by the
    grammar and by verification, which stays lossless)."""
    allowed = unpack(mask, logits.shape[-1])                                    # [N, V'] bool
    masked = logits.masked_fill(~allowed, float("-inf"))
    if keep_empty_rows:
        masked = torch.where(allowed.any(-1, keepdim=True), masked, logits)
    return masked
