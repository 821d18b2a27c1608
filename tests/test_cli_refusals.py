"""Mistakes a new user makes with their own files are refused in one line with exit 2 before
any training (issue 12, item 3), or reported as documented (warnings, dropped counts)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import secure_vfl.experiment
from secure_vfl.cli import main


def write_own_files(root: Path, *, n: int = 120, parties: int = 3, seed: int = 0) -> list[Path]:
    """``parties`` party files (two features each, ids ``id0000``..) and ``labels.csv``;
    returns the party files then the label file."""
    rng = np.random.default_rng(seed)
    ids = np.array([f"id{i:04d}" for i in range(n)])
    y = rng.integers(0, 2, size=n)
    x = rng.normal(size=(n, 2 * parties)) + y[:, None]
    paths = []
    for k in range(parties):
        frame = pd.DataFrame({"id": ids, f"a{k}": x[:, 2 * k], f"b{k}": x[:, 2 * k + 1]})
        path = root / f"party{k}.csv"
        frame.to_csv(path, index=False)
        paths.append(path)
    labels = root / "labels.csv"
    pd.DataFrame({"id": ids, "label": np.where(y == 1, "yes", "no")}).to_csv(labels, index=False)
    return [*paths, labels]


def own_argv(parties: list[Path], labels: Path, out: Path, *extra: str) -> list[str]:
    argv = ["train", "--method", "laser", "--epochs", "1", "--label-file", str(labels)]
    for path in parties:
        argv += ["--party-file", str(path)]
    return [*argv, "--out", str(out), "--quiet", *extra]


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if training starts: every refusal here must come before it."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr(secure_vfl.experiment, "run_training", refuse)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``argv``; assert exit 2 and a one-line message; return it."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.usefixtures("no_training")
def test_the_same_party_file_twice_or_a_copy_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    *parties, labels = write_own_files(tmp_path)
    twice = refused(own_argv([parties[0], parties[0]], labels, tmp_path / "r"), capsys)
    assert "party0.csv is given twice; expected one file per party" in twice
    copy = tmp_path / "copy.csv"
    shutil.copy(parties[1], copy)
    err = refused(own_argv([parties[0], parties[1], copy], labels, tmp_path / "r"), capsys)
    assert "party1.csv and " in err and "copy.csv hold the same table" in err
    assert not (tmp_path / "r").exists() and not (tmp_path / "results.sqlite").exists()


@pytest.mark.usefixtures("no_training")
def test_the_label_file_given_as_a_party_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    *parties, labels = write_own_files(tmp_path)
    numeric = tmp_path / "numeric_labels.csv"
    frame = pd.read_csv(labels)
    frame.assign(label=(frame["label"] == "yes").astype(int)).to_csv(numeric, index=False)
    err = refused(own_argv([parties[0], numeric], numeric, tmp_path / "r"), capsys)
    assert "has a `label` column" in err and "numeric_labels.csv" in err


@pytest.mark.usefixtures("no_training")
def test_a_party_column_equal_to_the_label_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    *parties, labels = write_own_files(tmp_path)
    # The label recoded (yes -> 7, no -> 3) under another name, rows in another order.
    leaky = pd.read_csv(parties[1])
    label = pd.read_csv(labels).set_index("id")["label"]
    leaky["outcome"] = np.where(label.loc[leaky["id"]].to_numpy() == "yes", 7.0, 3.0)
    leaky.sample(frac=1.0, random_state=1).to_csv(parties[1], index=False)
    err = refused(own_argv(parties, labels, tmp_path / "r"), capsys)
    assert "party1.csv: column 'outcome' equals the label" in err


def test_a_feature_that_merely_separates_the_classes_is_kept(tmp_path: Path) -> None:
    *parties, labels = write_own_files(tmp_path)
    frame = pd.read_csv(parties[0])
    y = (pd.read_csv(labels)["label"] == "yes").to_numpy()
    frame["strong"] = 10.0 * y + np.random.default_rng(3).random(len(frame))  # not one value
    frame.to_csv(parties[0], index=False)
    assert main(own_argv(parties, labels, tmp_path / "r")) == 0


@pytest.mark.usefixtures("no_training")
def test_parties_that_contradict_the_files_given_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    *parties, labels = write_own_files(tmp_path)
    err = refused(own_argv(parties, labels, tmp_path / "r", "--parties", "5"), capsys)
    assert "--parties 5 contradicts the 3 --party-file given" in err


def test_parties_equal_to_the_files_given_are_accepted(tmp_path: Path) -> None:
    *parties, labels = write_own_files(tmp_path)
    assert main(own_argv(parties, labels, tmp_path / "r", "--parties", "3")) == 0
    assert json.loads((tmp_path / "r" / "result.json").read_text())["config"]["parties"] == 3


@pytest.mark.parametrize("command", ["train", "impute"])
def test_deployment_flags_without_a_federation_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    run = ["--method", "laser", "--dataset", "wine"] if command == "train" else []
    run = run or ["--method", "mean", "--dataset", "airquality"]
    argv = [command, *run, "--out", str(tmp_path / "o")]
    for flags, named in (
        (["--name", "bank", "--insecure"], "--name, --insecure go"),
        (["--wait", "5"], "--wait goes"),
        (["--deadline", "5"], "--deadline goes"),
    ):
        err = refused([*argv, *flags], capsys)
        assert f"{named} with --federation (a deployment); found no --federation" in err
    assert not (tmp_path / "o").exists()


def test_parties_that_contradict_a_federation_name_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_deploy import write_federation

    from secure_vfl.federation.network import free_loopback_ports

    path = write_federation(tmp_path, tmp_path / "certs", free_loopback_ports(5))
    argv = ["train", "--federation", str(path), "--name", "bank", "--method", "laser"]
    err = refused([*argv, "--parties", "7", "--out", str(tmp_path / "o")], capsys)
    assert f"--parties 7 contradicts the 4 parties of {path}; expected --parties 4" in err
    assert "--party-file" not in err and not (tmp_path / "o").exists()


@pytest.mark.usefixtures("no_training")
def test_out_pointing_at_a_file_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    *parties, labels = write_own_files(tmp_path)
    target = tmp_path / "taken.txt"
    target.write_text("mine\n")
    err = refused(own_argv(parties, labels, target), capsys)
    assert f"--out {target} is a file; a directory, or a path where one can be made" in err
    under = refused(own_argv(parties, labels, target / "run"), capsys)
    assert f"--out {target / 'run'} lies under {target}, a file;" in under
    assert target.read_text() == "mine\n" and not (tmp_path / "results.sqlite").exists()


@pytest.mark.usefixtures("no_training")
def test_an_error_quoting_control_characters_shows_them_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file name, a cell or another party's text can hold terminal escapes; the one-line
    error shows them, it does not send them to the terminal."""
    *parties, labels = write_own_files(tmp_path)
    target = tmp_path / "clear\x1b[2J\rscreen"
    target.write_text("mine\n")
    err = refused(own_argv(parties, labels, target), capsys)
    assert "\x1b" not in err and "\r" not in err
    assert "clear\\x1b[2J\\rscreen is a file" in err
    missing = refused(["psi", "--mine", str(target) + "\x1b]0;", "--theirs", str(target)], capsys)
    assert "\x1b" not in missing and "\\x1b]0;" in missing


def test_a_value_argparse_takes_for_a_flag_is_shown_with_how_to_write_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--dp-gradients -1:0.1`` is not a negative number to argparse, which said only
    "expected one argument"; a flag followed by a real flag gets no such hint."""
    err = refused(["train", "--dp-gradients", "-1:0.1"], capsys)
    assert "found -1:0.1, taken for a flag; write --dp-gradients=-1:0.1" in err
    # abbreviated, or given twice (the second the one argparse stops at)
    err = refused(["train", "--dp-grad", "-1:0.1"], capsys)
    assert "found -1:0.1, taken for a flag; write --dp-grad=-1:0.1" in err
    err = refused(["train", "--dp-gradients", "1:0.1", "--dp-gradients", "-.5:0.1"], capsys)
    assert "found -.5:0.1, taken for a flag; write --dp-gradients=-.5:0.1" in err
    err = refused(["train", "--p-miss-test", "--epochs", "1"], capsys)
    assert err.strip().endswith("argument --p-miss-test: expected one argument")


@pytest.mark.usefixtures("no_training")
def test_a_store_that_is_not_a_database_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    *parties, labels = write_own_files(tmp_path)
    store = tmp_path / "notes.txt"
    store.write_text("not a database\n")
    err = refused(own_argv(parties, labels, tmp_path / "r", "--store", str(store)), capsys)
    assert f"--store {store} is not an SQLite database" in err
    assert not (tmp_path / "r").exists() and store.read_text() == "not a database\n"
    err = refused(own_argv(parties, labels, tmp_path / "r", "--store", str(tmp_path)), capsys)
    assert "is a directory; expected an SQLite file path" in err


@pytest.mark.usefixtures("no_training")
def test_a_database_with_a_foreign_runs_table_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    *parties, labels = write_own_files(tmp_path)
    store = tmp_path / "other.sqlite"
    with sqlite3.connect(store) as connection:
        connection.execute("CREATE TABLE runs (lap INTEGER, seconds REAL)")
    connection.close()
    err = refused(own_argv(parties, labels, tmp_path / "r", "--store", str(store)), capsys)
    assert "has a `runs` table that secure-vfl did not write" in err


def psi_argv(tmp_path: Path) -> list[str]:
    """`psi` of two small id files (ids 2 and 3 in common), without --out."""
    mine, theirs = tmp_path / "mine.csv", tmp_path / "theirs.csv"
    mine.write_text("id\n1\n2\n3\n")
    theirs.write_text("id\n2\n3\n4\n")
    return ["psi", "--mine", str(mine), "--theirs", str(theirs)]


def test_psi_out_is_refused_when_it_exists_unless_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "common.txt"
    out.write_text("old\n")
    argv = [*psi_argv(tmp_path), "--out", str(out)]
    err = refused(argv, capsys)
    assert f"{out} exists; expected a new --out file (or --overwrite)" in err
    assert out.read_text() == "old\n"
    assert main([*argv, "--overwrite"]) == 0
    assert out.read_text().split() == ["2", "3"]
    assert "is a directory" in refused([*argv[:-1], str(tmp_path)], capsys)


def test_psi_out_is_refused_when_it_is_an_input_even_with_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--out mine.csv --overwrite` replaced the input with the intersection, header gone."""
    argv = psi_argv(tmp_path)
    for side in ("mine.csv", "theirs.csv"):
        read = tmp_path / side
        before = read.read_text()
        err = refused([*argv, "--out", str(read), "--overwrite"], capsys)
        assert f"--out {read} is the input file {read}; expected another path (its ids" in err
        assert read.read_text() == before


def test_psi_output_that_cannot_be_written_is_refused_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = psi_argv(tmp_path)
    mine = tmp_path / "mine.csv"
    # replacing a pipe or a device would not write to it (as root, /dev/null would be a file
    # afterwards): a pipe here, which a regression cannot harm beyond this test's directory
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    err = refused([*argv, "--out", str(pipe), "--overwrite"], capsys)
    assert "a regular file (or a new path) expected, found a named pipe" in err
    assert stat.S_ISFIFO(pipe.stat().st_mode)
    err = refused([*argv, "--capture", str(mine / "capture.bin")], capsys)
    assert f"its folder {mine} cannot be made ({mine} is not a folder)" in err
    # what the operating system refuses is said in one line, without a traceback
    assert main([*argv, "--out", str(tmp_path / ("a" * 300))]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(": File name too long\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.csv", "pipe", "theirs.csv"]


def test_psi_refuses_ids_it_cannot_match_or_write_one_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    theirs = tmp_path / "theirs.csv"
    theirs.write_text("id\na\nc\n")
    cases = {
        "id\n": "must have at least one row. Found none.",
        'id\n"x\ny"\nc\n': "found a line break ('\\n') in 'x\\ny' at data row 1",
        # str.splitlines() splits at U+2028: a reader of --out by lines saw two ids
        "id\nc\nx\u2028y\n": "found a line break ('\\u2028') in 'x\\u2028y' at data row 2",
        "id,id\n1,2\n": "column names must be distinct. Found ['id'] repeated.",
        "id,x\na,1\nb,2,3\n": "line 3 has 3 fields; expected 2, as the lines before",
    }
    for text, message in cases.items():
        mine = tmp_path / "mine.csv"
        mine.write_text(text, encoding="utf-8")
        out = tmp_path / "common.txt"
        argv = ["psi", "--mine", str(mine), "--theirs", str(theirs), "--out", str(out)]
        assert message in refused(argv, capsys) and not out.exists()
    # a byte order mark (as spreadsheet programs write) is not part of the first column's name
    (tmp_path / "mine.csv").write_bytes(b"\xef\xbb\xbfid\na\nb\n")
    assert main([*argv[:-2]]) == 0
    assert "intersection size: 1 (of 2 mine, 2 theirs)" in capsys.readouterr().out


def test_ids_with_spaces_around_them_are_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PSI compares ids as text: ' a' in one file never matched 'a' in the other, silently (the
    join names near matches; PSI cannot see the other side's ids)."""
    mine, theirs = tmp_path / "mine.csv", tmp_path / "theirs.csv"
    mine.write_text("id\n a\nb\nc\n")
    theirs.write_text("id\na\nb\n")
    assert main(["psi", "--mine", str(mine), "--theirs", str(theirs)]) == 0
    captured = capsys.readouterr()
    assert "intersection size: 1 (of 3 mine, 2 theirs)" in captured.out
    assert f"secure-vfl: warning: {mine}: 1 id(s) with spaces around them, e.g. ' a';" in (
        captured.err
    )
    assert "theirs.csv" not in captured.err


def test_psi_with_a_repeated_id_names_the_file_and_the_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine, theirs = tmp_path / "mine.csv", tmp_path / "theirs.csv"
    mine.write_text("id\n1\n2\n3\n")
    theirs.write_text("id\n7\n2\n9\n7\n")
    err = refused(["psi", "--mine", str(mine), "--theirs", str(theirs)], capsys)
    assert str(theirs) in err and "must be unique" in err and "'7' at data rows [1, 4]" in err


@pytest.mark.usefixtures("no_training")
def test_ids_in_another_format_say_no_id_matched_with_an_example_of_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    *parties, labels = write_own_files(tmp_path)
    for path in [*parties, labels]:  # ids 0000..0119 everywhere, party-2's as 0..119
        frame = pd.read_csv(path, dtype={"id": str})
        frame["id"] = frame["id"].str.removeprefix("id")
        if path == parties[2]:
            frame["id"] = frame["id"].astype(int).astype(str)
        frame.to_csv(path, index=False)
    err = refused(own_argv(parties, labels, tmp_path / "r"), capsys)
    assert "no ids matched between party file" in err and "party2.csv" in err
    assert "e.g. '0' in the party file, '0000' in the label file" in err


def test_ids_at_one_party_only_without_a_label_are_counted_as_dropped(tmp_path: Path) -> None:
    *parties, labels = write_own_files(tmp_path)
    extra = pd.DataFrame({"id": ["stray1", "stray2"], "a0": [0.5, 0.1], "b0": [1.0, 2.0]})
    frame = pd.read_csv(parties[0], dtype={"id": str})
    pd.concat([frame, extra]).to_csv(parties[0], index=False)
    label_frame = pd.read_csv(labels, dtype={"id": str})
    pd.concat([label_frame, pd.DataFrame({"id": ["orphan"], "label": ["no"]})]).to_csv(
        labels, index=False
    )
    assert main(own_argv(parties, labels, tmp_path / "r")) == 0
    dropped = json.loads((tmp_path / "r" / "result.json").read_text())["dropped"]
    assert dropped["alignment_no_label"] == 2  # party-0's two ids without a label
    assert dropped["alignment_no_party"] == 1  # the label no party holds
    assert dropped["alignment"] == 3


def test_a_class_too_small_for_both_splits_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    *parties, labels = write_own_files(tmp_path)
    frame = pd.read_csv(labels, dtype={"id": str})
    frame.loc[:1, "label"] = "rare"  # 2 samples: round(0.2 * 2) = 0 in the test split
    frame.to_csv(labels, index=False)
    assert main(own_argv(parties, labels, tmp_path / "r")) == 0
    err = capsys.readouterr().err
    assert "secure-vfl: warning: class 'rare' has 2 aligned sample(s)" in err
    assert "in the training split only" in err
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert any("class 'rare'" in warning for warning in result["warnings"])


@pytest.mark.usefixtures("no_training")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--clients", "4"], "--clients 4 contradicts the 3 --client-file given"),
        (["--availability", "0.6"], "--availability deals a --dataset's features to clients"),
    ],
)
def test_impute_flags_that_contradict_client_files_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    *parties, _ = write_own_files(tmp_path)
    argv = ["impute", "--method", "mean", "--out", str(tmp_path / "r")]
    for path in parties:
        argv += ["--client-file", str(path)]
    assert message in refused([*argv, *extra], capsys)


@pytest.mark.parametrize("method", ["combinatorial", "local", "ensemble"])
@pytest.mark.parametrize("command", ["train", "attack"])
def test_heads_active_with_an_every_head_method_is_refused_before_any_work(
    command: str, method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An attack said `(heads='active') party-1 holds a head`, as if that were the attack's
    limit: combinatorial trains a head at every party and needs them all. Local and ensemble
    were refused only once their method was built, after the data had loaded."""
    argv = [command, "--method", method, "--dataset", "wine", "--heads", "active"]
    argv += ["--attack", "norm-scoring"] if command == "attack" else []
    err = refused([*argv, "--out", str(tmp_path / "a")], capsys)
    assert f"--heads active: {method} trains a head at every party" in err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("method", ["standard", "plugvfl", "false-vfl-1"])
def test_heads_all_with_a_one_head_method_is_refused_and_the_run_records_active(
    method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--heads all was accepted and ignored, and result.json recorded heads 'all' for a
    method whose only head is the label party's."""
    argv = ["train", "--method", method, "--dataset", "wine", "--epochs", "1", "--quiet"]
    err = refused([*argv, "--heads", "all", "--out", str(tmp_path / "a")], capsys)
    assert f"--heads all: {method} trains one head, the label party's." in err
    assert not (tmp_path / "a").exists()
    from secure_vfl.experiment import TrainConfig
    from secure_vfl.methods import MethodConfig

    config = TrainConfig(method=method, dataset="wine", method_config=MethodConfig(heads="all"))
    assert config.method_config.heads == "active"  # what the library records for it
    assert TrainConfig(method="laser", dataset="wine").method_config.heads == "all"


def test_a_training_missingness_that_leaves_no_training_sample_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It trained on nothing (every epoch's loss null), printed the untrained model's accuracy
    and exited 0."""
    train = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    train += ["--missing-train", "mcar:0.99999", "--out", str(tmp_path / "t")]
    assert main(train) == 2
    err = capsys.readouterr().err
    assert "the training split holds no sample (120 dropped for having no observed block)" in err
    assert "--missing-train" in err
    assert not (tmp_path / "t").exists()


def test_a_training_missingness_that_leaves_one_class_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It trained on the 3 samples left, all of class 0, printed the model's accuracy without
    a warning and exited 0."""
    train = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    train += ["--missing-train", "mcar:0.995", "--seed", "18", "--out", str(tmp_path / "t")]
    assert main(train) == 2
    err = capsys.readouterr().err
    assert "the training split holds 3 sample(s), all of one class (0) (117 dropped" in err
    assert not (tmp_path / "t").exists()


def test_a_test_split_or_an_imputation_with_nothing_to_score_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both printed `nan` for their metrics, with numpy's "Mean of empty slice", and exited
    0: a test missingness that dropped every test sample, and 30 imputation clients none of
    which had a test entry to hide."""
    train = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    train += ["--missing-test", "mcar:0.99", "--out", str(tmp_path / "t")]
    assert main(train) == 2
    err = capsys.readouterr().err
    assert "test split 'mcar:0.99' holds no sample (30 dropped for having no observed" in err
    assert not (tmp_path / "t").exists()
    # Three labelled ids: none set aside for testing (it said "0 dropped ... no observed block").
    for name, text in (("a.csv", "id,x\n1,1\n2,2\n3,3\n"), ("b.csv", "id,y\n1,3\n2,1\n3,2\n")):
        (tmp_path / name).write_text(text)
    (tmp_path / "y.csv").write_text("id,label\n1,0\n2,1\n3,0\n")
    own = ["train", "--method", "laser", "--label-file", str(tmp_path / "y.csv"), "--quiet"]
    own += ["--party-file", str(tmp_path / "a.csv"), "--party-file", str(tmp_path / "b.csv")]
    assert main([*own, "--out", str(tmp_path / "o")]) == 2
    assert "holds no sample (no row was set aside for testing, of 3 aligned)" in (
        capsys.readouterr().err
    )
    impute = ["impute", "--method", "mean", "--dataset", "airquality", "--clients", "30"]
    assert main([*impute, "--out", str(tmp_path / "i")]) == 2
    err = capsys.readouterr().err
    assert "no client had a test entry to hide and score (30 clients, 0 hidden" in err
    assert not (tmp_path / "i").exists()
    # A model-based method found it only after its whole training (and --capture kept it all)
    capture = tmp_path / "i.capture"
    impute[2] = "fedhf"
    assert main([*impute, "--out", str(tmp_path / "i"), "--capture", str(capture)]) == 2
    assert "no client had a test entry" in capsys.readouterr().err
    assert not capture.exists() and not (tmp_path / "i").exists()


@pytest.mark.parametrize("method", ["laser", "false-vfl-2"])
def test_labelled_samples_of_one_class_are_refused(
    method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--labeled 1` trained on one class and warned only that predictions collapsed."""
    argv = ["train", "--method", method, "--dataset", "iris", "--labeled", "1", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert "(--labeled 1) hold one class (2); a classifier needs at least 2" in (
        capsys.readouterr().err
    )
    assert main([*argv[:-3], "--labeled", "10", "--epochs", "1", "--out", str(tmp_path / "s")]) == 0


def test_settings_past_float32_are_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A learning rate, weight decay or trigger value above the float32 maximum crashed the
    run mid-step (torch: "value cannot be converted to type float without overflow")."""
    train = ["train", "--method", "laser", "--dataset", "breast-cancer", "--epochs", "1"]
    attack = ["attack", "--method", "laser", "--dataset", "breast-cancer", "--heads", "active"]
    attack += ["--epochs", "1", "--attack", "gradient-replacement-backdoor"]
    impute = ["impute", "--dataset", "airquality", "--method", "fedhf"]
    cases = [
        (
            [*train, "--lr", "1e39"],
            "`lr` must be a positive number, at most 3.40282e+38 (float32's largest). Found 1e+39.",
        ),
        (
            [*train, "--weight-decay", "1e39"],
            "`weight_decay` must be a number >= 0, at most 3.40282e+38 (float32's largest)",
        ),
        (
            [*impute, "--lr", "1e39"],
            "`lr` must be a positive number, at most 3.40282e+38 (float32's largest). Found 1e+39.",
        ),
        (
            [*attack, "--attack-option", "trigger_value=-1e39"],
            "`trigger_value` must be a finite float32 number",
        ),
    ]
    for argv, message in cases:
        out = tmp_path / "out"
        assert message in refused([*argv, "--quiet", "--out", str(out)], capsys)
        assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["party", "serve", "--federation", "FED", "--name", "shop", "--deadline", "1e10"],
        ["party", "serve", "--federation", "FED", "--name", "shop", "--wait", "1e10"],
        ["train", "--federation", "FED", "--name", "bank", "--method", "laser", "--wait", "1e10"],
    ],
)
def test_network_seconds_past_what_the_system_waits_are_refused(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --deadline of 1e10 s was taken, and the first wait that long raised OverflowError
    (timeout value is too large) from the queue it waited on."""
    federation = tmp_path / "federation.toml"
    federation.write_text("")
    argv = [str(federation) if a == "FED" else a for a in argv]
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "expected a positive number of seconds, at most 1000000, found '1e10'" in err


NORM_SCORING_ON_WINE = ["--method", "laser", "--dataset", "wine", "--attack", "norm-scoring"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--dataset", "wine", "--epochs", "1_0"], "found '1_0'"),
        (["train", "--dataset", "wine", "--seed", "٣"], "found '٣'"),
        (["train", "--dataset", "wine", "--lr", "1_0"], "found '1_0'"),
        (["train", "--dataset", "wine", "--dp-sgd", "1_0:1"], "two numbers, e.g. 1.1:1.0"),
        (["train", "--dataset", "wine", "--missing-train", "mcar:0_5"], "must be numbers"),
        (
            ["attack", *NORM_SCORING_ON_WINE, *["--defense", "marvell:1_0"]],
            "marvell:NUMBER expected. Found 'marvell:1_0'",
        ),
        (
            [
                "sweep",
                *NORM_SCORING_ON_WINE,
                *["--defense", "marvell:SCALE", "--grid", "SCALE=1,1_0"],
            ],
            "--grid SCALE: numbers expected",
        ),
    ],
)
def test_numbers_are_read_as_written_never_with_underscores_or_other_scripts_digits(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Python's float and int read '1_0' as 10 and '٣' as 3: `marvell:1_0` ran a defense of
    strength 10, a typo taken for another setting."""
    out = tmp_path / "out"
    assert message in refused([*argv, "--quiet", "--out", str(out)], capsys)
    assert not out.exists()


def test_a_model_trained_with_release_dp_is_refused_where_its_parts_live(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its prediction asked each data party for DP releases that no accountant prices outside
    training, and a deployed party refused them mid-prediction (ProtocolError: "asked to send
    36 rows as a DP release ... but it holds no release mechanism")."""
    from test_deploy import write_federation

    from secure_vfl.federation.network import free_loopback_ports

    out = tmp_path / "run"
    argv = ["train", "--method", "laser", "--dataset", "breast-cancer", "--heads", "active"]
    argv += ["--secure-agg", "masks", "--release", "dp", "--release-noise", "1:1", "--epochs"]
    argv += ["1", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    path = write_federation(tmp_path, tmp_path / "certs", free_loopback_ports(5))
    predict = ["predict", "--federation", str(path), "--name", "bank", "--model", str(out)]
    err = refused([*predict, "--secure-agg", "masks", "--out", str(tmp_path / "p.csv")], capsys)
    assert "was trained with --release dp: its predictions ask parties for DP releases" in err
    assert f"`predict --model {out} --party-file ...`" in err
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.usefixtures("no_training")
def test_train_keeps_a_model_folder_of_the_users_own_without_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only a model/ holding a manifest was refused: one of the user's own files was replaced
    by the run's model, its files gone, without --overwrite."""
    (tmp_path / "o" / "model").mkdir(parents=True)
    (tmp_path / "o" / "model" / "notes.txt").write_text("mine")
    argv = ["train", "--method", "local", "--dataset", "breast-cancer", "--epochs", "1"]
    err = refused([*argv, "--quiet", "--out", str(tmp_path / "o")], capsys)
    assert (
        f"{tmp_path / 'o' / 'model'} exists; expected a new --out directory (or --overwrite)"
        in (err)
    )
    assert (tmp_path / "o" / "model" / "notes.txt").read_text() == "mine"
