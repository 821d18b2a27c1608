"""What gRPC alone costs a deployed LASER step's messages, and the least deployed/in-process
ratio that leaves on this machine.

One LASER training step's messages (Satellite, 4 parties, batch 128, ``--heads active``, plain
sums: the configuration of ``deploy_costs.py``), recorded once, are carried from a client to a
server process on 127.0.0.1 under mutual TLS, one after the other, each a full round trip, by
three transports:

- ``endpoint``: secure-vfl's :class:`~secure_vfl.federation.network.PartyEndpoint` (encode,
  numbering, decode, the sender and replay checks, the hand-off to the party's thread, which
  drops the message);
- ``grpc unary``: gRPC alone, the same encoded bytes as one unary call each (the endpoint's
  call, with its two metadata entries), answered at once by a handler that keeps nothing: what
  any secure-vfl built on gRPC's Python unary calls pays at the least;
- ``grpc stream``: gRPC alone over one long-lived bidirectional stream, a reply per message:
  no per-call set-up, the cheapest way gRPC's Python API carries a message and waits for it.

Each is timed (wall) and its CPU counted in both processes, as the kernel counts it (every
thread). A step cannot take less wall time than its CPU over the machine's cores, so the CPU of
the in-process step plus the transport's CPU for the step's messages, over the cores, against
the in-process step, is the least the deployed/in-process ratio can be here, however the
messages overlap and whatever else the parties do. Medians of repeats.

    python benchmarks/grpc_floor.py            # the committed configuration
    python benchmarks/grpc_floor.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from _shared import RESULTS, PortServer, command_line, output_directory, quick_marked, write_outputs
from grpc_costs import _readdressed, record_step_messages, serve_dropping

TRANSPORTS = ("endpoint", "grpc unary", "grpc stream")
SERVICE = "secure_vfl_floor.Floor"
TARGET = 1.5


def _credentials(certs: Path, name: str) -> tuple[bytes, bytes, bytes]:
    return tuple(  # type: ignore[return-value]
        (certs / file).read_bytes() for file in ("ca.pem", f"{name}.key", f"{name}.pem")
    )


def serve(transport: str, certs: Path) -> int:
    """The server process: ``transport``'s receiving side; prints its port, serves until a line
    arrives on stdin."""
    import grpc

    from secure_vfl.federation.certificates import TlsIdentity
    from secure_vfl.federation.network import PartyEndpoint

    if transport == "endpoint":
        identity = TlsIdentity.from_files(
            certs / "ca.pem", certs / "server.pem", certs / "server.key"
        )
        with PartyEndpoint("server", identity=identity) as endpoint:
            return serve_dropping(endpoint)

    def unary(data: bytes, context: Any) -> bytes:
        return b""

    def stream(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for _ in requests:
            yield b""

    handlers = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(8), handlers=(handlers,))
    ca, key, certificate = _credentials(certs, "server")
    credentials = grpc.ssl_server_credentials(
        [(key, certificate)], root_certificates=ca, require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    print(f"PORT {port}", flush=True)
    sys.stdin.readline()
    server.stop(0.5)
    return 0


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _sender(transport: str, certs: Path, address: str) -> tuple[Callable[[Any], None], Any]:
    """A function that carries one message to the server and waits for its answer, and what
    to close afterwards."""
    import grpc

    from secure_vfl.federation import wire
    from secure_vfl.federation.certificates import TlsIdentity
    from secure_vfl.federation.network import PartyEndpoint

    if transport == "endpoint":
        identity = TlsIdentity.from_files(
            certs / "ca.pem", certs / "client.pem", certs / "client.key"
        )
        endpoint = PartyEndpoint("client", identity=identity)
        endpoint.add_peer("server", address)

        def send_delivered(message: Any) -> None:
            endpoint.send(message)

        return send_delivered, endpoint
    ca, key, certificate = _credentials(certs, "client")
    channel = grpc.secure_channel(
        address,
        grpc.ssl_channel_credentials(ca, key, certificate),
        options=[("grpc.ssl_target_name_override", "server")],
    )
    if transport == "grpc unary":
        call = channel.unary_unary(f"/{SERVICE}/Unary")
        numbers = iter(range(1, 1 << 62))

        def send_unary(message: Any) -> None:
            metadata = (("stream", "0" * 32), ("sequence", str(next(numbers))))
            call(wire.encode(message), timeout=30, metadata=metadata)

        return send_unary, channel
    requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def outgoing() -> Iterator[bytes]:
        while (data := requests.get()) is not None:
            yield data

    replies = channel.stream_stream(f"/{SERVICE}/Stream")(outgoing(), timeout=3600)

    def send_streamed(message: Any) -> None:
        requests.put(wire.encode(message))
        next(replies)

    class _Closing:
        def close(self) -> None:
            requests.put(None)
            channel.close()

    return send_streamed, _Closing()


def carry(certs: Path, steps: list[list[Any]], repeats: int) -> list[dict[str, Any]]:
    """Wall and CPU (both processes) per step of carrying ``steps``' messages by each
    transport, medians over ``repeats``; within a repeat the transports take turns, each
    repeat in another order, so that a slow spell of the machine falls on all of them."""
    servers = {
        transport: PortServer(
            [sys.executable, __file__, "--serve", transport, "--certs", str(certs)],
            what=f"{transport} server",
        )
        for transport in TRANSPORTS
    }
    senders: dict[str, Callable[[Any], None]] = {}
    closing = []
    try:
        for transport, server in servers.items():
            send, closable = _sender(transport, certs, server.address)
            senders[transport] = send
            closing.append(closable)
            for message in steps[0]:  # warm-up: the connection, the caches
                send(message)
        walls: dict[str, list[float]] = {transport: [] for transport in TRANSPORTS}
        clients: dict[str, list[float]] = {transport: [] for transport in TRANSPORTS}
        others: dict[str, list[float]] = {transport: [] for transport in TRANSPORTS}
        for repeat in range(repeats):
            turn = repeat % len(TRANSPORTS)
            for transport in [*TRANSPORTS[turn:], *TRANSPORTS[:turn]]:
                send, server = senders[transport], servers[transport]
                wall, own, other = time.perf_counter(), _own_cpu_seconds(), server.cpu_seconds()
                for step in steps:
                    for message in step:
                        send(message)
                walls[transport].append((time.perf_counter() - wall) / len(steps))
                clients[transport].append((_own_cpu_seconds() - own) / len(steps))
                others[transport].append((server.cpu_seconds() - other) / len(steps))
    finally:
        for closable in closing:
            closable.close()
        for server in servers.values():
            server.stop()
    return [
        {
            "transport": transport,
            "wall_ms": 1000 * statistics.median(walls[transport]),
            "client_cpu_ms": 1000 * statistics.median(clients[transport]),
            "server_cpu_ms": 1000 * statistics.median(others[transport]),
        }
        for transport in TRANSPORTS
    ]


def in_process_step_ms(steps: int, repeats: int) -> float:
    """The same configuration's training step in one process (``wire_costs.py``'s measure)."""
    from wire_costs import measure

    return float(measure("active", steps=steps, repeats=repeats)["step_ms"])


def measure_all(*, steps: int, repeats: int, directory: Path) -> dict[str, Any]:
    from protocols.tls import make_federation
    from secure_vfl.federation import wire

    certs = directory / "certs"
    make_federation(certs, ["client", "server"])
    recorded = [_readdressed(step) for step in record_step_messages("active", steps)]
    rows = carry(certs, recorded, repeats)
    in_process = in_process_step_ms(100, repeats)
    cores = os.cpu_count() or 1
    for row in rows:
        row["cpu_ms"] = row["client_cpu_ms"] + row["server_cpu_ms"]
        row["least_ratio"] = (in_process + row["cpu_ms"]) / cores / in_process
        row["cores_for_target"] = (in_process + row["cpu_ms"]) / (TARGET * in_process)
    return {
        "steps": steps,
        "repeats": repeats,
        "cores": cores,
        "messages_per_step": statistics.mean(len(step) for step in recorded),
        "bytes_per_step": statistics.mean(
            sum(len(wire.encode(m)) for m in step) for step in recorded
        ),
        "in_process_step_ms": in_process,
        "rows": rows,
    }


def render(result: dict[str, Any], command: str) -> str:
    messages = result["messages_per_step"]
    lines = [
        "# What gRPC alone costs a deployed LASER step's messages",
        "",
        f"Command: `{command}`",
        "",
        f"One LASER training step's messages (Satellite, 4 parties, batch 128, `--heads active`, "
        f"plain sums: {messages:g} messages, {result['bytes_per_step'] / 1024:.1f} KiB a step, "
        f"{result['steps']} recorded steps) carried from a client to a server process on "
        "127.0.0.1 under mutual TLS, one after the other, each a full round trip. `endpoint` is "
        "secure-vfl's party endpoint; `grpc unary` and `grpc stream` are gRPC alone carrying "
        "the same encoded bytes, answered at once by a handler that keeps nothing (one unary "
        "call per message, or one long-lived bidirectional stream). CPU is both processes' "
        "(every thread, as the kernel counts it).",
        "",
        "| transport | wall per step (ms) | client CPU (ms) | server CPU (ms) | CPU per step "
        "(ms) | CPU per message (ms) | least deployed / in-process here | cores for 1.5x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['transport']} | {row['wall_ms']:.1f} | {row['client_cpu_ms']:.1f} | "
            f"{row['server_cpu_ms']:.1f} | {row['cpu_ms']:.1f} | {row['cpu_ms'] / messages:.2f} "
            f"| {row['least_ratio']:.2f}x | {row['cores_for_target']:.1f} |"
        )
    lines += [
        "",
        f"The in-process step, same configuration, same run: {result['in_process_step_ms']:.1f} "
        f"ms (one process, one core: its CPU is its wall time). A deployed step's processes "
        f"need at least that CPU plus the transport's for the step's messages; over this "
        f"machine's {result['cores']} cores that is the `least deployed / in-process here` "
        "column, however the messages overlap and however little else the parties do. "
        "`cores for 1.5x`: the cores that CPU would need, all busy all the time, for the "
        "issue's target.",
        "",
        f"Medians of {result['repeats']} repeats; in each repeat the transports took turns, "
        "each repeat in another order. The machine is shared with other work, so absolute "
        "times are noisy.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (fewer steps)")
    parser.add_argument("--serve", choices=TRANSPORTS, help=argparse.SUPPRESS)
    parser.add_argument("--certs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=output_directory, default=RESULTS, help="output directory")
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.certs)
    steps, repeats = (5, 3) if args.quick else (20, 9)
    with tempfile.TemporaryDirectory() as directory:
        result = measure_all(steps=steps, repeats=repeats, directory=Path(directory))
    command = command_line("grpc_floor.py", argv)
    text = render(result, command)
    text = quick_marked(text, args.quick)
    stem = "grpc_floor_quick" if args.quick else "grpc_floor"  # never over the committed result
    write_outputs(args.out, stem, text, {"command": command, **result})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
