"""The results store: one SQLite row per run, so sweeps can be queried and compared later."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at TEXT NOT NULL,
    kind TEXT NOT NULL,
    method TEXT NOT NULL,
    dataset TEXT NOT NULL,
    seed INTEGER,
    config TEXT NOT NULL,
    metrics TEXT NOT NULL,
    wall_time_s REAL NOT NULL,
    out_dir TEXT
)
"""


class ResultsStore:
    """Append-only store of run results in an SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path)
        connection.execute(SCHEMA)
        return connection

    def add(self, result: dict[str, Any], *, kind: str, out_dir: Path | None) -> int:
        """Insert one run in a single transaction; return its row id."""
        connection = self._connect()
        try:
            with connection:
                cursor = connection.execute(
                    "INSERT INTO runs (created_at, kind, method, dataset, seed, config, metrics, "
                    "wall_time_s, out_dir) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        datetime.now(UTC).isoformat(timespec="seconds"),
                        kind,
                        result["method"],
                        result["dataset"],
                        result["config"].get("seed"),
                        json.dumps(result["config"], sort_keys=True),
                        json.dumps(result["metrics"], sort_keys=True),
                        result["wall_time_s"],
                        str(out_dir) if out_dir is not None else None,
                    ),
                )
                return int(cursor.lastrowid or 0)
        finally:
            connection.close()

    def rows(self) -> list[dict[str, Any]]:
        """Every stored run, oldest first, with config and metrics decoded."""
        connection = self._connect()
        try:
            connection.row_factory = sqlite3.Row
            rows = connection.execute("SELECT * FROM runs ORDER BY id").fetchall()
        finally:
            connection.close()
        out = []
        for row in rows:
            entry = dict(row)
            entry["config"] = json.loads(entry["config"])
            entry["metrics"] = json.loads(entry["metrics"])
            out.append(entry)
        return out
