"""What the homomorphic-encryption backends share: a metered ``combine`` around their own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from torch import Tensor

from secure_vfl.federation.aggregator import AggregationCost
from secure_vfl.federation.messages import AGGREGATOR, RepresentationMessage, SumMessage

C = TypeVar("C")


class CiphertextAggregator(Generic[C]):
    """An ``Aggregator`` whose parties send ciphertexts of type ``C``.

    Subclasses implement :meth:`_combine` (which records ``last_ciphertexts``, what reached the
    aggregator from each party, and ``last_sum``, what the receiver got) and :meth:`_wire_size`;
    :meth:`combine` times each call and counts those ciphertexts' bytes in ``cost``.
    """

    cost: AggregationCost
    last_ciphertexts: dict[str, list[C]]
    last_sum: list[C]

    def combine(
        self,
        contributions: Sequence[RepresentationMessage],
        selection: Tensor,
        *,
        parties: Sequence[str],
        receiver: str,
        round: int,
        batch_id: int,
        tag: str = "",
    ) -> SumMessage:
        """See :meth:`_combine`; the call is timed and its wire bytes counted in ``cost``."""
        with self.cost.timed():
            result = self._combine(
                contributions,
                selection,
                parties=parties,
                receiver=receiver,
                round=round,
                batch_id=batch_id,
                tag=tag,
            )
        for sender, sent in self.last_ciphertexts.items():
            self.cost.add_bytes(sender, tag, sum(self._wire_size(c) for c in sent))
        self.cost.add_bytes(AGGREGATOR, tag, sum(self._wire_size(c) for c in self.last_sum))
        return result

    def _combine(
        self,
        contributions: Sequence[RepresentationMessage],
        selection: Tensor,
        *,
        parties: Sequence[str],
        receiver: str,
        round: int,
        batch_id: int,
        tag: str,
    ) -> SumMessage:
        raise NotImplementedError

    def _wire_size(self, ciphertext: C) -> int:
        """Bytes of one ciphertext on the wire."""
        raise NotImplementedError
