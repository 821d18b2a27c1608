"""Certificates for a federation: one certificate authority (CA) and one key pair and certificate
per party, for mutual TLS on the gRPC transport (:mod:`secure_vfl.federation.network`).

``make_federation(DIR, parties)`` writes

- ``DIR/ca.pem``, ``DIR/ca.key``: the federation CA (self-signed, may sign leaf certificates
  only: path length 0). Whoever holds ``ca.key`` can admit a party; keep it off the parties'
  machines once the certificates are issued (``check_federation`` does not need it).
- ``DIR/NAME.pem``, ``DIR/NAME.key`` per party: a certificate signed by the CA for server and
  client authentication (one certificate serves both ends of every connection).

A party's identity is its name, written twice into its certificate: as the subject's common name
(which the receiving server reads from the connection, ``x509_common_name`` of gRPC's auth
context) and as its first DNS name (which a calling client checks, by asking gRPC to verify the
server's certificate against that name, ``grpc.ssl_target_name_override``). Party names are
lower-case DNS labels (``[a-z0-9]``, inner ``-``, at most 63 characters), so the name is a valid
DNS name. The hosts the party is reached at are further subject alternative names (default
``localhost`` and ``127.0.0.1``; an IP literal becomes an IP address entry), for standard TLS
tools; they may not be another party's name, or one certificate would pass for two parties.

Keys are EC P-256 (ECDSA with SHA-256): gRPC's TLS stack (BoringSSL) completes no handshake with
an Ed25519 certificate (``NO_COMMON_SIGNATURE_ALGORITHMS``, tested with grpcio 1.85.1), so
Ed25519 keys are refused by :func:`check_federation`. Keys are written PKCS#8, unencrypted, mode
0600, atomically (whole or absent). Validity: the CA 5 years, a party 1 year by default (``days``),
starting one minute in the past to absorb small clock differences between machines.

``check_federation(DIR)`` reports every problem with a set of certificates: a file missing or
unreadable, a certificate expired or not yet valid, one not signed by this CA, a name that is not
in its certificate, a key that does not match its certificate, a key file readable by others, a
key type gRPC cannot use, a certificate without both TLS usages.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from secure_vfl.errors import ConfigError
from secure_vfl.federation.network import (
    UNREADABLE_PEM,
    check_party_name,
    parse_certificate,
    same_key,
)
from secure_vfl.io import atomic_write

CA_CERT, CA_KEY = "ca.pem", "ca.key"
CA_DAYS = 5 * 365
PARTY_DAYS = 365
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
CLOCK_SKEW = datetime.timedelta(minutes=1)
KEY_MODE = 0o600
PRIVATE_BITS = stat.S_IRWXG | stat.S_IRWXO  # a key file must grant nothing to group or others


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Write ``data`` to ``path`` atomically; a private file (a key) keeps mode 0600."""

    def write(tmp: Path) -> None:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    atomic_write(path, write, mode=KEY_MODE if private else None)


def _host_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """Subject alternative names of ``hosts``: IP literals as IP addresses, others as DNS."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _ca_certificate(key: ec.EllipticCurvePrivateKey, now: datetime.datetime) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "secure-vfl federation CA")])
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def party_certificate(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    not_before: datetime.datetime | None = None,
    days: int = PARTY_DAYS,
) -> x509.Certificate:
    """The certificate of party ``name`` for ``key``, signed by the CA: common name and first DNS
    name ``name``, then ``hosts``; server and client authentication."""
    start = not_before if not_before is not None else _now() - CLOCK_SKEW
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(name), *_host_names(hosts)]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _check_request(parties: Sequence[str], hosts: Sequence[str], days: int) -> None:
    if not parties:
        raise ConfigError("at least one --party NAME expected. Found none.")
    for name in parties:
        check_party_name(name)
    repeated = sorted({name for name in parties if list(parties).count(name) > 1})
    if repeated:
        raise ConfigError(f"each party once expected. Found {', '.join(repeated)} repeated.")
    clash = sorted(set(parties) & set(hosts))
    if clash:
        raise ConfigError(
            f"a --san host may not be a party's name (its certificate would pass for that party)."
            f" Found {', '.join(clash)}."
        )
    if days < 1:
        raise ConfigError(f"a validity of >= 1 day expected. Found {days}.")


# What reading a PEM file, or a part of the certificate in it, raises when it is not one.
_UNREADABLE = (OSError, *UNREADABLE_PEM)


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA of ``directory`` and its key (to issue more party certificates)."""
    try:
        ca = parse_certificate((directory / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), None)
    except _UNREADABLE as error:
        raise ConfigError(
            f"{directory} holds a CA, but it cannot be read to issue certificates: {error}"
        ) from error
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not same_key(ca, key):
        raise ConfigError(f"{directory / CA_KEY} is not the key of {directory / CA_CERT}.")
    return ca, key


def make_federation(
    directory: Path,
    parties: Sequence[str],
    *,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    days: int = PARTY_DAYS,
) -> list[Path]:
    """Write a federation CA (unless ``directory`` already holds one: then it issues with it)
    and a key and certificate per party; return the files written. ConfigError, before anything
    is written, for a bad name, a host that is a party's name, or a party file already there."""
    _check_request(parties, hosts, days)
    existing = [
        directory / f"{name}{suffix}"
        for name in parties
        for suffix in (".pem", ".key")
        if (directory / f"{name}{suffix}").exists()
    ]
    if existing:
        raise ConfigError(
            f"{', '.join(map(str, existing))} already exist; remove them or choose another --out."
        )
    written: list[Path] = []
    if (directory / CA_CERT).exists() or (directory / CA_KEY).exists():
        ca, ca_key = _load_ca(directory)
    else:
        ca_key = _new_key()
        ca = _ca_certificate(ca_key, _now())
        _write(directory / CA_KEY, _key_pem(ca_key), private=True)
        _write(directory / CA_CERT, _cert_pem(ca), private=False)
        written += [directory / CA_CERT, directory / CA_KEY]
    for name in parties:
        key = _new_key()
        certificate = party_certificate(name, key, ca, ca_key, hosts=hosts, days=days)
        _write(directory / f"{name}.key", _key_pem(key), private=True)
        _write(directory / f"{name}.pem", _cert_pem(certificate), private=False)
        written += [directory / f"{name}.pem", directory / f"{name}.key"]
    return written


# -- checking a set of certificates ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a federation's certificates: the file and what is wrong with it."""

    path: Path
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def _validity(path: Path, certificate: x509.Certificate, now: datetime.datetime) -> list[Problem]:
    start, end = certificate.not_valid_before_utc, certificate.not_valid_after_utc
    if now < start:
        return [Problem(path, f"not valid yet: valid from {start:%Y-%m-%d %H:%M} UTC.")]
    if now > end:
        return [Problem(path, f"expired on {end:%Y-%m-%d %H:%M} UTC.")]
    return []


def _signed_by(path: Path, certificate: x509.Certificate, ca: x509.Certificate) -> list[Problem]:
    """A problem unless ``ca`` issued ``certificate`` (its name and its signature)."""
    if certificate.issuer != ca.subject:
        return [
            Problem(
                path,
                f"issued by {certificate.issuer.rfc4514_string()!r}, not by this federation's CA "
                f"{ca.subject.rfc4514_string()!r}.",
            )
        ]
    try:
        certificate.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return [
            Problem(path, "not signed by this federation's CA (the signature does not verify).")
        ]
    return []


def _dns_names(certificate: x509.Certificate) -> list[str]:
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(names.value.get_values_for_type(x509.DNSName))


def _names(
    path: Path, certificate: x509.Certificate, name: str, parties: Sequence[str]
) -> list[Problem]:
    problems = []
    common = [a.value for a in certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if common != [name]:
        problems.append(Problem(path, f"common name {name!r} expected, found {common}."))
    dns = _dns_names(certificate)
    if name not in dns:
        problems.append(Problem(path, f"{name!r} is not among its DNS names {dns}."))
    others = sorted(set(dns) & (set(parties) - {name}))
    if others:
        problems.append(
            Problem(path, f"it also names the parties {others}: it would pass for them.")
        )
    return problems


def _usages(path: Path, certificate: x509.Certificate) -> list[Problem]:
    try:
        usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return []  # no restriction: any usage
    needed = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    if not needed <= set(usages):
        return [Problem(path, "TLS server and client authentication usages expected.")]
    return []


def _key_type(path: Path, key: object) -> list[Problem]:
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        return []
    return [
        Problem(
            path,
            f"an EC P-256 key expected, found {type(key).__name__}: gRPC's TLS (BoringSSL) "
            "completes no handshake with it.",
        )
    ]


def _permissions(path: Path) -> list[Problem]:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & PRIVATE_BITS:
        return [
            Problem(path, f"mode {mode:04o} lets others read the key; 0600 expected (chmod 600).")
        ]
    return []


def _load(path: Path, loader: Callable[[bytes], object], what: str) -> tuple[object, list[Problem]]:
    if not path.is_file():
        return None, [Problem(path, f"missing ({what} expected).")]
    try:
        return loader(path.read_bytes()), []
    except _UNREADABLE as error:
        return None, [Problem(path, f"not a PEM {what}: {error}")]


def _load_key(data: bytes) -> object:
    return serialization.load_pem_private_key(data, None)


def check_party(
    directory: Path,
    name: str,
    ca: x509.Certificate,
    parties: Sequence[str],
    now: datetime.datetime,
) -> list[Problem]:
    """What is wrong with party ``name``'s certificate and key in ``directory``."""
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    certificate, problems = _load(cert_path, parse_certificate, "certificate")
    key, key_problems = _load(key_path, _load_key, "private key")
    problems += key_problems
    if key is not None:
        problems += _permissions(key_path) + _key_type(key_path, key)
    if not isinstance(certificate, x509.Certificate):
        return problems
    problems += _validity(cert_path, certificate, now)
    problems += _signed_by(cert_path, certificate, ca)
    problems += _names(cert_path, certificate, name, parties)
    problems += _usages(cert_path, certificate)
    if key is not None and not same_key(certificate, key):
        problems.append(Problem(key_path, f"not the key of {cert_path.name}."))
    return problems


def _check_ca(directory: Path, now: datetime.datetime) -> tuple[object, list[Problem]]:
    path = directory / CA_CERT
    ca, problems = _load(path, parse_certificate, "CA certificate")
    if not isinstance(ca, x509.Certificate):
        return None, problems
    problems += _validity(path, ca, now)
    try:
        is_ca = ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        problems.append(Problem(path, "not a CA certificate (basic constraints CA:TRUE)."))
    key_path = directory / CA_KEY
    if key_path.exists():  # optional: the CA key may be kept elsewhere
        key, key_problems = _load(key_path, _load_key, "private key")
        problems += key_problems + _permissions(key_path)
        if key is not None and not same_key(ca, key):
            problems.append(Problem(key_path, f"not the key of {CA_CERT}."))
    return ca, problems


def federation_parties(directory: Path) -> list[str]:
    """The parties with a certificate in ``directory`` (every ``NAME.pem`` but the CA's)."""
    return sorted(p.stem for p in directory.glob("*.pem") if p.name != CA_CERT)


def check_federation(
    directory: Path,
    parties: Sequence[str] | None = None,
    *,
    now: datetime.datetime | None = None,
) -> list[Problem]:
    """Every problem with the CA of ``directory`` and the certificates and keys of ``parties``
    (default: every party with a certificate there); an empty list when all is well.
    ConfigError if ``directory`` is not a directory or holds no party."""
    if not directory.is_dir():
        raise ConfigError(f"a directory of certificates expected. Found no directory {directory}.")
    now = now if now is not None else _now()
    everyone = federation_parties(directory)
    chosen = list(parties) if parties else everyone
    if not chosen:
        raise ConfigError(f"party certificates (NAME.pem) expected in {directory}. Found none.")
    for name in chosen:
        check_party_name(name)
    ca, problems = _check_ca(directory, now)
    if not isinstance(ca, x509.Certificate):
        return problems
    for name in chosen:
        problems += check_party(directory, name, ca, sorted(set(everyone) | set(chosen)), now)
    return problems


def certificate_expiry(path: Path) -> datetime.datetime:
    """When the certificate at ``path`` expires (for reports)."""
    return parse_certificate(path.read_bytes()).not_valid_after_utc
