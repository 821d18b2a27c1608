"""`secure-vfl impute`: bad input refused in one line, good input writes result and tables."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from opacus.accountants import RDPAccountant
from test_cli import warning_at_step_1
from test_paillier import paillier_aggregator

from secure_vfl.cli import main
from secure_vfl.errors import DataError
from secure_vfl.experiment import (
    ImputeRunConfig,
    imputed_tables,
    prepare_imputation_task,
    run_imputation,
)
from secure_vfl.methods.imputation import ImputeConfig
from secure_vfl.store import ResultsStore

BAD_FLAGS = [
    (["--clients", "1"], "expected an integer number of clients in [2, 64], found '1'"),
    (["--availability", "0"], "expected a share in (0, 1], found '0'"),
    (["--availability", "1.5"], "expected a share in (0, 1], found '1.5'"),
    (["--rounds", "0"], "expected a positive integer, found '0'"),
    (["--client-fraction", "0"], "expected a share in (0, 1], found '0'"),
    (["--local-epochs", "-1"], "expected a positive integer, found '-1'"),
    (["--lr", "0"], "expected a positive finite number, found '0'"),
    # the run finished, then the results store refused the seed with a traceback
    (["--seed", "99999999999999999999"], "expected an integer seed in [0, 2**32)"),
    (["--method", "magic"], "invalid choice: 'magic'"),
    (["--secure-agg", "rot13"], "invalid choice: 'rot13'"),
    (["--dp-statistics", "0:1"], "SIGMA must be > 0 for a private release"),
    (["--dp-statistics", "abc"], "Noise must be given as SIGMA:CLIP"),
    (["--dp-statistics", "1:x"], "must be two numbers"),
    (["--dp-statistics", "1:0"], "the clip norm (CLIP) must be a positive number"),
    (["--dp-statistics", "1:1", "--target-epsilon", "0"], "expected a positive finite number"),
    (["--dp-statistics", "1:1", "--delta", "1"], "expected a probability in (0, 1)"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_FLAGS)
def test_bad_impute_flags_are_refused_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["impute", "--method", "fedhf", "--dataset", "ozone", "--out", str(tmp_path / "r")]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [  # ignored before, even when they named a column the dataset does not have
        (["--id-column", "key"], "--id-column applies to --client-file (a registered dataset"),
        (["--id-column", "id", "--label-column", "label"], "--id-column, --label-column apply"),
    ],
)
def test_column_flags_are_refused_with_a_registered_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["impute", "--method", "fedhf", "--dataset", "ozone", "--out", str(tmp_path / "r")]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_unknown_imputation_dataset_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["impute", "--method", "mean", "--dataset", "digits", "--out", str(tmp_path / "r")])
    assert code == 2
    assert "unknown imputation dataset 'digits'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_impute_writes_result_store_row_and_imputed_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fedhf"
    argv = [
        "impute",
        "--method",
        "fedhf",
        "--dataset",
        "ozone",
        "--rounds",
        "2",
        "--client-fraction",
        "0.5",
        "--out",
        str(out),
        "--save-imputed",
        "--quiet",
    ]
    assert main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["method"] == "fedhf" and result["dataset"] == "ozone"
    assert len(result["validation_curve"]) == 2
    assert set(result["rmse_per_client"]) == {f"client-{k}" for k in range(4)}
    assert 0.0 < result["rmse"] < 3.0
    rows = ResultsStore(tmp_path / "results.sqlite").rows()
    assert len(rows) == 1 and rows[0]["kind"] == "impute"
    capsys.readouterr()  # `runs list` showed an imputation's every figure as `-`
    assert main(["runs", "list", "--store", str(tmp_path / "results.sqlite")]) == 0
    header, row = capsys.readouterr().out.splitlines()
    rmse = header.split().index("RMSE")
    assert row.split()[rmse + 2] == f"{result['rmse']:.4f}"  # the run's name is 3 words
    for name, info in result["clients"].items():
        table = pd.read_csv(out / "imputed" / f"{name}.csv")
        assert len(table) == info["train_rows"] + info["test_rows"]
        assert table.shape[1] == info["available_features"] + 1  # + the split column
        assert not table.drop(columns="split").isna().any().any()
    # --overwrite without --save-imputed: the old tables would outlive the run they were of
    written = (out / "result.json").read_bytes()
    again = [a for a in argv if a != "--save-imputed"] + ["--overwrite"]
    assert main(again) == 2  # refused before any work: nothing replaced
    assert (out / "result.json").read_bytes() == written
    assert len(ResultsStore(tmp_path / "results.sqlite").rows()) == 1


def test_impute_prints_a_run_warning_as_it_is_raised_and_lists_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A RunWarning raised in a FedAvg round was printed only after the run's summary, which
    may come minutes later. It is printed as raised, once, and listed in result.json once."""
    import secure_vfl.experiment as experiment

    fit_and_score = experiment.fit_and_score
    stderr_at_round_2: list[str] = []

    def fitted(imputer: Any, score: Any, *, rounds: int, on_round: Any) -> Any:
        text = "client-2 is slow in round 1"
        round_done = warning_at_step_1(on_round, text, capsys, stderr_at_round_2)
        return fit_and_score(imputer, score, rounds=rounds, on_round=round_done)

    monkeypatch.setattr(experiment, "fit_and_score", fitted)
    out = tmp_path / "fedhf"
    argv = ["impute", "--method", "fedhf", "--dataset", "ozone", "--rounds", "2"]
    assert main([*argv, "--client-fraction", "0.5", "--out", str(out), "--quiet"]) == 0
    line = "secure-vfl: warning: client-2 is slow in round 1\n"
    [during] = stderr_at_round_2
    after = capsys.readouterr()
    assert during.count(line) == 1
    assert "RMSE" in after.out and "client-2 is slow" not in after.err  # not again at the end
    result = json.loads((out / "result.json").read_text())
    assert result["warnings"] == ["client-2 is slow in round 1"]


def test_impute_prints_and_keeps_each_features_rmse_also_in_its_own_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["impute", "--method", "fed-mean", "--dataset", "ozone"]
    assert main([*argv, "--out", str(tmp_path / "ozone")]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "ozone" / "result.json").read_text())
    per_feature, in_units = result["rmse_per_feature"], result["rmse_per_feature_in_units"]
    hidden = result["hidden_per_feature"]
    assert list(per_feature) == list(in_units) == list(hidden) and len(per_feature) == 10
    assert sum(hidden.values()) == sum(result["hidden_per_client"].values())
    # the overall RMSE is the features' pooled
    pooled = sum(per_feature[f] ** 2 * hidden[f] for f in hidden) / sum(hidden.values())
    assert result["rmse"] == pytest.approx(pooled**0.5, rel=1e-9)
    assert "feature               RMSE (std units)  RMSE (its units)  hidden" in out
    for feature, rmse in per_feature.items():
        line = f"{per_feature[feature]:.4f}{in_units[feature]:>18.4g}{hidden[feature]:>8}"
        assert any(row.startswith(feature) and row.endswith(line) for row in out.splitlines())
        assert in_units[feature] > rmse  # ozone's stds are all above 1
    # 99 features are too many lines: result.json has them
    assert main(["impute", "--method", "mean", "--dataset", "chorizon", "--out",
                 str(tmp_path / "chorizon")]) == 0  # fmt: skip
    assert "RMSE per feature (99 features): rmse_per_feature and rmse_per_feature_in_units in " \
        "result.json" in capsys.readouterr().out  # fmt: skip
    result = json.loads((tmp_path / "chorizon" / "result.json").read_text())
    assert len(result["rmse_per_feature_in_units"]) == 99


@pytest.mark.parametrize("method", ["mean", "knn", "mice", "fed-mean"])
def test_training_flags_are_refused_for_a_method_that_trains_no_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str
) -> None:
    argv = ["impute", "--method", method, "--dataset", "airquality", "--out", str(tmp_path / "o")]
    assert main([*argv, "--rounds", "5", "--lr", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "--rounds, --lr apply to the methods that train a model (dae, fed-dae, fedhf)" in err
    assert not (tmp_path / "o").exists()


def test_saved_imputed_tables_are_all_or_none_and_never_mixed_with_older_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mean"
    argv = ["impute", "--method", "mean", "--dataset", "airquality", "--out", str(out)]
    argv += ["--save-imputed", "--quiet"]
    # a folder already there (the user's own, say) is not written into without --overwrite
    (out / "imputed").mkdir(parents=True)
    (out / "imputed" / "client-0.csv").write_text("mine\n")
    assert main(argv) == 2
    assert "imputed exists; expected a new --out directory (or --overwrite)" in (
        capsys.readouterr().err
    )
    assert (out / "imputed" / "client-0.csv").read_text() == "mine\n"
    # with --overwrite the folder is replaced whole: a 4-client run's tables, then 2 clients'
    assert main([*argv, "--overwrite"]) == 0
    assert sorted(p.name for p in (out / "imputed").iterdir()) == [
        f"client-{k}.csv" for k in range(4)
    ]
    assert main([*argv, "--overwrite", "--clients", "2"]) == 0
    assert sorted(p.name for p in (out / "imputed").iterdir()) == ["client-0.csv", "client-1.csv"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_impute_on_the_users_own_client_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    latent = rng.normal(size=(200, 2))
    full = pd.DataFrame(latent @ rng.normal(size=(2, 6)), columns=[f"x{i}" for i in range(6)])
    full[rng.random(full.shape) < 0.1] = np.nan
    paths = []
    for k, columns in enumerate([["x0", "x1", "x2", "x3"], ["x2", "x3", "x4", "x5"]]):
        path = tmp_path / f"site{k}.csv"
        full.iloc[k * 100 : (k + 1) * 100][columns].to_csv(path, index=False)
        paths.append(path)
    argv = ["impute", "--method", "knn", "--out", str(tmp_path / "own"), "--quiet"]
    for path in paths:
        argv += ["--client-file", str(path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "own" / "result.json").read_text())
    assert result["dataset"] == "client-files"
    assert set(result["rmse_per_client"]) == {"site0", "site1"}
    # The files' own facts, not the defaults that deal a dataset to 4 clients at 60 %.
    assert result["config"]["clients"] == 2
    assert result["config"]["availability"] == pytest.approx(4 / 6)
    # From Python, the same tables as --save-imputed writes (a private helper of the CLI's)
    config = ImputeRunConfig(method="knn", client_files=tuple(paths))
    task = prepare_imputation_task(config)
    _, imputer = run_imputation(config, task=task)
    tables = imputed_tables(task, imputer)
    assert list(tables) == ["site0", "site1"]
    assert main([*argv, "--overwrite", "--save-imputed"]) == 0
    for name, table in tables.items():
        written = pd.read_csv(tmp_path / "own" / "imputed" / f"{name}.csv")
        pd.testing.assert_frame_equal(table, written, check_dtype=False, atol=1e-6)
        original = pd.read_csv(tmp_path / f"{name}.csv")
        assert not table.isna().any().any() and original.isna().any().any()
        kept = original.notna()
        assert np.allclose(table[kept].fillna(0), original[kept].fillna(0), atol=1e-6)


def test_saved_imputed_tables_keep_each_cell_as_the_file_wrote_it(tmp_path: Path) -> None:
    # Whole numbers, True/False and a formatted decimal came back as 52.0, 1.0 and 0.1.
    (tmp_path / "a.csv").write_text(
        "id,age,smoker,chol,label\n"
        "a1,52,True,0.10,yes\na2,,False,1.5e2,no\na3,61,,200,NA\n"
        "a4,70,True,,yes\na5,44,False,180,no\na6,39,True,NA,no\n"
    )
    (tmp_path / "b.csv").write_text(
        "id,age,chol,bp\nb1,50,190,120\nb2,60,,130\nb3,,170,125\nb4,45,160,\nb5,58,175,128\n"
    )
    argv = ["impute", "--method", "fed-mean", "--out", str(tmp_path / "r"), "--quiet"]
    for name in ("a", "b"):
        argv += ["--client-file", str(tmp_path / f"{name}.csv")]
    assert main([*argv, "--save-imputed"]) == 0
    for name in ("a", "b"):
        original = pd.read_csv(tmp_path / f"{name}.csv", dtype=str, keep_default_na=False)
        written = pd.read_csv(
            tmp_path / "r" / "imputed" / f"{name}.csv", dtype=str, keep_default_na=False
        )
        assert list(written.columns) == list(original.columns)
        for column in original.columns:
            for before, after in zip(original[column], written[column], strict=True):
                if column in ("id", "label") or before not in ("", "NA"):
                    assert after == before  # as the file wrote it
                elif column == "smoker":
                    assert after in ("True", "False")  # filled, and still a True/False column
                else:
                    assert np.isfinite(float(after))  # filled
    assert written_cells(tmp_path / "r" / "imputed" / "a.csv", "smoker")[2] == "True"  # 3 of 4
    # A column of whole numbers is filled with whole numbers: the other rows' mean, 52.625
    # (a fractional age, count or score did not read as the file's own column).
    assert written_cells(tmp_path / "r" / "imputed" / "a.csv", "age") == [
        "52",
        "53",
        "61",
        "70",
        "44",
        "39",
    ]
    # a column with a decimal or an exponent among its cells is filled as it is imputed
    assert written_cells(tmp_path / "r" / "imputed" / "a.csv", "chol")[3] not in ("", "NA")
    assert float(written_cells(tmp_path / "r" / "imputed" / "a.csv", "chol")[3]) % 1 != 0


@pytest.mark.parametrize("writer", ["pandas", "pyarrow"])
def test_a_parquet_integer_column_is_filled_with_whole_numbers(tmp_path: Path, writer: str) -> None:
    """pandas reads a Parquet integer column with nulls as float64 (unless the file says it
    is pandas' Int64): the fills, and the file's own 36, came back as 52.085712 and 36.0."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    paths = []
    for name in ("a", "b"):
        count = pd.array(rng.integers(0, 10, 40), dtype="Int64")
        count[rng.random(40) < 0.2] = None
        level = rng.normal(size=40)
        level[rng.random(40) < 0.2] = np.nan
        paths.append(tmp_path / f"{name}.parquet")
        if writer == "pandas":
            pd.DataFrame({"count": count, "level": level}).to_parquet(paths[-1])
        else:  # no pandas metadata: a plain int64 column with nulls
            counts = [None if v is pd.NA else int(v) for v in count]
            columns = {"count": pa.array(counts, pa.int64()), "level": pa.array(level)}
            pq.write_table(pa.table(columns), paths[-1])
    config = ImputeRunConfig(method="mean", client_files=tuple(paths))
    task = prepare_imputation_task(config)
    _, imputer = run_imputation(config, task=task)
    tables = imputed_tables(task, imputer, as_written=True)
    for (name, table), path in zip(tables.items(), paths, strict=True):
        original = pd.read_parquet(path)
        filled = original["count"].isna().to_numpy()
        assert filled.any()
        assert all(str(cell).isdigit() for cell in table["count"][filled]), name
        kept = original["count"][~filled].tolist()
        assert [str(cell) for cell in table["count"][~filled]] == [str(int(v)) for v in kept]
        fractional = [float(cell) % 1 for cell in table["level"][original["level"].isna()]]
        assert fractional and all(part != 0 for part in fractional)  # not whole: kept as imputed


@pytest.mark.parametrize("nullable", [False, True])
def test_a_parquet_float32_columns_cells_are_written_as_float32_text(
    tmp_path: Path, nullable: bool
) -> None:
    """Its kept cells were written as float64 text (2.48 as 2.4800000190734863), its filled
    cells as float32 text: one column in two forms."""
    rng = np.random.default_rng(0)
    paths = []
    for name in ("a", "b"):
        values = rng.normal(size=(40, 2)).astype(np.float32)
        values[rng.random((40, 2)) < 0.2] = np.nan
        frame = pd.DataFrame(values, columns=["x", "y"])
        paths.append(tmp_path / f"{name}.parquet")
        (frame.astype("Float32") if nullable else frame).to_parquet(paths[-1])
    config = ImputeRunConfig(method="mean", client_files=tuple(paths))
    task = prepare_imputation_task(config)
    _, imputer = run_imputation(config, task=task)
    tables = imputed_tables(task, imputer, as_written=True)
    for (name, table), path in zip(tables.items(), paths, strict=True):
        original = pd.read_parquet(path).astype(np.float32)
        for column in ("x", "y"):
            kept = original[column].notna().to_numpy()
            cells = table[column].tolist()
            assert all(cell == str(np.float32(cell)) for cell in cells), (name, column)
            assert [np.float32(cell) for cell in np.array(cells)[kept]] == list(
                original[column][kept]
            )


def test_the_summary_shows_every_name_whole_and_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Names were cut at 19 characters (two cholesterol columns read alike), and a tab or a
    line break in a header broke the table."""
    rng = np.random.default_rng(0)
    columns = ["serum_cholesterol_mg_dL_fasting", "serum_cholesterol_mg_dL_random", "tab\there"]
    argv = ["impute", "--method", "mean", "--out", str(tmp_path / "r")]
    for name in ("site\x1b[2Ja", "site_b"):
        frame = pd.DataFrame(rng.normal(size=(60, 3)), columns=columns)
        frame[rng.random(frame.shape) < 0.15] = np.nan
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
        argv += ["--client-file", str(tmp_path / f"{name}.csv")]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any("\x1b" in line or "\t" in line for line in lines)
    assert any(line.startswith("site\\x1b[2Ja ") for line in lines)
    for name in ("serum_cholesterol_mg_dL_fasting", "serum_cholesterol_mg_dL_random", "tab\\there"):
        assert len([line for line in lines if line.startswith(name + " ")]) == 1
    widths = {len(line) for line in lines if line.startswith(("serum", "tab", "feature"))}
    assert len(widths) == 1  # one table, its columns aligned


def written_cells(path: Path, column: str) -> list[str]:
    return pd.read_csv(path, dtype=str, keep_default_na=False)[column].tolist()


def test_a_client_file_changed_before_its_table_is_written_is_refused(tmp_path: Path) -> None:
    paths = []
    for name in ("a", "b"):
        paths.append(tmp_path / f"{name}.csv")
        paths[-1].write_text("x,y\n" + "".join(f"{i},{i + 1}\n" for i in range(1, 20)) + ",5\n")
    config = ImputeRunConfig(method="fed-mean", client_files=tuple(paths))
    task = prepare_imputation_task(config)
    _, imputer = run_imputation(config, task=task)
    assert imputed_tables(task, imputer, as_written=True)["a"]["x"].tolist()[0] == "1"
    # a value it had is gone
    paths[0].write_text("x,y\n,2\n" + "".join(f"{i},{i + 1}\n" for i in range(2, 20)) + ",5\n")
    with pytest.raises(DataError, match=r"a.csv changed after it was read: column 'x'"):
        imputed_tables(task, imputer, as_written=True)
    paths[0].write_text("x,z\n1,2\n")  # a column gone
    with pytest.raises(DataError, match=r"a.csv changed after it was read: columns \['x', 'y'\]"):
        imputed_tables(task, imputer, as_written=True)
    paths[0].write_text("x,y\n1,2\n")
    with pytest.raises(
        DataError, match=r"a.csv changed after it was read: 20 rows expected, found 1"
    ):
        imputed_tables(task, imputer, as_written=True)


def test_secure_aggregation_of_client_sums_matches_the_clear(tmp_path: Path) -> None:
    results = {}
    for method in ("fed-mean", "fedhf"):
        for backend in ("none", "masks"):
            out = tmp_path / f"{method}-{backend}"
            argv = [
                "impute",
                "--method",
                method,
                "--dataset",
                "ozone",
                *(["--rounds", "3"] if method == "fedhf" else []),  # fed-mean trains nothing
                "--secure-agg",
                backend,
                "--out",
                str(out),
                "--quiet",
            ]
            assert main(argv) == 0
            results[method, backend] = json.loads((out / "result.json").read_text())
    assert results["fedhf", "masks"]["aggregator"] == "MaskingAggregator"
    assert results["fedhf", "none"]["aggregator"] == "PlainAggregator"
    # Statistics alone: equal up to the fixed-point step.
    plain, secure = results["fed-mean", "none"], results["fed-mean", "masks"]
    assert secure["rmse"] == pytest.approx(plain["rmse"], abs=1e-5)
    # Training amplifies the fixed-point rounding a little; the result stays close.
    plain, secure = results["fedhf", "none"], results["fedhf", "masks"]
    assert secure["rmse"] == pytest.approx(plain["rmse"], abs=0.02)


def _impute(tmp_path: Path, name: str, *extra: str, method: str = "fedhf") -> dict:
    out = tmp_path / name
    argv = ["impute", "--method", method, "--dataset", "ozone", "--out", str(out), "--quiet"]
    assert main([*argv, *extra]) == 0
    return json.loads((out / "result.json").read_text())


def test_paillier_and_ckks_statistics_on_the_cli_match_the_clear(tmp_path: Path) -> None:
    """Ozone's raw sums (~4e5 per client) exceed both backends' ranges unless encoded."""
    plain = _impute(tmp_path, "none", method="fed-mean")
    for backend, name in (("paillier", "PaillierAggregator"), ("ckks", "CkksAggregator")):
        secure = _impute(tmp_path, backend, "--secure-agg", backend, method="fed-mean")
        assert secure["aggregator"] == name
        assert secure["rmse"] == pytest.approx(plain["rmse"], abs=1e-6)


def test_fedhf_under_ckks_on_the_cli_matches_the_clear(tmp_path: Path) -> None:
    plain = _impute(tmp_path, "none", "--rounds", "2")
    secure = _impute(tmp_path, "ckks", "--rounds", "2", "--secure-agg", "ckks")
    assert secure["aggregator"] == "CkksAggregator"
    np.testing.assert_allclose(secure["validation_curve"], plain["validation_curve"], atol=2e-3)
    assert secure["rmse"] == pytest.approx(plain["rmse"], abs=5e-3)


def test_fedhf_under_paillier_matches_the_clear() -> None:
    """FedAvg updates and statistics through 1024-bit Paillier (the tests' key size)."""
    config = ImputeRunConfig(
        method="fedhf",
        dataset="ozone",
        impute_config=ImputeConfig(rounds=2, local_epochs=1, hidden=16, layers=1),
    )
    task = prepare_imputation_task(config)
    plain, _ = run_imputation(config, task=task)
    secure, _ = run_imputation(config, task=task, aggregator=paillier_aggregator())
    assert secure.aggregator == "PaillierAggregator"
    np.testing.assert_allclose(secure.validation_curve, plain.validation_curve, atol=1e-3)
    assert secure.rmse == pytest.approx(plain.rmse, abs=2e-3)


def test_dp_statistics_write_epsilon_per_client_to_the_result(tmp_path: Path) -> None:
    result = _impute(
        tmp_path, "dp", "--rounds", "1", "--secure-agg", "masks", "--dp-statistics", "2:1.5"
    )
    privacy = result["privacy"]
    clients = {f"client-{k}" for k in range(4)}
    assert set(privacy["epsilon"]) == clients
    assert privacy["releases"] == {name: {"statistics": 3} for name in clients}
    assert privacy["noise"] == {"statistics": {"sigma": 2.0, "clip": 1.5}}
    assert privacy["noise_shares"] == 4 and privacy["delta"] == 1e-5
    reference = RDPAccountant()  # three Gaussian releases of every row, add/remove
    for _ in range(3):
        reference.step(noise_multiplier=2.0, sample_rate=1.0)
    for name, epsilon in privacy["epsilon"].items():
        assert epsilon == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-9)
        (guarantee,) = privacy["guarantees"][name]
        assert guarantee["adjacency"] == "add or remove one record"
        assert guarantee["amplification"] is False and guarantee["releases"] == 3
    assert privacy["insecure_reproducible_noise"] is False
    # without secure aggregation every client adds the whole noise (nothing is shared)
    local = _impute(tmp_path, "local", "--rounds", "1", "--dp-statistics", "2:1.5")
    assert local["privacy"]["noise_shares"] == 1


def test_target_epsilon_calibrates_the_statistics_noise(tmp_path: Path) -> None:
    result = _impute(
        tmp_path,
        "target",
        "--rounds",
        "1",
        "--dp-statistics",
        "1:2",
        "--target-epsilon",
        "4",
        "--delta",
        "1e-6",
    )
    privacy = result["privacy"]
    assert privacy["noise"]["statistics"]["sigma"] > 1.0
    assert all(3.9 <= e <= 4.0 for e in privacy["epsilon"].values())


def test_target_epsilon_without_dp_statistics_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["impute", "--method", "fedhf", "--dataset", "ozone", "--out", str(tmp_path / "r")]
    assert main([*argv, "--target-epsilon", "2"]) == 2
    err = capsys.readouterr().err
    assert "expected `dp_statistics` (--dp-statistics) with it" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r" / "result.json").exists()


def test_declared_feature_ranges_replace_the_observed_ones(tmp_path: Path) -> None:
    task = prepare_imputation_task(ImputeRunConfig(method="fedhf", dataset="ozone"))
    table = pd.DataFrame(
        {"feature": list(task.features), "lower": -1000.0, "upper": 1000.0}
    ).sample(frac=1.0, random_state=0)  # any row order
    table.to_csv(tmp_path / "ranges.csv", index=False)
    args = ["--rounds", "1", "--dp-statistics", "2:1.5"]
    declared = _impute(
        tmp_path, "declared", *args, "--feature-ranges", str(tmp_path / "ranges.csv")
    )
    observed = _impute(tmp_path, "observed", *args)
    assert declared["privacy"]["ranges"] == f"declared in {tmp_path / 'ranges.csv'}"
    assert "not private" in observed["privacy"]["ranges"]
    assert declared["rmse"] != observed["rmse"]  # the clipping bounds changed what was released
    assert not any("no client file has" in text for text in declared["warnings"])
    # A row for a feature the files do not have was dropped in silence (e.g. a misspelt name).
    extra = pd.concat([table, pd.DataFrame({"feature": ["Extra"], "lower": [0.0], "upper": [1.0]})])
    extra.to_csv(tmp_path / "extra.csv", index=False)
    more = _impute(tmp_path, "extra", *args, "--feature-ranges", str(tmp_path / "extra.csv"))
    unused = f"{tmp_path / 'extra.csv'}: ranges of 1 feature(s) no client file has, unused: "
    assert unused + "['Extra']." in more["warnings"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ({"feature": ["x"], "lower": [0.0]}, "missing ['upper']"),
        ({"feature": ["x"], "lower": [0.0], "upper": [1.0]}, "no range for feature(s)"),
        (  # named by the file's feature names (it said "for feature 0")
            {
                "feature": [f"V{k}" for k in range(4, 14)],
                "lower": [5.0] + [0.0] * 9,
                "upper": [1.0] * 10,
            },
            "every feature range needs lower < upper. Found V4 [5, 1].",
        ),
    ],
)
def test_bad_feature_ranges_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: dict[str, list[object]], message: str
) -> None:
    pd.DataFrame(rows).to_csv(tmp_path / "ranges.csv", index=False)
    argv = ["impute", "--method", "fedhf", "--dataset", "ozone", "--out", str(tmp_path / "r")]
    argv += ["--dp-statistics", "1:1", "--feature-ranges", str(tmp_path / "ranges.csv")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_imputation_results_report_the_wire_bytes_of_every_client(tmp_path: Path) -> None:
    plain = _impute(tmp_path, "plain", "--rounds", "2")
    masked = _impute(tmp_path, "masked", "--rounds", "2", "--secure-agg", "masks")
    clients = {f"client-{k}" for k in range(4)}
    for result in (plain, masked):
        traffic = result["traffic"]
        assert clients <= set(traffic["bytes"]) and traffic["train_steps"] == 2
        for name in clients:
            sent = traffic["bytes"][name]["train"]
            assert sent > 0 and traffic["bytes_per_step"][name] == sent / 2
    assert plain["traffic"]["protection_s"] == 0.0 < masked["traffic"]["protection_s"]
    # Masked contributions are uint64 ring elements: twice the float32 bytes of the same sums
    # (the plain messages also carry an 8-byte row position each).
    ratio = (
        masked["traffic"]["bytes"]["client-0"]["train"]
        / plain["traffic"]["bytes"]["client-0"]["train"]
    )
    assert 1.99 < ratio < 2.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--name", "bank", "--method", "mean"], "--method mean is not offered with --federation"),
        (["--name", "bank", "--method", "dae"], "--method dae is not offered with --federation"),
        (["--method", "fedhf"], "--federation needs --name NAME"),
        (["--name", "shop", "--method", "fedhf"], "shop is not the label party"),
        (
            ["--name", "bank", "--method", "fedhf", "--dp-statistics", "1:1"],
            "--dp-statistics with --federation clips the clients' values to declared ranges: "
            "expected --feature-ranges CSV",
        ),
        (
            ["--name", "bank", "--method", "fedhf", "--insecure-reproducible-noise"],
            "--insecure-reproducible-noise is refused with --federation",
        ),
        (
            ["--name", "bank", "--method", "fedhf", "--clients", "3"],
            "--clients not offered with impute --federation",
        ),
    ],
)
def test_a_deployed_impute_refuses_what_it_does_not_offer_before_any_contact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    from test_deploy import write_federation

    from secure_vfl.federation.network import free_loopback_ports

    federation = write_federation(tmp_path, tmp_path / "certs", free_loopback_ports(5))
    out = tmp_path / "out"
    code = main(["impute", "--federation", str(federation), *extra, "--out", str(out)])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_deployed_impute_with_one_client_says_so_before_any_contact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_deploy import write_federation

    from secure_vfl.federation.network import free_loopback_ports

    ports = free_loopback_ports(3)  # bank and shop, and the aggregator
    path = write_federation(tmp_path, tmp_path / "certs", [ports[0], ports[1], ports[2]])
    text = path.read_text()
    path.write_text(text[: text.index("[party.insurer]")])  # bank (the label party) and shop
    out = tmp_path / "out"
    argv = ["impute", "--federation", str(path), "--name", "bank", "--method", "fedhf"]
    code = main([*argv, "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "needs at least 2 clients besides the coordinator bank. Found 1" in err, err
    assert "client files" not in err and not out.exists()


def test_an_imputation_that_diverges_says_in_which_fedavg_round_and_what_to_try(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It stopped with the codec's refusal of a message's own round ("round 4" of a 2-round
    run) and nothing to try."""
    out = tmp_path / "r"
    argv = ["impute", "--method", "fedhf", "--dataset", "ozone", "--rounds", "2", "--lr", "1e6"]
    assert main([*argv, "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("secure-vfl: error: imputation diverged in FedAvg round 1: ")
    assert err.rstrip().endswith("try a lower --lr or fewer --local-epochs.")
    assert not out.exists()


def test_an_imputation_that_diverges_carries_its_fedavg_round_as_its_step() -> None:
    """Its DivergenceError named the FedAvg round in its text only (step None), so a caller
    could not report where it diverged without reading the message, as it can a training's."""
    from secure_vfl.errors import DivergenceError

    config = ImputeRunConfig(
        method="fedhf", dataset="ozone", impute_config=ImputeConfig(rounds=2, lr=1e6)
    )
    with pytest.raises(DivergenceError, match="in FedAvg round 1: ") as raised:
        run_imputation(config)
    assert raised.value.step == 1
    # the message's own round counts messages, not FedAvg rounds: it said "(round 4)" beside it
    assert "(round " not in str(raised.value), str(raised.value)


def test_one_client_file_is_refused_as_one_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "site.csv"
    path.write_text("id,a,b\nu1,1,2\nu2,3,4\nu3,5,\n")
    argv = ["impute", "--method", "fedhf", "--client-file", str(path), "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    # it said "`clients` must be an integer >= 2. Found 1."
    assert "federated imputation needs at least 2 client files. Found 1." in capsys.readouterr().err


def test_a_run_warns_when_the_epsilons_rest_on_observed_ranges() -> None:
    """The epsilon was printed as if private; only result.json's `ranges` said it was not.
    Then it was a `WARNING:` line of the summary on stdout; it is a run warning, as every
    other caveat of a guarantee is (stderr, and result.json's warnings)."""
    from protocols.privacy import _warn_of_weak_guarantees
    from secure_vfl.cli import _privacy_lines
    from secure_vfl.errors import RunWarning

    privacy = {
        "epsilon": {"client-0": 2.0},
        "sampling": {"kind": "full"},
        "delta": 1e-5,
        "adjacency": "add or remove one record",
        "insecure_reproducible_noise": False,
        "ranges": "observed training ranges (not private: pass --feature-ranges)",
    }
    with pytest.warns(RunWarning) as warned:
        _warn_of_weak_guarantees(privacy, {})
    assert [str(w.message) for w in warned] == [
        "the feature ranges are the observed training ranges (not private: pass --feature-ranges)."
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunWarning)
        _warn_of_weak_guarantees({**privacy, "ranges": "declared in r.csv"}, {})
    assert len(_privacy_lines(privacy)) == 1  # the epsilons; the caveat is not repeated
    # A deployed party lost mid-run reported nothing: the line left it out without a word.
    lost = {"client-1": "none: it reported nothing (lost mid-run; see faults), so ..."}
    lines = _privacy_lines({**privacy, "ranges": None, "accounted_by": lost})
    assert lines[1] == (
        "no epsilon for client-1: lost mid-run, it reported nothing (see faults); its releases "
        "before it was lost are not priced here"
    )


def test_noise_too_large_for_the_statistics_sums_is_named_as_a_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --dp-statistics SIGMA of 1e15 swamps the statistics; the refusal blamed only the
    features' units."""
    argv = ["impute", "--method", "fedhf", "--dataset", "ozone", "--rounds", "1"]
    argv += ["--dp-statistics", "1e15:1", "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "a --dp-statistics SIGMA x CLIP that large swamps them" in err, err
    assert not (tmp_path / "r").exists()


def test_a_feature_too_large_for_the_statistics_sums_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The refusal named neither the client nor the feature, and quoted a magnitude scaled by 2^20.
    rng = np.random.default_rng(0)
    argv = ["impute", "--method", "fedhf", "--rounds", "1", "--out", str(tmp_path / "r")]
    for k in range(2):
        frame = pd.DataFrame(rng.normal(size=(40, 3)), columns=["a", "b", "c"])
        frame["income"] = rng.normal(size=40) * 3e8 + 1e9
        frame.to_csv(tmp_path / f"site{k}.csv", index=False)
        argv += ["--client-file", str(tmp_path / f"site{k}.csv")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "client 'site0': feature 'income' holds values up to 1." in err
    assert "rescale that feature's units" in err
    frame["income"] /= 1e3  # in thousands it is carried
    frame.to_csv(tmp_path / "site1.csv", index=False)
    pd.read_csv(tmp_path / "site0.csv").assign(income=lambda f: f.income / 1e3).to_csv(
        tmp_path / "site0.csv", index=False
    )
    assert main(argv) == 0


def test_a_constant_feature_is_filled_with_its_constant(tmp_path: Path) -> None:
    # A model's output for it was destandardised with the fallback std 1: 7.3195 for 7.3.
    rng = np.random.default_rng(0)
    argv = ["impute", "--method", "fedhf", "--rounds", "2", "--out", str(tmp_path / "r")]
    for k in range(2):
        frame = pd.DataFrame(rng.normal(size=(40, 3)), columns=["a", "b", "c"])
        frame["const"] = 7.3
        frame[rng.random(frame.shape) < 0.15] = np.nan
        frame.to_csv(tmp_path / f"site{k}.csv", index=False)
        argv += ["--client-file", str(tmp_path / f"site{k}.csv")]
    assert main([*argv, "--quiet", "--save-imputed"]) == 0
    for k in range(2):
        original = pd.read_csv(tmp_path / f"site{k}.csv")
        written = pd.read_csv(tmp_path / "r" / "imputed" / f"site{k}.csv")
        assert original["const"].isna().any()
        assert (written["const"] == 7.3).all()
        assert written[["a", "b", "c"]].notna().all().all()
