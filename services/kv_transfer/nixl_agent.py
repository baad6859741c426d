"""The KV pool behind a NIXL agent (PyPI `nixl-cu12`, the UCX backend): one wheel moves host memory in CI
(UCX picks shared memory/CMA on one host, TCP across hosts) and device memory on GPUs (cuda_ipc over
NVLink, RDMA), through the same calls. Why NIXL over Mooncake's transfer engine, measured on CPU:
docs/disaggregation.md.

The pool is registered once. A consumer pulls (one-sided READ) a producer's blocks into its own, with a
notification that tells the producer it may free them; the producer's side runs no code per read (the
agent's progress thread serves it) and reads its notifications from a thread of its own, never the
engine's. Peers are learnt from the metadata blob the producer hands out with each request
(`get_agent_metadata()`, a few hundred bytes: its UCX address and registered regions).
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import structlog

from engine.worker.kv_regions import KVPoolLayout

log = structlog.get_logger(__name__)


class KVTransferError(RuntimeError):
    """A pull that did not complete (the peer is gone, the transfer failed or timed out)."""


class NixlKVAgent:
    def __init__(self, layout: KVPoolLayout, name: str | None = None):
        from nixl_cu12 import nixl_agent, nixl_agent_config     # only a producer or consumer loads NIXL
        self.name = name or f"ninfer-{uuid.uuid4().hex[:12]}"
        self.layout = layout
        self._mem = "VRAM" if layout.device_type == "cuda" else "DRAM"
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                                                              backends=["UCX"]))
        self._lock = threading.Lock()            # NIXL calls from the servicer's worker threads, one at a time
        dev = layout.device_id
        self._registered = self._agent.get_reg_descs([(addr, size, dev, "") for addr, size in layout.regions],
                                                     self._mem)
        self._agent.register_memory(self._registered)
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._peers: dict[bytes, str] = {}       # a producer's metadata -> its agent name here
        self._closed = False

    def pull(self, peer_metadata: bytes, remote: list[tuple[int, int]], local: list[tuple[int, int]],
             notification: bytes, timeout_s: float) -> None:
        """READ the remote (address, bytes) spans into the local ones, pairwise (blocks, then a state slot
        and a hidden row: `KVPoolLayout.block_descs`, `slot_descs`, `row_descs`), blocking the calling
        thread until done; the producer gets `notification` when the data is here."""
        if len(local) != len(remote) or any(a[1] != b[1] for a, b in zip(local, remote)):
            raise KVTransferError(f"{len(remote)} remote spans for {len(local)} local ones")
        dev = self.layout.device_id
        with self._lock:
            try:
                peer = self._peers.get(peer_metadata)
                if peer is None:
                    peer = self._peers[peer_metadata] = self._agent.add_remote_agent(peer_metadata)
                handle = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(np.array([(a, n, dev) for a, n in local], dtype=np.uint64),
                                                       self._mem),
                    self._agent.get_xfer_descs(np.array([(a, n, dev) for a, n in remote], dtype=np.uint64), self._mem),
                    peer, notification)
                state = self._agent.transfer(handle)
            except Exception as e:  # noqa: BLE001 - NIXL's errors (unknown peer, unregistered memory...)
                raise KVTransferError(f"the pull of {len(local)} spans could not start: {e}") from None
        deadline = time.monotonic() + timeout_s
        try:
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KVTransferError(f"the pull of {len(local)} spans from {peer!r} took longer "
                                          f"than {timeout_s:g} s")
                time.sleep(0.0005)
                with self._lock:
                    try:
                        state = self._agent.check_xfer_state(handle)
                    except Exception as e:  # noqa: BLE001
                        state = f"ERR: {e}"
            if state != "DONE":
                raise KVTransferError(f"the pull of {len(local)} spans from {peer!r} failed ({state})")
        finally:
            with self._lock:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception as e:  # noqa: BLE001 - an aborted transfer may refuse its release
                    log.warning("kv_transfer_release_failed", peer=peer, error=repr(e))

    def notify(self, peer_metadata: bytes, notification: bytes) -> None:
        """Send a notification without a transfer (a consumer that will not pull tells the producer to free);
        KVTransferError when the peer cannot be reached."""
        with self._lock:
            try:
                peer = self._peers.get(peer_metadata)
                if peer is None:
                    peer = self._peers[peer_metadata] = self._agent.add_remote_agent(peer_metadata)
                self._agent.send_notif(peer, notification)
            except Exception as e:  # noqa: BLE001 - NIXL's errors (unknown peer, a closed connection...)
                raise KVTransferError(f"the notification could not be sent: {e}") from None

    def forget_peer(self, peer_metadata: bytes) -> None:
        """Drop a peer that failed (a restarted producer comes back with new metadata)."""
        with self._lock:
            name = self._peers.pop(peer_metadata, None)
            if name is not None:
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    pass

    def notifications(self) -> list[bytes]:
        """Notifications received since the last call (the consumers' 'pulled' messages)."""
        with self._lock:
            return [m for msgs in self._agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._agent.deregister_memory(self._registered)
