"""HOST:PORT strings of the command line."""

from __future__ import annotations

from engine.errors import InvalidArgumentError


def split_host_port(address: str) -> tuple[str, int]:
    """'127.0.0.1:50051' -> ('127.0.0.1', 50051); '[::1]:80' -> ('::1', 80)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgumentError("address", f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
