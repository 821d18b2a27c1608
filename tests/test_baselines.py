"""The baselines: Local, Ensemble, Standard VFL, PlugVFL and Combinatorial behave as defined."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from conftest import MakeData

from secure_vfl.errors import ConfigError, ProtocolError, RunWarning
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import Message, RepresentationMessage
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.baselines import Combinatorial, ConcatFusionMethod
from secure_vfl.methods.laser import majority_vote
from secure_vfl.metrics import accuracy

FAST = MethodConfig(epochs=4, batch_size=64, lr=0.05)


@pytest.mark.parametrize("name", ["local", "ensemble", "standard", "plugvfl", "combinatorial"])
def test_every_baseline_learns_on_fully_observed_data(make_data: MakeData, name: str) -> None:
    data = make_data(train_missing="mcar:0", test_missing=("mcar:0",))
    method = METHODS.get(name)(data, FAST, seed=0)
    losses = method.fit()
    assert losses[-1] < losses[0]
    predictions = method.predict("mcar:0")
    assert np.array_equal(predictions >= 0, data.tests["mcar:0"].mask)
    # chance is 33 %; 74.8-100 over data seeds 0-8 (local, from one block, the lowest)
    assert accuracy(predictions, data.tests["mcar:0"].labels) > 70.0


def test_standard_vfl_trains_on_complete_samples_and_guesses_on_incomplete_ones(
    make_data: MakeData,
) -> None:
    data = make_data(train_missing="mcar:0.3", test_missing=("mcar:0.3",), n=1200)
    method = METHODS.get("standard")(data, FAST, seed=0)
    assert isinstance(method, ConcatFusionMethod)
    assert np.array_equal(method.train_rows, np.nonzero(data.train.mask.all(axis=1))[0])
    method.fit()
    split = data.tests["mcar:0.3"]
    predictions = method.predict("mcar:0.3")
    complete = split.mask.all(axis=1)
    assert complete.sum() > 40 and (~complete).sum() > 100
    assert accuracy(predictions[complete], split.labels[complete]) > 80.0  # 88.2-100, 9 seeds
    assert accuracy(predictions[~complete], split.labels[~complete]) < 45.0


def test_standard_vfl_without_a_complete_training_sample_is_refused(make_data: MakeData) -> None:
    """It ran no step and reported its untrained model's accuracy (wine, 10 parties, MCAR 0.5:
    25 % with null losses) as Standard VFL's."""
    data = make_data(n=40, train_missing="mcar:0.8", test_missing=("mcar:0",))
    assert data.train.n and not data.train.mask.all(axis=1).any()
    with pytest.raises(ConfigError, match=rf"the 4 parties holds; found none of {data.train.n}"):
        METHODS.get("standard")(data, FAST, seed=0)
    assert METHODS.get("plugvfl")(data, FAST, seed=0)  # trains on incomplete samples


def test_standard_vfl_warns_when_its_complete_training_samples_hold_one_class(
    make_data: MakeData,
) -> None:
    """Its top model learned that class alone and the run said nothing (incomplete samples
    guessed at random) or blamed the epochs and learning rate (--standard-incomplete zero)."""
    data = make_data(n=100, seed=7, train_missing="mcar:0.6", test_missing=("mcar:0",))
    complete = data.train.mask.all(axis=1)
    assert complete.sum() == 3 and np.unique(data.train.labels[complete]).tolist() == [1]
    method = METHODS.get("standard")(data, FAST, seed=0)
    with pytest.warns(RunWarning) as caught:
        method.fit()
    assert [str(w.message) for w in caught if w.category is RunWarning] == [
        "standard trains on the labelled samples every one of the 4 parties holds, and the 3 "
        "of them hold one class (1): its top model learns that class alone. Expected complete "
        "samples of at least 2 classes: fewer parties or less training missingness would "
        "leave more (or --aligned-labeled N, a registered dataset); laser and plugvfl train "
        "on incomplete samples."
    ]
    assert (method.predict("mcar:0") == 1).all()  # what it warned of
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunWarning)
        METHODS.get("standard")(make_data(), FAST, seed=0).fit()  # two classes: no warning


def test_standard_vfl_can_zero_impute_instead_of_guessing(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0", test_missing=("mcar:0.5",))
    config = dataclasses.replace(FAST, standard_incomplete="zero")
    method = METHODS.get("standard")(data, config, seed=0)
    method.fit()
    split = data.tests["mcar:0.5"]
    incomplete = ~split.mask.all(axis=1)
    predictions = method.predict("mcar:0.5")
    assert accuracy(predictions[incomplete], split.labels[incomplete]) > 65.0  # 72.5-96.2


def test_plugvfl_drops_passive_parties_but_never_the_label_party(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0")
    recorder = RecordingLayer()
    config = dataclasses.replace(FAST, plug_dropout=0.9)
    method = METHODS.get("plugvfl")(data, config, seed=0, channel=Channel([recorder]))
    assert isinstance(method, ConcatFusionMethod)
    # The label party's gradient to its own bottom crosses no boundary: its incoming hook sees it.
    in_process_parties(method.fed.channel)[0].incoming.append(recorder)
    method.train_step(np.arange(64), 0, 0)
    gradients = {m.receiver: m.gradient for m in recorder.messages if m.kind == "gradient"}
    zero_rows = {k: int((g.abs().sum(1) == 0).sum()) for k, g in gradients.items()}
    assert zero_rows["party-0"] == 0
    assert all(zero_rows[f"party-{k}"] > 40 for k in (1, 2, 3))  # ~90 % of 64 rows dropped


def test_local_heads_use_only_their_own_block(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0", test_missing=("mcar:0",))
    method = METHODS.get("local")(data, FAST, seed=0)
    method.fit()
    before = method.predict("mcar:0")
    party = in_process_parties(method.fed.channel)[1]
    party._blocks["mcar:0"] = torch.randn_like(party._blocks["mcar:0"])
    after = method.predict("mcar:0")
    assert np.array_equal(before[:, [0, 2, 3]], after[:, [0, 2, 3]])
    assert not np.array_equal(before[:, 1], after[:, 1])


def test_majority_vote_picks_the_majority_and_breaks_ties_at_random() -> None:
    predictions = np.array([[1, 1, 2, -1], [0, 1, -1, -1]])
    winners = set()
    for seed in range(30):
        voted = majority_vote(predictions, 3, np.random.default_rng(seed))
        assert voted[0].tolist() == [1, 1, 1, -1]
        assert voted[1, 0] == voted[1, 1] and voted[1, 2] == -1
        winners.add(int(voted[1, 0]))
    assert winners == {0, 1}


def test_combinatorial_has_one_predictor_per_subset_and_uses_the_exact_one(
    make_data: MakeData,
) -> None:
    data = make_data(parties=3, train_missing="mcar:0.3", test_missing=("mcar:0.5",))
    method = METHODS.get("combinatorial")(data, FAST, seed=0)
    assert isinstance(method, Combinatorial)
    assert len(method.subsets) == 7
    parties = in_process_parties(method.fed.channel)
    # 3 * 2^(3-1) subset bottoms besides each party's own, and each subset's head at its first
    assert sum(len(p.models) - 1 for p in parties) == 12
    assert [len(p.heads) for p in parties] == [4, 2, 1]
    method.fit()
    split = data.tests["mcar:0.5"]
    recorder = RecordingLayer()
    method.fed.channel.layers.append(recorder)
    method.predict("mcar:0.5")
    used = {m.model for m in recorder.messages if m.kind == "represent-request"}
    observed_sets = {tuple(np.nonzero(row)[0]) for row in split.mask}
    # The label party's own requests cross no boundary; every other party's are recorded.
    assert used == {"subset:" + ",".join(map(str, s)) for s in observed_sets if s != (0,)}


def test_combinatorial_warns_of_predictors_that_no_training_sample_trains(
    make_data: MakeData,
) -> None:
    """Its predictor of every party saw no training sample (none held by all four) and, after
    20 epochs, scored 20 % (chance 33 %) on the test rows, which it predicts alone, without a
    word."""
    data = make_data(n=80, seed=0, train_missing="mcar:0.7", test_missing=("mcar:0",))
    method = METHODS.get("combinatorial")(data, FAST, seed=0)
    with pytest.warns(RunWarning) as caught:
        method.fit()
    assert [str(w.message) for w in caught if w.category is RunWarning] == [
        "combinatorial trained 2 of its 15 predictors on no sample: no labelled training "
        "sample is held by every party of {party-0, party-1, party-2} or of {party-0, party-1, "
        "party-2, party-3}; each predicts the samples whose observed set is exactly its "
        "parties from its initial weights. Expected less training missingness or fewer "
        "parties; laser shares each party's model across every set of parties, which "
        "incomplete samples then train."
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunWarning)
        METHODS.get("combinatorial")(make_data(parties=3), FAST, seed=0).fit()  # all trained


def test_methods_that_need_labels_at_every_party_refuse_a_single_head(
    make_data: MakeData,
) -> None:
    data = make_data()
    active = dataclasses.replace(FAST, heads="active")
    for name in ("local", "ensemble", "combinatorial"):
        with pytest.raises(ConfigError, match="heads='all'"):
            METHODS.get(name)(data, active, seed=0)


def test_combinatorial_refuses_too_many_parties(make_data: MakeData) -> None:
    data = make_data(parties=9)
    with pytest.raises(ConfigError, match=r"K must be <= 8\. Found K=9"):
        METHODS.get("combinatorial")(data, FAST, seed=0)


class _DropsItsLastRow:
    """A data party's outgoing hook: its representations leave without their last row."""

    def on_message(self, message: Message) -> Message:
        if isinstance(message, RepresentationMessage) and message.positions.numel() > 1:
            return dataclasses.replace(
                message,
                positions=message.positions[:-1],
                representation=message.representation[:-1],
            )
        return message


@pytest.mark.parametrize("name", ["standard", "plugvfl"])
def test_a_representation_of_other_rows_than_asked_is_refused_before_the_head_trains(
    make_data: MakeData, name: str
) -> None:
    """A party's representations of fewer rows than the label party asked it for: the head
    trained on zeros where its mask says the party's row is, and stepped."""
    method = METHODS.get(name)(make_data(), FAST, seed=0)
    assert isinstance(method, ConcatFusionMethod)
    method.fed.channel.parties["party-2"].outgoing.append(_DropsItsLastRow())
    head = [p.detach().clone() for p in method.head.module.parameters()]
    rows = method.train_rows[:32]
    with pytest.raises(
        ProtocolError,
        match=r"^party-0: representations of party-2's (\d+) rows asked for expected, found ",
    ):
        method.train_step(rows, 0, 0)
    after = list(method.head.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(head, after, strict=True))
    assert all(p.grad is None for p in after)


@pytest.mark.parametrize("name", ["local", "ensemble"])
@pytest.mark.parametrize("batching", ["grouped", "mixed"])
def test_a_local_head_averages_its_loss_over_the_rows_its_party_observes(
    make_data: MakeData, name: str, batching: str
) -> None:
    """Local and Ensemble train each party's model on the samples it observes: a head's loss
    of a batch is the mean over its party's observed rows of it. Under mixed batching it was
    divided by the whole batch, scaling each head's step by its party's observed share."""
    data = make_data(train_missing="mcar:0.4")
    recorder = RecordingLayer()
    config = dataclasses.replace(FAST, batching=batching)
    method = METHODS.get(name)(data, config, seed=0, channel=Channel([recorder]))
    # The label party's task to its own head crosses no boundary: its incoming hook sees it.
    in_process_parties(method.fed.channel)[0].incoming.append(recorder)
    batch = next(iter(method.sampler.epoch(np.random.default_rng(0))))
    method.train_step(batch, 0, 0)
    mask = data.train.mask[batch]
    tasks = [m for m in recorder.messages if m.kind == "head-task"]
    for party, observed in enumerate(mask.sum(axis=0)):
        task = next((m for m in tasks if m.receiver == f"party-{party}"), None)
        if observed == 0:
            assert task is None
            continue
        assert task is not None and task.normaliser == observed
    if batching == "mixed":
        assert (mask.sum(axis=0) < len(batch)).any()  # some head saw part of the batch
