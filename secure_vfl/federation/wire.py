"""The wire codec: the one place where messages become bytes and bytes become messages.

Every message class is a frozen dataclass registered here under its ``kind``
(:func:`register_message`); its wire schema is derived from its fields' declared types at
registration, so protocols register their own messages without writing a codec. The encoding is
canonical, exactly one byte string per message, and :func:`decode` refuses every other byte string
with :class:`~secure_vfl.errors.ProtocolError` (never another exception type), so a peer cannot
smuggle anything past the codec: ``encode(decode(data)) == data`` whenever ``decode`` accepts.

Layout (integers little-endian and fixed-width)::

    magic b"SVFL" | wire version: u16 | kind: str
    | schema_version: i64 | sender: str | receiver: str | session: str | round: i64 | batch_id: i64
    | the class's other fields, in declaration order

    int     i64                      float   f64, finite
    bool    u8, 0 or 1               str     u64 byte count, UTF-8 (strict)
    bytes   u64 byte count, bytes    Literal a str, one of the declared values
    tuple   u64 item count, items    X | None  u8 presence (0 or 1), then X if present
    Tensor, ndarray  dtype code: u8 | ndim: u8 | each dimension: u64 | byte count: u64
                     | the elements in C order, little-endian; floating-point values finite

Allowed array dtypes (code): float32 (1), float64 (2), int64 (3), int32 (4), uint64 (5),
uint8 (6), bool (7, each byte 0 or 1). Decoding runs only the parsing below: nothing a peer sends
is ever run as code or handed to a general-purpose object deserialiser.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import struct
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import torch
from torch import Tensor

from secure_vfl.errors import IntegrityError, ProtocolError
from secure_vfl.registry import Registry

if TYPE_CHECKING:  # messages.py registers its classes here: importing it would be a cycle
    from secure_vfl.federation.messages import Message

WIRE_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAGIC = b"SVFL"
MAX_NDIM = 64  # numpy's limit

# The header fields every message carries, in wire order; the class's other fields follow.
HEADER_FIELDS = ("schema_version", "sender", "receiver", "session", "round", "batch_id")

_PREFIX = struct.Struct("<4sH")
_U8 = struct.Struct("<B")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_ARRAY_HEAD = struct.Struct("<BB")
# An array's dimensions and byte count, by its number of dimensions.
_ARRAY_SHAPES = tuple(struct.Struct(f"<{ndim}QQ") for ndim in range(MAX_NDIM + 1))
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1

# Wire dtype code -> (little-endian numpy dtype, torch dtype). Nothing else crosses the wire.
_DTYPES: dict[int, tuple[np.dtype[Any], torch.dtype]] = {
    1: (np.dtype("<f4"), torch.float32),
    2: (np.dtype("<f8"), torch.float64),
    3: (np.dtype("<i8"), torch.int64),
    4: (np.dtype("<i4"), torch.int32),
    5: (np.dtype("<u8"), torch.uint64),
    6: (np.dtype("u1"), torch.uint8),
    7: (np.dtype("?"), torch.bool),
}
_FLOAT_CODES = frozenset({1, 2})
_BOOL_CODE = 7
_CODE_BY_KIND = {(dtype.kind, dtype.itemsize): code for code, (dtype, _) in _DTYPES.items()}
_TORCH_DTYPES = {torch_dtype for _, torch_dtype in _DTYPES.values()}
_DTYPE_NAMES = ", ".join(dtype.name for dtype, _ in _DTYPES.values())

MessageT = TypeVar("MessageT", bound="Message")
_Parts = list[bytes | memoryview]


class _Reader:
    """A cursor over the bytes being decoded that refuses to read past their end."""

    __slots__ = ("offset", "view")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.offset = 0

    def remaining(self) -> int:
        return len(self.view) - self.offset

    def take(self, size: int, where: str) -> memoryview:
        if size > len(self.view) - self.offset:
            raise ProtocolError(
                f"{where}: {size} bytes expected, found {self.remaining()}: the message is "
                "truncated."
            )
        start = self.offset
        self.offset = start + size
        return self.view[start : self.offset]

    def unpack(self, layout: struct.Struct, where: str) -> tuple[Any, ...]:
        if layout.size > len(self.view) - self.offset:
            raise ProtocolError(
                f"{where}: {layout.size} bytes expected, found {self.remaining()}: the message is "
                "truncated."
            )
        values = layout.unpack_from(self.view, self.offset)
        self.offset += layout.size
        return values


class _Codec(ABC):
    """Encodes and decodes the values of one declared field type; ``where`` names the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    @abstractmethod
    def encode(self, value: object, out: _Parts) -> None:
        """Append the bytes of ``value`` to ``out``; raise ProtocolError if it has none."""

    @abstractmethod
    def decode(self, reader: _Reader) -> object:
        """Read one value; raise ProtocolError if the bytes are not its canonical encoding."""

    def refuse(self, expected: str, value: object) -> ProtocolError:
        return ProtocolError(f"{self.where}: {expected} expected, found {type(value).__name__}.")


class _IntCodec(_Codec):
    def encode(self, value: object, out: _Parts) -> None:
        if isinstance(value, bool | np.bool_):
            raise self.refuse("an int", value)
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise self.refuse("an int", value) from None
        if not _I64_MIN <= number <= _I64_MAX:
            raise ProtocolError(f"{self.where}: a 64-bit signed integer expected, found {number}.")
        out.append(_I64.pack(number))

    def decode(self, reader: _Reader) -> int:
        value: int = reader.unpack(_I64, self.where)[0]
        return value


class _FloatCodec(_Codec):
    def encode(self, value: object, out: _Parts) -> None:
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            raise self.refuse("a float", value)
        number = float(value)
        if not math.isfinite(number):
            raise IntegrityError(f"{self.where}: a finite float expected, found {number}.")
        out.append(_F64.pack(number))

    def decode(self, reader: _Reader) -> float:
        value: float = reader.unpack(_F64, self.where)[0]
        if not math.isfinite(value):
            raise IntegrityError(f"{self.where}: a finite float expected, found {value}.")
        return value


def _shown(value: object) -> str:
    """``repr(value)``, cut short: a peer chooses the strings that errors quote."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _read_flag(reader: _Reader, where: str, meaning: str) -> bool:
    flag = reader.unpack(_U8, where)[0]
    if flag > 1:
        raise ProtocolError(f"{where}: {meaning} byte 0 or 1 expected, found {flag}.")
    return flag == 1


class _BoolCodec(_Codec):
    def encode(self, value: object, out: _Parts) -> None:
        if not isinstance(value, bool):
            raise self.refuse("a bool", value)
        out.append(b"\x01" if value else b"\x00")

    def decode(self, reader: _Reader) -> bool:
        return _read_flag(reader, self.where, "a bool")


class _BytesCodec(_Codec):
    def encode(self, value: object, out: _Parts) -> None:
        if not isinstance(value, bytes | bytearray):
            raise self.refuse("bytes", value)
        out.append(_U64.pack(len(value)))
        out.append(bytes(value))

    def decode(self, reader: _Reader) -> bytes:
        size = reader.unpack(_U64, self.where)[0]
        return bytes(reader.take(size, self.where))


class _StrCodec(_Codec):
    def encode(self, value: object, out: _Parts) -> None:
        if not isinstance(value, str):
            raise self.refuse("a str", value)
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ProtocolError(f"{self.where}: a str encodable as UTF-8 expected.") from error
        out.append(_U64.pack(len(raw)))
        out.append(raw)

    def decode(self, reader: _Reader) -> str:
        size = reader.unpack(_U64, self.where)[0]
        raw = reader.take(size, self.where)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as error:
            raise ProtocolError(
                f"{self.where}: UTF-8 text expected, found {error.reason}."
            ) from None


class _LiteralCodec(_StrCodec):
    def __init__(self, where: str, values: tuple[str, ...]) -> None:
        super().__init__(where)
        self.values = values

    def encode(self, value: object, out: _Parts) -> None:
        if value not in self.values:
            raise ProtocolError(
                f"{self.where}: one of {self.values} expected, found {_shown(value)}."
            )
        super().encode(value, out)

    def decode(self, reader: _Reader) -> str:
        value = super().decode(reader)
        if value not in self.values:
            raise ProtocolError(
                f"{self.where}: one of {self.values} expected, found {_shown(value)}."
            )
        return value


class _TupleCodec(_Codec):
    def __init__(self, where: str, item: _Codec, item_bytes: int) -> None:
        super().__init__(where)
        self.item = item
        self.item_bytes = item_bytes  # the fewest bytes one item takes: bounds the count

    def encode(self, value: object, out: _Parts) -> None:
        if not isinstance(value, tuple):
            raise self.refuse("a tuple", value)
        out.append(_U64.pack(len(value)))
        for item in value:
            self.item.encode(item, out)

    def decode(self, reader: _Reader) -> tuple[object, ...]:
        count = reader.unpack(_U64, self.where)[0]
        if count * self.item_bytes > reader.remaining():
            raise ProtocolError(
                f"{self.where}: {count} items of at least {self.item_bytes} bytes expected, found "
                f"{reader.remaining()} bytes: the message is truncated."
            )
        return tuple(self.item.decode(reader) for _ in range(count))


class _OptionalCodec(_Codec):
    def __init__(self, where: str, inner: _Codec) -> None:
        super().__init__(where)
        self.inner = inner

    def encode(self, value: object, out: _Parts) -> None:
        if value is None:
            out.append(b"\x00")
        else:
            out.append(b"\x01")
            self.inner.encode(value, out)

    def decode(self, reader: _Reader) -> object:
        if _read_flag(reader, self.where, "a presence"):
            return self.inner.decode(reader)
        return None


def _all_finite(array: np.ndarray) -> bool:
    """Whether every value is finite: NaN and inf reach the min or the max (two vectorised
    passes, no temporary of the array's size)."""
    return array.size == 0 or bool(np.isfinite(array.min()) and np.isfinite(array.max()))


class _ArrayCodec(_Codec):
    """A numpy array, or a torch tensor when ``as_tensor``: the declared type decides."""

    def __init__(self, where: str, *, as_tensor: bool) -> None:
        super().__init__(where)
        self.as_tensor = as_tensor

    def encode(self, value: object, out: _Parts) -> None:
        if self.as_tensor:
            if not isinstance(value, Tensor):
                raise self.refuse("a torch.Tensor", value)
            array = self._tensor_array(value)
        else:
            if not isinstance(value, np.ndarray):
                raise self.refuse("a numpy.ndarray", value)
            array = value
        code = _CODE_BY_KIND.get((array.dtype.kind, array.dtype.itemsize))
        if code is None:
            raise ProtocolError(
                f"{self.where}: dtype in ({_DTYPE_NAMES}) expected, found {array.dtype}."
            )
        wire = array.astype(_DTYPES[code][0], order="C", copy=False)
        raw = wire.reshape(-1).view(np.uint8)
        if code == _BOOL_CODE and raw.size and int(raw.max()) > 1:
            raise ProtocolError(f"{self.where}: bool bytes 0 or 1 expected, found others.")
        out.append(_ARRAY_HEAD.pack(code, wire.ndim))
        out.append(_ARRAY_SHAPES[wire.ndim].pack(*wire.shape, wire.nbytes))
        out.append(raw.data)

    def _tensor_array(self, tensor: Tensor) -> np.ndarray:
        if tensor.requires_grad:
            raise ProtocolError(
                f"{self.where}: a detached tensor expected, found one that requires grad; "
                "detach it before it leaves the party."
            )
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise ProtocolError(
                f"{self.where}: a dense CPU tensor expected, found {tensor.layout} on "
                f"{tensor.device}."
            )
        if tensor.dtype not in _TORCH_DTYPES:
            raise ProtocolError(
                f"{self.where}: dtype in ({_DTYPE_NAMES}) expected, found {tensor.dtype}."
            )
        return tensor.contiguous().numpy()

    def decode(self, reader: _Reader) -> object:
        code, ndim = reader.unpack(_ARRAY_HEAD, self.where)
        if code not in _DTYPES:
            raise ProtocolError(
                f"{self.where}: a dtype code in {sorted(_DTYPES)} expected, found {code}."
            )
        if ndim > MAX_NDIM:
            raise ProtocolError(
                f"{self.where}: at most {MAX_NDIM} dimensions expected, found {ndim}."
            )
        wire_dtype = _DTYPES[code][0]
        *shape, nbytes = reader.unpack(_ARRAY_SHAPES[ndim], self.where)
        capacity = wire_dtype.itemsize * math.prod(dim for dim in shape if dim)
        if capacity > _I64_MAX:
            raise ProtocolError(
                f"{self.where}: an array shape of at most 2**63 - 1 bytes expected, found "
                f"{tuple(shape)} of {wire_dtype.name}."
            )
        expected = wire_dtype.itemsize * math.prod(shape)
        if nbytes != expected:
            raise ProtocolError(
                f"{self.where}: shape {tuple(shape)} of {wire_dtype.name} takes {expected} bytes, "
                f"found {nbytes} announced."
            )
        raw = reader.take(nbytes, self.where)
        if code == _BOOL_CODE and nbytes and int(np.frombuffer(raw, dtype=np.uint8).max()) > 1:
            raise ProtocolError(f"{self.where}: bool bytes 0 or 1 expected, found others.")
        # A fresh, aligned array that owns its memory: the input may sit at any offset.
        array = np.empty(shape, dtype=wire_dtype)
        array.reshape(-1).view(np.uint8)[:] = raw
        if code in _FLOAT_CODES and not _all_finite(array):
            raise IntegrityError(f"{self.where}: finite values expected, found non-finite ones.")
        return torch.from_numpy(array) if self.as_tensor else array


_SCALAR_CODECS: dict[object, Callable[[str], _Codec]] = {
    int: _IntCodec,
    float: _FloatCodec,
    bool: _BoolCodec,
    str: _StrCodec,
    bytes: _BytesCodec,
    Tensor: lambda where: _ArrayCodec(where, as_tensor=True),
    np.ndarray: lambda where: _ArrayCodec(where, as_tensor=False),
}
# The fewest bytes one tuple item takes (its length prefix or its fixed width).
_TUPLE_ITEMS: dict[object, int] = {str: 8, int: 8, bytes: 8}
_SUPPORTED = (
    "int, float, bool, str, bytes, torch.Tensor, numpy.ndarray, tuple[str, ...], "
    "tuple[int, ...], tuple[bytes, ...], Literal[...] of str, and X | None of these"
)


def _codec_for(hint: object, where: str) -> _Codec:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        present = [arg for arg in args if arg is not type(None)]
        if len(args) == 2 and len(present) == 1:
            return _OptionalCodec(where, _codec_for(present[0], where))
    elif origin is Literal:
        if args and all(isinstance(arg, str) for arg in args):
            return _LiteralCodec(where, args)
    elif origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            for item, item_bytes in _TUPLE_ITEMS.items():
                if args[0] is item:
                    return _TupleCodec(where, _SCALAR_CODECS[item](where), item_bytes)
    else:
        for declared, codec in _SCALAR_CODECS.items():
            if hint is declared:
                return codec(where)
    raise TypeError(f"{where}: a field of type {_SUPPORTED} expected, found {hint}.")


@dataclasses.dataclass(frozen=True)
class _Schema:
    """How one registered message class is laid out on the wire."""

    cls: type[Message]
    prefix: bytes  # magic, wire version and kind: the same for every message of the class
    schema_version: int  # the one this code speaks: the default of the class's field
    fields: tuple[tuple[str, _Codec], ...]  # in wire order, schema_version (an i64) excluded


_KIND = _StrCodec("kind")
_SCHEMA_VERSION = _IntCodec("schema_version")
_SCHEMAS: Registry[_Schema] = Registry("wire message kind")
_SCHEMA_BY_CLASS: dict[type[Message], _Schema] = {}


def register_message(cls: type[MessageT]) -> type[MessageT]:
    """Make the Message dataclass ``cls`` encodable and decodable under its ``kind``; usable as a
    class decorator. Raises RegistryError if the kind is taken and TypeError if a field's declared
    type has no wire encoding."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"a Message dataclass expected, found {cls!r}.")
    defaults = {field.name: field.default for field in dataclasses.fields(cls)}
    if not set(HEADER_FIELDS) <= set(defaults) or not callable(getattr(cls, "validate", None)):
        raise TypeError(
            f"a Message dataclass expected (header fields {HEADER_FIELDS} and validate()), "
            f"found {cls.__name__}."
        )
    kind = vars(cls).get("kind")
    if not isinstance(kind, str) or not kind:
        raise TypeError(
            f"{cls.__name__} must declare its own `kind: ClassVar[str]`, found "
            f"{getattr(cls, 'kind', None)!r} inherited."
        )
    try:
        hints = typing.get_type_hints(cls)
    except Exception as error:
        raise TypeError(
            f"{kind}: the field types of {cls.__name__} do not resolve: {error}"
        ) from error
    codecs: dict[str, _Codec] = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            raise TypeError(f"{kind}.{field.name}: init fields only, found init=False.")
        codecs[field.name] = _codec_for(hints[field.name], f"{kind}.{field.name}")
    if not isinstance(codecs["schema_version"], _IntCodec) or not isinstance(
        defaults["schema_version"], int
    ):
        raise TypeError(f"{kind}.schema_version: an int with a default expected.")
    order = list(HEADER_FIELDS[1:]) + [name for name in codecs if name not in HEADER_FIELDS]
    schema = _Schema(
        cls=cls,
        prefix=_PREFIX.pack(MAGIC, WIRE_VERSION) + _encoded_str(kind),
        schema_version=defaults["schema_version"],
        fields=tuple((name, codecs[name]) for name in order),
    )
    _SCHEMAS.register(kind, schema)
    _SCHEMA_BY_CLASS[cls] = schema
    return cls


def _encoded_str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _U64.pack(len(raw)) + raw


def encode(message: Message) -> bytes:
    """The canonical bytes of ``message``; raise ProtocolError if it cannot be sent as it is (an
    unregistered class, a field of the wrong type, a tensor that requires grad or is not on the
    CPU, a non-finite float field, more than MAX_MESSAGE_BYTES). Non-finite values inside
    tensors and arrays are left to the receiver's :func:`decode`, which scans each once."""
    schema = _SCHEMA_BY_CLASS.get(type(message))
    if schema is None:
        raise ProtocolError(
            f"{type(message).__name__} is not registered with the wire codec; decorate it with "
            "@register_message."
        )
    out: _Parts = [schema.prefix]
    _SCHEMA_VERSION.encode(message.schema_version, out)
    for name, codec in schema.fields:
        codec.encode(getattr(message, name), out)
    size = sum(map(len, out))
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"{message.kind}: message of {size} bytes exceeds the limit of {MAX_MESSAGE_BYTES}."
        )
    return b"".join(out)


def decode(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message ``data`` encodes, validated (:meth:`Message.validate`). Anything malformed,
    non-canonical or invalid raises ProtocolError (IntegrityError for non-finite values), never
    another exception type."""
    try:
        return _decode(data, max_bytes)
    except ProtocolError:
        raise
    except Exception as error:
        raise ProtocolError(f"undecodable message: {type(error).__name__}: {error}") from error


def _decode(data: bytes, max_bytes: int) -> Message:
    view = memoryview(data).cast("B")
    if len(view) > max_bytes:
        raise ProtocolError(f"message of {len(view)} bytes exceeds the limit of {max_bytes}.")
    reader = _Reader(view)
    magic, version = reader.unpack(_PREFIX, "header")
    if magic != MAGIC:
        raise ProtocolError(
            f"magic bytes {MAGIC!r} expected, found {bytes(magic)!r}: not a secure-vfl message."
        )
    if version != WIRE_VERSION:
        raise ProtocolError(f"wire version {WIRE_VERSION} expected, found {version}.")
    kind = _KIND.decode(reader)
    if kind not in _SCHEMAS:
        raise ProtocolError(
            f"a message kind in ({', '.join(_SCHEMAS.names())}) expected, found {_shown(kind)}."
        )
    schema = _SCHEMAS.get(kind)
    schema_version = _SCHEMA_VERSION.decode(reader)
    if schema_version != schema.schema_version:
        raise ProtocolError(
            f"{kind}: schema version {schema.schema_version} expected, found {schema_version}."
        )
    values: dict[str, Any] = {"schema_version": schema_version}
    for name, codec in schema.fields:
        values[name] = codec.decode(reader)
    if reader.remaining():
        raise ProtocolError(
            f"{kind}: the message ends after {reader.offset} bytes, found {reader.remaining()} "
            "more."
        )
    message = schema.cls(**values)
    try:
        message.validate()
    except ProtocolError:
        raise
    except Exception as error:
        raise ProtocolError(f"{kind} from {message.sender}: invalid: {error}") from error
    return message
