"""Saved models and `predict` given inputs they must refuse or handle: output column names that
collide, a model whose files agree with their hashes but not with each other, files the
manifest does not list, a model saved over another, and rows a method makes no prediction for.

Iris split by columns across a bank, a retailer and an insurer, ids in a `customer` column.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.datasets import load_iris

from secure_vfl.cli import main
from secure_vfl.data.party_files import PartyTable, read_party_file
from secure_vfl.deployment import ServedModel, _deployment
from secure_vfl.errors import ConfigError, DataError, IntegrityError, ProtocolError, RunWarning
from secure_vfl.saved_model import MANIFEST_FILE, MODEL_DIR, SavedModel, read_manifest
from secure_vfl.tensor_file import SUFFIX, dumps, loads

COLUMNS = {"bank": ["sl", "sw"], "retailer": ["pl"], "insurer": ["pw"]}
SPECIES = np.array(["setosa", "versicolor", "virginica"])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each party's file and one of its first 100 ids (`retailer-100.csv` ...), the labels as
    numbers (`labels.csv`) and as text (`species.csv`)."""
    root = tmp_path_factory.mktemp("iris-files")
    iris = load_iris()
    ids = [f"c{i:03d}" for i in range(len(iris.target))]
    features = dict(zip(["sl", "sw", "pl", "pw"], iris.data.T, strict=True))
    for party, columns in COLUMNS.items():
        frame = pd.DataFrame({"customer": ids, **{c: features[c] for c in columns}})
        frame.to_csv(root / f"{party}.csv", index=False)
        frame.iloc[:100].to_csv(root / f"{party}-100.csv", index=False)
    pd.DataFrame({"customer": ids, "label": iris.target}).to_csv(root / "labels.csv", index=False)
    text = pd.DataFrame({"customer": ids, "label": SPECIES[iris.target]})
    text.to_csv(root / "species.csv", index=False)
    return root


def train(
    files: Path, out: Path, method: str, labels: str, parties: tuple[str, ...], *flags: str
) -> Path:
    """`train` of ``parties``' files for one epoch into ``out``."""
    argv = ["train", "--method", method, "--label-file", str(files / labels), *flags]
    for party in parties:
        argv += ["--party-file", str(files / f"{party}.csv")]
    argv += ["--id-column", "customer", "--epochs", "1", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def laser(files: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LASER run of the bank and the retailer with text labels."""
    out = tmp_path_factory.mktemp("laser") / "run"
    return train(files, out, "laser", "species.csv", ("bank", "retailer"))


@pytest.fixture()
def copy(laser: Path, tmp_path: Path) -> Path:
    """A copy of the LASER run's model directory, to alter."""
    return Path(shutil.copytree(laser / MODEL_DIR, tmp_path / MODEL_DIR))


def tables(files: Path, retailer: str = "retailer") -> dict[str, Any]:
    paths = {"bank": files / "bank.csv", "retailer": files / f"{retailer}.csv"}
    return {n: (read_party_file(p, id_column="customer"), str(p)) for n, p in paths.items()}


def edit_manifest(model: Path, edit: Any) -> None:
    manifest = json.loads((model / MANIFEST_FILE).read_text())
    edit(manifest)
    (model / MANIFEST_FILE).write_text(json.dumps(manifest))


def rewrite_part_file(model: Path, party: int, name: str, content: str | bytes) -> None:
    """Rewrite a part's file and its hash in the manifest: a consistent model, if a wrong one."""
    path = model / f"party-{party}" / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    edit_manifest(model, lambda m: m["parties"][party]["files"].__setitem__(name, digest))


# -- the output's columns ------------------------------------------------------------------------


@pytest.mark.parametrize("label_column", ["customer", "p_setosa", ""])
def test_a_label_column_named_as_another_output_column_or_empty_is_refused(
    files: Path,
    laser: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    label_column: str,
) -> None:
    """The predicted label would replace the ids or a probability column, or go under an empty
    header: refused in the library (before any row is read: a file of the wrong columns is
    not looked at) and by `predict` (one line, exit 2, nothing written)."""
    out = tmp_path / "p.csv"
    argv = ["predict", "--model", str(laser), "--party-file", str(files / "bank.csv")]
    capsys.readouterr()
    try:  # an empty name is refused by the flag's own type, as argparse does (SystemExit)
        code = main([*argv, "--label-column", label_column, "--out", str(out)])
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert f"found {label_column!r}" in err and err.count("\n") == 1, err
    assert not out.exists()
    model = SavedModel.load(laser)
    message = re.escape("other than the output's other columns (customer, p_setosa, p_versicol")
    wrong = {"bank": tables(files)["retailer"]}  # the retailer's columns: the bank refuses them
    with pytest.raises(ConfigError, match=message):
        model.predict(wrong, label_column=label_column)
    predictions = model.predict(tables(files))
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(predictions, label_column=label_column)


def test_an_id_column_named_as_a_probability_column_is_refused(files: Path, laser: Path) -> None:
    predictions = SavedModel.load(laser).predict(tables(files))
    with pytest.raises(ConfigError, match="distinct, non-empty output column names expected"):
        dataclasses.replace(predictions, id_column="p_virginica")
    assert list(predictions.frame().columns) == [
        "customer", "predicted", "p_setosa", "p_versicolor", "p_virginica",
    ]  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"the id.s column: a column name \(str\) expected; found"
    ):
        SavedModel.load(laser).predict(tables(files), id_column=3)  # type: ignore[arg-type]


def test_predictions_write_to_a_path_given_as_text(
    files: Path, laser: Path, tmp_path: Path
) -> None:
    predictions = SavedModel.load(laser).predict(tables(files))
    predictions.write(str(tmp_path / "p.parquet"))
    assert pd.read_parquet(tmp_path / "p.parquet")["predicted"].tolist() == predictions.labels()


# -- tables built in Python ------------------------------------------------------------------------


def test_a_table_built_in_python_gets_the_checks_of_a_file(files: Path) -> None:
    """What read_party_file refuses in a file, PartyTable refuses when a user builds one from a
    DataFrame: the model would otherwise predict rows without that party's block, or fail deep
    in the wire codec on an infinite value."""
    bank = read_party_file(files / "bank.csv", id_column="customer")
    n = len(bank.ids)
    inf = bank.frame.copy()
    inf.iloc[0, 0] = np.inf
    # a column named twice crashed predict (TypeError from pandas)
    twice = pd.concat([bank.frame, bank.frame.iloc[:, :1]], axis=1)
    for ids, frame, expected in (
        (np.array(["a"] * n), bank.frame, "bank: ids must be unique. Found 1 repeated, e.g. 'a'"),
        (bank.ids, twice, "bank: column names must be distinct. Found ['sl'] repeated."),
        (bank.ids[:5], bank.frame, f"bank: one id per row expected, found 5 ids for {n} rows"),
        (np.array([""] * n), bank.frame, f"bank: every row must have an id. Found {n} empty"),
        (bank.ids, inf, "bank: column 'sl' must hold finite float32 values. Found 1 infinite"),
    ):
        with pytest.raises(DataError, match=re.escape(expected)):
            PartyTable(name="bank", ids=ids, frame=frame)
    for ids, frame, expected in (
        (list(bank.ids), bank.frame, "ids: a 1-d numpy array of str expected"),
        (np.array([np.nan] * n, dtype=object), bank.frame, "found ndarray dtype object"),
        (bank.ids, bank.frame.to_numpy(), "frame: a pandas DataFrame expected, found ndarray"),
    ):
        with pytest.raises(TypeError, match=re.escape(expected)):
            PartyTable(name="bank", ids=ids, frame=frame)  # type: ignore[arg-type]
    PartyTable(name="bank", ids=np.asarray(list(bank.ids), dtype=str), frame=bank.frame)
    with pytest.raises(ConfigError, match="a party table's name must be a non-empty str"):
        PartyTable(name=None, ids=bank.ids, frame=bank.frame)  # type: ignore[arg-type]


def test_a_table_without_rows_is_refused_by_predict_as_a_file_is(files: Path, laser: Path) -> None:
    """An empty table predicted nothing, in silence (a header-only file is refused)."""
    bank = read_party_file(files / "bank.csv", id_column="customer")
    empty = PartyTable(name="bank", ids=bank.ids[:0], frame=bank.frame.iloc[:0])
    with pytest.raises(DataError, match=r"^memory must have at least one row\. Found none\.$"):
        SavedModel.load(laser).predict({"bank": (empty, "memory")})


def test_predict_wants_a_table_and_its_path_per_party_and_each_party_once(
    files: Path, laser: Path
) -> None:
    model = SavedModel.load(laser)
    given = tables(files)
    bank, path = given["bank"]
    for wrong in (bank.frame, bank, (bank.frame, path)):
        with pytest.raises(TypeError, match="bank: a \\(PartyTable, path\\) pair expected"):
            model.predict({**given, "bank": wrong})
    with pytest.raises(ConfigError, match="one table per party expected, found two for bank"):
        model.predict({**given, "party-0": given["bank"]})
    with pytest.raises(
        TypeError, match=r"a mapping of party name -> \(PartyTable, path\) expected"
    ):
        model.predict([given["bank"]])  # type: ignore[arg-type]
    assert len(model.predict(given).ids) == len(bank.ids)
    # the model named by its manifest file, as by its directory
    by_file = SavedModel.load(laser / MODEL_DIR / MANIFEST_FILE).predict(given)
    np.testing.assert_array_equal(by_file.probabilities, model.predict(given).probabilities)


def test_one_table_given_for_two_parties_is_refused_as_train_refuses_it(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two parties whose columns share names (north and south each measure `v`): one file
    given for both, or a copy of it, was predicted from without a word, one party's rows read
    as the other's."""
    frame = pd.read_csv(files / "bank.csv")
    for name, column in (("north", "sl"), ("south", "sw")):
        frame[["customer", column]].rename(columns={column: "v"}).to_csv(
            tmp_path / f"{name}.csv", index=False
        )
    run = tmp_path / "run"
    argv = ["train", "--method", "laser", "--label-file", str(files / "species.csv")]
    argv += [
        "--party-file",
        str(tmp_path / "north.csv"),
        "--party-file",
        str(tmp_path / "south.csv"),
    ]
    assert (
        main([*argv, "--id-column", "customer", "--epochs", "1", "--quiet", "--out", str(run)]) == 0
    )
    north = tmp_path / "north.csv"
    (tmp_path / "copy").mkdir()
    copied = Path(shutil.copy(north, tmp_path / "copy" / "south.csv"))
    for south in (f"south={north}", str(copied)):
        argv = ["predict", "--model", str(run), "--party-file", str(north), "--party-file", south]
        assert main([*argv, "--out", str(tmp_path / "p.csv")]) == 2
        err = capsys.readouterr().err
        said = f"{north} (north) and {south.removeprefix('south=')} (south) hold the same table"
        assert f"{said} (same ids, columns and values); expected each party's own file." in err
        assert not (tmp_path / "p.csv").exists()
    model = SavedModel.load(run)
    table = read_party_file(north, id_column="customer")
    with pytest.raises(DataError, match="hold the same table"):
        model.predict({"north": (table, str(north)), "south": (table, str(north))})
    south = tmp_path / "south.csv"
    given = {name: (read_party_file(path, id_column="customer"), str(path)) for name, path in
             (("north", north), ("south", south))}  # fmt: skip
    assert len(model.predict(given).ids) == len(table.ids)  # their own files: predicted


# -- rows a method makes no prediction for -------------------------------------------------------


def test_rows_a_method_cannot_predict_are_left_empty_and_labels_keep_their_type(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Standard VFL makes no prediction for the 50 ids the retailer lacks (NaN probabilities);
    the others' labels stay the label file's integers (`0`, not `0.0`), and the 50 cells are
    empty. LASER, the control, predicts every row from the blocks present."""
    run = train(files, tmp_path / "standard", "standard", "labels.csv", ("bank", "retailer"))
    predictions = SavedModel.load(run).predict(tables(files, "retailer-100"))
    assert sum(label is None for label in predictions.labels()) == 50
    assert np.isnan(predictions.probabilities[~predictions.mask.all(axis=1)]).all()
    assert str(predictions.frame()["predicted"].dtype) == "Int64"
    out = tmp_path / "p.csv"
    argv = ["predict", "--model", str(run), "--party-file", str(files / "bank.csv")]
    argv += ["--party-file", f"retailer={files / 'retailer-100.csv'}", "--out", str(out)]
    assert main(argv) == 0
    written = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert set(written["predicted"][:100]) <= {"0", "1", "2"}
    assert (written["predicted"][100:] == "").all() and (written["p_0"][100:] == "").all()
    laser = train(files, tmp_path / "laser", "laser", "labels.csv", ("bank", "retailer"))
    every = SavedModel.load(laser).predict(tables(files, "retailer-100"))
    assert all(label is not None for label in every.labels())


def test_the_summary_of_one_row_left_unpredicted_says_row() -> None:
    """`predict` on a file of one row said "2 rows" rightly but "1 rows" and "no prediction
    for 1 rows" for one."""
    from types import SimpleNamespace

    from secure_vfl.cli import _prediction_summary

    manifest = SimpleNamespace(method="standard", run_id="0123456789abcdef", parties=["a", "b"])
    predictions = SimpleNamespace(
        ids=np.array(["x"]), mask=np.array([[True, False]]), parties=["a", "b"],
        classes=[0, 1], labels=lambda: [None],
    )  # fmt: skip
    text = _prediction_summary(SimpleNamespace(manifest=manifest), predictions, Path("p.csv"))
    assert "(2 parties): 1 row\n" in text and "no prediction for 1 row (" in text


# -- what the model directory holds ---------------------------------------------------------------


@pytest.mark.parametrize(
    "classes", [["a", "b", "c", "d"], ["setosa", "versicolor"], ["setosa", 1, "1"]]
)
def test_class_values_that_disagree_with_num_classes_are_refused_naming_the_file(
    copy: Path, classes: list[Any]
) -> None:
    """classes.json rewritten with its hash: 4 values in a 3-class model would index past the
    probabilities, 2 would silently drop a class, and 1 beside '1' would share a column."""
    path = copy / "party-0" / "classes.json"
    payload = {**json.loads(path.read_text()), "classes": classes}
    rewrite_part_file(copy, 0, "classes.json", json.dumps(payload))
    with pytest.raises(DataError, match=re.escape(f"{path}: 3 class values, distinct as text")):
        SavedModel.load(copy)


@pytest.mark.parametrize(
    "stray", ["party-0/evil.txt", "party-0/02-x.safetensors", "notes.txt", "empty/", "party-1/d/"]
)
def test_a_file_or_directory_the_manifest_does_not_list_is_refused_by_name(
    copy: Path, stray: str
) -> None:
    path = copy / stray
    if stray.endswith("/"):
        path.mkdir()
    else:
        path.write_text("x")
    with pytest.raises(IntegrityError, match=re.escape(f"{path} is not listed")):
        SavedModel.load(copy)


def test_a_listed_file_replaced_by_a_directory_is_named_as_listed(copy: Path) -> None:
    """It was refused as "not listed in the manifest", which lists it."""
    path = copy / "party-1" / "part.json"
    path.unlink()
    path.mkdir()
    with pytest.raises(IntegrityError, match=re.escape(f"{path}: the file the manifest lists")):
        SavedModel.load(copy)


def test_a_served_party_refuses_a_file_beside_its_part_that_the_manifest_does_not_list(
    files: Path, laser: Path, tmp_path: Path
) -> None:
    """No processes: a deployed data party's `predict-setup` with its part laid out as it keeps
    it (DIR/NAME/RUN_ID/) and one file more."""
    from secure_vfl.deployed_prediction import _predict_setup, build_predicting_party

    manifest, directory = read_manifest(laser)
    entry = manifest.parties[1]
    models = tmp_path / "models"
    part = Path(shutil.copytree(directory / entry.directory, models / entry.name / manifest.run_id))
    body = _predict_setup(manifest, 1, [e.name for e in manifest.parties], np.array([0, 1]))
    message = _deployment("party-0", entry.name, "predict-setup", body)
    table = read_party_file(files / "retailer.csv", id_column="customer")
    served = ServedModel(entry.name, models)
    build_predicting_party(entry.name, message, table, served, lambda _: None)
    (part / "evil.txt").write_text("x")
    with pytest.raises(ProtocolError, match=re.escape(f"{part / 'evil.txt'} is not listed")):
        build_predicting_party(entry.name, message, table, served, lambda _: None)


def test_a_model_saved_over_another_keeps_none_of_its_files(files: Path, tmp_path: Path) -> None:
    """Three parties, then two with --overwrite: no `party-2/` of the first survives, and no
    directory is left beside the model."""
    run = tmp_path / "run"
    train(files, run, "laser", "species.csv", ("bank", "retailer", "insurer"))
    assert (run / MODEL_DIR / "party-2").is_dir()
    train(files, run, "local", "labels.csv", ("bank", "retailer"), "--overwrite")
    assert sorted(p.name for p in (run / MODEL_DIR).iterdir()) == [
        MANIFEST_FILE, "party-0", "party-1",
    ]  # fmt: skip
    assert not [p for p in run.iterdir() if p.name.startswith(f".{MODEL_DIR}")]
    assert SavedModel.load(run).manifest.method == "local"


# -- what a refusal says -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.pop("method"), "(missing ['method'])"),
        (lambda m: m.update(foo=1), "unknown ['foo']"),
        (lambda m: m.pop("parties"), "missing ['parties']"),
        (lambda m: m["parties"][1].pop("role"), "party entry 1's keys"),
        (lambda m: m["parties"][1].update(bar=1), "unknown ['bar']"),
        # A schema that is not text was looked up among the model kinds: TypeError.
        (lambda m: m.update(schema=[m["schema"]]), "a 'secure-vfl/model-manifest' document"),
    ],
)
def test_a_manifest_with_a_missing_or_unknown_key_names_the_keys(
    copy: Path, edit: Any, message: str
) -> None:
    edit_manifest(copy, edit)
    with pytest.raises(DataError, match=re.escape(message)) as refused:
        SavedModel.load(copy)
    assert "expected" in str(refused.value) and "Error(" not in str(refused.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda m: m["block_shapes"].__setitem__(1, [2]),
            "retailer (party-1): the saved 'bottom' does not fit the architecture the manifest "
            "describes (its block_shapes and method_config): parameter 'net.0.weight' of shape "
            "[128, 2] expected, found [128, 1].",
        ),
        (
            lambda m: m["method_config"].__setitem__("representation_dim", 64),
            "bank (party-0): the saved 'bottom' does not fit the architecture the manifest "
            "describes (its block_shapes and method_config): parameter 'net.4.weight' of shape "
            "[64, 128] expected, found [128, 128].",
        ),
    ],
)
def test_a_part_that_does_not_fit_its_architecture_names_the_first_parameter(
    copy: Path, edit: Any, message: str
) -> None:
    edit_manifest(copy, edit)
    with pytest.raises(IntegrityError, match=re.escape(message)):
        SavedModel.load(copy)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.fill_(float("nan")), "of finite values expected, found NaN or infinite"),
        (lambda t: t.to(torch.float64), "of dtype torch.float32 expected, found torch.float64"),
    ],
)
def test_a_part_of_non_finite_or_other_typed_weights_is_refused_when_loaded(
    copy: Path, change: Any, message: str
) -> None:
    """Weights of NaN loaded, and predict failed later on "representation from party-1 (phase
    'predict'): ... finite values expected", naming no file; float64 weights were cast."""
    path = sorted((copy / "party-1").glob(f"*{SUFFIX}"))[0]  # its bottom model
    states = loads(path.read_bytes(), str(path))
    first = next(iter(states))
    states[first] = change(states[first])
    rewrite_part_file(copy, 1, path.name, dumps(states))
    with pytest.raises(IntegrityError, match=re.escape(message)):
        SavedModel.load(copy)


def test_an_altered_part_is_refused_naming_the_party_as_the_user_does(copy: Path) -> None:
    (copy / "party-1" / "preprocessing.json").write_text("{}")
    with pytest.raises(IntegrityError, match=r"^retailer \(party-1\): .* does not match the SHA"):
        SavedModel.load(copy)


def test_a_model_trained_under_secure_sums_says_which_blocks_it_left_out(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With one file of a block of other parties it predicted every row from the prior (the
    same probabilities for all), and with the label party's file it left that block out, in
    silence."""
    run = train(
        files,
        tmp_path / "secure",
        "laser",
        "species.csv",
        ("bank", "retailer", "insurer"),
        *["--heads", "active", "--secure-agg", "masks"],
    )
    predict = ["predict", "--model", str(run)]
    capsys.readouterr()
    assert main([*predict, "--party-file", str(files / "retailer.csv")]) == 0
    err = capsys.readouterr().err
    assert "whole blocks of other parties ({retailer, insurer})" in err, err
    assert "Left out: retailer (150 rows); 150 of 150 rows predicted from the prior" in err
    both = ["--party-file", str(files / "bank.csv"), "--party-file", str(files / "retailer.csv")]
    assert main([*predict, *both]) == 0
    assert "Left out: retailer (150 rows); 0 of 150 rows" in capsys.readouterr().err
    every = [*both, "--party-file", str(files / "insurer.csv")]
    assert main([*predict, *every]) == 0
    assert "secure sums" not in capsys.readouterr().err  # nothing left out: nothing said


def test_predict_refuses_an_out_in_the_model_or_on_its_input_and_writes_parquet(
    files: Path, laser: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out inside the model's directory made the model refuse to load afterwards; --out on an
    input file with --overwrite replaced the rows read; a .parquet name held CSV text."""
    source = tmp_path / "bank.csv"
    shutil.copy(files / "bank.csv", source)
    argv = ["predict", "--model", str(laser), "--party-file", str(source), "--id-column"]
    argv += ["customer"]
    assert main([*argv, "--out", str(laser / MODEL_DIR / "p.csv")]) == 2
    assert "is inside the model's directory" in capsys.readouterr().err
    # --model given as the manifest's path (a documented form): its directory is the model's
    by_manifest = [*argv[:1], "--model", str(laser / MODEL_DIR / "manifest.json"), *argv[3:]]
    assert main([*by_manifest, "--out", str(laser / MODEL_DIR / "p.csv")]) == 2
    assert "is inside the model's directory" in capsys.readouterr().err
    assert not (laser / MODEL_DIR / "p.csv").exists()
    assert main([*argv, "--out", str(source), "--overwrite"]) == 2
    assert f"is the input file {source}" in capsys.readouterr().err
    assert source.read_bytes() == (files / "bank.csv").read_bytes()
    assert main([*argv, "--out", str(tmp_path / "p.parquet")]) == 0
    assert main([*argv, "--out", str(tmp_path / "p.csv")]) == 0
    pd.testing.assert_frame_equal(
        pd.read_parquet(tmp_path / "p.parquet"),
        pd.read_csv(tmp_path / "p.csv"),
        check_dtype=False,
    )
    assert SavedModel.load(laser)  # still loads
    assert main([*argv, "--out", str(tmp_path / "p.xlsx")]) == 2  # it held CSV text
    assert "a .csv or .parquet file expected" in capsys.readouterr().err
    assert not (tmp_path / "p.xlsx").exists()
    with pytest.raises(SystemExit):  # a folder meant: it wrote the file p.csv
        main([*argv, "--out", str(tmp_path / "out.csv") + "/"])
    assert "ends with a separator (a directory)" in capsys.readouterr().err
    assert not (tmp_path / "out.csv").exists()


def test_predict_warns_of_rows_far_outside_the_training_range(
    files: Path, laser: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bank file in millimetres (the model was trained on centimetres) was predicted in
    silence; a cell of 3e38 (finite in float32) stopped predict with a message about a
    non-finite representation from party-0."""
    bank = pd.read_csv(files / "bank.csv").head(4)
    bank["sl"] = bank["sl"] * 10
    bank.loc[0, "sw"] = 40.0
    millimetres = tmp_path / "bank.csv"
    bank.to_csv(millimetres, index=False)
    argv = ["predict", "--model", str(laser), "--party-file", str(millimetres), "--id-column"]
    argv += ["customer", "--out"]
    assert main([*argv, str(tmp_path / "p.csv")]) == 0
    warned = capsys.readouterr().err
    assert f"warning: {millimetres} (bank): 4 of 4 rows hold values far outside" in warned
    assert "'sl' (training range [4.3, 7.7], found 46 to 51)" in warned
    assert "'sw' (training range [2, 4.4], found 40)" in warned
    assert len(pd.read_csv(tmp_path / "p.csv")) == 4  # predicted all the same
    bank.loc[0, "sw"] = 3e38
    bank.to_csv(millimetres, index=False)
    assert main([*argv, str(tmp_path / "q.csv"), "--overwrite"]) == 2
    refused = capsys.readouterr().err
    assert f"{millimetres} (bank): column 'sw' holds 3e+38, beyond float32's range" in refused
    assert not (tmp_path / "q.csv").exists()
    argv[argv.index(str(millimetres))] = str(files / "bank.csv")
    assert main([*argv, str(tmp_path / "q.csv")]) == 0
    assert "far outside" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--insecure"], "--insecure goes"),
        (["--wait", "5", "--deadline", "5"], "--wait, --deadline go"),
        (
            ["--name", "bank", "--align", "psi", "--secure-agg", "masks"],
            "--name, --align psi, --secure-agg masks go",
        ),
    ],
)
def test_predict_without_a_federation_refuses_its_flags_as_train_does(
    files: Path,
    laser: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    named: str,
) -> None:
    """--insecure, --wait and --deadline were ignored in one process, where `train` and
    `impute` refuse them."""
    out = tmp_path / "p.csv"
    argv = ["predict", "--model", str(laser), "--party-file", str(files / "bank.csv")]
    assert main([*argv, "--id-column", "customer", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{named} with --federation (a deployment); found no --federation." in err
    assert err.count("\n") == 1 and not out.exists()


def test_a_deployed_partys_part_not_copied_here_leaves_it_absent_and_its_file_refused(
    files: Path, copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The retailer's part kept at the retailer (a deployed run's manifest) and not copied: the
    model loads and predicts from the bank's block alone, as when the retailer's file is left
    out of a model that has every part; the retailer's file is refused, naming where its part
    lies. (`tests/test_deploy_model.py` does this with parts saved by real party processes.)"""
    whole = SavedModel.load(copy).predict({"bank": tables(files)["bank"]})
    edit_manifest(copy, lambda m: m["parties"][1].__setitem__("location", "party"))
    part = shutil.move(copy / "party-1", tmp_path / "retailer-part")
    model = SavedModel.load(copy)
    shutil.copytree(part, copy / "party-1")  # copied after loading: not in this model
    assert model.absent == {"retailer": "its part is kept by that party and was not copied here"}
    bank_only = model.predict({"bank": tables(files)["bank"]})
    np.testing.assert_allclose(bank_only.probabilities, whole.probabilities, rtol=0, atol=0)
    with pytest.raises(DataError, match=r"the part of retailer is kept by that party \(its"):
        model.predict(tables(files))
    shutil.rmtree(copy / "party-1")
    argv = ["predict", "--model", str(copy), "--party-file", str(files / "bank.csv")]
    assert main([*argv, "--out", str(tmp_path / "p.csv")]) == 0
    printed = capsys.readouterr().out
    assert "absent: retailer (its part is kept by that party and was not copied here)" in printed
    assert len(pd.read_csv(tmp_path / "p.csv")) == 150


def test_a_method_that_needs_every_block_refuses_a_deployed_part_not_copied_here(
    files: Path, tmp_path: Path
) -> None:
    run = train(files, tmp_path / "standard", "standard", "labels.csv", ("bank", "retailer"))
    edit_manifest(run / MODEL_DIR, lambda m: m["parties"][1].__setitem__("location", "party"))
    shutil.rmtree(run / MODEL_DIR / "party-1")
    with pytest.raises(DataError, match="standard predicts only with every party's block"):
        SavedModel.load(run)


def test_a_file_sharing_no_id_with_the_others_and_an_empty_column_are_named_in_warnings(
    files: Path, laser: Path, tmp_path: Path
) -> None:
    """The retailer's new ids written `C000` against the bank's `c000`: 4 rows for 2, each
    from one block, exit 0 and no word; a column empty in every row: filled in silence."""
    model = SavedModel.load(laser)
    retailer = pd.read_csv(files / "retailer.csv").head(2)
    retailer["customer"] = retailer["customer"].str.upper()
    shouting = tmp_path / "retailer.csv"
    retailer.to_csv(shouting, index=False)
    bank = pd.read_csv(files / "bank.csv").head(2)
    bank["sl"] = np.nan
    empty = tmp_path / "bank.csv"
    bank.to_csv(empty, index=False)
    given = {
        "bank": (read_party_file(empty, id_column="customer"), str(empty)),
        "retailer": (read_party_file(shouting, id_column="customer"), str(shouting)),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predictions = model.predict(given)
    messages = [str(w.message) for w in caught]
    assert len(predictions.ids) == 4
    assert any(
        f"{shouting} (retailer) shares no id with the other parties' (e.g. 'C000' there, "
        f"'c000' in {empty} (bank))" in m
        for m in messages
    ), messages
    assert any("column(s) 'sl' empty in every one of its 2 rows" in m for m in messages)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.predict(tables(files))
    assert not [w for w in caught if "shares no id" in str(w.message)]


def test_ids_written_otherwise_in_some_rows_of_one_file_are_named_in_a_warning(
    files: Path, laser: Path, tmp_path: Path
) -> None:
    """A third of the retailer's new ids with a trailing space: 67 rows for 50, each of those
    predicted from one block, exit 0 and no word (only a file sharing no id warned)."""
    retailer = pd.read_csv(files / "retailer.csv").head(30)
    retailer["customer"] = [f"{c} " if i % 3 == 0 else c for i, c in enumerate(retailer.customer)]
    spaced = tmp_path / "retailer.csv"
    retailer.to_csv(spaced, index=False)
    given = {**tables(files), "retailer": (read_party_file(spaced, id_column="customer"), "r")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SavedModel.load(laser).predict(given)
    messages = [str(w.message) for w in caught if issubclass(w.category, RunWarning)]
    # Both sides read as the other's: each file is named.
    assert any(
        m.startswith("r (retailer): 10 of its ids read as ids of the other") for m in messages
    )
    assert any("(bank): 10 of its ids read as ids of the other" in m for m in messages)
