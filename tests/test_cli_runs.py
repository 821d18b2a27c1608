"""Runs you can compare (issue 12, item 4): the results store keeps the whole configuration,
one row per run directory; `runs list` and `runs compare` tell runs apart; every run writes its
plots; a run whose predictions collapse to one class warns."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sqlite3
import subprocess
import time
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import secure_vfl.experiment
import secure_vfl.store
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import collapse_warnings
from secure_vfl.runs import RunSummary, provenance, table
from secure_vfl.store import SCHEMA_VERSION, ResultsStore

PNG = b"\x89PNG\r\n\x1a\n"


def train(out: Path, *extra: str) -> list[str]:
    """A one-epoch LASER run on wine with a single label party (secure sums possible)."""
    argv = ["train", "--method", "laser", "--dataset", "wine", "--heads", "active"]
    argv += ["--epochs", "2", "--batch-size", "32", "--out", str(out), "--quiet", *extra]
    assert main(argv) == 0
    return argv


def test_compare_tells_a_masks_run_from_a_ckks_run_from_a_dp_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train(tmp_path / "masks", "--secure-agg", "masks")
    train(tmp_path / "ckks", "--secure-agg", "ckks")
    train(tmp_path / "dp", "--dp-gradients", "1.0:0.05")
    capsys.readouterr()
    dirs = [tmp_path / name for name in ("masks", "ckks", "dp")]
    assert main(["runs", "compare", *map(str, dirs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[:5] == ["run", "method", "backend", "dp", "epsilon"]
    assert "mcar:0" in lines[0] and "mcar:0.5" in lines[0] and "time" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    masks, ckks, dp = (rows[str(d)] for d in dirs)
    assert masks[2:5] == ["masks", "none", "-"]
    assert ckks[2:5] == ["ckks", "none", "-"]
    assert dp[2] == "none" and dp[3:5] == ["gradients", "1:0.05"]
    # the worst party's: the representations crossed without noise (the gradients' is finite)
    epsilon = json.loads((tmp_path / "dp" / "result.json").read_text())["privacy"]["epsilon"]
    assert dp[5] == "inf" and max(epsilon.values()) < 1e3
    # The store holds the same distinctions, one row per run, with the whole configuration.
    rows_stored = {
        Path(r["out_dir"]).name: r for r in ResultsStore(tmp_path / "results.sqlite").rows()
    }
    assert {name: r["backend"] for name, r in rows_stored.items()} == {
        "masks": "masks",
        "ckks": "ckks",
        "dp": "none",
    }
    assert rows_stored["dp"]["dp"] == "gradients 1:0.05"
    assert rows_stored["dp"]["epsilon"] == epsilon
    assert rows_stored["masks"]["epsilon"] is None
    assert rows_stored["dp"]["config"]["privacy"]["dp_gradients"] == [1.0, 0.05]
    assert rows_stored["ckks"]["config"]["privacy"]["secure_agg"] == "ckks"
    assert main(["runs", "list", "--store", str(tmp_path / "results.sqlite")]) == 0
    listed = capsys.readouterr().out
    assert "1 train masks" in listed and "ckks" in listed and "gradients 1:0.05" in listed


def test_the_store_keeps_one_row_per_run_directory_and_its_provenance(tmp_path: Path) -> None:
    argv = train(tmp_path / "run", "--seed", "3")
    assert main([*argv, "--overwrite", "--lr", "0.1"]) == 0
    rows = ResultsStore(tmp_path / "results.sqlite").rows()
    assert len(rows) == 1  # replaced, not added
    row = rows[0]
    assert row["config"]["method_config"]["lr"] == 0.1 and row["seed"] == 3
    assert row["config"]["privacy"]["seed"] == 3 and row["config"]["privacy"]["delta"] == 1e-5
    assert row["version"] == provenance()["version"] and row["version"]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["provenance"]["version"] == row["version"]
    root = Path(__file__).resolve().parent.parent
    git = shutil.which("git")
    if git is not None and (root / ".git").exists():
        head = subprocess.run(
            [git, "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        assert row["git_commit"] == head == result["provenance"]["git_commit"]
        changed = subprocess.run(
            [git, "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout
        assert result["provenance"]["git_modified"] is bool(changed) is row["git_modified"]
    else:
        assert row["git_commit"] is None and result["provenance"]["git_modified"] is None
        assert row["git_modified"] is None


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_provenance_says_when_the_code_differs_from_its_commit(tmp_path: Path) -> None:
    from secure_vfl.runs import git_state

    checkout = tmp_path / "a checkout"  # a space in its path read as two paths: no commit

    def git(*command: str) -> str:
        return subprocess.run(
            ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t", *command],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip

    checkout.mkdir()
    assert git_state(checkout) == (None, None)  # not a checkout
    git("init", "-q")
    (checkout / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "HEAD")
    assert git_state(checkout) == (head, False)
    (checkout / "notes.txt").write_text("not tracked\n")
    assert git_state(checkout) == (head, False)  # untracked files do not count
    index = checkout / ".git" / "index"
    before = index.stat().st_mtime_ns
    time.sleep(0.05)
    os.utime(checkout / "code.py")  # same content, newer time: git would refresh its index
    assert git_state(checkout) == (head, False)
    assert index.stat().st_mtime_ns == before  # read only: a user's `git add` is never locked out
    (checkout / "code.py").write_text("x = 2\n")
    assert git_state(checkout) == (head, True)
    git("add", "code.py")  # staged is still not the commit
    assert git_state(checkout) == (head, True)
    (checkout / "inner").mkdir()  # a folder inside a checkout is not its top level
    assert git_state(checkout / "inner") == (None, None)
    index.write_bytes(b"not an index")  # git cannot tell what changed: the commit still holds
    assert git_state(checkout) == (head, None)


def _entry(seed: int) -> dict[str, Any]:
    return {
        "method": "standard",
        "dataset": "digits",
        "config": {"seed": seed},
        "metrics": {"accuracy": 0.5},
        "wall_time_s": 1.0,
    }


def test_a_sweeps_rows_are_replaced_all_at_once_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep or suite written again replaces its rows in one transaction: they were deleted,
    then added one by one, so a reader could see part of the set, and a failure between them
    (a full disk) left the store with part of the new set and none of the old."""
    store, out = ResultsStore(tmp_path / "results.sqlite"), tmp_path / "sweep"
    store.add(_entry(9), kind="train", out_dir=tmp_path / "other")
    old = [(_entry(seed), "sweep:x", f"none seed {seed}") for seed in range(3)]
    store.replace_runs(out, old)

    def seeds() -> list[int]:
        return sorted(row["seed"] for row in store.rows() if row["kind"] == "sweep:x")

    assert seeds() == [0, 1, 2]
    rows = secure_vfl.store._row

    def second_fails(result: dict[str, Any], **where: Any) -> tuple[Any, ...]:
        row = rows(result, **where)  # SQLite cannot store the last value of seed 6's row
        return (*row[:-1], object()) if result["config"]["seed"] == 6 else row

    monkeypatch.setattr(secure_vfl.store, "_row", second_fails)
    new = [(_entry(seed), "sweep:x", f"none seed {seed}") for seed in (5, 6)]
    with pytest.raises(sqlite3.Error):  # after seed 5's row went in, in the same transaction
        store.replace_runs(out, new)
    assert seeds() == [0, 1, 2]  # the old set, whole
    monkeypatch.undo()
    store.replace_runs(out, [(_entry(7), "sweep:x", "none seed 7")])
    assert seeds() == [7] and len(store.rows()) == 2  # the other run's row stays


def test_runs_remove_takes_runs_out_of_the_store_all_or_none_and_keeps_their_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ResultsStore(tmp_path / "results.sqlite")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "result.json").write_text("{}")
        store.add(_entry(1), kind="train", out_dir=tmp_path / name)
    store.replace_runs(tmp_path / "sweep", [(_entry(s), "sweep:x", f"s{s}") for s in (1, 2)])

    def stored() -> list[str]:
        return sorted({Path(row["out_dir"]).name for row in store.rows()})

    # "gone" has no run here: refused, and "a" keeps its row
    assert main(["runs", "remove", str(tmp_path / "a"), str(tmp_path / "gone")]) == 2
    assert f"no run of {tmp_path / 'gone'} in " in capsys.readouterr().err
    assert stored() == ["a", "b", "sweep"]
    assert main(["runs", "remove", str(tmp_path / "a"), str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'a'}: 1 run removed" in out and "sweep: 2 runs removed" in out
    assert stored() == ["b"] and (tmp_path / "a" / "result.json").exists()  # files stay
    shutil.rmtree(tmp_path / "b")  # runs list marks a run whose directory is gone
    assert main(["runs", "list", "--store", str(tmp_path / "results.sqlite")]) == 0
    assert " train b (gone) " in capsys.readouterr().out
    elsewhere = tmp_path / "other" / "c"
    assert main(["runs", "remove", str(tmp_path / "b"), str(elsewhere)]) == 2
    assert "directories in one folder expected" in capsys.readouterr().err
    store_flag = ["--store", str(tmp_path / "results.sqlite")]
    assert main(["runs", "remove", str(tmp_path / "b"), *store_flag]) == 0
    assert stored() == []


@pytest.mark.parametrize(
    ("column", "cell", "expected"),
    [
        ("metrics", "{", "JSON text"),
        ("config", "not json", "JSON text"),
        ("config", "[1]", "a JSON object"),  # "config: an object expected", naming no run
        ("epsilon", "[", "JSON text"),
        ("checkpoints", "{", "JSON text"),
        ("epsilon_max", "x", "a number"),
    ],
)
def test_runs_list_names_a_damaged_cell_of_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], column: str, cell: str, expected: str
) -> None:
    """A cell edited to what this code never writes crashed `runs list` (JSONDecodeError;
    TypeError in formatting an epsilon_max of text)."""
    train(tmp_path / "run")
    store = tmp_path / "results.sqlite"
    with sqlite3.connect(store) as connection:
        connection.execute(f"UPDATE runs SET {column} = ?", (cell,))
    connection.close()
    assert main(["runs", "list", "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert f"run 1's `{column}` holds {cell!r}; expected {expected}" in err, err


@pytest.mark.parametrize("column", ["kind", "method", "dataset", "backend", "dp", "out_dir"])
def test_runs_list_and_remove_name_a_text_cell_of_the_store_that_holds_no_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], column: str
) -> None:
    """A blob in a text column (an edited or damaged store) failed `runs list` with a
    traceback (TypeError, AttributeError), and `runs remove` too where it was `out_dir`."""
    store = ResultsStore(tmp_path / "results.sqlite")
    store.add(_entry(0), kind="train", out_dir=tmp_path / "a")
    blob = b"\xff\x00"
    with sqlite3.connect(store.path) as connection:
        connection.execute(f"UPDATE runs SET {column} = ?", (blob,))
    connection.close()
    assert main(["runs", "list", "--store", str(store.path)]) == 2
    err = capsys.readouterr().err
    assert f"run 1's `{column}` holds {blob!r}; expected text" in err, err
    assert main(["runs", "remove", str(tmp_path / "b"), "--store", str(store.path)]) == 2
    assert "Nothing was removed." in capsys.readouterr().err


def _first_schema_store(path: Path, rows: list[tuple[str, str, str]]) -> None:
    """A results store of the first schema at ``path`` holding ``rows`` (config, metrics and
    out_dir cells) of training runs."""
    with sqlite3.connect(path) as connection:
        connection.execute(
            "CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, created_at TEXT NOT NULL, "
            "kind TEXT NOT NULL, method TEXT NOT NULL, dataset TEXT NOT NULL, seed INTEGER, "
            "config TEXT NOT NULL, metrics TEXT NOT NULL, wall_time_s REAL NOT NULL, out_dir TEXT)"
        )
        connection.executemany(
            "INSERT INTO runs (created_at, kind, method, dataset, seed, config, metrics, "
            "wall_time_s, out_dir) VALUES ('t', 'train', 'laser', 'wine', 0, ?, ?, 1.0, ?)",
            rows,
        )
    connection.close()


def test_a_first_schema_store_is_migrated_in_place(tmp_path: Path) -> None:
    path = tmp_path / "results.sqlite"
    metrics = json.dumps({"mcar:0": {"accuracy": 90.0, "f1": 88.0}})
    # the old --overwrite's second row of one run directory
    rows = [
        (json.dumps({"seed": 0, "lr": lr}), metrics, str(tmp_path / "run")) for lr in (0.03, 0.1)
    ]
    _first_schema_store(path, rows)
    store = ResultsStore(path)
    store.check()
    rows = store.rows()
    assert len(rows) == 1 and rows[0]["config"]["lr"] == 0.1  # the latest kept
    assert rows[0]["backend"] == "none" and rows[0]["dp"] == "none"
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    connection.close()
    # A migrated store takes new runs, keyed like the old ones.
    store.add(
        {
            "method": "laser",
            "dataset": "wine",
            "config": {"seed": 0, "privacy": {"secure_agg": "masks"}},
            "metrics": {"mcar:0": {"accuracy": 91.0, "f1": 90.0}},
            "wall_time_s": 2.0,
        },
        kind="train",
        out_dir=tmp_path / "run",
    )
    assert [r["backend"] for r in store.rows()] == ["masks"]


@pytest.mark.parametrize(
    ("config", "metrics", "expected"),
    [
        ("{bad", "{}", "run 1's config is not JSON ('{bad')"),
        ("[1, 2]", "{}", "run 1: config: an object expected"),
        ("{}", "nope", "run 1's metrics is not JSON ('nope')"),
    ],
)
def test_a_first_schema_store_that_cannot_be_migrated_is_left_as_it_was(
    tmp_path: Path, config: str, metrics: str, expected: str
) -> None:
    """The table was renamed and the new one made (DDL commits at once in Python's sqlite3)
    before a row failed: a traceback, then every run hidden ("no runs.")."""
    path = tmp_path / "results.sqlite"
    _first_schema_store(path, [(config, metrics, "r")])
    before = path.read_bytes()
    for _ in range(2):  # and again: the same refusal, not an empty store
        with pytest.raises(ConfigError, match=re.escape(expected)):
            ResultsStore(path).check()
        assert path.read_bytes() == before


def test_runs_remove_counts_a_directory_given_twice_once_and_an_empty_store_stays_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The second DELETE of one directory found nothing and said so ("no run of ..."); an
    empty store file became a store with a table, though nothing was removed."""
    store = ResultsStore(tmp_path / "results.sqlite")
    (tmp_path / "a").mkdir()
    store.add(_entry(1), kind="train", out_dir=tmp_path / "a")
    again = tmp_path / "x" / ".." / "a"
    assert main(["runs", "remove", str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.count("1 run removed") == 1
    assert store.rows() == []
    store.add(_entry(1), kind="train", out_dir=tmp_path / "a")
    (tmp_path / "x").mkdir()
    assert (
        main(["runs", "remove", str(tmp_path / "a"), str(again), "--store", str(store.path)]) == 0
    )
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    assert main(["runs", "remove", str(tmp_path / "a"), "--store", str(empty)]) == 2
    assert "Nothing was removed" in capsys.readouterr().err
    assert empty.read_bytes() == b""


def test_runs_remove_of_a_moved_folder_names_the_path_the_store_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ResultsStore(tmp_path / "old" / "results.sqlite")
    store.add(_entry(1), kind="train", out_dir=tmp_path / "old" / "a")
    argv = ["runs", "remove", str(tmp_path / "new" / "a"), "--store", str(store.path)]
    assert main(argv) == 2
    err = capsys.readouterr().err  # it said only "no run of ..."
    assert f"It records {tmp_path / 'old' / 'a'} of those names" in err
    assert len(store.rows()) == 1


@pytest.mark.parametrize("schema", [2, 3, 4])
def test_a_second_to_fourth_schema_store_gains_its_missing_columns_in_place(
    tmp_path: Path, schema: int
) -> None:
    path = tmp_path / "results.sqlite"
    store = ResultsStore(path)
    result = {
        "method": "laser",
        "dataset": "own files",
        "config": {"seed": 0},
        "metrics": {"mcar:0": {"accuracy": 91.0, "f1": 90.0}},
        "wall_time_s": 2.0,
        "parties": {"party-0": "bank", "party-1": "shop"},
        "checkpoints": {"every": 5, "resumed_from_step": 10},
    }
    store.add(result, kind="train", out_dir=tmp_path / "old")
    # schema 2 kept no parties, 3 no checkpoints, 4 not whether the code was the commit's
    with sqlite3.connect(path) as connection:
        connection.execute("ALTER TABLE runs DROP COLUMN git_modified")
        if schema <= 3:
            connection.execute("ALTER TABLE runs DROP COLUMN checkpoints")
        if schema == 2:
            connection.execute("ALTER TABLE runs DROP COLUMN parties")
        connection.execute(f"PRAGMA user_version = {schema}")
    connection.close()
    store.check()
    store.add(result, kind="train", out_dir=tmp_path / "new")
    rows = store.rows()
    old_parties = None if schema == 2 else result["parties"]
    assert [r["parties"] for r in rows] == [old_parties, result["parties"]]
    old_checkpoints = None if schema <= 3 else result["checkpoints"]
    assert [r["checkpoints"] for r in rows] == [old_checkpoints, result["checkpoints"]]
    assert [r["git_modified"] for r in rows] == [None, provenance()["git_modified"]]
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    connection.close()


def test_a_store_another_program_holds_is_named_busy_not_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store locked by another program's write for longer than a command waits was called
    no results store ("expected a results store written by secure-vfl or a new path", exit 2),
    as if it were another file: it is one the system holds (exit 1), to try again."""
    from secure_vfl.errors import OutputError

    path = tmp_path / "results.sqlite"
    ResultsStore(path).add(_entry(0), kind="train", out_dir=tmp_path / "old")
    monkeypatch.setattr(secure_vfl.store, "BUSY_SECONDS", 0.05)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        for use in (
            lambda: ResultsStore(path).rows(),
            lambda: ResultsStore(path).add(_entry(1), kind="train", out_dir=tmp_path / "new"),
        ):
            with pytest.raises(OutputError, match="is held by another program's write"):
                use()
    finally:
        holder.close()
    assert [row["seed"] for row in ResultsStore(path).rows()] == [0]


@pytest.mark.parametrize("schema", [0, 4])
def test_an_old_store_that_another_command_migrates_meanwhile_keeps_its_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schema: int
) -> None:
    """Two commands started at once on an old store both read its columns, then both migrated
    it: the second's ADD COLUMN failed its command ("duplicate column name"), and a first
    schema's rewrite, run again over the migrated table, emptied the columns of a run the
    other command had recorded in between (its parties, its provenance)."""
    path = tmp_path / "results.sqlite"
    if schema == 0:
        metrics = json.dumps({"mcar:0": {"accuracy": 90.0, "f1": 88.0}})
        _first_schema_store(path, [(json.dumps({"seed": 0}), metrics, str(tmp_path / "old"))])
    else:
        ResultsStore(path).add(_entry(0), kind="train", out_dir=tmp_path / "old")
        with sqlite3.connect(path) as connection:
            connection.execute("ALTER TABLE runs DROP COLUMN git_modified")
            connection.execute("PRAGMA user_version = 4")
        connection.close()
    other = {**_entry(1), "parties": {"party-0": "bank", "party-1": "shop"}}
    connect = sqlite3.connect
    interleaved: list[bool] = []

    class OtherCommandBetween(sqlite3.Connection):
        """This command's connection: the other command migrates the store and records its
        run right after this one first read the store's columns."""

        def execute(self, sql: str, *parameters: Any) -> Any:
            cursor = super().execute(sql, *parameters)
            if not sql.startswith("PRAGMA table_info") or interleaved:
                return cursor
            interleaved.append(True)
            columns = cursor.fetchall()
            ResultsStore(path).add(other, kind="train", out_dir=tmp_path / "new")
            return iter(columns)

    def connecting(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        kwargs.setdefault("factory", OtherCommandBetween if not interleaved else sqlite3.Connection)
        return connect(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connecting)
    ResultsStore(path).check()
    monkeypatch.undo()
    assert interleaved
    rows = ResultsStore(path).rows()
    assert [row["out_dir"] for row in rows] == [str(tmp_path / "old"), str(tmp_path / "new")]
    assert rows[1]["parties"] == other["parties"]
    assert rows[1]["version"] == provenance()["version"]


def test_a_store_of_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "results.sqlite"
    with sqlite3.connect(path) as connection:
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    connection.close()
    with pytest.raises(ConfigError, match="newer than this secure-vfl"):
        ResultsStore(path).check()


def test_a_damaged_store_is_refused_before_the_run_not_after_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A damaged page passed the check: the run trained, wrote its results, then failed with a
    # traceback from sqlite3 when it recorded itself (and `runs list` with another).
    path = tmp_path / "results.sqlite"
    ResultsStore(path)._connect().close()  # an empty store of the current schema
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE notes (text TEXT)")
        connection.executemany("INSERT INTO notes VALUES (?)", [("x" * 500,)] * 40)
    connection.close()
    ResultsStore(path).check()  # intact
    with path.open("r+b") as handle:
        handle.seek(4096)
        handle.write(b"\xff" * 90)
    with pytest.raises(ConfigError, match=r"is damaged \(SQLite's check: "):
        ResultsStore(path).check()
    out = tmp_path / "run"
    argv = ["train", "--method", "standard", "--dataset", "iris", "--epochs", "1", "--quiet"]
    assert main([*argv, "--out", str(out), "--store", str(path)]) == 2
    assert main(["runs", "list", "--store", str(path)]) == 2
    assert capsys.readouterr().err.count("is damaged") == 2
    assert not out.exists()


def test_compare_names_the_dataset_only_when_the_runs_do_not_share_one() -> None:
    from secure_vfl.runs import RunSummary, table

    def run(dataset: str) -> RunSummary:
        return RunSummary("train", "laser", dataset, "none", "none", None, {"mcar:0": 0.9})

    same = table(["a", "b"], [run("wine"), run("wine")]).splitlines()
    assert same[0].split()[:3] == ["run", "method", "backend"]
    mixed = table(["a", "b"], [run("wine"), run("iris")]).splitlines()
    assert mixed[0].split()[:4] == ["run", "method", "dataset", "backend"]
    assert [line.split()[:4] for line in mixed[1:]] == [
        ["a", "laser", "wine", "none"],
        ["b", "laser", "iris", "none"],
    ]


def test_the_parties_column_names_own_files_parties_deployed_or_not() -> None:
    from secure_vfl.runs import _user_party_names

    # In one process the actors are party-k, mapped to the files' names; deployed, each actor
    # carries its federation name; a registered dataset's parties have no other name.
    assert _user_party_names({"party-0": "bank", "party-1": "shop"}) == ("bank", "shop")
    assert _user_party_names({"bank": "bank", "shop": "shop"}) == ("bank", "shop")
    assert _user_party_names({"party-0": "party-0", "party-1": "party-1"}) == ()
    assert _user_party_names(None) == ()


def test_another_programs_database_is_refused_and_listing_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as connection:
        connection.execute("CREATE TABLE laps (lap INTEGER, seconds REAL)")
    connection.close()
    before = other.read_bytes()
    assert main(["runs", "list", "--store", str(other)]) == 2
    assert "another program's database (tables laps, no `runs` table)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="another program's database"):
        ResultsStore(other).check()  # what train and the others call before they write
    assert other.read_bytes() == before
    empty = tmp_path / "empty.sqlite"
    empty.touch()  # an empty file is an empty SQLite database: nothing to list, nothing written
    assert main(["runs", "list", "--store", str(empty)]) == 0
    assert "no runs" in capsys.readouterr().out and empty.stat().st_size == 0


def test_every_run_writes_its_plots_and_epsilon_over_epochs_under_dp(tmp_path: Path) -> None:
    train(tmp_path / "plain")
    train(tmp_path / "dp", "--dp-gradients", "1.0:0.05", "--epochs", "3")
    for name in ("loss.png", "accuracy.png"):
        assert (tmp_path / "plain" / name).read_bytes()[:8] == PNG
        assert (tmp_path / "dp" / name).read_bytes()[:8] == PNG
    assert not (tmp_path / "plain" / "epsilon.png").exists()
    assert (tmp_path / "dp" / "epsilon.png").read_bytes()[:8] == PNG
    privacy = json.loads((tmp_path / "dp" / "result.json").read_text())["privacy"]
    for party, curve in privacy["epsilon_per_epoch"].items():
        assert len(curve) == 3 and curve == sorted(curve) and curve[0] > 0
        assert curve[-1] == pytest.approx(privacy["epsilon"][party])
    assert not list(tmp_path.glob("**/*.tmp"))  # written atomically


def test_collapsed_predictions_are_detected_per_test_split(make_data) -> None:  # type: ignore[no-untyped-def]
    data = make_data(parties=2, test_missing=("mcar:0", "mcar:0.5"))
    constant = {name: np.where(s.mask, 2, -1) for name, s in data.tests.items()}
    warnings = collapse_warnings(constant, data)
    assert len(warnings) == 2 and "'mcar:0' collapsed to one class (label 2 for" in warnings[0]
    # DP noise is suggested only where the run had some
    assert warnings[0].endswith("expected more --epochs or another --lr.")
    noised = collapse_warnings(constant, data, noised=True)[0]
    assert noised.endswith("expected more --epochs, another --lr or less DP noise.")
    # The label file's own value, not the class index.
    named = dataclasses.replace(data, classes=tuple(f"kind-{c}" for c in range(data.num_classes)))
    assert "collapsed to one class (label 'kind-2' for" in collapse_warnings(constant, named)[0]
    varied = {name: np.where(s.mask, s.labels[:, None], -1) for name, s in data.tests.items()}
    assert collapse_warnings(varied, data) == []


def test_a_run_that_collapses_to_one_class_warns_and_says_so_in_result_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    predict = secure_vfl.experiment.predict_tests

    def constant(method, data):  # type: ignore[no-untyped-def]
        return {name: np.where(p >= 0, 0, -1) for name, p in predict(method, data).items()}

    monkeypatch.setattr(secure_vfl.experiment, "predict_tests", constant)
    train(tmp_path / "run")
    err = capsys.readouterr().err
    assert "secure-vfl: warning: predictions on test split 'mcar:0' collapsed" in err
    warnings = json.loads((tmp_path / "run" / "result.json").read_text())["warnings"]
    assert len(warnings) == 2 and all("collapsed to one class" in w for w in warnings)
    # a run without DP is not told to use less DP noise (the CLI always has a privacy engine)
    assert all(w.endswith("expected more --epochs or another --lr.") for w in warnings)


def test_compare_refuses_a_directory_without_a_training_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", "compare", str(tmp_path)]) == 2
    assert "holds no result.json; expected a run directory" in capsys.readouterr().err
    assert main(["runs", "compare", str(tmp_path / "typo")]) == 2
    assert "a run directory expected, found nothing there" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert main(["runs", "compare", str(tmp_path / "notes.txt")]) == 2
    assert "a run directory expected, found a file" in capsys.readouterr().err
    assert main(["runs", "list", "--store", str(tmp_path / "none.sqlite")]) == 2
    assert "no results store at" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"config": 1.5}, "config: an object expected, found float"),
        ({"metrics": [1]}, "metrics: an object expected, found list"),
        ({"privacy": {"epsilon": {"party-0": "x"}}}, "privacy.epsilon: a number per party"),
        ({"privacy": {"noise": True}}, "privacy.noise: an object expected, found bool"),
        ({"privacy": {"noise": {"gradient": {"sigma": 1}}}}, "privacy.noise.gradient: a sigma"),
        ({"config": {"privacy": {"dp_gradients": 3}}}, "config.privacy.dp_gradients: a sigma"),
        ({"wall_time_s": {}}, "wall_time_s: a number expected"),
        # these ended in a traceback (an unhashable seed; an int no float holds)
        ({"config": {"seed": [1]}}, "config.seed: an integer expected, found [1]"),
        ({"wall_time_s": 10**400}, "wall_time_s: a number expected"),
        ({"privacy": {"epsilon": {"party-0": 10**400}}}, "privacy.epsilon: a number per party"),
        # these showed "-" for every accuracy, and exit 0
        ({"metrics": {}}, "metrics: an accuracy per test missingness expected, found none"),
        ({"metrics": {"mcar:0": "x"}}, "metrics.mcar:0.accuracy: a number expected, found 'x'"),
        ({"metrics": {"mcar:0": {"f1": 1}}}, "metrics.mcar:0.accuracy: a number expected"),
    ],
)
def test_compare_refuses_a_malformed_result_naming_the_file_and_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object], message: str
) -> None:
    """A result.json edited by hand is the user's file: a field of another shape is one line
    naming it, not a traceback from formatting the table."""
    metrics = {"mcar:0": {"accuracy": 90.0}}
    result = {"epoch_loss": [1.0], "method": "laser", "metrics": metrics, "wall_time_s": 1.0}
    (tmp_path / "result.json").write_text(json.dumps(result))
    assert main(["runs", "compare", str(tmp_path)]) == 0  # as written, it reads
    capsys.readouterr()
    (tmp_path / "result.json").write_text(json.dumps({**result, **change}))
    assert main(["runs", "compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "result.json") in err and message in err


def test_a_store_this_user_may_not_write_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It used to end in a traceback from sqlite after every output was written. (Root may
    write anything: the check is os.access, stood in for here.)"""
    import os

    store = tmp_path / "stores" / "results.sqlite"
    train(tmp_path / "first", "--store", str(store))
    for read_only in (store, store.parent):
        monkeypatch.setattr(os, "access", lambda path, mode, ro=read_only: Path(path) != ro)
        argv = ["train", "--method", "laser", "--dataset", "wine", "--epochs", "1", "--quiet"]
        # the system's refusal, said before the run: exit 1, as where the run met it
        assert main([*argv, "--out", str(tmp_path / "second"), "--store", str(store)]) == 1
        err = capsys.readouterr().err
        what = "the file" if read_only == store else "its folder"
        assert f"a results store this user may write expected; {what} is read-only" in err, err
        assert not (tmp_path / "second").exists()
    monkeypatch.undo()
    assert main(["runs", "list", "--store", str(store)]) == 0  # reading needs no write access


def test_an_attack_runs_accuracies_are_both_percentages() -> None:
    """`runs list` showed an attack's accuracy as a share (0.10) beside its main accuracy in %
    (75.49)."""
    from secure_vfl.runs import summarise

    entry = {
        "config": {"method": "laser", "privacy": {}},
        "metrics": {"main": {"accuracy": 0.7549}, "attack": {"accuracy": 0.0991, "rows": 1438}},
    }
    summary = summarise(entry, kind="attack:direct-label-inference")
    assert summary.accuracy == pytest.approx({"main": 75.49, "attack": 9.91})
    scored = {**entry, "metrics": {"main": {"accuracy": 0.7}, "attack": {"auc": 0.98}}}
    assert summarise(scored, kind="attack:norm-scoring").accuracy == pytest.approx({"main": 70.0})


def test_attack_runs_show_their_attack_defense_and_score() -> None:
    """`runs list` showed an attack's runs under MARVELL, sparsification and its negative
    control alike (`dp none`), without the attack's score."""
    from secure_vfl.runs import summarise, table

    def attack(defense: str, control: bool, performance: float) -> dict[str, object]:
        return {
            "attack_name": "norm-scoring",
            "defenses": [defense] if defense else [],
            "control": control,
            "main": {"accuracy": 0.9},
            "attack": {"auc": performance},
            "performance": performance,
            "chance": 0.5,
            "dcs_chance": 0.75,
            "training": {"config": {"method": "laser", "privacy": {}}},
        }

    plain = summarise(attack("", False, 0.95))
    marvell = summarise(attack("marvell:4", False, 0.55))
    control = summarise(attack("", True, 0.5))
    assert (plain.attack, plain.defense, plain.score) == ("norm-scoring", "", (0.95, 0.5, 0.75))
    assert marvell.defense == "marvell:4" and control.attack == "norm-scoring, control"
    # DP and secure sums have their own columns; other defenses are listed in order
    entry = {
        "config": {
            "method": "laser",
            "privacy": {},
            "defense": "dp-gradients:1:0.01, norm-filter:3, secure-agg:masks",
        },
        "metrics": {"main": {"accuracy": 0.9}, "attack": {"auc": 0.6}},
    }
    stored = summarise(entry, kind="sweep:norm-scoring")
    assert stored.defense == "norm-filter:3" and stored.backend == "masks"
    assert stored.score is None  # stored before the score was: shown as "-"
    header, *rows = table(["a", "b", "c", "d"], [plain, marvell, control, stored]).splitlines()
    assert header.split() == [
        *["run", "method", "attack", "defense", "backend", "dp", "epsilon", "acc", "main"],
        *["AP", "chance", "DCS", "vs", "chance", "time", "s"],
    ]
    assert rows[1].split()[3:4] == ["marvell:4"]
    assert rows[1].split()[-4:-1] == ["0.550", "0.500", "0.750"]
    assert rows[2].split()[2:4] == ["norm-scoring,", "control"]
    assert rows[3].split()[-4:] == ["-", "-", "-", "-"]
    training = summarise({"config": {"method": "laser", "privacy": {}}, "metrics": {}})
    assert training.attack == "" and "attack" not in table(["t"], [training])
    # An attack scored by accuracy: its result.json (`runs compare`) shows it as its store
    # entry (`runs list`) does; compare dropped the column.
    result = {**attack("", False, 1.0), "attack": {"accuracy": 1.0}}
    entry = {**result["training"], "metrics": {"main": result["main"], "attack": result["attack"]}}
    assert summarise(result).accuracy == summarise(entry, kind="attack:x").accuracy
    assert summarise(result).accuracy == {"main": 90.0, "attack": 100.0}


def test_runs_that_were_trained_differently_say_how() -> None:
    """A run under dirichlet missingness on 20 labels looked like one with the defaults."""
    from secure_vfl.runs import summarise, table

    def entry(train: str, epochs: int, **method: int) -> dict[str, object]:
        config = {"epochs": epochs, "labeled": None, "pretrain_epochs": 0, **method}
        return {
            "config": {"train_missing": train, "method_config": config, "privacy": {}},
            "metrics": {"mcar:0": {"accuracy": 80.0}},
        }

    plain = summarise(entry("mcar:0", 5))
    other = summarise(entry("dirichlet:inf", 1, labeled=20, pretrain_epochs=2))
    assert plain.trained == "mcar:0, 5 epochs"
    assert other.trained == "dirichlet:inf, 1 epoch, 20 labelled, pretrained 2"
    reserved = entry("mcar:0.2", 5, labeled=1000)
    reserved["config"]["aligned_labeled"] = 200  # type: ignore[index]
    assert summarise(reserved).trained == "mcar:0.2, 5 epochs, 1000 labelled, 200 kept aligned"
    lines = table(["a", "b"], [plain, other]).splitlines()
    assert "trained" in lines[0] and "dirichlet:inf, 1 epoch" in lines[2]
    assert "trained" not in table(["a", "b"], [plain, plain]).splitlines()[0]  # alike: no column
    edited = entry("mcar:0", 5)
    edited["config"]["method_config"]["epochs"] = True  # type: ignore[index]
    assert summarise(edited).trained == "mcar:0"  # it read "mcar:0, True epoch"


def test_runs_that_differ_in_a_setting_show_it(tmp_path: Path) -> None:
    """Runs with another --lr or --batch-size read as the same run in `runs compare`."""
    from secure_vfl.runs import summarise, summarise_run, table

    base = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    runs = {
        "a": [],
        "b": ["--lr", "0.1"],
        "c": ["--batch-size", "32", "--heads", "active"],
    }
    for name, flags in runs.items():
        assert main([*base, *flags, "--out", str(tmp_path / name)]) == 0
    summaries = [summarise_run(tmp_path / name) for name in runs]
    header, *rows = table(list(runs), summaries).splitlines()
    start = header.index("settings")
    cells = [row[start : header.index("backend")].strip() for row in rows]
    assert cells == [
        "batch-size 128, heads all, lr 0.03",
        "batch-size 128, heads all, lr 0.1",
        "batch-size 32, heads active, lr 0.03",
    ]
    # alike in every setting: no column; an imputation run's own settings count
    assert "settings" not in table(["a", "a"], summaries[:1] * 2).splitlines()[0]
    imputed = [
        summarise(
            {"config": {"method": "fedhf", "clients": 4, "impute_config": {"lr": lr, "rounds": 3}}}
        )
        for lr in (0.001, 0.1)
    ]
    assert [dict(s.settings) for s in imputed] == [
        {"clients": "4", "lr": "0.001", "rounds": "3"},
        {"clients": "4", "lr": "0.1", "rounds": "3"},
    ]
    assert "lr 0.1" in table(["x", "y"], imputed).splitlines()[2]
    # a setting of one method is not shown for another, which does not use it
    dropout = {"plug_dropout": 0.5, "standard_incomplete": "random"}
    plug, laser = (
        summarise({"config": {"method": method, "method_config": dropout}})
        for method in ("plugvfl", "laser")
    )
    assert dict(plug.settings) == {"plug-dropout": "0.5"} and laser.settings == ()
    # nor one the method keeps at its default: FALSE-VFL's lr, a mean imputer's rounds
    split = {"lr": 0.03, "representation_dim": 128, "top_model": "linear", "batch_size": 64}
    false_vfl = summarise({"config": {"method": "false-vfl-1", "method_config": split}})
    assert dict(false_vfl.settings) == {"batch-size": "64"}
    mean = summarise({"config": {"method": "mean", "impute_config": {"rounds": 30}}})
    assert mean.settings == ()
    # 0.1 and 0.1000004 are different rates
    assert _lr_cells([0.1, 0.1000004]) == ["lr 0.1", "lr 0.1000004"]


def _lr_cells(rates: list[float]) -> list[str]:
    from secure_vfl.runs import summarise, table

    summaries = [
        summarise({"config": {"method": "laser", "method_config": {"lr": lr}}}) for lr in rates
    ]
    header, *rows = table([str(i) for i in range(len(rates))], summaries).splitlines()
    start, end = header.index("settings"), header.index("backend")
    return [row[start:end].strip() for row in rows]


def test_runs_show_the_settings_behind_their_test_rows_epsilon_and_attacker() -> None:
    """Runs that differed in --test-fraction, --delta, --dp-adjacency or --attacker looked
    alike: their accuracies, epsilons or attack scores read as like for like."""
    from secure_vfl.runs import summarise

    own = {"method": "laser", "party_files": ["a.csv", "b.csv"], "test_fraction": 0.5}
    assert dict(summarise({"config": own}).settings)["test-fraction"] == "0.5"
    dataset = {"method": "laser", "test_fraction": None, "missing_cells": "mean-indicator"}
    assert summarise({"config": dataset}).settings == ()  # a dataset's own split
    privacy = {"delta": 1e-7, "adjacency": "add-remove", "dp_gradients": [1.0, 0.01]}
    noised = summarise({"config": {"method": "laser", "privacy": privacy}})
    assert dict(noised.settings) == {"delta": "1e-07", "dp-adjacency": "add-remove"}
    plain = summarise({"config": {"method": "laser", "privacy": {**privacy, "dp_gradients": None}}})
    assert plain.settings == ()  # nothing was priced
    result = {
        "attack_name": "norm-scoring",
        "attacker": "party-2",
        "training": {"config": {"method": "standard"}},
    }
    assert dict(summarise(result).settings) == {"attacker": "party-2"}


def test_the_train_summary_keeps_its_columns_for_a_long_missingness_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long = "mcar:0.1,0.2,0.3,0.45"  # 21 characters: it ran into the accuracy column
    argv = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    assert main([*argv, "--missing-test", long, "--out", str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("test missingness"))
    header, row = lines[start], lines[start + 1]
    assert row.startswith(long + " ") and len(row) == len(header)  # numbers aligned right


def test_the_train_summary_says_standard_vfl_trains_only_on_the_samples_every_party_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It read "(train mcar:0.3, 120 training samples)", as if Standard VFL had used them all."""
    config = secure_vfl.experiment.TrainConfig(
        method="standard", dataset="iris", train_missing="mcar:0.3", test_missing=("mcar:0",)
    )
    mask = secure_vfl.experiment.prepare_data(config).train.mask
    held, complete = mask.shape[0], int(mask.all(axis=1).sum())
    assert 0 < complete < held
    argv = ["train", "--dataset", "iris", "--p-miss-train", "0.3", "--epochs", "1", "--quiet"]
    assert main([*argv, "--method", "standard", "--out", str(tmp_path / "s")]) == 0
    summary = capsys.readouterr().out.splitlines()[0]
    assert f", {held} training samples; trained on the {complete} held by every party)" in summary
    assert json.loads((tmp_path / "s" / "result.json").read_text())["trained_on"] == complete
    assert (
        main([*argv, "--method", "standard", "--labeled", "60", "--out", str(tmp_path / "l")]) == 0
    )
    summary = capsys.readouterr().out.splitlines()[0]
    labelled = json.loads((tmp_path / "l" / "result.json").read_text())["trained_on"]
    assert labelled < complete
    assert f", 60 labelled; trained on the {labelled} labelled ones held by every party)" in summary
    assert main([*argv, "--method", "plugvfl", "--out", str(tmp_path / "p")]) == 0
    assert f", {held} training samples) in" in capsys.readouterr().out.splitlines()[0]
    assert "trained_on" not in json.loads((tmp_path / "p" / "result.json").read_text())


def test_a_damaged_stored_run_is_named_with_its_store_and_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 0
    store = tmp_path / "results.sqlite"
    with sqlite3.connect(store) as connection:
        connection.execute("UPDATE runs SET config = json_set(config, '$.privacy', 5)")
    capsys.readouterr()
    assert main(["runs", "list", "--store", str(store)]) == 2
    error = capsys.readouterr().err  # it named neither the store nor the run
    assert f"--store {store}: run 1: config.privacy: an object expected" in error


def test_runs_list_names_a_run_by_its_path_from_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs named `run` in different folders of one store read as the same name."""
    argv = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    store = tmp_path / "results.sqlite"
    for folder in ("x", "y"):
        out = tmp_path / folder / "run"
        assert main([*argv, "--out", str(out), "--store", str(store)]) == 0
    capsys.readouterr()
    assert main(["runs", "list", "--store", str(store)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:3] for row in rows] == [
        ["1", "train", str(Path("x", "run"))],
        ["2", "train", str(Path("y", "run"))],
    ]


def test_the_runs_tables_lists_of_methods_are_the_methods_own() -> None:
    from secure_vfl.experiment import TrainConfig, build_method, prepare_data
    from secure_vfl.methods import METHODS, MethodConfig
    from secure_vfl.methods.imputation.fedhf import RECONSTRUCTIONS
    from secure_vfl.runs import MEAN_FUSION_METHODS, TRAINED_IMPUTERS

    assert set(TRAINED_IMPUTERS) == set(RECONSTRUCTIONS.names())
    taking = set()
    for name in METHODS.names():
        config = TrainConfig(
            method=name,
            dataset="iris",
            parties=2,
            method_config=MethodConfig(epochs=1, top_model="none", representation_dim=3),
        )
        try:
            build_method(config, prepare_data(config))
        except ConfigError as error:
            assert "top_model" in str(error)
        else:
            taking.add(name)
    assert taking == set(MEAN_FUSION_METHODS)


def test_a_two_stage_runs_loss_plot_draws_each_stage_as_its_own_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FALSE-VFL's epoch_loss holds stage 1's bound, then stage 2's: one line joined them."""
    from secure_vfl import plots

    drawn: dict[str, Any] = {}
    monkeypatch.setattr(plots, "_save", lambda figure, path: drawn.__setitem__(path.name, figure))
    payload: dict[str, Any] = {
        "method": "false-vfl-1",
        "dataset": "wine",
        "epoch_loss": [20.0, 19.5, 19.4, 3.0, 2.5],
        "metrics": {"mcar:0": {"accuracy": 80.0}},
        "config": {"method_config": {"epochs": 2}, "false_vfl": {"pretrain_epochs": 3}},
    }
    plots.write_run_plots(payload, tmp_path)
    lines = drawn["loss.png"].axes[0].get_lines()
    assert [list(line.get_xdata()) for line in lines] == [[1, 2, 3], [4, 5]]
    assert [line.get_label() for line in lines] == ["stage 1: -L_kappa", "stage 2: -L'_kappa"]
    plots.write_run_plots({**payload, "config": {"method_config": {"epochs": 2}}}, tmp_path)
    assert len(drawn["loss.png"].axes[0].get_lines()) == 1  # one stage: one curve


@pytest.mark.parametrize("method", ["laser", "false-vfl-1"])
def test_weight_decay_reaches_every_optimiser_of_every_party(method: str, tmp_path: Path) -> None:
    """The FALSE-VFL paper trains with weight decay 1e-4; no flag set it (always 0)."""
    from secure_vfl.experiment import TrainConfig, build_method, prepare_data
    from secure_vfl.methods import MethodConfig
    from secure_vfl.methods.base import in_process_parties

    argv = ["train", "--method", method, "--dataset", "iris", "--epochs", "1", "--quiet"]
    assert main([*argv, "--weight-decay", "1e-4", "--out", str(tmp_path / "r")]) == 0
    config = json.loads((tmp_path / "r" / "result.json").read_text())["config"]
    assert config["method_config"]["weight_decay"] == 1e-4
    run = TrainConfig(
        method=method,
        dataset="iris",
        parties=config["parties"],
        method_config=MethodConfig(epochs=1, weight_decay=1e-4),
    )
    method_object = build_method(run, prepare_data(run))
    decays = {
        group["weight_decay"]
        for party in in_process_parties(method_object.fed.channel)
        for optimiser in party.own_optimizers().values()
        for group in optimiser.param_groups
    }
    assert decays == {1e-4}, decays
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--weight-decay", "-1", "--out", str(tmp_path / "s")])
    assert refused.value.code == 2


def test_a_resumed_runs_time_says_it_is_the_resumed_part() -> None:
    """`runs compare` showed a resumed run's 0.9 s beside the uninterrupted run's 23.4 s with
    nothing to tell them apart."""
    from secure_vfl.runs import summarise, table

    entry = {"config": {"method": "laser", "privacy": {}}, "metrics": {}, "wall_time_s": 0.9}
    resumed = summarise({**entry, "checkpoints": {"resumed_from_step": 40}})
    fresh = summarise({**entry, "checkpoints": {"resumed_from_step": None}})
    assert resumed.resumed and not fresh.resumed and not summarise(entry).resumed
    lines = table(["resumed", "fresh"], [resumed, fresh]).splitlines()
    assert lines[1].endswith("0.9 (resumed)") and lines[2].endswith("0.9")


def test_runs_list_marks_a_resumed_run_from_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The store kept no checkpoint report, so `runs list` could not mark a resumed run."""
    store = ResultsStore(tmp_path / "results.sqlite")
    entry = {
        "method": "laser",
        "dataset": "digits",
        "config": {"seed": 0, "method": "laser", "privacy": {}},
        "metrics": {"mcar:0": {"accuracy": 90.0, "f1": 89.0}},
        "wall_time_s": 0.9,
    }
    store.add({**entry, "checkpoints": {"resumed_from_step": 40}}, kind="train", out_dir=None)
    store.add({**entry, "checkpoints": {"resumed_from_step": None}}, kind="train", out_dir=None)
    assert main(["runs", "list", "--store", str(tmp_path / "results.sqlite")]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert rows[0].endswith("0.9 (resumed)") and rows[1].endswith("0.9")


def test_the_table_shows_the_seed_where_the_runs_differ_in_it() -> None:
    # A sweep's runs of one setting at two seeds read as the same row twice.
    runs = [
        RunSummary(kind="sweep:x", method="laser", dataset="wine", backend="none", dp="none",
                   epsilon=None, seed=seed, attack="x", defense="")
        for seed in (0, 1)
    ]  # fmt: skip
    lines = table(["a", "b"], runs).splitlines()
    assert lines[0].split()[:3] == ["run", "method", "seed"]
    assert [line.split()[2] for line in lines[1:]] == ["0", "1"]
    same = table(["a", "b"], [runs[0], dataclasses.replace(runs[1], seed=0)])
    assert "seed" not in same.splitlines()[0]


def test_the_tables_accuracy_columns_keep_one_order_whatever_the_runs_order() -> None:
    """`runs list` (store order: a training run first) and `runs compare` (the order given: an
    attack run first) of the same runs put `acc main` after and before the training run's
    columns."""
    trained = RunSummary(
        kind="train",
        method="laser",
        dataset="wine",
        backend="none",
        dp="none",
        epsilon=None,
        accuracy={"mcar:0": 90.0, "mcar:0.5": 80.0},
    )
    attacked = RunSummary(kind="attack:x", method="laser", dataset="wine", backend="none",
                          dp="none", epsilon=None, attack="x",
                          accuracy={"attack": 60.0, "main": 85.0})  # fmt: skip
    expected = ["acc main", "acc mcar:0", "acc mcar:0.5", "acc attack"]
    for runs in ([trained, attacked], [attacked, trained]):
        header = table(["a", "b"], runs).splitlines()[0]
        assert [column for column in expected if column in header] == expected
        assert sorted(expected, key=header.index) == expected
    # Two training runs of other test splits each (the review's case): one order either way.
    other = dataclasses.replace(trained, accuracy={"mcar:0.25": 70.0, "mcar:0.10": 75.0})
    expected = ["acc mcar:0", "acc mcar:0.10", "acc mcar:0.25", "acc mcar:0.5"]
    for runs in ([trained, other], [other, trained]):
        header = table(["a", "b"], runs).splitlines()[0]
        assert sorted(expected, key=header.index) == expected


def test_an_attacks_options_are_kept_and_tell_its_runs_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs of one attack that differed only in --attack-option had the same result.json
    configuration, store row and `runs compare` line."""
    store = ["--store", str(tmp_path / "results.sqlite")]
    argv = ["attack", "--attack", "gradient-replacement-backdoor", "--method", "laser"]
    argv += ["--dataset", "breast-cancer", "--heads", "active", "--epochs", "1", "--quiet"]
    argv += ["--cache", str(tmp_path / "cache"), *store]
    assert main([*argv, "--out", str(tmp_path / "default")]) == 0
    given = ["--attack-option", "gamma=3", "--attack-option", "target=0"]  # target: its default
    assert main([*argv, *given, "--out", str(tmp_path / "gamma")]) == 0
    default = json.loads((tmp_path / "default" / "result.json").read_text())
    gamma = json.loads((tmp_path / "gamma" / "result.json").read_text())
    assert default["options"] == {} and gamma["options"] == {"gamma": 3}
    assert default["parameters"]["gamma"] == 1.5 and gamma["parameters"]["gamma"] == 3
    assert {
        key for key in gamma["parameters"] if default["parameters"][key] != gamma["parameters"][key]
    } == {"gamma"}
    capsys.readouterr()
    assert main(["runs", "compare", str(tmp_path / "default"), str(tmp_path / "gamma")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "gradient-replacement-backdoor (gamma=3)" in lines[2]
    assert "(gamma" not in lines[1]
    assert main(["runs", "list", *store]) == 0
    listed = capsys.readouterr().out
    assert listed.count("gradient-replacement-backdoor (gamma=3)") == 1


def test_overwrite_leaves_no_file_of_the_run_it_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run without DP written over one with DP kept its epsilon.png, and an attack written over
    a training run left that run's model and plots beside the attack's result.json (`predict`
    then loaded the old model)."""
    out = tmp_path / "run"  # each run's store row in tmp_path/results.sqlite, beside it
    train = ["train", "--method", "laser", "--dataset", "iris", "--heads", "active"]
    train += ["--epochs", "1", "--quiet", "--out", str(out)]
    assert main([*train, "--dp-gradients", "1:0.01"]) == 0
    assert (out / "epsilon.png").is_file()
    assert main([*train, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "accuracy.png",
        "loss.png",
        "model",
        "result.json",
    ]
    before = (out / "result.json").read_bytes()
    capsys.readouterr()
    attack = ["attack", "--attack", "direct-label-inference", "--method", "laser"]
    attack += ["--dataset", "iris", "--heads", "active", "--top-model", "none"]
    attack += ["--representation-dim", "3", "--epochs", "1", "--quiet"]
    assert main([*attack, "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"{out} holds a train run ({out / 'result.json'}); --overwrite replaces a run" in err
    assert "Expected a new --out directory for the attack run" in err
    impute = ["impute", "--method", "mean", "--dataset", "airquality", "--quiet"]
    assert main([*impute, "--out", str(out), "--overwrite"]) == 2
    assert "holds a train run" in capsys.readouterr().err
    assert (out / "result.json").read_bytes() == before


def test_compare_takes_an_imputation_run_as_list_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`runs list` showed an imputation run with its RMSE; `runs compare` refused its folder:
    'is not the result of a training run (train or attack)'."""
    out = tmp_path / "imputed"
    impute = ["impute", "--method", "mean", "--dataset", "airquality", "--quiet"]
    assert main([*impute, "--out", str(out)]) == 0
    rmse = json.loads((out / "result.json").read_text())["rmse"]
    capsys.readouterr()
    assert main(["runs", "compare", str(out)]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert "RMSE" in header.split() and f"{rmse:.4f}" in row.split()
    assert main(["runs", "list", "--store", str(tmp_path / "results.sqlite")]) == 0
    assert f"{rmse:.4f}" in capsys.readouterr().out


def test_an_attacks_default_out_tells_seeds_its_control_and_defenses_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second seed, the negative control, or the same attack under a defense was refused by
    default: its `--out` (runs/attack-NAME-METHOD-DATASET) held the first run."""
    monkeypatch.chdir(tmp_path)
    argv = ["attack", "--attack", "gradient-replacement-backdoor", "--method", "laser"]
    argv += ["--dataset", "breast-cancer", "--heads", "active", "--epochs", "1", "--quiet"]
    defended = ["--defense", "norm-filter:3", "--defense", "gradient-sparsification:0.5"]
    secure = ["--secure-agg", "masks"]  # train's privacy flags are defenses too
    for extra in ([], ["--seed", "1"], ["--control"], defended, secure):
        assert main([*argv, *extra]) == 0, capsys.readouterr().err
    made = sorted(path.name for path in (tmp_path / "runs").iterdir() if path.is_dir())
    stem = "gradient-replacement-backdoor"
    assert [name for name in made if name.startswith("attack-")] == [
        f"attack-{stem}-control-laser-breast-cancer-s0",
        f"attack-{stem}-laser-breast-cancer-s0",
        f"attack-{stem}-laser-breast-cancer-s0-norm-filter-3-gradient-sparsification-0.5",
        f"attack-{stem}-laser-breast-cancer-s0-secure-agg-masks",
        f"attack-{stem}-laser-breast-cancer-s1",
    ]


def test_tables_keep_their_columns_in_line_after_wide_and_combining_characters() -> None:
    from types import SimpleNamespace

    from secure_vfl.cli import _feature_lines
    from secure_vfl.runs import columns, display_width

    korean = unicodedata.normalize("NFD", "한국어")  # as letters (macOS file names): 8 of them
    texts = ("ozone", "臭氧", "é", "e\u0301", "🙂", "", korean)
    assert [display_width(text) for text in texts] == [5, 4, 1, 1, 2, 0, 6]
    lines = columns([["name", "rmse"], ["臭氧濃度", "0.5"], ["e\u0301t\u00e9", "0.25"]], right=[1])
    # every row ends at the same terminal column: the right-aligned numbers line up
    assert len({display_width(line) for line in lines}) == 1, lines
    assert lines[1] == "臭氧濃度   0.5" and lines[2] == "e\u0301té" + " " * 7 + "0.25"
    # a cell a terminal would act on (a run directory's name, a party's) is escaped
    escaped = columns([["run", "time"], ["x\x1b[2J\nrm", "1.0"]])
    assert escaped[1] == "x\\x1b[2J\\nrm  1.0" and all(line.isprintable() for line in escaped)
    # impute's per-feature table, a feature named in Chinese among others
    result = SimpleNamespace(
        rmse_per_feature={"臭氧濃度": 0.5, "wind": 0.25},
        rmse_per_feature_in_units={"臭氧濃度": 2.0, "wind": 1.0},
        hidden_per_feature={"臭氧濃度": 3, "wind": 4},
    )
    table = _feature_lines(result)
    assert len({display_width(line) for line in table}) == 1, table
    assert table[1].startswith("臭氧濃度" + " " * 24 + "0.5000")


def test_runs_tell_apart_noise_levels_that_differ_in_the_fourth_digit() -> None:
    """SIGMA was shown to 3 significant digits: sigmas a target epsilon calibrated to 1.001 and
    1.002 were both `gradients 1:0.05` in `runs list` and `runs compare`."""
    from secure_vfl.runs import summarise

    def dp(sigma: float) -> str:
        return summarise({"config": {"privacy": {"dp_gradients": [sigma, 0.05]}}}).dp

    assert (dp(1.001), dp(1.002), dp(1.0)) == (
        "gradients 1.001:0.05",
        "gradients 1.002:0.05",
        "gradients 1:0.05",
    )
