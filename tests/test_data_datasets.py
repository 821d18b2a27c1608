"""The offline dataset registry: installed datasets load with their documented shapes."""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path

import numpy as np
import pytest

from secure_vfl.data import datasets
from secure_vfl.data.datasets import (
    DATASETS,
    DatasetSplit,
    LabeledArrays,
    data_home,
    dataset_status,
    install_dataset,
    load_dataset,
    read_idx_gz,
)
from secure_vfl.errors import DataError, DatasetNotInstalledError, RegistryError


def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(scope="module")
def fashion_mnist() -> DatasetSplit:
    return load_dataset("fashion-mnist", rng=rng())


@pytest.fixture
def empty_data_home(tmp_path, monkeypatch) -> Path:
    """No dataset files anywhere: an empty data home and an empty system root."""
    monkeypatch.setenv("SECURE_VFL_DATA", str(tmp_path / "home"))
    monkeypatch.setattr(datasets, "_SYSTEM_ROOT", tmp_path / "system")
    return tmp_path / "home"


def check_split(split: DatasetSplit, train: int, test: int, shape: tuple[int, ...], classes: int):
    assert split.train.x.shape == (train, *shape) and split.test.x.shape == (test, *shape)
    assert split.train.x.dtype == np.float32 and split.train.y.dtype == np.int64
    assert split.num_classes == classes
    labels = np.concatenate([split.train.y, split.test.y])
    assert set(np.unique(labels)) == set(range(classes))
    assert np.isfinite(split.train.x).all() and np.isfinite(split.test.x).all()


def test_digits_loads_with_stratified_80_20_split():
    split = load_dataset("digits", rng=rng())
    check_split(split, 1438, 359, (64,), 10)
    assert split.kind == "tabular" and split.feature_names is not None


def test_breast_cancer_loads():
    check_split(load_dataset("breast-cancer", rng=rng()), 456, 113, (30,), 2)


def test_wine_loads():
    check_split(load_dataset("wine", rng=rng()), 142, 36, (13,), 3)


def test_fashion_mnist_has_official_split_and_unit_range(fashion_mnist):
    check_split(fashion_mnist, 60000, 10000, (1, 28, 28), 10)
    assert fashion_mnist.kind == "image"
    assert fashion_mnist.train.x.min() == 0.0 and fashion_mnist.train.x.max() == 1.0
    assert np.bincount(fashion_mnist.test.y).tolist() == [1000] * 10


def test_satellite_has_statlog_split():
    split = load_dataset("satellite", rng=rng())
    check_split(split, 4435, 2000, (36,), 6)
    assert split.feature_names is not None and len(split.feature_names) == 36


def test_german_credit_has_61_features_and_good_as_1():
    split = load_dataset("german-credit", rng=rng())
    assert len(split.train) + len(split.test) == 1000
    check_split(split, 800, 200, (61,), 2)
    assert np.concatenate([split.train.y, split.test.y]).sum() == 700  # 700 Good, 300 Bad
    assert split.feature_names is not None and "Class" not in split.feature_names


def test_split_without_official_one_depends_on_rng():
    first = load_dataset("german-credit", rng=np.random.default_rng(1))
    second = load_dataset("german-credit", rng=np.random.default_rng(2))
    assert not np.array_equal(first.test.x, second.test.x)


def test_missing_files_raise_not_installed_with_install_command(empty_data_home):
    assert not DATASETS.get("fashion-mnist").is_installed()
    with pytest.raises(DatasetNotInstalledError, match="`secure-vfl datasets install satellite`"):
        load_dataset("satellite", rng=rng())
    with pytest.raises(DatasetNotInstalledError, match=str(empty_data_home / "debian")):
        load_dataset("fashion-mnist", rng=rng())
    status = {spec.name: present for spec, present in dataset_status()}
    assert status["digits"] and not status["fashion-mnist"] and not status["german-credit"]


def test_system_location_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("SECURE_VFL_DATA", str(tmp_path / "home"))
    monkeypatch.setattr(datasets, "_SYSTEM_ROOT", tmp_path / "system")
    spec = DATASETS.get("german-credit")
    (path,) = spec.files()
    relative = path.relative_to(tmp_path / "home" / "debian")
    (tmp_path / "system" / relative).parent.mkdir(parents=True)
    (tmp_path / "system" / relative).write_bytes(b"")
    assert spec.is_installed() and spec.files() == [tmp_path / "system" / relative]


def test_registering_a_name_twice_raises():
    with pytest.raises(RegistryError, match="dataset 'digits' is already registered"):
        DATASETS.register("digits", DATASETS.get("digits"))
    with pytest.raises(RegistryError, match="unknown dataset 'mnist'"):
        load_dataset("mnist", rng=rng())


def test_data_home_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("SECURE_VFL_DATA", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_home() == tmp_path / "xdg" / "secure-vfl"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert data_home() == Path.home() / ".local" / "share" / "secure-vfl"
    monkeypatch.setenv("SECURE_VFL_DATA", str(tmp_path / "explicit"))
    assert data_home() == tmp_path / "explicit"


def test_install_is_a_noop_when_installed():
    messages: list[str] = []
    install_dataset("digits", log=messages.append)
    assert messages == ["digits: already installed."]


def completed(code: int, stderr: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess([], code, "", stderr)


def test_install_failure_as_non_root_names_the_commands(empty_data_home, monkeypatch):
    calls: list[list[str]] = []

    def failing_run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return completed(100, "E: Unable to locate package")

    monkeypatch.setattr(datasets, "_is_root", lambda: False)
    monkeypatch.setattr(datasets, "_run", failing_run)
    with pytest.raises(DataError, match=r"`sudo apt-get update`.*secure-vfl datasets install sat"):
        install_dataset("satellite", log=lambda _: None)
    assert calls == [["apt-get", "download", "r-cran-mlbench"]]


def test_install_as_root_updates_once_then_unpacks(empty_data_home, monkeypatch):
    calls: list[list[str]] = []
    relative = "usr/lib/R/site-library/caret/data/GermanCredit.RData"

    def fake_run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        downloads = sum(c[:2] == ["apt-get", "download"] for c in calls)
        if cmd[:2] == ["apt-get", "download"] and downloads == 2:
            assert cwd is not None
            (cwd / "r-cran-caret_1.0_all.deb").write_bytes(b"deb")
        elif cmd[:2] == ["dpkg", "-x"]:
            target = Path(cmd[3]) / relative
            target.parent.mkdir(parents=True)
            target.write_bytes(b"")
        return completed(1 if downloads == 1 and cmd[1] == "download" else 0)

    monkeypatch.setattr(datasets, "_is_root", lambda: True)
    monkeypatch.setattr(datasets, "_run", fake_run)
    install_dataset("german-credit", log=lambda _: None)
    assert [c[:2] for c in calls] == [
        ["apt-get", "download"],
        ["apt-get", "update"],
        ["apt-get", "download"],
        ["dpkg", "-x"],
    ]
    assert (empty_data_home / "debian" / relative).is_file()
    assert DATASETS.get("german-credit").is_installed()


def test_an_unpack_that_fails_midway_installs_no_file_and_a_damaged_file_is_named(
    empty_data_home, monkeypatch, tmp_path
):
    """dpkg unpacked straight into the data home: a file it left cut short (stopped, or out of
    disk) counted as installed, `install` said "already installed", and training ended in a
    traceback (LZMAError) from reading it."""
    relative = "usr/lib/R/site-library/mlbench/data/Satellite.rda"

    def dying_run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        if cmd[:2] == ["apt-get", "download"]:
            assert cwd is not None
            (cwd / "r-cran-mlbench_1.0_amd64.deb").write_bytes(b"deb")
        elif cmd[:2] == ["dpkg", "-x"]:
            cut = Path(cmd[3]) / relative  # half a file, then the unpack fails
            cut.parent.mkdir(parents=True)
            cut.write_bytes(b"\xfd7zXZ\x00")
            return completed(2)
        return completed(0)

    monkeypatch.setattr(datasets, "_run", dying_run)
    with pytest.raises(DataError, match="must unpack into"):
        install_dataset("satellite", log=lambda _: None)
    assert not DATASETS.get("satellite").is_installed()
    assert [p.name for p in empty_data_home.iterdir()] == ["debian"]  # no staging left
    damaged = tmp_path / "Satellite.rda"
    damaged.write_bytes(b"\xfd7zXZ\x00" + bytes(100))
    with pytest.raises(DataError, match=r"Satellite\.rda must be an R data file; it cannot be"):
        datasets.read_rda(damaged, "satellite")


def test_read_idx_round_trip_and_bad_magic(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    header = (2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in images.shape)
    path = tmp_path / "images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(header + images.tobytes()))
    np.testing.assert_array_equal(read_idx_gz(path), images)
    path.write_bytes(gzip.compress(b"\x00\x00\x09\x99" + header[4:] + images.tobytes()))
    with pytest.raises(DataError, match=r"must start with idx magic 2049 or 2051. Found 2457"):
        read_idx_gz(path)
    path.write_bytes(gzip.compress(header + images.tobytes()[:-1]))
    with pytest.raises(DataError, match=r"declares shape \(2, 3, 4\) \(24 bytes\). Found 23"):
        read_idx_gz(path)


def test_labeled_arrays_validate_dtypes_and_shapes():
    with pytest.raises(DataError, match="`x` must be float32"):
        LabeledArrays(np.zeros((2, 3)), np.zeros(2, np.int64))
    with pytest.raises(
        DataError, match=r"`y` must be int64 of shape \(2,\). Found int64 of shape \(3,\)"
    ):
        LabeledArrays(np.zeros((2, 3), np.float32), np.zeros(3, np.int64))
    arrays = LabeledArrays(np.zeros((2, 3), np.float32), np.array([0, 2]))
    with pytest.raises(DataError, match=r"`train.y` must be in 0..1. Found 2"):
        DatasetSplit("toy", "tabular", arrays, arrays, num_classes=2)
