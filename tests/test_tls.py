"""Federation certificates: `certs init` makes a usable set, `certs check` names what is wrong."""

from __future__ import annotations

import base64
import datetime
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protocols import tls
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError, OutputError
from secure_vfl.federation.certificates import TlsIdentity, certificate_name

PARTIES = ("bank", "shop")


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    tls.make_federation(directory, PARTIES)
    return directory


@pytest.fixture
def certs(federation: Path, tmp_path: Path) -> Path:
    """A private copy of the federation's files that a test may break."""
    directory = tmp_path / "certs"
    shutil.copytree(federation, directory)
    return directory


def _ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return ca, key


def _reissue(directory: Path, name: str, **kwargs: object) -> None:
    """Replace ``name``'s certificate by one the CA issues with ``kwargs`` (same key)."""
    ca, ca_key = _ca(directory)
    key = serialization.load_pem_private_key((directory / f"{name}.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    certificate = tls.party_certificate(name, key, ca, ca_key, **kwargs)  # type: ignore[arg-type]
    (directory / f"{name}.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


def _problems(directory: Path, party: str | None = None) -> list[str]:
    return [str(p) for p in tls.check_federation(directory, None if party is None else [party])]


def test_init_writes_a_ca_and_a_key_and_certificate_per_party_that_check_clean(
    federation: Path,
) -> None:
    assert sorted(p.name for p in federation.iterdir()) == sorted(
        ["ca.pem", "ca.key", "bank.pem", "bank.key", "shop.pem", "shop.key"]
    )
    assert tls.check_federation(federation) == []
    for name in PARTIES:
        certificate = x509.load_pem_x509_certificate((federation / f"{name}.pem").read_bytes())
        assert certificate_name(certificate.public_bytes(serialization.Encoding.PEM)) == name
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == [name, "localhost"]
        assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
        usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        key = serialization.load_pem_private_key((federation / f"{name}.key").read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
        lifetime = certificate.not_valid_after_utc - certificate.not_valid_before_utc
        assert lifetime == datetime.timedelta(days=tls.PARTY_DAYS)
    ca = x509.load_pem_x509_certificate((federation / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_keys_are_written_mode_0600_and_certificates_readable(federation: Path) -> None:
    for path in federation.iterdir():
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.suffix == ".key":
            assert mode == 0o600, path
        else:
            assert mode & stat.S_IRUSR and not mode & stat.S_IWOTH, path
    assert not list(federation.glob(".*.tmp"))  # nothing half-written left behind


def test_hosts_become_dns_and_ip_names(tmp_path: Path) -> None:
    tls.make_federation(tmp_path, ["bank"], hosts=("bank.example.org", "10.1.2.3", "::1"))
    certificate = x509.load_pem_x509_certificate((tmp_path / "bank.pem").read_bytes())
    sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["bank", "bank.example.org"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.1.2.3", "::1"]


def test_init_issues_new_parties_with_the_existing_ca_and_never_overwrites(certs: Path) -> None:
    ca_before = (certs / "ca.pem").read_bytes()
    tls.make_federation(certs, ["aggregator"])
    assert (certs / "ca.pem").read_bytes() == ca_before
    assert tls.check_federation(certs) == []
    bank_before = (certs / "bank.key").read_bytes()
    with pytest.raises(ConfigError, match=r"bank\.pem, .*bank\.key already exist"):
        tls.make_federation(certs, ["bank"])
    assert (certs / "bank.key").read_bytes() == bank_before


def test_init_refuses_new_certificates_that_would_pass_for_a_party_of_the_set(
    tmp_path: Path,
) -> None:
    """Within one call a --san that is a party's name was refused; against the parties already
    in the directory it was not: `certs init --party evil --san bank` wrote a certificate that
    passes for bank (`certs check` then found it, exit 1)."""
    tls.make_federation(tmp_path, ["bank", "shop"], hosts=("localhost", "backup"))
    before = sorted(p.name for p in tmp_path.iterdir())
    for parties, hosts, match in [
        (["evil"], ("bank",), r"would pass for bank, whose certificate is in .*Found bank\."),
        (["telco"], ("localhost", "Shop"), r"would pass for shop"),
        (["backup"], ("localhost",), r"bank\.pem also names backup among its hosts"),
    ]:
        with pytest.raises(ConfigError, match=match):
            tls.make_federation(tmp_path, parties, hosts=hosts)
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    tls.make_federation(tmp_path, ["telco"])  # a party no certificate names joins as before
    assert tls.check_federation(tmp_path) == []


@pytest.mark.parametrize(
    ("parties", "hosts", "match"),
    [
        ([], ("localhost",), "at least one --party"),
        (["Bank"], ("localhost",), "lower-case letters"),
        (["bank_1"], ("localhost",), "lower-case letters"),
        (["-bank"], ("localhost",), "lower-case letters"),
        (["bank", "bank"], ("localhost",), "bank repeated"),
        (["bank", "shop"], ("localhost", "shop"), r"may not be a party's name .*Found shop"),
        (["bank", "shop"], ("localhost", "Shop"), r"may not be a party's name .*Found shop"),
        # ca.pem and ca.key are the CA's: party "ca" would overwrite them (found by exploration).
        (["ca", "other"], ("localhost",), r"other than 'ca' expected .*Found 'ca'"),
        (["bank"], ("bücher.example",), r"Found 'bücher\.example': it is not ASCII; .*xn--"),
        (["bank"], ("",), "Found '': it is empty"),
        (["bank"], ("not a host!",), "label 'not a host!' is not 1 to 63 letters"),
        (["bank"], ("256.1.1.1",), "not an IP address, and a host name's last label is not all"),
        (["bank"], ("10.0.0.5", "123"), "Found '123': it is not an IP address"),
        (["bank"], ("bank.example.org.",), "an empty label"),
        (["bank"], ("*.example.org",), r"label '\*' is not"),
        (["bank"], ("-bank.example.org",), "label '-bank' is not"),
        (["bank"], (f"{'a' * 64}.example.org",), "is not 1 to 63 letters"),
        (["bank"], (".".join(["a" * 63] * 4),), "255 characters, at most 253 expected"),
        (["bank"], ("fe80::1%eth0",), "IP address without a zone expected"),
    ],
)
def test_init_refuses_bad_requests_before_writing(
    tmp_path: Path, parties: list[str], hosts: tuple[str, ...], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        tls.make_federation(tmp_path / "out", parties, hosts=hosts)
    assert not (tmp_path / "out").exists()


def test_init_accepts_ascii_host_names_and_ip_addresses(tmp_path: Path) -> None:
    hosts = ("localhost", "Bank-1.Example.ORG", "xn--bcher-kva.example", "a1.b2", "10.0.0.5", "::1")
    tls.make_federation(tmp_path, ["bank"], hosts=hosts)
    assert tls.check_federation(tmp_path) == []


def _listing(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory``, hidden ones too, with its content."""
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else b""
        for path in sorted(directory.rglob("*"))
    }


def test_init_refuses_a_bad_host_for_an_existing_ca_and_leaves_the_directory_as_it_was(
    certs: Path,
) -> None:
    before = _listing(certs)
    with pytest.raises(ConfigError, match="not ASCII"):
        tls.make_federation(certs, ["insurer"], hosts=("localhost", "bücher.example"))
    assert _listing(certs) == before


def _fail_on_call(number: int, target: Callable[..., object]) -> Callable[..., object]:
    """``target``, raising OSError on its ``number``-th call instead (a disk filling up)."""
    calls = iter(range(1, 1_000_000))

    def failing(*args: object, **kwargs: object) -> object:
        if next(calls) == number:
            raise OSError(28, "No space left on device")
        return target(*args, **kwargs)

    return failing


@pytest.mark.parametrize("failing_write", [1, 3, 4])
def test_init_that_fails_while_writing_leaves_no_new_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_write: int
) -> None:
    monkeypatch.setattr(tls, "_write", _fail_on_call(failing_write, tls._write))
    with pytest.raises(OutputError, match="No space left on device; nothing was written"):
        tls.make_federation(tmp_path / "out", ["bank"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failing_write", [1, 2, 4])
def test_init_that_fails_while_writing_leaves_an_existing_directory_as_it_was(
    certs: Path, monkeypatch: pytest.MonkeyPatch, failing_write: int
) -> None:
    before = _listing(certs)
    monkeypatch.setattr(tls, "_write", _fail_on_call(failing_write, tls._write))
    with pytest.raises(OutputError, match="No space left on device; nothing was written"):
        tls.make_federation(certs, ["insurer", "broker"])
    assert _listing(certs) == before
    empty = certs.parent / "empty"
    empty.mkdir()
    monkeypatch.setattr(tls, "_write", _fail_on_call(failing_write, tls._write))
    with pytest.raises(OutputError, match="No space left on device; nothing was written"):
        tls.make_federation(empty, ["bank"])
    assert list(empty.iterdir()) == []


def test_init_that_fails_while_moving_files_in_removes_those_moved(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _listing(certs)
    link = os.link
    into_certs = iter(range(1, 100))

    def failing_link(source: str | Path, target: str | Path) -> None:
        if Path(target).parent == certs and next(into_certs) == 3:
            raise OSError(5, "Input/output error")
        link(source, target)

    monkeypatch.setattr(tls.os, "link", failing_link)
    with pytest.raises(OutputError, match="Input/output error; nothing was written"):
        tls.make_federation(certs, ["insurer", "broker"])
    assert _listing(certs) == before


def test_init_never_replaces_a_ca_another_init_wrote_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `certs init` into one empty folder at once: the second's CA replaced the first's,
    whose party certificates no CA then signed; both exited 0."""
    out = tmp_path / "certs"
    out.mkdir()
    write = tls._write

    def another_init_meanwhile(path: Path, data: bytes, *, private: bool) -> None:
        write(path, data, private=private)
        if path.name == "bank.key":  # the other init's CA lands before this one moves in
            (out / "ca.pem").write_bytes(b"the other init's CA")

    monkeypatch.setattr(tls, "_write", another_init_meanwhile)
    with pytest.raises(ConfigError, match=r"ca.pem appeared while this certs init ran"):
        tls.make_federation(out, ["bank"])
    assert [p.name for p in out.iterdir()] == ["ca.pem"]
    assert (out / "ca.pem").read_bytes() == b"the other init's CA"


def test_certs_init_refuses_a_non_ascii_host_without_a_traceback_or_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "certs"
    assert (
        main(["certs", "init", "--out", str(out), "--party", "bank", "--san", "bücher.example"])
        == 2
    )
    assert "IDNA A-label form (xn--" in capsys.readouterr().err
    assert not out.exists()
    assert main(["certs", "init", "--out", str(out), "--party", "ca", "--party", "other"]) == 2
    assert "other than 'ca' expected" in capsys.readouterr().err
    assert not out.exists()


def test_init_refuses_party_certificates_that_would_outlive_the_ca(
    tmp_path: Path, certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A certificate is worth nothing once its CA has expired: asking for more is refused,
    with the most the CA can give (found by exploration: --days 100000 outlived the CA)."""
    with pytest.raises(ConfigError, match=r"at most 1825 days expected .*Found 100000\."):
        tls.make_federation(tmp_path / "new", ["bank"], days=100_000)
    with pytest.raises(ConfigError, match=r"at most 18\d\d days expected .*Found 1000000000\."):
        tls.make_federation(certs, ["insurer"], days=10**9)
    assert not (tmp_path / "new").exists() and not (certs / "insurer.pem").exists()
    tls.make_federation(tmp_path / "longest", ["bank"], days=tls.CA_DAYS)
    assert tls.check_federation(tmp_path / "longest") == []
    later = _ca(certs)[0].not_valid_after_utc - datetime.timedelta(days=10)
    monkeypatch.setattr(tls, "_now", lambda: later)
    with pytest.raises(ConfigError, match=r"at most 10 days expected .*Found 365\."):
        tls.make_federation(certs, ["insurer"])
    monkeypatch.setattr(tls, "_now", lambda: later + datetime.timedelta(days=20))
    with pytest.raises(ConfigError, match="a CA valid for at least another day expected"):
        tls.make_federation(certs, ["insurer"], days=1)
    assert not (certs / "insurer.pem").exists()


def test_check_reports_an_expired_certificate(certs: Path) -> None:
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=10)
    _reissue(certs, "bank", not_before=start, days=2)
    assert _problems(certs) == [
        f"{certs / 'bank.pem'}: expired on {start + datetime.timedelta(days=2):%Y-%m-%d %H:%M} UTC."
    ]


def test_check_reports_a_certificate_not_yet_valid(certs: Path) -> None:
    start = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3)
    _reissue(certs, "shop", not_before=start)
    (problem,) = _problems(certs)
    assert problem == f"{certs / 'shop.pem'}: not valid yet: valid from {start:%Y-%m-%d %H:%M} UTC."


def test_check_reports_a_certificate_valid_beyond_its_ca(certs: Path) -> None:
    _reissue(certs, "bank", days=tls.CA_DAYS + 30)
    ca, _ = _ca(certs)
    bank = x509.load_pem_x509_certificate((certs / "bank.pem").read_bytes())
    assert _problems(certs) == [
        f"{certs / 'bank.pem'}: valid until {bank.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, beyond "
        f"its CA (valid until {ca.not_valid_after_utc:%Y-%m-%d %H:%M} UTC): it stops working "
        "when the CA expires."
    ]


def test_check_reports_a_certificate_from_another_ca(certs: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    tls.make_federation(other, ["bank"])
    for suffix in (".pem", ".key"):
        shutil.copy(other / f"bank{suffix}", certs / f"bank{suffix}")
    # Both CAs carry the same subject: only the signature tells them apart.
    assert _problems(certs) == [
        f"{certs / 'bank.pem'}: not signed by this federation's CA (the signature does not verify)."
    ]


def test_check_reports_a_certificate_that_does_not_name_its_party(certs: Path) -> None:
    for suffix in (".pem", ".key"):
        shutil.copy(certs / f"shop{suffix}", certs / f"bank{suffix}")
    problems = _problems(certs, "bank")
    path = certs / "bank.pem"
    assert problems == [
        f"{path}: common name 'bank' expected, found ['shop'].",
        f"{path}: 'bank' is not among its DNS names ['shop', 'localhost'].",
        f"{path}: it also names the parties ['shop']: it would pass for them.",
    ]


def test_check_reports_a_certificate_that_would_pass_for_another_party(certs: Path) -> None:
    _reissue(certs, "bank", hosts=("localhost", "shop"))
    assert _problems(certs) == [
        f"{certs / 'bank.pem'}: it also names the parties ['shop']: it would pass for them."
    ]


def _issue_with_dns_names(directory: Path, name: str, dns: list[str]) -> None:
    """Replace ``name``'s certificate by one whose DNS names are ``dns``, which certs init
    refuses to write (another tool might not)."""
    ca, ca_key = _ca(directory)
    key = serialization.load_pem_private_key((directory / f"{name}.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(host) for host in dns]), critical=False
        )
        .sign(ca_key, tls.hashes.SHA256())
    )
    (directory / f"{name}.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


def test_check_reports_dns_names_that_are_not_host_names(certs: Path) -> None:
    _issue_with_dns_names(certs, "bank", ["bank", "", "256.1.1.1", "not a host!", "ok.example"])
    path = certs / "bank.pem"
    assert _problems(certs) == [
        f"{path}: its DNS name '' is not a host name: it is empty.",
        f"{path}: its DNS name '256.1.1.1' is not a host name: it is not an IP address, and a "
        "host name's last label is not all digits.",
        f"{path}: its DNS name 'not a host!' is not a host name: its label 'not a host!' is not 1 "
        "to 63 letters, digits and inner hyphens.",
    ]


def test_check_takes_an_all_digit_party_name_as_its_name_not_as_a_host(certs: Path) -> None:
    tls.make_federation(certs, ["42"])
    assert tls.check_federation(certs) == []


def test_check_reports_a_key_that_does_not_match_its_certificate(certs: Path) -> None:
    bank, shop = (certs / "bank.key").read_bytes(), (certs / "shop.key").read_bytes()
    (certs / "bank.key").write_bytes(shop)
    (certs / "shop.key").write_bytes(bank)
    assert _problems(certs) == [
        f"{certs / 'bank.key'}: not the key of bank.pem.",
        f"{certs / 'shop.key'}: not the key of shop.pem.",
    ]


def test_check_reports_key_files_others_can_read(certs: Path) -> None:
    (certs / "shop.key").chmod(0o640)
    (certs / "ca.key").chmod(0o604)
    assert _problems(certs) == [
        f"{certs / 'ca.key'}: mode 0604 lets others read the key; 0600 expected (chmod 600).",
        f"{certs / 'shop.key'}: mode 0640 lets others read the key; 0600 expected (chmod 600).",
    ]


def test_check_reports_an_ed25519_key_grpc_cannot_use(certs: Path) -> None:
    ca, ca_key = _ca(certs)
    key = ed25519.Ed25519PrivateKey.generate()
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bank")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("bank")]), critical=False)
        .sign(ca_key, tls.hashes.SHA256())
    )
    (certs / "bank.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    (certs / "bank.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (problem,) = _problems(certs)
    assert problem.startswith(
        f"{certs / 'bank.key'}: an EC P-256 or P-384 key or an RSA key of at least 2048 bits "
        "expected, found an Ed25519"
    )


def test_check_accepts_p384_and_rsa_keys_and_names_what_it_refuses(certs: Path) -> None:
    """P-384 and RSA keys were refused as keys gRPC "completes no handshake with"; it does
    (tests/test_network.py); it does not with P-521, and RSA below 2048 bits is too short."""
    ca, ca_key = _ca(certs)

    def reissue(key: Any) -> list[str]:
        certificate = tls.party_certificate("bank", key, ca, ca_key)
        (certs / "bank.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        (certs / "bank.key").write_bytes(tls._key_pem(key))
        return _problems(certs)

    assert reissue(ec.generate_private_key(ec.SECP384R1())) == []
    assert reissue(rsa.generate_private_key(65537, 2048)) == []
    expected = f"{certs / 'bank.key'}: an EC P-256 or P-384 key or an RSA key of at least 2048 bits"
    assert reissue(ec.generate_private_key(ec.SECP521R1())) == [
        f"{expected} expected, found an EC key on secp521r1: gRPC's TLS (BoringSSL) completes "
        "no handshake with it."
    ]
    assert reissue(rsa.generate_private_key(65537, 1024)) == [
        f"{expected} expected, found an RSA key of 1024 bits: shorter than 112-bit security."
    ]


def test_check_reports_missing_files_and_needs_no_ca_key(certs: Path) -> None:
    (certs / "ca.key").unlink()  # the CA key may live elsewhere: not a problem
    (certs / "shop.key").unlink()
    assert _problems(certs) == [f"{certs / 'shop.key'}: missing (private key expected)."]
    with pytest.raises(
        ConfigError, match=r"a directory of certificates expected\. Found nothing at"
    ):
        tls.check_federation(certs / "nowhere")


def test_check_reports_a_key_left_without_its_certificate(
    certs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by exploration: only the certificates were listed, so bank's lone key went unseen."""
    (certs / "bank.pem").unlink()
    assert _problems(certs) == [f"{certs / 'bank.pem'}: missing (certificate expected)."]
    assert main(["certs", "check", "--dir", str(certs)]) == 1
    assert "bank.pem: missing (certificate expected)." in capsys.readouterr().out
    (certs / "shop.pem").unlink()
    assert _problems(certs) == [
        f"{certs / 'bank.pem'}: missing (certificate expected).",
        f"{certs / 'shop.pem'}: missing (certificate expected).",
    ]


def test_check_refuses_the_ca_as_a_party(certs: Path) -> None:
    with pytest.raises(ConfigError, match="other than 'ca' expected"):
        tls.check_federation(certs, ["ca"])


def test_check_names_a_file_that_is_no_party_s_and_checks_the_others(certs: Path) -> None:
    """One `server_cert.pem` refused the whole folder, naming no file and no other problem."""
    shutil.copy(certs / "bank.pem", certs / "server_cert.pem")
    (certs / "shop.key").chmod(0o644)
    problems = _problems(certs)
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{certs / 'server_cert.pem'}: not a party's file: a party name")
    assert "shop.key: mode 0644 lets others read the key" in problems[1]
    assert tls.check_federation(certs, ["bank"]) == []  # named parties: the others are not read


def test_a_tls_identity_says_when_certificate_and_key_are_swapped(certs: Path) -> None:
    """Swapped, the certificate (mode 0644) was refused as a key others may read: chmod 600
    would not have helped."""
    with pytest.raises(ConfigError) as swapped:
        TlsIdentity.from_files(certs / "ca.pem", certs / "bank.key", certs / "bank.pem")
    assert str(swapped.value) == (
        f"{certs / 'bank.pem'}: a PEM private key expected, found a certificate "
        f"({certs / 'bank.key'} holds a private key: cert and key swapped?)."
    )
    with pytest.raises(ConfigError, match=r"found a certificate\.$"):
        TlsIdentity.from_files(certs / "ca.pem", certs / "shop.pem", certs / "bank.pem")


def test_a_certificate_file_holding_a_private_key_is_refused(certs: Path) -> None:
    """A CA file with the CA's key appended passed every check, and it is the file handed to
    every party; so did a party's certificate with its key appended."""
    beside = "found a private key beside the certificate (a certificate file is handed to others"
    shop = certs / "shop.pem"
    shop.write_bytes(shop.read_bytes() + (certs / "shop.key").read_bytes())
    problems = _problems(certs, "shop")
    assert len(problems) == 1 and problems[0].startswith(
        f"{shop}: a PEM certificate expected; {beside}"
    ), problems
    ca = certs / "ca.pem"
    ca.write_bytes(ca.read_bytes() + (certs / "ca.key").read_bytes())
    assert _problems(certs, "bank")[0].startswith(f"{ca}: a PEM CA certificate expected; {beside}")
    with pytest.raises(ConfigError, match=re.escape(f"{ca}: a PEM certificate expected; {beside}")):
        TlsIdentity.from_files(ca, certs / "bank.pem", certs / "bank.key")


def test_a_file_of_several_certificates_is_refused_where_one_is_expected(certs: Path) -> None:
    """`certs check` passed a party's file with another party's certificate appended, and a
    CA file with a second certificate, which gRPC would trust too: every check read the first."""
    several = "found 2 certificates (one expected: every check reads the first"
    bank = (certs / "bank.pem").read_bytes()
    (certs / "shop.pem").write_bytes((certs / "shop.pem").read_bytes() + bank)
    assert _problems(certs, "shop") == [
        f"{certs / 'shop.pem'}: a PEM certificate expected; {several}, and TLS would trust or "
        "send them all)."
    ]
    with pytest.raises(ConfigError, match=re.escape(f"{certs / 'shop.pem'}: a PEM certificate")):
        TlsIdentity.from_files(certs / "ca.pem", certs / "shop.pem", certs / "shop.key")
    (certs / "ca.pem").write_bytes((certs / "ca.pem").read_bytes() + bank)
    (problem,) = _problems(certs, "bank")
    assert problem.startswith(f"{certs / 'ca.pem'}: a PEM CA certificate expected; {several}")
    with pytest.raises(ConfigError, match=re.escape(several)):
        TlsIdentity.from_files(certs / "ca.pem", certs / "bank.pem", certs / "bank.key")


def test_a_tls_identity_refuses_a_key_others_can_read(certs: Path) -> None:
    paths = (certs / "ca.pem", certs / "bank.pem", certs / "bank.key")
    assert TlsIdentity.from_files(*paths).name == "bank"
    (certs / "bank.key").chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0644: others may read the private key"):
        TlsIdentity.from_files(*paths)


# P-256's object identifier (1.2.840.10045.3.1.7) as DER writes it, in a key and in a certificate's
# public key; its last byte changed, a curve cryptography does not know.
P256 = bytes.fromhex("06082a8648ce3d030107")
UNKNOWN_CURVE = bytes.fromhex("06082a8648ce3d030115")


def _rewrite_der(path: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (once) inside the DER that the PEM file at ``path`` holds."""
    lines = path.read_bytes().strip().split(b"\n")
    der = base64.b64decode(b"".join(lines[1:-1]))
    assert der.count(old) == 1
    body = base64.encodebytes(der.replace(old, new)).strip()
    path.write_bytes(b"\n".join([lines[0], body, lines[-1]]) + b"\n")


def _point(path: Path) -> bytes:
    """The uncompressed EC point of the certificate at ``path``, as its DER holds it."""
    public = x509.load_pem_x509_certificate(path.read_bytes()).public_key()
    return public.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )


def test_check_reports_certificates_and_keys_it_cannot_parse_rather_than_crash(
    certs: Path,
) -> None:
    """cryptography parses a certificate's public key when first asked for it: a certificate
    that loads may still hold a point off its curve, or a curve it does not know, and a key may
    name such a curve. Each is a problem with the file named; found by fuzzing certs check."""
    _rewrite_der(certs / "bank.key", P256, UNKNOWN_CURVE)
    point = _point(certs / "shop.pem")
    _rewrite_der(certs / "shop.pem", point, point[:-1] + bytes([point[-1] ^ 1]))  # off the curve
    problems = _problems(certs)
    unreadable = f"{certs / 'bank.key'}: a PEM private key expected; found a PEM block that "
    assert unreadable in "\n".join(problems)
    shop = f"{certs / 'shop.pem'}: a PEM certificate expected; found a PEM block that does not"
    assert any(p.startswith(shop) for p in problems)
    _rewrite_der(certs / "ca.pem", P256, UNKNOWN_CURVE)
    (problem,) = _problems(certs)
    assert problem.startswith(f"{certs / 'ca.pem'}: a PEM CA certificate expected; found a PEM")
    with pytest.raises(ConfigError, match=r"ca\.pem: a PEM CA certificate expected; found a PEM"):
        tls.make_federation(certs, ["insurer"])


def test_certs_init_refuses_a_ca_it_cannot_issue_with_naming_the_file(
    certs: Path, tmp_path: Path
) -> None:
    """A party's certificate and key copied in as ca.pem and ca.key issued a certificate no
    peer accepts (exit 0, and `certs check` found it after); a missing ca.key, garbage PEM and
    an unreadable file gave the library's own text ("[Errno 2] ...", a link to cryptography's
    FAQ, "MalformedFraming")."""
    fake = tmp_path / "fake"
    fake.mkdir()
    shutil.copy(certs / "bank.pem", fake / "ca.pem")
    shutil.copy(certs / "bank.key", fake / "ca.key")
    with pytest.raises(ConfigError, match=r"ca.pem: a CA certificate \(basic constraints CA:TRUE"):
        tls.make_federation(fake, ["insurer"])
    (fake / "ca.key").unlink()
    with pytest.raises(ConfigError, match=r"found no file .*ca.key"):
        tls.make_federation(fake, ["insurer"])
    (fake / "ca.key").write_text("-----BEGIN PRIVATE KEY-----\nnot base64\n")
    shutil.copy(certs / "ca.pem", fake / "ca.pem")
    with pytest.raises(ConfigError, match=r"ca\.key: a PEM private key expected; found") as refused:
        tls.make_federation(fake, ["insurer"])
    assert "https://" not in str(refused.value)
    (fake / "ca.key").write_bytes(b"\x00\xff garbage")
    with pytest.raises(ConfigError, match=r"ca\.key: a PEM private key expected; found no PEM bl"):
        tls.make_federation(fake, ["insurer"])
    assert sorted(p.name for p in fake.iterdir()) == ["ca.key", "ca.pem"]  # nothing written


def test_a_tls_identity_refuses_files_that_are_not_a_certificate_and_its_key(certs: Path) -> None:
    """gRPC, given them, would say only that it cannot listen on the address."""
    ca, bank, key = certs / "ca.pem", certs / "bank.pem", certs / "bank.key"
    with pytest.raises(ConfigError, match=r"shop\.key is not the private key of .*bank\.pem"):
        TlsIdentity.from_files(ca, bank, certs / "shop.key")
    key.write_bytes(b"-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
    with pytest.raises(ConfigError, match=r"bank\.key: a PEM private key without a passphrase"):
        TlsIdentity.from_files(ca, bank, key)
    point = _point(bank)
    _rewrite_der(bank, point, point[:-1] + bytes([point[-1] ^ 1]))
    with pytest.raises(ConfigError, match=r"bank\.pem: a PEM certificate expected"):
        TlsIdentity.from_files(ca, bank, certs / "shop.key")
    with pytest.raises(ConfigError, match=r"ca\.key: a PEM certificate expected"):
        TlsIdentity.from_files(ca, certs / "ca.key", certs / "shop.key")


def test_certs_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "certs"
    assert main(["certs", "init", "--out", str(out), "--party", "bank", "--party", "shop"]) == 0
    assert main(["certs", "check", "--dir", str(out)]) == 0
    assert "bank: ok (valid until" in capsys.readouterr().out
    (out / "bank.key").chmod(0o644)
    assert main(["certs", "check", "--dir", str(out), "--party", "bank"]) == 1
    assert "bank.key: mode 0644 lets others read the key" in capsys.readouterr().out
    assert main(["certs", "check", "--dir", str(out), "--party", "shop"]) == 0
    assert main(["certs", "init", "--out", str(tmp_path / "x"), "--party", "Bank"]) == 2
    assert "lower-case letters" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_init_removes_the_staging_folders_a_killed_init_left_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL during `certs init` left `.certs.XXXX.tmp` beside the set, its CA key inside,
    and every later init left it there."""
    out = tmp_path / "certs"
    beside = tmp_path / ".certs.q1w2e3r4.tmp"
    beside.mkdir()
    (beside / "ca.key").write_bytes(b"a private key")
    unrelated = tmp_path / ".other.q1w2e3r4.tmp"  # another write's: not this set's
    unrelated.mkdir()
    assert main(["certs", "init", "--out", str(out), "--party", "bank"]) == 0
    err = capsys.readouterr().err
    assert "removed 1 staging folder(s) an earlier write of" in err and ".certs.q1w2e3r4.tmp" in err
    assert not beside.exists() and unrelated.is_dir()
    inside = out / ".staging.a1b2c3d4.tmp"  # a killed init that added parties to the set
    inside.mkdir()
    (inside / "shop.key").write_bytes(b"a private key")
    assert main(["certs", "init", "--out", str(out), "--party", "shop"]) == 0
    assert ".staging.a1b2c3d4.tmp" in capsys.readouterr().err and not inside.exists()
    assert main(["certs", "check", "--dir", str(out)]) == 0
    # a second init at the same time, still writing (its process id in the name): left alone
    live = out / f".staging.{os.getpid()}-c3d4.tmp"
    live.mkdir()
    assert main(["certs", "init", "--out", str(out), "--party", "telco"]) == 0
    assert live.is_dir() and "staging folder" not in capsys.readouterr().err


def test_check_of_a_file_or_nothing_says_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --dir that is a file said "Found no directory p0.csv", as if nothing were there."""
    (tmp_path / "p0.csv").write_text("x\n")
    assert main(["certs", "check", "--dir", str(tmp_path / "p0.csv")]) == 2
    err = capsys.readouterr().err
    assert f"a directory of certificates expected. Found a file at {tmp_path / 'p0.csv'}." in err
    assert main(["certs", "check", "--dir", str(tmp_path / "none")]) == 2
    assert "Found nothing at" in capsys.readouterr().err


# -- revocation ----------------------------------------------------------------------------


def _crl(directory: Path) -> x509.CertificateRevocationList:
    return x509.load_pem_x509_crl((directory / "crl.pem").read_bytes())


def _serial(directory: Path, name: str) -> int:
    return x509.load_pem_x509_certificate((directory / f"{name}.pem").read_bytes()).serial_number


def test_revoke_writes_a_crl_the_ca_signed_and_keeps_the_revocations_already_there(
    certs: Path,
) -> None:
    ca, _ = _ca(certs)
    first = tls.revoke(certs, "bank", reason="key-compromise")
    assert (first.party, first.serial, first.count, first.already) == (
        "bank",
        _serial(certs, "bank"),
        1,
        False,
    )
    assert first.crl == certs / "crl.pem" and first.revoked.endswith("UTC (key-compromise)")
    second = tls.revoke(certs, "shop")
    assert second.count == 2 and second.revoked.endswith("UTC")  # no reason: none recorded
    crl = _crl(certs)
    assert crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    assert crl.issuer == ca.subject
    assert crl.next_update_utc == ca.not_valid_after_utc  # holds as long as the CA
    assert {entry.serial_number for entry in crl} == {_serial(certs, n) for n in PARTIES}
    assert crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number == 2
    bank = crl.get_revoked_certificate_by_serial_number(_serial(certs, "bank"))
    assert bank is not None
    reason = bank.extensions.get_extension_for_class(x509.CRLReason).value.reason
    assert reason == x509.ReasonFlags.key_compromise
    shop = crl.get_revoked_certificate_by_serial_number(_serial(certs, "shop"))
    assert shop is not None and len(shop.extensions) == 0
    assert not stat.S_IMODE((certs / "crl.pem").stat().st_mode) & stat.S_IWOTH
    # Revoking again changes nothing: the list and its dates stay as they were.
    before = (certs / "crl.pem").read_bytes()
    again = tls.revoke(certs, "bank", reason="superseded")
    assert again.already and again.revoked == first.revoked and again.count == 2
    assert (certs / "crl.pem").read_bytes() == before


def test_revoke_extends_the_list_under_the_directorys_lock(tmp_path: Path) -> None:
    """Two revocations at once each read the list, added their entry and wrote it: the later
    write lost the other's entry (and running parties refuse a list that lacks one they
    apply). revoke now reads, extends and writes the list holding the directory's lock, and
    refuses, naming the holder, while another command holds it."""
    from secure_vfl.io import LOCK_FILE, lock_directory

    pki = tmp_path / "pki"
    tls.make_federation(pki, ["bank", "shop"])
    release = lock_directory(pki, "--dir")
    try:
        with pytest.raises(ConfigError) as refused:
            tls.revoke(pki, "bank")
    finally:
        release()
    assert str(refused.value) == (
        f"--dir {pki}: a folder no other command writes in expected; process {os.getpid()} is "
        f"writing there (it holds {pki / LOCK_FILE}). Wait for it to finish, or choose another "
        "--dir."
    )
    assert not (pki / "crl.pem").exists()
    tls.revoke(pki, "bank")
    tls.revoke(pki, "shop")
    assert {entry.serial_number for entry in _crl(pki)} == {_serial(pki, n) for n in PARTIES}
    assert not (pki / LOCK_FILE).exists()  # given back


def test_revoke_refuses_what_it_cannot_revoke_before_writing(certs: Path, tmp_path: Path) -> None:
    tls.make_federation(tmp_path / "other", ["bank"])
    with pytest.raises(ConfigError, match=r"a reason among key-compromise, .* Found 'stolen'"):
        tls.revoke(certs, "bank", reason="stolen")
    with pytest.raises(ConfigError, match=r"telco's certificate expected at .*telco\.pem"):
        tls.revoke(certs, "telco")
    with pytest.raises(ConfigError, match="a party name other than 'crl' expected"):
        tls.revoke(certs, "crl")
    shutil.copy(tmp_path / "other" / "bank.pem", certs / "bank.pem")
    with pytest.raises(ConfigError, match="A certificate this CA issued expected to revoke"):
        tls.revoke(certs, "bank")
    without_key = tmp_path / "without-key"
    shutil.copytree(certs, without_key)
    (without_key / "ca.key").unlink()
    with pytest.raises(
        ConfigError, match=r"certificate and key .* expected to sign a revocation list"
    ):
        tls.revoke(without_key, "shop")
    assert not (certs / "crl.pem").exists() and not (without_key / "crl.pem").exists()


def test_revoke_takes_a_certificate_kept_from_before_its_party_was_issued_again(
    certs: Path, tmp_path: Path
) -> None:
    """Once a party's certificate was issued again (its files removed, `certs init`), nothing
    could revoke the old one, whose key may be out there: revoke read DIR/NAME.pem only. The
    old file revokes its own serial number; the party's new certificate stays good."""
    old = tmp_path / "bank-old.pem"
    shutil.copy(certs / "bank.pem", old)
    (certs / "bank.pem").unlink()
    (certs / "bank.key").unlink()
    tls.make_federation(certs, ["bank"])
    done = tls.revoke(certs, certificate=old, reason="key-compromise")
    assert done.party == "bank" and not done.already
    crl = x509.load_pem_x509_crl((certs / "crl.pem").read_bytes())
    serial = x509.load_pem_x509_certificate(old.read_bytes()).serial_number
    assert [entry.serial_number for entry in crl] == [serial]
    assert tls.check_federation(certs) == []  # bank's new certificate is not the old one
    for both_or_neither in ({"name": "bank", "certificate": old}, {}):
        with pytest.raises(ConfigError, match="a party name or a certificate file to revoke"):
            tls.revoke(certs, **both_or_neither)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"a certificate expected at .*missing\.pem to revoke"):
        tls.revoke(certs, certificate=tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match=r"ca\.pem: a party's certificate expected to revoke; "):
        tls.revoke(certs, certificate=certs / "ca.pem")  # self-signed: its issuer is the CA


def _rebuilt(
    certificate: x509.Certificate, signer: ec.EllipticCurvePrivateKey, extension: x509.ExtensionType
) -> bytes:
    """``certificate`` signed again by ``signer``, PEM, with ``extension`` (critical) in place of
    its extension of that type."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(certificate.subject)
        .issuer_name(certificate.issuer)
        .public_key(certificate.public_key())  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(certificate.not_valid_before_utc)
        .not_valid_after(certificate.not_valid_after_utc)
    )
    for kept in certificate.extensions:
        if not isinstance(kept.value, type(extension)):
            builder = builder.add_extension(kept.value, kept.critical)
    builder = builder.add_extension(extension, critical=True)
    return builder.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _key_usage(*, digital_signature: bool, key_cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=not digital_signature,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )


def test_a_party_certificate_that_is_a_ca_is_reported_and_can_be_revoked(certs: Path) -> None:
    """A party's certificate with basic constraints CA:TRUE (an organisation's PKI may issue
    one) passed `certs check`, and `certs revoke` refused it as "the CA's own", so it could not
    be revoked: the guard read CA:TRUE, not the CA's key."""
    ca, ca_key = _ca(certs)
    key = serialization.load_pem_private_key((certs / "bank.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    certificate = tls.party_certificate("bank", key, ca, ca_key)
    ca_true = x509.BasicConstraints(ca=True, path_length=None)
    (certs / "bank.pem").write_bytes(_rebuilt(certificate, ca_key, ca_true))
    assert _problems(certs) == [
        f"{certs / 'bank.pem'}: a CA certificate (basic constraints CA:TRUE); a party's "
        "certificate that is not a CA's expected (with its key the party could issue "
        "certificates of its own)."
    ]
    done = tls.revoke(certs, "bank", reason="key-compromise")
    assert done.party == "bank" and not done.already and done.count == 1


def test_revoke_refuses_to_replace_a_crl_that_is_not_the_cas(certs: Path, tmp_path: Path) -> None:
    """Its revocations would be lost: a list of another CA, or bytes that are no list."""
    tls.make_federation(tmp_path / "other", ["bank"])
    tls.revoke(tmp_path / "other", "bank")
    shutil.copy(tmp_path / "other" / "crl.pem", certs / "crl.pem")
    with pytest.raises(
        ConfigError,
        match=r"crl\.pem: not signed by this federation's CA .* "
        r"This CA's list expected to add to",
    ):
        tls.revoke(certs, "shop")
    (certs / "crl.pem").write_bytes(b"not a list")
    with pytest.raises(
        ConfigError,
        match=r"a PEM certificate revocation list .* expected; found "
        r"no PEM block",
    ):
        tls.revoke(certs, "shop")
    assert (certs / "crl.pem").read_bytes() == b"not a list"


def test_revoke_refuses_a_ca_that_has_expired(certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca, _ = _ca(certs)
    monkeypatch.setattr(tls, "_now", lambda: ca.not_valid_after_utc + datetime.timedelta(days=1))
    with pytest.raises(ConfigError, match="a CA valid now expected to sign a revocation list"):
        tls.revoke(certs, "bank")
    assert not (certs / "crl.pem").exists()


def test_check_reports_a_revoked_certificate_and_a_reissued_one_checks_clean(certs: Path) -> None:
    done = tls.revoke(certs, "bank", reason="affiliation-changed")
    assert _problems(certs) == [
        f"{certs / 'bank.pem'}: {done.revoked} by {certs / 'crl.pem'} (serial {done.serial:x}): "
        "every party that has this list refuses its calls; a new certificate expected (remove it "
        "and its key, then `secure-vfl certs init --out DIR --party NAME` issues one)."
    ]
    assert "crl" not in tls.federation_parties(certs)  # crl.pem is no party's certificate
    for suffix in (".pem", ".key"):
        (certs / f"bank{suffix}").unlink()
    tls.make_federation(certs, ["bank"])  # the CA and its list stay
    assert _problems(certs) == []
    assert len(_crl(certs)) == 1


def _crl_signed_by(directory: Path, key: ec.EllipticCurvePrivateKey, **dates: Any) -> bytes:
    """A revocation list in the name of ``directory``'s CA (or ``issuer``), signed with
    ``key``, with ``dates`` (``last_update``, ``next_update``) instead of now and a day on, and
    the critical ``extensions`` given."""
    ca, _ = _ca(directory)
    now = datetime.datetime.now(datetime.UTC)
    issuer = x509.Name.from_rfc4514_string(dates["issuer"]) if "issuer" in dates else ca.subject
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer)
        .last_update(dates.get("last_update", now))
        .next_update(dates.get("next_update", now + datetime.timedelta(days=1)))
    )
    for extension in dates.get("extensions", ()):
        builder = builder.add_extension(extension, critical=True)
    return builder.sign(key, tls.hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_check_reports_a_crl_it_cannot_read_not_signed_by_the_ca_or_out_of_date(
    certs: Path,
) -> None:
    path = certs / "crl.pem"
    path.write_bytes(b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n")
    (problem,) = _problems(certs)
    assert problem.startswith(
        f"{path}: a PEM certificate revocation list expected; found a PEM block that does not parse"
    )
    path.write_bytes(_crl_signed_by(certs, ec.generate_private_key(ec.SECP256R1())))
    assert _problems(certs) == [
        f"{path}: not signed by this federation's CA (the signature does not verify)."
    ]
    _, ca_key = _ca(certs)
    path.write_bytes(_crl_signed_by(certs, ca_key, issuer="CN=another CA"))
    assert _problems(certs) == [
        f"{path}: issued by 'CN=another CA', not by this federation's CA 'CN=secure-vfl "
        "federation CA'."
    ]
    long_ago = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    path.write_bytes(
        _crl_signed_by(
            certs, ca_key, last_update=long_ago, next_update=long_ago + datetime.timedelta(1)
        )
    )
    assert _problems(certs) == [
        f"{path}: out of date since 2020-01-02 00:00 UTC (its next update); a newer one from the "
        "federation's CA expected."
    ]


def test_check_reports_a_crl_issued_in_the_future_a_delta_list_or_an_unknown_critical_one(
    certs: Path,
) -> None:
    """Each was taken as the federation's list: one issued in the future would make a running
    party refuse every honest list issued before then, a delta list lacks its base's
    revocations, and RFC 5280 forbids using a list with a critical extension one cannot read."""
    path = certs / "crl.pem"
    _, ca_key = _ca(certs)
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=2)
    path.write_bytes(
        _crl_signed_by(certs, ca_key, last_update=later, next_update=later + datetime.timedelta(1))
    )
    assert _problems(certs) == [
        f"{path}: issued in the future ({later:%Y-%m-%d %H:%M} UTC, after now: the CA's clock "
        "ahead?); a running party would refuse every honest list issued before then. A list "
        "issued before now expected."
    ]
    unknown = x509.UnrecognizedExtension(x509.ObjectIdentifier("1.3.6.1.4.1.55555.1"), b"\x05\x00")
    for extension, found in (
        (x509.DeltaCRLIndicator(1), "a delta list (it holds the changes since a base list"),
        (unknown, "a list with a critical extension this code cannot read (1.3.6.1.4.1.55555.1;"),
    ):
        path.write_bytes(_crl_signed_by(certs, ca_key, extensions=[extension]))
        (problem,) = _problems(certs)
        assert problem.startswith(
            f"{path}: a PEM certificate revocation list expected; found {found}"
        ), problem


def test_a_list_the_ca_did_not_sign_revokes_nothing_in_check(certs: Path, tmp_path: Path) -> None:
    """Another CA's list that names bank's serial number is reported, not believed."""
    tls.make_federation(tmp_path / "other", ["bank"])
    shutil.copy(certs / "bank.pem", tmp_path / "other" / "bank.pem")  # this CA's bank
    other_ca = x509.load_pem_x509_certificate((tmp_path / "other" / "ca.pem").read_bytes())
    other_key = serialization.load_pem_private_key(
        (tmp_path / "other" / "ca.key").read_bytes(), None
    )
    assert isinstance(other_key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime.now(datetime.UTC)
    entry = (
        x509.RevokedCertificateBuilder().serial_number(_serial(certs, "bank")).revocation_date(now)
    )
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(other_ca.subject)
        .last_update(now)
        .next_update(now + datetime.timedelta(days=1))
        .add_revoked_certificate(entry.build())
        .sign(other_key, tls.hashes.SHA256())
    )
    (certs / "crl.pem").write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    # Both CAs are named alike: the signature tells them apart. bank is not reported revoked.
    assert _problems(certs) == [
        f"{certs / 'crl.pem'}: not signed by this federation's CA (the signature does not verify)."
    ]


def test_init_refuses_a_party_named_after_the_crl(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"a party name other than 'crl' expected \(crl\.pem"):
        tls.make_federation(tmp_path / "certs", ["crl"])


def test_a_tls_identity_reads_the_cas_list_and_refuses_one_that_is_not(
    certs: Path, tmp_path: Path
) -> None:
    files = (certs / "ca.pem", certs / "shop.pem", certs / "shop.key")
    assert TlsIdentity.from_files(*files).crl is None
    tls.revoke(certs, "bank")
    identity = TlsIdentity.from_files(*files, crl=certs / "crl.pem")
    assert identity.crl == (certs / "crl.pem").read_bytes()
    with pytest.raises(ConfigError, match=r"a PEM file expected at .*missing\.pem"):
        TlsIdentity.from_files(*files, crl=tmp_path / "missing.pem")
    (tmp_path / "bad.pem").write_bytes((certs / "ca.pem").read_bytes())
    with pytest.raises(ConfigError, match=r"bad\.pem: a PEM certificate revocation list .*"):
        TlsIdentity.from_files(*files, crl=tmp_path / "bad.pem")
    (tmp_path / "forged.pem").write_bytes(
        _crl_signed_by(certs, ec.generate_private_key(ec.SECP256R1()))
    )
    with pytest.raises(
        ConfigError,
        match=r"forged\.pem: not signed by this federation's CA .* "
        "A revocation list from the CA",
    ):
        TlsIdentity.from_files(*files, crl=tmp_path / "forged.pem")


def _federation_file(directory: Path, certs: Path, extra: str = "") -> Path:
    """A federation of bank (the label party), shop and the aggregator, certificates in
    ``certs``; ``extra`` lines at the top."""
    members = {"aggregator": "[aggregator]", "bank": "[party.bank]", "shop": "[party.shop]"}
    lines = [extra, f'ca = "{certs}/ca.pem"', 'label_party = "bank"']
    for port, (name, table) in enumerate(members.items(), start=50050):
        lines += [table, f'address = "127.0.0.1:{port}"']
        lines += [f'cert = "{certs}/{name}.pem"', f'key = "{certs}/{name}.key"']
        lines += [] if name == "aggregator" else [f'data = "{name}.csv"']
    path = directory / "federation.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_check_and_start_up_refuse_key_usages_grpc_refuses(certs: Path, tmp_path: Path) -> None:
    """A party certificate whose key usage lacks digital signature (its party cannot even
    listen: gRPC refuses the certificate), or a CA whose key usage lacks certificate signing
    (every handshake fails), passed `certs check` and a party's start-up alike."""
    from secure_vfl.federation.federation_file import read_federation

    ca, ca_key = _ca(certs)
    bank = x509.load_pem_x509_certificate((certs / "bank.pem").read_bytes())
    no_signature = _key_usage(digital_signature=False, key_cert_sign=False)
    (certs / "bank.pem").write_bytes(_rebuilt(bank, ca_key, no_signature))
    no_cert_sign = _key_usage(digital_signature=True, key_cert_sign=False)
    (certs / "ca.pem").write_bytes(_rebuilt(ca, ca_key, no_cert_sign))
    ca_problem = (
        f"{certs / 'ca.pem'}: the certificate signing key usage expected of a CA (every peer's "
        "handshake refuses the certificates it issued otherwise); found a key usage without it."
    )
    bank_problem = (
        f"{certs / 'bank.pem'}: the digital signature key usage expected (TLS signs the "
        "handshake with the key); found a key usage without it."
    )
    assert _problems(certs) == [ca_problem, bank_problem]
    federation = read_federation(_federation_file(tmp_path, certs))
    with pytest.raises(ConfigError) as refused:
        federation.identity("bank")
    assert ca_problem in str(refused.value) and bank_problem in str(refused.value)
    with pytest.raises(ConfigError, match="the certificate signing key usage expected of a CA"):
        federation.identity("shop")


def test_revoke_names_a_ca_key_it_cannot_sign_with_rather_than_calling_it_another_key(
    tmp_path: Path,
) -> None:
    """An RSA CA (another tool's) with its own key: `certs revoke` said the key was not the
    CA's, when it is; secure-vfl signs only with an EC key, and says so."""
    key = rsa.generate_private_key(65537, 2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "another tool's CA")])
    now = datetime.datetime.now(datetime.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    (tmp_path / "ca.key").write_bytes(pem)
    (tmp_path / "ca.key").chmod(0o600)
    with pytest.raises(ConfigError, match="an EC key expected to sign a revocation list") as error:
        tls.revoke(tmp_path, "bank")
    assert "is not the key of" not in str(error.value)


def test_check_and_start_up_refuse_a_critical_extension_tls_cannot_read(
    certs: Path, tmp_path: Path
) -> None:
    """A certificate with a critical extension no TLS library knows fails every handshake (the
    peer refuses it), yet passed `certs check` and a party's start-up."""
    from secure_vfl.federation.federation_file import read_federation

    ca, ca_key = _ca(certs)
    bank = x509.load_pem_x509_certificate((certs / "bank.pem").read_bytes())
    unknown = x509.UnrecognizedExtension(x509.ObjectIdentifier("1.3.6.1.4.1.55555.1"), b"\x05\x00")
    (certs / "bank.pem").write_bytes(_rebuilt(bank, ca_key, unknown))
    problem = (
        f"{certs / 'bank.pem'}: no critical extension TLS cannot read expected; found "
        "1.3.6.1.4.1.55555.1 (a peer refuses the certificate in every handshake)."
    )
    assert _problems(certs) == [problem]
    federation = read_federation(_federation_file(tmp_path, certs))
    with pytest.raises(ConfigError, match=re.escape(problem)):
        federation.identity("bank")
    federation.identity("shop")
    (certs / "ca.pem").write_bytes(_rebuilt(ca, ca_key, unknown))
    assert any(p.startswith(f"{certs / 'ca.pem'}: no critical extension") for p in _problems(certs))


def test_check_and_start_up_refuse_a_weak_ca_key_or_one_grpc_cannot_verify(
    tmp_path: Path,
) -> None:
    """A CA with an RSA key of 1024 bits (anyone who breaks it issues any party's certificate)
    or on secp256k1 (every handshake fails) passed `certs check` and a party's start-up: only
    the parties' keys were judged."""
    from secure_vfl.federation.federation_file import read_federation

    for ca_key, found in (
        (rsa.generate_private_key(65537, 1024), "an RSA key of 1024 bits: shorter than 112-bit"),
        (ec.generate_private_key(ec.SECP256K1()), "an EC key on secp256k1: gRPC's TLS verifies"),
    ):
        certs = tmp_path / found.split(":")[0].replace(" ", "-")
        tls.make_federation(certs, ["bank", "shop"])
        ca, _ = _ca(certs)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "another PKI's CA")])
        weak = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(ca.not_valid_before_utc)
            .not_valid_after(ca.not_valid_after_utc)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        (certs / "ca.pem").write_bytes(weak.public_bytes(serialization.Encoding.PEM))
        (certs / "ca.key").unlink()
        for party in ("bank", "shop"):
            key = serialization.load_pem_private_key((certs / f"{party}.key").read_bytes(), None)
            assert isinstance(key, ec.EllipticCurvePrivateKey)
            issued = tls.party_certificate(party, key, weak, ca_key)  # type: ignore[arg-type]
            (certs / f"{party}.pem").write_bytes(issued.public_bytes(serialization.Encoding.PEM))
        problem = (
            f"{certs / 'ca.pem'}: a CA key on EC P-256, P-384 or P-521, Ed25519, or RSA of at "
            f"least 2048 bits expected, found {found}"
        )
        assert [line[: len(problem)] for line in _problems(certs)] == [problem]
        federation = read_federation(_federation_file(tmp_path, certs))
        with pytest.raises(ConfigError, match=re.escape(problem)):
            federation.identity("bank")


def test_a_party_loads_the_crl_beside_its_ca_and_will_not_start_revoked(tmp_path: Path) -> None:
    from secure_vfl.federation.federation_file import read_federation

    certs = tmp_path / "certs"
    tls.make_federation(certs, ["bank", "shop", "aggregator"])
    federation = read_federation(_federation_file(tmp_path, certs))
    assert federation.crl_file() is None and federation.identity("bank").crl is None
    done = tls.revoke(certs, "bank", reason="key-compromise")
    assert federation.crl_file() == certs / "crl.pem"
    assert federation.identity("shop").crl == (certs / "crl.pem").read_bytes()
    with pytest.raises(ConfigError) as refused:
        federation.identity("bank")
    assert str(refused.value) == (
        f"{tmp_path / 'federation.toml'}: [party.bank] bank cannot take part: "
        f"{certs / 'bank.pem'}: {done.revoked} by {certs / 'crl.pem'} (serial {done.serial:x}): "
        "every party that has this list refuses its calls; a new certificate expected (remove it "
        "and its key, then `secure-vfl certs init --out DIR --party NAME` issues one)."
    )


def test_a_serving_party_says_which_revocation_list_it_applies(tmp_path: Path) -> None:
    """A party's "serving at" line says which list it applies as it starts and how many it
    revokes (or that there is none yet, and where one would be read)."""
    from secure_vfl.deployment import _revocation_note
    from secure_vfl.federation.federation_file import read_federation
    from secure_vfl.federation.network import PartyEndpoint

    certs = tmp_path / "certs"
    tls.make_federation(certs, ["bank", "shop", "aggregator"])
    federation = read_federation(_federation_file(tmp_path, certs))
    before = federation.identity("shop")
    none = f" (no certificate revocation list yet at {certs / 'crl.pem'})"
    with PartyEndpoint("shop", identity=before) as shop:
        assert _revocation_note(federation, shop) == none
    tls.revoke(certs, "bank")
    with PartyEndpoint("shop", identity=before) as shop:  # read before the list was there
        assert _revocation_note(federation, shop) == none
    with PartyEndpoint("shop", identity=federation.identity("shop")) as shop:
        assert shop.revoked_count == 1
        assert _revocation_note(federation, shop) == (
            f" (revocation list {certs / 'crl.pem'}: 1 revoked)"
        )
    with PartyEndpoint("shop", insecure=True) as plaintext:
        assert _revocation_note(federation, plaintext) == ""


def test_a_party_refuses_to_start_with_a_bad_crl_saying_what_is_wrong(tmp_path: Path) -> None:
    from secure_vfl.federation.federation_file import read_federation

    certs = tmp_path / "certs"
    tls.make_federation(certs, ["bank", "shop", "aggregator"])
    elsewhere = tmp_path / "lists" / "revoked.pem"
    named = read_federation(_federation_file(tmp_path, certs, f'crl = "{elsewhere}"'))
    assert named.crl == elsewhere
    with pytest.raises(
        ConfigError,
        match=rf"shop cannot take part: a PEM file expected at "
        rf"{elsewhere}\. Found none\.",
    ):
        named.identity("shop")
    federation = read_federation(_federation_file(tmp_path, certs))
    where = f"{tmp_path / 'federation.toml'}: [party.shop] shop cannot take part: "
    crl = certs / "crl.pem"
    crl.write_bytes(b"garbage")
    with pytest.raises(ConfigError) as refused:
        federation.identity("shop")
    assert str(refused.value) == (
        f"{where}{crl}: a PEM certificate revocation list (-----BEGIN X509 CRL-----) expected; "
        "found no PEM block (-----BEGIN ...-----)."
    )
    crl.write_bytes(_crl_signed_by(certs, ec.generate_private_key(ec.SECP256R1())))
    with pytest.raises(ConfigError, match=rf"{re.escape(where)}.*not signed by this federation"):
        federation.identity("shop")
    _, ca_key = _ca(certs)
    long_ago = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    crl.write_bytes(_crl_signed_by(certs, ca_key, last_update=long_ago, next_update=long_ago))
    with pytest.raises(ConfigError) as refused:
        federation.identity("shop")
    assert str(refused.value) == (
        f"{where}{crl}: out of date since 2020-01-01 00:00 UTC (its next update); a newer one "
        "from the federation's CA expected."
    )


def test_certs_revoke_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from secure_vfl.cli import REVOCATION_REASON_NAMES
    from secure_vfl.federation.certificates import REVOCATION_REASONS

    assert tuple(REVOCATION_REASONS) == REVOCATION_REASON_NAMES
    out = tmp_path / "certs"
    assert main(["certs", "init", "--out", str(out), "--party", "bank", "--party", "shop"]) == 0
    capsys.readouterr()
    argv = ["certs", "revoke", "--dir", str(out), "--party", "bank"]
    assert main([*argv, "--reason", "key-compromise"]) == 0
    said = capsys.readouterr().out
    assert f"bank's certificate (serial {_serial(out, 'bank'):x}) revoked on " in said
    assert "(key-compromise): " in said and "now lists 1 revoked certificate(s)" in said
    assert "Whoever holds its key can still answer at bank's address" in said
    assert "To admit bank again, remove" in said
    assert main(argv) == 0
    assert "already;" in capsys.readouterr().out
    assert main(["certs", "check", "--dir", str(out)]) == 1
    assert "bank.pem: revoked on" in capsys.readouterr().out
    assert main(["certs", "check", "--dir", str(out), "--party", "shop"]) == 0
    assert "crl.pem: 1 certificate(s) revoked, next update" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--reason", "stolen"])
    assert "invalid choice: 'stolen'" in capsys.readouterr().err
    # A certificate named by its file: one kept from before its party's was issued again, and
    # one that is the party's current certificate (then it needs a new one, as with --party).
    old = tmp_path / "shop-old.pem"
    shutil.copy(out / "shop.pem", old)
    (out / "shop.pem").unlink()
    (out / "shop.key").unlink()
    assert main(["certs", "init", "--out", str(out), "--party", "shop"]) == 0
    current = tmp_path / "shop-current.pem"
    shutil.copy(out / "shop.pem", current)
    capsys.readouterr()
    assert main(["certs", "revoke", "--dir", str(out), "--cert", str(old)]) == 0
    said = capsys.readouterr().out
    assert f"shop's certificate (serial {_serial(tmp_path, 'shop-old'):x}) revoked on " in said
    assert "now lists 2 revoked" in said and "To admit" not in said
    assert main(["certs", "revoke", "--dir", str(out), "--cert", str(current)]) == 0
    said = capsys.readouterr().out
    assert "now lists 3 revoked" in said and "To admit shop again, remove" in said
    with pytest.raises(SystemExit):
        main(["certs", "revoke", "--dir", str(out), "--cert", str(old), "--party", "shop"])
    assert "not allowed with argument" in capsys.readouterr().err
