"""The federation file: one TOML file every party of a deployment shares.

::

    ca = "certs/ca.pem"
    label_party = "bank"
    # crl = "certs/crl.pem"      # optional: the CA's revocation list (default: crl.pem beside ca)

    [aggregator]                 # the aggregation server: its own process and certificate
    address = "127.0.0.1:50050"
    cert = "certs/aggregator.pem"
    key = "certs/aggregator.key"

    [party.bank]                 # the label party: its features and the labels
    address = "127.0.0.1:50051"
    cert = "certs/bank.pem"
    key = "certs/bank.key"
    data = "bank.csv"
    labels = "labels.csv"

    [party.shop]                 # a data party
    address = "127.0.0.1:50052"
    cert = "certs/shop.pem"
    key = "certs/shop.key"
    data = "shop.csv"

The label party is party 0 (block 0, as the first ``--party-file`` of an in-process run), the
other parties follow in the file's order. Relative paths are relative to the file. An address is
``HOST:PORT``, the host an IP address (IPv6 in brackets, ``[::1]:50051``) or a DNS host name;
two members may not share one, however written (``localhost`` is the loopback address, an IP
address is compared by its value). Parsing reads and checks the file only: a party opens its own
certificate, key and files (:meth:`Federation.identity`, :meth:`Federation.own_file`), never
another party's, which need not exist on its machine. Every mistake is a ConfigError naming the
file, the key and what was expected and found.

A party loads the CA's certificate revocation list (``secure-vfl certs revoke`` writes it) from
``crl`` where the file names one (then it must be there), else from ``crl.pem`` beside the CA
file where there is one: it refuses to start with its own certificate revoked, and its server
refuses the callers whose certificates the list revokes (:meth:`Federation.identity`). The list
is not part of what every party's copy must agree on (:meth:`Federation.roster`): a new one
reaches each party when it is handed out.

The aggregation server is its own ``[aggregator]`` entry (its own process, address and
certificate) because the threat model (DESIGN section 4) assumes an aggregator that does not
collude with the label party: under Paillier or CKKS the sums are encrypted under the label
party's key, so an aggregator inside the label party's process could decrypt each party's
contribution.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import logging
import tomllib
from pathlib import Path
from typing import Any

from secure_vfl.errors import ConfigError
from secure_vfl.federation.certificates import (
    CRL_FILE,
    TlsIdentity,
    check_party_name,
    covers_host,
    host_problem,
    identity_problems,
    ip_host,
    read_certificate,
    revoked_identity_problems,
)
from secure_vfl.federation.messages import AGGREGATOR
from secure_vfl.io import decimal

logger = logging.getLogger(__name__)

_TOP_KEYS = {"ca", "crl", "label_party", "aggregator", "party"}
_PARTY_KEYS = {"address", "cert", "key", "data", "labels"}
_SERVER_KEYS = {"address", "cert", "key"}


@dataclasses.dataclass(frozen=True)
class Member:
    """One process of the federation: its name, address (``host:port``), certificate and key
    files; a party's ``data`` file and, at the label party, its ``labels`` file."""

    name: str
    address: str
    cert: Path
    key: Path
    data: Path | None = None
    labels: Path | None = None

    @property
    def port(self) -> int:
        """The port of its address."""
        return int(self.address.rsplit(":", 1)[1])

    @property
    def host(self) -> str:
        """The host of its address (an IPv6 address without its brackets)."""
        return self.address.rsplit(":", 1)[0].removeprefix("[").removesuffix("]")

    @property
    def table(self) -> str:
        """Its table in the federation file."""
        return "aggregator" if self.name == AGGREGATOR else f"party.{self.name}"


@dataclasses.dataclass(frozen=True)
class Federation:
    """A parsed federation file: the CA, the label party's name, the aggregation server and
    the parties in order (the label party first); the CA's revocation list where the file
    names one (:meth:`crl_file` also finds one beside the CA)."""

    path: Path
    ca: Path
    label_party: str
    aggregator: Member
    parties: tuple[Member, ...]
    crl: Path | None = None

    @property
    def names(self) -> list[str]:
        """The parties' names in block order (the label party first)."""
        return [party.name for party in self.parties]

    @property
    def members(self) -> tuple[Member, ...]:
        """Every process: the parties, then the aggregation server."""
        return (*self.parties, self.aggregator)

    def member(self, name: str) -> Member:
        """The entry of ``name``; ConfigError naming the file and its members otherwise."""
        for member in self.members:
            if member.name == name:
                return member
        raise ConfigError(
            f"{self.path}: no party named {name!r}; expected one of "
            f"{', '.join(m.name for m in self.members)}."
        )

    def addresses(self, *, but: str) -> dict[str, str]:
        """Every member's address but ``but``'s (the peers of ``but``)."""
        return {m.name: m.address for m in self.members if m.name != but}

    def roster(self) -> dict[str, Any]:
        """What every party's copy of the file must agree on, as JSON: the label party, each
        member's name and address in order, and the SHA-256 of the CA certificate (each party
        opens its own files: their paths may differ)."""
        try:
            ca = hashlib.sha256(self.ca.read_bytes()).hexdigest()
        except OSError as error:
            raise ConfigError(f"{self.path}: ca {self.ca} cannot be read: {error}.") from None
        return {
            "label_party": self.label_party,
            "members": [[member.name, member.address] for member in self.members],
            "ca_sha256": ca,
        }

    def labels(self) -> Path:
        """The label party's labels file (training needs it; an imputation does not);
        ConfigError naming the file's key if it has none (:meth:`own_file` checks the file)."""
        return self._to_train("labels")

    def label_data(self) -> Path:
        """The label party's own data file, as :meth:`labels` its labels file."""
        return self._to_train("data")

    def _to_train(self, key: str) -> Path:
        label = self.member(self.label_party)
        path = label.labels if key == "labels" else label.data
        if path is None:
            raise ConfigError(
                f"{self.path}: [party.{label.name}] key `{key}` expected at the label party to "
                "train. Found none."
            )
        return path

    def crl_file(self) -> Path | None:
        """The CA's revocation list a party loads: the file's ``crl``, else ``crl.pem`` beside
        the ``ca`` file where there is one, else None (nothing revoked)."""
        if self.crl is not None:
            return self.crl
        beside = self.ca.with_name(CRL_FILE)
        return beside if beside.exists() else None

    def identity(self, name: str) -> TlsIdentity:
        """``name``'s TLS identity: the CA, its own certificate and its own key (no other
        party's key is opened) and the CA's revocation list (:meth:`crl_file`; its server reads
        the list again when it changes, or appears beside the CA), checked before
        the party listens or connects: ConfigError naming this file, the party and what is
        wrong unless the certificate is valid now, signed by this file's CA, names the party
        (and no other member) and takes its key, as every peer's handshake needs
        (:func:`~secure_vfl.federation.certificates.identity_problems`), and unless the
        revocation list is the CA's, is not out of date and does not revoke the certificate.
        A certificate whose subject alternative names do not cover the host of the party's
        address is only warned of: peers check the party's name, not the host (gRPC's
        ``ssl_target_name_override``), but standard TLS tools check the host."""
        member = self.member(name)
        where = f"{self.path}: [{member.table}] {name}"
        crl = self.crl_file()
        try:
            identity = TlsIdentity.from_files(self.ca, member.cert, member.key, crl=crl)
        except ConfigError as error:
            raise ConfigError(f"{where} cannot take part: {error}") from None
        names = [m.name for m in self.members]
        files = (self.ca, member.cert, member.key)
        problems = identity_problems(identity, name, files=files, parties=names)
        if problems:
            raise ConfigError(
                f"{where} cannot take part: no peer would complete a TLS handshake with its "
                f"certificate: {' '.join(map(str, problems))} (`secure-vfl certs check` lists "
                "what is wrong with a set of certificates.)"
            )
        if crl is not None:
            revoked = revoked_identity_problems(identity, files=(crl, member.cert))
            if revoked:
                raise ConfigError(f"{where} cannot take part: {' '.join(map(str, revoked))}")
        certificate = read_certificate(identity.certificate, str(member.cert))
        if not covers_host(certificate, member.host):
            logger.warning(
                "%s: %s does not name %s, the host of %s's address, among its subject "
                "alternative names: the federation's peers accept it (they check the name "
                "%s), standard TLS tools do not (`secure-vfl certs init --san %s`).",
                where,
                member.cert,
                member.host,
                name,
                name,
                member.host,
            )
        # A running party reads the list again where it is, or where the CA's first revocation
        # will put it.
        watched = self.crl if self.crl is not None else self.ca.with_name(CRL_FILE)
        return dataclasses.replace(identity, crl_path=watched)

    def own_file(self, name: str, key: str) -> Path:
        """Party ``name``'s own ``key`` file (``data`` or ``labels``), checked before the party
        listens or connects: ConfigError naming this file, the party's table and the key
        unless the entry is there and is a file (a party sees only its own machine's files)."""
        member = self.member(name)
        path = member.data if key == "data" else member.labels
        where = f"{self.path}: [{member.table}] key `{key}`"
        if path is None:
            raise ConfigError(f"{where} expected. Found none.")
        if not path.is_file():
            found = "a directory" if path.is_dir() else "nothing"
            raise ConfigError(f"{where}: a file expected at {path}. Found {found}.")
        return path


def roster_differences(own: dict[str, Any], theirs: dict[str, Any], *, them: str) -> list[str]:
    """How the roster ``theirs`` (party ``them``'s copy of the federation file,
    :meth:`Federation.roster`) differs from ``own``: one phrase each, empty if it does not."""
    found = []
    if theirs["label_party"] != own["label_party"]:
        found.append(f"label party {theirs['label_party']} at {them}, {own['label_party']} here")
    ours, their = dict(map(tuple, own["members"])), dict(map(tuple, theirs["members"]))
    for name in [n for n in their if n not in ours]:
        found.append(f"{name} only at {them}")
    for name in [n for n in ours if n not in their]:
        found.append(f"{name} only here")
    for name in [n for n in their if n in ours and their[n] != ours[n]]:
        found.append(f"{name} at {their[name]} at {them}, at {ours[name]} here")
    order = [n for n in their if n in ours], [n for n in ours if n in their]
    if not found and order[0] != order[1]:
        found.append(f"the parties in the order {', '.join(order[0])} at {them}")
    if theirs["ca_sha256"] != own["ca_sha256"]:
        found.append("another CA certificate")
    return found


def read_federation(path: Path) -> Federation:
    """Parse and check the federation file at ``path`` (ConfigError on any mistake)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"a federation file (TOML) expected at {path}. Found none.")
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a BOM, as Notepad writes
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: TOML expected: {error}") from None
    except RecursionError:  # the parser recurses into nested arrays and tables
        raise ConfigError(f"{path}: TOML expected: nested too deeply to read.") from None
    _known(path, "", document, _TOP_KEYS)
    for key in ("ca", "label_party", "aggregator", "party"):
        if key not in document:
            raise ConfigError(f"{path}: key `{key}` expected at the top level. Found none.")
    ca = _path(path, "ca", document["ca"])
    crl = _path(path, "crl", document["crl"]) if "crl" in document else None
    label_party = _name(path, "label_party", document["label_party"])
    aggregator = _member(
        path, "aggregator", AGGREGATOR, document["aggregator"], _SERVER_KEYS, set()
    )
    tables = document["party"]
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{path}: at least one [party.NAME] table expected. Found {tables!r}.")
    parties = [
        _member(
            path,
            f"party.{name}",
            _name(path, f"party.{name}", name),
            table,
            _PARTY_KEYS,
            # the label party's own data and labels: what training needs, an imputation does not
            {"labels", "data"} if name == label_party else {"labels"},
        )
        for name, table in tables.items()
    ]
    _check_roles(path, label_party, parties)
    _check_distinct(path, [*parties, aggregator])
    label = next(p for p in parties if p.name == label_party)
    ordered = (label, *(p for p in parties if p.name != label_party))
    return Federation(path, ca, label_party, aggregator, ordered, crl)


def _known(path: Path, where: str, table: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        prefix = f"[{where}] " if where else ""
        raise ConfigError(
            f"{path}: {prefix}unknown key(s) {', '.join(unknown)}; expected only "
            f"{', '.join(sorted(allowed))}."
        )


def _name(path: Path, key: str, value: Any) -> str:
    try:
        return check_party_name(value)
    except ConfigError as error:
        raise ConfigError(f"{path}: `{key}`: {error}") from None


def _path(path: Path, key: str, value: Any) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: `{key}` must be a file path (a string). Found {value!r}.")
    if "\0" in value:  # TOML's \u0000, which no file name holds (open() raises ValueError)
        raise ConfigError(
            f"{path}: `{key}` must be a file path, without a NUL character. Found {value!r}."
        )
    given = Path(value)
    return given if given.is_absolute() else path.parent / given


def _address(path: Path, key: str, value: Any) -> str:
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    number = decimal(port, digits=5)
    problem = _host_problem(host) if sep else "it has no `:PORT`"
    if problem is None and (number is None or not 1 <= number <= 65535):
        problem = f"its port {port!r} is not a number in 1..65535"
    if problem is not None:
        raise ConfigError(
            f"{path}: `{key}` must be HOST:PORT, HOST an IP address (IPv6 in brackets) or a DNS "
            f"host name, with a port in 1..65535. Found {value!r}: {problem}."
        )
    return str(value)


def _host_problem(host: str) -> str | None:
    """Why ``host`` (an address's, IPv6 in brackets) is neither an IP address nor a DNS host
    name, or None."""
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        if isinstance(ip_host(inner), ipaddress.IPv6Address):
            return None
        return f"{inner!r} in brackets is not an IPv6 address"
    if ip_host(host) is not None:
        if ":" in host:
            return f"the IPv6 address {host!r} goes in brackets ([{host}]:PORT)"
        return None
    problem = host_problem(host)
    return None if problem is None else f"its host {host!r} is not a host name: {problem}"


def _member(
    path: Path, where: str, name: str, table: Any, allowed: set[str], optional: set[str]
) -> Member:
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{where}] must be a table. Found {table!r}.")
    _known(path, where, table, allowed)
    for key in sorted(allowed - optional):
        if key not in table:
            raise ConfigError(f"{path}: [{where}] key `{key}` expected. Found none.")
    return Member(
        name=name,
        address=_address(path, f"{where}.address", table["address"]),
        cert=_path(path, f"{where}.cert", table["cert"]),
        key=_path(path, f"{where}.key", table["key"]),
        data=_path(path, f"{where}.data", table["data"]) if "data" in table else None,
        labels=_path(path, f"{where}.labels", table["labels"]) if "labels" in table else None,
    )


def _check_roles(path: Path, label_party: str, parties: list[Member]) -> None:
    names = [p.name for p in parties]
    if label_party not in names:
        raise ConfigError(
            f"{path}: `label_party` must name a [party.NAME] table. Found {label_party!r}, "
            f"parties {', '.join(names)}."
        )
    if AGGREGATOR in names:
        raise ConfigError(
            f"{path}: [party.{AGGREGATOR}]: the name {AGGREGATOR!r} is the aggregation "
            "server's ([aggregator]); expected another party name."
        )
    if len(parties) < 2:
        raise ConfigError(
            f"{path}: the label party and at least one data party expected. Found {names}."
        )
    for party in parties:
        if party.name != label_party and party.labels is not None:
            raise ConfigError(
                f"{path}: [party.{party.name}].labels: labels belong to the label party "
                f"{label_party!r} only. Found {party.labels}."
            )


def _check_distinct(path: Path, members: list[Member]) -> None:
    """ConfigError naming both members if two share an address, however each is written; an
    unspecified host (``0.0.0.0``, ``::``) binds every address of its machine, so it shares its
    port with every member."""
    seen: dict[tuple[str, int], Member] = {}
    for member in members:
        everywhere = _binds_every_address(member)
        for place in _places(member):
            other = seen.setdefault(place, member)
            if other is member:
                other = next(
                    (
                        m
                        for (_, port), m in seen.items()
                        if port == member.port and (everywhere or _binds_every_address(m))
                    ),
                    member,
                )
            if other is not member:
                same = "" if other.address == member.address else f" and {member.address}"
                wildcard = everywhere or _binds_every_address(other)
                raise ConfigError(
                    f"{path}: every party needs its own address; {other.name} and {member.name} "
                    f"both have {other.address}{same} (one host and port"
                    f"{'; 0.0.0.0 and :: stand for every address' if wildcard else ''})."
                )


def _binds_every_address(member: Member) -> bool:
    """Whether ``member``'s host is the unspecified address (0.0.0.0 or ::)."""
    address = ip_host(member.host.lower())
    return address is not None and address.is_unspecified


def _places(member: Member) -> set[tuple[str, int]]:
    """The (host, port) pairs ``member``'s address stands for, each host written one way: an IP
    address by its value (an IPv4-mapped IPv6 address as the IPv4 one), a name in lower case,
    ``localhost`` as the loopback addresses it binds."""
    host = member.host.lower()
    if host == "localhost":
        return {("127.0.0.1", member.port), ("::1", member.port)}
    address = ip_host(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return {(str(address) if address is not None else host, member.port)}
