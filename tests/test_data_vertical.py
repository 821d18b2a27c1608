"""The vertical pipeline: partition, standardise with train stats, mask, zero-fill, drop."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from secure_vfl.data.datasets import DatasetSplit, LabeledArrays, load_dataset
from secure_vfl.data.missingness import parse_mechanism
from secure_vfl.data.vertical import VerticalSplit, make_vertical, vertical_from_party_files
from secure_vfl.errors import ConfigError, DataError, RunWarning
from secure_vfl.federation.alignment import JoinAligner


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def toy_split(n_train: int = 4000, n_test: int = 4000, width: int = 12) -> DatasetSplit:
    generator = rng(10)
    train_x = generator.normal(3.0, 2.0, size=(n_train, width)).astype(np.float32)
    test_x = generator.normal(-1.0, 1.0, size=(n_test, width)).astype(np.float32)
    return DatasetSplit(
        name="toy",
        kind="tabular",
        train=LabeledArrays(train_x, generator.integers(0, 3, n_train)),
        test=LabeledArrays(test_x, generator.integers(0, 3, n_test)),
        num_classes=3,
        feature_names=tuple(f"f{i}" for i in range(width)),
    )


def same_rows_split(n: int = 20000) -> DatasetSplit:
    """Train and test are the same rows, labelled by row index so kept rows can be matched."""
    x = rng(11).normal(size=(n, 8)).astype(np.float32)
    arrays = LabeledArrays(x, np.arange(n, dtype=np.int64))
    return DatasetSplit("same", "tabular", arrays, arrays, num_classes=n)


def test_make_vertical_builds_blocks_masks_and_test_splits():
    data = make_vertical(
        load_dataset("digits", rng=rng()),
        parties=4,
        train_missing=parse_mechanism("mcar:0.3"),
        test_missing=[parse_mechanism("mcar:0"), parse_mechanism("mcar:0.5")],
        rng=rng(1),
    )
    assert data.name == "digits" and data.kind == "tabular" and data.num_classes == 10
    assert data.block_shapes == ((16,),) * 4 and data.parties == 4
    assert set(data.tests) == {"mcar:0", "mcar:0.5"}
    assert set(data.dropped) == {"train", "mcar:0", "mcar:0.5"}
    assert data.dropped["mcar:0"] == 0
    assert data.train.n + data.dropped["train"] == 1438
    assert data.tests["mcar:0.5"].n + data.dropped["mcar:0.5"] == 359
    assert data.tests["mcar:0"].mask.all()
    assert data.feature_names is not None and data.feature_names[1][0] == "pixel_2_0"
    for split in (data.train, *data.tests.values()):
        assert split.mask.any(axis=1).all()  # no sample without an observed block
        for k, block in enumerate(split.blocks):
            assert block.dtype == np.float32
            assert not block[~split.mask[:, k]].any()  # unobserved entries are zero


def test_dropped_samples_are_counted():
    data = make_vertical(
        toy_split(),
        parties=2,
        train_missing=parse_mechanism("mcar:0.5"),
        test_missing=[parse_mechanism("mcar:0.5")],
        rng=rng(2),
    )
    # Both of 2 blocks missing: p^2 = 0.25 of 4000 samples.
    assert abs(data.dropped["train"] - 1000) < 100
    assert data.train.n == 4000 - data.dropped["train"]


def test_blocks_are_standardised_with_training_statistics_only():
    data = make_vertical(
        toy_split(),
        parties=3,
        train_missing=parse_mechanism("mcar:0"),
        test_missing=[parse_mechanism("mcar:0")],
        rng=rng(3),
    )
    for block in data.train.blocks:
        np.testing.assert_allclose(block.mean(axis=0), 0.0, atol=1e-4)
        np.testing.assert_allclose(block.std(axis=0), 1.0, atol=1e-3)
    for block in data.tests["mcar:0"].blocks:
        np.testing.assert_allclose(block.mean(axis=0), -2.0, atol=0.1)  # (-1 - 3) / 2


def test_masking_rules_see_standardised_blocks():
    split = toy_split()
    scaled = DatasetSplit(
        "toy",
        "tabular",
        LabeledArrays(split.train.x * 1000 + 7, split.train.y),
        LabeledArrays(split.test.x * 1000 + 7, split.test.y),
        num_classes=3,
    )
    for text in ("mar1", "mar2", "mnar:0.9"):
        mechanism = parse_mechanism(text)
        plain, rescaled = (
            make_vertical(
                data, parties=4, train_missing=mechanism, test_missing=[mechanism], rng=rng(4)
            )
            for data in (split, scaled)
        )
        np.testing.assert_array_equal(plain.train.mask, rescaled.train.mask)
        assert 0.2 < plain.train.mask.mean() < 0.9  # the rule did drop blocks


def drawn_warnings(split: DatasetSplit, parties: int, train: str, *tests: str) -> list[str]:
    """The RunWarnings of make_vertical with these mechanisms (by their text)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_vertical(
            split,
            parties=parties,
            train_missing=parse_mechanism(train),
            test_missing=[parse_mechanism(text) for text in tests],
            rng=rng(4),
        )
    return [str(w.message) for w in caught if issubclass(w.category, RunWarning)]


def test_mar_on_one_column_blocks_warns_that_no_block_went_missing():
    """iris over 4 parties: a block of one column has variance 0, so mar1 and mar2 hid no
    block and the run was mcar:0 under another name, without a word."""
    iris = load_dataset("iris", rng=rng())
    train, test = drawn_warnings(iris, 4, "mar1", "mcar:0", "mar2")
    assert train.startswith(
        "the training missingness mar1 left every block of all 120 training samples observed, "
        "as mcar:0 would: each of the 4 blocks has one column, whose variance within the block "
        "is 0 for every sample, too little for mar1 to end any sample's visit"
    )
    assert test.startswith("the test missingness mar2 left every block of all 30 test samples")
    assert "each of the 4 blocks has one column" in test


def test_missingness_that_hides_blocks_or_is_asked_for_none_does_not_warn():
    assert drawn_warnings(toy_split(300, 300), 4, "mar1", "mar2", "mcar:0", "mcar:0,0,0,0") == []
    assert drawn_warnings(toy_split(300, 300), 4, "mcar:0.2", "dirichlet:inf,0", "mnar:0.7") == []
    # A rate so small that no block went missing: said, without the MAR reason.
    [message] = drawn_warnings(toy_split(100, 100), 4, "mcar:1e-09")
    assert message == (
        "the training missingness mcar:1e-09 left every block of all 100 training samples "
        "observed, as mcar:0 would."
    )


def test_columns_that_equal_blocks_leave_out_are_named():
    iris = load_dataset("iris", rng=rng())
    mechanism = parse_mechanism("mcar:0")
    for parties, left_out in ((3, ("petal width (cm)",)), (4, ()), (2, ())):
        data = make_vertical(
            iris, parties=parties, train_missing=mechanism, test_missing=[], rng=rng()
        )
        assert data.left_out_columns == left_out


def test_train_and_test_masks_are_independent():
    n = 20000
    data = make_vertical(
        same_rows_split(n),
        parties=4,
        train_missing=parse_mechanism("mcar:0.3"),
        test_missing=[parse_mechanism("mcar:0.3"), parse_mechanism("mcar:0.3,0.3,0.3,0.3")],
        rng=rng(5),
    )
    full = []
    for key, split in [("train", data.train), *data.tests.items()]:
        mask = np.zeros((n, 4), dtype=bool)  # dropped rows: no block observed
        mask[split.labels] = split.mask
        assert data.dropped[key] == n - split.n > 0
        full.append(mask)
    for first, second in ((0, 1), (0, 2), (1, 2)):
        both_missing = (~full[first] & ~full[second]).mean()
        assert abs(both_missing - 0.09) < 0.01  # p^2 when independent, 0.3 if identical


def test_duplicate_test_mechanisms_are_refused():
    with pytest.raises(ConfigError, match=r"must be distinct. Found repeated \['mar1'\]"):
        make_vertical(
            toy_split(100, 100),
            parties=2,
            train_missing=parse_mechanism("mar1"),
            test_missing=[parse_mechanism("mar1"), parse_mechanism("mar1")],
            rng=rng(),
        )


def test_image_data_is_cut_into_patches():
    generator = rng(6)
    arrays = LabeledArrays(
        generator.random((50, 1, 28, 28)).astype(np.float32), generator.integers(0, 10, 50)
    )
    split = DatasetSplit("images", "image", arrays, arrays, num_classes=10)
    data = make_vertical(
        split,
        parties=8,
        train_missing=parse_mechanism("mcar:0.2"),
        test_missing=[parse_mechanism("mar2")],
        rng=rng(7),
    )
    assert data.block_shapes == ((1, 14, 7),) * 8
    assert data.feature_names is None


def test_subset_keeps_blocks_labels_and_mask_in_step():
    data = make_vertical(
        toy_split(100, 100),
        parties=3,
        train_missing=parse_mechanism("mcar:0.2"),
        test_missing=[],
        rng=rng(8),
    )
    index = np.array([5, 2, 9])
    subset = data.train.subset(index)
    assert subset.n == 3 and subset.parties == 3
    np.testing.assert_array_equal(subset.blocks[1], data.train.blocks[1][index])
    np.testing.assert_array_equal(subset.labels, data.train.labels[index])
    np.testing.assert_array_equal(subset.mask, data.train.mask[index])


def test_vertical_split_validates_its_arrays():
    with pytest.raises(DataError, match=r"`mask` must be bool of shape \(2, 1\)"):
        VerticalSplit((np.zeros((2, 3), np.float32),), np.zeros(2, np.int64), np.ones((2, 2), bool))


def write_party_files(root: Path) -> tuple[list[Path], Path]:
    """Three parties holding overlapping ids; feature a separates the labels (10 * label + k
    + noise in [0, 1): not the label itself, which a party file may not hold)."""
    generator = rng(12)
    ids = np.array([f"u{i:04d}" for i in range(600)])
    labels = generator.integers(0, 2, ids.size)
    label_path = root / "labels.csv"
    rows = ["id,label"] + [f"{i},{'yes' if y else 'no'}" for i, y in zip(ids, labels, strict=True)]
    rows.append("nobody,yes")  # a label no party holds
    label_path.write_text("\n".join(rows) + "\n")
    paths = []
    for k in range(3):
        held = generator.random(ids.size) < 0.7
        order = generator.permutation(np.flatnonzero(held))
        path = root / f"party{k}.csv"
        lines = ["id,a,b"] + [
            f"{ids[i]},{10 * labels[i] + k + generator.random()},{generator.normal()}"
            for i in order
        ]
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths, label_path


def test_party_files_are_aligned_split_and_masked(tmp_path):
    paths, label_path = write_party_files(tmp_path)
    data = vertical_from_party_files(
        paths,
        label_path,
        aligner=JoinAligner(),
        train_missing=parse_mechanism("mcar:0"),
        test_missing=[parse_mechanism("mcar:0"), parse_mechanism("mcar:0.5")],
        rng=rng(13),
    )
    assert data.num_classes == 2 and data.block_shapes == ((2,),) * 3
    held_anywhere = set().union(*(pd.read_csv(p, dtype={"id": str})["id"] for p in paths))
    label_ids = pd.read_csv(label_path, dtype={"id": str})["id"]
    no_party = (~label_ids.isin(held_anywhere)).sum()
    assert data.dropped["alignment_no_party"] == no_party > 1
    assert data.feature_names == (("a", "b"),) * 3
    total = data.train.n + data.tests["mcar:0"].n + data.dropped["train"] + data.dropped["mcar:0"]
    assert total + data.dropped["alignment_no_party"] == 601  # every labelled id accounted for
    # With mcar:0 the mask is the alignment mask: about 70 % held per party.
    np.testing.assert_allclose(data.train.mask.mean(axis=0), 0.7, atol=0.06)
    for split in (data.train, *data.tests.values()):
        for k, block in enumerate(split.blocks):
            held = split.mask[:, k]
            assert not block[~held].any()
            # Feature a = 10 * label + k: after standardising, label 1 rows sit above label 0.
            values, labels = block[held, 0], split.labels[held]
            assert values[labels == 1].min() > values[labels == 0].max()
    # Standardised with the training rows the party holds.
    for k, block in enumerate(data.train.blocks):
        held = data.train.mask[:, k]
        assert abs(block[held, 1].mean()) < 1e-5
    # mcar:0.5 on top of the alignment: about 0.7 * 0.5 of all (kept and dropped) cells observed.
    halved = data.tests["mcar:0.5"]
    cells = (halved.n + data.dropped["mcar:0.5"]) * 3
    assert abs(halved.mask.sum() / cells - 0.35) < 0.08


def test_party_files_with_bad_file_are_refused(tmp_path):
    paths, label_path = write_party_files(tmp_path)
    paths[1].write_text("key,a\n1,2\n")
    with pytest.raises(DataError, match=r"party1\.csv must have an id column `id`"):
        vertical_from_party_files(
            paths,
            label_path,
            aligner=JoinAligner(),
            train_missing=parse_mechanism("mcar:0"),
            test_missing=[],
            rng=rng(),
        )


def test_a_test_fraction_that_leaves_a_party_no_training_row_names_the_split(tmp_path):
    """It said only that the party held no training sample, naming no flag."""
    paths, label_path = write_party_files(tmp_path)
    with pytest.raises(
        DataError,
        match=r"party0\.csv\) holds no training sample \(test_fraction 0\.999 \(--test-fraction\) "
        r"left \d+ of \d+ aligned rows for training\)",
    ):
        vertical_from_party_files(
            paths,
            label_path,
            aligner=JoinAligner(),
            train_missing=parse_mechanism("mcar:0"),
            test_missing=[parse_mechanism("mcar:0")],
            test_fraction=0.999,
            rng=rng(),
        )


def test_aligned_samples_are_observed_by_every_party_and_the_others_keep_their_masks():
    split = same_rows_split(n=4000)
    mechanisms = {"train_missing": parse_mechanism("mnar:0.7"), "test_missing": []}
    plain = make_vertical(split, parties=4, rng=rng(3), **mechanisms)
    reserved = make_vertical(
        split, parties=4, rng=rng(3), aligned=300, aligned_rng=rng(4), **mechanisms
    )
    assert plain.aligned_rows is None and reserved.aligned_rows is not None
    drawn = np.sort(rng(4).choice(4000, size=300, replace=False))
    rows = reserved.aligned_rows
    # The labels are the original row numbers: the reserve is the rows drawn, all observed.
    assert np.array_equal(reserved.train.labels[rows], drawn)
    assert reserved.train.mask[rows].all()
    assert all(np.abs(block[rows]).sum(axis=1).all() for block in reserved.train.blocks)
    # Without the reserve, few of the same samples are complete (MNAR 0.7).
    assert plain.train.mask[np.isin(plain.train.labels, drawn)].all(axis=1).mean() < 0.2
    # Every other sample keeps the mask it has in the run without a reserve.
    others = ~np.isin(reserved.train.labels, drawn)
    kept = ~np.isin(plain.train.labels, drawn)
    assert np.array_equal(reserved.train.labels[others], plain.train.labels[kept])
    assert np.array_equal(reserved.train.mask[others], plain.train.mask[kept])


def test_an_aligned_reserve_larger_than_the_training_set_is_refused():
    with pytest.raises(ConfigError, match=r"`aligned_labeled` must be an integer in \[0, 4000\]"):
        make_vertical(
            toy_split(),
            parties=2,
            train_missing=parse_mechanism("mcar:0.5"),
            test_missing=[parse_mechanism("mcar:0")],
            rng=rng(0),
            aligned=4001,
            aligned_rng=rng(1),
        )


def test_ids_a_party_writes_otherwise_than_the_label_file_are_named_in_a_warning(tmp_path):
    """A party writing `000`-`199` against labels `0`-`199` kept only `100`-`199`: half its rows
    left out, with `warnings: []`."""
    labels = tmp_path / "labels.csv"
    labels.write_text("id,label\n" + "".join(f"{i},{i % 2}\n" for i in range(200)))
    plain, padded = tmp_path / "plain.csv", tmp_path / "padded.csv"
    plain.write_text("id,a\n" + "".join(f"{i},{i}\n" for i in range(200)))
    padded.write_text("id,b\n" + "".join(f"{i:03d},{i}\n" for i in range(200)))

    def read(files: list[Path]) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vertical_from_party_files(
                files,
                labels,
                aligner=JoinAligner(),
                train_missing=parse_mechanism("mcar:0"),
                test_missing=[parse_mechanism("mcar:0")],
                rng=rng(0),
            )
        return [str(w.message) for w in caught if "leading zeros" in str(w.message)]

    [message] = read([plain, padded])
    assert f"{padded}: 100 of its ids without a label read as ids of {labels}" in message
    assert "(e.g. '000' here, '0' there)" in message
    other = tmp_path / "other.csv"
    other.write_text("id,c\n" + "".join(f"{i},{i}\n" for i in range(200)))
    assert not read([plain, other])  # every id matched: nothing to say


def _with_test_file(parties: list[Path], labels: Path, held: Path) -> Any:
    """The party files' data with ``held`` as the test file, nothing missing."""
    return vertical_from_party_files(
        parties,
        labels,
        aligner=JoinAligner(),
        train_missing=parse_mechanism("mcar:0"),
        test_missing=[parse_mechanism("mcar:0")],
        test_file=held,
        rng=rng(0),
    )


def test_a_held_out_file_of_number_labels_matches_text_labels_beside_na(tmp_path):
    """Labels `0`, `1` and `NA` are text; a test file of `0` and `1` read them as numbers and
    was refused: 'held-out labels must be among the training classes ['0', '1', 'NA']'."""
    labels, held = tmp_path / "labels.csv", tmp_path / "held.csv"
    labels.write_text("id,label\n" + "".join(f"{i},{['0', '1', 'NA'][i % 3]}\n" for i in range(90)))
    held.write_text("id,label\n" + "".join(f"{i},{i % 2}\n" for i in range(90, 120)))
    party = tmp_path / "party.csv"
    party.write_text("id,a\n" + "".join(f"{i},{i % 7}\n" for i in range(120)))
    other = tmp_path / "other.csv"
    other.write_text("id,b\n" + "".join(f"{i},{i % 5}\n" for i in range(120)))
    data = _with_test_file([party, other], labels, held)
    assert data.classes == ("0", "1", "NA")
    assert sorted(set(data.tests["mcar:0"].labels.tolist())) == [0, 1]


def test_a_held_out_file_of_one_class_is_a_test_split_of_that_class(tmp_path):
    """A test file whose labels are all `yes` (a training class) was refused: 'a classifier
    needs at least 2 classes. Found ['yes']'; the training labels still need two."""
    labels, held = tmp_path / "labels.csv", tmp_path / "held.csv"
    labels.write_text("id,label\n" + "".join(f"{i},{['no', 'yes'][i % 2]}\n" for i in range(90)))
    held.write_text("id,label\n" + "".join(f"{i},yes\n" for i in range(90, 110)))
    party = tmp_path / "party.csv"
    party.write_text("id,a\n" + "".join(f"{i},{i % 7}\n" for i in range(110)))
    data = _with_test_file([party], labels, held)
    assert data.classes == ("no", "yes")
    assert data.tests["mcar:0"].labels.tolist() == [1] * 20
    with pytest.raises(DataError, match=r"a classifier needs at least 2 classes\. Found"):
        _with_test_file([party], held, labels)  # one class to train on is still refused


def test_many_classes_too_small_for_both_splits_are_one_warning() -> None:
    from secure_vfl.data.vertical import warn_small_classes

    labels = np.concatenate([np.zeros(50, np.int64), np.arange(1, 9)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_small_classes(labels, 0.2, tuple(range(9)))
    [message] = [str(w.message) for w in caught]
    assert message.startswith("8 of 9 classes have too few aligned samples") and "1 (1, " in message
