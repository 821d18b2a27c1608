"""The attack suite's auditors: each attack succeeds undefended where the literature says it
does (positive control), sits at chance when its signal is destroyed (negative control), is
lowered by the defense meant to stop it, and is scored with VFLAIR's DCS."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import LABEL_LEAK_RUN

from attacks import ATTACKS
from attacks.label_inference import GradientObserver
from attacks.model_completion import Completion
from attacks.runner import apply_defense, dcs, make_attack, run_attack, undefended_accuracy
from protocols.privacy import PrivacySpec
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError, RegistryError, run_warnings
from secure_vfl.experiment import TrainConfig
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parties import DataParty
from secure_vfl.methods import MethodConfig
from secure_vfl.store import ResultsStore


def _digits_direct(epochs: int = 2) -> TrainConfig:
    return TrainConfig(
        method="laser",
        dataset="digits",
        parties=4,
        seed=0,
        method_config=MethodConfig(
            heads="active", epochs=epochs, top_model="none", representation_dim=10
        ),
    )


def _binary(dataset: str, method: str, epochs: int) -> TrainConfig:
    return TrainConfig(
        method=method,
        dataset=dataset,
        parties=4,
        seed=0,
        method_config=MethodConfig(heads="active", epochs=epochs, batch_size=64),
    )


def test_direct_label_inference_reads_every_label_and_sits_at_chance_when_shuffled() -> None:
    config = _digits_direct()
    channel = Channel()
    attacked = run_attack(config, "direct-label-inference", channel=channel)
    assert attacked.attack["balanced_accuracy"] >= 0.99 and attacked.attack["accuracy"] >= 0.99
    assert attacked.attack["rows"] > 1000  # every training row it holds, not a lucky few
    # only the attacker changed role; it kept nothing but what it was sent
    assert isinstance(channel.parties["party-1"], GradientObserver)
    assert all(
        type(channel.parties[name]) is DataParty for name in ("party-0", "party-2", "party-3")
    )
    control = run_attack(config, "direct-label-inference", control=True)
    assert abs(control.attack["balanced_accuracy"] - control.chance) <= 0.05
    assert control.main == attacked.main  # the control changes the scoring, not the training


@pytest.mark.parametrize(
    ("attack", "top_model"),
    [("direct-label-inference", "none"), ("passive-model-completion", "linear")],
)
def test_a_label_inference_control_sits_at_chance_on_a_skewed_task(
    attack: str, top_model: str
) -> None:
    """German credit is 70/30. The controls' plain accuracy sat below the majority class's share
    used as chance (direct: 0.60 against 0.70, a guess shuffled within the batch scores the sum
    of the squared shares; model completion from balanced granted labels: 0.56), and an
    undefended completion below it scored DCS (AP* = chance) 1.000. By balanced accuracy a
    guess without signal scores 1/C: measured 0.518 and 0.539 (seed 0)."""
    # direct label inference reads the loss gradient itself: no top model, 2 outputs
    direct = {"top_model": "none", "representation_dim": 2} if top_model == "none" else {}
    config = TrainConfig(
        method="laser" if direct else "standard",
        dataset="german-credit",
        parties=4,
        seed=0,
        method_config=MethodConfig(heads="active", epochs=5, batch_size=64, **direct),  # type: ignore[arg-type]
    )
    control = run_attack(config, attack, control=True)
    assert abs(control.performance - control.chance) <= 0.05  # AP, the headline metric
    assert abs(control.performance - 0.5) <= 0.05
    assert control.performance == control.attack["balanced_accuracy"]


def test_gradient_dp_lowers_direct_label_inference_and_the_dcs_prices_both() -> None:
    config = _digits_direct()
    undefended = run_attack(config, "direct-label-inference")
    defended = run_attack(config, "direct-label-inference", defenses=["dp-gradients:3:0.01"])
    # 0.855-0.874 lower over seeds 0-8
    assert defended.attack["balanced_accuracy"] <= undefended.attack["balanced_accuracy"] - 0.75
    assert defended.privacy is not None and defended.privacy["epsilon"]["party-0"] > 0
    assert defended.undefended_accuracy == pytest.approx(undefended.main["accuracy"])
    assert defended.dcs > undefended.dcs
    assert undefended.dcs == pytest.approx(
        dcs(
            1.0, undefended.main["accuracy"], attack_star=0.0, main_star=undefended.main["accuracy"]
        )
    )


def test_direct_label_inference_scores_the_rows_a_defense_left_blank() -> None:
    """Sparsifying half of a binary task's two gradient entries, of equal magnitude, zeroes
    about half of the rows (the others survive by a rounding difference). Scoring only the rows
    left readable gave balanced accuracy 1.000 over 217 of 310 rows (breast-cancer, seed 0),
    where the undefended run scores all 310: a defense that blanked half the labels scored as
    no defense at all."""
    config = TrainConfig(
        method="laser",
        dataset="breast-cancer",
        parties=4,
        seed=0,
        train_missing="mcar:0.3",
        method_config=MethodConfig(
            heads="active", epochs=2, top_model="none", representation_dim=2
        ),
    )
    undefended = run_attack(config, "direct-label-inference")
    defended = run_attack(
        config, "direct-label-inference", defenses=["gradient-sparsification:0.5"]
    )
    assert undefended.attack["balanced_accuracy"] >= 0.99
    assert defended.attack["rows"] == undefended.attack["rows"]  # every row it was sent
    assert defended.attack["balanced_accuracy"] <= 0.9


@pytest.mark.parametrize(
    ("attack", "dataset", "method", "epochs", "floor"),
    [
        # Li et al. (ICLR 2022): the norm of the gradient singles out the rare class in
        # split learning with a trainable top model on an imbalanced task (30 % bad credit)
        ("norm-scoring", "german-credit", "standard", 5, 0.8),
        # the cosine with a known positive's gradient separates the classes almost exactly
        ("direction-scoring", "breast-cancer", "laser", 3, 0.95),
    ],
)
def test_gradient_scoring_succeeds_and_its_shuffled_control_sits_at_one_half(
    attack: str, dataset: str, method: str, epochs: int, floor: float
) -> None:
    config = _binary(dataset, method, epochs)
    attacked = run_attack(config, attack)
    assert attacked.attack["auc"] >= floor
    assert attacked.attack["batches"] >= 10
    control = run_attack(config, attack, control=True)
    assert abs(control.attack["auc"] - 0.5) <= 0.05
    assert control.chance == 0.5


def test_the_direction_scoring_control_scores_the_labels_of_the_rows_it_scores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control permuted every row of a batch, the known positives among them, and then
    took the scored positions: a known row's label was scored in another's place and the
    batch's scored labels were not those of its scored rows. They are, permuted among them."""
    import attacks.label_inference as label_inference

    expected: list[list[bool]] = []
    scored: list[list[bool]] = []
    config = _binary("breast-cancer", "laser", 1)
    labels = {}
    scores = label_inference.DirectionScoring.scores

    def noted_scores(self: Any, observation: Any, known: np.ndarray) -> Any:
        result = scores(self, observation, known)
        if result is not None:
            rows = observation.rows[result[1]]
            expected.append(sorted((labels["train"][rows] == labels["positive"]).tolist()))
        return result

    def noted_auc(batch_scores: np.ndarray, positive: np.ndarray) -> Any:
        scored.append(sorted(positive.tolist()))
        return batch_auc(batch_scores, positive)

    batch_auc = label_inference._batch_auc
    prepare = label_inference.DirectionScoring.prepare

    def noted_prepare(self: Any, party: Any, context: Any) -> None:
        labels["train"] = context.data.train.labels
        labels["positive"] = label_inference._binary_positive(context.data, self.name)
        prepare(self, party, context)

    monkeypatch.setattr(label_inference.DirectionScoring, "scores", noted_scores)
    monkeypatch.setattr(label_inference.DirectionScoring, "prepare", noted_prepare)
    monkeypatch.setattr(label_inference, "_batch_auc", noted_auc)
    run_attack(config, "direction-scoring", control=True)
    assert len(scored) >= 5
    assert expected == scored


def test_scores_that_rank_the_rare_class_last_are_a_leak_not_a_defense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Standard VFL on breast-cancer, 2 parties, 1 epoch; the same run again with every score
    negated, so that the scores rank the classes the other way round (AUC 1 - AUC). That leaks
    as much to an attacker who knows which class is rarer: an inverted AUC of 0.08 was scored
    DCS 1 against chance, a perfect defense. Which way round the run itself ranks them depends
    on its seed; the two runs together do not."""
    from attacks.label_inference import NormScoring

    config = TrainConfig(
        method="standard",
        dataset="breast-cancer",
        parties=2,
        seed=0,
        method_config=MethodConfig(epochs=1),
    )
    runs = [run_attack(config, "norm-scoring")]
    scores = NormScoring.scores

    def negated(self: Any, observation: Any, known: np.ndarray) -> Any:
        scored = scores(self, observation, known)
        return None if scored is None else (-scored[0], scored[1])

    monkeypatch.setattr(NormScoring, "scores", negated)
    runs.append(run_attack(config, "norm-scoring"))
    assert runs[1].attack["auc"] == pytest.approx(1 - runs[0].attack["auc"])
    for result in runs:
        auc = result.attack["auc"]
        assert result.attack["separation"] == max(auc, 1 - auc)
        main_accuracy = result.main["accuracy"]
        reference = result.undefended_accuracy
        assert result.dcs_chance == pytest.approx(
            dcs(max(auc, 1 - auc), main_accuracy, attack_star=0.5, main_star=reference)
        )
    assert min(result.attack["auc"] for result in runs) < 0.4  # one ranks the rare class last
    assert runs[1].dcs_chance == pytest.approx(runs[0].dcs_chance)  # the same leak either way


@pytest.mark.parametrize(
    ("attack", "options", "expected"),
    [
        # each of these failed after training, with a traceback (AttributeError, TypeError,
        # ValueError from numpy)
        # a Completion object cannot be an option's value: it offered `settings` as one
        (
            "passive-model-completion",
            {"settings": 1},
            "settings takes a Completion object, from Python only. Found settings=1.",
        ),
        (
            "passive-model-completion",
            {"colour": 1},
            "takes the parameters (known) (from Python also settings). Found colour.",
        ),
        ("passive-model-completion", {"known": 2.5}, "known takes an integer. Found known=2.5"),
        ("feature-reconstruction", {"victim": 1.5}, "victim takes an integer"),
        ("direction-scoring", {"known": math.nan}, "known takes an integer. Found known=nan"),
        ("gradient-replacement-backdoor", {"gamma": math.inf}, "gamma takes a finite number"),
        ("gradient-replacement-backdoor", {"swap": 3}, "swap takes text. Found swap=3"),
        # it said "takes the parameters (none of them)"
        ("norm-scoring", {"known": 3}, "norm-scoring takes no parameters. Found known."),
    ],
)
def test_an_option_of_the_wrong_type_is_refused_before_training(
    attack: str, options: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        make_attack(attack, options)
    assert make_attack("passive-model-completion", {"known": 3, "settings": Completion()})


def test_an_attack_that_does_not_apply_is_refused_with_what_it_needs() -> None:
    with pytest.raises(ConfigError, match="--top-model none"):
        run_attack(_binary("breast-cancer", "laser", 1), "direct-label-inference")
    with pytest.raises(ConfigError, match="binary task; found 10 classes"):
        run_attack(_digits_direct(1), "norm-scoring")
    with pytest.raises(ConfigError, match="latent samples and likelihoods"):
        run_attack(_binary("german-credit", "false-vfl-1", 1), "norm-scoring")
    with pytest.raises(ConfigError, match="passive data party"):
        run_attack(_digits_direct(1), "direct-label-inference", attacker="party-0")
    with pytest.raises(RegistryError, match="unknown attack 'no-such-attack'; expected one of"):
        run_attack(_digits_direct(1), "no-such-attack")


def test_direction_scoring_that_would_grant_every_positive_is_refused_before_training() -> None:
    """Known rows are never scored: granting all the rare class's rows the attacker holds left
    no positive to score, and the run trained to the end before saying that no batch held rows
    of both classes (breast-cancer, party-1 holds 170 of class 0)."""
    config = _binary("breast-cancer", "standard", 1)
    expected = "known=170 grants every one of the 170 training rows of the rare class 0"
    with pytest.raises(ConfigError, match=expected) as refused:
        run_attack(config, "direction-scoring", options={"known": 170})
    assert "expected known < 170" in str(refused.value)
    assert run_attack(config, "direction-scoring", options={"known": 169}).attack["batches"] >= 1


def test_label_inference_by_a_label_holder_or_a_backdoor_with_no_crossing_gradient_is_refused() -> (
    None
):
    from attacks.suite import applicable
    from secure_vfl.experiment import prepare_data

    def verdicts(method: str, heads: str) -> dict[str, str | None]:
        config = TrainConfig(
            method=method,
            dataset="breast-cancer",
            parties=3,
            seed=0,
            method_config=MethodConfig(heads=heads),  # type: ignore[arg-type]
        )
        return applicable(config, prepare_data(config))

    label_inference = ("norm-scoring", "direction-scoring")
    # every party holds a head, and with it the labels: nothing to infer
    for method in ("laser", "local", "ensemble", "combinatorial"):
        found = verdicts(method, "all")
        for attack in label_inference:
            assert "holds a head, and with it the labels" in str(found[attack]), (method, attack)
    # the labels stay with the label party: the attacks apply
    for method, heads in (("laser", "active"), ("standard", "all"), ("plugvfl", "all")):
        found = verdicts(method, heads)
        assert all(found[attack] is None for attack in label_inference), (method, found)
    # no head sends the attacker a gradient under local and ensemble; other heads do elsewhere
    for method in ("local", "ensemble"):
        assert "no party receives another's gradient" in str(
            verdicts(method, "all")["gradient-replacement-backdoor"]
        )
    for method, heads in (("laser", "all"), ("laser", "active"), ("standard", "all")):
        assert verdicts(method, heads)["gradient-replacement-backdoor"] is None
    # the same refusal stops a run before any training
    with pytest.raises(ConfigError, match="holds a head, and with it the labels; run it with"):
        run_attack(
            TrainConfig(method="laser", dataset="breast-cancer", parties=3, seed=0),
            "norm-scoring",
        )


@pytest.mark.parametrize(
    ("defenses", "expected"),
    [
        (["dp-gradients:1"], "SIGMA:CLIP"),
        # which defense: it said only "Noise must be given as SIGMA:CLIP ... Found ''"
        (["dp-gradients"], "defense dp-gradients: Noise must be given as SIGMA:CLIP"),
        (["dp-sgd:1:1:1"], "defense dp-sgd: Noise must be given as SIGMA:CLIP"),
        (["secure-agg:rot13"], "BACKEND"),
        (["dp-sgd:1:1", "dp-sgd:2:1"], "given twice"),
        (["secure-agg:masks", "secure-agg:ckks"], "given twice"),
        (["marvel:1"], "a defense in"),
    ],
)
def test_a_bad_defense_spec_is_refused(defenses: list[str], expected: str) -> None:
    spec = PrivacySpec()
    with pytest.raises(ConfigError, match=expected):
        for text in defenses:
            spec = apply_defense(spec, text)


def test_a_refused_defense_is_named_as_it_was_given() -> None:
    # it said "Found --dp-gradients", a flag the command was not given
    config = TrainConfig(method="local", dataset="wine", method_config=MethodConfig(epochs=1))
    with pytest.raises(ConfigError, match=r"Found --defense dp-gradients:1:0\.5\.$"):
        run_attack(config, "norm-scoring", defenses=["dp-gradients:1:0.5"])
    given = PrivacySpec(dp_gradients=(1.0, 0.5))  # train's own flag: named as given
    with pytest.raises(ConfigError, match=r"Found --dp-gradients\.$"):
        run_attack(config, "norm-scoring", privacy=given)
    false_vfl = replace(config, method="false-vfl-1")
    with pytest.raises(ConfigError, match=r"Found --defense dp-embeddings:2:1, --dp-sgd\.$"):
        run_attack(
            false_vfl,
            "norm-scoring",
            privacy=PrivacySpec(dp_sgd=(1.0, 1.0)),
            defenses=["dp-embeddings:2:1"],
        )


def test_defense_specs_map_onto_the_privacy_layer() -> None:
    spec = PrivacySpec()
    for text in ("dp-gradients:1.5:0.01", "dp-embeddings:0.5:2", "dp-sgd:1:1", "secure-agg:masks"):
        spec = apply_defense(spec, text)
    assert spec.dp_gradients == (1.5, 0.01) and spec.dp_embeddings == (0.5, 2.0)
    assert spec.dp_sgd == (1.0, 1.0) and spec.secure_agg == "masks"


def test_dcs_is_vflair_formula() -> None:
    # an attack at full strength with no accuracy lost: 1 / (1 + sqrt(0.5))
    assert dcs(1.0, 0.9, attack_star=0.0, main_star=0.9) == pytest.approx(1 / (1 + math.sqrt(0.5)))
    # a perfect defense: the attack at its reference, no accuracy lost
    assert dcs(0.5, 0.9, attack_star=0.5, main_star=0.9) == 1.0
    # both terms, equally weighted
    expected = 1 / (1 + math.sqrt(0.5 * 0.2**2 + 0.5 * 0.1**2))
    assert dcs(0.7, 0.8, attack_star=0.5, main_star=0.9) == pytest.approx(expected)
    # an accuracy gain or an attack below the reference is not rewarded
    assert dcs(0.2, 0.95, attack_star=0.5, main_star=0.9) == 1.0


def test_every_registered_attack_names_its_metric_and_chance() -> None:
    for name in ATTACKS.names():
        attack = ATTACKS.get(name)()
        assert attack.name == name and attack.metric


def test_attack_command_writes_the_scores(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "attack",
            "--attack",
            "direct-label-inference",
            *LABEL_LEAK_RUN,
            "--defense",
            "dp-gradients:1:0.01",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    assert 0 < result["main"]["accuracy"] <= 1
    assert 0 <= result["attack"]["accuracy"] <= 1
    assert result["epsilon"]["party-0"] > 0
    assert 0 < result["dcs"] <= 1 and 0 < result["dcs_chance"] <= 1
    assert result["dcs_chance"] >= result["dcs"]
    assert list((tmp_path / ".undefended").glob("*.json"))  # MP*, cached for the next run
    assert (
        main(
            [
                "attack",
                "--attack",
                "norm-scoring",
                "--method",
                "laser",
                "--dataset",
                "digits",
                "--epochs",
                "1",
                "--quiet",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )


def test_top_model_none_needs_mean_fusion_and_one_width_per_class() -> None:
    from secure_vfl.experiment import run_training

    with pytest.raises(ConfigError, match="representation_dim must equal the 10 classes"):
        run_training(
            TrainConfig(
                method="laser",
                dataset="digits",
                method_config=MethodConfig(epochs=1, top_model="none", representation_dim=8),
            )
        )
    with pytest.raises(ConfigError, match="trainable top model"):
        run_training(
            TrainConfig(
                method="standard",
                dataset="digits",
                method_config=MethodConfig(epochs=1, top_model="none", representation_dim=10),
            )
        )
    result = run_training(_digits_direct(1))
    # it learns with no top model at all: 61.0-75.5 % over seeds 0-8
    assert result.metrics["mcar:0"]["accuracy"] > 50
    assert np.isfinite(result.epoch_loss).all()


def test_trains_privacy_flags_are_listed_among_an_attacks_defenses() -> None:
    """DP given by train's flags (the CLI's --dp-gradients) was reported as "defenses: none"."""
    from attacks.runner import spec_defenses

    spec = PrivacySpec(dp_gradients=(1.0, 0.01), target_epsilon=8.0, secure_agg="masks")
    assert spec_defenses(spec) == ["dp-gradients:1:0.01", "target-epsilon:8", "secure-agg:masks"]
    assert spec_defenses(PrivacySpec()) == []
    result = run_attack(
        _digits_direct(1),
        "direct-label-inference",
        privacy=PrivacySpec(dp_gradients=(1.0, 0.01)),
        defenses=["gradient-sparsification:0.5"],
    )
    assert result.defenses == ["dp-gradients:1:0.01", "gradient-sparsification:0.5"]


def test_an_attacks_defenses_complete_the_train_flags_that_need_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--release dp failed after the whole defended training (the undefended reference run
    kept it without secure sums), and was refused up front with secure sums as a --defense;
    --insecure-reproducible-noise was refused whenever DP came from a --defense; --align psi
    failed inside the configuration instead of saying why."""
    argv = ["attack", "--attack", "direct-label-inference", *LABEL_LEAK_RUN, "--quiet"]
    release = ["--release", "dp", "--release-noise", "1:1"]
    for n, defended in enumerate(
        (["--secure-agg", "masks", *release], ["--defense", "secure-agg:masks", *release])
    ):
        assert main([*argv, *defended, "--out", str(tmp_path / f"release{n}")]) == 0
        result = json.loads((tmp_path / f"release{n}" / "result.json").read_text())
        assert result["epsilon"] and 0 < result["undefended_accuracy"] <= 1
    # Both are runs of masked sums with a DP release (runs said `none` for the defense's
    # backend, and `none` for the release's DP in both)
    capsys.readouterr()
    compare = ["runs", "compare", *(str(tmp_path / f"release{n}") for n in (0, 1))]
    for listing in (compare, ["runs", "list", "--store", str(tmp_path / "results.sqlite")]):
        assert main(listing) == 0
        printed = capsys.readouterr().out
        assert len(re.findall(r" masks +release 1:1 ", printed)) == 2, printed
    noisy = ["--defense", "dp-gradients:1:0.01", "--insecure-reproducible-noise"]
    for n in range(2):  # the same noise again: the same scores
        assert main([*argv, *noisy, "--out", str(tmp_path / f"noise{n}")]) == 0
    first, again = (
        json.loads((tmp_path / f"noise{n}" / "result.json").read_text()) for n in (0, 1)
    )
    assert first["attack"] == again["attack"] and first["main"] == again["main"]
    capsys.readouterr()
    assert main([*argv, "--insecure-reproducible-noise", "--out", str(tmp_path / "x")]) == 2
    assert "expected a DP mechanism with it. Found none." in capsys.readouterr().err
    (tmp_path / "file").write_text("")  # refused after the defended training had run
    assert main([*argv, "--cache", str(tmp_path / "file"), "--out", str(tmp_path / "x")]) == 2
    assert f"--cache {tmp_path / 'file'} is a file" in capsys.readouterr().err
    # --target-epsilon with DP given only as a --defense: it said no DP mechanism was given.
    calibrated = ["--defense", "dp-gradients:1:0.01", "--target-epsilon", "50"]
    assert main([*argv, *calibrated, "--out", str(tmp_path / "x")]) == 2
    assert "a --defense spec's SIGMA is its own" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_undefended_reference_follows_the_party_files_contents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MP* was cached under the files' paths: labels shuffled in place kept the old reference
    # (90.8 % against the shuffled run's 63.2 %), and the DCS with it.
    import attacks.runner

    trained: list[TrainConfig] = []

    def train(config: TrainConfig) -> Any:
        trained.append(config)
        return _Trained(len(trained))

    monkeypatch.setattr(attacks.runner, "run_training", train)
    paths = []
    for name in ("a", "b", "labels"):
        paths.append(tmp_path / f"{name}.csv")
        paths[-1].write_text(f"id,{name}\n1,0\n2,1\n")
    config = TrainConfig(method="standard", party_files=tuple(paths[:2]), label_file=paths[2])
    cache = tmp_path / "cache"
    assert undefended_accuracy(config, cache=cache) == 0.01
    assert undefended_accuracy(config, cache=cache) == 0.01 and len(trained) == 1  # cached
    paths[2].write_text("id,labels\n1,1\n2,0\n")  # the same path, other labels
    assert undefended_accuracy(config, cache=cache) == 0.02 and len(trained) == 2
    assert undefended_accuracy(config, cache=cache) == 0.02 and len(trained) == 2
    # a damaged entry is trained again and replaced (`[]` crashed with AttributeError)
    (entry,) = [e for e in cache.iterdir() if json.loads(e.read_text())["accuracy"] == 0.02]
    stored = json.loads(entry.read_text())
    for damaged in ([], "x", {**stored, "accuracy": "NaN"}, {**stored, "accuracy": [1]}):
        entry.write_text(json.dumps(damaged))
        before = len(trained)
        assert undefended_accuracy(config, cache=cache) == (before + 1) / 100
        assert json.loads(entry.read_text())["accuracy"] == (before + 1) / 100


def test_a_cache_that_cannot_be_written_is_warned_of_and_the_run_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default cache (beside --out) was not checked before the work: a folder that could
    not be made failed the attack after its training, and a sweep at its first defended run."""
    import attacks.runner

    monkeypatch.setattr(attacks.runner, "run_training", lambda config: _Trained(42))
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with run_warnings() as noted:
        config = TrainConfig(method="standard", dataset="digits")
        assert undefended_accuracy(config, cache=blocked / ".undefended") == 0.42
    [warning] = noted
    assert warning.startswith("the undefended accuracy was not cached (") and "a-file" in warning


def test_the_attack_summary_shows_counts_as_whole_numbers(tmp_path: Path) -> None:
    """A reconstruction's row counts printed as `reconstructed_rows 410.0000`."""
    from types import SimpleNamespace

    from secure_vfl.cli import _attack_summary

    result = SimpleNamespace(
        attack_name="feature-reconstruction",
        attacker="party-0",
        control=False,
        defenses=[],
        main={"accuracy": 0.9},
        undefended_accuracy=0.9,
        attack={"mse": 0.04, "reconstructed_rows": 410.0, "auxiliary_rows": 46.0},
        performance=0.96,
        chance=0.0,
        dcs=0.1,
        dcs_chance=0.1,
        privacy=None,
    )
    text = _attack_summary(result, tmp_path)
    assert re.search(r"^attack reconstructed_rows +410$", text, re.M), text
    assert re.search(r"^attack auxiliary_rows +46$", text, re.M), text
    assert re.search(r"^attack mse +0\.0400$", text, re.M), text


class _Trained:
    """What the reference reads of a training result: its first metric's accuracy (%)."""

    def __init__(self, percent: float) -> None:
        self.metrics = {"test": {"accuracy": percent}}


def test_a_sweep_or_suite_is_refused_in_a_folder_that_holds_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The sweep went ahead without --overwrite and took the run's row out of the results store.
    out = tmp_path / "run"
    attack = ["--attack", "direct-label-inference", *LABEL_LEAK_RUN, "--quiet", "--out", str(out)]
    assert main(["attack", *attack]) == 0
    rows = ResultsStore(tmp_path / "results.sqlite").rows()
    assert len(rows) == 1
    capsys.readouterr()
    sweep = ["sweep", *attack, "--defense", "dp-gradients:S:0.01", "--grid", "S=1"]
    suite = ["attack", "--suite", "all", *LABEL_LEAK_RUN, "--quiet", "--out", str(out)]
    for argv in (sweep, suite, [*sweep, "--overwrite"]):
        assert main(argv) == 2
        assert f"{out} holds another kind of run (result.json)" in capsys.readouterr().err
    assert ResultsStore(tmp_path / "results.sqlite").rows() == rows
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".json") == ["result.json"]
    # Inside the run's folder: it went ahead, its store and cache inside the other run's folder,
    # and `runs list` from the parent did not show it.
    sub = out / "sub"
    nested = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    for argv in (sweep, ["attack", *attack], nested):
        inside = [str(sub) if arg == str(out) else arg for arg in argv]
        assert main(inside if str(sub) in inside else [*inside, "--out", str(sub)]) == 2
        expected = f"--out {sub} is inside the folder of another run, {out}"
        assert expected in capsys.readouterr().err
    # Another tool's result.json in a folder above is not a run of this one.
    elsewhere = tmp_path / "project"
    elsewhere.mkdir()
    (elsewhere / "result.json").write_text('{"score": 1}')
    assert main([*nested, "--out", str(elsewhere / "runs" / "iris")]) == 0
    assert not (out / "sub").exists()


def test_an_attack_on_party_files_speaks_of_the_parties_by_their_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--attacker shop` was refused (only party-1 was known), the outputs said party-1, and a
    # training's warning (predictions collapsed to one class) went unprinted.
    rng = np.random.default_rng(0)
    ids = [f"c{i:03d}" for i in range(160)]
    y = (rng.random(160) < 0.15).astype(int)  # mostly "no", and features that say nothing:
    x = rng.normal(size=(160, 4))  # one epoch predicts "no" for every sample
    argv = ["attack", "--attack", "norm-scoring", "--method", "standard", "--epochs", "1"]
    for k, name in enumerate(("bank", "shop")):
        frame = pd.DataFrame({"id": ids, f"a{k}": x[:, 2 * k], f"b{k}": x[:, 2 * k + 1]})
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
        argv += ["--party-file", str(tmp_path / f"{name}.csv")]
    pd.DataFrame({"id": ids, "label": np.where(y == 1, "yes", "no")}).to_csv(
        tmp_path / "labels.csv", index=False
    )
    argv += ["--label-file", str(tmp_path / "labels.csv"), "--quiet"]
    assert main([*argv, "--attacker", "shop", "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("norm-scoring by shop;")
    assert "collapsed to one class (label 'no' for every sample" in captured.err
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["attacker"] == "shop"
    assert result["parties"] == {"party-0": "bank", "party-1": "shop"}
    row = ResultsStore(tmp_path / "results.sqlite").rows()[0]
    assert row["parties"] == {"party-0": "bank", "party-1": "shop"}
    assert main([*argv, "--attacker", "party-1", "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "result.json").read_text())["attacker"] == "shop"
    # A refusal names the parties as the user does: it said "the label party party-0".
    reconstruction = ["--attack", "feature-reconstruction", "--attacker", "shop"]
    capsys.readouterr()
    assert main([*argv, *reconstruction, "--out", str(tmp_path / "refused")]) == 2
    assert "run by the label party bank" in capsys.readouterr().err
    # The passive parties and a victim's index by name: "one of insurer..telco" read as a
    # range of names, and "victim ... Found party-9" mixed names and indices.
    assert main([*argv, "--attacker", "bank", "--out", str(tmp_path / "refused")]) == 2
    assert "a passive data party, one of shop. Found attacker 'bank'" in capsys.readouterr().err
    victim = ["--attack", "feature-reconstruction", "--attacker", "bank"]
    victim += ["--attack-option", "victim=9", "--out", str(tmp_path / "refused")]
    assert main([*argv, *victim]) == 2
    assert "one of 1 (shop). Found victim=9." in capsys.readouterr().err
    # A sweep and a suite take the same names and report in them: `--attacker shop` was
    # refused by both ("Found attacker 'shop'"), their reports said party-1.
    sweep = ["sweep", *argv[1:], "--attacker", "shop", "--seeds", "1", "--workers", "1"]
    assert main([*sweep, "--out", str(tmp_path / "sweep")]) == 0
    written = (tmp_path / "sweep" / "sweep.json").read_text()
    assert "shop" in written and not re.search(r"\bparty-\d", written)
    suite = ["attack", "--suite", "all", *argv[3:], "--attacker", "shop"]
    assert main([*suite, "--out", str(tmp_path / "suite")]) == 0
    report = json.loads((tmp_path / "suite" / "suite.json").read_text())
    assert {run["attacker"] for run in report["runs"]} == {"shop"}
    assert "run by the label party bank" in report["skipped"]["feature-reconstruction"]
    assert not re.search(r"\bparty-\d", (tmp_path / "suite" / "suite.md").read_text())
    # Their store rows said who attacked and named the parties as `attack` does: a sweep's had
    # attacker None (two sweeps by different attackers looked alike), neither had the names.
    names = {"party-0": "bank", "party-1": "shop"}
    for kind in ("sweep", "suite"):
        rows = [r for r in ResultsStore(tmp_path / "results.sqlite").rows() if kind in r["kind"]]
        assert rows and all(r["parties"] == names for r in rows), kind
        assert {r["config"]["attacker"] for r in rows} == {"shop"}, kind


def test_run_attack_and_run_sweep_refuse_arguments_of_the_wrong_kind() -> None:
    """Each failed deep inside with an AttributeError or a TypeError (a PrivacyEngine where the
    spec goes, a dict, None), or split a template string into characters."""
    from attacks.sweep import run_sweep
    from protocols.privacy import PrivacyEngine

    config = TrainConfig(method="laser", dataset="iris", parties=2)
    engine = PrivacyEngine(PrivacySpec(dp_gradients=(1.0, 0.01)))
    wrong: list[tuple[dict[str, Any], str]] = [
        ({"privacy": engine}, "`privacy` must be a PrivacySpec (an attack adds its defenses"),
        ({"privacy": {"secure_agg": "masks"}}, "`privacy` must be a PrivacySpec"),
        ({"options": [("known", 1)]}, "`options` must be a Mapping of parameter names"),
    ]
    for arguments, message in wrong:
        with pytest.raises(ConfigError, match=re.escape(message)):
            run_attack(config, "norm-scoring", **arguments)
    with pytest.raises(ConfigError, match=re.escape("`config` must be a TrainConfig. Found")):
        run_attack(None, "norm-scoring")  # type: ignore[arg-type]
    sweep: dict[str, Any] = {"templates": ["marvell:SCALE"], "grid": {"SCALE": (2.0,)}}
    for changes, message in [
        ({"privacy": engine}, "`privacy` must be a PrivacySpec"),
        ({"templates": "marvell:SCALE"}, "`templates` must be a list of defense templates"),
        ({"grid": {"SCALE": 2.0}}, "`grid` 'SCALE': a list of values expected. Found float."),
        ({"seeds": "2"}, "`seeds` must be an integer. Found '2'."),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            run_sweep(config, "norm-scoring", **{**sweep, **changes})
