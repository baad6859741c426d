"""Prefill/decode on different engines behind `smg launch --pd-disaggregation` (docs/disaggregation.md).

smg drives the vLLM protocol's sequential PD flow (its NixlConnector mode): it sends the prefill leg to a
producer (`max_tokens=1`, `kv_transfer_params_json={"do_remote_decode":true}`), drains it, and relays the
producer's `GenerateComplete.kv_transfer_params_json` verbatim to a consumer's decode leg, whose stream is
the answer.

- Producer (`--kv-role producer`): the leg is submitted to park after its prefill; its answer carries the
  first token and the hand-off (services.kv_transfer.handoff), which names the lease everything it lends is
  lent under (engine.cache.kv_leases). The request stays parked, holding its KV (hybrids: its state slot;
  MTP: its hidden-state row), until the consumer's notification says they were pulled, or `--lease-seconds`
  passes (smg never aborts a finished prefill: retries and client aborts orphan it, the lease frees it).
- Consumer (`--kv-role consumer`): blocks (hybrids: a state slot; MTP: a hidden-state row) are reserved on
  the engine thread, the pull runs in a worker thread (the engine keeps stepping), then the request is
  admitted over what landed straight into the decode batch, its stream starting with the producer's first
  token: no prompt token is recomputed. A request that must compute its prompt (prompt_logprobs) pulls
  the leading full blocks only, as a prefix hit. A pull that fails or outlasts `--kv-pull-timeout` answers
  UNAVAILABLE (smg retries the whole pipeline) and leaves nothing held. Two cases recompute the prompt
  instead (the request is served, only the saving is lost): no room for what lands now (the consumer
  notifies the producer without a READ, so it frees at once; the request queues for room as any other),
  and a lease that had ended before the pull finished (the lease's word, read back after the blocks, slot
  and row, says so: they may hold another request's state and are all given back unread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid

import grpc
import structlog

from engine.config import EngineConfig
from engine.cache.kv_landing import lendable_blocks, prompt_blocks
from engine.errors import InvalidArgumentError, RequestNotFoundError
from engine.sched.admission import truncation
from engine.sampling_params import SamplingParams
from services.kv_transfer import handoff as kvh
from services.kv_transfer.nixl_agent import KVTransferError, NixlKVAgent
from services.server.errors import RpcAbort
from services.smg.engine_port import EnginePort
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

log = structlog.get_logger(__name__)
KV_CONNECTOR = "NixlConnector"          # smg's name for the mode that relays our hand-off verbatim
PULLED = b"ninfer-kv-pulled:"           # consumer -> producer notification, then the producer's request id
NOTIFY_POLL_S = 0.005


class PDRole:
    def __init__(self, port: EnginePort, config: EngineConfig):
        self.port = port
        self.role = config.kv_role
        self.engine_id = f"ninfer-{uuid.uuid4().hex[:16]}"
        self.max_model_len = config.max_model_len
        self.pull_timeout_s = config.kv_pull_timeout_seconds
        self._agent: NixlKVAgent | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def active(self) -> bool:
        return self.role != "both"

    def server_info(self) -> dict:
        """GetServerInfo's PD fields, as smg reads them (`kv_connector` picks its mode, `kv_role`)."""
        if not self.active:
            return {}
        return {"kv_connector": KV_CONNECTOR, "kv_role": f"kv_{self.role}", "kv_engine_id": self.engine_id}

    def agent(self) -> NixlKVAgent:
        """The NIXL agent over the KV pool, made once the engine is loaded (the pool registered once)."""
        with self._lock:
            if self._agent is None:
                leases = self.port.kv_lease_region() if self.role == "producer" else None
                self._agent = NixlKVAgent(self.port.kv_pool_layout(), self.engine_id, leases)
                if self.role == "producer":
                    threading.Thread(target=self._serve_notifications, name="ninfer-kv-notify", daemon=True).start()
            return self._agent

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._agent is not None:
                self._agent.close()

    def truncated(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """The prompt as the engine keeps it (`truncate_prompt_tokens`, -1: the context limit), applied before
        either leg: the hand-off's blocks and length are the kept prompt's on both sides."""
        if params.truncate_prompt_tokens is None:
            return prompt
        return prompt[-truncation(params, self.port.facts().info.max_model_len):]

    # -- producer -------------------------------------------------------------------------------

    def prefill_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """The leg parks after its first token: it must not end there (max_tokens 1 from smg would)."""
        room = (self.max_model_len or 1 << 62) - prompt_len
        return dataclasses.replace(params, max_tokens=2) if params.max_tokens == 1 and room >= 2 else params

    async def lend(self, request_id: str, prompt_len: int) -> str:
        """The hand-off for a parked leg: its prompt's blocks, state slot, hidden row and first token."""
        agent = self.agent()
        lent, hidden_row, lease = await self.port.lent(request_id)
        if lease is None:                   # every lease word is taken: nothing is lent, the leg is freed now
            self._release(request_id)
            return '{"do_remote_decode":false,"do_remote_prefill":false}'
        handoff = kvh.handoff_for(agent.layout, self.engine_id, agent.metadata, request_id, prompt_len, lent,
                                  hidden_row, lease)
        log.info("kv_lent", request_id=request_id, blocks=len(lent.block_ids), state_slot=lent.state_slot,
                 hidden_row=hidden_row, bytes=handoff.nbytes)
        return handoff.to_json()

    def _serve_notifications(self) -> None:
        while not self._stop.wait(NOTIFY_POLL_S):
            try:
                messages = self._agent.notifications()
            except Exception as e:  # noqa: BLE001 - the agent is closing
                log.warning("kv_notifications_failed", error=repr(e))
                return
            for m in messages:
                if m.startswith(PULLED):
                    self._release(m[len(PULLED):].decode(errors="replace"))

    def _release(self, request_id: str) -> None:
        try:
            self.port.release(request_id)
        except RequestNotFoundError:          # expired, or aborted already: nothing held
            log.info("kv_release_moot", request_id=request_id)
        except Exception as e:  # noqa: BLE001 - the engine is gone
            log.warning("kv_release_failed", request_id=request_id, error=repr(e))

    # -- consumer -------------------------------------------------------------------------------

    async def pull(self, request_id: str, prompt: list[int], handoff: kvh.Handoff, whole: bool = True):
        """Reserve, pull and return the landing (None: recompute the prompt); UNAVAILABLE if the pull fails
        or times out. `whole` (and a whole hand-off): the request's every block, state slot and hidden row;
        otherwise the prompt's leading full blocks, a prefix hit for a request that computes the rest."""
        agent = self.agent()
        handoff.check_fits(agent.layout, len(prompt))
        if not handoff.block_ids:
            return None
        block_size = self.port.facts().info.block_size
        whole = whole and handoff.whole
        most = (prompt_blocks if handoff.whole else lendable_blocks)(len(prompt), block_size)
        if len(handoff.block_ids) > most or (handoff.whole and len(handoff.block_ids) != most):
            raise InvalidArgumentError(f"{kvh.FIELD}.remote_block_ids", f"{len(handoff.block_ids)} blocks for a "
                                       f"prompt of {len(prompt)} tokens (want {most})")
        num_blocks = len(handoff.block_ids) if whole else min(len(handoff.block_ids),
                                                              lendable_blocks(len(prompt), block_size))
        notification = PULLED + handoff.request_id.encode()
        if num_blocks == 0:
            await self._let_go(handoff, notification)
            return None
        landing = await self.port.reserve_landing(request_id, prompt, num_blocks, whole)
        if landing is None:
            log.warning("kv_pull_skipped_no_room", request_id=request_id, blocks=num_blocks, whole=whole)
            await self._let_go(handoff, notification)
            return None
        local = agent.layout.block_descs(landing.block_ids[:num_blocks])
        if whole:
            local += agent.layout.slot_descs(landing.state_slot) + agent.layout.row_descs(landing.hidden_row)
        remote = handoff.remote_descs(None if whole else num_blocks)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        pulling = loop.run_in_executor(None, agent.pull, handoff.agent_metadata, remote, local, handoff.lease,
                                       notification, self.pull_timeout_s)
        try:
            lease_held = await asyncio.shield(pulling)
        except asyncio.CancelledError:            # the call ended: the blocks go back once the READ is over
            pulling.add_done_callback(lambda f: self._drop_after(landing, f))
            raise
        except KVTransferError as e:
            self._drop_after(landing, pulling)
            agent.forget_peer(handoff.agent_metadata)
            log.warning("kv_pull_failed", request_id=request_id, producer=handoff.engine_id, error=str(e))
            raise RpcAbort(grpc.StatusCode.UNAVAILABLE,
                           f"pulling the prompt's KV from producer {handoff.engine_id} failed: {e}") from None
        except BaseException:
            self.port.drop_landing(landing)
            raise
        seconds = time.perf_counter() - started
        if not lease_held:
            # the producer's lease ended before the READ was over: its blocks, slot and row may have been
            # reused for another request while they were read. The whole landing is given back unread and the
            # prompt recomputed (the producer is healthy and smg would only redo the same prefill: recomputing
            # here costs the same and answers at once).
            self.port.drop_landing(landing)
            log.warning("kv_pull_stale", request_id=request_id, producer=handoff.engine_id, blocks=num_blocks,
                        whole=whole, seconds=round(seconds, 6))
            return None
        size = sum(n for _, n in local)
        log.info("kv_pulled", request_id=request_id, producer=handoff.engine_id, blocks=num_blocks, whole=whole,
                 bytes=size, seconds=round(seconds, 6), gb_per_s=round(size / max(seconds, 1e-9) / 1e9, 3))
        return landing

    async def _let_go(self, handoff: kvh.Handoff, notification: bytes) -> None:
        """No pull after all (the prompt is recomputed here): the producer frees what it lent now rather than
        at its lease's end (best effort: the lease still ends it). Nothing was read, so no lease word is."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.agent().notify, handoff.agent_metadata,
                                                             notification)
        except KVTransferError as e:
            log.warning("kv_let_go_failed", producer=handoff.engine_id, error=str(e))

    def _drop_after(self, landing, pulling: asyncio.Future) -> None:
        """Give the landing (blocks, slot, row) back once no READ can write it: never after a READ that could
        be neither finished nor cancelled (it stays held, logged, rather than hold another request's state)."""
        error = pulling.exception() if pulling.done() and not pulling.cancelled() else None
        if isinstance(error, KVTransferError) and error.landing_unsafe:
            log.error("kv_landing_quarantined", request_id=landing.request_id, blocks=len(landing.block_ids))
            return
        self.port.drop_landing(landing)


def complete_with_handoff(response: pb.GenerateResponse, handoff_json: str) -> pb.GenerateResponse:
    """The prefill leg's answer: its one token, finish "length" (the leg ends here), and the hand-off."""
    response.complete.finish_reason = "length"
    response.complete.kv_transfer_params_json = handoff_json
    return response
