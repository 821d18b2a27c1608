"""Tensor files (saved model parts, checkpoints): what is written reads back the same, and
anything else is refused with IntegrityError, without unpickling."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import struct
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_vfl import checkpoints, tensor_file
from secure_vfl.errors import IntegrityError
from secure_vfl.federation import parts


def _tree() -> dict[str, Any]:
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "modules": {"bottom/subset:0,1": {"weight": weights, "row": weights[1], "t": weights.t()}},
        "optimizers": {"sgd": {}},
        "generators": {"plan": torch.Generator().manual_seed(3).get_state()},
        "order": None,
        "schedule": [[torch.tensor([4, 0, 2])], [], [torch.empty(0, dtype=torch.int64)]],
        "flags": (torch.tensor([True, False]), torch.tensor(7)),
    }


def _same(saved: Any, read: Any) -> None:
    if isinstance(saved, torch.Tensor):
        assert isinstance(read, torch.Tensor)
        assert read.dtype == saved.dtype and torch.equal(read, saved)
    elif isinstance(saved, dict):
        assert isinstance(read, dict) and list(read) == list(saved)
        for key in saved:
            _same(saved[key], read[key])
    elif isinstance(saved, list | tuple):
        assert isinstance(read, list) and len(read) == len(saved)
        for a, b in zip(saved, read, strict=True):
            _same(a, b)
    else:
        assert saved is None and read is None


def test_a_tree_of_tensors_reads_back_the_same_in_memory_of_its_own() -> None:
    tree = _tree()
    data = tensor_file.dumps(tree)
    read = tensor_file.loads(data, "f")
    _same(tree, read)
    # Views of one tensor (a row, a transpose) are written as tensors of their own, and what
    # is read is writable memory that neither the file's bytes nor the other tensors share.
    row = read["modules"]["bottom/subset:0,1"]["row"]
    row.add_(100)
    assert torch.equal(
        read["modules"]["bottom/subset:0,1"]["weight"][1],
        tree["modules"]["bottom/subset:0,1"]["weight"][1],
    )
    assert tensor_file.loads(data, "f")["modules"]["bottom/subset:0,1"]["row"][0] == 4


def test_what_is_not_a_tree_of_tensors_is_not_written() -> None:
    with pytest.raises(TypeError, match=r"tensors\.a: text keys expected"):
        tensor_file.dumps({"a": {0: torch.zeros(1)}})
    with pytest.raises(TypeError, match=r"tensors\[1\]: a tensor, None, dict or list expected"):
        tensor_file.dumps([torch.zeros(1), 0.5])


def _with_layout(tensors: dict[str, torch.Tensor], layout: Any) -> bytes:
    return safetensors.torch.save(tensors, metadata={tensor_file.LAYOUT_KEY: json.dumps(layout)})


def _nested(depth: int) -> Any:
    layout = None
    for _ in range(depth):
        layout = {"list": [layout]}
    return layout


def _nested_text(depth: int) -> bytes:
    text = '{"list": [' * depth + "null" + "]}" * depth
    return safetensors.torch.save({}, metadata={tensor_file.LAYOUT_KEY: text})


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "expected; refused"),
        (b"\x00" * 7, "expected; refused"),
        # a safetensors file of another program: "refused ('__metadata__')"
        (safetensors.torch.save({"0": torch.zeros(2)}), r"refused \(its metadata holds no '__m"),
        (_with_layout({"0": torch.zeros(2)}, {"tensor": "1"}), "tensor '1' of its layout expe"),
        (_with_layout({"0": torch.zeros(2)}, {"tensor": "0", "dict": {}}), "a layout node"),
        (_with_layout({"0": torch.zeros(2)}, {"list": [{"tensor": "0"}] * 2}), "laid out twice"),
        (_with_layout({"0": torch.zeros(2), "1": torch.ones(1)}, {"tensor": "0"}), "unused"),
        (_with_layout({"0": torch.zeros(2)}, {"object": "os.system"}), "a layout node"),
        (_with_layout({}, _nested(17)), "nested at most 16 deep"),
        (_nested_text(100_000), "refused .its metadata is nested too deeply to read"),
    ],
)
def test_a_file_that_is_not_a_tensor_file_of_ours_is_refused(data: bytes, reason: str) -> None:
    with pytest.raises(IntegrityError, match=f"^where: .*{reason}"):
        tensor_file.loads(data, "where")


def test_a_pickled_state_dict_is_refused_not_unpickled() -> None:
    buffer = io.BytesIO()
    torch.save({"weight": torch.zeros(2)}, buffer)
    with pytest.raises(IntegrityError, match=r"a secure-vfl tensor file .* expected; refused"):
        tensor_file.loads(buffer.getvalue(), "model.pt")


def test_a_truncated_or_extended_file_is_refused() -> None:
    data = tensor_file.dumps(_tree())
    for altered in (data[:-1], data + b"\x00", data[: len(data) // 2]):
        with pytest.raises(IntegrityError, match="expected; refused"):
            tensor_file.loads(altered, "f")


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.data())
def test_loads_refuses_any_altered_file_with_integrity_error_only(data: st.DataObject) -> None:
    original = bytearray(tensor_file.dumps(_tree()))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(original) - 1))
        original[at] = data.draw(st.integers(0, 255))
    # An altered header is refused; an altered buffer reads back as other numbers.
    with contextlib.suppress(IntegrityError):
        tensor_file.loads(bytes(original), "f")


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_loads_refuses_arbitrary_bytes_with_integrity_error_only(data: bytes) -> None:
    header = struct.pack("<Q", len(data)) + data
    for candidate in (data, header):
        with contextlib.suppress(IntegrityError):
            tensor_file.loads(candidate, "f")


def test_the_modules_that_read_models_and_checkpoints_never_unpickle() -> None:
    for module in (tensor_file, parts, checkpoints):
        source = inspect.getsource(module)
        for forbidden in ("import pickle", "torch.load(", "pickle.load", "eval(", "exec("):
            assert forbidden not in source, (module.__name__, forbidden)
