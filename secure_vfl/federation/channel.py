"""Point-to-point delivery: a stack of channel layers in front of a transport.

A layer sees every message on its way and may record it, account for it or transform it (DP noise
on gradients or embeddings, sparsification, an attack's tampering). Layers never reach into a
party; they only see what crosses the boundary.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Protocol, TypeVar

from secure_vfl.federation.messages import AGGREGATOR, Message, check_header, message_bytes

M = TypeVar("M", bound=Message)


class ChannelLayer(Protocol):
    """One transformation of messages in transit."""

    def on_message(self, message: M) -> M:
        """Return the message to pass on (the same object, or a transformed copy)."""
        ...


class Transport(Protocol):
    """Moves a message to its receiver and returns it as received."""

    def deliver(self, message: M) -> M:
        """Deliver ``message``; the receiver validates what arrives."""
        ...


class InProcessTransport:
    """All parties in one process: delivery is a hand-over, validated on receipt."""

    def deliver(self, message: M) -> M:
        message.validate()
        return message


class Channel:
    """The path every message between parties takes: layers in order, then the transport."""

    def __init__(
        self, layers: Sequence[ChannelLayer] = (), transport: Transport | None = None
    ) -> None:
        self.layers = list(layers)
        self.transport: Transport = transport if transport is not None else InProcessTransport()
        self.layer_seconds: defaultdict[str, float] = defaultdict(float)

    def send(self, message: M) -> M:
        """Pass ``message`` through every layer and deliver it; return what the receiver gets.

        ``layer_seconds`` accumulates the time each layer class spends (e.g. DP noise).
        """
        for layer in self.layers:
            start = time.perf_counter()
            message = layer.on_message(message)
            self.layer_seconds[type(layer).__name__] += time.perf_counter() - start
        return self.transport.deliver(message)

    def receive(
        self, message: M, *, sender: str | None = None, receiver: str, round: int, batch_id: int
    ) -> M:
        """Send ``message`` and check on arrival that it is the one the receiver waits for."""
        delivered = self.send(message)
        check_header(delivered, sender=sender, receiver=receiver, round=round, batch_id=batch_id)
        return delivered


class RecordingLayer:
    """Keeps every message that passes, in order (tests, byte accounting, curious observers)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def on_message(self, message: M) -> M:
        self.messages.append(message)
        return message

    def kinds(self) -> list[str]:
        """The kinds of the recorded messages, in order."""
        return [m.kind for m in self.messages]


class TrafficMeter:
    """Counts the payload bytes of every message between parties, by sender and phase.

    Messages to or from the aggregator are left out: the aggregation protocol's wire format
    (masked ring elements, ciphertexts) is the aggregator's to count (``Aggregator.cost``).
    """

    def __init__(self) -> None:
        self.bytes: Counter[tuple[str, str]] = Counter()

    def on_message(self, message: M) -> M:
        if AGGREGATOR not in (message.sender, message.receiver):
            phase = getattr(message, "phase", "train")
            self.bytes[(message.sender, phase)] += message_bytes(message)
        return message
