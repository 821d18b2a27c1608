"""The results store: one SQLite row per run, so runs can be listed, queried and compared later.

A row keeps the run's whole configuration (method, data, seeds, the privacy settings as given:
secure-sum backend, alignment and every DP flag), the epsilon each party spent, the package
version and the git commit it ran from. A run is keyed by its output directory (and, for
sweeps and suites that write many runs into one directory, an entry name), so writing a run
again (``--overwrite``) replaces its row instead of adding a second one.

Schema versions (``PRAGMA user_version``): 0/1, the first store (no privacy columns, one row per
write), is migrated in place on first use, and so are 2 (no ``parties``) and 3 (no
``checkpoints``: a run's checkpoint report, which says whether it resumed a killed run), whose
rows keep them empty; a newer version than this code knows is refused.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from secure_vfl.errors import ConfigError, OutputError
from secure_vfl.io import check_directory, file_kind
from secure_vfl.runs import provenance, summarise

SCHEMA_VERSION = 5

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_key TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL,
    kind TEXT NOT NULL,
    method TEXT NOT NULL,
    dataset TEXT NOT NULL,
    seed INTEGER,
    backend TEXT NOT NULL,
    dp TEXT NOT NULL,
    epsilon TEXT,
    epsilon_max REAL,
    version TEXT,
    git_commit TEXT,
    config TEXT NOT NULL,
    metrics TEXT NOT NULL,
    wall_time_s REAL NOT NULL,
    out_dir TEXT,
    parties TEXT,
    checkpoints TEXT,
    git_modified TEXT
)
"""
_ADDED_COLUMNS = ("parties", "checkpoints", "git_modified")
"""The columns added since schema 2 (in order: 3, 4, 5), each empty for the rows written before
(JSON text: ``git_modified`` is ``true`` or ``false``, empty where git could not tell)."""

_FIRST_COLUMNS = {
    "id",
    "created_at",
    "kind",
    "method",
    "dataset",
    "seed",
    "config",
    "metrics",
    "wall_time_s",
    "out_dir",
}
"""The columns of the first store (schema 0), which :meth:`ResultsStore.check` migrates."""

_SQLITE_HEADER = b"SQLite format 3\x00"


def run_key(out_dir: Path | None, entry: str = "") -> str:
    """The key of one run: its output directory, resolved (plus ``entry`` when a directory
    holds many runs); a run without a directory gets a fresh key of its own."""
    if out_dir is None:
        return f"no-dir:{uuid.uuid4()}"
    resolved = _stored_dir(out_dir)
    return f"{resolved}#{entry}" if entry else resolved


_INSERT = (
    "INSERT INTO runs (run_key, created_at, kind, method, dataset, seed, backend, dp, epsilon, "
    "epsilon_max, version, git_commit, config, metrics, wall_time_s, out_dir, parties, "
    "checkpoints, git_modified) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _stored_dir(directory: Path) -> str:
    """How the store records a run's directory (its ``out_dir`` column): resolved."""
    return str(Path(directory).resolve())


def _row(result: dict[str, Any], *, kind: str, out_dir: Path | None, entry: str) -> tuple[Any, ...]:
    """The values of ``result``'s row, in :data:`_INSERT`'s order."""
    summary = summarise(result, kind=kind)
    origin = result.get("provenance") or provenance()
    epsilon = (result.get("privacy") or {}).get("epsilon")
    return (
        run_key(out_dir, entry),
        datetime.now(UTC).isoformat(timespec="seconds"),
        kind,
        result["method"],
        result["dataset"],
        result["config"].get("seed"),
        summary.backend,
        summary.dp,
        json.dumps(epsilon, sort_keys=True) if epsilon is not None else None,
        summary.epsilon,
        origin.get("version"),
        origin.get("git_commit"),
        json.dumps(result["config"], sort_keys=True),
        json.dumps(result["metrics"], sort_keys=True),
        result["wall_time_s"],
        _stored_dir(out_dir) if out_dir is not None else None,
        json.dumps(result["parties"], sort_keys=True) if result.get("parties") else None,
        json.dumps(result["checkpoints"], sort_keys=True) if result.get("checkpoints") else None,
        None if origin.get("git_modified") is None else json.dumps(origin["git_modified"]),
    )


class ResultsStore:
    """The runs of one results store (an SQLite file), one row per run."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def check(self, *, create: bool = True) -> None:
        """Refuse (ConfigError) a path this store cannot use, before any run writes to it: a
        directory, a path under a file, a file that is not an SQLite database, another
        program's database (tables but no ``runs`` table), a ``runs`` table of another shape
        or a newer schema, and for a command that writes (``create``) a file or folder this user
        may not write in (SQLite writes its journal beside the file); migrate the first schema
        in place. Creates nothing when there is no store yet; with ``create=False`` (a command
        that only reads) it writes nothing to an SQLite file that has no ``runs`` table yet
        either."""
        if self.path.is_dir():
            raise ConfigError(f"--store {self.path} is a directory; expected an SQLite file path.")
        if self.path.exists() and not self.path.is_file():
            raise ConfigError(
                f"--store {self.path} is {file_kind(self.path)}; expected an SQLite file path."
            )
        if not self.path.exists():
            check_directory(f"--store {self.path}: its folder", self.path.parent)
            return  # created by the first run written
        if self.path.stat().st_size > 0:
            with self.path.open("rb") as handle:
                header = handle.read(len(_SQLITE_HEADER))
            if header != _SQLITE_HEADER:
                raise ConfigError(
                    f"--store {self.path} is not an SQLite database (it starts with "
                    f"{header[:8]!r}); expected a results store written by secure-vfl or a new "
                    "path."
                )
        if create:
            for what, path in (("the file", self.path), ("its folder", self.path.parent)):
                if not os.access(path, os.W_OK):
                    refusal = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
                    raise ConfigError(
                        f"--store {self.path}: a results store this user may write expected; "
                        f"{what} is read-only (a run would fail to record itself after its work)."
                    ) from refusal
        connection = self._connect(create=create)
        try:  # a damaged page reads as a database until the run records itself after its work
            verdict = connection.execute("PRAGMA quick_check").fetchone()[0]
        except sqlite3.DatabaseError as error:
            verdict = str(error)
        finally:
            connection.close()
        if verdict != "ok":
            raise ConfigError(
                f"--store {self.path} is damaged (SQLite's check: {str(verdict)[:120]}); expected "
                "an intact results store (restore it from a copy) or a new path."
            )

    def _connect(self, *, create: bool = True) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        made = not self.path.exists()
        connection = sqlite3.connect(self.path, timeout=BUSY_SECONDS)
        try:
            self._prepare(connection, create=create)
        except BaseException as error:
            connection.close()
            if made and self.path.is_file() and self.path.stat().st_size == 0:  # no run wrote it
                self.path.unlink(missing_ok=True)
            if not isinstance(error, sqlite3.DatabaseError):
                raise
            refusal = _refusal(error, self.path)
            if refusal is not None:
                raise OutputError(
                    f"--store {self.path} cannot be written: {error}; nothing was recorded."
                ) from refusal
            if _busy(error):  # not the store's fault: another program is writing to it
                raise OutputError(
                    f"--store {self.path} is held by another program's write ({error}) for "
                    f"longer than the {BUSY_SECONDS:g} s a command waits; nothing was read or "
                    "recorded: try again once it is done."
                ) from None
            raise ConfigError(
                f"--store {self.path} could not be used as a results store ({error}); expected "
                "a results store written by secure-vfl or a new path."
            ) from None
        return connection

    def _prepare(self, connection: sqlite3.Connection, *, create: bool = True) -> None:
        """Create the table (unless ``create`` is False), or migrate an older schema (the first:
        rewritten; the second to the fourth: the columns they lack added, empty for their rows);
        refuse what this code cannot read, and a database of other tables, which another program
        wrote."""
        version = int(connection.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise ConfigError(
                f"--store {self.path} has schema {version}, newer than this secure-vfl "
                f"({SCHEMA_VERSION}); expected a store written by this version or older."
            )
        columns = {row[1] for row in connection.execute("PRAGMA table_info(runs)")}
        if not columns:
            tables = [
                row[0]
                for row in connection.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
                )
            ]
            if "runs" in tables:  # made between the two reads, by a run that started with this
                return self._prepare(connection, create=create)
            if tables:
                shown = ", ".join(tables[:5]) + (
                    f" and {len(tables) - 5} more" if len(tables) > 5 else ""
                )
                raise ConfigError(
                    f"--store {self.path} is another program's database (tables {shown}, no "
                    "`runs` table); expected a results store written by secure-vfl or a new "
                    "path."
                )
            if not create:
                return
            with connection:
                connection.execute("BEGIN")  # the table and its version, or neither
                connection.execute(SCHEMA)
                connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            return
        if "run_key" in columns:
            missing = [column for column in _ADDED_COLUMNS if column not in columns]
            if missing:  # schema 2 to 4: what was not kept stays empty for their rows
                with connection:
                    connection.execute("BEGIN IMMEDIATE")  # every column and the version, or none
                    # read again under the write lock: a command that opened the store at the
                    # same time may have added them (a second ADD COLUMN failed that command)
                    present = {row[1] for row in connection.execute("PRAGMA table_info(runs)")}
                    for column in _ADDED_COLUMNS:
                        if column not in present:
                            connection.execute(f"ALTER TABLE runs ADD COLUMN {column} TEXT")
                    connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            return
        if not columns >= _FIRST_COLUMNS:
            raise ConfigError(
                f"--store {self.path} has a `runs` table that secure-vfl did not write (columns "
                f"{sorted(columns)}); expected a results store or a new path."
            )
        self._migrate_first_schema(connection)

    def _migrate_first_schema(self, connection: sqlite3.Connection) -> None:
        """Rewrite a schema-0 store in one transaction: every row gets the new columns (as far
        as its stored config tells them), and repeated rows of one run directory (what
        ``--overwrite`` used to leave) collapse to the latest. The rows are read under the
        write lock: a command that opened the store at the same time migrates it first (this
        one then finds it migrated) or waits."""
        with connection:
            connection.execute("BEGIN IMMEDIATE")
            if "run_key" in {row[1] for row in connection.execute("PRAGMA table_info(runs)")}:
                return  # migrated meanwhile (a rename of the new table failed this command)
            self._rewrite_first_schema(connection)

    def _rewrite_first_schema(self, connection: sqlite3.Connection) -> None:
        """:meth:`_migrate_first_schema`'s rewrite, inside its transaction."""
        connection.row_factory = sqlite3.Row
        old = [dict(row) for row in connection.execute("SELECT * FROM runs ORDER BY id")]
        connection.row_factory = None
        latest: dict[str, dict[str, Any]] = {}
        for row in old:
            if not isinstance(row["kind"], str):
                raise self._unreadable_row(row, "kind", "text")
            many = row["kind"].startswith(("sweep:", "suite:"))
            key = (
                f"legacy:{row['id']}"
                if row["out_dir"] is None or many
                else run_key(Path(row["out_dir"]))
            )
            latest[key] = row
        summaries = {}  # every row read before the store changes: one that cannot be, changes none
        for key, row in latest.items():
            payload = {}
            for cell in ("config", "metrics"):
                try:
                    payload[cell] = json.loads(row[cell])
                except (TypeError, ValueError, RecursionError):
                    raise self._unreadable_row(row, cell, "JSON") from None
            try:
                summaries[key] = summarise(payload, kind=row["kind"])
            except ConfigError as error:
                raise ConfigError(
                    f"--store {self.path}: run {row['id']}: {error} Expected a results store "
                    "written by secure-vfl; the store was left as it was."
                ) from None
        # DDL commits at once outside a transaction (Python's sqlite3 opens one only before a
        # row is written): without the caller's BEGIN, a failure left the table renamed and empty.
        connection.execute("ALTER TABLE runs RENAME TO runs_schema0")
        connection.execute(SCHEMA)
        for key, row in latest.items():
            summary = summaries[key]
            connection.execute(
                "INSERT INTO runs (id, run_key, created_at, kind, method, dataset, seed, "
                "backend, dp, epsilon, epsilon_max, version, git_commit, config, metrics, "
                "wall_time_s, out_dir) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                "?, ?)",
                (
                    row["id"],
                    key,
                    row["created_at"],
                    row["kind"],
                    row["method"],
                    row["dataset"],
                    row["seed"],
                    summary.backend,
                    summary.dp,
                    None,
                    None,
                    None,
                    None,
                    row["config"],
                    row["metrics"],
                    row["wall_time_s"],
                    row["out_dir"],
                ),
            )
        connection.execute("DROP TABLE runs_schema0")
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _unreadable_row(self, row: dict[str, Any], cell: str, expected: str) -> ConfigError:
        return ConfigError(
            f"--store {self.path}: run {row['id']}'s {cell} is not {expected} ({row[cell]!r:.40}); "
            "expected a results store written by secure-vfl. The store was left as it was."
        )

    def add(
        self,
        result: dict[str, Any],
        *,
        kind: str,
        out_dir: Path | None,
        entry: str = "",
    ) -> int:
        """Write one run in a single transaction, replacing the row of the same run (its
        ``out_dir`` and ``entry``) if there is one; return its row id.

        ``result`` is the run's ``result.json`` payload (``method``, ``dataset``, ``config``,
        ``metrics``, ``wall_time_s``; ``privacy``, ``parties``, ``checkpoints`` and
        ``provenance`` when present; the provenance of this process otherwise)."""
        row = _row(result, kind=kind, out_dir=out_dir, entry=entry)
        with self._writing() as connection:
            connection.execute("DELETE FROM runs WHERE run_key = ?", (row[0],))
            return int(connection.execute(_INSERT, row).lastrowid or 0)

    def replace_runs(self, out_dir: Path, runs: Sequence[tuple[dict[str, Any], str, str]]) -> None:
        """Make ``runs`` (``(result, kind, entry)`` each, as :meth:`add` takes them) the only
        rows of the runs written into ``out_dir`` (a sweep or suite, written again from
        scratch), in one transaction: a reader sees the old set of rows or the new one, never
        part of either."""
        rows = [
            _row(result, kind=kind, out_dir=out_dir, entry=entry) for result, kind, entry in runs
        ]
        with self._writing() as connection:
            connection.execute("DELETE FROM runs WHERE out_dir = ?", (_stored_dir(out_dir),))
            for row in rows:
                connection.execute("DELETE FROM runs WHERE run_key = ?", (row[0],))
                connection.execute(_INSERT, row)

    def remove(self, out_dirs: Sequence[Path]) -> dict[Path, int]:
        """Delete every row of the runs written into each of ``out_dirs`` (a run, sweep or
        suite directory, whether it still exists or not), in one transaction; return how many
        rows each had. ConfigError, and nothing deleted, where one of them has no row here."""
        stored: dict[str, Path] = {}  # one directory given twice (or by two paths) once
        for directory in out_dirs:
            stored.setdefault(_stored_dir(directory), directory)
        with self._writing(create=False) as connection:
            empty = not connection.execute("PRAGMA table_info(runs)").fetchall()
            removed = {
                directory: 0
                if empty
                else connection.execute("DELETE FROM runs WHERE out_dir = ?", (key,)).rowcount
                for key, directory in stored.items()
            }
            missing = [directory for directory, count in removed.items() if count == 0]
            if missing:
                recorded = [] if empty else connection.execute("SELECT out_dir FROM runs")
                names = {Path(directory).name for directory in missing}
                alike = sorted(
                    {d for (d,) in recorded if isinstance(d, str) and d and Path(d).name in names}
                )
                hint = (  # a folder moved or copied: the store records where it was written
                    f" It records {', '.join(alike[:5])} of those names (the path a run was "
                    "written to): give that path."
                    if alike
                    else ""
                )
                raise ConfigError(
                    f"no run of {', '.join(map(str, missing))} in {self.path}; expected "
                    "directories whose runs it records (`secure-vfl runs list`). Nothing was "
                    f"removed.{hint}"
                )
        return removed

    @contextmanager
    def _writing(self, *, create: bool = True) -> Iterator[sqlite3.Connection]:
        """A connection inside one transaction, committed when the block ends (rolled back if
        it raises); OutputError where SQLite could not write (a full disk). ``create``: make
        the table where there is none (:meth:`_prepare`)."""
        connection = self._connect(create=create)
        try:
            with connection:
                yield connection
        except sqlite3.OperationalError as error:
            raise OutputError(
                f"--store {self.path}: the run could not be recorded ({error}); its own outputs "
                "were written."
            ) from _refusal(error, self.path)
        finally:
            connection.close()

    def rows(self) -> list[dict[str, Any]]:
        """Every stored run, oldest first, with config, metrics and epsilon decoded (none, and
        nothing written, when the store has no ``runs`` table yet)."""
        connection = self._connect(create=False)
        try:
            if not connection.execute("PRAGMA table_info(runs)").fetchall():
                return []
            connection.row_factory = sqlite3.Row
            rows = connection.execute("SELECT * FROM runs ORDER BY id").fetchall()
        except sqlite3.DatabaseError as error:
            raise ConfigError(
                f"--store {self.path} could not be read ({error}); expected an intact results "
                "store (restore it from a copy)."
            ) from None
        finally:
            connection.close()
        return [self._decoded(dict(row)) for row in rows]

    def _decoded(self, entry: dict[str, Any]) -> dict[str, Any]:
        """A stored row with its JSON cells decoded; ConfigError naming the row and the column
        where a cell is not what this code writes (an edited or damaged store)."""
        for column in ("config", "metrics", "epsilon", *_ADDED_COLUMNS):
            cell = entry[column]
            if column not in ("config", "metrics") and not cell:
                entry[column] = None
                continue
            try:
                entry[column] = json.loads(cell)
            except (TypeError, ValueError):
                self._damaged(entry, column, "JSON text")
            if column in ("config", "metrics") and not isinstance(entry[column], dict):
                entry[column] = cell  # quoted as the store holds it
                self._damaged(entry, column, "a JSON object")
        for column in ("epsilon_max", "wall_time_s"):
            cell = entry[column]
            if not (cell is None or type(cell) in (int, float)):
                self._damaged(entry, column, "a number")
        for column in ("kind", "method", "dataset", "backend", "dp", "out_dir"):
            cell = entry[column]  # a blob there failed `runs list` with a traceback
            if not (isinstance(cell, str) or (cell is None and column == "out_dir")):
                self._damaged(entry, column, "text")
        return entry

    def _damaged(self, entry: dict[str, Any], column: str, expected: str) -> NoReturn:
        raise ConfigError(
            f"--store {self.path}: run {entry['id']}'s `{column}` holds {entry[column]!r:.40}; "
            f"expected {expected} (an intact results store: restore it from a copy)."
        )


BUSY_SECONDS = 5.0
"""How long a command waits for another's write to the store to end (SQLite's busy timeout)."""

_REFUSALS = {  # SQLite's codes for a refusal of the file system, as the errno of an OSError
    sqlite3.SQLITE_FULL: errno.ENOSPC,
    sqlite3.SQLITE_IOERR: errno.EIO,
    sqlite3.SQLITE_READONLY: errno.EROFS,
    sqlite3.SQLITE_PERM: errno.EPERM,
}


def _busy(error: sqlite3.Error) -> bool:
    """Whether SQLite's ``error`` says another connection holds a lock on the database."""
    code = getattr(error, "sqlite_errorcode", -1) & 0xFF
    return code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _refusal(error: sqlite3.Error, path: Path) -> OSError | None:
    """The file system's refusal behind SQLite's ``error`` (a full disk, an I/O error, a
    read-only file), as an OSError the CLI answers with its exit status for one; else None."""
    code = _REFUSALS.get(getattr(error, "sqlite_errorcode", -1) & 0xFF)
    return None if code is None else OSError(code, os.strerror(code), str(path))
