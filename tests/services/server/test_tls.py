"""TLS and mutual TLS end to end: a gateway serving mTLS in front of an engine serving mTLS (the
gateway's calls to it carry its own client certificate), clients with and without certificates,
`ninfer generate --tls-ca/--tls-cert/--tls-key`, keys read from files. The certificates are made here."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from engine.config import EngineConfig
from gateway.client import GatewayClient, SamplingParams
from gateway.server import GatewayServer
from ninfer.cli.main import main
from services.engine_host import EngineHost
from services.server.grpc_server import ServerOptions
from services.server.tls import ClientTLS, ServerTLS

API_KEY = "s3cret-from-a-file"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, issuer_key, issuer_name, *, ca: bool = False, server: bool = False,
           valid: tuple[datetime.timedelta, datetime.timedelta] = (datetime.timedelta(minutes=-5),
                                                                  datetime.timedelta(days=1))):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name or _name(subject))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now + valid[0]).not_valid_after(now + valid[1])
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(path: Path, key, cert) -> tuple[str, str]:
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


@pytest.fixture(autouse=True)
def logging_outlives_capsys():
    """`main()` points the logs at the captured stderr of its test: point them back after."""
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA; a server certificate for 127.0.0.1/localhost; a client certificate; a stranger's certificate
    from another CA. Paths of PEM files."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _issue("ninfer test CA", None, None, ca=True)
    other_key, other_ca = _issue("another CA", None, None, ca=True)
    ca_path, _ = _write(d / "ca", ca_key, ca_cert)
    server = _write(d / "server", *_issue("server", ca_key, ca_cert.subject, server=True))
    client = _write(d / "client", *_issue("client", ca_key, ca_cert.subject))
    stranger = _write(d / "stranger", *_issue("stranger", other_key, other_ca.subject))
    key_file = d / "api-key"
    key_file.write_text(API_KEY + "\n")
    return {"ca": ca_path, "server": server, "client": client, "stranger": stranger, "api_key_file": str(key_file)}


@pytest.fixture(scope="module")
def secured(pki):
    mtls = ServerTLS(*pki["server"], client_ca=pki["ca"])
    engine = EngineHost(EngineConfig(kv_capacity=2048), ServerOptions(listen="127.0.0.1:0", tls=mtls)).start().load()
    gateway = GatewayServer([engine.address], ServerOptions(listen="127.0.0.1:0", tls=mtls, api_key=API_KEY),
                            poll_interval_s=0.1, engine_tls=ClientTLS(pki["ca"], *pki["client"])).start()
    yield gateway, engine
    gateway.stop()
    engine.stop()


def test_a_client_with_a_certificate_streams_through_mtls_to_an_mtls_engine(secured, pki):
    gateway, _ = secured
    with GatewayClient(gateway.address, API_KEY, tls=ClientTLS(pki["ca"], *pki["client"])) as client:
        client.wait_until_serving(timeout_s=60)
        *_, last = client.generate("over TLS", sampling=SamplingParams(max_tokens=4, ignore_eos=True))
        assert last.result.stats.usage.completion_tokens == 4


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "a stranger's certificate"])
def test_clients_without_a_trusted_certificate_are_refused(secured, pki, who):
    gateway, _ = secured
    tls = {"plaintext": None, "no client certificate": ClientTLS(pki["ca"]),
           "a stranger's certificate": ClientTLS(pki["ca"], *pki["stranger"])}[who]
    with GatewayClient(gateway.address, API_KEY, tls=tls) as client:
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate("hi", sampling=SamplingParams(max_tokens=2), timeout=10))
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE


def test_ninfer_generate_with_tls_flags_and_a_key_file(secured, pki, capsys, monkeypatch):
    gateway, _ = secured
    monkeypatch.setenv("NINFER_API_KEY_FILE", pki["api_key_file"])
    monkeypatch.delenv("NINFER_API_KEY", raising=False)
    cert, key = pki["client"]
    code = main(["generate", "--gateway", gateway.address, "--prompt", "hello", "--max-tokens", "3", "--json",
                 "--wait-ready", "60", "--tls-ca", pki["ca"], "--tls-cert", cert, "--tls-key", key])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert '"finish_reason"' in out.out and API_KEY not in out.out + out.err


def test_a_wrong_key_file_is_refused_and_not_echoed(secured, pki, tmp_path, capsys):
    gateway, _ = secured
    wrong = tmp_path / "wrong-key"
    wrong.write_text("not-the-key")
    cert, key = pki["client"]
    code = main(["generate", "--gateway", gateway.address, "--prompt", "hello", "--max-tokens", "2",
                 "--api-key-file", str(wrong), "--tls-ca", pki["ca"], "--tls-cert", cert, "--tls-key", key])
    err = capsys.readouterr().err
    assert code == 1 and "UNAUTHENTICATED" in err and "not-the-key" not in err


def test_a_missing_tls_file_ends_in_a_message(tmp_path, capsys):
    code = main(["gateway", "--engine", "127.0.0.1:1", "--listen", "127.0.0.1:0", "--metrics-listen", "off",
                 "--tls-cert", str(tmp_path / "none.crt"), "--tls-key", str(tmp_path / "none.key")])
    assert code == 2 and "--tls-key" in capsys.readouterr().err


def test_binding_beyond_loopback_without_tls_or_a_key_warns_and_loopback_does_not():
    with structlog.testing.capture_logs() as logs:
        for listen in ("0.0.0.0:0", "127.0.0.1:0"):
            GatewayServer(["127.0.0.1:1"], ServerOptions(listen=listen)).stop()
    warned = [(e["event"], e["address"].split(":")[0]) for e in logs if e["log_level"] == "warning"]
    assert warned == [("listening_without_tls", "0.0.0.0"), ("listening_without_authentication", "0.0.0.0")]


@pytest.mark.parametrize("valid, event", [
    ((datetime.timedelta(days=-30), datetime.timedelta(days=-1)), "tls_certificate_expired"),
    ((datetime.timedelta(days=1), datetime.timedelta(days=30)), "tls_certificate_not_yet_valid"),
    ((datetime.timedelta(days=-1), datetime.timedelta(days=30)), None),
])
def test_a_server_certificate_outside_its_validity_is_a_warning_at_start(tmp_path, valid, event):
    key, cert = _issue("127.0.0.1", None, None, server=True, valid=valid)
    cert_path, key_path = _write(tmp_path / "server", key, cert)
    with structlog.testing.capture_logs() as logs:
        host = EngineHost(EngineConfig(kv_capacity=1024),
                          ServerOptions(listen="127.0.0.1:0", tls=ServerTLS(cert_path, key_path)))
        host.stop()
    warnings = [e for e in logs if e["event"].startswith("tls_certificate")]
    if event is None:
        assert warnings == []
    else:
        assert [e["event"] for e in warnings] == [event] and warnings[0]["log_level"] == "warning"
        assert warnings[0]["cert"] == cert_path
