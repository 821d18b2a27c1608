"""The wire codec: every message kind round-trips canonically, and every malformed, non-canonical
or oversize byte string is refused with ProtocolError (never another exception type)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import Tensor

from secure_vfl.errors import IntegrityError, NonFiniteError, ProtocolError, RegistryError
from secure_vfl.federation import messages, wire
from secure_vfl.federation.messages import (
    AGGREGATOR,
    SCHEMA_VERSION,
    ComputeRequest,
    ErrorMessage,
    GlobalStatisticsMessage,
    GradientMessage,
    LatentGradientMessage,
    LatentMessage,
    LikelihoodMessage,
    Message,
    ParametersMessage,
    PredictionMessage,
    RepresentationMessage,
    SumMessage,
)
from secure_vfl.federation.wire import (
    MAX_MESSAGE_BYTES,
    WIRE_VERSION,
    decode,
    encode,
    register_message,
)

# ---- test-only message classes -------------------------------------------------------------


@register_message
@dataclass(frozen=True, kw_only=True)
class EveryFieldMessage(Message):
    """One field of every supported type, plain and optional."""

    count: int
    ratio: float
    flag: bool
    label: str
    blob: bytes
    tensor: Tensor
    array: np.ndarray
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    chunks: tuple[bytes, ...]
    mode: Literal["up", "down"]
    maybe_count: int | None = None
    maybe_ratio: float | None = None
    maybe_flag: bool | None = None
    maybe_label: str | None = None
    maybe_blob: bytes | None = None
    maybe_tensor: Tensor | None = None
    maybe_array: np.ndarray | None = None
    maybe_names: tuple[str, ...] | None = None
    maybe_sizes: tuple[int, ...] | None = None
    maybe_chunks: tuple[bytes, ...] | None = None
    maybe_mode: Literal["up", "down"] | None = None
    kind: ClassVar[str] = "test-every-field"


@register_message
@dataclass(frozen=True, kw_only=True)
class TensorMessage(Message):
    tensor: Tensor
    kind: ClassVar[str] = "test-tensor"


@register_message
@dataclass(frozen=True, kw_only=True)
class ArrayMessage(Message):
    array: np.ndarray
    kind: ClassVar[str] = "test-array"


@register_message
@dataclass(frozen=True, kw_only=True)
class ScalarsMessage(Message):
    flag: bool
    ratio: float
    mode: Literal["up", "down"]
    maybe: int | None
    sizes: tuple[int, ...]
    kind: ClassVar[str] = "test-scalars"


@register_message
@dataclass(frozen=True, kw_only=True)
class FragileMessage(Message):
    """Its constructor and validate() fail with exceptions other than ProtocolError."""

    count: int
    kind: ClassVar[str] = "test-fragile"

    def __post_init__(self) -> None:
        if self.count == 13:
            raise ZeroDivisionError("unlucky")

    def validate(self) -> None:
        super().validate()
        if self.count == 7:
            raise ValueError("seven is not allowed")


# ---- a hand-written encoder of the documented layout: an oracle independent of wire.py --------


def text(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else value
    return struct.pack("<Q", len(raw)) + raw


def header(
    kind: str | bytes,
    *,
    magic: bytes = b"SVFL",
    version: int = WIRE_VERSION,
    schema_version: int = SCHEMA_VERSION,
    sender: str | bytes = "party-0",
    receiver: str = AGGREGATOR,
    session: str = "",
    round: int = 0,
    batch_id: int = 0,
) -> bytes:
    return (
        magic
        + struct.pack("<H", version)
        + text(kind)
        + struct.pack("<q", schema_version)
        + text(sender)
        + text(receiver)
        + text(session)
        + struct.pack("<qq", round, batch_id)
    )


def array_block(
    code: int, shape: tuple[int, ...], payload: bytes, nbytes: int | None = None
) -> bytes:
    size = len(payload) if nbytes is None else nbytes
    return (
        struct.pack("<BB", code, len(shape))
        + struct.pack(f"<{len(shape)}Q", *shape)
        + struct.pack("<Q", size)
        + payload
    )


def scalars(
    *, flag: bytes = b"\x01", ratio: float = 0.5, mode: str = "up", maybe: bytes = b"\x00"
) -> bytes:
    return (
        header("test-scalars")
        + flag
        + struct.pack("<d", ratio)
        + text(mode)
        + maybe
        + struct.pack("<Q", 0)
    )


HEADER = {"sender": "party-0", "receiver": AGGREGATOR, "round": 0, "batch_id": 0}


# ---- helpers ---------------------------------------------------------------------------------


def assert_same(decoded: Message, original: Message) -> None:
    assert type(decoded) is type(original)
    for field in dataclasses.fields(original):
        got, want = getattr(decoded, field.name), getattr(original, field.name)
        if isinstance(want, Tensor):
            assert isinstance(got, Tensor), field.name
            assert got.dtype == want.dtype and got.shape == want.shape, field.name
            assert not got.requires_grad
            assert np.array_equal(got.numpy(), want.numpy()), field.name
        elif isinstance(want, np.ndarray):
            assert isinstance(got, np.ndarray), field.name
            assert got.dtype == want.dtype and got.shape == want.shape, field.name
            assert np.array_equal(got, want), field.name
        else:
            assert type(got) is type(want) and got == want, field.name


def assert_round_trip(message: Message) -> bytes:
    data = encode(message)
    decoded = decode(data)
    assert_same(decoded, message)
    assert encode(decoded) == data
    return data


def assert_canonical_or_refused(data: bytes) -> None:
    """What decode accepts re-encodes to exactly the same bytes; anything else is refused."""
    try:
        message = decode(data)
    except ProtocolError as error:
        # decode turns any other exception into ProtocolError("undecodable message: ...")
        # chained from it: a crash of the decoder, which must not count as a refusal
        assert error.__cause__ is None, f"decode crashed: {error!r}"
        return
    assert encode(message) == data


def core_messages() -> list[Message]:
    generator = torch.Generator().manual_seed(0)
    header: dict[str, Any] = {
        "sender": "party-2",
        "receiver": AGGREGATOR,
        "round": 7,
        "batch_id": 3,
        "session": "run-ß-42",
    }
    positions = torch.tensor([0, 3, 4, 9])
    no_rows = torch.empty(0, dtype=torch.int64)
    return [
        RepresentationMessage(
            **header, positions=positions, representation=torch.randn(4, 16, generator=generator)
        ),
        RepresentationMessage(**header, positions=no_rows, representation=torch.empty(0, 16)),
        GradientMessage(
            **header,
            positions=positions,
            gradient=torch.randn(4, 16, generator=generator),
            tag="head-1",
            phase="train",
        ),
        SumMessage(
            **header,
            sums=torch.randn(3, 4, 16, generator=generator),
            counts=torch.randint(0, 4, (3, 4), generator=generator),
        ),
        SumMessage(
            **header, sums=torch.empty(3, 0, 16), counts=torch.empty(3, 0, dtype=torch.int64)
        ),
        PredictionMessage(
            **header, positions=positions, predictions=torch.tensor([1, 0, 9, 2]), phase="predict"
        ),
        ErrorMessage(**header, error="batch 3: no such rows ✗"),
        LatentMessage(
            **header,
            positions=positions,
            samples=torch.randn(4, 5, 8, generator=generator),
            split="train",
            rows=positions + 7,
            backward=True,
        ),
        LikelihoodMessage(
            **header, positions=positions, log_likelihood=-torch.rand(4, 5, generator=generator)
        ),
        LatentGradientMessage(
            **header, positions=positions, gradient=torch.randn(4, 5, 8, generator=generator)
        ),
        ComputeRequest(
            **header,
            computation="deviations",
            arguments=torch.randn(5, generator=generator, dtype=torch.float64),
            tag="statistics",
        ),
        ParametersMessage(**header, parameters=torch.randn(300, generator=generator), tag="best"),
        GlobalStatisticsMessage(
            **header,
            mean=torch.randn(3, generator=generator, dtype=torch.float64),
            std=torch.rand(3, generator=generator, dtype=torch.float64) + 0.5,
            neighbours=torch.tensor([[1, 2], [0, 1], [0, 2]]),
            weights=torch.tensor([[1.0, 0.25], [1.0, 0.0], [0.25, 0.0]]),
            mask=torch.tensor([[True, True], [True, False], [True, False]]),
        ),
        GlobalStatisticsMessage(
            **header,
            mean=torch.zeros(3, dtype=torch.float64),
            std=torch.ones(3, dtype=torch.float64),
        ),
    ]


def every_field_message(**changes: Any) -> EveryFieldMessage:
    values: dict[str, Any] = {
        **HEADER,
        "count": -(2**63),
        "ratio": -0.0,
        "flag": True,
        "label": "ünïcode ✓",
        "blob": b"\x00\xff",
        "tensor": torch.tensor([[True, False, True]]),
        "array": np.array([0, 1, 2**64 - 1], dtype=np.uint64),
        "names": ("a", "", "ß"),
        "sizes": (2**63 - 1, -1, 0),
        "chunks": (b"", b"\x01\x02"),
        "mode": "down",
        "maybe_count": 0,
        "maybe_ratio": 1e-310,
        "maybe_flag": False,
        "maybe_label": "",
        "maybe_blob": b"",
        "maybe_tensor": torch.tensor(3.5, dtype=torch.float64),
        "maybe_array": np.zeros((2, 0, 3), dtype=np.float32),
        "maybe_names": (),
        "maybe_sizes": (5,),
        "maybe_chunks": (b"x",),
        "maybe_mode": "up",
    }
    values.update(changes)
    return EveryFieldMessage(**values)


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("message", core_messages(), ids=lambda m: m.kind)
def test_core_message_round_trips_canonically(message: Message) -> None:
    assert_round_trip(message)


def test_every_concrete_message_class_of_messages_module_is_registered() -> None:
    abstract = {Message, messages.RowsMessage}
    concrete = [
        cls
        for cls in vars(messages).values()
        if isinstance(cls, type) and issubclass(cls, Message) and cls not in abstract
    ]
    assert {cls.kind for cls in concrete} >= {m.kind for m in core_messages()}
    for cls in concrete:
        with pytest.raises(RegistryError, match="already registered"):
            register_message(cls)


def test_every_supported_field_type_round_trips_present_and_absent() -> None:
    assert_round_trip(every_field_message())
    fields = dataclasses.fields(EveryFieldMessage)
    absent = {field.name: None for field in fields if field.name.startswith("maybe_")}
    assert_round_trip(every_field_message(**absent))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([[1.5, -0.0]], dtype=torch.float32),
        torch.tensor([1e300, -1e-300], dtype=torch.float64),
        torch.tensor([-(2**63), 2**63 - 1], dtype=torch.int64),
        torch.tensor([-(2**31), 7], dtype=torch.int32),
        torch.tensor([0, 2**64 - 1], dtype=torch.uint64),
        torch.tensor([0, 255], dtype=torch.uint8),
        torch.tensor([[True], [False]]),
        torch.empty(0, 3, 0),
        torch.tensor(2.0),
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}",
)
def test_every_allowed_dtype_and_shape_round_trips(tensor: Tensor) -> None:
    assert_round_trip(TensorMessage(**HEADER, tensor=tensor))
    assert_round_trip(ArrayMessage(**HEADER, array=tensor.numpy()))


def test_non_contiguous_and_big_endian_inputs_encode_as_their_values() -> None:
    transposed = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    decoded = decode(encode(TensorMessage(**HEADER, tensor=transposed)))
    assert isinstance(decoded, TensorMessage)
    assert torch.equal(decoded.tensor, transposed)
    big_endian = np.arange(4, dtype=">i8")
    decoded_array = decode(encode(ArrayMessage(**HEADER, array=big_endian)))
    assert isinstance(decoded_array, ArrayMessage)
    assert np.array_equal(decoded_array.array, big_endian)
    assert decoded_array.array.dtype == np.int64


def test_layout_is_the_documented_one() -> None:
    message = TensorMessage(
        sender="party-1", receiver="party-3", round=5, batch_id=2, session="s", tensor=torch.ones(2)
    )
    payload = np.ones(2, dtype="<f4").tobytes()
    expected = header(
        "test-tensor", sender="party-1", receiver="party-3", round=5, batch_id=2, session="s"
    ) + array_block(1, (2,), payload)
    assert encode(message) == expected
    assert scalars() == encode(
        ScalarsMessage(**HEADER, flag=True, ratio=0.5, mode="up", maybe=None, sizes=())
    )


def test_decoded_tensors_own_writable_memory() -> None:
    original = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    data = bytearray(encode(TensorMessage(**HEADER, tensor=original)))
    decoded = decode(bytes(data))
    assert isinstance(decoded, TensorMessage)
    received = decode(memoryview(data))
    assert isinstance(received, TensorMessage)
    data[-4:] = b"\x00\x00\x80\x7f"  # the input changes after decoding: the tensor does not
    assert torch.equal(received.tensor, original)
    received.tensor.add_(1.0)  # writable, no warning about a read-only buffer
    assert torch.equal(received.tensor, original + 1)
    assert not received.tensor.requires_grad
    decoded_array = decode(encode(ArrayMessage(**HEADER, array=np.arange(3))))
    assert isinstance(decoded_array, ArrayMessage)
    assert decoded_array.array.flags.writeable and decoded_array.array.flags.owndata


# ---- property-based --------------------------------------------------------------------------

WIRE_DTYPES = ["<f4", "<f8", "<i8", "<i4", "<u8", "u1", "?"]


@st.composite
def wire_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(WIRE_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    elements = (
        st.floats(allow_nan=False, allow_infinity=False, width=8 * dtype.itemsize)
        if dtype.kind == "f"
        else None
    )
    return draw(hnp.arrays(dtype, shape, elements=elements))


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


texts = st.text(max_size=12)
ints = st.integers(-(2**63), 2**63 - 1)
floats = st.floats(allow_nan=False, allow_infinity=False)
blobs = st.binary(max_size=24)
modes = st.sampled_from(["up", "down"])
tensors = wire_arrays().map(lambda array: torch.from_numpy(array.copy()))
tuples_of = lambda items: st.lists(items, max_size=4).map(tuple)  # noqa: E731

every_field_messages = st.builds(
    EveryFieldMessage,
    sender=texts,
    receiver=texts,
    round=st.integers(0, 2**63 - 1),
    batch_id=st.integers(0, 2**63 - 1),
    session=texts,
    count=ints,
    ratio=floats,
    flag=st.booleans(),
    label=texts,
    blob=blobs,
    tensor=tensors,
    array=wire_arrays(),
    names=tuples_of(texts),
    sizes=tuples_of(ints),
    chunks=tuples_of(blobs),
    mode=modes,
    maybe_count=optional(ints),
    maybe_ratio=optional(floats),
    maybe_flag=optional(st.booleans()),
    maybe_label=optional(texts),
    maybe_blob=optional(blobs),
    maybe_tensor=optional(tensors),
    maybe_array=optional(wire_arrays()),
    maybe_names=optional(tuples_of(texts)),
    maybe_sizes=optional(tuples_of(ints)),
    maybe_chunks=optional(tuples_of(blobs)),
    maybe_mode=optional(modes),
)


@settings(derandomize=True, max_examples=100, deadline=None)
@given(message=every_field_messages)
def test_random_messages_round_trip_canonically(message: EveryFieldMessage) -> None:
    assert_round_trip(message)


CORE_ENCODINGS = [encode(message) for message in core_messages()]
encodings = st.sampled_from(CORE_ENCODINGS) | every_field_messages.map(encode)


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    data = draw(encodings)
    how = draw(st.sampled_from(["truncate", "extend", "flip", "overwrite", "tail"]))
    at = draw(st.integers(0, len(data)))
    if how == "truncate":
        return data[:at]
    if how == "extend":
        return data + draw(st.binary(min_size=1, max_size=16))
    if how == "flip":
        flips = draw(st.lists(st.integers(0, 8 * len(data) - 1), min_size=1, max_size=3))
        flipped = bytearray(data)
        for bit in flips:
            flipped[bit // 8] ^= 1 << (bit % 8)
        return bytes(flipped)
    if how == "overwrite":
        patch = draw(st.binary(min_size=1, max_size=9))
        return data[:at] + patch + data[at + len(patch) :]
    return data[:at] + draw(st.binary(max_size=40))


@settings(derandomize=True, max_examples=200, deadline=None)
@given(data=mangled() | st.binary(max_size=64))
def test_decode_of_arbitrary_bytes_is_canonical_or_refused(data: bytes) -> None:
    assert_canonical_or_refused(data)


def test_every_single_byte_change_is_canonical_or_refused() -> None:
    small = RepresentationMessage(
        **HEADER, positions=torch.tensor([1, 4]), representation=torch.ones(2, 1)
    )
    for data in [encode(every_field_message()), encode(small)]:
        for at in range(len(data)):
            changes = [data[at] ^ (1 << bit) for bit in range(8)] + [2, 0xFF]
            for byte in changes:
                assert_canonical_or_refused(data[:at] + bytes([byte]) + data[at + 1 :])


def test_every_truncation_is_refused_as_truncated() -> None:
    for data in [*CORE_ENCODINGS[:3], encode(every_field_message())]:
        for cut in range(len(data)):
            with pytest.raises(ProtocolError, match="truncated"):
                decode(data[:cut])


# ---- one test per refusal --------------------------------------------------------------------


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(ProtocolError, match="found 1 more"):
        decode(CORE_ENCODINGS[0] + b"\x00")


def test_wrong_magic_is_refused() -> None:
    with pytest.raises(ProtocolError, match=r"magic bytes b'SVFL' expected, found b'PK\\x03\\x04'"):
        decode(b"PK\x03\x04" + CORE_ENCODINGS[0][4:])


def test_wrong_wire_version_is_refused() -> None:
    data = header("test-tensor", version=7) + array_block(6, (0,), b"")
    with pytest.raises(ProtocolError, match="wire version 1 expected, found 7"):
        decode(data)


def test_wrong_schema_version_is_refused_before_the_rest_is_parsed() -> None:
    old = SCHEMA_VERSION - 1
    data = header("test-tensor", schema_version=old) + array_block(6, (0,), b"")
    refusal = f"schema version {SCHEMA_VERSION} expected, found {old}"
    with pytest.raises(ProtocolError, match=refusal):
        decode(data)
    with pytest.raises(ProtocolError, match=refusal):
        decode(header("test-tensor", schema_version=old) + b"a layout of another version")


def test_unknown_kind_is_refused_and_quoted_short() -> None:
    with pytest.raises(
        ProtocolError, match=r"expected \(.*protocols\.psi.*\), found 'no-such-kind'"
    ):
        decode(header("no-such-kind"))
    with pytest.raises(ProtocolError, match=r"found 'xxxxx.*\.\.\. \(10002 characters\)\.$"):
        decode(header("x" * 10_000))


@pytest.mark.parametrize("code", [0, 8, 255])
def test_disallowed_dtype_code_is_refused(code: int) -> None:
    with pytest.raises(ProtocolError, match=f"dtype code in .* expected, found {code}"):
        decode(header("test-tensor") + array_block(code, (1,), b"\x00" * 2))


def test_disallowed_dtype_is_not_encoded() -> None:
    with pytest.raises(ProtocolError, match=r"found torch\.float16"):
        encode(TensorMessage(**HEADER, tensor=torch.ones(2, dtype=torch.float16)))
    with pytest.raises(ProtocolError, match="found int16"):
        encode(ArrayMessage(**HEADER, array=np.ones(2, dtype=np.int16)))
    with pytest.raises(ProtocolError, match="found object"):
        encode(ArrayMessage(**HEADER, array=np.array([object()])))


def test_shape_inconsistent_with_byte_count_is_refused() -> None:
    payload = np.zeros(5, dtype="<f4").tobytes()
    with pytest.raises(ProtocolError, match=r"shape \(2, 3\) of float32 takes 24 bytes, found 20"):
        decode(header("test-tensor") + array_block(1, (2, 3), payload))


def test_absurd_dimensions_are_refused_before_allocating() -> None:
    with pytest.raises(ProtocolError, match="takes 4611686018427387904 bytes, found 8"):
        decode(header("test-tensor") + array_block(1, (2**60,), b"\x00" * 8))
    with pytest.raises(ProtocolError, match="truncated"):  # consistent, but not there
        decode(header("test-tensor") + array_block(1, (2**60,), b"\x00" * 8, nbytes=2**62))
    with pytest.raises(ProtocolError, match="at most 2\\*\\*63 - 1 bytes"):
        decode(header("test-tensor") + array_block(1, (0, 2**62), b""))
    with pytest.raises(ProtocolError, match="at most 64 dimensions expected, found 200"):
        decode(header("test-tensor") + struct.pack("<BB", 1, 200))
    with pytest.raises(ProtocolError, match="items of at least 8 bytes"):
        decode(scalars()[:-8] + struct.pack("<Q", 2**60))


@pytest.mark.parametrize("message_kind", ["test-tensor", "test-array"])
@pytest.mark.parametrize(
    ("code", "shape", "payload"),
    [
        (1, (0, 2**40), b""),  # empty, with a side whose array would not fit in memory
        (7, (2**20, 0, 2**20), b""),
        (2, (0,) * wire.MAX_NDIM, b""),
        (6, (1,) * wire.MAX_NDIM, b"\x07"),  # as many dimensions as numpy allows
        (2, (), struct.pack("<d", -0.0)),  # zero-dim; the sign of zero is kept
        (1, (2,), struct.pack("<2I", 0x80000000, 0x00000001)),  # -0.0 and the least subnormal
        (5, (), struct.pack("<Q", 2**64 - 1)),
    ],
    ids=str,
)
def test_edge_arrays_decode_and_encode_to_the_same_bytes(
    message_kind: str, code: int, shape: tuple[int, ...], payload: bytes
) -> None:
    data = header(message_kind) + array_block(code, shape, payload)
    decoded = decode(data)
    assert isinstance(decoded, TensorMessage | ArrayMessage)
    value = decoded.tensor if isinstance(decoded, TensorMessage) else decoded.array
    assert tuple(value.shape) == shape
    assert encode(decoded) == data


@pytest.mark.parametrize(
    ("message_kind", "code", "value"),
    [
        ("test-tensor", 1, np.array([1.0, np.nan], dtype="<f4")),
        ("test-tensor", 2, np.array([np.inf], dtype="<f8")),
        ("test-array", 2, np.array([[0.0, -np.inf]], dtype="<f8")),
    ],
)
def test_non_finite_array_values_are_refused(
    message_kind: str, code: int, value: np.ndarray
) -> None:
    data = header(message_kind) + array_block(code, value.shape, value.tobytes())
    with pytest.raises(IntegrityError, match="finite values expected"):
        decode(data)


def test_non_finite_float_field_is_refused() -> None:
    with pytest.raises(IntegrityError, match="finite float expected, found nan"):
        decode(scalars(ratio=float("nan")))
    with pytest.raises(IntegrityError, match="finite float expected, found inf"):
        encode(
            ScalarsMessage(**HEADER, flag=True, ratio=float("inf"), mode="up", maybe=None, sizes=())
        )


def test_a_non_finite_tensor_is_refused_by_its_receiver() -> None:
    # The sender's encode leaves the scan to the receiver (one pass per tensor, not two).
    data = encode(TensorMessage(**HEADER, tensor=torch.tensor([0.0, float("nan")])))
    with pytest.raises(IntegrityError, match="finite values expected"):
        decode(data)


def test_oversize_message_is_refused_before_parsing() -> None:
    data = CORE_ENCODINGS[0]
    with pytest.raises(ProtocolError, match=f"message of {len(data)} bytes exceeds the limit"):
        decode(data, max_bytes=len(data) - 1)
    assert decode(data, max_bytes=len(data)).kind == "representation"
    junk = bytes(MAX_MESSAGE_BYTES + 1)  # not even the magic is checked
    with pytest.raises(ProtocolError, match="of 67108865 bytes exceeds the limit of 67108864"):
        decode(junk)


def test_oversize_message_is_not_encoded() -> None:
    big = torch.zeros(MAX_MESSAGE_BYTES, dtype=torch.uint8)
    with pytest.raises(ProtocolError, match=r"exceeds the limit of 67108864; .* \(--batch-size\)"):
        encode(TensorMessage(**HEADER, tensor=big))


def test_bool_byte_other_than_0_or_1_is_refused() -> None:
    assert isinstance(decode(scalars(flag=b"\x00")), ScalarsMessage)
    with pytest.raises(ProtocolError, match="bool byte 0 or 1 expected, found 2"):
        decode(scalars(flag=b"\x02"))
    with pytest.raises(ProtocolError, match="bool bytes 0 or 1 expected"):
        decode(header("test-tensor") + array_block(7, (3,), b"\x01\x00\x02"))


def test_presence_byte_other_than_0_or_1_is_refused() -> None:
    present = scalars(maybe=b"\x01" + struct.pack("<q", -5))
    decoded = decode(present)
    assert isinstance(decoded, ScalarsMessage) and decoded.maybe == -5
    with pytest.raises(ProtocolError, match="presence byte 0 or 1 expected, found 255"):
        decode(scalars(maybe=b"\xff" + struct.pack("<q", -5)))


@pytest.mark.parametrize("sender", [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"ok\xe2\x82"], ids=str)
def test_invalid_utf8_is_refused(sender: bytes) -> None:
    data = header("test-tensor", sender=sender) + array_block(6, (0,), b"")
    with pytest.raises(ProtocolError, match=r"test-tensor\.sender: UTF-8 text expected"):
        decode(data)


def test_literal_outside_its_values_is_refused() -> None:
    with pytest.raises(ProtocolError, match=r"one of \('up', 'down'\) expected, found 'sideways'"):
        decode(scalars(mode="sideways"))
    with pytest.raises(ProtocolError, match="found 'sideways'"):
        encode(
            ScalarsMessage(**HEADER, flag=True, ratio=0.0, mode="sideways", maybe=None, sizes=())
        )


def test_message_that_fails_validation_is_refused() -> None:
    unordered = RepresentationMessage(
        **HEADER, positions=torch.tensor([2, 1]), representation=torch.ones(2, 3)
    )
    with pytest.raises(ProtocolError, match="strictly increasing"):
        decode(encode(unordered))
    negative_round = header("test-tensor", round=-1) + array_block(6, (0,), b"")
    with pytest.raises(ProtocolError, match="round and batch id must be >= 0"):
        decode(negative_round)


def test_unexpected_exceptions_while_decoding_become_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="seven is not allowed") as refused:
        decode(encode(FragileMessage(**HEADER, count=7)))
    assert isinstance(refused.value.__cause__, ValueError)
    data = encode(FragileMessage(**HEADER, count=1))[:-8] + struct.pack("<q", 13)
    with pytest.raises(ProtocolError, match="ZeroDivisionError: unlucky") as broken:
        decode(data)
    assert isinstance(broken.value.__cause__, ZeroDivisionError)
    for not_bytes in ("SVFL", None, 12, [1, 2]):
        with pytest.raises(ProtocolError):
            decode(not_bytes)


def test_a_decoded_message_is_built_as_its_constructor_builds_it() -> None:
    """Decoding builds a message without calling its generated ``__init__`` (it only stores
    the fields): the result has exactly the constructor's attributes, and a class whose
    construction does more (a ``__post_init__``, its own ``__init__``) is built by calling it."""
    for message in core_messages():
        decoded = decode(encode(message))
        assert type(decoded) is type(message)
        assert vars(decoded).keys() == vars(message).keys()
        assert encode(decoded) == encode(message)
    with pytest.raises(ProtocolError, match="ZeroDivisionError: unlucky"):
        decode(encode(FragileMessage(**HEADER, count=1))[:-8] + struct.pack("<q", 13))

    @dataclass(frozen=True, kw_only=True)
    class Counted(Message):
        count: int
        kind: ClassVar[str] = "test-counted"

    built = []

    def init(self: Counted, **values: object) -> None:
        built.append(values["count"])
        for name, value in values.items():
            object.__setattr__(self, name, value)

    Counted.__init__ = init  # type: ignore[assignment]
    register_message(Counted)
    assert decode(encode(Counted(**HEADER, count=4))).count == 4
    assert built == [4, 4]  # constructed, then decoded through the constructor


# ---- encode refusals -------------------------------------------------------------------------


def test_tensor_that_requires_grad_is_not_encoded() -> None:
    weights = torch.ones(2, 3, requires_grad=True)
    with pytest.raises(ProtocolError, match="requires grad"):
        encode(TensorMessage(**HEADER, tensor=weights * 2))
    assert_round_trip(TensorMessage(**HEADER, tensor=(weights * 2).detach()))


def test_non_cpu_or_sparse_tensor_is_not_encoded() -> None:
    with pytest.raises(
        ProtocolError, match=r"dense CPU tensor expected, found torch\.strided on meta"
    ):
        encode(TensorMessage(**HEADER, tensor=torch.ones(2, device="meta")))
    with pytest.raises(ProtocolError, match=r"dense CPU tensor expected, found torch\.sparse_coo"):
        encode(TensorMessage(**HEADER, tensor=torch.eye(2).to_sparse()))


def test_field_of_the_wrong_type_is_not_encoded() -> None:
    with pytest.raises(
        ProtocolError, match=r"test-tensor\.tensor: a torch\.Tensor expected, found ndarray"
    ):
        encode(TensorMessage(**HEADER, tensor=np.ones(2)))
    with pytest.raises(ProtocolError, match=r"test-tensor\.round: an int expected, found bool"):
        encode(TensorMessage(**{**HEADER, "round": True}, tensor=torch.ones(1)))
    with pytest.raises(
        ProtocolError, match="64-bit signed integer expected, found 9223372036854775808"
    ):
        encode(TensorMessage(**{**HEADER, "batch_id": 2**63}, tensor=torch.ones(1)))
    with pytest.raises(ProtocolError, match="encodable as UTF-8"):
        encode(TensorMessage(**{**HEADER, "sender": "\udc80"}, tensor=torch.ones(1)))


def test_unregistered_message_class_is_not_encoded() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Unregistered(RepresentationMessage):
        pass

    message = Unregistered(**HEADER, positions=torch.tensor([0]), representation=torch.ones(1, 2))
    with pytest.raises(ProtocolError, match="Unregistered is not registered"):
        encode(message)


# ---- registration ----------------------------------------------------------------------------


def test_registering_a_kind_twice_is_refused() -> None:
    with pytest.raises(RegistryError, match="'representation' is already registered"):
        register_message(RepresentationMessage)

    @dataclass(frozen=True, kw_only=True)
    class Impostor(Message):
        note: str
        kind: ClassVar[str] = "error"

    with pytest.raises(RegistryError, match="'error' is already registered"):
        register_message(Impostor)
    assert type(decode(encode(ErrorMessage(**HEADER, error="x")))) is ErrorMessage


@pytest.mark.parametrize(
    ("annotation", "shown"),
    [
        (list[int], "list[int]"),
        (dict[str, int], "dict[str, int]"),
        (tuple[float, ...], "tuple[float, ...]"),
        (tuple[int, int], "tuple[int, int]"),
        (Literal[1, 2], "Literal[1, 2]"),
        (int | str, "int | str"),
        (complex, "complex"),
    ],
)
def test_registering_an_unsupported_field_type_is_refused(annotation: object, shown: str) -> None:
    namespace = {"__annotations__": {"value": annotation}, "kind": "test-unsupported"}
    cls = dataclass(frozen=True, kw_only=True)(type("Unsupported", (Message,), namespace))
    with pytest.raises(TypeError, match=rf"test-unsupported\.value: .* found .*{re.escape(shown)}"):
        register_message(cls)
    with pytest.raises(ProtocolError, match="found 'test-unsupported'"):  # nothing registered
        decode(header("test-unsupported"))


def test_registering_a_class_without_its_own_kind_or_not_a_message_is_refused() -> None:
    @dataclass(frozen=True, kw_only=True)
    class NoKind(Message):
        note: str

    with pytest.raises(TypeError, match="must declare its own `kind"):
        register_message(NoKind)

    @dataclass(frozen=True)
    class NotAMessage:
        note: str
        kind: ClassVar[str] = "test-not-a-message"

    with pytest.raises(TypeError, match="a Message dataclass expected"):
        register_message(NotAMessage)


def test_wire_module_never_runs_a_general_deserialiser() -> None:
    source = inspect.getsource(wire)
    for forbidden in ("pickle", "torch.load", "eval(", "exec(", "marshal", "allow_pickle"):
        assert forbidden not in source, forbidden


# ---- the compiled codec's own paths ----------------------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([3e38, -3e38, 1.0], dtype=torch.float32),
        torch.tensor([1e300, -1e300], dtype=torch.float64),
    ],
    ids=lambda t: str(t.dtype),
)
def test_finite_values_whose_squares_overflow_are_accepted(tensor: Tensor) -> None:
    # The finiteness scan sums squares; when that overflows the exact elementwise test decides.
    assert_round_trip(TensorMessage(**HEADER, tensor=tensor))
    poisoned = torch.cat([tensor, torch.tensor([float("nan")], dtype=tensor.dtype)])
    with pytest.raises(IntegrityError, match="finite values expected"):
        decode(encode(TensorMessage(**HEADER, tensor=poisoned)))


def test_views_encode_as_their_values() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for view in (base[1:3], base[1:, ::2], base.t()[2:], base.reshape(-1)[5:9]):
        decoded = decode(encode(TensorMessage(**HEADER, tensor=view)))
        assert isinstance(decoded, TensorMessage)
        assert torch.equal(decoded.tensor, view) and decoded.tensor.is_contiguous()


def test_a_bool_tensor_holding_other_bytes_is_not_encoded() -> None:
    forged = torch.tensor([1, 2, 0], dtype=torch.uint8).view(torch.bool)
    with pytest.raises(ProtocolError, match="bool bytes 0 or 1 expected"):
        encode(TensorMessage(**HEADER, tensor=forged))


def test_another_schema_version_is_encoded_as_it_is_and_refused() -> None:
    newer = SCHEMA_VERSION + 1
    message = TensorMessage(**HEADER, schema_version=newer, tensor=torch.ones(1, dtype=torch.uint8))
    data = encode(message)
    assert data == header("test-tensor", schema_version=newer) + array_block(6, (1,), b"\x01")
    with pytest.raises(
        ProtocolError, match=f"schema version {SCHEMA_VERSION} expected, found {newer}"
    ):
        decode(data)
    with pytest.raises(ProtocolError, match=r"schema_version: an int expected, found bool"):
        encode(TensorMessage(**HEADER, schema_version=True, tensor=torch.ones(1)))


def test_registering_a_kind_longer_than_max_kind_bytes_is_refused() -> None:
    namespace = {"__annotations__": {}, "kind": "k" * (wire.MAX_KIND_BYTES + 1)}
    cls = dataclass(frozen=True, kw_only=True)(type("LongKind", (Message,), namespace))
    with pytest.raises(TypeError, match=f"at most {wire.MAX_KIND_BYTES} UTF-8 bytes"):
        register_message(cls)


def test_registering_a_class_that_retypes_a_header_field_is_refused() -> None:
    namespace = {"__annotations__": {"round": str}, "kind": "test-retyped-header"}
    cls = dataclass(frozen=True, kw_only=True)(type("RetypedHeader", (Message,), namespace))
    with pytest.raises(TypeError, match=r"test-retyped-header: header fields .* expected"):
        register_message(cls)


def test_header_names_seen_before_decode_to_the_same_message() -> None:
    # The names of a header are converted once and then looked up: the second decode of the
    # same names takes the cached path and must agree with the first, field for field.
    message = TensorMessage(**{**HEADER, "session": "run-ß"}, tensor=torch.ones(1))
    data = encode(message)
    first, second = decode(data), decode(data)
    assert_same(first, message)
    assert_same(second, message)
    other = dataclasses.replace(message, sender="party-9", round=3, batch_id=4)
    assert_same(decode(encode(other)), other)


def test_a_cached_header_name_changed_on_the_wire_is_parsed_again() -> None:
    data = encode(TensorMessage(**HEADER, tensor=torch.ones(1)))
    decode(data)  # the names are now cached
    name_at = data.index(b"party-0")
    with pytest.raises(ProtocolError, match="sender: UTF-8 text expected"):
        decode(data[:name_at] + b"\xff" + data[name_at + 1 :])
    renamed = decode(data[:name_at] + b"P" + data[name_at + 1 :])
    assert renamed.sender == "Party-0"


def test_header_names_of_other_types_are_refused_after_the_same_names_were_cached() -> None:
    encode(TensorMessage(**HEADER, tensor=torch.ones(1)))  # "party-0", "aggregator", "" cached
    with pytest.raises(ProtocolError, match=r"test-tensor\.receiver: a str expected, found bytes"):
        encode(TensorMessage(**{**HEADER, "receiver": b"aggregator"}, tensor=torch.ones(1)))
    with pytest.raises(ProtocolError, match=r"test-tensor\.round: an int expected, found bool"):
        encode(TensorMessage(**{**HEADER, "round": True}, tensor=torch.ones(1)))
    with pytest.raises(ProtocolError, match=r"batch_id: a 64-bit signed integer expected"):
        encode(TensorMessage(**{**HEADER, "batch_id": 2**63}, tensor=torch.ones(1)))


def test_the_text_caches_stay_bounded_and_correct_when_peers_send_new_names() -> None:
    for index in range(wire._CACHE_ENTRIES + 10):
        message = ErrorMessage(**{**HEADER, "sender": f"peer-{index}"}, error=f"reason {index}")
        assert_round_trip(message)
    for cache in (wire._ENCODED_NAMES, wire._DECODED_NAMES, wire._ENCODED_TEXT):
        assert 0 < len(cache) <= wire._CACHE_ENTRIES
    assert_round_trip(ErrorMessage(**{**HEADER, "sender": "peer-0"}, error="reason 0"))


def test_a_tensor_numpy_cannot_read_is_refused_as_a_protocol_error() -> None:
    negated = torch._neg_view(torch.ones(2))  # a lazily negated view: numpy() refuses it
    with pytest.raises(ProtocolError, match=r"test-tensor\.tensor: a tensor numpy can read"):
        encode(TensorMessage(**HEADER, tensor=negated))
    assert_round_trip(TensorMessage(**HEADER, tensor=negated.resolve_neg()))


def test_the_header_is_read_without_the_fields_and_garbage_refused() -> None:
    """``header_of`` reads what a capture shows of a message the codec refuses for its values;
    it parses the head and the header only, and refuses what is not a message's."""
    message = GradientMessage(
        sender="party-0",
        receiver="party-2",
        round=5,
        batch_id=1,
        session="s",
        positions=torch.tensor([0, 1]),
        gradient=torch.tensor([[float("inf")], [1.0]]),
    )
    data = encode(message)
    with pytest.raises(NonFiniteError):
        decode(data)
    assert wire.header_of(data) == wire.Header("gradient", "party-0", "party-2", "s", 5, 1)
    for junk in (b"", b"SVFL", b"not a message", data[:20]):
        with pytest.raises(ProtocolError):
            wire.header_of(junk)
