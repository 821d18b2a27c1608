"""Saved models and prediction on new rows, end to end on the user's own files.

Breast-cancer columns split across three organisations' CSVs (bank, retailer, insurer) with an
id column and text labels; a federation trains, every party saves its own part, and the loaded
federation predicts new rows by id, with every party's file or with one absent.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.datasets import load_breast_cancer

from secure_vfl.cli import main
from secure_vfl.data.party_files import PartyTable, read_party_file
from secure_vfl.errors import ConfigError, DataError, IntegrityError, RunWarning
from secure_vfl.experiment import TrainConfig, build_method, prepare_data
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parts import PART_INDEX, TRAINING_SAMPLES_FILE, TrainingSamples
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import Method, in_process_parties
from secure_vfl.saved_model import SavedModel, predict_tables, save_model

PARTIES = ("bank", "retailer", "insurer")


@dataclass(frozen=True)
class Files:
    """Training files, held-out labels and new rows (shuffled, some ids at some parties)."""

    root: Path
    train: tuple[Path, ...]
    labels: Path
    held_out: Path
    new: tuple[Path, ...]
    new_ids: np.ndarray
    held_out_ids: np.ndarray


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    """The files of ``examples/own_party_files.py`` (run as a script: nothing imports examples)."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("own-files")
    script = ROOT / "examples" / "own_party_files.py"
    subprocess.run([sys.executable, str(script), "--out", str(root)], check=True)
    new = tuple(root / "new" / f"{name}.csv" for name in PARTIES)
    held_out = pd.read_csv(root / "held_out.csv", dtype={"id": str})["id"].to_numpy(str)
    return Files(
        root=root,
        train=tuple(root / f"{name}.csv" for name in PARTIES),
        labels=root / "labels.csv",
        held_out=root / "held_out.csv",
        new=new,
        new_ids=np.sort(pd.read_csv(new[0], dtype={"id": str})["id"].to_numpy(str)),
        held_out_ids=np.sort(held_out),
    )


def _config(files: Files, method: str, **options: object) -> TrainConfig:
    return TrainConfig(
        method=method,
        party_files=files.train,
        label_file=files.labels,
        test_file=files.held_out,
        seed=0,
        method_config=MethodConfig(**{"epochs": 3, "lr": 0.1, "batch_size": 64, **options}),  # type: ignore[arg-type]
    )


def _train(files: Files, directory: Path, method: str, **options: object) -> tuple[Method, Channel]:
    """Train in memory, then let every party save its own part into ``directory``."""
    config = _config(files, method, **options)
    data = prepare_data(config)
    channel = Channel()
    trained = build_method(config, data, channel=channel)
    trained.fit()
    save_model(
        directory,
        in_process_parties(channel),
        method=config.method,
        seed=config.seed,
        method_config=config.method_config,
        false_vfl=config.false_vfl,
        data=data,
        sources=PARTIES,
    )
    return trained, channel


def _tables(
    paths: tuple[Path, ...], absent: str | None = None
) -> list[tuple[PartyTable, str] | None]:
    return [
        None if name == absent else (read_party_file(path), str(path))
        for name, path in zip(PARTIES, paths, strict=True)
    ]


@pytest.fixture(scope="module")
def laser(files: Files, tmp_path_factory: pytest.TempPathFactory) -> tuple[Method, Channel, Path]:
    directory = tmp_path_factory.mktemp("laser") / "model"
    method, channel = _train(files, directory, "laser")
    return method, channel, directory


@pytest.mark.parametrize("absent", [None, "insurer"])
def test_loaded_laser_predicts_new_rows_as_the_trained_federation(
    files: Files, laser: tuple[Method, Channel, Path], absent: str | None
) -> None:
    method, channel, directory = laser
    in_memory = predict_tables(method, channel, _tables(files.new, absent))
    loaded = SavedModel.load(directory)
    tables = {n: t for n, t in zip(PARTIES, _tables(files.new, absent), strict=True) if t}
    saved = loaded.predict(tables)
    np.testing.assert_array_equal(saved.ids, files.new_ids)
    np.testing.assert_array_equal(saved.ids, in_memory.ids)
    np.testing.assert_allclose(saved.probabilities, in_memory.probabilities, atol=1e-6)
    np.testing.assert_allclose(saved.probabilities.sum(axis=1), 1.0, atol=1e-5)
    # The availability is per row: the retailer lacks 10 ids; an absent file, every id.
    held = saved.mask.sum(axis=0)
    assert held.tolist() == [109, 99, 0 if absent else 109]
    assert set(saved.labels()) == {"benign", "malignant"}


def test_a_party_absent_changes_the_prediction_of_its_rows(
    files: Files, laser: tuple[Method, Channel, Path]
) -> None:
    loaded = SavedModel.load(laser[2])
    every = loaded.predict({n: t for n, t in zip(PARTIES, _tables(files.new), strict=True) if t})
    tables = _tables(files.new, "insurer")
    fewer = loaded.predict({n: t for n, t in zip(PARTIES, tables, strict=True) if t})
    assert np.abs(every.probabilities - fewer.probabilities).max() > 1e-3


def test_loaded_model_repeats_the_evaluation_on_the_held_out_ids(
    files: Files, laser: tuple[Method, Channel, Path]
) -> None:
    """Independent of the new-rows path: the held-out ids of --test-file as raw rows give the
    probabilities and classes that the trained federation evaluated them with."""
    method, _, directory = laser
    expected = method.predict_proba("mcar:0")
    expected_classes = method.predict("mcar:0")
    tables = {}
    for name, path in zip(PARTIES, files.train, strict=True):
        table = read_party_file(path)
        keep = np.isin(table.ids, files.held_out_ids)
        tables[name] = (table.subset(keep), str(path))
    saved = SavedModel.load(directory).predict(tables)
    np.testing.assert_array_equal(saved.ids, files.held_out_ids)
    np.testing.assert_allclose(saved.probabilities, expected, atol=1e-6)
    # heads='all': every head predicts from the same observed set; the mean agrees with them.
    agree = (expected_classes == expected_classes[:, :1]).all(axis=1)
    assert agree.mean() > 0.9
    assert (saved.probabilities.argmax(axis=1)[agree] == expected_classes[agree, 0]).all()


def test_predictions_are_keyed_by_id_whatever_the_row_order(
    files: Files, laser: tuple[Method, Channel, Path], tmp_path: Path
) -> None:
    loaded = SavedModel.load(laser[2])
    shuffled = loaded.predict({n: t for n, t in zip(PARTIES, _tables(files.new), strict=True) if t})
    # One id alone in each file: its probabilities must be its row of the shuffled prediction.
    target = files.new_ids[42]
    alone = {}
    for name, path in zip(PARTIES, files.new, strict=True):
        frame = pd.read_csv(path, dtype={"id": str})
        frame[frame["id"] == target].to_csv(tmp_path / f"{name}.csv", index=False)
        alone[name] = (read_party_file(tmp_path / f"{name}.csv"), name)
    single = loaded.predict(alone)
    assert single.ids.tolist() == [target]
    row = int(np.flatnonzero(shuffled.ids == target)[0])
    np.testing.assert_allclose(single.probabilities[0], shuffled.probabilities[row], atol=1e-6)
    other = int(np.flatnonzero(shuffled.ids != target)[0])
    assert not np.allclose(shuffled.probabilities[other], shuffled.probabilities[row])


def test_cli_train_saves_and_predict_writes_labels_in_the_files_own_values(
    files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    argv = ["train", "--method", "laser", "--label-file", str(files.labels)]
    for path in files.train:
        argv += ["--party-file", str(path)]
    argv += ["--test-file", str(files.held_out), "--epochs", "2", "--lr", "0.1", "--quiet"]
    assert main([*argv, "--out", str(run)]) == 0
    result = json.loads((run / "result.json").read_text())
    assert result["samples"]["mcar:0"] == len(files.held_out_ids)
    manifest = json.loads((run / "model" / "manifest.json").read_text())
    assert result["model"]["run_id"] == manifest["run_id"]
    assert [p["source"] for p in manifest["parties"]] == list(PARTIES)
    classes = json.loads((run / "model" / "party-0" / "classes.json").read_text())
    assert classes["classes"] == ["benign", "malignant"]
    out = tmp_path / "predictions.csv"
    predict = ["predict", "--model", str(run), "--out", str(out)]
    for path in files.new:
        predict += ["--party-file", str(path)]
    capsys.readouterr()
    assert main(predict) == 0
    assert "rows held: bank 109, retailer 99, insurer 109" in capsys.readouterr().out
    frame = pd.read_csv(out, dtype={"id": str})
    assert list(frame.columns) == ["id", "predicted", "p_benign", "p_malignant"]
    assert frame["id"].tolist() == files.new_ids.tolist()
    assert set(frame["predicted"]) <= {"benign", "malignant"}
    probabilities = frame[["p_benign", "p_malignant"]].to_numpy()
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    winner = np.where(probabilities[:, 0] >= probabilities[:, 1], "benign", "malignant")
    assert (frame["predicted"].to_numpy() == winner).all()
    # The same model from Python, with the insurer's file absent, names parties by file.
    assert main([*predict[:5], "--overwrite", "--party-file", f"bank={files.new[0]}"]) == 0
    assert pd.read_csv(out)["id"].size == 109


def test_numeric_labels_stay_numbers(files: Files, tmp_path: Path) -> None:
    labels = pd.read_csv(files.labels, dtype={"id": str})
    labels["label"] = np.where(labels["label"] == "benign", 2, 4)
    labels.to_csv(tmp_path / "labels.csv", index=False)
    held = pd.read_csv(files.held_out, dtype={"id": str})
    held["label"] = np.where(held["label"] == "benign", 2, 4)
    held.to_csv(tmp_path / "held.csv", index=False)
    argv = ["train", "--method", "local", "--label-file", str(tmp_path / "labels.csv")]
    for path in files.train:
        argv += ["--party-file", str(path)]
    argv += ["--test-file", str(tmp_path / "held.csv"), "--epochs", "1", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    out = tmp_path / "p.csv"
    argv = ["predict", "--model", str(tmp_path / "run"), "--out", str(out)]
    assert main([*argv, "--party-file", str(files.new[0])]) == 0
    frame = pd.read_csv(out)
    assert list(frame.columns) == ["id", "predicted", "p_2", "p_4"]
    assert set(frame["predicted"]) <= {2, 4}


def test_standard_vfl_refuses_an_absent_party_file_with_the_reason(
    files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _train(files, tmp_path / "model", "standard")
    loaded = SavedModel.load(tmp_path / "model")
    tables = {n: t for n, t in zip(PARTIES, _tables(files.new, "insurer"), strict=True) if t}
    with pytest.raises(ConfigError, match="trained only on samples that every party holds"):
        loaded.predict(tables)
    argv = ["predict", "--model", str(tmp_path), "--party-file", str(files.new[0])]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "retailer, insurer absent" in err
    # With every file, the ids some party lacks get no prediction (standard guesses there).
    every = loaded.predict({n: t for n, t in zip(PARTIES, _tables(files.new), strict=True) if t})
    assert sum(label is None for label in every.labels()) == 10


def _corrupt(directory: Path) -> Path:
    return next((directory / "party-1").glob("*bottom.safetensors"))


def test_a_tampered_or_missing_part_is_refused(
    files: Files, laser: tuple[Method, Channel, Path], tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(laser[2], copy)
    target = _corrupt(copy)
    data = bytearray(target.read_bytes())
    data[-30] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="does not match the SHA-256"):
        SavedModel.load(copy)
    target.unlink()
    with pytest.raises(IntegrityError, match="is missing"):
        SavedModel.load(copy)
    (copy / "manifest.json").write_text('{"schema": "secure-vfl/model-manifest"')
    with pytest.raises(DataError, match="JSON expected"):
        SavedModel.load(copy)
    (copy / "manifest.json").write_text('{"schema": "secure-vfl/model-manifest", "version": 9}')
    with pytest.raises(DataError, match="manifest version 1 or 2 expected"):
        SavedModel.load(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(DataError, match="no saved model"):
        SavedModel.load(copy)


def _set(manifest: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        manifest = manifest[key]
    manifest[path[-1]] = value


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("seed",), True, "`seed` of type int expected, found bool"),
        (("seed",), -1, "a seed in [0, 2**32) and num_classes in [2, 4096] expected"),
        # a traceback (OverflowError) from the generator it seeded
        (("seed",), 2**70, "a seed in [0, 2**32) and num_classes in [2, 4096] expected"),
        (("num_classes",), [2], "`num_classes` of type int expected, found list"),
        (("num_classes",), 1, "a seed in [0, 2**32) and num_classes in [2, 4096] expected"),
        # a huge count or shape: it allocated 512 GB and crashed with a traceback
        (("num_classes",), 10**12, "found 0 and 1000000000000"),
        (("method",), 3, "`method` of type str expected, found int"),
        (("run_id",), "../../x", "a run_id of 32 hex digits expected"),
        (("block_shapes", 0), [-1], "a block shape of 1 to 4 sizes >= 1, of at most 1048576"),
        (("block_shapes", 0), [1] * 65, "a block shape of 1 to 4 sizes >= 1, of at most"),
        (("block_shapes", 0), [10**9], "values in all, expected, found [1000000000]"),
        (("parties", 1, "name"), {"a": 1}, "`name` of type str expected, found dict"),
        (("parties", 1), "party-1", "a party entry (an object) expected"),
        # kind and roles were taken whatever they said
        (("kind",), "graph", "a data kind of tabular or image expected, found 'graph'"),
        (("parties", 0, "role"), "data party", "party entry 0 (party-0) is the label party"),
        (("parties", 1, "role"), "label party", "party entry 1 (party-1) is the data party"),
        # it loaded, then told the user to leave out a file it did not need
        (("parties", 0, "location"), "party", "the label party party-0: location 'here' expected"),
        # it said "MethodConfig.__init__() got an unexpected keyword argument 'zzz'"
        (("method_config", "zzz"), 1, "method_config names settings this version does not have"),
    ],
)
def test_a_malformed_manifest_is_refused_saying_what_was_expected(
    laser: tuple[Method, Channel, Path],
    tmp_path: Path,
    path: tuple[Any, ...],
    value: Any,
    message: str,
) -> None:
    """A manifest is the user's file: a value of the wrong type or range is a DataError naming
    the field, not a TypeError from deep inside the rebuilt method."""
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(laser[2], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    _set(manifest, path, value)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=re.escape(message)):
        SavedModel.load(copy)


def test_a_part_whose_preprocessing_disagrees_with_the_manifest_is_refused(
    laser: tuple[Method, Channel, Path], tmp_path: Path
) -> None:
    """A part whose preprocessing makes blocks of another shape than the manifest's (here one
    column fewer, its files' hashes in the manifest made to match) gave a RuntimeError from a
    matrix product ("mat1 and mat2 shapes cannot be multiplied") when it predicted."""
    import hashlib
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(laser[2], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = manifest["parties"][1]
    path = copy / entry["directory"] / "preprocessing.json"
    preprocessing = json.loads(path.read_text())
    missing, standardize = preprocessing["steps"]  # numeric columns, no indicators
    assert missing["indicators"] == [] and standardize["step"] == "standardize"
    preprocessing["columns"] = preprocessing["columns"][:-1]
    preprocessing["block_shape"] = [preprocessing["block_shape"][0] - 1]
    missing["fill"] = missing["fill"][:-1]
    for key in ("mean", "std"):
        standardize[key] = standardize[key][:-1]
    path.write_text(json.dumps(preprocessing))
    entry["files"]["preprocessing.json"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    shape = manifest["block_shapes"][1]
    with pytest.raises(
        IntegrityError,
        match=re.escape(
            f"its preprocessing makes blocks of shape [{shape[0] - 1}], the manifest's "
            f"block_shapes say {shape}"
        ),
    ):
        SavedModel.load(copy)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        # Each within its bounds; together 20 GB: it took 66 s and 20 GB before its refusal.
        (("method_config", "representation_dim"), 65536, "'net.4.weight' of shape [65536, "),
        (("block_shapes", 1), [2**20], "'net.0.weight' of shape [128, 1048576] expected"),
        (("method",), "combinatorial", "modules ['bottom', 'bottom/subset:0', "),
    ],
)
def test_a_manifest_that_asks_for_another_network_is_refused_before_it_is_built(
    laser: tuple[Method, Channel, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    path: tuple[Any, ...],
    value: Any,
    message: str,
) -> None:
    """The architecture a manifest describes is built first on torch's meta device and checked
    against the saved parts' shapes: one that does not fit is never built in memory."""
    import shutil

    from secure_vfl import saved_model

    copy = tmp_path / "model"
    shutil.copytree(laser[2], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    _set(manifest, path, value)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    built_on: list[str] = []
    rebuild = saved_model.rebuild_method

    def recording(*args: Any, **kwargs: Any) -> Any:
        built_on.append(torch.get_default_device().type)
        return rebuild(*args, **kwargs)

    monkeypatch.setattr(saved_model, "rebuild_method", recording)
    with pytest.raises(IntegrityError, match=re.escape(message)):
        SavedModel.load(copy)
    assert built_on == ["meta"]
    shutil.rmtree(copy)
    shutil.copytree(laser[2], copy)  # and the model as saved builds for real, once checked
    built_on.clear()
    SavedModel.load(copy)
    assert built_on == ["meta", "cpu"]


class _Payload:
    """Pickles to a call that would create a file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def test_a_part_with_a_pickle_payload_is_refused_without_running_it(
    files: Files, laser: tuple[Method, Channel, Path], tmp_path: Path
) -> None:
    """Even with the manifest's hash rewritten to match (whoever can write the directory can
    do both), the part is read as a tensor file, never unpickled: the payload never runs."""
    import hashlib
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(laser[2], copy)
    marker = tmp_path / "payload-ran"
    buffer = io.BytesIO()
    torch.save({"net.0.weight": _Payload(marker)}, buffer)
    target = _corrupt(copy)
    target.write_bytes(buffer.getvalue())
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["parties"][1]["files"][target.name] = hashlib.sha256(buffer.getvalue()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match=r"a secure-vfl tensor file .* expected; refused"):
        SavedModel.load(copy)
    assert not marker.exists()
    # The control: the same bytes unpickled without the restriction do run the payload.
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert marker.exists()
    assert pickle.HIGHEST_PROTOCOL >= 2


def test_a_part_index_of_an_earlier_version_or_malformed_is_refused(
    files: Files, laser: tuple[Method, Channel, Path], tmp_path: Path
) -> None:
    """A part of version 1 (its state dicts pickled by torch.save) is not read: the message
    names the version and what to do, even with the manifest's hash rewritten to match."""
    import hashlib
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(laser[2], copy)
    index = copy / "party-1" / PART_INDEX
    payload = json.loads(index.read_text())
    index.write_text(json.dumps({**payload, "version": 1}))
    manifest = json.loads((copy / "manifest.json").read_text())
    digest = hashlib.sha256(index.read_bytes()).hexdigest()
    manifest["parties"][1]["files"][PART_INDEX] = digest
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"version 2 expected .* found 1: saved by an earlier"):
        SavedModel.load(copy)
    # A part index naming its other files by anything but text is refused as malformed.
    index.write_text(json.dumps({**payload, "classes": 3}))
    manifest["parties"][1]["files"][PART_INDEX] = hashlib.sha256(index.read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="classes: a file name or null expected, found 3"):
        SavedModel.load(copy)


def test_wrong_columns_and_unknown_files_are_refused_in_one_line(
    files: Files,
    laser: tuple[Method, Channel, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = laser[2]
    frame = pd.read_csv(files.new[0], dtype={"id": str})
    renamed = frame.rename(columns={"mean radius": "radius"})
    renamed.to_csv(tmp_path / "bank.csv", index=False)
    cases = {
        "missing ['mean radius'] and unexpected ['radius']": [
            "--party-file",
            str(tmp_path / "bank.csv"),
        ],
        "unknown party file": ["--party-file", str(files.root / "labels.csv")],
        "unknown party 'shop'": ["--party-file", f"shop={files.new[0]}"],
        "two files for party bank": [
            "--party-file",
            str(files.new[0]),
            "--party-file",
            f"party-0={files.new[0]}",
        ],
    }
    for message, flags in cases.items():
        capsys.readouterr()
        assert main(["predict", "--model", str(run), *flags]) == 2, message
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    capsys.readouterr()
    assert main(["predict", "--model", str(tmp_path), "--party-file", str(files.new[0])]) == 2
    assert "no saved model" in capsys.readouterr().err
    existing = tmp_path / "exists.csv"
    existing.write_text("x\n")
    argv = ["predict", "--model", str(run), "--party-file", str(files.new[0])]
    assert main([*argv, "--out", str(existing)]) == 2
    assert existing.read_text() == "x\n"


def test_held_out_rows_by_fraction_or_file_and_their_refusals(
    files: Files, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["train", "--method", "local", "--label-file", str(files.labels), "--epochs", "1"]
    for path in files.train:
        base += ["--party-file", str(path)]
    base += ["--quiet", "--p-miss-test", "0"]
    assert main([*base, "--test-fraction", "0.5", "--out", str(tmp_path / "half")]) == 0
    samples = json.loads((tmp_path / "half" / "result.json").read_text())["samples"]
    assert samples == {"train": 190, "mcar:0": 190}
    assert main([*base, "--out", str(tmp_path / "default")]) == 0
    samples = json.loads((tmp_path / "default" / "result.json").read_text())["samples"]
    assert samples == {"train": 304, "mcar:0": 76}
    refused = {
        "not allowed with argument": [
            *base,
            "--test-fraction",
            "0.5",
            "--test-file",
            str(files.held_out),
        ],
        "a probability in (0, 1)": [*base, "--test-fraction", "1.5"],
        "must not be training ids": [*base, "--test-file", str(files.labels)],
    }
    for message, argv in refused.items():
        capsys.readouterr()
        assert _exit_code([*argv, "--out", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / "refused").exists()
    argv = ["train", "--method", "laser", "--dataset", "breast-cancer", "--test-fraction", "0.3"]
    assert _exit_code([*argv, "--out", str(tmp_path / "dataset")]) == 2
    assert "`test_fraction` applies to party files" in capsys.readouterr().err


def _exit_code(argv: list[str]) -> int:
    """``main``'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exit:
        return int(exit.code or 0)


def test_a_registered_dataset_run_saves_a_model_that_predicts_from_named_columns(
    tmp_path: Path,
) -> None:
    argv = ["train", "--method", "laser", "--dataset", "breast-cancer", "--parties", "3"]
    assert main([*argv, "--epochs", "1", "--quiet", "--out", str(tmp_path / "run")]) == 0
    bunch = load_breast_cancer(as_frame=True)
    loaded = SavedModel.load(tmp_path / "run")
    assert loaded.party_names == ("party-0", "party-1", "party-2")
    tables = {}
    for k, columns in enumerate(np.array_split(np.array(bunch.data.columns), 3)):
        frame = bunch.data[list(columns)].iloc[:20].copy()
        frame.insert(0, "id", [f"r{i}" for i in range(20)])
        frame.to_csv(tmp_path / f"party-{k}.csv", index=False)
        tables[f"party-{k}"] = (read_party_file(tmp_path / f"party-{k}.csv"), f"party-{k}")
    predictions = loaded.predict(tables)
    assert predictions.classes == (0, 1)
    np.testing.assert_allclose(predictions.probabilities.sum(axis=1), 1.0, atol=1e-5)


def test_false_vfl_saves_its_label_model_and_predicts_with_a_party_absent(
    files: Files, tmp_path: Path
) -> None:
    _train(files, tmp_path / "model", "false-vfl-1", epochs=1)
    part = json.loads((tmp_path / "model" / "party-0" / "part.json").read_text())
    assert sorted(part["modules"]) == ["bottom", "label-model"]
    loaded = SavedModel.load(tmp_path / "model")
    tables = {n: t for n, t in zip(PARTIES, _tables(files.new, "retailer"), strict=True) if t}
    predictions = loaded.predict(tables)
    np.testing.assert_allclose(predictions.probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert predictions.mask[:, 1].sum() == 0
    # A row's prediction is a function of the row alone: the same on a second call, and with
    # only a few of the rows (it drew its latent samples after the rows before it, from one
    # generator: 0.45 and 0.34 for one row; a label flipped at fewer samples).
    again = loaded.predict(tables)
    np.testing.assert_array_equal(again.probabilities, predictions.probabilities)
    chosen = sorted(set.intersection(*(set(t.ids) for t, _ in tables.values())))[-5:]
    few = {}
    for name, (table, where) in tables.items():
        keep = np.isin(table.ids, chosen)
        few[name] = (PartyTable(table.name, table.ids[keep], table.frame[keep]), where)
    some = loaded.predict(few)
    assert sorted(some.ids) == chosen
    at = [list(predictions.ids).index(i) for i in some.ids]
    np.testing.assert_allclose(some.probabilities, predictions.probabilities[at], atol=1e-6)


def test_a_saved_false_vfl_2_model_predicts_a_row_from_the_row_alone(
    files: Files, tmp_path: Path
) -> None:
    """FALSE-VFL-II scores a block a row lacks by drawing it at the party that lacks it
    (x~): those draws came from the party's generator in row order, so a row some party
    lacks moved between calls and with the other rows (0.502 to 0.487 for one, its label
    flipped), after the label party's draws were shared."""
    _train(files, tmp_path / "model", "false-vfl-2", epochs=1)
    loaded = SavedModel.load(tmp_path / "model")
    tables = {n: t for n, t in zip(PARTIES, _tables(files.new, "retailer"), strict=True) if t}
    predictions = loaded.predict(tables)
    assert not predictions.mask[:, 1].any()  # every row lacks the retailer's block
    np.testing.assert_array_equal(loaded.predict(tables).probabilities, predictions.probabilities)
    chosen = sorted(set.intersection(*(set(t.ids) for t, _ in tables.values())))[:5]
    few = {}
    for name, (table, where) in tables.items():
        keep = np.isin(table.ids, chosen)
        few[name] = (PartyTable(table.name, table.ids[keep], table.frame[keep]), where)
    some = loaded.predict(few)
    at = [list(predictions.ids).index(i) for i in some.ids]
    np.testing.assert_allclose(some.probabilities, predictions.probabilities[at], atol=1e-6)


def test_a_false_vfl_model_in_memory_predicts_new_rows_as_its_saved_model(
    files: Files, tmp_path: Path
) -> None:
    """predict_tables on a trained FALSE-VFL still in memory drew each row's latent samples
    from the label party's generator, after the rows before it: its probabilities differed
    from the saved model's (by 0.31 here), between calls and with the other rows."""
    method, channel = _train(files, tmp_path / "model", "false-vfl-2", epochs=1)
    tables = _tables(files.new, "retailer")
    in_memory = predict_tables(method, channel, tables)
    saved = SavedModel.load(tmp_path / "model").predict(
        {n: t for n, t in zip(PARTIES, tables, strict=True) if t}
    )
    np.testing.assert_array_equal(in_memory.probabilities, saved.probabilities)
    again = predict_tables(method, channel, tables)
    np.testing.assert_array_equal(again.probabilities, in_memory.probabilities)
    chosen = in_memory.ids[:5]
    few = [None if t is None else (t[0].subset(np.isin(t[0].ids, chosen)), t[1]) for t in tables]
    some = predict_tables(method, channel, few)
    np.testing.assert_allclose(some.probabilities, in_memory.probabilities[:5], atol=1e-6)
    # Its test splits keep their per-row draws (as the papers evaluate).
    assert not method.shared_draws  # type: ignore[attr-defined]


def test_readme_commands_for_saved_models_run(tmp_path: Path) -> None:
    """docs/models.md's "Saved models and prediction" commands, as written (2 epochs)."""
    import shlex
    import subprocess
    import sys

    models = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    section = models.split("## Saved models and prediction", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [
        line
        for line in block.replace("\\\n", " ").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert len(commands) == 4
    outputs = []
    for command in commands:
        argv = shlex.split(command.replace("--epochs 10", "--epochs 2"))
        if argv[0] == ".venv/bin/python":
            argv = [sys.executable, str(ROOT / argv[1]), *argv[2:]]
        else:
            assert argv[0] == ".venv/bin/secure-vfl"
            argv = [sys.executable, "-m", "secure_vfl", *argv[1:]]
        completed = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True)
        assert completed.returncode == 0, completed.stderr
        outputs.append(completed.stdout)
    frame = pd.read_csv(tmp_path / "runs" / "mine" / "predictions.csv")
    assert len(frame) == 109 and set(frame["predicted"]) <= {"benign", "malignant"}
    assert "rows held: bank 109, retailer 99, insurer 0" in outputs[-1]


@pytest.fixture(scope="module")
def messy(files: Files, tmp_path_factory: pytest.TempPathFactory) -> Files:
    """The same files as users have them: the bank's first column binned into a categorical
    `segment` (text), about 10 % of the retailer's cells empty, in training and new rows; the
    new bank rows also show a segment training never saw."""
    root = tmp_path_factory.mktemp("messy")
    (root / "new").mkdir()
    rng = np.random.default_rng(5)
    for source, target in [
        *zip(files.train, (root / f"{name}.csv" for name in PARTIES), strict=True),
        *zip(files.new, (root / "new" / f"{name}.csv" for name in PARTIES), strict=True),
    ]:
        frame = pd.read_csv(source, dtype={"id": str})
        if source.stem == "bank":
            first = frame.columns[1]
            cut = pd.qcut(frame[first], 3, labels=["low", "mid", "high"]).astype(str)
            frame[first] = cut
            frame = frame.rename(columns={first: "segment"})
            if source.parent.name == "new":
                frame.loc[:4, "segment"] = "vip"
        if source.stem == "retailer":
            features = frame.columns[1:]
            frame[features] = frame[features].mask(rng.random((len(frame), len(features))) < 0.1)
        frame.to_csv(target, index=False)
    for name in ("labels.csv", "held_out.csv"):
        (root / name).write_bytes((files.root / name).read_bytes())
    return Files(
        root=root,
        train=tuple(root / f"{name}.csv" for name in PARTIES),
        labels=root / "labels.csv",
        held_out=root / "held_out.csv",
        new=tuple(root / "new" / f"{name}.csv" for name in PARTIES),
        new_ids=files.new_ids,
        held_out_ids=files.held_out_ids,
    )


@pytest.mark.parametrize("absent", [None, "insurer"])
def test_categorical_columns_and_missing_cells_predict_as_the_trained_federation(
    messy: Files, tmp_path: Path, absent: str | None
) -> None:
    directory = tmp_path / "model"
    method, channel = _train(messy, directory, "laser")
    bank = json.loads((directory / "party-0" / "preprocessing.json").read_text())
    retailer = json.loads((directory / "party-1" / "preprocessing.json").read_text())
    assert bank["columns"][0]["categories"] == ["high", "low", "mid"]
    assert retailer["steps"][0]["policy"] == "mean-indicator"
    assert len(retailer["steps"][0]["indicators"]) == 10  # every retailer column had a gap
    with pytest.warns(RunWarning, match="column 'segment' has 1 value"):
        in_memory = predict_tables(method, channel, _tables(messy.new, absent))
    tables = {n: t for n, t in zip(PARTIES, _tables(messy.new, absent), strict=True) if t}
    with pytest.warns(RunWarning, match="'vip'"):
        saved = SavedModel.load(directory).predict(tables)
    np.testing.assert_array_equal(saved.ids, messy.new_ids)
    np.testing.assert_allclose(saved.probabilities, in_memory.probabilities, atol=1e-6)
    assert not np.isnan(saved.probabilities).any()
    # The held-out ids as raw rows give what training evaluated them with: the same one-hot
    # encoding, the same filled cells and indicators, the same standardisation.
    held_out = {}
    for name, path in zip(PARTIES, messy.train, strict=True):
        table = read_party_file(path)
        held_out[name] = (table.subset(np.isin(table.ids, messy.held_out_ids)), str(path))
    repeated = SavedModel.load(directory).predict(held_out)
    np.testing.assert_allclose(repeated.probabilities, method.predict_proba("mcar:0"), atol=1e-6)


@pytest.mark.parametrize("name", ["laser", "standard"])
def test_a_method_predicts_once_trained_and_trains_once(files: Files, name: str) -> None:
    """Predicting before fit() gave an untrained model's labels without a word; a second fit()
    failed as a replay of round 0."""
    config = _config(files, name)
    channel = Channel()
    method = build_method(config, prepare_data(config), channel=channel)
    with pytest.raises(ConfigError, match=f"{name} has not been trained .new.: expected"):
        predict_tables(method, channel, _tables(files.new))
    method.fit()
    assert len(predict_tables(method, channel, _tables(files.new)).ids) == len(files.new_ids)
    with pytest.raises(ConfigError, match=r"fit\(\) was called on this method already .trained."):
        method.fit()


def _with_training_samples(source: Path, copy: Path, index: int, samples: TrainingSamples) -> Path:
    """The model at ``source`` copied to ``copy``, party ``index``'s part given ``samples``
    as a deployed label party saves them (its part index and the manifest's hashes
    rewritten to match, as whoever writes the directory can)."""
    import hashlib
    import shutil

    shutil.copytree(source, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = manifest["parties"][index]
    part = copy / entry["directory"]
    (part / TRAINING_SAMPLES_FILE).write_bytes(samples.to_bytes())
    payload = json.loads((part / PART_INDEX).read_text())
    (part / PART_INDEX).write_text(
        json.dumps({**payload, "training_samples": TRAINING_SAMPLES_FILE})
    )
    for name in (TRAINING_SAMPLES_FILE, PART_INDEX):
        entry["files"][name] = hashlib.sha256((part / name).read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_training_samples_kept_in_the_label_partys_part_are_matched_by_id_in_prediction(
    files: Files, tmp_path: Path
) -> None:
    """A deployed label party under secure sums keeps the samples it trained on (salted
    digests of their ids, and who held each); a prediction of those ids sums their parties by
    their training blocks (F29). Here on a model trained in one process under secure sums,
    its label party's part given such a record, and refused where it does not belong."""
    directory = tmp_path / "secure" / "model"
    _train(files, directory, "laser", heads="active", secure_sums=True)
    trained_ids = pd.read_csv(files.train[0], dtype={"id": str})["id"].to_numpy(str)[:50]
    mask = np.random.default_rng(0).random((50, 3)) < 0.8
    samples = TrainingSamples.of(trained_ids, mask)
    assert b"".join(value.encode() for value in trained_ids[:3]) not in samples.to_bytes()
    model = SavedModel.load(_with_training_samples(directory, tmp_path / "kept", 0, samples))
    tables = {n: t for n, t in zip(PARTIES, _tables(files.train), strict=True) if t}
    model.predict(tables)
    assert cast(Any, model.method).blocks.matched("predict") == 50
    # New ids: none of them was trained on.
    model.predict({n: t for n, t in zip(PARTIES, _tables(files.new), strict=True) if t})
    assert cast(Any, model.method).blocks.matched("predict") == 0
    # Digests match by the exact id and salt only.
    rows = samples.rows_of(
        np.array([trained_ids[7], "unknown", trained_ids[0], f"{trained_ids[0]} "])
    )
    assert rows.tolist() == [7, -1, 0, -1]
    again = TrainingSamples.from_bytes(samples.to_bytes(), "here")
    assert again.rows_of(trained_ids).tolist() == list(range(50))
    # Only the label party keeps them, over the manifest's parties.
    with pytest.raises(DataError, match="the label party's training samples over the manifest"):
        SavedModel.load(_with_training_samples(directory, tmp_path / "data-party", 1, samples))
    wrong = TrainingSamples.of(trained_ids, np.ones((50, 4), dtype=bool))
    with pytest.raises(DataError, match="3 parties expected, found 4 parties"):
        SavedModel.load(_with_training_samples(directory, tmp_path / "width", 0, wrong))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"digests": torch.zeros((2, 31), dtype=torch.uint8)}, r"digests of shape \(N, 32\)"),
        ({"mask": torch.ones((3, 3), dtype=torch.bool)}, "a \\(N, K\\) bool mask of 2 rows"),
        ({"mask": torch.ones((2, 3), dtype=torch.int64)}, "bool mask"),
        ({"digests": torch.zeros((2, 32), dtype=torch.uint8)}, "distinct digests"),
        ({"salt": torch.zeros(4, dtype=torch.uint8)}, "a salt of 16 bytes expected, found 4"),
        ({"salt": torch.zeros((2, 8), dtype=torch.uint8)}, "a 1-d uint8 salt"),
        ({"extra": torch.zeros(1)}, "tensors salt, digests and mask expected"),
    ],
)
def test_a_malformed_training_samples_file_is_refused_naming_it(
    change: dict[str, torch.Tensor], message: str
) -> None:
    from secure_vfl.tensor_file import dumps

    samples = TrainingSamples.of(np.array(["a", "b"]), np.ones((2, 3), dtype=bool))
    tree = {
        "salt": torch.frombuffer(bytearray(samples.salt), dtype=torch.uint8),
        "digests": torch.from_numpy(samples.digests),
        "mask": torch.from_numpy(samples.mask),
        **change,
    }
    with pytest.raises(DataError, match=f"part/training-samples: .*{message}"):
        TrainingSamples.from_bytes(dumps(tree), "part/training-samples")
