"""Checkpoints and resume: a run killed after a checkpoint and resumed ends with exactly the
model and metrics of an uninterrupted run; a bad checkpoint is refused before anything trains."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MakeData
from test_faults import LosingChannel

from protocols.privacy import PrivacyEngine, PrivacySpec
from protocols.secagg import MaskingAggregator
from secure_vfl.checkpoints import (
    MANIFEST_FILE,
    STATE_FILE,
    TENSORS_FILE,
    CheckpointPlan,
    find_resume_point,
    journal_path,
    party_state,
    restore_party_state,
    step_directory,
    write_checkpoint,
    written_steps,
)
from secure_vfl.cli import main
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import (
    ConfigError,
    DataError,
    IntegrityError,
    ProtocolError,
    TransportError,
    run_warnings,
)
from secure_vfl.experiment import TrainConfig, TrainResult, run_training
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parties import DataParty
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import in_process_parties

EVERY = 5
STOP = 13  # killed 3 steps after the checkpoint of step 10


class Killed(Exception):
    """Stands in for the process dying at a step."""


def _kill_at(step_to_die: int) -> Any:
    def on_step(step: int, loss: float) -> None:
        if step == step_to_die:
            raise Killed(step)

    return on_step


def _config(
    *, secure: bool = False, epochs: int = 3, lr: float = 0.03, method: str = "laser"
) -> TrainConfig:
    return TrainConfig(
        method=method,
        dataset="synthetic",
        method_config=MethodConfig(
            heads="active" if secure else "all",
            epochs=epochs,
            batch_size=64,
            lr=lr,
            representation_dim=16,
            secure_sums=secure,
        ),
    )


def _states(channel: Channel) -> dict[str, dict[str, torch.Tensor]]:
    """Every party's trained modules, by party and module."""
    return {
        party.name: {
            f"{module}.{key}": value.detach().clone()
            for module, m in party.own_modules().items()
            for key, value in m.state_dict().items()
        }
        for party in in_process_parties(channel)
    }


def _train(
    config: TrainConfig,
    data: VerticalData,
    *,
    plan: CheckpointPlan | None = None,
    on_step: Any = None,
    secure: bool = False,
    privacy: PrivacyEngine | None = None,
    channel: Channel | None = None,
) -> tuple[TrainResult, Channel]:
    channel = channel if channel is not None else Channel()
    result = run_training(
        config,
        data=data,
        channel=channel,
        aggregator=MaskingAggregator() if secure else None,
        privacy=privacy,
        on_step=on_step,
        checkpoints=plan,
    )
    return result, channel


def _settings(config: TrainConfig) -> dict[str, Any]:
    return config.to_json()


def _killed_then_resumed(
    tmp_path: Path, config: TrainConfig, data: VerticalData, *, stop: int = STOP, **kwargs: Any
) -> tuple[TrainResult, Channel]:
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    with pytest.raises(Killed):
        _train(config, data, plan=plan, on_step=_kill_at(stop), **kwargs)
    # The older checkpoints were dropped.
    assert written_steps(tmp_path, "party-0") == [stop - stop % EVERY]
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    resume = CheckpointPlan(
        directory=tmp_path, every=EVERY, resume=point, settings=_settings(config)
    )
    return _train(config, data, plan=resume, **kwargs)


def _assert_same_run(
    whole: TrainResult, whole_channel: Channel, resumed: TrainResult, resumed_channel: Channel
) -> None:
    """The resumed run ended as the uninterrupted one: its losses, metrics and every module."""
    assert resumed.epoch_loss == whole.epoch_loss
    assert resumed.metrics == whole.metrics
    expected, found = _states(whole_channel), _states(resumed_channel)
    assert expected.keys() == found.keys()
    for party, modules in expected.items():
        assert modules.keys() == found[party].keys()
        for name, value in modules.items():
            assert torch.equal(value, found[party][name]), (party, name)


@pytest.mark.parametrize(
    ("method", "secure", "batching"),
    [
        ("laser", False, "mixed"),
        ("laser", True, "mixed"),
        ("laser", False, "grouped"),
        ("plugvfl", False, "mixed"),
        ("combinatorial", False, "mixed"),
    ],
    ids=["laser-plaintext", "laser-masks", "laser-grouped", "plugvfl", "combinatorial"],
)
def test_a_killed_run_resumed_from_its_checkpoint_equals_an_uninterrupted_run(
    tmp_path: Path,
    make_data: MakeData,
    one_thread: None,
    method: str,
    secure: bool,
    batching: str,
) -> None:
    config = _config(secure=secure, method=method)
    config = dataclasses.replace(
        config, method_config=dataclasses.replace(config.method_config, batching=batching)
    )
    data = make_data(train_missing="mcar:0.3")
    whole, whole_channel = _train(config, data, secure=secure)
    resumed, resumed_channel = _killed_then_resumed(tmp_path, config, data, secure=secure)
    _assert_same_run(whole, whole_channel, resumed, resumed_channel)


def test_a_resumed_runs_traffic_is_per_step_of_the_steps_it_trained(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """Its bytes are those of the steps after its checkpoint: divided by every step of the run,
    its bytes per step read 11 of 21 steps' bytes as a whole run's (about half the true)."""
    config = _config()
    data = make_data()
    whole, _ = _train(config, data)
    resumed, _ = _killed_then_resumed(tmp_path, config, data)
    traffic = resumed.traffic
    assert traffic["train_steps"] == whole.traffic["train_steps"] - (STOP - STOP % EVERY) > 0
    for party, sent in traffic["bytes"].items():
        assert traffic["bytes_per_step"][party] == sent["train"] / traffic["train_steps"]
    party = whole.traffic["bytes_per_step"]["party-1"]
    assert traffic["bytes_per_step"]["party-1"] == pytest.approx(party, rel=0.2)


def test_a_pretrained_run_resumes_to_the_uninterrupted_run(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """SimSiam pretraining left its last batch's gradient on every bottom model: the first step
    of a run took it in, and a resumed run, pretrained again, took it into the step after its
    checkpoint (the losses parted from the epoch of the checkpoint on)."""
    config = _config()
    config = dataclasses.replace(
        config, method_config=dataclasses.replace(config.method_config, pretrain_epochs=1)
    )
    data = make_data(train_missing="mcar:0.3")
    whole, whole_channel = _train(config, data)
    resumed, resumed_channel = _killed_then_resumed(tmp_path, config, data)
    _assert_same_run(whole, whole_channel, resumed, resumed_channel)


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "masks"])
@pytest.mark.parametrize(
    ("method", "stop"),
    [("false-vfl-1", 13), ("false-vfl-2", 13), ("false-vfl-1", 33)],
    ids=["variant-1-stage-1", "variant-2-stage-1", "variant-1-stage-2"],
)
def test_a_killed_false_vfl_run_resumes_in_either_stage_to_the_uninterrupted_run(
    tmp_path: Path, make_data: MakeData, one_thread: None, method: str, stop: int, secure: bool
) -> None:
    """FALSE-VFL's two stages (here 21 steps each: 3 epochs of 7 batches) count epochs and
    steps on across both, so a run killed in stage 1 (step 13, after the checkpoint of step 10)
    or in stage 2 (step 33, after that of step 30) resumes there: every party's encoder and
    decoder, the label side's model and the optimisers of both stages come back."""
    config = _config(secure=secure, method=method)
    data = make_data(train_missing="mcar:0.3")
    whole, whole_channel = _train(config, data, secure=secure)
    assert len(whole.epoch_loss) == 6  # both stages' epochs
    resumed, resumed_channel = _killed_then_resumed(
        tmp_path, config, data, stop=stop, secure=secure
    )
    _assert_same_run(whole, whole_channel, resumed, resumed_channel)


def test_a_run_that_lost_a_party_resumes_with_it_lost_to_the_uninterrupted_result(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """party-2 is lost at step 8, between the checkpoints of steps 5 and 10: the checkpoint of
    step 10 holds none of it, and the resumed run goes on with its block missing, its fault
    on record, to the result of the run that never stopped."""
    config = _config()
    lost_at = 7  # the round (0-based) in which party-2 goes

    def data() -> VerticalData:  # a loss marks the run's own data: each run gets its own
        return make_data(train_missing="mcar:0.3")

    whole, _ = _train(config, data(), channel=LosingChannel("represent-request", step=lost_at))
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    with pytest.raises(Killed):
        _train(
            config,
            data(),
            plan=plan,
            on_step=_kill_at(STOP),
            channel=LosingChannel("represent-request", step=lost_at),
        )
    assert not (tmp_path / "party-2" / "step-00000010").exists()
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    assert point.dropped == ["party-2"] and "party-2" not in point.parties
    resume = CheckpointPlan(directory=tmp_path, resume=point, settings=_settings(config))
    resumed, _ = _train(config, data(), plan=resume)  # nothing is lost in this one
    assert resumed.faults == whole.faults
    assert [(f["party"], f["step"]) for f in resumed.faults] == [("party-2", lost_at + 1)]
    assert resumed.epoch_loss == whole.epoch_loss
    assert resumed.metrics == whole.metrics


class DyingElsewhere:
    """party-2 as a party elsewhere (a deployment's process) that writes its own checkpoint
    when asked, until its process dies after training step ``dies_after``: from its
    checkpoint request of that step on, asking fails and ``channel`` reports it unreachable.
    With ``refuses``, it stays reachable and refuses instead (a protocol error, not a loss)."""

    def __init__(
        self, channel: LosingChannel, root: Path, dies_after: int, *, refuses: bool = False
    ) -> None:
        self.names = ["party-2"]
        self.channel, self.root, self.dies_after, self.refuses = channel, root, dies_after, refuses
        self.asked: list[tuple[int, list[str]]] = []

    def start(self, run_id: str, *, every: int, resume: object) -> None:
        pass

    def write(
        self, step: int, run_id: str, *, committed: int | None, parties: list[str]
    ) -> dict[str, str]:
        self.asked.append((step, list(parties)))
        if step >= self.dies_after:
            if self.refuses:
                raise ProtocolError("party-2 refused checkpoint: not the step it expected")
            self.channel.lost = True
            raise TransportError("checkpoint to party-2: its process is gone")
        party = self.channel.parties["party-2"]
        assert isinstance(party, DataParty)
        tensors, meta = party_state(party)
        return {
            "party-2": write_checkpoint(
                self.root, "party-2", run_id=run_id, step=step, tensors=tensors, meta=meta
            )
        }


def test_a_party_elsewhere_that_died_before_its_checkpoint_is_dropped_and_the_step_committed(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """party-2's process dies between step 10 and its checkpoint request: it is dropped there
    (``"phase": "checkpoint"``), step 10 is committed without it, nothing is sent to it again
    and the run finishes; killed at step 13, the run resumes from that commit, with party-2
    lost, to the same result. A party that refuses but still answers fails the run."""
    config = _config()

    def run(on_step: Any = None, **plan: Any) -> tuple[TrainResult, LosingChannel]:
        channel = LosingChannel("none: lost by its checkpoint request")
        elsewhere = DyingElsewhere(channel, tmp_path / "ckpt", 2 * EVERY, **plan)
        checkpoints = CheckpointPlan(
            directory=tmp_path / "ckpt",
            every=EVERY,
            settings=_settings(config),
            elsewhere=elsewhere,
        )
        result, _ = _train(config, make_data(), plan=checkpoints, on_step=on_step, channel=channel)
        assert elsewhere.asked[:2] == [(EVERY, ["party-2"]), (2 * EVERY, ["party-2"])]
        return result, channel

    whole, channel = run()
    [fault] = [dict(fault) for fault in whole.faults]
    assert fault.pop("epoch") >= 1
    assert fault == {
        "party": "party-2",
        "step": 2 * EVERY,
        "phase": "checkpoint",
        "what": "checkpoint to party-2: its process is gone",
    }
    assert channel.after_loss == 0  # never asked for anything again, checkpoints included
    shutil.rmtree(tmp_path / "ckpt")
    with pytest.raises(Killed):
        run(on_step=_kill_at(STOP))
    point = find_resume_point(tmp_path / "ckpt", label_party="party-0", settings=_settings(config))
    assert point.step == 2 * EVERY
    assert point.dropped == ["party-2"] and sorted(point.label.parties) == ["party-1", "party-3"]
    resume = CheckpointPlan(directory=tmp_path / "ckpt", resume=point, settings=_settings(config))
    resumed, _ = _train(config, make_data(), plan=resume)
    assert resumed.faults == whole.faults
    assert resumed.epoch_loss == whole.epoch_loss
    assert resumed.metrics == whole.metrics
    # Refused by a party that still answers: a protocol error, and the run fails on it.
    shutil.rmtree(tmp_path / "ckpt")
    with pytest.raises(ProtocolError, match="not the step it expected"):
        run(refuses=True)


def test_a_resume_that_loses_the_optimiser_state_would_differ(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """The control of the test above: momentum lost at the resume changes the model, so the
    equality there is the checkpoint's doing."""
    config = _config()
    data = make_data(train_missing="mcar:0.3")
    whole, _ = _train(config, data)
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    with pytest.raises(Killed):
        _train(config, data, plan=plan, on_step=_kill_at(STOP))
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    for optimiser in point.label.tensors["optimizers"].values():
        for state in optimiser.values():
            state["momentum_buffer"].zero_()
    lossy, _ = _train(
        config,
        data,
        plan=CheckpointPlan(directory=tmp_path, resume=point, settings=_settings(config)),
    )
    assert lossy.epoch_loss != whole.epoch_loss


def _first(mapping: dict[str, Any]) -> Any:
    return mapping[next(iter(mapping))]


def _last_batch(change: Any) -> Any:
    """An alteration of a checkpoint: the last batch of its epoch's order made ``change(it)``."""

    def alter(tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        order = tensors["run"]["order"]
        order[-1] = change(order[-1].clone())

    return alter


@pytest.mark.parametrize(
    ("alter", "message"),
    [
        (
            lambda tensors, meta: _first(meta["optimizers"])["param_groups"][0].update(lr=0.5),
            "the parameter groups of this run's settings expected; they differ at group 0, lr",
        ),
        (
            lambda tensors, meta: _first(meta["optimizers"]).update(state=[]),
            "its state and parameter groups expected; found otherwise",
        ),
        (
            lambda tensors, meta: _first(meta["optimizers"])["state"].update(
                {"0": {"momentum_buffer": "zeros"}}
            ),
            "state 'momentum_buffer' of parameter 0: a tensor, a number or null expected",
        ),
        (
            lambda tensors, meta: _first(tensors["optimizers"])["0"].update(
                momentum_buffer=torch.zeros(3)
            ),
            "state 'momentum_buffer' of shape (128, 4) expected, found (3,).",
        ),
        (  # a 0-dim buffer was taken for a scalar and torch's sgd raised at the first step
            lambda tensors, meta: _first(tensors["optimizers"])["0"].update(
                momentum_buffer=torch.tensor(0.5)
            ),
            "state 'momentum_buffer' of shape (128, 4) expected, found ().",
        ),
        (  # numpy's OverflowError came through as a traceback
            lambda tensors, meta: meta["run"]["epoch_generator"]["state"].update(state=-1),
            "a run position expected, found otherwise (Python integer -1 out of bounds",
        ),
        (  # a fault without its keys: the summary raised KeyError after result.json was written
            lambda tensors, meta: meta["run"].update(faults=[{"party": "party-1"}]),
            "(a fault entry's keys ['epoch', 'party', 'phase', 'step', 'what'] expected, found "
            "['party']).",
        ),
        (
            lambda tensors, meta: meta["run"].update(
                faults=[
                    {"party": "party-1", "step": "2", "epoch": 1, "phase": "training", "what": ""}
                ]
            ),
            '(a fault entry\'s `step` of type int expected, found str "2").',
        ),
        (
            lambda tensors, meta: meta.update(generators=[]),
            "random generators by name expected",
        ),
        # positions no run reaches: an epoch of -5 trained 55 more epochs, one of 1000000
        # ended the run at once as finished, and a batch beyond the epoch was taken
        (
            lambda tensors, meta: meta["run"]["progress"].update(epoch=-5),
            "a run position expected, found otherwise (counts >= 0 expected, found epoch -5)",
        ),
        (
            lambda tensors, meta: meta["run"]["progress"].update(epoch=10**6),
            "(one loss per finished epoch expected, found 1 for epoch 1000000)",
        ),
        (
            lambda tensors, meta: meta["run"]["progress"].update(batch=10**6),
            "expected, found 1000000)",
        ),
        # positions that were only checked against each other: an epoch past the run's
        # (--epochs 3) trained none and reported 50 losses, a batch of 1.5 was taken for 1
        (
            lambda tensors, meta: meta["run"]["progress"].update(epoch=50, losses=[0.5] * 50),
            "(fewer finished epochs than the run's 3 expected, found 50)",
        ),
        (
            lambda tensors, meta: meta["run"]["progress"].update(epoch=2, losses=[0.5, 0.5]),
            "(step 17 after 2 epoch(s) and 3 batch(es) of this run expected, found step 10)",
        ),
        (
            lambda tensors, meta: meta["run"]["progress"].update(step=9),
            "(step 10 (its manifest's) expected, found step 9)",
        ),
        (
            lambda tensors, meta: meta["run"]["progress"].update(batch=1.5),
            "(an integer batch expected, found 1.5)",
        ),
        (
            lambda tensors, meta: meta["run"]["progress"].update(losses=[float("inf")]),
            "(a finite loss of epoch 1 expected, found inf)",
        ),
        (
            lambda tensors, meta: meta["run"]["progress"].update(losses=["0.5"]),
            "(a number as the epoch loss expected, found '0.5')",
        ),
        (
            lambda tensors, meta: meta["run"]["progress"].update(count=10**6),
            "rows (those of the epoch's 3 batch(es) done) expected, found 1000000)",
        ),
        # batch orders the sampler never draws: an index out of range was an IndexError
        # mid-run, a 2-D batch a ValueError; bool and repeated indices trained other rows
        (
            _last_batch(lambda batch: batch + 10**6),
            "batch 7 of the epoch's order: row indices in [0, 447) expected, found 1000",
        ),
        (
            _last_batch(lambda batch: batch.reshape(1, -1)),
            "batch 7 of the epoch's order: a 1-D array of row indices expected, found int64 of "
            "shape (1, ",
        ),
        (
            _last_batch(lambda batch: batch > 100),
            "batch 7 of the epoch's order: a 1-D array of row indices expected, found bool",
        ),
        (
            _last_batch(lambda batch: torch.cat([batch[:1], batch[:-1]])),
            "an epoch's batch order that holds each of its 447 rows once expected; found row ",
        ),
    ],
)
def test_a_checkpoint_whose_state_this_run_would_not_hold_is_refused_before_training(
    tmp_path: Path, make_data: MakeData, one_thread: None, alter: Any, message: str
) -> None:
    """A checkpoint is the user's file: optimiser settings other than the run's, or state of
    another type or shape, is an IntegrityError naming it, not a crash at the first step."""
    config = _config()
    data = make_data()
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    with pytest.raises(Killed):
        _train(config, data, plan=plan, on_step=_kill_at(STOP))
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    alter(point.label.tensors, point.label.meta)
    resume = CheckpointPlan(directory=tmp_path, resume=point, settings=_settings(config))
    with pytest.raises(IntegrityError, match=re.escape(message)):
        _train(config, data, plan=resume)


def test_checkpoints_leave_an_uninterrupted_run_unchanged_and_write_each_party_apart(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    config = _config(epochs=2)
    data = make_data()
    plain, _ = _train(config, data)
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    checked, _ = _train(config, data, plan=plan)
    assert checked.epoch_loss == plain.epoch_loss and checked.metrics == plain.metrics
    steps = checked.traffic["train_steps"]
    last = steps - steps % EVERY
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"party-{k}" for k in range(4)]
    label = json.loads((step_directory(tmp_path, "party-0", last) / MANIFEST_FILE).read_text())
    assert label["step"] == last and sorted(label["parties"]) == ["party-1", "party-2", "party-3"]
    for k in range(1, 4):
        manifest = json.loads(
            (step_directory(tmp_path, f"party-{k}", last) / MANIFEST_FILE).read_text()
        )
        assert manifest["party"] == f"party-{k}" and manifest["run_id"] == label["run_id"]
        assert sorted(manifest["files"]) == [STATE_FILE, TENSORS_FILE]
        state = json.loads((step_directory(tmp_path, f"party-{k}", last) / STATE_FILE).read_text())
        assert "run" not in state and "settings" not in state  # only the label party's
        assert written_steps(tmp_path, f"party-{k}") == [last]


def test_resume_refuses_another_configuration_naming_the_first_differing_field(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    config = _config(epochs=1)
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    _train(config, make_data(), plan=plan)
    other = _config(epochs=1, lr=0.1)
    with pytest.raises(ConfigError, match=r"`method_config\.lr` differs.*0\.03.*0\.1"):
        find_resume_point(tmp_path, label_party="party-0", settings=_settings(other))


def _checkpointed(tmp_path: Path, make_data: MakeData) -> tuple[TrainConfig, Path]:
    config = _config(epochs=1)
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    _train(config, make_data(), plan=plan)
    step = written_steps(tmp_path, "party-0")[-1]
    return config, step_directory(tmp_path, "party-2", step)


def _resume(tmp_path: Path, config: TrainConfig) -> None:
    find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))


def test_a_truncated_tensor_file_is_refused_with_its_hash(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    config, directory = _checkpointed(tmp_path, make_data)
    data = (directory / TENSORS_FILE).read_bytes()
    (directory / TENSORS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(
        IntegrityError, match=r"party-2.*tensors\.safetensors.*expected.*found.*truncated"
    ):
        _resume(tmp_path, config)


def test_a_directory_or_dead_link_in_a_checkpoint_files_place_is_named_as_such(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """Either was refused as "found none (truncated?)"."""
    config, directory = _checkpointed(tmp_path, make_data)
    (directory / STATE_FILE).unlink()
    (directory / STATE_FILE).mkdir()
    with pytest.raises(
        IntegrityError, match=r"state\.json: a checkpoint file expected; found a dir"
    ):
        _resume(tmp_path, config)
    (directory / STATE_FILE).rmdir()
    (directory / STATE_FILE).symlink_to(tmp_path / "nowhere")
    with pytest.raises(IntegrityError, match=r"file expected; found a link to nothing\.$"):
        _resume(tmp_path, config)


def test_a_checkpoint_whose_manifest_was_altered_is_refused(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    config, directory = _checkpointed(tmp_path, make_data)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest["run_id"] = "another-run"
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match=r"the label party recorded.*expected.*found another"):
        _resume(tmp_path, config)


def test_a_checkpoint_of_an_earlier_version_is_refused_with_what_to_do(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """Version 1 kept its tensors in a torch.save file; this secure-vfl reads none."""
    config, directory = _checkpointed(tmp_path, make_data)
    label = directory.parent.parent / "party-0" / directory.name
    manifest = json.loads((label / MANIFEST_FILE).read_text())
    (label / MANIFEST_FILE).write_text(json.dumps({**manifest, "version": 1}))
    with pytest.raises(DataError, match=r"checkpoint version 2 expected, found 1 .*train afresh"):
        _resume(tmp_path, config)


def test_another_partys_checkpoint_in_its_place_is_refused(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    config, directory = _checkpointed(tmp_path, make_data)
    other = directory.parent.parent / "party-3" / directory.name
    for name in (MANIFEST_FILE, STATE_FILE, TENSORS_FILE):
        (directory / name).write_bytes((other / name).read_bytes())
    # Its manifest is not the one recorded for party-2, nor does it name party-2.
    with pytest.raises(IntegrityError, match="party-2"):
        _resume(tmp_path, config)


def test_a_label_checkpoint_that_is_not_json_is_refused(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    config, directory = _checkpointed(tmp_path, make_data)
    label = directory.parent.parent / "party-0" / directory.name
    (label / MANIFEST_FILE).write_text('{"schema": "secure-vfl/checkpoint", "ver')
    with pytest.raises(DataError, match="JSON expected"):
        _resume(tmp_path, config)


def test_a_checkpoint_of_another_run_is_refused(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    config, directory = _checkpointed(tmp_path, make_data)
    # A second run (another run id) checkpoints into another directory; its party-2 is moved in.
    second = tmp_path.parent / f"{tmp_path.name}-second"
    _train(
        config,
        make_data(),
        plan=CheckpointPlan(directory=second, every=EVERY, settings=_settings(config)),
    )
    foreign = step_directory(second, "party-2", int(directory.name.split("-")[1]))
    for name in (MANIFEST_FILE, STATE_FILE, TENSORS_FILE):
        (directory / name).write_bytes((foreign / name).read_bytes())
    with pytest.raises(IntegrityError, match="expected"):
        _resume(tmp_path, config)


def test_a_resume_on_other_training_rows_is_refused_by_the_party_whose_rows_changed(
    tmp_path: Path, make_data: MakeData
) -> None:
    """A data file changed between the kill and the resume: the run went on over other rows,
    mixing two datasets without a word."""
    config = _config()
    data = make_data(train_missing="mcar:0")
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    with pytest.raises(Killed):
        _train(config, data, plan=plan, on_step=_kill_at(STOP))
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    resume = CheckpointPlan(
        directory=tmp_path, every=EVERY, resume=point, settings=_settings(config)
    )
    blocks = list(data.train.blocks)
    blocks[2] = blocks[2][np.random.default_rng(0).permutation(len(blocks[2]))]
    shuffled = dataclasses.replace(
        data, train=dataclasses.replace(data.train, blocks=tuple(blocks))
    )
    with pytest.raises(IntegrityError, match=r"party-2's checkpoint was trained on other rows"):
        _train(config, shuffled, plan=resume)
    relabelled = dataclasses.replace(
        data, train=dataclasses.replace(data.train, labels=np.roll(data.train.labels, 1))
    )
    with pytest.raises(IntegrityError, match=r"party-0's checkpoint was trained on other rows"):
        _train(config, relabelled, plan=resume)


def test_resume_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"label party party-0 expected.*found none"):
        find_resume_point(tmp_path, label_party="party-0", settings={})


CLI_RUN = [
    "train",
    "--method",
    "laser",
    "--dataset",
    "breast-cancer",
    "--epochs",
    "1",
    "--batch-size",
    "64",
    "--quiet",
]


def _killed_cli_run(out: Path, *argv: str) -> int:
    """A `train` run with checkpoints every 3 steps, as its kill leaves it: its checkpoints
    and no result; the step of its latest."""
    assert main([*CLI_RUN, *argv, "--checkpoint-every", "3", "--out", str(out)]) == 0
    (out / "result.json").unlink()
    shutil.rmtree(out / "model")
    return written_steps(out / "checkpoints", "party-0")[-1]


def test_a_resume_into_another_runs_checkpoint_dir_is_refused_and_keeps_them(
    tmp_path: Path, one_thread: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh run into a --checkpoint-dir holding another run's checkpoints is refused; a
    resumed one went ahead and its first checkpoint removed them."""
    killed = tmp_path / "killed"
    _killed_cli_run(killed)
    other = tmp_path / "other"
    another = ["--seed", "1", "--checkpoint-every", "4", "--checkpoint-dir", str(other)]
    assert main([*CLI_RUN, *another, "--out", str(tmp_path / "o")]) == 0
    steps = written_steps(other, "party-0")
    capsys.readouterr()
    argv = [*CLI_RUN, "--checkpoint-every", "1", "--resume", str(killed)]
    assert main([*argv, "--checkpoint-dir", str(other), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint-dir {other} holds the checkpoints of another run" in err
    assert "expected another directory, or --overwrite" in err
    assert written_steps(other, "party-0") == steps
    mine = tmp_path / "mine"  # the resumed run's own, from a resume into it before, go on
    assert main([*argv, "--checkpoint-dir", str(mine), "--out", str(tmp_path / "r1")]) == 0
    assert main([*argv, "--checkpoint-dir", str(mine), "--out", str(tmp_path / "r2")]) == 0


def _dp_engine(**kwargs: Any) -> PrivacyEngine:
    return PrivacyEngine(PrivacySpec(dp_gradients=(1.0, 0.1), dp_sgd=(1.0, 0.1), **kwargs))


def _events(channel: Channel) -> dict[str, list[tuple[Any, ...]]]:
    """Every party's releases, as sortable tuples (the order of a step's releases may differ)."""
    return {
        party.name: sorted(
            tuple(json.dumps(v) for v in dataclasses.asdict(e).values())
            for e in party.accountant.events
        )
        for party in in_process_parties(channel)
    }


def test_a_resumed_dp_run_prices_the_whole_run_and_the_killed_runs_lost_releases(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """DP noise differs after a resume (fresh noise), so the model may differ; what must not is
    the privacy spent: the accountants go on from the releases they had checkpointed, and each
    adds those its journal recorded after the checkpoint (steps 10-12, seen by their receivers
    before the kill, released again by the resumed run), the killed run's DP-SGD steps among
    them (their model made the messages sent after them) but not in the model guarantee (the
    resumed run discards that model)."""
    config = _config()
    data = make_data(train_missing="mcar:0")
    whole, uninterrupted = _train(
        config, data, privacy=_dp_engine(insecure_reproducible_noise=True)
    )
    with run_warnings() as noted:  # a run warning (it was a log line, not in result.json)
        resumed, channel = _killed_then_resumed(
            tmp_path, config, data, privacy=_dp_engine(insecure_reproducible_noise=True)
        )
    assert any(
        re.fullmatch(r"party-0: \d+ release\(s\) of the killed run .* too .*", w) for w in noted
    ), noted
    assert whole.privacy is not None and resumed.privacy is not None
    for key in ("sampling", "noise"):
        assert resumed.privacy[key] == whole.privacy[key], key
    for name, releases in whole.privacy["releases"].items():
        again = resumed.privacy["releases"][name]
        assert again["dp-sgd"] == releases["dp-sgd"]  # the steps of the model it kept
        assert again["dp-sgd-discarded"] > 0  # and the killed run's after its checkpoint
        assert again["gradient"] > releases["gradient"]
        assert resumed.privacy["epsilon"][name] > whole.privacy["epsilon"][name]
        (model,) = [g for g in resumed.privacy["guarantees"][name] if g["amplification"]]
        assert model in whole.privacy["guarantees"][name]  # the final model's: unchanged
        # Against the receivers: the lost steps are releases of their own, in the count too.
        (messages,) = [
            g
            for g in resumed.privacy["guarantees"][name]
            if g["observer"].startswith("the parties")
        ]
        (before,) = [
            g for g in whole.privacy["guarantees"][name] if g["observer"].startswith("the parties")
        ]
        assert messages["releases"] > before["releases"], (messages, before)
    # Exactly the uninterrupted run's releases, and those of the lost steps once more; what
    # the resumed run released itself is its second attempt at its steps.
    expected = {}
    for party in in_process_parties(uninterrupted):
        events = party.accountant.events
        # The killed run's last step: the label party's head held the gradients that close the
        # other parties' steps for its next messages, which the kill kept from them, so their
        # DP-SGD steps of that round never ran.
        unsent = party.name != "party-0"
        twice = [
            dataclasses.replace(e, discarded=e.kind == "dp-sgd")
            for e in events
            if 10 <= e.round < STOP and not (unsent and e.kind == "dp-sgd" and e.round == STOP - 1)
        ]
        kept = [e for e in events if e.phase == "train" and e.round < 10]
        again = [dataclasses.replace(e, attempt=1) for e in events if e not in kept]
        expected[party.name] = [*kept, *twice, *again]
    assert _events(channel) == {
        name: sorted(tuple(json.dumps(v) for v in dataclasses.asdict(e).values()) for e in events)
        for name, events in expected.items()
    }


def _dp_killed(old: Path, data: VerticalData) -> tuple[TrainConfig, dict[str, Any]]:
    """A DP run checkpointed into ``old`` and killed 3 steps after its checkpoint of step 10."""
    config, settings = _config(), _settings(_config())
    with pytest.raises(Killed):
        plan = CheckpointPlan(directory=old, every=EVERY, settings=settings)
        _train(config, data, plan=plan, on_step=_kill_at(STOP), privacy=_dp_engine())
    return config, settings


def _assert_priced(
    result: TrainResult, engine: PrivacyEngine, discarded: int, *, kills: int
) -> None:
    """Every draw once in the model kept, and the steps after each kill's checkpoint apart:
    ``discarded`` at the label party; one fewer a kill at the others, whose step the label
    party's head closes with the gradients it holds for its next messages, which the kill
    kept from them."""
    assert result.privacy is not None and engine.poisson is not None
    for name, releases in result.privacy["releases"].items():
        assert releases["dp-sgd"] == engine.poisson.draws, name
        lost = 0 if name == "party-0" else kills
        assert releases["dp-sgd-discarded"] == discarded - lost, name


def test_a_dp_run_resumed_into_another_directory_journals_there_and_resumes_from_it(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """A DP resume with its checkpoints in a new directory looked for the killed run's
    release journal there ("... expected; found none"): it is read beside the checkpoint, and
    goes on beside the new checkpoints, from which the run resumes again."""
    data = make_data(train_missing="mcar:0")
    old, new = tmp_path / "old", tmp_path / "new"
    config, settings = _dp_killed(old, data)
    journals = [journal_path(old, f"party-{k}").read_text() for k in range(4)]
    point = find_resume_point(old, label_party="party-0", settings=settings)
    with pytest.raises(Killed):  # killed again, 3 steps after its checkpoint of step 20
        plan = CheckpointPlan(directory=new, every=EVERY, resume=point, settings=settings)
        _train(config, data, plan=plan, on_step=_kill_at(23), privacy=_dp_engine())
    assert [journal_path(old, f"party-{k}").read_text() for k in range(4)] == journals
    assert written_steps(new, "party-0") == [20]
    point = find_resume_point(new, label_party="party-0", settings=settings)
    engine = _dp_engine()
    plan = CheckpointPlan(directory=new, resume=point, settings=settings)
    result, _ = _train(config, data, plan=plan, privacy=engine)
    _assert_priced(result, engine, (STOP - 10) + (23 - 20), kills=2)


def test_a_second_resume_from_one_checkpoint_into_another_directory_prices_every_kill(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """Resumed from old/ into new/ and killed again before new/ held a checkpoint, a run
    resumed from old/ once more read old/'s journal (the first kill's releases only) and wrote
    new/'s anew, erasing the second process's: 3 lost steps priced of 7."""
    data = make_data(train_missing="mcar:0")
    old, new = tmp_path / "old", tmp_path / "new"
    config, settings = _dp_killed(old, data)
    point = find_resume_point(old, label_party="party-0", settings=settings)
    plan = CheckpointPlan(directory=new, every=EVERY, resume=point, settings=settings)
    with pytest.raises(Killed):  # killed at 14, before new/ holds its checkpoint of 20
        _train(config, data, plan=plan, on_step=_kill_at(14), privacy=_dp_engine())
    assert written_steps(new, "party-0") == []
    point = find_resume_point(old, label_party="party-0", settings=settings)
    engine = _dp_engine()
    plan = CheckpointPlan(directory=new, every=EVERY, resume=point, settings=settings)
    result, _ = _train(config, data, plan=plan, privacy=engine)
    _assert_priced(result, engine, (STOP - 10) + (14 - 10), kills=2)


def test_a_release_journal_that_does_not_fit_its_checkpoint_is_refused(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    config = _config()
    data = make_data(train_missing="mcar:0")
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    with pytest.raises(Killed):
        _train(config, data, plan=plan, on_step=_kill_at(STOP), privacy=_dp_engine())
    journal = journal_path(tmp_path, "party-2")
    lines = journal.read_text().splitlines(keepends=True)
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    resume = CheckpointPlan(directory=tmp_path, resume=point, settings=_settings(config))
    cases = {
        "found none": None,
        "line 2: a release as": [lines[0], "{not json\n", *lines[2:]],
        "a release of run": [lines[0].replace(point.run_id, "0" * 16), *lines[1:]],
        "that do not": lines[1:],
    }
    for message, changed in cases.items():
        journal.unlink(missing_ok=True)
        if changed is not None:
            journal.write_text("".join(changed))
        with pytest.raises(IntegrityError, match=message):
            _train(config, data, plan=resume, privacy=_dp_engine())
    # The checkpoint's own releases must be a list of releases.
    journal.write_text("".join(lines))
    kept = point.label.meta["accountant"]
    point.label.meta["accountant"] = True
    with pytest.raises(IntegrityError, match="the accountant's releases as a list of objects"):
        _train(config, data, plan=resume, privacy=_dp_engine())
    point.label.meta["accountant"] = kept
    # A last line cut short by the kill: its release never left the party.
    journal.write_text("".join(lines) + lines[-1][:20])
    result, channel = _train(config, data, plan=resume, privacy=_dp_engine())
    (party,) = [p for p in in_process_parties(channel) if p.name == "party-2"]
    kept = [json.loads(line)["release"] for line in journal.read_text().splitlines()]
    assert kept == party.accountant.to_json()  # the journal, rewritten, holds every release
    assert result.privacy is not None


def test_a_resumed_dp_run_keeps_its_secure_poisson_schedule(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    """With the secure source the schedule is drawn once, from the OS, by the killed run: the
    resumed run trains on that schedule, not on a fresh draw."""
    config = _config()
    data = make_data(train_missing="mcar:0")
    killed = _dp_engine()
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    with pytest.raises(Killed):
        _train(config, data, plan=plan, on_step=_kill_at(STOP), privacy=killed)
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    again = _dp_engine()
    result, _ = _train(
        config,
        data,
        plan=CheckpointPlan(directory=tmp_path, resume=point, settings=_settings(config)),
        privacy=again,
    )
    assert killed.poisson is not None and again.poisson is not None
    assert [b.tolist() for b in again.poisson.schedule] == [
        b.tolist() for b in killed.poisson.schedule
    ]
    assert result.privacy is not None
    releases = result.privacy["releases"]["party-0"]
    # Every step of the schedule once, and apart the killed run's steps after its last
    # checkpoint (step 10), whose model was discarded.
    # (one step per draw, an empty one included: a noise-only step)
    assert releases["dp-sgd"] == len(killed.poisson.schedule) == killed.poisson.draws
    assert releases["dp-sgd-discarded"] == STOP - 10


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda draw: draw + 10**6, "row indices in [0, 450) expected, found 1000"),
        (lambda draw: draw.reshape(1, -1), "a 1-D array of row indices expected, found int64"),
        (lambda draw: draw.double(), "a 1-D array of row indices expected, found float64"),
        (lambda draw: draw.flip(0), "distinct candidate rows in their order expected; found row"),
        (
            lambda draw: torch.cat([draw[:1], draw]),
            "distinct candidate rows in their order expected; found row",
        ),
    ],
)
def test_a_poisson_schedule_that_was_never_drawn_is_refused_before_training(
    tmp_path: Path, make_data: MakeData, one_thread: None, change: Any, message: str
) -> None:
    """A draw of the checkpointed schedule is a sorted set of candidate rows: an index out of
    range failed with an IndexError after training, a 2-D one with a ValueError, and a float,
    repeated or unsorted one was taken."""
    config = _config()
    data = make_data(train_missing="mcar:0")
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    with pytest.raises(Killed):
        _train(config, data, plan=plan, on_step=_kill_at(STOP), privacy=_dp_engine())
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    schedule = point.label.tensors["run"]["schedule"]
    schedule[-1][0] = change(schedule[-1][0])
    resume = CheckpointPlan(directory=tmp_path, resume=point, settings=_settings(config))
    where = str(step_directory(tmp_path, "party-0", 10))
    expected = f"{where}: draw 1 of epoch 3 of the Poisson schedule: {message}"
    with pytest.raises(IntegrityError, match=re.escape(expected)):
        _train(config, data, plan=resume, privacy=_dp_engine())


def test_a_party_restores_only_a_state_that_fits_it(
    tmp_path: Path, make_data: MakeData, one_thread: None
) -> None:
    config = _config(epochs=1)
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    _train(config, make_data(), plan=plan)
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    wider = TrainConfig(
        method="laser",
        dataset="synthetic",
        method_config=MethodConfig(epochs=1, batch_size=64, representation_dim=32),
    )
    with pytest.raises(IntegrityError, match="does not fit party-"):
        _train(
            wider,
            make_data(),
            plan=CheckpointPlan(directory=tmp_path, resume=point, settings=_settings(config)),
        )


def test_a_party_generator_state_out_of_range_is_refused(
    make_data: MakeData, one_thread: None
) -> None:
    """numpy's OverflowError on a state of -1 came through restore as a traceback."""
    _, channel = _train(_config(epochs=1), make_data())
    party = in_process_parties(channel)[1]
    party.sampling = np.random.default_rng(0)  # a generator of its own, as a role holds
    tensors, meta = party_state(party)
    meta["generators"]["sampling"]["state"]["state"] = -1
    with pytest.raises(IntegrityError, match=r"here: the state does not fit party-1 \(Python int"):
        restore_party_state(party, tensors, meta, where="here")


def test_a_resumed_run_with_reproducible_noise_draws_none_of_the_killed_runs_noise_again(
    tmp_path: Path, make_data: MakeData, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No checkpoint keeps a noise stream's state: under --insecure-reproducible-noise a
    resumed run regenerated each party's streams from (seed, stream), so its steps 10.. drew
    the noise of the killed run's steps 0.. again, and the docs said it drew fresh noise. Its
    streams are now regenerated from (seed, stream, the step it resumed at)."""
    import protocols.privacy

    seeds: list[list[int] | None] = []
    drawn = protocols.privacy.noise_source

    def recorded(seed: list[int] | None) -> Any:
        seeds.append(seed)
        return drawn(seed)

    monkeypatch.setattr(protocols.privacy, "noise_source", recorded)
    config, data = _config(), make_data(train_missing="mcar:0")
    plan = CheckpointPlan(directory=tmp_path, every=EVERY, settings=_settings(config))
    with pytest.raises(Killed):
        _train(
            config,
            data,
            plan=plan,
            on_step=_kill_at(STOP),
            privacy=_dp_engine(insecure_reproducible_noise=True),
        )
    first, seeds[:] = list(seeds), []
    point = find_resume_point(tmp_path, label_party="party-0", settings=_settings(config))
    resume = CheckpointPlan(
        directory=tmp_path, every=EVERY, resume=point, settings=_settings(config)
    )
    _train(config, data, plan=resume, privacy=_dp_engine(insecure_reproducible_noise=True))
    # The Poisson sample's stream (1) is the killed run's (its schedule is restored anyway);
    # every party's mechanism streams go on from the step resumed at.
    assert [0, 1] in first and [0, 1] in seeds
    streams = [seed for seed in first if seed is not None and seed != [0, 1]]
    assert streams and all(len(seed) == 2 for seed in streams)
    resumed = [seed for seed in seeds if seed is not None and seed != [0, 1]]
    step = STOP - STOP % EVERY
    assert sorted(resumed) == sorted([*seed, step] for seed in streams)
