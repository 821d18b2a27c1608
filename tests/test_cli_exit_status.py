"""The exit status says which kind of failure it was, whichever command and code path met it:
1 where the operating system refused a file operation (a name too long, a full disk, no
permission), 2 for a bad flag, file or value; one line either way, and what the failed command
made and left empty is gone."""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import secure_vfl.cli
from secure_vfl.cli import command_line, main
from secure_vfl.errors import ConfigError, OutputError
from secure_vfl.store import ResultsStore

LONG = "a" * 300  # longer than a file name may be (ENAMETOOLONG), also for root


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("secure-vfl: error: "), err
    return err


def ids_file(path: Path) -> Path:
    path.write_text("id\n1\n2\n3\n")
    return path


def test_an_input_name_the_system_refuses_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flag's own check met the refusal while parsing, outside the command's error
    handling: a traceback (OSError: [Errno 36] File name too long)."""
    theirs = ids_file(tmp_path / "theirs.csv")
    assert main(["psi", "--mine", str(tmp_path / f"{LONG}.csv"), "--theirs", str(theirs)]) == 1
    assert one_line(capsys).endswith(f"{LONG}.csv: File name too long\n")
    argv = ["train", "--method", "laser", "--party-file", str(tmp_path / f"{LONG}.csv")]
    assert main([*argv, "--label-file", str(theirs)]) == 1
    assert one_line(capsys).endswith(": File name too long\n")


def test_a_refusal_turned_into_a_message_still_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--out` is checked before any work and refused in words (a ConfigError): it exited 2,
    where psi's `--out` of the same name exited 1."""
    argv = ["train", "--method", "laser", "--dataset", "digits", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / LONG)]) == 1
    assert "a path this system can use expected; File name too long." in one_line(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_capture_the_disk_refuses_names_its_file_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said `secure-vfl: error: No space left on device`, naming no file."""
    mine, theirs = ids_file(tmp_path / "mine.csv"), ids_file(tmp_path / "theirs.csv")
    argv = ["psi", "--mine", str(mine), "--theirs", str(theirs), "--capture", "/dev/full"]
    assert main(argv) == 1
    err = one_line(capsys)
    assert "--capture /dev/full cannot be written: No space left on device" in err


def test_a_failed_command_removes_the_folders_it_made_and_left_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk while the model was written left an empty `--out` folder (and the folders
    above it that the run made)."""

    def fails_writing(args: object) -> int:
        out = Path(getattr(args, "out"))  # noqa: B009 (argparse's namespace)
        (out / "model" / "party-0").mkdir(parents=True)
        raise OutputError(f"{out}/model cannot be written: No space left on device")

    monkeypatch.setattr(secure_vfl.cli, "run_train", fails_writing)
    argv = ["train", "--method", "laser", "--dataset", "digits", "--quiet"]
    made = tmp_path / "new" / "deeper" / "run"
    assert main([*argv, "--out", str(made)]) == 2
    assert "cannot be written" in one_line(capsys)
    assert list(tmp_path.iterdir()) == []
    # a folder that was there before stays, with what it held
    kept = tmp_path / "kept"
    (kept / "notes").mkdir(parents=True)
    assert main([*argv, "--out", str(kept)]) == 2
    assert (kept / "notes").is_dir() and (kept / "model" / "party-0").is_dir()
    capsys.readouterr()

    def writes_then_fails(args: object) -> int:
        out = Path(getattr(args, "out"))  # noqa: B009
        out.mkdir(parents=True)
        (out / "result.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(secure_vfl.cli, "run_train", writes_then_fails)
    written = tmp_path / "written"
    assert main([*argv, "--out", str(written)]) == 130
    assert (written / "result.json").read_text() == "{}"  # what it had written stays

    def default_out_fails(args: object) -> int:  # no --out: runs/METHOD-DATASET-sSEED
        out = secure_vfl.cli._run_out(args, Path("runs") / "laser-digits-s0")  # type: ignore[arg-type]
        (out / "model").mkdir(parents=True)
        raise OutputError(f"{out}/model cannot be written: No space left on device")

    monkeypatch.setattr(secure_vfl.cli, "run_train", default_out_fails)
    monkeypatch.chdir(tmp_path / "kept")
    assert main(argv) == 2
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["model", "notes"]
    capsys.readouterr()


def test_a_run_folder_whose_name_is_not_utf8_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The results store records `--out` as text: the run trained, wrote its result, and then
    failed with a UnicodeEncodeError traceback, unrecorded."""
    monkeypatch.chdir(tmp_path)
    name = os.fsdecode(b"r\xffun")
    for command in (["train", "--method", "laser"], ["impute", "--method", "mean"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--dataset", "digits", "--out", name])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert (
            "--out: expected a path in UTF-8 (the results store records it), found b'r\\xffun'"
            in err
        )
    assert list(tmp_path.iterdir()) == []


def test_a_report_records_a_command_line_of_any_bytes_as_utf8(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sweep wrote its command into sweep.md and failed there on an argument not in UTF-8,
    its sweep.json written and its sweep.md not."""
    monkeypatch.setattr(sys, "argv", ["secure-vfl", "sweep", "--party-file", os.fsdecode(b"b\xe9")])
    text = command_line("secure-vfl sweep")
    assert text == "secure-vfl sweep --party-file b\\xe9"
    text.encode("utf-8")
    monkeypatch.setattr(sys, "argv", ["python"])
    assert command_line("secure-vfl sweep") == "secure-vfl sweep"


def test_a_client_file_whose_name_is_not_utf8_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client is named by its file's stem, which travels in messages: it was refused as
    `compute-request.receiver: a str encodable as UTF-8 expected`."""
    rng = np.random.default_rng(0)
    paths = []
    for stem in (os.fsdecode(b"site\xff"), "other"):
        frame = pd.DataFrame({"a": rng.normal(size=20), "b": rng.normal(size=20)})
        frame.loc[3, "a"] = np.nan
        path = tmp_path / f"{stem}.csv"
        frame.to_csv(path, index=False)
        paths += ["--client-file", str(path)]
    argv = ["impute", "--method", "mean", *paths, "--out", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 2
    err = one_line(capsys)
    assert "a client is named by its file's stem" in err and "b'site\\xff.csv'" in err
    assert "rename the file" in err


def test_a_store_the_disk_refuses_leaves_no_empty_file_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite made the file, then could not write it: a 0-byte store stayed, and the message
    blamed the file (`could not be used as a results store`), with exit 2."""

    def full(self: object, connection: object, *, create: bool = True) -> None:
        error = sqlite3.OperationalError("database or disk is full")
        error.sqlite_errorcode = sqlite3.SQLITE_FULL
        raise error

    monkeypatch.setattr(ResultsStore, "_prepare", full)
    path = tmp_path / "results.sqlite"
    with pytest.raises(OutputError, match="cannot be written: database or disk is full") as info:
        ResultsStore(path).rows()
    assert not path.exists()
    assert secure_vfl.cli._exit_status(info.value) == 1

    def damaged(self: object, connection: object, *, create: bool = True) -> None:
        raise sqlite3.DatabaseError("file is not a database")

    monkeypatch.setattr(ResultsStore, "_prepare", damaged)
    with pytest.raises(ConfigError, match="could not be used as a results store") as refused:
        ResultsStore(path).rows()
    assert not path.exists()
    assert secure_vfl.cli._exit_status(refused.value) == 2


def test_a_device_is_refused_as_a_store(tmp_path: Path) -> None:
    """/dev/null as --store failed with SQLite's `disk I/O error`."""
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ConfigError, match="pipe is a named pipe; expected an SQLite file path"):
        ResultsStore(tmp_path / "pipe").check()


def test_a_party_that_is_gone_exits_1_and_a_refused_message_2() -> None:
    """A deployed label party whose peers were unreachable exited 2, as a bad flag does; a
    served party 2 when its label party went silent, 1 when the label party ended the run."""
    from secure_vfl.errors import ProtocolError, TransportError

    assert secure_vfl.cli._exit_status(TransportError("bank accepts no connection")) == 1
    assert secure_vfl.cli._exit_status(ProtocolError("a replayed message")) == 2


def test_a_signal_while_a_run_writes_its_outputs_is_acted_on_after_the_last_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C between result.json and the store's row left a run that neither a rerun
    (`result.json exists`) nor --resume (`holds a finished run`) would take, missing from
    `runs list`."""
    import signal

    import secure_vfl.plots

    real = secure_vfl.plots.write_run_plots

    def interrupted_while_plotting(payload: object, out: Path) -> object:
        os.kill(os.getpid(), signal.SIGINT)
        return real(payload, out)  # type: ignore[arg-type]

    monkeypatch.setattr(secure_vfl.plots, "write_run_plots", interrupted_while_plotting)
    out = tmp_path / "run"
    argv = ["train", "--method", "laser", "--dataset", "digits", "--epochs", "1", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 130
    assert "secure-vfl: interrupted;" in capsys.readouterr().err
    assert (out / "result.json").is_file() and (out / "loss.png").is_file()
    assert (out / "model" / "manifest.json").is_file()
    [row] = ResultsStore(tmp_path / "results.sqlite").rows()
    assert Path(row["out_dir"]) == out.resolve()

    def asked_twice(payload: object, out: Path) -> object:  # writes that hang: stop at once
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the second Ctrl-C did not stop it")

    monkeypatch.setattr(secure_vfl.plots, "write_run_plots", asked_twice)
    assert main([*argv, "--out", str(tmp_path / "again")]) == 130
    assert "secure-vfl: interrupted;" in capsys.readouterr().err
    assert len(ResultsStore(tmp_path / "results.sqlite").rows()) == 1


def test_outputs_that_cannot_all_be_written_leave_no_result_json_and_say_how_to_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plot the disk refused was written after result.json: the run read as finished without
    its plots or store row, a rerun refused it (`result.json exists`) and the error said
    "nothing was written"."""
    import secure_vfl.io
    import secure_vfl.plots

    def full(out: Path) -> OutputError:
        return OutputError(
            f"{out} cannot be written: No space left on device; nothing was written."
        )

    def plots_refused(payload: object, out: Path) -> object:
        raise full(out / "loss.png")

    real_plots = secure_vfl.plots.write_run_plots
    monkeypatch.setattr(secure_vfl.plots, "write_run_plots", plots_refused)
    out = tmp_path / "run"
    argv = ["train", "--method", "laser", "--dataset", "wine", "--epochs", "1", "--quiet"]
    argv += ["--out", str(out)]
    assert main(argv) == 2
    err = one_line(capsys)
    assert "This run is not finished (its result.json was not written): run the command " in err
    assert not (out / "result.json").exists() and not (out / "model").exists()
    assert ResultsStore(tmp_path / "results.sqlite").rows() == []
    monkeypatch.setattr(secure_vfl.plots, "write_run_plots", real_plots)
    assert main(argv) == 0  # the same command, as it was
    assert (out / "result.json").is_file() and (out / "loss.png").is_file()
    capsys.readouterr()

    # result.json itself refused: the model it wrote first makes the rerun ask for --overwrite
    real_json = secure_vfl.io.atomic_write_json

    def result_refused(path: Path, payload: object, **kwargs: Any) -> None:
        if path.name == "result.json":
            raise full(path)
        real_json(path, payload, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(secure_vfl.io, "atomic_write_json", result_refused)
    again = [*argv[:-1], str(tmp_path / "again")]
    assert main(again) == 2
    assert "This run is not finished (its result.json was not written)" in one_line(capsys)
    assert (tmp_path / "again" / "model" / "manifest.json").is_file()
    assert len(ResultsStore(tmp_path / "results.sqlite").rows()) == 1
    monkeypatch.setattr(secure_vfl.io, "atomic_write_json", real_json)
    assert main(again) == 2
    assert f"{tmp_path / 'again' / 'model'} exists; expected a new --out" in one_line(capsys)
    assert main([*again, "--overwrite"]) == 0
    assert len(ResultsStore(tmp_path / "results.sqlite").rows()) == 2
    capsys.readouterr()

    # a sweep's and a suite's marker files go last too
    import attacks.sweep

    def sweep_plot_refused(*args: Any, **kwargs: Any) -> Any:
        raise full(tmp_path / "sweep" / "sweep.png")

    monkeypatch.setattr(attacks.sweep, "plot", sweep_plot_refused)
    sweep = [
        "sweep",
        "--attack",
        "norm-scoring",
        "--method",
        "standard",
        "--dataset",
        "breast-cancer",
    ]
    sweep += ["--epochs", "1", "--seeds", "1", "--workers", "1", "--quiet"]
    assert main([*sweep, "--out", str(tmp_path / "sweep")]) == 2
    assert "This run is not finished (its sweep.json was not written)" in one_line(capsys)
    assert not (tmp_path / "sweep" / "sweep.json").exists()


def test_a_store_made_by_another_run_between_two_reads_is_used_not_refused(tmp_path: Path) -> None:
    """Runs finishing together into a new folder: one read no `runs` table, another run made
    it, and the schema check then found tables and refused the store as another program's
    (and, having made the file, would have removed it with the other run's row)."""
    path = tmp_path / "results.sqlite"
    store = ResultsStore(path)
    store._connect().close()  # the other run's store, its table made

    class ReadBeforeTheOtherRun:
        def __init__(self, connection: sqlite3.Connection) -> None:
            self.connection, self.first = connection, True

        def execute(self, sql: str, *args: Any) -> object:
            if sql == "PRAGMA table_info(runs)" and self.first:
                self.first = False
                return iter(())
            return self.connection.execute(sql, *args)

    connection = sqlite3.connect(path)
    racing = ReadBeforeTheOtherRun(connection)
    try:
        store._prepare(racing, create=True)  # type: ignore[arg-type]
    finally:
        connection.close()
    assert not racing.first  # the race was played: the first read found no table
    assert path.stat().st_size > 0 and store.rows() == []  # the store stays, and reads


def test_a_capture_record_is_one_write() -> None:
    """Two commands capturing into one file at once interleaved a length and its message (the
    other's record between them), and the file could not be read past it."""
    from secure_vfl.federation.channel import append_record

    class Writes:
        def __init__(self) -> None:
            self.calls: list[bytes] = []

        def write(self, data: bytes) -> int:
            self.calls.append(bytes(data))
            return len(data)

        def flush(self) -> None:
            self.calls.append(b"<flush>")

    handle = Writes()
    append_record(handle, b"SVFL" + b"x" * 100_000)  # type: ignore[arg-type]
    assert handle.calls == [b"\x00\x01\x86\xa4SVFL" + b"x" * 100_000, b"<flush>"]
