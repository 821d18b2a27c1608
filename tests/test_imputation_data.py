"""The imputation data layer: client schemas, row partition, the hiding protocol, client files,
R lazy-load databases and the offline imputation datasets."""

from __future__ import annotations

import bz2
import lzma
import subprocess
import warnings
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import rdata

from secure_vfl.data import datasets
from secure_vfl.data.imputation import (
    AIRQUALITY_COLUMNS,
    IMPUTATION_DATASETS,
    OZONE_COLUMNS,
    ClientData,
    ImputationTask,
    client_file_columns,
    client_from_frame,
    hide_entries,
    imputation_dataset_status,
    install_imputation_dataset,
    load_imputation_dataset,
    make_imputation_task,
    make_task_from_client_files,
    read_client_files,
    read_lazyload,
)
from secure_vfl.errors import ConfigError, DataError, DatasetNotInstalledError, RegistryError


def table(rows: int = 103, features: int = 10, seed: int = 0) -> pd.DataFrame:
    """A numeric table whose first column numbers the rows and with ~10 % natural NaNs."""
    generator = np.random.default_rng(seed)
    values = generator.normal(size=(rows, features))
    values[generator.random(values.shape) < 0.1] = np.nan
    values[:, 0] = np.arange(rows)
    return pd.DataFrame(values, columns=[f"x{i}" for i in range(features)])


def all_clients(task: ImputationTask) -> list[ClientData]:
    return [*task.train, *task.test]


@pytest.mark.parametrize("features", [10, 7, 13])
def test_each_client_keeps_round_availability_times_f_features_and_nan_elsewhere(features):
    task = make_imputation_task(table(features=features), name="t", rng=np.random.default_rng(1))
    kept = round(0.6 * features)
    assert len(task.train) == len(task.test) == 4
    assert task.features == tuple(f"x{i}" for i in range(features))
    for train, test in zip(task.train, task.test, strict=True):
        assert train.available.sum() == kept
        np.testing.assert_array_equal(train.available, test.available)
        for client in (train, test):
            assert np.isnan(client.values[:, ~client.available]).all()
            assert not client.observed[:, ~client.available].any()
    masks = {tuple(client.available) for client in task.train}
    assert len(masks) > 1  # drawn independently per client


def test_availability_keeps_at_least_one_feature():
    task = make_imputation_task(
        table(features=3), name="t", availability=0.1, rng=np.random.default_rng(0)
    )
    assert all(client.available.sum() == 1 for client in task.train)


def test_rows_are_partitioned_into_clients_and_disjoint_train_test():
    frame = table(rows=103)
    task = make_imputation_task(frame, name="t", availability=1.0, rng=np.random.default_rng(2))
    ids = np.concatenate([client.values[:, 0] for client in all_clients(task)])
    assert sorted(ids.tolist()) == list(range(103))  # every row exactly once
    sizes = [train.n + test.n for train, test in zip(task.train, task.test, strict=True)]
    assert sorted(sizes) == [25, 26, 26, 26]
    for train, test in zip(task.train, task.test, strict=True):
        assert test.n == round(0.2 * (train.n + test.n))
        assert not set(train.values[:, 0]) & set(test.values[:, 0])
    original = frame.to_numpy(dtype=np.float32)
    for client in all_clients(task):  # rows are carried whole, natural NaNs included
        rows = client.values[:, 0].astype(int)
        np.testing.assert_array_equal(client.values, original[rows])


def test_natural_missing_stays_distinct_from_unavailable():
    frame = table(rows=200)
    task = make_imputation_task(frame, name="t", rng=np.random.default_rng(3))
    original = frame.to_numpy(dtype=np.float32)
    holding = [c for c in all_clients(task) if c.available[0]]
    assert holding
    for client in holding:
        rows = original[client.values[:, 0].astype(int)]
        np.testing.assert_array_equal(client.observed, client.available & ~np.isnan(rows))
        assert (client.available & np.isnan(client.values)).any()  # missing inside the schema


def test_same_rng_same_task_other_rng_other_task():
    def build(seed: int) -> ImputationTask:
        return make_imputation_task(table(), name="t", rng=np.random.default_rng(seed))

    first, again, other = build(5), build(5), build(6)
    for a, b in zip(all_clients(first), all_clients(again), strict=True):
        np.testing.assert_array_equal(a.values, b.values)
        np.testing.assert_array_equal(a.available, b.available)
    assert any(
        not np.array_equal(a.available, b.available)
        for a, b in zip(first.train, other.train, strict=True)
    )


def test_make_task_refuses_bad_settings():
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match=r"`clients` must be an integer >= 1. Found 0"):
        make_imputation_task(table(), name="t", clients=0, rng=rng)
    with pytest.raises(ConfigError, match=r"`availability` must be in \(0, 1\]. Found 1.5"):
        make_imputation_task(table(), name="t", availability=1.5, rng=rng)
    with pytest.raises(ConfigError, match=r"`availability` must be in \(0, 1\]. Found 0"):
        make_imputation_task(table(), name="t", availability=0.0, rng=rng)
    with pytest.raises(ConfigError, match=r"`test_fraction` must be in \(0, 1\). Found 1"):
        make_imputation_task(table(), name="t", test_fraction=1.0, rng=rng)
    with pytest.raises(DataError, match=r"must keep at least 2 training rows. Found 1 rows"):
        make_imputation_task(table(rows=15), name="t", clients=8, rng=rng)
    with pytest.raises(
        DataError, match=r"dataset 't' must have at least 2 feature columns. Found 1"
    ):
        make_imputation_task(table(features=1), name="t", rng=rng)
    text = table().assign(city="Oslo")
    with pytest.raises(DataError, match=r"numeric. Found non-numeric \['city'\]"):
        make_imputation_task(text, name="t", rng=rng)


def test_client_data_validates_schema_and_dtypes():
    values = np.array([[1.0, np.nan], [2.0, np.nan]], dtype=np.float32)
    client = ClientData("c", values, np.array([True, False]))
    assert client.n == 2
    np.testing.assert_array_equal(client.observed, [[True, False], [True, False]])
    with pytest.raises(DataError, match=r"unavailable features must hold only NaN. Found 2"):
        ClientData("c", values, np.array([False, False]))
    with pytest.raises(
        DataError, match=r"`values` must be float32 of shape \(n, F\). Found float64"
    ):
        ClientData("c", values.astype(np.float64), np.array([True, False]))
    with pytest.raises(DataError, match=r"`available` must be bool of shape \(2,\)"):
        ClientData("c", values, np.array([1, 0]))
    with pytest.raises(DataError, match=r"finite or NaN\. Found 1 infinite"):
        ClientData("c", np.array([[np.inf, 0.0]], np.float32), np.array([True, True]))


def protocol_client() -> ClientData:
    task = make_imputation_task(
        table(rows=400, features=12), name="t", clients=1, rng=np.random.default_rng(4)
    )
    return task.test[0]


def test_hide_entries_hides_the_share_of_observed_available_entries_only():
    client = protocol_client()
    before = client.values.copy()
    hidden_client, hidden = hide_entries(client, 0.2, rng=np.random.default_rng(0))
    assert hidden.shape == client.values.shape and hidden.dtype == np.bool_
    assert hidden.sum() == round(0.2 * client.observed.sum())
    assert not (hidden & ~client.observed).any()  # never unavailable or already missing
    assert np.isnan(hidden_client.values[hidden]).all()
    np.testing.assert_array_equal(hidden_client.values[~hidden], client.values[~hidden])
    np.testing.assert_array_equal(hidden_client.observed, client.observed & ~hidden)
    np.testing.assert_array_equal(client.values, before)  # the input is untouched
    np.testing.assert_array_equal(hidden_client.available, client.available)


def test_hide_entries_is_fixed_by_the_seed_and_bounded():
    client = protocol_client()
    _, first = hide_entries(client, rng=np.random.default_rng(7))
    _, again = hide_entries(client, rng=np.random.default_rng(7))
    _, other = hide_entries(client, rng=np.random.default_rng(8))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert first.sum() == round(0.2 * client.observed.sum())  # 0.2 is the default
    assert not hide_entries(client, 0.0, rng=np.random.default_rng(0))[1].any()
    np.testing.assert_array_equal(
        hide_entries(client, 1.0, rng=np.random.default_rng(0))[1], client.observed
    )
    with pytest.raises(ConfigError, match=r"`fraction` must be in \[0, 1\]. Found 1.2"):
        hide_entries(client, 1.2, rng=np.random.default_rng(0))


def write_client_files(tmp_path: Path) -> list[Path]:
    first = tmp_path / "hospital-a.csv"
    first.write_text("id,age,bp\n007,40,120\n008,,130\n009,60,\n")
    second = tmp_path / "hospital-b.parquet"
    pd.DataFrame({"bp": [110.0, np.nan], "chol": [5.1, 6.2]}).to_parquet(second)
    return [first, second]


def test_client_files_union_of_columns_absent_is_unavailable_nan_is_missing(tmp_path):
    features, clients = read_client_files(write_client_files(tmp_path))
    assert features == ("age", "bp", "chol")  # union in first-seen order; id ignored
    a, b = clients
    assert (a.name, b.name) == ("hospital-a", "hospital-b")
    np.testing.assert_array_equal(a.available, [True, True, False])
    np.testing.assert_array_equal(b.available, [False, True, True])
    np.testing.assert_array_equal(
        a.observed, [[True, True, False], [False, True, False], [True, False, False]]
    )
    np.testing.assert_array_equal(a.values[0], np.array([40, 120, np.nan], np.float32))
    np.testing.assert_array_equal(b.values[:, 2], np.array([5.1, 6.2], np.float32))
    assert np.isnan(b.values[:, 0]).all()


def test_task_from_client_files_splits_each_client(tmp_path):
    paths = write_client_files(tmp_path)
    paths.append(tmp_path / "hospital-c.csv")
    pd.DataFrame({"age": np.arange(20.0), "chol": np.arange(20.0)}).to_csv(paths[2], index=False)
    task = make_task_from_client_files(paths, test_fraction=0.25, seed=0)
    assert [c.n for c in task.train] == [2, 2, 15] and [c.n for c in task.test] == [1, 0, 5]
    ages = np.concatenate([task.train[2].values[:, 0], task.test[2].values[:, 0]])
    assert sorted(ages.tolist()) == list(range(20))


def test_client_split_is_seeded_and_random(tmp_path):
    path = tmp_path / "site.csv"
    pd.DataFrame({"age": np.arange(50.0), "bp": np.arange(50.0)}).to_csv(path, index=False)

    def test_ages(seed: int) -> list[float]:
        task = make_task_from_client_files([path], seed=seed)
        return task.test[0].values[:, 0].tolist()

    assert test_ages(0) == test_ages(0)
    assert test_ages(0) != test_ages(1)
    assert test_ages(0) != list(range(10)) and test_ages(0) != list(range(40, 50))


def test_client_from_frame_refuses_unknown_columns():
    frame = pd.DataFrame({"x": [1.0], "w": [2.0]})  # feature columns only
    with pytest.raises(DataError, match=r"among the 2 global features. Found unknown \['w'\]"):
        client_from_frame("c", frame, ["x", "y"])


def test_bad_client_files_are_refused_with_file_and_column(tmp_path):
    text = tmp_path / "text.csv"
    text.write_text("id,age,city\n1,40,Oslo\n")
    with pytest.raises(DataError, match=r"text.csv: feature columns must be numeric.*\['city'\]"):
        read_client_files([text])
    keyed = tmp_path / "keyed.csv"  # ids under another name: it said only "must be numeric"
    keyed.write_text("customer,age\nc-1,40\nc-2,41\n")
    with pytest.raises(
        DataError,
        match=r"\['customer'\] \('customer' holds 'c-1' at data row 1\) \(an empty cell is a "
        r"missing value\); the file has no id column `id`: if 'customer' holds the ids, give "
        r"--id-column customer\.",
    ):
        read_client_files([keyed])
    empty = tmp_path / "empty.csv"
    empty.write_text("age,bp\n")
    with pytest.raises(DataError, match=r"empty.csv must have at least one row. Found none"):
        read_client_files([empty])
    only_id = tmp_path / "only-id.csv"
    only_id.write_text("id\n1\n")
    with pytest.raises(DataError, match=r"only-id.csv must have at least one feature column"):
        read_client_files([only_id])
    with pytest.raises(DataError, match=r"must be a .csv or .parquet file. Found suffix '.txt'"):
        read_client_files([tmp_path / "x.txt"])
    with pytest.raises(DataError, match=r"expected a client file at .*absent.csv"):
        read_client_files([tmp_path / "absent.csv"])
    one = tmp_path / "one.csv"
    one.write_text("age\n1\n2\n")
    with pytest.raises(DataError, match=r"at least 2 feature columns. Found 1"):
        read_client_files([one])
    (tmp_path / "sub").mkdir()
    twin = tmp_path / "sub" / "one.csv"
    twin.write_text("bp\n1\n")
    with pytest.raises(DataError, match=r"distinct names \(file stems\). Found 'one' twice"):
        read_client_files([one, twin])
    with pytest.raises(ConfigError, match="at least one client file"):
        read_client_files([])


def test_client_files_with_an_empty_or_repeated_id_or_a_column_nobody_observed_are_refused(
    tmp_path,
):
    """An empty id cell cut every saved id to its first character (u000 -> u); a repeated id
    passed into tables advertised for `train`; a column with no value anywhere was filled with
    what the model made of nothing."""
    other = tmp_path / "other.csv"
    other.write_text("id,bp,chol\nu000,120,5\nu001,130,6\n")
    empty_id = tmp_path / "empty_id.csv"
    empty_id.write_text("id,age,bp\nu000,40,120\n,50,130\nu002,60,\n")
    with pytest.raises(DataError, match=r"empty_id.csv: every row must have an id. Found 1 empty"):
        read_client_files([empty_id, other])
    repeated = tmp_path / "repeated.csv"
    repeated.write_text("id,age,bp\nu000,40,120\nu000,50,130\n")
    with pytest.raises(DataError, match=r"repeated.csv: ids must be unique"):
        read_client_files([repeated, other])
    unobserved = tmp_path / "unobserved.csv"
    unobserved.write_text("id,age,bp,z\nu000,40,120,\nu001,50,,\n")
    with pytest.raises(DataError, match=r"needs a value in some client file.*none of 'z'"):
        read_client_files([unobserved, other])
    features, _ = read_client_files([other])
    assert features == ("bp", "chol")


def test_a_feature_with_values_in_test_rows_only_is_refused_naming_it(tmp_path):
    """Its values all fell in the seed's test rows: every method imputed it from nothing (mean
    0, std 1), and its hidden entries' raw errors were scored as std units (RMSE 1025 on a
    column near 1000), where a deployed run refuses it from the statistics' counts."""
    site, rare = tmp_path / "site.csv", tmp_path / "rare.csv"
    frame = pd.DataFrame({"age": np.arange(40.0), "bp": np.arange(40.0) * 2})
    for path in (site, rare):
        frame.to_csv(path, index=False)
    test_rows = make_task_from_client_files([site, rare], seed=0).files[1].in_test
    frame["chol"] = np.where(test_rows, 1000.0 + np.arange(40.0), np.nan)
    frame.to_csv(rare, index=False)
    with pytest.raises(DataError, match=r"training rows, to impute it from; found none of 'chol'"):
        make_task_from_client_files([site, rare], seed=0)
    make_task_from_client_files([site, rare], seed=1)  # another split has some in training
    wide = table(rows=40)
    wide["x9"] = np.nan
    wide.loc[0, "x9"] = 1.0  # its one value, in a row that seed 14 deals to a test split
    rng = np.random.default_rng(14)
    with pytest.raises(DataError, match=r"none of 'x9' in the training rows.*fewer clients"):
        make_imputation_task(wide, name="wide", clients=4, availability=1.0, rng=rng)


def test_a_parquet_column_of_nulls_is_missing_and_one_of_numbers_as_text_is_named(tmp_path):
    """Both ended in an IndexError traceback: no cell of the column was text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    nulls, other = tmp_path / "n0.parquet", tmp_path / "n1.parquet"
    pq.write_table(
        pa.table({"id": ["a", "b"], "x": [1.0, None], "y": [2.0, 2.5], "z": pa.nulls(2)}), nulls
    )
    pq.write_table(
        pa.table({"id": ["d", "e"], "x": [1.5, 2.0], "y": [1.0, 2.0], "z": [1.0, 3.0]}), other
    )
    features, clients = read_client_files([nulls, other])
    assert features == ("x", "y", "z")
    assert np.isnan(clients[0].values[:, 2]).all() and clients[0].available[2]
    text = tmp_path / "t0.parquet"
    pq.write_table(pa.table({"x": ["1.5", None, "3"], "y": [1.0, 2.0, 3.0]}), text)
    with pytest.raises(DataError, match=r"\('x' is stored as text, each cell a number: store it"):
        read_client_files([text])


def test_a_feature_named_id_is_a_feature_when_the_ids_are_named_otherwise(tmp_path):
    """It was dropped as if it held ids, then refused as a feature no file has values of."""
    first, second = tmp_path / "s0.csv", tmp_path / "s1.csv"
    first.write_text("patient,id,a,b\np1,1,1.0,\np2,2,,2.0\np3,3,3.0,3.0\n")
    second.write_text("patient,a,b\nq1,1.5,\nq2,,2.5\nq3,3.5,1.0\n")
    features, clients = read_client_files([first, second], id_column="patient")
    assert features == ("id", "a", "b")
    assert clients[0].values[:, 0].tolist() == [1.0, 2.0, 3.0]


def test_a_csv_column_is_typed_as_a_whole_however_long_the_file(tmp_path):
    """pandas typed each chunk of rows alone: '001' became 1 in the first 262,144 rows and
    stayed '001' after, two categories of one value (and a pandas warning leaked)."""
    from secure_vfl.data.party_files import read_table

    rows = 300_000
    codes = np.where(np.arange(rows) % 2, "001", "002").astype(object)
    codes[-10:] = "A1"
    path = tmp_path / "a.csv"
    pd.DataFrame({"id": np.arange(rows), "seg": codes, "x": 1.0}).to_csv(path, index=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frame = read_table(path, what="party file", id_column="id")
    assert sorted(set(frame["seg"])) == ["001", "002", "A1"]


def test_a_given_id_column_a_client_file_lacks_is_refused_naming_its_columns(tmp_path):
    path = tmp_path / "site.csv"
    path.write_text("id,age,bp,label\na,40,120,0\nb,50,130,1\nc,60,,0\n")
    message = (
        r"site.csv must have an id column `key` \(--id-column\). "
        r"Found columns: \['id', 'age', 'bp', 'label'\]\."
    )
    with pytest.raises(DataError, match=message):
        read_client_files([path], id_column="key")
    # a deployed client reads its own file by the same rule
    with pytest.raises(DataError, match=message):
        client_file_columns(path, id_column="key")


def test_a_given_label_column_no_client_file_has_is_refused_naming_their_columns(tmp_path):
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    first.write_text("id,age,bp,label\na,40,120,0\nb,50,130,1\n")
    second.write_text("age,chol,outcome\n30,5.1,1\n35,,0\n")
    with pytest.raises(
        DataError,
        match=r"a label column `outcme` \(--label-column\) must be in at least one client file. "
        r"Found columns: .*a.csv \['id', 'age', 'bp', 'label'\]; .*b.csv \['age', 'chol', "
        r"'outcome'\]\.",
    ):
        read_client_files([first, second], label_column="outcme")
    # a label held by some clients only: the others have none
    features, _ = read_client_files([second, first], label_column="outcome")
    assert features == ("age", "chol", "bp", "label")


def test_client_files_need_no_id_or_label_column_under_the_default_names(tmp_path):
    path = tmp_path / "site.csv"
    path.write_text("age,bp\n40,120\n50,\n60,140\n70,150\n")
    task = make_task_from_client_files([path], test_fraction=0.25, seed=0)
    assert task.features == ("age", "bp")
    assert task.files is not None and task.files[0].id_column is None
    assert task.files[0].passthrough.columns.tolist() == []
    named = tmp_path / "named.csv"
    named.write_text("key,age,bp,outcome\nk1,40,120,0\nk2,50,,1\nk3,60,140,1\n")
    assert client_file_columns(named, id_column="key", label_column="outcome") == (
        ("age", "bp"),
        3,
        True,
    )
    assert client_file_columns(path) == (("age", "bp"), 4, False)


def test_a_client_file_naming_a_column_twice_is_refused(tmp_path):
    path = tmp_path / "site.csv"
    path.write_text("id,a,a,c,label\nx,1,2,3,0\ny,4,5,6,1\n")
    with pytest.raises(DataError, match=r"site.csv: column names must be distinct. Found \['a'\] "):
        read_client_files([path])


def test_task_refuses_mismatched_clients():
    a = ClientData("a", np.zeros((2, 2), np.float32), np.array([True, True]))
    b = ClientData("a", np.full((2, 2), np.nan, np.float32), np.array([True, False]))
    with pytest.raises(DataError, match="same availability in train and test"):
        ImputationTask("t", ("x", "y"), (a,), (b,))
    with pytest.raises(DataError, match=r"must have the 3 task features. Found 2"):
        ImputationTask("t", ("x", "y", "z"), (a,), (a,))
    with pytest.raises(DataError, match=r"feature names must be distinct. Found \['x'\] repeated"):
        ImputationTask("t", ("x", "x"), (a,), (a,))
    with pytest.raises(DataError, match="client names must be distinct"):
        ImputationTask("t", ("x", "y"), (a, a), (a, a))


# --- R lazy-load databases ---------------------------------------------------------------------


def write_lazyload(tmp_path: Path, compressed: int, kind: bytes, obj: object) -> Path:
    """A one-object lazy-load database as R writes it, for compression ``compressed``."""
    rds = tmp_path / "obj.rds"
    rdata.write_rds(rds, obj, compression=None)
    raw = rds.read_bytes()
    compressors = {
        b"1": zlib.compress,
        b"2": bz2.compress,
        b"Z": lambda d: lzma.compress(
            d, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 6}]
        ),
        b"0": bytes,
    }
    body = compressors[kind](raw) if compressed == 1 else kind + compressors[kind](raw)
    entry = len(raw).to_bytes(4, "big") + body
    database = tmp_path / "Rdata.rdb"
    database.write_bytes(b"padding" + entry)
    index = {
        "variables": {"toy": np.array([7, len(entry)], dtype=np.int32)},
        "references": {},
        "compressed": np.array([compressed], dtype=np.int32),
    }
    rdata.write_rds(database.with_suffix(".rdx"), index)
    return database


@pytest.mark.parametrize(("compressed", "kind"), [(1, b"1"), (2, b"2"), (3, b"Z"), (3, b"0")])
def test_lazyload_reads_every_r_compression(tmp_path, compressed, kind):
    frame = pd.DataFrame({"a": [1.0, np.nan, 3.0], "b": [4.0, 5.0, np.nan]})
    database = write_lazyload(tmp_path, compressed, kind, frame)
    loaded = read_lazyload(database, "toy")
    np.testing.assert_array_equal(loaded.to_numpy(), frame.to_numpy())


def test_lazyload_refuses_unknown_objects_and_corrupt_entries(tmp_path):
    database = write_lazyload(tmp_path, 3, b"Z", pd.DataFrame({"a": [1.0]}))
    with pytest.raises(
        DataError, match=r"must hold an object named 'cars'. Found objects: \['toy'\]"
    ):
        read_lazyload(database, "cars")
    data = bytearray(database.read_bytes())
    data[11] = ord("Q")  # the compression type byte of the entry
    database.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"compression type '0', '1', '2' or 'Z'. Found b'Q'"):
        read_lazyload(database, "toy")
    data[11] = ord("Z")
    data[-5:] = b"\x00" * 5
    database.write_bytes(bytes(data))
    with pytest.raises(DataError, match="entry 'toy' must decompress"):
        read_lazyload(database, "toy")


# --- the offline datasets ----------------------------------------------------------------------


def test_ozone_loads_366_by_10_with_natural_nans():
    frame = load_imputation_dataset("ozone")
    assert frame.shape == (366, 10) and tuple(frame.columns) == OZONE_COLUMNS
    assert (frame.dtypes == np.float64).all()
    assert int(frame.isna().sum().sum()) == 203 and frame["V9"].isna().sum() == 139
    task = make_imputation_task(frame, name="ozone", rng=np.random.default_rng(0))
    assert all(client.available.sum() == 6 for client in task.train)
    assert sum(c.n for c in all_clients(task)) == 366


def test_airquality_loads_153_by_4_with_natural_nans():
    frame = load_imputation_dataset("airquality")
    assert frame.shape == (153, 4) and tuple(frame.columns) == AIRQUALITY_COLUMNS
    assert frame.isna().sum().tolist() == [37, 7, 0, 0]
    assert frame.iloc[0].tolist() == [41.0, 190.0, 7.4, 67.0]


def test_chorizon_is_wide_with_natural_nans():
    frame = load_imputation_dataset("chorizon")
    assert frame.shape == (606, 99)
    assert not any(str(c).startswith("*") for c in frame.columns)
    assert not {"LITO", "TOPC", "PO4_IC"} & set(frame.columns)
    assert frame.notna().any().all() and int(frame.isna().sum().sum()) == 7659
    assert float(frame["Al"].max()) < 10  # log10 concentrations (raw Al reaches ~85800)


def test_every_registered_dataset_is_installed_here():
    assert IMPUTATION_DATASETS.names() == ["airquality", "chorizon", "ozone"]
    assert all(installed for _, installed in imputation_dataset_status())


@pytest.fixture
def empty_data_home(tmp_path, monkeypatch) -> Path:
    """No dataset files anywhere: an empty data home and an empty system root."""
    monkeypatch.setenv("SECURE_VFL_DATA", str(tmp_path / "home"))
    monkeypatch.setattr(datasets, "_SYSTEM_ROOT", tmp_path / "system")
    return tmp_path / "home"


def test_missing_dataset_names_the_install_command(empty_data_home):
    with pytest.raises(DatasetNotInstalledError, match="`secure-vfl datasets install ozone`"):
        load_imputation_dataset("ozone")
    with pytest.raises(DatasetNotInstalledError, match=str(empty_data_home / "debian")):
        load_imputation_dataset("airquality")
    assert not any(installed for _, installed in imputation_dataset_status())
    assert (
        IMPUTATION_DATASETS.get("chorizon").install_hint() == "secure-vfl datasets install chorizon"
    )
    with pytest.raises(RegistryError, match="unknown imputation dataset 'iris'"):
        load_imputation_dataset("iris")


def test_install_uses_the_shared_debian_steps(empty_data_home, monkeypatch):
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        if cmd[:2] == ["apt-get", "download"]:
            assert cwd is not None
            (cwd / "r-base-core_4.2_amd64.deb").write_bytes(b"deb")
        elif cmd[:2] == ["dpkg", "-x"]:
            folder = Path(cmd[3]) / "usr/lib/R/library/datasets/data"
            folder.mkdir(parents=True)
            (folder / "Rdata.rdb").write_bytes(b"")
            (folder / "Rdata.rdx").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(datasets, "_run", fake_run)
    install_imputation_dataset("airquality", log=lambda _: None)
    assert calls[0] == ["apt-get", "download", "r-base-core"] and calls[1][:2] == ["dpkg", "-x"]
    assert IMPUTATION_DATASETS.get("airquality").is_installed()
    messages: list[str] = []
    install_imputation_dataset("airquality", log=messages.append)
    assert messages == ["airquality: already installed."]
