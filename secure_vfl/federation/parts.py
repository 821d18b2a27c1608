"""One party's saved part of a federation: its own modules, preprocessing and class mapping.

A party writes its part into its own directory and reads it back from there; nothing here reads
another party's state. A part is

- ``part.json``: which module is in which file, and the names of its other files;
- one state dict per module (``bottom``, ``head``, ``bottom/subset:0,1``, FALSE-VFL's
  ``label-model`` ...), written atomically as a tensor file (:mod:`secure_vfl.tensor_file`:
  safetensors, raw buffers under a JSON header; no pickle, so no code runs from a model file);
- ``preprocessing.json`` (:class:`~secure_vfl.data.party_preprocessing.PartyPreprocessing`) and,
  at the label party, ``classes.json`` (the label file's own label values, in class order);
- at the label party of a deployed run under secure sums, ``training-samples.safetensors``
  (:class:`TrainingSamples`): which samples it trained on, by salted digests of their ids, and
  which parties held each as the run started, so that a later prediction of such a sample sums
  its parties as its training did (:meth:`~secure_vfl.federation.releases.ReleaseBlocks.match`).

Every file is checked against the SHA-256 the federation's manifest lists for it before it is
parsed: a missing, extra or altered file is refused (:class:`~secure_vfl.errors.IntegrityError`).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from secure_vfl.data.party_files import LABEL_COLUMN
from secure_vfl.data.party_preprocessing import PartyPreprocessing
from secure_vfl.errors import DataError, IntegrityError
from secure_vfl.io import atomic_write, atomic_write_json, parse_json
from secure_vfl.tensor_file import SUFFIX, dumps, loads

PART_SCHEMA = "secure-vfl/party-part"
CLASSES_SCHEMA = "secure-vfl/classes"
PART_VERSION = 2  # 2: state dicts as tensor files (1: torch.save)
PART_INDEX = "part.json"
PREPROCESSING_FILE = "preprocessing.json"
CLASSES_FILE = "classes.json"
TRAINING_SAMPLES_FILE = f"training-samples{SUFFIX}"
ClassValue = str | int | float | bool
SALT_BYTES = 16


@dataclass(frozen=True, eq=False)
class TrainingSamples:
    """The samples a run trained on, as its label party keeps them in its part: each one's
    id as ``SHA-256(salt || UTF-8 id)`` (``digests`` (N, 32) uint8, in training-row order; the
    ids themselves are not kept, but whoever holds the part can test whether a given id was
    trained on) and which parties held it as the run started (``mask`` (N, K) bool)."""

    salt: bytes
    digests: np.ndarray
    mask: np.ndarray

    def __post_init__(self) -> None:
        digests, mask = self.digests, self.mask
        if len(self.salt) != SALT_BYTES:
            raise DataError(f"a salt of {SALT_BYTES} bytes expected, found {len(self.salt)}.")
        if digests.dtype != np.uint8 or digests.ndim != 2 or digests.shape[1] != 32:
            raise DataError(
                f"digests of shape (N, 32) uint8 expected, found {digests.shape} {digests.dtype}."
            )
        if mask.dtype != np.bool_ or mask.ndim != 2 or mask.shape[0] != digests.shape[0]:
            raise DataError(
                f"a (N, K) bool mask of {digests.shape[0]} rows expected, found {mask.shape} "
                f"{mask.dtype}."
            )
        if digests.shape[0] == 0 or len(np.unique(digests, axis=0)) != digests.shape[0]:
            raise DataError(
                f"distinct digests of at least one sample expected, found {digests.shape[0]} "
                "samples with repeats or none."
            )

    @classmethod
    def of(cls, ids: np.ndarray, mask: np.ndarray) -> TrainingSamples:
        """The training samples ``ids`` (N,) str, held as ``mask`` (N, K) says, under a
        fresh random salt."""
        salt = secrets.token_bytes(SALT_BYTES)
        return cls(salt, _digests(salt, ids), np.asarray(mask, dtype=bool).copy())

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Each of ``ids``' training row (int64), -1 for an id the run did not train on."""
        row_of = {digest.tobytes(): row for row, digest in enumerate(self.digests)}
        asked = _digests(self.salt, ids)
        return np.array([row_of.get(digest.tobytes(), -1) for digest in asked], dtype=np.int64)

    def to_bytes(self) -> bytes:
        return dumps(
            {
                "salt": torch.frombuffer(bytearray(self.salt), dtype=torch.uint8),
                "digests": torch.from_numpy(self.digests),
                "mask": torch.from_numpy(self.mask),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> TrainingSamples:
        tree = loads(data, where)
        if not (
            isinstance(tree, dict)
            and set(tree) == {"salt", "digests", "mask"}
            and all(isinstance(value, Tensor) for value in tree.values())
        ):
            raise DataError(f"{where}: tensors salt, digests and mask expected; found others.")
        salt = tree["salt"]
        if salt.dtype != torch.uint8 or salt.dim() != 1:
            raise DataError(f"{where}: a 1-d uint8 salt expected, found {salt.dtype}.")
        try:
            return cls(bytes(salt.numpy()), tree["digests"].numpy(), tree["mask"].numpy())
        except DataError as error:
            raise DataError(f"{where}: {error}") from None


def _digests(salt: bytes, ids: np.ndarray) -> np.ndarray:
    """(N, 32) uint8: SHA-256 of the salt and each id's UTF-8 text."""
    rows = [hashlib.sha256(salt + str(value).encode("utf-8")).digest() for value in ids]
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), 32).copy()


@dataclass(frozen=True)
class Part:
    """What a party reads back from its part: module states by name, its preprocessing (None
    where it kept none) and, at the label party, its class values and (a deployed run under
    secure sums) its training samples."""

    states: dict[str, dict[str, Tensor]]
    preprocessing: PartyPreprocessing | None
    classes: tuple[ClassValue, ...] | None
    training_samples: TrainingSamples | None = None


def sha256(data: bytes) -> str:
    """The hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def unwrapped(module: nn.Module) -> nn.Module:
    """The module itself inside privacy wrappers (Opacus' GradSampleModule keeps it as
    ``_module``), so a part holds the plain architecture's parameter names."""
    inner = getattr(module, "_module", None)
    return unwrapped(inner) if isinstance(inner, nn.Module) else module


def _file_name(index: int, module: str) -> str:
    return f"{index:02d}-{re.sub(r'[^A-Za-z0-9_-]+', '_', module)}{SUFFIX}"


def save_part(
    directory: Path,
    *,
    party: str,
    role: str,
    modules: Mapping[str, nn.Module],
    preprocessing: PartyPreprocessing | None,
    classes: Sequence[ClassValue] | None,
    training_samples: TrainingSamples | None = None,
) -> dict[str, str]:
    """Write one party's part into ``directory`` (each file atomically); return the SHA-256 of
    every file written, by file name, for the federation's manifest."""
    written: dict[str, str] = {}

    def write_bytes(name: str, data: bytes) -> None:
        def write(tmp: Path) -> None:
            tmp.write_bytes(data)

        atomic_write(directory / name, write)
        written[name] = sha256(data)

    def write_json(name: str, payload: Any) -> None:
        atomic_write_json(directory / name, payload)
        written[name] = sha256((directory / name).read_bytes())

    files = {}
    for index, (name, module) in enumerate(sorted(modules.items())):
        files[name] = _file_name(index, name)
        write_bytes(files[name], dumps(unwrapped(module).state_dict()))
    if preprocessing is not None:
        write_json(PREPROCESSING_FILE, preprocessing.to_json())
    if classes is not None:
        write_json(
            CLASSES_FILE,
            {
                "schema": CLASSES_SCHEMA,
                "version": PART_VERSION,
                "label_column": LABEL_COLUMN,
                "classes": list(classes),
            },
        )
    if training_samples is not None:
        write_bytes(TRAINING_SAMPLES_FILE, training_samples.to_bytes())
    contents: dict[str, Any] = {
        "schema": PART_SCHEMA,
        "version": PART_VERSION,
        "party": party,
        "role": role,
        "modules": files,
        "preprocessing": PREPROCESSING_FILE if preprocessing is not None else None,
        "classes": CLASSES_FILE if classes is not None else None,
    }
    if training_samples is not None:  # an older part names no such file
        contents["training_samples"] = TRAINING_SAMPLES_FILE
    write_json(PART_INDEX, contents)
    return written


def verified_bytes(directory: Path, name: str, files: Mapping[str, str], party: str) -> bytes:
    """The bytes of ``name`` in ``directory`` once they match the SHA-256 the manifest lists."""
    if name not in files:
        raise IntegrityError(
            f"{party}: its part names {name!r}, which the manifest does not list; refused."
        )
    if Path(name).name != name or name.startswith("."):
        raise IntegrityError(f"{party}: a plain file name expected in its part, found {name!r}.")
    path = directory / name
    if not path.is_file():
        raise IntegrityError(f"{party}: part file {path} is missing.")
    data = path.read_bytes()
    if sha256(data) != files[name]:
        raise IntegrityError(
            f"{party}: {path} does not match the SHA-256 in the manifest (altered or from "
            "another run); refused."
        )
    return data


def _state(data: bytes, where: str) -> dict[str, Tensor]:
    """A state dict read from a tensor file: tensors built from raw buffers, nothing else."""
    state = loads(data, where)
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()
    ):
        raise IntegrityError(f"{where}: a mapping of names to tensors expected; found otherwise.")
    return state


def _check_header(payload: Any, schema: str, where: str) -> Mapping[str, Any]:
    if not isinstance(payload, Mapping) or payload.get("schema") != schema:
        raise DataError(f"{where}: a {schema!r} document expected.")
    version = payload.get("version")
    if version != PART_VERSION:
        earlier = version == 1 and ": saved by an earlier secure-vfl, its state dicts pickled"
        raise DataError(
            f"{where}: version {PART_VERSION} expected (this secure-vfl reads only it), found "
            f"{version!r}{earlier or ''}; train and save the model again."
        )
    return payload


def read_classes(data: bytes, where: str) -> tuple[ClassValue, ...]:
    """The class values of ``classes.json``: unique numbers, text or booleans."""
    payload = _check_header(parse_json(data, where), CLASSES_SCHEMA, where)
    classes = payload.get("classes")
    if (
        not isinstance(classes, list)
        or len(classes) < 2
        or not all(isinstance(c, str | int | float | bool) for c in classes)
        or len({json.dumps(c) for c in classes}) != len(classes)
    ):
        raise DataError(f"{where}: at least 2 distinct class values expected, found {classes!r}.")
    return tuple(classes)


def load_part(directory: Path, files: Mapping[str, str], *, party: str) -> Part:
    """Read one party's part from ``directory``, every file checked against ``files`` (its
    manifest entry: file name -> SHA-256); IntegrityError for a missing, unlisted, extra or
    altered file, DataError for a malformed one."""
    where = str(directory / PART_INDEX)
    index = _check_header(
        parse_json(verified_bytes(directory, PART_INDEX, files, party), where), PART_SCHEMA, where
    )
    if index.get("party") != party:
        raise IntegrityError(
            f"{where}: the part of {party} expected, found {index.get('party')!r}."
        )
    modules = index.get("modules")
    if not isinstance(modules, Mapping) or not all(isinstance(v, str) for v in modules.values()):
        raise DataError(f"{where}: a mapping of module names to files expected.")
    for key in ("preprocessing", "classes", "training_samples"):
        if not isinstance(index.get(key), str | None):
            raise DataError(
                f"{where}: {key}: a file name or null expected, found {index[key]!r:.60}."
            )
    named = [
        *modules.values(),
        index.get("preprocessing"),
        index.get("classes"),
        index.get("training_samples"),
    ]
    used = {PART_INDEX, *(name for name in named if name is not None)}
    if used != set(files):
        raise IntegrityError(
            f"{party}: the manifest lists files {sorted(files)}, its part names {sorted(used)}."
        )
    states = {
        name: _state(verified_bytes(directory, file, files, party), str(directory / file))
        for name, file in modules.items()
    }
    preprocessing = None
    if index.get("preprocessing") is not None:
        name = str(index["preprocessing"])
        preprocessing = PartyPreprocessing.from_json(
            parse_json(verified_bytes(directory, name, files, party), str(directory / name)),
            str(directory / name),
        )
    classes = None
    if index.get("classes") is not None:
        name = str(index["classes"])
        classes = read_classes(verified_bytes(directory, name, files, party), str(directory / name))
    training_samples = None
    if index.get("training_samples") is not None:
        name = str(index["training_samples"])
        training_samples = TrainingSamples.from_bytes(
            verified_bytes(directory, name, files, party), str(directory / name)
        )
    return Part(
        states=states,
        preprocessing=preprocessing,
        classes=classes,
        training_samples=training_samples,
    )


def refuse_unfit(
    modules: Mapping[str, nn.Module], states: Mapping[str, Mapping[str, Tensor]], *, party: str
) -> None:
    """IntegrityError naming what differs between the saved ``states`` and this party's
    ``modules`` (their names, then each parameter's name, shape and dtype, and finite values).
    The modules may be on torch's meta device: built there first, an architecture is checked
    against the saved shapes before it takes any memory."""
    if set(modules) != set(states):
        raise IntegrityError(
            f"{party}: modules {sorted(modules)} expected in its part, found {sorted(states)}."
        )
    for name, module in modules.items():
        differs = first_difference(unwrapped(module).state_dict(), states[name])
        if differs is not None:
            raise IntegrityError(
                f"{party}: the saved {name!r} does not fit the architecture the manifest "
                f"describes (its block_shapes and method_config): {differs}."
            )


def load_states(
    modules: Mapping[str, nn.Module], states: Mapping[str, Mapping[str, Tensor]], *, party: str
) -> None:
    """Put the saved states into this party's modules (same names, same architectures), or
    refuse with what differs."""
    refuse_unfit(modules, states, party=party)
    for name, module in modules.items():
        target = unwrapped(module)
        try:
            target.load_state_dict(dict(states[name]), strict=True)
        except RuntimeError as error:
            first = str(error).strip().splitlines()[0]
            raise IntegrityError(
                f"{party}: the saved {name!r} does not fit its architecture ({first})."
            ) from None


def first_difference(built: Mapping[str, Tensor], saved: Mapping[str, Tensor]) -> str | None:
    """The first parameter (or buffer) that ``saved`` lacks, adds or holds in another shape or
    dtype than the module ``built`` has it, or with a value that is not finite (a model that
    would predict NaN); None if every name, shape and dtype agrees and every value is finite."""
    for key in [*built, *(key for key in saved if key not in built)]:
        want = list(built[key].shape) if key in built else None
        have = list(saved[key].shape) if key in saved else None
        if want != have:
            expected = (
                f"no parameter {key!r}" if want is None else f"parameter {key!r} of shape {want}"
            )
            return f"{expected} expected, found {'none' if have is None else have}"
        if built[key].dtype != saved[key].dtype:
            return (
                f"parameter {key!r} of dtype {built[key].dtype} expected, found {saved[key].dtype}"
            )
        if saved[key].is_floating_point() and not bool(saved[key].isfinite().all()):
            return f"parameter {key!r} of finite values expected, found NaN or infinite ones"
    return None
