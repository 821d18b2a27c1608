"""The user's own per-party files: reading, validation and clear refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from secure_vfl.data.party_files import read_label_file, read_party_file
from secure_vfl.errors import DataError


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_reads_csv_party_file_keeping_ids_as_text(tmp_path):
    table = read_party_file(write(tmp_path / "bank.csv", "id,income,age\n007,1.5,30\n8,2.5,41\n"))
    assert table.name == "bank"
    assert table.ids.tolist() == ["007", "8"]
    assert table.columns == ("income", "age")
    assert table.features.dtype == np.float32
    np.testing.assert_array_equal(table.features, [[1.5, 30], [2.5, 41]])


def test_reads_parquet_party_file(tmp_path):
    path = tmp_path / "shop.parquet"
    pd.DataFrame({"id": [3, 1], "spend": [10.0, 20.0], "visits": [1, 2]}).to_parquet(path)
    table = read_party_file(path)
    assert table.ids.tolist() == ["3", "1"]
    assert table.features.shape == (2, 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("key,x\n1,2\n", r"must have an `id` column. Found columns: \['key', 'x'\]"),
        ("id,x\n1,2\n1,3\n", r"ids must be unique. Found 1 repeated, e.g. '1'"),
        (
            "id,x,colour\n1,2,red\n2,3,blue\n",
            r"must be numeric. Found non-numeric columns: \['colour'\]",
        ),
        ("id\n1\n2\n", "at least one feature column"),
        ("id,x,y\n1,2,\n2,,\n3,1,1\n", r"Found 3 missing values in 2 rows, columns \['x', 'y'\]"),
        ("id,x\n", "at least one row"),
        ("id,x\n,2\n", "every row must have an id"),
    ],
)
def test_bad_party_files_are_refused_naming_the_problem(tmp_path, text, message):
    with pytest.raises(DataError, match=message):
        read_party_file(write(tmp_path / "party.csv", text))


def test_unsupported_or_missing_files_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"\.csv or \.parquet file. Found suffix '\.xlsx'"):
        read_party_file(tmp_path / "party.xlsx")
    with pytest.raises(DataError, match="Found no such file"):
        read_party_file(tmp_path / "absent.csv")


def test_label_file_maps_sorted_classes_to_indices(tmp_path):
    labels = read_label_file(write(tmp_path / "y.csv", "id,label\na,yes\nb,no\nc,yes\n"))
    assert labels.classes == ("no", "yes")
    assert labels.labels.dtype == np.int64
    assert labels.labels.tolist() == [1, 0, 1]
    numeric = read_label_file(write(tmp_path / "z.csv", "id,label\na,10\nb,2\nc,7\n"))
    assert numeric.classes == (2, 7, 10) and numeric.labels.tolist() == [2, 0, 1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("id,target\na,1\n", r"must have a `label` column. Found columns: \['id', 'target'\]"),
        ("label\n1\n", "must have an `id` column"),
        ("id,label\na,1\nb,\n", "every row must have a label. Found 1 empty"),
        ("id,label\na,1\nb,1\n", "at least 2 classes. Found"),
        ("id,label\na,1\na,0\n", "ids must be unique"),
    ],
)
def test_bad_label_files_are_refused(tmp_path, text, message):
    with pytest.raises(DataError, match=message):
        read_label_file(write(tmp_path / "labels.csv", text))
