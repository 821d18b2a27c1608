"""One party in its own process, for the network tests (run by tests/test_network.py).

    python tests/network_peer.py SPEC.json

SPEC (JSON): ``name``; ``certs`` (a directory from ``certs init``: ``ca.pem``, ``NAME.pem``,
``NAME.key``, and ``crl.pem`` if there is one, the CA's revocation list, read again when it
changes) or ``insecure: true``; optionally ``members`` (the only parties that may call it);
``program`` and its settings; ``result`` (where to write the outcome). The process starts its
endpoint on a free loopback port and prints ``PORT <n>``, reads its peers' addresses as one JSON
line on stdin, runs its program, writes ``result`` atomically, then keeps serving until stdin
says ``stop`` (or closes) so that no peer loses it mid-delivery.

Programs:
- ``exchange``: send every message of the capture file ``send`` (each to the receiver it names),
  then receive ``expect`` messages, appended as capture records to ``received``.
- ``listen``: receive until a message arrives (``deadline`` seconds each time, ``total`` in
  all), noting every refusal it learns of on the way; the message goes to ``received``.
- ``psi-requester`` / ``psi-responder``: one DH-PSI session between the two over a
  :class:`~secure_vfl.federation.network.NetworkChannel`, fixed keys and shuffle seeds.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from secure_vfl.errors import SecureVFLError
from secure_vfl.federation import wire
from secure_vfl.federation.certificates import TlsIdentity
from secure_vfl.federation.channel import CAPTURE_LENGTH, read_capture
from secure_vfl.federation.network import NetworkChannel, PartyEndpoint, RetryPolicy
from secure_vfl.io import atomic_write_json


def _endpoint(spec: dict[str, Any]) -> PartyEndpoint:
    name = spec["name"]
    identity = None
    if not spec.get("insecure"):
        certs = Path(spec["certs"])
        crl = certs / "crl.pem"
        identity = dataclasses.replace(
            TlsIdentity.from_files(
                certs / "ca.pem",
                certs / f"{name}.pem",
                certs / f"{name}.key",
                crl=crl if crl.exists() else None,
            ),
            crl_path=crl,  # read again when it changes, as a deployed party's
        )
    return PartyEndpoint(
        name,
        identity=identity,
        insecure=bool(spec.get("insecure")),
        deadline=float(spec.get("deadline", 30.0)),
        retry=RetryPolicy(attempts=3, first_backoff=0.05, max_backoff=0.2),
        members=spec.get("members"),
    )


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as handle:
        handle.write(CAPTURE_LENGTH.pack(len(data)) + data)


def exchange(endpoint: PartyEndpoint, spec: dict[str, Any], result: dict[str, Any]) -> None:
    sizes = [endpoint.send(message) for message in read_capture(Path(spec["send"]))]
    result["sent_sizes"] = sizes
    for _ in range(int(spec["expect"])):
        _append(Path(spec["received"]), wire.encode(endpoint.receive()))


def listen(endpoint: PartyEndpoint, spec: dict[str, Any], result: dict[str, Any]) -> None:
    refusals: list[str] = []
    result["refusals"] = refusals
    end = time.monotonic() + float(spec["total"])
    while time.monotonic() < end:
        try:
            message = endpoint.receive(float(spec["deadline"]))
        except SecureVFLError as error:
            refusals.append(f"{type(error).__name__}: {error}")
            continue
        _append(Path(spec["received"]), wire.encode(message))
        result["refused"] = list(endpoint.refused)  # what its server refused on the way
        return


def psi(endpoint: PartyEndpoint, spec: dict[str, Any], result: dict[str, Any]) -> None:
    from protocols.psi import PsiRequester, PsiResponder

    requester_rng, responder_rng = np.random.default_rng(spec["seed"]).spawn(2)
    channel = NetworkChannel(endpoint)
    ids = [str(i) for i in spec["ids"]]
    options = {"workers": int(spec.get("workers", 1)), "chunk_size": int(spec["chunk_size"])}
    if spec["program"] == "psi-requester":
        requester = PsiRequester(ids, name=endpoint.name, rng=requester_rng, **options)
        requester.connect(channel)
        outcome = requester.intersect(
            spec["peer"], session_id=spec["session"], key=bytes.fromhex(spec["key"])
        )
        assert outcome.indices is not None
        result["size"], result["peer_size"] = outcome.size, outcome.peer_size
        result["indices"] = outcome.indices.tolist()
        sample_of = np.full(len(ids), -1, dtype=np.int64)
        sample_of[outcome.indices] = np.arange(outcome.indices.size, dtype=np.int64)
        requester.send_matches(spec["peer"], sample_of, int(outcome.indices.size))
        result["sent_bytes"] = sum(endpoint.bytes.values())
        return
    responder = PsiResponder(ids, name=endpoint.name, rng=responder_rng, **options)
    responder.connect(channel)
    responder.accept(spec["peer"], session_id=spec["session"], key=bytes.fromhex(spec["key"]))
    while True:  # serve until the requester's matches have arrived
        endpoint.act_on_next(awaiting=f"message of {spec['peer']}'s PSI session")
        try:
            rows = responder.aligned_rows(spec["peer"])
        except SecureVFLError:
            continue
        result["rows"] = rows.tolist()
        result["sent_bytes"] = sum(endpoint.bytes.values())
        return


PROGRAMS = {
    "exchange": exchange,
    "listen": listen,
    "psi-requester": psi,
    "psi-responder": psi,
}


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    with _endpoint(spec) as endpoint:
        print(f"PORT {endpoint.port}", flush=True)
        for name, address in json.loads(sys.stdin.readline()).items():
            endpoint.add_peer(name, address)
        result: dict[str, Any] = {}
        try:
            PROGRAMS[spec["program"]](endpoint, spec, result)
            result["ok"] = True
        except SecureVFLError as error:
            result["error"] = f"{type(error).__name__}: {error}"
        atomic_write_json(Path(spec["result"]), result)
        sys.stdin.readline()  # "stop", or EOF when the test ends
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
