"""The attack suite: every attack that applies, undefended and under each defense, with VFLAIR's
T-DCS per attack kind and C-DCS per defense."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import LABEL_LEAK_RUN

import attacks.suite as suite
from protocols.privacy import PrivacySpec
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError, DivergenceError, RegistryError
from secure_vfl.experiment import TrainConfig, prepare_data
from secure_vfl.methods import MethodConfig
from secure_vfl.store import ResultsStore

SUITE_ARGV = [
    "attack",
    "--suite",
    "all",
    *LABEL_LEAK_RUN,
    "--quiet",
]


def _direct(epochs: int = 1) -> TrainConfig:
    return TrainConfig(
        method="laser",
        dataset="digits",
        parties=4,
        seed=0,
        method_config=MethodConfig(
            heads="active", epochs=epochs, top_model="none", representation_dim=10
        ),
    )


def test_the_suite_runs_what_applies_and_scores_each_defense(tmp_path: Path) -> None:
    report = suite.run_suite(_direct(), defenses=["dp-gradients:3:0.01"], cache=tmp_path / "cache")
    applied = (
        "active-model-completion",
        "direct-label-inference",
        "gradient-replacement-backdoor",
        "passive-model-completion",
        "subset-differencing",  # the label party receives plain sums over subsets
    )
    assert [(r["attack"], r["defense"]) for r in report.runs] == [
        (attack, defense) for attack in applied for defense in ("none", "dp-gradients:3:0.01")
    ]
    # norm and direction scoring need a binary task: skipped, with the reason
    assert "binary task" in report.skipped["norm-scoring"]
    assert "binary task" in report.skipped["direction-scoring"]
    undefended, defended = (r for r in report.runs if r["attack"] == "direct-label-inference")
    assert undefended["value"] >= 0.99 and defended["value"] < 0.5
    # every run keeps its attack's metrics: model completion's untrained control is its chance
    for run in report.runs:
        if run["attack"] == "passive-model-completion":
            assert run["chance"] == run["metrics"]["untrained_balanced_accuracy"] > 0.2
    # T-DCS averages the attacks of a kind and C-DCS the kinds
    assert set(report.t_dcs["none"]) == {"label-inference", "backdoor", "reconstruction"}
    for defense, kinds in report.t_dcs.items():
        for kind, value in kinds.items():
            assert value == pytest.approx(
                statistics.fmean(
                    r["dcs"] for r in report.runs if r["defense"] == defense and r["kind"] == kind
                )
            )
        assert report.c_dcs[defense] == pytest.approx(statistics.fmean(kinds.values()))
    assert (
        report.t_dcs["dp-gradients:3:0.01"]["label-inference"]
        > (report.t_dcs["none"]["label-inference"])
    )
    text = suite.markdown(report, command="test")
    assert "| none | 0." in text and "norm-scoring: " in text


def test_scores_average_over_the_attacks_of_a_kind_then_over_kinds() -> None:
    runs = [
        {"defense": "d", "kind": "a", "dcs": 0.2, "dcs_chance": 0.3},
        {"defense": "d", "kind": "a", "dcs": 0.4, "dcs_chance": 0.5},
        {"defense": "d", "kind": "b", "dcs": 0.9, "dcs_chance": 1.0},
    ]
    t_dcs, c_dcs = suite._scores(runs, "dcs")
    assert t_dcs == {"d": {"a": pytest.approx(0.3), "b": 0.9}}
    assert c_dcs["d"] == pytest.approx(statistics.fmean([0.3, 0.9]))


def test_a_diverged_run_is_reported_not_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    real = suite.run_attack

    def diverging(config: TrainConfig, name: str, **kwargs: Any) -> Any:
        if kwargs["defenses"]:
            raise DivergenceError("training diverged: gradient.gradient: finite values expected")
        return real(config, name, **kwargs)

    monkeypatch.setattr(suite, "run_attack", diverging)
    report = suite.run_suite(_direct(), defenses=["dp-gradients:9:1"])
    assert {r["defense"] for r in report.runs} == {"none"}
    assert "diverged" in report.failed["direct-label-inference / dp-gradients:9:1"]
    assert "Runs that diverged" in suite.markdown(report, command="test")


def test_a_defense_that_does_not_apply_to_the_method_is_reported() -> None:
    config = TrainConfig(
        method="standard",
        dataset="breast-cancer",
        parties=4,
        seed=0,
        method_config=MethodConfig(heads="active", epochs=1, batch_size=64),
    )
    report = suite.run_suite(config, defenses=["secure-agg:masks"])
    assert {r["defense"] for r in report.runs} == {"none"}
    assert "not applicable" in report.failed["norm-scoring / secure-agg:masks"]


def test_a_defense_given_twice_is_refused_before_anything_runs() -> None:
    """`--defense marvell:4 --defense marvell:4` ran it twice, both runs averaged into its
    scores and one of them lost from the store (their rows shared a key); `marvell:4.0` too."""

    def ran(*_: object) -> None:
        raise AssertionError("a run was started")

    for twice in (["marvell:4", "marvell:4"], ["marvell:4", "marvell:4.0"]):
        with pytest.raises(ConfigError, match="each --defense once expected"):
            suite.run_suite(_direct(), defenses=twice, on_run=ran)


def test_a_run_no_attack_applies_to_is_refused() -> None:
    # FALSE-VFL exchanges no representation gradients: only model completion could apply
    config = TrainConfig(method="false-vfl-1", dataset="digits")
    with pytest.raises(ConfigError, match="no attack applies"):
        suite.run_suite(config, attacks=["norm-scoring", "gradient-replacement-backdoor"])
    with pytest.raises(RegistryError, match="unknown attack"):
        suite.run_suite(config, attacks=["no-such-attack"])
    with pytest.raises(ConfigError, match="at least one attack name expected"):
        suite.run_suite(config, attacks=[])
    # What every run shares and its method refuses, or an empty attacker: each run was listed
    # as not applicable, the report written, then the suite exited 1.
    width = MethodConfig(heads="active", top_model="none", epochs=1)
    refused = TrainConfig(method="laser", dataset="digits", method_config=width)
    with pytest.raises(ConfigError, match="representation_dim must equal the 10 classes"):
        suite.run_suite(refused)
    # Not a party at all: said once (it was said once per attack, joined by "; ").
    for attacker in ("", "party-9"):
        with pytest.raises(ConfigError) as refusal:
            suite.run_suite(TrainConfig(method="standard", dataset="digits"), attacker=attacker)
        assert str(refusal.value) == (
            "attacker: a party of this run expected, one of party-0, party-1, party-2, party-3, "
            f"aggregator. Found {attacker!r}."
        )


def test_attack_suite_command_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its runs' warnings (a model that predicts one class scores attacks that mean little)
    were dropped: the suite printed and kept none."""
    real = suite.run_attack
    collapsed = "predictions on test split 'mcar:0' collapsed to one class (stand-in)"

    def warned(config: TrainConfig, name: str, **kwargs: Any) -> Any:
        result = real(config, name, **kwargs)
        if kwargs["defenses"]:
            result.training["warnings"].append(collapsed)
        return result

    monkeypatch.setattr(suite, "run_attack", warned)
    out = tmp_path / "suite"
    argv = [*SUITE_ARGV, "--defense", "dp-gradients:1:0.01", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "suite.json").read_text())
    assert set(report["c_dcs"]) == {"none", "dp-gradients:1:0.01"}
    for run in report["runs"]:
        assert (collapsed in run["warnings"]) == (run["defense"] != "none"), run
    text = (out / "suite.md").read_text()
    assert "C-DCS" in text
    assert f"- direct-label-inference / dp-gradients:1:0.01: {collapsed}" in text
    err = capsys.readouterr().err
    assert f"warning: direct-label-inference / dp-gradients:1:0.01: {collapsed}" in err
    assert main([*argv[:-2], "--dp-gradients", "1:0.01", "--out", str(tmp_path / "x")]) == 2


def test_each_attack_is_played_by_its_own_attacker_unless_one_is_named() -> None:
    config = TrainConfig(
        method="standard",
        dataset="breast-cancer",
        parties=4,
        seed=0,
        method_config=MethodConfig(heads="active", epochs=1, batch_size=64),
    )
    verdicts = suite.applicable(config, prepare_data(config))
    # the reconstruction attacks' default attacker is the label party, the others' party-1
    assert verdicts["feature-reconstruction"] is None
    assert verdicts["norm-scoring"] is None
    named = suite.applicable(config, prepare_data(config), "party-1")
    assert "party-0" in str(named["feature-reconstruction"])
    report = suite.run_suite(config)
    attackers = {run["attack"]: run["attacker"] for run in report.runs}
    assert attackers["feature-reconstruction"] == "party-0"
    assert attackers["norm-scoring"] == "party-1"
    assert "| feature-reconstruction | party-0 |" in suite.markdown(report, command="test")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--control"], "--control goes with one --attack"),
        (["--attack-option", "known=2"], "--attack-option goes with one --attack"),
        # a typo was listed as "not applicable" and the suite exited 0
        (["--defense", "dp-gradient:1:0.01"], "a defense in (dp-gradients, "),
        (["--defense", "marvell:-1"], "marvell:SCALE with SCALE > 0"),
        # it asked for --secure-agg masks, a flag the suite refuses
        (
            ["--defense", "secure-agg:masks", "--release", "dp", "--release-noise", "1:1"],
            "the undefended runs of a sweep or suite have none",
        ),
    ],
)
def test_a_suite_refuses_what_it_would_ignore_or_misread_before_anything_runs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    expected: str,
) -> None:
    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a run started")

    monkeypatch.setattr(suite, "run_attack", no_run)
    out = tmp_path / "suite"
    assert main([*SUITE_ARGV, *extra, "--out", str(out)]) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "results.sqlite").exists()


def test_a_suite_hands_its_dp_accounting_to_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """--delta, --dp-adjacency and --insecure-reproducible-noise reached no run of a suite."""
    seen: list[Any] = []

    def recording(config: TrainConfig, name: str, **kwargs: Any) -> Any:
        seen.append(kwargs["privacy"])
        raise DivergenceError("training diverged (not run here)")

    monkeypatch.setattr(suite, "run_attack", recording)
    spec = PrivacySpec(delta=1e-3, adjacency="add-remove", seed=0)
    report = suite.run_suite(
        _direct(),
        defenses=["dp-gradients:1:0.01"],
        attacks=["direct-label-inference"],
        privacy=spec,
    )
    assert seen == [spec, spec] and not report.runs
    assert "No run was scored" in suite.markdown(report, command="test")


def test_a_refused_or_interrupted_suite_leaves_the_store_and_the_report_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--overwrite emptied the store of the suite's rows before any work: a refused or stopped
    suite left the store and suite.md disagreeing."""
    real = suite.run_suite

    def one_attack(config: TrainConfig, **kwargs: Any) -> Any:
        return real(config, attacks=["direct-label-inference"], **kwargs)

    monkeypatch.setattr(suite, "run_suite", one_attack)
    out = tmp_path / "suite"
    argv = [*SUITE_ARGV, "--out", str(out)]
    assert main(argv) == 0
    store = ResultsStore(tmp_path / "results.sqlite")
    before, report = store.rows(), (out / "suite.md").read_bytes()
    assert len(before) == 1
    assert main([*argv, "--overwrite", "--attacker", "party-9"]) == 2  # no attack applies

    def interrupted(config: TrainConfig, *, on_run: Any, **kwargs: Any) -> Any:
        def then_stop(*args: Any) -> None:
            on_run(*args)
            raise KeyboardInterrupt

        return one_attack(config, on_run=then_stop, **kwargs)

    monkeypatch.setattr(suite, "run_suite", interrupted)
    assert main([*argv, "--overwrite"]) == 130
    assert store.rows() == before and (out / "suite.md").read_bytes() == report


def test_a_diverged_run_is_shown_as_diverged_with_its_step_apart_from_a_defense_that_does_not_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The suite lumped a run whose training diverged (here: gradient noise of std 1e30
    overflows at the first step) with one whose defense does not apply (Marvell on ten
    classes) under "failed": a result of the defense's setting read as a fault. Its JSON, its
    tables, the lists under them and what the command prints say which, and the step."""
    real = suite.run_suite

    def one_attack(config: TrainConfig, **kwargs: Any) -> Any:
        return real(config, attacks=["direct-label-inference"], **kwargs)

    monkeypatch.setattr(suite, "run_suite", one_attack)
    out = tmp_path / "suite"
    argv = [*SUITE_ARGV, "--defense", "dp-gradients:1e30:0.01", "--defense", "marvell:4"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "suite.json").read_text())
    diverged, other = (
        "direct-label-inference / dp-gradients:1e30:0.01",
        "direct-label-inference / marvell:4",
    )
    assert report["unscored"] == {
        diverged: {"status": "diverged", "step": 1},
        other: {"status": "not applicable", "step": None},
    }
    assert "training diverged" in report["failed"][diverged]  # why, as before
    text = (out / "suite.md").read_text()
    assert "failed" not in text
    assert f"- {diverged} (diverged at step 1): training diverged" in text
    assert f"- {other}: not applicable: marvell protects binary tasks" in text
    # the defenses no run of which was scored are in the T-DCS table, with why
    assert "| dp-gradients:1e30:0.01 (1 diverged at step 1) | - |" in text
    assert "| marvell:4 (1 not applicable) | - |" in text
    err = capsys.readouterr().err
    assert f"{diverged} (diverged at step 1): training diverged" in err
    assert f"{other}: not applicable: marvell" in err

    def unscored(config: TrainConfig, name: str, **kwargs: Any) -> Any:
        if kwargs["defenses"]:
            raise ConfigError("marvell protects binary tasks; found 10 classes.")
        raise DivergenceError("training diverged: at step 3", step=3)

    monkeypatch.setattr(suite, "run_attack", unscored)
    assert main([*argv, "--out", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert "no run of the suite was scored (1 diverged, 2 not applicable)" in err
