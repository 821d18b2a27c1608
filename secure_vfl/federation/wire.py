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

Registration compiles each field's declared type into an encoder and a decoder (closures over the
field's layout), so encoding or decoding a message walks two flat lists of them: no type
introspection and no per-value dispatch at call time. The header's names, round and batch id
are one encoder and one decoder, and the names and other text a run repeats on every message
are converted once, into bounded caches keyed by their exact text or bytes; what misses a cache
takes the full path, so a cache changes how fast a message is read, never what is accepted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
import struct
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import torch
from torch import Tensor

from secure_vfl.errors import NonFiniteError, ProtocolError, RegistryError, VersionError
from secure_vfl.io import shown
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
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_ARRAY_HEAD = struct.Struct("<BB")
# An array's dimensions and byte count, by its number of dimensions (what decode reads after the
# head), and the whole array header, head included (what encode writes in one pack).
_ARRAY_SHAPES = tuple(struct.Struct(f"<{ndim}QQ") for ndim in range(MAX_NDIM + 1))
_ARRAY_HEADERS = tuple(struct.Struct(f"<BB{ndim}QQ") for ndim in range(MAX_NDIM + 1))
_HEADER_NUMBERS = struct.Struct("<qq")  # round, batch_id
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_BOOL_BYTES = b"\x00\x01"  # what bytes.translate deletes: whatever is left is not a bool byte

# Encoded text by its str, and a header's three names by their encoded bytes: the same party
# names, sessions, tags and phases are on every message, so each is converted once. Bounded (a
# peer chooses what it sends): a cache that is full is emptied and fills again.
_CACHE_ENTRIES = 4096
_CACHED_TEXT_BYTES = 256
_ENCODED_TEXT: dict[str, bytes] = {}
_ENCODED_NAMES: dict[tuple[str, str, str], bytes] = {}
_DECODED_NAMES: dict[bytes, tuple[str, str, str]] = {}
_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def _remember(cache: dict[_Key, _Value], key: _Key, value: _Value) -> None:
    """Keep ``value`` under ``key``, emptying ``cache`` first when it is full."""
    if len(cache) >= _CACHE_ENTRIES:
        cache.clear()
    cache[key] = value


@dataclasses.dataclass(frozen=True)
class _Dtype:
    """One dtype allowed on the wire."""

    code: int
    numpy: np.dtype[Any]  # little-endian
    torch: torch.dtype
    finite: bool  # floating point: every value must be finite
    boolean: bool  # every byte must be 0 or 1


# Wire dtype code -> dtype. Nothing else crosses the wire.
_DTYPES = {
    dtype.code: dtype
    for dtype in (
        _Dtype(1, np.dtype("<f4"), torch.float32, finite=True, boolean=False),
        _Dtype(2, np.dtype("<f8"), torch.float64, finite=True, boolean=False),
        _Dtype(3, np.dtype("<i8"), torch.int64, finite=False, boolean=False),
        _Dtype(4, np.dtype("<i4"), torch.int32, finite=False, boolean=False),
        _Dtype(5, np.dtype("<u8"), torch.uint64, finite=False, boolean=False),
        _Dtype(6, np.dtype("u1"), torch.uint8, finite=False, boolean=False),
        _Dtype(7, np.dtype("?"), torch.bool, finite=False, boolean=True),
    )
}
_DTYPE_BY_TORCH = {dtype.torch: dtype for dtype in _DTYPES.values()}
# A tensor's wire dtype by the numpy type number of its Tensor.numpy() view.
_DTYPE_BY_TENSOR_VIEW = {
    torch.empty(0, dtype=dtype.torch).numpy().dtype.num: dtype for dtype in _DTYPES.values()
}
# A numpy array's wire dtype by its (kind, itemsize), whatever its byte order.
_DTYPE_BY_KIND = {(dtype.numpy.kind, dtype.numpy.itemsize): dtype for dtype in _DTYPES.values()}
_DTYPE_NAMES = ", ".join(dtype.numpy.name for dtype in _DTYPES.values())

MessageT = TypeVar("MessageT", bound="Message")
# The pieces of a message being encoded, joined once at the end (arrays by their buffers).
_Parts = list[bytes | memoryview]
# A field's encoder appends one value to the parts and returns how many bytes it appended; its
# decoder reads one value at an offset into the message and returns it with the offset after it.
# Both raise ProtocolError for what has no canonical encoding.
_Encoder = Callable[[Any, _Parts], int]
_Decoder = Callable[[memoryview, int], tuple[Any, int]]
_Codec = tuple[_Encoder, _Decoder]


def _truncated(where: str, size: int, view: memoryview, offset: int) -> ProtocolError:
    return ProtocolError(
        f"{where}: {size} bytes expected, found {len(view) - offset}: the message is truncated."
    )


def _refused(where: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(f"{where}: {expected} expected, found {type(value).__name__}.")


def _read_flag(view: memoryview, offset: int, where: str, meaning: str) -> bool:
    if offset >= len(view):
        raise _truncated(where, 1, view, offset)
    flag: int = view[offset]
    if flag > 1:
        raise ProtocolError(f"{where}: {meaning} byte 0 or 1 expected, found {flag}.")
    return flag == 1


def _int_codec(where: str) -> _Codec:
    def encode_int(value: Any, out: _Parts) -> int:
        if type(value) is not int:  # exactly int is the common case; bool is not an int here
            if isinstance(value, bool | np.bool_):
                raise _refused(where, "an int", value)
            try:
                value = operator.index(value)
            except TypeError:
                raise _refused(where, "an int", value) from None
        if not _I64_MIN <= value <= _I64_MAX:
            raise ProtocolError(f"{where}: a 64-bit signed integer expected, found {value}.")
        out.append(_I64.pack(value))
        return 8

    def decode_int(view: memoryview, offset: int) -> tuple[int, int]:
        end = offset + 8
        if end > len(view):
            raise _truncated(where, 8, view, offset)
        value: int = _I64.unpack_from(view, offset)[0]
        return value, end

    return encode_int, decode_int


def _float_codec(where: str) -> _Codec:
    def encode_float(value: Any, out: _Parts) -> int:
        if type(value) is not float:
            if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
                raise _refused(where, "a float", value)
            value = float(value)
        if not math.isfinite(value):
            raise NonFiniteError(f"{where}: a finite float expected, found {value}.")
        out.append(_F64.pack(value))
        return 8

    def decode_float(view: memoryview, offset: int) -> tuple[float, int]:
        end = offset + 8
        if end > len(view):
            raise _truncated(where, 8, view, offset)
        value: float = _F64.unpack_from(view, offset)[0]
        if not math.isfinite(value):
            raise NonFiniteError(f"{where}: a finite float expected, found {value}.")
        return value, end

    return encode_float, decode_float


def _bool_codec(where: str) -> _Codec:
    def encode_bool(value: Any, out: _Parts) -> int:
        if value is True:
            out.append(b"\x01")
        elif value is False:
            out.append(b"\x00")
        else:
            raise _refused(where, "a bool", value)
        return 1

    def decode_bool(view: memoryview, offset: int) -> tuple[bool, int]:
        return _read_flag(view, offset, where, "a bool"), offset + 1

    return encode_bool, decode_bool


def _span(where: str, view: memoryview, offset: int) -> tuple[int, int]:
    """Where the byte string whose u64 length is at ``offset`` starts and ends."""
    start = offset + 8
    if start > len(view):
        raise _truncated(where, 8, view, offset)
    end: int = start + _U64.unpack_from(view, offset)[0]
    if end > len(view):
        raise _truncated(where, end - start, view, start)
    return start, end


def _bytes_codec(where: str) -> _Codec:
    def encode_bytes(value: Any, out: _Parts) -> int:
        if not isinstance(value, bytes | bytearray):
            raise _refused(where, "bytes", value)
        out.append(_U64.pack(len(value)))
        out.append(bytes(value))
        return 8 + len(value)

    def decode_bytes(view: memoryview, offset: int) -> tuple[bytes, int]:
        start, end = _span(where, view, offset)
        return bytes(view[start:end]), end

    return encode_bytes, decode_bytes


def _str_codec(where: str) -> _Codec:
    def encode_str(value: Any, out: _Parts) -> int:
        raw = _ENCODED_TEXT.get(value) if type(value) is str else None
        if raw is None:
            if not isinstance(value, str):
                raise _refused(where, "a str", value)
            raw = _encoded_text(where, value)
            if type(value) is str and len(raw) <= _CACHED_TEXT_BYTES:
                _remember(_ENCODED_TEXT, value, raw)
        out.append(raw)
        return len(raw)

    def decode_str(view: memoryview, offset: int) -> tuple[str, int]:
        start = offset + 8
        size = len(view)
        if start > size or (end := start + _U64.unpack_from(view, offset)[0]) > size:
            start, end = _span(where, view, offset)  # raises: the message is truncated
        if end == start:  # an unset tag or model, on most messages
            return "", end
        try:
            return str(view[start:end], "utf-8"), end
        except UnicodeDecodeError as error:
            raise ProtocolError(f"{where}: UTF-8 text expected, found {error.reason}.") from None

    return encode_str, decode_str


def _encoded_text(where: str, value: str) -> bytes:
    """``value`` as the wire writes a str: its UTF-8 byte count, then the bytes."""
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ProtocolError(f"{where}: a str encodable as UTF-8 expected.") from error
    return _U64.pack(len(raw)) + raw


def _literal_codec(where: str, values: tuple[str, ...]) -> _Codec:
    encode_str, decode_str = _str_codec(where)

    def encode_literal(value: Any, out: _Parts) -> int:
        if value not in values:
            raise ProtocolError(f"{where}: one of {values} expected, found {shown(value)}.")
        return encode_str(value, out)

    def decode_literal(view: memoryview, offset: int) -> tuple[str, int]:
        value, offset = decode_str(view, offset)
        if value not in values:
            raise ProtocolError(f"{where}: one of {values} expected, found {shown(value)}.")
        return value, offset

    return encode_literal, decode_literal


def _tuple_codec(where: str, item: _Codec, item_bytes: int) -> _Codec:
    """A tuple of one item type; ``item_bytes``, the fewest bytes one item takes, bounds the count
    a peer may announce before anything is allocated."""
    encode_item, decode_item = item

    def encode_tuple(value: Any, out: _Parts) -> int:
        if not isinstance(value, tuple):
            raise _refused(where, "a tuple", value)
        out.append(_U64.pack(len(value)))
        size = 8
        for element in value:
            size += encode_item(element, out)
        return size

    def decode_tuple(view: memoryview, offset: int) -> tuple[tuple[Any, ...], int]:
        start = offset + 8
        if start > len(view):
            raise _truncated(where, 8, view, offset)
        count: int = _U64.unpack_from(view, offset)[0]
        if count * item_bytes > len(view) - start:
            raise ProtocolError(
                f"{where}: {count} items of at least {item_bytes} bytes expected, found "
                f"{len(view) - start} bytes: the message is truncated."
            )
        items = []
        for _ in range(count):
            element, start = decode_item(view, start)
            items.append(element)
        return tuple(items), start

    return encode_tuple, decode_tuple


def _optional_codec(where: str, inner: _Codec) -> _Codec:
    encode_inner, decode_inner = inner

    def encode_optional(value: Any, out: _Parts) -> int:
        if value is None:
            out.append(b"\x00")
            return 1
        out.append(b"\x01")
        return 1 + encode_inner(value, out)

    def decode_optional(view: memoryview, offset: int) -> tuple[Any, int]:
        if _read_flag(view, offset, where, "a presence"):
            return decode_inner(view, offset + 1)
        return None, offset + 1

    return encode_optional, decode_optional


_Names = tuple[str, str, str]  # sender, receiver, session
# The header after schema_version: encoded from the message's (sender, receiver, session, round,
# batch_id, ...) values; decoded as the names, round, batch_id and the offset after them.
_HeaderEncoder = Callable[[tuple[Any, ...], _Parts], int]
_HeaderDecoder = Callable[[memoryview, int], tuple[_Names, int, int, int]]


def _names_end(view: memoryview, offset: int) -> int:
    """Where the header's three names that start at ``offset`` end, as their byte counts say
    (past the end of ``view`` when they do not fit)."""
    try:
        at = offset + 8 + _U64.unpack_from(view, offset)[0]
        at += 8 + _U64.unpack_from(view, at)[0]
        return at + 8 + int(_U64.unpack_from(view, at)[0])
    except (struct.error, OverflowError):
        return len(view) + 1


def _header_codec(kind: str) -> tuple[_HeaderEncoder, _HeaderDecoder]:
    """The header fields after schema_version (sender, receiver, session: str; round, batch_id:
    i64) as one encoder and one decoder: every message has them, and their names repeat, so a
    header whose names were seen before is one cache look-up and one pack or unpack. Anything
    else goes through the fields' own codecs, which refuse what has no canonical encoding."""
    name_codecs = [_str_codec(f"{kind}.{name}") for name in HEADER_FIELDS[1:4]]
    number_codecs = [_int_codec(f"{kind}.{name}") for name in HEADER_FIELDS[4:]]

    def encode_header(values: tuple[Any, ...], out: _Parts) -> int:
        names, round, batch_id = values[:3], values[3], values[4]
        raw = None
        if type(names[0]) is str and type(names[1]) is str and type(names[2]) is str:
            raw = _ENCODED_NAMES.get(names)
        if raw is None:
            parts: _Parts = []
            for (encode_name, _), name in zip(name_codecs, names, strict=True):
                encode_name(name, parts)
            raw = b"".join(parts)
            if all(type(name) is str for name in names) and len(raw) <= _CACHED_TEXT_BYTES:
                _remember(_ENCODED_NAMES, names, raw)
        out.append(raw)
        if (
            type(round) is int
            and type(batch_id) is int
            and _I64_MIN <= round <= _I64_MAX
            and _I64_MIN <= batch_id <= _I64_MAX
        ):
            out.append(_HEADER_NUMBERS.pack(round, batch_id))
        else:
            for (encode_number, _), number in zip(number_codecs, (round, batch_id), strict=True):
                encode_number(number, out)  # refuses it
        return len(raw) + _HEADER_NUMBERS.size

    def decode_header(view: memoryview, offset: int) -> tuple[_Names, int, int, int]:
        end = _names_end(view, offset)
        if end + _HEADER_NUMBERS.size <= len(view):
            names = _DECODED_NAMES.get(bytes(view[offset:end]))
            if names is not None:
                round, batch_id = _HEADER_NUMBERS.unpack_from(view, end)
                return names, round, batch_id, end + _HEADER_NUMBERS.size
        at = offset
        decoded = []
        for _, decode_name in name_codecs:
            name, at = decode_name(view, at)
            decoded.append(name)
        names = (decoded[0], decoded[1], decoded[2])
        if at - offset <= _CACHED_TEXT_BYTES:
            _remember(_DECODED_NAMES, bytes(view[offset:at]), names)
        round, at = number_codecs[0][1](view, at)
        batch_id, at = number_codecs[1][1](view, at)
        return names, round, batch_id, at

    return encode_header, decode_header


def _all_finite(array: np.ndarray) -> bool:
    """Whether every value is finite. The sum of squares (one BLAS pass, no temporary) is NaN or
    inf whenever a value is; when it is not finite it may only have overflowed, and the exact
    elementwise test decides."""
    return math.isfinite(np.vdot(array, array)) or bool(np.isfinite(array).all())


def _append_array(where: str, dtype: _Dtype, array: np.ndarray, out: _Parts) -> int:
    """Append the header and the elements of ``array`` as ``dtype`` (converted to it and to C
    order first if it is not in them already, e.g. a big-endian or transposed array)."""
    wire = array.astype(dtype.numpy, order="C", copy=False)
    if dtype.boolean and wire.tobytes().translate(None, _BOOL_BYTES):
        raise ProtocolError(f"{where}: bool bytes 0 or 1 expected, found others.")
    header = _ARRAY_HEADERS[wire.ndim]
    out.append(header.pack(dtype.code, wire.ndim, *wire.shape, wire.nbytes))
    out.append(wire.data)
    return header.size + wire.nbytes


def _check_extent(
    where: str, dtype: np.dtype[Any], shape: tuple[int, ...], nbytes: int, view: memoryview, at: int
) -> None:
    """Refuse an array whose shape, byte count and the bytes left disagree, unless it is empty:
    the decoders' slow path, so that each refusal names the first thing wrong."""
    capacity = dtype.itemsize * math.prod(dim for dim in shape if dim)
    if capacity > _I64_MAX:
        raise ProtocolError(
            f"{where}: an array shape of at most 2**63 - 1 bytes expected, found "
            f"{shape} of {dtype.name}."
        )
    expected = dtype.itemsize * math.prod(shape)
    if nbytes != expected:
        raise ProtocolError(
            f"{where}: shape {shape} of {dtype.name} takes {expected} bytes, found {nbytes} "
            "announced."
        )
    if nbytes > len(view) - at:
        raise _truncated(where, nbytes, view, at)


def _decode_array(where: str, view: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """Read one array into fresh, aligned memory that it owns: the input may sit at any offset
    and may change after decoding. Refuses what does not match its header and non-finite
    floating-point values."""
    size = len(view)
    start = offset + _ARRAY_HEAD.size
    if start > size:
        raise _truncated(where, _ARRAY_HEAD.size, view, offset)
    code, ndim = _ARRAY_HEAD.unpack_from(view, offset)
    dtype = _DTYPES.get(code)
    if dtype is None:
        raise ProtocolError(f"{where}: a dtype code in {sorted(_DTYPES)} expected, found {code}.")
    if ndim > MAX_NDIM:
        raise ProtocolError(f"{where}: at most {MAX_NDIM} dimensions expected, found {ndim}.")
    layout = _ARRAY_SHAPES[ndim]
    offset, start = start, start + layout.size
    if start > size:
        raise _truncated(where, layout.size, view, offset)
    *shape, nbytes = layout.unpack_from(view, offset)
    end = start + nbytes
    numpy_dtype = dtype.numpy
    if not (nbytes and end <= size and nbytes == numpy_dtype.itemsize * math.prod(shape)):
        _check_extent(where, numpy_dtype, tuple(shape), nbytes, view, start)
        return np.empty(shape, numpy_dtype), end  # consistent, and empty
    if dtype.boolean and bytes(view[start:end]).translate(None, _BOOL_BYTES):
        raise ProtocolError(f"{where}: bool bytes 0 or 1 expected, found others.")
    array = np.ndarray(shape, numpy_dtype, view, start).copy()
    if dtype.finite and not _all_finite(array):
        raise NonFiniteError(f"{where}: finite values expected, found non-finite ones.")
    return array, end


def _tensor_codec(where: str) -> _Codec:
    def encode_tensor(value: Any, out: _Parts) -> int:
        if isinstance(value, Tensor):
            # One call into torch per tensor: numpy() itself refuses a tensor that requires grad,
            # is not on the CPU or is not dense; the view's dtype names the wire dtype.
            try:
                array = value.numpy()
            except (RuntimeError, TypeError) as error:
                raise _tensor_refusal(where, value, error) from None
            dtype = _DTYPE_BY_TENSOR_VIEW.get(array.dtype.num)
            if dtype is not None:
                return _append_array(where, dtype, array, out)
        raise _tensor_refusal(where, value)

    def decode_tensor(view: memoryview, offset: int) -> tuple[Tensor, int]:
        array, end = _decode_array(where, view, offset)
        return torch.from_numpy(array), end

    return encode_tensor, decode_tensor


def _tensor_refusal(where: str, value: object, error: Exception | None = None) -> ProtocolError:
    """Why ``value`` cannot be sent as a tensor field (``error``: what ``numpy()`` raised)."""
    if not isinstance(value, Tensor):
        return _refused(where, "a torch.Tensor", value)
    if value.requires_grad:
        return ProtocolError(
            f"{where}: a detached tensor expected, found one that requires grad; detach it "
            "before it leaves the party."
        )
    if not value.is_cpu or value.layout != torch.strided:
        return ProtocolError(
            f"{where}: a dense CPU tensor expected, found {value.layout} on {value.device}."
        )
    if value.dtype not in _DTYPE_BY_TORCH:
        return ProtocolError(f"{where}: dtype in ({_DTYPE_NAMES}) expected, found {value.dtype}.")
    return ProtocolError(f"{where}: a tensor numpy can read expected: {error}")


def _ndarray_codec(where: str) -> _Codec:
    def encode_ndarray(value: Any, out: _Parts) -> int:
        if not isinstance(value, np.ndarray):
            raise _refused(where, "a numpy.ndarray", value)
        dtype = _DTYPE_BY_KIND.get((value.dtype.kind, value.dtype.itemsize))
        if dtype is None:
            raise ProtocolError(
                f"{where}: dtype in ({_DTYPE_NAMES}) expected, found {value.dtype}."
            )
        return _append_array(where, dtype, value, out)

    def decode_ndarray(view: memoryview, offset: int) -> tuple[np.ndarray, int]:
        return _decode_array(where, view, offset)

    return encode_ndarray, decode_ndarray


_SCALAR_CODECS: dict[object, Callable[[str], _Codec]] = {
    int: _int_codec,
    float: _float_codec,
    bool: _bool_codec,
    str: _str_codec,
    bytes: _bytes_codec,
    Tensor: _tensor_codec,
    np.ndarray: _ndarray_codec,
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
            return _optional_codec(where, _codec_for(present[0], where))
    elif origin is Literal:
        if args and all(isinstance(arg, str) for arg in args):
            return _literal_codec(where, args)
    elif origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            for item, item_bytes in _TUPLE_ITEMS.items():
                if args[0] is item:
                    return _tuple_codec(where, _SCALAR_CODECS[item](where), item_bytes)
    else:
        for declared, codec in _SCALAR_CODECS.items():
            if hint is declared:
                return codec(where)
    raise TypeError(f"{where}: a field of type {_SUPPORTED} expected, found {hint}.")


@dataclasses.dataclass(frozen=True)
class _Schema:
    """How one registered message class is laid out on the wire, compiled at registration: its
    constant head, then its other fields (``sender`` to the class's own, in wire order), read
    off a message together by ``values``; the header's by one encoder and decoder, the class's
    own each by its own closures."""

    cls: type[Message]
    kind: str
    schema_version: int  # the one this code speaks: the default of the class's field
    prefix: bytes  # magic, wire version and kind: the same for every message of the class
    head: bytes  # the prefix and schema_version: what every message this code accepts starts with
    values: Callable[[Message], tuple[Any, ...]]
    encode_header: _HeaderEncoder
    decode_header: _HeaderDecoder
    encoders: tuple[_Encoder, ...]
    decoders: tuple[tuple[str, _Decoder], ...]
    build: Callable[[dict[str, Any]], Message]  # the message from every field's decoded value


_SCHEMA_VERSION_ENCODER, _SCHEMA_VERSION_DECODER = _int_codec("schema_version")
_KIND_DECODER = _str_codec("kind")[1]
_KIND_AT = _PREFIX.size  # where the kind's byte count is
MAX_KIND_BYTES = 256  # bounds the head decode looks up before it parses anything
_HEADER_TYPES = (str, str, str, int, int)  # sender, receiver, session, round, batch_id
_SCHEMAS: Registry[_Schema] = Registry("wire message kind")
_SCHEMA_BY_CLASS: dict[type[Message], _Schema] = {}
_SCHEMA_BY_HEAD: dict[bytes, _Schema] = {}


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
    if len(kind.encode("utf-8")) > MAX_KIND_BYTES:
        raise TypeError(f"{kind[:60]}...: a kind of at most {MAX_KIND_BYTES} UTF-8 bytes expected.")
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
    schema_version = defaults["schema_version"]
    if hints["schema_version"] is not int or type(schema_version) is not int:
        raise TypeError(f"{kind}.schema_version: an int with a default expected.")
    declared = tuple(hints[name] for name in HEADER_FIELDS[1:])
    if declared != _HEADER_TYPES:
        raise TypeError(
            f"{kind}: header fields {HEADER_FIELDS[1:]} of types (str, str, str, int, int) "
            f"expected, found {declared}."
        )
    # Five header fields at least: attrgetter of several names returns a tuple.
    own = [name for name in codecs if name not in HEADER_FIELDS]
    encode_header, decode_header = _header_codec(kind)
    prefix = _PREFIX.pack(MAGIC, WIRE_VERSION) + _encoded_text(kind, kind)
    build: Callable[[dict[str, Any]], Message] = lambda values: cls(**values)  # noqa: E731
    if _plain_init(cls):
        build = functools.partial(_filled, cls)
    schema = _Schema(
        cls=cls,
        kind=kind,
        schema_version=schema_version,
        prefix=prefix,
        head=prefix + _I64.pack(schema_version),
        values=operator.attrgetter(*HEADER_FIELDS[1:], *own),
        encode_header=encode_header,
        decode_header=decode_header,
        encoders=tuple(codecs[name][0] for name in own),
        decoders=tuple((name, codecs[name][1]) for name in own),
        build=build,
    )
    _SCHEMAS.register(kind, schema)
    _SCHEMA_BY_CLASS[cls] = schema
    _SCHEMA_BY_HEAD[schema.head] = schema
    return cls


def _plain_init(cls: type) -> bool:
    """Whether the ``__init__`` of the dataclass ``cls`` only stores its arguments: the one
    ``dataclass`` generates, with no ``__post_init__`` and no descriptor or slot in the way."""
    init = getattr(cls, "__init__", None)
    return (
        getattr(init, "__qualname__", "") == f"{cls.__qualname__}.__init__"
        and getattr(getattr(init, "__code__", None), "co_filename", "") == "<string>"
        and not hasattr(cls, "__post_init__")
        and not hasattr(cls, "__slots__")
        and all(
            not hasattr(getattr(cls, field.name, None), "__set__")
            for field in dataclasses.fields(cls)
        )
    )


def _filled(cls: type[MessageT], values: dict[str, Any]) -> MessageT:
    """The message of class ``cls`` whose fields are ``values`` (every one of them), as its
    generated ``__init__`` makes it but without its per-field ``object.__setattr__`` calls:
    a decoded message is built for each one received."""
    message = object.__new__(cls)
    message.__dict__.update(values)
    return message


def kinds() -> list[str]:
    """The registered message kinds (the privacy layer's once their modules are imported)."""
    return _SCHEMAS.names()


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
    version = message.schema_version
    if type(version) is int and version == schema.schema_version:
        out: _Parts = [schema.head]
    else:  # sent as it is, for the receiver to refuse
        out = [schema.prefix]
        _SCHEMA_VERSION_ENCODER(version, out)
    values = schema.values(message)
    size = len(schema.head) + schema.encode_header(values, out)  # the prefix and an i64 either way
    for encode_field, value in zip(schema.encoders, values[5:], strict=True):
        size += encode_field(value, out)
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"{message.kind}: message of {size} bytes exceeds the limit of {MAX_MESSAGE_BYTES}; "
            "a message carries one batch's tensors, so a smaller batch (--batch-size) makes it "
            "smaller."
        )
    return b"".join(out)


def decode(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message ``data`` encodes, validated (:meth:`Message.validate`). Anything malformed,
    non-canonical or invalid raises ProtocolError (NonFiniteError for non-finite values), never
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
    schema = _schema_of(view)
    names, round, batch_id, offset = schema.decode_header(view, len(schema.head))
    values: dict[str, Any] = {
        "schema_version": schema.schema_version,
        "sender": names[0],
        "receiver": names[1],
        "session": names[2],
        "round": round,
        "batch_id": batch_id,
    }
    try:
        for name, decode_field in schema.decoders:
            values[name], offset = decode_field(view, offset)
    except NonFiniteError as error:  # say whose, and at which step: a run that diverged
        phase = values.get("phase", "train")  # a message's phase precedes its tensors
        when = f"round {round}" if phase == "train" else f"phase {shown(phase)}"
        raise NonFiniteError(
            f"{schema.kind} from {names[0]} ({when}): {error}",
            step=round if phase == "train" else None,
        ) from None
    if offset != len(view):
        raise ProtocolError(
            f"{schema.kind}: the message ends after {offset} bytes, found {len(view) - offset} "
            "more."
        )
    message = schema.build(values)
    try:
        message.validate()
    except ProtocolError:
        raise
    except Exception as error:
        raise ProtocolError(f"{schema.kind} from {message.sender}: invalid: {error}") from error
    return message


@dataclasses.dataclass(frozen=True)
class Header:
    """What every message's header says: its kind, who sent it to whom, in which session, for
    which round and batch."""

    kind: str
    sender: str
    receiver: str
    session: str
    round: int
    batch_id: int


def header_of(data: bytes) -> Header:
    """The header of the message ``data`` encodes, read without its other fields: what a
    capture shows of a message :func:`decode` refuses for its values (a diverged run's NaN).
    ProtocolError where the head or the header itself does not parse."""
    try:
        view = memoryview(data).cast("B")
        schema = _schema_of(view)
        names, round, batch_id, _ = schema.decode_header(view, len(schema.head))
    except ProtocolError:
        raise
    except Exception as error:
        raise ProtocolError(f"undecodable header: {type(error).__name__}: {error}") from error
    return Header(schema.kind, *names, round=round, batch_id=batch_id)


def _schema_of(view: memoryview) -> _Schema:
    """The schema of the message in ``view``, whose head it starts with. A registered head is
    found in one look-up; anything else is parsed field by field, which names what is wrong."""
    if len(view) >= _KIND_AT + 8:
        kind_bytes: int = _U64.unpack_from(view, _KIND_AT)[0]
        if kind_bytes <= MAX_KIND_BYTES:
            schema = _SCHEMA_BY_HEAD.get(bytes(view[: _KIND_AT + 16 + kind_bytes]))
            if schema is not None:
                return schema
    if len(view) < _PREFIX.size:
        raise _truncated("header", _PREFIX.size, view, 0)
    magic, version = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise ProtocolError(
            f"magic bytes {MAGIC!r} expected, found {magic!r}: not a secure-vfl message."
        )
    if version != WIRE_VERSION:
        raise VersionError(f"wire version {WIRE_VERSION} expected, found {version}.")
    kind, offset = _KIND_DECODER(view, _KIND_AT)
    try:
        schema = _SCHEMAS.get(kind)
    except RegistryError:
        raise ProtocolError(
            f"a message kind in ({', '.join(_SCHEMAS.names())}) expected (the privacy layer's "
            "kinds register when their module is imported, e.g. protocols.psi for psi-*), found "
            f"{shown(kind)}."
        ) from None
    schema_version, offset = _SCHEMA_VERSION_DECODER(view, offset)
    if schema_version != schema.schema_version:
        raise VersionError(
            f"{kind}: schema version {schema.schema_version} expected, found {schema_version}."
        )
    return schema
