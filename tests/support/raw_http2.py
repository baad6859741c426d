"""A raw HTTP/2 client (the `h2` library over a socket) that does what a gRPC client never does:
open gRPC streams with HEADERS and never send the request message."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions


@dataclass
class StreamEnd:
    grpc_status: int | None = None        # from the trailers (or a trailers-only response)
    message: str = ""
    reset: bool = False
    at: float = 0.0                        # monotonic time the stream ended


@dataclass
class HeaderOnlyClient:
    """One connection; `open(n, path)` starts n streams that send only their headers."""

    address: str
    authority: str = "127.0.0.1"
    ends: dict[int, StreamEnd] = field(default_factory=dict)
    closed: bool = False                   # the server closed the connection (or sent GOAWAY)
    goaway: bool = False

    def __post_init__(self) -> None:
        host, port = self.address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self._lock = threading.Lock()
        self._flush()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def open(self, n: int, path: str) -> list[int]:
        ids = []
        with self._lock:
            for _ in range(n):
                sid = self.conn.get_next_available_stream_id()
                self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                             (":authority", self.authority), ("content-type", "application/grpc"),
                                             ("te", "trailers")], end_stream=False)
                ids.append(sid)
            self._flush()
        return ids

    def remote_max_streams(self) -> int:
        return self.conn.remote_settings.max_concurrent_streams

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def _read(self) -> None:
        self.sock.settimeout(None)
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                return
            with self._lock:
                try:
                    events = self.conn.receive_data(data)
                except h2.exceptions.ProtocolError:     # frames after the connection closed (GOAWAY)
                    self.closed = True
                    return
                for event in events:
                    self._on(event)
                try:
                    self._flush()
                except OSError:
                    pass

    def _on(self, event) -> None:
        now = time.monotonic()
        if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            headers = dict(event.headers)
            if "grpc-status" in headers:
                self.ends[event.stream_id] = StreamEnd(int(headers["grpc-status"]), headers.get("grpc-message", ""),
                                                       at=now)
        elif isinstance(event, h2.events.StreamReset):
            self.ends.setdefault(event.stream_id, StreamEnd(reset=True, at=now))
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
