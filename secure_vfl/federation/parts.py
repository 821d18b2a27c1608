"""One party's saved part of a federation: its own modules, preprocessing and class mapping.

A party writes its part into its own directory and reads it back from there; nothing here reads
another party's state. A part is

- ``part.json``: which module is in which file, and the names of its other files;
- one state dict per module (``bottom``, ``head``, ``bottom/subset:0,1``, FALSE-VFL's
  ``label-model`` ...), written atomically as a tensor file (:mod:`secure_vfl.tensor_file`:
  safetensors, raw buffers under a JSON header; no pickle, so no code runs from a model file);
- ``preprocessing.json`` (:class:`~secure_vfl.data.party_preprocessing.PartyPreprocessing`) and,
  at the label party, ``classes.json`` (the label file's own label values, in class order).

Every file is checked against the SHA-256 the federation's manifest lists for it before it is
parsed: a missing, extra or altered file is refused (:class:`~secure_vfl.errors.IntegrityError`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
ClassValue = str | int | float | bool


@dataclass(frozen=True)
class Part:
    """What a party reads back from its part: module states by name, its preprocessing (None
    where it kept none) and, at the label party, its class values."""

    states: dict[str, dict[str, Tensor]]
    preprocessing: PartyPreprocessing | None
    classes: tuple[ClassValue, ...] | None


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
    write_json(
        PART_INDEX,
        {
            "schema": PART_SCHEMA,
            "version": PART_VERSION,
            "party": party,
            "role": role,
            "modules": files,
            "preprocessing": PREPROCESSING_FILE if preprocessing is not None else None,
            "classes": CLASSES_FILE if classes is not None else None,
        },
    )
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
    for key in ("preprocessing", "classes"):
        if not isinstance(index.get(key), str | None):
            raise DataError(
                f"{where}: {key}: a file name or null expected, found {index[key]!r:.60}."
            )
    named = [*modules.values(), index.get("preprocessing"), index.get("classes")]
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
    return Part(states=states, preprocessing=preprocessing, classes=classes)


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
