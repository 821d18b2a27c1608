"""The gRPC transport between real processes on loopback: mutual TLS, identity, chunking,
deadlines. No mock of gRPC: each party is a process (tests/network_peer.py) with its own server on
a port the OS chose, and the test process plays the odd client (an impostor, a plaintext one).
Every process started here is stopped by its pid when the test ends, passed or failed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from protocols import tls
from secure_vfl.deployment import private_paths
from secure_vfl.errors import ConfigError, DataError, NotSetUpError, ProtocolError, TransportError
from secure_vfl.federation import network, wire
from secure_vfl.federation.certificates import TlsIdentity
from secure_vfl.federation.channel import CAPTURE_LENGTH, read_capture
from secure_vfl.federation.messages import (
    GradientMessage,
    Message,
    RepresentationMessage,
    RepresentRequest,
)
from secure_vfl.federation.network import (
    DELIVER,
    DELIVER_STREAM,
    STREAM_THRESHOLD,
    NetworkChannel,
    PartyEndpoint,
    RetryPolicy,
)
from secure_vfl.federation.parties import Party

pytestmark = pytest.mark.processes  # peer processes with deadlines: run one at a time

PEER = Path(__file__).with_name("network_peer.py")
ROOT = Path(__file__).resolve().parents[1]
START_SECONDS = 60.0  # a cold process imports torch: generous on a busy machine
FAST_RETRY = RetryPolicy(attempts=3, first_backoff=0.05, max_backoff=0.2)


@dataclasses.dataclass
class Peer:
    """A party process: its pid, port and the files it writes."""

    name: str
    process: subprocess.Popen[str]
    port: int
    result: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def connect(self, peers: dict[str, str]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(peers) + "\n")
        self.process.stdin.flush()

    def outcome(self, timeout: float) -> dict[str, Any]:
        """The result the process wrote, waiting up to ``timeout`` seconds for it."""
        end = time.monotonic() + timeout
        while not self.result.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited early: {self._stderr()}")
            if time.monotonic() > end:
                raise AssertionError(f"{self.name} wrote no result in {timeout} s")
            time.sleep(0.05)
        return dict(json.loads(self.result.read_text()))

    def stop(self) -> int:
        """Tell the process to stop serving and wait for its exit status."""
        assert self.process.stdin is not None
        self.process.stdin.write("stop\n")
        self.process.stdin.flush()
        return self.process.wait(timeout=30)

    def _stderr(self) -> str:
        assert self.process.stderr is not None
        return self.process.stderr.read()[-2000:]


class Launcher:
    """Starts party processes and remembers their pids, to stop them whatever happens."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, name: str, program: str, **settings: Any) -> Peer:
        result = self.directory / f"{name}.result.json"
        spec = {"name": name, "program": program, "result": str(result), **settings}
        spec_path = self.directory / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GRPC_VERBOSITY": "NONE"}
        process = subprocess.Popen(
            [sys.executable, str(PEER), str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.processes.append(process)
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], START_SECONDS)
        line = process.stdout.readline() if ready else ""
        if not line.startswith("PORT "):
            raise AssertionError(f"{name} did not start: {line!r}")
        return Peer(name, process, int(line.split()[1]), result)

    def stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    try:
        yield launcher
    finally:
        launcher.stop_all()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    tls.make_federation(directory, ["bank", "shop", "aggregator", "requester", "responder"])
    return directory


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Certificates for the same names, from another federation's CA."""
    directory = tmp_path_factory.mktemp("other-certs")
    tls.make_federation(directory, ["bank"])
    return directory


def _identity(certs: Path, name: str) -> TlsIdentity:
    return TlsIdentity.from_files(certs / "ca.pem", certs / f"{name}.pem", certs / f"{name}.key")


def _capture(path: Path, messages: list[Message]) -> bytes:
    data = b"".join(
        CAPTURE_LENGTH.pack(len(encoded)) + encoded for encoded in map(wire.encode, messages)
    )
    path.write_bytes(data)
    return data


def _messages(sender: str, receiver: str, seed: int, big_rows: int = 0) -> list[Message]:
    """A few real secure-vfl messages (tensors of seeded random values)."""
    generator = torch.Generator().manual_seed(seed)
    header = {"sender": sender, "receiver": receiver, "session": "s1"}
    messages: list[Message] = [
        RepresentRequest(
            **header,
            round=3,
            batch_id=0,
            split="train",
            rows=torch.randperm(50, generator=generator)[:16],
            positions=torch.arange(16),
            reply_to=receiver,
        ),
        RepresentationMessage(
            **header,
            round=3,
            batch_id=0,
            positions=torch.arange(16),
            representation=torch.randn(16, 32, generator=generator),
        ),
        GradientMessage(
            **header,
            round=3,
            batch_id=1,
            positions=torch.arange(8),
            gradient=torch.randn(8, 32, generator=generator),
        ),
    ]
    if big_rows:
        messages.append(
            RepresentationMessage(
                **header,
                round=4,
                batch_id=0,
                positions=torch.arange(big_rows),
                representation=torch.randn(big_rows, 32, generator=generator),
            )
        )
    return messages


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


@pytest.fixture(scope="module")
def exchange(
    tmp_path_factory: pytest.TempPathFactory, certs: Path
) -> Iterator[dict[str, dict[str, Any]]]:
    """bank and shop, each in its own process, send each other a few messages over mutual TLS
    (bank also one of about 8 MB, streamed in chunks) and keep what they receive."""
    directory = tmp_path_factory.mktemp("exchange")
    launcher = Launcher(directory)
    sent = {
        "bank": _capture(directory / "bank.send", _messages("bank", "shop", 1, big_rows=65_000)),
        "shop": _capture(directory / "shop.send", _messages("shop", "bank", 2)),
    }
    try:
        peers = {
            name: launcher.start(
                name,
                "exchange",
                certs=str(certs),
                send=str(directory / f"{name}.send"),
                received=str(directory / f"{name}.received"),
                expect=4 if name == "shop" else 3,
            )
            for name in ("bank", "shop")
        }
        peers["bank"].connect({"shop": peers["shop"].address})
        peers["shop"].connect({"bank": peers["bank"].address})
        outcomes = {name: peer.outcome(timeout=120) for name, peer in peers.items()}
        statuses = {name: peer.stop() for name, peer in peers.items()}
        yield {
            name: {
                "outcome": outcomes[name],
                "status": statuses[name],
                "sent": sent[name],
                "received": _read(directory / f"{name}.received"),
                "received_path": directory / f"{name}.received",
            }
            for name in peers
        }
    finally:
        launcher.stop_all()


def test_two_processes_receive_exactly_the_bytes_sent_over_mutual_tls(
    exchange: dict[str, dict[str, Any]],
) -> None:
    for name in ("bank", "shop"):
        assert exchange[name]["outcome"] == {
            "ok": True,
            "sent_sizes": exchange[name]["outcome"]["sent_sizes"],
        }
        assert exchange[name]["status"] == 0
    # Byte-identical: what each received, re-encoded, is what the other encoded and sent.
    assert exchange["shop"]["received"] == exchange["bank"]["sent"]
    assert exchange["bank"]["received"] == exchange["shop"]["sent"]
    received = list(read_capture(exchange["bank"]["received_path"]))
    assert [m.kind for m in received] == ["represent-request", "representation", "gradient"]
    assert all(m.sender == "shop" and m.receiver == "bank" for m in received)
    assert torch.equal(
        received[2].gradient,  # type: ignore[attr-defined]
        _messages("shop", "bank", 2)[2].gradient,  # type: ignore[attr-defined]
    )


def test_a_message_above_4_mb_arrives_intact_through_chunks(
    exchange: dict[str, dict[str, Any]],
) -> None:
    sizes = exchange["bank"]["outcome"]["sent_sizes"]
    assert sizes[-1] > STREAM_THRESHOLD  # streamed in chunks, not one gRPC message
    (big,) = [m for m in read_capture(exchange["shop"]["received_path"]) if m.round == 4]
    assert len(wire.encode(big)) == sizes[-1]
    expected = _messages("bank", "shop", 1, big_rows=65_000)[-1]
    assert torch.equal(big.representation, expected.representation)  # type: ignore[attr-defined]


def _listener(
    launcher: Launcher,
    certs: Path,
    directory: Path,
    name: str = "shop",
    deadline: float = 2.0,
    **settings: Any,
) -> Peer:
    """A party process that takes the first message that arrives (its endpoint's and each
    wait's deadline: ``deadline``)."""
    peer = launcher.start(
        name,
        "listen",
        certs=str(certs),
        received=str(directory / f"{name}.received"),
        deadline=deadline,
        total=90.0,
        **settings,
    )
    peer.connect({})
    return peer


def _greeting(sender: str = "bank", receiver: str = "shop") -> RepresentationMessage:
    return RepresentationMessage(
        sender=sender,
        receiver=receiver,
        round=1,
        batch_id=0,
        positions=torch.arange(2),
        representation=torch.ones(2, 3),
    )


def _legitimate_delivery(certs: Path, listener: Peer, tmp_path: Path) -> dict[str, Any]:
    """bank, with its own certificate, reaches the listener: what it noted on the way."""
    with PartyEndpoint("bank", identity=_identity(certs, "bank"), deadline=20.0) as bank:
        bank.add_peer("shop", listener.address)
        bank.send(_greeting())
    outcome = listener.outcome(timeout=60)
    (arrived,) = read_capture(tmp_path / "shop.received")
    assert wire.encode(arrived) == wire.encode(_greeting())
    return outcome


def test_parties_with_rsa_and_p384_keys_complete_the_mutual_tls_handshake(
    launcher: Launcher, tmp_path: Path
) -> None:
    """Keys an organisation's own PKI may issue, which `certs check` refused ("gRPC's TLS
    completes no handshake with it"): bank's RSA-2048 and shop's P-384 key, both ways."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    certs = tmp_path / "pki"
    tls.make_federation(certs, ["bank", "shop"])
    ca = tls.x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), None)
    for name, key in (
        ("bank", rsa.generate_private_key(65537, 2048)),
        ("shop", ec.generate_private_key(ec.SECP384R1())),
    ):
        certificate = tls.party_certificate(name, key, ca, ca_key)  # type: ignore[arg-type]
        (certs / f"{name}.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        (certs / f"{name}.key").write_bytes(tls._key_pem(key))  # type: ignore[arg-type]
    assert tls.check_federation(certs) == []
    listener = _listener(launcher, certs, tmp_path)
    assert _legitimate_delivery(certs, listener, tmp_path) == {
        "ok": True,
        "refusals": [],
        "refused": [],
    }


def test_an_impostor_with_a_certificate_from_another_ca_is_refused(
    launcher: Launcher, certs: Path, other_ca: Path, tmp_path: Path
) -> None:
    listener = _listener(launcher, certs, tmp_path)
    # The impostor trusts the real CA (it can read ca.pem) but holds another CA's certificate.
    stolen_name = dataclasses.replace(
        _identity(other_ca, "bank"), ca=(certs / "ca.pem").read_bytes()
    )
    with PartyEndpoint("bank", identity=stolen_name, deadline=10.0, retry=FAST_RETRY) as impostor:
        impostor.add_peer("shop", listener.address)
        with pytest.raises(
            TransportError, match=r"could not be reached \(3 attempts.*federation's CA"
        ):
            impostor.send(_greeting())
    outcome = _legitimate_delivery(certs, listener, tmp_path)
    # The handshake failed: nothing the impostor sent ever reached the listening party.
    assert outcome == {"ok": True, "refusals": [], "refused": []}


def _refused_greeting(listener: Peer, ca: bytes, key: bytes, certificate: bytes) -> grpc.RpcError:
    """How ``listener`` (shop) refuses bank's greeting from a caller with ``key`` and
    ``certificate`` (PEM), which trusts ``ca``: the error of one raw gRPC call."""
    credentials = grpc.ssl_channel_credentials(ca, key, certificate)
    options = [("grpc.ssl_target_name_override", "shop")]
    with (
        grpc.secure_channel(listener.address, credentials, options=options) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        channel.unary_unary(DELIVER)(
            wire.encode(_greeting(sender="bank")),
            timeout=20,
            metadata=(("svfl-stream", "x"), ("svfl-sequence", "1")),
        )
    return refused.value


def _certificate_naming(certs: Path, common_name: str, dns: list[str]) -> tuple[bytes, bytes]:
    """A key and a certificate the CA of ``certs`` signs with ``common_name`` and the DNS
    names ``dns`` (PEM): what `certs init` never issues, another tool might."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca = tls.x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = tls._now()
    certificate = (
        tls.x509.CertificateBuilder()
        .subject_name(tls.x509.Name([tls.x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(tls.x509.random_serial_number())
        .not_valid_before(now - tls.CLOCK_SKEW)
        .not_valid_after(now + tls.CLOCK_SKEW * 60)
        .add_extension(
            tls.x509.SubjectAlternativeName([tls.x509.DNSName(host) for host in dns]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return tls._key_pem(key), certificate.public_bytes(serialization.Encoding.PEM)


def test_a_caller_certificate_whose_dns_names_name_another_party_is_refused(
    launcher: Launcher, certs: Path, tmp_path: Path
) -> None:
    """The server named a caller by its certificate's common name alone, a client names a
    server by its DNS names: a certificate of the CA with the common name bank and the DNS
    name aggregator passed for bank when calling (and would for aggregator when serving).
    The server now holds the caller to what a party's start-up holds itself to."""
    listener = _listener(launcher, certs, tmp_path, members=["bank", "shop", "aggregator"])
    ca = (certs / "ca.pem").read_bytes()
    reasons = {
        ("aggregator", "localhost"): "'bank' is not among its DNS names ['aggregator', "
        "'localhost']; it also names the parties ['aggregator']: it would pass for them.",
        ("bank", "aggregator"): "it also names the parties ['aggregator']: it would pass for them.",
    }
    refusals = []
    for dns, reason in reasons.items():
        refused = _refused_greeting(listener, ca, *_certificate_naming(certs, "bank", list(dns)))
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        refusals.append(
            "shop: a caller certificate that names one party (its common name among its DNS "
            f"names, no other member there) expected; found common name 'bank': {reason}"
        )
        assert refused.details() == refusals[-1]
    outcome = _legitimate_delivery(certs, listener, tmp_path)
    # Neither reached the party (the only message it got is bank's own); its server says why.
    assert outcome == {"ok": True, "refusals": [], "refused": refusals}


def test_without_a_federations_members_a_server_checks_callers_against_its_peers(
    certs: Path,
) -> None:
    """An endpoint made without a federation's members (the library's, the benchmarks') took
    a caller certificate that also names one of its peers among its DNS names: it checked
    the names against no party at all. Its peers and itself are the parties then."""
    with PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=5.0) as shop:
        shop.add_peer("aggregator", "127.0.0.1:1")  # never called
        _, certificate = _certificate_naming(certs, "bank", ["bank", "aggregator"])
        with pytest.raises(network._Refusal, match=r"names the parties \['aggregator'\]"):
            shop._judge(certificate)
        _, bank = _certificate_naming(certs, "bank", ["bank", "localhost"])
        assert shop._judge(bank) == "bank"


class _CallerContext:
    """What PartyEndpoint._caller reads of gRPC's servicer context: the caller's certificate."""

    def __init__(self, pem: bytes) -> None:
        self.pem = pem

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_pem_cert": [self.pem]}


def test_a_server_judges_each_caller_certificate_once_and_keeps_a_bounded_number(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's certificate is parsed once, not on every call; the verdicts kept stay
    within CALLER_CERTIFICATES_KEPT however many certificates call (the oldest go first)."""
    Context = _CallerContext
    parsed = collections.Counter[bytes]()
    parse = network.parse_certificate

    def counted(pem: bytes) -> Any:
        parsed[pem] += 1
        return parse(pem)

    monkeypatch.setattr(network, "CALLER_CERTIFICATES_KEPT", 3)
    monkeypatch.setattr(network, "parse_certificate", counted)
    bank = (certs / "bank.pem").read_bytes()
    with PartyEndpoint("shop", identity=_identity(certs, "shop")) as shop:
        for _ in range(3):
            assert shop._caller(Context(bank)) == "bank"  # type: ignore[arg-type]
        assert parsed[bank] == 1
        others = [_certificate_naming(certs, "bank", ["shop"])[1] for _ in range(4)]
        for pem in others:
            with pytest.raises(network._Refusal, match="'bank' is not among its DNS names"):
                shop._caller(Context(pem))  # type: ignore[arg-type]
        assert list(shop._verdicts) == others[1:]
        assert shop._caller(Context(bank)) == "bank"  # type: ignore[arg-type]
        assert parsed[bank] == 2 and list(shop._verdicts) == [*others[2:], bank]


def test_a_revoked_partys_calls_are_refused_while_the_others_go_through(
    launcher: Launcher, tmp_path: Path
) -> None:
    """gRPC's Python API takes no revocation list: a certificate the CA revoked (a stolen key)
    called as its party until a new CA replaced every certificate. The server now refuses a
    caller whose certificate the CA's list (crl.pem beside ca.pem) revokes; another member,
    and the revoked party's new certificate, go through."""
    pki = tmp_path / "pki"
    tls.make_federation(pki, ["bank", "shop", "aggregator"])
    stolen = _identity(pki, "bank")
    revoked = tls.revoke(pki, "bank", reason="key-compromise")
    listener = _listener(launcher, pki, tmp_path, members=["bank", "shop", "aggregator"])
    with PartyEndpoint("bank", identity=stolen, deadline=20.0, retry=FAST_RETRY) as bank:
        bank.add_peer("shop", listener.address)
        with pytest.raises(ProtocolError) as refused:
            bank.send(_greeting())
    reason = (
        f"shop: a caller certificate the CA has not revoked expected; 'bank''s (serial "
        f"{revoked.serial:x}) was {revoked.revoked} (the federation's certificate revocation "
        "list)."
    )
    assert str(refused.value) == (
        f"representation from bank to shop refused (PERMISSION_DENIED): {reason}"
    )
    with PartyEndpoint(
        "aggregator", identity=_identity(pki, "aggregator"), deadline=20.0
    ) as aggregator:
        aggregator.add_peer("shop", listener.address)
        aggregator.send(_greeting(sender="aggregator"))
    assert listener.outcome(timeout=60) == {"ok": True, "refusals": [], "refused": [reason]}
    (arrived,) = read_capture(tmp_path / "shop.received")
    assert arrived.sender == "aggregator"
    (tmp_path / "shop.received").unlink()
    # bank admitted again: a new certificate of the CA, which the list does not revoke
    for suffix in (".pem", ".key"):
        (pki / f"bank{suffix}").unlink()
    tls.make_federation(pki, ["bank"])
    listener.result.unlink()  # the second shop writes its outcome where the first did
    second = _listener(launcher, pki, tmp_path)
    with PartyEndpoint("bank", identity=_identity(pki, "bank"), deadline=20.0) as bank:
        bank.add_peer("shop", second.address)
        bank.send(_greeting())
    assert second.outcome(timeout=60) == {"ok": True, "refusals": [], "refused": []}
    (arrived,) = read_capture(tmp_path / "shop.received")
    assert arrived.sender == "bank"


def test_a_revocation_reaches_a_running_party_without_a_restart(
    launcher: Launcher, tmp_path: Path
) -> None:
    """A party process serving when the CA revokes a caller's certificate refuses that
    caller's next call once the new list is beside its CA (within CRL_RECHECK_SECONDS), over
    the connection the caller already had: no restart."""
    pki = tmp_path / "pki"
    tls.make_federation(pki, ["bank", "shop", "aggregator"])
    listener = _listener(launcher, pki, tmp_path, members=["bank", "shop", "aggregator"])
    with PartyEndpoint(
        "bank", identity=_identity(pki, "bank"), deadline=20.0, retry=FAST_RETRY
    ) as bank:
        bank.add_peer("shop", listener.address)
        bank.send(_greeting())
        assert listener.outcome(timeout=60) == {"ok": True, "refusals": [], "refused": []}
        revoked = tls.revoke(pki, "bank", reason="key-compromise")
        time.sleep(network.CRL_RECHECK_SECONDS + 0.5)
        with pytest.raises(ProtocolError) as refused:
            bank.send(_greeting())
    assert str(refused.value) == (
        "representation from bank to shop refused (PERMISSION_DENIED): shop: a caller "
        f"certificate the CA has not revoked expected; 'bank''s (serial {revoked.serial:x}) was "
        f"{revoked.revoked} (the federation's certificate revocation list)."
    )


def test_a_running_server_applies_a_new_revocation_list_that_keeps_every_revocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server read the revocation list once, when it started: a revocation reached a
    running federation only when every party was restarted. It now reads the list again when
    the file changes (or first appears beside the CA) and applies it, dropping the verdicts
    it kept; it keeps the list in force, and logs why once, when the new file is not a list,
    not the CA's, lacks a revocation of the list in force (an older list put back) or is gone."""
    monkeypatch.setattr(network, "CRL_RECHECK_SECONDS", 0.0)  # looked at on every call
    pki = tmp_path / "pki"
    tls.make_federation(pki, ["bank", "shop", "aggregator"])
    crl = pki / "crl.pem"
    identity = dataclasses.replace(_identity(pki, "shop"), crl_path=crl)
    pems = {name: (pki / f"{name}.pem").read_bytes() for name in ("bank", "aggregator")}
    kept = "shop: keeps applying the certificate revocation list it has"

    def logged(text: str) -> int:
        return sum(text in record.getMessage() for record in caplog.records)

    with (
        PartyEndpoint("shop", identity=identity, members=["bank", "shop", "aggregator"]) as shop,
        caplog.at_level("WARNING", logger=network.__name__),
    ):

        def refusal(name: str) -> network._Refusal:
            with pytest.raises(network._Refusal) as refused:
                shop._caller(_CallerContext(pems[name]))  # type: ignore[arg-type]
            assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
            return refused.value

        assert shop._caller(_CallerContext(pems["bank"])) == "bank"  # type: ignore[arg-type]
        bank = tls.revoke(pki, "bank", reason="key-compromise")  # the CA's first: the file appears
        assert f"'bank''s (serial {bank.serial:x}) was {bank.revoked}" in refusal("bank").reason
        assert logged(f"applies the new certificate revocation list {crl}: 1 revoked (0 before)")
        assert shop._caller(_CallerContext(pems["aggregator"])) == "aggregator"  # type: ignore[arg-type]
        first = crl.read_bytes()
        aggregator = tls.revoke(pki, "aggregator")
        second = crl.read_bytes()
        refusal("aggregator")
        assert shop.revoked_count == 2

        crl.write_bytes(first)  # an older list of the CA's would admit aggregator again
        refusal("aggregator")
        assert logged(
            f"{kept} (2 revoked), not the one now at {crl}: lacks 1 revocation(s) of the list in "
            f"force (serial {aggregator.serial:x}); a list that keeps every revocation expected"
        )
        other = tmp_path / "other"
        tls.make_federation(other, ["bank"])
        tls.revoke(other, "bank")
        crl.write_bytes((other / "crl.pem").read_bytes())  # another CA's list
        refusal("bank")
        assert logged(f"{kept} (2 revoked), not the one now at {crl}: ") == 2
        assert logged("this federation's CA") == 1
        crl.write_bytes(b"garbage")
        for _ in range(3):  # said once
            refusal("aggregator")
        assert logged(f"not the one now at {crl}: a PEM certificate revocation list") == 1
        assert logged("found no PEM block") == 1
        crl.unlink()
        refusal("bank")
        assert logged(f"its certificate revocation list {crl} is gone; it keeps applying") == 1
        assert shop.revoked_count == 2
        crl.write_bytes(b"")  # an empty file where the list was: said too
        refusal("bank")
        assert logged(f"not the one now at {crl}: ") == 4

        crl.write_bytes(second)  # back as it was: nothing to apply
        refusal("bank")
        shop_revoked = tls.revoke(pki, "shop")
        refusal("aggregator")
        assert logged(
            f"3 revoked (2 before); it revokes this party's own certificate "
            f"({shop_revoked.revoked}): every peer that has it refuses this party's calls"
        )
        assert logged("applies the new certificate revocation list") == 3


def test_a_running_server_reads_no_revocation_list_file_that_is_not_plain_or_too_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The file at the list's path was read whole, whatever it was, on a server thread: a
    named pipe blocked that call for good, holding the look's lock (no later list was ever
    applied), and /dev/zero or a huge file was read until memory ran out (MemoryError out of
    the call). Neither is read now: the list in force stays, the log says why, once, and a
    list put there later is applied."""
    monkeypatch.setattr(network, "CRL_RECHECK_SECONDS", 0.0)
    pki = tmp_path / "pki"
    tls.make_federation(pki, ["bank", "shop"])
    crl = pki / "crl.pem"
    identity = dataclasses.replace(_identity(pki, "shop"), crl_path=crl)
    bank = (pki / "bank.pem").read_bytes()
    outcome: list[Any] = []

    def call(shop: PartyEndpoint) -> Any:
        caller = threading.Thread(
            target=lambda: outcome.append(shop._caller(_CallerContext(bank))),  # type: ignore[arg-type]
            daemon=True,  # one that never returns must not hold the test up
        )
        caller.start()
        caller.join(5.0)
        assert not caller.is_alive(), "the call is still reading the list's file"
        return outcome.pop()

    with (
        PartyEndpoint("shop", identity=identity, members=["bank", "shop"]) as shop,
        caplog.at_level("WARNING", logger=network.__name__),
    ):
        os.mkfifo(crl)
        for _ in range(2):  # said once
            assert call(shop) == "bank"
        said = [r.getMessage() for r in caplog.records if "not the one now at" in r.getMessage()]
        assert said == [
            "shop: keeps applying the certificate revocation list it has (0 revoked), not the "
            f"one now at {crl}: it is not a plain file (a named pipe)"
        ]
        crl.unlink()
        staged = tmp_path / "staged"
        staged.mkdir()
        for name in ("ca.pem", "ca.key", "bank.pem"):
            (staged / name).write_bytes((pki / name).read_bytes())
        tls.revoke(staged, "bank")
        monkeypatch.setattr(network, "CRL_MAX_BYTES", 64)
        os.replace(staged / "crl.pem", crl)
        assert call(shop) == "bank"  # too large: not read
        assert any("it is larger than 64 bytes" in r.getMessage() for r in caplog.records)
        monkeypatch.setattr(network, "CRL_MAX_BYTES", 16 * 1024 * 1024)
        with pytest.raises(network._Refusal):
            shop._caller(_CallerContext(bank))  # type: ignore[arg-type]
        assert shop.revoked_count == 1


def test_a_verdict_judged_against_a_list_replaced_meanwhile_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server thread judging a caller while another applies a new list (which revokes that
    caller) would keep its verdict, judged against the old list, past the other's clearing of
    the kept verdicts: the revoked caller would pass until the next list. The verdict is kept
    only if judged against the list still in force."""
    monkeypatch.setattr(network, "CRL_RECHECK_SECONDS", 0.0)
    pki = tmp_path / "pki"
    tls.make_federation(pki, ["bank", "shop", "aggregator"])
    identity = dataclasses.replace(_identity(pki, "shop"), crl_path=pki / "crl.pem")
    bank, aggregator = ((pki / f"{name}.pem").read_bytes() for name in ("bank", "aggregator"))
    with PartyEndpoint("shop", identity=identity) as shop:
        shop.add_peer("aggregator", "127.0.0.1:1")  # never called
        judge = shop._judge

        def judged_while_a_new_list_arrives(pem: bytes) -> str:
            caller = judge(pem)  # against the list in force: none
            if pem == bank:
                tls.revoke(pki, "bank")
                # another call comes meanwhile: it applies the new list and drops the verdicts
                assert shop._caller(_CallerContext(aggregator)) == "aggregator"  # type: ignore[arg-type]
            return caller

        monkeypatch.setattr(shop, "_judge", judged_while_a_new_list_arrives)
        assert shop._caller(_CallerContext(bank)) == "bank"  # type: ignore[arg-type]
        assert bank not in shop._verdicts
        with pytest.raises(network._Refusal, match=r"'bank''s .* was revoked on"):
            shop._caller(_CallerContext(bank))  # type: ignore[arg-type]


def test_a_peer_whose_certificate_this_party_refuses_is_given_up_at_once(
    certs: Path, tmp_path: Path
) -> None:
    """A peer serving another CA's certificate, or one that does not name it, fails every
    handshake: neither the wait for peers nor a delivery waits it out or retries it."""
    tls.make_federation(tmp_path / "other", ["shop"])
    impostors = {
        "CERTIFICATE_VERIFY_FAILED": ("shop", _identity(tmp_path / "other", "shop")),
        "Hostname Verification Check failed": ("aggregator", _identity(certs, "aggregator")),
        "WRONG_VERSION_NUMBER": ("shop", None),  # served without TLS (--insecure)
    }
    # what each means, said first (gRPC's words followed, with one question for all three)
    meanings = {
        "CERTIFICATE_VERIFY_FAILED": "shop's certificate is not signed by this federation's CA",
        "Hostname Verification Check failed": "the certificate served there does not name shop",
        "WRONG_VERSION_NUMBER": "what answers there does not speak TLS: is shop served with",
    }
    for said, (name, identity) in impostors.items():
        with (
            PartyEndpoint(name, identity=identity, insecure=identity is None) as impostor,
            PartyEndpoint("bank", identity=_identity(certs, "bank"), deadline=60.0) as bank,
        ):
            bank.add_peer("shop", impostor.address)
            start = time.monotonic()
            assert bank.await_peers(["shop"], 60.0) == ["shop"]
            assert time.monotonic() - start < 10.0, said
            start = time.monotonic()
            with pytest.raises(TransportError) as refused:
                bank.send(_greeting())
            assert time.monotonic() - start < 10.0, said
        message = str(refused.value)
        assert "the TLS handshake with shop at 127.0.0.1:" in message, message
        assert "failed, which no retry changes" in message and said in message, message
        assert f"which no retry changes: {meanings[said]}" in message, message


@pytest.mark.processes
def test_a_refused_handshake_is_said_once_not_also_by_grpcs_own_log(
    certs: Path, other_ca: Path
) -> None:
    """gRPC's core printed its own INFO line ("Handshake failed with error SSL_ERROR_SSL ...")
    beside the party's error that names the peer and what to check. In a fresh interpreter
    (gRPC reads its verbosity when first imported), with no GRPC_VERBOSITY of the user's."""
    program = f"""
from pathlib import Path
from secure_vfl.federation.certificates import TlsIdentity
from secure_vfl.federation.network import PartyEndpoint
def identity(directory, name):
    d = Path(directory)
    return TlsIdentity.from_files(d / "ca.pem", d / f"{{name}}.pem", d / f"{{name}}.key")
with PartyEndpoint("shop", identity=identity({str(certs)!r}, "shop")) as shop, PartyEndpoint(
    "bank", identity=identity({str(other_ca)!r}, "bank"), peers={{"shop": shop.address}}
) as bank:
    print("unreachable:", bank.await_peers(["shop"], 30.0))
"""
    env = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"}
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "unreachable: ['shop']"  # the handshake was refused
    assert "Handshake failed" not in done.stderr, done.stderr


def test_a_peer_not_listening_yet_is_waited_for(certs: Path) -> None:
    """A refused connection (nothing listens there yet) is not a refused certificate."""
    with PartyEndpoint("bank", identity=_identity(certs, "bank")) as bank:
        bank.add_peer("shop", f"127.0.0.1:{network.free_loopback_ports(1)[0]}")
        start = time.monotonic()
        assert bank.await_peers(["shop"], 1.5) == ["shop"]
        assert time.monotonic() - start >= 1.4


def test_a_peer_whose_host_does_not_resolve_is_named_so(certs: Path) -> None:
    """It asked whether the peer ran and whether both certificates came from one CA."""
    with PartyEndpoint("bank", identity=_identity(certs, "bank"), deadline=5.0) as bank:
        bank.add_peer("shop", "nohost.invalid:47000")
        with pytest.raises(TransportError, match="Its host name does not resolve"):
            bank.send(_greeting())


def test_a_second_party_cannot_listen_at_a_port_in_use(certs: Path) -> None:
    """gRPC's servers set SO_REUSEPORT unless told not to: two parties would both bind."""
    with PartyEndpoint("shop", identity=_identity(certs, "shop")) as shop:
        with pytest.raises(TransportError, match=rf"bank: cannot listen on {shop.address}"):
            PartyEndpoint("bank", listen=shop.address, identity=_identity(certs, "bank"))
        with pytest.raises(TransportError, match="cannot listen"):
            PartyEndpoint("bank", listen=shop.address, insecure=True)


def test_a_port_in_use_or_an_address_not_of_this_machine_is_refused_saying_so(
    certs: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """gRPC's refusal said only that it failed to bind; the reason went to a raw log line."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(TransportError, match=r"another process listens there"):
            PartyEndpoint("bank", listen=address, identity=_identity(certs, "bank"))
    with pytest.raises(TransportError, match=r"192\.0\.2\.1 is not an address of this machine"):
        PartyEndpoint("bank", listen="192.0.2.1:47000", identity=_identity(certs, "bank"))
    assert "add_port" not in capfd.readouterr().err  # no raw gRPC log line


def test_a_party_claiming_another_partys_name_is_refused(
    launcher: Launcher, certs: Path, tmp_path: Path
) -> None:
    listener = _listener(launcher, certs, tmp_path)
    aggregator = _identity(certs, "aggregator")
    refused = _refused_greeting(listener, aggregator.ca, aggregator.key, aggregator.certificate)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    reason = (
        "shop: a representation claiming to come from 'bank' over a connection whose "
        "certificate is 'aggregator''s; a party sends only in its own name."
    )
    assert refused.details() == reason
    outcome = _legitimate_delivery(certs, listener, tmp_path)
    # The receiving party's server refused it (logged, kept in `refused`); the party itself
    # was not stopped by it, and got the real message.
    assert outcome == {"ok": True, "refusals": [], "refused": [reason]}


def test_an_address_where_nothing_listens_is_not_blamed_on_certificates(certs: Path) -> None:
    (port,) = network.free_loopback_ports(1)
    with PartyEndpoint("bank", identity=_identity(certs, "bank"), retry=FAST_RETRY) as bank:
        bank.add_peer("shop", f"127.0.0.1:{port}")
        with pytest.raises(TransportError) as refused:
            bank.send(_greeting())
    text = str(refused.value)
    assert "onnection refused" in text and text.endswith("Is it running?"), text
    assert "certificate" not in text, text


def test_send_all_retries_the_peers_it_cannot_reach_at_once_not_one_after_another(
    certs: Path,
) -> None:
    """A label party starting a run with no peer up waited for each peer's retries in turn (and
    again for each to end the run): 11 s more than one peer's retries with four of them."""
    ports = network.free_loopback_ports(3)
    names = ("shop", "insurer", "aggregator")
    with PartyEndpoint("bank", identity=_identity(certs, "bank"), retry=FAST_RETRY) as bank:
        for name, port in zip(names, ports, strict=True):
            bank.add_peer(name, f"127.0.0.1:{port}")
        by_channel = {bank._channels[name]: name for name in names}
        calls: list[str] = []
        call = bank._call

        def recorded(channel: Any, *args: Any) -> Any:
            calls.append(by_channel[channel])
            return call(channel, *args)

        bank._call = recorded  # type: ignore[method-assign]
        failed: dict[str, ProtocolError] = {}
        with pytest.raises(TransportError, match=r"shop at 127\.0\.0\.1"):
            bank.send_all([_greeting(receiver=name) for name in names], failed=failed)
    assert sorted(failed) == sorted(names)
    for name in names:
        assert isinstance(failed[name], TransportError)
        assert "(3 attempts over" in str(failed[name]), failed[name]
    assert sorted(calls) == sorted(names * 3)
    # Every peer's second attempt went before any third: one after another, shop's third went
    # before insurer's second.
    attempts = [calls[: i + 1].count(name) for i, name in enumerate(calls)]
    assert max(i for i, n in enumerate(attempts) if n == 2) < min(
        i for i, n in enumerate(attempts) if n == 3
    ), calls


def test_a_plaintext_client_cannot_talk_to_a_tls_server(
    launcher: Launcher, certs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    listener = _listener(launcher, certs, tmp_path)
    with PartyEndpoint("bank", insecure=True, deadline=10.0, retry=FAST_RETRY) as plaintext:
        assert "WITHOUT TLS (insecure=True)" in caplog.text  # opting out is loud
        plaintext.add_peer("shop", listener.address)
        with pytest.raises(TransportError, match=r"shop at 127\.0\.0\.1:\d+ could not be reached"):
            plaintext.send(_greeting())
    assert _legitimate_delivery(certs, listener, tmp_path) == {
        "ok": True,
        "refusals": [],
        "refused": [],
    }


def test_a_receive_with_no_message_times_out_naming_what_it_awaited(certs: Path) -> None:
    with PartyEndpoint("shop", identity=_identity(certs, "shop")) as shop:
        shop.add_peer("bank", "127.0.0.1:9")
        start = time.monotonic()
        with pytest.raises(TransportError) as timeout:
            shop.receive(0.3, sender="bank", kind="gradient")
        assert 0.3 <= time.monotonic() - start < 10
    assert str(timeout.value) == (
        "shop: no gradient from bank arrived within 0.3 s; is bank at 127.0.0.1:9 running, and "
        "can it reach this party?"
    )


def test_close_waits_for_the_channels_that_reconnect_replaced(certs: Path) -> None:
    """reconnect closes the old channel on a thread of its own (gRPC's connectivity poll can
    take a while); the endpoint's close waits for every such thread."""

    class SlowToClose:
        def __init__(self, channel: Any) -> None:
            self.channel, self.closed = channel, False

        def close(self) -> None:
            time.sleep(0.5)
            self.channel.close()
            self.closed = True

    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=5.0)
    bank = PartyEndpoint("bank", identity=_identity(certs, "bank"), deadline=5.0)
    try:
        bank.add_peer("shop", shop.address)
        old = bank._channels["shop"] = SlowToClose(bank._channels["shop"])
        bank.reconnect("shop")
        assert not old.closed
    finally:
        bank.close()
        shop.close()
    assert old.closed
    assert not [t for t in threading.enumerate() if t.name == "bank-close"]


def test_an_endpoint_needs_a_certificate_naming_it_or_an_explicit_opt_out(certs: Path) -> None:
    with pytest.raises(ConfigError, match="or insecure=True expected"):
        PartyEndpoint("shop")
    with pytest.raises(ConfigError, match="its certificate names 'bank'"):
        PartyEndpoint("shop", identity=_identity(certs, "bank"))
    with PartyEndpoint("shop", identity=_identity(certs, "shop")) as shop:
        with pytest.raises(ProtocolError, match="sends only in its own name"):
            shop.send(_greeting())
        with pytest.raises(ProtocolError, match="no address for 'shop'"):
            shop.send(_greeting(sender="shop"))


def test_dh_psi_between_two_processes_finds_the_in_process_intersection(
    launcher: Launcher, certs: Path
) -> None:
    from protocols.psi import run_psi

    rng = np.random.default_rng(5)
    mine = [f"id{i}" for i in rng.permutation(3000)]
    theirs = [f"id{i}" for i in rng.permutation(np.arange(2000, 5000))][:2500]
    keys = {"requester": "11" * 32, "responder": "22" * 32}
    # Two workers each: 3000 points start a pool of worker processes, inside a process whose
    # gRPC threads run (forking it crashed the workers: they are spawned there).
    common = {"certs": str(certs), "seed": 9, "chunk_size": 4096, "session": "psi-1"}
    common["workers"] = 2
    requester = launcher.start(
        "requester", "psi-requester", ids=mine, peer="responder", key=keys["requester"], **common
    )
    responder = launcher.start(
        "responder", "psi-responder", ids=theirs, peer="requester", key=keys["responder"], **common
    )
    responder.connect({"requester": requester.address})
    requester.connect({"responder": responder.address})
    over_network = requester.outcome(timeout=180)
    rows = responder.outcome(timeout=60)
    expected = run_psi(
        mine,
        theirs,
        key_mine=bytes.fromhex(keys["requester"]),
        key_theirs=bytes.fromhex(keys["responder"]),
        rng=np.random.default_rng(9),
        session_id="psi-1",
        workers=1,
        chunk_size=4096,
    )
    assert expected.indices is not None
    assert over_network["ok"] and rows["ok"], (over_network, rows)
    assert (over_network["size"], over_network["peer_size"]) == (expected.size, 2500)
    assert over_network["indices"] == expected.indices.tolist()
    assert expected.size == len(set(mine) & set(theirs)) > 0
    # The responder learnt its row of each aligned sample, in the requester's order.
    assert [theirs[r] for r in rows["rows"]] == [mine[i] for i in expected.indices]
    assert requester.stop() == 0 and responder.stop() == 0


class _Serving:
    """An endpoint whose party thread (a thread of the test process) acts on what arrives."""

    def __init__(self, endpoint: PartyEndpoint) -> None:
        self.endpoint = endpoint
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopped.is_set():
            with contextlib.suppress(TransportError):
                self.endpoint.act_on_next(0.1)

    def __enter__(self) -> PartyEndpoint:
        self.thread.start()
        return self.endpoint

    def __exit__(self, *_: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
        self.endpoint.close()


def test_send_returns_once_the_receiver_acted_and_its_replies_were_handled(certs: Path) -> None:
    """The in-process call stack, across endpoints: shop's handler answers bank inside bank's
    send; a handler's ProtocolError comes back to the sender as its refusal."""
    bank = PartyEndpoint("bank", identity=_identity(certs, "bank"), deadline=20.0)
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)
    bank.add_peer("shop", shop.address)
    shop.add_peer("bank", bank.address)
    acted: list[int] = []

    def handle(message: Message) -> None:
        if message.round == 13:
            raise ProtocolError("round 13 is not the round expected")
        if message.round == 14:  # its own data refuse it: said as such, not as a crash
            raise DataError("new.csv: the 5 columns this party's model was trained on expected")
        acted.append(message.round)
        shop.send(_greeting(sender="shop", receiver="bank"))  # a reply, nested in bank's send

    shop.handler = handle
    with bank, _Serving(shop):
        bank.send(_greeting())
        assert acted == [1]
        # The reply is already here when send returns: nothing to wait for.
        assert bank.receive(0.0, sender="shop").sender == "shop"
        with pytest.raises(ProtocolError) as refused:
            bank.send(dataclasses.replace(_greeting(), round=13))
        assert str(refused.value) == (
            "representation from bank to shop refused: shop refused representation "
            "from bank: round 13 is not the round expected"
        )
        with pytest.raises(ProtocolError) as refused:
            bank.send(dataclasses.replace(_greeting(), round=14))
        assert str(refused.value) == (
            "representation from bank to shop refused: shop could not act on representation "
            "from bank: new.csv: the 5 columns this party's model was trained on expected"
        )
        bank.send(dataclasses.replace(_greeting(), round=2))  # shop goes on after refusing
        assert acted == [1, 2]
    assert bank.bytes[("bank", "shop", "train")] == 4 * len(wire.encode(_greeting()))


class _Relay(Party):
    """Answers a representation from shop with one to bank, sent after its answer to shop."""

    def on_representation(self, message: RepresentationMessage) -> None:
        reply = _greeting(sender=self.name, receiver="bank")
        self.send_after(dataclasses.replace(reply, round=message.round))


class _Driver(Party):
    """bank's party: keeps what arrives (for take) and runs ``check`` on it first."""

    def __init__(self, check: Any) -> None:
        super().__init__("bank")
        self.check = check

    def on_representation(self, message: RepresentationMessage) -> None:
        self.check(message)
        self._inbox.append(message)


def _relaying(certs: Path, check: Any) -> tuple[_Driver, dict[str, PartyEndpoint], threading.Event]:
    """bank (a driving party on this thread) -> shop -> aggregator (a relay), which answers shop
    and then sends bank a reply; shop's handler sets the event it returns once its send to the
    aggregator has returned."""
    endpoints = {
        name: PartyEndpoint(name, identity=_identity(certs, name), deadline=20.0)
        for name in ("bank", "shop", "aggregator")
    }
    for name, endpoint in endpoints.items():
        for peer, other in endpoints.items():
            if peer != name:
                endpoint.add_peer(peer, other.address)
    driver, relay = _Driver(check), _Relay("aggregator")
    driver.connect(NetworkChannel(endpoints["bank"]))
    relay.connect(NetworkChannel(endpoints["aggregator"]))
    returned = threading.Event()

    def shop_acts(message: Message) -> None:
        relayed = _greeting(sender="shop", receiver="aggregator")
        endpoints["shop"].send(dataclasses.replace(relayed, round=message.round))
        returned.set()

    endpoints["shop"].handler = shop_acts
    return driver, endpoints, returned


def test_a_reply_sent_after_the_answer_does_not_hold_up_whoever_caused_it(certs: Path) -> None:
    """Party.send_after over the network: the aggregator answers shop's delivery, then sends
    bank its reply, so shop's send has returned by the time bank acts on the reply (nested,
    shop would still be waiting for bank: the wait below would time out), and bank's send
    returns once shop has acted, the reply handled on the way or waited for with take."""
    returned_first: list[bool] = []
    driver, endpoints, returned = _relaying(
        certs, lambda message: returned_first.append(returned.wait(10.0))
    )
    with endpoints["bank"], _Serving(endpoints["shop"]), _Serving(endpoints["aggregator"]):
        driver.send(_greeting())
        reply = driver.take("representation", sender="aggregator", round=1, batch_id=0)
        assert reply.sender == "aggregator" and returned_first == [True]


def test_a_reply_sent_after_the_answer_is_refused_in_its_receivers_own_wait(
    certs: Path,
) -> None:
    """Nobody relays bank's refusal of a reply the aggregator sent after answering (the
    aggregator only logs it): bank's own take raises it, naming it, at once rather than
    waiting out the deadline for a reply that will not come."""

    def refuse(message: Message) -> None:
        raise ProtocolError("a reply of round 1 is not wanted")

    driver, endpoints, _ = _relaying(certs, refuse)
    with endpoints["bank"], _Serving(endpoints["shop"]), _Serving(endpoints["aggregator"]):
        driver.send(_greeting())  # shop acted: no refusal of its own to relay
        start = time.monotonic()
        with pytest.raises(ProtocolError, match="a reply of round 1 is not wanted") as refused:
            driver.take("representation", sender="aggregator", round=1, batch_id=0)
        assert not isinstance(refused.value, TransportError)
        assert time.monotonic() - start < 10.0


def test_a_refused_reply_to_an_abandoned_attempt_is_forgotten_and_the_retry_waits_afresh(
    certs: Path,
) -> None:
    """A driver that abandons an attempt (a party lost) forgets its refusals of replies to it
    (what NetworkChannel.forget_refusals asks its endpoint): the retry's take gets the retry's
    reply instead of raising the old refusal (which it does without forgetting: the test
    above)."""
    refused: list[int] = []

    def refuse_the_first(message: Message) -> None:
        if not refused:
            refused.append(message.round)
            raise ProtocolError("a reply to the abandoned attempt")

    driver, endpoints, _ = _relaying(certs, refuse_the_first)
    with endpoints["bank"], _Serving(endpoints["shop"]), _Serving(endpoints["aggregator"]):
        driver.send(_greeting())
        while not refused:  # the reply came after the send returned: act on it
            endpoints["bank"].act_on_next(10.0)
        assert endpoints["bank"].forget_detached_refusals() == [
            "bank refused representation from aggregator: a reply to the abandoned attempt"
        ]
        assert endpoints["bank"].forget_detached_refusals() == []
        # The retry, in a round of its own (a party takes each message once; a driver's
        # retry of the same round follows its abort, which these parties have no use for).
        driver.send(dataclasses.replace(_greeting(), round=2))
        reply = driver.take("representation", sender="aggregator", round=2, batch_id=0)
        assert reply.sender == "aggregator" and refused == [1]


def test_a_party_never_set_up_for_the_run_is_reported_lost_by_its_sender(certs: Path) -> None:
    """A receiver that refuses a message as never set up for its run (a restarted process) is
    lost to its sender's channel, without a probe (its process is up); a NotSetUpError it met
    further down a chain (naming another party) is an ordinary refusal."""
    bank = PartyEndpoint("bank", identity=_identity(certs, "bank"), deadline=20.0)
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)
    bank.add_peer("shop", shop.address)

    def handle(message: Message) -> None:
        raise NotSetUpError("shop" if message.round == 1 else "telco", "not set up")

    shop.handler = handle
    with bank, _Serving(shop):
        channel = NetworkChannel(bank)
        with pytest.raises(ProtocolError) as further:
            bank.send(dataclasses.replace(_greeting(), round=2))
        assert not isinstance(further.value, NotSetUpError), further.value
        assert "refused: shop refused representation from bank: not set up" in str(further.value)
        assert bank.restarted == set() and channel.unreachable(["shop"]) == []
        with pytest.raises(NotSetUpError) as own:
            bank.send(_greeting())
        assert own.value.party == "shop"
        assert "shop was never set up for this run" in str(own.value)
        assert bank.restarted == {"shop"}
        assert channel.unreachable(["shop"]) == ["shop"]
        assert bank.restarted == set()  # reported once; its process is up: not lost again
        assert channel.unreachable(["shop"]) == []


def test_a_refusal_tells_the_sender_what_redact_leaves_and_the_own_log_everything(
    certs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A serving party's refusals name its own directories to the sender only by what they
    are (:func:`~secure_vfl.deployment.private_paths`); its own log keeps the paths."""
    models = tmp_path / "org" / "models"
    data = tmp_path / "org"
    redact = private_paths({"its data directory": data, "its model directory": models, "x": None})
    assert redact(f"{models}/a.pt and {data}/shop.csv, {data.resolve()}") == (
        "<its model directory>/a.pt and <its data directory>/shop.csv, <its data directory>"
    )
    # Never "/" or "." as such: a relative directory is matched resolved only.
    around = private_paths({"the root": Path("/"), "here": Path(".")})
    assert around(f"/a ./b {Path.cwd()}/c") == "/a ./b <here>/c"
    bank = PartyEndpoint("bank", identity=_identity(certs, "bank"), deadline=20.0)
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)
    bank.add_peer("shop", shop.address)

    def handle(message: Message) -> None:
        raise ProtocolError(f"{models}/part.pt does not match its SHA-256")

    shop.handler = handle
    shop.redact = redact
    with bank, _Serving(shop), pytest.raises(ProtocolError) as refused:
        bank.send(_greeting())
    assert "<its model directory>/part.pt does not match" in str(refused.value)
    assert str(tmp_path) not in str(refused.value)
    assert f"{models}/part.pt does not match" in caplog.text


def test_send_all_lets_its_receivers_act_at_once_and_raises_a_refusal_after_all_acted(
    certs: Path,
) -> None:
    """shop's handler waits for aggregator's to have acted: one send after the other would
    leave it waiting in vain (it records False); send_all has both deliveries in flight."""
    bank = PartyEndpoint("bank", identity=_identity(certs, "bank"), deadline=20.0)
    peers = {
        name: PartyEndpoint(name, identity=_identity(certs, name), deadline=20.0)
        for name in ("shop", "aggregator")
    }
    for name, peer in peers.items():
        bank.add_peer(name, peer.address)
    aggregator_acted = threading.Event()
    seen: list[tuple[str, int, bool]] = []

    def shop_handler(message: Message) -> None:
        seen.append(("shop", message.round, aggregator_acted.wait(timeout=10.0)))
        if message.round == 13:
            raise ProtocolError("round 13 is not the round expected")

    def aggregator_handler(message: Message) -> None:
        seen.append(("aggregator", message.round, True))
        aggregator_acted.set()

    peers["shop"].handler = shop_handler
    peers["aggregator"].handler = aggregator_handler
    to_shop, to_aggregator = _greeting(), _greeting(receiver="aggregator")
    with bank, _Serving(peers["shop"]), _Serving(peers["aggregator"]):
        sizes = bank.send_all([to_shop, to_aggregator])
        assert sorted(seen) == [("aggregator", 1, True), ("shop", 1, True)]
        assert sizes == [len(wire.encode(to_shop)), len(wire.encode(to_aggregator))]
        seen.clear()
        aggregator_acted.clear()
        failed: dict[str, ProtocolError] = {}
        with pytest.raises(ProtocolError, match="round 13 is not the round expected"):
            bank.send_all(
                [dataclasses.replace(m, round=13) for m in (to_shop, to_aggregator)],
                failed=failed,
            )
        assert sorted(seen) == [("aggregator", 13, True), ("shop", 13, True)]
        # whose refusal it was (a label party ending a run said "it did not answer")
        assert list(failed) == ["shop"] and "round 13 is not" in str(failed["shop"])
    assert bank.bytes[("bank", "shop", "train")] == 2 * len(wire.encode(to_shop))
    assert bank.bytes[("bank", "aggregator", "train")] == 2 * len(wire.encode(to_aggregator))


def test_a_retried_delivery_is_acted_on_once_and_a_replay_is_refused(certs: Path) -> None:
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)
    bank = _identity(certs, "bank")
    credentials = grpc.ssl_channel_credentials(bank.ca, bank.key, bank.certificate)
    options = [("grpc.ssl_target_name_override", "shop")]
    data = wire.encode(_greeting())
    other = wire.encode(dataclasses.replace(_greeting(), round=7))
    with (
        _Serving(shop),
        grpc.secure_channel(shop.address, credentials, options=options) as channel,
    ):
        deliver = channel.unary_unary(DELIVER)
        stream = (("svfl-stream", "retry-test"), ("svfl-sequence", "1"))
        deliver(data, timeout=20, metadata=stream)
        deliver(data, timeout=20, metadata=stream)  # a retry: answered, not acted on again
        with pytest.raises(grpc.RpcError) as replay:
            deliver(other, timeout=20, metadata=stream)  # same number, other bytes
        assert replay.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "replays delivery 1 of its stream" in str(replay.value.details())
    # The party's server kept why it refused the replay; the party holds the message once.
    assert len(shop.refused) == 1 and "replays delivery 1 of its stream" in shop.refused[0]
    assert wire.encode(shop.receive(0.0)) == data
    with pytest.raises(TransportError, match="no message from any peer"):
        shop.receive(0.0)


def test_a_number_older_than_the_replay_window_is_refused_and_the_window_stays_bounded(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(network, "REPLAY_WINDOW", 3)
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)
    bank = _identity(certs, "bank")
    credentials = grpc.ssl_channel_credentials(bank.ca, bank.key, bank.certificate)
    options = [("grpc.ssl_target_name_override", "shop")]
    sent = [wire.encode(dataclasses.replace(_greeting(), round=n)) for n in range(1, 7)]
    with (
        _Serving(shop),
        grpc.secure_channel(shop.address, credentials, options=options) as channel,
    ):
        deliver = channel.unary_unary(DELIVER)

        def numbered(number: int) -> tuple[tuple[str, str], ...]:
            return (("svfl-stream", "window-test"), ("svfl-sequence", str(number)))

        for number, data in enumerate(sent, start=1):
            deliver(data, timeout=20, metadata=numbered(number))
        deliver(sent[4], timeout=20, metadata=numbered(5))  # within the window: a retry
        # 2 is forgotten (6 - 3 = 3 is the oldest still remembered): its retry is a replay.
        with pytest.raises(grpc.RpcError) as replay:
            deliver(sent[1], timeout=20, metadata=numbered(2))
        assert replay.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "replays delivery 2 of its stream" in str(replay.value.details())
    (recent,) = shop._deliveries.values()
    assert sorted(recent.arrivals) == [4, 5, 6]
    # The party's server kept why it refused the replay; the party holds each message once.
    assert len(shop.refused) == 1 and "replays delivery 2 of its stream" in shop.refused[0]
    assert [shop.receive(0.0).round for _ in sent] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(TransportError, match="no message from any peer"):
        shop.receive(0.0)
    # Acted on, a delivery keeps what a retry is answered with, not its messages (a step's
    # tensors): 1024 of them per sender stream held up to 64 MiB each.
    assert [arrival.messages for arrival in recent.arrivals.values()] == [(), (), ()]


def test_a_frame_the_server_refuses_does_not_stop_the_party(certs: Path) -> None:
    """Bytes the codec refuses, or a message addressed to another party, from a peer with a
    certificate of the federation's CA: the sender gets the refusal, the receiving party's log
    and `refused` the reason, and the party goes on acting on what comes next (here: its
    thread acts on the good delivery, which returns). The refusal used to reach the party's
    next wait as a ProtocolError, which ended a serving party's process (exit 2) and the label
    party's run: one bad frame stopped a federation."""
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)
    bank = _identity(certs, "bank")
    credentials = grpc.ssl_channel_credentials(bank.ca, bank.key, bank.certificate)
    options = [("grpc.ssl_target_name_override", "shop")]
    with (
        _Serving(shop),
        grpc.secure_channel(shop.address, credentials, options=options) as channel,
    ):
        deliver = channel.unary_unary(DELIVER)
        bad = (b"\x00garbage", wire.encode(_greeting(receiver="telco")))
        for number, data in enumerate(bad, start=1):
            with pytest.raises(grpc.RpcError) as refused:
                deliver(
                    data,
                    timeout=20,
                    metadata=(("svfl-stream", "s"), ("svfl-sequence", str(number))),
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        deliver(
            wire.encode(_greeting()),
            timeout=10,
            metadata=(("svfl-stream", "s"), ("svfl-sequence", "3")),
        )
    assert wire.encode(shop.receive(0.0)) == wire.encode(_greeting())
    first, second = shop.refused
    assert "a message from bank that the codec refuses: magic bytes" in first
    assert "a representation from bank addressed to 'telco'" in second


def test_a_refused_reply_sent_after_its_answer_is_raised_where_it_is_awaited(
    certs: Path,
) -> None:
    """A reply that travels detached (the aggregator's sum, sent after it answered) has no
    sender waiting to relay its refusal: when the server refuses it (here bytes the codec
    refuses, as a sum that overflowed to inf would be), the party awaiting it is woken and
    told why, rather than waiting out its deadline for a reply that will not come. Only the
    aggregator sends such replies: the same mark from another certificate of the CA (a member
    or not) is a refusal like any other, which does not fail the wait (the review found any
    certificate could end the label party's run so)."""
    shop = PartyEndpoint(
        "shop",
        identity=_identity(certs, "shop"),
        deadline=2.0,
        members=["bank", "shop", "aggregator"],
    )
    options = [("grpc.ssl_target_name_override", "shop")]
    metadata = (("svfl-stream", "s"), ("svfl-sequence", "1"), ("svfl-detached", "1"))

    def deliver_as(name: str) -> None:
        caller = _identity(certs, name)
        credentials = grpc.ssl_channel_credentials(caller.ca, caller.key, caller.certificate)
        with (
            grpc.secure_channel(shop.address, credentials, options=options) as channel,
            pytest.raises(grpc.RpcError),
        ):
            channel.unary_unary(DELIVER)(b"\x00garbage", timeout=10, metadata=metadata)

    try:
        for name in ("bank", "requester"):  # a member that sends no detached reply; none
            deliver_as(name)
            with pytest.raises(TransportError, match="no sum arrived within 2 s"):
                shop.await_reply("sum")
        assert len(shop.refused) == 2
        deliver_as("aggregator")
        start = time.monotonic()
        with pytest.raises(ProtocolError, match="that the codec refuses: magic bytes"):
            shop.await_reply("sum")
        assert time.monotonic() - start < 1.5  # woken, not timed out
    finally:
        shop.close()


def test_a_certificate_of_the_ca_for_a_non_member_is_refused(certs: Path) -> None:
    """The CA outlives a federation (one CA for several is the documented way): a certificate
    it issued to "requester", which this federation does not count among its members, reaches
    no party. Refused with PERMISSION_DENIED, a stream before any of it is read; a member
    goes through."""
    shop = PartyEndpoint(
        "shop", identity=_identity(certs, "shop"), deadline=20.0, members=["bank", "shop"]
    )
    outsider = _identity(certs, "requester")
    credentials = grpc.ssl_channel_credentials(outsider.ca, outsider.key, outsider.certificate)
    options = [("grpc.ssl_target_name_override", "shop")]
    data = wire.encode(_greeting(sender="requester"))
    with (
        _Serving(shop),
        grpc.secure_channel(shop.address, credentials, options=options) as channel,
    ):
        metadata = (("svfl-stream", "s"), ("svfl-sequence", "1"))
        calls = [
            (channel.unary_unary(DELIVER), data, metadata),
            (channel.stream_unary(DELIVER_STREAM), iter([data]), (("svfl-size", "9" * 8),)),
        ]
        for call, request, call_metadata in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=20, metadata=call_metadata)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert refused.value.details() == (
                "shop: a caller whose certificate names 'requester', not a member of the "
                "federation (bank, shop)."
            )
        bank = _identity(certs, "bank")
        member = grpc.ssl_channel_credentials(bank.ca, bank.key, bank.certificate)
        with grpc.secure_channel(shop.address, member, options=options) as from_bank:
            from_bank.unary_unary(DELIVER)(wire.encode(_greeting()), timeout=10, metadata=metadata)
    assert wire.encode(shop.receive(0.0)) == wire.encode(_greeting())
    assert len(shop.refused) == 2


def _as_bank(certs: Path, address: str) -> grpc.Channel:
    """A channel to shop at ``address`` under bank's certificate: the test process as bank."""
    bank = _identity(certs, "bank")
    credentials = grpc.ssl_channel_credentials(bank.ca, bank.key, bank.certificate)
    return grpc.secure_channel(address, credentials, [("grpc.ssl_target_name_override", "shop")])


def test_a_delivery_whose_caller_set_no_deadline_is_answered(certs: Path) -> None:
    """gRPC tells a call without a deadline as about 2^63 seconds left, more than the server's
    wait for its party can take: the caller was answered UNKNOWN ("timestamp out of range for
    platform time_t"), though the party acted on its message. It waits the endpoint's deadline."""
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)
    with _Serving(shop), _as_bank(certs, shop.address) as channel:
        metadata = (("svfl-stream", "s"), ("svfl-sequence", "1"))
        call = channel.unary_unary(DELIVER).future(wire.encode(_greeting()), metadata=metadata)
        try:
            assert call.result(timeout=30) == b""
        finally:
            call.cancel()
    assert wire.encode(shop.receive(0.0)) == wire.encode(_greeting())


def _unfinished(release: threading.Event, every: float | None = None) -> Iterator[bytes]:
    """A streamed message's chunks as a caller that ties up a server sends them: one, then
    nothing more until ``release`` (``every``: another one every so many seconds, a trickle).
    Its stream announces 5 MB (:data:`_ANNOUNCED`), which it never completes."""
    yield b"\0" * 1024
    while not release.wait(every):
        yield b"\0" * 1024


def _never_sent(release: threading.Event) -> Iterator[bytes]:
    """The message of a ``Deliver`` call (unary: one message) that never comes."""
    release.wait()
    yield from ()


_ANNOUNCED = (("svfl-size", "5000000"),)
_HOLDING = {  # the calls a caller can hold a server's threads with: their method and messages
    "streams": (DELIVER_STREAM, _unfinished, _ANNOUNCED),
    "deliveries": (DELIVER, _never_sent, ()),
}


def _ended(calls: list[Any], count: int, seconds: float) -> list[Any]:
    """Those of ``calls`` (gRPC futures) that ended, once ``count`` have or ``seconds`` passed."""
    end = time.monotonic() + seconds
    while sum(call.done() for call in calls) < count and time.monotonic() < end:
        time.sleep(0.05)
    return [call for call in calls if call.done()]


@pytest.mark.parametrize("holding", sorted(_HOLDING))
def test_a_caller_is_refused_calls_past_its_limit_and_other_members_still_get_through(
    launcher: Launcher, certs: Path, tmp_path: Path, holding: str
) -> None:
    """Any holder of a certificate of the CA held every thread of a party's server with 16
    calls it never finished (streams, or unary deliveries whose message never came, which
    gRPC waited for before the party's code saw the call), and no member's delivery got
    through. One caller has at most CALLS_PER_CALLER calls served at once; those past it are
    refused at once, saying whose and why, and another member's delivery goes through."""
    listener = _listener(launcher, certs, tmp_path, deadline=60.0)  # nothing broken off
    method, messages, metadata = _HOLDING[holding]
    extra = network.SERVER_THREADS - network.CALLS_PER_CALLER
    reason = (
        f"shop: bank already has {network.CALLS_PER_CALLER} calls in flight here, the most "
        "one caller may have at once; refused."
    )
    release = threading.Event()
    with _as_bank(certs, listener.address) as channel:
        holding_call = channel.stream_unary(method)
        calls = [
            holding_call.future(messages(release), timeout=120, metadata=metadata)
            for _ in range(network.SERVER_THREADS)
        ]
        try:
            refused = _ended(calls, extra, seconds=30)
            assert len(refused) == extra
            for ended in refused:
                assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert ended.details() == reason
            assert not any(call.done() for call in calls if call not in refused)  # still held
            aggregator = _identity(certs, "aggregator")
            with PartyEndpoint("aggregator", identity=aggregator, deadline=20.0) as sender:
                sender.add_peer("shop", listener.address)
                sender.send(_greeting(sender="aggregator"))
            outcome = listener.outcome(timeout=60)
        finally:
            for call in calls:
                call.cancel()
            release.set()
    (arrived,) = read_capture(tmp_path / "shop.received")
    assert wire.encode(arrived) == wire.encode(_greeting(sender="aggregator"))
    # Each refusal was logged and kept where the party's server keeps its refusals.
    assert outcome == {"ok": True, "refusals": [], "refused": [reason] * extra}


@pytest.mark.parametrize("held", ["stops", "trickles", "never-sent"])
def test_a_call_whose_messages_do_not_all_arrive_within_the_deadline_is_broken_off(
    launcher: Launcher, certs: Path, tmp_path: Path, held: str
) -> None:
    """A stream whose caller stops sending its chunks, or trickles them, or a delivery whose
    message never comes, held a server thread (and what had arrived) as long as the caller's
    own deadline, here far off (none at all was as good). It is broken off once the receiving
    party's deadline (2 s here) has passed, with DEADLINE_EXCEEDED saying so; the caller's
    next delivery goes through."""
    listener = _listener(launcher, certs, tmp_path)  # its endpoint's deadline: 2 s
    release = threading.Event()
    if held == "never-sent":
        method, messages, metadata = DELIVER, _never_sent(release), ()
        what = "a delivery"
    else:
        method, metadata = DELIVER_STREAM, _ANNOUNCED
        messages = _unfinished(release, every=0.3 if held == "trickles" else None)
        what = "a streamed message of 5000000 bytes"
    with _as_bank(certs, listener.address) as channel:
        try:
            with pytest.raises(grpc.RpcError) as broken:
                channel.stream_unary(method)(messages, timeout=30, metadata=metadata)
        finally:
            release.set()
    assert broken.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    reason = str(broken.value.details())
    assert re.fullmatch(
        rf"shop: {what} from bank did not arrive within the deadline \(2 s; \d+ bytes did\); "
        r"broken off\.",
        reason,
    ), reason
    outcome = _legitimate_delivery(certs, listener, tmp_path)
    assert outcome["ok"] and outcome["refused"] == [reason]


def test_without_tls_a_caller_is_its_connection_and_its_places_come_back_however_calls_end(
    certs: Path,
) -> None:
    """A plaintext caller tells no name: its limit is its connection's (the address gRPC
    gives, ``context.peer()``), another connection is another caller. A caller's places come
    back however its calls end: cancelled by it, broken off at the deadline, refused."""
    shop = PartyEndpoint("shop", insecure=True, deadline=2.0)
    limit = network.CALLS_PER_CALLER
    release = threading.Event()
    with (
        _Serving(shop),
        grpc.insecure_channel(shop.address) as first,
        # A connection of its own (gRPC shares one between a process's channels to an address).
        grpc.insecure_channel(shop.address, [("grpc.use_local_subchannel_pool", 1)]) as second,
    ):
        stream, deliver = first.stream_unary(DELIVER_STREAM), first.unary_unary(DELIVER)
        held = [
            stream.future(_unfinished(release), timeout=30, metadata=_ANNOUNCED)
            for _ in range(limit + 1)
        ]
        try:
            (refused,) = _ended(held, 1, seconds=20)
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert re.fullmatch(
                rf"shop: the plaintext peer at ipv4:127\.0\.0\.1:\d+ already has {limit} calls "
                r"in flight here, the most one caller may have at once; refused\.",
                str(refused.details()),
            ), refused.details()
            metadata = (("svfl-stream", "s"), ("svfl-sequence", "1"))
            second.unary_unary(DELIVER)(wire.encode(_greeting()), timeout=10, metadata=metadata)
            for call in held[:2]:
                call.cancel()  # the others are broken off at the deadline
            assert len(_ended(held, len(held), seconds=20)) == len(held)
        finally:
            for call in held:
                call.cancel()
            release.set()
        end = time.monotonic() + 10
        while shop._in_flight and time.monotonic() < end:  # a cancellation takes a moment
            time.sleep(0.05)
        assert not shop._in_flight
        # Refused deliveries, more of them than the limit, one after another: none keeps a place.
        for _ in range(limit + 1):
            with pytest.raises(grpc.RpcError) as too_long:
                stream(iter([b"x" * 11]), timeout=10, metadata=(("svfl-size", "10"),))
            assert too_long.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "longer than the 10 bytes announced" in str(too_long.value.details())
            with pytest.raises(grpc.RpcError) as garbage:
                deliver(b"\x00garbage", timeout=10, metadata=metadata)
            assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        metadata = (("svfl-stream", "s"), ("svfl-sequence", "2"))
        deliver(wire.encode(_greeting()), timeout=10, metadata=metadata)
        assert not shop._in_flight
    assert [shop.receive(0.0).round for _ in range(2)] == [1, 1]


def test_members_holding_their_calls_together_cannot_keep_another_member_out() -> None:
    """A server had 16 threads whatever its federation: four members holding their 4 calls
    each left no thread for a fifth, whose delivery gRPC refused ("Concurrent RPC limit
    exceeded"). A server that knows its members has a thread for each member's every call
    and as many more. (Plaintext callers here: each connection is a caller of its own.)"""
    members = [f"member-{k}" for k in range(6)]
    shop = PartyEndpoint("shop", insecure=True, deadline=30.0, members=members)
    assert shop.server_threads == network.CALLS_PER_CALLER * (len(members) + 1)
    release = threading.Event()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_Serving(shop))
        channels = [  # a connection each (gRPC shares one between a process's channels)
            stack.enter_context(
                grpc.insecure_channel(shop.address, [("grpc.use_local_subchannel_pool", 1)])
            )
            for _ in range(len(members))
        ]
        held = [
            channel.stream_unary(DELIVER_STREAM).future(
                _unfinished(release), timeout=60, metadata=_ANNOUNCED
            )
            for channel in channels[:-1]
            for _ in range(network.CALLS_PER_CALLER)
        ]
        try:
            assert len(held) > network.SERVER_THREADS
            assert _ended(held, 1, seconds=3) == []  # every one is served, none refused
            metadata = (("svfl-stream", "s"), ("svfl-sequence", "1"))
            deliver = channels[-1].unary_unary(DELIVER)
            assert deliver(wire.encode(_greeting()), timeout=20, metadata=metadata) == b""
        finally:
            for call in held:
                call.cancel()
            release.set()


def test_a_call_whose_caller_went_away_gives_its_place_back_and_a_retry_is_answered() -> None:
    """A delivery's call held its caller's place until the party acted on its message, even once
    its caller had gone away (a dropped connection, a caller that gave up): retries of one
    delivery during one long action of the party (a set-up) used up the caller's places, and
    the next was refused for good (RESOURCE_EXHAUSTED is not retried). A call now gives its
    place back when it ends; the retry is answered with the party's outcome once it acts."""
    shop = PartyEndpoint("shop", insecure=True, deadline=60.0)  # its party acts on nothing yet
    try:
        with grpc.insecure_channel(shop.address) as channel:
            deliver = channel.unary_unary(DELIVER)
            data = wire.encode(_greeting())
            metadata = (("svfl-stream", "s"), ("svfl-sequence", "1"))
            for _ in range(network.CALLS_PER_CALLER + 1):  # the first attempt and its retries
                attempt = deliver.future(data, timeout=30, metadata=metadata)
                time.sleep(0.3)  # it reaches the server and waits there for the party
                attempt.cancel()
            end = time.monotonic() + 10
            while shop._in_flight and time.monotonic() < end:  # a cancellation takes a moment
                time.sleep(0.05)
            assert not shop._in_flight
            retry = deliver.future(data, timeout=30, metadata=metadata)
            assert shop.receive(10.0).round == 1  # the party acts on it, once
            assert retry.result(timeout=10) == b""
            with pytest.raises(TransportError):
                shop.receive(0.0)  # nothing more arrived: the attempts were one delivery
    finally:
        shop.close()


def test_a_caller_whose_calls_end_first_queues_no_more_than_its_limit_of_deliveries(
    certs: Path,
) -> None:
    """A call that ends before the party acts on its delivery (cancelled, or past its caller's
    deadline) leaves the delivery queued for the party, as it should be (a retry is answered
    from it): a caller that ended each call at once queued as many deliveries as it sent, each
    up to the codec's limit, while the party was busy. At most UNACTED_PER_CALLER wait for one
    caller; the next is refused at once, saying why, another member's still gets through, and
    the caller's own do again once the party has acted on its queue."""
    limit = network.UNACTED_PER_CALLER
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=60.0)  # acts later
    aggregator = _identity(certs, "aggregator")
    as_aggregator = grpc.secure_channel(
        shop.address,
        grpc.ssl_channel_credentials(aggregator.ca, aggregator.key, aggregator.certificate),
        [("grpc.ssl_target_name_override", "shop")],
    )
    try:
        with _as_bank(certs, shop.address) as channel, as_aggregator:
            deliver = channel.unary_unary(DELIVER)
            data = wire.encode(_greeting())

            def delivery(number: int) -> dict[str, Any]:
                metadata = (("svfl-stream", "s"), ("svfl-sequence", str(number)))
                return {"request": data, "timeout": 30, "metadata": metadata}

            for number in range(limit):
                with pytest.raises(grpc.RpcError) as ended:
                    deliver(**{**delivery(number), "timeout": 0.5})  # gone before it is acted on
                assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(grpc.RpcError) as refused:
                deliver(**delivery(limit))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            reason = (
                f"shop: bank already has {limit} deliveries here that the party has not acted "
                "on, the most one caller may have; refused."
            )
            assert refused.value.details() == reason
            assert list(shop.refused) == [reason]
            other = as_aggregator.unary_unary(DELIVER).future(
                wire.encode(_greeting(sender="aggregator")),
                timeout=30,
                metadata=(("svfl-stream", "a"), ("svfl-sequence", "0")),
            )
            senders = [shop.receive(10.0).sender for _ in range(limit + 1)]
            assert senders == ["bank"] * limit + ["aggregator"]
            assert other.result(timeout=10) == b""
            again = deliver.future(**delivery(limit + 1))
            assert shop.receive(10.0).sender == "bank"
            assert again.result(timeout=10) == b""
    finally:
        shop.close()


def test_a_delivery_that_could_not_be_recorded_does_not_count_among_those_waiting(
    certs: Path,
) -> None:
    """A delivery whose bytes the capture file refused (a full disk) was counted among its
    caller's deliveries waiting for the party (UNACTED_PER_CALLER) but never handed to the
    party, so never counted off: after that many such failures the caller was refused for
    good, though nothing of it waited. Such a delivery is now answered as failed (a retry
    too) and counts no more."""

    class FullDisk(io.BytesIO):
        full = True
        name = "capture.bin"

        def write(self, data: Any) -> int:
            if self.full:
                raise OSError(28, "No space left on device")
            return super().write(data)

    capture = FullDisk()
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=30.0, capture=capture)
    try:
        with _as_bank(certs, shop.address) as channel:
            deliver = channel.unary_unary(DELIVER)
            data = wire.encode(_greeting())

            def metadata(number: int) -> tuple[tuple[str, str], ...]:
                return (("svfl-stream", "s"), ("svfl-sequence", str(number)))

            for number in range(network.UNACTED_PER_CALLER):
                with pytest.raises(grpc.RpcError):
                    deliver(data, timeout=10, metadata=metadata(number))
            assert not shop._unacted
            with pytest.raises(grpc.RpcError) as retried:  # answered from the first attempt
                deliver(data, timeout=10, metadata=metadata(0))
            assert retried.value.code() == grpc.StatusCode.INTERNAL
            assert "shop could not record representation from bank" in retried.value.details()
            capture.full = False  # room again
            again = deliver.future(data, timeout=10, metadata=metadata(network.UNACTED_PER_CALLER))
            assert shop.receive(10.0).sender == "bank"
            assert again.result(timeout=10) == b""
    finally:
        shop.close()


def test_a_callers_refusals_are_logged_up_to_a_bound_in_each_span(
    certs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every refused delivery was logged: a caller sending bytes the codec refuses as fast as
    it could call filled the party's log, and buried what else it said. At most
    REFUSALS_LOGGED of one caller's refusals are logged in each span of REFUSAL_LOG_SECONDS,
    with a line saying the next are not and, when the next span begins, how many were not;
    every refusal is still kept and answered, and another caller's are logged."""
    monkeypatch.setattr(network, "REFUSALS_LOGGED", 3)
    monkeypatch.setattr(network, "REFUSAL_LOG_SECONDS", 3.0)
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)
    aggregator = _identity(certs, "aggregator")
    as_aggregator = grpc.secure_channel(
        shop.address,
        grpc.ssl_channel_credentials(aggregator.ca, aggregator.key, aggregator.certificate),
        [("grpc.ssl_target_name_override", "shop")],
    )
    metadata = (("svfl-stream", "s"), ("svfl-sequence", "1"))

    def refused(channel: grpc.Channel) -> None:
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary(DELIVER)(b"garbage", timeout=10, metadata=metadata)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def logged(text: str) -> int:
        return sum(text in record.getMessage() for record in caplog.records)

    try:
        with (
            caplog.at_level("WARNING", logger=network.__name__),
            _as_bank(certs, shop.address) as channel,
            as_aggregator,
        ):
            start = time.monotonic()
            for _ in range(6):
                refused(channel)
            refused(as_aggregator)
            assert time.monotonic() - start < 3.0  # one span
            assert logged("shop: a message from bank that the codec refuses") == 3
            assert (
                logged(
                    "shop: 3 refusals of deliveries from bank within 3 s; the next ones are not "
                    "logged until 3 s have passed"
                )
                == 1
            )
            assert logged("shop: a message from aggregator that the codec refuses") == 1
            assert len(shop.refused) == 7  # kept all the same
            time.sleep(3.0 - (time.monotonic() - start) + 0.2)  # the next span
            refused(channel)
            assert logged("shop: 3 more refusals of deliveries from bank were not logged.") == 1
            assert logged("shop: a message from bank that the codec refuses") == 4
            for _ in range(4):  # five in this span: two past the bound...
                refused(channel)
            shop.close()  # ...said when the party stops, as no later refusal will
            assert logged("shop: 2 more refusals of deliveries from bank were not logged.") == 1
    finally:
        shop.close()


def test_a_plaintext_callers_party_refusals_count_against_its_host_whatever_name_it_claims(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The party's refusals were counted by the sender name a message claims, which a plaintext
    caller chooses: a new name for each delivery had every refusal logged. They count against
    the caller's host, as the server's refusals do."""
    monkeypatch.setattr(network, "REFUSALS_LOGGED", 3)

    def refuse(message: Message) -> None:
        raise ProtocolError(f"no {message.sender} here")

    shop = PartyEndpoint("shop", insecure=True, deadline=20.0)
    shop.handler = refuse
    with (
        caplog.at_level("WARNING", logger=network.__name__),
        _Serving(shop),
        grpc.insecure_channel(shop.address) as channel,
    ):
        metadata = (("svfl-stream", "s"), ("svfl-sequence", "1"))
        for k in range(6):
            with pytest.raises(grpc.RpcError) as error:
                channel.unary_unary(DELIVER)(
                    wire.encode(_greeting(sender=f"name-{k}")), timeout=10, metadata=metadata
                )
            assert error.value.code() == grpc.StatusCode.ABORTED
        with pytest.raises(grpc.RpcError):
            channel.unary_unary(DELIVER)(b"garbage", timeout=10, metadata=metadata)
    messages = [record.getMessage() for record in caplog.records]
    assert sum("shop refused representation from name-" in text for text in messages) == 3
    assert sum("from ipv4:127.0.0.1 within" in text for text in messages) == 1
    assert not any("the codec refuses" in text for text in messages)  # the same host's


def test_a_partys_own_failure_is_logged_past_the_bound_of_a_callers_refusals(
    certs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The bound on a caller's refusals in the log is for what the caller did wrong: a
    failure of the party's own (its code raised acting on the message) is logged however
    many of the caller's deliveries were refused before."""
    monkeypatch.setattr(network, "REFUSALS_LOGGED", 1)
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)

    def broken(message: Message) -> None:
        raise RuntimeError("the party's own bug")

    shop.handler = broken
    with (
        caplog.at_level("WARNING", logger=network.__name__),
        _Serving(shop),
        _as_bank(certs, shop.address) as channel,
    ):
        deliver = channel.unary_unary(DELIVER)
        for number in range(3):  # refused by the codec: one logged
            metadata = (("svfl-stream", "s"), ("svfl-sequence", str(number)))
            with pytest.raises(grpc.RpcError):
                deliver(b"garbage", timeout=10, metadata=metadata)
        metadata = (("svfl-stream", "s"), ("svfl-sequence", "3"))
        with pytest.raises(grpc.RpcError) as failed:
            deliver(wire.encode(_greeting()), timeout=10, metadata=metadata)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    said = [record.getMessage() for record in caplog.records]
    assert sum("the codec refuses" in line for line in said) == 1
    assert sum("shop failed acting on representation from bank" in line for line in said) == 1


def test_messages_to_one_peer_travel_in_one_delivery_acted_on_in_order_up_to_a_refusal(
    certs: Path, tmp_path: Path
) -> None:
    """send_all puts each peer's messages in one call (a step's closing gradient rides with the
    next request): the peer acts on them in their order, stops at the first it refuses, and
    every one is counted and captured as if sent alone."""
    capture = (tmp_path / "shop.capture").open("wb")
    bank = PartyEndpoint("bank", identity=_identity(certs, "bank"), deadline=20.0)
    peers = {
        "shop": PartyEndpoint(
            "shop", identity=_identity(certs, "shop"), deadline=20.0, capture=capture
        ),
        "aggregator": PartyEndpoint("aggregator", identity=_identity(certs, "aggregator")),
    }
    for name, peer in peers.items():
        bank.add_peer(name, peer.address)
    seen: list[tuple[str, int]] = []

    def handler(name: str) -> Any:
        def handle(message: Message) -> None:
            seen.append((name, message.round))
            if message.round == 13:
                raise ProtocolError("round 13 is not the round expected")

        return handle

    for name, peer in peers.items():
        peer.handler = handler(name)
    shop = [dataclasses.replace(_greeting(), round=r) for r in (1, 2, 3)]
    to_aggregator = _greeting(receiver="aggregator")
    with bank, _Serving(peers["shop"]), _Serving(peers["aggregator"]):
        sizes = bank.send_all([shop[0], to_aggregator, shop[1], shop[2]])
        assert sizes == [len(wire.encode(m)) for m in (shop[0], to_aggregator, *shop[1:])]
        assert sorted(seen) == [("aggregator", 1), ("shop", 1), ("shop", 2), ("shop", 3)]
        assert [r for name, r in seen if name == "shop"] == [1, 2, 3]
        (recent,) = peers["shop"]._deliveries.values()
        assert recent.highest == 1  # one delivery for the three
        seen.clear()
        refused = [dataclasses.replace(m, round=r) for m, r in zip(shop, (4, 13, 5), strict=True)]
        with pytest.raises(ProtocolError, match="round 13 is not the round expected"):
            bank.send_all(refused)
        assert seen == [("shop", 4), ("shop", 13)]  # not 5: it follows the refused one
    capture.close()
    delivered = [*shop, *refused]
    assert bank.bytes[("bank", "shop", "train")] == sum(len(wire.encode(m)) for m in delivered)
    assert (
        peers["shop"].received[("bank", "shop", "train")] == bank.bytes[("bank", "shop", "train")]
    )
    assert [wire.encode(m) for m in read_capture(tmp_path / "shop.capture")] == [
        wire.encode(m) for m in delivered
    ]


def test_messages_over_the_size_limit_go_in_several_deliveries_every_peer_at_once(
    certs: Path,
) -> None:
    """Where one peer's messages pass the size limit together, they go in deliveries of as
    many as fit, one after another, in order; every peer's first delivery is in flight at
    once (shop's handler waits for aggregator's to have acted on the same round: one peer
    after the other, it waited in vain), and a refusal stops its own peer's next ones only."""
    greetings = {name: _greeting(receiver=name) for name in ("shop", "aggregator")}
    size = max(len(wire.encode(m)) + CAPTURE_LENGTH.size for m in greetings.values())
    bank = PartyEndpoint(
        "bank", identity=_identity(certs, "bank"), deadline=20.0, max_message_bytes=2 * size
    )
    peers = {
        name: PartyEndpoint(name, identity=_identity(certs, name), deadline=20.0)
        for name in ("shop", "aggregator")
    }
    for name, peer in peers.items():
        bank.add_peer(name, peer.address)
    acted = collections.defaultdict(threading.Event)
    seen: list[tuple[str, int, bool]] = []

    def shop_handler(message: Message) -> None:
        seen.append(("shop", message.round, acted[message.round].wait(timeout=5.0)))
        if message.round == 13:
            raise ProtocolError("round 13 is not the round expected")

    def aggregator_handler(message: Message) -> None:
        seen.append(("aggregator", message.round, True))
        acted[message.round].set()

    peers["shop"].handler = shop_handler
    peers["aggregator"].handler = aggregator_handler
    rounds = (1, 2, 3, 4, 5)
    with bank, _Serving(peers["shop"]), _Serving(peers["aggregator"]):
        sent = [dataclasses.replace(greetings[n], round=r) for r in rounds for n in peers]
        assert bank.send_all(sent) == [len(wire.encode(m)) for m in sent]
        assert [(n, r) for n, r, _ in seen if n == "shop"] == [("shop", r) for r in rounds]
        assert all(waited for _, _, waited in seen)
        for peer in peers.values():  # 2 + 2 + 1 messages
            (deliveries,) = peer._deliveries.values()
            assert deliveries.highest == 3
        seen.clear()
        failed: dict[str, ProtocolError] = {}
        refused = [dataclasses.replace(greetings[n], round=r) for r in (6, 13, 7) for n in peers]
        with pytest.raises(ProtocolError, match="round 13 is not the round expected"):
            bank.send_all(refused, failed=failed)
        assert list(failed) == ["shop"]
        assert [(n, r) for n, r, _ in seen if n == "shop"] == [("shop", 6), ("shop", 13)]
        assert [r for n, r, _ in seen if n == "aggregator"] == [6, 13, 7]
        # A peer's next delivery goes once it acted on its last, not once every peer did:
        # shop's one message waits for aggregator's third delivery (in waves, it waited in vain).
        seen.clear()
        later = [dataclasses.replace(greetings["shop"], round=10)]
        later += [dataclasses.replace(greetings["aggregator"], round=r) for r in range(8, 14)]
        acted[10] = acted[12]  # shop's round 10 waits for aggregator's round 12: its 3rd delivery
        bank.send_all(later)
        assert ("shop", 10, True) in seen
        assert [r for n, r, _ in seen if n == "aggregator"] == list(range(8, 14))


def test_a_malformed_delivery_of_several_messages_is_refused_whole(certs: Path) -> None:
    """A count out of range, a record cut short, bytes after the last record, or one record in
    another party's name: the delivery is refused saying what was expected, and the party acts
    on none of its messages."""
    shop = PartyEndpoint("shop", identity=_identity(certs, "shop"), deadline=20.0)
    bank = _identity(certs, "bank")
    credentials = grpc.ssl_channel_credentials(bank.ca, bank.key, bank.certificate)
    options = [("grpc.ssl_target_name_override", "shop")]
    good = wire.encode(_greeting())
    foreign = wire.encode(_greeting(sender="telco"))

    def records(*parts: bytes) -> bytes:
        return b"".join(CAPTURE_LENGTH.pack(len(part)) + part for part in parts)

    cases = [
        ("1", records(good), grpc.StatusCode.INVALID_ARGUMENT, "a delivery of 2 to 64 messages"),
        ("x", records(good, good), grpc.StatusCode.INVALID_ARGUMENT, "found 'x' announced"),
        ("9" * 5000, records(good), grpc.StatusCode.INVALID_ARGUMENT, "found '99999999"),
        ("3", records(good, good), grpc.StatusCode.INVALID_ARGUMENT, "message 3 is cut short"),
        ("2", records(good, good)[:-1], grpc.StatusCode.INVALID_ARGUMENT, "message 2 is cut"),
        ("2", records(good, good) + b"\0", grpc.StatusCode.INVALID_ARGUMENT, "found 1 more"),
        ("2", records(good, foreign), grpc.StatusCode.PERMISSION_DENIED, "from 'telco'"),
    ]
    with (
        _Serving(shop),
        grpc.secure_channel(shop.address, credentials, options=options) as channel,
    ):
        deliver = channel.unary_unary(DELIVER)
        for number, (count, data, code, reason) in enumerate(cases, start=1):
            metadata = (
                ("svfl-stream", "bundle-test"),
                ("svfl-sequence", str(number)),
                ("svfl-count", count),
            )
            with pytest.raises(grpc.RpcError) as refused:
                deliver(data, timeout=20, metadata=metadata)
            assert refused.value.code() == code, count
            assert reason in str(refused.value.details()), refused.value.details()
        # Numbers int() cannot read (more than 4300 digits) are refusals like any other.
        huge = "9" * 5000
        odd = [
            (deliver, good, (("svfl-stream", "s"), ("svfl-sequence", huge)), "sequence number"),
            (channel.stream_unary(DELIVER_STREAM), iter([good]), (("svfl-size", huge),), "at most"),
        ]
        for call, request, metadata, reason in odd:
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=20, metadata=metadata)
            assert reason in str(refused.value.details()), refused.value.details()
            assert refused.value.code() != grpc.StatusCode.UNKNOWN  # not an exception in it
        # A well-formed one on the same stream goes through: both messages, in order.
        second = dataclasses.replace(_greeting(), round=2)
        metadata = (("svfl-stream", "bundle-test"), ("svfl-sequence", "99"), ("svfl-count", "2"))
        deliver(records(good, wire.encode(second)), timeout=20, metadata=metadata)
    # Each refusal is in the party's `refused`, in order; the party acted on none of them.
    assert len(shop.refused) == len(cases) + len(odd)
    for refusal, (*_, reason) in zip(shop.refused, [*cases, *odd], strict=True):
        assert reason in refusal, (reason, refusal)
    assert [shop.receive(0.0).round for _ in range(2)] == [1, 2]
    with pytest.raises(TransportError, match="no message from any peer"):
        shop.receive(0.0)
