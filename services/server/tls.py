"""TLS and mutual TLS for every ninfer server and client, and secrets read from files or the
environment (never needed on the command line, where `ps` shows them to every user).

    server: grpc.ssl_server_credentials from --tls-cert/--tls-key; --tls-client-ca requires client
            certificates signed by that CA (mTLS)
    client: --tls-ca (roots to trust) [+ --tls-cert/--tls-key: the client's certificate for mTLS]
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from engine.envs import Switch

log = structlog.get_logger(__name__)


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


def open_aio_channel(target: str, tls: ClientTLS | None, options: list | None = None,
                     interceptors: list | None = None) -> grpc.aio.Channel:
    """`open_channel` for asyncio callers; create it on the event loop that will use it."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, tls.credentials(), options=options, interceptors=interceptors)


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


# -- certificate validity -------------------------------------------------------------------------

def warn_if_not_valid_now(tls: ServerTLS, now: datetime.datetime | None = None) -> None:
    """Log a warning when the server's certificate is expired or not yet valid: clients will refuse
    every handshake, and the server would otherwise start as if nothing were wrong."""
    try:
        not_before, not_after = certificate_validity(read_pem(tls.cert, "--tls-cert"))
    except (OSError, ValueError) as e:
        log.warning("tls_certificate_unreadable", cert=tls.cert, error=str(e))
        return
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if now > not_after:
        log.warning("tls_certificate_expired", cert=tls.cert, not_after=not_after.isoformat(),
                    hint="clients refuse it: renew the certificate")
    elif now < not_before:
        log.warning("tls_certificate_not_yet_valid", cert=tls.cert, not_before=not_before.isoformat(),
                    hint="clients refuse it until then: check the clock or the certificate")


def certificate_validity(pem: bytes) -> tuple[datetime.datetime, datetime.datetime]:
    """(notBefore, notAfter) of the first certificate of a PEM chain, read from its DER (RFC 5280:
    Certificate = SEQUENCE { tbsCertificate = SEQUENCE { [0] version?, serialNumber, signature,
    issuer, validity = SEQUENCE { notBefore, notAfter }, ... }, ... })."""
    text = pem.decode("ascii", "replace")
    begin = text.find("-----BEGIN CERTIFICATE-----")
    end = text.find("-----END CERTIFICATE-----", begin)
    if begin < 0 or end < 0:
        raise ValueError("no CERTIFICATE block")
    der = base64.b64decode("".join(text[begin + 27:end].split()))
    _, body, _ = _tlv(der, 0)                         # Certificate
    _, tbs, _ = _tlv(der, body)                       # tbsCertificate: walk its fields
    pos = tbs
    tag, _, pos = _tlv(der, pos)
    if tag == 0xA0:                                   # [0] version: then serialNumber
        _, _, pos = _tlv(der, pos)
    for _ in range(2):                                # signature, issuer
        _, _, pos = _tlv(der, pos)
    _, validity, _ = _tlv(der, pos)
    times = []
    pos = validity
    for _ in range(2):
        tag, start, pos = _tlv(der, pos)
        value = der[start:pos].decode("ascii")
        fmt = "%y%m%d%H%M%SZ" if tag == 0x17 else "%Y%m%d%H%M%SZ"   # UTCTime, GeneralizedTime
        times.append(datetime.datetime.strptime(value, fmt).replace(tzinfo=datetime.timezone.utc))
    return times[0], times[1]


def _tlv(der: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of the value, end of the value) of the DER element at `pos`."""
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        n = length & 0x7F
        length = int.from_bytes(der[pos:pos + n], "big")
        pos += n
    if pos + length > len(der):
        raise ValueError("truncated DER")
    return tag, pos, pos + length
