"""FedHF-Impute's parties as actors: the results they gave before they were actors, each secret
with its owner only, nothing but sealed shares at the aggregator, and bad or replayed messages
refused without changing any party."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import numpy as np
import pytest
import torch
from aggregator_contract import TamperedSum
from reachability import reachable
from test_fedhf import synthetic_task
from test_secure_split import BACKENDS, _secret

from protocols.secagg import MaskingAggregator
from secure_vfl.data.imputation import ClientData, hide_entries
from secure_vfl.errors import ConfigError, ProtocolError
from secure_vfl.experiment import ImputeRunConfig, run_imputation
from secure_vfl.federation.aggregator import PlainAggregator, SumBackend
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import (
    AGGREGATOR,
    ComputeRequest,
    GlobalStatisticsMessage,
    Message,
    ParametersMessage,
    RepresentationMessage,
    ScoreMessage,
    ScoreRequest,
    SealedMessage,
    SealRequest,
    SumMessage,
)
from secure_vfl.federation.parties import ROLES, AggregationServer
from secure_vfl.methods.imputation import (
    IMPUTERS,
    SERVER,
    ImputationClient,
    ImputeConfig,
    ReconstructionImputer,
    build_imputation_federation,
    federated_statistics,
    hidden_test_entries,
    in_process_clients,
)
from secure_vfl.methods.imputation.clients import RESTART_TAG
from secure_vfl.methods.imputation.evaluation import (
    TEST_FRACTION,
    ScoredErrors,
    scores_of,
    squared_errors,
)
from secure_vfl.methods.imputation.statistics import wide_width

TINY = ImputeConfig(rounds=2, local_epochs=1, hidden=8, layers=1)

# Measured on the code before the parties were actors (commit 417e94a), one torch thread:
# synthetic_task(seed=0), ImputeConfig(rounds=4, local_epochs=2, hidden=16, layers=2), seed 0.
# The RMSEs were scored with one generator, seeded 0, drawing every client's hidden test entries
# in client order; each client now draws its own (so that it can score itself), and the test
# scores the trained imputer under the old draws (_scored_as_before_actors) to compare.
# On that machine they matched to 1e-12. Another CPU's vector kernels round the float32 sums
# differently: on an AVX-512 (fp16) Xeon the same code lands up to 4e-9 (relative) away, so the
# tolerance is 1e-6, still far below what a change of the protocol (another batch, sample or
# order of updates) moves these figures by.
BEFORE_ACTORS = {
    ("fedhf", "none"): (
        0.9800769952387358,
        [0.9706772465779245, 0.9667529437464399, 0.9657236533361588, 0.9638552287643072],
    ),
    ("fedhf", "masks"): (0.9800784272469244, None),
    ("fed-dae", "none"): (
        0.9748101656459817,
        [0.9752171035862275, 0.9725022522647386, 0.9694311467747293, 0.9662069761267483],
    ),
    ("dae", "none"): (
        0.9520489028358601,
        [0.9781848098846595, 0.9732859448252612, 0.9679172828625251, 0.9623681263275204],
    ),
    ("fed-mean", "none"): (0.9830804700018272, []),
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("method", "backend"), list(BEFORE_ACTORS))
def test_the_actors_give_the_results_measured_before_them(method: str, backend: str) -> None:
    config = ImputeRunConfig(
        method=method,
        dataset="synthetic",
        impute_config=ImputeConfig(rounds=4, local_epochs=2, hidden=16, layers=2),
    )
    aggregator = MaskingAggregator() if backend == "masks" else None
    task = synthetic_task(seed=0)
    result, imputer = run_imputation(config, task=task, aggregator=aggregator)
    rmse, curve = BEFORE_ACTORS[method, backend]
    assert _scored_as_before_actors(imputer, task, method) == pytest.approx(rmse, rel=1e-6)
    if curve is not None:
        assert result.validation_curve == pytest.approx(curve, rel=1e-6)


def _scored_as_before_actors(imputer: Any, task: Any, method: str) -> float:
    """The RMSE of ``imputer`` with every client's hidden test entries drawn by one generator
    seeded 0, in client order (how BEFORE_ACTORS was scored)."""
    std = federated_statistics(task.train).standardisation.std
    rng = np.random.default_rng(0)
    errors = {}
    for k, truth in enumerate(task.test):
        corrupted, hidden = hide_entries(truth, TEST_FRACTION, rng=rng)
        errors[truth.name] = squared_errors(
            imputer.impute(k, corrupted), truth, hidden, std, by=method
        )
    scored = ScoredErrors.of(errors, len(task.features))
    return scores_of(scored, features=task.features, std=std)["rmse"]


@pytest.mark.parametrize("method", ["fedhf", "dae"])
@pytest.mark.parametrize("backend", ["plain", "masks"])
def test_each_client_scores_itself_as_the_evaluator_would_and_sends_two_numbers(
    method: str, backend: str
) -> None:
    recorder = RecordingLayer()
    aggregator = MaskingAggregator() if backend == "masks" else PlainAggregator()
    imputer = _imputer(aggregator, recorder, method=method)
    imputer.fit()
    task = imputer.task
    standardisation = federated_statistics(task.train).standardisation
    recorder.messages.clear()
    scored = imputer.score(standardisation, seed=3, fraction=0.2)
    # The evaluator's computation, from the test rows it holds in one process.
    expected = ScoredErrors.of(
        {
            truth.name: squared_errors(
                imputer.impute(k, corrupted), truth, hidden, standardisation.std, by=method
            )
            for k, (truth, (corrupted, hidden)) in enumerate(
                zip(task.test, hidden_test_entries(task, seed=3), strict=True)
            )
        },
        len(task.features),
    )
    assert scored.per_client == expected.per_client
    assert all(count > 0 for _, count in scored.per_client.values())
    # per feature, as a sum over the clients, to the sums' fixed point (2**-20)
    np.testing.assert_allclose(scored.feature_sse, expected.feature_sse, atol=1e-5)
    np.testing.assert_array_equal(scored.feature_count, expected.feature_count)
    assert scored.feature_count.sum() == sum(n for _, n in scored.per_client.values())
    # What crossed to the coordinator: each client's two numbers, and the per-feature errors
    # only summed over the clients by the aggregator (under masks, sealed until then).
    clients = {c.name for c in task.test}
    to_coordinator = [m for m in recorder.messages if m.receiver == SERVER]
    summed = "sealed-sum" if backend == "masks" else "sum"
    assert sorted(m.kind for m in to_coordinator) == sorted(["score"] * len(clients) + [summed])
    assert {m.sender for m in to_coordinator if m.kind == "score"} == clients
    contributions = [m for m in recorder.messages if m.sender in clients and m.kind != "score"]
    if backend == "masks":
        assert {m.kind for m in contributions} == {"sealed"}
    else:
        assert {(m.kind, m.receiver) for m in contributions} == {("representation", AGGREGATOR)}
    # Another seed draws other entries.
    other = imputer.score(standardisation, seed=4, fraction=0.2)
    assert other.per_client != scored.per_client


def test_a_client_without_test_rows_refuses_to_score() -> None:
    task = synthetic_task(rows=24, test_rows=6, features=6)
    federation = build_imputation_federation(task.train)
    with pytest.raises(ProtocolError, match="test rows to score on expected, found none"):
        federation.score(np.ones(6), lambda k: 1, fraction=0.2, round=1, fedavg_round=0)


def _imputer(
    aggregator: SumBackend, recorder: RecordingLayer | None = None, method: str = "fedhf"
) -> ReconstructionImputer:
    task = synthetic_task(rows=24, test_rows=6, features=6)
    channel = Channel([recorder] if recorder is not None else [])
    imputer = IMPUTERS.get(method)(task, TINY, seed=0, aggregator=aggregator, channel=channel)
    assert isinstance(imputer, ReconstructionImputer)
    return imputer


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_each_secret_is_reachable_from_its_owner_only(backend: str) -> None:
    imputer = _imputer(BACKENDS[backend]())
    imputer.fit()
    channel = imputer.federation.channel
    owners: dict[int, list[str]] = {}
    for name, party in channel.parties.items():
        for value in reachable(party, stop={id(channel)}):
            if _secret(value):
                owners.setdefault(id(value), []).append(name)
    assert owners, "no secret found: the test would pass vacuously"
    assert all(len(names) == 1 for names in owners.values()), owners
    held = sorted(names[0] for names in owners.values())
    # Masks: one X25519 key per client and the coordinator's (the receiver's, for the
    # self-masks). Paillier, CKKS: the coordinator alone.
    clients = sorted(imputer.federation.names)
    assert held == (sorted([*clients, SERVER]) if backend == "masks" else [SERVER])
    # The coordinator's program reaches no client's secret (the clients only by the channel).
    seen = reachable(imputer, stop={id(channel)})
    assert {id(v) for v in seen if _secret(v)} <= {
        key for key, names in owners.items() if names == [SERVER]
    }
    assert not any(isinstance(v, ImputationClient) for v in seen)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_nothing_but_sealed_shares_reach_the_aggregator(backend: str) -> None:
    recorder = RecordingLayer()
    imputer = _imputer(BACKENDS[backend](), recorder)
    imputer.fit()
    names = set(imputer.federation.names)
    kinds = set(recorder.kinds())
    assert {"sealed", "sealed-sum", "seal-request"} <= kinds
    assert not kinds & {"representation", "sum"}, "a contribution or a sum crossed in the clear"
    # What a client holds until it seals gets no ticket; its seal request's does.
    for message in recorder.messages:
        if isinstance(message, ComputeRequest | SealRequest):
            assert len(message.ticket) == (32 if isinstance(message, SealRequest) else 0)
    for message in recorder.messages:
        if message.receiver == AGGREGATOR:
            allowed = (
                {"sealed"}
                if message.sender in names
                else {"sum-request", "public-key", "key-request", "ticket-key"}
            )
            assert message.kind in allowed, (message.kind, message.sender)
        if message.receiver == SERVER:  # and, under masks, the clients' public keys
            announced = backend == "masks" and message.sender in names
            expected = ("public-key", message.sender) if announced else ("sealed-sum", AGGREGATOR)
            assert (message.kind, message.sender) == expected
        if message.kind == "public-key" and backend != "masks":
            assert message.sender == SERVER  # the receiver's public key, nothing else


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_secure_run_gives_the_plain_one_within_the_backends_precision(backend: str) -> None:
    plain = _imputer(PlainAggregator())
    secure = _imputer(BACKENDS[backend]())
    np.testing.assert_allclose(secure.fit(), plain.fit(), atol=1e-4)
    assert plain.theta is not None and secure.theta is not None
    assert torch.allclose(secure.theta, plain.theta, atol=1e-3)


def test_traffic_counts_the_encoded_messages_that_crossed_the_transport() -> None:
    channel = Channel()
    aggregator = MaskingAggregator()
    result, _ = run_imputation(
        ImputeRunConfig(method="fedhf", dataset="synthetic", impute_config=TINY),
        task=synthetic_task(rows=24, test_rows=6, features=6),
        aggregator=aggregator,
        channel=channel,
    )
    crossed: dict[str, int] = {}
    for (sender, _, _), count in channel.transport.bytes.items():
        crossed[sender] = crossed.get(sender, 0) + count
    reported = {name: sum(by_phase.values()) for name, by_phase in result.traffic["bytes"].items()}
    assert reported == crossed
    assert crossed[SERVER] > 0  # the coordinator's requests and downloads count too


def _state(channel: Channel) -> dict[str, Any]:
    """What every party holds that a message could change: models, what each has kept and
    sealed, the server's batch and the coordinator's inbox (deep copies)."""
    state: dict[str, Any] = {}
    for name, party in channel.parties.items():
        if isinstance(party, ImputationClient):
            assert party.model is not None
            state[name] = [
                [p.detach().clone() for p in party.model.parameters()],
                copy.deepcopy(party.optimiser.state_dict()) if party.optimiser else None,
                sorted(party._held),
                set(party._sealed._served),
                torch.get_rng_state(),
                party.generator.get_state() if party.generator else None,
            ]
        elif isinstance(party, AggregationServer):
            state[name] = [
                party._batch,
                {tag: sorted(by) for tag, by in party._contributions.items()},
                {tag: sorted(by) for tag, by in party._sealed.items()},
                set(party._served._served),
            ]
        else:
            state[name] = [len(party._inbox), set(party._sealed._served)]
    return state


def _same(before: dict[str, Any], after: dict[str, Any]) -> bool:
    def equal(a: object, b: object) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, list | tuple) and isinstance(b, list | tuple):
            return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    return equal(before, after)


def _last(recorder: RecordingLayer, kind: type[Message], **fields: object) -> Any:
    return [
        m
        for m in recorder.messages
        if isinstance(m, kind) and all(getattr(m, k) == v for k, v in fields.items())
    ][-1]


def _row(sender: str, receiver: str) -> RepresentationMessage:
    """A one-row contribution of a fresh round, in the clear."""
    return RepresentationMessage(
        sender=sender,
        receiver=receiver,
        round=99,
        batch_id=0,
        positions=torch.zeros(1, dtype=torch.int64),
        representation=torch.zeros(1, 14),
    )


@pytest.mark.parametrize("backend", ["plain", "masks"])
def test_bad_or_replayed_messages_are_refused_and_change_no_party(backend: str) -> None:
    recorder = RecordingLayer()
    aggregator = MaskingAggregator() if backend == "masks" else PlainAggregator()
    imputer = _imputer(aggregator, recorder, method="fed-dae")
    imputer.fit()
    imputer.score(federated_statistics(imputer.task.train).standardisation, seed=0, fraction=0.2)
    channel = imputer.federation.channel
    coordinator = imputer.federation.own
    clients = {c.name: c for c in in_process_clients(channel)}
    first, second = list(clients.values())[:2]
    server = channel.parties[AGGREGATOR]
    train = _last(recorder, ComputeRequest, receiver=first.name, computation="train")
    scoring = _last(recorder, ScoreRequest, receiver=first.name)
    download = _last(recorder, ParametersMessage, receiver=first.name)
    published = _last(recorder, GlobalStatisticsMessage, receiver=first.name)
    fresh = {"round": 99, "tag": "fresh"}

    attempts: list[tuple[str, Any, str]] = [
        # the coordinator's messages, replayed by the network
        ("replayed request", lambda: coordinator.send(train), "a second compute-request"),
        ("replayed download", lambda: coordinator.send(download), "a second parameters"),
        ("replayed statistics", lambda: coordinator.send(published), "a second global-stat"),
        ("replayed score request", lambda: coordinator.send(scoring), "a second score-request"),
        (
            "a yardstick of another width",
            lambda: coordinator.send(
                dataclasses.replace(scoring, round=99, std=torch.ones(2, dtype=torch.float64))
            ),
            "a std for each of its 6 features expected, found 2",
        ),
        # malformed requests: nothing is trained or loaded
        (
            "wrong parameter count",
            lambda: coordinator.send(
                dataclasses.replace(download, **fresh, parameters=torch.zeros(3))
            ),
            "a parameter vector of length",
        ),
        (
            "row count below its own",
            lambda: coordinator.send(
                dataclasses.replace(
                    train, **fresh, arguments=torch.tensor([1.0], dtype=torch.float64)
                )
            ),
            "the federation's row count",
        ),
        (
            "arguments where none are expected",
            lambda: coordinator.send(
                dataclasses.replace(
                    train, **fresh, computation="rows", arguments=torch.ones(2, dtype=torch.float64)
                )
            ),
            "no arguments for 'rows' expected",
        ),
        # a client acting as the coordinator, or reaching past the aggregator
        (
            "a request from a client",
            lambda: second.send(dataclasses.replace(train, sender=second.name, **fresh)),
            f"found a compute-request from {second.name}",
        ),
        (
            "a contribution sent to the coordinator",
            lambda: second.send(_row(second.name, SERVER)),
            "sums from aggregator expected, found a representation",
        ),
        (
            "a score nobody asked for",
            lambda: second.send(
                ScoreMessage(
                    sender=second.name,
                    receiver=SERVER,
                    round=99,
                    batch_id=0,
                    sse=0.0,
                    count=0,
                )
            ),
            f"found a score from {second.name}",
        ),
        (
            "a sum forged by a client",
            lambda: second.send(
                SumMessage(
                    sender=second.name,
                    receiver=SERVER,
                    round=99,
                    batch_id=0,
                    sums=torch.zeros(1, 1, 14),
                    counts=torch.ones(1, 1, dtype=torch.int64),
                    tag="validation",
                )
            ),
            f"found a sum from {second.name}",
        ),
    ]
    if backend == "masks":
        share = _last(recorder, SealedMessage, sender=second.name)
        attempts += [
            (
                "a replayed sealed share",
                lambda: second.send(share),
                r"a second sealed .*\(a replay\?\)",
            ),
            (
                "a sealed share of a served sum",
                lambda: second.send(dataclasses.replace(share, session="other")),
                "already served",
            ),
            (
                "a contribution in the clear",
                lambda: second.send(_row(second.name, AGGREGATOR)),
                "refuses to see it",
            ),
        ]
    else:
        contribution = _last(recorder, RepresentationMessage, sender=second.name)
        attempts += [
            ("a replayed contribution", lambda: second.send(contribution), r"a second repr"),
            (
                "a second contribution to a sum, in another session",
                lambda: second.send(dataclasses.replace(contribution, session="other")),
                "of session 'other'; the driver's session is",
            ),
            (
                "a second contribution to a sum, under another tag",
                lambda: second.send(dataclasses.replace(contribution, tag="other")),
                "that the driver did not ask for",
            ),
        ]
    for what, attempt, error in attempts:
        before = _state(channel)
        with pytest.raises(ProtocolError, match=error):
            attempt()
        assert _same(before, _state(channel)), what
    assert isinstance(server, AggregationServer)


def _statistics(**changes: object) -> GlobalStatisticsMessage:
    fields: dict[str, Any] = {
        "sender": SERVER,
        "receiver": "client-0",
        "round": 0,
        "batch_id": 0,
        "mean": torch.zeros(3, dtype=torch.float64),
        "std": torch.ones(3, dtype=torch.float64),
        "neighbours": torch.tensor([[1], [0], [2]]),
        "weights": torch.tensor([[1.0], [0.5], [0.0]]),
        "mask": torch.tensor([[True], [True], [False]]),
    }
    fields.update(changes)
    return GlobalStatisticsMessage(**fields)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"std": torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)}, "a std > 0"),
        ({"mask": None}, "expected together"),
        ({"neighbours": torch.tensor([[1], [0], [3]])}, r"neighbours in \[0, 3\)"),
        ({"weights": torch.tensor([[1.0], [0.5], [0.2]])}, "and 0 where the mask is False"),
        ({"weights": torch.ones(3, 2)}, "of shape \\(3, k\\)"),
        ({"constant": torch.tensor([True, False])}, "a constant flag for each of the 3 features"),
        ({"constant": torch.zeros(3)}, "constant must be a 1-d torch.bool tensor"),
    ],
)
def test_bad_global_statistics_are_refused(changes: dict[str, object], error: str) -> None:
    _statistics().validate()
    _statistics(neighbours=None, weights=None, mask=None).validate()  # a model without a graph
    _statistics(constant=torch.tensor([False, True, False])).validate()
    with pytest.raises(ProtocolError, match=error):
        _statistics(**changes).validate()


@pytest.mark.parametrize(("sse", "count"), [(-0.5, 2), (1.0, -1), (1.0, 0)])
def test_a_score_that_cannot_be_one_is_refused(sse: float, count: int) -> None:
    header = {"sender": "client-0", "receiver": SERVER, "round": 0, "batch_id": 0}
    ScoreMessage(**header, sse=0.0, count=0).validate()
    with pytest.raises(ProtocolError, match=r"a squared error >= 0 over a count >= 0"):
        ScoreMessage(**header, sse=sse, count=count).validate()


class _ShortFeatureErrorsClient(ImputationClient):
    """A client that contributes its first feature's errors only to the feature-errors sum."""

    def _compute(self, computation: str, arguments: np.ndarray, round: int) -> np.ndarray:
        vector = super()._compute(computation, arguments, round)
        return vector[: wide_width(2)] if computation == "feature-errors" else vector


ROLES.register("test-short-feature-errors-client", _ShortFeatureErrorsClient)


def test_feature_errors_of_another_width_are_refused() -> None:
    task = synthetic_task(rows=24, test_rows=6, features=6)
    name = task.train[2].name
    imputer = IMPUTERS.get("fedhf")(
        task, TINY, seed=0, channel=Channel(), roles={name: "test-short-feature-errors-client"}
    )
    imputer.fit()
    standardisation = federated_statistics(task.train).standardisation
    width = wide_width(2 * len(task.features) + 1)
    # Refused on arrival, naming its sender, against the clients' kept before it.
    said = rf"the representation from {name} .*: of width 14, where .* are of width {width}:"
    with pytest.raises(ProtocolError, match=said):
        imputer.score(standardisation, seed=0, fraction=0.2)


class _DivergedClient(ImputationClient):
    """A client whose model imputes its test rows a hundred million stds off."""

    def impute(self, client: ClientData) -> np.ndarray:
        return super().impute(client) + 1e8 * self.standardisation.std  # type: ignore[union-attr]


class _MiscountingClient(ImputationClient):
    """A client that adds 500 to its first feature's count in the feature-errors sum."""

    def _compute(self, computation: str, arguments: np.ndarray, round: int) -> np.ndarray:
        if computation == "feature-errors":
            assert self._feature_errors is not None
            self._feature_errors[len(self._feature_errors) // 2] += 500
        return super()._compute(computation, arguments, round)


ROLES.register("test-diverged-client", _DivergedClient)
ROLES.register("test-miscounting-client", _MiscountingClient)


@pytest.mark.parametrize("backend", ["plain", "masks"])
def test_errors_too_large_to_sum_leave_the_features_unscored_not_the_run(backend: str) -> None:
    """A diverged client's per-feature errors (1e16 std units squared) exceed what a sum's
    values carry: the run stopped after training, blaming a statistic and its units."""
    task = synthetic_task(rows=24, test_rows=6, features=6)
    name = task.train[1].name
    imputer = IMPUTERS.get("fedhf")(
        task,
        TINY,
        seed=0,
        channel=Channel(),
        aggregator=MaskingAggregator() if backend == "masks" else PlainAggregator(),
        roles={name: "test-diverged-client"},
    )
    imputer.fit()
    standardisation = federated_statistics(task.train).standardisation
    scored = imputer.score(standardisation, seed=0, fraction=0.2)
    assert scored.per_client[name][0] > 1e15  # its total, sent in the clear as before
    assert np.isnan(scored.feature_sse).all()
    assert scored.feature_count.sum() == sum(n for _, n in scored.per_client.values())
    scores = scores_of(scored, features=task.features, std=standardisation.std)
    assert scores["rmse"] > 1e7 and all(np.isnan(list(scores["rmse_per_feature"].values())))


def test_a_feature_errors_sum_that_disagrees_with_the_scores_is_refused() -> None:
    task = synthetic_task(rows=24, test_rows=6, features=6)
    imputer = IMPUTERS.get("fedhf")(
        task, TINY, seed=0, channel=Channel(), roles={task.train[2].name: "test-miscounting-client"}
    )
    imputer.fit()
    standardisation = federated_statistics(task.train).standardisation
    with pytest.raises(ProtocolError, match="the feature-errors sum disagrees with the clients'"):
        imputer.score(standardisation, seed=0, fraction=0.2)


def test_requests_and_downloads_are_checked_on_their_own() -> None:
    header = {"sender": SERVER, "receiver": "client-0", "round": 0, "batch_id": 0}
    arguments = torch.zeros(0, dtype=torch.float64)
    with pytest.raises(ProtocolError, match="computation must be one of"):
        ComputeRequest(**header, computation="gradients", arguments=arguments, tag="t").validate()
    with pytest.raises(ProtocolError, match=re.escape("arguments must be a 1-d torch.float64")):
        ComputeRequest(**header, computation="rows", arguments=torch.zeros(0), tag="t").validate()
    with pytest.raises(ProtocolError, match=re.escape("parameters must be a 1-d torch.float32")):
        ParametersMessage(**header, parameters=torch.zeros(2, 2)).validate()


def test_a_refused_training_request_leaves_what_a_restart_puts_back() -> None:
    """A training request of the round a client last trained in (another batch id: not a
    replay) with a row count it refuses: before it was refused, the client had noted its
    optimiser's moments and generator as the round's start, so a restart of the round put back
    those of after its training, not of before it."""
    recorder = RecordingLayer()
    imputer = _imputer(PlainAggregator(), recorder, method="fed-dae")
    imputer.fit()
    coordinator = imputer.federation.own
    client = in_process_clients(imputer.federation.channel)[0]
    train = _last(recorder, ComputeRequest, receiver=client.name, computation="train")
    download = _last(recorder, ParametersMessage, receiver=client.name)
    assert client._round_start is not None and client._round_start[0] == train.round
    assert client.optimiser is not None and client.generator is not None
    start = copy.deepcopy(client._round_start)
    bad = dataclasses.replace(
        train, batch_id=train.batch_id + 5, arguments=torch.tensor([1.0], dtype=torch.float64)
    )
    with pytest.raises(ProtocolError, match="the federation's row count"):
        coordinator.send(bad)
    coordinator.send(dataclasses.replace(download, round=train.round, batch_id=99, tag=RESTART_TAG))
    restored, moments = client.optimiser.state_dict()["state"], start[1]["state"]
    assert restored.keys() == moments.keys() and restored
    for index, values in moments.items():
        for name, value in values.items():
            assert torch.equal(restored[index][name], value), (index, name)
    assert torch.equal(client.generator.get_state(), start[2])


class _CuriousClient(ImputationClient):
    """A client that keeps every global model it is sent (what an attacker would study)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.downloads: list[ParametersMessage] = []

    def on_parameters(self, message: ParametersMessage) -> None:
        self.downloads.append(message)
        super().on_parameters(message)


ROLES.register("test-curious-client", _CuriousClient)


def test_an_imputation_client_is_replaceable_by_a_registered_role() -> None:
    task = synthetic_task(rows=24, test_rows=6, features=6)
    name = task.train[1].name
    channel = Channel()
    imputer = IMPUTERS.get("fed-dae")(
        task, TINY, seed=0, channel=channel, roles={name: "test-curious-client"}
    )
    imputer.fit()
    clients = in_process_clients(channel)
    curious = [c for c in clients if isinstance(c, _CuriousClient)]
    assert [c.name for c in curious] == [name]
    # The initial model, one average per round and the best one, as every client gets them.
    assert [m.tag for m in curious[0].downloads][:1] == ["initial"]
    assert len(curious[0].downloads) >= TINY.rounds + 1
    for bad, expected in ((SERVER, "keeps its role"), ("nobody", "roles can replace")):
        with pytest.raises(ConfigError, match=expected):
            IMPUTERS.get("fed-dae")(task, TINY, seed=0, roles={bad: "test-curious-client"})


def test_a_method_that_trains_nothing_reports_its_traffic_as_one_step_whatever_the_rounds() -> None:
    """fed-mean's one exchange was divided by the config's rounds, which it ignores: the same
    bytes read 561.5 a step with rounds=2 and 37.4 with the default 30."""
    traffic = []
    for rounds in (2, 30):
        config = ImputeRunConfig(
            method="fed-mean", dataset="synthetic", impute_config=ImputeConfig(rounds=rounds)
        )
        result, _ = run_imputation(config, task=synthetic_task(seed=0))
        traffic.append(result.traffic)
    timed = ("aggregation_s", "protection_s")  # the rest is counted, not timed
    assert [{k: v for k, v in t.items() if k not in timed} for t in traffic[1:]] == [
        {k: v for k, v in traffic[0].items() if k not in timed}
    ]
    assert traffic[0]["train_steps"] == 1
    assert traffic[0]["bytes_per_step"] and all(
        value == traffic[0]["bytes"][name]["train"]
        for name, value in traffic[0]["bytes_per_step"].items()
    )


@pytest.mark.usefixtures("one_thread")
def test_a_secure_imputation_that_diverges_says_so_in_its_own_flags() -> None:
    """A client's FedAvg update past what the masks encode was reported in a training run's
    words: "training diverged at step 4: client-0's representation ... try ... fewer --epochs,
    or --dp-embeddings" (flags impute has not; a message round, in a 3-round run)."""
    from secure_vfl.errors import DivergenceError

    config = ImputeRunConfig(
        method="fed-dae",
        dataset="synthetic",
        impute_config=ImputeConfig(rounds=3, local_epochs=1, hidden=16, lr=1e30),
    )
    said = (
        r"^in FedAvg round 1, the imputation diverged: client-\d's contribution to the masks sums "
        r"of server has .*, beyond what they encode, \|value\| <= .*; try a lower --lr or fewer "
        r"--local-epochs\.$"
    )
    with pytest.raises(DivergenceError, match=said) as raised:
        run_imputation(config, task=synthetic_task(seed=0), aggregator=MaskingAggregator())
    assert raised.value.step == 1  # the FedAvg round, for a caller to report (it had none)


@pytest.mark.parametrize("fault", ["another width", "other members"])
@pytest.mark.parametrize("backend", ["plain", *BACKENDS])
def test_a_coordinators_sum_not_as_asked_is_refused_before_it_is_opened_and_still_awaited(
    backend: str, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator opened each sum it asked for before checking its width and clients
    (under masks, one over other clients failed inside the opener, the masks not cancelling),
    and its expectation was spent on the refused sum. Checked against what it asked for before
    its key opens it; the right sum is still taken after."""
    aggregator = PlainAggregator() if backend == "plain" else BACKENDS[backend]()
    imputer = _imputer(aggregator)
    coordinator = imputer.federation.own
    opened: list[int] = []
    if coordinator.opener is not None:
        real_open = coordinator.opener.open
        monkeypatch.setattr(
            coordinator.opener, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k)
        )
    server = imputer.federation.channel.parties[AGGREGATOR]
    tamper = TamperedSum(fault)
    server.outgoing.append(tamper)
    said = (
        r"sums of width (\d+) \(what it asked for\) expected, found \d+\."
        if fault == "another width"
        else "its request selected expected, found other "
        + ("counts" if backend == "plain" else "members")
    )
    with pytest.raises(
        ProtocolError, match=rf"^server: the sum '[^']*' of round \d+ from aggregator: .*{said}"
    ):
        imputer.fit()
    assert opened == []  # its key did no work on it
    original = tamper.kept[0]
    imputer.federation.channel.post(original, sender=server)
    summed = coordinator.take(
        "sum", sender=AGGREGATOR, round=original.round, batch_id=original.batch_id, tag=original.tag
    )
    assert isinstance(summed, SumMessage)
