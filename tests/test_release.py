"""Release policies for what a secure sum cannot hide (``--release drop|dp``).

Under ``drop`` no sum ever has a single contributor besides the label party; under ``dp`` such
sums are planned and their lone contributor sends exactly those rows clipped and noised, inside
itself, priced by its own accountant. The tests look at what the receiver opens, row by row,
against every party's clean representations recorded where they are made.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace as dataclass_replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MakeData

from protocols.dp import clip_rows
from protocols.privacy import PrivacyEngine, PrivacySpec, release_plan
from protocols.sum_range import REPRESENTATION_BOUND, noised_bound, sum_range
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError, ProtocolError
from secure_vfl.experiment import TrainConfig, TrainResult, run_training
from secure_vfl.federation.aggregator import lone_contributors, refuse_single_contributors
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import RepresentationMessage, SumMessage, SumRequest
from secure_vfl.federation.releases import ReleaseBlocks
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import in_process_parties

SIGMA, CLIP = 0.5, 0.3
RECEIVER = "party-0"


def _config(release: str = "drop", **changes: Any) -> TrainConfig:
    return TrainConfig(
        method="laser",
        dataset="synthetic",
        test_missing=("mcar:0", "mcar:0.5"),
        seed=0,
        method_config=MethodConfig(
            heads="active",
            epochs=2,
            batch_size=32,
            lr=0.05,
            representation_dim=8,
            secure_sums=True,
            release=release,  # type: ignore[arg-type]
            **changes,
        ),
    )


class Observer:
    """Records, in one in-process run, every party's clean contribution (before its own hooks),
    every sum request, and every sum the label party opens."""

    def __init__(self) -> None:
        self.clean: dict[tuple[str, str, int, int, str], RepresentationMessage] = {}
        self.opened: list[SumMessage] = []
        self.requests = RecordingLayer()
        self.parties: list[Any] = []

    def attach(self, channel: Channel) -> None:
        channel.layers.append(self.requests)
        self.parties = in_process_parties(channel)
        for party in self.parties:
            party.contribute = self._kept(party.name, party.contribute)  # type: ignore[method-assign,assignment]
            if party.name == RECEIVER:
                party.take_sum = self._opened(party.take_sum)  # type: ignore[method-assign,assignment]

    def _kept(self, name: str, contribute: Callable[[Any], None]) -> Callable[[Any], None]:
        def record(message: RepresentationMessage) -> None:
            key = (name, message.phase, message.round, message.batch_id, message.tag)
            self.clean[key] = message
            contribute(message)

        return record

    def _opened(self, take_sum: Callable[[SumMessage], None]) -> Callable[[SumMessage], None]:
        def record(message: SumMessage) -> None:
            self.opened.append(message)
            take_sum(message)

        return record

    def sum_requests(self) -> dict[tuple[int, int, str], SumRequest]:
        return {
            (m.round, m.batch_id, m.tag): m
            for m in self.requests.messages
            if isinstance(m, SumRequest) and type(m) is SumRequest
        }

    def row(self, name: str, request: SumRequest, position: int) -> torch.Tensor | None:
        key = (name, request.phase, request.round, request.batch_id, request.source_tag)
        message = self.clean.get(key)
        if message is None:
            return None
        where = torch.nonzero(message.positions == position).flatten()
        return message.representation[int(where[0])] if where.numel() else None


def _run(
    make_data: MakeData, spec: PrivacySpec, config: TrainConfig
) -> tuple[TrainResult, Observer, PrivacyEngine]:
    observer = Observer()
    engine = PrivacyEngine(spec)
    data = make_data(train_missing="mcar:0.3", n=400)
    result = run_training(config, data=data, privacy=engine, on_ready=observer.attach)
    return result, observer, engine


def test_under_release_dp_exactly_the_rows_no_sum_hides_are_noised_and_priced(
    make_data: MakeData,
) -> None:
    spec = PrivacySpec(secure_agg="masks", release="dp", release_noise=(SIGMA, CLIP))
    _, observer, engine = _run(make_data, spec, _config("dp"))
    requests = observer.sum_requests()
    residuals: list[torch.Tensor] = []
    lone_rows: dict[tuple[str, str, int], int] = defaultdict(int)  # (party, phase, round)
    hidden = 0
    for opened in observer.opened:
        request = requests[(opened.round, opened.batch_id, opened.tag)]
        names = request.parties
        flagged = request.dp_rows
        for t, b in np.ndindex(*request.selection.shape[:2]):
            members = [names[k] for k in torch.nonzero(request.selection[t, b]).flatten()]
            others = [name for name in members if name != RECEIVER]
            found = {name: observer.row(name, request, b) for name in members}
            terms = {name: term for name, term in found.items() if term is not None}
            assert len(terms) == len(members)
            noised = [
                n for n in members if flagged is not None and bool(flagged[b, names.index(n)])
            ]
            if len(others) == 1:  # a sum no crowd hides: its lone party's row is a DP release
                assert noised == others
            if noised:
                expected = torch.stack(
                    [
                        clip_rows(term.unsqueeze(0), CLIP)[0] if name in noised else term
                        for name, term in terms.items()
                    ]
                ).sum(dim=0)
                residual = opened.sums[t, b] - expected
                assert float(residual.abs().max()) > 1e-3  # it carries noise, not the clear row
                if len(others) == 1:
                    residuals.append(residual)
            else:
                clear = torch.zeros(opened.sums.shape[-1])
                for term in terms.values():
                    clear = clear + term
                assert torch.allclose(opened.sums[t, b], clear, atol=1e-4)
                hidden += 1
        if flagged is not None:  # each flagged row is released once per request
            for k in torch.nonzero(flagged.any(dim=0)).flatten().tolist():
                lone_rows[(names[k], request.phase, request.round)] += int(flagged[:, k].sum())
    phases = {phase for _, phase, _ in lone_rows}
    assert phases == {"train", "predict"} and hidden > 0
    noise = torch.stack(residuals)
    assert abs(float(noise.std()) / (SIGMA * CLIP) - 1) < 0.15  # the noise is N(0, (sigma C)^2)
    # Each lone contributor priced one event per step (or prediction batch) with exposed rows,
    # naming exactly those rows; the label party, the receiver, released nothing.
    for name, accountant in engine.accountants.items():
        events = [e for e in accountant.events if e.kind == "exposure"]
        seen: dict[tuple[str, str, int], int] = defaultdict(int)
        for event in events:
            assert event.noise_multiplier == SIGMA and len(set(event.rows)) == len(event.rows)
            seen[(name, event.phase, event.round)] += len(event.rows)
        expected_rows = {key: n for key, n in lone_rows.items() if key[0] == name}
        train_events = [e for e in events if e.phase == "train"]
        assert len({e.round for e in train_events}) == len(train_events)  # one per step
        assert dict(seen) == expected_rows
        if name == RECEIVER:
            assert not events
    report = engine.report()
    assert report is not None and report["release"]["policy"] == "dp"
    for name in ("party-1", "party-2", "party-3"):
        (training,) = [g for g in report["guarantees"][name] if not g["amplification"]][:1]
        assert "exposure" in training["mechanisms"] and math.isfinite(training["epsilon"])


def test_release_drop_is_the_default_and_plans_no_exposed_row(make_data: MakeData) -> None:
    default, observer, _ = _run(make_data, PrivacySpec(secure_agg="masks"), _config())
    explicit, _, engine = _run(
        make_data, PrivacySpec(secure_agg="masks", release="drop"), _config("drop")
    )
    assert default.metrics == explicit.metrics and default.epoch_loss == explicit.epoch_loss
    for request in observer.sum_requests().values():
        assert request.dp_rows is None
        assert not bool(lone_contributors(request.selection, 0).any())
    assert all(party.exposure is None for party in observer.parties)
    assert engine.report() is None  # no DP mechanism: nothing installed, nothing priced


def test_dp_exposes_only_a_lone_party_or_a_triples_fixed_member_of_an_unusable_block() -> None:
    start = torch.tensor(
        [[True, True, True, True], [False, True, False, False], [True, True, True, False]]
    )
    blocks = ReleaseBlocks(start.numpy(), receiver=0, seed=0, expose=True)
    rows = torch.arange(3)
    plan = blocks.plan("train", rows, start)
    # A usable triple and a usable pair are clean; the lone party of row 1 is a DP release.
    assert plan.exposed.tolist() == [[False] * 4, [False, True, False, False], [False] * 4]
    assert torch.equal(plan.union(), start)
    # Party 3 dropped: row 0's triple is unusable and only its exposable member may go, noised.
    dropped = start.clone()
    dropped[:, 3] = False
    _, exposable = blocks.blocks_of("train", rows)
    assert exposable[0].sum() == 1 and exposable[1].tolist() == [False, True, False, False]
    plan = blocks.plan("train", rows, dropped)
    member = int(torch.nonzero(exposable[0]).flatten()[0])
    assert plan.exposed[0].tolist() == [k == member and k != 3 for k in range(4)]
    assert torch.equal(plan.union()[0], plan.exposed[0] | (torch.arange(4) == 0))
    # Outside training the one fixed triple {1, 2, 3} exposes its fixed member only.
    test = torch.tensor([[True, True, True, False], [False, True, True, True]])
    fixed, fixed_exposable = blocks.blocks_of("mcar:0.5", torch.arange(2))
    assert fixed[0].tolist()[1:] == [0, 0, 0] and fixed_exposable[0].sum() == 1
    plan = blocks.plan("mcar:0.5", torch.arange(2), test)
    assert torch.equal(plan.exposed[0], fixed_exposable[0] & test[0])
    assert not bool(plan.exposed[1].any()) and torch.equal(plan.union()[1], test[1])
    # Under drop nothing is exposed and the lone party's row has nothing releasable.
    safe = ReleaseBlocks(start.numpy(), receiver=0, seed=0).plan("train", rows, start)
    assert not bool(safe.exposed.any()) and not bool(safe.union()[1].any())


def test_a_lone_contributor_is_refused_unless_its_row_is_a_dp_release() -> None:
    parties = ("party-0", "party-1", "party-2")
    selection = torch.tensor([[[True, True, False], [False, True, True]]])
    with pytest.raises(ProtocolError, match="reveals a single party"):
        refuse_single_contributors(selection, parties, receiver="party-0")
    flagged = lone_contributors(selection, 0).any(dim=0)
    assert flagged.tolist() == [[False, True, False], [False, False, False]]
    counts = refuse_single_contributors(selection, parties, receiver="party-0", dp_rows=flagged)
    assert counts.tolist() == [[2, 2]]
    wrong = torch.zeros_like(flagged)
    wrong[0, 2] = True  # another party's row flagged, not the lone one's
    with pytest.raises(ProtocolError, match="reveals a single party"):
        refuse_single_contributors(selection, parties, receiver="party-0", dp_rows=wrong)


def test_a_party_without_a_release_mechanism_refuses_to_send_exposed_rows(
    make_data: MakeData,
) -> None:
    """The method plans exposed rows (release='dp') but no privacy layer installed the noise:
    the lone contributor refuses rather than let its row out in the clear."""
    from protocols.secagg import MaskingAggregator

    config = _config("dp")
    data = make_data(train_missing="mcar:0.3", n=400)
    with pytest.raises(ProtocolError, match="holds no release mechanism"):
        run_training(config, data=data, aggregator=MaskingAggregator())


def test_the_sum_range_holds_exposed_rows_noise() -> None:
    wide = sum_range({"exposure": (10_000.0, 1.0)}, contributors=4)
    assert wide.value_bound == noised_bound(10_000.0, 1.0) > REPRESENTATION_BOUND
    assert not wide.clipped
    assert sum_range({"exposure": (1.0, 1.0)}, contributors=4).value_bound == REPRESENTATION_BOUND


def test_target_epsilon_calibrates_the_release_within_target(make_data: MakeData) -> None:
    spec = PrivacySpec(secure_agg="masks", release="dp", target_epsilon=4.0)
    result, _, _ = _run(make_data, spec, _config("dp"))
    assert result.privacy is not None and result.privacy["within_target"] is True
    sigma, clip = result.privacy["noise"]["exposure"].values()
    assert sigma > 0 and clip == 1.0
    plan = release_plan("laser", _config("dp").method_config, 4)
    assert [p["exposure"] for p in plan] == [0, 1, 1, 1]
    assert set(result.privacy["epsilon"]) == {"party-1", "party-2", "party-3"}
    assert max(result.privacy["epsilon"].values()) <= 4.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(release="dp", release_noise=(1.0, 1.0)), "--secure-agg masks, paillier or ckks"),
        (dict(release="dp", secure_agg="masks"), r"`release_noise` \(--release-noise\) or"),
        (dict(release_noise=(1.0, 1.0), secure_agg="masks"), "found it with 'drop'"),
        (dict(release="shout", secure_agg="masks"), "`release` must be one of drop, dp"),
    ],
)
def test_bad_release_specs_are_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):  # secure sums may come from a --defense:
        PrivacyEngine(PrivacySpec(**spec))  # the engine refuses a whole run without them


def test_a_spec_and_a_method_config_that_disagree_on_the_release_are_refused_first() -> None:
    """A spec of release drop under a method of release dp trained until a party was asked
    for a DP release it had no mechanism for; the other way round was refused first."""
    plain = PrivacyEngine(PrivacySpec(secure_agg="masks"))
    noisy = PrivacyEngine(PrivacySpec(secure_agg="masks", release="dp", release_noise=(1, 1)))
    for engine, config in ((plain, _config("dp")), (noisy, _config("drop"))):
        with pytest.raises(ConfigError, match=r"release=.* and the method.s release=.* must agree"):
            engine.refuse(config)


def test_release_dp_needs_secure_sums_and_the_single_label_party() -> None:
    with pytest.raises(ConfigError, match="needs secure sums and the single label party"):
        MethodConfig(heads="active", release="dp")
    with pytest.raises(ConfigError, match="needs secure sums and the single label party"):
        MethodConfig(heads="all", secure_sums=True, release="dp")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--release", "dp", "--release-noise", "1:1"], "--secure-agg masks, paillier or ckks"),
        (
            [
                "--release",
                "dp",
                "--secure-agg",
                "masks",
                "--release-noise",
                "1:1",
                "--method",
                "standard",
            ],
            "expected --method laser --heads active",
        ),
        (
            ["--release", "dp", "--secure-agg", "masks", "--heads", "all", "--target-epsilon", "2"],
            "needs secure sums and the single label party",
        ),
        (
            ["--release-noise", "1:1", "--secure-agg", "masks"],
            "found it with 'drop' (--release drop",
        ),
    ],
)
def test_the_command_line_refuses_release_dp_where_it_cannot_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    args = [
        "train",
        "--method",
        "laser",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--out",
        str(tmp_path / "run"),
    ]
    assert (
        main([*args, "--heads", "active", *flags] if "--heads" not in flags else [*args, *flags])
        == 2
    )
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("method", ["false-vfl-1", "plugvfl", "local"])
def test_release_dp_with_another_method_names_the_method_not_the_heads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str
) -> None:
    """Without --heads it answered "expected ... --heads active. Found ... heads='all'": a
    FALSE-VFL or PlugVFL run has only the label party's head and a local run refuses --heads
    active, so following the advice only led to another refusal."""
    args = ["train", "--method", method, "--dataset", "iris", "--epochs", "1", "--parties", "3"]
    args += ["--secure-agg", "masks", "--release", "dp", "--release-noise", "1:1"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"expected --method laser --heads active. Found --method {method}." in err
    assert "heads='all'" not in err
    assert not (tmp_path / "run").exists()


def test_a_clipped_exposed_row_backpropagates_through_its_clipping() -> None:
    """The gradient of a row the mechanism clipped comes back multiplied by the clip's Jacobian
    (no radial push that the clip would cancel); other rows' gradients pass unchanged."""
    from protocols.dp import ExposureNoise
    from protocols.noise import noise_source
    from secure_vfl.federation.messages import GradientMessage, RepresentRequest

    events: list[Any] = []
    layer = ExposureNoise(
        0.0, 1.0, sample_rate=0.5, noise=noise_source([0, 1]), on_event=events.append
    )
    header = {"sender": "party-0", "receiver": "party-1", "round": 3, "batch_id": 0}
    positions = torch.tensor([0, 2])
    layer.on_accepted(
        RepresentRequest(
            **header,
            split="train",
            rows=torch.tensor([7, 9]),
            positions=positions,
            reply_to="aggregator",
        )
    )
    held = torch.tensor([[2.0, 0.0], [0.3, 0.4]])
    contribution = RepresentationMessage(
        **{**header, "sender": "party-1", "receiver": "aggregator"},
        positions=positions,
        representation=held,
    )
    sent = layer.release_exposed(contribution, torch.tensor([True, True]))
    assert torch.allclose(sent.representation, torch.tensor([[1.0, 0.0], [0.3, 0.4]]))
    assert [e.rows for e in events] == [(7, 9)] and events[0].kind == "exposure"
    gradient = GradientMessage(
        **header, positions=positions, gradient=torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    )
    back = layer.on_message(gradient).gradient
    assert torch.allclose(back, torch.tensor([[0.0, 0.5], [1.0, 1.0]]))


def test_a_request_the_party_refuses_leaves_the_exposed_rows_of_the_one_it_answered() -> None:
    """The exposure mechanism names the rows of the request a contribution answered: a later
    request the party refuses (a model it does not hold) neither replaces that request nor
    makes the release of its exposed rows fail."""
    from protocols.dp import ExposureNoise
    from protocols.noise import noise_source
    from secure_vfl.federation.messages import RepresentRequest
    from secure_vfl.federation.parties import DataParty, Party

    party = DataParty("party-1", {"train": torch.randn(10, 3)}, torch.nn.Linear(3, 2), None)
    channel, label = Channel(), Party("party-0")
    party.connect(channel)
    label.connect(channel)
    events: list[Any] = []
    layer = ExposureNoise(
        0.0, 1.0, sample_rate=0.5, noise=noise_source([0, 1]), on_event=events.append
    )
    party.incoming.append(layer)
    party.exposure = layer
    request = RepresentRequest(
        sender="party-0",
        receiver="party-1",
        round=3,
        batch_id=0,
        split="train",
        rows=torch.tensor([7, 9]),
        positions=torch.tensor([0, 2]),
        reply_to="party-0",
    )
    label.expect("representation", senders=["party-1"], round=3, batch_id=0)
    label.send(request)
    contribution = RepresentationMessage(
        sender="party-1",
        receiver="aggregator",
        round=3,
        batch_id=0,
        positions=request.positions,
        representation=torch.tensor([[0.3, 0.4], [0.0, 0.5]]),
    )
    for later in ({"round": 4}, {}):  # a later step's request, and one of the same step
        refused = dataclass_replace(request, rows=torch.tensor([1, 2]), model="nope", **later)
        with pytest.raises(ProtocolError, match="model 'nope' requested"):
            label.send(refused)
        layer.release_exposed(contribution, torch.tensor([True, True]))
    assert [(e.kind, e.round, e.rows) for e in events] == [("exposure", 3, (7, 9))] * 2
