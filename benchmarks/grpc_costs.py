"""What carrying a LASER step's messages over loopback gRPC costs, against the in-process transport.

The messages are those of real LASER training steps on Satellite with 4 parties (batch 128, both
head settings, as ``wire_costs.py``), recorded once, re-addressed from a ``client`` party to a
``server`` party in another process. Three transports carry them:

- ``in-process``: encode + decode in this process (:class:`~secure_vfl.federation.channel.
  InProcessTransport`), what every in-process run pays per message;
- ``grpc``: plaintext gRPC on 127.0.0.1 (``insecure=True``);
- ``grpc+mtls``: gRPC with mutual TLS (P-256 certificates from ``protocols.tls``).

Over gRPC a send is a full round trip: it returns once the server process has decoded the message
and acted on it (the endpoint's synchronous delivery). Reported: the round-trip time per message
kind at its size in a step, the time to carry one whole step's messages (one after the other, as
the label party's driving does) and the resulting throughput; medians of repeats.

    python benchmarks/grpc_costs.py            # the committed configuration
    python benchmarks/grpc_costs.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import select
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from _shared import RESULTS, PortServer, command_line, output_directory, quick_marked, write_outputs

from secure_vfl.cli import positive_int

TRANSPORTS = ("in-process", "grpc", "grpc+mtls")


def record_step_messages(heads: str, steps: int) -> list[list[Any]]:
    """The messages that crossed parties in ``steps`` LASER training steps, step by step."""
    import numpy as np
    import torch

    from secure_vfl.experiment import TrainConfig, build_method, prepare_data
    from secure_vfl.federation.channel import Channel, RecordingLayer
    from secure_vfl.methods import MethodConfig

    torch.set_num_threads(1)
    config = TrainConfig(
        method="laser",
        dataset="satellite",
        parties=4,
        train_missing="mcar:0.1",
        test_missing=("mcar:0",),
        seed=0,
        method_config=MethodConfig(heads=cast(Any, heads)),
    )
    data = prepare_data(config)
    recorder = RecordingLayer()
    method = build_method(config, data, channel=Channel([recorder]))
    batches = list(method.sampler.epoch(np.random.default_rng(0)))
    method.train_step(batches[0], 0, 0)  # warm-up, not recorded
    recorded = []
    for step in range(1, steps + 1):
        recorder.messages.clear()
        method.train_step(batches[step % len(batches)], step, 0)
        recorded.append(list(recorder.messages))
    return recorded


def _readdressed(messages: list[Any]) -> list[Any]:
    return [dataclasses.replace(m, sender="client", receiver="server") for m in messages]


def serve(spec_path: str) -> int:
    """The server process: an endpoint that acts on each message by dropping it."""
    from secure_vfl.federation.certificates import TlsIdentity
    from secure_vfl.federation.network import PartyEndpoint

    spec = json.loads(Path(spec_path).read_text())
    identity = None
    if spec["certs"]:
        certs = Path(spec["certs"])
        identity = TlsIdentity.from_files(
            certs / "ca.pem", certs / "server.pem", certs / "server.key"
        )
    with PartyEndpoint("server", identity=identity, insecure=identity is None) as endpoint:
        return serve_dropping(endpoint)


def serve_dropping(endpoint: Any) -> int:
    """Print the endpoint's port, then act on each message by dropping it until a line
    arrives on stdin."""
    endpoint.handler = lambda message: None
    print(f"PORT {endpoint.port}", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        try:
            endpoint.act_on_next(0.2)
        except Exception:  # nothing arrived: look at stdin again
            continue
    return 0


def _server(certs: Path | None, directory: Path) -> PortServer:
    """A server process (started here, stopped by its pid)."""
    spec = directory / "server.json"
    spec.write_text(json.dumps({"certs": str(certs) if certs else ""}))
    return PortServer([sys.executable, __file__, "--serve", str(spec)])


def _median_seconds(run: Callable[[], object], count: int, repeats: int) -> float:
    """Median over ``repeats`` of the seconds per call of ``run`` over ``count`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            run()
        times.append((time.perf_counter() - start) / count)
    return statistics.median(times)


def _senders(directory: Path, certs: Path) -> dict[str, tuple[Callable[[Any], object], Any]]:
    """For each transport, a function that carries one message, and what to stop afterwards."""
    from secure_vfl.federation.certificates import TlsIdentity
    from secure_vfl.federation.channel import InProcessTransport
    from secure_vfl.federation.network import PartyEndpoint

    senders: dict[str, tuple[Callable[[Any], object], Any]] = {}
    local = InProcessTransport()
    senders["in-process"] = (local.deliver, None)
    for name, tls in (("grpc", False), ("grpc+mtls", True)):
        server = _server(certs if tls else None, directory)
        identity = (
            TlsIdentity.from_files(certs / "ca.pem", certs / "client.pem", certs / "client.key")
            if tls
            else None
        )
        client = PartyEndpoint("client", identity=identity, insecure=not tls)
        client.add_peer("server", server.address)
        senders[name] = (client.send, (client, server))
    return senders


def measure(heads: str, *, steps: int, repeats: int, directory: Path) -> dict[str, Any]:
    """Round-trip time per message kind and time per step for each transport."""
    from protocols.tls import make_federation
    from secure_vfl.federation import wire

    recorded = [_readdressed(step) for step in record_step_messages(heads, steps)]
    certs = directory / f"certs-{heads}"
    make_federation(certs, ["client", "server"])
    senders = _senders(directory, certs)
    try:
        by_kind: dict[str, Any] = {}
        for message in recorded[0]:
            by_kind.setdefault(message.kind, message)
        kinds = []
        for kind, message in by_kind.items():
            row: dict[str, Any] = {"kind": kind, "bytes": len(wire.encode(message))}
            for name, (send, _) in senders.items():
                send(message)  # warm-up: connection, caches
                row[name] = _median_seconds(functools.partial(send, message), 20, repeats)
            kinds.append(row)
        per_step: dict[str, float] = {}
        for name, (send, _) in senders.items():

            def carry_steps(send: Callable[[Any], object] = send) -> None:
                for step in recorded:
                    for message in step:
                        send(message)

            carry_steps()  # warm-up
            per_step[name] = _median_seconds(carry_steps, 1, repeats) / len(recorded)
    finally:
        for _, stoppable in senders.values():
            if stoppable is not None:
                client, server = stoppable
                client.close()
                server.stop()
    step_bytes = statistics.mean(sum(len(wire.encode(m)) for m in step) for step in recorded)
    return {
        "heads": heads,
        "steps": steps,
        "repeats": repeats,
        "messages_per_step": statistics.mean(len(step) for step in recorded),
        "bytes_per_step": step_bytes,
        "kinds": kinds,
        "step_seconds": per_step,
    }


def _table(
    rows: list[dict[str, Any]], argv: Sequence[str] | None, load: tuple[float, float]
) -> str:
    lines = [
        "# Carrying a LASER step's messages: in-process vs loopback gRPC vs gRPC + mutual TLS",
        "",
        f"Command: `{command_line('grpc_costs.py', argv)}`",
        "",
        "Satellite, 4 parties, batch 128, one step's messages replayed from one process to a",
        "server process on 127.0.0.1; a gRPC send returns once the server has decoded the",
        "message and acted on it (a full round trip).",
        "",
        "## One step's messages, one after the other",
        "",
        "| heads | messages/step | KiB/step | in-process (ms) | gRPC (ms) | gRPC + mTLS (ms) "
        "| mTLS / plaintext | gRPC + mTLS throughput |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        step = row["step_seconds"]
        throughput = row["bytes_per_step"] / step["grpc+mtls"] / 2**20
        lines.append(
            f"| {row['heads']} | {row['messages_per_step']:.0f} | "
            f"{row['bytes_per_step'] / 1024:.1f} | {1000 * step['in-process']:.2f} | "
            f"{1000 * step['grpc']:.2f} | {1000 * step['grpc+mtls']:.2f} | "
            f"{step['grpc+mtls'] / step['grpc']:.2f}x | {throughput:.0f} MiB/s |"
        )
    lines += [
        "",
        "## Round trip per message kind (its size in a step)",
        "",
        "| heads | kind | bytes | in-process (ms) | gRPC (ms) | gRPC + mTLS (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        for kind in row["kinds"]:
            lines.append(
                f"| {row['heads']} | {kind['kind']} | {kind['bytes']} | "
                f"{1000 * kind['in-process']:.3f} | {1000 * kind['grpc']:.3f} | "
                f"{1000 * kind['grpc+mtls']:.3f} |"
            )
    repeats, steps = rows[0]["repeats"], rows[0]["steps"]
    lines += [
        "",
        f"Medians of {repeats} repeats (per kind: 20 sends each; per step: {steps} recorded "
        f"steps each). The machine ({os.cpu_count()} cores) was shared with other work "
        f"(1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end), so "
        "absolute times are noisy and small differences (mTLS against plaintext) are within "
        "the noise. This measures the transport alone: the label party's step time in a "
        "federation adds the parties' compute on top (see `wire_costs.md` for a step's "
        "in-process time).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=10, help="recorded steps per repeat")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 steps x 2 repeats, no output")
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    parser.add_argument("--serve", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    steps, repeats = (2, 2) if args.quick else (args.steps, args.repeats)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        rows = [
            measure(heads, steps=steps, repeats=repeats, directory=Path(scratch))
            for heads in ("all", "active")
        ]
    text = _table(rows, argv, (load_before, os.getloadavg()[0]))
    text = quick_marked(text, args.quick)
    print(text)
    if not args.quick:
        write_outputs(args.out, "grpc_costs", text, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
