"""Certificates for a federation: one certificate authority (CA) and one key pair and certificate
per party, for mutual TLS on the gRPC transport (:mod:`secure_vfl.federation.network`).

``make_federation(DIR, parties)`` writes, all files or none (each is written into a staging
directory first and moved in once all are there),

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
DNS name; ``ca`` is not a party name (``ca.pem`` and ``ca.key`` are the CA's files). The hosts
the party is reached at are further subject alternative names (default ``localhost`` and
``127.0.0.1``), for standard TLS tools: an IP address becomes an IP address entry, anything else
must be an ASCII DNS host name (see :func:`host_problem`; an internationalised name in its IDNA
A-label form, ``xn--...``). A host may not be another party's name, or one certificate would
pass for two parties.

Keys made here are EC P-256 (ECDSA with SHA-256). An organisation's own PKI may issue EC P-384 or
RSA keys of at least 2048 bits, which gRPC's TLS stack (BoringSSL) accepts too; it completes no
handshake with an Ed25519 certificate (``NO_COMMON_SIGNATURE_ALGORITHMS``) or a P-521 one (tested
with grpcio 1.85.1), so :func:`check_federation` refuses those, and shorter RSA keys. Keys are
written PKCS#8, unencrypted, mode 0600. Validity: the CA 5 years, a party 1 year by default
(``days``), starting one minute in the past to absorb small clock differences between machines. A
party certificate may not outlive the CA that signs it (no client accepts it once the CA has
expired, so the extra years would be a false promise): ``make_federation`` refuses a ``days`` that
reaches beyond the CA's expiry, and says the most it can issue, rather than quietly shortening the
certificate.

``check_federation(DIR)`` reports every problem with a set of certificates: a file missing or
unreadable (a key without its certificate, or a certificate without its key), a certificate expired
or not yet valid or valid beyond its CA, one not signed by this CA, a name that is not in its
certificate, a DNS name that is not a host name, a key that does not match its certificate, a key
file readable by others, a key type gRPC cannot use, a certificate without both TLS usages or whose
key usage lacks digital signature (a CA's: certificate signing), a certificate with a critical
extension TLS cannot read, a CA key that is weak or of a type gRPC cannot verify, a party's
certificate that is a CA's, a certificate the CA revoked; and a revocation list ``DIR/crl.pem``
that cannot be read, is not signed by the CA or is past its next update.

``revoke(DIR, NAME)`` revokes party ``NAME``'s certificate (a stolen key, an organisation that
left): it adds the certificate's serial number to the CA's certificate revocation list (X.509 CRL),
``DIR/crl.pem``, signed with ``DIR/ca.key`` and written atomically, keeping the revocations already
there; its next update is the CA's expiry. Hand every party the new ``crl.pem``, beside its
``ca.pem`` (or where its federation file's ``crl`` says): a running party reads the list again when
the file changes, within seconds, and applies it if it keeps every revocation of the list in force
(no restart). A party refuses to start with a revoked certificate, and its server refuses every
caller whose certificate the list revokes (:mod:`secure_vfl.federation.network`; gRPC's Python API
takes no CRL, so the party applies it). To admit the party again, revoke first (``revoke`` reads the
serial number from ``NAME.pem``), then remove ``NAME.pem`` and ``NAME.key`` and issue new ones
(``make_federation(DIR, [NAME])``, ``certs init``: the CA is reused). What a revocation cannot do: a
client sees nothing of a server's certificate in gRPC's Python API, so whoever holds the revoked key
can still answer as that party wherever they can take its address; move the party's address, or,
where the key may be used anywhere on the path, make a new CA and certificates for every party.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import ipaddress
import os
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from secure_vfl.errors import ConfigError, RunWarning
from secure_vfl.federation.certificates import (
    CRL_FILE,
    REVOCATION_REASONS,
    UNREADABLE_PEM,
    Problem,
    ca_key_problems,
    ca_usage_problems,
    certificate_name,
    check_party_name,
    crl_issuer_problems,
    crl_problems,
    dns_names,
    host_problem,
    is_ca,
    issuer_problems,
    key_type_problems,
    name_problems,
    parse_certificate,
    parse_crl,
    read_certificate,
    read_crl,
    revocation_problems,
    revocation_words,
    same_key,
    unreadable,
    usage_problems,
    validity_problems,
)
from secure_vfl.io import (
    atomic_directory,
    atomic_write,
    fsync_directory,
    left_beside,
    lock_directory,
    temporary_prefix,
    unwritable,
)

CA_NAME = "ca"
CA_CERT, CA_KEY = f"{CA_NAME}.pem", f"{CA_NAME}.key"
CRL_NAME = Path(CRL_FILE).stem
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


def _remove_stale_staging(directory: Path) -> None:
    """Remove the staging folders that a write of ``directory`` killed before its end left
    (SIGKILL, a power cut: no handler ran), which may hold private keys: beside a new
    ``directory`` (``.NAME.*.tmp``) and inside an existing one (``.staging.*.tmp``), but not
    those of a writer that still runs (a second ``certs init`` at the same time). A RunWarning
    names them: their keys lay on disk, mode 0600, outside the set."""
    stale = left_beside(directory, ".tmp")
    if directory.is_dir():
        stale += left_beside(directory / "staging", ".tmp")
    for path in stale:
        shutil.rmtree(path)
    if stale:
        warnings.warn(
            f"removed {len(stale)} staging folder(s) an earlier write of {directory} left when "
            f"it was killed ({', '.join(path.name for path in stale)}); any keys in them lay "
            "on disk (mode 0600) outside the set.",
            RunWarning,
            stacklevel=2,
        )


def _write_all(directory: Path, files: Mapping[str, tuple[bytes, bool]]) -> None:
    """Write ``files`` (name: content, and whether it is private, a key) into ``directory``, all
    or none: they are written into a staging directory and moved in once all are there (a new
    ``directory`` is the staging directory renamed); a failure removes what was moved in and
    raises OutputError (KeyboardInterrupt and the like pass as they are)."""

    def stage(staging: Path) -> None:
        for name, (data, private) in files.items():
            _write(staging / name, data, private=private)

    _remove_stale_staging(directory)
    if not directory.exists():

        def stage_directory(staging: Path) -> None:
            stage(staging)
            umask = os.umask(0)
            os.umask(umask)
            staging.chmod(0o777 & ~umask)  # an ordinary directory, as mkdir makes it

        atomic_directory(directory, stage_directory)
        return
    try:
        staging = Path(
            tempfile.mkdtemp(
                prefix=temporary_prefix(directory / "staging"), suffix=".tmp", dir=directory
            )
        )
    except OSError as error:
        raise unwritable(directory, error) from None
    moved: list[Path] = []
    try:
        stage(staging)
        for name in files:
            _move_in(staging / name, directory / name)
            moved.append(directory / name)
        fsync_directory(directory)
    except BaseException as error:
        for path in moved:
            path.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise unwritable(directory, error) from error
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_in(staged: Path, target: Path) -> None:
    """Put ``staged`` at ``target`` only if nothing is there: a hard link fails where a file
    appeared since the set was checked (another ``certs init`` at the same time, whose CA this
    one's would replace, leaving certificates no CA signs: ConfigError). Where the file system
    has no hard links, a replace after a last check."""
    appeared = ConfigError(
        f"{target} appeared while this certs init ran (another one at the same time?); "
        "nothing of this one is kept: run it again."
    )
    try:
        os.link(staged, target)
    except FileExistsError:
        raise appeared from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        if target.exists():
            raise appeared from None
        os.replace(staged, target)


def _host_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """Subject alternative names of ``hosts``: IP addresses as such, host names as DNS names;
    ConfigError for anything else."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            problem = host_problem(host)
            if problem is not None:
                raise ConfigError(
                    f"a --san host name or IP address expected. Found {host!r}: {problem}."
                ) from None
            names.append(x509.DNSName(host))
            continue
        if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
            raise ConfigError(
                f"a --san IP address without a zone expected (a zone names an interface of one "
                f"machine; a certificate holds none). Found {host!r}."
            )
        names.append(x509.IPAddress(address))
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


def _check_party_name(name: str) -> None:
    """ConfigError unless ``name`` can name a party here: a party name on the network, and not
    the CA's or its revocation list's (its files would be theirs)."""
    check_party_name(name)
    if name == CA_NAME:
        raise ConfigError(
            f"a party name other than {CA_NAME!r} expected ({CA_CERT} and {CA_KEY} are the "
            f"federation CA's files). Found {name!r}."
        )
    if name == CRL_NAME:
        raise ConfigError(
            f"a party name other than {CRL_NAME!r} expected ({CRL_FILE} is the CA's "
            f"certificate revocation list). Found {name!r}."
        )


def _check_request(parties: Sequence[str], hosts: Sequence[str], days: int) -> None:
    if not parties:
        raise ConfigError("at least one --party NAME expected. Found none.")
    for name in parties:
        _check_party_name(name)
    repeated = sorted({name for name in parties if list(parties).count(name) > 1})
    if repeated:
        raise ConfigError(f"each party once expected. Found {', '.join(repeated)} repeated.")
    _host_names(hosts)  # ConfigError for a host that is neither an IP address nor a host name
    clash = sorted(set(parties) & {host.lower() for host in hosts})
    if clash:
        raise ConfigError(
            f"a --san host may not be a party's name (its certificate would pass for that party)."
            f" Found {', '.join(clash)}."
        )
    if days < 1:
        raise ConfigError(f"a validity of >= 1 day expected. Found {days}.")


def _refuse_passing_for(directory: Path, parties: Sequence[str], hosts: Sequence[str]) -> None:
    """ConfigError where new certificates for ``parties`` (naming ``hosts`` too) would pass for
    a party whose certificate ``directory`` already holds (a host that is its name), or one of
    those would pass for a new party (its DNS names hold the new name): one call checks this
    within its own parties; this checks them against the set they join."""
    names = {host.lower() for host in hosts}
    for other in federation_parties(directory):
        if other in names:
            raise ConfigError(
                f"a --san host may not be a party's name (the new certificates would pass for "
                f"{other}, whose certificate is in {directory}). Found {other}."
            )
        path = directory / f"{other}.pem"
        if not path.is_file():
            continue
        try:
            certificate = parse_certificate(path.read_bytes())
        except UNREADABLE_PEM:  # `certs check` names what is wrong with it
            continue
        named = sorted({host.lower() for host in dns_names(certificate)} & set(parties))
        if named:
            raise ConfigError(
                f"{path} also names {', '.join(named)} among its hosts: it would pass for the "
                "new party. Expected party names that no certificate of the set names; found "
                f"{', '.join(named)}."
            )


def _load_ca(
    directory: Path, purpose: str = "to issue certificates"
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA of ``directory`` and its key (``purpose``: to issue more party certificates, or
    to sign a revocation list); ConfigError, naming the file, unless both are there and
    readable, the certificate is a CA's and the key is its own."""
    found = {}
    for name, what, load in (
        (CA_CERT, "CA certificate", parse_certificate),
        (CA_KEY, "private key", _load_key),
    ):
        path = directory / name
        if not path.is_file():
            raise ConfigError(
                f"{directory} holds part of a CA: its certificate and key ({CA_CERT}, {CA_KEY}) "
                f"expected {purpose}; found no file {path}."
            )
        found[name], problems = _load(path, load, what)  # what `certs check` says of it
        if problems:
            raise ConfigError(str(problems[0]))
    ca, key = found[CA_CERT], found[CA_KEY]
    assert isinstance(ca, x509.Certificate)
    if not is_ca(ca):
        raise ConfigError(
            f"{directory / CA_CERT}: a CA certificate (basic constraints CA:TRUE) expected "
            f"{purpose}; found one that is not a CA's ({ca.subject.rfc4514_string()})."
        )
    if not same_key(ca, key):
        raise ConfigError(f"{directory / CA_KEY} is not the key of {directory / CA_CERT}.")
    if not isinstance(key, ec.EllipticCurvePrivateKey):  # a CA another tool made
        raise ConfigError(
            f"{directory / CA_KEY}: an EC key expected {purpose} (secure-vfl signs with the "
            f"CA's EC key); found a {type(key).__name__}. Make a new set with `secure-vfl certs "
            "init`, or issue and revoke with the tool that made this CA."
        )
    return ca, key


def _check_lifetime(
    directory: Path, ca: x509.Certificate, start: datetime.datetime, days: int
) -> None:
    """ConfigError if a party certificate valid ``days`` from ``start`` would outlive ``ca``."""
    end = ca.not_valid_after_utc
    longest = (end - start).days
    if longest < 1:
        raise ConfigError(
            f"a CA valid for at least another day expected to issue certificates. Found the CA "
            f"in {directory} valid until {end:%Y-%m-%d %H:%M} UTC; make a new one in another "
            "--out."
        )
    if days > longest:
        raise ConfigError(
            f"a validity of at most {longest} days expected (a party certificate may not outlive "
            f"its CA, valid until {end:%Y-%m-%d %H:%M} UTC). Found {days}."
        )


def make_federation(
    directory: Path,
    parties: Sequence[str],
    *,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    days: int = PARTY_DAYS,
) -> list[Path]:
    """Write a federation CA (unless ``directory`` already holds one: then it issues with it)
    and a key and certificate per party; return the files written. ConfigError, before anything
    is written, for a bad name, a host that is neither an IP address nor a host name or is a
    party's name, a party file already there, or ``days`` reaching beyond the CA's expiry. The
    files are written all or none: a failure leaves ``directory`` as it was."""
    _check_request(parties, hosts, days)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"a directory expected for the certificates. Found the file {directory}.")
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
    if directory.is_dir():
        _refuse_passing_for(directory, parties, hosts)
    files: dict[str, tuple[bytes, bool]] = {}  # name: content, private
    now = _now()
    if (directory / CA_CERT).exists() or (directory / CA_KEY).exists():
        ca, ca_key = _load_ca(directory)
    else:
        ca_key = _new_key()
        ca = _ca_certificate(ca_key, now)
        files[CA_CERT] = (_cert_pem(ca), False)
        files[CA_KEY] = (_key_pem(ca_key), True)
    start = now - CLOCK_SKEW
    _check_lifetime(directory, ca, start, days)
    for name in parties:
        key = _new_key()
        certificate = party_certificate(
            name, key, ca, ca_key, hosts=hosts, not_before=start, days=days
        )
        files[f"{name}.pem"] = (_cert_pem(certificate), False)
        files[f"{name}.key"] = (_key_pem(key), True)
    _write_all(directory, files)
    return [directory / name for name in files]


# -- checking a set of certificates ------------------------------------------------------------


def _within_ca(path: Path, certificate: x509.Certificate, ca: x509.Certificate) -> list[Problem]:
    """A problem if ``certificate`` is valid beyond ``ca``: it stops working when the CA expires."""
    end, ca_end = certificate.not_valid_after_utc, ca.not_valid_after_utc
    if end <= ca_end:
        return []
    return [
        Problem(
            path,
            f"valid until {end:%Y-%m-%d %H:%M} UTC, beyond its CA (valid until "
            f"{ca_end:%Y-%m-%d %H:%M} UTC): it stops working when the CA expires.",
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
        data = path.read_bytes()
        return loader(data), []
    except OSError as error:
        return None, [Problem(path, f"cannot be read ({error.strerror}).")]
    except UNREADABLE_PEM as error:
        return None, [Problem(path, f"a PEM {what} expected; found {unreadable(data, error)}.")]


def _load_key(data: bytes) -> object:
    return serialization.load_pem_private_key(data, None)


def check_party(
    directory: Path,
    name: str,
    ca: x509.Certificate,
    parties: Sequence[str],
    now: datetime.datetime,
    crl: x509.CertificateRevocationList | None = None,
) -> list[Problem]:
    """What is wrong with party ``name``'s certificate and key in ``directory`` (revoked too,
    where ``crl``, the CA's revocation list in ``directory``, says so)."""
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    certificate, problems = _load(cert_path, parse_certificate, "certificate")
    key, key_problems = _load(key_path, _load_key, "private key")
    problems += key_problems
    if key is not None:
        problems += _permissions(key_path) + key_type_problems(key_path, key)
    if not isinstance(certificate, x509.Certificate):
        return problems
    problems += validity_problems(cert_path, certificate, now)
    problems += _within_ca(cert_path, certificate, ca)
    problems += issuer_problems(cert_path, certificate, ca)
    problems += name_problems(cert_path, certificate, name, parties)
    problems += usage_problems(cert_path, certificate)
    if is_ca(certificate):
        problems.append(
            Problem(
                cert_path,
                "a CA certificate (basic constraints CA:TRUE); a party's certificate that is not "
                "a CA's expected (with its key the party could issue certificates of its own).",
            )
        )
    if crl is not None:
        problems += revocation_problems(cert_path, certificate, crl, directory / CRL_FILE)
    if key is not None and not same_key(certificate, key):
        problems.append(Problem(key_path, f"not the key of {cert_path.name}."))
    return problems


def _check_ca(directory: Path, now: datetime.datetime) -> tuple[object, list[Problem]]:
    path = directory / CA_CERT
    ca, problems = _load(path, parse_certificate, "CA certificate")
    if not isinstance(ca, x509.Certificate):
        return None, problems
    problems += validity_problems(path, ca, now)
    if not is_ca(ca):
        problems.append(Problem(path, "not a CA certificate (basic constraints CA:TRUE)."))
    problems += ca_usage_problems(path, ca)
    problems += ca_key_problems(path, ca)
    key_path = directory / CA_KEY
    if key_path.exists():  # optional: the CA key may be kept elsewhere
        key, key_problems = _load(key_path, _load_key, "private key")
        problems += key_problems + _permissions(key_path)
        if key is not None and not same_key(ca, key):
            problems.append(Problem(key_path, f"not the key of {CA_CERT}."))
    return ca, problems


def _check_crl(
    directory: Path, ca: x509.Certificate, now: datetime.datetime
) -> tuple[x509.CertificateRevocationList | None, list[Problem]]:
    """The CA's revocation list in ``directory`` (None where there is none, or where it is not
    the CA's: it revokes nothing then) and what is wrong with it: unreadable, not signed by the
    CA, out of date."""
    path = directory / CRL_FILE
    if not path.exists():
        return None, []
    crl, problems = _load(path, parse_crl, "certificate revocation list")
    if not isinstance(crl, x509.CertificateRevocationList):
        return None, problems
    problems = crl_problems(path, crl, ca, now)
    return (None if crl_issuer_problems(path, crl, ca) else crl), problems


def federation_parties(directory: Path) -> list[str]:
    """The parties with a certificate or a key in ``directory`` (every ``NAME.pem`` and
    ``NAME.key`` but the CA's and its revocation list's), so that a key left without its
    certificate, or a certificate without its key, is checked, and found missing its other
    half. PermissionError where the directory cannot be listed (glob would find nothing in
    it)."""
    files = [path for path in directory.iterdir() if path.suffix in (".pem", ".key")]
    return sorted({path.stem for path in files if path.is_file()} - {CA_NAME, CRL_NAME})


def check_federation(
    directory: Path,
    parties: Sequence[str] | None = None,
    *,
    now: datetime.datetime | None = None,
) -> list[Problem]:
    """Every problem with the CA of ``directory``, its revocation list (if there is one) and
    the certificates and keys of ``parties`` (default: every party with a certificate or a key
    there, a revoked certificate too); an empty list when all is well. ConfigError if
    ``directory`` is not a directory or holds no party, or for a bad party name."""
    if not directory.is_dir():
        found = "a file" if directory.exists() else "nothing"
        raise ConfigError(f"a directory of certificates expected. Found {found} at {directory}.")
    now = now if now is not None else _now()
    everyone, strays = [], []
    for name in federation_parties(directory):
        try:
            _check_party_name(name)
        except ConfigError as error:  # another file of the folder: named, the rest still checked
            files = [directory / f"{name}{suffix}" for suffix in (".pem", ".key")]
            strays.append(
                Problem(
                    next(path for path in files if path.exists()),
                    f"not a party's file: {error} Rename it, move it out, or check the parties "
                    "by name (--party NAME).",
                )
            )
        else:
            everyone.append(name)
    chosen = list(parties) if parties else everyone
    if not chosen:
        raise ConfigError(f"party certificates (NAME.pem) expected in {directory}. Found none.")
    for name in chosen:
        _check_party_name(name)
    ca, problems = _check_ca(directory, now)
    problems = [*([] if parties else strays), *problems]
    if not isinstance(ca, x509.Certificate):
        return problems
    crl, crl_found = _check_crl(directory, ca, now)
    problems += crl_found
    for name in chosen:
        problems += check_party(directory, name, ca, sorted(set(everyone) | set(chosen)), now, crl)
    return problems


def crl_summary(directory: Path) -> str | None:
    """The revocation list of ``directory`` in a line (for ``certs check`` once it found
    nothing wrong), or None where there is none."""
    path = directory / CRL_FILE
    if not path.exists():
        return None
    crl = read_crl(path.read_bytes(), str(path))
    until = f", next update {crl.next_update_utc:%Y-%m-%d} UTC" if crl.next_update_utc else ""
    return f"{CRL_FILE}: {len(crl)} certificate(s) revoked{until}"


# -- revoking a party's certificate --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Revocation:
    """What :func:`revoke` did: the party, its certificate's serial number, when and why the
    certificate was revoked (words), the list it is in and how many that holds, and whether it
    was there already (the list then is left as it was)."""

    party: str
    serial: int
    revoked: str
    crl: Path
    count: int
    already: bool


def _crl_to_extend(
    path: Path, ca: x509.Certificate
) -> tuple[x509.CertificateRevocationList | None, int]:
    """The CA's revocation list at ``path`` (None where there is none) and its CRL number (0
    without one); ConfigError if it is unreadable or not the CA's: a new list would lose the
    revocations it holds."""
    if not path.exists():
        return None, 0
    keep = "expected to add to (a new list would lose its revocations); move it away to start one"
    try:
        crl = read_crl(path.read_bytes(), str(path))
    except OSError as error:
        raise ConfigError(f"{path} cannot be read ({error.strerror}); {keep}.") from None
    except ConfigError as error:
        raise ConfigError(f"{error} This CA's list {keep}.") from None
    problems = crl_issuer_problems(path, crl, ca)
    if problems:
        raise ConfigError(f"{problems[0]} This CA's list {keep}.")
    try:
        number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        number = 0
    return crl, number


def revoke(
    directory: Path,
    name: str | None = None,
    *,
    certificate: Path | None = None,
    reason: str | None = None,
) -> Revocation:
    """Revoke party ``name``'s certificate in ``directory`` (``NAME.pem``), or the certificate file
    ``certificate`` (one kept from before the party's was issued again, whose key may be out
    there; its party is its common name), by its serial number: write the CA's revocation list
    ``DIR/crl.pem``, signed with ``DIR/ca.key``, with every revocation it held and this one
    (``reason``: one of :data:`REVOCATION_REASONS`, or none), a CRL number one above the last,
    and its next update at the CA's expiry (the list holds as long as the CA, which signs
    nothing after). A certificate already revoked leaves the list as it is. ConfigError, before
    anything is written, for a bad name or reason, a CA that cannot sign (missing, expired, its
    key not there), a certificate missing or not this CA's, or a ``crl.pem`` that is not the
    CA's, and while another command holds the directory's lock (:func:`~secure_vfl.io.
    lock_directory`): the list is read, extended and written atomically under that lock, so a
    revocation at the same time cannot lose the other's entry (nor write a list that lacks it,
    which running parties refuse to apply)."""
    if (name is None) == (certificate is None):
        raise ConfigError(
            "a party name or a certificate file to revoke expected (one of the two). Found "
            f"{'both' if name is not None else 'neither'}."
        )
    if name is not None:
        _check_party_name(name)
    if reason is not None and reason not in REVOCATION_REASONS:
        raise ConfigError(
            f"a reason among {', '.join(REVOCATION_REASONS)} expected. Found {reason!r}."
        )
    if not directory.is_dir():
        found = "a file" if directory.exists() else "nothing"
        raise ConfigError(f"a directory of certificates expected. Found {found} at {directory}.")
    ca, ca_key = _load_ca(directory, "to sign a revocation list")
    now = _now()
    if now >= ca.not_valid_after_utc:
        raise ConfigError(
            f"a CA valid now expected to sign a revocation list. Found the CA in {directory} "
            f"expired on {ca.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: every certificate it "
            "issued is refused already; make a new one in another --out."
        )
    path = certificate if certificate is not None else directory / f"{name}.pem"
    if not path.is_file():
        whose = f"{name}'s certificate" if name is not None else "a certificate"
        raise ConfigError(f"{whose} expected at {path} to revoke. Found none.")
    revoked = read_certificate(path.read_bytes(), str(path))
    problems = issuer_problems(path, revoked, ca)
    if problems:
        raise ConfigError(f"{problems[0]} A certificate this CA issued expected to revoke.")
    if revoked.public_key() == ca.public_key():  # not is_ca: a party's may say CA:TRUE too
        raise ConfigError(
            f"{path}: a party's certificate expected to revoke; found the CA's own (it signs "
            "its own list, and no list revokes it). To stop trusting the CA, make a new one "
            "(`secure-vfl certs init` into another --out) and hand out its certificates."
        )
    if name is None:
        name = certificate_name(path.read_bytes(), str(path))
    release = lock_directory(directory, "--dir")
    try:
        return _extend_crl(directory / CRL_FILE, ca, ca_key, name, revoked, reason)
    finally:
        release()


def _extend_crl(
    crl_path: Path,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    name: str,
    revoked: x509.Certificate,
    reason: str | None,
) -> Revocation:
    """Write ``crl_path``: the list there (if any) with ``revoked`` added (:func:`revoke`, which
    holds the directory's lock)."""
    now = _now()
    old, number = _crl_to_extend(crl_path, ca)
    serial = revoked.serial_number
    known = old.get_revoked_certificate_by_serial_number(serial) if old is not None else None
    if old is not None and known is not None:
        return Revocation(name, serial, revocation_words(known), crl_path, len(old), True)
    entry = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now)
    if reason is not None:
        entry = entry.add_extension(x509.CRLReason(REVOCATION_REASONS[reason]), critical=False)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.subject)
        .last_update(now - CLOCK_SKEW)
        .next_update(ca.not_valid_after_utc)
        .add_extension(x509.CRLNumber(number + 1), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    new = entry.build()
    for listed in [*(old if old is not None else []), new]:
        builder = builder.add_revoked_certificate(listed)
    crl = builder.sign(ca_key, hashes.SHA256())
    _write(crl_path, crl.public_bytes(serialization.Encoding.PEM), private=False)
    return Revocation(name, serial, revocation_words(new), crl_path, len(crl), False)


def certificate_expiry(path: Path) -> datetime.datetime:
    """When the certificate at ``path`` expires (for reports)."""
    return parse_certificate(path.read_bytes()).not_valid_after_utc
