"""Loaders of the papers' original datasets, on tiny files written in the published formats."""

from __future__ import annotations

import datetime
import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from secure_vfl.data.originals import load_cifar, load_credit_default, load_hapt
from secure_vfl.errors import ConfigError, DataError


def write_cifar_batch(path: Path, n: int, label_key: bytes, seed: int, classes: int) -> dict:
    generator = np.random.default_rng(seed)
    batch = {
        b"batch_label": b"tiny batch",
        b"data": generator.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        label_key: generator.integers(0, classes, size=n).tolist(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(batch, protocol=2))
    return batch


def make_cifar10(root: Path) -> list[dict]:
    folder = root / "cifar-10-batches-py"
    batches = [
        write_cifar_batch(folder / f"data_batch_{i}", 4, b"labels", i, 10) for i in range(1, 6)
    ]
    batches.append(write_cifar_batch(folder / "test_batch", 3, b"labels", 9, 10))
    return batches


def test_cifar10_loads_images_in_channel_first_unit_range(tmp_path):
    batches = make_cifar10(tmp_path)
    split = load_cifar(tmp_path, which=10)
    assert split.kind == "image" and split.num_classes == 10
    assert split.train.x.shape == (20, 3, 32, 32) and split.test.x.shape == (3, 3, 32, 32)
    assert split.train.x.min() >= 0.0 and split.train.x.max() <= 1.0
    first = batches[0][b"data"][0]
    assert split.train.x[0, 0, 0, 0] == pytest.approx(first[0] / 255)  # red plane first
    assert split.train.x[0, 1, 0, 0] == pytest.approx(first[1024] / 255)  # then green
    assert split.train.x[0, 0, 0, 1] == pytest.approx(first[1] / 255)
    assert split.train.y.tolist() == [y for b in batches[:5] for y in b[b"labels"]]
    assert load_cifar(tmp_path / "cifar-10-batches-py", which=10).train.x.shape[0] == 20


def test_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    train = write_cifar_batch(folder / "train", 6, b"fine_labels", 1, 100)
    write_cifar_batch(folder / "test", 2, b"fine_labels", 2, 100)
    split = load_cifar(tmp_path, which=100)
    assert split.num_classes == 100 and split.train.y.tolist() == train[b"fine_labels"]


def test_cifar_missing_batch_names_the_file(tmp_path):
    make_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"expected data_batch_3 at .*Found no such file"):
        load_cifar(tmp_path, which=10)


def test_cifar_malformed_batch_is_refused(tmp_path):
    make_cifar10(tmp_path)
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    bad.write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(
        DataError, match=r"must be uint8 of shape \(N, 3072\). Found uint8 \(2, 100\)"
    ):
        load_cifar(tmp_path, which=10)
    bad.write_bytes(b"not a pickle")
    with pytest.raises(DataError, match=r"must be a CIFAR python pickle batch"):
        load_cifar(tmp_path, which=10)


def test_cifar_pickle_with_foreign_objects_is_refused(tmp_path):
    make_cifar10(tmp_path)
    tampered = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [datetime.date(2020, 1, 1)]}
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps(tampered))
    with pytest.raises(DataError, match=r"refusing to load datetime.date"):
        load_cifar(tmp_path, which=10)


def test_cifar_which_must_be_10_or_100(tmp_path):
    with pytest.raises(ConfigError, match=r"`which` must be 10 or 100. Found 20"):
        load_cifar(tmp_path, which=20)  # type: ignore[arg-type]


def make_hapt(root: Path, features: int = 5) -> None:
    generator = np.random.default_rng(0)
    for part, folder, n in (("train", "Train", 24), ("test", "Test", 12)):
        (root / folder).mkdir(parents=True)
        x = generator.normal(size=(n, features))
        np.savetxt(root / folder / f"X_{part}.txt", x, fmt="%.6e", delimiter=" ")
        y = np.arange(n) % 12 + 1
        np.savetxt(root / folder / f"y_{part}.txt", y, fmt="%d")


def test_hapt_maps_labels_1_to_12_onto_0_to_11(tmp_path):
    make_hapt(tmp_path)
    split = load_hapt(tmp_path)
    assert split.train.x.shape == (24, 5) and split.test.x.shape == (12, 5)
    assert split.num_classes == 12
    assert split.train.y.min() == 0 and split.train.y.max() == 11
    expected = np.loadtxt(tmp_path / "Train" / "X_train.txt", dtype=np.float32)
    np.testing.assert_allclose(split.train.x, expected)


def test_hapt_refuses_out_of_range_labels_and_text(tmp_path):
    make_hapt(tmp_path)
    (tmp_path / "Test" / "y_test.txt").write_text("1\n13\n" + "2\n" * 10)
    with pytest.raises(
        DataError, match=r"labels must be integers 1\.\.12. Found values \[1.0, 2.0, 13.0\]"
    ):
        load_hapt(tmp_path)
    (tmp_path / "Train" / "X_train.txt").write_text("1.0 abc\n")
    with pytest.raises(DataError, match=r"X_train.txt must hold whitespace-separated numbers"):
        load_hapt(tmp_path)


def test_hapt_missing_file_is_named(tmp_path):
    make_hapt(tmp_path)
    (tmp_path / "Test" / "X_test.txt").unlink()
    with pytest.raises(
        DataError, match=r"expected X_test.txt at .*Found no such file .*y_test.txt"
    ):
        load_hapt(tmp_path)


def credit_frame(n: int = 100) -> pd.DataFrame:
    generator = np.random.default_rng(0)
    frame = pd.DataFrame(
        {"ID": np.arange(1, n + 1), "LIMIT_BAL": generator.integers(1, 50, n) * 1e4}
    )
    for column in ("SEX", "EDUCATION", "AGE", "PAY_0", "BILL_AMT1", "PAY_AMT1"):
        frame[column] = generator.integers(0, 100, n)
    frame["default.payment.next.month"] = (np.arange(n) % 4 == 0).astype(int)
    return frame


def test_credit_default_csv_gives_stratified_split(tmp_path):
    credit_frame().to_csv(tmp_path / "UCI_Credit_Card.csv", index=False)
    split = load_credit_default(tmp_path, rng=np.random.default_rng(0))
    assert split.train.x.shape == (80, 7) and split.test.x.shape == (20, 7)
    assert split.feature_names is not None and "ID" not in split.feature_names
    assert split.test.y.sum() == 5 and split.train.y.sum() == 20
    again = load_credit_default(tmp_path, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(split.test.x, again.test.x)


def test_credit_default_csv_without_label_is_refused(tmp_path):
    credit_frame().drop(columns="default.payment.next.month").to_csv(
        tmp_path / "UCI_Credit_Card.csv", index=False
    )
    with pytest.raises(DataError, match=r"must have columns ID and default.payment.next.month"):
        load_credit_default(tmp_path, rng=np.random.default_rng(0))


def test_credit_default_missing_files_are_named(tmp_path):
    with pytest.raises(DataError, match=r"expected UCI_Credit_Card.csv or 'default of credit"):
        load_credit_default(tmp_path, rng=np.random.default_rng(0))


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) for m in ("xlrd", "python_calamine")),
    reason="an Excel reader is installed, so the .xls is read instead of refused",
)
def test_credit_default_xls_without_reader_says_convert_to_csv(tmp_path):
    (tmp_path / "default of credit card clients.xls").write_bytes(b"\xd0\xcf\x11\xe0")
    with pytest.raises(DataError, match=r"convert the sheet to CSV"):
        load_credit_default(tmp_path, rng=np.random.default_rng(0))
