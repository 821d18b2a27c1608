"""What a deployed party refuses before it listens or connects (its own certificate, files and
directories), and what the federation file refuses when it is read (malformed hosts, one address
written two ways). In process, on loopback: a party refused at start-up never binds a port, and
a test that would wait for peers (without these checks) is bounded by a short --wait.
"""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from test_deploy import PARTIES, write_federation, write_party_files

from protocols import tls
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError
from secure_vfl.federation import certificates, federation_file
from secure_vfl.federation.certificates import covers_host
from secure_vfl.federation.federation_file import read_federation
from secure_vfl.federation.network import free_loopback_ports

WAIT = "30"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Party files, this federation's certificates (certs/) and another CA's (other/)."""
    directory = tmp_path_factory.mktemp("inputs")
    write_party_files(directory)
    tls.make_federation(directory / "certs", [*PARTIES, "aggregator"])
    tls.make_federation(directory / "other", ["bank", "shop", "aggregator"])
    return directory


def _federation(site: Path, directory: Path, **changes: str) -> Path:
    """A federation file in ``directory`` (data and labels at ``site``), with ``changes``."""
    directory.mkdir(exist_ok=True)
    files = {f'"{name}.csv"': f'"{site}/{name}.csv"' for name in PARTIES}
    return write_federation(
        directory,
        site / "certs",
        free_loopback_ports(5),
        **files,
        **{'"labels.csv"': f'"{site}/labels.csv"'},
        **changes,
    )


def _swap(site: Path, name: str, *suffixes: str) -> dict[str, str]:
    """Changes that point ``name``'s files with ``suffixes`` at the other CA's."""
    return {f"{site}/certs/{name}.{s}": f"{site}/other/{name}.{s}" for s in suffixes}


def _refused(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``argv``; assert it is refused (exit 2) and never served; its stderr (whose text
    each test checks: a refusal at start-up, not a peer given up after the --wait)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "serving at" not in out, out
    return err


def _serve(federation: Path, name: str, *extra: str) -> list[str]:
    return [
        "party",
        "serve",
        "--federation",
        str(federation),
        "--name",
        name,
        "--wait",
        WAIT,
        *extra,
    ]


def _train(federation: Path, out: Path) -> list[str]:
    return [
        *("train", "--federation", str(federation), "--name", "bank", "--method", "laser"),
        *("--wait", WAIT, "--deadline", "5", "--quiet", "--out", str(out)),
    ]


# -- 1. a party's own certificate, checked against its federation's CA --------------------------


def _expired(site: Path, directory: Path) -> dict[str, str]:
    """Changes giving shop an expired certificate from this federation's CA."""
    ca = x509.load_pem_x509_certificate((site / "certs" / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((site / "certs" / "ca.key").read_bytes(), None)
    key = serialization.load_pem_private_key((site / "certs" / "shop.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3)
    old = tls.party_certificate("shop", key, ca, ca_key, not_before=start, days=1)
    directory.mkdir(exist_ok=True)
    (directory / "shop.pem").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    return {f"{site}/certs/shop.pem": f"{directory}/shop.pem"}


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("another CA's certificate and key", "not signed by this federation's CA"),
        ("another CA's ca.pem", "not signed by this federation's CA"),
        ("an expired certificate", "expired on"),
        ("insurer's certificate and key", "common name 'shop' expected, found ['insurer']"),
    ],
)
def test_a_served_party_refuses_a_certificate_no_peer_accepts_before_it_listens(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, said: str
) -> None:
    if case == "another CA's certificate and key":
        changes = _swap(site, "shop", "pem", "key")
    elif case == "another CA's ca.pem":
        changes = {f'ca = "{site}/certs/ca.pem"': f'ca = "{site}/other/ca.pem"'}
    elif case == "an expired certificate":
        changes = _expired(site, tmp_path / "old")
    else:
        changes = {f"{site}/certs/shop.{s}": f"{site}/certs/insurer.{s}" for s in ("pem", "key")}
    federation = _federation(site, tmp_path / "fed", **changes)
    err = _refused(_serve(federation, "shop"), capsys)
    assert f"{federation}: [party.shop] shop cannot take part" in err, err
    assert said in err, err


def test_the_aggregation_server_refuses_another_cas_certificate(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    federation = _federation(site, tmp_path / "fed", **_swap(site, "aggregator", "pem", "key"))
    err = _refused(_serve(federation, "aggregator"), capsys)
    assert f"{federation}: [aggregator] aggregator cannot take part" in err, err


def test_the_label_party_refuses_its_own_certificate_before_it_connects(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    federation = _federation(site, tmp_path / "fed", **_swap(site, "bank", "pem", "key"))
    err = _refused(_train(federation, tmp_path / "out"), capsys)
    assert f"{federation}: [party.bank] bank cannot take part" in err, err
    assert "not signed by this federation's CA" in err, err


def test_a_certificate_that_does_not_name_the_host_of_its_address_is_warned_of_not_refused(
    site: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Peers check a party's name, not its host (gRPC's target name override): a handshake
    completes, so the party takes part; standard TLS tools would not accept it, so it is told."""
    path = _federation(site, tmp_path / "fed")
    text = path.read_text()
    port = read_federation(path).member("shop").port
    path.write_text(text.replace(f"127.0.0.1:{port}", f"127.0.0.2:{port}"))
    federation = read_federation(path)
    with caplog.at_level(logging.WARNING):
        assert federation.identity("shop").name == "shop"
    assert "does not name 127.0.0.2, the host of shop's address" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        federation.identity("bank")
    assert not caplog.text


def test_the_loopback_names_cover_each_other_and_nothing_else(tmp_path: Path) -> None:
    def certificate(*hosts: str) -> x509.Certificate:
        directory = tmp_path / "-".join(hosts).replace(":", "_")
        tls.make_federation(directory, ["shop"], hosts=hosts)
        return x509.load_pem_x509_certificate((directory / "shop.pem").read_bytes())

    by_ip, by_name = certificate("127.0.0.1"), certificate("localhost")
    six, named = certificate("::1"), certificate("shop.example.org", "10.0.0.2")
    assert covers_host(by_ip, "127.0.0.1") and covers_host(by_ip, "localhost")
    assert covers_host(by_name, "127.0.0.1") and covers_host(by_name, "::1")
    assert covers_host(six, "localhost") and covers_host(six, "::1")
    assert covers_host(named, "SHOP.example.org") and covers_host(named, "10.0.0.2")
    assert not covers_host(by_ip, "10.0.0.2") and not covers_host(named, "127.0.0.1")
    assert not covers_host(named, "localhost") and not covers_host(named, "example.org")
    assert not covers_host(by_name, "127.0.0.2")  # localhost does not resolve to it


# -- 3. one address written two ways --------------------------------------------------------------


@pytest.mark.parametrize(
    ("bank", "shop"),
    [
        ("127.0.0.1", "localhost"),
        ("[::1]", "LocalHost"),
        ("127.0.0.1", "[::ffff:127.0.0.1]"),
        ("[::1]", "[0:0:0:0:0:0:0:1]"),
        ("shop.example.org", "SHOP.Example.org"),
        # an unspecified address binds every address of its machine (it was accepted)
        ("0.0.0.0", "127.0.0.1"),
        ("127.0.0.1", "0.0.0.0"),
        ("[::]", "localhost"),
        ("10.0.0.2", "[::]"),
    ],
)
def test_one_address_written_two_ways_is_refused_naming_both_parties(
    tmp_path: Path, bank: str, shop: str
) -> None:
    port = free_loopback_ports(1)[0]
    path = _two_addresses(tmp_path, f"{bank}:{port}", f"{shop}:{port}")
    with pytest.raises(ConfigError) as caught:
        read_federation(path)
    said = str(caught.value)
    assert said.startswith(f"{path}: every party needs its own address; bank and shop both have")
    assert f"{bank}:{port}" in said and f"{shop}:{port}" in said


@pytest.mark.parametrize(
    ("bank", "shop"),
    [("127.0.0.1", "127.0.0.2"), ("127.0.0.1", "[::1]"), ("localhost", "10.0.0.2")],
)
def test_different_hosts_on_one_port_are_accepted(tmp_path: Path, bank: str, shop: str) -> None:
    port = free_loopback_ports(1)[0]
    federation = read_federation(_two_addresses(tmp_path, f"{bank}:{port}", f"{shop}:{port}"))
    assert federation.member("shop").address == f"{shop}:{port}"


def _two_addresses(directory: Path, bank: str, shop: str) -> Path:
    ports = free_loopback_ports(5)
    path = write_federation(directory, directory, ports)
    text = path.read_text()
    text = text.replace(f'"127.0.0.1:{ports[0]}"', f'"{bank}"')
    path.write_text(text.replace(f'"127.0.0.1:{ports[1]}"', f'"{shop}"'))
    return path


# -- 4. malformed hosts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ("bad host!:51152", "its host 'bad host!' is not a host name"),
        ("http://127.0.0.1:51152", "its host 'http://127.0.0.1' is not a host name"),
        ("127.000.0.1:51152", "a host name's last label is not all digits"),
        ("::1:51152", "the IPv6 address '::1' goes in brackets"),
        ("[127.0.0.1]:51152", "'127.0.0.1' in brackets is not an IPv6 address"),
        ("[shop]:51152", "'shop' in brackets is not an IPv6 address"),
        (":51152", "it is empty"),
        ("shop.example.org", "it has no `:PORT`"),
        ("shop.example.org:0", "its port '0' is not a number in 1..65535"),
    ],
)
def test_a_malformed_address_is_refused_when_the_file_is_read(
    tmp_path: Path, address: str, said: str
) -> None:
    ports = free_loopback_ports(5)
    path = write_federation(
        tmp_path, tmp_path, ports, **{f'"127.0.0.1:{ports[1]}"': f'"{address}"'}
    )
    with pytest.raises(ConfigError) as caught:
        read_federation(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: `party.shop.address` must be HOST:PORT, HOST an IP")
    assert f"Found {address!r}: " in message and said in message, message


@pytest.mark.parametrize("host", ["[::1]", "shop.example.org", "10.0.0.2", "localhost"])
def test_ip_addresses_and_host_names_are_accepted(tmp_path: Path, host: str) -> None:
    ports = free_loopback_ports(5)
    path = write_federation(
        tmp_path, tmp_path, ports, **{f'"127.0.0.1:{ports[1]}"': f'"{host}:{ports[1]}"'}
    )
    member = read_federation(path).member("shop")
    assert member.host == host.strip("[]") and member.port == ports[1]


def test_a_federation_file_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """Notepad's UTF-8 starts with a BOM: it was refused as "Invalid statement (at line 1,
    column 1)", while party files and JSON with one were read."""
    path = write_federation(tmp_path, tmp_path, free_loopback_ports(5))
    plain = read_federation(path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert read_federation(path) == plain


@pytest.mark.parametrize(("line", "key"), [("ca = ", "ca"), ("cert = ", "aggregator.cert")])
def test_a_path_with_a_nul_character_is_refused_when_the_file_is_read(
    tmp_path: Path, line: str, key: str
) -> None:
    """TOML lets a string hold U+0000, which no file name can: `ca = "c\\u0000a.pem"` was read,
    then the roster's SHA-256 of the CA (which `--insecure` reaches without opening it first)
    failed with a bare "ValueError: embedded null byte"."""
    path = write_federation(tmp_path, tmp_path, free_loopback_ports(5))
    text = path.read_text()
    old = next(row for row in text.splitlines() if row.startswith(line))
    path.write_text(text.replace(old, old.replace('.pem"', '\\u0000.pem"'), 1))
    with pytest.raises(ConfigError) as caught:
        read_federation(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: `{key}` must be a file path"), message
    assert "without a NUL character" in message and "\\x00.pem" in message, message


def test_certificates_and_addresses_check_hosts_by_one_rule() -> None:
    assert tls.host_problem is certificates.host_problem is federation_file.host_problem


# -- 5. the label party's and a data party's own files ----------------------------------------


@pytest.mark.parametrize(("key", "file"), [("labels", "labels.csv"), ("data", "bank.csv")])
def test_the_label_party_checks_its_own_files_before_any_contact(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, file: str
) -> None:
    missing = tmp_path / "nope.csv"
    old = f'{key} = "{site}/{file}"'
    federation = _federation(site, tmp_path / "fed", **{old: f'{key} = "{missing}"'})
    err = _refused(_train(federation, tmp_path / "out"), capsys)
    said = f"{federation}: [party.bank] key `{key}`: a file expected at {missing}. Found nothing."
    assert said in err, err


def test_the_label_party_reads_its_label_file_before_any_contact(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A label file of garbage was read only once the peers had answered: with them not up,
    the run said only that they could not be reached."""
    garbage = tmp_path / "labels.csv"
    garbage.write_text("id,label\nc1\n")
    old = f'labels = "{site}/labels.csv"'
    federation = _federation(site, tmp_path / "fed", **{old: f'labels = "{garbage}"'})
    err = _refused(_train(federation, tmp_path / "out"), capsys)
    assert f"{garbage}: line 2 has 1 field; expected 2" in err, err


def test_a_labels_entry_naming_a_directory_is_refused(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = f'labels = "{site}/labels.csv"'
    federation = _federation(site, tmp_path / "fed", **{old: f'labels = "{tmp_path}"'})
    err = _refused(_train(federation, tmp_path / "out"), capsys)
    assert f"[party.bank] key `labels`: a file expected at {tmp_path}. Found a directory." in err


def test_a_served_party_checks_its_own_data_file_before_it_listens(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "gone.csv"
    old = f'data = "{site}/shop.csv"'
    federation = _federation(site, tmp_path / "fed", **{old: f'data = "{missing}"'})
    err = _refused(_serve(federation, "shop"), capsys)
    assert f"{federation}: [party.shop] key `data`: a file expected at {missing}" in err, err
    # Another party's missing file is not this party's business: insurer's is not checked.
    other = _federation(site, tmp_path / "fed2", **{f'data = "{site}/insurer.csv"': 'data = "x"'})
    assert read_federation(other).own_file("shop", "data") == site / "shop.csv"


# -- 6. a served party's directories ---------------------------------------------------------------


@pytest.mark.parametrize("option", ["--model-dir", "--checkpoint-dir", "--imputed-dir"])
@pytest.mark.parametrize("under", [False, True])
def test_a_served_party_refuses_a_directory_option_naming_a_file_before_it_listens(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, under: bool
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    given = a_file / "sub" if under else a_file
    federation = _federation(site, tmp_path / "fed")
    err = _refused([*_serve(federation, "shop"), option, str(given)], capsys)
    where = f"lies under {a_file}," if under else "is"
    assert f"{option} {given} {where} a file; a directory, or a path where one can" in err, err


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (
            {"imputed_dir": Path("imputed")},
            "writes no imputed table: serve it without --imputed-dir",
        ),
        ({"psi_only": True}, "holds no ids to align: serve it without --align psi"),
    ],
)
def test_the_aggregation_server_refuses_a_data_partys_option_before_it_listens(
    tmp_path: Path, option: dict[str, Any], said: str
) -> None:
    """`party serve --name aggregator` took --imputed-dir and --align psi and ignored them (it
    writes no table and aligns nothing), where it refuses --model-dir, --checkpoint-dir and
    --data. Its certificates are missing here: before the fix it was refused for those."""
    from secure_vfl.deployment import serve

    federation = read_federation(write_federation(tmp_path, tmp_path / "none", [1, 2, 3, 4, 5]))
    with pytest.raises(ConfigError, match=f"^the aggregation server {re.escape(said)}"):
        serve(
            federation,
            "aggregator",
            secure_sums=lambda scheme: None,
            deadline=1.0,
            wait=1.0,
            **option,
        )


def test_directories_that_exist_or_can_be_made_are_accepted(tmp_path: Path) -> None:
    from secure_vfl.io import check_directory

    (tmp_path / "there").mkdir()
    for given in (tmp_path / "there", tmp_path / "new" / "deeper", Path("relative-new")):
        check_directory("--model-dir", given)
