"""The user's own vertical data: one CSV or Parquet file per party plus a label file.

A party file has an ``id`` column and that party's numeric feature columns; the label file has
``id`` and ``label``. Ids are compared as text, so ``007`` in a CSV stays ``007``. Files are
validated on read, so a bad file fails here with a message naming the problem, not deep inside
training.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from secure_vfl.errors import DataError

ID_COLUMN = "id"
LABEL_COLUMN = "label"
_SUFFIXES = (".csv", ".parquet", ".pq")


@dataclass(frozen=True)
class PartyTable:
    """One party's rows: ``ids`` (str, unique), ``features`` (float32, (N, D)), column names."""

    name: str
    ids: np.ndarray
    features: np.ndarray
    columns: tuple[str, ...]


@dataclass(frozen=True)
class LabelTable:
    """The label party's rows: ``ids`` (str, unique), ``labels`` (int64 in 0..C-1) and the
    original label value of each class index, sorted."""

    ids: np.ndarray
    labels: np.ndarray
    classes: tuple[object, ...]


def read_table(path: Path, *, what: str = "data file") -> pd.DataFrame:
    """Read a non-empty CSV or Parquet file; an ``id`` column, if any, is read as text."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise DataError(f"{path} must be a .csv or .parquet file. Found suffix {suffix!r}.")
    if not path.is_file():
        raise DataError(f"expected a {what} at {path}. Found no such file.")
    try:
        if suffix == ".csv":
            frame = pd.read_csv(path, dtype={ID_COLUMN: str})
        else:
            frame = pd.read_parquet(path)
    except (ValueError, OSError, pd.errors.ParserError) as error:
        raise DataError(f"{path} could not be read as {suffix[1:]}: {error}") from None
    frame.columns = [str(c) for c in frame.columns]
    if len(frame) == 0:
        raise DataError(f"{path} must have at least one row. Found none.")
    return frame


def _read_frame(path: Path) -> pd.DataFrame:
    """Read a party or label file, which must have the ``id`` column."""
    frame = read_table(path)
    if ID_COLUMN not in frame.columns:
        raise DataError(
            f"{path} must have an `{ID_COLUMN}` column. Found columns: {list(frame.columns)}."
        )
    return frame


def _read_ids(frame: pd.DataFrame, path: Path) -> np.ndarray:
    """The ``id`` column as unique strings; empty and duplicate ids are refused."""
    column = frame[ID_COLUMN]
    empty = int(column.isna().sum())
    if empty:
        first = int(np.flatnonzero(column.isna().to_numpy())[0])
        raise DataError(
            f"{path}: every row must have an id. Found {empty} empty (first at row {first})."
        )
    ids = column.astype(str).to_numpy(dtype=str)
    unique, counts = np.unique(ids, return_counts=True)
    if unique.size != ids.size:
        repeated = unique[counts > 1]
        raise DataError(
            f"{path}: ids must be unique. Found {repeated.size} repeated, "
            f"e.g. {', '.join(map(repr, repeated[:3].tolist()))}."
        )
    return ids


def read_party_file(path: Path) -> PartyTable:
    """Read and validate one party's file: unique ids, at least one finite numeric feature."""
    path = Path(path)
    frame = _read_frame(path)
    ids = _read_ids(frame, path)
    feature_frame = frame.drop(columns=ID_COLUMN)
    if feature_frame.shape[1] == 0:
        raise DataError(f"{path} must have at least one feature column besides `id`. Found none.")
    non_numeric = [
        str(c) for c in feature_frame.columns if not pd.api.types.is_numeric_dtype(feature_frame[c])
    ]
    if non_numeric:
        raise DataError(
            f"{path}: feature columns must be numeric. Found non-numeric columns: {non_numeric}."
        )
    values = feature_frame.to_numpy(dtype=np.float64, na_value=np.nan)
    missing = np.isnan(values)
    if missing.any():
        bad_columns = missing.any(axis=0)
        columns = [str(c) for c, bad in zip(feature_frame.columns, bad_columns, strict=True) if bad]
        raise DataError(
            f"{path}: features must not be missing. Found {int(missing.sum())} missing values in "
            f"{int(missing.any(axis=1).sum())} rows, columns {columns}; impute or drop them first."
        )
    features = values.astype(np.float32)
    if not np.isfinite(features).all():
        raise DataError(
            f"{path}: features must be finite float32 values. "
            f"Found {int((~np.isfinite(features)).sum())} infinite or too large."
        )
    return PartyTable(
        name=path.stem,
        ids=ids,
        features=features,
        columns=tuple(str(c) for c in feature_frame.columns),
    )


def read_label_file(path: Path) -> LabelTable:
    """Read the label file: ``id`` and ``label`` columns; labels map to 0..C-1 in sorted order.

    Other columns are ignored.
    """
    path = Path(path)
    frame = _read_frame(path)
    if LABEL_COLUMN not in frame.columns:
        raise DataError(
            f"{path} must have a `{LABEL_COLUMN}` column. Found columns: {list(frame.columns)}."
        )
    ids = _read_ids(frame, path)
    column = frame[LABEL_COLUMN]
    if column.isna().any():
        raise DataError(
            f"{path}: every row must have a label. Found {int(column.isna().sum())} empty."
        )
    values = column.tolist()
    try:
        classes = tuple(sorted(set(values)))
    except TypeError:
        raise DataError(
            f"{path}: labels must be of one sortable kind (all numbers or all text). "
            f"Found types {sorted({type(v).__name__ for v in values})}."
        ) from None
    if len(classes) < 2:
        raise DataError(f"{path}: a classifier needs at least 2 classes. Found {list(classes)}.")
    index = {value: position for position, value in enumerate(classes)}
    labels = np.fromiter((index[v] for v in values), dtype=np.int64, count=len(values))
    return LabelTable(ids=ids, labels=labels, classes=classes)


def check_party_tables(
    tables: list[PartyTable], paths: list[Path], labels: LabelTable, label_path: Path
) -> None:
    """Refuse the mistakes that would train silently on wrong data: two party files holding
    the same table (one file given twice, or a copy), and a party file holding the label (a
    ``label`` column, or a column equal to the label up to a renaming of its classes on the
    ids it shares with the label file: the label file given as a party file, say)."""
    for k, table in enumerate(tables):
        for j in range(k):
            if _same_table(tables[j], table):
                raise DataError(
                    f"party files {paths[j]} and {paths[k]} hold the same table (same ids, "
                    "columns and values); expected one file per party, each with its own "
                    "features."
                )
    for table, path in zip(tables, paths, strict=True):
        if LABEL_COLUMN in table.columns:
            raise DataError(
                f"party file {path} has a `{LABEL_COLUMN}` column, which would become a "
                f"feature; expected features only (is it the label file {label_path}?)."
            )
        leaked = _label_columns(table, labels)
        if leaked:
            raise DataError(
                f"party file {path}: column {leaked[0]!r} equals the label of {label_path} on "
                "every shared id, so it would hand the model the answer; expected features "
                "only (drop that column)."
            )


def _same_table(first: PartyTable, second: PartyTable) -> bool:
    if first.columns != second.columns or first.features.shape != second.features.shape:
        return False
    order_first, order_second = np.argsort(first.ids), np.argsort(second.ids)
    return bool(
        np.array_equal(first.ids[order_first], second.ids[order_second])
        and np.array_equal(first.features[order_first], second.features[order_second])
    )


MIN_SHARED_FOR_LEAK = 10
"""Ids a party must share with the label file before a column equal to the label is refused
(on a handful of rows a binary feature can match the label by chance)."""


def _label_columns(table: PartyTable, labels: LabelTable) -> list[str]:
    """The columns of ``table`` that equal the label up to a renaming of the classes (one
    value per class, a different value for each class) on the ids both hold."""
    shared, rows, label_rows = np.intersect1d(table.ids, labels.ids, return_indices=True)
    if shared.size < MIN_SHARED_FOR_LEAK:
        return []
    label = labels.labels[label_rows]
    classes = np.unique(label).size
    if classes < 2:
        return []
    leaked = []
    for c, column in enumerate(table.columns):
        values = table.features[rows, c]
        pairs = np.unique(np.stack([values, label.astype(values.dtype)]), axis=1).shape[1]
        if np.unique(values).size == classes and pairs == classes:
            leaked.append(column)
    return leaked


def describe_unmatched(table: PartyTable, path: Path, labels: LabelTable, label_path: Path) -> str:
    """The message for a party file none of whose ids is in the label file: an example id of
    each side, as ids are compared as text (``0304`` is not ``304``)."""
    return (
        f"no ids matched between party file {path} and label file {label_path} (e.g. "
        f"{str(table.ids[0])!r} in the party file, {str(labels.ids[0])!r} in the label file); ids "
        "are compared as text, so expected the same format on both sides (leading zeros, "
        "spaces, decimals)."
    )
