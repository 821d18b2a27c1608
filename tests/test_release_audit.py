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

import numpy as np
import pytest
import torch
from conftest import MakeData

from protocols.privacy import PrivacyEngine, PrivacySpec
from secure_vfl.data.vertical import VerticalData, VerticalSplit
from secure_vfl.experiment import TrainConfig, run_training
from secure_vfl.federation.aggregator import PlainAggregator
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import RepresentRequest, SumRequest
from secure_vfl.federation.releases import BlockPlan, ReleaseBlocks, isolated_terms
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.false_vfl import FalseVflConfig

RECEIVER = 0
Sample = tuple[str, int]


class ReleaseLedger:
    """Every sum the label party asks for in a run, per sample: the clean part of each sum (an
    indicator vector over the parties, the receiver's own column cleared) and the parties whose
    row entered some sum as a DP release (``dp_rows``)."""

    def __init__(self) -> None:
        self.recorder = RecordingLayer()

    def attach(self, channel: Channel) -> None:
        channel.layers.append(self.recorder)

    def releases(self) -> dict[Sample, tuple[set[tuple[bool, ...]], set[int]]]:
        """sample -> (the distinct clean vectors released about it, its exposed parties). A
        sample is ``("train", row)`` or ``("test", row)``: every test split holds the same
        test samples in the same order."""
        rows: dict[tuple[int, int, str, str], tuple[str, dict[int, int]]] = {}
        out: dict[Sample, tuple[set[tuple[bool, ...]], set[int]]] = defaultdict(
            lambda: (set(), set())
        )
        for message in self.recorder.messages:
            if isinstance(message, RepresentRequest):
                key = (message.round, message.batch_id, message.phase, message.tag)
                split, positions = rows.setdefault(key, (message.split, {}))
                assert split == message.split
                positions.update(
                    zip(message.positions.tolist(), message.rows.tolist(), strict=True)
                )
            elif type(message) is SumRequest:
                key = (message.round, message.batch_id, message.phase, message.source_tag)
                split, positions = rows[key]
                group = "train" if split == "train" else "test"
                dp = message.dp_rows
                for t, b in zip(*np.nonzero(message.selection.any(dim=2).numpy()), strict=True):
                    members = message.selection[t, b].clone()
                    members[RECEIVER] = False
                    if not bool(members.any()):
                        continue  # the receiver's own term alone (its own request is local)
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
