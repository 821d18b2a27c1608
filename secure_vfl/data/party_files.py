"""The user's own vertical data: one CSV or Parquet file per party plus a label file.

A party file has an id column (``id`` unless named otherwise) and that party's feature columns,
numeric or categorical (text), possibly with empty cells; the label file has the id column and a
label column (``label`` unless named otherwise). Ids are compared as the text in the file, so
``007`` in a CSV stays ``007`` and is not ``7``. Files are validated on read, so a bad file fails
here with a message naming the problem, not deep inside training. What a party does to its raw
columns (one-hot encoding, missing cells, standardisation) is
:mod:`secure_vfl.data.party_preprocessing`'s.
"""

from __future__ import annotations

import csv
import datetime
import decimal
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pandas as pd

from secure_vfl.errors import ConfigError, DataError, RunWarning

ID_COLUMN = "id"
LABEL_COLUMN = "label"
MAX_CLASSES_FREE = 20
"""Classes a label file may always have; more must leave at least two rows a class on average:
a label of about one class per row is a quantity (regression), not a class."""
_SUFFIXES = (".csv", ".parquet", ".pq")


@dataclass(frozen=True)
class PartyTable:
    """One party's rows: ``ids`` (str, unique) and ``frame``, its raw feature columns (numbers
    or text, NaN where a cell is empty) in file order, one row per id. Checked and its columns
    made numbers or text on construction (:func:`feature_columns`, on a copy of ``frame``), as
    for a file, whichever way it was built (``PartyTable(name, np.asarray(ids, dtype=str),
    frame)`` from a DataFrame); ``booleans``: the columns that held True/False, now 1/0 (a
    saved model warns of them where it was trained on other numbers)."""

    name: str
    ids: np.ndarray
    frame: pd.DataFrame
    booleans: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name):
            raise ConfigError(f"a party table's name must be a non-empty str. Found {self.name!r}.")
        if not isinstance(self.frame, pd.DataFrame):
            raise TypeError(
                f"{self.name}: frame: a pandas DataFrame expected, found "
                f"{type(self.frame).__name__}."
            )
        repeated = sorted({str(c) for c in self.frame.columns[self.frame.columns.duplicated()]})
        if repeated:  # one of them would be read as the other (a TypeError deep in predict)
            raise DataError(
                f"{self.name}: column names must be distinct. Found {repeated} repeated."
            )
        frame = self.frame.copy()
        booleans = feature_columns(frame, self.name)
        object.__setattr__(self, "frame", frame)
        object.__setattr__(self, "booleans", tuple(dict.fromkeys([*self.booleans, *booleans])))
        ids = self.ids
        if not (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind == "U"):
            found = f"dtype {ids.dtype}, shape {ids.shape}" if isinstance(ids, np.ndarray) else ""
            raise TypeError(
                f"{self.name}: ids: a 1-d numpy array of str expected (np.asarray(ids, "
                f"dtype=str)), found {type(ids).__name__} {found}".rstrip()
                + "."
            )
        if ids.size != len(self.frame):
            raise DataError(
                f"{self.name}: one id per row expected, found {ids.size} ids for "
                f"{len(self.frame)} rows."
            )
        empty = int(np.count_nonzero(ids == ""))
        if empty:
            raise DataError(f"{self.name}: every row must have an id. Found {empty} empty.")
        _check_unique(ids, self.name)
        infinite = _infinite_column(self.frame)
        if infinite is not None:
            column, count = infinite
            raise DataError(
                f"{self.name}: column {column!r} must hold finite float32 values. Found "
                f"{count} infinite or too large."
            )

    @property
    def columns(self) -> tuple[str, ...]:
        """The feature columns' names, in file order."""
        return tuple(str(c) for c in self.frame.columns)

    def subset(self, rows: np.ndarray) -> PartyTable:
        """The rows at ``rows`` (integer indices or a bool mask), in that order."""
        return PartyTable(
            name=self.name,
            ids=self.ids[rows],
            frame=self.frame.iloc[np.asarray(rows)].reset_index(drop=True),
            booleans=self.booleans,
        )


@dataclass(frozen=True)
class LabelTable:
    """The label party's rows: ``ids`` (str, unique), ``labels`` (int64 in 0..C-1) and the
    original label value of each class index, sorted."""

    ids: np.ndarray
    labels: np.ndarray
    classes: tuple[object, ...]


def read_table(
    path: Path,
    *,
    what: str = "data file",
    id_column: str = ID_COLUMN,
    literal: Sequence[str] = (),
    nullable: bool = False,
    blank_cells: bool = False,
) -> pd.DataFrame:
    """Read a non-empty CSV or Parquet file whose column names are distinct and non-empty; the
    ``id_column``, if any, is read as text. In a CSV, the id column and the ``literal`` ones
    (a label column) are read as written: only an empty cell is missing there, where pandas
    would also read ``NA``, ``null`` or ``None`` (a region, a name) as missing. ``nullable``:
    a Parquet file's columns in pandas' nullable types, so that an integer column with nulls
    stays integers (else float64). ``blank_cells``: its cells may be empty, so a blank line of
    a one-column CSV is refused rather than skipped (:func:`_refuse_short_rows`)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise DataError(f"{path} must be a .csv or .parquet file. Found suffix {suffix!r}.")
    if not path.is_file():
        raise DataError(f"expected a {what} at {path}. Found no such file.")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: a header and rows expected; found an empty file.")
    try:
        names = _column_names(path, suffix)
        _refuse_repeated_columns(path, names)
        if suffix == ".csv":
            _refuse_short_rows(path, len(names), blank_cells=blank_cells)
            frame = _read_csv(path, id_column)
            as_written = [c for c in dict.fromkeys((id_column, *literal)) if c in frame.columns]
            if as_written:  # one more read, of these columns only
                read = _read_csv(path, id_column, usecols=as_written, literal=True)
                for column in as_written:
                    frame[column] = read[column]
        else:
            if nullable:
                frame = pd.read_parquet(path, dtype_backend="numpy_nullable")
            else:
                frame = pd.read_parquet(path)
            if any(name is not None for name in frame.index.names):
                frame = frame.reset_index()  # a column pandas stored as the index is a column
    except DataError:
        raise
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path} could not be read as UTF-8 text ({error.encoding}: {error.reason}); "
            "expected a CSV saved as UTF-8 (e.g. Excel's 'CSV UTF-8')."
        ) from None
    except (ValueError, OSError, pd.errors.ParserError) as error:
        reason = _parser_reason(str(error).strip())  # pandas ends some with a line break
        raise DataError(f"{path} could not be read as {suffix[1:]}: {reason}") from None
    frame.columns = [str(c) for c in frame.columns]
    if len(frame) == 0:
        raise DataError(f"{path} must have at least one row. Found none.")
    return frame


def read_as_written(path: Path, columns: Sequence[str], *, id_column: str) -> pd.DataFrame:
    """The ``columns`` of a file :func:`read_table` read before, as the file writes them: a
    CSV's text (only an empty cell missing), in one read of those columns; a Parquet file's
    own values."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        return _read_csv(path, id_column, usecols=list(columns), literal=True)
    return read_table(path, id_column=id_column, nullable=True)[list(columns)]


def _read_csv(
    path: Path, id_column: str, *, usecols: list[str] | None = None, literal: bool = False
) -> pd.DataFrame:
    """``path`` as pandas reads it, but that the first column is never taken for an index (a
    trailing comma on every data row made pandas shift every column onto the one before it),
    and a row with more fields than the header is refused (pandas would drop them), and a
    column of numbers stays numbers with a whole number beyond 64 bits (:func:`_beyond_64_bits`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.ParserWarning)
        try:
            frame = pd.read_csv(
                path,
                dtype=str if literal else {id_column: str},
                index_col=False,
                usecols=usecols,
                low_memory=False,  # else each chunk of rows is typed alone: 001 and '001'
                keep_default_na=not literal,
                na_values=[""] if literal else None,
            )
        except pd.errors.ParserWarning:
            raise DataError(
                f"{path}: some rows have more fields than the header names columns (the values "
                "after the last column would be lost); expected as many fields in every row as "
                "in the header."
            ) from None
    if not literal:
        for column in frame.columns:
            if column != id_column and _beyond_64_bits(frame[column]):
                frame[column] = _read_again(path, column)
    return frame


_LONG_INTEGER = r"\s*[-+]?\d{19,}\s*"


def _beyond_64_bits(column: pd.Series) -> bool:
    """Whether pandas may have read ``column`` as it does one holding a whole number beyond 64
    bits (``1`` and 20 zeros): every cell as text, or as a Python int, and an empty cell as
    ``''`` rather than missing, so that a column of numbers would be one-hot encoded in
    silence, its empty cells a category."""
    if pd.api.types.is_numeric_dtype(column):
        return False
    return bool(column.dropna().astype(str).str.fullmatch(_LONG_INTEGER).any())


def _read_again(path: Path, column: str) -> pd.Series:
    """A CSV's ``column`` read again as numbers (float64), or, where a cell is text, as text;
    an empty cell missing either way."""
    try:
        return pd.read_csv(path, usecols=[column], dtype=np.float64, index_col=False)[column]
    except ValueError:  # a text cell: a column of categories
        return pd.read_csv(path, usecols=[column], dtype=str, index_col=False)[column]


def _parser_reason(reason: str) -> str:
    """pandas' reason for refusing a CSV, in the words of a file's lines and fields."""
    if found := re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", reason):
        expected, line, saw = found.groups()
        return (
            f"line {line} has {saw} fields; expected {expected}, as the lines before it (a "
            "separator inside a value needs the value in double quotes)."
        )
    if found := re.search(r"EOF inside string starting at row (\d+)", reason):
        return (
            f"a double quote opens a value in data row {found.group(1)} and is never closed; "
            "expected every quoted value to end with a double quote (a quote inside a value is "
            'written "").'
        )
    if reason.startswith("No columns to parse from file"):
        return "a header and rows expected; found only blank lines."
    return reason


def _refuse_short_rows(path: Path, fields: int, *, blank_cells: bool = False) -> None:
    """Refuse a CSV with a row of fewer fields than the header's ``fields``: pandas fills the
    fields a row lacks as empty cells, so a row cut short, or broken in two by a stray line
    break, would be read as missing values in silence. Blank (or white-space) lines are
    skipped, as pandas skips them, but with ``blank_cells`` (a file whose cells may be empty:
    an imputation client's) in a file of one column, where a blank line may be an empty cell
    (a spreadsheet writes one so; pandas writes ``""``) and skipping it would drop a row in
    silence: there it is refused. (In an id file a blank line is no id: it is skipped.)"""
    with path.open("rb") as lines:  # streamed: a file's size is the user's
        for number, line in enumerate(lines, start=1):
            if blank_cells and fields == 1 and not line.strip():
                _blank(path, number)
            if b'"' in line:
                break  # a quoted value may hold commas and line breaks: parse it as CSV
            if line.strip() and line.count(b",") + 1 < fields:
                _short(path, number, line.count(b",") + 1, fields)
        else:
            return
    with path.open(newline="", encoding="utf-8-sig") as file:
        reader = csv.reader(file)
        start = 1
        for row in reader:
            if blank_cells and fields == 1 and not any(f.strip() for f in row) and row != [""]:
                _blank(path, start)  # [""] is a quoted empty cell, "", as pandas writes one
            if len(row) < fields and any(field.strip() for field in row):
                quoted = reader.line_num > start  # a value in quotes ran on over line breaks
                _short(path, start, len(row), fields, runs_to=reader.line_num if quoted else None)
            start = reader.line_num + 1


def _blank(path: Path, line: int) -> NoReturn:
    raise DataError(
        f"{path}: line {line} is blank; in a file of one column a blank line is an empty cell "
        'or nothing, so expected an empty cell written as "" and no blank line.'
    )


def _short(path: Path, line: int, found: int, fields: int, runs_to: int | None = None) -> NoReturn:
    quoted = (
        f" (a double-quoted value in it runs on to line {runs_to}: a quote not closed?)"
        if runs_to is not None
        else ""
    )
    raise DataError(
        f"{path}: line {line} has {found} field{'s' if found != 1 else ''}{quoted}; expected "
        f"{fields}, one per column of the header (an empty cell is an empty field: `a,,c`)."
    )


def _column_names(path: Path, suffix: str) -> list[str]:
    """The column names as the file writes them: pandas renames a repeated CSV name (`a`,
    `a.1`), and a repeated Parquet one fails deep inside pyarrow. A CSV header of one name
    that holds the file's other separator (``;`` or a tab) is refused naming it."""
    if suffix == ".csv":
        header = pd.read_csv(path, header=None, nrows=1, dtype=str, keep_default_na=False)
        names = [str(name) for name in header.iloc[0]]
        if len(names) == 1 and (separator := next((s for s in ";\t" if s in names[0]), None)):
            shown = "a tab" if separator == "\t" else repr(separator)
            raise DataError(
                f"{path}: the header is one column, {names[0][:60]!r}, separated by {shown}; "
                "expected a comma-separated file (save it as CSV with commas)."
            )
        return names
    import pyarrow.parquet as pq

    return [str(name) for name in pq.read_schema(path).names]


def _refuse_repeated_columns(path: Path, names: list[str]) -> None:
    """Refuse a header that names a column twice or leaves one unnamed (pandas would invent
    ``Unnamed: 3``, and take an index written without a name for a feature)."""
    repeated = sorted({name for name in names if name and names.count(name) > 1})
    if repeated:
        raise DataError(f"{path}: column names must be distinct. Found {repeated} repeated.")
    unnamed = [position + 1 for position, name in enumerate(names) if not name.strip()]
    if unnamed:
        raise DataError(
            f"{path}: every column needs a name in the header; found none for column "
            f"{', '.join(map(str, unnamed))} of {len(names)} (a trailing separator, or an index "
            "written without a name, e.g. pandas' to_csv without index=False?)."
        )


def _read_frame(path: Path, id_column: str, literal: Sequence[str] = ()) -> pd.DataFrame:
    """Read a party or label file, which must have the id column."""
    frame = read_table(path, id_column=id_column, literal=literal)
    if id_column not in frame.columns:
        raise DataError(
            f"{path} must have an id column `{id_column}` (--id-column). Found columns: "
            f"{list(frame.columns)}."
        )
    return frame


def read_ids(frame: pd.DataFrame, path: Path, id_column: str) -> np.ndarray:
    """The id column as unique strings; empty and duplicate ids are refused."""
    column = frame[id_column]
    empty = int(column.isna().sum())
    if empty:
        first = int(np.flatnonzero(column.isna().to_numpy())[0])
        raise DataError(
            f"{path}: every row must have an id. Found {empty} empty (first at data row "
            f"{first + 1})."
        )
    text = column.astype(str)
    nul = text.str.contains("\x00", regex=False).to_numpy(dtype=bool)
    if nul.any():  # a numpy str array drops trailing NULs: 'a\x00' would be (and match) 'a'
        first = int(np.flatnonzero(nul)[0])
        raise DataError(
            f"{path}: ids must be text without NUL characters. Found {int(nul.sum())} with one, "
            f"first at data row {first + 1}: {text.iloc[first][:40]!r} (a UTF-16 file?)."
        )
    ids = text.to_numpy(dtype=str)
    _check_unique(ids, str(path))
    spaced = [value for value in ids.tolist() if value != value.strip()]
    if spaced:  # another party's file, or PSI, cannot say that ' a' was meant as 'a'
        warnings.warn(
            f"{path}: {len(spaced)} id(s) with spaces around them, e.g. {spaced[0][:40]!r}; ids "
            "are compared as the text in the files, so such an id matches only an id written "
            "with the same spaces",
            RunWarning,
            stacklevel=2,
        )
    return ids


def read_id_file(path: Path, *, id_column: str = ID_COLUMN) -> np.ndarray:
    """The ids of a CSV or Parquet file, read as :func:`read_party_file` reads a party's (as
    text, unique, none empty); the file needs no other column (an id file of `secure-vfl psi`)."""
    path = Path(path)
    return read_ids(_read_frame(path, id_column), path, id_column)


def _check_unique(ids: np.ndarray, where: str) -> None:
    if pd.Index(ids).is_unique:
        return
    unique, counts = np.unique(ids, return_counts=True)
    repeated = unique[counts > 1]
    examples = (
        f"{value!r} at data rows {(np.flatnonzero(ids == value) + 1)[:5].tolist()}"
        for value in repeated[:3].tolist()
    )
    raise DataError(
        f"{where}: ids must be unique. Found {repeated.size} repeated, e.g. {', '.join(examples)}."
    )


def _infinite_column(frame: pd.DataFrame) -> tuple[str, int] | None:
    """The first numeric column of ``frame`` with values that are infinite or beyond float32,
    and how many (None: none has)."""
    for column in frame.columns:
        if pd.api.types.is_numeric_dtype(frame[column]):
            values = frame[column].to_numpy(dtype=np.float64, na_value=np.nan)
            too_large = np.isinf(values) | (
                np.abs(np.nan_to_num(values)) > np.finfo(np.float32).max
            )
            if too_large.any():
                return str(column), int(too_large.sum())
    return None


def read_party_file(
    path: Path, *, id_column: str = ID_COLUMN, name: str | None = None
) -> PartyTable:
    """Read and validate one party's file: unique ids and at least one feature column.

    Numeric columns may have empty cells (NaN) but no infinities; any other column is
    categorical and kept as text (the party one-hot encodes it). ``name`` is the party's
    name (default: :func:`party_name` of the file's stem)."""
    path = Path(path)
    frame = _read_frame(path, id_column)
    ids = read_ids(frame, path, id_column)
    features = frame.drop(columns=id_column).reset_index(drop=True)
    if features.shape[1] == 0:
        raise DataError(
            f"{path} must have at least one feature column besides `{id_column}`. Found none."
        )
    name = name if name is not None else party_name(path.stem)
    try:
        return PartyTable(name=name, ids=ids, frame=features)
    except DataError as error:  # a value the table refuses: named by the file it is in
        raise DataError(f"{path}: {str(error).removeprefix(f'{name}: ')}") from None


def feature_columns(features: pd.DataFrame, path: Path | str) -> list[str]:
    """Make each feature column of ``features`` (read from ``path``, or a table's name) numbers
    (float64, NaN for an empty cell) or text, in place: decimals, and True/False with or
    without empty cells, are numbers; dates, times and nested values are refused naming the
    column. Returns the columns that were True/False (now 1/0)."""
    booleans = []
    for column in features.columns:
        _refuse_unsupported(features[column], column, path)
        if _decimals(features[column]):  # a Parquet decimal (money, from a database)
            features[column] = features[column].map(_as_number).astype(np.float64)
        if pd.api.types.is_bool_dtype(features[column]) or _booleans(features[column]):
            # True/False with empty cells as well: 1/0 and missing, as without them
            features[column] = features[column].map(_as_number).astype(np.float64)
            booleans.append(str(column))
        if pd.api.types.is_numeric_dtype(features[column]):
            features[column] = features[column].to_numpy(dtype=np.float64, na_value=np.nan)
        else:
            text = features[column].astype(object)
            features[column] = text.where(text.isna(), text.astype(str))
    return booleans


def _refuse_unsupported(column: pd.Series, name: object, path: Path | str) -> None:
    """Refuse a column of dates or times, or of nested values (lists, mappings), which a
    Parquet file may hold: neither is a number or a category."""
    present = column.dropna()
    if pd.api.types.is_datetime64_any_dtype(column) or (
        column.dtype == object
        and len(present)
        and all(isinstance(v, datetime.date | datetime.time) for v in present)
    ):
        kind = "dates or times"
    elif column.dtype == object and any(not np.isscalar(v) for v in present.head(1000)):
        kind = f"nested values such as {str(present.iloc[0])[:40]!r}"
    elif pd.api.types.is_complex_dtype(column):
        kind = "complex numbers"
    elif (
        isinstance(column.dtype, pd.CategoricalDtype | pd.StringDtype)
        or column.dtype == object
        or pd.api.types.is_numeric_dtype(column)
        or pd.api.types.is_bool_dtype(column)
    ):
        return  # numbers, or text (categories)
    else:
        kind = f"values of type {column.dtype}"
    raise DataError(
        f"{path}: column {str(name)!r} holds {kind}; expected numbers or text (categories): "
        "convert it (a date, e.g., to days since a fixed date) or drop it."
    )


_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")


def _label_values(values: list[Any]) -> list[Any]:
    """Labels read as text (a CSV's) as numbers where each one's text is the number's own
    (``7``, ``-2``, ``0.5``), else as the text written (``007``, ``1.50``, ``NA``): a label
    is the label file's own value, and ``007`` is not ``7``."""
    if not all(isinstance(value, str) for value in values):
        return values  # a Parquet column: its own types
    if all(_INTEGER.fullmatch(value) for value in values):
        return [int(value) for value in values]
    try:
        numbers = [float(value) for value in values]
    except ValueError:
        return values
    if all(math.isfinite(n) and str(n) == value for n, value in zip(numbers, values, strict=True)):
        return numbers
    return values


def alike_texts(values: Sequence[object]) -> list[list[str]]:
    """The groups of distinct texts among ``values`` that differ only in case or surrounding
    spaces (``yes``, ``Yes``, ``yes ``), each sorted."""
    groups: dict[str, set[str]] = {}
    for value in {v for v in values if isinstance(v, str)}:
        groups.setdefault(value.strip().casefold(), set()).add(value)
    return [sorted(group) for group in groups.values() if len(group) > 1]


def _warn_alike_labels(values: list[Any], path: Path) -> None:
    """Warn of text labels that differ only in case or surrounding spaces: they are different
    classes, as written."""
    alike = alike_texts(values)
    if alike:
        shown = "; ".join(", ".join(map(repr, group)) for group in alike[:3])
        warnings.warn(
            f"{path}: labels that differ only in case or surrounding spaces are different "
            f"classes ({shown}); write each class alike if they are one.",
            RunWarning,
            stacklevel=3,
        )


def _decimals(column: pd.Series) -> bool:
    """Whether a column of objects holds only decimal numbers besides missing cells."""
    present = column.dropna()
    return (
        column.dtype == object
        and len(present) > 0
        and all(isinstance(v, decimal.Decimal) for v in present)
    )


def _booleans(column: pd.Series) -> bool:
    """Whether a column of objects holds only True and False besides missing cells."""
    present = column.dropna()
    return (
        column.dtype == object
        and len(present) > 0
        and all(isinstance(value, bool | np.bool_) for value in present)
    )


def _as_number(value: object) -> float:
    return float("nan") if value is None or value is pd.NA else float(value)  # type: ignore[arg-type]


def read_label_file(
    path: Path,
    *,
    id_column: str = ID_COLUMN,
    label_column: str = LABEL_COLUMN,
    held_out: bool = False,
) -> LabelTable:
    """Read the label file: the id and label columns; labels map to 0..C-1 in sorted order.

    Other columns are ignored. ``held_out``: a test file's labels, which may all be of one
    class (the training labels need two; a test class must be among theirs).
    """
    path = Path(path)
    frame = _read_frame(path, id_column, literal=[label_column])
    if label_column not in frame.columns:
        raise DataError(
            f"{path} must have a label column `{label_column}` (--label-column). Found "
            f"columns: {list(frame.columns)}."
        )
    ids = read_ids(frame, path, id_column)
    column = frame[label_column]
    if column.isna().any():
        raise DataError(
            f"{path}: every row must have a label. Found {int(column.isna().sum())} empty."
        )
    values = _label_values(column.tolist())
    _warn_alike_labels(values, path)
    try:
        classes = tuple(sorted(set(values)))
    except TypeError:
        raise DataError(
            f"{path}: labels must be of one sortable kind (all numbers or all text). "
            f"Found types {sorted({type(v).__name__ for v in values})}."
        ) from None
    if len(classes) < (1 if held_out else 2):
        raise DataError(f"{path}: a classifier needs at least 2 classes. Found {list(classes)}.")
    if len(classes) > max(MAX_CLASSES_FREE, len(values) // 2):
        raise DataError(
            f"{path}: {len(classes)} distinct labels in {len(values)} rows (e.g. "
            f"{', '.join(map(repr, classes[:3]))}); a classifier needs several rows of each "
            f"class. Is `{label_column}` a quantity to predict (regression)? secure-vfl "
            "classifies: expected a label column of classes."
        )
    index = {value: position for position, value in enumerate(classes)}
    labels = np.fromiter((index[v] for v in values), dtype=np.int64, count=len(values))
    return LabelTable(ids=ids, labels=labels, classes=classes)


_UNSAFE = re.compile(r"[^a-z0-9-]+")


def party_name(text: str) -> str:
    """A party's name made safe from a file stem or a user's name: lower-case letters, digits
    and hyphens (``Bank_A 2024`` -> ``bank-a-2024``); ConfigError if nothing is left."""
    safe = _UNSAFE.sub("-", text.lower()).strip("-")
    safe = re.sub("-{2,}", "-", safe)
    if not safe:
        raise ConfigError(
            f"a party name needs an ASCII letter (a-z) or digit; {text!r} has none (use "
            "--party-name)."
        )
    return safe


def party_names(paths: Sequence[Path], given: Sequence[str] | None = None) -> tuple[str, ...]:
    """Each party's name: ``given`` (one per file, from ``--party-name``) or the files' stems,
    made safe (:func:`party_name`). Refuses a count that differs from the files, two parties of
    one name, and a name of the form ``party-K`` for another party than the K-th (the internal
    names the federation uses; the K-th party may keep its own)."""
    if given:
        if len(given) != len(paths):
            raise ConfigError(
                f"one --party-name per --party-file expected ({len(paths)}); found {len(given)}."
            )
        names = [party_name(text) for text in given]
    else:
        names = [party_name(Path(path).stem) for path in paths]
    for k, name in enumerate(names):
        if names.index(name) != k:
            first = names.index(name)
            if Path(paths[first]).resolve() == Path(paths[k]).resolve():
                raise ConfigError(
                    f"party file {paths[k]} is given twice; expected one file per party, each "
                    "with its own features."
                )
            raise ConfigError(
                f"two parties are called {name!r} ({paths[first]} and {paths[k]}); party names "
                "must differ: rename a file or give --party-name NAME once per --party-file."
            )
        internal = re.fullmatch(r"party-(\d+)", name)
        if internal and int(internal.group(1)) != k:
            raise ConfigError(
                f"party name {name!r} (for {paths[k]}) is the internal name of another party; "
                f"expected another name, or party-{k} for this file."
            )
    return tuple(names)


def check_party_tables(
    tables: list[PartyTable],
    paths: list[Path],
    labels: LabelTable,
    label_path: Path,
    *,
    label_column: str = LABEL_COLUMN,
) -> None:
    """Refuse the mistakes that would train silently on wrong data: two party files holding
    the same table (one file given twice, or a copy), and a party file holding the label (the
    label column, or a column equal to the label up to a renaming of its classes on the ids it
    shares with the label file: the label file given as a party file, say)."""
    for k, table in enumerate(tables):
        for j in range(k):
            if same_table(tables[j], table):
                raise DataError(
                    f"party files {paths[j]} and {paths[k]} hold the same table (same ids, "
                    "columns and values); expected one file per party, each with its own "
                    "features."
                )
    for table, path in zip(tables, paths, strict=True):
        if label_column in table.columns:
            raise DataError(
                f"party file {path} has a `{label_column}` column, which would become a "
                f"feature; expected features only (is it the label file {label_path}?)."
            )
        leaked = _label_columns(table, labels)
        if leaked:
            raise DataError(
                f"party file {path}: column {leaked[0]!r} equals the label of {label_path} on "
                "every shared id, so it would hand the model the answer; expected features "
                "only (drop that column)."
            )


def same_table(first: PartyTable, second: PartyTable) -> bool:
    """Whether two tables hold the same ids, columns and values, whatever their rows' order
    (one file given twice, or a copy of it)."""
    if first.columns != second.columns or first.frame.shape != second.frame.shape:
        return False
    order_first, order_second = np.argsort(first.ids), np.argsort(second.ids)
    if not np.array_equal(first.ids[order_first], second.ids[order_second]):
        return False
    return bool(first.subset(order_first).frame.equals(second.subset(order_second).frame))


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
    for column in table.columns:
        values = table.frame[column].iloc[rows].reset_index(drop=True)
        pairs = pd.DataFrame({"value": values, "label": label}).drop_duplicates()
        if values.nunique(dropna=False) == classes and len(pairs) == classes:
            leaked.append(column)
    return leaked


def loose_id(text: str) -> str:
    """An id as a person reads it: no surrounding spaces, lower case, no leading zeros and no
    ``.0`` decimal (``' 007.0'`` reads ``7``): what two files that write the same ids
    differently still share."""
    loose = text.strip().lower().removesuffix(".0").lstrip("0")
    return loose or ("0" if text.strip() else "")


def near_matches(ids: np.ndarray, others: np.ndarray) -> list[tuple[str, str]]:
    """The ids of ``ids`` that are not in ``others`` but read as one of the ``others`` that no
    id matched exactly (:func:`loose_id`), each with that id: the same samples, written
    differently in two files."""
    exact = set(others.tolist()) & set(ids.tolist())
    loose: dict[str, str] = {}
    for other in others.tolist():
        if other not in exact:
            loose.setdefault(loose_id(other), other)
    return [
        (own, loose[loose_id(own)])
        for own in ids.tolist()
        if own not in exact and loose_id(own) in loose
    ]


def describe_unmatched(table: PartyTable, path: Path, labels: LabelTable, label_path: Path) -> str:
    """The message for a party file none of whose ids is in the label file: an example id of
    each side, as ids are compared as text (``0304`` is not ``304``)."""
    return (
        f"no ids matched between party file {path} and label file {label_path} (e.g. "
        f"{str(table.ids[0])!r} in the party file, {str(labels.ids[0])!r} in the label file); ids "
        "are compared as the text in the files, so expected the same format on both sides "
        "(leading zeros, spaces, decimals)."
    )
