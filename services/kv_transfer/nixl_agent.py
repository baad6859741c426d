"""The KV pool behind a NIXL agent (PyPI `nixl-cu12`, the UCX backend): one wheel moves host memory in CI
(UCX picks shared memory/CMA on one host, TCP across hosts) and device memory on GPUs (cuda_ipc over
NVLink, RDMA), through the same calls. Why NIXL over Mooncake's transfer engine, measured on CPU:
docs/disaggregation.md.

The pools are registered once (the KV pool, and on hybrids the state pool and the MTP hidden-row pool:
`KVPoolLayout.regions`), and beside them a table of 8-byte words: a producer's lease table
(engine.cache.kv_leases), a consumer's landing words. A consumer pulls (one-sided READ) a producer's blocks,
state slot and hidden row into its own, then, once that READ is complete, READs the lease's word into a
landing word with a notification that tells the producer it may free them: the word says whether the
lease held throughout the pull. A consumer that reads nothing sends the notification alone. The producer's side runs no code per read (the agent's progress thread serves it)
and reads its notifications from a thread of its own, never the engine's. Peers are learnt from the
metadata blob the producer hands out with each request (`get_agent_metadata()`, a few hundred bytes: its
UCX address and registered regions).
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import structlog

from engine.cache.kv_leases import KVLease

from engine.worker.kv_regions import KVPoolLayout

log = structlog.get_logger(__name__)


class KVTransferError(RuntimeError):
    """A pull that did not complete (the peer is gone, the transfer failed or timed out). `landing_unsafe`:
    the READ could be neither finished nor cancelled, so the local blocks it targets may still be written."""

    def __init__(self, message: str, landing_unsafe: bool = False):
        super().__init__(message)
        self.landing_unsafe = landing_unsafe


LANDING_WORDS = 256             # a consumer's pulls in flight at once (each reads one lease word)
POLL_S = 0.0005


class NixlKVAgent:
    def __init__(self, layout: KVPoolLayout, name: str | None = None, lease_region: tuple[int, int] | None = None):
        """`lease_region`: a producer's lease table (address, bytes); a consumer leaves it out and gets
        landing words of its own."""
        from nixl_cu12 import nixl_agent, nixl_agent_config     # only a producer or consumer loads NIXL
        self.name = name or f"ninfer-{uuid.uuid4().hex[:12]}"
        self.layout = layout
        self._mem = "VRAM" if layout.device_type == "cuda" else "DRAM"
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                                                              backends=["UCX"]))
        self._lock = threading.Lock()            # NIXL calls from the servicer's worker threads, one at a time
        dev = layout.device_id
        self._registered = [self._agent.get_reg_descs([(addr, size, dev, "") for addr, size in layout.regions],
                                                      self._mem)]
        # [LANDING_WORDS] uint64: a consumer's landing words, where producers' lease words are read back; a
        # producer registers its lease table instead and reads nothing, so it has none
        self._words = np.zeros(0 if lease_region else LANDING_WORDS, dtype=np.uint64)
        self._free_words = list(range(len(self._words)))
        words = lease_region or (self._words.ctypes.data, self._words.nbytes)
        self._registered.append(self._agent.get_reg_descs([(words[0], words[1], 0, "")], "DRAM"))
        for descs in self._registered:
            self._agent.register_memory(descs)
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._peers: dict[bytes, str] = {}       # a producer's metadata -> its agent name here

    def pull(self, peer_metadata: bytes, remote: list[tuple[int, int]], local: list[tuple[int, int]], lease: KVLease,
             notification: bytes, timeout_s: float) -> bool:
        """READ the remote (address, bytes) spans into the local ones, pairwise, in one READ (blocks, then a
        state slot and a hidden row: `KVPoolLayout.block_descs`, `slot_descs`, `row_descs`), then, once that
        READ is complete, the lease's word, blocking the calling thread until done (at most `timeout_s` in
        all); the producer gets `notification` once the word is read. True when the lease held throughout the
        data's READ (blocks, slot and row are the prompt's); False when it had ended (they may hold another
        request's state: discard them all)."""
        if len(local) != len(remote) or any(a[1] != b[1] for a, b in zip(local, remote)):
            raise KVTransferError(f"{len(remote)} remote spans for {len(local)} local ones")
        deadline = time.monotonic() + timeout_s
        what = f"the pull of {len(local)} spans"
        peer = self._peer(peer_metadata, what)
        self._read(peer, local, remote, self._mem, b"", deadline, what)
        with self._lock:
            if not self._free_words:
                raise KVTransferError(f"{what}: {LANDING_WORDS} pulls in flight already")
            word = self._free_words.pop()
        try:
            self._words[word] = 0
            self._read(peer, [(self._words.ctypes.data + word * 8, 8)], [(lease.address, 8)], "DRAM", notification,
                       deadline, f"the lease check after {what}")
            return int(self._words[word]) == lease.epoch
        finally:
            with self._lock:
                self._free_words.append(word)

    def _peer(self, peer_metadata: bytes, what: str) -> str:
        with self._lock:
            peer = self._peers.get(peer_metadata)
            if peer is None:
                try:
                    peer = self._peers[peer_metadata] = self._live().add_remote_agent(peer_metadata)
                except Exception as e:  # noqa: BLE001 - NIXL's errors (a blob that is no agent's metadata)
                    raise KVTransferError(f"{what} could not start: {e}") from None
            return peer

    def _read(self, peer: str, local: list[tuple[int, int]], remote: list[tuple[int, int]], mem: str,
              notification: bytes, deadline: float, what: str) -> None:
        dev = self.layout.device_id if mem == self._mem else 0
        with self._lock:
            try:
                agent = self._live()
                handle = agent.initialize_xfer(
                    "READ", agent.get_xfer_descs(np.array([(a, n, dev) for a, n in local], dtype=np.uint64), mem),
                    agent.get_xfer_descs(np.array([(a, n, dev) for a, n in remote], dtype=np.uint64), mem),
                    peer, notification)
                state = agent.transfer(handle)
            except Exception as e:  # noqa: BLE001 - NIXL's errors (unknown peer, unregistered memory...)
                raise KVTransferError(f"{what} could not start: {e}") from None
        try:
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KVTransferError(f"{what} from {peer!r} timed out (--kv-pull-timeout)")
                time.sleep(POLL_S)
                state = self._state(handle)
            if state != "DONE":
                raise KVTransferError(f"{what} from {peer!r} failed ({state})")
        finally:
            self._release(handle, peer, what)

    def _state(self, handle) -> str:
        with self._lock:
            try:
                return self._live().check_xfer_state(handle)
            except Exception as e:  # noqa: BLE001
                return f"ERR: {e}"

    def _release(self, handle, peer: str, what: str) -> None:
        """Free the handle; an active READ is cancelled. One that can be neither cancelled nor finished
        leaves its local memory unsafe to give back (KVTransferError.landing_unsafe)."""
        for attempt in range(2):
            with self._lock:
                try:
                    self._live().release_xfer_handle(handle)
                    return
                except Exception as e:  # noqa: BLE001 - an active transfer that could not be cancelled
                    log.warning("kv_transfer_release_failed", peer=peer, error=repr(e), attempt=attempt)
            give_up = time.monotonic() + 10.0          # let it finish or fail, then release it
            while self._state(handle) == "PROC" and time.monotonic() < give_up:
                time.sleep(0.01)
        raise KVTransferError(f"{what} from {peer!r} could not be cancelled: its landing stays held",
                              landing_unsafe=True)

    def notify(self, peer_metadata: bytes, notification: bytes) -> None:
        """Send a notification without a transfer (a consumer that read nothing tells the producer to free
        at once; no lease word to check, since no data was read); KVTransferError when the peer cannot be
        reached."""
        peer = self._peer(peer_metadata, "the notification")
        with self._lock:
            try:
                self._live().send_notif(peer, notification)
            except Exception as e:  # noqa: BLE001 - NIXL's errors (unknown peer, a closed connection...)
                raise KVTransferError(f"the notification could not be sent: {e}") from None

    def forget_peer(self, peer_metadata: bytes) -> None:
        """Drop a peer that failed (a restarted producer comes back with new metadata)."""
        with self._lock:
            name = self._peers.pop(peer_metadata, None)
            if name is not None:
                try:
                    self._live().remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    pass

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call (the consumers' 'pulled' messages)."""
        with self._lock:
            if self._agent is None:
                return []
            return [m for msgs in self._agent.get_new_notifs().values() for m in msgs]

    def _live(self):
        """The NIXL agent; KVTransferError once closed (the caller holds the lock)."""
        if self._agent is None:
            raise KVTransferError("the engine's KV transfer agent is closed")
        return self._agent

    def close(self) -> None:
        with self._lock:
            if self._agent is not None:
                for descs in self._registered:
                    self._agent.deregister_memory(descs)
                # dropping the agent stops UCX's progress thread, which polls a core for as long as it lives
                self._agent = None
