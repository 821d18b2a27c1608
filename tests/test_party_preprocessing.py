"""A party's own preprocessing: one-hot encoding, the missing-cell policy, standardisation,
fitted on its training rows only and kept as versioned JSON (issue 12, item 2)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from secure_vfl.data.party_files import PartyTable, read_party_file
from secure_vfl.data.party_preprocessing import PartyPreprocessing
from secure_vfl.errors import DataError, RunWarning


def training_rows() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "age": [30.0, np.nan, 50.0, 40.0],
            "city": ["paris", "lyon", None, "paris"],
            "income": [1.0, 2.0, 3.0, 4.0],
        }
    )


def test_mean_indicator_fills_with_training_means_and_adds_one_indicator_per_column() -> None:
    fitted = PartyPreprocessing.fit(training_rows(), missing_cells="mean-indicator", where="t")
    assert fitted.categories == {"city": ("lyon", "paris")}
    assert fitted.indicators == ("age", "city")  # income had no missing cell
    assert fitted.input_columns == (
        "age",
        "city=lyon",
        "city=paris",
        "income",
        "age:missing",
        "city:missing",
    )
    # age's mean of 30, 50, 40; city's one-hot columns: their frequencies among 3 known cities.
    np.testing.assert_allclose(fitted.fill, [40.0, 1 / 3, 2 / 3, 2.5])
    new = pd.DataFrame({"income": [2.0], "city": [None], "age": [np.nan]})  # another order
    inputs = fitted.transform_frame(new, "new")
    raw = inputs.astype(np.float64) * fitted.std + fitted.mean
    np.testing.assert_allclose(raw, [[40.0, 1 / 3, 2 / 3, 2.0, 1.0, 1.0]], atol=1e-6)
    # The training rows themselves come out standardised.
    train = fitted.transform_frame(training_rows(), "train")
    np.testing.assert_allclose(train.mean(axis=0), 0.0, atol=1e-6)


def test_an_unseen_category_is_all_zero_and_warns_naming_column_and_value() -> None:
    fitted = PartyPreprocessing.fit(training_rows(), where="t")
    new = pd.DataFrame({"age": [35.0], "city": ["nice"], "income": [1.0]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inputs = fitted.transform_frame(new, "new.csv (shop)")
    messages = [str(w.message) for w in caught if issubclass(w.category, RunWarning)]
    assert len(messages) == 1
    assert "new.csv (shop): column 'city'" in messages[0] and "'nice'" in messages[0]
    raw = inputs.astype(np.float64) * fitted.std + fitted.mean
    np.testing.assert_allclose(raw[0, 1:3], [0.0, 0.0], atol=1e-6)


def test_refuse_policy_refuses_missing_cells_in_training_and_at_prediction() -> None:
    with pytest.raises(
        DataError, match=r"Found 2 missing values in 2 rows, columns \['age', 'city'\]"
    ) as training:
        PartyPreprocessing.fit(training_rows(), missing_cells="refuse", where="t")
    assert str(training.value).endswith("(or use --missing-cells mean-indicator).")
    complete = training_rows().dropna()
    fitted = PartyPreprocessing.fit(complete, missing_cells="refuse", where="t")
    assert fitted.indicators == () and fitted.fill is None
    with pytest.raises(DataError, match="new: features must not be missing") as prediction:
        fitted.transform_frame(training_rows(), "new")
    # predict takes no --missing-cells: it advised that flag
    assert "or use --missing-cells" not in str(prediction.value)
    assert "(a model trained with --missing-cells mean-indicator fills them)" in str(
        prediction.value
    )


def test_a_column_empty_in_every_training_row_is_refused() -> None:
    rows = training_rows().assign(notes=[np.nan] * 4)
    with pytest.raises(DataError, match="column 'notes' is empty in every training row"):
        PartyPreprocessing.fit(rows, where="t")


def test_a_categorical_column_with_too_many_values_is_refused() -> None:
    rows = pd.DataFrame({"name": [f"person {i}" for i in range(150)], "x": np.arange(150.0)})
    with pytest.raises(DataError, match="'name' has 150 distinct values in training"):
        PartyPreprocessing.fit(rows, where="t")


def test_text_in_a_column_that_was_numeric_in_training_is_refused() -> None:
    fitted = PartyPreprocessing.fit(training_rows(), where="t")
    new = pd.DataFrame({"age": ["old"], "city": ["paris"], "income": [1.0]})
    with pytest.raises(DataError, match="column 'age' was numeric in training; found text"):
        fitted.transform_frame(new, "new")


def test_json_round_trip_keeps_every_step_exactly() -> None:
    fitted = PartyPreprocessing.fit(training_rows(), where="t", id_column="patient")
    payload = json.loads(json.dumps(fitted.to_json()))
    assert payload["version"] == 3
    assert payload["columns"][0] == {"name": "age", "kind": "numeric", "range": [30.0, 50.0]}
    assert payload["columns"][1] == {
        "name": "city",
        "kind": "categorical",
        "categories": ["lyon", "paris"],
    }
    loaded = PartyPreprocessing.from_json(payload, "p.json")
    new = pd.DataFrame({"age": [np.nan, 31.0], "city": ["lyon", None], "income": [5.0, 0.0]})
    np.testing.assert_array_equal(
        loaded.transform_frame(new, "n"), fitted.transform_frame(new, "n")
    )
    assert loaded.id_column == "patient" and loaded.indicators == fitted.indicators
    assert loaded.ranges == fitted.ranges == {"age": (30.0, 50.0), "income": (1.0, 4.0)}


def test_version_1_json_is_still_read_as_numeric_columns_that_refuse_missing_cells() -> None:
    version_1 = {
        "schema": "secure-vfl/party-preprocessing",
        "version": 1,
        "id_column": "id",
        "block_shape": [2],
        "columns": [{"name": "a", "kind": "numeric"}, {"name": "b", "kind": "numeric"}],
        "steps": [{"step": "standardize", "mean": [1.0, 2.0], "std": [2.0, 4.0]}],
    }
    loaded = PartyPreprocessing.from_json(version_1, "old.json")
    assert loaded.missing_cells == "refuse" and loaded.categories == {}
    out = loaded.transform_frame(pd.DataFrame({"b": [6.0], "a": [3.0]}), "n")
    np.testing.assert_allclose(out, [[1.0, 1.0]])
    version_1["columns"][0]["kind"] = "categorical"  # type: ignore[index]
    with pytest.raises(DataError, match=r"column kinds \['numeric'\] expected"):
        PartyPreprocessing.from_json(version_1, "old.json")
    with pytest.raises(DataError, match="preprocessing version 1 or 2 or 3 expected"):
        PartyPreprocessing.from_json({**version_1, "version": 4}, "new.json")


def _far_outside(fitted: PartyPreprocessing, new: pd.DataFrame) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitted.transform_frame(new, "new.csv (shop)")
    return [str(w.message) for w in caught if "far outside" in str(w.message)]


def test_a_true_false_column_where_numbers_were_trained_warns() -> None:
    """Read as 1/0, near enough to a range of 1 to 4 for no range check to see it."""
    fitted = PartyPreprocessing.fit(training_rows(), where="t")  # income 1..4
    new = pd.DataFrame({"age": [40.0, 41.0], "city": ["lyon"] * 2, "income": [True, False]})
    with pytest.warns(
        RunWarning,
        match=r"new.csv: True/False columns read as 1/0 where the "
        r"model was trained on other numbers: 'income' \(training range \[1, 4\]\)",
    ):
        fitted.transform_frame(new, "new.csv")
    flags = PartyPreprocessing.fit(pd.DataFrame({"f": [True, False, True]}), where="t")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # trained as True/False (0 and 1): nothing to say
        flags.transform_frame(pd.DataFrame({"f": [False, True]}), "new.csv")


def test_a_true_false_column_of_a_file_warns_as_one_of_a_dataframe(tmp_path: Path) -> None:
    """Reading a file made its True/False column 1/0 before the table was built, so the
    check, which looked for a bool column, never fired for files (CSV or Parquet)."""
    fitted = PartyPreprocessing.fit(training_rows(), where="t")  # income 1..4
    path = tmp_path / "shop.csv"
    path.write_text("id,age,city,income\na,40,lyon,True\nb,41,lyon,\nc,42,paris,False\n")
    table = read_party_file(path)
    assert table.booleans == ("income",)
    assert table.subset(np.array([0, 2])).booleans == ("income",)
    with pytest.warns(RunWarning, match=r"shop.csv: True/False columns read as 1/0 .*'income'"):
        fitted.apply(table, "shop.csv")
    frame = pd.DataFrame({"age": [40.0], "city": ["lyon"], "income": [True]})
    built = PartyTable("shop", np.array(["a"]), frame)
    assert built.booleans == ("income",) and frame["income"].dtype == bool  # a copy is made
    with pytest.warns(RunWarning, match="True/False columns read as 1/0"):
        fitted.apply(built, "shop")


@pytest.mark.parametrize(
    ("values", "found"),
    [
        (pd.to_datetime(["2024-01-01", "2024-02-01"]), "holds dates or times"),
        (pd.to_timedelta([1, 2], unit="D"), "holds values of type timedelta64"),
        (np.array([1 + 2j, 3j]), "holds complex numbers"),
    ],
)
def test_a_table_built_from_a_dataframe_is_checked_as_a_file(values: Any, found: str) -> None:
    """Dates, durations and complex numbers were scored from a DataFrame (a far-outside
    warning, or numpy's ComplexWarning) where a file holding them was refused."""
    frame = pd.DataFrame({"age": [40.0, 41.0], "when": values})
    with pytest.raises(
        DataError, match=rf"shop: column 'when' {found}\S*; expected numbers or text"
    ):
        PartyTable("shop", np.array(["a", "b"]), frame)


def test_rows_far_outside_a_columns_training_range_warn_with_the_range() -> None:
    """A column in other units (or a value of 3e38) was scored in silence: probabilities
    saturated at 0 and 1, with nothing said."""
    fitted = PartyPreprocessing.fit(training_rows(), where="t")  # age 30..50, income 1..4
    # within, and beyond the range by at most its width: no warning
    near = pd.DataFrame(
        {"age": [10.0, 70.0, np.nan], "city": ["paris"] * 3, "income": [-2.0, 7.0, 3]}
    )
    assert _far_outside(fitted, near) == []
    far = pd.DataFrame(
        {"age": [40.0, 9.0, 3e38], "city": ["lyon"] * 3, "income": [2.0, 2.0, 4000.0]}
    )
    [message] = _far_outside(fitted, far)
    assert message.startswith("new.csv (shop): 2 of 3 rows hold values far outside")
    assert "'age' (training range [30, 50], found 9 to 3e+38)" in message
    assert "'income' (training range [1, 4], found 4000)" in message
    assert "check the columns' units and scale" in message
    # a column constant in training: any other value is outside its range
    constant = PartyPreprocessing.fit(pd.DataFrame({"k": [5.0, 5.0]}), where="t")
    assert _far_outside(constant, pd.DataFrame({"k": [5.0]})) == []
    assert (
        "'k' (training range [5, 5], found 5.5)"
        in _far_outside(constant, pd.DataFrame({"k": [5.5]}))[0]
    )
    # a model saved before ranges were kept (version 2) checks nothing
    old = fitted.to_json()
    old["version"] = 2
    for column in old["columns"]:
        column.pop("range", None)
    assert PartyPreprocessing.from_json(old, "v2.json").ranges == {}
    assert _far_outside(PartyPreprocessing.from_json(old, "v2.json"), far) == []


@pytest.mark.parametrize(
    ("saved", "expected"),
    [
        ("low", "a training range [low, high] of two numbers expected, found 'low'"),
        ([1.0, True], "a training range [low, high] of two numbers expected"),
        ([3.0, 1.0], "a finite training range low <= high expected, found [3.0, 1.0]"),
        ([1.0, 1e400], "a finite training range low <= high expected"),
    ],
)
def test_a_malformed_saved_range_is_refused(saved: object, expected: str) -> None:
    payload = PartyPreprocessing.fit(training_rows(), where="t").to_json()
    payload["columns"][0]["range"] = saved
    with pytest.raises(DataError, match=re.escape(expected)):
        PartyPreprocessing.from_json(payload, "p.json")


def test_codes_a_new_file_reads_as_numbers_are_the_categories_they_were_in_training(
    tmp_path,
) -> None:
    """`007`, `012`, `HQ` are text in training; a new file with only `007` and `012` reads them
    as the numbers 7 and 12, which were 'never seen in training' and encoded as no category."""
    from secure_vfl.data.party_files import read_party_file

    train = tmp_path / "train.csv"
    train.write_text("id,branch\na,007\nb,012\nc,HQ\nd,7.5\n")
    fitted = PartyPreprocessing.fit(read_party_file(train).frame, where="t")
    assert fitted.categories == {"branch": ("007", "012", "7.5", "HQ")}
    new = tmp_path / "new.csv"
    new.write_text("id,branch\nx,12\ny,007\nz,7.5\nw,3\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inputs = fitted.transform_frame(read_party_file(new).frame, "new.csv")
    raw = inputs.astype(np.float64) * fitted.std + fitted.mean
    np.testing.assert_allclose(raw[:3], [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]], atol=1e-6)
    np.testing.assert_allclose(raw[3], 0.0, atol=1e-6)  # 3 is no category
    [message] = [str(w.message) for w in caught if issubclass(w.category, RunWarning)]
    assert "1 value(s) never seen in training ('3'; 1 row(s))" in message
    # Two categories that read as one number: neither is taken for it.
    both = PartyPreprocessing.fit(pd.DataFrame({"b": ["07", "007", "x"]}), where="t")
    with pytest.warns(RunWarning, match="never seen in training"):
        both.transform_frame(pd.DataFrame({"b": [7]}), "n")


def test_a_category_in_another_case_is_named_as_the_one_it_resembles() -> None:
    """`HIGH` and `high ` for the training category `high` were only 'never seen in training',
    though every row of a file written in capitals is then encoded as no category."""
    fitted = PartyPreprocessing.fit(pd.DataFrame({"segment": ["high", "low", "mid"]}), where="t")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inputs = fitted.transform_frame(
            pd.DataFrame({"segment": ["HIGH", "high ", "Low", "vip", "mid"]}), "new.csv"
        )
    raw = inputs.astype(np.float64) * fitted.std + fitted.mean
    np.testing.assert_allclose(raw[:4], 0.0, atol=1e-6)  # not taken for them: only named
    [message] = [str(w.message) for w in caught if issubclass(w.category, RunWarning)]
    assert "4 value(s) never seen in training ('HIGH', 'high ', 'Low'; 4 row(s))" in message
    assert (
        "3 of them are training categories but for case or spaces ('HIGH' as 'high', 'high ' as "
        "'high', 'Low' as 'low'): expected them written as in training" in message
    )
    with warnings.catch_warnings(record=True) as caught:  # none alike: nothing more said
        warnings.simplefilter("always")
        fitted.transform_frame(pd.DataFrame({"segment": ["vip"]}), "new.csv")
    [message] = [str(w.message) for w in caught if issubclass(w.category, RunWarning)]
    assert "case or spaces" not in message


def test_true_and_false_read_alike_with_and_without_an_empty_cell(tmp_path) -> None:
    from secure_vfl.data.party_files import read_party_file

    gaps, full = tmp_path / "gaps.csv", tmp_path / "full.csv"
    gaps.write_text("id,flag\na,True\nb,\nc,False\n")
    full.write_text("id,flag\nx,False\ny,True\n")
    for train, new in ((gaps, full), (full, gaps)):
        fitted = PartyPreprocessing.fit(
            read_party_file(train).frame, missing_cells="mean-indicator", where="t"
        )
        assert fitted.categories == {}  # a number, 1 or 0, either way
        inputs = fitted.transform_frame(read_party_file(new).frame, "n")
        assert np.isfinite(inputs).all()


def test_a_column_of_numbers_but_for_a_few_text_cells_says_so() -> None:
    """3 cells of `n/a ` and `?` among 130 numbers: refused as 'an identifier or free text?';
    2 of `unknown` among rounded numbers: 8 categories without a word."""
    rng = np.random.default_rng(0)
    many = [f"{v:.3f}" for v in rng.normal(size=130)] + ["n/a ", "?", "?"]
    with pytest.raises(
        DataError, match=r"it is numbers but for 3 cell\(s\) of text \('\?', 'n/a '"
    ):
        PartyPreprocessing.fit(pd.DataFrame({"c": many}), where="x.csv")
    few = [str(round(v)) for v in rng.normal(size=130)] + ["unknown", "unknown"]
    with pytest.warns(RunWarning, match=r"x.csv: column 'c' is numbers but for 2 cell\(s\)"):
        PartyPreprocessing.fit(pd.DataFrame({"c": few}), where="x.csv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PartyPreprocessing.fit(pd.DataFrame({"c": ["lyon", "paris", "7"]}), where="x.csv")


def test_numbers_written_with_percent_or_separators_and_alike_categories_say_so() -> None:
    rng = np.random.default_rng(0)
    rates = pd.DataFrame({"rate": [f"{v}%" for v in rng.integers(0, 60, 200)]})
    with pytest.warns(RunWarning, match=r"'rate' is one-hot encoded as \d+ categories; it holds"):
        PartyPreprocessing.fit(rates, where="b.csv")
    wide = pd.DataFrame({"inc": [f"{v:,}" for v in rng.integers(1, 1000, 400) * 1000]})
    with pytest.raises(
        DataError, match=r"values in training; at most 100 expected for one-hot"
    ) as e:
        PartyPreprocessing.fit(wide, where="b.csv")
    assert "numbers written as text" in str(e.value) and "free text" not in str(e.value)
    cities = pd.DataFrame({"c": ["Paris", "paris", " Paris", "Lyon"]})
    with pytest.warns(RunWarning, match=r"differ only in case or surrounding spaces \(' Paris'"):
        PartyPreprocessing.fit(cities, where="b.csv")


def test_a_file_of_thousands_of_other_columns_is_refused_in_a_short_line() -> None:
    """predict on a file of 10,000 other columns printed every name: a 100 KB error line."""
    fitted = PartyPreprocessing.fit(training_rows(), where="t")
    found = ["age", *(f"c{i}" for i in range(10_000))]
    with pytest.raises(DataError) as refused:
        fitted.check_columns(found, "wide.csv")
    message = str(refused.value)
    assert "missing ['city', 'income'] and unexpected ['c0', 'c1'," in message
    assert "'c9'] and 9990 more." in message and len(message) < 400
    # one name as long as a file allows is cut short: it was repeated whole (a 20 KB line)
    with pytest.raises(DataError) as refused:
        fitted.check_columns(["age", "w" * 20_000], "long.csv")
    assert "(20002 characters)" in str(refused.value) and len(str(refused.value)) < 400


def test_a_text_column_whose_cells_are_all_numbers_says_so() -> None:
    """A Parquet column of numbers stored as text was one-hot encoded without a word."""
    rng = np.random.default_rng(0)
    stored = pd.DataFrame({"radius": [str(v) for v in rng.integers(10, 30, 200)]})
    with pytest.warns(RunWarning, match=r"'radius' is one-hot encoded as \d+ categories; each"):
        PartyPreprocessing.fit(stored, where="bank.parquet")
    many = pd.DataFrame({"radius": [f"{v:.2f}" for v in rng.normal(20, 3, 300)]})
    with pytest.raises(DataError, match="each of its cells is a number stored as text") as e:
        PartyPreprocessing.fit(many, where="bank.parquet")
    assert "free text" not in str(e.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda p: p.pop("steps"),
            "malformed preprocessing: the key 'steps' expected, found none.",
        ),
        (lambda p: p["columns"][0].pop("name"), "the key 'name' expected, found none."),
        (lambda p: p["steps"][1].__setitem__("std", [1.0]), "cannot reshape array of size 1"),
        (lambda p: p["steps"][1].__setitem__("mean", ["a"] * 6), "could not convert string"),
    ],
)
def test_a_malformed_preprocessing_file_says_what_it_lacks(edit: Any, message: str) -> None:
    """It said "malformed preprocessing (KeyError('steps'))"."""
    payload = PartyPreprocessing.fit(training_rows(), where="t").to_json()
    edit(payload)
    with pytest.raises(DataError, match=re.escape(message)) as refused:
        PartyPreprocessing.from_json(payload, "p.json")
    assert "Error(" not in str(refused.value)


@pytest.mark.parametrize(
    ("frame", "policy"),
    [
        # a numeric column named as the one-hot input of city's category paris
        (pd.DataFrame({"city=paris": [1.0, 2.0], "city": ["paris", "rome"]}), "refuse"),
        # a numeric column named as income's missing-cell indicator
        (pd.DataFrame({"income": [1.0, None], "income:missing": [0.5, 0.7]}), "mean-indicator"),
    ],
    ids=["category", "indicator"],
)
def test_a_column_named_as_another_columns_input_is_refused(
    frame: pd.DataFrame, policy: str
) -> None:
    """Two inputs of one name shared one training range (the later one's), so a new row's
    warning of values far outside it judged one column by the other's range."""
    name = frame.columns[0] if policy == "refuse" else frame.columns[1]
    with pytest.raises(DataError, match=f"found \\['{re.escape(name)}'\\] twice"):
        PartyPreprocessing.fit(frame, missing_cells=policy, where="t")
