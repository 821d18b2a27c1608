"""The gradient-replacement backdoor as an auditor's experiment: undefended it plants the trigger
without costing clean accuracy (positive control), without poisoning the same trigger does
what it does to the honest model (negative control), the norm filter lowers it at a cost it
reports, and it refuses to run where it cannot see what it filters."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from attacks.backdoor import BackdoorParty, GradientReplacementBackdoor
from attacks.norm_filter import NormFilter
from attacks.runner import AttackResult, parse_defenses, run_attack
from protocols.privacy import PrivacySpec
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig, prepare_data
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import AGGREGATOR
from secure_vfl.federation.parties import DataParty
from secure_vfl.methods import MethodConfig

ATTACK = "gradient-replacement-backdoor"


def _config(method: str = "laser", *, epochs: int = 3, seed: int = 0) -> TrainConfig:
    return TrainConfig(
        method=method,
        dataset="breast-cancer",
        parties=4,
        seed=seed,
        method_config=MethodConfig(heads="active", epochs=epochs, batch_size=64),
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MP*, the honest undefended run, trained once for the whole module."""
    return tmp_path_factory.mktemp("undefended")


@pytest.fixture(scope="module")
def attacked_channel(cache: Path) -> tuple[AttackResult, Channel]:
    channel = Channel()
    return run_attack(_config(), ATTACK, cache=cache, channel=channel), channel


@pytest.fixture(scope="module")
def attacked(attacked_channel: tuple[AttackResult, Channel]) -> AttackResult:
    return attacked_channel[0]


@pytest.fixture(scope="module")
def control(cache: Path) -> AttackResult:
    return run_attack(_config(), ATTACK, control=True, cache=cache)


def test_backdoor_flips_triggered_rows_to_the_target_and_keeps_clean_accuracy(
    attacked_channel: tuple[AttackResult, Channel],
) -> None:
    result, channel = attacked_channel
    assert result.attack["asr"] >= 0.8
    assert result.main["accuracy"] >= result.undefended_accuracy - 0.03
    assert result.attack["untriggered_asr"] <= 0.1  # the trigger does it, not a broken model
    assert result.attack["replaced_gradients"] > 0
    assert result.attack["known_rows"] == 10  # the default `known`: it holds more
    assert result.attack["clean_accuracy"] == result.main["accuracy"]
    # only the attacker changed role
    assert isinstance(channel.parties["party-1"], BackdoorParty)
    assert all(
        type(channel.parties[name]) is DataParty for name in ("party-0", "party-2", "party-3")
    )
    # chance: the model's own rate of predicting the target for those rows without the trigger
    assert result.chance == result.attack["untriggered_asr"]


def test_known_beyond_the_target_rows_held_grants_them_all_and_says_how_many(cache: Path) -> None:
    """`known=100000` was recorded as given, the rows it granted nowhere."""
    config = _config(epochs=1)
    result = run_attack(config, ATTACK, options={"known": 100_000}, cache=cache)
    train = prepare_data(config).train
    held = train.mask[:, 1] & (train.labels == 0)  # the attacker's (party-1) target rows
    assert result.attack["known_rows"] == held.sum() > 10
    assert result.parameters["known"] == 100_000  # as given; the metric says what it meant


def test_without_poisoning_the_trigger_does_what_it_does_to_the_honest_model(
    attacked: AttackResult, control: AttackResult
) -> None:
    # the control trains the honest federation: the same accuracy as the undefended run
    assert control.main["accuracy"] == control.undefended_accuracy
    assert control.attack["replaced_gradients"] == 0 == control.attack["poisoned_rows"]
    assert attacked.attack["poisoned_rows"] > 0
    # the honest model predicts the target for few triggered rows; the backdoor for most
    assert control.attack["asr"] <= 0.1
    assert attacked.attack["asr"] - control.attack["asr"] >= 0.7
    assert abs(control.attack["asr"] - control.chance) <= 0.05  # the control sits at chance


def test_norm_filter_lowers_the_backdoor_and_reports_what_it_dropped(
    attacked: AttackResult, cache: Path
) -> None:
    defended = run_attack(_config(), ATTACK, defenses=["norm-filter:4"], cache=cache)
    assert defended.attack["asr"] <= attacked.attack["asr"] - 0.5
    assert defended.main["accuracy"] >= defended.undefended_accuracy - 0.05
    filtered = defended.defense_reports["norm-filter:4"]
    # at prediction it drops the attacker's triggered rows; honest senders lose few rows
    assert filtered["party-1"]["predict"]["dropped"] >= 71  # the triggered probe rows
    for honest in ("party-0", "party-2", "party-3"):
        counts = filtered[honest]["predict"]
        assert counts["dropped"] <= 0.2 * counts["seen"]
    assert defended.dcs > attacked.dcs
    assert defended.dcs_chance > attacked.dcs_chance  # scored against chance, too
    assert attacked.defense_reports == {}


def test_under_secure_aggregation_no_receiver_sees_a_representation_to_filter() -> None:
    """The survey's point, measured: under secure sums the aggregator holds sealed shares and
    the label party sums, never another party's representation; so the filter is refused."""
    from protocols.privacy import PrivacyEngine
    from secure_vfl.experiment import run_training

    channel = Channel()
    seen: dict[str, RecordingLayer] = {}

    def on_ready(ready: Channel) -> None:
        for name in ("party-0", AGGREGATOR):
            seen[name] = RecordingLayer()
            ready.parties[name].incoming.append(seen[name])

    config = _config("laser", epochs=1)
    secure = replace(config, method_config=replace(config.method_config, secure_sums=True))
    run_training(
        secure,
        channel=channel,
        privacy=PrivacyEngine(PrivacySpec(secure_agg="masks")),
        on_ready=on_ready,
    )
    received = [m for layer in seen.values() for m in layer.messages]
    assert received  # they did receive: sealed shares and sums
    assert not [m for m in received if m.kind == "representation" and m.sender != "party-0"]
    with pytest.raises(ConfigError, match="no receiver sees one"):
        run_attack(config, ATTACK, defenses=["secure-agg:masks", "norm-filter:4"])


def test_norm_filter_refuses_false_vfl_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its parties send a latent variable's (mean, precision): with no attacker it zeroed 15-19 %
    # of the honest rows and the training loss rose from 43 to 1900.
    import attacks.runner

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained")

    monkeypatch.setattr(attacks.runner, "run_training", no_training)
    config = TrainConfig(method="false-vfl-1", dataset="breast-cancer", parties=2)
    with pytest.raises(ConfigError, match="norm-filter does not apply to false-vfl-1"):
        run_attack(config, "passive-model-completion", defenses=["norm-filter"])


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"target": 2}, "not one of the 2 classes"),
        ({"known": 0}, "at least 1 known target row"),
        ({"poison_fraction": 1.5}, r"`poison_fraction` must be in \(0, 1\)"),
        ({"gamma": -1.0}, "`gamma` must be a positive number"),
        (
            {"trigger_columns": 8},
            "a trigger of 8 columns in a block of 7 columns: party-1's block is too narrow. "
            "Expected --attack-option trigger_columns=N with N <= 7",
        ),
        ({"trigger_value": float("inf")}, "trigger_value takes a finite number"),
        ({"swap": "sideways"}, "`swap` must be one of own, target, none"),
        ({"colour": 1}, r"takes the parameters \(target, known.*\)\. Found colour\."),
        # a known parameter of the wrong type is not called unknown
        (
            {"trigger_columns": "abc"},
            r"trigger_columns takes an integer\. Found trigger_columns='abc'",
        ),
    ],
)
def test_bad_backdoor_parameters_are_refused(options: dict[str, float], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        run_attack(_config(epochs=1), ATTACK, options=options)


def test_a_first_test_split_without_the_attackers_rows_is_refused_saying_so() -> None:
    """With nearly every block missing at test time the attacker held no probe row, and the
    refusal said that no row had been set aside for testing (113 had)."""
    config = replace(_config(epochs=1), test_missing=("mcar:0.99",))
    with pytest.raises(ConfigError, match=r"party-1 holds no row of test split 'mcar:0.99'"):
        run_attack(config, ATTACK)


@pytest.mark.parametrize(
    ("defenses", "expected"),
    [
        (["norm-filter:"], "norm-filter:NUMBER expected"),
        (["norm-filter:x"], "norm-filter:NUMBER expected"),
        (["norm-filter:-1"], "threshold must be a positive number"),
        (["norm-filter:4", "norm-filter:3"], "norm-filter given twice"),
    ],
)
def test_a_bad_norm_filter_spec_is_refused(defenses: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_defenses(defenses, PrivacySpec())


def test_norm_filter_alone_takes_its_default_threshold() -> None:
    _, hooks = parse_defenses(["norm-filter"], PrivacySpec())
    assert [hook.spec for hook in hooks] == ["norm-filter:4"]


def test_norm_filter_zeroes_only_rows_far_from_the_senders_recent_norms() -> None:
    import torch

    from secure_vfl.federation.messages import RepresentationMessage

    def message(representation: torch.Tensor, phase: str) -> RepresentationMessage:
        n = representation.shape[0]
        return RepresentationMessage(
            sender="party-1",
            receiver=AGGREGATOR,
            round=0,
            batch_id=0,
            positions=torch.arange(n),
            phase=phase,
            representation=representation,
        )

    layer = NormFilter(4.0, warmup=8)
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(64, 4, generator=generator)
    assert layer.on_message(message(normal, "train")).representation.equal(normal)
    probe = torch.cat([torch.randn(3, 4, generator=generator), 100 * torch.ones(1, 4)])
    out = layer.on_message(message(probe, "predict")).representation
    assert out[:3].equal(probe[:3]) and not out[3].any()
    assert layer.report() == {
        "party-1": {"predict": {"seen": 4, "dropped": 1}, "train": {"seen": 64, "dropped": 0}}
    }


def test_an_attack_option_given_twice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["attack", "--attack", ATTACK, "--dataset", "breast-cancer", "--method", "laser"]
    argv += ["--attack-option", "target=1", "--attack-option", "target=0", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "each --attack-option KEY once expected. Found target repeated" in (
        capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []


def test_attack_command_writes_asr_and_clean_accuracy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "attack",
            "--attack",
            ATTACK,
            "--attack-option",
            "swap=target",
            "--method",
            "laser",
            "--dataset",
            "breast-cancer",
            "--heads",
            "active",
            "--epochs",
            "1",
            "--batch-size",
            "64",
            "--defense",
            "norm-filter:4",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    assert 0 <= result["attack"]["asr"] <= 1
    assert result["attack"]["clean_accuracy"] == result["main"]["accuracy"]
    assert result["defense_reports"]["norm-filter:4"]["party-1"]["train"]["seen"] > 0
    assert GradientReplacementBackdoor().metric == "asr"
    # its summary: counts as whole numbers, values in one column however long a metric's name
    lines = capsys.readouterr().out.splitlines()
    metrics = [line for line in lines if line.startswith(("attack ", "main accuracy", "chance"))]
    starts = {re.match(r"(attack \S+|main accuracy|chance level) +", m).end() for m in metrics}
    assert len(metrics) >= 8 and len(starts) == 1
    poisoned = next(line for line in metrics if line.startswith("attack poisoned_rows"))
    assert re.fullmatch(r"attack poisoned_rows +\d+", poisoned)
    assert re.fullmatch(r"attack asr +\d\.\d{4}", next(m for m in metrics if " asr " in m))
