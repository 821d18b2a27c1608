"""`secure-vfl train` with differential privacy: every party's guarantees in the result (checked
against Google's dp_accounting), the target epsilon, fresh noise per run, flags checked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import pytest

from secure_vfl.cli import main

BASE = ["train", "--method", "laser", "--dataset", "digits", "--heads", "active", "--quiet"]


# The issue's example: three data parties, DP-SGD on every bottom model, gradient noise on what
# the label party sends back.
EXAMPLE = [*BASE, "--epochs", "5", "--dp-sgd", "1.0:0.05", "--dp-gradients", "1.0:0.01"]
EXAMPLE += ["--seed", "0"]


def _independent(event: dp_accounting.DpEvent) -> tuple[float, float]:
    """Google's dp_accounting: (RDP, PLD) epsilon of ``event`` at delta 1e-5, add/remove."""
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(event)
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(event)
    return float(rdp.get_epsilon(1e-5)), float(pld.get_epsilon(1e-5))


def _label_party_as_the_issue_prices_it(privacy: dict[str, object]) -> dp_accounting.DpEvent:
    """The label party's three gradient messages of a step as one Poisson-subsampled Gaussian
    of multiplier sigma / sqrt(3) under add/remove, over every draw: the issue's independent
    figure (which assumes the receivers do not know the batches)."""
    sampling = privacy["sampling"]
    assert isinstance(sampling, dict)
    joint = dp_accounting.GaussianDpEvent(1.0 / math.sqrt(3))
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sampling["rate"], joint), sampling["draws"]
    )


def _guarantee_event(guarantee: dict[str, object]) -> dp_accounting.DpEvent:
    """The event a guarantee says it priced, rebuilt for dp_accounting from its own fields."""
    sigma, releases = guarantee["noise_multiplier"], guarantee["releases"]
    assert isinstance(sigma, float) and isinstance(releases, int)
    if guarantee["amplification"]:
        sampling = str(guarantee["sampling"])
        rate = float(sampling.split("rate ")[1].split(",")[0])
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)),
            releases,
        )
    return dp_accounting.GaussianDpEvent(sigma)  # the record's releases as one Gaussian


def test_the_issues_example_prices_joint_events_per_record_under_replace_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dp"
    assert main([*EXAMPLE, "--out", str(out)]) == 0
    privacy = json.loads((out / "result.json").read_text())["privacy"]
    assert set(privacy["epsilon"]) == {f"party-{k}" for k in range(4)}
    assert privacy["adjacency"].startswith("replace one record")
    assert privacy["sampling"]["kind"] == "poisson" and privacy["sampling"]["draws"] == 60
    assert privacy["insecure_reproducible_noise"] is False
    assert "AES-128-CTR" in privacy["noise_source"]
    # every epsilon says what it protects, against whom, adjacency, sampling and accountant
    for guarantees in privacy["guarantees"].values():
        for g in guarantees:
            assert {"protects", "observer", "adjacency", "sampling", "accountant"} <= set(g)
    label = privacy["guarantees"]["party-0"]
    receivers = next(g for g in label if not g["amplification"])
    assert receivers["mechanisms"] == ["gradient", "dp-sgd"]
    # one joint event per step: three gradient messages and one DP-SGD step, each moved 2C
    uses = privacy["sampling"]["most_steps_per_record"]
    assert receivers["releases"] == uses
    assert receivers["noise_multiplier"] == pytest.approx(1 / (2 * math.sqrt(4 * uses)))
    assert privacy["releases"]["party-0"] == {"gradient": 3 * 60, "dp-sgd": 60}
    # at least the independent accountant's figures: the issue's pricing of the same run, and
    # dp_accounting's own pricing of each guarantee's event
    issue_rdp, issue_pld = _independent(_label_party_as_the_issue_prices_it(privacy))
    assert privacy["epsilon"]["party-0"] >= max(issue_rdp, issue_pld)
    for guarantees in privacy["guarantees"].values():
        for g in guarantees:
            rdp, pld = _independent(_guarantee_event(g))
            assert g["epsilon"] >= pld and g["epsilon"] >= 0.99 * rdp
    # the data parties' DP-SGD guarantee is the issue's 5.68 (60 steps at q = 0.089)
    assert privacy["epsilon"]["party-1"] == pytest.approx(5.68, abs=0.01)
    assert "representations: sent without noise" in privacy["not_noised"][0]
    # DP-SGD covers the bottom models, not what they send: every party's representations are
    # listed as unguarded (no epsilon bounds them; 'the worst party' was 5.68-ish, finite)
    unguarded = {f"party-{k}": ["representations"] for k in range(4)}
    assert privacy["unguarded"] == unguarded
    printed = capsys.readouterr().out
    assert "epsilon (delta 1e-05, replace one record" in printed and "party-0" in printed
    assert (
        "no DP guarantee (epsilon inf), sent without noise: the representations of party-0, "
        "party-1, party-2, party-3" in printed
    )
    # what every epsilon leaves out is said where the figures are, not only in the docs
    assert "heads" in privacy["scope"] and "not covered" in privacy["scope"]
    assert f"note: {privacy['scope']}" in printed
    assert privacy["sampling"]["records"] == 1438  # digits' training rows
    assert "WARNING" not in printed  # delta 1e-5 is below 1/1438


def test_not_noised_lists_only_what_the_method_sends(tmp_path: Path) -> None:
    """local sends no gradient: the report said gradients crossed in the clear."""
    argv = ["train", "--method", "local", "--dataset", "iris", "--parties", "3", "--epochs", "1"]
    assert main([*argv, "--dp-embeddings", "1:1", "--quiet", "--out", str(tmp_path / "l")]) == 0
    privacy = json.loads((tmp_path / "l" / "result.json").read_text())["privacy"]
    assert privacy["not_noised"] == [] and privacy["unguarded"] == {}
    argv[2] = "laser"
    assert main([*argv, "--dp-embeddings", "1:1", "--quiet", "--out", str(tmp_path / "s")]) == 0
    privacy = json.loads((tmp_path / "s" / "result.json").read_text())["privacy"]
    assert [text.split(":")[0] for text in privacy["not_noised"]] == ["gradients"]
    # with every head (LASER's default) every party sends gradients, none with noise
    assert privacy["unguarded"] == {f"party-{k}": ["gradients"] for k in range(3)}
    # under secure sums the label party's own representation is sealed for itself alone
    secure = ["--heads", "active", "--secure-agg", "masks", "--dp-gradients", "1:0.01"]
    assert main([*argv, *secure, "--quiet", "--out", str(tmp_path / "m")]) == 0
    privacy = json.loads((tmp_path / "m" / "result.json").read_text())["privacy"]
    assert privacy["unguarded"] == {f"party-{k}": ["representations"] for k in (1, 2)}


def test_a_run_without_noise_or_with_a_large_delta_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--dp-embeddings 0:1` reported epsilon inf for every party and said nothing else. The
    delta warning was a line of the summary only; both are run warnings now, in result.json."""
    argv = [*BASE, "--epochs", "1", "--dp-embeddings", "0:1", "--delta", "0.01"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 0
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert set(result["privacy"]["epsilon"].values()) == {math.inf}
    [unbounded] = [w for w in result["warnings"] if w.startswith("epsilon is inf")]
    [delta] = [w for w in result["warnings"] if w.startswith("delta")]
    assert "(--dp-embeddings SIGMA 0: no noise): the run holds no differential privacy" in unbounded
    assert delta.startswith("delta 0.01 is not below 1/n = 1/1438")
    printed = capsys.readouterr().err
    assert f"secure-vfl: warning: {unbounded}" in printed and delta in printed


def test_a_target_epsilon_covers_the_test_records_released_at_prediction(tmp_path: Path) -> None:
    """Calibration planned the training steps only: with one step an epoch the test records'
    two releases (one per test split) priced 12.13 against a target of 8, and the run exited 0
    with nothing said."""
    argv = ["train", "--method", "laser", "--heads", "active", "--dataset", "breast-cancer"]
    argv += ["--parties", "3", "--epochs", "1", "--batch-size", "456", "--seed", "0", "--quiet"]
    argv += ["--dp-embeddings", "1:1", "--target-epsilon", "8", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    privacy = result["privacy"]
    assert privacy["within_target"] is True and result["warnings"] == []
    for guarantees in privacy["guarantees"].values():
        test = next(g for g in guarantees if g["protects"].startswith("the test records"))
        assert test["releases"] == 2  # mcar:0 and mcar:0.5
        assert 7.5 < test["epsilon"] <= 8.0  # calibrated to it: the binding guarantee here


def test_a_run_over_its_target_says_so() -> None:
    """`within_target` false was in result.json only (a resumed run prices the killed run's
    releases after its checkpoint again)."""
    from secure_vfl.experiment import target_warnings

    privacy = {"target_epsilon": 4.0, "within_target": False}
    [warning] = target_warnings({**privacy, "epsilon": {"party-0": 4.2, "party-1": 3.9}})
    assert warning.startswith("the target epsilon 4 was exceeded: party-0 4.20 (")
    assert target_warnings({**privacy, "within_target": True, "epsilon": {}}) == []
    assert target_warnings(None) == []


def test_target_epsilon_8_keeps_every_guarantee_within_8_by_the_independent_accountant(
    tmp_path: Path,
) -> None:
    out = tmp_path / "target"
    assert main([*EXAMPLE, "--target-epsilon", "8", "--out", str(out)]) == 0
    privacy = json.loads((out / "result.json").read_text())["privacy"]
    assert privacy["within_target"] is True
    assert max(privacy["epsilon"].values()) <= 8.0
    assert max(privacy["epsilon"].values()) > 7.5  # calibrated to, not far below, the target
    sigmas = {mechanism["sigma"] for mechanism in privacy["noise"].values()}
    assert len(sigmas) == 1 and sigmas != {1.0}
    for guarantees in privacy["guarantees"].values():
        for g in guarantees:
            rdp, pld = _independent(_guarantee_event(g))
            assert pld <= 8.0 and rdp <= 8.0 * 1.01
    issue_view = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            privacy["sampling"]["rate"], dp_accounting.GaussianDpEvent(sigmas.pop() / math.sqrt(3))
        ),
        privacy["sampling"]["draws"],
    )
    assert max(_independent(issue_view)) <= 8.0


@pytest.mark.usefixtures("one_thread")
def test_the_same_seed_draws_new_noise_unless_reproducible_noise_is_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--method", "laser", "--dataset", "iris", "--heads", "active", "--quiet"]
    argv += ["--epochs", "2", "--batch-size", "16", "--dp-embeddings", "1:1"]
    argv += ["--dp-gradients", "1:0.05", "--dp-sgd", "1:0.05", "--seed", "3"]

    def run(name: str, *extra: str) -> dict[str, object]:
        assert main([*argv, *extra, "--out", str(tmp_path / name)]) == 0
        result = json.loads((tmp_path / name / "result.json").read_text())
        assert isinstance(result, dict)
        return result

    first, second = run("a"), run("b")
    assert first["samples"] == second["samples"] and first["config"] == second["config"]
    assert first["epoch_loss"] != second["epoch_loss"]  # fresh noise (and Poisson sample)
    insecure = run("c", "--insecure-reproducible-noise")
    again = run("d", "--insecure-reproducible-noise")
    assert insecure["epoch_loss"] == again["epoch_loss"]
    assert insecure["metrics"] == again["metrics"] and insecure["privacy"] == again["privacy"]
    privacy = insecure["privacy"]
    assert isinstance(privacy, dict) and privacy["insecure_reproducible_noise"] is True
    assert "INSECURE" in privacy["noise_source"]
    # Said once a run, through the run warnings (stderr and result.json), not in the summary.
    caveat = "--insecure-reproducible-noise: the noise is reproducible from the seed"
    printed = capsys.readouterr()
    assert printed.err.count(f"secure-vfl: warning: {caveat}") == 2  # runs c and d
    assert caveat not in printed.out
    assert [w for w in again["warnings"] if caveat in w] == [
        f"{caveat}; these epsilons do not hold against anyone who knows it."
    ]  # type: ignore[union-attr]
    assert not [w for w in first["warnings"] if caveat in w]  # type: ignore[union-attr]


def test_add_remove_adjacency_is_chosen_by_flag_and_halves_the_row_shift(tmp_path: Path) -> None:
    argv = ["train", "--method", "laser", "--dataset", "iris", "--heads", "active", "--quiet"]
    argv += ["--epochs", "1", "--dp-gradients", "2:0.05", "--insecure-reproducible-noise"]
    found = {}
    for adjacency in ("replace-one", "add-remove"):
        out = tmp_path / adjacency
        assert main([*argv, "--dp-adjacency", adjacency, "--out", str(out)]) == 0
        privacy = json.loads((out / "result.json").read_text())["privacy"]
        (guarantee,) = [
            g
            for g in privacy["guarantees"]["party-0"]
            if g["protects"].endswith("training records")
        ]
        found[adjacency] = guarantee["noise_multiplier"]
    assert found["add-remove"] == pytest.approx(2 * found["replace-one"])


def test_clipped_embeddings_train_without_their_norms_drifting_to_divergence(
    tmp_path: Path,
) -> None:
    """Regression: clipping every representation (no noise at all) made the bottom models grow
    rows whose growth the clip cancels, until a representation was non-finite at step 67 of
    Satellite; each party now backpropagates through its own clipping."""
    argv = ["train", "--method", "laser", "--heads", "active", "--dataset", "satellite"]
    argv += ["--parties", "4", "--epochs", "3", "--seed", "0", "--quiet"]
    argv += ["--dp-embeddings", "0:1.0", "--insecure-reproducible-noise"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert all(math.isfinite(loss) for loss in result["epoch_loss"])
    assert result["metrics"]["mcar:0"]["accuracy"] > 70.0  # chance is about 24 %


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target-epsilon", "2"], "(--target-epsilon) calibrates a mechanism"),
        (["--dp-embeddings", "1.0"], "SIGMA:CLIP"),
        (["--dp-gradients", "-1:1"], "--dp-gradients"),
        (["--delta", "1"], "expected a probability in (0, 1), found '1'"),
        (["--dp-adjacency", "swap"], "invalid choice: 'swap'"),
        (["--insecure-reproducible-noise"], "expected a DP mechanism with it"),
        (["--dp-sgd", "1:0.05", "--batching", "grouped"], "expected --batching mixed"),
    ],
)
def test_bad_privacy_flags_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    try:
        code = main([*BASE, *extra, "--out", str(tmp_path / "r")])
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_dp_sgd_is_refused_for_combinatorial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--method", "combinatorial", "--dataset", "digits", "--dp-sgd", "1:0.05"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert "--dp-sgd applies to methods with one bottom model per party" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
