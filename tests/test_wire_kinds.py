"""Every message kind of the messages module, through the wire codec's per-class compiled codecs:
each round-trips canonically, and each refuses a truncated buffer, a tensor whose dtype code is
changed and a non-finite floating-point tensor (the codec's fast paths weaken none of this)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor

from secure_vfl.errors import IntegrityError, ProtocolError
from secure_vfl.federation import messages, wire
from secure_vfl.federation.messages import AGGREGATOR, Message
from secure_vfl.federation.wire import decode, encode

HEADER: dict[str, Any] = {
    "sender": "party-1",
    "receiver": AGGREGATOR,
    "round": 4,
    "batch_id": 2,
    "session": "s-ß",
}
DTYPE_CODES = {
    torch.float32: 1,
    torch.float64: 2,
    torch.int64: 3,
    torch.int32: 4,
    torch.uint64: 5,
    torch.uint8: 6,
    torch.bool: 7,
}


def samples() -> list[Message]:
    """One valid message of every kind the messages module registers."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 4])
    selection = torch.rand(2, 3, 2, generator=generator) > 0.5
    parties = ("party-0", "party-1")
    counts = torch.tensor([[0, 1, 2], [2, 1, 0]])
    return [
        messages.RepresentationMessage(
            **HEADER,
            positions=positions,
            representation=torch.randn(3, 4, generator=generator),
            ticket=b"\x05" * 32,
        ),
        messages.GradientMessage(
            **HEADER, positions=positions, gradient=torch.randn(3, 4, generator=generator), tag="t"
        ),
        messages.SumMessage(
            **HEADER, sums=torch.randn(2, 3, 4, generator=generator), counts=counts
        ),
        messages.PredictionMessage(
            **HEADER, positions=positions, predictions=torch.tensor([2, 0, 1])
        ),
        messages.ErrorMessage(**HEADER, error="no such rows"),
        messages.DeploymentMessage(**HEADER, topic="ids", body='{"ids": ["a", "b"]}'),
        messages.LatentMessage(
            **HEADER,
            positions=positions,
            samples=torch.randn(3, 2, 4, generator=generator),
            split="train",
            rows=torch.tensor([2, 6, 5]),
            backward=True,
        ),
        messages.LikelihoodMessage(
            **HEADER, positions=positions, log_likelihood=-torch.rand(3, 2, generator=generator)
        ),
        messages.LatentGradientMessage(
            **HEADER, positions=positions, gradient=torch.randn(3, 2, 4, generator=generator)
        ),
        messages.RepresentRequest(
            **HEADER,
            split="train",
            rows=torch.tensor([5, 1, 7]),
            positions=positions,
            reply_to=AGGREGATOR,
            tag="t",
            model="m",
            ticket=bytes(range(32)),
        ),
        messages.SumRequest(
            **HEADER, selection=selection, parties=parties, deliver_to="party-0", tag="t"
        ),
        messages.UpdateRequest(**HEADER, tag="t", heads=True),
        messages.ScoreRequest(
            **HEADER, std=torch.tensor([1.0, 0.5], dtype=torch.float64), seed=3, fraction=0.2
        ),
        messages.ScoreMessage(**HEADER, sse=1.5, count=4),
        messages.AbortRequest(**HEADER),
        messages.HeadTask(
            **HEADER,
            rows=torch.tensor([9, 8, 7]),
            weights=torch.rand(2, 3, generator=generator),
            normaliser=1.5,
            selection=selection,
            present=torch.ones(3, 2, dtype=torch.bool),
            parties=parties,
            tag="t",
            head="h",
        ),
        messages.HeadTask(
            **HEADER,
            rows=torch.tensor([9, 8, 7]),
            weights=torch.rand(3, 3, generator=generator),
            normaliser=1.5,
            selection=torch.tensor([[True, False], [False, True], [True, True]])
            .unsqueeze(1)
            .expand(3, 3, 2)
            .contiguous(),
            present=torch.ones(3, 2, dtype=torch.bool),
            parties=parties,
            tag="p",
            parts=torch.eye(2, dtype=torch.bool).unsqueeze(1).expand(2, 3, 2).contiguous(),
        ),
        messages.PredictTask(**HEADER, positions=positions, tag="t"),
        messages.LossMessage(**HEADER, loss=0.25, tag="t"),
        messages.KeyRequest(**HEADER, scheme="masks", contributors=parties, receivers=("party-2",)),
        messages.PublicKeyMessage(**HEADER, scheme="masks", role="sender", key=b"\x01\x02"),
        messages.TicketKeyMessage(**HEADER, key=bytes(range(32))),
        messages.SealRequest(
            **HEADER,
            selection=selection,
            parties=parties,
            deliver_to="party-0",
            tag="t",
            ticket=b"\x07" * 32,
        ),
        messages.SealedMessage(
            **HEADER,
            scheme="masks",
            deliver_to="party-0",
            tag="t",
            width=2,
            payload=(b"ab", b""),
            ticket=b"\x07" * 32,
        ),
        messages.SealedSumMessage(
            **HEADER,
            scheme="masks",
            tag="t",
            width=1,
            selection=selection,
            parties=parties,
            payload=(b"xyz",),
        ),
        messages.ComputeRequest(
            **HEADER,
            computation="deviations",
            arguments=torch.tensor([0.5, -1.25], dtype=torch.float64),
            tag="t",
            ticket=b"\x01" * 32,
        ),
        messages.ParametersMessage(
            **HEADER, parameters=torch.randn(5, generator=generator), tag="global"
        ),
        messages.GlobalStatisticsMessage(
            **HEADER,
            mean=torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64),
            std=torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64),
            neighbours=torch.tensor([[1, 2], [0, 2], [0, 1]]),
            weights=torch.tensor([[1.0, 0.5], [0.25, 0.0], [0.75, 1.0]]),
            mask=torch.tensor([[True, True], [True, False], [True, True]]),
            constant=torch.tensor([False, True, False]),
        ),
    ]


SAMPLES = samples()


def encoded_size(value: object) -> int:
    """Bytes of ``value`` by the documented layout (an optional field adds its presence byte:
    see :func:`presence_bytes`)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return 8 + len(value.encode("utf-8"))
    if isinstance(value, bytes):
        return 8 + len(value)
    if isinstance(value, bool):
        return 1
    if isinstance(value, int | float):
        return 8
    if isinstance(value, tuple):
        return 8 + sum(map(encoded_size, value))
    assert isinstance(value, Tensor)
    return 2 + 8 * value.dim() + 8 + value.numel() * value.element_size()


def field_offsets(message: Message) -> dict[str, int]:
    """Where each field's bytes start in ``encode(message)``, walking the documented layout:
    an oracle independent of the codec's compiled schema."""
    names = [*wire.HEADER_FIELDS]
    names += [f.name for f in dataclasses.fields(message) if f.name not in wire.HEADER_FIELDS]
    offset = 4 + 2 + encoded_size(message.kind)
    offsets = {}
    for name in names:
        offset += presence_bytes(message, name)
        offsets[name] = offset  # where the value itself starts
        offset += encoded_size(getattr(message, name))
    assert offset == len(encode(message))
    return offsets


def presence_bytes(message: Message, name: str) -> int:
    """1 for a field declared ``X | None`` (its presence byte), else 0."""
    declared = {f.name: str(f.type) for f in dataclasses.fields(message)}
    return 1 if declared.get(name, "").endswith("| None") else 0


def tensor_fields(message: Message) -> list[str]:
    return [
        f.name for f in dataclasses.fields(message) if isinstance(getattr(message, f.name), Tensor)
    ]


def test_every_kind_of_the_messages_module_has_a_sample() -> None:
    registered = {
        cls.kind
        for cls in vars(messages).values()
        if isinstance(cls, type) and issubclass(cls, Message) and "kind" in vars(cls)
    } - {Message.kind}
    assert {message.kind for message in SAMPLES} == registered


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.kind)
def test_every_kind_round_trips_canonically(message: Message) -> None:
    data = encode(message)
    decoded = decode(data)
    assert type(decoded) is type(message)
    assert encode(decoded) == data
    for name in tensor_fields(message):
        assert torch.equal(getattr(decoded, name), getattr(message, name)), name


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.kind)
def test_every_kind_refuses_every_truncation(message: Message) -> None:
    data = encode(message)
    for cut in range(len(data)):
        with pytest.raises(ProtocolError, match="truncated"):
            decode(data[:cut])


WITH_TENSORS = [m for m in SAMPLES if tensor_fields(m)]
WITH_FLOATS = [
    m
    for m in SAMPLES
    if any(getattr(m, n).is_floating_point() and getattr(m, n).numel() for n in tensor_fields(m))
]


@pytest.mark.parametrize("message", WITH_TENSORS, ids=lambda m: m.kind)
def test_every_kind_refuses_a_changed_dtype_code(message: Message) -> None:
    data = encode(message)
    offsets = field_offsets(message)
    for name in tensor_fields(message):
        at = offsets[name]
        assert data[at] == DTYPE_CODES[getattr(message, name).dtype]
        for code in [*range(9), 255]:
            if code != data[at]:
                # an unknown code, or another dtype's: its element count (bool: its values)
                # does not match the bytes, or the message's validate refuses the dtype; each
                # names the field
                with pytest.raises(ProtocolError, match=name) as refused:
                    decode(data[:at] + bytes([code]) + data[at + 1 :])
                assert refused.value.__cause__ is None  # refused, not a crash turned into one


@pytest.mark.parametrize("message", WITH_FLOATS, ids=lambda m: m.kind)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_every_kind_refuses_a_non_finite_tensor(message: Message, bad: float) -> None:
    poisoned_fields = 0
    for name in tensor_fields(message):
        tensor = getattr(message, name)
        if tensor.is_floating_point() and tensor.numel():
            poisoned = tensor.clone()
            poisoned.view(-1)[-1] = bad
            data = encode(dataclasses.replace(message, **{name: poisoned}))
            with pytest.raises(IntegrityError, match=f"{message.kind}.{name}: finite values"):
                decode(data)
            poisoned_fields += 1
    assert poisoned_fields  # WITH_FLOATS: each has one


def test_the_kinds_with_tensors_cover_the_wire_dtypes() -> None:
    """The two tests above leave out kinds without (float) tensors; those left cover every
    floating-point dtype the wire allows."""
    floats = {
        getattr(m, n).dtype
        for m in WITH_FLOATS
        for n in tensor_fields(m)
        if getattr(m, n).is_floating_point()
    }
    assert floats == {torch.float32, torch.float64} and len(WITH_FLOATS) >= 8
