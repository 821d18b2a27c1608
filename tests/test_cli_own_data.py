"""Data as users have it, end to end through the CLI on files written here (issue 12, item 2):
ids and labels in named columns (text ids with leading zeros), categorical columns, missing
cells, party names, the alignment report, and `impute --save-imputed` feeding `train`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import secure_vfl.experiment
from secure_vfl.cli import main

CITIES = ("lyon", "nice", "paris")


def write_case(root: Path, *, n: int = 60, seed: int = 0) -> tuple[Path, Path, Path]:
    """A case whose alignment answer is known. Ids ``0001``..``0060`` (text, leading zeros) in
    column ``patient``, labels in ``outcome``; ``labels.csv`` also has ``0099``, which no party
    holds. ``Bank_A.csv`` (party name ``bank-a``) holds every labelled id plus ``x1`` and ``x2``
    (no label), with missing cells in ``income``; ``shop.csv`` holds the first 45 ids plus
    ``x1`` and ``x3`` (no label), with a categorical ``city``. Without a label: x1, x2, x3 (3
    distinct ids; x2 and x3 at one party only)."""
    rng = np.random.default_rng(seed)
    ids = [f"{i:04d}" for i in range(1, n + 1)]
    y = rng.integers(0, 2, size=n)
    income = rng.normal(size=n) + 2 * y
    income[rng.random(n) < 0.15] = np.nan
    bank = pd.DataFrame({"patient": ids, "income": income, "age": rng.normal(size=n) + y})
    bank = pd.concat(
        [bank, pd.DataFrame({"patient": ["x1", "x2"], "income": [0.1, 0.2], "age": [1.0, 2.0]})]
    )
    city = np.where(y == 1, "paris", rng.choice(["lyon", "nice"], size=n))
    shop = pd.DataFrame({"city": city, "spend": rng.normal(size=n) - y, "patient": ids})
    shop = pd.concat(
        [
            shop.iloc[:45],
            pd.DataFrame({"city": ["nice", "lyon"], "spend": [0.0, 1.0], "patient": ["x1", "x3"]}),
        ]
    )
    labels = pd.DataFrame(
        {"patient": [*ids, "0099"], "outcome": [*np.where(y, "ill", "well"), "ill"]}
    )
    paths = (root / "Bank_A.csv", root / "shop.csv", root / "labels.csv")
    for frame, path in zip((bank, shop, labels), paths, strict=True):
        frame.sample(frac=1.0, random_state=seed).to_csv(path, index=False)
    return paths


def train_argv(bank: Path, shop: Path, labels: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--method",
        "laser",
        "--epochs",
        "2",
        "--party-file",
        str(bank),
        "--party-file",
        str(shop),
        "--label-file",
        str(labels),
        "--id-column",
        "patient",
        "--label-column",
        "outcome",
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr(secure_vfl.experiment, "run_training", refuse)


def test_named_columns_categories_and_missing_cells_train_report_and_predict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bank, shop, labels = write_case(tmp_path)
    out = tmp_path / "run"
    assert main(train_argv(bank, shop, labels, out)) == 0
    summary = capsys.readouterr().out
    result = json.loads((out / "result.json").read_text())
    # The alignment report on the constructed case.
    report = result["alignment"]
    assert report["label_file"]["ids"] == 61
    assert report["parties"]["bank-a"] == {
        "file": str(bank),
        "ids": 62,
        "aligned": 60,
        "without_label": 2,
    }
    assert report["parties"]["shop"]["ids"] == 47 and report["parties"]["shop"]["aligned"] == 45
    assert report["samples"] == 60 and report["held_by_every_party"] == 45
    assert report["dropped"]["label_file_only"] == 1
    assert report["dropped"]["without_label"] == 3
    assert report["dropped"]["one_party_only_without_label"] == 2
    assert result["dropped"]["alignment_no_label"] == 4  # per party, as PSI would count
    assert (
        "61 labelled ids (label and test files); bank-a 62 (60 aligned), shop 47 (45 aligned)"
        in summary
    )
    assert "60 samples (45 held by every party)" in summary
    assert "3 party ids without a label, 2 of them at one party only" in summary
    # The class mapping (sorted label values), shown and kept.
    assert result["classes"] == {"0": "ill", "1": "well"}
    assert "classes (index = label value): 0 = ill, 1 = well" in summary
    # Names and the column report.
    assert result["parties"] == {"party-0": "bank-a", "party-1": "shop"}
    assert result["columns"]["shop"]["encoded"] == {"city": 3}
    assert result["columns"]["shop"]["inputs"] == 4  # 3 one-hot + spend
    assert result["columns"]["bank-a"]["indicators"] == ["income"]
    assert result["columns"]["bank-a"]["inputs"] == 3  # income, age, income:missing
    assert "shop: 2 columns -> 4 model inputs; one-hot: city (3 categories)" in summary
    assert "indicators for income" in summary
    manifest = json.loads((out / "model" / "manifest.json").read_text())
    assert [p["source"] for p in manifest["parties"]] == ["bank-a", "shop"]
    saved = json.loads((out / "model" / "party-1" / "preprocessing.json").read_text())
    assert saved["version"] == 3 and saved["id_column"] == "patient"
    assert saved["columns"][0] == {
        "name": "city",
        "kind": "categorical",
        "categories": list(CITIES),
    }
    [spend] = [column for column in saved["columns"] if column["name"] == "spend"]
    low, high = spend["range"]  # the training rows' own, which the party keeps
    assert spend["kind"] == "numeric" and low < high

    # New rows: a missing cell, an unseen city, ids with leading zeros under `patient`.
    new = tmp_path / "new"
    new.mkdir()
    pd.DataFrame({"patient": ["0101", "0102"], "income": [np.nan, 1.0], "age": [0.5, -0.5]}).to_csv(
        new / "Bank_A.csv", index=False
    )
    pd.DataFrame({"patient": ["0101"], "city": ["oslo"], "spend": [0.3]}).to_csv(
        new / "shop.csv", index=False
    )
    predictions = tmp_path / "predictions.csv"
    argv = ["predict", "--model", str(out), "--party-file", str(new / "Bank_A.csv")]
    argv += ["--party-file", str(new / "shop.csv"), "--out", str(predictions)]
    assert main([*argv, "--label-column", "expected"]) == 0
    captured = capsys.readouterr()
    assert "rows held: bank-a 2, shop 1" in captured.out
    assert (
        "warning:" in captured.err and "column 'city'" in captured.err and "'oslo'" in captured.err
    )
    frame = pd.read_csv(predictions, dtype={"patient": str})
    assert list(frame.columns[:2]) == ["patient", "expected"]
    assert frame["patient"].tolist() == ["0101", "0102"]
    assert set(frame["expected"]) <= {"ill", "well"}


def test_ids_compared_as_text_name_both_files_and_an_example_of_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_training: None
) -> None:
    bank, shop, labels = write_case(tmp_path)
    frame = pd.read_csv(shop, dtype={"patient": str})
    frame["patient"] = frame["patient"].str.lstrip("0")  # 0304 -> 304
    frame.to_csv(shop, index=False)
    err = refused(train_argv(bank, shop, labels, tmp_path / "r"), capsys)
    assert f"no ids matched between party file {shop} and label file {labels}" in err
    assert "compared as the text in the files" in err
    assert "in the party file" in err and "in the label file" in err


def test_missing_cells_refused_on_request_and_an_empty_column_always(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_training: None
) -> None:
    bank, shop, labels = write_case(tmp_path)
    err = refused(
        train_argv(bank, shop, labels, tmp_path / "r", "--missing-cells", "refuse"), capsys
    )
    assert "features must not be missing under --missing-cells refuse" in err
    assert "columns ['income']" in err and "Bank_A.csv (bank-a)" in err
    frame = pd.read_csv(shop, dtype={"patient": str})
    frame["notes"] = np.nan
    frame.to_csv(shop, index=False)
    err = refused(train_argv(bank, shop, labels, tmp_path / "r"), capsys)
    assert "column 'notes' is empty in every training row" in err
    assert not (tmp_path / "r").exists()


def test_party_names_given_are_shown_in_result_json_the_summary_runs_compare_and_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bank, shop, labels = write_case(tmp_path)
    out = tmp_path / "named"
    extra = ["--party-name", "North Bank", "--party-name", "south", "--dp-gradients", "1:0.05"]
    assert main(train_argv(bank, shop, labels, out, *extra)) == 0
    summary = capsys.readouterr().out
    result = json.loads((out / "result.json").read_text())
    assert result["parties"] == {"party-0": "north-bank", "party-1": "south"}
    assert set(result["privacy"]["epsilon"]) <= {"north-bank", "south"}
    assert result["privacy"]["epsilon"]  # DP ran and its spend is keyed by the users' names
    assert not re.search(r"party-\d", json.dumps([result["privacy"], result["traffic"]]))
    assert "north-bank 62 (60 aligned)" in summary and "epsilon" in summary
    assert main(["runs", "compare", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].rstrip().endswith("parties") and table[1].endswith("north-bank, south")
    assert main(["runs", "list", "--store", str(tmp_path / "results.sqlite")]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].rstrip().endswith("parties") and listed[1].endswith("north-bank, south")
    err = refused(train_argv(bank, shop, labels, tmp_path / "r", "--party-name", "one"), capsys)
    assert "one --party-name per --party-file expected (2); found 1" in err
    dataset = ["train", "--method", "laser", "--dataset", "digits", "--out", str(tmp_path / "d")]
    err = refused([*dataset, "--party-name", "a", "--id-column", "key"], capsys)
    assert "--party-name, --id-column apply to --party-file" in err
    err = refused([*dataset, "--label-column", "label"], capsys)  # even spelt as the default
    assert "--label-column applies to --party-file" in err


def test_impute_save_imputed_keeps_ids_and_order_and_feeds_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bank, shop, labels = write_case(tmp_path)
    # Three clients' files of the same people: ids first or last, a label column kept aside.
    frame = pd.read_csv(bank, dtype={"patient": str})
    third = tmp_path / "third.csv"
    third_frame = pd.DataFrame(
        {
            "patient": frame["patient"],
            "income": frame["income"].fillna(0.0) * 2.0,
            "age": frame["age"].where(np.arange(len(frame)) % 7 != 0),
            "outcome": np.arange(len(frame)),
        }
    )
    third_frame.to_csv(third, index=False)
    numeric_shop = tmp_path / "shop_numbers.csv"
    shop_frame = pd.read_csv(shop, dtype={"patient": str}).drop(columns="city")
    shop_frame.loc[::5, "spend"] = np.nan
    shop_frame.to_csv(numeric_shop, index=False)
    out = tmp_path / "impute"
    argv = ["impute", "--method", "mean", "--out", str(out), "--save-imputed", "--quiet"]
    argv += ["--id-column", "patient", "--label-column", "outcome"]
    for path in (bank, numeric_shop, third):
        argv += ["--client-file", str(path)]
    assert main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["clients"] == 3  # the files given, not the dataset default of 4
    # Features income, age, spend: bank and third hold 2 of 3, the shop 1 of 3.
    assert result["config"]["availability"] == pytest.approx((2 + 1 + 2) / 9)
    for source, original in ((bank, frame), (numeric_shop, shop_frame), (third, third_frame)):
        imputed = pd.read_csv(out / "imputed" / f"{source.stem}.csv", dtype={"patient": str})
        assert imputed.columns[0] == "patient"
        assert imputed["patient"].tolist() == original["patient"].tolist()  # input order
        assert sorted(imputed.columns) == sorted(original.columns)
        assert not imputed.drop(columns="patient").isna().any().any()
        for column in original.columns.drop("patient"):
            known = original[column].notna()
            np.testing.assert_allclose(
                imputed.loc[known, column].to_numpy(float),
                original.loc[known, column].to_numpy(float),
            )
    capsys.readouterr()
    imputed_bank = out / "imputed" / "Bank_A.csv"
    imputed_shop = out / "imputed" / "shop_numbers.csv"
    run = tmp_path / "run"
    assert (
        main(train_argv(imputed_bank, imputed_shop, labels, run, "--missing-cells", "refuse")) == 0
    )
    trained = json.loads((run / "result.json").read_text())
    assert trained["alignment"]["samples"] == 60


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """`secure-vfl ... | head`: the reader is gone before anything is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    for argv in (["--help"], ["datasets"]):
        completed = subprocess.run(
            [sys.executable, "-m", "secure_vfl", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )
        assert completed.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored"
        # argparse swallows the error of its own help; a command stops as if by SIGPIPE.
        assert completed.returncode == (0 if argv == ["--help"] else 141)
    os.close(write_end)


def test_readme_commands_for_data_as_users_have_it_run(tmp_path: Path) -> None:
    """docs/own-data.md's commands, as written (2 epochs)."""
    import shlex

    root = Path(__file__).resolve().parents[1]
    section = (root / "docs" / "own-data.md").read_text(encoding="utf-8")
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [
        line
        for line in block.replace("\\\n", " ").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert len(commands) == 3
    outputs = []
    for command in commands:
        argv = shlex.split(command.replace("--epochs 10", "--epochs 2"))
        if argv[0] == ".venv/bin/python":
            argv = [sys.executable, str(root / argv[1]), *argv[2:]]
        else:
            assert argv[0] == ".venv/bin/secure-vfl"
            argv = [sys.executable, "-m", "secure_vfl", *argv[1:]]
        env = {**os.environ, "PYTHONPATH": str(root)}
        completed = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env)
        assert completed.returncode == 0, completed.stderr
        outputs.append(completed)
    assert (
        "bank: 10 columns -> 12 model inputs; one-hot: segment (3 categories)" in outputs[1].stdout
    )
    assert "retailer: 10 columns -> 20 model inputs" in outputs[1].stdout
    assert "column 'segment'" in outputs[2].stderr and "'vip'" in outputs[2].stderr
    frame = pd.read_csv(tmp_path / "runs" / "messy" / "predictions.csv", dtype={"customer": str})
    assert len(frame) == 109 and list(frame.columns[:2]) == ["customer", "predicted"]
    assert set(frame["predicted"]) <= {"benign", "malignant"}


def test_version_comes_from_the_package_metadata_or_the_source_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tomllib
    from importlib import metadata

    import secure_vfl

    root = Path(__file__).resolve().parents[1]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert secure_vfl.__version__ == metadata.version("secure-vfl")

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert secure_vfl._version() == declared


def test_under_psi_the_report_counts_ids_without_a_label_per_party_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bank, shop, labels = write_case(tmp_path)
    out = tmp_path / "psi"
    assert main(train_argv(bank, shop, labels, out, "--align", "psi")) == 0
    summary = capsys.readouterr().out
    report = json.loads((out / "result.json").read_text())["alignment"]
    assert report["samples"] == 60 and report["held_by_every_party"] == 45
    assert report["dropped"]["label_file_only"] == 1
    # PSI tells no party which of another's ids are the same: no distinct counts.
    assert report["dropped"]["without_label"] is None
    assert report["dropped"]["one_party_only_without_label"] is None
    assert report["dropped"]["without_label_per_party"] == {"bank-a": 2, "shop": 2}
    assert "party ids without a label: bank-a 2, shop 2 (per party" in summary


def test_the_column_report_counts_one_column_in_the_singular() -> None:
    from secure_vfl.cli import _column_lines

    entry = {"columns": 1, "inputs": 1, "encoded": {}, "indicators": []}
    assert _column_lines({"shop": entry}) == ["columns:", "  shop: 1 column -> 1 model input"]


def test_the_python_api_result_is_the_cli_result_json_but_for_the_cli_own_entries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run_training(...).to_json()`` says what ``train`` writes to result.json (parties in
    the users' names, classes, columns, alignment, provenance, the privacy chosen): only the
    saved model's place is the CLI's own. Before, a library user's result lacked all but the
    figures, and its per-party figures were keyed by ``party-k``."""
    from protocols.privacy import PrivacyEngine, PrivacySpec
    from secure_vfl.experiment import TrainConfig, run_training
    from secure_vfl.methods import MethodConfig

    bank, shop, labels = write_case(tmp_path)
    out = tmp_path / "cli"
    named = ["--party-name", "North Bank", "--party-name", "south"]
    assert main(train_argv(bank, shop, labels, out, *named, "--dp-gradients", "1:0.05")) == 0
    capsys.readouterr()
    written = json.loads((out / "result.json").read_text())
    config = TrainConfig(
        method="laser",
        party_files=(bank, shop),
        label_file=labels,
        id_column="patient",
        label_column="outcome",
        party_names=("North Bank", "south"),
        test_missing=("mcar:0", "mcar:0.5"),
        method_config=MethodConfig(epochs=2),
    )
    spec = PrivacySpec(dp_gradients=(1.0, 0.05), seed=0)
    result = run_training(config, privacy=PrivacyEngine(spec)).to_json()
    assert set(written) - set(result) == {"model"}
    assert set(result) <= set(written)
    assert result["config"] == written["config"]
    for key in ("parties", "classes", "columns", "alignment", "provenance", "samples"):
        assert result[key] == written[key], key
    assert result["parties"] == {"party-0": "north-bank", "party-1": "south"}
    assert set(result["privacy"]["epsilon"]) == set(written["privacy"]["epsilon"])
    assert set(result["traffic"]["bytes"]) == set(written["traffic"]["bytes"])
    assert not re.search(r"party-\d", json.dumps([result["privacy"], result["traffic"]]))
    # An attack's record of its training is named as a whole later: in the actors' names.
    raw = run_training(config, privacy=PrivacyEngine(spec))
    assert "parties" not in raw.to_json(named=False)
    assert set(raw.to_json(named=False)["privacy"]["epsilon"]) == set(raw.parties)
