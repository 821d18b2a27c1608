"""The privacy entry object: one spec, every mechanism installed inside the party it protects."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MakeData

from protocols.dp import EmbeddingNoise, GradientNoise
from protocols.noise import SecureNoise
from protocols.party_privacy import PartyPlan
from protocols.privacy import PrivacyEngine, PrivacySpec
from protocols.secagg import MaskingAggregator
from secure_vfl.cli import main
from secure_vfl.data.samplers import MixedSampler, PoissonSampler
from secure_vfl.errors import ConfigError, RunWarning
from secure_vfl.experiment import (
    ImputeRunConfig,
    TrainConfig,
    prepare_data,
    prepare_imputation_task,
    run_imputation,
    run_training,
)
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.imputation import ImputeConfig


def _private_run(make_data: MakeData, heads: str, spec: PrivacySpec):  # type: ignore[no-untyped-def]
    config = MethodConfig(
        heads=heads,  # type: ignore[arg-type]
        epochs=1,
        batch_size=32,
        lr=0.05,
        representation_dim=8,
        secure_sums=spec.secure_sums,
    )
    engine = PrivacyEngine(spec)
    data = make_data()
    method = METHODS.get("laser")(data, config, seed=0, aggregator=engine.aggregator())
    sampler = engine.sampler(method.sampler, n=data.train.n, epochs=1)
    assert isinstance(sampler, PoissonSampler)
    parties = in_process_parties(method.fed.channel)
    engine.make_private(parties, method="laser", method_config=config, predictions=0)
    for round in range(2):
        method.train_step(sampler.schedule[round], round, 0)
    return engine, parties


def test_a_report_that_protects_nothing_warns(make_data: MakeData) -> None:
    """Zero noise priced epsilon inf, and a delta of 0.5 was accepted, both in silence (the CLI
    alone warned of the delta): each is a RunWarning of the report now, so a Python caller and
    result.json's warnings see it."""
    spec = PrivacySpec(dp_embeddings=(0.0, 1.0), dp_gradients=(1.0, 0.1), delta=0.5)
    engine, _ = _private_run(make_data, "active", spec)
    with pytest.warns(RunWarning) as caught:
        report = engine.report()
    assert report is not None and all(e == float("inf") for e in report["epsilon"].values())
    unbounded, delta = (str(w.message) for w in caught)
    assert unbounded.startswith(f"epsilon is inf for {', '.join(sorted(report['epsilon']))}")
    assert "(--dp-embeddings SIGMA 0: no noise)" in unbounded
    records = report["sampling"]["records"]
    assert delta.startswith(f"delta 0.5 is not below 1/n = 1/{records}")
    for fine in (PrivacySpec(dp_embeddings=(1.0, 1.0)), PrivacySpec(delta=1 / (records + 1))):
        engine, _ = _private_run(
            make_data, "active", dataclasses.replace(fine, dp_gradients=(1.0, 0.1))
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", RunWarning)
            assert engine.report() is not None


def _draws_without(schedule: list[np.ndarray], rows: np.ndarray) -> int:
    """How many draws of ``schedule`` hold none of ``rows`` (bool over the training rows)."""
    return sum(1 for batch in schedule if not rows[batch].any())


def test_dp_sgd_steps_on_every_draw_noise_only_where_none_of_its_records_came() -> None:
    """A draw with none of a party's records (wine, batch 2, half of the blocks missing: most
    draws), or with no row at all, is a noise-only step, as Opacus takes on an empty batch:
    the party took no step there, so the number of steps it took told an observer of its
    model how often the sample missed its records, and the accountant priced steps that were
    never taken (its delta void). Every party now steps on every draw, and the run is the
    mechanism priced: no warning, the delta asked for."""
    spec = PrivacySpec(dp_sgd=(1.0, 1.0), dp_gradients=(1.0, 0.01))
    config = TrainConfig(
        method="laser",
        dataset="wine",
        train_missing="mcar:0.5",
        method_config=MethodConfig(heads="active", epochs=1, batch_size=2),
    )
    data = prepare_data(config)
    engine = PrivacyEngine(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunWarning)
        result = run_training(config, data=data, privacy=engine)
    assert result.privacy is not None and engine.poisson is not None
    schedule = engine.poisson.schedule
    draws = result.privacy["sampling"]["draws"]
    assert len(schedule) == result.privacy["sampling"]["steps"] == draws
    assert any(batch.size == 0 for batch in schedule)  # empty draws are steps too
    mask = np.asarray(data.train.mask, dtype=bool)
    for k in range(4):
        name = f"party-{k}"
        assert _draws_without(schedule, mask[:, k]) > draws // 4  # what the test is about
        assert result.privacy["releases"][name]["dp-sgd"] == draws
        (model,) = [g for g in result.privacy["guarantees"][name] if g["amplification"]]
        assert model["delta"] == spec.delta and math.isfinite(model["epsilon"])


def test_under_secure_sums_a_party_outside_every_usable_block_steps_on_noise() -> None:
    """Under secure sums a party is sent no gradient for a row it holds outside the row's
    usable blocks; its DP-SGD still steps once on every draw (digits, masks, half of the blocks
    missing)."""
    spec = PrivacySpec(secure_agg="masks", dp_sgd=(1.0, 1.0), dp_gradients=(1.0, 0.01))
    config = TrainConfig(
        method="laser",
        dataset="digits",
        train_missing="mcar:0.5",
        method_config=MethodConfig(heads="active", epochs=2, batch_size=48, secure_sums=True),
    )
    result = run_training(config, privacy=PrivacyEngine(spec))
    assert result.privacy is not None
    draws = result.privacy["sampling"]["draws"]
    assert {name: r["dp-sgd"] for name, r in result.privacy["releases"].items()} == {
        f"party-{k}": draws for k in range(4)
    }


@pytest.mark.parametrize("heads", ["all", "active"])
def test_each_party_holds_its_own_mechanisms_and_accountant(
    make_data: MakeData, heads: str
) -> None:
    spec = PrivacySpec(dp_embeddings=(1.0, 1.0), dp_gradients=(1.0, 0.1), dp_sgd=(1.0, 0.1))
    engine, parties = _private_run(make_data, heads, spec)
    accountants = [party.accountant for party in parties]
    assert len({id(a) for a in accountants}) == len(parties)
    for party in parties:
        kinds = {type(hook) for hook in party.outgoing}
        assert EmbeddingNoise in kinds
        assert (GradientNoise in kinds) == bool(party.heads)
        events = party.accountant.events
        assert events and {e.party for e in events} == {party.name}
        released = {e.kind for e in events}
        assert {"embedding", "dp-sgd"} <= released
        assert ("gradient" in released) == (heads == "all" or party.name == "party-0")
    report = engine.report()
    assert report is not None
    assert set(report["epsilon"]) == {p.name for p in parties}
    for party in parties:
        guarantees = report["guarantees"][party.name]
        assert report["epsilon"][party.name] == max(g["epsilon"] for g in guarantees) > 0
        # against the receivers (no amplification) and, with DP-SGD, the model's observer
        assert [g["amplification"] for g in guarantees] == [False, True]
        assert all(g["adjacency"] and g["sampling"] and g["accountant"] for g in guarantees)
    # No two parties share a noise source: each draws its own, secure, noise.
    sources = [h.noise for p in parties for h in p.outgoing if hasattr(h, "noise")]
    sources += [p.optimizer._noise for p in parties]  # type: ignore[union-attr]
    assert len({id(s) for s in sources}) == len(sources)
    assert all(isinstance(s, SecureNoise) for s in sources)


def test_secure_sums_and_dp_compose_noise_before_sealing(make_data: MakeData) -> None:
    spec = PrivacySpec(secure_agg="masks", dp_embeddings=(1.0, 1.0))
    engine, parties = _private_run(make_data, "active", spec)
    assert isinstance(engine.aggregator(), MaskingAggregator)
    assert all(p.sealer is not None for p in parties)
    report = engine.report()
    assert report is not None
    assert all(report["releases"][p.name]["embedding"] == 2 for p in parties)


def test_target_epsilon_calibrates_one_sigma_for_every_mechanism(make_data: MakeData) -> None:
    spec = PrivacySpec(dp_gradients=(9.0, 0.1), dp_sgd=(9.0, 0.1), target_epsilon=4.0)
    engine, _ = _private_run(make_data, "active", spec)
    sigmas = {sigma for sigma, _ in engine.noise.values()}
    assert len(sigmas) == 1 and sigmas != {9.0}
    assert {clip for _, clip in engine.noise.values()} == {0.1}
    report = engine.report()
    assert report is not None and report["within_target"]
    assert max(report["epsilon"].values()) <= 4.0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"target_epsilon": 1.0}, "`target_epsilon` .--target-epsilon. calibrates"),
        ({"secure_agg": "rot13"}, "`secure_agg` must be one of"),
        ({"align": "guess"}, "`align` must be one of"),
        ({"dp_sgd": (1.0, 0.0)}, "`dp_sgd` .--dp-sgd. needs SIGMA >= 0 and CLIP > 0"),
        ({"dp_gradients": (float("nan"), 1.0)}, "`dp_gradients` .--dp-gradients. needs"),
        ({"delta": 1.0}, "`delta` must be in"),
        ({"dp_statistics": (0.0, 1.0)}, "`dp_statistics` .--dp-statistics. needs SIGMA > 0"),
        ({"dp_statistics": (1.0, 1.0), "dp_sgd": (1.0, 0.1)}, "expected one kind, found both"),
        ({"feature_ranges": Path("ranges.csv")}, "`feature_ranges` .--feature-ranges. bounds"),
        ({"dp_sgd": (1.0, 0.1), "adjacency": "swap"}, "`adjacency` must be one of"),
    ],
)
def test_a_bad_spec_is_refused(kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        PrivacySpec(**kwargs)  # type: ignore[arg-type]


def test_what_a_template_spec_lacks_is_refused_by_the_engine() -> None:
    # A spec may be a template an attack's defenses add DP to; the engine installs a whole run.
    template = PrivacySpec(insecure_reproducible_noise=True)
    with pytest.raises(ConfigError, match="expected a DP mechanism with it"):
        PrivacyEngine(template)
    PrivacyEngine(dataclasses.replace(template, dp_gradients=(1.0, 0.1)))
    released = PrivacySpec(release="dp", release_noise=(1.0, 1.0))
    with pytest.raises(ConfigError, match="expected --secure-agg masks, paillier or ckks with it"):
        PrivacyEngine(released)
    PrivacyEngine(dataclasses.replace(released, secure_agg="masks"))


def _config(method: str, **method_config: object) -> TrainConfig:
    return TrainConfig(
        method=method,
        dataset="wine",
        method_config=MethodConfig(**method_config),  # type: ignore[arg-type]
    )


def test_methods_that_cannot_host_a_mechanism_are_refused() -> None:
    engine = PrivacyEngine(PrivacySpec(dp_sgd=(1.0, 0.1)))
    with pytest.raises(ConfigError, match="one bottom model per party"):
        engine.refuse(_config("combinatorial"))
    with pytest.raises(ConfigError, match="not available for false-vfl-1"):
        engine.refuse(_config("false-vfl-1"))
    PrivacyEngine(PrivacySpec()).refuse(_config("false-vfl-1"))  # nothing asked: nothing refused
    # Local and Ensemble send no gradient: --dp-gradients was recorded, calibrated and priced
    # nothing
    gradients = PrivacyEngine(PrivacySpec(dp_gradients=(1.0, 0.01)))
    for method in ("local", "ensemble"):
        with pytest.raises(ConfigError, match=f"{method} sends none .* Found --dp-gradients"):
            gradients.refuse(_config(method))
    gradients.refuse(_config("laser"))


def test_dp_sgd_refuses_a_bottom_model_pretrained_in_the_clear() -> None:
    """--pretrain-epochs trains each bottom model on its party's training rows by SimSiam
    without noise before DP-SGD: the run reported 4.12 for whoever sees that model (breast
    cancer, --dp-sgd 1:1, 8 draws), which a model trained in the clear does not have."""
    engine = PrivacyEngine(PrivacySpec(dp_sgd=(1.0, 0.1)))
    with pytest.raises(ConfigError, match="expected --pretrain-epochs 0 with --dp-sgd"):
        engine.refuse(_config("laser", pretrain_epochs=1))
    engine.refuse(_config("laser"))
    # the other mechanisms price releases given the model state; pretraining stays theirs
    PrivacyEngine(PrivacySpec(dp_embeddings=(1.0, 1.0))).refuse(_config("laser", pretrain_epochs=1))


def test_the_terms_of_a_guarantee_without_a_mechanism_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--delta` and `--dp-adjacency` with no DP flag were recorded in result.json and applied
    to nothing."""
    from secure_vfl.cli import DEFAULT_DELTA

    assert PrivacySpec().delta == DEFAULT_DELTA
    train = ["train", "--method", "laser", "--dataset", "iris", "--out", "unused"]
    for flags, named in (
        (["--delta", "0.001"], "--delta set"),
        (["--dp-adjacency", "add-remove"], "--dp-adjacency set"),
        (["--delta", "0.001", "--dp-adjacency", "add-remove"], "--delta and --dp-adjacency set"),
    ):
        assert main([*train, *flags]) == 2
        assert (
            f"error: {named} the terms of DP guarantees; expected a DP" in capsys.readouterr().err
        )
    impute = ["impute", "--method", "fed-mean", "--dataset", "ozone", "--delta", "0.001"]
    assert main([*impute, "--out", "unused"]) == 2
    assert "expected --dp-statistics SIGMA:CLIP with it" in capsys.readouterr().err
    assert not Path("unused").exists()


def test_a_run_whose_config_disagrees_with_its_spec_is_refused_before_any_data(
    tmp_path: Path,
) -> None:
    """The spec and the config each say how ids are aligned and whether sums are secure: a
    run refuses them disagreeing (it used to align by the config and ignore the spec's PSI, or
    fail mid-training on a sum the plain plan exposed)."""
    psi = PrivacyEngine(PrivacySpec(align="psi"))
    with pytest.raises(ConfigError, match="spec aligns the ids by 'psi', the training config by"):
        run_training(_config("laser", epochs=1), privacy=psi)
    masks = PrivacyEngine(PrivacySpec(secure_agg="masks"))
    for method in ("laser", "standard"):
        with pytest.raises(ConfigError, match=r"secure_agg='masks'\) expected with Method"):
            run_training(_config(method, epochs=1, heads="active"), privacy=masks)
    plain = PrivacyEngine(PrivacySpec())
    with pytest.raises(ConfigError, match=r"secure_agg='none'\) expected with MethodConfig\(s"):
        plain.refuse(_config("laser", heads="active", secure_sums=True))
    masks.refuse(_config("laser", heads="active", secure_sums=True))


def test_a_run_refuses_data_that_is_not_the_data_of_its_config() -> None:
    from secure_vfl.experiment import prepare_data

    config = TrainConfig(
        method="laser", dataset="wine", parties=2, method_config=MethodConfig(epochs=1)
    )
    data = prepare_data(config)
    for other, found in (
        ({"dataset": "digits", "parties": 4}, "parties 4 expected, found 2"),
        ({"parties": 3}, "parties 3 expected, found 2"),
        ({"test_missing": ("mcar:0", "mcar:0.5")}, "test splits ['mcar:0', 'mcar:0.5'] expected"),
    ):
        with pytest.raises(ConfigError, match=re.escape(found)):
            run_training(dataclasses.replace(config, **other), data=data)


@pytest.mark.usefixtures("one_thread")  # bit for bit: one torch thread
def test_an_imputation_run_takes_the_engine_as_one_object_as_the_cli_does(tmp_path: Path) -> None:
    argv = ["impute", "--method", "fedhf", "--dataset", "ozone", "--rounds", "1", "--quiet"]
    argv += ["--secure-agg", "masks", "--dp-statistics", "2:1.5", "--out", str(tmp_path / "r")]
    argv += ["--insecure-reproducible-noise"]  # the same noise on both sides, to compare
    assert main(argv) == 0
    cli = json.loads((tmp_path / "r" / "result.json").read_text())
    flags = cli["config"]
    config = ImputeRunConfig(
        method="fedhf",
        dataset="ozone",
        clients=flags["clients"],
        availability=flags["availability"],
        seed=flags["seed"],
        impute_config=ImputeConfig(**flags["impute_config"]),
    )
    spec = PrivacySpec(
        secure_agg="masks",
        dp_statistics=(2.0, 1.5),
        insecure_reproducible_noise=True,
        seed=flags["seed"],
    )
    result, _ = run_imputation(config, privacy=PrivacyEngine(spec))
    assert result.aggregator == "MaskingAggregator"  # the engine chose the backend
    assert result.privacy is not None
    assert set(result.privacy["epsilon"]) == set(result.rmse_per_client)
    assert (result.rmse, result.validation_curve) == (cli["rmse"], cli["validation_curve"])
    assert result.privacy == cli["privacy"]


def test_an_imputation_at_a_delta_not_below_one_over_n_warns_and_no_epsilon_is_negative() -> None:
    """At delta 0.5 the accountant's conversion gave epsilon -0.02 per client, printed and
    stored, and an imputation never said that its delta was not below 1/n (its report named no
    record count), where a training run did."""
    spec = PrivacySpec(dp_statistics=(2.0, 1.0), delta=0.5)
    config = ImputeRunConfig(method="fed-mean", dataset="ozone")
    with pytest.warns(RunWarning, match=r"delta 0\.5 is not below 1/n = 1/(\d+)") as caught:
        result, _ = run_imputation(config, privacy=PrivacyEngine(spec))
    assert result.privacy is not None
    records = result.privacy["sampling"]["records"]
    said = [str(w.message) for w in caught]
    assert next(m for m in said if "1/n = 1/" in m).count(f"1/n = 1/{records} ") == 1
    assert any(m.startswith("the feature ranges are the observed") for m in said)
    assert records == sum(c.values.shape[0] for c in prepare_imputation_task(config).train)
    assert result.privacy["epsilon"] and min(result.privacy["epsilon"].values()) == 0.0


def test_each_kind_of_run_refuses_the_mechanisms_of_the_other() -> None:
    training_noise = PrivacyEngine(PrivacySpec(dp_gradients=(1.0, 0.1)))
    with pytest.raises(ConfigError, match=r"expected no mechanism of training\. Found --dp-grad"):
        run_imputation(ImputeRunConfig(method="fed-mean", dataset="ozone"), privacy=training_noise)
    statistics_noise = PrivacyEngine(PrivacySpec(dp_statistics=(1.0, 1.0)))
    with pytest.raises(ConfigError, match="training laser expected --dp-embeddings"):
        run_training(TrainConfig(method="laser", dataset="iris"), privacy=statistics_noise)


def test_runs_without_training_dp_keep_the_methods_sampler() -> None:
    mixed = MixedSampler(100, 10)
    for spec in (PrivacySpec(), PrivacySpec(secure_agg="masks")):
        assert PrivacyEngine(spec).sampler(mixed, n=100, epochs=3) is mixed
    private = PrivacyEngine(PrivacySpec(dp_gradients=(1.0, 0.1))).sampler(mixed, n=100, epochs=3)
    assert isinstance(private, PoissonSampler) and private.rate == pytest.approx(0.1)


def test_a_resumed_deployed_plan_is_calibrated_to_the_killed_runs_sample() -> None:
    """A deployed label party plans every party's privacy before the run, so before its
    checkpoint's schedule is restored: on resume it puts the killed run's Poisson sample into
    the one it draws first, and SIGMA (calibrated to the most steps any record is in) is the
    killed run's. A fresh draw would calibrate to another sample (the control)."""
    spec = PrivacySpec(dp_embeddings=(1.0, 1.0), target_epsilon=8.0)
    names = ["party-0", "party-1", "party-2"]
    terms = {
        "n": 100,
        "epochs": 3,
        "method": "laser",
        "method_config": MethodConfig(),
        "predictions": 2,
    }

    def plan(**more: object) -> tuple[PrivacyEngine, dict[str, object]]:
        engine = PrivacyEngine(spec)
        plans = engine.plan_parties(MixedSampler(100, 10), names=names, **terms, **more)  # type: ignore[arg-type]
        return engine, plans

    killed, plans = plan()
    assert killed.poisson is not None
    drawn = [[batch.copy() for batch in epoch] for epoch in killed.poisson.epochs]
    resumed, again = plan(resumed=lambda sampler: sampler.restore(drawn, next_epoch=1))
    assert resumed.poisson is not None
    assert [[b.tolist() for b in e] for e in resumed.poisson.epochs] == [
        [b.tolist() for b in e] for e in drawn
    ]
    assert again == plans
    others = [plan()[1] for _ in range(10)]  # fresh samples: another calibration, mostly
    assert any(other != plans for other in others)


def test_a_deployed_party_no_mechanism_of_the_run_is_in_gets_a_plan_that_sizes_its_sums() -> None:
    """Under `--dp-gradients` alone (one label party) a data party releases nothing noised, but
    its secure-sum halves must be sized as the label party's opener is: its plan of no mechanism
    was refused as malformed, so the run stopped at set-up (and a plan left out, tried first,
    left its Paillier shares decoded 4x too large). With every party a head, each noises the
    gradients it sends."""
    names = ["party-0", "party-1", "party-2"]
    terms = {"n": 100, "epochs": 1, "method": "laser", "names": names, "predictions": 1}
    engine = PrivacyEngine(PrivacySpec(dp_gradients=(1.0, 0.01)))
    active = MethodConfig(heads="active")
    plans = engine.plan_parties(MixedSampler(100, 10), method_config=active, **terms)  # type: ignore[arg-type]
    label = engine._parties["party-0"]
    assert label.noise == {"gradient": (1.0, 0.01)}
    for plan in plans.values():
        assert plan is not None and plan["noise"] == {}
        read = PartyPlan.from_json(json.loads(json.dumps(plan)))  # what the party takes
        assert read.noise == {} and read.value_range == label.value_range
    every = PrivacyEngine(PrivacySpec(dp_gradients=(1.0, 0.01)))
    plans = every.plan_parties(MixedSampler(100, 10), method_config=MethodConfig(), **terms)  # type: ignore[arg-type]
    assert all(
        plan is not None and plan["noise"] == {"gradient": [1.0, 0.01]} for plan in plans.values()
    )


@pytest.mark.parametrize(
    ("flags", "imported"),
    [
        (["--secure-agg", "masks"], False),  # no DP at all
        # the positive control: DP-SGD runs on Opacus (with seeded noise: the run is the same
        # every time, where fresh noise diverged at some seeds)
        (["--dp-sgd", "1.0:1.0", "--insecure-reproducible-noise"], True),
    ],
)
def test_opacus_is_imported_only_by_a_run_that_uses_it(
    tmp_path: Path, flags: list[str], imported: bool
) -> None:
    """Importing Opacus takes seconds of every process that does (each party of a deployment):
    a run without DP never imports it."""
    argv = [
        "train",
        "--method",
        "laser",
        "--heads",
        "active",
        "--dataset",
        "digits",
        "--epochs",
        "1",
    ]
    argv += ["--quiet", *flags]
    argv += ["--out", str(tmp_path / "r")]
    code = "import sys; from secure_vfl.cli import main; code = main(sys.argv[1:]); "
    code += "print(sorted(sys.modules)); sys.exit(code)"
    completed = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    modules = set(ast.literal_eval(completed.stdout.strip().splitlines()[-1]))
    assert ("opacus" in modules) is imported
    assert (tmp_path / "r" / "result.json").exists()


@pytest.mark.parametrize("method", ["laser", "standard", "combinatorial"])
def test_under_poisson_sampling_a_rows_gradient_does_not_depend_on_the_other_rows_drawn(
    make_data: MakeData, method: str
) -> None:
    """The head divided a batch's loss by the rows drawn, so one more record in the training
    set rescaled every other row's gradient by |B| / (|B| + 1): a DP-SGD step's sum of clipped
    per-sample gradients moved by up to twice the clip norm where its add/remove guarantee
    prices once. Under Poisson sampling the loss is divided by the expected batch size, as
    Opacus does: each row's gradient is the same whichever other rows are drawn."""
    from secure_vfl.federation.channel import Channel, RecordingLayer

    data = make_data(parties=2, train_missing="mcar:0")
    # heads="all": with 2 parties each head's subsets are fixed ({k}, {0, 1}), so no draw of
    # LASER's tasks depends on the batch either
    config = MethodConfig(heads="all", epochs=1, batch_size=32, representation_dim=8)

    def gradients(batch: np.ndarray) -> dict[int, torch.Tensor]:
        recorder = RecordingLayer()
        built = METHODS.get(method)(data, config, seed=0, channel=Channel([recorder]))
        engine = PrivacyEngine(PrivacySpec(dp_gradients=(1.0, 0.1)))
        built.sampler = engine.sampler(built.sampler, n=data.train.n, epochs=1)
        built.train_step(batch, 0, 0)
        built.fed.flush(round=0)  # the label party's head's gradients, held to close the step
        [message] = [
            m
            for m in recorder.messages
            if m.kind == "gradient" and (m.sender, m.receiver) == ("party-0", "party-1")
        ]
        return {
            int(batch[p]): row for p, row in zip(message.positions, message.gradient, strict=True)
        }

    batch = np.arange(0, 64, 2)
    drawn = gradients(batch)
    more = gradients(np.sort(np.append(batch, 1)))
    assert set(drawn) < set(more)
    for row, gradient in drawn.items():
        torch.testing.assert_close(more[row], gradient, rtol=0, atol=0)


def test_importing_opacus_leaves_the_root_logger_as_the_program_set_it() -> None:
    """Opacus calls logging.basicConfig on import: a program that had not configured logging
    got a stderr handler from it (and its own basicConfig after that did nothing)."""
    untouched = (
        "import logging; import protocols.dp_sgd, protocols.dp as dp; import opacus; "
        "print(len(logging.getLogger().handlers), dp.price([(1.0, 0.01, 10)], 1e-5, "
        "accountant='prv') > 0)"
    )
    # a handler of the program's own stays
    kept = "import logging; logging.basicConfig(); import protocols.dp_sgd; "
    kept += "print(len(logging.getLogger().handlers))"
    for code, printed in ((untouched, ["0", "True"]), (kept, ["1"])):
        completed = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert completed.returncode == 0, completed.stderr
        assert completed.stdout.split() == printed
