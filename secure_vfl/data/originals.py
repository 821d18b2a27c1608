"""Loaders for the papers' original datasets from a user-given directory, in published formats.

Nothing is downloaded: the user points at the files they obtained (CIFAR python batches, UCI
HAPT text files, UCI credit default CSV/XLS). Missing or malformed files raise ``DataError``
saying which file was expected where and what was found.
"""

from __future__ import annotations

import importlib
import importlib.util
import pickle
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from secure_vfl.data.datasets import DatasetSplit, LabeledArrays
from secure_vfl.data.preprocessing import stratified_split
from secure_vfl.errors import ConfigError, DataError

_CIFAR_PICKLE_GLOBALS: dict[tuple[str, str], tuple[str, str]] = {
    ("_codecs", "encode"): ("_codecs", "encode"),
    ("numpy", "ndarray"): ("numpy", "ndarray"),
    ("numpy", "dtype"): ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"): ("numpy._core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"): ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"): ("numpy._core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"): ("numpy._core.numeric", "_frombuffer"),
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists and numpy arrays only: a CIFAR batch needs nothing else, and
    refusing other globals keeps a tampered file from running code."""

    def find_class(self, module: str, name: str) -> Any:
        target = _CIFAR_PICKLE_GLOBALS.get((module, name))
        if target is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return getattr(importlib.import_module(target[0]), target[1])


def _expect_file(path: Path) -> Path:
    if not path.is_file():
        found = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else None
        where = (
            f"{path.parent} contains {found[:10]}"
            if found is not None
            else (f"{path.parent} does not exist")
        )
        raise DataError(f"expected {path.name} at {path}. Found no such file ({where}).")
    return path


def _read_cifar_batch(path: Path, label_key: bytes) -> LabeledArrays:
    """One CIFAR python batch: ``b"data"`` (N, 3072) uint8 and a list of N labels."""
    _expect_file(path)
    try:
        with path.open("rb") as handle:
            batch = _ArrayOnlyUnpickler(handle, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
        raise DataError(f"{path} must be a CIFAR python pickle batch. Found: {error}.") from None
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise DataError(f"{path} must be a dict with keys b'data' and {label_key!r}. Found {keys}.")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(
            f"{path}: b'data' must be uint8 of shape (N, 3072). Found {data.dtype} {data.shape}."
        )
    if labels.shape != (data.shape[0],) or labels.dtype.kind not in "iu":
        raise DataError(
            f"{path}: {label_key!r} must hold {data.shape[0]} integer labels. "
            f"Found {labels.dtype} of shape {labels.shape}."
        )
    images = data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    return LabeledArrays(images, labels.astype(np.int64))


def _concat(parts: list[LabeledArrays]) -> LabeledArrays:
    return LabeledArrays(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]))


def load_cifar(data_dir: Path, *, which: Literal[10, 100]) -> DatasetSplit:
    """CIFAR-10 (``cifar-10-batches-py/data_batch_1..5``, ``test_batch``) or CIFAR-100
    (``cifar-100-python/train``, ``test``, fine labels); images (N, 3, 32, 32) in [0, 1]."""
    data_dir = Path(data_dir)
    if which == 10:
        folder, train_names, test_name = (
            "cifar-10-batches-py",
            [f"data_batch_{i}" for i in range(1, 6)],
            "test_batch",
        )
        label_key = b"labels"
    elif which == 100:
        folder, train_names, test_name = "cifar-100-python", ["train"], "test"
        label_key = b"fine_labels"
    else:
        raise ConfigError(f"`which` must be 10 or 100. Found {which!r}.")
    root = data_dir if data_dir.name == folder else data_dir / folder
    train = _concat([_read_cifar_batch(root / name, label_key) for name in train_names])
    test = _read_cifar_batch(root / test_name, label_key)
    for part, arrays in (("train", train), ("test", test)):
        if arrays.y.size and int(arrays.y.max()) >= which:
            raise DataError(
                f"CIFAR-{which} {part} labels must be in 0..{which - 1}. "
                f"Found {int(arrays.y.max())}."
            )
    return DatasetSplit(
        name=f"cifar-{which}", kind="image", train=train, test=test, num_classes=which
    )


def _read_whitespace_table(path: Path) -> np.ndarray:
    """A whitespace-separated numeric text file as a float64 (rows, cols) array."""
    _expect_file(path)
    try:
        frame = pd.read_csv(path, sep=r"\s+", header=None, dtype=np.float64)
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as error:
        raise DataError(
            f"{path} must hold whitespace-separated numbers. Found: {str(error)[:200]}."
        ) from None
    values = frame.to_numpy()
    if values.size == 0 or not np.isfinite(values).all():
        raise DataError(f"{path} must hold finite numbers. Found {values.shape} with NaN or inf.")
    return values


HAPT_CLASSES = 12


def load_hapt(data_dir: Path) -> DatasetSplit:
    """UCI HAPT (smartphone activities and postural transitions): 561 features, labels 1..12
    in ``Train/`` and ``Test/`` mapped to 0..11; the published train/test split."""
    data_dir = Path(data_dir)
    parts = []
    for part, folder in (("train", "Train"), ("test", "Test")):
        x = _read_whitespace_table(data_dir / folder / f"X_{part}.txt")
        y = _read_whitespace_table(data_dir / folder / f"y_{part}.txt")
        if y.shape[1] != 1 or y.shape[0] != x.shape[0]:
            raise DataError(
                f"{data_dir / folder / f'y_{part}.txt'} must hold one label per row of "
                f"X_{part}.txt ({x.shape[0]}). Found shape {y.shape}."
            )
        labels = y[:, 0]
        if not np.all((labels == np.round(labels)) & (labels >= 1) & (labels <= HAPT_CLASSES)):
            raise DataError(
                f"HAPT {part} labels must be integers 1..{HAPT_CLASSES}. "
                f"Found values {np.unique(labels)[:10].tolist()}."
            )
        parts.append(LabeledArrays(x.astype(np.float32), labels.astype(np.int64) - 1))
    train, test = parts
    if train.x.shape[1] != test.x.shape[1]:
        raise DataError(
            f"HAPT train and test must have the same features. "
            f"Found {train.x.shape[1]} and {test.x.shape[1]} columns."
        )
    return DatasetSplit(name="hapt", kind="tabular", train=train, test=test, num_classes=12)


CREDIT_CSV = "UCI_Credit_Card.csv"
CREDIT_XLS = "default of credit card clients.xls"
_EXCEL_ENGINES: tuple[tuple[Literal["calamine", "xlrd"], str], ...] = (
    ("calamine", "python_calamine"),
    ("xlrd", "xlrd"),
)
"""(pandas engine, module) pairs that can read the original .xls, in order of preference."""
_CREDIT_LABELS = ("default.payment.next.month", "default payment next month")


def _read_credit_frame(data_dir: Path) -> tuple[pd.DataFrame, Path]:
    csv, xls = data_dir / CREDIT_CSV, data_dir / CREDIT_XLS
    if csv.is_file():
        try:
            return pd.read_csv(csv), csv
        except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as error:
            raise DataError(f"{csv} must be a CSV file. Found: {str(error)[:200]}.") from None
    if xls.is_file():
        engine = next((e for e in _EXCEL_ENGINES if importlib.util.find_spec(e[1])), None)
        if engine is None:
            raise DataError(
                f"reading {xls} needs an Excel reader (xlrd or python-calamine). Found neither "
                f"installed; convert the sheet to CSV as {csv} (columns ID, LIMIT_BAL, ..., "
                "default.payment.next.month) or install xlrd."
            )
        try:
            # The published sheet has a row of codes (X1..X23, Y) above the column names.
            return pd.read_excel(xls, header=1, engine=engine[0]), xls
        except (ValueError, OSError) as error:
            raise DataError(f"{xls} must be an Excel sheet. Found: {str(error)[:200]}.") from None
    found = sorted(p.name for p in data_dir.iterdir())[:10] if data_dir.is_dir() else "no directory"
    raise DataError(f"expected {CREDIT_CSV} or {CREDIT_XLS!r} in {data_dir}. Found {found}.")


def load_credit_default(data_dir: Path, *, rng: np.random.Generator) -> DatasetSplit:
    """UCI default of credit card clients (30000 x 23, 2 classes) with a seeded stratified
    80/20 split; reads ``UCI_Credit_Card.csv`` or the original ``.xls``."""
    frame, path = _read_credit_frame(Path(data_dir))
    label_column = next((c for c in _CREDIT_LABELS if c in frame.columns), None)
    if label_column is None or "ID" not in frame.columns:
        raise DataError(
            f"{path} must have columns ID and {_CREDIT_LABELS[0]}. Found {list(frame.columns)}."
        )
    labels = frame[label_column]
    if not labels.isin([0, 1]).all():
        raise DataError(
            f"{path}: `{label_column}` must be 0 or 1. Found {sorted(labels.unique())[:5]}."
        )
    features = frame.drop(columns=["ID", label_column])
    non_numeric = [c for c in features.columns if not pd.api.types.is_numeric_dtype(features[c])]
    if non_numeric or features.shape[1] == 0:
        raise DataError(
            f"{path}: features must be numeric. Found non-numeric columns {non_numeric}."
        )
    x = features.to_numpy(dtype=np.float32, na_value=np.nan)
    if not np.isfinite(x).all():
        raise DataError(
            f"{path}: features must be finite. Found {int((~np.isfinite(x)).sum())} not."
        )
    y = labels.to_numpy().astype(np.int64)
    train, test = stratified_split(y, 0.2, rng=rng)
    return DatasetSplit(
        name="credit-default",
        kind="tabular",
        train=LabeledArrays(x[train], y[train]),
        test=LabeledArrays(x[test], y[test]),
        num_classes=2,
        feature_names=tuple(str(c) for c in features.columns),
    )
