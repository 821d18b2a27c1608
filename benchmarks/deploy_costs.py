"""What a deployed LASER run costs against the same run in one process (issue "Deployment").

Satellite (the packaged dataset, train and test rows together, 6435 rows) is written as four
party files, as a user would have them: the label party ``bank`` (9 columns and the labels) and
the data parties ``shop``, ``insurer`` and ``telco`` (9 columns each). The same LASER run
(``--heads active``, seed 0) is then run from the command line three ways, each with plaintext
sums and with ``--secure-agg masks``:

- ``in-process``: ``secure-vfl train --party-file ... --label-file ...``, one process;
- ``grpc+mtls``: a deployment on 127.0.0.1, every party its own process (``party serve`` for the
  three data parties and the aggregation server, ``train --federation`` for the label party),
  over gRPC with mutual TLS;
- ``grpc``: the same deployment with ``--insecure`` (plaintext gRPC).

Reported, medians over the repeats (the configurations take turns within each repeat, so a
burst of load on the shared machine hits all of them alike): epoch time, ``wall_time_s`` from
``result.json`` divided by the epochs; bytes on the wire, ``result.json``'s traffic (every
party's training bytes, the data parties' reported to the label party); and the ratios
deployed / in-process and mTLS / plaintext gRPC. Every process is started with its pid recorded
and killed by it in a ``finally``; ports are free ones picked at run time, on 127.0.0.1 only.

    python benchmarks/deploy_costs.py            # the committed configuration
    python benchmarks/deploy_costs.py --quick    # a smoke run: 1 epoch, 1 repeat, no output

On a machine without the packaged dataset (or the ``cryptography`` package), write the party
files and certificates where it is installed and run on the other machine from that copy:

    python benchmarks/deploy_costs.py --write-site SITE      # here: files and certificates
    python benchmarks/deploy_costs.py --site SITE --stem deploy_costs_NAME   # there
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _shared import (
    RESULTS,
    Processes,
    child_env,
    command_line,
    medians_of,
    output_directory,
    quick_marked,
    verdict,
    write_outputs,
)

from secure_vfl.cli import positive_int
from secure_vfl.io import counted

PARTIES = ("bank", "shop", "insurer", "telco")  # the label party first
PROCESSES = len(PARTIES) + 1  # a deployment: every party and the aggregation server
MODES = ("in-process", "grpc+mtls", "grpc")
SUMS = ("plain", "masks")
METHOD_FLAGS = ("--method", "laser", "--heads", "active", "--seed", "0", "--quiet")
TARGET_DEPLOYED = 1.5  # deployed (mTLS) epoch time at most this times the in-process one
TARGET_MTLS = 1.25  # mTLS epoch time at most this times plaintext gRPC's
RUN_SECONDS = 900.0
GRPC_COSTS = RESULTS / "grpc_costs.json"


def write_site(directory: Path) -> None:
    """The four parties' files of Satellite, the labels, and every party's certificate."""
    import numpy as np
    import pandas as pd

    from protocols.tls import make_federation
    from secure_vfl.data.datasets import load_dataset

    split = load_dataset("satellite", rng=np.random.default_rng(0))
    features = np.concatenate([split.train.x, split.test.x])
    labels = np.concatenate([split.train.y, split.test.y])
    ids = [f"s{i:05d}" for i in range(len(labels))]
    names = split.feature_names
    assert names is not None, "the packaged Satellite names its columns"
    blocks = np.array_split(np.arange(features.shape[1]), len(PARTIES))
    for name, columns in zip(PARTIES, blocks, strict=True):
        frame = pd.DataFrame(features[:, columns], columns=[names[c] for c in columns])
        frame.insert(0, "id", ids)
        frame.to_csv(directory / f"{name}.csv", index=False)
    pd.DataFrame({"id": ids, "label": labels}).to_csv(directory / "labels.csv", index=False)
    make_federation(directory / "certs", [*PARTIES, "aggregator"])


def add_site_arguments(parser: argparse.ArgumentParser, stem: str) -> None:
    """``--stem``, ``--write-site`` and ``--site``: results under another name, and the party
    files made on one machine and run on another (one without the dataset's package)."""
    parser.add_argument("--stem", default=stem, help="the results' file names: STEM.md, STEM.json")
    parser.add_argument(
        "--write-site",
        type=Path,
        metavar="DIR",
        help="write the party files and certificates to DIR (a new directory) and stop",
    )
    parser.add_argument(
        "--site",
        type=Path,
        metavar="DIR",
        help="run on a copy of the party files and certificates that --write-site wrote to DIR",
    )


def wrote_site_only(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Write the site if ``--write-site`` asks (then the script stops); check ``--site``'s."""
    if args.write_site is not None:
        try:
            args.write_site.mkdir(parents=True, exist_ok=False)
        except OSError as error:
            found = "it exists" if args.write_site.exists() else error.strerror or str(error)
            parser.error(f"--write-site {args.write_site}: a new directory expected; {found}.")
        write_site(args.write_site)
        print(f"wrote the party files and certificates to {args.write_site}")
        return True
    if args.site is not None:
        wanted = [f"{name}.csv" for name in PARTIES] + ["labels.csv", "certs/ca.pem"]
        missing = [name for name in wanted if not (args.site / name).is_file()]
        if missing:
            parser.error(f"--site {args.site}: expected what --write-site writes; no {missing}")
    return False


def make_site(args: argparse.Namespace, scratch: Path) -> Path:
    """The runs' directory under ``scratch``: a copy of ``--site``, or the files written anew."""
    site = scratch / "site"
    if args.site is not None:
        shutil.copytree(args.site, site)
        for key in (site / "certs").glob("*.key"):
            key.chmod(0o600)  # a copy across machines may lose the keys' mode
    else:
        site.mkdir()
        write_site(site)
    return site


def write_federation(directory: Path) -> Path:
    """A federation file for the four parties and the aggregator on free loopback ports."""
    from secure_vfl.federation.network import free_loopback_ports

    ports = free_loopback_ports(len(PARTIES) + 1)
    lines = ['ca = "certs/ca.pem"', f'label_party = "{PARTIES[0]}"', "", "[aggregator]"]
    lines += [f'address = "127.0.0.1:{ports[-1]}"']
    lines += ['cert = "certs/aggregator.pem"', 'key = "certs/aggregator.key"']
    for name, port in zip(PARTIES, ports, strict=False):
        lines += ["", f"[party.{name}]", f'address = "127.0.0.1:{port}"']
        lines += [f'cert = "certs/{name}.pem"', f'key = "certs/{name}.key"']
        lines += [f'data = "{name}.csv"']
        if name == PARTIES[0]:
            lines += ['labels = "labels.csv"']
    path = directory / "federation.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _svfl(*args: str) -> list[str]:
    """The `secure-vfl` command line, run by this interpreter on this checkout."""
    return [sys.executable, "-m", "secure_vfl", *args]


def _run_flags(sums: str, epochs: int) -> list[str]:
    secure = ["--secure-agg", "masks"] if sums == "masks" else []
    return [*METHOD_FLAGS, "--epochs", str(epochs), *secure]


def _finished(process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    """Wait for ``process``; a failure is an error quoting the end of its log."""
    try:
        code = process.wait(timeout=RUN_SECONDS)
    except subprocess.TimeoutExpired:
        code = None
    if code != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{what} ended with {code} (expected 0); its log ends:\n{tail}")


def run_once(site: Path, mode: str, sums: str, epochs: int, out: Path) -> dict[str, Any]:
    """One run of ``mode`` with ``sums``: its result.json and the label party's command time."""
    # One torch thread per process, in every mode (the in-process run too): five processes with
    # a torch thread per core each oversubscribe a small machine.
    env = child_env(GRPC_VERBOSITY="NONE")
    flags = [*_run_flags(sums, epochs), "--out", str(out)]
    with Processes(cwd=site, env=env) as processes:
        if mode == "in-process":
            files = [arg for name in PARTIES for arg in ("--party-file", f"{name}.csv")]
            command = _svfl("train", *files, "--label-file", "labels.csv", *flags)
            servers = []
        else:
            federation = write_federation(site)
            insecure = ["--insecure"] if mode == "grpc" else []
            servers = [
                (
                    name,
                    processes.start(
                        _svfl("party", "serve", "--federation", str(federation), "--name", name)
                        + insecure,
                        log=out.parent / f"{out.name}-{name}.log",
                    ),
                )
                for name in (*PARTIES[1:], "aggregator")
            ]
            label = ["--federation", str(federation), "--name", PARTIES[0], *insecure]
            command = _svfl("train", *label, *flags)
        log = out.parent / f"{out.name}-{PARTIES[0]}.log"
        start = time.perf_counter()
        _finished(processes.start(command, log=log), log, f"{mode} {sums}: the label party")
        command_seconds = time.perf_counter() - start
        for name, server in servers:
            _finished(server, out.parent / f"{out.name}-{name}.log", f"{mode} {sums}: {name}")
    result = json.loads((out / "result.json").read_text())
    traffic = result["traffic"]
    steps = int(traffic["train_steps"])
    train_bytes = sum(int(phases.get("train", 0)) for phases in traffic["bytes"].values())
    return {
        "mode": mode,
        "sums": sums,
        "epochs": epochs,
        "epoch_seconds": result["wall_time_s"] / epochs,
        "command_seconds": command_seconds,
        "train_steps": steps,
        "train_bytes": train_bytes,
        "bytes_per_step": train_bytes / max(steps, 1),
        "bytes_by_party": {party: phases for party, phases in traffic["bytes"].items()},
        "metrics": result["metrics"],
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (sums, mode), with the ratios against in-process and against plaintext gRPC,
    and whether every repeat gave exactly the in-process metrics."""
    rows = []
    for sums in SUMS:
        medians: dict[str, dict[str, Any]] = {}
        for mode in MODES:
            mine = [r for r in runs if r["sums"] == sums and r["mode"] == mode]
            if not mine:
                continue
            medians[mode] = {
                "sums": sums,
                "mode": mode,
                "repeats": len(mine),
                "epoch_seconds": statistics.median(r["epoch_seconds"] for r in mine),
                "command_seconds": statistics.median(r["command_seconds"] for r in mine),
                "steps_per_epoch": mine[0]["train_steps"] / mine[0]["epochs"],
                "train_bytes_per_epoch": statistics.median(r["train_bytes"] for r in mine)
                / mine[0]["epochs"],
                "bytes_per_step": statistics.median(r["bytes_per_step"] for r in mine),
                "epoch_seconds_all": [r["epoch_seconds"] for r in mine],
            }
        alone = [r for r in runs if r["sums"] == sums and r["mode"] == "in-process"]
        for mode, row in medians.items():
            row["vs_in_process"] = row["epoch_seconds"] / medians["in-process"]["epoch_seconds"]
            if "grpc" in medians:
                row["vs_grpc"] = row["epoch_seconds"] / medians["grpc"]["epoch_seconds"]
            mine = [r for r in runs if r["sums"] == sums and r["mode"] == mode]
            row["same_metrics"] = all(r["metrics"] == alone[0]["metrics"] for r in mine)
            rows.append(row)
    return rows


def transport_figures() -> dict[str, float] | None:
    """The committed ``grpc_costs.json`` figures for ``--heads active``: messages per step and
    the time per message (one round trip) over plaintext gRPC and over mTLS."""
    if not GRPC_COSTS.exists():
        return None
    rows = json.loads(GRPC_COSTS.read_text())["rows"]
    (active,) = [row for row in rows if row["heads"] == "active"]
    messages = float(active["messages_per_step"])
    step = active["step_seconds"]
    return {
        "messages_per_step": messages,
        "grpc_round_trip_s": step["grpc"] / messages,
        "mtls_round_trip_s": step["grpc+mtls"] / messages,
        "in_process_message_s": step["in-process"] / messages,
    }


def verdicts(rows: list[dict[str, Any]]) -> list[tuple[str, str, float, float]]:
    """(target, sums, measured ratio, limit) for both targets and both sums."""
    found = []
    for row in rows:
        if row["mode"] == "grpc+mtls":
            found.append(
                ("deployed (mTLS) / in-process", row["sums"], row["vs_in_process"], TARGET_DEPLOYED)
            )
            if "vs_grpc" in row:
                found.append(("mTLS / plaintext gRPC", row["sums"], row["vs_grpc"], TARGET_MTLS))
    return found


def machine() -> str:
    """The machine's cores, processor and the versions a timing depends on, in one line."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def _analysis(rows: list[dict[str, Any]], figures: dict[str, float] | None) -> list[str]:
    """Where a deployed epoch's time goes: the round trips per step against the extra time."""
    if figures is None:
        return ["(`results/grpc_costs.json` is missing: no per-round-trip figures to compare.)"]
    messages = figures["messages_per_step"]
    lines = [
        "## Why: round trips per step",
        "",
        f"Over the network every delivery is one gRPC call that returns once the receiver "
        f"has acted on it. A LASER `--heads active` step on Satellite is {messages:.0f} "
        f"messages (`grpc_costs.md`, plaintext sums). The label party sends them at once "
        f"(`Party.send_all`), each party's in one delivery: to each data party the previous "
        f"step's closing gradient, held back until then, with its representation request "
        f"(and under masks its seal request), to the aggregator its own representation with "
        f"the sum request. The aggregator serves the sum once the last representation is in, "
        f"after answering it (`Party.send_after`), so the data parties' calls return while "
        f"the label party's head trains on the sum: a step waits once, plain or masks, in 8 "
        f"calls (12 and twice, three times under masks, before deliveries carried several "
        f"messages; the answers waited for the head until the sum went after them). "
        f"`grpc_costs.md` measured a round trip at "
        f"{1000 * figures['grpc_round_trip_s']:.2f} ms (plaintext gRPC) and "
        f"{1000 * figures['mtls_round_trip_s']:.2f} ms (mTLS) on loopback against "
        f"{1000 * figures['in_process_message_s']:.3f} ms in one process.",
        "",
        "| sums | steps/epoch | in-process step (ms) | mTLS step (ms) | extra per step (ms) "
        "| every message a round trip in turn, predicted (ms) | extra per message (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for sums in SUMS:
        by_mode = {r["mode"]: r for r in rows if r["sums"] == sums}
        if "grpc+mtls" not in by_mode:
            continue
        steps = by_mode["in-process"]["steps_per_epoch"]
        alone = by_mode["in-process"]["epoch_seconds"] / steps
        deployed = by_mode["grpc+mtls"]["epoch_seconds"] / steps
        predicted = messages * (figures["mtls_round_trip_s"] - figures["in_process_message_s"])
        lines.append(
            f"| {sums} | {steps:.0f} | {1000 * alone:.1f} | {1000 * deployed:.1f} | "
            f"{1000 * (deployed - alone):.1f} | {1000 * predicted:.1f} | "
            f"{1000 * (deployed - alone) / messages:.2f} |"
        )
    lines += [
        "",
        "The predicted column is the transport alone as if every message waited for the one "
        "before (`grpc_costs.py`'s round trip on the machine of `grpc_costs.md`, nothing else "
        "running); with a step's requests in flight together the transport's own share is "
        "smaller than that.",
    ]
    cores = os.cpu_count() or 1
    if cores < PROCESSES:
        lines[-1] += (
            f" So most of the extra time is what {PROCESSES} processes on this machine's "
            f"{cores} cores add: each message waits for the receiving process to be scheduled and "
            "its handler to run while the others compete for the same cores (on their own "
            "machines, as in a real deployment, the parties would not). Their CPU is most of "
            "what the cores can give (`deploy_cpu.md`), so what would close more of it is "
            "mostly less CPU per message (a long-lived stream per peer instead of a call per "
            "delivery: `grpc_floor.md`) rather than more overlap."
        )
    else:
        lines[-1] += (
            f" This machine has a core for each of the {PROCESSES} processes, as a deployment "
            "with a machine per party has, so the processes do not wait for one another's "
            "cores: the extra time is the transport's own, its latency on a step's critical path "
            "(the label party's requests, the data parties' answers to the aggregator, its sum "
            "to the label party) and the CPU each message costs its receiver "
            "(`grpc_floor.md`); this run does not tell the two apart."
        )
    return lines


def _table(
    rows: list[dict[str, Any]],
    argv: Sequence[str] | None,
    load: tuple[tuple[float, float, float], tuple[float, float, float]],
    epochs: int,
    *,
    quick: bool,
) -> str:
    """The report of a run of ``epochs`` epochs (``quick``: a --quick smoke run's, whose
    verdicts say so)."""
    names = {"in-process": "in-process", "grpc+mtls": "gRPC + mTLS", "grpc": "gRPC (insecure)"}
    lines = [
        "# A deployed LASER run against the same run in one process",
        "",
        f"Command: `{command_line('deploy_costs.py', argv)}`",
        "",
        "Satellite (6435 rows; the label party `bank` with 9 columns and the labels, three data "
        "parties with 9 columns each; 20 % of the rows held out for testing), LASER "
        f"`--heads active`, batch 128, seed 0, {counted(epochs, 'epoch')}, every run from the "
        "command line. "
        "The deployments are on 127.0.0.1: three `party serve` processes, the aggregation "
        "server and the label party's `train --federation`. Every process, the in-process run's "
        "too, runs one torch thread (`OMP_NUM_THREADS=1`).",
        "",
        "Epoch time is `wall_time_s` from `result.json` divided by the epochs: it counts building "
        "the label party's side of the method, every training step and the evaluation on both "
        "test sets (p_miss 0 and 0.5), but not the process start, the alignment, the "
        "deployment's set-up messages or torch's one-off import of what its optimisers need, "
        "about a second, made before the clock starts (counted until 2026-11-28, it made every "
        "epoch of both runs about 0.3 s longer). The whole label-party command, all of that "
        "included, is the `command (s)` column. Bytes are `result.json`'s traffic: the "
        "training bytes every party (and the aggregation server) put on the wire.",
        "",
        "| sums | run | epoch (s) | command (s) | MiB/epoch | KiB/step | vs in-process "
        "| vs gRPC (insecure) | same metrics as in-process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['sums']} | {names[row['mode']]} | {row['epoch_seconds']:.2f} | "
            f"{row['command_seconds']:.1f} | {row['train_bytes_per_epoch'] / 2**20:.1f} | "
            f"{row['bytes_per_step'] / 1024:.1f} | {row['vs_in_process']:.2f}x | "
            + (f"{row['vs_grpc']:.2f}x" if "vs_grpc" in row else "-")
            + f" | {'yes' if row['same_metrics'] else 'NO'} |"
        )
    found = verdicts(rows)
    lines += ["", "## Targets", "", "| target | sums | measured | limit | verdict |"]
    lines += ["|---|---|---|---|---|"]
    for target, sums, ratio, limit in found:
        said = verdict(ratio <= limit, quick)
        lines.append(f"| {target} | {sums} | {ratio:.2f}x | {limit:.2f}x | {said} |")
    repeats = min(row["repeats"] for row in rows)
    lines += [
        "",
        f"{medians_of(repeats)}; within each repeat the six configurations ran one after "
        f"the other. The machine: {machine()}. Its load "
        f"average (1, 5, 15 minutes) {load[0][0]:.1f}, {load[0][1]:.1f}, {load[0][2]:.1f} at "
        f"the start and {load[1][0]:.1f}, {load[1][1]:.1f}, {load[1][2]:.1f} at the end, so "
        "absolute times are noisy; the ratios are taken within this one run of the script.",
        "",
    ]
    if any(ratio > limit for _, _, ratio, limit in found):
        lines += _analysis(rows, transport_figures())
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=positive_int, default=3, help="training epochs per run")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 epoch x 1 repeat, no output")
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    add_site_arguments(parser, "deploy_costs")
    args = parser.parse_args(argv)
    if wrote_site_only(parser, args):
        return 0
    epochs, repeats = (1, 1) if args.quick else (args.epochs, args.repeats)
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        site = make_site(args, Path(scratch))
        for repeat in range(repeats):
            for sums in SUMS:
                for mode in MODES:
                    out = site / f"{mode}-{sums}-{repeat}"
                    run = run_once(site, mode, sums, epochs, out)
                    print(
                        f"repeat {repeat} {sums:5s} {mode:10s} epoch {run['epoch_seconds']:.2f} s"
                        f", {run['bytes_per_step'] / 1024:.1f} KiB/step",
                        flush=True,
                    )
                    runs.append({**run, "repeat": repeat})
    rows = summarise(runs)
    text = _table(rows, argv, (load_before, os.getloadavg()), epochs, quick=args.quick)
    text = quick_marked(text, args.quick)
    print(text)
    if not args.quick:
        write_outputs(args.out, args.stem, text, {"rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
