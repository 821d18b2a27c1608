"""The contract every :class:`Aggregator` backend inherits: its sums equal the plain oracle's.

Subclass :class:`AggregatorContract` as ``Test...`` and implement :meth:`make_aggregator` (and
:meth:`step` when the backend rounds). The oracle is a float64 einsum of the same float32 inputs;
the allowed error is the backend's own step plus float32 accumulation error, which bounds even
the plain backend's float32 einsum.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from secure_vfl.errors import ProtocolError
from secure_vfl.federation.aggregator import Aggregator, PlainAggregator, SealingScheme
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import (
    AGGREGATOR,
    KeyRequest,
    RepresentationMessage,
    SealRequest,
    SumMessage,
    SumRequest,
    party_name,
)
from secure_vfl.federation.parties import AggregationServer, SecureSumParty

PARTIES = [party_name(k) for k in range(4)]
RECEIVER = party_name(0)


def representations(
    present: Tensor, width: int, generator: torch.Generator, *, round: int, batch_id: int
) -> list[RepresentationMessage]:
    """One message per party with any present row (``present`` (B, K)), normal values * 3."""
    messages = []
    for k, name in enumerate(PARTIES):
        positions = torch.nonzero(present[:, k]).flatten()
        if positions.numel() == 0:
            continue
        values = 3.0 * torch.randn(positions.numel(), width, generator=generator)
        messages.append(
            RepresentationMessage(
                sender=name,
                receiver=AGGREGATOR,
                round=round,
                batch_id=batch_id,
                positions=positions,
                representation=values,
            )
        )
    return messages


def releasable_selection(present: Tensor, tasks: int, generator: torch.Generator) -> Tensor:
    """A random (T, B, K) selection of present parties whose sums have 0 or >= 2 contributors
    besides the receiver (party 0)."""
    selection = torch.rand((tasks, *present.shape), generator=generator) < 0.6
    selection &= present.unsqueeze(0)
    selection[selection[..., 1:].sum(dim=2) == 1] = False
    return selection


def oracle(messages: list[RepresentationMessage], selection: Tensor) -> tuple[Tensor, Tensor]:
    """Float64 sums of the selected representations and the sums of their magnitudes."""
    _, batch, parties = selection.shape
    width = messages[0].representation.shape[1]
    dense = torch.zeros(parties, batch, width, dtype=torch.float64)
    for message in messages:
        dense[PARTIES.index(message.sender), message.positions] = message.representation.double()
    chosen = selection.double()
    return (
        torch.einsum("tbk,kbd->tbd", chosen, dense),
        torch.einsum("tbk,kbd->tbd", chosen, dense.abs()),
    )


def full_batch(
    seed: int, *, batch: int = 16, width: int = 8, tasks: int = 2, round: int = 0, batch_id: int = 0
) -> tuple[list[RepresentationMessage], Tensor]:
    """Representations from all four parties and a selection with 0 or >= 2 per sum."""
    generator = torch.Generator().manual_seed(seed)
    present = torch.ones(batch, 4, dtype=torch.bool)
    messages = representations(present, width, generator, round=round, batch_id=batch_id)
    return messages, releasable_selection(present, tasks, generator)


def vector_sum(
    aggregator: Aggregator,
    vectors: dict[str, Tensor],
    *,
    channel: Channel | None = None,
    receiver: str = "server",
    round: int = 0,
) -> Tensor:
    """The sum of one flat vector per contributor as ``receiver`` gets it: each contributor is a
    :class:`SecureSumParty` that contributes its vector as one row, an aggregation server adds
    (``aggregator`` split into its halves, keys meeting by messages, when it is a
    :class:`SealingScheme`)."""
    channel = channel if channel is not None else Channel()
    contributors = [SecureSumParty(name) for name in vectors]
    owner = SecureSumParty(receiver)
    split = isinstance(aggregator, SealingScheme)
    server = AggregationServer(PlainAggregator() if split else aggregator)
    for party in (*contributors, owner, server):
        party.connect(channel)
    names = tuple(vectors)
    header = {"sender": receiver, "round": round, "batch_id": 0}
    if isinstance(aggregator, SealingScheme):
        for party in contributors:
            party.install(aggregator.scheme, aggregator.sender(), None)
        owner.install(aggregator.scheme, None, aggregator.receiver())
        server.install(aggregator.scheme, aggregator.adder())
        for name in (*names, receiver):
            owner.send(
                KeyRequest(
                    **header,
                    receiver=name,
                    scheme=aggregator.scheme,
                    contributors=names,
                    receivers=(receiver,),
                )
            )
    for party in contributors:
        party.contribute(
            RepresentationMessage(
                sender=party.name,
                receiver=AGGREGATOR,
                round=round,
                batch_id=0,
                positions=torch.zeros(1, dtype=torch.int64),
                tag="vectors",
                representation=vectors[party.name].reshape(1, -1),
            )
        )
    plan = {
        "selection": torch.ones(1, 1, len(names), dtype=torch.bool),
        "parties": names,
        "deliver_to": receiver,
        "tag": "vectors",
        "source_tag": "vectors",
    }
    for name in names if split else ():
        owner.send(SealRequest(**header, receiver=name, **plan))  # type: ignore[arg-type]
    owner.send(SumRequest(**header, receiver=AGGREGATOR, **plan))  # type: ignore[arg-type]
    summed = owner.take("sum", sender=AGGREGATOR, round=round, batch_id=0, tag="vectors")
    assert isinstance(summed, SumMessage)
    return summed.sums[0, 0]


def combine(
    aggregator: Aggregator,
    messages: list[RepresentationMessage],
    selection: Tensor,
    *,
    round: int = 0,
    batch_id: int = 0,
    tag: str = "",
) -> Tensor:
    """The sums ``aggregator`` delivers to :data:`RECEIVER` for ``selection``."""
    return aggregator.combine(
        messages,
        selection,
        parties=PARTIES,
        receiver=RECEIVER,
        round=round,
        batch_id=batch_id,
        tag=tag,
    ).sums


class AggregatorContract:
    """Behaviour every aggregation backend shares, checked against the plain oracle."""

    def make_aggregator(self) -> Aggregator:
        """A fresh backend under test."""
        raise NotImplementedError

    def step(self, parties: int) -> float:
        """The backend's rounding bound on a sum of ``parties`` values (0 for exact backends)."""
        return 0.0

    def assert_close_to_oracle(
        self, sums: Tensor, messages: list[RepresentationMessage], selection: Tensor
    ) -> None:
        expected, magnitude = oracle(messages, selection)
        bound = self.step(selection.shape[2]) + 2.0**-23 * selection.shape[2] * magnitude
        assert sums.dtype == torch.float32
        error = (sums.double() - expected).abs()
        assert bool((error <= bound).all()), f"largest error {float((error - bound).max())}"

    def test_random_selections_sum_like_the_plain_oracle(self) -> None:
        generator = torch.Generator().manual_seed(11)
        aggregator = self.make_aggregator()
        for batch_id in range(3):
            present = torch.rand(32, 4, generator=generator) < 0.8
            messages = representations(present, 8, generator, round=5, batch_id=batch_id)
            selection = releasable_selection(present, 3, generator)
            result = aggregator.combine(
                messages, selection, parties=PARTIES, receiver=RECEIVER, round=5, batch_id=batch_id
            )
            self.assert_close_to_oracle(result.sums, messages, selection)
            assert torch.equal(result.counts, selection.sum(dim=2))
            assert (result.receiver, result.round, result.batch_id) == (RECEIVER, 5, batch_id)
            result.validate()

    def test_an_absent_party_is_left_out_of_every_sum(self) -> None:
        generator = torch.Generator().manual_seed(12)
        present = torch.rand(24, 4, generator=generator) < 0.9
        present[:, 2] = False  # party-2 sends nothing this batch (a missing block)
        messages = representations(present, 6, generator, round=1, batch_id=0)
        assert party_name(2) not in {m.sender for m in messages}
        selection = releasable_selection(present, 4, generator)
        result = self.make_aggregator().combine(
            messages, selection, parties=PARTIES, receiver=RECEIVER, round=1, batch_id=0
        )
        self.assert_close_to_oracle(result.sums, messages, selection)
        nobody = selection.sum(dim=2) == 0
        assert bool((result.sums[nobody] == 0).all())

    def test_whole_vectors_are_summed_through_the_parties_and_the_server(self) -> None:
        generator = torch.Generator().manual_seed(13)
        vectors = {name: torch.randn(50, generator=generator) for name in PARTIES[:3]}
        total = vector_sum(self.make_aggregator(), vectors, round=2)
        expected = sum(v.double() for v in vectors.values())
        magnitude = sum(v.double().abs() for v in vectors.values())
        assert isinstance(expected, Tensor) and isinstance(magnitude, Tensor)
        bound = self.step(3) + 2.0**-23 * 3 * magnitude
        assert bool(((total.double() - expected).abs() <= bound).all())

    def test_a_selection_of_a_representation_never_sent_is_refused(self) -> None:
        generator = torch.Generator().manual_seed(14)
        present = torch.ones(8, 4, dtype=torch.bool)
        present[3, 1] = False
        messages = representations(present, 4, generator, round=0, batch_id=0)
        selection = torch.zeros(1, 8, 4, dtype=torch.bool)
        selection[0, 3, :2] = True
        with pytest.raises(ProtocolError, match="did not send"):
            self.make_aggregator().combine(
                messages, selection, parties=PARTIES, receiver=RECEIVER, round=0, batch_id=0
            )


class SecureAggregatorContract(AggregatorContract):
    """What every *secure* backend adds: refusals that leave no trace, and fresh contexts."""

    def untouched(self, aggregator: Aggregator) -> bool:
        """Whether ``aggregator`` holds no keys, ciphertexts or masks yet (backend-specific)."""
        raise NotImplementedError

    def magnitude_limit(self) -> float:
        """The largest |value| the backend accepts (its fixed-point or encoding range)."""
        raise NotImplementedError

    def test_values_beyond_the_range_are_refused_and_spend_nothing(self) -> None:
        messages, selection = full_batch(8)
        aggregator = self.make_aggregator()
        for bad in (-1.01 * self.magnitude_limit(), float("nan")):
            values = messages[1].representation.clone()
            values[0, 0] = bad
            tampered = [*messages]
            tampered[1] = dataclasses.replace(messages[1], representation=values)
            with pytest.raises(ProtocolError):
                combine(aggregator, tampered, selection)
            assert self.untouched(aggregator)
        result = combine(aggregator, messages, selection)  # nothing was spent by the refusals
        self.assert_close_to_oracle(result, messages, selection)

    def test_a_sum_over_a_single_contributor_is_refused_and_changes_nothing(self) -> None:
        messages, selection = full_batch(4)
        aggregator = self.make_aggregator()
        lonely = selection.clone()
        lonely[0, 5] = False
        lonely[0, 5, 2] = True
        with pytest.raises(ProtocolError, match=r"single party.*task 0, row 5, party party-2"):
            combine(aggregator, messages, lonely)
        assert self.untouched(aggregator)
        result = combine(aggregator, messages, selection)  # the same context is still fresh
        self.assert_close_to_oracle(result, messages, selection)

    def test_the_receivers_own_term_does_not_count_as_a_second_contributor(self) -> None:
        messages, selection = full_batch(4)
        aggregator = self.make_aggregator()
        pair = selection.clone()
        pair[0, 3] = False
        pair[0, 3, 0] = True  # the receiver's own block ...
        pair[0, 3, 1] = True  # ... and one other: the receiver would learn party-1's term
        with pytest.raises(ProtocolError, match=r"to party-0.*row 3, party party-1"):
            combine(aggregator, messages, pair)
        assert self.untouched(aggregator)
        own = selection.clone()
        own[0, 3] = False
        own[0, 3, 0] = True  # the receiver's own term alone reveals nothing new
        self.assert_close_to_oracle(combine(aggregator, messages, own), messages, own)

    def test_a_sum_over_nobody_is_zero(self) -> None:
        messages, _ = full_batch(5)
        nobody = torch.zeros(1, 16, 4, dtype=torch.bool)
        assert bool((combine(self.make_aggregator(), messages, nobody) == 0).all())

    def test_a_replayed_context_is_refused_and_another_tag_is_fresh(self) -> None:
        messages, selection = full_batch(6, round=3, batch_id=7)
        aggregator = self.make_aggregator()
        first = combine(aggregator, messages, selection, round=3, batch_id=7, tag="train")
        with pytest.raises(ProtocolError, match=r"round 3, batch 7, tag 'train' was already"):
            combine(aggregator, messages, selection, round=3, batch_id=7, tag="train")
        again = combine(aggregator, messages, selection, round=3, batch_id=7, tag="predict/x")
        self.assert_close_to_oracle(first, messages, selection)
        self.assert_close_to_oracle(again, messages, selection)

    def test_a_message_replayed_from_another_round_or_batch_is_refused(self) -> None:
        messages, selection = full_batch(7, round=3, batch_id=7)
        aggregator = self.make_aggregator()
        with pytest.raises(ProtocolError, match=r"round 4, batch 7 expected, found .* round 3"):
            combine(aggregator, messages, selection, round=4, batch_id=7)
        with pytest.raises(ProtocolError, match=r"batch 8 expected, found .* batch 7"):
            combine(aggregator, messages, selection, round=3, batch_id=8)
        assert self.untouched(aggregator)
