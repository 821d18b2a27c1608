"""Differential privacy under ``--federation``: each data party installs its own mechanisms from
the privacy plan in its ``setup``, in its own process, draws its noise from its own OS entropy,
runs its own accountant and reports what it priced at the end; the label party's result lists
every party's guarantee as the in-process run does. The plan and the report are checked as
another party's bytes (unit tests, no processes); two runs on loopback (real processes, each
stopped by its pid) check the figures against the in-process run and the target epsilon."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_deploy import (
    PARTIES,
    Processes,
    deployed,
    in_process,
    write_federation,
    write_party_files,
)
from torch import nn

from protocols import tls
from protocols.dp import GaussianRelease, Guarantee
from protocols.noise import noise_source
from protocols.party_privacy import PartyPlan, PartyPrivacy, RequestedRows, read_entry
from protocols.party_privacy import served_privacy as served_half
from protocols.sum_range import SumRange
from secure_vfl.checkpoints import rejoin_from_journal, start_journal
from secure_vfl.cli import main
from secure_vfl.deployment import SETUP_KEYS, ServedCheckpoints, served_privacy
from secure_vfl.errors import IntegrityError, ProtocolError
from secure_vfl.federation.messages import (
    DeploymentMessage,
    RepresentationMessage,
    RepresentRequest,
)
from secure_vfl.federation.parties import DataParty

pytestmark = pytest.mark.processes  # party processes, loopback endpoints, deadlines

PLAN = PartyPlan(
    noise={"embedding": (1.5, 1.0), "dp-sgd": (0.8, 0.05)},
    sample_rate=0.25,
    draws=8,
    epoch_ends=(4, 8),
    records=20,
    delta=1e-5,
    adjacency="replace-one",
    grad_sample_mode="auto",
    value_range=SumRange(100.0, 4, True),
)


def test_a_party_plan_survives_its_setup_as_json_unchanged() -> None:
    wire = json.loads(json.dumps(PLAN.to_json()))
    assert PartyPlan.from_json(wire) == PLAN
    assert PartyPlan.from_json(wire).steps_per_epoch == 4


def _changed(**changes: Any) -> dict[str, Any]:
    body = PLAN.to_json()
    body.update(changes)
    return body


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "keys ["),
        ({k: v for k, v in PLAN.to_json().items() if k != "delta"}, "keys ["),
        ({**PLAN.to_json(), "seed": 0}, "keys ["),
        (_changed(sample_rate=1.5), "`sample_rate` in (0, 1] expected; found 1.5"),
        (_changed(draws=True), "`draws` of type"),
        (_changed(noise={"statistics": [1.0, 1.0]}), "a mechanism of"),
        (_changed(noise={"embedding": [-1.0, 1.0]}), "SIGMA >= 0 and CLIP > 0"),
        (_changed(noise={"embedding": [math.nan, 1.0]}), "SIGMA >= 0 and CLIP > 0"),
        (_changed(noise={"embedding": [1.0]}), "as [SIGMA, CLIP]"),
        (_changed(epoch_ends=[8, 4]), "`epoch_ends`"),
        (_changed(epoch_ends=[4, 9]), "`epoch_ends`"),
        (_changed(adjacency="swap"), "`adjacency`"),
        (_changed(grad_sample_mode="fast"), "`grad_sample_mode`"),
        (_changed(delta=1.0), "`delta` in (0, 1)"),
        (
            _changed(value_range={"value_bound": -1.0, "contributors": 4, "clipped": True}),
            "positive, finite value bound",
        ),
    ],
)
def test_a_malformed_privacy_plan_is_refused_saying_what_was_expected(
    body: Any, message: str
) -> None:
    with pytest.raises(ProtocolError, match="setup: the `privacy") as refused:
        PartyPlan.from_json(body)
    assert message in str(refused.value)


def _party(name: str = "shop") -> DataParty:
    model = nn.Linear(3, 2)
    blocks = {"train": torch.zeros(PLAN.records, 3)}
    return DataParty(name, blocks, model, torch.optim.SGD(model.parameters(), lr=0.1))


def _setup(privacy: Any) -> DeploymentMessage:
    # a set-up of the right shape (what else it says is build_served_party's to check)
    empty = {
        key: (kind[0] if isinstance(kind, tuple) else kind)() for key, kind in SETUP_KEYS.items()
    }
    body = empty | {"privacy": privacy}
    return DeploymentMessage(
        sender="bank", receiver="shop", round=0, batch_id=0, topic="setup", body=json.dumps(body)
    )


def test_a_setup_privacy_part_is_installed_only_by_a_process_that_offers_dp() -> None:
    party = _party()
    assert served_privacy("shop", _setup(None), party, None) is None
    with pytest.raises(ProtocolError, match="offers no DP mechanisms"):
        served_privacy("shop", _setup(PLAN.to_json()), party, None)
    with pytest.raises(ProtocolError, match="`sample_rate`"):
        served_privacy("shop", _setup(_changed(sample_rate=0)), party, served_half)
    # Gradient noise protects a head's labels: refused at a party that holds no head.
    with pytest.raises(ProtocolError, match="holds no head"):
        served_half("shop", _changed(noise={"gradient": [1.0, 0.1]}), _party())


def _first_release(party: DataParty) -> torch.Tensor:
    """What ``party`` sends of the same representation, after its outgoing hooks."""
    request = RepresentRequest(
        sender="bank",
        receiver=party.name,
        round=0,
        batch_id=0,
        split="train",
        rows=torch.arange(4),
        positions=torch.arange(4),
        reply_to="aggregator",
    )
    for layer in party.incoming:
        request = layer.on_message(request)
    sent = RepresentationMessage(
        sender=party.name,
        receiver="aggregator",
        round=0,
        batch_id=0,
        positions=torch.arange(4),
        representation=torch.full((4, 2), 0.25),
    )
    return party.release(sent).representation


def test_a_served_partys_noise_is_fresh_entropy_never_the_seed() -> None:
    # Two data parties built from the same setup (the same seed): their embedding noise
    # differs, and each reports a secure source.
    halves, released = [], []
    for _ in range(2):
        party = _party()
        halves.append(served_half("shop", PLAN.to_json(), party))
        released.append(_first_release(party))
    assert not torch.equal(released[0], released[1])
    assert all(not torch.equal(r, torch.full((4, 2), 0.25)) for r in released)  # noised
    entry = halves[0].entry()
    assert "operating-system entropy" in entry["noise_source"]
    assert entry["releases"] == {"embedding": 1}


def test_a_served_party_prices_the_rows_it_was_asked_for_as_the_schedule_would() -> None:
    # One embedding release per step; the party's view of the batches (the rows it was asked
    # for) gives the guarantee the engine gives over the same schedule.
    schedule = [torch.tensor([0, 3, 5]), torch.tensor([3, 7]), torch.tensor([3])]
    requested = RequestedRows(len(schedule), PLAN.records)
    plan = PartyPlan(**{**PLAN.__dict__, "draws": len(schedule), "epoch_ends": (len(schedule),)})
    halves = [
        PartyPrivacy(
            "shop",
            plan,
            noise=lambda stream: noise_source(None),
            schedule=view,
            sampling="s",
            source="x",
        )
        for view in (requested.schedule, lambda: [rows.numpy() for rows in schedule])
    ]
    for step, rows in enumerate(schedule):
        requested.on_accepted(requested.on_message(_request(step, rows)))
        for half in halves:
            half.accountant.on_event(GaussianRelease("shop", 1.5, 0.25, "embedding", step))
    assert halves[0].guarantees() == halves[1].guarantees()
    (guarantee,) = halves[0].guarantees()
    assert guarantee.releases == 3  # row 3, in every step
    with pytest.raises(ProtocolError, match="privacy plan has 3 steps"):
        requested.on_message(_request(3, torch.tensor([0])))


def test_a_served_partys_view_of_the_batches_survives_its_checkpoint_and_refuses_another() -> None:
    requested = RequestedRows(3, PLAN.records)
    requested.on_accepted(requested.on_message(_request(0, torch.tensor([0, 3, 5]))))
    # another request of the step
    requested.on_accepted(requested.on_message(_request(0, torch.tensor([3, 9]))))
    requested.on_accepted(requested.on_message(_request(2, torch.tensor([7]))))
    state = json.loads(json.dumps(requested.checkpoint_state()))  # as the checkpoint keeps it
    assert state == {"0": [0, 3, 5, 9], "2": [7]}
    again = RequestedRows(3, PLAN.records)
    again.restore_checkpoint(state)
    assert [rows.tolist() for rows in again.schedule()] == [[0, 3, 5, 9], [], [7]]
    bad_steps = ({"3": [1]}, {"x": [1]}, {"\u00b2": [1]}, {"9" * 5000: [1]})  # '²'.isdigit()
    bad_rows = ({"0": [PLAN.records]}, {"0": [-1]}, {"0": [1.0]}, [1])
    for bad in (*bad_steps, *bad_rows):
        with pytest.raises(ValueError, match="expected"):
            RequestedRows(3, PLAN.records).restore_checkpoint(bad)


def test_a_party_rejoining_under_dp_takes_back_its_releases_and_rows_from_its_journal(
    tmp_path: Path,
) -> None:
    first = _party()
    served_half("shop", PLAN.to_json(), first)
    start_journal(tmp_path, first, RUN)
    [requested] = [hook for hook in first.incoming if isinstance(hook, RequestedRows)]
    for step, rows in enumerate([torch.tensor([0, 3]), torch.tensor([3, 7])]):
        requested.on_accepted(requested.on_message(_request(step, rows)))
        first.accountant.on_event(GaussianRelease("shop", 1.5, 0.25, "embedding", step))
        first.accountant.on_event(GaussianRelease("shop", 0.8, 0.25, "dp-sgd", step))
    # Its process dies; a new one, set up anew, rejoins the run.
    again = _party()
    served_half("shop", PLAN.to_json(), again)
    # the DP-SGD steps too, discarded: priced against the receivers, not in the fresh model's
    assert rejoin_from_journal(tmp_path, again, RUN) == 4
    assert again.accountant.releases("shop") == {"embedding": 2, "dp-sgd-discarded": 2}
    assert [e.discarded for e in again.accountant.events if e.kind == "dp-sgd"] == [True, True]
    [view] = [hook for hook in again.incoming if isinstance(hook, RequestedRows)]
    assert [rows.tolist() for rows in view.schedule()[:3]] == [[0, 3], [3, 7], []]
    view.on_accepted(view.on_message(_request(2, torch.tensor([1]))))  # the journal goes on
    again.accountant.on_event(GaussianRelease("shop", 1.5, 0.25, "embedding", 2))
    third = _party()
    served_half("shop", PLAN.to_json(), third)
    assert rejoin_from_journal(tmp_path, third, RUN) == 5
    [view] = [hook for hook in third.incoming if isinstance(hook, RequestedRows)]
    assert [rows.tolist() for rows in view.schedule()[:3]] == [[0, 3], [3, 7], [1]]
    with pytest.raises(IntegrityError, match=r"release journal .* expected"):
        rejoin_from_journal(tmp_path / "elsewhere", _served(), RUN)
    with pytest.raises(IntegrityError, match="a release of run"):
        rejoin_from_journal(tmp_path, _served(), "fedcba9876543210")


def _served() -> DataParty:
    party = _party()
    served_half("shop", PLAN.to_json(), party)
    return party


RUN = "0123456789abcdef"


def _request(step: int, rows: torch.Tensor) -> RepresentRequest:
    return RepresentRequest(
        sender="bank",
        receiver="shop",
        round=step,
        batch_id=0,
        split="train",
        rows=rows,
        positions=torch.arange(rows.numel()),
        reply_to="aggregator",
    )


def _entry(**changes: Any) -> dict[str, Any]:
    guarantee = Guarantee(
        protects="its training records",
        observer="o",
        mechanisms=("dp-sgd",),
        adjacency="a",
        sampling="s",
        amplification=True,
        accountant="rdp (Opacus)",
        epsilon=2.5,
        delta=1e-5,
        noise_multiplier=1.0,
        releases=8,
    ).to_json()
    entry = {
        "guarantees": [guarantee | changes.pop("guarantee", {})],
        "epsilon_per_epoch": [1.0, 2.5],
        "releases": {"dp-sgd": 8},
        "exposed": {"train": 0, "predict": 0, "train_rows": 0},
        "noise_source": "AES",
    }
    return entry | changes


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("nothing", "keys ["),
        (_entry(guarantee={"epsilon": -1.0}), "an epsilon >= 0 expected"),
        (_entry(guarantee={"epsilon": math.nan}), "an epsilon >= 0 expected"),
        (_entry(guarantee={"delta": 1e-3}), "the run's delta"),
        (_entry(guarantee={"releases": "8"}), "`releases` of type"),
        (_entry(releases={"dp-sgd": -1}), "as counts expected"),
        (_entry(epsilon_per_epoch=["a"]), "`epsilon_per_epoch`"),
    ],
)
def test_a_partys_report_about_itself_is_checked_before_it_is_listed(
    entry: Any, message: str
) -> None:
    assert read_entry("shop", _entry(), delta=1e-5)["guarantees"][0]["epsilon"] == 2.5
    with pytest.raises(ProtocolError, match="report from shop: its privacy entry") as refused:
        read_entry("shop", entry, delta=1e-5)
    assert message in str(refused.value)


# -- real processes on loopback ---------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deploy-dp")
    write_party_files(directory)
    tls.make_federation(directory / "certs", [*PARTIES, "aggregator"])
    return directory


DP = ["--method", "laser", "--heads", "active", "--dp-sgd", "1.0:0.05"]
DP += ["--dp-gradients", "1.0:0.01"]


def test_a_deployed_dp_run_reports_every_partys_guarantee_at_the_in_process_epsilons(
    site: Path,
    processes: Processes,
    tmp_path: Path,
) -> None:
    # A batch as large as the training set: every record in every step (rate 1), so the
    # per-record figures do not depend on the fresh Poisson sample and the two runs compare.
    flags = [*DP, "--batch-size", "256"]
    alone = in_process(site, tmp_path / "alone", *flags)["privacy"]
    result, codes = deployed(site, processes, tmp_path / "deployed", *flags)
    assert codes == [0, 0, 0, 0], [processes.log(n) for n in (*PARTIES[1:], "aggregator")]
    privacy = result["privacy"]
    assert set(privacy["guarantees"]) == set(PARTIES)
    assert privacy["sampling"]["rate"] == alone["sampling"]["rate"] == 1.0
    assert set(alone["epsilon"]) == set(PARTIES)  # the in-process run names them by file
    assert privacy["epsilon"] == pytest.approx(alone["epsilon"], rel=1e-9)
    assert privacy["epsilon"]["bank"] > privacy["epsilon"]["shop"]  # gradients + DP-SGD
    for name in PARTIES[1:]:
        assert "reported about itself" in privacy["accounted_by"][name]
        (model,) = privacy["guarantees"][name]
        assert model["mechanisms"] == ["dp-sgd"] and model["amplification"] is True
        assert privacy["releases"][name]["dp-sgd"] == alone["releases"][name]["dp-sgd"]
    assert "this process" in privacy["accounted_by"]["bank"]
    assert {g["mechanisms"][0] for g in privacy["guarantees"]["bank"]} == {"gradient", "dp-sgd"}
    assert privacy["epsilon_per_epoch"]["shop"][-1] == pytest.approx(privacy["epsilon"]["shop"])


def test_gradient_dp_alone_runs_deployed_as_in_one_process(
    site: Path,
    processes: Processes,
    tmp_path: Path,
) -> None:
    """`--dp-gradients` alone stopped at set-up: every data party was sent a plan of no
    mechanism (only the label party noises what it sends) and refused it as malformed; left
    without one, a data party's Paillier shares were sized otherwise than the label party's
    opener and decoded 4x too large. SIGMA 0 and a batch as large as the training set (rate 1)
    make both runs the same run: Paillier's fixed-point sums are exact, so the metrics agree."""
    flags = ["--method", "laser", "--heads", "active", "--dp-gradients", "0:0.01"]
    flags += ["--secure-agg", "paillier", "--epochs", "1", "--batch-size", "256"]
    alone = in_process(site, tmp_path / "alone", *flags)
    result, codes = deployed(site, processes, tmp_path / "deployed", *flags)
    assert codes == [0, 0, 0, 0], [processes.log(n) for n in (*PARTIES[1:], "aggregator")]
    assert result["metrics"] == alone["metrics"]
    assert result["epoch_loss"] == pytest.approx(alone["epoch_loss"], rel=1e-6)
    privacy = result["privacy"]
    assert set(privacy["epsilon"]) == set(alone["privacy"]["epsilon"]) == {"bank"}
    for name in PARTIES[1:]:
        assert "reported about itself" in privacy["accounted_by"][name]
        assert privacy["guarantees"].get(name) is None  # it released nothing noised


def test_a_deployed_run_with_a_target_epsilon_keeps_every_partys_epsilon_within_it(
    site: Path,
    processes: Processes,
    tmp_path: Path,
) -> None:
    # Embedding noise at every data party, priced over the rows it was asked for, its
    # noise sized into masked sums: the secure-sum range travels in the plan too.
    flags = [*DP, "--dp-embeddings", "1.0:1.0", "--secure-agg", "masks", "--target-epsilon", "8"]
    result, codes = deployed(site, processes, tmp_path / "target", *flags)
    assert codes == [0, 0, 0, 0], [processes.log(n) for n in (*PARTIES[1:], "aggregator")]
    privacy = result["privacy"]
    assert set(privacy["epsilon"]) == set(PARTIES)
    assert privacy["within_target"] is True
    assert all(0 < epsilon <= 8.0 for epsilon in privacy["epsilon"].values())
    for name in PARTIES[1:]:
        mechanisms = {m for g in privacy["guarantees"][name] for m in g["mechanisms"]}
        assert mechanisms == {"embedding", "dp-sgd"}
        assert privacy["releases"][name]["embedding"] > 0
    (sigma,) = {mechanism["sigma"] for mechanism in privacy["noise"].values()}
    assert sigma != 1.0  # calibrated
    assert privacy["sum_range"]["clipped"] is True


def test_what_a_deployment_cannot_do_with_dp_is_refused_before_any_contact(
    site: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    federation = write_federation(site, site / "certs", [1, 2, 3, 4, 5])
    base = ["train", "--federation", str(federation), "--name", "bank", "--method", "laser"]
    base += ["--quiet"]
    base += ["--out", str(tmp_path / "r"), "--wait", "1", "--deadline", "1"]
    cases = [
        (["--dp-sgd", "1:0.05", "--insecure-reproducible-noise"], "noise anyone with the seed"),
        (["--test-file", str(site / "labels.csv")], "--test-file not offered"),
        (["--method", "false-vfl-2", "--dp-sgd", "1:0.05"], "not available for false-vfl-2"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_a_dp_party_rejoining_from_its_checkpoint_prices_its_releases_up_to_its_death(
    tmp_path: Path,
) -> None:
    # Its checkpoint of step 1 holds the releases and rows of step 0; the journal those of step
    # 1, after it, up to its death. Restarted and readmitted from that checkpoint, it prices
    # both (their receivers saw them), the DP-SGD step after the checkpoint as discarded (its
    # model died, but the messages after it were computed with it; as on resume), and knows
    # every row it was asked for.
    first = _served()
    own = ServedCheckpoints("shop", tmp_path, resume=False)
    own.start(first, {**CHECKPOINTS, "step": 0, "manifest": None, "committed": None})
    [requested] = [hook for hook in first.incoming if isinstance(hook, RequestedRows)]
    for step, rows in enumerate([torch.tensor([0, 3]), torch.tensor([3, 7])]):
        requested.on_accepted(requested.on_message(_request(step, rows)))
        first.accountant.on_event(GaussianRelease("shop", 1.5, 0.25, "embedding", step))
        first.accountant.on_event(GaussianRelease("shop", 0.8, 0.25, "dp-sgd", step))
        if step == 0:
            written = own.write(first, {"run": RUN, "step": 1, "committed": None})
    again = _served()
    rejoin = {**CHECKPOINTS, "step": 1, "manifest": written["manifest"], "committed": 1}
    answer = ServedCheckpoints("shop", tmp_path, resume=False).start(
        again, {**rejoin, "rejoin": True}
    )
    assert answer == {"run": RUN, "step": 1}
    assert again.accountant.releases("shop") == {
        "embedding": 2,
        "dp-sgd": 1,
        "dp-sgd-discarded": 1,
    }
    [view] = [hook for hook in again.incoming if isinstance(hook, RequestedRows)]
    assert [rows.tolist() for rows in view.schedule()[:3]] == [[0, 3], [3, 7], []]


CHECKPOINTS = {"run": RUN, "every": 1, "rejoin": False}
