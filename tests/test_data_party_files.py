"""The user's own per-party files: reading, validation and clear refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from secure_vfl.data.party_files import (
    party_name,
    party_names,
    read_id_file,
    read_label_file,
    read_party_file,
)
from secure_vfl.errors import ConfigError, DataError, RunWarning


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_reads_csv_party_file_keeping_ids_as_text(tmp_path):
    table = read_party_file(write(tmp_path / "bank.csv", "id,income,age\n007,1.5,30\n8,2.5,41\n"))
    assert table.name == "bank"
    assert table.ids.tolist() == ["007", "8"]
    assert table.columns == ("income", "age")
    np.testing.assert_array_equal(table.frame.to_numpy(np.float64), [[1.5, 30], [2.5, 41]])


def test_reads_parquet_party_file(tmp_path):
    path = tmp_path / "shop.parquet"
    pd.DataFrame({"id": [3, 1], "spend": [10.0, 20.0], "visits": [1, 2]}).to_parquet(path)
    table = read_party_file(path)
    assert table.ids.tolist() == ["3", "1"]
    assert table.frame.shape == (2, 2)


def test_an_id_with_a_nul_character_is_refused_not_cut(tmp_path):
    """A numpy str array drops trailing NULs: `a\\x00` was read as `a`, so it matched another
    party's (or PSI's peer's) `a`, and `a` beside it was refused as a repeat."""
    csv = tmp_path / "bank.csv"
    csv.write_bytes(b"id,x\nb,1\na\x00,2\n")
    parquet = tmp_path / "bank.parquet"
    pd.DataFrame({"id": ["b", "a\x00"], "x": [1.0, 2.0]}).to_parquet(parquet)
    for path in (csv, parquet):
        with pytest.raises(DataError, match=r"without NUL characters. Found 1 .* data row 2: "):
            read_party_file(path)
        with pytest.raises(DataError, match="without NUL characters"):
            read_id_file(path)


def test_ids_and_labels_in_named_columns_keep_leading_zeros(tmp_path):
    table = read_party_file(
        write(tmp_path / "lab.csv", "x,patient\n1.5,0304\n2.5,304\n"), id_column="patient"
    )
    assert table.ids.tolist() == ["0304", "304"] and table.columns == ("x",)
    labels = read_label_file(
        write(tmp_path / "y.csv", "patient,outcome,note\n0304,sick,a\n304,well,b\n"),
        id_column="patient",
        label_column="outcome",
    )
    assert labels.ids.tolist() == ["0304", "304"] and labels.classes == ("sick", "well")
    with pytest.raises(DataError, match=r"id column `key` \(--id-column\)"):
        read_party_file(tmp_path / "lab.csv", id_column="key")
    with pytest.raises(DataError, match=r"label column `label` \(--label-column\)"):
        read_label_file(tmp_path / "y.csv", id_column="patient")


def test_text_columns_and_empty_cells_are_kept_for_the_party_to_encode(tmp_path):
    table = read_party_file(write(tmp_path / "shop.csv", "id,city,spend\n1,paris,\n2,,3.5\n"))
    assert table.frame["city"].tolist()[0] == "paris" and pd.isna(table.frame["city"][1])
    assert np.isnan(table.frame["spend"][0]) and table.frame["spend"][1] == 3.5


@pytest.mark.parametrize(
    ("stem", "name"),
    [("bank", "bank"), ("Bank_A 2024", "bank-a-2024"), ("--x..y--", "x-y"), ("PARTY-0", "party-0")],
)
def test_party_names_are_file_stems_made_safe(stem, name):
    assert party_name(stem) == name


def test_party_names_must_differ_and_match_the_files(tmp_path):
    paths = [tmp_path / "Bank.csv", tmp_path / "bank.parquet"]
    with pytest.raises(ConfigError, match="two parties are called 'bank'"):
        party_names(paths)
    assert party_names(paths, ["north", "South Shop"]) == ("north", "south-shop")
    with pytest.raises(ConfigError, match=r"one --party-name per --party-file expected \(2\)"):
        party_names(paths, ["north"])
    with pytest.raises(ConfigError, match="internal name of another party"):
        party_names(paths, ["party-1", "party-0"])
    for text in ("__", "é"):  # é is a letter, but not one a name keeps: said so
        with pytest.raises(ConfigError, match=r"needs an ASCII letter \(a-z\) or digit"):
            party_name(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "key,x\n1,2\n",
            r"must have an id column `id` \(--id-column\). Found columns: \['key', 'x'\]",
        ),
        ("id,x\n1,2\n1,3\n", r"ids must be unique. Found 1 repeated, e.g. '1'"),
        ("id\n1\n2\n", "at least one feature column"),
        ("id,x\n1,inf\n2,1\n", r"column 'x' must hold finite float32 values. Found 1 infinite"),
        ("id,x\n", "at least one row"),
        ("id,x\n1,1\n,2\n", r"every row must have an id. Found 1 empty \(first at data row 2\)"),
        # these gave pandas' own words ("No columns to parse from file", "Error tokenizing data.
        # C error: ..."), and a row cut short was read as missing cells in silence
        ("", "a header and rows expected; found an empty file"),
        ("\n\n", "a header and rows expected; found only blank lines"),
        ("id,x,y\n1,2,3\n2,3\n\n3,4,5\n", r"line 3 has 2 fields; expected 3, one per column"),
        ('id,x,y\n1,2,3\n   \n2,"3",4\n3,4\n', "line 5 has 2 fields; expected 3"),
        ('id,x,y\n1,2,3\n2,"3,4\n3,4,5\n', "line 3 has 2 fields .a double-quoted value in it runs"),
        ("id,x,y\n1,2,3\n2,3,4,5,6\n", "line 3 has 5 fields; expected 3, as the lines before"),
        ('id,x,y\n1,2,3\n2,3,"4\n', "a double quote opens a value in data row 2 and is never"),
    ],
)
def test_bad_party_files_are_refused_naming_the_problem(tmp_path, text, message):
    with pytest.raises(DataError, match=message):
        read_party_file(write(tmp_path / "party.csv", text))


def test_a_whole_number_beyond_64_bits_leaves_its_column_numbers(tmp_path):
    # pandas read such a column as text, an empty cell as '' where the number came first, else
    # as Python ints: one-hot encoded in silence, each number (and the empty cells) a category
    huge = write(tmp_path / "huge.csv", "id,x\n1,1" + "0" * 41 + "\n2,\n3,1.5\n")
    with pytest.raises(DataError, match=r"column 'x' must hold finite float32 values. Found 1"):
        read_party_file(huge)
    big = "2" + "0" * 19  # beyond 64 bits, within float32
    table = read_party_file(write(tmp_path / "big.csv", f"id,x,y\n1,{big},1\n2,,2\n3,1.5,{big}\n"))
    np.testing.assert_array_equal(table.frame["x"], [2e19, np.nan, 1.5])
    np.testing.assert_array_equal(table.frame["y"], [1, 2, 2e19])
    text = read_party_file(write(tmp_path / "text.csv", f"id,x\n1,{big}\n2,\n3,a\n"))
    assert text.frame["x"].tolist()[::2] == [big, "a"] and pd.isna(text.frame["x"][1])


@pytest.mark.parametrize(
    ("header", "repeated"),
    [("id,x,x,y", "'x'"), ("id,x,id", "'id'"), ("\ufeffid,x,id,x", "'id', 'x'")],
)
def test_a_csv_naming_a_column_twice_is_refused_not_renamed(tmp_path, header, repeated):
    # pandas alone would read `x,x` as `x`, `x.1`: two features where the file has one name.
    path = write(tmp_path / "party.csv", f"{header}\n1,2,3,4\n")
    message = rf"party.csv: column names must be distinct. Found \[{repeated}\] repeated"
    with pytest.raises(DataError, match=message):
        read_party_file(path)
    with pytest.raises(DataError, match=message):
        read_label_file(path)


def test_a_parquet_naming_a_column_twice_is_refused_naming_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "party.parquet"
    table = pa.table([pa.array(["a"]), pa.array([1.0]), pa.array([2.0])], names=["id", "x", "x"])
    pq.write_table(table, path)
    with pytest.raises(DataError, match=r"column names must be distinct. Found \['x'\] repeated"):
        read_party_file(path)


def test_dotted_header_names_are_not_repeats_and_unnamed_columns_are_refused(tmp_path):
    table = read_party_file(write(tmp_path / "party.csv", "id,x,x.1\n1,2,3\n"))
    assert table.columns == ("x", "x.1")
    # pandas named them `Unnamed: 3` and read an index written without a name as a feature.
    for header, row, which in (
        ("id,x,x.1,,", "1,2,3,4,5", "4, 5 of 5"),
        (",id,x", "0,a,2", "1 of 3"),
    ):
        with pytest.raises(DataError, match=f"found none for column {which} .a trailing"):
            read_party_file(write(tmp_path / "unnamed.csv", f"{header}\n{row}\n"))


def test_a_trailing_comma_on_every_row_does_not_shift_the_columns(tmp_path):
    """pandas took the ids for an index and every value for the column before it: predict wrote
    predictions keyed by feature values."""
    table = read_party_file(write(tmp_path / "p.csv", "id,c,d\nc1,0.5,0.6,\nc2,-0.7,0.8,\n"))
    assert table.ids.tolist() == ["c1", "c2"]
    assert table.frame.to_dict("list") == {"c": [0.5, -0.7], "d": [0.6, 0.8]}
    with pytest.raises(DataError, match="some rows have more fields than the header names"):
        read_party_file(write(tmp_path / "q.csv", "id,c,d\nc1,0.5,0.6,7\nc2,-0.7,0.8,\n"))


def test_text_pandas_reads_as_missing_is_an_id_or_a_label_and_booleans_stay_numbers(tmp_path):
    """`NA` (North America) was an empty label and an empty id; True/False with an empty cell
    became categories, and without one numbers: a model trained on one refused the other."""
    labels = read_label_file(write(tmp_path / "y.csv", "id,label\nNA,NA\nb,EU\nnull,NA\n"))
    assert labels.ids.tolist() == ["NA", "b", "null"] and labels.classes == ("EU", "NA")
    numbers = read_label_file(write(tmp_path / "n.csv", "id,label\na,0\nb,1\n"))
    assert numbers.classes == (0, 1)  # numbers stay numbers
    with pytest.raises(DataError, match=r"every row must have a label\. Found 1 empty"):
        read_label_file(write(tmp_path / "e.csv", "id,label\na,0\nb,\n"))
    flags = read_party_file(write(tmp_path / "f.csv", "id,flag,region\n1,True,NA\n2,,EU\n"))
    assert flags.frame["flag"].tolist()[0] == 1.0 and np.isnan(flags.frame["flag"].tolist()[1])
    assert flags.frame["region"].isna().tolist() == [True, False]  # a feature: NA is missing


def test_a_file_in_another_encoding_or_separator_is_refused_saying_so(tmp_path):
    latin = tmp_path / "latin.csv"
    latin.write_bytes("id,city\na,Montr\xe9al\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"could not be read as UTF-8 text .* saved as UTF-8"):
        read_party_file(latin)
    with pytest.raises(DataError, match="the header is one column, 'id;c', separated by ';'"):
        read_party_file(write(tmp_path / "semi.csv", "id;c\n1;2\n"))


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
        ("id,target\na,1\n", r"`label` \(--label-column\). Found columns: \['id', 'target'\]"),
        ("label\n1\n", "must have an id column `id`"),
        ("id,label\na,1\nb,\n", "every row must have a label. Found 1 empty"),
        ("id,label\na,1\nb,1\n", "at least 2 classes. Found"),
        ("id,label\na,1\na,0\n", "ids must be unique"),
    ],
)
def test_bad_label_files_are_refused(tmp_path, text, message):
    with pytest.raises(DataError, match=message):
        read_label_file(write(tmp_path / "labels.csv", text))


def test_a_label_of_about_one_class_per_row_is_refused_as_a_quantity(tmp_path):
    """A regression target given as labels: 200 classes in 200 rows, and then a feature
    'equal to the label up to renaming' because each of its values is unique."""
    rows = "".join(f"r{i},{i * 0.37:.2f}\n" for i in range(200))
    with pytest.raises(DataError, match=r"200 distinct labels in 200 rows .* \(regression\)"):
        read_label_file(write(tmp_path / "y.csv", "id,label\n" + rows))
    # Many classes with a few rows each are classes (and 20 classes are allowed in any case).
    many = "".join(f"r{i},c{i % 50}\n" for i in range(150))
    assert len(read_label_file(write(tmp_path / "m.csv", "id,label\n" + many)).classes) == 50
    few = "".join(f"r{i},c{i}\n" for i in range(20))
    assert len(read_label_file(write(tmp_path / "f.csv", "id,label\n" + few)).classes) == 20


def test_parquet_decimals_are_numbers_and_dates_or_nested_values_are_refused(tmp_path):
    """A money column exported as decimal was one-hot encoded or refused as free text; lists
    and dates became categories of their text."""
    import datetime
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    ids = {"id": ["a", "b", "c"]}
    money = pa.array([decimal.Decimal("1.50"), None, decimal.Decimal("2.25")], pa.decimal128(9, 2))
    pq.write_table(pa.table({**ids, "money": money}), path)
    assert read_party_file(path).frame["money"].tolist()[::2] == [1.5, 2.25]
    when = [datetime.date(2020, 1, 1), None, datetime.date(2021, 1, 1)]
    for column, values, kind in (
        ("when", when, "dates or times"),
        ("tags", [[1], [2, 3], []], "nested"),
    ):
        pq.write_table(pa.table({**ids, column: values}), path)
        with pytest.raises(DataError, match=f"column '{column}' holds {kind}"):
            read_party_file(path)


def test_a_parquet_column_stored_as_the_pandas_index_is_a_column(tmp_path):
    """`df.set_index("a1").to_parquet()`: the feature a1 was dropped without a word, and a file
    indexed by its ids had 'no id column'."""
    frame = pd.DataFrame({"id": ["x", "y"], "a1": [1.0, 2.0], "a2": [3.0, 4.0]})
    for index in ("a1", "id"):
        path = tmp_path / f"{index}.parquet"
        frame.set_index(index).to_parquet(path)
        table = read_party_file(path)
        assert table.ids.tolist() == ["x", "y"] and set(table.columns) == {"a1", "a2"}


def test_labels_keep_the_text_they_are_written_in_unless_it_is_a_numbers_own(tmp_path):
    codes = read_label_file(write(tmp_path / "c.csv", "id,label\na,007\nb,012\nc,007\n"))
    assert codes.classes == ("007", "012")  # they were the numbers 7 and 12
    assert read_label_file(write(tmp_path / "i.csv", "id,label\na,-1\nb,2\n")).classes == (-1, 2)
    assert read_label_file(write(tmp_path / "f.csv", "id,label\na,0.5\nb,2.0\n")).classes == (
        0.5,
        2.0,
    )
    assert read_label_file(write(tmp_path / "t.csv", "id,label\na,1.50\nb,2\n")).classes == (
        "1.50",
        "2",
    )
    with pytest.warns(
        RunWarning, match=r"differ only in case or surrounding spaces .*'Yes', 'yes'"
    ):
        read_label_file(write(tmp_path / "y.csv", "id,label\na,yes\nb,Yes\nc,no\nd,yes\n"))


def test_a_label_column_before_the_id_column_is_read_as_written(tmp_path):
    labels = read_label_file(write(tmp_path / "y.csv", "label,x,id\nNA,1,007\nEU,2,b\nNA,3,c\n"))
    assert labels.ids.tolist() == ["007", "b", "c"] and labels.labels.tolist() == [1, 0, 1]
