"""Deployed checkpoints and resume: every party its own process on loopback (gRPC with mutual
TLS, no mock), each writing its own checkpoint into its own directory; the federation killed
with SIGKILL after a committed checkpoint and restarted with ``--resume`` ends with exactly the
metrics of an uninterrupted run, and a tampered party checkpoint is refused by that party.
Every process started here is stopped by its pid when the test ends, passed or failed. The
message checks of both sides are unit-tested without processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import MakeData
from test_deploy import (
    PARTIES,
    PROCESS_SECONDS,
    PartyProcess,
    Processes,
    flags_for,
    in_process,
    write_federation,
    write_party_files,
)

from protocols import tls
from secure_vfl.checkpoints import MANIFEST_FILE, TENSORS_FILE, step_directory, written_steps
from secure_vfl.cli import main
from secure_vfl.deployment import (
    CHECKPOINTED_KEYS,
    DeployedCheckpoints,
    ServedCheckpoints,
    _body,
    _deployment,
    _end_failed,
    _reported_bytes,
)
from secure_vfl.errors import ProtocolError
from secure_vfl.experiment import TrainConfig, build_method
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.federation_file import read_federation
from secure_vfl.federation.messages import DeploymentMessage
from secure_vfl.federation.network import free_loopback_ports
from secure_vfl.federation.parties import DataParty
from secure_vfl.federation.parts import sha256
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import in_process_parties

pytestmark = pytest.mark.processes  # party processes, loopback endpoints, deadlines

EVERY = "3"
EPOCHS = ["--epochs", "6"]  # 18 steps: still training when killed after the commit of step 3


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deploy-resume")
    write_party_files(directory)
    tls.make_federation(directory / "certs", [*PARTIES, "aggregator"])
    return directory


def start_federation(
    site: Path,
    processes: Processes,
    tmp_path: Path,
    phase: str,
    *flags: str,
    resume: bool,
    fresh: tuple[str, ...] = (),
) -> tuple[PartyProcess, list[PartyProcess]]:
    """The three data parties (each with its own checkpoint directory), the aggregator and
    the label party (checkpoints every 3 steps into its --out), logs named by ``phase``; on
    ``resume`` every data party serves with --resume but those ``fresh``."""
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    command = ["party", "serve", "--federation", str(federation), "--name"]
    servers = []
    for name in PARTIES[1:]:
        own = ["--checkpoint-dir", str(tmp_path / f"{name}-checkpoints")]
        own += ["--resume"] if resume and name not in fresh else []
        servers.append(processes.start(*command, name, *own, log=f"{name}-{phase}"))
    servers.append(processes.start(*command, "aggregator", log=f"aggregator-{phase}"))
    out = tmp_path / "out"
    label = processes.start(
        "train", "--federation", str(federation), "--name", "bank", *flags_for([*EPOCHS, *flags]),
        "--checkpoint-every", EVERY, "--out", str(out),
        *(["--resume", str(out)] if resume else []), log=f"bank-{phase}",
    )  # fmt: skip
    return label, servers


def kill_after_a_commit(
    processes: Processes,
    label: PartyProcess,
    servers: list[PartyProcess],
    out: Path,
) -> int:
    """SIGKILL every process once the label party has committed a checkpoint (the label
    party first, so that no party is declared lost); the step it committed last."""
    end = time.monotonic() + PROCESS_SECONDS
    while not written_steps(out / "checkpoints", "bank"):
        assert time.monotonic() < end and label.poll() is None, processes.log("bank-killed")
        time.sleep(0.02)
    for process in (label, *servers):
        os.kill(process.pid, signal.SIGKILL)
    for process in (label, *servers):
        assert process.wait(timeout=30) == -signal.SIGKILL, "the run ended before its kill"
    assert not (out / "result.json").exists()
    return written_steps(out / "checkpoints", "bank")[-1]


def finish(label: PartyProcess, servers: list[PartyProcess]) -> tuple[int, list[int]]:
    """The exit codes of the label party and of every serving party."""
    code = label.wait(timeout=PROCESS_SECONDS)
    return code, [server.wait(timeout=PROCESS_SECONDS) for server in servers]


def resume_and_compare(
    site: Path, processes: Processes, tmp_path: Path, step: int, *flags: str
) -> None:
    """Restart every party with --resume: the run goes on from ``step`` (each data party
    restores its own checkpoint) and ends with the uninterrupted run's losses and metrics."""
    label, servers = start_federation(site, processes, tmp_path, "resumed", *flags, resume=True)
    code, codes = finish(label, servers)
    assert code == 0, processes.log("bank-resumed")
    assert codes == [0, 0, 0, 0], [processes.log(f"{n}-resumed") for n in PARTIES[1:]]
    for name in PARTIES[1:]:
        assert f"{name}: restored its checkpoint of step {step}" in processes.log(f"{name}-resumed")
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["checkpoints"]["resumed_from_step"] == step
    whole = in_process(site, tmp_path / "whole", *flags, *EPOCHS)
    assert result["epoch_loss"] == whole["epoch_loss"]
    assert result["metrics"] == whole["metrics"]


def test_a_killed_federation_refuses_a_tampered_party_checkpoint_and_resumes_from_intact_ones(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    flags = ("--method", "laser", "--heads", "all")
    label, servers = start_federation(site, processes, tmp_path, "killed", *flags, resume=False)
    step = kill_after_a_commit(processes, label, servers, tmp_path / "out")
    for name in PARTIES[1:]:  # each party's own checkpoint of the committed step, in its own
        assert step in written_steps(tmp_path / f"{name}-checkpoints", name)  # directory
    tensors = step_directory(tmp_path / "insurer-checkpoints", "insurer", step) / TENSORS_FILE
    intact = tensors.read_bytes()
    tensors.write_bytes(intact[:-64] + bytes(64))
    label, servers = start_federation(site, processes, tmp_path, "tampered", *flags, resume=True)
    code, codes = finish(label, servers)
    log = processes.log("bank-tampered")
    assert code == 2, log
    [error] = [line for line in log.splitlines() if line.startswith("secure-vfl: error:")]
    assert f"insurer refuses its checkpoint of step {step}" in error, error
    assert "corrupt or truncated" in error, error
    assert "could not end the run" not in log, log  # every party told, none left waiting
    assert codes == [1, 1, 1, 1]  # the run failed at every party, before anything trained
    assert "first training step" not in processes.log("shop-tampered")
    assert not (tmp_path / "out" / "result.json").exists()
    tensors.write_bytes(intact)
    # A data file changed since the kill: resumed, the run went on over other rows in silence.
    data = site / "insurer.csv"
    original = data.read_bytes()
    frame = pd.read_csv(data)
    frame.iloc[:, 1] = np.random.default_rng(0).permutation(frame.iloc[:, 1].to_numpy())
    frame.to_csv(data, index=False)
    try:
        label, servers = start_federation(site, processes, tmp_path, "changed", *flags, resume=True)
        code, codes = finish(label, servers)
    finally:
        data.write_bytes(original)  # the module's other tests read it
    log = processes.log("bank-changed")
    assert code == 2, log
    [error] = [line for line in log.splitlines() if line.startswith("secure-vfl: error:")]
    assert "insurer's checkpoint was trained on other rows" in error, error
    assert codes == [1, 1, 1, 1] and not (tmp_path / "out" / "result.json").exists()
    resume_and_compare(site, processes, tmp_path, step, *flags)


def test_a_killed_federation_resumes_under_masks_with_fresh_keys_to_the_uninterrupted_metrics(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    flags = ("--method", "laser", "--heads", "active", "--secure-agg", "masks")
    label, servers = start_federation(site, processes, tmp_path, "killed", *flags, resume=False)
    step = kill_after_a_commit(processes, label, servers, tmp_path / "out")
    resume_and_compare(site, processes, tmp_path, step, *flags)


def test_a_killed_false_vfl_federation_resumes_to_the_uninterrupted_metrics(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    """FALSE-VFL's two stages resume too: each data party its encoder and decoder and their
    optimiser in its own process, the label party its label-side model and both stages'
    optimisers."""
    flags = ("--method", "false-vfl-1")
    label, servers = start_federation(site, processes, tmp_path, "killed", *flags, resume=False)
    step = kill_after_a_commit(processes, label, servers, tmp_path / "out")
    resume_and_compare(site, processes, tmp_path, step, *flags)


@pytest.mark.parametrize("secure_agg", ["none", "masks"])
def test_a_federation_killed_after_losing_a_party_resumes_without_it_until_it_rejoins(
    site: Path, processes: Processes, tmp_path: Path, secure_agg: str
) -> None:
    # telco is killed once step 3 is committed; the run goes on without it and commits a
    # later step without its checkpoint; then every process is killed. The resumed run keeps
    # telco lost (its fault on record) until the restarted telco is readmitted at an epoch
    # boundary. Under masks the resumed run's key set-up asked the lost telco for its keys,
    # which it refused as a party never set up: the resume failed.
    flags = ("--method", "laser", "--heads", "active", "--secure-agg", secure_agg)
    out = tmp_path / "out"
    label, servers = start_federation(site, processes, tmp_path, "killed", *flags, resume=False)
    telco = servers[PARTIES.index("telco") - 1]
    end = time.monotonic() + PROCESS_SECONDS
    while not written_steps(out / "checkpoints", "bank"):
        assert time.monotonic() < end and label.poll() is None, processes.log("bank-killed")
        time.sleep(0.02)
    os.kill(telco.pid, signal.SIGKILL)
    telco.wait(timeout=30)

    def committed_without_telco() -> int | None:
        for step in reversed(written_steps(out / "checkpoints", "bank")):
            manifest = step_directory(out / "checkpoints", "bank", step) / MANIFEST_FILE
            try:
                if "telco" not in json.loads(manifest.read_text())["parties"]:
                    return step
            except (OSError, ValueError):
                pass  # dropped meanwhile
        return None

    while committed_without_telco() is None:
        assert time.monotonic() < end and label.poll() is None, processes.log("bank-killed")
        time.sleep(0.02)
    for process in (label, *servers):
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    assert not (out / "result.json").exists(), "the run ended before its kill"
    step = written_steps(out / "checkpoints", "bank")[-1]
    assert committed_without_telco() == step
    label, servers = start_federation(
        site, processes, tmp_path, "resumed", *flags, resume=True, fresh=("telco",)
    )
    code, codes = finish(label, servers)
    assert code == 0, processes.log("bank-resumed")
    assert codes == [0, 0, 0, 0], [processes.log(f"{n}-resumed") for n in PARTIES[1:]]
    result = json.loads((out / "result.json").read_text())
    assert result["checkpoints"]["resumed_from_step"] == step
    lost, rejoined = result["faults"]
    assert lost["party"] == "telco" and lost["step"] <= step and lost["phase"] == "training"
    assert rejoined["party"] == "telco" and rejoined["what"] == "rejoined"
    assert rejoined["step"] > step and (rejoined["step"] - 1) % 3 == 0  # an epoch boundary
    for name in ("shop", "insurer"):
        assert f"{name}: restored its checkpoint of step {step}" in processes.log(f"{name}-resumed")
    assert "restored its checkpoint" not in processes.log("telco-resumed")


MESSAGES = "the parties receiving its messages, who know which rows each step used"


def _lost(log: str, name: str) -> int:
    """How many releases of the killed run ``name`` priced again after its resume (its log)."""
    found = re.findall(rf"{name}: (\d+) release\(s\) of the killed run after", log)
    return int(found[0]) if found else 0


def test_a_killed_dp_federation_resumes_each_accountant_and_view_of_the_batches_in_its_process(
    site: Path, processes: Processes, tmp_path: Path
) -> None:
    # A batch as large as the training set (rate 1: every record in every step), so that the
    # epsilons do not depend on the Poisson sample, and 12 steps (one an epoch).
    flags = ("--method", "laser", "--heads", "active", "--batch-size", "256")
    flags += ("--dp-sgd", "1.0:0.05", "--dp-embeddings", "1.0:1.0", "--dp-gradients", "1.0:0.01")
    epochs = ("--epochs", "12")
    label, servers = start_federation(
        site, processes, tmp_path, "killed", *flags, *epochs, resume=False
    )
    step = kill_after_a_commit(processes, label, servers, tmp_path / "out")
    label, servers = start_federation(
        site, processes, tmp_path, "resumed", *flags, *epochs, resume=True
    )
    code, codes = finish(label, servers)
    assert code == 0, processes.log("bank-resumed")
    assert codes == [0, 0, 0, 0], [processes.log(f"{n}-resumed") for n in PARTIES[1:]]
    privacy = json.loads((tmp_path / "out" / "result.json").read_text())["privacy"]
    alone = in_process(site, tmp_path / "alone", *flags, *epochs)["privacy"]
    for name in PARTIES:
        log = processes.log(f"{name}-resumed")
        if name != "bank":
            assert f"{name}: restored its checkpoint of step {step}" in log
        lost = _lost(log, name)  # releases after the checkpoint, before the kill
        releases, whole = privacy["releases"][name], alone["releases"][name]
        # The accountant went on: every release of the uninterrupted run, and those of the
        # killed run after its checkpoint once more (its DP-SGD steps there, discarded, too).
        assert releases["dp-sgd"] == whole["dp-sgd"] == 12  # the kept model's steps
        assert set(releases) - set(whole) <= {"dp-sgd-discarded"}
        assert sum(releases.values()) == sum(whole.values()) + lost
        # The model's guarantee is the uninterrupted run's; the messages' counts every
        # release the receivers saw, over the rows of every step (the checkpointed view of
        # the batches included: without it the first steps' rows would go uncharged).
        [model] = [g for g in privacy["guarantees"][name] if g["amplification"]]
        [whole_model] = [g for g in alone["guarantees"][name] if g["amplification"]]
        assert model["epsilon"] == pytest.approx(whole_model["epsilon"], rel=1e-9)
        [messages, whole_messages] = [
            next(g for g in found["guarantees"][name] if g["observer"] == MESSAGES)
            for found in (privacy, alone)
        ]
        if lost:
            assert messages["epsilon"] > whole_messages["epsilon"]
        else:
            assert messages["epsilon"] == pytest.approx(whole_messages["epsilon"], rel=1e-9)


# -- the message checks, without processes -------------------------------------------------

RUN = "0123456789abcdef"


@pytest.fixture
def party(make_data: MakeData) -> DataParty:
    """A data party with a bottom model, a head and their optimisers (LASER, heads="all")."""
    config = TrainConfig(
        method="laser",
        dataset="synthetic",
        method_config=MethodConfig(epochs=1, batch_size=64, representation_dim=8),
    )
    channel = Channel()
    build_method(config, make_data(), channel=channel)
    return in_process_parties(channel)[1]


def _params(party: DataParty) -> dict[str, torch.Tensor]:
    return {
        f"{module}.{key}": value.detach().clone()
        for module, m in party.own_modules().items()
        for key, value in m.state_dict().items()
    }


def _fresh(every: int = 3) -> dict[str, Any]:
    return {
        "run": RUN,
        "every": every,
        "step": 0,
        "manifest": None,
        "committed": None,
        "rejoin": False,
    }


def _step(step: int, committed: int | None, run: str = RUN) -> dict[str, Any]:
    return {"run": run, "step": step, "committed": committed}


def test_a_served_party_writes_its_checkpoint_only_on_a_request_that_checks_out(
    tmp_path: Path, party: DataParty
) -> None:
    served = ServedCheckpoints("shop", tmp_path, resume=False)
    with pytest.raises(ProtocolError, match="announced by `checkpoints` expected"):
        served.write(party, _step(3, None))  # before the run's `checkpoints`
    with pytest.raises(ProtocolError, match="16 hex digits"):
        served.start(party, {**_fresh(), "run": "../../elsewhere"})
    assert served.start(party, _fresh()) == {"run": RUN, "step": 0}
    with pytest.raises(ProtocolError, match="a second `checkpoints`"):
        served.start(party, _fresh())
    answer = served.write(party, _step(3, None))
    manifest = step_directory(tmp_path, "shop", 3) / MANIFEST_FILE
    assert answer == {"run": RUN, "step": 3, "manifest": sha256(manifest.read_bytes())}
    refusals = {
        "a replay, or out of order": _step(3, None),  # the same step again
        "last commit 3 expected": _step(6, None),  # not the label party's last commit
        "found run 'fedcba9876543210'": _step(6, 3, run="fedcba9876543210"),
    }
    for reason, body in refusals.items():
        with pytest.raises(ProtocolError, match=reason):
            served.write(party, body)
    served.write(party, _step(6, 3))
    assert written_steps(tmp_path, "shop") == [3, 6]  # 3 is kept until 6 is committed
    served.write(party, _step(9, 6))
    assert written_steps(tmp_path, "shop") == [6, 9]
    assert [p.name for p in tmp_path.iterdir()] == ["shop"]  # nothing outside its directory


def test_a_resuming_party_restores_its_own_checkpoint_and_refuses_any_other(
    tmp_path: Path, party: DataParty
) -> None:
    writer = ServedCheckpoints("shop", tmp_path, resume=False)
    writer.start(party, _fresh())
    digest = writer.write(party, _step(3, None))["manifest"]
    saved = _params(party)
    with torch.no_grad():
        for module in party.own_modules().values():
            for value in module.parameters():
                value.add_(1.0)  # the party moved on after its checkpoint
    shutil.copytree(tmp_path / "shop", tmp_path / "insurer")  # another party's checkpoint
    resume = {"run": RUN, "every": 3, "step": 3, "manifest": digest, "committed": 3}
    resume["rejoin"] = False
    refusals = {
        "manifest the label party recorded for step 3 expected": {**resume, "manifest": "0" * 64},
        "run_id 'fedcba9876543210' expected": {**resume, "run": "fedcba9876543210"},
        "shop's checkpoint of step 6 expected; found none": {**resume, "step": 6, "committed": 6},
        "the label party's last commit": {**resume, "committed": 2},
        "serves with --resume; the label party starts a fresh run": _fresh(),
    }
    for reason, body in refusals.items():
        served = ServedCheckpoints("shop", tmp_path, resume=True)
        with pytest.raises(ProtocolError, match=reason) as refused:
            served.start(party, body)
        assert str(refused.value).startswith("shop ")  # the party is named
        with pytest.raises(ProtocolError, match="serves with --resume"):
            served.check_ready("forward-request")  # nothing trains after a refusal
    other = ServedCheckpoints("insurer", tmp_path, resume=True)
    with pytest.raises(ProtocolError, match="checkpoint of party 'insurer' expected, found 'shop'"):
        other.start(party, resume)
    tensors = step_directory(tmp_path, "shop", 3) / TENSORS_FILE
    intact = tensors.read_bytes()
    tensors.write_bytes(intact[:-64] + bytes(64))
    with pytest.raises(ProtocolError, match=r"shop refuses its checkpoint of step 3.*corrupt"):
        ServedCheckpoints("shop", tmp_path, resume=True).start(party, resume)
    tensors.write_bytes(intact)
    not_resuming = ServedCheckpoints("shop", tmp_path, resume=False)
    with pytest.raises(ProtocolError, match="serves without --resume"):
        not_resuming.start(party, resume)
    nowhere = ServedCheckpoints("shop", None, resume=False)
    with pytest.raises(ProtocolError, match="--checkpoint-dir DIR"):
        nowhere.start(party, _fresh())
    served = ServedCheckpoints("shop", tmp_path, resume=True)
    assert served.start(party, resume) == {"run": RUN, "step": 3}
    served.check_ready("forward-request")
    restored = _params(party)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[name], saved[name]) for name in saved)
    # The next checkpoint follows the restored one (the label party's commit is step 3).
    assert served.write(party, _step(6, 3))["step"] == 6


class LoopbackEndpoint:
    """The label party's endpoint for the message checks: a request is answered at once by
    ``answer`` (the serving side), each answer kept until received."""

    name = "bank"

    def __init__(self, answer: Callable[[DeploymentMessage], tuple[str, dict[str, Any]]]):
        self.answer = answer
        self.handler: Any = "the label party"
        self.kept: list[DeploymentMessage] = []

    def send(self, message: DeploymentMessage) -> None:
        assert self.handler is None  # the answers must not reach the label party's handler
        topic, body = self.answer(message)
        header = {"sender": message.receiver, "receiver": self.name, "round": 0}
        self.kept.append(
            DeploymentMessage(**header, batch_id=0, topic=topic, body=json.dumps(body))
        )

    def receive(self, *, sender: str, kind: str) -> DeploymentMessage:
        [message] = [m for m in self.kept if m.sender == sender and m.kind == kind]
        self.kept.remove(message)
        return message


def test_the_label_party_takes_every_party_checkpoint_and_checks_every_answer(
    tmp_path: Path, party: DataParty
) -> None:
    federation = read_federation(write_federation(tmp_path, tmp_path, free_loopback_ports(5)))
    served = {name: ServedCheckpoints(name, tmp_path / name, resume=False) for name in PARTIES}
    lie: dict[str, Any] = {}

    def answer(message: DeploymentMessage) -> tuple[str, dict[str, Any]]:
        side, body = served[message.receiver], json.loads(message.body)
        if message.topic == "checkpoints":
            return "checkpoints-ready", side.start(party, body)
        return "checkpointed", {**side.write(party, body), **lie}

    endpoint = LoopbackEndpoint(answer)
    label = DeployedCheckpoints(endpoint, federation)  # type: ignore[arg-type]
    assert label.names == list(PARTIES[1:])  # the aggregator keeps nothing between steps
    label.start(RUN, every=3, resume=None)
    manifests = label.write(3, RUN, committed=None, parties=["shop", "telco"])  # insurer lost
    assert sorted(manifests) == ["shop", "telco"]
    for name, digest in manifests.items():
        manifest = step_directory(tmp_path / name, name, 3) / MANIFEST_FILE
        assert digest == sha256(manifest.read_bytes())
    assert endpoint.handler == "the label party"  # handed back after the answers
    # A party that answers for another step, or without a manifest's SHA-256, is refused.
    lie.update(step=5)
    with pytest.raises(ProtocolError, match="run 0123456789abcdef, step 6 and a manifest"):
        label.write(6, RUN, committed=3, parties=["shop"])
    lie.clear()
    lie.update(manifest="not a digest")
    with pytest.raises(
        ProtocolError, match=re.escape("found {'run': '0123456789abcdef', 'step': 9}, ")
    ):
        label.write(9, RUN, committed=6, parties=["shop"])
    assert endpoint.kept == []


def test_a_stopped_runs_end_skips_a_checkpoint_answer_still_in_flight() -> None:
    """Ctrl-C while the parties wrote a checkpoint: the end took their 'checkpointed' answer
    for the report ("a deployment 'report' message expected; found 'checkpointed'") and lost
    the report."""

    class Endpoint:
        name = "bank"

        def __init__(self) -> None:
            def answer(topic: str, body: dict[str, Any]) -> DeploymentMessage:
                header = {"sender": "shop", "receiver": "bank", "round": 0, "batch_id": 0}
                return DeploymentMessage(**header, topic=topic, body=json.dumps(body))

            self.queue = [  # what the party sent: the stopped run's answer, then its report
                answer("checkpointed", {"run": RUN, "step": 6, "manifest": "0" * 64}),
                answer("report", {"bytes": [["shop", "bank", "train", 10]], "privacy": None}),
            ]

        def send_all(self, messages: Any, *, deadline: float, failed: dict[str, Any]) -> None:
            pass

        def receive(self, seconds: float, *, sender: str, kind: str) -> DeploymentMessage:
            return self.queue.pop(0)

    ends = [_deployment("bank", "shop", "end", {"outcome": "interrupted"})]
    bodies = _end_failed(cast(Any, Endpoint()), ["shop"], ends, 1.0)
    assert bodies == {"shop": {"bytes": [["shop", "bank", "train", 10]], "privacy": None}}


def test_an_answer_nested_beyond_the_json_parser_is_refused_as_a_protocol_error() -> None:
    """json.loads raises RecursionError, not a JSON error, on such a body: it must not escape
    as a crash of the label party."""
    deep = "[" * 100_000 + "]" * 100_000
    header = {"sender": "shop", "receiver": "bank", "round": 0, "batch_id": 0}
    message = DeploymentMessage(**header, topic="checkpointed", body=deep)
    with pytest.raises(ProtocolError, match=r"checkpointed from shop: JSON expected \(nested"):
        _body(message, "checkpointed", CHECKPOINTED_KEYS)


def test_a_rejoined_party_restores_its_last_committed_checkpoint_and_takes_the_next_ones(
    tmp_path: Path, party: DataParty
) -> None:
    federation = read_federation(write_federation(tmp_path, tmp_path, free_loopback_ports(5)))
    served = {name: ServedCheckpoints(name, tmp_path / name, resume=False) for name in PARTIES}

    def answer(message: DeploymentMessage) -> tuple[str, dict[str, Any]]:
        side, body = served[message.receiver], json.loads(message.body)
        if message.topic == "checkpoints":
            return "checkpoints-ready", side.start(party, body)
        return "checkpointed", side.write(party, body)

    label = DeployedCheckpoints(LoopbackEndpoint(answer), federation)  # type: ignore[arg-type]
    label.start(RUN, every=3, resume=None)
    label.write(3, RUN, committed=None, parties=["shop", "insurer", "telco"])
    trained = _params(party)  # what shop's checkpoint of step 3 holds
    label.write(6, RUN, committed=3, parties=["insurer", "telco"])  # shop lost after step 3
    assert label.held["shop"][0] == 3 and label.held["insurer"][0] == 6
    # shop's operator restarts it: a new process, whose checkpoints know nothing of the run,
    # and whose models are its initial ones.
    with torch.no_grad():
        for module in party.own_modules().values():
            for parameter in module.parameters():
                parameter.add_(1.0)
    initial = _params(party)
    served["shop"] = ServedCheckpoints("shop", tmp_path / "shop", resume=False)
    with pytest.raises(ProtocolError, match="announced by `checkpoints` expected"):
        label.write(9, RUN, committed=6, parties=["shop"])  # what a rejoin without it hit
    # Restarted where its checkpoints are not (another machine): it rejoins from its initial
    # models.
    served["shop"] = ServedCheckpoints("shop", tmp_path / "elsewhere", resume=False)
    assert label.rejoined("shop") == 0
    assert all(torch.equal(value, initial[key]) for key, value in _params(party).items())
    # A checkpoint that is not the one committed is refused (it stays lost).
    held = label.held["shop"]
    label.held["shop"] = (3, "0" * 64)
    served["shop"] = ServedCheckpoints("shop", tmp_path / "shop", resume=False)
    with pytest.raises(ProtocolError, match="refuses its checkpoint of step 3"):
        label.rejoined("shop")
    # With its directory, it restores its checkpoint in the last commit that held it.
    label.held["shop"] = held
    served["shop"] = ServedCheckpoints("shop", tmp_path / "shop", resume=False)
    assert label.rejoined("shop") == 3
    assert all(torch.equal(value, trained[key]) for key, value in _params(party).items())
    manifests = label.write(9, RUN, committed=6, parties=["shop", "insurer", "telco"])
    assert sorted(manifests) == ["insurer", "shop", "telco"]
    assert written_steps(tmp_path / "shop", "shop") == [9]  # the old incarnation's 3 dropped
    # A restarted party that cannot keep checkpoints refuses the rejoin (it stays lost).
    for refusing, reason in [
        (ServedCheckpoints("shop", None, resume=False), "--checkpoint-dir DIR"),
        (ServedCheckpoints("shop", tmp_path / "shop", resume=True), "serves with --resume"),
    ]:
        served["shop"] = refusing
        with pytest.raises(ProtocolError, match=reason):
            label.rejoined("shop")


def test_serving_checkpoint_flags_that_cannot_apply_are_refused_before_serving(
    site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    serve = ["party", "serve", "--federation", str(federation), "--wait", "1", "--name"]
    empty = tmp_path / "empty"
    refusals = {
        (*serve, "aggregator", "--checkpoint-dir", str(empty)): "aggregation server keeps nothing",
        (*serve, "shop", "--resume"): "--resume needs --checkpoint-dir DIR",
        (*serve, "shop", "--resume", "--checkpoint-dir", str(empty)): "a checkpoint of shop "
        f"expected under {empty / 'shop'}; found none",
        ("train", "--federation", str(federation), "--name", "bank", "--method", "laser",
         "--quiet", "--wait", "1", "--out", str(tmp_path / "o"), "--resume", str(empty)):
        f"--resume {empty}: the --out of a killed run (or its checkpoints directory) expected; "
        "found nothing there",
        ("train", "--federation", str(federation), "--name", "bank", "--method", "laser",
         "--quiet", "--wait", "1", "--out", str(tmp_path / "o"), "--resume", str(tmp_path)):
        "a checkpoint of the label party bank expected",
    }  # fmt: skip
    for argv, reason in refusals.items():
        capsys.readouterr()
        assert main(list(argv)) == 2
        out, err = capsys.readouterr()
        assert reason in err and "serving at" not in out, (argv, err)
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "entry",
    [
        ["shop", "bank", "train"],
        ["shop", "bank", "train", "12"],
        ["shop", "bank", "train", -1],
        ["shop", "bank", "train", True],
        ["shop", "bank", 3, 12],
        {"sender": "shop"},
        ["bank", "shop", "train", 12],
    ],
)
def test_a_report_of_bytes_that_is_not_the_reporters_own_count_is_refused(entry: Any) -> None:
    good = ["shop", "bank", "train", 7]
    assert _reported_bytes("shop", [good, good]) == {("shop", "bank", "train"): 14}
    with pytest.raises(ProtocolError, match=r"^report from shop: (bytes as|bytes sent by)"):
        _reported_bytes("shop", [good, entry])
