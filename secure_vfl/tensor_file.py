"""Tensors on disk without pickle: a party's saved model parts and checkpoints.

A tensor file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file: a JSON header
(every tensor's dtype, shape and byte range) and the raw buffers, read back by the library's
parser, which builds tensors from those buffers and nothing else (no code, no object of any
other type, unlike ``torch.load``, whose weights-only unpickler is still an unpickler).
Nested containers (a checkpoint's modules, optimisers and generators by name, lists of batch
orders) are kept by their *layout*, a JSON document in the header's text metadata
(``__metadata__``) that names each leaf's tensor::

    null | {"tensor": "<key>"} | {"dict": {"<name>": layout, ...}} | {"list": [layout, ...]}

:func:`loads` accepts only a file whose layout uses every tensor exactly once.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import safetensors
from safetensors.torch import load as read_safetensors
from safetensors.torch import save as write_safetensors
from torch import Tensor

from secure_vfl.errors import IntegrityError

LAYOUT_KEY = "secure-vfl/layout"
"""The header metadata entry that holds a tensor file's layout."""
SUFFIX = ".safetensors"
MAX_DEPTH = 16
"""How deeply a layout may nest (a checkpoint's is 5 deep)."""
_HEADER_LENGTH = struct.Struct("<Q")


def dumps(tree: Any) -> bytes:
    """The tensor file of ``tree``: tensors, None, and dicts (str keys) and lists or tuples of
    them (a tuple reads back as a list). TypeError for anything else."""
    tensors: dict[str, Tensor] = {}
    storages: set[int] = set()

    def layout_of(node: Any, path: str) -> Any:
        if isinstance(node, Tensor):
            tensor = node.detach().cpu().contiguous()
            storage = tensor.untyped_storage().data_ptr()
            if storage in storages and tensor.numel():  # safetensors keeps no shared memory
                tensor = tensor.clone()
            storages.add(tensor.untyped_storage().data_ptr())
            key = str(len(tensors))
            tensors[key] = tensor
            return {"tensor": key}
        if node is None:
            return None
        if isinstance(node, Mapping):
            if not all(isinstance(name, str) for name in node):
                raise TypeError(f"{path}: text keys expected, found {sorted(map(repr, node))}.")
            return {
                "dict": {name: layout_of(value, f"{path}.{name}") for name, value in node.items()}
            }
        if isinstance(node, list | tuple):
            return {"list": [layout_of(value, f"{path}[{i}]") for i, value in enumerate(node)]}
        raise TypeError(
            f"{path}: a tensor, None, dict or list expected, found {type(node).__name__}."
        )

    layout = layout_of(tree, "tensors")
    return write_safetensors(tensors, metadata={LAYOUT_KEY: json.dumps(layout)})


def loads(data: bytes, where: str) -> Any:
    """The tree a tensor file holds (tensors in memory of their own, on the CPU); IntegrityError
    saying what is wrong for anything else (another format, a truncated or altered header, a
    layout that does not use each tensor once)."""
    try:
        tensors = read_safetensors(data)
        # The library has checked the header; its metadata is not returned by load.
        (length,) = _HEADER_LENGTH.unpack_from(data)
        metadata = json.loads(data[_HEADER_LENGTH.size : _HEADER_LENGTH.size + length])
        layout = json.loads(metadata["__metadata__"][LAYOUT_KEY])
    except (
        safetensors.SafetensorError,
        struct.error,
        ValueError,
        KeyError,
        TypeError,
        RecursionError,  # JSON nested beyond the interpreter's stack
    ) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if isinstance(error, KeyError):  # a safetensors file, but not one this code wrote
            first = f"its metadata holds no {error.args[0]!r}"
        elif isinstance(error, RecursionError):
            first = "its metadata is nested too deeply to read"
        raise IntegrityError(
            f"{where}: a secure-vfl tensor file (safetensors with its layout) expected; "
            f"refused ({first})."
        ) from None
    used: set[str] = set()
    tree = _build(layout, tensors, used, where, MAX_DEPTH)
    if used != set(tensors):
        raise IntegrityError(
            f"{where}: a layout that uses every tensor expected; "
            f"{len(set(tensors) - used)} tensor(s) unused."
        )
    return tree


def _build(node: Any, tensors: Mapping[str, Tensor], used: set[str], where: str, depth: int) -> Any:
    if node is None:
        return None
    if depth == 0:
        raise IntegrityError(f"{where}: a layout nested at most {MAX_DEPTH} deep expected.")
    if isinstance(node, dict) and len(node) == 1:
        [(kind, value)] = node.items()
        if kind == "tensor" and isinstance(value, str):
            if value not in tensors:
                raise IntegrityError(
                    f"{where}: tensor {value[:40]!r} of its layout expected in the file; found "
                    f"none of that name ({len(tensors)} tensor(s) in it)."
                )
            if value in used:
                raise IntegrityError(f"{where}: tensor {value!r} laid out twice; refused.")
            used.add(value)
            return tensors[value]
        if kind == "dict" and isinstance(value, dict):
            return {
                name: _build(item, tensors, used, where, depth - 1) for name, item in value.items()
            }
        if kind == "list" and isinstance(value, list):
            return [_build(item, tensors, used, where, depth - 1) for item in value]
    raise IntegrityError(
        f"{where}: a layout node (null, tensor, dict or list) expected, found {_shown(node)}."
    )


def _shown(node: Any) -> str:
    text = json.dumps(node)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
