"""An imputation client lost mid-run, in one process: a channel that loses a client when a
chosen message is posted to it (test_deploy_impute.py kills a real client process; these reach
each place a FedAvg round can break)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from test_fedhf import synthetic_task

from protocols.secagg import MaskingAggregator
from secure_vfl.errors import ProtocolError, RunWarning, TransportError
from secure_vfl.federation.aggregator import PlainAggregator, SealingScheme, SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import AGGREGATOR, Message, SealedSumMessage
from secure_vfl.federation.parties import Party
from secure_vfl.methods.imputation import IMPUTERS, ImputeConfig
from secure_vfl.methods.imputation.clients import ImputationClient, flat_parameters
from secure_vfl.methods.imputation.evaluation import score_seed
from secure_vfl.methods.imputation.fedhf import ReconstructionImputer, _message_round

CONFIG = ImputeConfig(rounds=4, local_epochs=1, hidden=8, layers=1)
ROUND = 1  # the FedAvg round (0-based) in which the client is lost


class LosingClient(Channel):
    """Loses client ``lost`` when the first ``kind`` of message round ``round`` is posted to
    it: that post and every later one to it raise TransportError, and :meth:`unreachable`
    names it from then on. ``posted``: every message posted, ``after_loss``: how many were
    posted to it once it was lost."""

    def __init__(self, lost: str, kind: str, round: int) -> None:
        super().__init__()
        self.lost, self.kind, self.round = lost, kind, round
        self.gone = False
        self.after_loss = 0
        self.posted: list[Message] = []

    def post(self, message: Message, *, sender: Party) -> None:
        self.posted.append(message)
        if message.receiver == self.lost:
            if self.gone:
                self.after_loss += 1
            elif message.kind == self.kind and message.round == self.round:
                self.gone = True
            if self.gone:
                raise TransportError(f"{message.kind} to {self.lost}: its process is gone")
        super().post(message, sender=sender)

    def unreachable(self, names: list[str]) -> list[str]:  # type: ignore[override]
        return [name for name in names if self.gone and name == self.lost]


def _fit(
    channel: Channel, aggregator: SumBackend, method: str = "fedhf"
) -> tuple[ReconstructionImputer, list[float], dict[str, tuple[float, int]]]:
    task = synthetic_task(rows=40, test_rows=12, features=6)
    imputer = IMPUTERS.get(method)(task, CONFIG, seed=0, aggregator=aggregator, channel=channel)
    assert isinstance(imputer, ReconstructionImputer)
    curve = imputer.fit()
    scored = imputer.score(imputer.standardisation, seed=0, fraction=0.2)
    # the per-feature sums cover exactly the clients that have a score
    assert scored.feature_count.sum() == sum(count for _, count in scored.per_client.values())
    return imputer, curve, scored.per_client


@pytest.mark.parametrize(
    ("kind", "round", "fedavg_round"),
    [
        ("compute-request", _message_round(ROUND), ROUND + 1),  # asked for its local update
        ("parameters", _message_round(ROUND), ROUND + 1),  # the round's download
        ("parameters", _message_round(CONFIG.rounds), CONFIG.rounds),  # the best model's
        ("score-request", _message_round(CONFIG.rounds + 1), CONFIG.rounds),  # being scored
        # scored, then asked for its per-feature errors: it has no score
        ("compute-request", _message_round(CONFIG.rounds + 1), CONFIG.rounds),
    ],
    ids=["local-update", "download", "best-download", "score", "feature-errors"],
)
@pytest.mark.parametrize("backend", ["plain", "masks"])
def test_a_lost_client_is_dropped_and_fedavg_goes_on_over_the_others(
    kind: str, round: int, fedavg_round: int, backend: str
) -> None:
    aggregator = PlainAggregator() if backend == "plain" else MaskingAggregator()
    channel = LosingClient("client-2", kind, round)
    imputer, curve, scores = _fit(channel, aggregator)
    federation = imputer.federation
    assert channel.gone and channel.after_loss == 0  # nothing more was sent to it
    [fault] = federation.faults
    assert fault["party"] == "client-2" and fault["round"] == fedavg_round
    assert "its process is gone" in fault["what"]
    assert federation.names == ["client-0", "client-1", "client-3"]
    assert federation.roster == ("client-0", "client-1", "client-2", "client-3")
    assert len(curve) == CONFIG.rounds and np.all(np.isfinite(curve))
    # Every other client scored itself, with its own draws (its index in the roster): the
    # same numbers as a run in which nobody was lost would give it, when the loss came after
    # training (the best model, the scoring).
    assert sorted(scores) == federation.names
    if round == _message_round(CONFIG.rounds + 1):
        whole, _, whole_scores = _fit(Channel(), type(aggregator)())
        assert whole.federation.faults == []
        for name in federation.names:
            assert scores[name] == pytest.approx(whole_scores[name], rel=1e-6)


@pytest.mark.parametrize("backend", ["plain", "masks"])
def test_a_loss_that_leaves_secure_sums_one_client_stops_saying_so(backend: str) -> None:
    """Two clients under masks, one lost: the retried round failed on the aggregator's refusal
    of a sum of one, in training terms ("a sum reveals a single party's representation ...
    task 0, row 0"), after a line saying FedAvg would go on. Plain sums go on with one."""
    aggregator = PlainAggregator() if backend == "plain" else MaskingAggregator()
    channel = LosingClient("client-1", "compute-request", _message_round(ROUND))
    task = synthetic_task(rows=40, test_rows=12, features=6, clients=2)
    imputer = IMPUTERS.get("fedhf")(task, CONFIG, seed=0, aggregator=aggregator, channel=channel)
    if backend == "plain":
        assert len(imputer.fit()) == CONFIG.rounds
        assert imputer.federation.names == ["client-0"]
        return
    with pytest.raises(TransportError) as refused:  # a lost party: exit 1, not 2
        imputer.fit()
    assert str(refused.value).startswith(
        f"client-1 lost in round {ROUND + 1}, which leaves client-0 alone: a secure sum (masks) "
        "needs at least 2 clients"
    )
    assert "its process is gone" in str(refused.value)
    assert refused.value.party == "client-1"  # the end of the run need not warn of it again


def test_a_lost_aggregation_server_stops_fedavg_naming_it() -> None:
    """A client's refusal (it could not reach the aggregator) stopped the run as that client's
    protocol error (exit 2), naming the wrong party."""
    channel = LosingClient("client-1", "compute-request", _message_round(ROUND))
    channel.unreachable = lambda names: [AGGREGATOR] if channel.gone else []  # type: ignore[method-assign]
    task = synthetic_task(rows=40, test_rows=12, features=6, clients=2)
    imputer = IMPUTERS.get("fedhf")(task, CONFIG, seed=0, channel=channel)
    with pytest.raises(
        TransportError, match="the aggregation server can no longer be reached"
    ) as raised:
        imputer.fit()
    assert raised.value.party == AGGREGATOR


class RestartingClient(LosingClient):
    """A :class:`LosingClient` whose lost client its operator restarts at once: the first probe
    after the loss finds it back, and the readmission attaches a new client built as at the
    start (its rows, test rows and training plan; under a scheme, its own new halves)."""

    def __init__(self, lost: str, kind: str, round: int, aggregator: SumBackend) -> None:
        super().__init__(lost, kind, round)
        self.aggregator = aggregator
        self.readmit = self._readmit
        self.restarted: ImputationClient | None = None

    def returned(self, names: list[str], *, quick: bool = False) -> list[str]:  # type: ignore[override]
        return [name for name in names if self.gone and name == self.lost]

    def _readmit(self, name: str) -> int:
        old = self.parties[name]
        assert isinstance(old, ImputationClient)
        client = ImputationClient(
            old._data, test=old._test, training=old.training, coordinator=old.coordinator
        )
        if isinstance(self.aggregator, SealingScheme):
            client.install(self.aggregator.scheme, self.aggregator.sender(), None)
        self.detach(name)
        client.connect(self)
        self.gone, self.restarted = False, client
        return 0


@pytest.mark.parametrize("backend", ["plain", "masks"])
def test_a_lost_client_restarted_by_its_operator_rejoins_before_the_next_round(
    backend: str,
) -> None:
    aggregator = PlainAggregator() if backend == "plain" else MaskingAggregator()
    channel = RestartingClient("client-2", "compute-request", _message_round(ROUND), aggregator)
    imputer, curve, scores = _fit(channel, aggregator)
    federation = imputer.federation
    lost, back = federation.faults
    assert lost["party"] == "client-2" and lost["round"] == ROUND + 1
    assert back == {"party": "client-2", "round": ROUND + 2, "what": "rejoined"}
    assert channel.after_loss == 0  # nothing was sent to it while it was lost
    assert federation.names == list(federation.roster)  # back in its place
    client = channel.restarted
    assert client is not None and channel.parties["client-2"] is client
    # Sent the statistics and the round's global model, it trained in the later rounds, took
    # the best model at the end and scored itself.
    [rejoin] = [m for m in channel.posted if m.receiver == "client-2" and m.kind == "parameters"
                and getattr(m, "tag", "") == "rejoin"]  # fmt: skip
    assert rejoin.round == _message_round(ROUND + 1)
    assert client.optimiser is not None and client.optimiser.state_dict()["state"]
    assert client.model is not None and imputer.best is not None
    assert torch.equal(flat_parameters(client.model), imputer.best)
    assert sorted(scores) == list(federation.roster)
    assert len(curve) == CONFIG.rounds and np.all(np.isfinite(curve))
    # A new session: under masks every client announced its keys again, the new one's new.
    requests = [m for m in channel.posted if m.kind == "key-request"]
    # the clients and the aggregation server, twice
    assert len(requests) == (2 * 5 if backend == "masks" else 0)
    assert len({m.session for m in requests}) == (2 if backend == "masks" else 0)


def test_a_retried_round_trains_the_others_from_the_rounds_global_model() -> None:
    """Lost at its local update: the others' updates of the abandoned attempt are undone by
    the round's model downloaded anew, so the round's average is theirs from that model, and
    its validation is summed over them alone (three clients, as the check on counts says)."""
    channel = LosingClient("client-1", "compute-request", _message_round(ROUND))
    imputer, _, _ = _fit(channel, PlainAggregator())
    restarts = [
        m for m in channel.posted if m.kind == "parameters" and getattr(m, "tag", "") == "restart"
    ]
    assert {m.receiver for m in restarts} == {"client-0", "client-2", "client-3"}
    assert {m.batch_id for m in restarts} == {1}  # the retry is a fresh batch
    assert imputer.federation.attempt == 1


class WatchingClient(LosingClient):
    """Also records ``watched``'s optimiser state and generator state when the round's local
    update is asked of it (before it trains) and once the round's restart has reached it."""

    def __init__(self, watched: str, lost: str, kind: str, round: int) -> None:
        super().__init__(lost, kind, round)
        self.watched = watched
        self.states: dict[str, tuple[dict[str, Any], torch.Tensor]] = {}

    def post(self, message: Message, *, sender: Party) -> None:
        watched = message.receiver == self.watched and message.round == self.round
        if watched and message.kind == "compute-request" and message.batch_id == 0:
            self.states.setdefault("before", self._state())
        super().post(message, sender=sender)
        if watched and getattr(message, "tag", "") == "restart":
            self.states["restarted"] = self._state()

    def _state(self) -> tuple[dict[str, Any], torch.Tensor]:
        client = self.parties[self.watched]
        assert isinstance(client, ImputationClient) and client.optimiser is not None
        assert client.generator is not None
        state = copy.deepcopy(client.optimiser.state_dict()["state"])
        return state, client.generator.get_state()


def test_a_retried_round_puts_back_the_survivors_optimiser_moments_and_generator() -> None:
    """client-0 trains in the abandoned attempt (client-3, asked last, is lost): the restart
    gives it back the Adam moments and the batch generator it had before, as well as the
    round's model, so the retry trains it as if the attempt had not been."""
    channel = WatchingClient("client-0", "client-3", "compute-request", _message_round(ROUND))
    _fit(channel, PlainAggregator())
    (before, generator_before), (after, generator_after) = (
        channel.states["before"],
        channel.states["restarted"],
    )
    assert before and before.keys() == after.keys()  # Adam moments of every parameter
    for index, moments in before.items():
        for name, value in moments.items():
            assert torch.equal(value, after[index][name]), (index, name)
    assert torch.equal(generator_before, generator_after)


def test_a_protocol_error_with_every_client_reachable_is_not_a_fault() -> None:
    task = synthetic_task(rows=40, test_rows=12, features=6)
    imputer = IMPUTERS.get("fedhf")(task, CONFIG, seed=0, channel=Channel())
    assert isinstance(imputer, ReconstructionImputer)
    error = ProtocolError("a malformed sum")
    with pytest.raises(ProtocolError, match="a malformed sum"):
        imputer.federation.recover(error, round=_message_round(0), fedavg_round=1)
    assert imputer.federation.faults == [] and imputer.federation.clients == 4


def test_scores_keep_each_clients_own_draws_after_a_loss() -> None:
    # The lost client's index is not reused: client-3 still draws with score_seed(seed, 3).
    channel = LosingClient("client-0", "compute-request", _message_round(ROUND))
    imputer, _, _ = _fit(channel, PlainAggregator())
    seeds = [m.seed for m in channel.posted if m.kind == "score-request"]
    assert seeds == [score_seed(0, k) for k in (1, 2, 3)]
    assert imputer.federation.faults[0]["party"] == "client-0"


def test_the_coordinator_stops_expecting_the_abandoned_rounds_sum() -> None:
    """A client lost at its seal request: the coordinator retries the round under a fresh
    batch id. It kept expecting the abandoned attempt's sum (a late one would have waited in
    its inbox for good); now it drops a late one and expects nothing of that attempt."""
    round = _message_round(ROUND)
    channel = LosingClient("client-1", "seal-request", round)
    imputer, _, _ = _fit(channel, MaskingAggregator())
    coordinator = imputer.federation.own
    assert [fault["party"] for fault in imputer.federation.faults] == ["client-1"]
    assert not [key for key in coordinator._expected if key[2] == round]
    [key] = [key for key in coordinator._abandoned_expected if key[0] == "sum"]
    late = SealedSumMessage(
        sender=AGGREGATOR,
        receiver=coordinator.name,
        round=key[2],
        batch_id=key[3],
        session=imputer.federation.session,
        scheme="masks",
        tag=key[4] or "",
        width=4,
        selection=torch.ones(1, 1, 3, dtype=torch.bool),
        parties=("client-0", "client-2", "client-3"),
        payload=(b"\0" * 32,),  # never opened: no key does any work on it
    )
    inbox = list(coordinator._inbox)
    coordinator.receive(late)
    assert coordinator._inbox == inbox


def test_a_loss_that_leaves_a_secure_cohort_of_one_samples_two() -> None:
    """Four clients at client_fraction 0.4 under masks sample 2 a round; with one lost, 0.4 of
    the three left rounds to 1, and the round failed on the aggregator's refusal of a sum of
    one ("a sum reveals a single party's representation ..."). It samples 2, saying so."""
    config = ImputeConfig(rounds=4, local_epochs=1, hidden=8, layers=1, client_fraction=0.4)
    channel = LosingClient("client-2", "compute-request", _message_round(ROUND))
    task = synthetic_task(rows=40, test_rows=12, features=6)
    imputer = IMPUTERS.get("fedhf")(
        task, config, seed=0, aggregator=MaskingAggregator(), channel=channel
    )
    with pytest.warns(RunWarning, match=r"fedhf: `client_fraction` 0.4 of the 3 clients left "
                      r"samples 1 a round, and a secure sum \(masks\) needs 2"):  # fmt: skip
        curve = imputer.fit()
    assert len(curve) == config.rounds and np.all(np.isfinite(curve))
    assert imputer.federation.names == ["client-0", "client-1", "client-3"]
