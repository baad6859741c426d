"""The hand-off a producer returns in `GenerateComplete.kv_transfer_params_json` and smg relays verbatim to
the consumer's `GenerateRequest.kv_transfer_params_json` (smg's NixlConnector mode; docs/disaggregation.md).

smg tags the prefill leg `{"do_remote_decode": true, "do_remote_prefill": false}`; the producer answers with
`do_remote_prefill: true` and what the consumer needs to pull: its agent's metadata (base64), the spans of
the lent blocks (per span of the pool's layout: where block b sits), the block ids, the prompt length they
belong to, the request id whose blocks the producer frees once notified, and the lease they are lent under
(the address of its word in the producer's memory and the epoch it holds while the lease does:
engine.cache.kv_leases). Nothing here is pickled:
plain JSON of ints and strings, validated field by field (INVALID_ARGUMENT naming the field).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from engine.cache.kv_leases import KVLease
from engine.errors import InvalidArgumentError
from engine.worker.kv_regions import KVPoolLayout

FIELD = "kv_transfer_params_json"
MAX_BLOCKS = 1 << 20


@dataclass(frozen=True)
class TransferRequest:
    """What smg's tags ask of this leg."""

    do_remote_decode: bool            # the prefill leg: prefill, lend the KV, return the hand-off
    do_remote_prefill: bool           # the decode leg: pull the KV (when a hand-off came), then decode
    handoff: "Handoff | None"


@dataclass(frozen=True)
class Handoff:
    engine_id: str
    agent_metadata: bytes
    request_id: str                   # the producer's request: the notification frees it
    num_prompt_tokens: int
    block_ids: list[int]
    spans: list[tuple[int, int, int]]   # (base, stride, bytes per block) per span of the producer's pool
    lease: KVLease                     # read back after the pull: unchanged = the blocks were the prompt's

    def remote_descs(self) -> list[tuple[int, int]]:
        """(address, bytes) of every span of every lent block, span-major (`KVPoolLayout.block_descs`)."""
        return [(base + b * stride, size) for base, stride, size in self.spans for b in self.block_ids]

    def check_fits(self, layout: KVPoolLayout, num_prompt_tokens: int) -> None:
        if [s[2] for s in self.spans] != layout.shape():
            raise InvalidArgumentError(f"{FIELD}.spans", "the producer's KV blocks are laid out unlike this "
                                       f"engine's ({len(self.spans)} spans of {[s[2] for s in self.spans][:4]}... "
                                       f"bytes vs {len(layout.spans)} of {layout.shape()[:4]}...): pair engines of "
                                       "one model, dtype, block size and draft (MTP) setting")
        if self.num_prompt_tokens != num_prompt_tokens:
            raise InvalidArgumentError(f"{FIELD}.num_prompt_tokens", f"the producer prefilled {self.num_prompt_tokens} "
                                       f"tokens, this request has {num_prompt_tokens}")

    def to_json(self) -> str:
        return json.dumps({"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": self.engine_id,
                           "remote_agent_metadata": base64.b64encode(self.agent_metadata).decode(),
                           "remote_request_id": self.request_id, "num_prompt_tokens": self.num_prompt_tokens,
                           "remote_block_ids": self.block_ids, "remote_spans": [list(s) for s in self.spans],
                           "remote_lease": [self.lease.address, self.lease.epoch]},
                          separators=(",", ":"))


def parse(text: str) -> TransferRequest:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise InvalidArgumentError(FIELD, f"is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InvalidArgumentError(FIELD, "must be a JSON object")
    decode, prefill = _flag(obj, "do_remote_decode"), _flag(obj, "do_remote_prefill")
    if decode and prefill:
        raise InvalidArgumentError(FIELD, "do_remote_decode and do_remote_prefill cannot both be true")
    handoff = _handoff(obj) if prefill and "remote_agent_metadata" in obj else None
    return TransferRequest(do_remote_decode=decode, do_remote_prefill=prefill, handoff=handoff)


def _flag(obj: dict, name: str) -> bool:
    value = obj.get(name, False)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{FIELD}.{name}", f"must be true or false, got {value!r}")
    return value


def _handoff(obj: dict) -> Handoff:
    def text(name: str) -> str:
        v = obj.get(name)
        if not isinstance(v, str) or not v:
            raise InvalidArgumentError(f"{FIELD}.{name}", "must be a non-empty string")
        return v

    def ints(name: str, value, limit: int) -> list[int]:
        if not isinstance(value, list) or len(value) > limit or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 64 for i in value):
            raise InvalidArgumentError(f"{FIELD}.{name}", f"must be a list of at most {limit} non-negative integers")
        return value
    try:
        metadata = base64.b64decode(text("remote_agent_metadata"), validate=True)
    except binascii.Error:
        raise InvalidArgumentError(f"{FIELD}.remote_agent_metadata", "must be base64") from None
    n = obj.get("num_prompt_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgumentError(f"{FIELD}.num_prompt_tokens", f"must be a positive integer, got {n!r}")
    spans = obj.get("remote_spans")
    if not isinstance(spans, list) or not spans or len(spans) > 4096:
        raise InvalidArgumentError(f"{FIELD}.remote_spans", "must be a list of 1 to 4096 [base, stride, bytes]")
    spans = [tuple(ints("remote_spans", s, 3)) for s in spans]
    if any(len(s) != 3 for s in spans):
        raise InvalidArgumentError(f"{FIELD}.remote_spans", "each span is [base, stride, bytes]")
    lease = obj.get("remote_lease")
    if not isinstance(lease, list) or len(ints("remote_lease", lease, 2)) != 2 or not lease[1]:
        raise InvalidArgumentError(f"{FIELD}.remote_lease", "must be [address, epoch] (a non-zero epoch)")
    return Handoff(engine_id=text("remote_engine_id"), agent_metadata=metadata, request_id=text("remote_request_id"),
                   num_prompt_tokens=n, block_ids=ints("remote_block_ids", obj.get("remote_block_ids"), MAX_BLOCKS),
                   spans=spans, lease=KVLease(address=lease[0], epoch=lease[1]))


def handoff_for(layout: KVPoolLayout, engine_id: str, metadata: bytes, request_id: str, num_prompt_tokens: int,
                block_ids: list[int], lease: KVLease) -> Handoff:
    return Handoff(engine_id=engine_id, agent_metadata=metadata, request_id=request_id,
                   num_prompt_tokens=num_prompt_tokens, block_ids=block_ids,
                   spans=[(s.base, s.stride, s.bytes_per_block) for s in layout.spans], lease=lease)
