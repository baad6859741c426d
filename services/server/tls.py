"""TLS and mutual TLS for every ninfer server and client, and secrets read from files or the
environment (never needed on the command line, where `ps` shows them to every user).

    server: grpc.ssl_server_credentials from --tls-cert/--tls-key; --tls-client-ca requires client
            certificates signed by that CA (mTLS)
    client: --tls-ca (roots to trust) [+ --tls-cert/--tls-key: the client's certificate for mTLS]
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

from engine.envs import Switch


@dataclass(frozen=True)
class ServerTLS:
    cert: str                         # PEM certificate chain file
    key: str                          # PEM private key file
    client_ca: str | None = None      # PEM CA file: require client certificates signed by it (mTLS)

    def credentials(self) -> grpc.ServerCredentials:
        ca = read_pem(self.client_ca, "--tls-client-ca") if self.client_ca else None
        return grpc.ssl_server_credentials([(read_pem(self.key, "--tls-key"), read_pem(self.cert, "--tls-cert"))],
                                           root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    ca: str | None = None             # PEM roots to trust (None: the system's)
    cert: str | None = None           # the client's certificate chain (mTLS)
    key: str | None = None            # the client's private key (mTLS)

    def credentials(self, flag: str = "--tls") -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise OSError(f"{flag}-cert and {flag}-key go together (a client certificate needs its key)")
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, f"{flag}-ca") if self.ca else None,
            private_key=read_pem(self.key, f"{flag}-key") if self.key else None,
            certificate_chain=read_pem(self.cert, f"{flag}-cert") if self.cert else None)


def open_channel(target: str, tls: ClientTLS | None, options: list | None = None) -> grpc.Channel:
    """A plaintext channel, or a TLS one when `tls` is given."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=options)


def read_pem(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"{flag} {path}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise OSError(f"{flag} {path}: not a PEM file")
    return data


def read_secret(value: str | None, file: str | None, env: Switch[str], file_env: Switch[str],
                flag: str) -> str | None:
    """A secret from (in order) its flag, its file flag, $<env>_FILE, $<env> (switches of engine.envs); None
    when none is set. A file's trailing newline is not part of the secret."""
    if value:
        return value
    path = file or file_env.read()
    if path:
        try:
            secret = Path(path).read_text().strip()
        except OSError as e:
            raise OSError(f"{flag}-file {path}: {e.strerror or e}") from None
        if not secret:
            raise OSError(f"{flag}-file {path}: the file is empty")
        return secret
    return env.read() or None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
