"""Saved imputers: `impute` keeps each client's part, `fill` fills new rows with it alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from secure_vfl.cli import main
from secure_vfl.errors import DataError, IntegrityError
from secure_vfl.experiment import (
    ImputeRunConfig,
    imputed_tables,
    prepare_imputation_task,
    run_imputation,
)
from secure_vfl.federation.parts import sha256
from secure_vfl.methods.imputation import ImputeConfig
from secure_vfl.saved_imputer import SavedImputer, model_methods, save_imputer
from secure_vfl.tensor_file import dumps, loads

SCHEMAS = (["x0", "x1", "x2", "x3"], ["x2", "x3", "x4", "x5"])


def client_files(directory: Path, *, seed: int = 0) -> list[Path]:
    """Two sites' files of correlated features (ids, a label, 10 % empty cells)."""
    rng = np.random.default_rng(seed)
    full = pd.DataFrame(
        rng.normal(size=(160, 2)) @ rng.normal(size=(2, 6)), columns=[f"x{i}" for i in range(6)]
    )
    full[rng.random(full.shape) < 0.1] = np.nan
    paths = []
    for k, columns in enumerate(SCHEMAS):
        rows = full.iloc[k * 80 : (k + 1) * 80][columns].reset_index(drop=True)
        rows.insert(0, "id", [f"s{k}-{i}" for i in range(80)])
        rows["label"] = rng.integers(0, 2, size=80)
        path = directory / f"site{k}.csv"
        rows.to_csv(path, index=False)
        paths.append(path)
    return paths


@pytest.mark.parametrize("method", model_methods())
def test_a_saved_imputer_fills_a_clients_rows_as_the_run_did(tmp_path: Path, method: str) -> None:
    paths = client_files(tmp_path)
    config = ImputeRunConfig(
        method=method, client_files=tuple(paths), impute_config=ImputeConfig(rounds=2)
    )
    task = prepare_imputation_task(config)
    _, imputer = run_imputation(config, task=task)
    expected = imputed_tables(task, imputer, as_written=True)
    manifest = save_imputer(
        tmp_path / "model", imputer, task, method=method, seed=0, config=config.impute_config
    )
    assert [entry.columns for entry in manifest.clients] == [tuple(s) for s in SCHEMAS]
    saved = SavedImputer.load(tmp_path / "model")
    for path, name in zip(paths, ("site0", "site1"), strict=True):
        filled = saved.fill(path, client=name, id_column="id", label_column="label")
        # Cell for cell the table the run wrote with its in-memory clients.
        pd.testing.assert_frame_equal(filled.table.astype(str), expected[name].astype(str))
        original = pd.read_csv(path)
        assert filled.filled == int(original.drop(columns=["id", "label"]).isna().sum().sum()) > 0


def impute_argv(tmp_path: Path, method: str, out: str) -> list[str]:
    argv = ["impute", "--method", method, "--out", str(tmp_path / out), "--quiet"]
    for path in client_files(tmp_path):
        argv += ["--client-file", str(path)]
    return argv + (["--rounds", "2"] if method in ("fedhf", "dae", "fed-dae") else [])


def impute(tmp_path: Path, *extra: str, method: str = "fedhf", out: str = "run") -> Path:
    assert main([*impute_argv(tmp_path, method, out), *extra]) == 0
    return tmp_path / out


def test_impute_saves_the_model_and_fill_fills_new_rows_of_a_clients_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = impute(tmp_path)
    result = json.loads((run / "result.json").read_text())
    assert result["model"]["directory"] == str(run / "model")
    assert f"secure-vfl fill --model {run}" in capsys.readouterr().out
    # New rows at site1: a column of its schema missing, the others in another order, empty cells.
    new = pd.DataFrame(
        {
            "x5": [1.0, np.nan, 0.5],
            "id": ["n1", "n2", "n3"],
            "x2": [np.nan, 0.3, np.nan],
            "x3": [0.1, np.nan, np.nan],
        }
    )
    new_file = tmp_path / "incoming" / "site1.csv"
    new_file.parent.mkdir()
    new.to_csv(new_file, index=False)
    out = tmp_path / "filled"
    assert (
        main(["fill", "--model", str(run), "--client-file", str(new_file), "--out", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert "fedhf imputer" in printed and "site1" in printed
    assert printed.splitlines()[-1].split()[2:4] == ["3", "5"]  # rows, filled cells
    filled = pd.read_csv(out / "site1.csv")
    assert list(filled.columns) == ["id", "x5", "x2", "x3"]  # the id first, then file order
    assert filled["id"].tolist() == ["n1", "n2", "n3"]
    assert not filled.isna().any().any()
    given = new.notna()
    for column in ("x5", "x2", "x3"):
        kept = given[column].to_numpy()
        assert np.allclose(filled[column][kept], new[column][kept])
    # The same client named explicitly, from a file of another stem, gives the same table.
    renamed = tmp_path / "incoming" / "batch.csv"
    new.to_csv(renamed, index=False)
    again = tmp_path / "again"
    argv = ["fill", "--model", str(run), "--client-file", f"site1={renamed}", "--out", str(again)]
    assert main(argv) == 0
    pd.testing.assert_frame_equal(pd.read_csv(again / "batch.csv"), filled)


def test_fill_reads_the_id_and_label_columns_the_imputer_was_trained_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["impute", "--method", "fed-mean", "--out", str(tmp_path / "run"), "--quiet"]
    for path in client_files(tmp_path):
        frame = pd.read_csv(path).rename(columns={"id": "patient", "label": "outcome"})
        frame.to_csv(path, index=False)
        argv += ["--client-file", str(path)]
    assert main([*argv, "--id-column", "patient", "--label-column", "outcome"]) == 0
    manifest = json.loads((tmp_path / "run" / "model" / "manifest.json").read_text())
    assert (manifest["id_column"], manifest["label_column"]) == ("patient", "outcome")
    out = tmp_path / "filled"
    fill = ["fill", "--model", str(tmp_path / "run"), "--client-file", str(tmp_path / "site0.csv")]
    assert main([*fill, "--out", str(out)]) == 0  # not taken for features: the model's own
    filled = pd.read_csv(out / "site0.csv")
    assert list(filled.columns) == ["patient", "x0", "x1", "x2", "x3", "outcome"]
    # Named otherwise, the model's id column would be read as a feature.
    capsys.readouterr()
    err = fill_error([*fill, "--out", str(tmp_path / "other"), "--id-column", "id"], capsys)
    assert "if 'patient' holds the ids, give --id-column patient" in err
    # The ids are optional (the docs say so): it was refused for lacking `patient`.
    bare = tmp_path / "bare" / "site0.csv"
    bare.parent.mkdir()
    pd.read_csv(tmp_path / "site0.csv").drop(columns=["patient"]).to_csv(bare, index=False)
    assert (
        main(
            [
                "fill",
                "--model",
                str(tmp_path / "run"),
                "--client-file",
                str(bare),
                "--out",
                str(tmp_path / "bare-out"),
            ]
        )
        == 0
    )
    filled = pd.read_csv(tmp_path / "bare-out" / "site0.csv")
    assert list(filled.columns) == ["x0", "x1", "x2", "x3", "outcome"]


def test_a_client_that_keeps_only_its_own_part_fills_alone(tmp_path: Path) -> None:
    run = impute(tmp_path, method="fed-mean")
    shutil.rmtree(run / "model" / "client-1")
    saved = SavedImputer.load(run)
    filled = saved.fill(
        tmp_path / "site0.csv", client="site0", id_column="id", label_column="label"
    )
    assert not filled.table.isna().any().any()
    with pytest.raises(DataError, match="its part is not here"):
        saved.fill(tmp_path / "site1.csv", client="site1", id_column="id", label_column="label")


def test_methods_without_a_model_save_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = impute(tmp_path, method="knn")
    assert not (run / "model").exists()
    assert json.loads((run / "result.json").read_text())["model"] is None
    assert "secure-vfl fill" not in capsys.readouterr().out
    with pytest.raises(DataError, match="is an impute run of knn, which keeps no model"):
        SavedImputer.load(run)
    # Over a run that kept one, --overwrite would leave that model beside the knn result.
    impute(tmp_path, method="fed-mean", out="kept")
    capsys.readouterr()
    assert main([*impute_argv(tmp_path, "knn", "kept"), "--overwrite"]) == 2
    assert "keeps no model to replace it with" in capsys.readouterr().err
    assert (tmp_path / "kept" / "model" / "manifest.json").is_file()


def fill_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_fill_refuses_what_it_cannot_fill_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = impute(tmp_path, method="fed-mean")
    site0 = tmp_path / "site0.csv"
    base = ["fill", "--model", str(run), "--out", str(tmp_path / "out")]
    # A column the client was not trained with (x4 is site1's).
    foreign = tmp_path / "other" / "site0.csv"
    foreign.parent.mkdir()
    pd.read_csv(tmp_path / "site1.csv").to_csv(foreign, index=False)
    err = fill_error([*base, "--client-file", str(foreign)], capsys)
    assert "feature columns of client site0 expected (x0, x1, x2, x3" in err and "'x4'" in err
    # A file whose stem names no client.
    stray = tmp_path / "stray.csv"
    shutil.copy(site0, stray)
    err = fill_error([*base, "--client-file", str(stray)], capsys)
    assert "expected one of site0, site1 (or --client-file CLIENT=" in err
    err = fill_error([*base, "--client-file", f"site9={site0}"], capsys)
    assert "no client 'site9' in this imputer; expected one of site0, site1" in err
    # Two files of one stem would write one table over the other.
    err = fill_error([*base, "--client-file", str(site0), "--client-file", str(foreign)], capsys)
    assert "found 'site0' twice" in err
    # A table inside the model (its manifest lists every file), a table over its own input,
    # an earlier table without --overwrite.
    inside = ["fill", "--model", str(run), "--client-file", str(site0), "--out"]
    err = fill_error([*inside, str(run / "model" / "x")], capsys)
    assert "lies in the model's directory" in err
    err = fill_error([*inside, str(tmp_path), "--overwrite"], capsys)
    assert "is the input file" in err and "site0.csv" in err
    assert not (tmp_path / "out").exists()
    assert main([*inside, str(tmp_path / "out")]) == 0
    capsys.readouterr()
    err = fill_error([*inside, str(tmp_path / "out")], capsys)
    assert "site0.csv exists; expected a new --out file (or --overwrite)" in err
    assert main([*inside, str(tmp_path / "out"), "--overwrite"]) == 0
    # A bad second file: nothing is written, not even the first file's table.
    err = fill_error(
        [*inside, str(tmp_path / "out2"), "--client-file", f"site0={tmp_path / 'site1.csv'}"],
        capsys,
    )
    assert "'x4'" in err and not (tmp_path / "out2").exists()
    # An infinite value is named with its file (a client may fill several): it named the client.
    infinite = tmp_path / "inf" / "site0.csv"
    infinite.parent.mkdir()
    frame = pd.read_csv(site0)
    frame.loc[0, "x1"] = np.inf
    frame.to_csv(infinite, index=False)
    base = ["fill", "--model", str(run), "--out", str(tmp_path / "out3")]
    err = fill_error([*base, "--client-file", str(infinite)], capsys)
    assert f"{infinite}: values must be finite or missing" in err and "'x1'" in err
    # A column name as long as a file allows is cut short in the error.
    long = tmp_path / "long" / "site0.csv"
    long.parent.mkdir()
    pd.read_csv(site0).assign(**{"w" * 20_000: 1.0}).to_csv(long, index=False)
    err = fill_error([*base, "--client-file", str(long)], capsys)
    assert "(20002 characters)" in err and len(err) < 1000


def test_fill_and_predict_each_refuse_the_others_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = impute(tmp_path, method="mean")
    err = fill_error(
        ["predict", "--model", str(run), "--party-file", str(tmp_path / "site0.csv")], capsys
    )
    assert (
        "found an imputer (saved by `secure-vfl impute`): fill rows with `secure-vfl fill`" in err
    )
    trained = tmp_path / "trained"
    assert (
        main(
            [
                "train",
                "--method",
                "local",
                "--dataset",
                "breast-cancer",
                "--epochs",
                "1",
                "--out",
                str(trained),
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    err = fill_error(
        ["fill", "--model", str(trained), "--client-file", str(tmp_path / "site0.csv")], capsys
    )
    assert "found a trained classifier (saved by `secure-vfl train`): score rows with" in err
    err = fill_error(
        ["fill", "--model", str(tmp_path), "--client-file", str(tmp_path / "site0.csv")], capsys
    )
    assert f"no saved imputer at {tmp_path}" in err


def test_each_batch_of_a_column_is_filled_in_the_form_of_its_training_file(
    tmp_path: Path,
) -> None:
    # Trained on real numbers (x0), whole numbers (n) and True/False (flag) ...
    rng = np.random.default_rng(1)
    for k in range(2):
        frame = pd.DataFrame(
            {
                "x0": rng.normal(size=30),
                "n": rng.integers(0, 9, size=30),
                "flag": rng.random(30) < 0.5,
            }
        ).astype(object)
        frame.iloc[::7, k] = None
        frame.to_csv(tmp_path / f"site{k}.csv", index=False)
    files = [arg for k in range(2) for arg in ("--client-file", str(tmp_path / f"site{k}.csv"))]
    assert main(["impute", "--method", "fed-mean", "--out", str(tmp_path / "r"), *files]) == 0
    manifest = json.loads((tmp_path / "r" / "model" / "manifest.json").read_text())
    assert manifest["clients"][0]["forms"] == {"x0": "real", "n": "whole", "flag": "boolean"}
    # ... a new batch whose x0 cells happen to be whole, n's real, and flag all empty.
    batch = tmp_path / "new" / "site0.csv"
    batch.parent.mkdir()
    batch.write_text("x0,n,flag\n1,2.5,\n,,\n")
    fill = ["fill", "--model", str(tmp_path / "r"), "--client-file", str(batch)]
    assert main([*fill, "--out", str(tmp_path / "o")]) == 0
    filled = (tmp_path / "o" / "site0.csv").read_text().splitlines()
    x0, n, flag = filled[2].split(",")
    assert float(x0) != round(float(x0)) and n == str(int(n)) and flag in ("True", "False")
    assert filled[1].startswith("1,2.5,")  # the cells it had, as it wrote them


def test_a_client_named_with_an_equals_sign_is_named_on_the_command_line(
    tmp_path: Path,
) -> None:
    paths = client_files(tmp_path)
    named = [path.rename(path.with_name(f"a=b {k}.csv")) for k, path in enumerate(paths)]
    files = [arg for path in named for arg in ("--client-file", str(path))]
    assert main(["impute", "--method", "mean", "--out", str(tmp_path / "r"), *files]) == 0
    batch = tmp_path / "batch.csv"
    shutil.copy(named[1], batch)
    argv = ["fill", "--model", str(tmp_path / "r"), "--out", str(tmp_path / "o")]
    assert main([*argv, "--client-file", f"a=b 1={batch}"]) == 0
    assert (tmp_path / "o" / "batch.csv").is_file()


def rewrite_part(part: Path, manifest: Path, change: object) -> None:
    """Change a client's tensor file and list its new SHA-256 in the manifest (a part altered
    by someone who can also edit the manifest: the hashes no longer protect it)."""
    tree = loads((part / "imputer.safetensors").read_bytes(), "test")
    change(tree)  # type: ignore[operator]
    data = dumps(tree)
    (part / "imputer.safetensors").write_bytes(data)
    payload = json.loads(manifest.read_text())
    entry = next(e for e in payload["clients"] if e["directory"] == part.name)
    entry["files"]["imputer.safetensors"] = sha256(data)
    manifest.write_text(json.dumps(payload))


def test_an_altered_part_or_manifest_is_refused(tmp_path: Path) -> None:
    run = impute(tmp_path)
    model = run / "model"
    pristine = tmp_path / "pristine"
    shutil.copytree(model, pristine)

    def fill() -> None:
        SavedImputer.load(model).fill(
            tmp_path / "site0.csv", client="site0", id_column="id", label_column="label"
        )

    fill()
    tensors = model / "client-0" / "imputer.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 1
    tensors.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="does not match the SHA-256 in the manifest"):
        fill()

    def restore() -> None:
        shutil.rmtree(model)
        shutil.copytree(pristine, model)

    restore()
    (model / "client-0" / "notes.txt").write_text("x")
    with pytest.raises(IntegrityError, match=r"notes\.txt is not listed in the manifest"):
        SavedImputer.load(model)
    restore()
    (model / "extra").mkdir()
    with pytest.raises(IntegrityError, match="extra is not listed in"):
        SavedImputer.load(model)
    restore()

    def nan_weight(tree: dict) -> None:
        name = next(k for k, v in tree["model"].items() if v.is_floating_point())
        tree["model"][name].view(-1)[0] = float("nan")

    rewrite_part(model / "client-0", model / "manifest.json", nan_weight)
    with pytest.raises(IntegrityError, match="finite values expected"):
        fill()
    restore()
    rewrite_part(model / "client-0", model / "manifest.json", lambda t: t.update(std=-t["std"]))
    with pytest.raises(IntegrityError, match="std"):
        fill()
    restore()

    def wider(tree: dict) -> None:
        tree["available"] = torch.ones(7, dtype=torch.bool)

    rewrite_part(model / "client-0", model / "manifest.json", lambda t: t.update(graph=None))
    with pytest.raises(IntegrityError, match="FedHF's model reads the feature graph"):
        fill()
    restore()

    def another_schema(tree: dict) -> None:
        tree["available"] = torch.tensor([False, False, True, True, True, True])

    rewrite_part(model / "client-0", model / "manifest.json", another_schema)
    with pytest.raises(IntegrityError, match=r"its part's schema \(x2, x3, x4, x5\) expected"):
        fill()
    restore()
    rewrite_part(model / "client-0", model / "manifest.json", wider)
    with pytest.raises(
        IntegrityError, match=r"available: finite torch.bool of shape \[6\] expected"
    ):
        fill()
    restore()
    # A manifest edited to ask for a vast network: refused by the saved shapes, not built.
    payload = json.loads((pristine / "manifest.json").read_text())
    payload["impute_config"].update(hidden=65536, layers=64)
    (model / "manifest.json").write_text(json.dumps(payload))
    with pytest.raises(IntegrityError, match=r"'embedding.weight' of shape \[6, 65536\] expected"):
        fill()
    for key, value, message in [
        ("version", 2, "imputer manifest version 1 expected"),
        ("method", "knn", "a method that keeps a model"),
        ("features", ["x0"], "2 to 65536 distinct feature names expected"),
        ("impute_config", {"hidden": 0}, "does not build here"),
        ("run_id", "../../x", "a run_id of 32 hex digits"),
        ("label_column", "id", "two distinct column names for the ids and labels"),
    ]:
        payload = json.loads((pristine / "manifest.json").read_text())
        payload[key] = value
        (model / "manifest.json").write_text(json.dumps(payload))
        with pytest.raises(DataError, match=message):
            SavedImputer.load(model)
    for change, message in [
        ({"directory": ".."}, "a plain directory name"),
        ({"columns": ["x0", "nope"]}, "each one of the manifest's features"),
        ({"files": {"part.json": "0" * 63}}, "SHA-256"),
    ]:
        payload = json.loads((pristine / "manifest.json").read_text())
        payload["clients"][0].update(change)
        (model / "manifest.json").write_text(json.dumps(payload))
        with pytest.raises(DataError, match=message):
            SavedImputer.load(model)


def test_impute_keeps_a_model_folder_of_the_users_own_without_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A model/ folder that holds no imputer (the user's own files) is not replaced unasked.
    (tmp_path / "run" / "model").mkdir(parents=True)
    (tmp_path / "run" / "model" / "notes.txt").write_text("mine")
    assert main(impute_argv(tmp_path, "fed-mean", "run")) == 2
    assert "run/model exists; expected a new --out directory (or --overwrite)" in (
        capsys.readouterr().err
    )
    assert (tmp_path / "run" / "model" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "run" / "result.json").exists()
    # With --overwrite it is replaced whole by the imputer.
    assert main([*impute_argv(tmp_path, "fed-mean", "run"), "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "run" / "model").iterdir()) == [
        "client-0",
        "client-1",
        "manifest.json",
    ]


def test_a_clients_part_that_is_a_file_is_refused_as_such_not_as_unlisted(tmp_path: Path) -> None:
    run = impute(tmp_path, method="fed-mean")
    shutil.rmtree(run / "model" / "client-0")
    (run / "model" / "client-0").write_text("x")
    with pytest.raises(IntegrityError) as refused:
        SavedImputer.load(run)
    message = str(refused.value)
    assert "client-0: site0's part directory expected, found a file" in message
    assert "not listed" not in message


def test_a_column_a_file_lacks_is_read_as_missing_cells_of_the_clients_feature(
    tmp_path: Path,
) -> None:
    """A trained column the file lacked was taken as a feature the client does not have, which
    FedHF reads otherwise (its availability input): the other columns' fills differed, by up to
    4e-4, from the same file with that column present and empty, as the docs say it reads."""
    run = impute(tmp_path, method="fedhf")
    saved = SavedImputer.load(run / "model")
    (tmp_path / "new").mkdir()
    rows = pd.read_csv(client_files(tmp_path / "new", seed=7)[1])  # new rows of site1
    lacking, empty = rows.drop(columns=["x5"]), rows.assign(x5=np.nan)
    lacking.to_csv(tmp_path / "lacking.csv", index=False)
    empty.to_csv(tmp_path / "empty.csv", index=False)
    fills = [
        saved.fill(tmp_path / name, client="site1", id_column="id", label_column="label")
        for name in ("lacking.csv", "empty.csv")
    ]
    others = ["x2", "x3", "x4"]
    pd.testing.assert_frame_equal(fills[0].table[others], fills[1].table[others])
    assert "x5" not in fills[0].table.columns  # the table keeps the file's own columns
    assert fills[0].filled == int(lacking[others].isna().sum().sum()) > 0


def test_fill_refuses_a_file_without_the_id_column_it_was_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--id-column patient` on a file with no `patient` column was taken silently, and the
    filled table came out without ids though the user named their column."""
    run = impute(tmp_path, method="fed-mean")
    rows = tmp_path / "new" / "site0.csv"  # its rows without any id column
    rows.parent.mkdir()
    pd.read_csv(tmp_path / "site0.csv").drop(columns=["id"]).to_csv(rows, index=False)
    out = tmp_path / "out"
    argv = ["fill", "--model", str(run), "--out", str(out), "--client-file", str(rows)]
    err = fill_error([*argv, "--id-column", "patient"], capsys)
    assert f"{rows} must have the id column `patient` (--id-column)" in err
    assert not (out / "site0.csv").exists()
    assert main(argv) == 0  # no id column named: ids are optional
    # one column cannot be both (impute refuses the pair too)
    err = fill_error([*argv, "--id-column", "id", "--label-column", "id", "--overwrite"], capsys)
    assert "the id and label columns must differ. Found both 'id'." in err
