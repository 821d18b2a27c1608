"""What one party does to its own raw rows before its bottom model reads them, kept as JSON.

A party's preprocessing is part of its saved model (:mod:`secure_vfl.saved_model`): the column
schema it was trained on (names, order, kind) and the steps that turn a raw row into a model
input, every one fitted on the party's own training rows only:

1. **one-hot encoding** of each categorical (non-numeric) column over the categories seen in
   training; a category never seen in training encodes as all zeros, with a warning naming the
   column and the value;
2. **missing cells**, by a named policy: ``refuse`` (a missing cell is an error) or
   ``mean-indicator`` (a missing cell takes its column's training mean, a one-hot column its
   training frequency, and every column that had a missing cell in training gets one 0/1
   indicator column, appended after the encoded columns in column order);
3. **standardisation** with the training mean and standard deviation of every model input.

It also keeps each numeric column's training range (its smallest and largest value), so rows far
outside it warn (:data:`FAR_OUTSIDE`): a column in other units, or a corrupt cell, that the model
would extrapolate on in silence.

Version 3 (version 1, written before categorical columns and missing cells, is still read: its
columns are numeric and its policy ``refuse``; version 2 kept no ranges)::

    {"schema": "secure-vfl/party-preprocessing", "version": 3, "id_column": "id",
     "block_shape": [6],
     "columns": [{"name": "age", "kind": "numeric", "range": [18.0, 90.0]},
                 {"name": "city", "kind": "categorical", "categories": ["lyon", "paris"]}],
     "steps": [{"step": "missing-cells", "policy": "mean-indicator",
                "fill": [41.5, 0.4, 0.6], "indicators": ["age"]},
               {"step": "standardize", "mean": [...], "std": [...]}]}

``fill`` has one value per encoded column (before the indicators). A numeric column's ``range``
is null where none was kept (a built-in dataset's block). ``columns`` is null for an image block
(no column names; ``block_shape`` is (C, H, W); only the standardize step).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from secure_vfl.data.party_files import ID_COLUMN, PartyTable, alike_texts
from secure_vfl.data.preprocessing import Standardizer
from secure_vfl.errors import DataError, RunWarning
from secure_vfl.io import shown_names

PREPROCESSING_SCHEMA = "secure-vfl/party-preprocessing"
PREPROCESSING_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
COLUMN_KINDS = ("numeric", "categorical")
NUMERIC_BUT_FOR = 0.05
"""The largest share of text cells in a column otherwise of numbers that is named as stray
text (``n/a``, ``?``) rather than taken for categories without a word."""
MISSING_POLICIES = ("mean-indicator", "refuse")
DEFAULT_MISSING_POLICY = "mean-indicator"
MAX_CATEGORIES = 100
"""Most categories a categorical column may have: more is almost always an identifier or free
text (a name, an address), whose one-hot block would be as wide as the table."""
INDICATOR_SUFFIX = ":missing"
FAR_OUTSIDE = 1.0
"""A value is far outside its column's training range [lo, hi] when it lies beyond it by more
than this many widths hi - lo (any other value, for a column constant in training)."""


@dataclass(frozen=True, kw_only=True)
class PartyPreprocessing:
    """One party's column schema and the steps fitted on its own training rows.

    ``columns`` are the raw feature columns in model order (None for an image block);
    ``categories`` maps each categorical column to its training categories (one one-hot column
    each, in that order); ``missing_cells`` is the policy, ``fill`` (mean-indicator only) the
    value of every encoded column that replaces a missing cell, and ``indicators`` the columns
    that get a 0/1 missing-cell indicator; ``mean`` and ``std`` (already floored, see
    :data:`~secure_vfl.data.preprocessing.STD_FLOOR`) have ``block_shape``; ``ranges`` maps
    numeric columns to their training (smallest, largest) value (none kept: empty).
    """

    columns: tuple[str, ...] | None
    block_shape: tuple[int, ...]
    mean: np.ndarray
    std: np.ndarray
    id_column: str = ID_COLUMN
    categories: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    missing_cells: str = "refuse"
    fill: np.ndarray | None = None
    indicators: tuple[str, ...] = ()
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)

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
        if self.missing_cells not in MISSING_POLICIES:
            raise DataError(
                f"missing-cell policy one of {list(MISSING_POLICIES)} expected, found "
                f"{self.missing_cells!r}."
            )
        if self.columns is None:
            if self.categories or self.indicators or self.fill is not None or self.ranges:
                raise DataError("an image block has no categories, missing-cell steps or ranges.")
            return
        unknown = [c for c in [*self.categories, *self.indicators] if c not in self.columns]
        if unknown:
            raise DataError(
                f"categories and indicators of known columns expected; found {unknown}."
            )
        for column, (low, high) in self.ranges.items():
            if column not in self.columns or column in self.categories:
                raise DataError(f"ranges of numeric columns expected; found one for {column!r}.")
            if not (math.isfinite(low) and math.isfinite(high) and low <= high):
                raise DataError(
                    f"column {column!r}: a finite training range low <= high expected, found "
                    f"[{low}, {high}]."
                )
        width = len(self.encoded_columns)
        if shape != (width + len(self.indicators),):
            raise DataError(
                f"a tabular block of {width} encoded columns and {len(self.indicators)} "
                f"indicators expected shape ({width + len(self.indicators)},), found {shape}."
            )
        if self.missing_cells == "mean-indicator":
            if self.fill is None or self.fill.shape != (width,) or not np.isfinite(self.fill).all():
                raise DataError(f"{width} finite fill values expected for mean-indicator.")
        elif self.fill is not None or self.indicators:
            raise DataError("the refuse policy has no fill values or indicators.")

    # -- what the model reads ------------------------------------------------------------

    @property
    def encoded_columns(self) -> tuple[str, ...]:
        """The names of the encoded columns (before the indicators): a numeric column's own
        name, ``column=category`` for each one-hot column."""
        if self.columns is None:
            return ()
        names: list[str] = []
        for column in self.columns:
            if column in self.categories:
                names.extend(f"{column}={value}" for value in self.categories[column])
            else:
                names.append(column)
        return tuple(names)

    @property
    def input_columns(self) -> tuple[str, ...]:
        """The model input's column names: the encoded columns, then ``column:missing`` for
        every indicator."""
        return (*self.encoded_columns, *(f"{c}{INDICATOR_SUFFIX}" for c in self.indicators))

    # -- fitting on the party's own training rows ------------------------------------------

    @classmethod
    def from_standardizer(
        cls, scaler: Standardizer, *, columns: Sequence[str] | None, id_column: str = ID_COLUMN
    ) -> PartyPreprocessing:
        """The preprocessing of a numeric block standardised by the fitted ``scaler`` (no
        categorical columns, no missing cells)."""
        return cls(
            columns=None if columns is None else tuple(columns),
            block_shape=tuple(int(n) for n in scaler.mean.shape),
            mean=np.asarray(scaler.mean, dtype=np.float64),
            std=np.asarray(scaler.std, dtype=np.float64),
            id_column=id_column,
        )

    @classmethod
    def fit(
        cls,
        frame: pd.DataFrame,
        *,
        missing_cells: str = DEFAULT_MISSING_POLICY,
        id_column: str = ID_COLUMN,
        where: str,
    ) -> PartyPreprocessing:
        """Fit every step on ``frame``, the party's raw training rows (its feature columns as
        :func:`~secure_vfl.data.party_files.read_party_file` reads them). Refuses a column empty
        in every training row, a categorical column of more than :data:`MAX_CATEGORIES`
        categories, and (policy ``refuse``) any missing cell, naming ``where``."""
        if missing_cells not in MISSING_POLICIES:
            raise DataError(
                f"--missing-cells must be one of {list(MISSING_POLICIES)}. Found {missing_cells!r}."
            )
        columns = tuple(str(c) for c in frame.columns)
        empty = [c for c in columns if frame[c].isna().all()]
        if empty:
            raise DataError(
                f"{where}: column {empty[0]!r} is empty in every training row, so there is "
                "nothing to learn from it or to fill it with; expected values in some training "
                f"rows (drop the column). Empty: {empty}."
            )
        categories = {
            c: _categories(frame[c], c, where)
            for c in columns
            if not pd.api.types.is_numeric_dtype(frame[c])
        }
        missing = frame.isna().to_numpy()
        if missing_cells == "refuse" and missing.any():
            raise _missing_refusal(frame, missing, where)
        had_missing: list[bool] = list(np.asarray(missing.any(axis=0), dtype=bool))
        indicators = tuple(c for c, had in zip(columns, had_missing, strict=True) if had)
        width = sum(len(categories[c]) if c in categories else 1 for c in columns)
        encoding = cls(
            columns=columns,
            block_shape=(width,),
            mean=np.zeros(width),
            std=np.ones(width),
            categories=categories,
        )
        kept = indicators if missing_cells == "mean-indicator" else ()
        _refuse_shared_input_names(
            [*encoding.encoded_columns, *(f"{c}{INDICATOR_SUFFIX}" for c in kept)], where
        )
        encoded, _ = encoding.encode(frame, where)
        ranges = {}
        for column, values in zip(encoding.encoded_columns, encoded.T, strict=True):
            if column in columns and column not in categories:
                ranges[column] = (float(np.nanmin(values)), float(np.nanmax(values)))
        fill = None
        if missing_cells == "mean-indicator":
            fill = np.nanmean(encoded, axis=0) if encoded.shape[0] else np.zeros(encoded.shape[1])
        staged = _fill(encoded, fill)
        inputs = np.concatenate([staged, missing[:, [columns.index(c) for c in indicators]]], 1)
        scaler = Standardizer().fit(inputs)
        return cls(
            columns=columns,
            block_shape=(inputs.shape[1],),
            mean=np.asarray(scaler.mean, dtype=np.float64),
            std=np.asarray(scaler.std, dtype=np.float64),
            id_column=id_column,
            categories=categories,
            missing_cells=missing_cells,
            fill=fill,
            indicators=kept,
            ranges=ranges,
        )

    # -- applying it to rows ---------------------------------------------------------------

    def encode(self, frame: pd.DataFrame, where: str) -> tuple[np.ndarray, np.ndarray]:
        """The encoded columns of ``frame`` (its columns in the saved order) as float64 with NaN
        in every encoded column of a missing cell, and the (N, columns) missing-cell mask. A
        category unseen in training encodes as zeros and warns (:class:`RunWarning`)."""
        assert self.columns is not None
        parts = []
        for column in self.columns:
            values = frame[column]
            if column in self.categories:
                parts.append(self._one_hot(values, column, where))
                continue
            if not pd.api.types.is_numeric_dtype(values):
                numbers = pd.to_numeric(values, errors="coerce")
                bad = values[numbers.isna() & values.notna()]
                if len(bad):
                    raise DataError(
                        f"{where}: column {column!r} was numeric in training; found text such "
                        f"as {str(bad.iloc[0])!r}."
                    )
                values = numbers
            parts.append(values.to_numpy(dtype=np.float64, na_value=np.nan)[:, None])
        width = len(self.encoded_columns)
        encoded = np.concatenate(parts, axis=1) if parts else np.zeros((len(frame), width))
        missing = frame[list(self.columns)].isna().to_numpy()
        gone = np.asarray(missing.all(axis=0), dtype=bool).tolist()
        empty = [c for c, nothing in zip(self.columns, gone, strict=True) if nothing]
        if empty and len(frame) > 1:
            warnings.warn(
                f"{where}: column(s) {', '.join(map(repr, empty))} empty in every one of its "
                f"{len(frame)} rows: each cell is filled as a missing cell is (the training "
                "mean), which says nothing of these rows.",
                RunWarning,
                stacklevel=3,
            )
        return encoded, missing

    def _one_hot(self, values: pd.Series, column: str, where: str) -> np.ndarray:
        categories = self.categories[column]
        index = {value: position for position, value in enumerate(categories)}
        block = np.zeros((len(values), len(categories)), dtype=np.float64)
        missing = values.isna().to_numpy()
        block[missing] = np.nan
        unseen: dict[str, int] = {}
        aliases: dict[float, str] | None = None
        for row, value in enumerate(values.tolist()):
            if missing[row]:
                continue
            text = _category_text(value)
            if text not in index and isinstance(value, int | float):
                # A file whose cells of this column all look like numbers reads them as numbers:
                # 7 is the category `007` where no other category reads as 7 (True: `True`).
                aliases = aliases if aliases is not None else _numeric_aliases(categories)
                text = aliases.get(float(value), text)
            if text in index:
                block[row, index[text]] = 1.0
            else:
                unseen[text] = unseen.get(text, 0) + 1
        if unseen:
            examples = ", ".join(repr(v) for v in list(unseen)[:3])
            warnings.warn(
                f"{where}: column {column!r} has {len(unseen)} value(s) never seen in training "
                f"({examples}; {sum(unseen.values())} row(s)); they are encoded as no category "
                f"(all-zero one-hot){_near_categories(unseen, categories)}.",
                RunWarning,
                stacklevel=3,
            )
        return block

    def transform_frame(
        self, frame: pd.DataFrame, where: str, booleans: Sequence[str] = ()
    ) -> np.ndarray:
        """The model input of raw rows ``frame`` (the saved columns, any order), exactly as in
        training: encoded, missing cells handled by the saved policy, standardised; float32.
        ``booleans``: its columns that held True/False (:attr:`PartyTable.booleans`)."""
        if self.missing_cells == "refuse":
            own = frame[list(self.columns or ())]
            if own.isna().to_numpy().any():
                # rows scored by a saved model (predict takes no --missing-cells), or test rows
                raise _missing_refusal(
                    own,
                    own.isna().to_numpy(),
                    where,
                    advice="a model trained with --missing-cells mean-indicator fills them",
                )
        self._warn_true_false(frame, where, booleans)
        encoded, missing = self.encode(frame, where)
        self._warn_far_outside(encoded, where)
        if self.missing_cells == "refuse":
            inputs = encoded
        else:
            assert self.columns is not None
            indicator = missing[:, [self.columns.index(c) for c in self.indicators]]
            inputs = np.concatenate([_fill(encoded, self.fill), indicator], axis=1)
        return self.transform(inputs, where)

    def _warn_true_false(self, frame: pd.DataFrame, where: str, booleans: Sequence[str]) -> None:
        """Warn (:class:`RunWarning`) of True/False columns (``booleans``, or of bool dtype;
        read as 1/0) whose training values were other numbers: a column of another meaning,
        which no range check sees when 0 and 1 lie near the training range."""
        named = [
            f"{column!r} (training range [{low:g}, {high:g}])"
            for column, (low, high) in self.ranges.items()
            if column in frame.columns
            and (column in booleans or pd.api.types.is_bool_dtype(frame[column]))
            and not (low >= 0 and high <= 1)
        ]
        if named:
            warnings.warn(
                f"{where}: True/False columns read as 1/0 where the model was trained on other "
                f"numbers: {'; '.join(named[:3])}"
                f"{f'; and {len(named) - 3} more' if len(named) > 3 else ''}. Their predictions "
                "are unreliable; check that the columns are the ones trained on.",
                RunWarning,
                stacklevel=3,
            )

    def _warn_far_outside(self, encoded: np.ndarray, where: str) -> None:
        """Warn (:class:`RunWarning`) of rows with a value far outside its column's training
        range (:data:`FAR_OUTSIDE`), naming the columns, their ranges and the values found."""
        if not self.ranges:
            return
        far_rows = np.zeros(len(encoded), dtype=bool)
        named = []
        for position, column in enumerate(self.encoded_columns):
            if column not in self.ranges:
                continue
            low, high = self.ranges[column]
            values = encoded[:, position]
            margin = FAR_OUTSIDE * (high - low)
            with np.errstate(invalid="ignore", over="ignore"):
                far = (values < low - margin) | (values > high + margin)  # NaN: neither
            if far.any():
                far_rows |= far
                lowest, highest = values[far].min(), values[far].max()
                found = f"{lowest:g}" if lowest == highest else f"{lowest:g} to {highest:g}"
                named.append(f"{column!r} (training range [{low:g}, {high:g}], found {found})")
        if named:
            shown = "; ".join(named[:3]) + (
                f"; and {len(named) - 3} more" if len(named) > 3 else ""
            )
            warnings.warn(
                f"{where}: {int(far_rows.sum())} of {len(encoded)} rows hold values far outside "
                f"their column's training range (beyond it by more than its width): {shown}. "
                "The model extrapolates there, so their predictions are unreliable; check the "
                "columns' units and scale.",
                RunWarning,
                stacklevel=3,
            )

    def transform(self, x: np.ndarray, where: str = "rows") -> np.ndarray:
        """Standardise model inputs ``x`` (N, *block_shape) exactly as in training: float32.
        Refuses a value whose standardised form is beyond float32's range (DataError naming
        ``where`` and the column): the model would read it as infinite."""
        if tuple(x.shape[1:]) != self.block_shape:
            raise DataError(
                f"rows of shape {self.block_shape} expected, found {tuple(x.shape[1:])}."
            )
        scaled = (x.astype(np.float64, copy=False) - self.mean) / self.std
        with np.errstate(over="ignore", invalid="ignore"):
            inputs = scaled.astype(np.float32)
        beyond = ~np.isfinite(inputs) & ~np.isnan(scaled)
        if beyond.any():
            row, *at = (int(i[0]) for i in np.nonzero(beyond))
            names = self.input_columns
            column = f"column {names[at[0]]!r}" if names else f"position {tuple(at)}"
            raw = x[(row, *at)]
            raise DataError(
                f"{where}: {column} holds {raw:g}, beyond float32's range once standardised "
                f"(training mean {self.mean[tuple(at)]:g}, std {self.std[tuple(at)]:g}); "
                "expected values of the scale the model was trained on."
            )
        return inputs

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
            for what, names in (("missing", missing), ("unexpected", extra)):
                if names:  # a file of other columns may have thousands: the first few say it
                    parts.append(f"{what} {shown_names(names)}")
            raise DataError(
                f"{where}: the {len(self.columns)} columns this party's model was trained on "
                f"expected; found {' and '.join(parts)}."
            )

    def apply(self, table: PartyTable, where: str) -> np.ndarray:
        """The model input of a party file's rows: its columns checked against the schema,
        then :meth:`transform_frame`."""
        self.check_columns(table.columns, where)
        return self.transform_frame(table.frame, where, table.booleans)

    def describe(self) -> dict[str, Any]:
        """What was done to the party's columns, for the run's column report: the columns
        one-hot encoded (with their number of categories), the missing-cell policy and the
        columns that got an indicator, and the model input's width."""
        return {
            "columns": len(self.columns or ()),
            "encoded": {c: len(values) for c, values in self.categories.items()},
            "missing_cells": self.missing_cells,
            "indicators": list(self.indicators),
            "inputs": int(np.prod(self.block_shape)),
        }

    # -- JSON ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The versioned JSON form (floats round-trip exactly)."""
        steps: list[dict[str, Any]] = []
        if self.columns is not None:
            steps.append(
                {
                    "step": "missing-cells",
                    "policy": self.missing_cells,
                    "fill": None if self.fill is None else self.fill.tolist(),
                    "indicators": list(self.indicators),
                }
            )
        steps.append(
            {
                "step": "standardize",
                "mean": self.mean.reshape(-1).tolist(),
                "std": self.std.reshape(-1).tolist(),
            }
        )
        return {
            "schema": PREPROCESSING_SCHEMA,
            "version": PREPROCESSING_VERSION,
            "id_column": self.id_column,
            "block_shape": list(self.block_shape),
            "columns": None
            if self.columns is None
            else [
                _column_json(c, self.categories.get(c), self.ranges.get(c)) for c in self.columns
            ],
            "steps": steps,
        }

    @classmethod
    def from_json(cls, payload: Any, where: str) -> PartyPreprocessing:
        """Read the JSON form (version 1, 2 or 3), refusing another schema, a newer version, an
        unknown column kind, step or policy, or malformed values (DataError naming ``where``)."""
        if not isinstance(payload, Mapping):
            raise DataError(f"{where}: a JSON object expected, found {type(payload).__name__}.")
        if payload.get("schema") != PREPROCESSING_SCHEMA:
            raise DataError(
                f"{where}: schema {PREPROCESSING_SCHEMA!r} expected, found "
                f"{payload.get('schema')!r}."
            )
        version = payload.get("version")
        if version not in READABLE_VERSIONS:
            raise DataError(
                f"{where}: preprocessing version {' or '.join(map(str, READABLE_VERSIONS))} "
                f"expected (this secure-vfl reads only those), found {version!r}."
            )
        try:
            return cls._from_body(payload, where)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            if isinstance(error, DataError):
                raise
            reason = (
                f"the key {error.args[0]!r} expected, found none"
                if isinstance(error, KeyError) and error.args
                else str(error) or type(error).__name__
            )
            raise DataError(f"{where}: malformed preprocessing: {reason}.") from None

    @classmethod
    def _from_body(cls, payload: Mapping[str, Any], where: str) -> PartyPreprocessing:
        shape = tuple(int(n) for n in payload["block_shape"])
        columns = payload["columns"]
        names, categories, ranges = None, {}, {}
        if columns is not None:
            kinds = {str(c["kind"]) for c in columns}
            allowed = COLUMN_KINDS if payload["version"] >= 2 else ("numeric",)
            unknown = sorted(kinds - set(allowed))
            if unknown:
                raise DataError(f"{where}: column kinds {list(allowed)} expected, found {unknown}.")
            names = tuple(str(c["name"]) for c in columns)
            categories = {
                str(c["name"]): tuple(str(v) for v in c["categories"])
                for c in columns
                if c["kind"] == "categorical"
            }
            if payload["version"] >= 3:
                ranges = {
                    str(c["name"]): _range(c["range"], str(c["name"]), where)
                    for c in columns
                    if c["kind"] == "numeric" and c["range"] is not None
                }
        steps = {str(step["step"]): step for step in payload["steps"]}
        expected = ["standardize"]
        if payload["version"] >= 2 and columns is not None:
            expected = ["missing-cells", "standardize"]
        found = [str(step["step"]) for step in payload["steps"]]
        if found != expected:
            raise DataError(f"{where}: steps {expected} expected, found {found}.")
        missing = steps.get("missing-cells", {"policy": "refuse", "fill": None, "indicators": []})
        fill = missing["fill"]
        return cls(
            columns=names,
            block_shape=shape,
            mean=np.asarray(steps["standardize"]["mean"], dtype=np.float64).reshape(shape),
            std=np.asarray(steps["standardize"]["std"], dtype=np.float64).reshape(shape),
            id_column=str(payload["id_column"]),
            categories=categories,
            missing_cells=str(missing["policy"]),
            fill=None if fill is None else np.asarray(fill, dtype=np.float64),
            indicators=tuple(str(c) for c in missing["indicators"]),
            ranges=ranges,
        )


def _range(value: Any, column: str, where: str) -> tuple[float, float]:
    """A numeric column's saved training range: two finite numbers, low <= high."""
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    ):
        raise DataError(
            f"{where}: column {column!r}: a training range [low, high] of two numbers expected, "
            f"found {value!r}."
        )
    return float(value[0]), float(value[1])


def _category_text(value: object) -> str:
    """A category as text; an integral float from a numeric-looking file reads as ``3``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _near_categories(unseen: Mapping[str, int], categories: Sequence[str]) -> str:
    """What the warning about ``unseen`` values adds where some of them are training
    categories written otherwise (another case, spaces around them): they are not taken for
    those categories, but the user is told which they resemble."""
    folded: dict[str, str] = {}
    for category in categories:
        folded.setdefault(category.strip().casefold(), category)
    near = {v: folded[v.strip().casefold()] for v in unseen if v.strip().casefold() in folded}
    if not near:
        return ""
    pairs = ", ".join(f"{value!r} as {category!r}" for value, category in list(near.items())[:3])
    return (
        f"; {len(near)} of them are training categories but for case or spaces ({pairs}): "
        "expected them written as in training"
    )


def _numeric_aliases(categories: Sequence[str]) -> dict[float, str]:
    """The categories that read as one number each (``007``: 7; ``True``, ``False``: 1, 0), by
    that number; a number two categories read as (``7`` and ``007``) is left out."""
    read: dict[float, list[str]] = {}
    for category in categories:
        number = {"True": 1.0, "False": 0.0}.get(category)
        if number is None:
            try:
                number = float(category)
            except ValueError:
                continue
        if math.isfinite(number):
            read.setdefault(number, []).append(category)
    return {number: found[0] for number, found in read.items() if len(found) == 1}


_FORMATTED_NUMBER = re.compile(r"\s*[-+]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?%?|\d+(?:\.\d+)?%)\s*")
"""A number written with thousands separators (``1,234.5``) or as a percentage (``12%``)."""


def _categories(values: pd.Series, column: str, where: str) -> tuple[str, ...]:
    """The sorted categories a categorical column shows in training; more than
    :data:`MAX_CATEGORIES` is refused. A column of numbers but for a few cells of text (``n/a``,
    ``?``) is categorical because of them: the refusal names them, and a column that is not
    refused warns (:class:`RunWarning`)."""
    present = values.dropna()
    found = sorted({_category_text(v) for v in present.tolist()})
    text = present[pd.to_numeric(present, errors="coerce").isna()]
    stray = sorted({str(v) for v in text.tolist()})
    numeric = 0 < len(text) <= NUMERIC_BUT_FOR * len(present)
    cells = f"{len(text)} cell(s) of text ({', '.join(map(repr, stray[:3]))})"
    because = (
        f"; it is numbers but for {cells}: if they mean missing, leave them empty"
        if numeric
        else ""
    )
    written = [str(v) for v in text.tolist()]
    formatted = bool(written) and all(_FORMATTED_NUMBER.fullmatch(v) for v in written)
    # a text column of numbers (Parquet keeps a column's type): categorical by its type alone
    stored = bool(len(present)) and not len(text)
    stored = stored and all(isinstance(v, str) for v in present.tolist())
    if stored:
        because = (
            "; each of its cells is a number stored as text: store the column as numbers to have "
            "it read as numbers"
        )
    if formatted:
        numeric = False  # every text cell is a number written with '%' or ',': say that
        because = (
            f"; it holds numbers written as text ({', '.join(map(repr, sorted(set(written))[:3]))}"
            "): write plain numbers (12, 1000, not 12% or 1,000) to have it read as numbers"
        )
    if (stored or formatted) and len(found) <= MAX_CATEGORIES:
        warnings.warn(
            f"{where}: column {column!r} is one-hot encoded as {len(found)} categories{because}.",
            RunWarning,
            stacklevel=3,
        )
    if len(found) > MAX_CATEGORIES:
        advice = (
            ""
            if numeric or formatted or stored
            else " (is it an identifier or free text? drop it, or make it numeric)"
        )
        raise DataError(
            f"{where}: categorical column {column!r} has {len(found)} distinct values in "
            f"training; at most {MAX_CATEGORIES} expected for one-hot encoding{advice}"
            f"{because}."
        )
    if numeric:
        warnings.warn(
            f"{where}: column {column!r} is numbers but for {cells}, so it is one-hot encoded "
            f"as {len(found)} categories; if those cells mean missing, leave them empty and "
            "the column is read as numbers.",
            RunWarning,
            stacklevel=3,
        )
    groups = alike_texts(found)
    if groups:
        shown = "; ".join(", ".join(map(repr, group)) for group in groups[:3])
        warnings.warn(
            f"{where}: column {column!r} has categories that differ only in case or "
            f"surrounding spaces ({shown}); they are encoded apart: write each alike if they "
            "are one.",
            RunWarning,
            stacklevel=3,
        )
    return tuple(found)


def _fill(encoded: np.ndarray, fill: np.ndarray | None) -> np.ndarray:
    """``encoded`` with every NaN replaced by its column's ``fill`` value (None: unchanged)."""
    if fill is None:
        return encoded
    return np.where(np.isnan(encoded), fill[None, :], encoded)


def _refuse_shared_input_names(names: Sequence[str], where: str) -> None:
    """DataError where two model inputs would have one name: a column named as another
    column's one-hot input (``column=category``) or missing-cell indicator (``column:missing``)
    is. Each input's training range and each warning about it go by its name."""
    shared = [name for name, count in Counter(names).items() if count > 1]
    if shared:
        raise DataError(
            f"{where}: each model input needs a name of its own, found {shown_names(shared)} "
            f"twice: a column's own name, and a category of another column "
            f"(column=category) or a missing-cell indicator (column{INDICATOR_SUFFIX}); "
            "rename the column."
        )


def _missing_refusal(
    frame: pd.DataFrame,
    missing: np.ndarray,
    where: str,
    *,
    advice: str = "or use --missing-cells mean-indicator",
) -> DataError:
    bad_columns: list[bool] = list(np.asarray(missing.any(axis=0), dtype=bool))
    columns = [str(c) for c, bad in zip(frame.columns, bad_columns, strict=True) if bad]
    return DataError(
        f"{where}: features must not be missing under --missing-cells refuse. Found "
        f"{int(missing.sum())} missing values in {int(missing.any(axis=1).sum())} rows, columns "
        f"{columns}; impute or drop them first ({advice})."
    )


def _column_json(
    name: str, categories: Sequence[str] | None, range: tuple[float, float] | None
) -> dict[str, Any]:
    if categories is None:
        return {"name": name, "kind": "numeric", "range": None if range is None else list(range)}
    return {"name": name, "kind": "categorical", "categories": list(categories)}
