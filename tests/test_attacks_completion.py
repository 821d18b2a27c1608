"""Model completion (Fu et al., USENIX Security 2022) as an auditor's experiment: a passive
party completes its own trained bottom model with a head from a few labels; its controls are the
same completion from an untrained bottom model and from shuffled labels (chance), and the active
attack's malicious optimiser makes the completed model better.

The task: digits over 2 parties (the attacker holds half of each image), Standard VFL with the
label party's top model, 10 epochs. Measured with seeds 0-4 (balanced accuracy, the attack's
metric): completion 0.72-0.76 against 0.53-0.65 from an untrained bottom model (its chance
level), 1/C = 0.10; the active attack (steps x3) 0.81-0.88. One shuffle of the granted labels is
at chance on average but spread by which of the 40 granted rows keep their own class (about 4):
0.047-0.153 over seeds 0-9 (plain accuracy, measured before balanced accuracy). The control
therefore averages 8 independent shuffles: 0.084-0.129 over seeds 0-9 (seeds 0-2, which the
tests run: 0.121, 0.100, 0.112, at their untrained levels 0.128, 0.092, 0.112).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from attacks.model_completion import (
    ActiveModelCompletion,
    Completion,
    MaliciousOptimiserParty,
    PassiveModelCompletion,
)
from attacks.runner import dcs, run_attack
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import GradientMessage, RepresentRequest, UpdateRequest
from secure_vfl.federation.parties import DataParty
from secure_vfl.methods import MethodConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _digits_split(seed: int = 0, epochs: int = 10) -> TrainConfig:
    return TrainConfig(
        method="standard",
        dataset="digits",
        parties=2,
        seed=seed,
        method_config=MethodConfig(heads="active", epochs=epochs),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_passive_completion_reads_labels_from_the_trained_bottom_and_not_from_shuffled_ones(
    seed: int,
) -> None:
    config = _digits_split(seed)
    channel = Channel()
    attacked = run_attack(config, "passive-model-completion", channel=channel)
    metrics = attacked.attack
    assert metrics["known"] == 40  # 4 rows per class
    assert metrics["balanced_accuracy"] >= 0.65 and metrics["train_accuracy"] >= 0.65
    # what the federation taught the bottom model is the signal: an untrained one does worse,
    # and it is the attack's no-signal level (it was the majority class's share, 0.10)
    assert metrics["balanced_accuracy"] >= metrics["untrained_balanced_accuracy"] + 0.05
    assert attacked.chance == metrics["untrained_balanced_accuracy"] >= 0.4
    assert attacked.dcs_chance == pytest.approx(
        dcs(
            attacked.performance,
            attacked.main["accuracy"],
            attack_star=metrics["untrained_balanced_accuracy"],
            main_star=attacked.undefended_accuracy,
        )
    )
    assert type(channel.parties["party-1"]) is DataParty  # the passive attacker is honest
    control = run_attack(config, "passive-model-completion", control=True)
    assert abs(control.attack["balanced_accuracy"] - control.chance) <= 0.05
    assert control.chance == pytest.approx(0.1, abs=0.05)  # labels shuffled: 1/C
    assert control.main == attacked.main  # the control changes the labels granted, not training


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_active_completion_beats_the_passive_one_and_is_priced_against_an_honest_run(
    seed: int,
) -> None:
    config = _digits_split(seed)
    channel = Channel()
    active = run_attack(config, "active-model-completion", channel=channel)
    passive = run_attack(config, "passive-model-completion")
    assert isinstance(channel.parties["party-1"], MaliciousOptimiserParty)
    assert type(channel.parties["party-0"]) is DataParty
    assert active.attack["balanced_accuracy"] >= passive.attack["balanced_accuracy"] + 0.03
    # the same completion from an untrained bottom model does not depend on how it trained
    assert (
        active.attack["untrained_balanced_accuracy"]
        == (passive.attack["untrained_balanced_accuracy"])
    )
    # MP* is the honest, undefended run's accuracy, not the attacked run's
    assert active.undefended_accuracy == pytest.approx(passive.main["accuracy"])


def _party(role: type[DataParty], x: torch.Tensor) -> DataParty:
    torch.manual_seed(0)
    model = nn.Linear(x.shape[1], 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    return role("party-1", {"train": x}, model, optimizer)


def _step(party: DataParty, step: int, gradient: torch.Tensor) -> list[torch.Tensor]:
    """One training step of ``party`` driven by hand (a request for every row, ``gradient``
    back, an update); returns how far each parameter moved."""
    header = {"sender": "party-0", "receiver": party.name, "round": step, "batch_id": 0}
    rows = torch.arange(gradient.shape[0])
    party.expect("representation", senders=[party.name], round=step, batch_id=0)
    party.on_represent_request(
        RepresentRequest(**header, split="train", rows=rows, positions=rows, reply_to=party.name)
    )
    party.on_gradient(GradientMessage(**header, positions=rows, gradient=gradient))
    before = [p.detach().clone() for p in party.model.parameters()]
    party.on_update(UpdateRequest(**header))
    return [p.detach() - b for p, b in zip(party.model.parameters(), before, strict=True)]


def test_the_malicious_optimiser_steps_scale_times_as_far_as_the_honest_one() -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    gradient = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    honest, malicious = _party(DataParty, x), _party(MaliciousOptimiserParty, x)
    assert isinstance(malicious, MaliciousOptimiserParty)
    malicious.step_scale = 3.0
    for step in range(2):  # the second step carries momentum
        honest_moves, malicious_moves = (
            _step(honest, step, gradient),
            _step(malicious, step, gradient),
        )
        for honest_move, malicious_move in zip(honest_moves, malicious_moves, strict=True):
            assert honest_move.abs().sum() > 0
            assert torch.allclose(malicious_move, 3.0 * honest_move, atol=1e-6)


def test_model_completion_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ConfigError, match="at least 1 known row per class"):
        PassiveModelCompletion(known=0)
    with pytest.raises(ConfigError, match="scale >= 1"):
        ActiveModelCompletion(scale=0.5)
    with pytest.raises(ConfigError, match="threshold"):
        Completion(threshold=1.5)
    with pytest.raises(ConfigError, match="passive data party"):
        run_attack(_digits_split(epochs=1), "passive-model-completion", attacker="party-0")
    every_head = TrainConfig(
        method="laser", dataset="digits", parties=2, method_config=MethodConfig(epochs=1)
    )
    with pytest.raises(ConfigError, match=r"party-1 holds a head.*--heads active"):
        run_attack(every_head, "passive-model-completion")
    heads_everywhere = TrainConfig(
        method="ensemble", dataset="digits", parties=2, method_config=MethodConfig(epochs=1)
    )
    with pytest.raises(ConfigError, match=r"party-1 holds a head.*stay with the label party"):
        run_attack(heads_everywhere, "passive-model-completion")


def test_completion_granted_every_training_row_reports_no_train_accuracy() -> None:
    # wine: 142 training rows, at most 57 of a class; 100 per class grants them all, and an
    # accuracy over no rows was NaN (written as null, printed as nan)
    config = TrainConfig(
        method="standard", dataset="wine", parties=2, method_config=MethodConfig(epochs=1)
    )
    attacked = run_attack(config, "passive-model-completion", options={"known": 100})
    assert attacked.attack["known"] == 142
    assert "train_accuracy" not in attacked.attack
    assert 0 <= attacked.attack["accuracy"] <= 1


def test_attack_command_runs_model_completion(tmp_path: Path) -> None:
    out = tmp_path / "completion"
    code = main(
        [
            "attack",
            "--attack",
            "passive-model-completion",
            "--method",
            "standard",
            "--dataset",
            "digits",
            "--parties",
            "2",
            "--epochs",
            "1",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    assert result["attack_name"] == "passive-model-completion"
    assert 0 <= result["attack"]["accuracy"] <= 1
    assert 0 <= result["attack"]["untrained_accuracy"] <= 1
    assert 0 < result["dcs"] <= 1
    assert result["performance"] == result["attack"]["balanced_accuracy"]  # its AP
    # `runs compare` and `runs list` say which attack ran under which defense, and its score
    # (four runs differing in defense or control read as one before)
    from secure_vfl.runs import summarise_run
    from secure_vfl.store import ResultsStore

    score = (result["performance"], result["chance"], result["dcs_chance"])
    assert summarise_run(out).score == pytest.approx(score)
    [row] = ResultsStore(tmp_path / "results.sqlite").rows()
    assert row["metrics"]["score"]["performance"] == result["performance"]
    assert row["config"]["control"] is False and row["config"]["defense"] == ""


def test_completion_without_a_test_row_the_attacker_holds_is_refused_before_training() -> None:
    """The completed model is scored on the first test split's rows the attacker holds: with
    none, balanced accuracy, AP and DCS were NaN after the whole training."""
    from secure_vfl.experiment import prepare_data

    config = _digits_split(epochs=1)
    data = prepare_data(config)
    attack = PassiveModelCompletion()
    attack.check(config, data, "party-1")  # as prepared: it holds test rows
    [(name, test)] = data.tests.items()
    test.mask[:, 1] = False
    with pytest.raises(ConfigError, match=f"expected at least one. Found none in '{name}'"):
        attack.check(config, data, "party-1")


def test_passive_completion_applies_to_every_method_whose_labels_stay_with_the_label_party() -> (
    None
):
    from attacks.suite import applicable
    from secure_vfl.experiment import prepare_data

    config = TrainConfig(method="false-vfl-1", dataset="digits", parties=4, seed=0)
    verdicts = applicable(config, prepare_data(config))
    # FALSE-VFL has one label party whatever `heads` says, so the passive attack applies
    assert verdicts["passive-model-completion"] is None
    # so do Standard VFL and PlugVFL, with `heads` left at its default ('all')
    for method in ("standard", "plugvfl"):
        config = TrainConfig(method=method, dataset="digits", parties=4, seed=0)
        assert applicable(config, prepare_data(config))["passive-model-completion"] is None
    assert "exchange latent samples and likelihoods" in str(verdicts["active-model-completion"])
