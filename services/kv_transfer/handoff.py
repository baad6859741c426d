"""The hand-off a producer returns in `GenerateComplete.kv_transfer_params_json` and smg relays verbatim to
the consumer's `GenerateRequest.kv_transfer_params_json` (smg's NixlConnector mode; docs/disaggregation.md).

smg tags the prefill leg `{"do_remote_decode": true, "do_remote_prefill": false}`; the producer answers with
`do_remote_prefill: true` and what the consumer needs to pull: its agent's metadata (base64), the spans of
the lent blocks (per span of the pool's layout: where block b sits), the block ids (every block of the
prompt), the prompt length they belong to, the first token its prefill sampled, the request's state slot
and hidden-state row with the spans of their pools (hybrids; MTP), the request id whose blocks the producer
frees once notified, and the lease they are all lent under (the address of its word in the producer's
memory and the epoch it holds while the lease does: engine.cache.kv_leases). Nothing here is pickled:
plain JSON of ints and strings, validated field by field (INVALID_ARGUMENT naming the field).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from dataclasses import dataclass, field

from engine.cache.kv_landing import Lent
from engine.cache.kv_leases import KVLease
from engine.errors import InvalidArgumentError
from engine.worker.kv_regions import BlockSpan, KVPoolLayout, span_descs

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
    lease: KVLease                     # read back after the pull: unchanged = blocks, slot and row were the prompt's
    # the rest of a parked request's state (absent from a hand-off of leading blocks only)
    first_token_id: int | None = None    # the token the producer's prefill sampled
    state_slot: int = -1                 # hybrids: the producer's state slot and its pool's spans
    state_spans: list[tuple[int, int, int]] = field(default_factory=list)
    hidden_row: int = -1                 # MTP: the producer's hidden-state row and its pool's span
    hidden_spans: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        """The hand-off carries the request's whole state: a consumer can decode without recomputing."""
        return self.first_token_id is not None

    def remote_descs(self, num_blocks: int | None = None) -> list[tuple[int, int]]:
        """(address, bytes) of every span of the first `num_blocks` lent blocks, span-major
        (`KVPoolLayout.block_descs`); whole: then the state slot's and the hidden row's spans."""
        descs = span_descs([BlockSpan(*s) for s in self.spans], self.block_ids[:num_blocks])
        if num_blocks is None:
            descs += span_descs([BlockSpan(*s) for s in self.state_spans], [self.state_slot])
            descs += span_descs([BlockSpan(*s) for s in self.hidden_spans], [self.hidden_row])
        return descs

    @property
    def nbytes(self) -> int:
        """Bytes a whole pull moves: every span of every lent block, then the state slot's and hidden row's spans
        (what `remote_descs()` lists, without listing it)."""
        return (len(self.block_ids) * sum(size for _, _, size in self.spans)
                + sum(size for _, _, size in (*self.state_spans, *self.hidden_spans)))

    def check_fits(self, layout: KVPoolLayout, num_prompt_tokens: int) -> None:
        if [s[2] for s in self.spans] != layout.shape():
            raise InvalidArgumentError(f"{FIELD}.spans", "the producer's KV blocks are laid out unlike this "
                                       f"engine's ({len(self.spans)} spans of {[s[2] for s in self.spans][:4]}... "
                                       f"bytes vs {len(layout.spans)} of {layout.shape()[:4]}...): pair engines of "
                                       "one model, dtype, block size and draft (MTP) setting")
        if self.num_prompt_tokens != num_prompt_tokens:
            raise InvalidArgumentError(f"{FIELD}.num_prompt_tokens", f"the producer prefilled {self.num_prompt_tokens} "
                                       f"tokens, this request has {num_prompt_tokens}")
        if not self.whole:
            return
        for name, theirs, ours, index in (("remote_state_spans", self.state_spans, layout.state_spans, self.state_slot),
                                          ("remote_hidden_spans", self.hidden_spans, layout.hidden_spans,
                                           self.hidden_row)):
            if [s[2] for s in theirs] != [s.bytes_per_block for s in ours]:
                raise InvalidArgumentError(f"{FIELD}.{name}", f"the producer's {len(theirs)} spans differ from this "
                                           f"engine's {len(ours)}: pair engines of one model, dtype and draft (MTP) "
                                           "setting")
            if theirs and index < 0:
                raise InvalidArgumentError(f"{FIELD}.{name}", "spans without a slot or row to read")

    def to_json(self) -> str:
        obj = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": self.engine_id,
               "remote_agent_metadata": base64.b64encode(self.agent_metadata).decode(),
               "remote_request_id": self.request_id, "num_prompt_tokens": self.num_prompt_tokens,
               "remote_block_ids": self.block_ids, "remote_spans": [list(s) for s in self.spans],
               "remote_lease": [self.lease.address, self.lease.epoch]}
        if self.whole:
            obj.update(first_token_id=self.first_token_id, remote_state_slot=self.state_slot,
                       remote_state_spans=[list(s) for s in self.state_spans], remote_hidden_row=self.hidden_row,
                       remote_hidden_spans=[list(s) for s in self.hidden_spans])
        return json.dumps(obj, separators=(",", ":"))


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
    def spans(name: str, least: int) -> list[tuple[int, int, int]]:
        value = obj.get(name)
        if not isinstance(value, list) or not least <= len(value) <= 4096:
            raise InvalidArgumentError(f"{FIELD}.{name}", f"must be a list of {least} to 4096 [base, stride, bytes]")
        out = [tuple(ints(name, s, 3)) for s in value]
        if any(len(s) != 3 for s in out):
            raise InvalidArgumentError(f"{FIELD}.{name}", "each span is [base, stride, bytes]")
        return out

    def index(name: str) -> int:
        v = obj.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or not -1 <= v < 1 << 32:
            raise InvalidArgumentError(f"{FIELD}.{name}", f"must be an integer from -1 (none), got {v!r}")
        return v
    lease = obj.get("remote_lease")
    if not isinstance(lease, list) or len(ints("remote_lease", lease, 2)) != 2 or not lease[1]:
        raise InvalidArgumentError(f"{FIELD}.remote_lease", "must be [address, epoch] (a non-zero epoch)")
    handoff = Handoff(engine_id=text("remote_engine_id"), agent_metadata=metadata,
                      request_id=text("remote_request_id"), num_prompt_tokens=n,
                      block_ids=ints("remote_block_ids", obj.get("remote_block_ids"), MAX_BLOCKS),
                      spans=spans("remote_spans", 1), lease=KVLease(address=lease[0], epoch=lease[1]))
    if "first_token_id" not in obj:
        return handoff
    first = obj["first_token_id"]
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise InvalidArgumentError(f"{FIELD}.first_token_id", f"must be a token id, got {first!r}")
    return dataclasses.replace(handoff, first_token_id=first, state_slot=index("remote_state_slot"),
                               state_spans=spans("remote_state_spans", 0), hidden_row=index("remote_hidden_row"),
                               hidden_spans=spans("remote_hidden_spans", 0))


def handoff_for(layout: KVPoolLayout, engine_id: str, metadata: bytes, request_id: str, num_prompt_tokens: int,
                lent: Lent, hidden_row: int, lease: KVLease) -> Handoff:
    """A parked request's whole hand-off: its prompt's blocks, first token, state slot and hidden row."""
    def listed(spans) -> list[tuple[int, int, int]]:
        return [(s.base, s.stride, s.bytes_per_block) for s in spans]
    return Handoff(engine_id=engine_id, agent_metadata=metadata, request_id=request_id,
                   num_prompt_tokens=num_prompt_tokens, block_ids=lent.block_ids, spans=listed(layout.spans), lease=lease,
                   first_token_id=lent.first_token_id, state_slot=lent.state_slot,
                   state_spans=listed(layout.state_spans), hidden_row=hidden_row,
                   hidden_spans=listed(layout.hidden_spans))
