"""Loaders for the FedHF-Impute paper's original datasets from a user-given directory.

Nothing is downloaded: the user points at the files they obtained, in their published formats
(UCI Air Quality CSV, UCI SECOM, PhysioNet Challenge 2012 set-a). Each loader returns a float64
table with NaN for missing values, ready for
:func:`secure_vfl.data.imputation.make_imputation_task`; a missing or malformed file raises
``DataError`` naming the expected file and what was found.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from secure_vfl.data.originals import _expect_file
from secure_vfl.errors import DataError

UCI_AIRQUALITY_FILE = "AirQualityUCI.csv"
UCI_AIRQUALITY_COLUMNS = (
    "CO(GT)",
    "PT08.S1(CO)",
    "NMHC(GT)",
    "C6H6(GT)",
    "PT08.S2(NMHC)",
    "NOx(GT)",
    "PT08.S3(NOx)",
    "NO2(GT)",
    "PT08.S4(NO2)",
    "PT08.S5(O3)",
    "T",
    "RH",
    "AH",
)
"""The 13 sensor and reference-analyser columns; Date and Time are dropped."""
UCI_AIRQUALITY_MISSING = -200.0
"""The published file marks a missing value with -200."""


def load_uci_airquality(path: Path) -> pd.DataFrame:
    """UCI Air Quality (De Vito et al.): hourly sensor readings, 13 numeric columns.

    ``path`` is ``AirQualityUCI.csv`` or the directory holding it: semicolon-separated, decimal
    comma, ``Date;Time;CO(GT);...``, -200 for missing, two trailing empty columns and empty rows
    at the end (both ignored).
    """
    path = Path(path)
    if path.is_dir():
        path = path / UCI_AIRQUALITY_FILE
    _expect_file(path)
    try:
        frame = pd.read_csv(path, sep=";", dtype=str, keep_default_na=False)
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as error:
        raise DataError(
            f"{path} must be a semicolon-separated CSV. Found: {str(error)[:200]}."
        ) from None
    frame.columns = [str(c).strip() for c in frame.columns]
    expected = ("Date", "Time", *UCI_AIRQUALITY_COLUMNS)
    missing = [c for c in expected if c not in frame.columns]
    if missing:
        raise DataError(
            f"{path} must have the columns {list(expected)}. "
            f"Found {list(frame.columns)[:17]} (missing {missing})."
        )
    text = frame[list(UCI_AIRQUALITY_COLUMNS)].apply(lambda col: col.str.strip())
    blank_rows = (text == "").all(axis=1) & (frame["Date"].str.strip() == "")
    text = text[~blank_rows]
    if text.empty:
        raise DataError(f"{path} must have at least one data row. Found none.")
    columns = {}
    for column in UCI_AIRQUALITY_COLUMNS:
        cells = text[column].str.replace(",", ".", regex=False)
        values = pd.to_numeric(cells.where(cells != ""), errors="coerce")
        bad = values.isna() & (cells != "")
        if bad.any():
            first = int(np.flatnonzero(bad.to_numpy())[0])
            raise DataError(
                f"{path}: column {column!r} must hold numbers with a decimal comma. "
                f"Found {cells.iloc[first]!r} on data row {first + 1}."
            )
        columns[column] = values.mask(values == UCI_AIRQUALITY_MISSING).to_numpy(np.float64)
    return pd.DataFrame(columns)


SECOM_FILE = "secom.data"
SECOM_FEATURES = 590


def load_secom(data_dir: Path) -> pd.DataFrame:
    """UCI SECOM semiconductor process data: ``secom.data``, one run per line, 590
    space-separated values with ``NaN`` for missing; columns named ``f0`` .. ``f589``."""
    path = _expect_file(Path(data_dir) / SECOM_FILE)
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise DataError(
            f"{path} must have at least one line of {SECOM_FEATURES} values. Found none."
        )
    for number, tokens in enumerate(rows, start=1):
        if len(tokens) != SECOM_FEATURES:
            raise DataError(
                f"{path} must have {SECOM_FEATURES} space-separated values per line. "
                f"Found {len(tokens)} on non-empty line {number}."
            )
    try:
        values = np.array(rows, dtype=np.float64)
    except ValueError:
        for number, tokens in enumerate(rows, start=1):
            for position, token in enumerate(tokens):
                try:
                    float(token)
                except ValueError:
                    raise DataError(
                        f"{path} must hold numbers or NaN. Found {token!r} on non-empty line "
                        f"{number}, column {position}."
                    ) from None
        raise
    if np.isinf(values).any():
        raise DataError(f"{path} must hold finite numbers or NaN. Found infinities.")
    return pd.DataFrame(values, columns=[f"f{i}" for i in range(SECOM_FEATURES)])


PHYSIONET_DIR = "set-a"
PHYSIONET_HEADER = "Time,Parameter,Value"
PHYSIONET_STATIC = ("Age", "Gender", "Height")
"""General descriptors kept as static features (their one value per patient)."""
PHYSIONET_DROPPED = ("RecordID", "ICUType")
"""General descriptors that are not measurements: the row id and a care-unit code."""
PHYSIONET_MISSING = -1.0
"""In the general descriptors (RecordID, Age, Gender, Height, ICUType, Weight) -1 is missing."""
_DESCRIPTORS = frozenset((*PHYSIONET_STATIC, *PHYSIONET_DROPPED, "Weight"))
_TIME = re.compile(r"\d{1,3}:[0-5]\d")


def _read_physionet_record(path: Path) -> dict[str, float]:
    """One patient's file as one row: static descriptors and the mean of every time-varying
    parameter over the stay (Weight included: its admission value and later measurements)."""
    lines = path.read_text().splitlines()
    if not lines or lines[0].strip() != PHYSIONET_HEADER:
        found = lines[0][:60] if lines else "an empty file"
        raise DataError(f"{path} must start with the header {PHYSIONET_HEADER!r}. Found {found!r}.")
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    row: dict[str, float] = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split(",")
        if len(fields) != 3:
            raise DataError(
                f"{path} line {number} must be `Time,Parameter,Value`. Found {line[:60]!r}."
            )
        time, parameter, text = (field.strip() for field in fields)
        if not _TIME.fullmatch(time):
            raise DataError(f"{path} line {number}: time must be HH:MM. Found {time!r}.")
        try:
            value = float(text)
        except ValueError:
            raise DataError(
                f"{path} line {number}: value of {parameter!r} must be a number. Found {text!r}."
            ) from None
        if not np.isfinite(value):
            raise DataError(f"{path} line {number}: value must be finite. Found {text!r}.")
        if parameter in _DESCRIPTORS and value == PHYSIONET_MISSING:
            continue
        if parameter in PHYSIONET_DROPPED:
            continue
        if parameter in PHYSIONET_STATIC:
            row.setdefault(parameter, value)
            continue
        sums[parameter] = sums.get(parameter, 0.0) + value
        counts[parameter] = counts.get(parameter, 0) + 1
    row.update({parameter: sums[parameter] / counts[parameter] for parameter in sums})
    return row


def load_physionet_set_a(data_dir: Path) -> pd.DataFrame:
    """PhysioNet/CinC Challenge 2012 set-a: one row per patient, indexed by RecordID.

    ``data_dir`` holds ``set-a/`` (or is it) with one ``RECORDID.txt`` per patient, a CSV of
    ``Time,Parameter,Value`` with time ``HH:MM``. Each row holds Age, Gender and Height as
    static features and the mean over the stay of every time-varying parameter (Weight
    included); RecordID and ICUType are dropped; -1 in a descriptor is missing. Columns are
    sorted by name; a parameter never measured for a patient is NaN.
    """
    data_dir = Path(data_dir)
    folder = data_dir if data_dir.name == PHYSIONET_DIR else data_dir / PHYSIONET_DIR
    if not folder.is_dir():
        found = sorted(p.name for p in data_dir.iterdir())[:10] if data_dir.is_dir() else None
        where = f"{data_dir} contains {found}" if found is not None else f"{data_dir} is absent"
        raise DataError(
            f"expected the directory {PHYSIONET_DIR}/ at {folder}. Found none ({where})."
        )
    paths = sorted(folder.glob("*.txt"))
    if not paths:
        found = sorted(p.name for p in folder.iterdir())[:10]
        raise DataError(f"expected RECORDID.txt files in {folder}. Found none (it holds {found}).")
    rows = {path.stem: _read_physionet_record(path) for path in paths}
    frame = pd.DataFrame.from_dict(rows, orient="index", dtype=np.float64)
    frame = frame.reindex(columns=sorted(frame.columns))
    frame.index.name = "RecordID"
    return frame
