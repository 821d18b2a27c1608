"""The whole-run audit of what secure sums hand the label party (issue 14, item 2).

Every sum the label party asks the aggregator for during a run (each training step of every
epoch, each prediction under every test split) is recorded from the messages themselves (a
:class:`RecordingLayer` on the channel) and turned into indicator vectors over the parties, per
sample. :func:`isolated_terms` then asks whether any linear combination over the reals of a
sample's releases isolates one party's term. Test splits here are the same test samples under
different missingness (as a run's mcar 0 / 0.2 / 0.5 are), so their releases add up.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, cast

import numpy as np
import pytest
import torch
from conftest import MakeData
from test_faults import LosingChannel

from protocols.privacy import PrivacyEngine, PrivacySpec
from secure_vfl.data.vertical import VerticalData, VerticalSplit
from secure_vfl.experiment import TrainConfig, build_method, run_training
from secure_vfl.federation.aggregator import PlainAggregator
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import (
    RepresentRequest,
    SealedSumMessage,
    SumMessage,
    SumRequest,
)
from secure_vfl.federation.releases import BlockPlan, ReleaseBlocks, isolated_terms
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.false_vfl import FalseVflConfig

RECEIVER = 0
Sample = tuple[str, int]


class ReleaseLedger:
    """Every sum the label party receives in a run, per sample: the clean part of each sum (an
    indicator vector over the parties, the receiver's own column cleared) and the parties whose
    row entered some sum as a DP release (``dp_rows``). A sum asked for but never delivered (the
    attempt of a step a party was lost in, which the driver abandons) released nothing."""

    def __init__(self) -> None:
        self.recorder = RecordingLayer()

    def attach(self, channel: Channel) -> None:
        channel.layers.append(self.recorder)

    def releases(self) -> dict[Sample, tuple[set[tuple[bool, ...]], set[int]]]:
        """sample -> (the distinct clean vectors released about it, its exposed parties). A
        sample is ``("train", row)`` or ``("test", row)``: every test split holds the same
        test samples in the same order. Each delivered sum is read through its request (its
        rows, its ``dp_rows``) and, sealed, by the shares that entered it."""
        rows: dict[tuple[int, int, str, str], tuple[str, dict[int, int]]] = {}
        summed: set[tuple[int, int, str, str]] = set()  # representations some request sums
        asked: dict[tuple[int, int, str, str, str], tuple[SumRequest, str, dict[int, int]]] = {}
        out: dict[Sample, tuple[set[tuple[bool, ...]], set[int]]] = defaultdict(
            lambda: (set(), set())
        )
        for message in self.recorder.messages:
            if isinstance(message, RepresentRequest):
                key = (message.round, message.batch_id, message.phase, message.tag)
                if key in summed or key not in rows:  # a new pass (a retry under the same key)
                    rows[key] = (message.split, {})
                    summed.discard(key)
                split, positions = rows[key]
                assert split == message.split
                positions.update(
                    zip(message.positions.tolist(), message.rows.tolist(), strict=True)
                )
            elif type(message) is SumRequest:
                source = (message.round, message.batch_id, message.phase, message.source_tag)
                summed.add(source)
                split, positions = rows.get(source, ("", {}))
                sum_key = (*source[:3], message.tag, message.deliver_to)
                asked[sum_key] = (message, split, positions)
            elif isinstance(message, SumMessage | SealedSumMessage):
                sum_key = (message.round, message.batch_id, message.phase, message.tag)
                found = asked.pop((*sum_key, message.receiver), None)
                assert found is not None, f"a sum delivered that nobody asked for: {sum_key}"
                request, split, positions = found
                selection = request.selection
                if isinstance(message, SealedSumMessage):  # the shares that entered it
                    assert message.parties == request.parties
                    selection = message.selection
                assert torch.equal(selection.sum(dim=2), message.counts)
                group = "train" if split == "train" else "test"
                dp = request.dp_rows
                for t, b in zip(*np.nonzero(selection.any(dim=2).numpy()), strict=True):
                    members = selection[t, b].clone()
                    members[RECEIVER] = False
                    if not bool(members.any()):
                        continue  # the receiver's own term alone (its own request is local)
                    assert int(b) in positions, f"a sum of row {b} that no request asked for"
                    noised = members & dp[b] if dp is not None else torch.zeros_like(members)
                    clean, exposed = out[(group, positions[int(b)])]
                    clean.add(tuple((members & ~noised).tolist()))
                    exposed.update(int(k) for k in torch.nonzero(noised).flatten())
        return dict(out)

    def isolated(self) -> list[tuple[Sample, int]]:
        """(sample, party) for every party term some combination of releases isolates."""
        releases = self.releases()
        samples = sorted(releases)
        if not samples:
            return []
        parties = len(next(iter(releases[samples[0]][0])))
        most = max(len(releases[s][0]) for s in samples)
        released = np.zeros((len(samples), most, parties))
        exposed = np.zeros((len(samples), parties), dtype=bool)
        for i, sample in enumerate(samples):
            clean, noised = releases[sample]
            for j, vector in enumerate(sorted(clean)):
                released[i, j] = vector
            exposed[i, sorted(noised)] = True
        found = isolated_terms(released, exposed)
        return [(samples[i], int(k)) for i, k in zip(*np.nonzero(found), strict=True)]


def shared_test_rows(data: VerticalData, rates: tuple[float, ...], seed: int) -> VerticalData:
    """``data`` with one test split per MCAR rate over the *same* test samples (no sample
    dropped, so row i is one sample in every split), as a run's test settings are."""
    base = data.tests[next(iter(data.tests))]
    rng = np.random.default_rng(seed)
    tests = {}
    for rate in rates:
        mask = base.mask & (rng.random(base.mask.shape) >= rate)
        tests[f"mcar:{rate:g}"] = VerticalSplit(blocks=base.blocks, labels=base.labels, mask=mask)
    return dataclasses.replace(data, tests=tests)


def _config(parties: int, release: str, epochs: int = 3) -> TrainConfig:
    return TrainConfig(
        method="laser",
        dataset="synthetic",
        parties=parties,
        seed=0,
        method_config=MethodConfig(
            heads="active",
            epochs=epochs,
            batch_size=32,
            lr=0.05,
            representation_dim=8,
            secure_sums=True,
            release=release,  # type: ignore[arg-type]
        ),
    )


def _audit_data(make_data: MakeData, parties: int, rates: tuple[float, ...]) -> VerticalData:
    return shared_test_rows(
        make_data(parties=parties, train_missing="mcar:0.3", n=300), rates, seed=1
    )


def _audited_run(make_data: MakeData, parties: int, release: str) -> ReleaseLedger:
    data = _audit_data(make_data, parties, (0.0, 0.2, 0.5))
    ledger = ReleaseLedger()
    spec = PrivacySpec(
        secure_agg="masks",
        release=release,
        release_noise=(0.5, 0.3) if release == "dp" else None,
    )
    privacy = PrivacyEngine(spec)
    run_training(_config(parties, release), data=data, privacy=privacy, on_ready=ledger.attach)
    assert ledger.releases(), "the run released nothing: the audit would pass vacuously"
    return ledger


@pytest.mark.parametrize("parties", [4, 7])
@pytest.mark.parametrize("release", ["drop", "dp"])
def test_no_combination_of_a_whole_runs_sums_isolates_a_party(
    make_data: MakeData, parties: int, release: str
) -> None:
    ledger = _audited_run(make_data, parties, release)
    isolated = ledger.isolated()
    assert not isolated, f"{len(isolated)} party terms isolated, e.g. {isolated[:5]}"
    releases = ledger.releases()
    # Not vacuous: other parties' terms were released, in training and at test, and under
    # dp some rows went as DP releases.
    for group in ("train", "test"):
        assert any(
            any(any(v) for v in clean) for (g, _), (clean, _) in releases.items() if g == group
        )
    assert any(exposed for _, exposed in releases.values()) == (release == "dp")


def test_a_party_dropped_mid_run_leaves_no_term_isolated(make_data: MakeData) -> None:
    """A drop makes its blocks unusable for the rest of the run (training and prediction);
    the blocks the others had before it must not be re-cut around the hole."""
    data = _audit_data(make_data, 7, (0.0, 0.5))
    channel, ledger = Channel(), ReleaseLedger()
    ledger.attach(channel)
    config = _config(7, "drop").method_config
    method = METHODS.get("laser")(
        data, config, seed=0, channel=channel, aggregator=PlainAggregator()
    )

    def drop_midway(step: int, loss: float) -> None:
        if step == 12:
            method.fed.drop("party-2", round=step, what="a test drop")

    method.fit(on_step=drop_midway)
    for name in data.tests:
        method.predict(name)
    assert "party-2" in method.fed.dropped
    assert not ledger.isolated()


@pytest.mark.parametrize("kind", ["represent-request", "gradient"])
def test_the_audit_counts_the_sums_delivered_when_a_party_is_lost_mid_step_under_dp(
    make_data: MakeData, kind: str
) -> None:
    """The ledger took every sum *asked* for as a release: the attempt a party is lost in asks
    for a sum over rows whose requests never reached the lost party, which the aggregator then
    never delivers, and under ``--release dp`` the audit ended in a KeyError. Only the sums the
    label party received count, with the shares that entered them."""
    data = _audit_data(make_data, 4, (0.0, 0.5))
    channel, ledger = LosingChannel(kind), ReleaseLedger()
    spec = PrivacySpec(secure_agg="masks", release="dp", release_noise=(0.5, 0.3))
    config = _config(4, "dp", epochs=2)
    run_training(
        config, data=data, channel=channel, privacy=PrivacyEngine(spec), on_ready=ledger.attach
    )
    assert channel.lost
    messages = ledger.recorder.messages
    asked = sum(type(m) is SumRequest for m in messages)
    assert sum(isinstance(m, SealedSumMessage) for m in messages) == asked - 1  # one abandoned
    releases = ledger.releases()
    assert releases and any(exposed for _, exposed in releases.values())
    assert not ledger.isolated()


@pytest.mark.parametrize("release", ["drop", "dp"])
@pytest.mark.usefixtures("fresh_subsets_rule")
def test_the_audit_catches_the_rule_that_drew_a_fresh_subset_every_step(
    make_data: MakeData, release: str
) -> None:
    isolated = _audited_run(make_data, 4, release).isolated()
    assert {group for (group, _), _ in isolated} == {"train", "test"}


def test_a_run_whose_sums_are_only_each_samples_full_union_passes(
    make_data: MakeData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: one test split and the whole observed set (>= 2 others) every time."""

    def full_union(
        self: ReleaseBlocks, split: str, rows: torch.Tensor, mask: torch.Tensor
    ) -> BlockPlan:
        others = mask.clone()
        others[:, self.receiver] = False
        others &= (others.sum(dim=1) >= 2).unsqueeze(1)
        own = torch.zeros_like(mask)
        own[:, self.receiver] = mask[:, self.receiver]
        return BlockPlan(torch.stack([own, others], dim=1), torch.zeros_like(mask), mask.sum(dim=1))

    monkeypatch.setattr(ReleaseBlocks, "plan", full_union)
    data = _audit_data(make_data, 4, (0.2,))
    ledger = ReleaseLedger()
    spec = PrivacySpec(secure_agg="masks")
    config = dataclasses.replace(_config(4, "drop"), test_missing=("mcar:0.2",))
    run_training(config, data=data, privacy=PrivacyEngine(spec), on_ready=ledger.attach)
    assert ledger.releases() and not ledger.isolated()


def _vectors(*subsets: str, parties: str = "RABC") -> np.ndarray:
    """Indicator rows over ``parties`` (R is the receiver) of sums such as ``"AB"``."""
    return np.array([[float(p in s) for p in parties] for s in subsets])


def test_three_pairwise_sums_isolate_every_term_over_the_reals() -> None:
    # Over GF(2) A+B, A+C and B+C are dependent and isolate nothing; over the reals,
    # A = ((A+B) + (A+C) - (B+C)) / 2.
    found = isolated_terms(_vectors("AB", "AC", "BC")[None], np.zeros((1, 4), dtype=bool))
    assert found.tolist() == [[False, True, True, True]]


def test_overlapping_unions_isolate_their_difference_and_disjoint_blocks_do_not() -> None:
    none = np.zeros((1, 5), dtype=bool)
    overlapping = _vectors("ABC", "AB", parties="RABCD")[None]
    assert isolated_terms(overlapping, none).tolist() == [[False, False, False, True, False]]
    # Unions of the disjoint blocks {A, B} and {C, D}: every combination is constant on each.
    blocks = _vectors("AB", "CD", "ABCD", parties="RABCD")[None]
    assert not isolated_terms(blocks, none).any()


def test_an_exposure_is_known_to_the_audit_of_everyone_but_its_own_party() -> None:
    none = np.zeros((1, 4), dtype=bool)
    exposed_a = np.array([[False, True, False, False]])
    # A's DP release next to a clean A+B gives B (with only A's noise on it); A is priced.
    assert isolated_terms(_vectors("AB")[None], exposed_a).tolist() == [[False, False, True, False]]
    # Next to A+B+C it isolates nobody; without it A+B+C isolates nobody either.
    assert not isolated_terms(_vectors("ABC")[None], exposed_a).any()
    assert not isolated_terms(_vectors("ABC")[None], none).any()
    # Two exposures next to A+B+C give the third party's term.
    both = np.array([[False, True, True, False]])
    assert isolated_terms(_vectors("ABC")[None], both).tolist() == [[False, False, False, True]]


@pytest.mark.parametrize("method", ["false-vfl-1", "false-vfl-2"])
def test_false_vfl_posteriors_over_a_whole_run_isolate_no_party(
    make_data: MakeData, method: str
) -> None:
    """FALSE-VFL sums each row's (mean, precision) for the label party in both stages and at
    every prediction: the same block rule holds there."""
    data = _audit_data(make_data, 7, (0.0, 0.2, 0.5))
    channel, ledger = Channel(), ReleaseLedger()
    ledger.attach(channel)
    config = MethodConfig(heads="active", epochs=2, batch_size=64, labeled=100, secure_sums=True)
    options = FalseVflConfig(
        latent_dim=4, global_latent_dim=2, hidden=16, kappa=2, inference_samples=4
    )
    model = METHODS.get(method)(
        data, config, seed=0, channel=channel, aggregator=PlainAggregator(), false_vfl=options
    )
    model.fit()
    for name in data.tests:
        model.predict(name)
    releases = ledger.releases()
    assert {group for group, _ in releases} == {"train", "test"}
    assert not ledger.isolated()


def _training_and_repredicted_releases(
    blocks: ReleaseBlocks, train_mask: np.ndarray, predict_mask: np.ndarray
) -> np.ndarray:
    """Per training sample (B, m, K): the clean part of every sum its training steps may ask
    for (each union of its usable blocks, with any of its parties dropped) and of its
    prediction sum when it is predicted again as row i of a later split (a saved model's
    prediction of the ids it trained on), the receiver's own column cleared."""
    samples, parties = train_mask.shape
    rows = torch.arange(samples)
    vectors: list[list[np.ndarray]] = [[] for _ in range(samples)]
    masks = [train_mask] + [train_mask & (np.arange(parties) != k) for k in range(1, parties)]
    for mask in masks:
        selection, _ = blocks.plan("train", rows, torch.from_numpy(mask)).tasks()
        for task in selection[0].numpy():
            for b in range(samples):
                vectors[b].append(task[b].astype(float))
    union = blocks.plan("predict", rows, torch.from_numpy(predict_mask)).union().numpy()
    for b in range(samples):
        vectors[b].append(union[b].astype(float))
    released = np.array(vectors)
    released[:, :, RECEIVER] = 0
    return released


@pytest.mark.parametrize("parties", [5, 6, 7])
def test_a_training_sample_predicted_again_with_its_training_blocks_isolates_no_party(
    parties: int,
) -> None:
    """F29: a saved model predicting the ids it trained on (every party holding them again).
    With the fixed partition of other splits, a prediction sum and a training sum of the same
    sample group its parties two ways and their difference isolates one party (the negative
    control: the audit finds such samples); matched to their training rows, the samples'
    prediction sums are unions of their training blocks, and nothing is isolated."""
    rng = np.random.default_rng(parties)
    train_mask = rng.random((300, parties)) < 0.8
    train_mask[:, RECEIVER] = True
    predict_mask = np.ones_like(train_mask)
    none = np.zeros(train_mask.shape, dtype=bool)
    fixed = ReleaseBlocks(train_mask, receiver=RECEIVER, seed=3)
    leaked = isolated_terms(
        _training_and_repredicted_releases(fixed, train_mask, predict_mask), none
    )
    assert leaked.any(axis=1).sum() > 10
    matched = ReleaseBlocks(train_mask, receiver=RECEIVER, seed=3)
    matched.match("predict", np.arange(train_mask.shape[0]))
    released = _training_and_repredicted_releases(matched, train_mask, predict_mask)
    assert not isolated_terms(released, none).any()
    assert matched.matched("predict") == train_mask.shape[0]
    # A rebuilt rule (a saved model's: no training rows) given the training mask is the same.
    rebuilt = ReleaseBlocks(train_mask[:1], receiver=RECEIVER, seed=3).with_training(train_mask)
    rows = torch.arange(train_mask.shape[0])
    assert torch.equal(rebuilt.blocks_of("train", rows)[0], matched.blocks_of("train", rows)[0])


def test_only_the_matched_rows_of_a_split_take_their_training_blocks() -> None:
    rng = np.random.default_rng(0)
    train_mask = rng.random((40, 5)) < 0.7
    blocks = ReleaseBlocks(train_mask, receiver=RECEIVER, seed=1)
    rows = torch.arange(6)
    fixed, _ = blocks.blocks_of("predict", rows)
    blocks.match("predict", np.array([-1, 7, -1, 39, 0, -1]))
    block, _ = blocks.blocks_of("predict", rows)
    training, _ = blocks.blocks_of("train", torch.tensor([7, 39, 0]))
    assert torch.equal(block[[1, 3, 4]], training)
    assert torch.equal(block[[0, 2, 5]], fixed[[0, 2, 5]])
    assert blocks.matched("predict") == 3 and blocks.matched("mcar:0") == 0
    with pytest.raises(ValueError, match=r"in \[-1, 40\)"):
        blocks.match("predict", np.array([40]))
    with pytest.raises(ValueError, match="training split"):
        blocks.match("train", np.array([0]))


@pytest.mark.parametrize("matched", [False, True])
def test_a_trained_model_predicting_its_training_samples_again_isolates_no_party(
    make_data: MakeData, matched: bool
) -> None:
    """F29, end to end in one process: a 5-party run under masks trains (each training sample
    summed by its own blocks, from its observed parties at the start), then predicts its
    training samples again with every party holding them, as a deployed prediction of the
    parties' training files does. Every sum of the run and of the prediction is recorded from
    the messages. Matched to their training rows (what a deployed model's label party does
    with the ids it trained on), nothing is isolated; by the fixed partition alone (the
    negative control), the audit finds parties isolated."""
    data = make_data(parties=5, train_missing="mcar:0.3", n=240)
    train = data.train
    again = VerticalSplit(blocks=train.blocks, labels=train.labels, mask=np.ones_like(train.mask))
    data = dataclasses.replace(data, tests={"again": again})
    config = _config(5, "drop", epochs=2)
    privacy = PrivacyEngine(PrivacySpec(secure_agg="masks"))
    channel = Channel()
    ledger = ReleaseLedger()
    method = build_method(config, data, channel=channel, aggregator=privacy.aggregator())
    privacy.make_private(
        in_process_parties(channel),
        method=config.method,
        method_config=config.method_config,
        predictions=1,
    )
    ledger.attach(channel)
    method.fit()
    blocks = cast(Any, method).blocks
    if matched:
        blocks.match("again", np.arange(train.n))
    method.predict_proba("again")
    releases = ledger.releases()
    parties = 5
    merged: dict[int, set[tuple[bool, ...]]] = defaultdict(set)
    for (_, row), (clean, exposed) in releases.items():
        assert not exposed
        merged[row].update(clean)
    assert {group for group, _ in releases} == {"train", "test"}
    most = max(len(vectors) for vectors in merged.values())
    released = np.zeros((len(merged), most, parties))
    for i, vectors in enumerate(merged.values()):
        for j, vector in enumerate(sorted(vectors)):
            released[i, j] = vector
    found = isolated_terms(released, np.zeros((len(merged), parties), dtype=bool))
    if matched:
        assert blocks.matched("again") == train.n
        assert not found.any()
    else:
        assert found.any(axis=1).sum() > 5
