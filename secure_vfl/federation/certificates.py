"""Party names, hosts and the X.509 certificates of mutual TLS: what a party's certificate must
be for every peer's handshake to accept it, checked before a party listens or connects
(:func:`identity_problems`, :class:`TlsIdentity`) and by ``secure-vfl certs``
(:mod:`protocols.tls`). No gRPC and no torch here: the certificate tools load in a moment."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import re
import stat
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from secure_vfl.errors import ConfigError

_PARTY_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
MAX_HOST_LENGTH = 253
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_party_name(name: str) -> str:
    """``name`` if it can name a party on the network (a lower-case DNS label: letters, digits,
    inner hyphens, at most 63 characters; it goes into certificates as a DNS name), else
    ConfigError."""
    if not isinstance(name, str) or not _PARTY_NAME.fullmatch(name):
        raise ConfigError(
            "a party name of lower-case letters, digits and inner hyphens (at most 63 "
            f"characters) expected. Found {name!r}."
        )
    return name


# What cryptography raises for PEM bytes that are not a readable certificate or key.
UNREADABLE_PEM = (
    ValueError,
    TypeError,
    UnsupportedAlgorithm,
    x509.DuplicateExtension,
    x509.UnsupportedGeneralNameType,
)


class UnusablePem(ValueError):
    """A PEM file that parses but cannot be used as what it is read for: more than one
    certificate (or revocation list) where one is expected, a certificate file that holds a
    private key too, or a revocation list no check here can apply whole."""


def unreadable(data: bytes, error: Exception) -> str:
    """What ``data`` holds instead of a readable PEM certificate, key or revocation list
    (cryptography raised ``error``), in words: no PEM block at all, one that does not parse (its
    reason, without the link to cryptography's FAQ that it carries), or several blocks."""
    if isinstance(error, UnusablePem):
        return str(error)
    if b"-----BEGIN " not in data:
        return "no PEM block (-----BEGIN ...-----)"
    reason = re.sub(r"\s*See https?://\S+ for more details\.?", "", str(error)).strip()
    reason = reason.splitlines()[0][:100] if reason else type(error).__name__
    return f"a PEM block that does not parse ({reason})"


def is_ca(certificate: x509.Certificate) -> bool:
    """Whether ``certificate`` says it is a CA's (basic constraints CA:TRUE)."""
    try:
        return bool(certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def parse_certificate(pem: bytes) -> x509.Certificate:
    """The PEM certificate ``pem`` with every part the checks read parsed now: cryptography
    parses a certificate's public key, names and extensions only when they are first read, so
    a malformed one fails here (one of :data:`UNREADABLE_PEM`), not in whatever reads it first.
    A file of several certificates is refused (:class:`UnusablePem`): every check would
    read the first, and gRPC would trust (a CA file) or send (a party's) them all. So is a file
    that holds a private key beside its certificate: certificate files are handed to others (the
    CA's to every party), keys are not."""
    if b"PRIVATE KEY-----" in pem:
        raise UnusablePem(
            "a private key beside the certificate (a certificate file is handed to others, the "
            "CA's to every party: keep the key in a file of its own, mode 0600)"
        )
    count = pem.count(b"-----BEGIN CERTIFICATE-----")
    if count > 1:
        raise UnusablePem(
            f"{count} certificates (one expected: every check reads the first, and TLS would "
            "trust or send them all)"
        )
    certificate = x509.load_pem_x509_certificate(pem)
    certificate.public_key()
    for part in ("extensions", "subject", "issuer", "not_valid_before_utc", "not_valid_after_utc"):
        getattr(certificate, part)
    return certificate


_Parsed = TypeVar("_Parsed")


def _read(parse: Callable[[bytes], _Parsed], pem: bytes, where: str, what: str) -> _Parsed:
    """``parse(pem)``, or ConfigError naming ``where`` and saying a PEM ``what`` was expected
    and what was found."""
    try:
        return parse(pem)
    except UNREADABLE_PEM as error:
        raise ConfigError(
            f"{where}: a PEM {what} expected; found {unreadable(pem, error)}."
        ) from error


def read_certificate(pem: bytes, where: str) -> x509.Certificate:
    """:func:`parse_certificate`, or ConfigError naming ``where``."""
    return _read(parse_certificate, pem, where, "certificate")


CRL_FILE = "crl.pem"
"""The federation's certificate revocation list, beside the CA's certificate: ``secure-vfl certs
revoke`` writes it there, and a deployed party reads it from beside its ``ca`` file."""

REVOCATION_REASONS = {
    "key-compromise": x509.ReasonFlags.key_compromise,
    "affiliation-changed": x509.ReasonFlags.affiliation_changed,
    "superseded": x509.ReasonFlags.superseded,
    "cessation-of-operation": x509.ReasonFlags.cessation_of_operation,
    "privilege-withdrawn": x509.ReasonFlags.privilege_withdrawn,
}
"""The reasons ``certs revoke --reason`` records (RFC 5280 section 5.3.1), by the name it takes.
Without one the entry carries no reason, as RFC 5280 asks rather than ``unspecified``."""


def parse_crl(pem: bytes) -> x509.CertificateRevocationList:
    """The PEM certificate revocation list ``pem`` with every part the checks read parsed now
    (its issuer, dates, extensions and entries), or one of :data:`UNREADABLE_PEM`. A file of
    several lists is refused (:class:`UnusablePem`): every check would read the first."""
    count = pem.count(b"-----BEGIN X509 CRL-----")
    if count > 1:
        raise UnusablePem(
            f"{count} revocation lists (one expected: every check would read the first)"
        )
    crl = x509.load_pem_x509_crl(pem)
    for part in ("issuer", "extensions", "last_update_utc", "next_update_utc"):
        getattr(crl, part)
    for entry in crl:
        for part in ("serial_number", "revocation_date_utc", "extensions"):
            getattr(entry, part)
    if any(isinstance(extension.value, x509.DeltaCRLIndicator) for extension in crl.extensions):
        raise UnusablePem(
            "a delta list (it holds the changes since a base list, so the revocations of the "
            "base would be missing; a complete list expected)"
        )
    unknown = [
        extension.oid.dotted_string
        for extensions in (crl.extensions, *(entry.extensions for entry in crl))
        for extension in extensions
        if extension.critical and isinstance(extension.value, x509.UnrecognizedExtension)
    ]
    if unknown:
        raise UnusablePem(
            f"a list with a critical extension this code cannot read ({unknown[0]}; RFC 5280 "
            "forbids using such a list)"
        )
    return crl


def read_crl(pem: bytes, where: str) -> x509.CertificateRevocationList:
    """:func:`parse_crl`, or ConfigError naming ``where``."""
    return _read(parse_crl, pem, where, "certificate revocation list (-----BEGIN X509 CRL-----)")


def revocation_words(entry: x509.RevokedCertificate) -> str:
    """When and why the certificate of ``entry`` was revoked, in words (``revoked on
    2026-01-05 09:30 UTC (key-compromise)``)."""
    try:
        flag = entry.extensions.get_extension_for_class(x509.CRLReason).value.reason
    except x509.ExtensionNotFound:
        reason = ""
    else:
        named = [name for name, known in REVOCATION_REASONS.items() if known == flag]
        reason = f" ({named[0] if named else flag.value})"
    return f"revoked on {entry.revocation_date_utc:%Y-%m-%d %H:%M} UTC{reason}"


def revoked_serials(crl: x509.CertificateRevocationList) -> dict[int, str]:
    """The serial numbers ``crl`` revokes, each with :func:`revocation_words`."""
    return {entry.serial_number: revocation_words(entry) for entry in crl}


def same_key(certificate: x509.Certificate, key: object) -> bool:
    """Whether ``key`` is the private key of ``certificate`` (their public keys are equal)."""
    public = getattr(key, "public_key", None)
    if public is None:
        return False
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return bool(public().public_bytes(*spki) == certificate.public_key().public_bytes(*spki))


def common_names(certificate: x509.Certificate) -> list[str | bytes]:
    """The common names of ``certificate``'s subject (one, for a party's certificate)."""
    return [a.value for a in certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]


def certificate_name(pem: bytes, where: str = "a certificate") -> str:
    """The party a PEM certificate names: its subject's common name. ConfigError if it is not a
    readable certificate, or names none or more than one (``where`` says which, in errors)."""
    names = common_names(read_certificate(pem, where))
    if len(names) != 1 or not isinstance(names[0], str):
        raise ConfigError(f"{where}: a certificate with one common name expected. Found {names}.")
    return names[0]


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a DNS host name (for an address or a certificate), or None when it is
    one: dot-separated labels of 1 to 63 ASCII letters, digits and inner hyphens, at most 253
    characters in all, the last label not all digits (``256.1.1.1`` is a mistyped IP address,
    not a name; RFC 1123 section 2.1)."""
    if not host:
        return "it is empty"
    if not host.isascii():
        return (
            "it is not ASCII; write an internationalised name in its IDNA A-label form "
            "(xn--..., as `idn2 NAME` prints it)"
        )
    if len(host) > MAX_HOST_LENGTH:
        return f"it has {len(host)} characters, at most {MAX_HOST_LENGTH} expected"
    labels = host.split(".")
    for label in labels:
        if not _HOST_LABEL.fullmatch(label):
            return (
                f"its label {label!r} is not 1 to 63 letters, digits and inner hyphens"
                if label
                else "it has an empty label (a dot at either end, or two dots in a row)"
            )
    if labels[-1].isdigit():
        return "it is not an IP address, and a host name's last label is not all digits"
    return None


# -- what stops a certificate from a handshake (`certs check` and a party's start-up) --------


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a federation's certificates: the file and what is wrong with it."""

    path: Path
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def validity_problems(
    path: Path, certificate: x509.Certificate, now: datetime.datetime
) -> list[Problem]:
    """A problem if ``certificate`` (at ``path``) is not valid at ``now``."""
    start, end = certificate.not_valid_before_utc, certificate.not_valid_after_utc
    if now < start:
        return [Problem(path, f"not valid yet: valid from {start:%Y-%m-%d %H:%M} UTC.")]
    if now > end:
        return [Problem(path, f"expired on {end:%Y-%m-%d %H:%M} UTC.")]
    return []


def _signer_problems(
    path: Path, issuer: x509.Name, ca: x509.Certificate, verifies: Callable[[], bool]
) -> list[Problem]:
    """A problem unless what is at ``path`` names ``ca`` as its ``issuer`` and its signature
    ``verifies`` under the CA's key."""
    if issuer != ca.subject:
        return [
            Problem(
                path,
                f"issued by {issuer.rfc4514_string()!r}, not by this federation's CA "
                f"{ca.subject.rfc4514_string()!r}.",
            )
        ]
    if not verifies():
        return [
            Problem(path, "not signed by this federation's CA (the signature does not verify).")
        ]
    return []


def issuer_problems(
    path: Path, certificate: x509.Certificate, ca: x509.Certificate
) -> list[Problem]:
    """A problem unless ``ca`` issued ``certificate`` (its name and its signature)."""

    def verifies() -> bool:
        try:
            certificate.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            return False
        return True

    return _signer_problems(path, certificate.issuer, ca, verifies)


def crl_issuer_problems(
    path: Path, crl: x509.CertificateRevocationList, ca: x509.Certificate
) -> list[Problem]:
    """A problem unless ``ca`` issued ``crl`` (at ``path``): its name and its signature. A list
    anyone could write would let them refuse any party."""

    def verifies() -> bool:
        try:
            return crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
        except (ValueError, TypeError):  # a key that signs nothing (X25519): it signed no list
            return False

    return _signer_problems(path, crl.issuer, ca, verifies)


def crl_validity_problems(
    path: Path, crl: x509.CertificateRevocationList, now: datetime.datetime
) -> list[Problem]:
    """A problem if ``crl`` (at ``path``) is past its next update, or names none (a revocation
    since then would be missing from it), or was issued after ``now``."""
    next_update = crl.next_update_utc
    if crl.last_update_utc > now:
        return [
            Problem(
                path,
                f"issued in the future ({crl.last_update_utc:%Y-%m-%d %H:%M} UTC, after now: the "
                "CA's clock ahead?); a running party would refuse every honest list issued "
                "before then. A list issued before now expected.",
            )
        ]
    if next_update is None:
        return [
            Problem(
                path, "no next update: a revocation list that says until when it holds expected."
            )
        ]
    if now > next_update:
        return [
            Problem(
                path,
                f"out of date since {next_update:%Y-%m-%d %H:%M} UTC (its next update); a "
                "newer one from the federation's CA expected.",
            )
        ]
    return []


def crl_problems(
    path: Path, crl: x509.CertificateRevocationList, ca: x509.Certificate, now: datetime.datetime
) -> list[Problem]:
    """What is wrong with the revocation list ``crl`` at ``path``: not ``ca``'s, or out of date."""
    return [*crl_issuer_problems(path, crl, ca), *crl_validity_problems(path, crl, now)]


def crl_replacement_problems(
    path: Path,
    new: x509.CertificateRevocationList,
    old: x509.CertificateRevocationList | None,
    ca: x509.Certificate,
) -> list[Problem]:
    """What keeps a running party from applying ``new`` (at ``path``) in place of the list
    ``old`` it applies (None: none): ``new`` not ``ca``'s, issued before ``old``, or without
    a revocation ``old`` holds. ``certs revoke`` keeps those already listed, so a list that
    lacks one is an older list of the CA's put back, which would admit a revoked certificate
    again (or a list from a CA tool that drops expired entries: a restart applies it)."""
    problems = crl_issuer_problems(path, new, ca)
    if problems or old is None:
        return problems
    if new.last_update_utc < old.last_update_utc:
        problems.append(
            Problem(
                path,
                f"issued {new.last_update_utc:%Y-%m-%d %H:%M:%S} UTC, before the list in force "
                f"({old.last_update_utc:%Y-%m-%d %H:%M:%S} UTC); a newer list expected.",
            )
        )
    missing = sorted({entry.serial_number for entry in old} - {e.serial_number for e in new})
    if missing:
        shown = ", ".join(f"{serial:x}" for serial in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(
            Problem(
                path,
                f"lacks {len(missing)} revocation(s) of the list in force (serial {shown}{more}); "
                "a list that keeps every revocation expected (an older list would admit them "
                "again).",
            )
        )
    return problems


def revocation_problems(
    path: Path, certificate: x509.Certificate, crl: x509.CertificateRevocationList, crl_path: Path
) -> list[Problem]:
    """A problem if ``crl`` (at ``crl_path``, this CA's) revokes ``certificate`` (at ``path``)."""
    entry = crl.get_revoked_certificate_by_serial_number(certificate.serial_number)
    if entry is None:
        return []
    return [
        Problem(
            path,
            f"{revocation_words(entry)} by {crl_path} (serial {certificate.serial_number:x}): "
            "every party that has this list refuses its calls; a new certificate expected "
            "(remove it and its key, then `secure-vfl certs init --out DIR --party NAME` issues "
            "one).",
        )
    ]


def _alternative_names(certificate: x509.Certificate) -> x509.SubjectAlternativeName | None:
    try:
        return certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None


def dns_names(certificate: x509.Certificate) -> list[str]:
    """The DNS names among ``certificate``'s subject alternative names."""
    names = _alternative_names(certificate)
    return [] if names is None else list(names.get_values_for_type(x509.DNSName))


def name_mismatches(
    certificate: x509.Certificate, name: str, parties: Collection[str]
) -> list[str]:
    """What stops ``certificate`` from naming party ``name`` alone, one sentence each: its
    common name is not ``name``, ``name`` is not among its DNS names, it names another of
    ``parties`` there too (it would pass for that party where DNS names are checked: a client
    checks a server's), or another DNS name is not a host name. Empty when it names ``name``
    alone. A party's start-up and ``certs check`` (:func:`name_problems`) and a server
    judging a caller's certificate (:mod:`secure_vfl.federation.network`) apply this rule, so
    a certificate passes for the same party at either end of a connection."""
    mismatches = []
    common = common_names(certificate)
    if common != [name]:
        mismatches.append(f"common name {name!r} expected, found {common}.")
    dns = dns_names(certificate)
    if name not in dns:
        mismatches.append(f"{name!r} is not among its DNS names {dns}.")
    others = sorted({host.lower() for host in dns} & (set(parties) - {name}))
    if others:
        mismatches.append(f"it also names the parties {others}: it would pass for them.")
    for host in dns:
        problem = None if host == name else host_problem(host)  # a party name is checked apart
        if problem is not None:
            mismatches.append(f"its DNS name {host!r} is not a host name: {problem}.")
    return mismatches


def name_problems(
    path: Path, certificate: x509.Certificate, name: str, parties: Collection[str]
) -> list[Problem]:
    """Problems unless ``certificate`` (at ``path``) names party ``name`` alone
    (:func:`name_mismatches`)."""
    return [Problem(path, what) for what in name_mismatches(certificate, name, parties)]


def _key_usage(certificate: x509.Certificate) -> x509.KeyUsage | None:
    try:
        return certificate.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return None  # no restriction: any usage


def unknown_critical_problems(path: Path, certificate: x509.Certificate) -> list[Problem]:
    """A problem for each critical extension of ``certificate`` that no TLS library knows: a
    verifier refuses a certificate with a critical extension it cannot read, so every
    handshake with it fails."""
    return [
        Problem(
            path,
            f"no critical extension TLS cannot read expected; found {extension.oid.dotted_string}"
            " (a peer refuses the certificate in every handshake).",
        )
        for extension in certificate.extensions
        if extension.critical and isinstance(extension.value, x509.UnrecognizedExtension)
    ]


def usage_problems(path: Path, certificate: x509.Certificate) -> list[Problem]:
    """A problem unless ``certificate`` may serve TLS servers and clients both, and its key may
    sign a handshake (gRPC's TLS refuses a certificate whose key usage lacks digital signature:
    its party cannot listen), and it has no critical extension TLS cannot read."""
    problems = unknown_critical_problems(path, certificate)
    key_usage = _key_usage(certificate)
    if key_usage is not None and not key_usage.digital_signature:
        problems.append(
            Problem(
                path,
                "the digital signature key usage expected (TLS signs the handshake with the "
                "key); found a key usage without it.",
            )
        )
    try:
        usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return problems  # no restriction: any usage
    needed = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    if not needed <= set(usages):
        problems.append(Problem(path, "TLS server and client authentication usages expected."))
    return problems


def ca_usage_problems(path: Path, ca: x509.Certificate) -> list[Problem]:
    """A problem unless the CA certificate ``ca`` (at ``path``) may sign certificates: gRPC's
    TLS refuses every certificate a CA whose key usage lacks certificate signing issued, or one
    with a critical extension TLS cannot read."""
    problems = unknown_critical_problems(path, ca)
    key_usage = _key_usage(ca)
    if key_usage is None or key_usage.key_cert_sign:
        return problems
    return [
        *problems,
        Problem(
            path,
            "the certificate signing key usage expected of a CA (every peer's handshake refuses "
            "the certificates it issued otherwise); found a key usage without it.",
        ),
    ]


MIN_RSA_BITS = 2048  # 112-bit security, as NIST SP 800-57 asks of keys in use today


def _key_kind(key: object) -> str:
    """What kind of key ``key`` is, in words: its algorithm, and its curve or size."""
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return f"an EC key on {key.curve.name}"
    if isinstance(key, rsa.RSAPrivateKey):
        return f"an RSA key of {key.key_size} bits"
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return "an Ed25519 key"
    if isinstance(key, ed448.Ed448PrivateKey):
        return "an Ed448 key"
    return f"a {type(key).__name__}"


def key_type_problems(path: Path, key: object) -> list[Problem]:
    """A problem unless ``key`` is one gRPC's TLS (BoringSSL) completes a mutual handshake with
    and that is strong enough: EC P-256 or P-384, or RSA of at least 2048 bits. Tested with
    grpcio 1.85.1 between two processes: Ed25519 and P-521 keys complete no handshake."""
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(
        key.curve, ec.SECP256R1 | ec.SECP384R1
    ):
        return []
    if isinstance(key, rsa.RSAPrivateKey) and key.key_size >= MIN_RSA_BITS:
        return []
    why = (
        "shorter than 112-bit security"
        if isinstance(key, rsa.RSAPrivateKey)
        else "gRPC's TLS (BoringSSL) completes no handshake with it"
    )
    return [
        Problem(
            path,
            f"an EC P-256 or P-384 key or an RSA key of at least {MIN_RSA_BITS} bits expected, "
            f"found {_key_kind(key)}: {why}.",
        )
    ]


def ca_key_problems(path: Path, ca: x509.Certificate) -> list[Problem]:
    """A problem unless the key of the CA certificate ``ca`` (at ``path``) is one gRPC's TLS
    verifies the certificates it signed with, and strong enough: EC P-256, P-384 or P-521,
    Ed25519, or RSA of at least 2048 bits (a weaker CA key lets whoever breaks it issue a
    certificate for any party). Tested with grpcio 1.85.1: a secp256k1, brainpool or Ed448 CA
    fails every handshake."""
    key = ca.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(
        key.curve, ec.SECP256R1 | ec.SECP384R1 | ec.SECP521R1
    ):
        return []
    if isinstance(key, ed25519.Ed25519PublicKey):
        return []
    if isinstance(key, rsa.RSAPublicKey) and key.key_size >= MIN_RSA_BITS:
        return []
    if isinstance(key, rsa.RSAPublicKey):
        found, why = f"an RSA key of {key.key_size} bits", "shorter than 112-bit security"
    elif isinstance(key, ec.EllipticCurvePublicKey):
        found, why = f"an EC key on {key.curve.name}", "gRPC's TLS verifies no signature of it"
    else:
        found, why = f"a {type(key).__name__}", "gRPC's TLS verifies no signature of it"
    return [
        Problem(
            path,
            "a CA key on EC P-256, P-384 or P-521, Ed25519, or RSA of at least "
            f"{MIN_RSA_BITS} bits expected, found {found}: {why}.",
        )
    ]


def covers_host(certificate: x509.Certificate, host: str) -> bool:
    """Whether ``certificate`` names ``host`` (an IP address or a DNS host name, as in an
    address) among its subject alternative names, as a standard TLS client checks it: an IP
    address as an IP address entry, a name as a DNS entry (case-insensitive). The loopback names
    stand for each other, as they do on every machine: ``localhost`` is covered by an IP address
    entry 127.0.0.1 or ::1, and those addresses by a ``localhost`` DNS entry (not another
    127.x.y.z address: ``localhost`` does not resolve to it)."""
    names = _alternative_names(certificate)
    if names is None:
        return False
    ips = set(names.get_values_for_type(x509.IPAddress))
    dns = [name.lower() for name in names.get_values_for_type(x509.DNSName)]
    address = ip_host(host)
    if address is not None:
        return address in ips or (address in _LOCALHOST and "localhost" in dns)
    wanted = host.lower()
    return wanted in dns or (wanted == "localhost" and bool(ips & _LOCALHOST))


_LOCALHOST = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}


def ip_host(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``host`` writes (an IPv6 one without its zone), or None for a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
        return ipaddress.IPv6Address(str(address).split("%", 1)[0])
    return address


def identity_problems(
    identity: TlsIdentity,
    name: str,
    *,
    files: tuple[Path, Path, Path],
    parties: Sequence[str] = (),
    now: datetime.datetime | None = None,
) -> list[Problem]:
    """What stops party ``name`` with ``identity`` (read by :meth:`TlsIdentity.from_files`
    from ``files``: the CA's certificate, the party's certificate and key) from any TLS
    handshake in its federation: the CA or the certificate not valid at ``now``, a CA that
    may not sign certificates or whose key is weak or of a type gRPC cannot verify, a
    certificate the CA did not sign, one that does not name the party (or names another of
    ``parties`` too), one without both TLS usages or whose key may not sign, a key type gRPC
    cannot use. The checks of ``secure-vfl certs check`` that a handshake depends on."""
    now = now if now is not None else datetime.datetime.now(datetime.UTC)
    ca_path, certificate_path, key_path = files
    ca = read_certificate(identity.ca, str(ca_path))
    certificate = read_certificate(identity.certificate, str(certificate_path))
    key = serialization.load_pem_private_key(identity.key, None)
    return [
        *validity_problems(ca_path, ca, now),
        *ca_usage_problems(ca_path, ca),
        *ca_key_problems(ca_path, ca),
        *validity_problems(certificate_path, certificate, now),
        *issuer_problems(certificate_path, certificate, ca),
        *name_problems(certificate_path, certificate, name, parties),
        *usage_problems(certificate_path, certificate),
        *key_type_problems(key_path, key),
    ]


def revoked_identity_problems(
    identity: TlsIdentity,
    *,
    files: tuple[Path, Path],
    now: datetime.datetime | None = None,
) -> list[Problem]:
    """What the federation's revocation list (``identity.crl``, read from ``files``: the list
    and the party's certificate) says against the party: the list out of date at ``now`` (a
    revocation since would be missing from it), or the party's own certificate revoked (every
    peer refuses its calls). Empty without a list; :meth:`TlsIdentity.from_files` has checked
    that the CA signed it."""
    if identity.crl is None:
        return []
    now = now if now is not None else datetime.datetime.now(datetime.UTC)
    crl_path, certificate_path = files
    crl = read_crl(identity.crl, str(crl_path))
    certificate = read_certificate(identity.certificate, str(certificate_path))
    return [
        *crl_validity_problems(crl_path, crl, now),
        *revocation_problems(certificate_path, certificate, crl, crl_path),
    ]


@dataclasses.dataclass(frozen=True)
class TlsIdentity:
    """A party's TLS material, PEM: the federation CA's certificate (which every peer's must be
    signed by), the party's certificate and its private key, and the CA's certificate
    revocation list where the federation has one (the party's server refuses the callers whose
    certificates it lists)."""

    ca: bytes
    certificate: bytes
    key: bytes = dataclasses.field(repr=False)
    crl: bytes | None = None
    crl_path: Path | None = dataclasses.field(default=None, compare=False)
    """Where the CA's revocation list is, or will be once the CA revokes a first certificate:
    a party's server reads it again when it changes (None: it keeps ``crl``)."""

    @classmethod
    def from_files(
        cls, ca: Path, certificate: Path, key: Path, *, crl: Path | None = None
    ) -> TlsIdentity:
        """Read the files; ConfigError if one is missing or is not PEM of its kind, if the key
        file lets anyone but its owner read it, if the key is not the certificate's, or if the
        revocation list ``crl`` (optional) is not the CA's."""
        for path in (ca, certificate, key, *([crl] if crl is not None else [])):
            if not path.is_file():
                raise ConfigError(f"a PEM file expected at {path}. Found none.")
        if b"-----BEGIN CERTIFICATE-----" in key.read_bytes()[:4096]:
            swapped = b"PRIVATE KEY-----" in certificate.read_bytes()[:4096]
            why = f" ({certificate} holds a private key: cert and key swapped?)" if swapped else ""
            raise ConfigError(f"{key}: a PEM private key expected, found a certificate{why}.")
        mode = stat.S_IMODE(key.stat().st_mode)
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{key} has mode {mode:04o}: others may read the private key. Expected 0600 "
                f"(chmod 600 {key})."
            )
        identity = cls(
            ca.read_bytes(),
            certificate.read_bytes(),
            key.read_bytes(),
            crl.read_bytes() if crl is not None else None,
            crl,
        )
        identity._check(ca, certificate, key, crl)
        return identity

    def _check(self, ca: Path, certificate: Path, key: Path, crl: Path | None) -> None:
        """ConfigError, naming the file, unless the CA and the certificate are PEM certificates,
        the key is the certificate's private key (gRPC would only say that it cannot listen,
        or fail every handshake) and the revocation list, if any, is one the CA signed."""
        authority = read_certificate(self.ca, str(ca))
        if self.crl is not None:
            where = Path(crl if crl is not None else CRL_FILE)
            problems = crl_issuer_problems(where, read_crl(self.crl, str(where)), authority)
            if problems:
                raise ConfigError(f"{problems[0]} A revocation list from the CA {ca} expected.")
        mine = read_certificate(self.certificate, str(certificate))
        try:
            private = serialization.load_pem_private_key(self.key, None)
        except UNREADABLE_PEM as error:
            raise ConfigError(
                f"{key}: a PEM private key without a passphrase expected; found "
                f"{unreadable(self.key, error)}."
            ) from error
        if not same_key(mine, private):
            raise ConfigError(
                f"{key} is not the private key of {certificate} (their public keys differ). "
                "`secure-vfl certs check` lists what is wrong with a set."
            )

    @property
    def name(self) -> str:
        """The party this identity's certificate names."""
        return certificate_name(self.certificate, "this party's certificate")
