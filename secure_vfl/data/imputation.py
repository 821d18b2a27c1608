"""The data layer of federated imputation (FedHF-Impute): clients with different feature schemas.

Every client holds rows of one global feature space of ``F`` features. Two kinds of absence are
kept apart everywhere: a feature outside a client's schema is *unavailable* (``available`` is
False for the whole column), a feature inside it can still be *missing* in a row (NaN). Values
are NaN in both cases; ``available`` says which case it is.

Data comes from a registered offline dataset (:data:`IMPUTATION_DATASETS`, split into clients by
:func:`make_imputation_task`) or from the user's own files, one per client
(:func:`make_task_from_client_files`). :func:`hide_entries` is the one evaluation protocol all
methods are scored with.
"""

from __future__ import annotations

import bz2
import lzma
import os
import re
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from secure_vfl.data.datasets import (
    debian_files,
    install_debian_dataset,
    read_rda,
    require_installed,
)
from secure_vfl.data.party_files import (
    ID_COLUMN,
    LABEL_COLUMN,
    alike_texts,
    feature_columns,
    read_as_written,
    read_ids,
    read_table,
)
from secure_vfl.errors import ConfigError, DataError, RunWarning
from secure_vfl.io import shown, shown_names
from secure_vfl.registry import Registry

BOOLEAN_CELLS, WHOLE_CELLS, REAL_CELLS = "boolean", "whole", "real"
CELL_FORMS = (BOOLEAN_CELLS, WHOLE_CELLS, REAL_CELLS)
"""How a client file writes a feature column's cells, and so its filled cells: True/False
(True where the value is at least 0.5), whole numbers (the nearest), or real numbers."""
HIDE_FRACTION = 0.2
"""Share of observed-and-available entries the evaluation protocol hides (FedHF-Impute)."""


@dataclass(frozen=True, eq=False)
class ClientData:
    """One client's rows in the global feature space.

    ``values`` is float32 ``(n, F)`` on the raw scale with NaN where an entry is missing or its
    feature is unavailable; ``available`` is the client's schema, bool ``(F,)``.
    """

    name: str
    values: np.ndarray
    available: np.ndarray

    def __post_init__(self) -> None:
        if self.values.dtype != np.float32 or self.values.ndim != 2:
            raise DataError(
                f"client {self.name!r}: `values` must be float32 of shape (n, F). "
                f"Found {self.values.dtype} of shape {self.values.shape}."
            )
        features = self.values.shape[1]
        if self.available.dtype != np.bool_ or self.available.shape != (features,):
            raise DataError(
                f"client {self.name!r}: `available` must be bool of shape ({features},). "
                f"Found {self.available.dtype} of shape {self.available.shape}."
            )
        if np.isinf(self.values).any():
            raise DataError(
                f"client {self.name!r}: `values` must be finite or NaN. "
                f"Found {int(np.isinf(self.values).sum())} infinite."
            )
        leaking = ~np.isnan(self.values[:, ~self.available])
        if leaking.any():
            raise DataError(
                f"client {self.name!r}: unavailable features must hold only NaN. "
                f"Found {int(leaking.sum())} values in unavailable columns."
            )

    @property
    def observed(self) -> np.ndarray:
        """Bool ``(n, F)``: the entry is in the client's schema and not missing."""
        return self.available[None, :] & ~np.isnan(self.values)

    @property
    def n(self) -> int:
        """The number of rows."""
        return int(self.values.shape[0])


@dataclass(frozen=True, eq=False)
class ClientFile:
    """Where one client's rows came from, so that its imputed table can be written back in
    the file's own form: its ``path``, its ``columns`` in file order, its ``id_column`` (None if
    it has none) with the ``ids`` as text, the columns that are not features (``passthrough``,
    e.g. a label, kept unchanged), its ``features`` as read (``booleans``: those that were
    True/False, now 1/0) and which of its rows went to the test split (``in_test``)."""

    path: Path
    columns: tuple[str, ...]
    id_column: str | None
    ids: np.ndarray | None
    passthrough: pd.DataFrame
    features: pd.DataFrame
    in_test: np.ndarray
    booleans: tuple[str, ...] = ()

    def imputed_frame(
        self,
        train: np.ndarray,
        test: np.ndarray,
        features: Sequence[str],
        *,
        as_written: bool = False,
        forms: Mapping[str, str] | None = None,
    ) -> pd.DataFrame:
        """The file's table with its features replaced by the imputed ``train`` and ``test``
        rows ((n, F) in the global ``features``): rows in the file's order, the id column
        first, every other column in the file's order; a cell the file has keeps its value
        exactly (only empty cells take the imputed float32 value).

        ``as_written``: the feature cells the file has as it writes them (a CSV's text, ``52``
        and ``True`` as they are, not ``52.0`` and ``1.0``; a Parquet file's own values), read
        from the file again, and each filled cell as the shortest text of its float32 value,
        in a column of whole numbers only (``52``, a Parquet integer) the nearest whole number,
        or in a True/False column True where it is at least 0.5, else False: the table a CSV
        writer puts back in the file's own form, which reads as the file did. ``forms``: a
        column's form (:data:`CELL_FORMS`) as another file had it (the training file of a saved
        imputer, so that every batch of a column is filled alike), in place of this file's."""
        values = np.empty((self.in_test.size, train.shape[1]), dtype=train.dtype)
        values[~self.in_test], values[self.in_test] = train, test
        index = {feature: position for position, feature in enumerate(features)}
        written = self._as_written() if as_written else None
        frame = pd.DataFrame(index=range(self.in_test.size))
        if self.id_column is not None and self.ids is not None:
            frame[self.id_column] = self.ids
        for column in self.columns:
            if column == self.id_column:
                continue
            if column in self.passthrough.columns:
                frame[column] = self.passthrough[column].to_numpy()
                continue
            given = self.features[column].to_numpy(dtype=np.float64, na_value=np.nan)
            imputed = values[:, index[column]]
            missing = np.isnan(given)
            if written is None:
                frame[column] = np.where(missing, imputed.astype(np.float64), given)
                continue
            cells = written[column].to_numpy(dtype=object, copy=True)
            if pd.isna(cells[~missing]).any():
                raise DataError(
                    f"{self.path} changed after it was read: column {column!r} has empty cells "
                    "where it had values; expected the file as the run read it (run again)."
                )
            form = (forms or {}).get(column) or self._form(column, cells[~missing])
            if written[column].dtype in (np.float32, pd.Float32Dtype()):  # a Parquet float32
                # its cells as the shortest text of their float32 value, as filled cells are
                # (as float64 text, 2.48 read 2.4800000190734863)
                cells[~missing] = [str(np.float32(value)) for value in cells[~missing]]
            if form == BOOLEAN_CELLS:
                cells[missing] = imputed[missing] >= 0.5
            elif form == WHOLE_CELLS:
                cells[missing] = [str(int(value)) for value in np.rint(imputed[missing])]
            else:
                cells[missing] = [str(value) for value in imputed[missing]]
            frame[column] = cells
        return frame

    def _form(self, column: str, cells: np.ndarray) -> str:
        """The form of a feature column whose cells, as the file writes them, are ``cells``."""
        if column in self.booleans:
            return BOOLEAN_CELLS
        return WHOLE_CELLS if _whole_numbers(cells) else REAL_CELLS

    def cell_forms(self) -> dict[str, str]:
        """The form of each feature column's cells as the file writes them (read again): True
        and False, whole numbers only, or real numbers; what its filled cells take."""
        written = self._as_written()
        forms = {}
        for column in self.features.columns:
            given = self.features[column].to_numpy(dtype=np.float64, na_value=np.nan)
            cells = written[column].to_numpy(dtype=object)[~np.isnan(given)]
            forms[str(column)] = self._form(str(column), cells)
        return forms

    def _as_written(self) -> pd.DataFrame:
        """The file's feature columns read again as it writes them (a CSV's text)."""
        columns = list(self.features.columns)
        try:
            frame = read_as_written(self.path, columns, id_column=self.id_column or ID_COLUMN)
        except (DataError, ValueError, OSError) as error:  # a column gone, the file gone
            raise DataError(
                f"{self.path} changed after it was read: columns {columns} expected ({error}); "
                "run again."
            ) from None
        if len(frame) != len(self.features):
            raise DataError(
                f"{self.path} changed after it was read: {len(self.features)} rows expected, "
                f"found {len(frame)} (run again)."
            )
        return frame.reset_index(drop=True)


_WHOLE_NUMBER = re.compile(r"\s*[+-]?\d+\s*")


def _whole_numbers(cells: np.ndarray) -> bool:
    """Whether a column's cells, as its file writes them, are all whole numbers (a CSV's text
    such as ``52`` or ``-3``, not ``52.0``; a Parquet file's integers), and there is one."""
    return cells.size > 0 and all(
        _WHOLE_NUMBER.fullmatch(cell) is not None
        if isinstance(cell, str)
        else isinstance(cell, Integral) and not isinstance(cell, (bool, np.bool_))
        for cell in cells
    )


@dataclass(frozen=True)
class ImputationTask:
    """``K`` clients' training and test rows over the global ``features``.

    ``test[k]`` belongs to the same client as ``train[k]`` and has the same availability mask.
    ``files[k]`` says where client k's rows came from (None for a registered dataset).
    """

    name: str
    features: tuple[str, ...]
    train: tuple[ClientData, ...]
    test: tuple[ClientData, ...]
    files: tuple[ClientFile, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.train) != len(self.test) or not self.train:
            raise DataError(
                "`train` and `test` must hold the same clients, at least one. "
                f"Found {len(self.train)} train and {len(self.test)} test clients."
            )
        names = [client.name for client in self.train]
        if len(set(names)) != len(names):
            raise DataError(f"client names must be distinct. Found {names}.")
        if len(set(self.features)) != len(self.features):
            repeated = sorted({f for f in self.features if self.features.count(f) > 1})
            raise DataError(f"feature names must be distinct. Found {repeated} repeated.")
        width = len(self.features)
        for train, test in zip(self.train, self.test, strict=True):
            if train.name != test.name:
                raise DataError(
                    "test clients must be in the order of the train clients. "
                    f"Found {test.name!r} where {train.name!r} was expected."
                )
            for part, client in (("train", train), ("test", test)):
                if client.values.shape[1] != width:
                    raise DataError(
                        f"{part} client {client.name!r} must have the {width} task features. "
                        f"Found {client.values.shape[1]} columns."
                    )
            if not np.array_equal(train.available, test.available):
                raise DataError(
                    f"client {train.name!r} must have the same availability in train and test. "
                    f"Found features {np.flatnonzero(train.available).tolist()} in train and "
                    f"{np.flatnonzero(test.available).tolist()} in test."
                )


def _check_feature_count(count: int, where: str) -> None:
    """Imputing from other features needs at least two of them."""
    if count < 2:
        raise DataError(f"{where} must have at least 2 feature columns. Found {count}.")


def _check_numeric(frame: pd.DataFrame, where: str, *, id_column: str | None = None) -> None:
    """Refuse non-numeric columns, naming them and the first text cell of the first;
    ``id_column``: the id column's name, which the file lacks (one of them may be its ids). A
    column without a value (a Parquet column of nulls) is read as numbers, all missing, in
    ``frame``."""
    for name in frame.columns:
        if not pd.api.types.is_numeric_dtype(frame[name]) and frame[name].isna().all():
            frame[name] = frame[name].astype(np.float64)
    bad = [str(c) for c in frame.columns if not pd.api.types.is_numeric_dtype(frame[c])]
    if bad:
        column = frame[bad[0]]
        text = column[column.notna() & pd.to_numeric(column, errors="coerce").isna()]
        if len(text):
            first = f" ({shown(bad[0])} holds {shown(str(text.iloc[0]))} at data row "
            first += f"{text.index[0] + 1})"
        else:  # a Parquet text column whose every cell is a number
            first = f" ({shown(bad[0])} is stored as text, each cell a number: store it as numbers)"
        hint = (
            f"; the file has no id column `{id_column}`: if {shown(bad[0])} holds the ids, give "
            f"--id-column {bad[0]}"
            if id_column is not None
            else ""
        )
        raise DataError(
            f"{where}: feature columns must be numeric. Found non-numeric "
            f"{shown_names(bad)}{first} (an empty cell is a missing value){hint}."
        )


def _as_float32(frame: pd.DataFrame, where: str) -> np.ndarray:
    """The frame's values as float32 with NaN for missing; infinities (and values beyond
    float32) are refused, naming the first column that holds one."""
    wide = frame.to_numpy(dtype=np.float64, na_value=np.nan)
    too_large = np.isinf(wide) | (np.abs(np.nan_to_num(wide)) > np.finfo(np.float32).max)
    if too_large.any():
        column = frame.columns[int(np.flatnonzero(too_large.any(axis=0))[0])]
        raise DataError(
            f"{where}: values must be finite or missing. Found {int(too_large.sum())} infinite "
            f"or beyond float32, e.g. in column {shown(str(column))}."
        )
    return wide.astype(np.float32)


SPLIT_STREAM = 6
"""The key of a client file's train/test split under the run's seed (:func:`split_rng`)."""


def split_rng(seed: int, index: int) -> np.random.Generator:
    """The generator that splits the rows of client file ``index`` into train and test in a
    run seeded ``seed``: each client its own, so a client in its own process (a deployment)
    splits its rows as the in-process run does."""
    return np.random.default_rng([seed, SPLIT_STREAM, index])


def _split_client(
    client: ClientData, test_fraction: float, rng: np.random.Generator
) -> tuple[ClientData, ClientData, np.ndarray]:
    """A seeded random (unstratified) train/test split of one client's rows, order kept."""
    n_test = round(test_fraction * client.n)
    if client.n - n_test < 2:
        raise DataError(
            f"client {client.name!r} must keep at least 2 training rows. Found {client.n} rows, "
            f"{client.n - n_test} left for training with test_fraction {test_fraction}; "
            "give it more rows (a dataset: fewer clients; from Python: a smaller test_fraction of "
            "make_imputation_task)."
        )
    in_test = np.zeros(client.n, dtype=bool)
    in_test[rng.permutation(client.n)[:n_test]] = True
    return (
        ClientData(client.name, client.values[~in_test], client.available.copy()),
        ClientData(client.name, client.values[in_test], client.available.copy()),
        in_test,
    )


def _check_test_fraction(test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"`test_fraction` must be in (0, 1). Found {test_fraction}.")


def _split_clients(
    name: str,
    features: tuple[str, ...],
    clients: Sequence[ClientData],
    test_fraction: float,
    rngs: Sequence[np.random.Generator],
    sources: Sequence[_ClientSource] | None = None,
) -> ImputationTask:
    """Split each client's rows into train and test (client ``k``'s by ``rngs[k]``) and
    assemble the task (with where each client's rows came from, if ``sources``)."""
    splits = [
        _split_client(client, test_fraction, rng) for client, rng in zip(clients, rngs, strict=True)
    ]
    _check_trained_features(features, [train for train, _, _ in splits], files=sources is not None)
    files = None
    if sources is not None:
        files = tuple(
            _client_file(source, in_test)
            for source, (_, _, in_test) in zip(sources, splits, strict=True)
        )
    return ImputationTask(
        name=name,
        features=features,
        train=tuple(train for train, _, _ in splits),
        test=tuple(test for _, test, _ in splits),
        files=files,
    )


def _check_trained_features(
    features: Sequence[str], train: Sequence[ClientData], *, files: bool
) -> None:
    """Refuse a feature that some client has but no client has a value of in its training
    rows (its values, if any, all fell in test rows): every method would impute it from
    nothing (mean 0, std 1) and score it in raw units as if they were std units. A deployed
    run's coordinator refuses it from the statistics' counts."""
    available = np.any([client.available for client in train], axis=0)
    observed = np.any([client.observed.any(axis=0) for client in train], axis=0)
    unobserved = [repr(features[int(j)]) for j in np.flatnonzero(available & ~observed)]
    if unobserved:
        hint = (
            "drop the column, add its values or split with another seed"
            if files
            else "fewer clients, a larger availability or another seed"
        )
        raise DataError(
            "every feature column needs a value in some client's training rows, to impute it "
            f"from; found none of {', '.join(unobserved)} in the training rows of this split: "
            f"{hint}."
        )


def _client_file(source: _ClientSource, in_test: np.ndarray) -> ClientFile:
    return ClientFile(
        path=source.path,
        columns=source.columns,
        id_column=source.id_column,
        ids=source.ids,
        passthrough=source.passthrough,
        features=source.features.reset_index(drop=True),
        in_test=in_test,
        booleans=source.booleans,
    )


def make_imputation_task(
    frame: pd.DataFrame,
    *,
    name: str,
    clients: int = 4,
    availability: float = 0.6,
    test_fraction: float = 0.2,
    rng: np.random.Generator,
) -> ImputationTask:
    """Deal a numeric table's rows to ``clients`` clients with random feature schemas.

    Rows are shuffled and dealt into near-equal parts; each client keeps ``round(availability *
    F)`` features (at least one) drawn independently, as in FedHF-Impute ("each client keeps a
    random 60 % of the features"), and its unavailable columns are set to NaN. Each client's rows
    are then split into train and test by ``test_fraction``. NaN in ``frame`` is a natural
    missing value and stays one.
    """
    if isinstance(clients, bool) or not isinstance(clients, Integral) or clients < 1:
        raise ConfigError(f"`clients` must be an integer >= 1. Found {clients!r}.")
    if not 0.0 < availability <= 1.0:
        raise ConfigError(f"`availability` must be in (0, 1]. Found {availability}.")
    _check_test_fraction(test_fraction)
    _check_feature_count(frame.shape[1], f"dataset {name!r}")
    _check_numeric(frame, f"dataset {name!r}")
    values = _as_float32(frame, f"dataset {name!r}")
    features = tuple(str(c) for c in frame.columns)
    width = len(features)
    kept = max(1, round(availability * width))
    parts = np.array_split(rng.permutation(values.shape[0]), clients)
    full_clients = []
    for k, rows in enumerate(parts):
        available = np.zeros(width, dtype=bool)
        available[rng.choice(width, size=kept, replace=False)] = True
        client_values = values[np.sort(rows)]
        client_values[:, ~available] = np.nan
        full_clients.append(ClientData(f"client-{k}", client_values, available))
    return _split_clients(name, features, full_clients, test_fraction, [rng] * clients)


def hide_entries(
    client: ClientData, fraction: float = HIDE_FRACTION, *, rng: np.random.Generator
) -> tuple[ClientData, np.ndarray]:
    """Hide a uniformly random ``fraction`` of the client's observed-and-available entries.

    The evaluation protocol of every method: ``round(fraction * count)`` of the ``count``
    observed entries become NaN in a copy; unavailable and already-missing entries are never
    touched. Returns the copy and the bool ``(n, F)`` mask of the hidden entries, on which the
    imputation error is measured.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"`fraction` must be in [0, 1]. Found {fraction}.")
    candidates = np.flatnonzero(client.observed.ravel())
    chosen = rng.choice(candidates, size=round(fraction * candidates.size), replace=False)
    hidden = np.zeros(client.values.shape, dtype=bool)
    hidden.flat[chosen] = True
    values = client.values.copy()
    values[hidden] = np.nan
    return ClientData(client.name, values, client.available.copy()), hidden


def client_from_frame(
    name: str, frame: pd.DataFrame, features: Sequence[str], *, where: str | None = None
) -> ClientData:
    """Place one client's table of feature columns into the global ``features``: its columns
    are its schema.

    A feature absent from ``frame`` is unavailable at this client; NaN inside a present column is
    missing. A column that is not one of ``features`` is refused. ``where`` names the table in
    errors (default: the client)."""
    where = where if where is not None else f"client {name!r}"
    columns = [str(c) for c in frame.columns]
    index = {feature: position for position, feature in enumerate(features)}
    unknown = [c for c in columns if c not in index]
    if unknown:
        raise DataError(
            f"{where}: columns must be among the {len(index)} global features. "
            f"Found unknown {shown_names(unknown)}."
        )
    _check_numeric(frame, where)
    values = np.full((len(frame), len(index)), np.nan, dtype=np.float32)
    positions = [index[c] for c in columns]
    values[:, positions] = _as_float32(frame, where)
    available = np.zeros(len(index), dtype=bool)
    available[positions] = True
    return ClientData(name, values, available)


_ID_LIKE = re.compile(r"(?:.*[_\s.-])?(?i:id)|.*[a-z](?:ID|Id)")


def warn_alike_features(schemas: Mapping[str, Sequence[str]]) -> None:
    """Warn (:class:`~secure_vfl.errors.RunWarning`) of feature names, in the clients'
    ``schemas`` (client -> its feature columns), that differ only in case or surrounding
    spaces: they are different features, each unavailable where it is named otherwise."""
    where: dict[str, list[str]] = {}
    for client, columns in schemas.items():
        for column in columns:
            where.setdefault(column, []).append(client)
    alike = alike_texts(list(where))
    if alike:
        shown = "; ".join(
            ", ".join(f"{name!r} ({', '.join(where[name])})" for name in group)
            for group in alike[:3]
        )
        warnings.warn(
            "feature columns whose names differ only in case or surrounding spaces are "
            f"different features, each unavailable where it is named otherwise: {shown}; "
            "name each feature alike in every file if they are one.",
            RunWarning,
            stacklevel=2,
        )


def _warn_id_like(path: Path, columns: Sequence[str], id_column: str) -> None:
    """Warn of feature columns named like an id (``patient_id``, ``ID``, ``PatientID``) in a
    file without the id column: they are imputed as features."""
    named = [c for c in columns if c != id_column and _ID_LIKE.fullmatch(c.strip())]
    if named:
        warnings.warn(
            f"{path}: {', '.join(map(repr, named))} looks like an id column but is imputed as "
            f"a feature (the id column is `{id_column}`); give --id-column "
            f"{named[0]} if it is the file's ids.",
            RunWarning,
            stacklevel=3,
        )


@dataclass(frozen=True, eq=False)
class _ClientSource:
    """One client file as read: its features and what is written back around them."""

    path: Path
    columns: tuple[str, ...]
    id_column: str | None
    ids: np.ndarray | None
    passthrough: pd.DataFrame
    features: pd.DataFrame
    booleans: tuple[str, ...]  # feature columns that were True/False


def _read_client_frame(
    path: Path, id_column: str, label_column: str, *, ids_optional: bool = False
) -> _ClientSource:
    """Read one client's CSV or Parquet file; refuse unreadable, empty or non-numeric files.
    The id column (read as text) and the label column are not features. Under the default
    name ``id`` the id column may be absent (imputation needs no ids); another name was given
    on purpose, so a file without that column is refused (its own id column would otherwise be
    imputed as a feature), unless ``ids_optional``: the caller refuses every column outside a
    saved schema by name (a saved imputer's client)."""
    frame = read_table(
        path, what="client file", id_column=id_column, literal=[label_column], blank_cells=True
    )
    if id_column != ID_COLUMN and id_column not in frame.columns and not ids_optional:
        raise DataError(
            f"{path} must have an id column `{id_column}` (--id-column). Found columns: "
            f"{list(frame.columns)}."
        )
    kept = [c for c in frame.columns if c in (id_column, label_column)]
    features = frame.drop(columns=kept).reset_index(drop=True)
    if id_column not in frame.columns:
        _warn_id_like(path, list(features.columns), id_column)
    if features.shape[1] == 0:
        raise DataError(f"{path} must have at least one feature column. Found none.")
    booleans = feature_columns(features, path)
    has_ids = id_column in frame.columns
    _check_numeric(features, str(path), id_column=None if has_ids else id_column)
    return _ClientSource(
        path=path,
        columns=tuple(str(c) for c in frame.columns),
        id_column=id_column if has_ids else None,
        ids=read_ids(frame, path, id_column) if has_ids else None,
        passthrough=frame[[c for c in kept if c != id_column]].reset_index(drop=True),
        features=features,
        booleans=tuple(booleans),
    )


def read_client_files(
    paths: Sequence[Path], *, id_column: str = ID_COLUMN, label_column: str = LABEL_COLUMN
) -> tuple[tuple[str, ...], list[ClientData]]:
    """Read one CSV or Parquet file per client into the global feature space.

    The global features are the union of the files' columns in first-seen order; a column absent
    from a file is unavailable at that client, an empty cell is missing, the id column and the
    label column are not features. Column names within a file must be distinct. Under the
    default names (``id``, ``label``) a file may lack either column (imputation needs no ids);
    an id column named otherwise must be in every file, a label column named otherwise in at
    least one (a client may hold no label). Clients are named by file stem, which must be
    distinct.
    """
    features, clients, _ = _read_client_sources(paths, id_column, label_column)
    return features, clients


def _read_client_sources(
    paths: Sequence[Path], id_column: str, label_column: str
) -> tuple[tuple[str, ...], list[ClientData], list[_ClientSource]]:
    if not paths:
        raise ConfigError("at least one client file is needed. Found none.")
    sources: dict[str, _ClientSource] = {}
    for path in map(Path, paths):
        try:
            path.stem.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(
                f"a client is named by its file's stem, which its messages carry as UTF-8 text; "
                f"found {os.fsencode(path.name)!r} at {path}: rename the file."
            ) from None
        if path.stem in sources:
            raise DataError(
                f"client files must have distinct names (file stems). Found {path.stem!r} twice, "
                f"the second at {path}; rename one of them."
            )
        sources[path.stem] = _read_client_frame(path, id_column, label_column)
    if label_column != LABEL_COLUMN and not any(
        label_column in source.columns for source in sources.values()
    ):
        found = "; ".join(f"{source.path} {list(source.columns)}" for source in sources.values())
        raise DataError(
            f"a label column `{label_column}` (--label-column) must be in at least one client "
            f"file. Found columns: {found}."
        )
    features: dict[str, None] = {}
    for source in sources.values():
        features.update(dict.fromkeys(source.features.columns))
    names = tuple(features)
    warn_alike_features({stem: list(source.features.columns) for stem, source in sources.items()})
    _check_feature_count(len(names), f"the client files together ({', '.join(map(str, paths))})")
    clients = [
        client_from_frame(stem, source.features, names, where=str(source.path))
        for stem, source in sources.items()
    ]
    observed = np.zeros(len(names), dtype=bool)
    for client in clients:
        observed |= ~np.isnan(client.values).all(axis=0)
    if not observed.all():  # it would be filled with what the model makes of nothing
        never = ", ".join(repr(names[i]) for i in np.flatnonzero(~observed))
        raise DataError(
            f"every feature column needs a value in some client file, to impute it from. Found "
            f"none of {never} in {', '.join(map(str, paths))}; drop the column or add its values."
        )
    return names, clients, list(sources.values())


def make_task_from_client_files(
    paths: Sequence[Path],
    *,
    test_fraction: float = 0.2,
    seed: int,
    id_column: str = ID_COLUMN,
    label_column: str = LABEL_COLUMN,
) -> ImputationTask:
    """Read the user's client files (:func:`read_client_files`) and split each client's rows
    into train and test by ``test_fraction``, file ``k``'s by :func:`split_rng` ``(seed, k)``;
    the task keeps where each client's rows came from (:class:`ClientFile`)."""
    _check_test_fraction(test_fraction)
    features, clients, sources = _read_client_sources(paths, id_column, label_column)
    rngs = [split_rng(seed, k) for k in range(len(clients))]
    return _split_clients("client-files", features, clients, test_fraction, rngs, sources)


def read_client_file(
    path: Path,
    *,
    id_column: str = ID_COLUMN,
    label_column: str = LABEL_COLUMN,
    ids_optional: bool = False,
) -> ClientFile:
    """One client file as read (its features, ids and the columns around them), every row
    to be filled: what a saved imputer fills (:meth:`ClientFile.imputed_frame`). With
    ``ids_optional`` the file may lack the id column whatever its name (the caller refuses
    any column outside the client's saved schema)."""
    source = _read_client_frame(Path(path), id_column, label_column, ids_optional=ids_optional)
    return _client_file(source, np.zeros(len(source.features), dtype=bool))


def client_file_columns(
    path: Path, *, id_column: str = ID_COLUMN, label_column: str = LABEL_COLUMN
) -> tuple[tuple[str, ...], int, bool]:
    """One client file's feature columns (its schema, in its order), its row count and whether
    it has the label column: what a client in its own process tells the coordinator, which
    unites the schemas in client order and checks a label column given, as
    :func:`read_client_files` does."""
    source = _read_client_frame(Path(path), id_column, label_column)
    features = tuple(str(c) for c in source.features.columns)
    return features, int(source.features.shape[0]), label_column in source.columns


def split_client_file(
    path: Path,
    *,
    name: str,
    features: Sequence[str],
    test_fraction: float,
    rng: np.random.Generator,
    id_column: str = ID_COLUMN,
    label_column: str = LABEL_COLUMN,
) -> tuple[ClientData, ClientData, ClientFile]:
    """One client file placed into the federation's global ``features`` (the union of every
    client's schema) as client ``name`` and split into train and test by ``rng``, as
    :func:`make_task_from_client_files` does each of its files; with the file's own form, to
    write its imputed table back (:meth:`ClientFile.imputed_frame`)."""
    _check_test_fraction(test_fraction)
    _check_feature_count(len(features), "the federation's features")
    source = _read_client_frame(Path(path), id_column, label_column)
    client = client_from_frame(name, source.features, tuple(features), where=str(path))
    train, test, in_test = _split_client(client, test_fraction, rng)
    return train, test, _client_file(source, in_test)


# --- R lazy-load databases (``Rdata.rdb`` / ``Rdata.rdx``), read without R ---------------------

_LZMA2_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6}]
"""R compresses lazy-load entries of type 'Z' as a raw LZMA2 stream with preset 6."""


def _parse_r_serialized(data: bytes, where: str) -> Any:
    """Parse and convert one R-serialized object with ``rdata``."""
    from rdata.conversion import convert
    from rdata.parser import parse_data

    try:
        with warnings.catch_warnings():
            # R's data files carry no encoding tag; rdata assumes ASCII and says so.
            warnings.filterwarnings("ignore", message="Unknown encoding", category=UserWarning)
            return convert(parse_data(data, extension=".rds"))
    except Exception as error:  # rdata raises many kinds on corrupt input
        raise DataError(
            f"{where} must hold an R-serialized object. Parsing failed: "
            f"{type(error).__name__}: {error}"
        ) from None


def _decompress_entry(blob: bytes, compression: int, where: str) -> bytes:
    """Undo R's lazy-load compression: a 4-byte big-endian length, then (types 2 and 3) a type
    byte ('0' none, '1' zlib, '2' bzip2, 'Z' LZMA2), then the compressed bytes."""
    if len(blob) < 5:
        raise DataError(f"{where} must be a compressed entry of at least 5 bytes. Found {blob!r}.")
    expected = int.from_bytes(blob[:4], "big")
    try:
        if compression == 1:
            raw = zlib.decompress(blob[4:])
        else:
            kind, body = blob[4:5], blob[5:]
            if kind == b"0":
                raw = body
            elif kind == b"1":
                raw = zlib.decompress(body)
            elif kind == b"2":
                raw = bz2.decompress(body)
            elif kind == b"Z":
                raw = lzma.decompress(body, format=lzma.FORMAT_RAW, filters=_LZMA2_FILTERS)
            else:
                raise DataError(
                    f"{where} must have compression type '0', '1', '2' or 'Z'. Found {kind!r}."
                )
    except (zlib.error, OSError, lzma.LZMAError) as error:
        raise DataError(
            f"{where} must decompress (R compression type {compression}). Found: {error}"
        ) from None
    if len(raw) != expected:
        raise DataError(f"{where} declares {expected} bytes. Found {len(raw)} after decompressing.")
    return raw


def read_lazyload(database: Path, object_name: str) -> Any:
    """Read one object from an R lazy-load database without R.

    ``database`` is the ``.rdb`` file; its ``.rdx`` sibling is a serialized index mapping each
    object to an (offset, length) in the ``.rdb`` and saying how entries are compressed. Data
    frames come back as :class:`pandas.DataFrame`.
    """
    index_path = database.with_suffix(".rdx")
    index = _parse_r_serialized(index_path.read_bytes(), str(index_path))
    if not isinstance(index, dict) or "variables" not in index:
        raise DataError(
            f"{index_path} must be an R lazy-load index with `variables`. "
            f"Found {type(index).__name__} {str(index)[:80]}."
        )
    variables = index["variables"]
    if object_name not in variables:
        raise DataError(
            f"{database} must hold an object named {object_name!r}. "
            f"Found objects: {sorted(str(v) for v in variables)}."
        )
    position = np.asarray(variables[object_name]).ravel()
    if position.size != 2:
        raise DataError(
            f"{index_path} must give {object_name!r} as (offset, length). Found {position}."
        )
    offset, length = int(position[0]), int(position[1])
    compression = int(np.asarray(index.get("compressed", 1)).ravel()[0])
    with database.open("rb") as handle:
        handle.seek(offset)
        blob = handle.read(length)
    where = f"{database} entry {object_name!r}"
    if len(blob) != length:
        raise DataError(f"{where} must span {length} bytes at {offset}. Found {len(blob)}.")
    return _parse_r_serialized(_decompress_entry(blob, compression, where), where)


def _read_lazyload_frame(database: Path, object_name: str) -> pd.DataFrame:
    """One data frame from an R lazy-load database."""
    frame = read_lazyload(database, object_name)
    if not isinstance(frame, pd.DataFrame):
        raise DataError(
            f"{database} must hold {object_name!r} as a data frame. Found {type(frame).__name__}."
        )
    return frame


# --- the registry of offline imputation datasets ----------------------------------------------


@dataclass(frozen=True)
class ImputationDatasetSpec:
    """A registered imputation dataset: an unlabelled numeric table with natural NaNs."""

    name: str
    description: str
    source: str
    debian_packages: tuple[str, ...]
    shape: str
    loader: Callable[[], pd.DataFrame]
    files: Callable[[], list[Path]]

    def is_installed(self) -> bool:
        """True when every file the loader needs exists on this machine."""
        return all(path.is_file() for path in self.files())

    def install_hint(self) -> str:
        """One line telling the user how to make this dataset available."""
        if not self.debian_packages:
            return f"{self.source}; nothing to install."
        return f"secure-vfl datasets install {self.name}"


IMPUTATION_DATASETS: Registry[ImputationDatasetSpec] = Registry("imputation dataset")
"""Every imputation dataset the CLI and benchmarks can select by name (unlabelled tables, so
apart from the classification registry ``DATASETS``)."""


def _numeric_float_frame(frame: pd.DataFrame, columns: Sequence[str], where: str) -> pd.DataFrame:
    """``columns`` of ``frame`` as float64 with NaN for R's NA, on a fresh 0..n-1 index."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise DataError(
            f"{where} must have columns {list(columns)}. Found {list(frame.columns)} "
            f"(missing {missing})."
        )
    selected = frame[list(columns)]
    _check_numeric(selected, where)
    return pd.DataFrame(selected.to_numpy(dtype=np.float64, na_value=np.nan), columns=list(columns))


_OZONE_FILE = "usr/lib/R/site-library/mlbench/data/Ozone.rda"
OZONE_COLUMNS = tuple(f"V{i}" for i in range(4, 14))
"""The 10 numeric columns of mlbench's Ozone; V1-V3 are month, day of month and weekday."""


def _load_ozone() -> pd.DataFrame:
    """LA ozone, 366 days x 10 meteorological measurements with their natural NaNs."""
    (path,) = debian_files((_OZONE_FILE,))
    frame = read_rda(path, "Ozone")
    if frame.shape != (366, 13):
        raise DataError(f"{path} must hold Ozone as 366 x 13. Found {frame.shape}.")
    return _numeric_float_frame(frame, OZONE_COLUMNS, str(path))


_R_DATASETS_DB = (
    "usr/lib/R/library/datasets/data/Rdata.rdb",
    "usr/lib/R/library/datasets/data/Rdata.rdx",
)
AIRQUALITY_COLUMNS = ("Ozone", "Solar.R", "Wind", "Temp")
"""R's ``airquality`` measurements; Month and Day are calendar fields, not measurements."""


def _load_airquality() -> pd.DataFrame:
    """New York air quality, May-September 1973: 153 days x 4 measurements with NaNs."""
    database, _ = debian_files(_R_DATASETS_DB)
    frame = _read_lazyload_frame(database, "airquality")
    if frame.shape != (153, 6):
        raise DataError(f"{database} must hold airquality as 153 x 6. Found {frame.shape}.")
    return _numeric_float_frame(frame, AIRQUALITY_COLUMNS, f"{database} airquality")


_VIM_DB = (
    "usr/lib/R/site-library/VIM/data/Rdata.rdb",
    "usr/lib/R/site-library/VIM/data/Rdata.rdx",
)


CHORIZON_NOT_CONCENTRATIONS = ("XCOO", "YCOO", "ELEV")
"""chorizonDL columns that are coordinates or elevation, not element concentrations."""
CHORIZON_CODES = ("LITO", "TOPC")
"""chorizonDL's lithology and topography class codes: categories, not quantities to impute."""
CHORIZON_MIN_DISTINCT = 5
"""Columns with fewer distinct observed values are detection-limit artefacts, not measurements."""


def _load_chorizon() -> pd.DataFrame:
    """Kola C-horizon geochemistry (VIM::chorizonDL), 606 samples with natural NaNs.

    Dropped: the ``*``-marked descriptors (sample id, country, aspect), the class codes LITO and
    TOPC, and columns with fewer than 5 distinct observed values (never observed, or only at a
    detection limit). Element concentrations are positive and heavy-tailed (max / median up to
    250), so they are log10-transformed, as is usual for geochemical data; otherwise a few
    extreme entries, standardised by a near-constant training column, dominate every RMSE.
    """
    database, _ = debian_files(_VIM_DB)
    frame = _read_lazyload_frame(database, "chorizonDL")
    if frame.shape != (606, 110):
        raise DataError(f"{database} must hold chorizonDL as 606 x 110. Found {frame.shape}.")
    columns = [
        str(c)
        for c in frame.columns
        if not str(c).startswith("*")
        and str(c) not in CHORIZON_CODES
        and frame[c].nunique(dropna=True) >= CHORIZON_MIN_DISTINCT
    ]
    numeric = _numeric_float_frame(frame, columns, f"{database} chorizonDL")
    concentrations = [c for c in numeric.columns if c not in CHORIZON_NOT_CONCENTRATIONS]
    if (numeric[concentrations] <= 0).any().any():
        raise DataError(f"{database} chorizonDL concentrations must be positive to take logs.")
    numeric[concentrations] = np.log10(numeric[concentrations])
    return numeric


def _register_imputation_datasets() -> None:
    """Register the offline imputation datasets (all R data read without R, GPL: loaded where
    they were unpacked, never copied into the repo)."""
    entries = (
        ImputationDatasetSpec(
            name="ozone",
            description="LA ozone 1976 (mlbench::Ozone): 10 numeric columns V4-V13; "
            "the AirQuality analogue of the FedHF reference run",
            source="Debian package r-cran-mlbench",
            debian_packages=("r-cran-mlbench",),
            shape="366 x 10, 203 NaN",
            loader=_load_ozone,
            files=lambda: debian_files((_OZONE_FILE,)),
        ),
        ImputationDatasetSpec(
            name="airquality",
            description="New York air quality 1973 (R datasets::airquality): Ozone, Solar.R, "
            "Wind, Temp; the calendar fields Month and Day are dropped",
            source="Debian package r-base-core (R's datasets library, read without R)",
            debian_packages=("r-base-core",),
            shape="153 x 4, 44 NaN",
            loader=_load_airquality,
            files=lambda: debian_files(_R_DATASETS_DB),
        ),
        ImputationDatasetSpec(
            name="chorizon",
            description="Kola C-horizon soil geochemistry (VIM::chorizonDL), wide: log10 element "
            "concentrations, coordinates, elevation; descriptors, class codes and columns with "
            "< 5 distinct values dropped",
            source="Debian package r-cran-vim",
            debian_packages=("r-cran-vim",),
            shape="606 x 99, 7659 NaN",
            loader=_load_chorizon,
            files=lambda: debian_files(_VIM_DB),
        ),
    )
    for spec in entries:
        IMPUTATION_DATASETS.register(spec.name, spec)


_register_imputation_datasets()


def load_imputation_dataset(name: str) -> pd.DataFrame:
    """Load a registered imputation dataset as a float64 table with NaN for missing values."""
    spec = IMPUTATION_DATASETS.get(name)
    require_installed(name, spec.files())
    return spec.loader()


def imputation_dataset_status() -> list[tuple[ImputationDatasetSpec, bool]]:
    """Every registered imputation dataset with whether its files are here, sorted by name."""
    return [
        (spec, spec.is_installed()) for spec in map(IMPUTATION_DATASETS.get, IMPUTATION_DATASETS)
    ]


def install_imputation_dataset(name: str, *, log: Callable[[str], None] = print) -> None:
    """Fetch and unpack the Debian packages of imputation dataset ``name`` (the same steps and
    errors as :func:`secure_vfl.data.datasets.install_dataset`)."""
    spec = IMPUTATION_DATASETS.get(name)
    install_debian_dataset(name, spec.debian_packages, spec.files, log=log)
