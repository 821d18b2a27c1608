"""A trained federation kept on disk and used again: each party's own part plus a manifest.

``train`` saves into ``DIR/model/``: every party writes its own part into its own directory
(``DIR/model/party-0/`` ...; :meth:`~secure_vfl.federation.parties.DataParty.save_part`), and the
run writes ``manifest.json`` last, which ties the parts of one federation together: the run id,
the method and its configuration (enough to rebuild every architecture), the parties (name, the
file they came from, role, directory) and the SHA-256 of every part file. A directory without a
valid manifest is not a model.

Loading rebuilds the federation from the manifest and asks every party to load its own part,
which it checks against the manifest's hashes before reading (a missing, altered or extra file
is refused; model files are safetensors files, read without unpickling:
:mod:`secure_vfl.tensor_file`). Nothing else may lie in the model directory: a file or directory
the manifest does not list is refused by name. Saving over a model replaces its whole directory
(:func:`replace_directory`), so no file of the older model survives beside the new manifest.

A deployed run (``train --federation``, :func:`secure_vfl.deployment.save_deployed`) writes the
same manifest, but only the label party's part lies beside it: every data party keeps its own in
its own process's model directory (``location`` :data:`KEPT_BY_PARTY`), and a party lost in
training has none (:data:`LOST`; prediction treats it as absent). Such a model loads here with
the data parties' parts that were copied beside the manifest, each checked against the hashes
its party reported; a party whose part was not copied is absent from every prediction here, as
a lost one is (its file is refused, naming where its part lies).

Prediction on new rows (:meth:`SavedModel.predict`): each party is handed its own new file (or
none), rows are aligned by id (the union of the ids given; a party that does not hold an id is
absent for that row), each party applies its own saved preprocessing, and the label party's
program predicts from the blocks present, as the method does at test time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast, get_args

import numpy as np
import pandas as pd

from secure_vfl import __version__, methods
from secure_vfl.checks import SEED_LIMIT
from secure_vfl.data.datasets import Kind
from secure_vfl.data.party_files import ID_COLUMN, PartyTable, near_matches, same_table
from secure_vfl.data.vertical import VerticalData, VerticalSplit
from secure_vfl.errors import ConfigError, DataError, IntegrityError, RunWarning
from secure_vfl.federation import parts
from secure_vfl.federation.aggregator import SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parties import DataParty
from secure_vfl.federation.parts import ClassValue
from secure_vfl.federation.releases import ReleaseBlocks
from secure_vfl.io import (
    atomic_write,
    atomic_write_json,
    check_document,
    check_keys,
    counted,
    left_beside,
    parse_json,
    replace_directory,
)
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.false_vfl import (
    FalseVflConfig,
    FalseVflMethod,
    draws_as_saved,
    predict_as_saved,
)

MANIFEST_SCHEMA = "secure-vfl/model-manifest"
IMPUTER_SCHEMA = "secure-vfl/imputer-manifest"
"""An imputer's manifest (:mod:`secure_vfl.saved_imputer`), refused here by name."""
MANIFEST_VERSION = 2
"""Version 2 adds each party's ``location`` (version 1, every part beside the manifest, is
still read)."""
READ_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.json"
MODEL_DIR = "model"
PREDICT_SPLIT = "predict"
PREDICTED_COLUMN = "predicted"
"""The output's column of the predicted label, unless the caller names another."""
LABEL_PARTY_ROLE = "label party"
DATA_PARTY_ROLE = "data party"
HERE = "here"
"""A part in the model directory, under its entry's ``directory``."""
KEPT_BY_PARTY = "party"
"""A deployed data party's part, kept in that party's own model directory (``party serve
--model-dir DIR``: ``DIR/NAME/RUN_ID/``); copied beside the manifest under its entry's
``directory``, it loads here."""
LOST = "lost"
"""A party lost in a deployed run's training (and not rejoined): it saved no part."""
LOCATIONS = (HERE, KEPT_BY_PARTY, LOST)


@dataclass(frozen=True, kw_only=True)
class PartEntry:
    """One party in the manifest: its internal name, the user's name of it (its ``source``:
    the file's stem made safe or ``--party-name``; its internal name for a registered
    dataset), its role, its directory (relative to the manifest), the SHA-256 of each file of
    its part and where the part lies (:data:`LOCATIONS`: beside the manifest, kept by a
    deployed party, or nowhere: the party was lost in training)."""

    name: str
    source: str
    role: str
    directory: str
    files: dict[str, str]
    location: str = HERE


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ties the saved parts of one trained federation together."""

    run_id: str
    created: str
    secure_vfl_version: str
    method: str
    seed: int
    method_config: dict[str, Any]
    false_vfl: dict[str, Any] | None
    data: str
    kind: str
    num_classes: int
    block_shapes: tuple[tuple[int, ...], ...]
    parties: tuple[PartEntry, ...]

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["block_shapes"] = [list(shape) for shape in self.block_shapes]
        return {"schema": MANIFEST_SCHEMA, "version": MANIFEST_VERSION, **payload}

    @classmethod
    def from_json(cls, payload: Any, where: str) -> Manifest:
        """Read a manifest, refusing another schema, another version or a malformed entry."""
        refuse_other_kind(payload, MANIFEST_SCHEMA, where)
        check_document(
            payload, schema=MANIFEST_SCHEMA, versions=READ_VERSIONS, where=where, what="manifest"
        )
        body = {k: v for k, v in payload.items() if k not in ("schema", "version")}
        _check_key_names(body, _MANIFEST_TYPES, what="manifest", where=where)
        check_keys(body, _MANIFEST_TYPES, refuse=_refusal(where), exact=False)
        if not re.fullmatch(r"[0-9a-f]{32}", str(body.get("run_id", "0" * 32))):
            raise DataError(
                f"{where}: a run_id of 32 hex digits expected (a served party keeps its part "
                f"under it), found {str(body.get('run_id'))[:40]!r}."
            )
        seed, classes = body.get("seed", 0), body.get("num_classes", 2)
        if not (0 <= seed < SEED_LIMIT and 2 <= classes <= MAX_CLASSES):
            raise DataError(
                f"{where}: a seed in [0, 2**32) and num_classes in [2, {MAX_CLASSES}] expected, "
                f"found {seed!r} and {classes!r}."
            )
        if body["kind"] not in get_args(Kind):
            raise DataError(
                f"{where}: a data kind of {' or '.join(get_args(Kind))} expected, found "
                f"{str(body['kind'])[:40]!r}."
            )
        body["parties"] = tuple(_entry(p, k, where) for k, p in enumerate(body["parties"]))
        body["block_shapes"] = tuple(_block_shape(s, where) for s in body["block_shapes"])
        manifest = cls(**body)
        if len(manifest.parties) != len(manifest.block_shapes) or len(manifest.parties) < 2:
            raise DataError(
                f"{where}: one block shape per party and >= 2 parties expected; found "
                f"{len(manifest.parties)} parties and {len(manifest.block_shapes)} shapes."
            )
        return manifest


_MANIFEST_TYPES: dict[str, type | tuple[type, ...]] = {
    "run_id": str,
    "created": str,
    "secure_vfl_version": str,
    "method": str,
    "seed": int,
    "method_config": dict,
    "false_vfl": (dict, type(None)),
    "data": str,
    "kind": str,
    "num_classes": int,
    "block_shapes": list,
    "parties": list,
}
_ENTRY_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "source": str,
    "role": str,
    "directory": str,
    "files": dict,
    "location": str,
}
_OPTIONAL_ENTRY_KEYS = ("location",)
"""A version 1 manifest's entries have no ``location`` (every part lies beside it)."""
MAX_BLOCK_DIMS = 4
"""A block's sample shape: features, or an image's channels, height and width."""
MAX_INPUT_WIDTH = 2**20
"""The most values a block holds per sample (its model input's width): a bound on what a peer
or a manifest may announce before anything is allocated for it; no party file comes near it."""
MAX_CLASSES = 4096
"""The most classes a label party or a manifest may announce (a head's output width; CIFAR-100
has 100)."""


def _refusal(where: str) -> Callable[[str], DataError]:
    """What a manifest's refusals raise: ``DataError`` naming the file."""
    return lambda wrong: DataError(f"{where}: {wrong}.")


def _check_key_names(
    body: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    what: str,
    where: str,
    optional: Sequence[str] = (),
) -> None:
    """DataError naming the keys of ``body`` missing from ``expected`` (but for ``optional``
    ones) and those it does not know."""
    missing = sorted(set(expected) - set(optional) - set(body))
    unknown = sorted(set(body) - set(expected))
    wrong = [
        f"{name} {keys}" for name, keys in (("missing", missing), ("unknown", unknown)) if keys
    ]
    if wrong:
        optionally = f" ({', '.join(optional)} optional)" if optional else ""
        raise DataError(
            f"{where}: {what} keys {sorted(expected)} expected{optionally}; found "
            f"{sorted(body)} ({', '.join(wrong)})."
        )


def _block_shape(shape: Any, where: str) -> tuple[int, ...]:
    if not (
        isinstance(shape, list)
        and 1 <= len(shape) <= MAX_BLOCK_DIMS
        and all(type(n) is int and n >= 1 for n in shape)
        and math.prod(shape) <= MAX_INPUT_WIDTH
    ):
        raise DataError(
            f"{where}: a block shape of 1 to {MAX_BLOCK_DIMS} sizes >= 1, of at most "
            f"{MAX_INPUT_WIDTH} values in all, expected, found {json.dumps(shape)[:60]}."
        )
    return tuple(shape)


def _entry(payload: Any, index: int, where: str) -> PartEntry:
    if not isinstance(payload, dict):
        raise DataError(f"{where}: a party entry (an object) expected, found {payload!r:.60}.")
    _check_key_names(
        payload,
        _ENTRY_TYPES,
        what=f"party entry {index}'s",
        where=where,
        optional=_OPTIONAL_ENTRY_KEYS,
    )
    check_keys(payload, _ENTRY_TYPES, refuse=_refusal(where), exact=False)
    entry = PartEntry(**payload)
    role = LABEL_PARTY_ROLE if index == 0 else DATA_PARTY_ROLE
    if entry.role != role:
        raise DataError(
            f"{where}: party entry {index} ({entry.name}) is the {role} (the label party comes "
            f"first, data parties after it), found role {entry.role[:40]!r}."
        )
    files = entry.files
    if (
        Path(entry.directory).name != entry.directory
        or entry.directory in ("", ".", "..")
        or not isinstance(files, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        raise DataError(
            f"{where}: a plain directory name and file hashes expected for {entry.name}."
        )
    if entry.location not in LOCATIONS or (entry.location == LOST) != (not files):
        raise DataError(
            f"{where}: {entry.name}: a location of {', '.join(LOCATIONS)} expected, with file "
            f"hashes unless {LOST!r}; found location {entry.location!r} and {len(files)} files."
        )
    if index == 0 and entry.location != HERE:  # it predicts: its part is the manifest's
        raise DataError(
            f"{where}: the label party {entry.name}: location {HERE!r} expected (its part beside "
            f"the manifest), found {entry.location!r}."
        )
    return entry


def save_model(
    directory: Path,
    parties: Sequence[DataParty],
    *,
    method: str,
    seed: int,
    method_config: methods.MethodConfig,
    false_vfl: FalseVflConfig | None,
    data: VerticalData,
    sources: Sequence[str] | None = None,
) -> Manifest:
    """Save a trained federation into ``directory``: each of ``parties`` (in block order, the
    label party first) writes its own part into its own directory, then the manifest is
    written; ``sources`` names the file each party's data came from (default: its name). The
    whole directory is written beside ``directory`` and swapped in (:func:`replace_directory`):
    a model saved over another keeps none of the other's files."""
    names = list(sources) if sources is not None else [p.name for p in parties]
    saved: list[Manifest] = []

    def write(staged: Path) -> None:
        entries = [saved_here(staged, party, names[k], k) for k, party in enumerate(parties)]
        saved.append(
            write_manifest(
                staged,
                entries,
                run_id=new_run_id(),
                method=method,
                seed=seed,
                method_config=method_config,
                false_vfl=false_vfl,
                data=data,
            )
        )

    replace_directory(directory, write)
    return saved[0]


def new_run_id() -> str:
    """A fresh model run id (32 hex digits)."""
    return uuid.uuid4().hex


def saved_here(directory: Path, party: DataParty, source: str, index: int) -> PartEntry:
    """Party ``index`` writes its own part into ``directory/<its name>/``; its manifest entry."""
    return PartEntry(
        name=party.name,
        source=source,
        role=LABEL_PARTY_ROLE if index == 0 else DATA_PARTY_ROLE,
        directory=party.name,
        files=party.save_part(directory / party.name),
    )


def write_manifest(
    directory: Path,
    entries: Sequence[PartEntry],
    *,
    run_id: str,
    method: str,
    seed: int,
    method_config: methods.MethodConfig,
    false_vfl: FalseVflConfig | None,
    data: VerticalData,
) -> Manifest:
    """Write the manifest tying ``entries`` (in block order) together, last, atomically."""
    manifest = Manifest(
        run_id=run_id,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        secure_vfl_version=__version__,
        method=method,
        seed=seed,
        method_config=asdict(method_config),
        false_vfl=asdict(false_vfl) if false_vfl is not None else None,
        data=data.name,
        kind=data.kind,
        num_classes=data.num_classes,
        block_shapes=data.block_shapes,
        parties=tuple(entries),
    )
    atomic_write_json(directory / MANIFEST_FILE, manifest.to_json())
    return manifest


@dataclass(frozen=True)
class ModelKind:
    """A kind of saved model: what it is, the command that saves it, the one that uses it."""

    what: str
    noun: str
    saved_by: str
    used_by: str


MODEL_KINDS = {
    MANIFEST_SCHEMA: ModelKind(
        "a trained classifier",
        "model",
        "`secure-vfl train`",
        "score rows with `secure-vfl predict`",
    ),
    IMPUTER_SCHEMA: ModelKind(
        "an imputer", "imputer", "`secure-vfl impute`", "fill rows with `secure-vfl fill`"
    ),
}
"""The kinds of model a manifest ties together, by the manifest's schema."""


def refuse_other_kind(payload: Any, schema: str, where: str) -> None:
    """DataError where the manifest ``payload`` (read from ``where``) is another kind of model
    than ``schema``'s, saying which command uses the one found."""
    found = payload.get("schema") if isinstance(payload, dict) else None
    if isinstance(found, str) and found != schema and found in MODEL_KINDS:
        expected, other = MODEL_KINDS[schema], MODEL_KINDS[found]
        raise DataError(
            f"{where}: {expected.what} (saved by {expected.saved_by}) expected, found "
            f"{other.what} (saved by {other.saved_by}): {other.used_by}."
        )


def find_manifest(path: Path, *, schema: str = MANIFEST_SCHEMA) -> Path:
    """The manifest of a model of ``schema`` (:data:`MODEL_KINDS`) at ``path``: a run directory
    (``path/model/manifest.json``), the model directory itself, or its manifest file;
    DataError if there is none."""
    if path.name == MANIFEST_FILE and path.is_file():
        return path
    for candidate in (path / MODEL_DIR / MANIFEST_FILE, path / MANIFEST_FILE):
        if candidate.is_file():
            return candidate
    stopped = ""
    for target in (path / MODEL_DIR, path):  # a save killed between its renames
        hidden = left_beside(target, ".old", links=True)
        if hidden:
            stopped = (
                f" A save over it was stopped before its end and left the model it replaced "
                f"at {hidden[-1]}: the next save there puts it back first, or rename it to "
                f"{target}."
            )
            break
    raise DataError(
        f"no saved {MODEL_KINDS[schema].noun} at {path}: expected "
        f"{path / MODEL_DIR / MANIFEST_FILE} (written by {MODEL_KINDS[schema].saved_by}) or a "
        f"model directory holding manifest.json.{stopped}"
    )


def read_manifest(path: Path) -> tuple[Manifest, Path]:
    """The manifest of the model at ``path`` and the model directory it lies in."""
    manifest_path = find_manifest(path)
    payload = parse_json(manifest_path.read_bytes(), str(manifest_path))
    return Manifest.from_json(payload, str(manifest_path)), manifest_path.parent


@dataclass(frozen=True)
class Predictions:
    """Class probabilities of new rows keyed by id: ``probabilities`` (N, C), NaN on a row the
    method makes no prediction for; ``mask`` (N, K) which parties held each row. Refuses
    (ConfigError) output columns that are empty or that two columns share
    (:func:`output_columns`), and probabilities of another number of classes (DataError)."""

    ids: np.ndarray
    probabilities: np.ndarray
    mask: np.ndarray
    classes: tuple[ClassValue, ...]
    parties: tuple[str, ...]
    id_column: str = "id"
    label_column: str = PREDICTED_COLUMN

    def __post_init__(self) -> None:
        if self.probabilities.shape != (self.ids.size, len(self.classes)):
            raise DataError(
                f"class probabilities of shape ({self.ids.size}, {len(self.classes)}) expected "
                f"(one per row and class value), found {self.probabilities.shape}."
            )
        output_columns(self.id_column, self.label_column, self.classes)

    def labels(self) -> list[ClassValue | None]:
        """The predicted label of every row in the label file's own values (None: the method
        makes no prediction for it)."""
        predicted = np.nan_to_num(self.probabilities, nan=-1.0).argmax(axis=1)
        made = ~np.isnan(self.probabilities).any(axis=1)
        return [self.classes[c] if ok else None for c, ok in zip(predicted, made, strict=True)]

    def frame(self) -> pd.DataFrame:
        """One row per id: the id (under ``id_column``), the predicted label (under
        ``label_column``; its values keep their type, missing where the method makes no
        prediction) and one probability column per class, ``p_<class value>``."""
        # pd.array keeps integer labels integers beside a missing one (a list makes them floats).
        frame = pd.DataFrame({self.id_column: self.ids, self.label_column: pd.array(self.labels())})
        for c, value in enumerate(self.classes):
            frame[probability_column(value)] = self.probabilities[:, c]
        return frame

    def write(self, path: Path | str, *, replace: bool = True) -> None:
        """Write :meth:`frame` to ``path`` atomically: Parquet where its suffix is
        ``.parquet`` or ``.pq`` (as the party files may be), else CSV; ``replace=False`` keeps
        a file there (:func:`~secure_vfl.io.atomic_write`)."""
        path = Path(path)

        def write(tmp: Path) -> None:
            frame = self.frame()
            if path.suffix.lower() in (".parquet", ".pq"):
                frame.to_parquet(tmp, index=False)
            else:
                frame.to_csv(tmp, index=False)

        atomic_write(path, write, replace=replace)


def probability_column(value: ClassValue) -> str:
    """The output's column of the probability of class ``value``."""
    return f"p_{value}"


def output_columns(id_column: str, label_column: str, classes: Sequence[ClassValue]) -> list[str]:
    """The columns of a prediction's output: the id, the predicted label, one probability per
    class. ConfigError for an empty name, or a name two of them share (the label column named
    as the id column or a ``p_<class>`` column would replace it)."""
    for what, name in (("id", id_column), ("predicted label", label_column)):
        if not isinstance(name, str):
            raise ConfigError(
                f"the {what}'s column: a column name (str) expected; found "
                f"{type(name).__name__} {name!r}."
            )
    probabilities = [probability_column(value) for value in classes]
    columns = [id_column, label_column, *probabilities]
    if label_column in (id_column, *probabilities) or not label_column:
        others = ", ".join([id_column, *probabilities])
        raise ConfigError(
            "the predicted label's column: a non-empty name other than the output's other "
            f"columns ({others}) expected; found {label_column!r}."
        )
    if not id_column or len(set(columns)) < len(columns):
        raise ConfigError(
            "distinct, non-empty output column names expected (the id, the predicted label, "
            f"p_<class> per class); found {columns}."
        )
    return columns


def union_alignment(party_ids: Sequence[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    """The sorted ids held by any party and ``rows`` (N, K): the row of party k's table that
    holds each id, -1 where party k does not (or gave no file)."""
    given = [ids for ids in party_ids if ids is not None]
    if not given:
        raise ConfigError("expected at least one party file to predict from. Found none.")
    sample_ids = np.unique(np.concatenate([ids.astype(str) for ids in given]))
    rows = np.full((sample_ids.size, len(party_ids)), -1, dtype=np.int64)
    for k, ids in enumerate(party_ids):
        if ids is None:
            continue
        position = np.searchsorted(sample_ids, ids.astype(str))
        rows[position, k] = np.arange(ids.size)
    return sample_ids, rows


def predict_tables(
    method: methods.Method,
    channel: Channel,
    tables: Sequence[tuple[PartyTable, str] | None],
    *,
    split: str = PREDICT_SPLIT,
    names: Sequence[str] | None = None,
    id_column: str | None = None,
    label_column: str = PREDICTED_COLUMN,
) -> Predictions:
    """Predict new rows with a trained federation (in memory or loaded): party k is handed its
    own table ``tables[k]`` (with the path it came from) or None, and holds its rows of the
    aligned ids after its own preprocessing; the label party's program then predicts from
    the blocks present (FALSE-VFL, as its saved model does: every row with the same draws,
    :func:`~secure_vfl.methods.false_vfl.draws_as_saved`). Refuses an absent party where the
    method cannot do without it, and
    output columns that collide (:func:`output_columns`), before any row is read. The output
    names the ids ``id_column`` (default: the one the model was trained with) and the
    predicted label ``label_column``."""
    if method.fed.fit != "trained":
        raise ConfigError(
            f"{method.name} has not been trained ({method.fed.fit}): expected method.fit() "
            "before predicting, or a saved model (SavedModel.load)."
        )
    parties = in_process_parties(channel)
    if len(tables) != len(parties):
        raise ConfigError(f"one entry per party expected ({len(parties)}); found {len(tables)}.")
    names = list(names) if names is not None else [p.name for p in parties]
    refuse_absent(method, [names[k] for k, table in enumerate(tables) if table is None])
    refuse_same_tables(tables, names)
    id_column = output_id_column(method.fed.own, id_column, label_column)
    party_ids = [None if t is None else t[0].ids for t in tables]
    sample_ids, rows = union_alignment(party_ids)
    warn_disjoint(
        party_ids, [f"{t[1]} ({names[k]})" if t else "" for k, t in enumerate(tables)], rows
    )
    for k, party in enumerate(parties):
        entry = tables[k]
        table, source = entry if entry is not None else (None, "")
        party.hold_rows(split, table, rows[:, k], source=source)
    with draws_as_saved(method, parties):  # a trained FALSE-VFL in memory draws as saved
        return predict_rows(
            method,
            sample_ids,
            rows,
            names,
            split=split,
            id_column=id_column,
            label_column=label_column,
        )


def refuse_same_tables(
    tables: Sequence[tuple[PartyTable, str] | None], names: Sequence[str]
) -> None:
    """DataError where two parties are handed the same table (one file given for both, or a
    copy of it): one party's rows would be read as the other's features, and predicted from
    without a word where their columns share names, as ``train`` refuses it
    (:func:`~secure_vfl.data.party_files.check_party_tables`)."""
    for k, entry in enumerate(tables):
        for j in range(k):
            earlier = tables[j]
            if entry is not None and earlier is not None and same_table(earlier[0], entry[0]):
                raise DataError(
                    f"{earlier[1]} ({names[j]}) and {entry[1]} ({names[k]}) hold the same table "
                    "(same ids, columns and values); expected each party's own file."
                )


def warn_disjoint(
    party_ids: Sequence[np.ndarray | None], where: Sequence[str], rows: np.ndarray
) -> None:
    """Warn about a party's rows (``where[k]`` names them) that share no id with the other
    parties' (:func:`union_alignment`'s ``rows``): each is predicted from its block alone, and
    theirs without it (ids are compared as written: ``C9001`` is not ``c9001``)."""
    given = [k for k, ids in enumerate(party_ids) if ids is not None and ids.size]
    if len(given) < 2:
        return
    held = rows[:, given] >= 0
    shared = held.sum(axis=1) > 1
    for column, k in enumerate(given):
        own = party_ids[k]
        assert own is not None
        if not (held[:, column] & shared).any():
            other = next(j for j in given if j != k)
            theirs = party_ids[other]
            assert theirs is not None
            warnings.warn(
                f"{where[k]} shares no id with the other parties' (e.g. {str(own[0])!r} there, "
                f"{str(theirs[0])!r} in {where[other]}); ids are compared as written, so each "
                "of its rows is predicted from its block alone: write the same ids alike in "
                "every file.",
                RunWarning,
                stacklevel=3,
            )
            continue
        others = np.concatenate([party_ids[j] for j in given if j != k])
        near = near_matches(own.astype(str), others.astype(str))
        if near:
            warnings.warn(
                f"{where[k]}: {len(near)} of its ids read as ids of the other parties' rows "
                "once spaces, case, leading zeros or '.0' are ignored (e.g. "
                f"{near[0][0]!r} there, {near[0][1]!r} elsewhere); ids are compared as written, "
                "so those rows are predicted apart, each from fewer blocks: write the same ids "
                "alike in every file.",
                RunWarning,
                stacklevel=3,
            )


def output_id_column(label_party: DataParty, id_column: str | None, label_column: str) -> str:
    """The output's id column (``id_column``, default the one ``label_party`` was trained with),
    once the output's columns are checked against its class values (:func:`output_columns`;
    unchecked where it keeps none, which a prediction refuses)."""
    if id_column is None:
        preprocessing = label_party.preprocessing
        id_column = preprocessing.id_column if preprocessing is not None else ID_COLUMN
    if label_party.classes is not None:
        output_columns(id_column, label_column, label_party.classes)
    return id_column


def refuse_absent(method: methods.Method, absent: Sequence[str]) -> None:
    """ConfigError if parties ``absent`` are, and ``method`` cannot predict without them."""
    reason = getattr(method, "absent_block_refusal", None)
    if absent and reason is not None:
        raise ConfigError(
            f"{method.name} cannot predict with the block of {', '.join(absent)} absent: "
            f"{reason}. Give every party's file, or use a method that predicts from the blocks "
            "present (laser)."
        )


def predict_rows(
    method: methods.Method,
    sample_ids: np.ndarray,
    rows: np.ndarray,
    names: Sequence[str],
    *,
    split: str = PREDICT_SPLIT,
    id_column: str | None = None,
    label_column: str = PREDICTED_COLUMN,
) -> Predictions:
    """The label party's prediction of ``split`` once every party holds its rows of it
    (``rows`` (N, K): party k's row of each sample, -1 where it holds none), its output
    columns named as :func:`predict_tables` names them."""
    label_party = method.fed.own
    if label_party.classes is None:
        raise DataError(f"{label_party.name} keeps no class values; cannot name the labels.")
    id_column = output_id_column(label_party, id_column, label_column)
    mask = rows >= 0
    blocks = getattr(method, "blocks", None)
    samples = label_party.training_samples
    if isinstance(blocks, ReleaseBlocks) and samples is not None:
        # The ids the model trained on are summed as in training (F29), the others by the
        # fixed partition.
        blocks = blocks.with_training(samples.mask)
        blocks.match(split, samples.rows_of(sample_ids))
        cast(Any, method).blocks = blocks
    method.fed.learn_split(split, mask)
    probabilities = method.predict_proba(split)
    _warn_unused_blocks(method, split, mask, names)
    return Predictions(
        ids=sample_ids,
        probabilities=probabilities,
        mask=mask,
        classes=label_party.classes,
        parties=tuple(names),
        id_column=id_column,
        label_column=label_column,
    )


def _warn_unused_blocks(
    method: methods.Method, split: str, mask: np.ndarray, names: Sequence[str]
) -> None:
    """A model trained under secure sums predicts from whole blocks of other parties only:
    warn (RunWarning) of rows whose present blocks it left out, and of rows it predicted from
    the prior, naming the blocks (a user who gave one file of a block sees why it changed
    nothing)."""
    blocks = getattr(method, "blocks", None)
    if not isinstance(blocks, ReleaseBlocks):
        return
    unused, prior = blocks.unused(split, mask)
    if not unused.any() and not prior.any():
        return
    together = "; ".join(
        "{" + ", ".join(names[k] for k in block) + "}" for block in blocks.fixed_blocks()
    )
    left_out = ", ".join(
        f"{names[int(k)]} ({counted(int(unused[:, k].sum()), 'row')})"
        for k in np.flatnonzero(unused.any(axis=0))
    )
    again = blocks.matched(split)
    if again:  # their blocks are their own, as in training
        together += f"; for the {again} ids it trained on, their training blocks"
    warnings.warn(
        RunWarning(
            "the model was trained under secure sums: it predicts from the label party's "
            f"block and whole blocks of other parties ({together}), each used only where all "
            f"its members hold the row. Left out: {left_out or 'none'}; "
            f"{int(prior.sum())} of {counted(len(mask), 'row')} predicted from the prior (nothing "
            "usable held). Give every member of a block to use it."
        ),
        stacklevel=2,
    )


class SavedModel:
    """A federation rebuilt from its manifest, every party holding the part it loaded itself.

    ``SavedModel.load(path)`` reads ``path/model/manifest.json`` (or ``path/manifest.json``);
    :meth:`predict` scores new rows. Prediction runs in plain sums in this process (every party
    whose part is here is here); a model trained under secure sums still predicts from the
    subsets it was trained to release. A deployed data party's part that was not copied beside
    the manifest leaves that party absent from every prediction (:attr:`absent`).
    """

    def __init__(self, manifest: Manifest, directory: Path) -> None:
        self.manifest = manifest
        self.directory = directory
        self.channel = Channel()
        self.channel.party_names = [entry.name for entry in manifest.parties]
        refuse_unlisted(manifest, directory)
        # Decided once, as the parts are loaded: a part copied later is not in this model.
        self._not_copied = frozenset(
            entry.name
            for entry in manifest.parties
            if entry.location == KEPT_BY_PARTY and not (directory / entry.directory).is_dir()
        )
        loaded = {
            k: read_party_part(directory / entry.directory, entry, manifest)
            for k, entry in enumerate(manifest.parties)
            if entry.location != LOST and self._copied(entry)
        }
        refuse_unfit_parts(manifest, loaded)
        self.method = rebuild_method(manifest, self.channel)
        uncopied = [entry for entry in manifest.parties if not self._copied(entry)]
        if uncopied and getattr(self.method, "absent_block_refusal", None) is not None:
            raise DataError(
                f"{self._uncopied(uncopied[0])}: expected a copy of it there, since "
                f"{manifest.method} predicts only with every party's block."
            )
        parties = in_process_parties(self.channel)
        for k, (party, entry) in enumerate(zip(parties, manifest.parties, strict=True)):
            if party.name != entry.name:
                raise DataError(f"party {entry.name} expected in block order, found {party.name}.")
            if k in loaded:
                load_party_part(party, loaded[k], entry)
        self.method.fed.fit = "trained"  # by the run that saved it

    def _copied(self, entry: PartEntry) -> bool:
        """Whether ``entry``'s part lay here when the model loaded: always, but for a deployed
        party's part that was not copied beside the manifest."""
        return entry.name not in self._not_copied

    def _uncopied(self, entry: PartEntry) -> str:
        """Why a deployed party's part is not here, and where a copy is expected."""
        return (
            f"the part of {entry.source} is kept by that party (its `party serve --model-dir "
            f"DIR`, under DIR/{entry.name}/{self.manifest.run_id}/) and was not copied to "
            f"{self.directory / entry.directory}"
        )

    @property
    def lost(self) -> tuple[str, ...]:
        """The parties lost in training (a deployed run): they saved no part and are absent
        from every prediction."""
        return tuple(entry.source for entry in self.manifest.parties if entry.location == LOST)

    @property
    def absent(self) -> dict[str, str]:
        """The parties absent from every prediction here, each with why: lost in training, or
        a deployed party whose part was not copied beside the manifest."""
        return {
            entry.source: "lost in training"
            if entry.location == LOST
            else "its part is kept by that party and was not copied here"
            for entry in self.manifest.parties
            if entry.location == LOST or not self._copied(entry)
        }

    @classmethod
    def load(cls, path: Path) -> SavedModel:
        """Load the model saved at ``path`` (a run directory or its ``model/``)."""
        if not isinstance(path, str | os.PathLike):
            raise ConfigError(
                f"`path` must be a path to a run directory or its model/. Found "
                f"{type(path).__name__}."
            )
        manifest, directory = read_manifest(Path(path))
        return cls(manifest, directory)

    @property
    def party_names(self) -> tuple[str, ...]:
        """Each party's name as the user knows it (its file's stem made safe, or the
        ``--party-name`` given in training)."""
        return tuple(entry.source for entry in self.manifest.parties)

    @property
    def id_column(self) -> str:
        """The id column the model was trained with (the label party's preprocessing)."""
        preprocessing = in_process_parties(self.channel)[0].preprocessing
        return preprocessing.id_column if preprocessing is not None else ID_COLUMN

    def party_index(self, name: str) -> int:
        """The block index of the party called ``name`` (its source or its party-k name)."""
        for k, entry in enumerate(self.manifest.parties):
            if name in (entry.source, entry.name):
                return k
        raise ConfigError(
            f"unknown party {name!r}; this model's parties are "
            f"{', '.join(f'{e.source} ({e.name})' for e in self.manifest.parties)}."
        )

    def predict(
        self,
        tables: Mapping[str, tuple[PartyTable, str]],
        *,
        id_column: str | None = None,
        label_column: str = PREDICTED_COLUMN,
    ) -> Predictions:
        """Class probabilities of the rows of ``tables`` (party name -> its table and the path
        it came from); a party not named is absent for every row. The output's columns are
        ``id_column`` (default :attr:`id_column`), ``label_column`` and ``p_<class>`` per
        class, refused before any row is read if they collide (:func:`output_columns`)."""
        if not isinstance(tables, Mapping):
            raise TypeError(
                "a mapping of party name -> (PartyTable, path) expected, e.g. {'bank': "
                f"(read_party_file(path), str(path))}}; found {type(tables).__name__}."
            )
        by_index: list[tuple[PartyTable, str] | None] = [None] * len(self.manifest.parties)
        for name, table in tables.items():
            if not (
                isinstance(table, tuple) and len(table) == 2 and isinstance(table[0], PartyTable)
            ):
                raise TypeError(
                    f"{name}: a (PartyTable, path) pair expected (read_party_file(path), "
                    f"str(path)), found {type(table).__name__}."
                )
            if table[0].ids.size == 0:  # as read_party_file refuses a file without rows
                raise DataError(f"{table[1]} must have at least one row. Found none.")
            k = self.party_index(name)
            if by_index[k] is not None:
                raise ConfigError(
                    f"{name}: one table per party expected, found two for "
                    f"{party_label(self.manifest.parties[k])}."
                )
            entry = self.manifest.parties[k]
            if entry.location == LOST:
                raise ConfigError(
                    f"{entry.source} was lost in training and saved no part; this model predicts "
                    "without its block: leave its file out."
                )
            if not self._copied(entry):
                raise DataError(
                    f"{self._uncopied(entry)}: expected a copy of it there to predict with "
                    f"{entry.source}'s rows in this process, or leave its file out (it is then "
                    "absent from every row)."
                )
            by_index[k] = table
        return predict_tables(
            self.method,
            self.channel,
            by_index,
            names=self.party_names,
            id_column=id_column,
            label_column=label_column,
        )


def refuse_unlisted(manifest: Manifest, directory: Path) -> None:
    """IntegrityError naming a file or directory in the model ``directory`` that ``manifest``
    does not list: the directory holds the manifest and a directory per saved part (a
    deployed party's part only once copied there), and each of those only its part's files."""
    entries = {entry.directory: entry for entry in manifest.parties if entry.location != LOST}
    for path in sorted(directory.iterdir()):
        if path.name == MANIFEST_FILE and path.is_file():
            continue
        entry = entries.get(path.name)
        if entry is None or not path.is_dir():
            listed = [f"{e.directory}/" for e in entries.values()]
            raise IntegrityError(
                f"{path} is not listed in {directory / MANIFEST_FILE}; the model directory "
                f"should hold only {', '.join([MANIFEST_FILE, *listed])}. Refused: remove it or "
                "save the model again."
            )
        refuse_unlisted_files(path, entry.files, who=party_label(entry))


def refuse_unlisted_files(directory: Path, files: Mapping[str, str], *, who: str) -> None:
    """IntegrityError naming a file or directory in the part ``directory`` of party ``who``
    other than ``files`` (its manifest entry's)."""
    for path in sorted(directory.iterdir()):
        if path.name in files and not path.is_file():
            raise IntegrityError(
                f"{who}: {path}: the file the manifest lists expected; found a directory or "
                "something else. Refused: save the model again."
            )
        if path.name not in files:
            raise IntegrityError(
                f"{who}: {path} is not listed in the manifest, which lists only "
                f"{sorted(files)} in its part. Refused: remove it or save the model again."
            )


def party_label(entry: PartEntry) -> str:
    """A party as errors name it: the user's name of it, and its internal one if it differs."""
    return entry.source if entry.source == entry.name else f"{entry.source} ({entry.name})"


def read_party_part(directory: Path, entry: PartEntry, manifest: Manifest) -> parts.Part:
    """The part of the party of ``manifest``'s ``entry``, read from ``directory`` (every file
    checked against the entry's SHA-256); an error names the party as the user does
    (:func:`party_label`). Class values must be the manifest's ``num_classes``, distinct also
    as the output's text."""
    who = party_label(entry)
    try:
        part = parts.load_part(directory, entry.files, party=entry.name)
    except (DataError, IntegrityError) as error:
        raise type(error)(f"{who}: {_unnamed(error, entry)}") from None
    classes = part.classes
    if (
        classes is not None
        and not len({str(c) for c in classes}) == len(classes) == manifest.num_classes
    ):
        raise DataError(
            f"{who}: {directory / parts.CLASSES_FILE}: {manifest.num_classes} class values, "
            "distinct as text, expected (the manifest's num_classes), found "
            f"{len(classes)}: {list(classes)!r:.120}."
        )
    samples = part.training_samples
    if samples is not None and (
        entry.role != LABEL_PARTY_ROLE or samples.mask.shape[1] != len(manifest.parties)
    ):
        raise DataError(
            f"{who}: {directory / parts.TRAINING_SAMPLES_FILE}: the label party's training "
            f"samples over the manifest's {len(manifest.parties)} parties expected, found "
            f"{samples.mask.shape[1]} parties at the {entry.role}."
        )
    return part


def _unnamed(error: Exception, entry: PartEntry) -> str:
    return str(error).removeprefix(f"{entry.name}: ")


def refuse_unfit_parts(
    manifest: Manifest, loaded: Mapping[int, parts.Part], *, secure_sums: bool = False
) -> None:
    """IntegrityError for a part of ``loaded`` (by block index) that does not fit the
    architecture ``manifest`` describes (``secure_sums`` as :func:`rebuild_method`'s), that
    architecture built first on torch's meta device: a manifest edited to ask for a vast
    network is refused by the saved shapes before any of its memory is taken (a part's files
    bound what it holds)."""
    import torch

    channel = Channel()
    channel.party_names = [entry.name for entry in manifest.parties]
    with torch.device("meta"):
        rebuild_method(manifest, channel, secure_sums=secure_sums)
    for k, party in enumerate(in_process_parties(channel)):
        if k in loaded:
            entry = manifest.parties[k]
            parts.refuse_unfit(party.own_modules(), loaded[k].states, party=party_label(entry))
    for k, part in loaded.items():  # the inputs its preprocessing makes, the model's
        made = tuple(part.preprocessing.block_shape) if part.preprocessing is not None else None
        if made is not None and made != tuple(manifest.block_shapes[k]):
            raise IntegrityError(
                f"{party_label(manifest.parties[k])}: its preprocessing makes blocks of shape "
                f"{list(made)}, the manifest's block_shapes say {list(manifest.block_shapes[k])} "
                "(its part and the manifest come from different models?)."
            )


def load_party_part(party: DataParty, part: parts.Part, entry: PartEntry) -> None:
    """``party`` takes its own ``part`` (its manifest ``entry``'s, read by
    :func:`read_party_part`); an error names it as the user does (:func:`party_label`)."""
    try:
        party.load_part(part)
    except (DataError, IntegrityError) as error:
        raise type(error)(f"{party_label(entry)}: {_unnamed(error, entry)}") from None


def rebuild_method(
    manifest: Manifest,
    channel: Channel,
    *,
    aggregator: SumBackend | None = None,
    secure_sums: bool = False,
) -> methods.Method:
    """The method's federation with fresh modules of the saved architectures, built on one
    placeholder row per party that ``channel`` hosts (in one process every party; deployed,
    the label party alone): nothing is trained, the parties load their parts next. With a
    sealing ``aggregator`` its keys are set up by messages, as in training; ``secure_sums``
    plans only the sums such a backend may release (:class:`~secure_vfl.methods.MethodConfig`),
    whatever the model was trained under (ConfigError for a method that cannot)."""
    from secure_vfl.experiment import make_method

    for key, kind, given in (
        ("method_config", methods.MethodConfig, manifest.method_config),
        ("false_vfl", FalseVflConfig, manifest.false_vfl or {}),
    ):
        known = {field.name for field in dataclasses.fields(kind)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise DataError(
                f"the manifest's {key} names settings this version does not have: {unknown} "
                f"(it has {sorted(known)}); a model from another version of secure-vfl?"
            )
    config = methods.MethodConfig(**manifest.method_config)
    false_vfl = FalseVflConfig(**manifest.false_vfl) if manifest.false_vfl else None
    config = replace(
        config, labeled=None, pretrain_epochs=0, secure_sums=config.secure_sums or secure_sums
    )
    blocks = tuple(np.zeros((1, *shape), dtype=np.float32) for shape in manifest.block_shapes)
    placeholder = VerticalSplit(
        blocks=blocks,
        labels=np.zeros(1, dtype=np.int64),
        mask=np.ones((1, len(blocks)), dtype=bool),
    )
    data = VerticalData(
        name=manifest.data,
        kind=cast(Any, manifest.kind),
        num_classes=manifest.num_classes,
        train=placeholder,
        tests={},
        dropped={},
    )
    method = make_method(
        manifest.method,
        data,
        config,
        seed=manifest.seed,
        false_vfl=false_vfl,
        channel=channel,
        aggregator=aggregator,
    )
    if isinstance(method, FalseVflMethod):  # a row's prediction: a function of the row alone
        method.shared_draws = True
        for index, party in enumerate(in_process_parties(channel)):  # in block order
            predict_as_saved(party, manifest.seed, index)
    return method
