"""Federated imputation as actors: the clients, the coordinator and the aggregation server.

:func:`build_imputation_federation` makes one :class:`~secure_vfl.methods.imputation.clients.
ImputationClient` per client (its rows, its own statistics mechanism, its training plan), the
:class:`Coordinator` (the FedAvg server, :data:`~secure_vfl.methods.imputation.statistics.
SERVER`) and an :class:`~secure_vfl.federation.parties.AggregationServer`, all attached to one
channel, and returns the coordinator's view of the run (:class:`ImputationFederation`).

Every client sum is a secure-sum-able vector sum: the coordinator asks each client for a local
computation (:class:`~secure_vfl.federation.messages.ComputeRequest`), each client sends its
vector to the aggregator as a one-row representation (plain) or keeps it and seals it on a
:class:`~secure_vfl.federation.messages.SealRequest` (split secure schemes: masks, Paillier,
CKKS), the aggregator adds on a :class:`~secure_vfl.federation.messages.SumRequest` and the
coordinator alone receives (and, under a scheme, opens) the sum.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from secure_vfl.data.imputation import ClientData
from secure_vfl.errors import ConfigError, DataError, ProtocolError, TransportError
from secure_vfl.federation.aggregator import SealingScheme, SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import (
    AGGREGATOR,
    AbortRequest,
    ComputeRequest,
    GlobalStatisticsMessage,
    KeyRequest,
    Message,
    ParametersMessage,
    ScoreMessage,
    ScoreRequest,
    SealRequest,
    SumMessage,
    SumRequest,
)
from secure_vfl.federation.parties import (
    ROLES,
    SecureSumParty,
    SumLayout,
    make_aggregation_server,
    ticket_issuer,
)
from secure_vfl.federation.tickets import Contribution, TicketIssuer
from secure_vfl.methods.base import REJOINED
from secure_vfl.methods.imputation.clients import ImputationClient, TrainingPlan
from secure_vfl.methods.imputation.evaluation import ScoredErrors
from secure_vfl.methods.imputation.statistics import (
    SERVER,
    FederatedStatistics,
    ReleaseTerms,
    Standardisation,
    StatisticsPrivacyFactory,
    collect_statistics,
    from_wide_digits,
    wide_width,
)
from secure_vfl.models.feature_graph import FeatureGraph

logger = logging.getLogger(__name__)

_NO_ARGUMENTS = np.zeros(0)

REJOIN_TAG = "rejoin"
"""The tag of the download of the global model to a client readmitted before a round."""


class Coordinator(SecureSumParty):
    """The FedAvg server of federated imputation (:data:`SERVER`): it drives the run by
    messages and is the receiver of every client sum (under Paillier or CKKS it holds the
    receiver half, the scheme's only secret key; under pairwise masks the key that removes
    the clients' self-masks). It holds no client's rows, model or generator, and accepts
    nothing but sums from the aggregator, its own key set-up, the clients' public keys and the
    scores it asked a client for (one each)."""

    def __init__(self, name: str = SERVER) -> None:
        super().__init__(name)
        self.scoring: set[str] = set()
        """The clients asked for a score that has not come: it accepts one from each."""

    def receive(self, message: Message) -> None:
        from_aggregator = message.kind in ("sum", "sealed-sum") and message.sender == AGGREGATOR
        own_set_up = message.kind == "key-request" and message.sender == self.name
        announced = message.kind == "public-key" and message.sender != AGGREGATOR
        scored = message.kind == "score" and message.sender in self.scoring
        if not (from_aggregator or own_set_up or announced or scored):
            raise ProtocolError(
                f"{self.name}: sums from {AGGREGATOR} expected, found a {message.kind} from "
                f"{message.sender} (besides sums it accepts only its own key set-up, public "
                "keys and the scores it asked a client for)."
            )
        if scored:
            self.scoring.discard(message.sender)
        super().receive(message)


@dataclass
class ImputationFederation:
    """The coordinator's view of an imputation run: its own party, the clients' names, the
    public width of their schema, the public terms of their private releases (if any), the
    channel it talks through and the session. Everything it asks of a client, and everything
    it learns from one, is a message; it holds no reference to a client's object."""

    own: Coordinator
    names: list[str]
    features: int
    channel: Channel
    session: str
    release_terms: ReleaseTerms | None = None
    scheme: str = ""
    faults: list[dict[str, Any]] = field(default_factory=list)
    """Every client lost (a deployment: its process died): its name, the FedAvg round (from 1)
    from which it took no part, and the error that revealed it; and every client readmitted
    (:meth:`rejoin`): its name, the round from which it took part again, ``"rejoined"``."""
    attempt: int = 0
    """The batch id of every message from now on: a round retried after a loss is a fresh
    batch, so no client or aggregator takes its messages for replays of the abandoned one."""
    roster: tuple[str, ...] = ()
    """Every client the run started with, in order (a client's index is its place here)."""
    tickets: TicketIssuer = field(init=False, repr=False)
    """The tickets of the contributions it asks the clients to send the aggregation server
    (:mod:`~secure_vfl.federation.tickets`)."""

    def __post_init__(self) -> None:
        self.roster = self.roster or tuple(self.names)
        self.tickets = ticket_issuer(self.own)

    def _ticket(self, kind: str, name: str, round: int, tag: str, *, deliver_to: str = "") -> bytes:
        """The ticket of the contribution (``kind``: ``representation`` or ``sealed``) to the
        sum ``tag`` it asks client ``name`` for."""
        named = Contribution(
            kind=kind,
            session=self.session,
            contributor=name,
            round=round,
            batch_id=self.attempt,
            phase="train",
            tag=tag,
            deliver_to=deliver_to,
        )
        return self.tickets.mint(named)

    @property
    def clients(self) -> int:
        """How many clients the federation has."""
        return len(self.names)

    def _header(self, receiver: str, round: int) -> dict[str, Any]:
        return {
            "sender": self.own.name,
            "receiver": receiver,
            "round": round,
            "batch_id": self.attempt,
            "session": self.session,
        }

    def recover(self, error: ProtocolError, *, round: int, fedavg_round: int) -> None:
        """After ``error`` cut message round ``round`` short (FedAvg round ``fedavg_round``,
        from 1): drop every client that can no longer be reached (FedAvg goes on over the
        others: eq. 8's weights are normalised over whoever contributes), abandon the round at
        every other client and the aggregator (:class:`AbortRequest`: what they kept of it is
        discarded, and a lost client's late share is refused, never added) and make the next
        messages a fresh batch, so the caller can retry the round. Re-raises ``error`` if no
        client was lost (a protocol error, not a fault) or if no client is left; raises
        TransportError if the aggregation server was lost, or, saying why, if secure sums are
        left one client
        (a sum of one would be that client's update in the clear, which they refuse)."""
        lost = self.channel.unreachable([*self.names, AGGREGATOR])
        if AGGREGATOR in lost:  # what the error says may be a client's refusal of it
            raise TransportError(
                f"the aggregation server can no longer be reached ({error}); FedAvg cannot go "
                "on without it.",
                AGGREGATOR,
            ) from error
        if not lost or set(lost) >= set(self.names):
            raise error
        left = [name for name in self.names if name not in lost]
        if self.scheme and len(left) < 2:  # a party lost that the run cannot go on without
            raise TransportError(
                f"{', '.join(lost)} lost in round {fedavg_round}, which leaves {left[0]} alone: "
                f"a secure sum ({self.scheme}) needs at least 2 clients (the sum of one is its "
                f"update in the clear), so FedAvg cannot go on ({error}).",
                lost[0] if len(lost) == 1 else None,
            ) from error
        for name in lost:
            self.names.remove(name)
            self.own.scoring.discard(name)
            self.faults.append({"party": name, "round": fedavg_round, "what": str(error)})
            logger.warning(
                "%s: client %s is lost in round %d; FedAvg goes on over the other %d: %s",
                self.own.name,
                name,
                fedavg_round,
                len(self.names),
                error,
            )
        for name in [*self.names, AGGREGATOR]:
            self.own.send(AbortRequest(**self._header(name, round)))
        self.own.abandon_expected(round)  # a late answer of the attempt is dropped
        self.attempt += 1

    def rejoin(
        self,
        *,
        round: int,
        fedavg_round: int,
        statistics: tuple[Standardisation, FeatureGraph | None],
        parameters: Tensor,
    ) -> list[str]:
        """Before FedAvg round ``fedavg_round`` (from 1; message round ``round``): probe every
        lost client at once (:meth:`~secure_vfl.federation.channel.Channel.returned`, quick: an
        address that refuses is not back) and readmit each that answers (the channel's
        readmission: a new process set up as at the start). A readmitted client is sent the
        published ``statistics`` and the global ``parameters`` (its local training goes on from
        them, its optimiser fresh), takes its place in the roster's order again and ``faults``
        records it (``"what": "rejoined"``); then a new session opens (under a secure-sum
        scheme every client announces its keys again: the readmitted one's are new). A client
        that answers but cannot be set up stays lost (logged), and is probed again next round.
        Returns the clients readmitted. Nothing is probed without lost clients or a
        readmission."""
        readmit = self.channel.readmit
        lost = [name for name in self.roster if name not in self.names]
        if not lost or readmit is None:
            return []
        back = []
        for name in self.channel.returned(lost, quick=True):
            try:
                readmit(name)
                self.publish(*statistics, names=[name])
                self.download(parameters, round=round, tag=REJOIN_TAG, names=[name])
            except ProtocolError as error:
                logger.warning(
                    "%s: client %s answers again but could not be set up (%s); it stays lost",
                    self.own.name,
                    name,
                    error,
                )
                continue
            back.append(name)
            self.names = [member for member in self.roster if member in (*self.names, name)]
            self.faults.append({"party": name, "round": fedavg_round, "what": REJOINED})
            logger.warning(
                "%s: client %s rejoined, set up anew; it takes part again from round %d",
                self.own.name,
                name,
                fedavg_round,
            )
        if back:
            self.open_session(round=round, fedavg_round=fedavg_round)
        return back

    def open_session(self, *, round: int, fedavg_round: int) -> None:
        """A new session for every message and sum from now on (no sum context of the old one
        can recur); under a secure-sum scheme every client announces its keys again. A client
        lost during the key set-up is dropped (:meth:`recover`) and the set-up runs again
        without it."""
        while True:
            self.session = secrets.token_hex(8)
            if not self.scheme:
                return
            try:
                self.set_up_keys()
                return
            except ProtocolError as error:
                self.recover(error, round=round, fedavg_round=fedavg_round)

    def sum(
        self,
        computation: str,
        arguments: np.ndarray,
        *,
        width: int,
        round: int,
        tag: str,
        cohort: Sequence[str] | None = None,
    ) -> np.ndarray:
        """The sum over ``cohort`` (default: every client) of the ``width``-value vectors each
        computes by ``computation`` on ``arguments``: float32, as the coordinator receives it.

        ``(round, tag)`` names the sum (secure backends never serve one context twice). Under a
        secure scheme each client is asked to seal what it kept; only the sum reaches the
        coordinator, and one over other clients or of another width is refused before it is
        opened (:meth:`~secure_vfl.federation.parties.SecureSumParty.expect_sums`).
        """
        parties = tuple(self.names if cohort is None else cohort)
        values = torch.from_numpy(np.array(arguments, dtype=np.float64).reshape(-1))
        for name in parties:
            self.own.send(
                ComputeRequest(
                    **self._header(name, round),
                    computation=computation,
                    arguments=values,
                    tag=tag,
                    # Under a scheme the row is held until sealed: the seal request has a ticket.
                    ticket=b"" if self.scheme else self._ticket("representation", name, round, tag),
                )
            )
        selection = torch.ones(1, 1, len(parties), dtype=torch.bool)
        # Under a secure scheme each client first seals what it kept; then the aggregator adds.
        sealers = list(parties) if self.scheme else []
        self.own.expect_sums(
            SumLayout(selection=selection, parties=parties, width=width),
            round=round,
            batch_id=self.attempt,
            tag=tag,
        )
        plan: dict[str, Any] = {
            "selection": selection,
            "parties": parties,
            "deliver_to": self.own.name,
            "tag": tag,
            "source_tag": tag,
        }
        for name in sealers:
            ticket = self._ticket("sealed", name, round, tag, deliver_to=self.own.name)
            self.own.send(SealRequest(**self._header(name, round), **plan, ticket=ticket))
        self.own.send(SumRequest(**self._header(AGGREGATOR, round), **plan))
        summed = cast(
            SumMessage,
            self.own.take("sum", sender=AGGREGATOR, round=round, batch_id=self.attempt, tag=tag),
        )
        return summed.sums[0, 0].numpy()

    def publish(
        self,
        standardisation: Standardisation,
        graph: FeatureGraph | None,
        *,
        names: Sequence[str] | None = None,
    ) -> None:
        """Send every client (or ``names``) the global standardisation and (for a graph model)
        the graph."""
        neighbours = weights = mask = None
        constant = None
        if standardisation.constant is not None:
            constant = torch.from_numpy(np.asarray(standardisation.constant, dtype=np.bool_))
        if graph is not None:
            neighbours = torch.from_numpy(graph.neighbours)
            weights = torch.from_numpy(graph.weights)
            mask = torch.from_numpy(graph.mask)
        for name in self.names if names is None else names:
            self.own.send(
                GlobalStatisticsMessage(
                    **self._header(name, 0),
                    mean=torch.from_numpy(np.asarray(standardisation.mean, dtype=np.float64)),
                    std=torch.from_numpy(np.asarray(standardisation.std, dtype=np.float64)),
                    neighbours=neighbours,
                    weights=weights,
                    mask=mask,
                    constant=constant,
                )
            )

    def download(
        self, parameters: Tensor, *, round: int, tag: str, names: Sequence[str] | None = None
    ) -> None:
        """FedAvg's download: one message with the global ``parameters`` to each client (or
        ``names``)."""
        for name in self.names if names is None else names:
            self.own.send(
                ParametersMessage(**self._header(name, round), parameters=parameters, tag=tag)
            )

    def score(
        self,
        std: np.ndarray,
        seed_of: Callable[[int], int],
        *,
        fraction: float,
        round: int,
        fedavg_round: int,
    ) -> ScoredErrors:
        """Each client's (sum of squared errors, count) on its own test rows, ``fraction`` of
        their entries hidden by a generator seeded ``seed_of(k)`` (k: the client's index in the
        roster), errors in units of ``std`` (:class:`~secure_vfl.federation.messages.
        ScoreRequest`): two numbers per client cross, never a row. Then the same per feature,
        summed over the clients scored (the ``feature-errors`` sum: through the secure-sum
        backend, so that under a secure one no client's per-feature errors reach the
        coordinator). A client lost on the way is dropped (:meth:`recover`, dated
        ``fedavg_round``) and has no score."""
        scores: dict[str, tuple[float, int]] = {}
        yardstick = torch.from_numpy(np.asarray(std, dtype=np.float64))
        features = yardstick.shape[0]
        while True:
            while unscored := [name for name in self.names if name not in scores]:
                name = unscored[0]
                self.own.scoring.add(name)
                request = ScoreRequest(
                    **self._header(name, round),
                    std=yardstick,
                    seed=seed_of(self.roster.index(name)),
                    fraction=fraction,
                )
                try:
                    self.own.expect("score", senders=[name], round=round, batch_id=self.attempt)
                    self.own.send(request)
                    answer = cast(
                        ScoreMessage,
                        self.own.take("score", sender=name, round=round, batch_id=self.attempt),
                    )
                except ProtocolError as error:
                    self.recover(error, round=round, fedavg_round=fedavg_round)
                    continue
                scores[name] = (answer.sse, answer.count)
            try:
                summed = self.sum(
                    "feature-errors",
                    _NO_ARGUMENTS,
                    width=wide_width(2 * features + 1),
                    round=round,
                    tag="feature-errors",
                )
            except ProtocolError as error:  # a client lost after it scored has no score
                self.recover(error, round=round, fedavg_round=fedavg_round)
                scores = {name: score for name, score in scores.items() if name in self.names}
                continue
            return _feature_errors(scores, from_wide_digits(summed), features)

    def set_up_keys(self) -> None:
        """Open the secure-sum session: every client announces its public key to the others
        (pairwise masks), the coordinator its encryption key to the clients and the aggregator
        (Paillier, CKKS). Only public keys cross."""
        for name in (AGGREGATOR, *self.names, self.own.name):  # the server takes keys too
            self.own.send(
                KeyRequest(
                    **self._header(name, 0),
                    scheme=self.scheme,
                    contributors=tuple(self.names),
                    receivers=(self.own.name,),
                )
            )


def _feature_errors(
    scores: dict[str, tuple[float, int]], totals: np.ndarray, features: int
) -> ScoredErrors:
    """The scoring's errors from the clients' ``scores`` and the ``feature-errors`` sum's
    ``totals`` (per feature the squared errors, then the counts, then how many clients' errors
    were too large to send: NaN errors then). ProtocolError where the sum disagrees with the
    scores (a count or error below zero, counts of another total, errors of another sum)."""
    sse, counts = totals[:features], np.rint(totals[features : 2 * features]).astype(np.int64)
    count = sum(n for _, n in scores.values())
    squared = sum(s for s, _ in scores.values())
    # each client's value is rounded to 2**-20 on the way: the sums may be off by that much each
    slack = len(scores) * (features + 1) * 2.0**-20 + 1e-9 * max(squared, 1.0)
    overflow = round(float(totals[2 * features])) > 0
    wrong = (counts < 0).any() or int(counts.sum()) != count
    if not overflow:
        wrong = wrong or bool((sse < -slack).any()) or abs(float(sse.sum()) - squared) > slack
    if wrong:
        raise ProtocolError(
            f"the feature-errors sum disagrees with the clients' scores: {count} hidden entries "
            f"of squared error {squared:.6g} expected in all, found counts {counts.tolist()} "
            f"and errors {sse.tolist()}."
        )
    return ScoredErrors(
        per_client=scores,
        feature_sse=np.full(features, np.nan) if overflow else np.maximum(sse, 0.0),
        feature_count=counts,
    )


def _check_clients(clients: Sequence[ClientData]) -> int:
    """The clients' common width; refuse none, mixed widths, or names that are not distinct
    client names."""
    if not clients:
        raise DataError("a federation needs at least one client, found none.")
    widths = {c.values.shape[1] for c in clients}
    if len(widths) != 1:
        raise DataError(f"every client must have the same F columns. Found widths {widths}.")
    names = [c.name for c in clients]
    if len(set(names)) != len(names) or {SERVER, AGGREGATOR} & set(names):
        raise DataError(
            f"client names must be distinct and other than {SERVER!r} and {AGGREGATOR!r}. "
            f"Found {names}."
        )
    return widths.pop()


def _release_terms(clients: Sequence[ImputationClient], features: int) -> ReleaseTerms | None:
    """The public terms every client's mechanism releases under (refusing mechanisms that
    are shared, differ in their terms or cover another number of features)."""
    mechanisms = [client.privacy for client in clients if client.privacy is not None]
    if not mechanisms:
        return None
    if len({id(m) for m in mechanisms}) != len(clients):
        raise ConfigError(
            "each client needs its own statistics mechanism (its own noise generator); found "
            f"{len({id(m) for m in mechanisms})} for {len(clients)} clients."
        )
    terms = ReleaseTerms.of(mechanisms[0])
    if terms.ranges.lower.shape[0] != features:
        raise DataError(
            f"the privacy mechanism's ranges cover {terms.ranges.lower.shape[0]} features; "
            f"the clients have {features}."
        )
    for client, mechanism in zip(clients, mechanisms, strict=True):
        if not ReleaseTerms.of(mechanism).matches(terms):
            raise ConfigError(
                f"every client's mechanism must release under the same public terms (ranges, "
                f"standard bound, noise std); {client.name}'s differ from {clients[0].name}'s."
            )
    return terms


def build_imputation_federation(
    clients: Sequence[ClientData],
    *,
    seed: int = 0,
    aggregator: SumBackend | None = None,
    channel: Channel | None = None,
    privacy: StatisticsPrivacyFactory | None = None,
    roles: Mapping[str, str] | None = None,
    training: TrainingPlan | None = None,
    tests: Sequence[ClientData] | None = None,
) -> ImputationFederation:
    """One :class:`ImputationClient` per client (with its own mechanism ``privacy(name)``,
    when the run trains its part of ``training``, and its test rows ``tests[k]`` when the run
    scores its clients' models by messages), the coordinator and an aggregation server
    running ``aggregator`` (plain by default), all attached to ``channel``. Under a scheme split
    at the boundary each party makes its own halves and keys meet by messages. Returns the
    coordinator's view.

    ``roles`` replaces a client (by its name) or the aggregation server by the role registered
    under a name in :data:`~secure_vfl.federation.parties.ROLES` (an attacker is a subclass of
    the role it plays: ``imputation-client``, ``aggregation-server``); the coordinator drives
    the run and keeps its role."""
    features = _check_clients(clients)
    if tests is not None and [t.name for t in tests] != [c.name for c in clients]:
        names = ", ".join(c.name for c in clients)
        raise ConfigError(
            f"test rows for each client, in order, expected ({names}); found them for "
            f"{', '.join(t.name for t in tests) or 'none'}."
        )
    roles = dict(roles or {})
    replaceable = [data.name for data in clients] + [AGGREGATOR]
    unknown = sorted(set(roles) - set(replaceable))
    if unknown:
        raise ConfigError(
            f"roles can replace {', '.join(replaceable)}; found {', '.join(unknown)} (the "
            f"coordinator {SERVER!r} drives the run and keeps its role)."
        )
    channel = channel if channel is not None else Channel()
    parties = []
    for k, data in enumerate(clients):
        client = ROLES.get(roles.get(data.name, "imputation-client"))(
            data,
            test=tests[k] if tests is not None else None,
            privacy=privacy(data.name) if privacy is not None else None,
            training=training.for_client(k, seed) if training is not None else None,
        )
        if not isinstance(client, ImputationClient):
            raise ConfigError(
                f"client {data.name!r} holds rows, so its role must be an ImputationClient; "
                f"found {type(client).__name__}."
            )
        client.connect(channel)
        parties.append(client)
    terms = _release_terms(parties, features)
    coordinator = Coordinator()
    coordinator.connect(channel)
    server = make_aggregation_server(aggregator, roles.get(AGGREGATOR, "aggregation-server"))
    server.connect(channel)
    for party in [*parties, server]:
        party.driver = coordinator.name  # its requests come from the coordinator only
    federation = ImputationFederation(
        own=coordinator,
        names=[client.name for client in parties],
        features=features,
        channel=channel,
        session=secrets.token_hex(8),
        release_terms=terms,
    )
    if isinstance(aggregator, SealingScheme):  # (split: repeated for the type checker)
        # Each party makes its own halves (its keys never leave it); keys meet by messages.
        for client in parties:
            client.install(aggregator.scheme, aggregator.sender(), None)
        coordinator.install(aggregator.scheme, None, aggregator.receiver())
        server.install(aggregator.scheme, aggregator.adder())
        federation.scheme = aggregator.scheme
        federation.set_up_keys()
    return federation


def federated_statistics(
    clients: Sequence[ClientData],
    *,
    aggregator: SumBackend | None = None,
    channel: Channel | None = None,
    privacy: StatisticsPrivacyFactory | None = None,
    roles: Mapping[str, str] | None = None,
    tag: str = "statistics",
) -> FederatedStatistics:
    """Global standardisation and pairwise correlations of ``clients`` from their summed
    statistics, through a federation of them built for the purpose (see
    :func:`build_imputation_federation`; ``privacy`` makes each client's own mechanism)."""
    federation = build_imputation_federation(
        clients, aggregator=aggregator, channel=channel, privacy=privacy, roles=roles
    )
    return collect_statistics(federation, tag=tag)


def in_process_clients(channel: Channel) -> list[ImputationClient]:
    """The imputation clients attached to ``channel``, in order: what the composition root of
    an in-process run (a local baseline, ``--save-imputed``'s tables, tests) reaches them by.
    No party's own program reaches another party this way, and the clients score themselves
    by messages."""
    return [party for party in channel.parties.values() if isinstance(party, ImputationClient)]
