"""A deployment on loopback: every party its own process running the command line, over gRPC
with mutual TLS, against the in-process run on the same files and seed. No mock of gRPC; every
process started here is stopped by its pid when the test ends, passed or failed. The processes
are forked warm (tests/warm_start.py) but for those a test starts with a fault injected at
interpreter start, which start cold (``python -m secure_vfl``), as the example script's do.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sklearn.datasets import load_breast_cancer
from warm_start import WarmProcess

from protocols import tls
from secure_vfl.checkpoints import read_checkpoint, written_steps
from secure_vfl.cli import main
from secure_vfl.data.party_files import read_party_file
from secure_vfl.deployment import _row_mapping, fit_served_preprocessing
from secure_vfl.errors import ConfigError, ProtocolError
from secure_vfl.federation import network, wire
from secure_vfl.federation.certificates import TlsIdentity
from secure_vfl.federation.channel import read_capture
from secure_vfl.federation.federation_file import read_federation
from secure_vfl.federation.messages import DeploymentMessage, Message
from secure_vfl.federation.network import NetworkChannel, PartyEndpoint, free_loopback_ports

pytestmark = pytest.mark.processes  # party processes, loopback endpoints, deadlines

ROOT = Path(__file__).resolve().parents[1]
PARTIES = ("bank", "shop", "insurer", "telco")  # the label party first
PROCESS_SECONDS = 120.0
FLAGS = ["--epochs", "2", "--batch-size", "64", "--representation-dim", "8", "--quiet"]


def flags_for(flags: Sequence[str]) -> list[str]:
    """FLAGS and then ``flags``, less --representation-dim where ``flags`` name a FALSE-VFL
    method (its latent sizes are its own: train refuses the flag with it)."""
    latent = any(flag.startswith("false-vfl") for flag in flags)
    common = FLAGS[:4] + FLAGS[6:] if latent else FLAGS
    return [*common, *flags]


def write_party_files(directory: Path, *, rows: int = 240) -> None:
    """Four parties' files of breast-cancer columns (the label party's with the labels), each
    missing a few ids, in its own row order."""
    bunch = load_breast_cancer(as_frame=True)
    features, target = bunch.data.iloc[:rows], bunch.target.to_numpy()[:rows]
    ids = np.array([f"p{i:04d}" for i in range(rows)])
    rng = np.random.default_rng(0)
    for k, (name, columns) in enumerate(
        zip(PARTIES, np.array_split(np.array(features.columns), 4), strict=True)
    ):
        frame = features[list(columns)].copy()
        frame.insert(0, "id", ids)
        kept = np.sort(rng.choice(rows, size=rows - 5 * k, replace=False))
        frame.iloc[rng.permutation(kept)].to_csv(directory / f"{name}.csv", index=False)
    pd.DataFrame({"id": ids, "label": target}).to_csv(directory / "labels.csv", index=False)


def write_federation(directory: Path, certs: Path, ports: list[int], **changes: str) -> Path:
    """A federation file for the parties and the aggregator on loopback; ``changes`` replace
    whole lines (by their key) for the refusal tests."""
    lines = [f'ca = "{certs}/ca.pem"', 'label_party = "bank"', "[aggregator]"]
    lines += [f'address = "127.0.0.1:{ports[-1]}"', f'cert = "{certs}/aggregator.pem"']
    lines += [f'key = "{certs}/aggregator.key"']
    for name, port in zip(PARTIES, ports, strict=False):
        lines += [f"[party.{name}]", f'address = "127.0.0.1:{port}"']
        lines += [f'cert = "{certs}/{name}.pem"', f'key = "{certs}/{name}.key"']
        lines += [f'data = "{name}.csv"']
        if name == "bank":
            lines += ['labels = "labels.csv"']
    text = "\n".join(lines) + "\n"
    for old, new in changes.items():
        text = text.replace(old, new)
    path = directory / "federation.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deploy")
    write_party_files(directory)
    tls.make_federation(directory / "certs", [*PARTIES, "aggregator"])
    return directory


PartyProcess = subprocess.Popen[str] | WarmProcess  # started cold, or forked warm


class Processes:
    """Party processes of one test, each stopped by its pid at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[PartyProcess] = []

    def start(self, *args: str, log: str, before: Sequence[Path] = ()) -> PartyProcess:
        """``secure-vfl ARGS`` logged to ``log``, forked warm (tests/warm_start.py); ``before``:
        directories a fresh interpreter looks in first (a test's fault injection, as a
        ``sitecustomize``), which only a cold start honours."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*before, ROOT]))}
        if not before:
            warm = WarmProcess(args, self.directory, env, self.directory / log)
            self.started.append(warm)
            return warm
        with (self.directory / log).open("w") as output:
            process = subprocess.Popen(
                [sys.executable, "-m", "secure_vfl", *args],
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=self.directory,
            )
        self.started.append(process)
        return process

    def serve(self, federation: Path, name: str, *extra: str) -> PartyProcess:
        return self.start(
            "party", "serve", "--federation", str(federation), "--name", name, *extra, log=name
        )

    def log(self, name: str) -> str:
        return (self.directory / name).read_text()

    def stop_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def in_process(site: Path, out: Path, *flags: str) -> dict[str, Any]:
    files = [arg for name in PARTIES for arg in ("--party-file", str(site / f"{name}.csv"))]
    labels = ["--label-file", str(site / "labels.csv")]
    code = main(["train", *files, *labels, *flags_for(flags), "--out", str(out)])
    assert code == 0
    return dict(json.loads((out / "result.json").read_text()))


def deploy(
    site: Path, processes: Processes, out: Path, *flags: str
) -> tuple[int, list[PartyProcess]]:
    """Every data party and the aggregator served from ``site``, and the label party's `train`
    with ``flags`` into ``out``: its exit status, and the servers."""
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    servers = [processes.serve(federation, name) for name in (*PARTIES[1:], "aggregator")]
    label = processes.start(
        "train",
        "--federation",
        str(federation),
        "--name",
        "bank",
        *flags_for(flags),
        "--out",
        str(out),
        log="bank",
    )
    return label.wait(timeout=PROCESS_SECONDS), servers


def deployed(
    site: Path, processes: Processes, out: Path, *flags: str
) -> tuple[dict[str, Any], list[int]]:
    code, servers = deploy(site, processes, out, *flags)
    assert code == 0, processes.log("bank")
    codes = [server.wait(timeout=PROCESS_SECONDS) for server in servers]
    return dict(json.loads((out / "result.json").read_text())), codes


@pytest.mark.parametrize(
    "flags",
    [
        ("--method", "laser", "--heads", "all"),
        ("--method", "laser", "--heads", "active", "--secure-agg", "masks"),
        # Paillier split at the boundary: the label party alone holds the private key, each
        # data party encrypts with the public key it was sent; exact fixed-point sums.
        ("--method", "laser", "--heads", "active", "--secure-agg", "paillier", "--epochs", "1"),
        # CKKS is approximate (randomised encryption, errors near 2^-30 per slot): equal up to
        # those errors, which the float32 additions after it almost always absorb.
        ("--method", "laser", "--heads", "active", "--secure-agg", "ckks", "--epochs", "1"),
        # FALSE-VFL-II: its data parties' encoders, decoders and missingness models built in
        # their own processes; stage 1 on every training row, 100 of them labelled.
        ("--method", "false-vfl-2", "--labeled", "100", "--kappa", "3"),
    ],
    ids=[
        "plaintext-heads-all",
        "masks-heads-active",
        "paillier-heads-active",
        "ckks-heads-active",
        "false-vfl-2-plaintext",
    ],
)
def test_four_processes_train_to_exactly_the_in_process_metrics(
    site: Path, processes: Processes, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    alone = in_process(site, tmp_path / "alone", *flags)
    result, codes = deployed(site, processes, tmp_path / "deployed", *flags)
    assert codes == [0, 0, 0, 0], [processes.log(n) for n in (*PARTIES[1:], "aggregator")]
    assert result["samples"] == alone["samples"]
    if "ckks" in flags:
        assert result["epoch_loss"] == pytest.approx(alone["epoch_loss"], rel=1e-5)
        one = 100 / min(n for split, n in alone["samples"].items() if split != "train")
        for split, metrics in alone["metrics"].items():  # at most one prediction apart
            assert result["metrics"][split]["accuracy"] == pytest.approx(
                metrics["accuracy"], abs=one + 1e-9
            )
    else:
        assert result["metrics"] == alone["metrics"]
        assert result["epoch_loss"] == alone["epoch_loss"]
    assert result["faults"] == alone["faults"] == []  # one schema, with or without faults
    # Every party's bytes are counted; the data parties' reports reach the label party.
    assert set(result["traffic"]["bytes"]) == {*PARTIES, "aggregator"}
    assert result["parties"] == {name: name for name in PARTIES}  # `runs list` names them


def test_each_party_captures_what_crossed_its_own_endpoint(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    """`--capture` in a deployment: each party records the messages it sent and received, the
    in-process capture's records, nothing of what passed between the others."""
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    captures = {name: tmp_path / f"{name}.capture" for name in ("bank", "shop", "aggregator")}
    servers = []
    for name in (*PARTIES[1:], "aggregator"):
        capture = ["--capture", str(captures[name])] if name in captures else []
        servers.append(processes.serve(federation, name, *capture))
    out = tmp_path / "deployed"
    label = processes.start(
        "train", "--federation", str(federation), "--name", "bank", *FLAGS,
        "--method", "laser", "--heads", "active", "--secure-agg", "masks",
        "--capture", str(captures["bank"]), "--out", str(out), log="bank",
    )  # fmt: skip
    assert label.wait(timeout=PROCESS_SECONDS) == 0, processes.log("bank")
    assert [server.wait(timeout=PROCESS_SECONDS) for server in servers] == [0, 0, 0, 0]
    result = json.loads((out / "result.json").read_text())
    seen = {name: list(read_capture(path)) for name, path in captures.items()}
    for name, messages in seen.items():  # nothing that passed between two others
        assert messages and all(name in (m.sender, m.receiver) for m in messages), name
    peers = {m.receiver for m in seen["bank"] if m.sender == "bank"}
    assert peers == {*PARTIES[1:], "aggregator"}  # the label party sets up and ends each
    shop = seen["shop"]
    requests = [m for m in shop if m.kind == "seal-request"]
    sealed = [m for m in shop if m.kind == "sealed"]
    assert requests and all(m.sender == "bank" for m in requests)
    assert len(sealed) == len(requests) and all(m.receiver == "aggregator" for m in sealed)
    # What shop reported sending (its last message, the report itself, follows the count) is
    # exactly what its capture holds.
    sizes = [len(wire.encode(m)) for m in shop if m.sender == "shop"]
    reported = result["traffic"]["bytes"]["shop"]
    assert shop[-1].kind == "deployment" and shop[-1].sender == "shop"
    assert sum(sizes[:-1]) == reported["train"] + reported["predict"]
    # Under masks the aggregator takes every party's sealed contributions, never one in the
    # clear, and sends the label party only sealed sums.
    kinds = {(m.sender, m.kind) for m in seen["aggregator"]}
    assert {(name, "sealed") for name in PARTIES} <= kinds
    assert {kind for _, kind in kinds} == {
        "sealed",
        "sum-request",
        "sealed-sum",
        "public-key",
        "key-request",  # the driver opens the key session there too
        "ticket-key",  # and tells it which contributions it asks for
        "deployment",
    }
    assert {m.sender for m in seen["aggregator"] if m.kind == "ticket-key"} == {"bank"}


@pytest.fixture(scope="module")
def messy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site's files, but shop's as users have them: a text column of categories and
    empty cells in a numeric one."""
    directory = tmp_path_factory.mktemp("deploy-messy")
    write_party_files(directory)
    shop = pd.read_csv(directory / "shop.csv", dtype={"id": str})
    rng = np.random.default_rng(1)
    shop.insert(1, "segment", rng.choice(["retail", "premium", "vip"], size=len(shop)))
    shop.loc[rng.random(len(shop)) < 0.15, shop.columns[2]] = np.nan
    shop.to_csv(directory / "shop.csv", index=False)
    tls.make_federation(directory / "certs", [*PARTIES, "aggregator"])
    return directory


def test_a_deployed_party_encodes_its_own_categories_and_empty_cells_as_in_one_process(
    messy_site: Path, processes: Processes, tmp_path: Path
) -> None:
    # shop one-hot encodes its categories and fills its empty cells (with indicator columns)
    # in its own process, from its own file: the label party sees only its block's width.
    flags = ("--method", "laser", "--heads", "active")
    alone = in_process(messy_site, tmp_path / "alone", *flags)
    result, codes = deployed(messy_site, processes, tmp_path / "deployed", *flags)
    assert codes == [0, 0, 0, 0], [processes.log(n) for n in (*PARTIES[1:], "aggregator")]
    assert result["samples"] == alone["samples"]
    assert result["metrics"] == alone["metrics"]
    assert result["epoch_loss"] == alone["epoch_loss"]
    # In one process shop's 9 columns became 3 one-hot inputs and an indicator more; deployed,
    # the label party learnt only that width (its `fit` answer), which the saved model keeps.
    shop = alone["columns"]["shop"]
    assert shop["encoded"] == {"segment": 3} and shop["indicators"]
    manifest = json.loads((tmp_path / "deployed" / "model" / "manifest.json").read_text())
    assert manifest["block_shapes"][1] == [shop["inputs"]] and shop["inputs"] > shop["columns"]


def wait_for_line(processes: Processes, log: str, line: str, *watched: Any) -> None:
    """Wait (bounded) until ``line`` appears in ``log``, failing if a ``watched`` process
    exits first."""
    end = time.monotonic() + PROCESS_SECONDS
    while line not in processes.log(log):
        assert time.monotonic() < end, f"no {line!r} in {log}: {processes.log(log)}"
        for process in watched:
            assert process.poll() is None, processes.log("bank")
        time.sleep(0.05)


def kill_shop_mid_training(
    processes: Processes,
    federation: Path,
    out: Path,
    *flags: str,
    epochs: int,
    serve_flags: Sequence[str] = (),
    after_commit: bool = False,
) -> tuple[dict[str, PartyProcess], PartyProcess]:
    """Start every data party (``serve_flags`` added), the aggregator and a LASER run of
    ``epochs`` at the label party (``flags`` added), then kill shop with SIGKILL once it has
    done its first training step (``after_commit``: once its checkpoint is in a commit of the
    label party's). Returns the servers by name and the label party's process."""
    # The label party gives up on a peer after 10 s (a step's chain of deliveries takes
    # seconds on a busy machine); the others wait longer for it (their set-up, one after the
    # other, takes seconds too). A dead peer is noticed in about 1.5 s (its address refuses
    # the probe at once).
    servers = {
        name: processes.serve(federation, name, "--deadline", "60", *serve_flags)
        for name in PARTIES[1:]
    }
    servers["aggregator"] = processes.serve(federation, "aggregator", "--deadline", "60")
    label = processes.start(
        "train", "--federation", str(federation), "--name", "bank", "--method", "laser",
        *flags, "--epochs", str(epochs), "--batch-size", "64", "--representation-dim", "8",
        "--quiet", "--deadline", "10", "--out", str(out), log="bank",
    )  # fmt: skip
    wait_for_line(processes, "shop", "first training step is done", label)
    end = time.monotonic() + PROCESS_SECONDS
    while after_commit and not written_steps(out / "checkpoints", "bank"):
        assert time.monotonic() < end and label.poll() is None, processes.log("bank")
        time.sleep(0.02)
    os.kill(servers["shop"].pid, signal.SIGKILL)
    return servers, label


@pytest.mark.parametrize(
    "flags",
    [
        ("--heads", "all"),
        ("--heads", "active"),
        ("--heads", "active", "--secure-agg", "masks"),
    ],
    ids=["plaintext-heads-all", "plaintext-heads-active", "masks-heads-active"],
)
def test_training_goes_on_without_a_data_party_killed_mid_training(
    site: Path, processes: Processes, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    out = tmp_path / "out"
    servers, label = kill_shop_mid_training(processes, federation, out, *flags, epochs=6)
    assert label.wait(timeout=PROCESS_SECONDS) == 0, processes.log("bank")
    others = [servers[name].wait(timeout=PROCESS_SECONDS) for name in ("insurer", "telco")]
    assert others == [0, 0], [processes.log(name) for name in ("insurer", "telco")]
    assert servers["aggregator"].wait(timeout=PROCESS_SECONDS) == 0, processes.log("aggregator")
    # it said "training", also when set up for a prediction (it trains nothing)
    assert "aggregator: set up by bank; serving its sums" in processes.log("aggregator")
    result = json.loads((out / "result.json").read_text())
    [fault] = result["faults"]
    steps = len(result["epoch_loss"]) * -(-result["samples"]["train"] // 64)
    # Killed once it has acted on step 1's update, shop may die before its answer reaches
    # the label party (the updates of a step go out at once): lost at step 1's update, or later.
    assert fault["party"] == "shop" and 1 <= fault["step"] <= steps, fault
    assert fault["epoch"] == (fault["step"] - 1) // (steps // 6) + 1
    assert "shop" in fault["what"]
    # Evaluation ran with shop's block missing, on every test split.
    tests = set(result["samples"]) - {"train"}
    assert tests and set(result["metrics"]) == tests
    assert all(0 <= m["accuracy"] <= 100 for m in result["metrics"].values())
    assert all(np.isfinite(loss) for loss in result["epoch_loss"])
    # shop was not asked to end the run (it sent no report of its bytes); the summary names it.
    assert "shop" not in result["traffic"]["bytes"]
    assert f"lost: shop at step {fault['step']}" in processes.log("bank")


def test_false_vfl_goes_on_without_a_data_party_killed_in_stage_one(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    servers = {
        name: processes.serve(federation, name, "--deadline", "60")
        for name in (*PARTIES[1:], "aggregator")
    }
    out = tmp_path / "out"
    epochs = 6  # per stage: stage 1 (every training row) runs 6 epochs before stage 2
    label = processes.start(
        "train",
        "--federation",
        str(federation),
        "--name",
        "bank",
        "--method",
        "false-vfl-1",
        "--epochs",
        str(epochs),
        "--batch-size",
        "32",
        "--kappa",
        "3",
        "--inference-samples",
        "10",
        "--quiet",
        "--deadline",
        "10",
        "--out",
        str(out),
        log="bank",
    )  # fmt: skip  (deadlines: see the LASER test above)
    wait_for_line(processes, "shop", "first training step is done", label)
    # Past step 1's update (where a kill right away is noticed: the others complete the
    # step), into a later step of stage 1's 36, which the label party abandons and retries
    # (of 18 steps, batches of 64, an idle machine was past them: lost at step 19 to 25).
    time.sleep(0.5)
    os.kill(servers["shop"].pid, signal.SIGKILL)
    assert label.wait(timeout=PROCESS_SECONDS) == 0, processes.log("bank")
    for name in ("insurer", "telco", "aggregator"):
        assert servers[name].wait(timeout=PROCESS_SECONDS) == 0, processes.log(name)
    result = json.loads((out / "result.json").read_text())
    [fault] = result["faults"]
    epoch_steps = -(-result["samples"]["train"] // 32)  # every training row (stage 1)
    assert fault["party"] == "shop" and "shop" in fault["what"], fault
    assert 1 <= fault["step"] <= epochs * epoch_steps, fault  # lost in stage 1
    assert fault["epoch"] == (fault["step"] - 1) // epoch_steps + 1
    assert len(result["epoch_loss"]) == 2 * epochs  # both stages ran to the end
    assert all(np.isfinite(loss) for loss in result["epoch_loss"])
    tests = set(result["samples"]) - {"train"}
    assert tests and set(result["metrics"]) == tests
    assert all(0 <= m["accuracy"] <= 100 for m in result["metrics"].values())
    assert "shop" not in result["traffic"]["bytes"]
    assert f"lost: shop at step {fault['step']}" in processes.log("bank")


def restart_shop_while_held(processes: Processes, label: PartyProcess, *flags: str) -> PartyProcess:
    """Hold the label party still (SIGSTOP), start a new `party serve` for shop (``flags``
    added), let the label party go on once it serves; the new process."""
    os.kill(label.pid, signal.SIGSTOP)
    try:
        restarted = processes.start(
            "party", "serve", "--name", "shop", *flags, log="shop-restarted"
        )  # fmt: skip
        wait_for_line(processes, "shop-restarted", "shop: serving at", restarted)
    finally:
        os.kill(label.pid, signal.SIGCONT)
    return restarted


@pytest.mark.parametrize(
    ("flags", "checkpoints"),
    [
        (("--heads", "all"), True),
        (("--heads", "active", "--secure-agg", "masks"), False),
        (("--heads", "active", "--align", "psi"), False),  # aligned again by a new PSI
        (("--heads", "active", "--dp-embeddings", "1.0:1.0"), True),  # releases from its journal
    ],
    ids=["plaintext-heads-all-checkpoints", "masks-heads-active", "psi-heads-active", "dp"],
)
def test_a_data_party_killed_mid_training_rejoins_when_its_operator_restarts_it(
    site: Path, processes: Processes, tmp_path: Path, flags: tuple[str, ...], checkpoints: bool
) -> None:
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    out = tmp_path / "out"
    # Each data party keeps its checkpoints under its own name in this directory (one machine).
    serve_flags = ("--checkpoint-dir", str(tmp_path / "kept")) if checkpoints else ()
    flags += ("--checkpoint-every", "7") if checkpoints else ()
    # With checkpoints in plaintext, shop dies after a commit that held it: it comes back from
    # that checkpoint. Under DP it dies before any: initial models, its releases from its journal.
    restores = checkpoints and "--dp-embeddings" not in flags
    servers, label = kill_shop_mid_training(
        processes, federation, out, *flags, epochs=24, serve_flags=serve_flags,
        after_commit=restores,
    )  # fmt: skip
    servers["shop"].wait(timeout=PROCESS_SECONDS)
    # The operator restarts shop (same certificate, same address) once the label party has
    # dropped it: a new `party serve` process, which the label party sets up again. (The label
    # party is held still until the new process serves: a dead party's probe is quick, and the
    # run could otherwise end before a process that takes seconds to start is up.)
    wait_for_line(processes, "bank", "shop is lost at step", label)
    restarted = restart_shop_while_held(
        processes, label, "--federation", str(federation), "--deadline", "60", *serve_flags
    )
    assert label.wait(timeout=PROCESS_SECONDS) == 0, processes.log("bank")
    codes = [servers[name].wait(timeout=PROCESS_SECONDS) for name in ("insurer", "telco")]
    codes += [servers["aggregator"].wait(timeout=PROCESS_SECONDS)]
    assert codes == [0, 0, 0], [processes.log(n) for n in ("insurer", "telco", "aggregator")]
    # The restarted shop was set up, trained, was asked to end the run and reported its bytes.
    assert restarted.wait(timeout=PROCESS_SECONDS) == 0, processes.log("shop-restarted")
    assert "shop: the run finished" in processes.log("shop-restarted")
    if "psi" in flags:  # its PSI state died with its first process: it aligned again
        assert "shop: aligning by PSI with bank" in processes.log("shop-restarted")
    result = json.loads((out / "result.json").read_text())
    lost, back = result["faults"]
    steps = -(-result["samples"]["train"] // 64)  # per epoch
    assert lost["party"] == back["party"] == "shop" and back["what"] == "rejoined", result["faults"]
    # Back at an epoch boundary after its loss, dated by its first step again.
    assert back["step"] > lost["step"] and (back["step"] - 1) % steps == 0, result["faults"]
    assert back["epoch"] == (back["step"] - 1) // steps + 1 > lost["epoch"]
    assert result["traffic"]["bytes"]["shop"]["train"] > 0
    assert all(np.isfinite(loss) for loss in result["epoch_loss"])
    log = processes.log("bank")
    assert f"lost: shop at step {lost['step']}" in log and "until it rejoined" in log, log
    assert f"rejoined: shop at step {back['step']}" in log, log
    if "--dp-embeddings" in flags:  # its first process's releases are priced in its report
        [taken] = re.findall(r"took back (\d+) release\(s\)", processes.log("shop-restarted"))
        after = steps * 24 - back["step"] + 1  # the steps since it rejoined, one release each
        releases = result["privacy"]["releases"]["shop"]["embedding"]
        # Its first process's training releases (``taken`` counts its evaluations' too).
        assert 1 <= releases - after <= int(taken), (taken, releases, after)
        assert "reported about itself" in result["privacy"]["accounted_by"]["shop"]
    if restores:  # it restored its checkpoint in the last commit that held it
        assert back["restored"] >= 7 and back["restored"] % 7 == 0, result["faults"]
        assert back["restored"] <= lost["step"], result["faults"]
        log = processes.log("shop-restarted")
        assert f"shop: restored its checkpoint of step {back['restored']}" in log, log
        assert f"set up anew (from its checkpoint of step {back['restored']})" in processes.log(
            "bank"
        )
    else:
        assert "restored" not in back and "restored its checkpoint" not in processes.log(
            "shop-restarted"
        )
    if checkpoints:  # back, shop keeps checkpoints again, and the label party's commits say so
        last = written_steps(out / "checkpoints", "bank")[-1]
        assert written_steps(tmp_path / "kept", "shop")[-1] == last >= back["step"]
        committed = read_checkpoint(out / "checkpoints", "bank", last)
        assert sorted(committed.parties) == ["insurer", "shop", "telco"]


def test_a_data_party_restarted_before_the_label_party_noticed_is_lost_then_rejoins(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    """A supervisor restarts a killed party at once: the label party's next message reaches a
    process the run never set up. That process refuses it as not set up, the label party takes
    the party for lost (not the refusal for a broken protocol: the run goes on) and readmits
    the restarted process at the next epoch boundary."""
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    out = tmp_path / "out"
    servers = {name: processes.serve(federation, name, "--deadline", "60") for name in PARTIES[1:]}
    servers["aggregator"] = processes.serve(federation, "aggregator", "--deadline", "60")
    label = processes.start(
        "train", "--federation", str(federation), "--name", "bank", "--method", "laser",
        "--heads", "active", "--epochs", "4", "--batch-size", "64", "--representation-dim",
        "8", "--quiet", "--deadline", "30", "--out", str(out), log="bank",
    )  # fmt: skip
    wait_for_line(processes, "shop", "first training step is done", label)
    # The label party is held still while shop is killed and its replacement starts, so the
    # replacement is what its next message meets: the label party never sees shop down.
    os.kill(label.pid, signal.SIGSTOP)
    try:
        os.kill(servers["shop"].pid, signal.SIGKILL)
        servers["shop"].wait(timeout=PROCESS_SECONDS)
        restarted = processes.start(
            "party", "serve", "--federation", str(federation), "--name", "shop", "--deadline",
            "60", log="shop-restarted",
        )  # fmt: skip
        wait_for_line(processes, "shop-restarted", "shop: serving at", restarted)
    finally:
        os.kill(label.pid, signal.SIGCONT)
    assert label.wait(timeout=PROCESS_SECONDS) == 0, processes.log("bank")
    assert restarted.wait(timeout=PROCESS_SECONDS) == 0, processes.log("shop-restarted")
    log = processes.log("shop-restarted")
    assert "before the run was set up" in log and "shop: the run finished" in log, log
    result = json.loads((out / "result.json").read_text())
    lost, back = result["faults"]
    assert lost["party"] == back["party"] == "shop" and back["what"] == "rejoined", result["faults"]
    assert "was never set up for this run" in lost["what"], lost
    assert back["epoch"] > lost["epoch"], result["faults"]
    assert result["traffic"]["bytes"]["shop"]["train"] > 0


def test_a_party_restarted_with_other_ids_is_not_readmitted_under_psi(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    """A lost party's restarted process must find the run's intersection again: one whose
    table has lost some of its ids is refused, told why (it exits), and stays lost; the run
    ends without it."""
    ports = free_loopback_ports(5)
    federation = write_federation(site, site / "certs", ports)
    out = tmp_path / "out"
    flags = ("--heads", "active", "--align", "psi")
    servers, label = kill_shop_mid_training(processes, federation, out, *flags, epochs=12)
    servers["shop"].wait(timeout=PROCESS_SECONDS)
    wait_for_line(processes, "bank", "shop is lost at step", label)
    table = pd.read_csv(site / "shop.csv")
    table.iloc[10:].to_csv(tmp_path / "shop.csv", index=False)  # 10 of its ids gone
    changed = write_federation(
        tmp_path,
        site / "certs",
        ports,
        **{f'"{name}.csv"': f'"{site}/{name}.csv"' for name in PARTIES[1:] if name != "shop"},
        **{'"bank.csv"': f'"{site}/bank.csv"', '"labels.csv"': f'"{site}/labels.csv"'},
    )
    restarted = restart_shop_while_held(
        processes, label, "--federation", str(changed), "--deadline", "5"
    )
    assert label.wait(timeout=PROCESS_SECONDS) == 0, processes.log("bank")
    codes = [servers[name].wait(timeout=PROCESS_SECONDS) for name in ("insurer", "telco")]
    assert codes == [0, 0], [processes.log(n) for n in ("insurer", "telco")]
    result = json.loads((out / "result.json").read_text())
    [lost] = result["faults"]  # lost, never rejoined
    assert lost["party"] == "shop", result["faults"]
    log = processes.log("bank")
    assert "its ids changed since the alignment?" in log and "it stays lost" in log, log
    assert "shop: aligning by PSI with bank" in processes.log("shop-restarted")
    assert "set up by" not in processes.log("shop-restarted")
    # Told why, it ends at once (exit non-zero) instead of waiting for probes.
    assert restarted.wait(timeout=PROCESS_SECONDS) == 1
    said = "the label party ended the run: not readmitted: PSI with shop again"
    assert said in processes.log("shop-restarted")


def test_a_lost_party_is_found_back_only_under_its_own_certificate(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    federation = read_federation(write_federation(site, site / "certs", free_loopback_ports(5)))
    address = federation.member("shop").address
    other = tmp_path / "other"
    tls.make_federation(other, ["shop"])
    impostors = {
        "insurer's certificate": ("insurer", federation.identity("insurer")),
        "another CA's": ("shop", TlsIdentity.from_files(other / "ca.pem", *_pair(other, "shop"))),
    }
    with PartyEndpoint(
        "bank", peers=federation.addresses(but="bank"), identity=federation.identity("bank")
    ) as bank:
        probe = NetworkChannel(bank)
        assert probe.returned(["shop"]) == []  # nothing listens at its address
        # A quick probe (an imputation's, before every round) does not wait out the probe time
        # for an address that refuses.
        monkeypatch.setattr(network, "REJOIN_PROBE_SECONDS", 30.0)
        start = time.monotonic()
        assert probe.returned(["shop"], quick=True) == []
        assert time.monotonic() - start < 15.0
        monkeypatch.undo()
        for what, (name, identity) in impostors.items():
            with PartyEndpoint(name, listen=address, identity=identity):
                assert probe.returned(["shop"]) == [], what  # the handshake fails: still lost
                assert probe.returned(["shop"], quick=True) == [], what
        with PartyEndpoint("shop", listen=address, identity=federation.identity("shop")):
            assert probe.returned(["shop"]) == ["shop"]
            assert probe.returned(["shop"], quick=True) == ["shop"]


def _pair(directory: Path, name: str) -> tuple[Path, Path]:
    return directory / f"{name}.pem", directory / f"{name}.key"


def test_a_data_party_exits_non_zero_when_the_label_party_dies(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    deadline = 4.0
    servers = [
        processes.serve(federation, name, "--deadline", str(deadline))
        for name in (*PARTIES[1:], "aggregator")
    ]
    label = processes.start(
        "train",
        "--federation",
        str(federation),
        "--name",
        "bank",
        "--method",
        "laser",
        "--epochs",
        "200",
        "--quiet",
        "--deadline",
        str(deadline),
        "--out",
        str(tmp_path / "out"),
        log="bank",
    )
    # Kill the label party once training has started (a data party has heard from it).
    end = time.monotonic() + PROCESS_SECONDS
    while "training" not in processes.log("shop") and time.monotonic() < end:
        assert label.poll() is None, processes.log("bank")
        time.sleep(0.1)
    os.kill(label.pid, signal.SIGKILL)
    killed = time.monotonic()
    # Each party says so within twice the deadline: silent for one deadline, then its probe
    # of the label party's address is refused at once (it waited out a second deadline before,
    # and the last to hear it said so at 9.5-10.3 s). Timed by when the line appears, not by the
    # exit: the interpreter's own teardown after it takes seconds more on a loaded 2-core
    # machine (10.9 s in all once, at load 6.5).
    names = (*PARTIES[1:], "aggregator")  # the aggregation server too
    said: dict[str, float] = {}
    while len(said) < len(names) and time.monotonic() - killed < PROCESS_SECONDS:
        for name in names:
            if name not in said and "label party bank was silent" in processes.log(name):
                said[name] = time.monotonic() - killed
        time.sleep(0.05)
    assert sorted(said) == sorted(names), [processes.log(name) for name in names]
    assert max(said.values()) < 2 * deadline, said
    codes = [server.wait(timeout=PROCESS_SECONDS) for server in servers]
    assert codes == [1] * len(servers), codes  # a party it needs is gone: exit 1


@pytest.mark.parametrize("first_wait", [1.0, 300.0])
def test_a_data_party_waits_on_a_silent_label_party_that_is_up_and_not_on_a_dead_one(
    site: Path, processes: Processes, first_wait: float
) -> None:
    """Silence alone is not death: a party whose label party says nothing for longer than its
    deadline (here the label party's endpoint is up but sends nothing, as while a lost party
    waits for readmission at a distant epoch boundary) checks that it still accepts a
    connection and waits on; once that endpoint is closed, the party exits non-zero saying so
    within twice its deadline. Before a first message too, whatever its `--wait`: a restarted
    party never readmitted waited out `--wait` (600 s by default) after its run had ended."""
    path = write_federation(site, site / "certs", free_loopback_ports(5))
    federation = read_federation(path)
    wait = 1.0  # the party's --deadline
    bank = PartyEndpoint(
        "bank",
        listen=federation.member("bank").address,
        peers=federation.addresses(but="bank"),
        identity=federation.identity("bank"),
    )
    try:
        shop = processes.serve(path, "shop", "--wait", str(first_wait), "--deadline", str(wait))
        end = time.monotonic() + PROCESS_SECONDS
        while processes.log("shop").count("accepts connections: waiting on") < 3:
            assert shop.poll() is None, processes.log("shop")  # 3 waits past its deadline
            assert time.monotonic() < end, processes.log("shop")
            time.sleep(0.05)
    finally:
        bank.close()
    closed = time.monotonic()
    while "accepts no connection" not in processes.log("shop"):
        assert time.monotonic() - closed < PROCESS_SECONDS, processes.log("shop")
        time.sleep(0.05)
    assert time.monotonic() - closed < 2 * wait + 2.0, processes.log("shop")
    assert shop.wait(timeout=PROCESS_SECONDS) == 1
    said = processes.log("shop")
    assert "label party bank was silent for 1 s and accepts no connection (it accepted them" in said


def test_a_data_party_whose_label_party_never_starts_says_so_after_its_wait(
    site: Path, processes: Processes
) -> None:
    """A label party that never came up is not one that died: the party waits --wait for its
    first message, then exits 1 asking whether it is started (it asked "did it die?")."""
    path = write_federation(site, site / "certs", free_loopback_ports(5))
    shop = processes.serve(path, "shop", "--wait", "2", "--deadline", "1")
    assert shop.wait(timeout=PROCESS_SECONDS) == 1
    said = processes.log("shop")
    assert (
        "the label party bank was silent for 2 s and accepts no connection (is it started, at "
        "the address of the federation file?)" in said
    ), said


def test_a_data_partys_empty_cells_are_refused_under_missing_cells_refuse(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    """`--missing-cells refuse` was ignored with --federation: every party filled its empty
    cells (mean-indicator) while result.json said `refuse`. shop refuses its own file now, and
    the label party's run fails saying so; nothing is written."""
    here = tmp_path / "site"
    shutil.copytree(site, here)
    shop = pd.read_csv(here / "shop.csv", dtype={"id": str})
    shop.iloc[:3, 1] = np.nan
    shop.to_csv(here / "shop.csv", index=False)
    out = tmp_path / "run"
    code, servers = deploy(here, processes, out, "--method", "laser", "--missing-cells", "refuse")
    assert code == 2, processes.log("bank")
    said = processes.log("bank")
    assert "shop" in said and "must not be missing under --missing-cells refuse" in said, said
    assert not out.exists()
    for server in servers:
        server.wait(timeout=PROCESS_SECONDS)


def test_a_party_given_the_wrong_name_is_refused(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    with pytest.raises(SystemExit):
        main(["party", "serve", "--federation", str(federation)])
    serve = ["party", "serve", "--federation", str(federation), "--name"]
    train = ["train", "--federation", str(federation), "--method", "laser", "--quiet", "--name"]
    refusals = {
        (*serve, "nobody"): "no party named 'nobody'; expected one of bank, shop, insurer, telco",
        (*serve, "bank"): "bank is the label party of",
        (*train, "shop", "--out", str(tmp_path / "o")): "shop is not the label party of",
        # the aggregation server was called "a data party"
        (*train, "aggregator", "--out", str(tmp_path / "o")): "is); the aggregation server "
        f"runs `secure-vfl party serve --federation {federation} --name aggregator`.",
        (*train, "bank", "--insecure-reproducible-noise"): "--insecure-reproducible-noise is "
        "refused with --federation",
    }
    for argv, reason in refusals.items():
        capsys.readouterr()
        assert main(list(argv)) == 2
        out, err = capsys.readouterr()
        assert reason in err and "serving at" not in out, (argv, out, err)
    assert not (tmp_path / "o").exists()


def test_a_certificate_from_another_ca_or_naming_another_party_is_refused(
    site: Path, processes: Processes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A party refuses, before it listens, a certificate no peer would accept: an impostor's
    process with another CA's exits at once and never says that it serves (it said so, and the
    label party waited out its --wait on a handshake that could never succeed). An honest party
    meeting such an impostor gives it up at once: tests/test_network.py."""
    other = tmp_path / "other"
    tls.make_federation(other, ["shop"])
    ports = free_loopback_ports(5)
    impostor_dir = tmp_path / "impostor"
    impostor_dir.mkdir()
    impostor = write_federation(
        impostor_dir,
        site / "certs",
        ports,
        **{
            f'cert = "{site}/certs/shop.pem"': f'cert = "{other}/shop.pem"',
            f'key = "{site}/certs/shop.key"': f'key = "{other}/shop.key"',
            'data = "shop.csv"': f'data = "{site}/shop.csv"',
        },
    )
    shop = processes.serve(impostor, "shop", "--wait", "60")
    assert shop.wait(timeout=PROCESS_SECONDS) == 2
    log = processes.log("shop")
    assert f"{impostor}: [party.shop] shop cannot take part" in log, log
    assert "not signed by this federation's CA" in log and "serving at" not in log, log
    # Given insurer's certificate and key, shop is refused for the name; given insurer's
    # certificate with its own key, for the key, before gRPC could only say it cannot listen.
    for swap, said in (
        ({"pem", "key"}, "common name 'shop' expected, found ['insurer']"),
        ({"pem"}, "shop.key is not the private key of"),
    ):
        swapped = write_federation(
            tmp_path,
            site / "certs",
            ports,
            **{f"{site}/certs/shop.{suffix}": f"{site}/certs/insurer.{suffix}" for suffix in swap},
            **{'data = "shop.csv"': f'data = "{site}/shop.csv"'},
        )
        serve = ["party", "serve", "--federation", str(swapped), "--name", "shop", "--wait", "1"]
        assert main(serve) == 2
        assert said in capsys.readouterr().err


def test_a_party_reads_only_its_own_key(site: Path, tmp_path: Path) -> None:
    ports = free_loopback_ports(5)
    federation = read_federation(
        write_federation(
            tmp_path, site / "certs", ports, **{f"{site}/certs/insurer.key": "/nonexistent.key"}
        )
    )
    assert federation.identity("shop").name == "shop"
    with pytest.raises(ConfigError, match="nonexistent"):
        federation.identity("insurer")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({'label_party = "bank"': 'label_party = "bank"\ncolour = "red"'}, "unknown key"),
        ({'label_party = "bank"\n': ""}, "`label_party` expected"),
        ({'data = "shop.csv"': 'data = "shop.csv"\nlabels = "x.csv"'}, "label party 'bank' only"),
        ({"[party.telco]": "[party.Telco]"}, "party.Telco"),
        ({'address = "127.0.0.1:': 'address = "127.0.0.1:99999'}, "HOST:PORT"),
        ({'address = "127.0.0.1:': 'address = "127.0.0.1:\u00b2'}, "HOST:PORT"),  # isdigit
        ({"[party.telco]\naddress": "[party.telco]\nport = 1\naddress"}, "[party.telco]"),
        ({'label_party = "bank"': "x = " + "[" * 50_000 + "]" * 50_000}, "nested too deeply"),
    ],
)
def test_the_federation_file_refuses_mistakes_naming_the_key(
    tmp_path: Path, change: dict[str, str], message: str
) -> None:
    path = write_federation(tmp_path, tmp_path, free_loopback_ports(5), **change)
    with pytest.raises(ConfigError) as caught:
        read_federation(path)
    assert message in str(caught.value)
    assert str(path) in str(caught.value)


def test_training_needs_the_label_partys_labels_and_an_imputation_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_federation(
        tmp_path, tmp_path, free_loopback_ports(5), **{'labels = "labels.csv"': ""}
    )
    federation = read_federation(path)  # the file itself is fine: an imputation reads no labels
    with pytest.raises(ConfigError, match="`labels` expected at the label party to train"):
        federation.labels()
    out = tmp_path / "out"
    flags = ["--name", "bank", "--method", "laser", *FLAGS, "--out", str(out)]
    code = main(["train", "--federation", str(path), *flags])
    assert code == 2
    assert "`labels` expected at the label party to train" in capsys.readouterr().err
    assert not out.exists()
    # nor its own data (it was required of the label party of an imputation, which reads none)
    path = write_federation(tmp_path, tmp_path, free_loopback_ports(5), **{'data = "bank.csv"': ""})
    federation = read_federation(path)
    assert federation.member("bank").data is None
    with pytest.raises(ConfigError, match="`data` expected at the label party to train"):
        federation.label_data()
    assert main(["train", "--federation", str(path), *flags]) == 2
    assert "[party.bank] key `data` expected at the label party to train" in capsys.readouterr().err
    path = write_federation(tmp_path, tmp_path, free_loopback_ports(5), **{'data = "shop.csv"': ""})
    with pytest.raises(ConfigError, match=r"\[party.shop\] key `data` expected. Found none"):
        read_federation(path)  # a data party's table is what it serves


def test_the_federation_file_refuses_a_shared_address(tmp_path: Path) -> None:
    port = free_loopback_ports(1)[0]
    path = write_federation(tmp_path, tmp_path, [port] * 5)
    with pytest.raises(ConfigError, match="both have"):
        read_federation(path)


def test_relative_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    path = write_federation(tmp_path, Path("certs"), free_loopback_ports(5))
    with contextlib.chdir(ROOT):
        federation = read_federation(path)
    assert federation.ca == tmp_path / "certs" / "ca.pem"
    assert federation.member("shop").data == tmp_path / "shop.csv"
    assert federation.names == list(PARTIES)


def test_own_file_options_are_refused_with_federation_before_any_contact(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    args = ["train", "--federation", str(federation), "--name", "bank", "--method", "laser"]
    args += ["--quiet", "--wait", "1", "--out", str(tmp_path / "o")]
    # Even spelt as the columns the files must have: the flag is not offered, not ignored.
    for extra in (["--id-column", "patient"], ["--label-column", "outcome"], ["--id-column", "id"]):
        capsys.readouterr()
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err
        assert f"{extra[0]} not offered with --federation yet" in err, err
    # One --party-name was counted against the federation's files ("one --party-name per
    # --party-file expected (3); found 1").
    assert main([*args, "--party-name", "x"]) == 2
    err = capsys.readouterr().err
    assert "--party-name not offered with --federation: the parties'" in err, err
    assert not (tmp_path / "o").exists()


# -- --align psi: PSI between the label party and each data party, over the network ----------


def write_sparse_party_files(directory: Path, *, rows: int = 260) -> dict[str, list[str]]:
    """Party files where the intersection matters: every party (the label party's own table
    too) lacks some ids, a few labelled ids are held by no party, and the last ids are in the
    parties' files but not in the label file. Returns each party's ids."""
    bunch = load_breast_cancer(as_frame=True)
    features, target = bunch.data.iloc[:rows], bunch.target.to_numpy()[:rows]
    ids = np.array([f"id-{i:05d}" for i in range(rows)])
    rng = np.random.default_rng(3)
    held: dict[str, list[str]] = {}
    for k, (name, columns) in enumerate(
        zip(PARTIES, np.array_split(np.array(features.columns), 4), strict=True)
    ):
        frame = features[list(columns)].copy()
        frame.insert(0, "id", ids)
        kept = np.sort(rng.choice(np.arange(3, rows), size=rows - 3 - (6 + 4 * k), replace=False))
        frame.iloc[rng.permutation(kept)].to_csv(directory / f"{name}.csv", index=False)
        held[name] = ids[kept].tolist()
    labelled = slice(0, rows - 10)  # ids 0-2: no party's; the last 10: no label
    labels = pd.DataFrame({"id": ids[labelled], "label": target[labelled]})
    labels.to_csv(directory / "labels.csv", index=False)
    return held


@pytest.fixture(scope="module")
def sparse_site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    directory = tmp_path_factory.mktemp("deploy-psi")
    held = write_sparse_party_files(directory)
    tls.make_federation(directory / "certs", [*PARTIES, "aggregator"])
    return directory, held


def deployed_here(
    site: Path,
    processes: Processes,
    out: Path,
    arrived: list[tuple[bytes, Message]],
    monkeypatch: pytest.MonkeyPatch,
    *flags: str,
) -> tuple[dict[str, Any], list[int]]:
    """A deployment whose label party runs in this process (the others in their own), every
    delivery that reaches it recorded in ``arrived`` as its bytes and its message."""
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    servers = [processes.serve(federation, name) for name in (*PARTIES[1:], "aggregator")]
    decode = wire.decode

    def recorded(data: bytes, **options: Any) -> Message:
        message = decode(data, **options)
        arrived.append((bytes(data), message))
        return message

    monkeypatch.setattr(wire, "decode", recorded)
    args = ["train", "--federation", str(federation), "--name", "bank", *FLAGS, *flags]
    try:
        assert main([*args, "--out", str(out)]) == 0
    finally:
        monkeypatch.setattr(wire, "decode", decode)
    codes = [server.wait(timeout=PROCESS_SECONDS) for server in servers]
    return dict(json.loads((out / "result.json").read_text())), codes


def from_data_parties(arrived: list[tuple[bytes, Message]]) -> list[tuple[bytes, Message]]:
    return [(data, m) for data, m in arrived if m.sender in PARTIES[1:]]


def test_deployed_psi_trains_to_the_in_process_psi_metrics_and_no_party_sends_its_ids(
    sparse_site: tuple[Path, dict[str, list[str]]],
    processes: Processes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    site, held = sparse_site
    flags = ("--method", "laser", "--heads", "all")
    alone = in_process(site, tmp_path / "alone", *flags, "--align", "psi")
    psi: list[tuple[bytes, Message]] = []
    result, codes = deployed_here(
        site, processes, tmp_path / "psi", psi, monkeypatch, *flags, "--align", "psi"
    )
    assert codes == [0, 0, 0, 0], [processes.log(n) for n in (*PARTIES[1:], "aggregator")]
    assert result["metrics"] == alone["metrics"]
    assert result["epoch_loss"] == alone["epoch_loss"]
    assert result["samples"] == alone["samples"]
    # The intersection mattered: ids held by no party, and party ids without a label, dropped.
    assert alone["dropped"]["alignment_no_party"] == 3, alone["dropped"]
    assert alone["dropped"]["alignment_no_label"] > 0, alone["dropped"]
    assert result["dropped"] == alone["dropped"]
    # The plain join aligns the same samples: the same run, to the same metrics.
    join: list[tuple[bytes, Message]] = []
    joined, codes = deployed_here(site, processes, tmp_path / "join", join, monkeypatch, *flags)
    assert codes == [0, 0, 0, 0]
    assert (joined["metrics"], joined["samples"]) == (result["metrics"], result["samples"])
    # Under PSI a data party answers the label party's deployment messages with its width, its
    # model input's shape and, at the end, its saved part's hashes and its bytes: never its
    # ids, which appear in none of the bytes that arrived.
    topics = [
        (m.sender, m.topic) for _, m in from_data_parties(psi) if isinstance(m, DeploymentMessage)
    ]
    answers = ("psi-ready", "fitted", "saved", "report")
    assert sorted(topics) == sorted((name, topic) for name in PARTIES[1:] for topic in answers)
    kinds = {m.kind for _, m in from_data_parties(psi)}
    assert {"psi-response", "deployment"} <= kinds, kinds
    for party in PARTIES[1:]:
        ids = [i.encode() for i in held[party]]
        leaked = [i for i in ids for data, _ in from_data_parties(psi) if i in data]
        assert leaked == [], (party, leaked[:5])
        # The check can fail: under the plain join every party sends its ids in the clear.
        sent = b"".join(data for data, m in from_data_parties(join) if m.sender == party)
        assert all(i in sent for i in ids)


def test_a_setup_in_psi_positions_maps_to_the_party_rows_and_refuses_what_it_does_not_hold() -> (
    None
):
    aligned = np.array([4, -1, 0, 2], dtype=np.int64)  # the party's row of each aligned sample
    to_rows = _row_mapping("psi", aligned, "shop", table_rows=5)
    assert to_rows(np.array([3, -1, 0, 2]), "rows.train").tolist() == [2, -1, 4, 0]
    with pytest.raises(ProtocolError, match="does not hold"):
        to_rows(np.array([1]), "rows.train")
    with pytest.raises(ProtocolError, match="ran PSI"):
        _row_mapping("join", aligned, "shop", table_rows=5)
    with pytest.raises(ProtocolError, match="ran no PSI"):
        _row_mapping("psi", None, "shop", table_rows=5)
    assert _row_mapping("join", None, "shop", table_rows=5)(np.array([1, -1]), "x").tolist() == [
        1,
        -1,
    ]


def test_a_party_fits_its_preprocessing_only_on_rows_it_holds_and_tells_only_the_shape(
    messy_site: Path,
) -> None:
    shop = read_party_file(messy_site / "shop.csv")
    fitted = fit_served_preprocessing(
        "shop", shop, list(range(0, 200, 2)), "join", None, missing_cells="mean-indicator"
    )
    # Its numeric columns, "segment" as 3 one-hot inputs, and one missing-cell indicator.
    assert fitted.block_shape == (len(shop.columns) - 1 + 3 + 1,)
    aligned = np.array([3, -1, 0], dtype=np.int64)  # under PSI: positions of aligned samples
    assert fit_served_preprocessing(
        "shop", shop, [0, 2], "psi", aligned, missing_cells="mean-indicator"
    ).block_shape
    refusals = {
        "must be a list of integers": (["0"], "join", None),
        "must lie in": ([shop.ids.size], "join", None),  # a row its table does not have
        "does not hold": ([1], "psi", aligned),
        "must hold a training row": ([], "join", None),
        "ran no PSI": ([0], "psi", None),
    }
    for reason, (rows, align, held) in refusals.items():
        with pytest.raises(ProtocolError, match=reason):
            fit_served_preprocessing(
                "shop", shop, rows, align, held, missing_cells="mean-indicator"
            )


def test_a_label_party_process_goes_past_the_refusals_to_psi_with_each_party(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    # A fresh process (nothing imported PSI before): `--align psi` is taken with --federation,
    # and the label party's first message is the PSI request to the first data party.
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    args = ["--name", "bank", "--method", "laser", "--align", "psi", "--quiet"]
    args += ["--wait", "1", "--deadline", "2", "--out", str(tmp_path / "out")]
    label = processes.start("train", "--federation", str(federation), *args, log="bank")
    # Nobody serves: it fails reaching shop.
    assert label.wait(timeout=PROCESS_SECONDS) != 0
    log = processes.log("bank")
    assert "deployment from bank to shop" in log and "could not be reached" in log, log
    # The start-up named the parties it could not reach: ending the run there is not warned of
    # again, one line each.
    assert "not reachable after" in log and "could not end the run" not in log, log
    assert not (tmp_path / "out" / "result.json").exists()


def test_a_party_whose_federation_file_differs_refuses_the_run_saying_how(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    """telco's copy of the file gives insurer another address: the run got as far as training,
    where telco's gradients for insurer went to an address nobody served."""
    ports = free_loopback_ports(5)
    federation = write_federation(site, site / "certs", ports)
    elsewhere = tmp_path / "telco-copy"
    elsewhere.mkdir()
    other = free_loopback_ports(1)[0]
    differs = write_federation(
        elsewhere,
        site / "certs",
        ports,
        **{f'address = "127.0.0.1:{ports[2]}"': f'address = "127.0.0.1:{other}"'},
        **{'data = "telco.csv"': f'data = "{site}/telco.csv"'},
    )
    servers = [processes.serve(federation, name) for name in ("shop", "insurer", "aggregator")]
    servers.append(processes.serve(differs, "telco"))
    args = ["--name", "bank", "--method", "laser", "--quiet", "--out", str(tmp_path / "out")]
    label = processes.start("train", "--federation", str(federation), *args, log="bank")
    assert label.wait(timeout=PROCESS_SECONDS) != 0
    log = processes.log("bank")
    expected = (
        "telco: the federation file of bank differs from this party's ({}): insurer "
        f"at 127.0.0.1:{ports[2]} at bank, at 127.0.0.1:{other} here."
    )
    # The label party is told how, not where telco keeps its files; telco's own log says where.
    assert expected.format("<its federation file's directory>/federation.toml") in log, log
    assert expected.format(differs) in processes.log("telco")
    assert not (tmp_path / "out" / "result.json").exists()
    assert [p.wait(timeout=PROCESS_SECONDS) for p in servers] == [1, 1, 1, 1]


def test_roster_differences_name_each_way_two_copies_differ() -> None:
    from secure_vfl.federation.federation_file import roster_differences

    own = {"label_party": "bank", "members": [["bank", "a:1"], ["shop", "a:2"]], "ca_sha256": "x"}
    assert roster_differences(own, own, them="bank") == []
    theirs = {
        "label_party": "shop",
        "members": [["bank", "a:1"], ["shop", "a:3"], ["telco", "a:4"]],
        "ca_sha256": "y",
    }
    assert roster_differences(own, theirs, them="bank") == [
        "label party shop at bank, bank here",
        "telco only at bank",
        "shop at a:3 at bank, at a:2 here",
        "another CA certificate",
    ]
    swapped = {**own, "members": [["shop", "a:2"], ["bank", "a:1"]]}
    assert roster_differences(own, swapped, them="bank") == [
        "the parties in the order shop, bank at bank"
    ]


def test_a_data_party_serving_psi_only_refuses_to_send_its_ids(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    shop = processes.serve(federation, "shop", "--align", "psi")
    others = [processes.serve(federation, name) for name in ("insurer", "telco", "aggregator")]
    args = ["--name", "bank", "--method", "laser", "--quiet", "--out", str(tmp_path / "out")]
    label = processes.start("train", "--federation", str(federation), *args, log="bank")
    assert label.wait(timeout=PROCESS_SECONDS) != 0
    assert "shop aligns by PSI only" in processes.log("bank"), processes.log("bank")
    # The label party ended the run as failed at every party, which exit non-zero.
    assert [p.wait(timeout=PROCESS_SECONDS) for p in (shop, *others)] == [1, 1, 1, 1]
    assert not (tmp_path / "out" / "result.json").exists()
