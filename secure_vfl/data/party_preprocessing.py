"""What one party does to its own raw rows before its bottom model reads them, kept as JSON.

A party's preprocessing is part of its saved model (:mod:`secure_vfl.saved_model`): the column
schema it was trained on (names, order, kind) and the steps that turn a raw row into a model input
(today: standardisation with its own training statistics). The JSON is versioned and built to
grow: a column's ``kind`` can later be ``"categorical"`` with its categories (a one-hot step), and
a step list can later hold an imputation policy, without changing what version 1 means.

Version 1::

    {"schema": "secure-vfl/party-preprocessing", "version": 1, "id_column": "id",
     "block_shape": [3], "columns": [{"name": "age", "kind": "numeric"}, ...],
     "steps": [{"step": "standardize", "mean": [...], "std": [...]}]}

``columns`` is null for an image block (no column names; ``block_shape`` is (C, H, W)).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from secure_vfl.data.party_files import ID_COLUMN, PartyTable
from secure_vfl.data.preprocessing import Standardizer
from secure_vfl.errors import DataError

PREPROCESSING_SCHEMA = "secure-vfl/party-preprocessing"
PREPROCESSING_VERSION = 1
COLUMN_KINDS = ("numeric",)
STEP_KINDS = ("standardize",)


@dataclass(frozen=True, kw_only=True)
class PartyPreprocessing:
    """One party's column schema and the standardisation fitted on its own training rows.

    ``columns`` are the feature columns in model order (None for an image block), ``mean`` and
    ``std`` have ``block_shape``; ``std`` is already floored (see
    :data:`~secure_vfl.data.preprocessing.STD_FLOOR`).
    """

    columns: tuple[str, ...] | None
    block_shape: tuple[int, ...]
    mean: np.ndarray
    std: np.ndarray
    id_column: str = ID_COLUMN

    def __post_init__(self) -> None:
        shape = tuple(self.block_shape)
        if self.mean.shape != shape or self.std.shape != shape:
            raise DataError(
                f"standardisation statistics of shape {shape} expected, found mean "
                f"{self.mean.shape} and std {self.std.shape}."
            )
        if not (np.isfinite(self.mean).all() and np.isfinite(self.std).all()):
            raise DataError("standardisation statistics must be finite. Found NaN or inf.")
        if bool((self.std <= 0).any()):
            raise DataError("standard deviations must be > 0. Found a value <= 0.")
        if self.columns is not None and (len(shape) != 1 or len(self.columns) != shape[0]):
            raise DataError(
                f"a tabular block of {len(self.columns)} columns expected shape "
                f"({len(self.columns)},), found {shape}."
            )

    @classmethod
    def from_standardizer(
        cls, scaler: Standardizer, *, columns: Sequence[str] | None, id_column: str = ID_COLUMN
    ) -> PartyPreprocessing:
        """The preprocessing of a block standardised by the fitted ``scaler``."""
        return cls(
            columns=None if columns is None else tuple(columns),
            block_shape=tuple(int(n) for n in scaler.mean.shape),
            mean=np.asarray(scaler.mean, dtype=np.float64),
            std=np.asarray(scaler.std, dtype=np.float64),
            id_column=id_column,
        )

    def transform(self, x: np.ndarray) -> np.ndarray:
        """Standardise raw rows ``x`` (N, *block_shape) exactly as in training: float32."""
        if tuple(x.shape[1:]) != self.block_shape:
            raise DataError(
                f"rows of shape {self.block_shape} expected, found {tuple(x.shape[1:])}."
            )
        return ((x.astype(np.float64, copy=False) - self.mean) / self.std).astype(np.float32)

    def check_columns(self, found: Sequence[str], where: str) -> None:
        """DataError naming the missing and the unexpected columns unless ``found`` holds exactly
        the saved columns (in any order)."""
        if self.columns is None:
            raise DataError(
                f"{where}: this party's model was trained on blocks of shape {self.block_shape} "
                "without column names; prediction reads party files with named columns only."
            )
        missing = [c for c in self.columns if c not in found]
        extra = [c for c in found if c not in self.columns]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if extra:
                parts.append(f"unexpected {extra}")
            raise DataError(
                f"{where}: the {len(self.columns)} columns this party's model was trained on "
                f"expected; found {' and '.join(parts)}."
            )

    def apply(self, table: PartyTable, where: str) -> np.ndarray:
        """The model input of a party file's rows: its columns checked against the schema,
        put in the saved order and standardised."""
        self.check_columns(table.columns, where)
        assert self.columns is not None
        order = [table.columns.index(c) for c in self.columns]
        return self.transform(table.features[:, order])

    def to_json(self) -> dict[str, Any]:
        """The versioned JSON form (floats round-trip exactly)."""
        return {
            "schema": PREPROCESSING_SCHEMA,
            "version": PREPROCESSING_VERSION,
            "id_column": self.id_column,
            "block_shape": list(self.block_shape),
            "columns": None
            if self.columns is None
            else [{"name": c, "kind": "numeric"} for c in self.columns],
            "steps": [
                {
                    "step": "standardize",
                    "mean": self.mean.reshape(-1).tolist(),
                    "std": self.std.reshape(-1).tolist(),
                }
            ],
        }

    @classmethod
    def from_json(cls, payload: Any, where: str) -> PartyPreprocessing:
        """Read the JSON form, refusing another schema, a newer version, an unknown column kind
        or step, or malformed values (DataError naming ``where``)."""
        if not isinstance(payload, Mapping):
            raise DataError(f"{where}: a JSON object expected, found {type(payload).__name__}.")
        if payload.get("schema") != PREPROCESSING_SCHEMA:
            raise DataError(
                f"{where}: schema {PREPROCESSING_SCHEMA!r} expected, found "
                f"{payload.get('schema')!r}."
            )
        if payload.get("version") != PREPROCESSING_VERSION:
            raise DataError(
                f"{where}: preprocessing version {PREPROCESSING_VERSION} expected (this "
                f"secure-vfl reads only it), found {payload.get('version')!r}."
            )
        try:
            shape = tuple(int(n) for n in payload["block_shape"])
            columns = payload["columns"]
            names = None
            if columns is not None:
                kinds = {str(c["kind"]) for c in columns}
                unknown = sorted(kinds - set(COLUMN_KINDS))
                if unknown:
                    raise DataError(
                        f"{where}: column kinds {list(COLUMN_KINDS)} expected, found {unknown}."
                    )
                names = tuple(str(c["name"]) for c in columns)
            steps = payload["steps"]
            step_kinds = [str(step["step"]) for step in steps]
            if step_kinds != list(STEP_KINDS):
                raise DataError(f"{where}: steps {list(STEP_KINDS)} expected, found {step_kinds}.")
            mean = np.asarray(steps[0]["mean"], dtype=np.float64).reshape(shape)
            std = np.asarray(steps[0]["std"], dtype=np.float64).reshape(shape)
            return cls(
                columns=names,
                block_shape=shape,
                mean=mean,
                std=std,
                id_column=str(payload["id_column"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, DataError):
                raise
            raise DataError(f"{where}: malformed preprocessing ({error!r}).") from None
