"""Party roles. Each party owns its data, its model and its optimiser; nothing outside reads them.

A :class:`DataParty` turns its rows of a batch into representations and, later, starts its
backward pass from the gradient messages it receives (``representation.backward(grad)``): the
tensor it sent was detached, so no autograd graph crosses the boundary. A :class:`HeadParty`
holds labels and a fusion head; it turns fused inputs into a loss and into the gradient messages
owed to each contributing party.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from secure_vfl.errors import ProtocolError
from secure_vfl.federation.messages import GradientMessage, RepresentationMessage


class DataParty:
    """A feature block and the bottom (representation) model that reads it."""

    def __init__(
        self,
        name: str,
        blocks: Mapping[str, Tensor],
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.name = name
        self._blocks = dict(blocks)
        self.model = model
        self.optimizer = optimizer
        self._pending: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}

    def represent(
        self,
        split: str,
        rows: Tensor,
        positions: Tensor,
        *,
        receiver: str,
        round: int,
        batch_id: int,
        train: bool,
        tag: str = "",
    ) -> RepresentationMessage:
        """Representations of ``rows`` of this party's ``split`` block, detached for sending."""
        x = self._blocks[split][rows]
        if train:
            self.model.train()
            output = self.model(x)
            self._pending[(round, tag)] = (output, positions)
            sent = output.detach()
        else:
            self.model.eval()
            with torch.no_grad():
                sent = self.model(x)
        return RepresentationMessage(
            sender=self.name,
            receiver=receiver,
            round=round,
            batch_id=batch_id,
            positions=positions,
            tag=tag,
            phase="train" if train else "predict",
            representation=sent,
        )

    def backward(self, gradients: Sequence[GradientMessage], *, round: int, tag: str = "") -> None:
        """Sum the gradients received for ``round`` and backpropagate them into the bottom model."""
        try:
            output, positions = self._pending.pop((round, tag))
        except KeyError:
            raise ProtocolError(
                f"{self.name}: gradient for round {round} (tag {tag!r}) "
                "but no pending forward pass."
            ) from None
        total = torch.zeros_like(output)
        for message in gradients:
            if message.receiver != self.name or message.round != round or message.tag != tag:
                raise ProtocolError(
                    f"{self.name}: gradient addressed to {message.receiver} for round "
                    f"{message.round} (tag {message.tag!r}) refused."
                )
            if not torch.equal(message.positions, positions):
                raise ProtocolError(
                    f"{self.name}: gradient rows do not match the {positions.numel()} rows sent."
                )
            total += message.gradient
        output.backward(total)

    def discard_pending(self) -> None:
        """Forget forward passes whose gradients will not come (e.g. a dropped party)."""
        self._pending.clear()

    def step(self) -> None:
        """Apply and clear the accumulated gradients."""
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


class HeadParty:
    """Labels and a fusion head (LASER's g_k, a split network's top model)."""

    def __init__(
        self,
        name: str,
        labels: Mapping[str, Tensor],
        head: nn.Module,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.name = name
        self._labels = dict(labels)
        self.head = head
        self.optimizer = optimizer

    def labels(self, split: str, rows: Tensor) -> Tensor:
        """This party's labels of ``rows``."""
        return self._labels[split][rows]

    def step(self) -> None:
        """Apply and clear the accumulated gradients of the head."""
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def gradient_messages(
    sender: str,
    gradients: Tensor,
    present: Tensor,
    parties: Sequence[str],
    *,
    round: int,
    batch_id: int,
    tag: str = "",
) -> list[GradientMessage]:
    """Split dense (K, B, d) gradients into one message per party for the rows it sent."""
    messages = []
    for k, name in enumerate(parties):
        positions = torch.nonzero(present[:, k]).flatten()
        if positions.numel() == 0:
            continue
        messages.append(
            GradientMessage(
                sender=sender,
                receiver=name,
                round=round,
                batch_id=batch_id,
                positions=positions,
                tag=tag,
                gradient=gradients[k, positions].detach().contiguous(),
            )
        )
    return messages
