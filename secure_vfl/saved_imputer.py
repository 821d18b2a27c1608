"""A trained imputer kept on disk and used again: each client's own part plus a manifest.

``impute`` saves into ``DIR/model/`` (for the methods that keep a model: ``mean``,
``fed-mean``, ``dae``, ``fed-dae`` and ``fedhf``): every client writes its own part into its own
directory (``client-0/`` ...; :mod:`secure_vfl.methods.imputation.parts`), and the run writes
``manifest.json`` last, which ties the parts together: the run id, the method and its
configuration (enough to rebuild the architecture), the federation's features, every client's
name and schema (its feature columns) and the SHA-256 of every part file. ``knn`` and ``mice``
keep no model (each fits on the rows it fills) and save none. Deployed, each client saves its
own imputer in its own process, under a manifest that lists it alone
(:meth:`~secure_vfl.deployed_imputation.ServedClient.save_model`).

Filling new rows (:meth:`SavedImputer.fill`) is a client's local step: it reads only its own
part (checked against the manifest's hashes before it is parsed; a file the manifest does not
list is refused) and applies eq. 7 to a table of its own columns, with the id column and the
label column passed through and every cell the table has kept as written
(:meth:`~secure_vfl.data.imputation.ClientFile.imputed_frame`). The other clients' parts need
not be there: a client may keep only its own directory and the manifest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pandas as pd

from secure_vfl import __version__
from secure_vfl.data.imputation import (
    CELL_FORMS,
    ImputationTask,
    client_from_frame,
    read_client_file,
)
from secure_vfl.data.party_files import ID_COLUMN, LABEL_COLUMN
from secure_vfl.errors import ConfigError, DataError, IntegrityError
from secure_vfl.io import (
    atomic_write_json,
    check_document,
    check_keys,
    parse_json,
    replace_directory,
    shown_names,
)
from secure_vfl.methods.imputation import ImputeConfig
from secure_vfl.methods.imputation.fedhf import RECONSTRUCTIONS
from secure_vfl.methods.imputation.parts import ClientPart, read_part
from secure_vfl.saved_model import (
    IMPUTER_SCHEMA,
    MANIFEST_FILE,
    find_manifest,
    refuse_other_kind,
    refuse_unlisted_files,
)

IMPUTER_VERSION = 1
MEAN_METHODS = ("mean", "fed-mean")
"""The methods whose clients keep column means; the reconstruction methods keep a model."""
MAX_FEATURES = 2**16
"""The most features a manifest may name (a bound before anything is built for them)."""
MAX_CLIENTS = 2**12
"""The most clients a manifest may list."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


@runtime_checkable
class SavableImputer(Protocol):
    """A fitted imputer whose clients can write their own parts."""

    def save_part(self, client: str, directory: Path) -> dict[str, str]: ...


@dataclass(frozen=True, kw_only=True)
class ClientEntry:
    """One client in the manifest: its name (its file's stem, or ``client-K`` of a dataset),
    its directory (relative to the manifest), its schema (feature columns) and the SHA-256 of
    each file of its part."""

    name: str
    directory: str
    columns: tuple[str, ...]
    files: dict[str, str]
    forms: dict[str, str]
    """How its training file wrote each column's cells (:data:`~secure_vfl.data.imputation.
    CELL_FORMS`), which its filled cells take in every file it fills; empty for a dataset's
    client (each file's own cells decide)."""


@dataclass(frozen=True, kw_only=True)
class ImputerManifest:
    """What ties the saved parts of one trained imputer together."""

    run_id: str
    created: str
    secure_vfl_version: str
    method: str
    seed: int
    impute_config: dict[str, Any]
    data: str
    id_column: str
    label_column: str
    features: tuple[str, ...]
    clients: tuple[ClientEntry, ...]

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["features"] = list(self.features)
        for entry in payload["clients"]:
            entry["columns"] = list(entry["columns"])
        return {"schema": IMPUTER_SCHEMA, "version": IMPUTER_VERSION, **payload}

    @classmethod
    def from_json(cls, payload: Any, where: str) -> ImputerManifest:
        """Read a manifest, refusing another schema, another version or a malformed entry."""
        refuse_other_kind(payload, IMPUTER_SCHEMA, where)
        check_document(
            payload,
            schema=IMPUTER_SCHEMA,
            versions=(IMPUTER_VERSION,),
            where=where,
            what="imputer manifest",
        )
        body = {k: v for k, v in payload.items() if k not in ("schema", "version")}

        def refuse(wrong: str) -> DataError:
            return DataError(f"{where}: {wrong}.")

        check_keys(body, _MANIFEST_TYPES, refuse=refuse)
        if not re.fullmatch(r"[0-9a-f]{32}", body["run_id"]) or body["seed"] < 0:
            raise refuse(
                f"a run_id of 32 hex digits and a seed >= 0 expected, found "
                f"{body['run_id'][:40]!r} and {body['seed']}"
            )
        if not keeps_model(body["method"]):
            raise refuse(
                f"a method that keeps a model ({', '.join(model_methods())}) expected, found "
                f"{body['method'][:40]!r}"
            )
        if (
            not body["id_column"]
            or not body["label_column"]
            or (body["id_column"] == body["label_column"])
        ):
            raise refuse(
                f"two distinct column names for the ids and labels expected, found "
                f"{body['id_column'][:40]!r} and {body['label_column'][:40]!r}"
            )
        features = body["features"]
        if not (
            2 <= len(features) <= MAX_FEATURES
            and all(isinstance(f, str) for f in features)
            and len(set(features)) == len(features)
        ):
            raise refuse(
                f"2 to {MAX_FEATURES} distinct feature names expected, found "
                f"{len(features)} entries"
            )
        body["features"] = tuple(features)
        clients = body["clients"]
        if not 1 <= len(clients) <= MAX_CLIENTS:
            raise refuse(f"1 to {MAX_CLIENTS} client entries expected, found {len(clients)}")
        body["clients"] = tuple(_entry(e, k, set(features), where) for k, e in enumerate(clients))
        names = [entry.name for entry in body["clients"]]
        directories = [entry.directory for entry in body["clients"]]
        if len(set(names)) != len(names) or len(set(directories)) != len(directories):
            raise refuse(f"distinct client names and directories expected, found {names}")
        manifest = cls(**body)
        manifest.config()  # a configuration this version can build
        return manifest

    def config(self) -> ImputeConfig:
        """The imputation settings the architecture is built from; DataError for settings
        this version does not have or does not accept."""
        try:
            return ImputeConfig(**self.impute_config)
        except (TypeError, ConfigError) as error:
            raise DataError(
                f"the manifest's impute_config does not build here ({error}); an imputer from "
                "another version of secure-vfl?"
            ) from None

    def client(self, name: str) -> ClientEntry:
        """The client named ``name``; ConfigError listing the names there are."""
        for entry in self.clients:
            if entry.name == name:
                return entry
        raise ConfigError(
            f"no client {name!r} in this imputer; expected one of "
            f"{', '.join(entry.name for entry in self.clients)}."
        )


_MANIFEST_TYPES: dict[str, type | tuple[type, ...]] = {
    "run_id": str,
    "created": str,
    "secure_vfl_version": str,
    "method": str,
    "seed": int,
    "impute_config": dict,
    "data": str,
    "id_column": str,
    "label_column": str,
    "features": list,
    "clients": list,
}
_ENTRY_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "directory": str,
    "columns": list,
    "files": dict,
    "forms": dict,
}


def _entry(payload: Any, index: int, features: set[str], where: str) -> ClientEntry:
    def refuse(wrong: str) -> DataError:
        return DataError(f"{where}: client entry {index}: {wrong}.")

    check_keys(payload, _ENTRY_TYPES, refuse=refuse)
    directory, columns, files = payload["directory"], payload["columns"], payload["files"]
    if not payload["name"]:
        raise refuse("a client name expected, found ''")
    if Path(directory).name != directory or directory in ("", ".", ".."):
        raise refuse(f"a plain directory name expected, found {directory[:60]!r}")
    if not (
        columns
        and all(isinstance(c, str) and c in features for c in columns)
        and len(set(columns)) == len(columns)
    ):
        raise refuse("distinct feature columns, each one of the manifest's features, expected")
    if not files or not all(
        isinstance(name, str) and isinstance(digest, str) and _SHA256.fullmatch(digest)
        for name, digest in files.items()
    ):
        raise refuse("file names with their SHA-256 (64 hex digits) expected")
    forms = payload["forms"]
    if not all(column in columns and form in CELL_FORMS for column, form in forms.items()):
        raise refuse(f"a form in {CELL_FORMS} for some of its columns expected")
    return ClientEntry(
        name=payload["name"],
        directory=directory,
        columns=tuple(columns),
        files=dict(files),
        forms=dict(forms),
    )


def model_methods() -> list[str]:
    """The imputation methods that keep a model (``knn`` and ``mice`` keep none)."""
    return [*MEAN_METHODS, *RECONSTRUCTIONS.names()]


def keeps_model(method: str) -> bool:
    """Whether ``impute --method method`` saves a model."""
    return method in model_methods()


PartWriter = Callable[[Path], dict[str, str]]
"""A client writing its own part into a directory; returns each file's SHA-256."""


@dataclass(frozen=True)
class SavedClient:
    """A client to save: its name, its schema (feature columns) and how it writes its part."""

    name: str
    columns: tuple[str, ...]
    forms: dict[str, str]
    write: PartWriter


def write_imputer(
    directory: Path,
    clients: Sequence[SavedClient],
    *,
    run_id: str,
    method: str,
    seed: int,
    config: ImputeConfig,
    data: str,
    features: Sequence[str],
    columns: tuple[str, str],
) -> ImputerManifest:
    """Into the fresh ``directory``: each of ``clients`` writes its own part into
    ``client-K/``, then the manifest tying them together (last, atomically). ``columns``: the
    id and label columns of the clients' files (``fill``'s defaults)."""
    entries = []
    for k, client in enumerate(clients):
        entries.append(
            ClientEntry(
                name=client.name,
                directory=f"client-{k}",
                columns=client.columns,
                files=client.write(directory / f"client-{k}"),
                forms=client.forms,
            )
        )
    manifest = ImputerManifest(
        run_id=run_id,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        secure_vfl_version=__version__,
        method=method,
        seed=seed,
        impute_config=asdict(config),
        data=data,
        id_column=columns[0],
        label_column=columns[1],
        features=tuple(features),
        clients=tuple(entries),
    )
    atomic_write_json(directory / MANIFEST_FILE, manifest.to_json())
    return manifest


def save_imputer(
    directory: Path,
    imputer: object,
    task: ImputationTask,
    *,
    method: str,
    seed: int,
    config: ImputeConfig,
    columns: tuple[str, str] = (ID_COLUMN, LABEL_COLUMN),
) -> ImputerManifest:
    """Save a fitted in-process imputer into ``directory`` (:func:`write_imputer`). The whole
    directory is written beside ``directory`` and swapped in
    (:func:`~secure_vfl.io.replace_directory`): an imputer saved over another keeps none of the
    other's files."""
    if not keeps_model(method) or not isinstance(imputer, SavableImputer):
        raise ConfigError(f"{method} keeps no model to save (it fits on the rows it fills).")
    clients = [
        SavedClient(
            name=client.name,
            columns=_schema(task, k),
            forms=task.files[k].cell_forms() if task.files is not None else {},
            write=functools.partial(imputer.save_part, client.name),
        )
        for k, client in enumerate(task.train)
    ]
    saved: list[ImputerManifest] = []

    def write(staged: Path) -> None:
        saved.append(
            write_imputer(
                staged,
                clients,
                run_id=uuid.uuid4().hex,
                method=method,
                seed=seed,
                config=config,
                data=task.name,
                features=task.features,
                columns=columns,
            )
        )

    replace_directory(directory, write)
    return saved[0]


def _schema(task: ImputationTask, k: int) -> tuple[str, ...]:
    """Client ``k``'s feature columns: its file's, in the file's order; a dataset's client's,
    in the dataset's."""
    if task.files is not None:
        return tuple(str(c) for c in task.files[k].features.columns)
    available = task.train[k].available
    return tuple(f for f, keep in zip(task.features, available, strict=True) if keep)


def _run_method(path: Path) -> str | None:
    """The method of the impute run whose ``result.json`` is in ``path``, if it reads as one."""
    try:
        payload = json.loads((path / "result.json").read_bytes())
        method = payload["config"]["method"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return method if isinstance(method, str) else None


@dataclass(frozen=True)
class Filled:
    """One client file filled: the table (in the file's own form), its rows and how many of
    its empty cells were filled (all of them)."""

    client: str
    table: pd.DataFrame
    rows: int
    filled: int

    def write_csv(self, path: Path) -> None:
        """The table as CSV at ``path`` (written atomically by the caller)."""
        self.table.to_csv(path, index=False)


class SavedImputer:
    """A saved imputer, read from its manifest; each client's part is read when it fills."""

    def __init__(self, manifest: ImputerManifest, directory: Path) -> None:
        self.manifest = manifest
        self.directory = directory
        self._parts: dict[str, ClientPart] = {}  # read once, however many files a client fills

    @classmethod
    def load(cls, path: Path) -> SavedImputer:
        """The imputer at ``path``: an ``impute`` run directory (``path/model/manifest.json``),
        the model directory itself, or its manifest file. Refuses a file or directory there that
        the manifest does not list (IntegrityError)."""
        path = Path(path)
        try:
            manifest_path = find_manifest(path, schema=IMPUTER_SCHEMA)
        except DataError:
            method = _run_method(path)
            if method is None or keeps_model(method):
                raise
            raise DataError(
                f"{path} is an impute run of {method}, which keeps no model (it fits on the "
                f"rows it fills): expected a run of a method that keeps one "
                f"({', '.join(model_methods())})."
            ) from None
        payload = parse_json(manifest_path.read_bytes(), str(manifest_path))
        manifest = ImputerManifest.from_json(payload, str(manifest_path))
        directory = manifest_path.parent
        entries = {entry.directory: entry for entry in manifest.clients}
        for item in sorted(directory.iterdir()):
            if item.name == MANIFEST_FILE and item.is_file():
                continue
            entry = entries.get(item.name)
            if entry is not None and not item.is_dir():
                raise IntegrityError(
                    f"{item}: {entry.name}'s part directory expected, found a file or something "
                    "else. Refused: save the imputer again."
                )
            if entry is None:
                raise IntegrityError(
                    f"{item} is not listed in {manifest_path}; the imputer's directory holds "
                    f"only {MANIFEST_FILE} and its clients' directories. Refused: remove it or "
                    "save the imputer again."
                )
            refuse_unlisted_files(item, entry.files, who=entry.name)
        return cls(manifest, directory)

    def part(self, client: str) -> ClientPart:
        """Client ``client``'s part, read from its directory and checked (once)."""
        if client not in self._parts:
            self._parts[client] = self._read_part(client)
        return self._parts[client]

    def _read_part(self, client: str) -> ClientPart:
        entry = self.manifest.client(client)
        part_directory = self.directory / entry.directory
        if not part_directory.is_dir():
            raise DataError(
                f"{client}: its part is not here: {part_directory} expected (each client may "
                "keep only its own part beside the manifest)."
            )
        method = self.manifest.method
        build = None
        if method not in MEAN_METHODS:
            config = self.manifest.config()
            build = RECONSTRUCTIONS.get(method).models(config, len(self.manifest.features))
        try:
            part = read_part(
                part_directory,
                entry.files,
                client=client,
                features=len(self.manifest.features),
                build=build,
            )
        except (DataError, IntegrityError) as error:
            raise type(error)(f"{client}: {str(error).removeprefix(f'{client}: ')}") from None
        schema = [f for f, keep in zip(self.manifest.features, part.available, strict=True) if keep]
        if set(schema) != set(entry.columns):
            raise IntegrityError(
                f"{client}: its part's schema ({', '.join(schema)}) expected in the manifest, "
                f"found columns {', '.join(entry.columns)}: the part or the manifest was altered "
                "(or put together from two imputers); refused."
            )
        return part

    def fill(
        self,
        path: Path,
        *,
        client: str,
        id_column: str,
        label_column: str,
        ids_required: bool = False,
    ) -> Filled:
        """Client ``client`` fills the empty cells of its file at ``path`` (CSV or Parquet: its
        id column and label column, if any, and some of its feature columns, in any order).
        With ``ids_required`` (an id column the user named) a file without it is refused."""
        if id_column == label_column:
            raise ConfigError(f"the id and label columns must differ. Found both {id_column!r}.")
        entry = self.manifest.client(client)
        part = self.part(client)
        source = read_client_file(
            Path(path), id_column=id_column, label_column=label_column, ids_optional=True
        )
        if ids_required and source.id_column is None:
            raise DataError(
                f"{path} must have the id column `{id_column}` (--id-column). Found columns: "
                f"{list(source.columns)}."
            )
        columns = [str(c) for c in source.features.columns]
        unknown = [c for c in columns if c not in entry.columns]
        if unknown:
            raise DataError(
                f"{path}: feature columns of client {client} expected ({', '.join(entry.columns)}"
                f"; the id column is `{id_column}`, the label column `{label_column}`), found "
                f"{shown_names(unknown)}."
            )
        rows = client_from_frame(client, source.features, self.manifest.features, where=str(path))
        present = rows.available
        # A column of its schema the file lacks: missing cells of a feature the client has, as
        # the model read them in training (not a feature it lacks, which FedHF reads otherwise);
        # filled for the model, not written (the table keeps the file's own columns).
        rows = dataclasses.replace(rows, available=part.available.astype(bool))
        filled = part.impute(rows)
        empty = ~rows.observed & present[None, :]
        table = source.imputed_frame(
            filled, filled[:0], self.manifest.features, as_written=True, forms=entry.forms
        )
        return Filled(client=client, table=table, rows=rows.n, filled=int(empty.sum()))
