"""Checkpoints of a training run: every party writes its own state, and a killed run resumes.

Every ``every`` steps each party writes what it alone holds into its own directory
``<checkpoints>/<party>/step-NNNNNNNN/``:

- ``tensors.safetensors``: its modules' parameters, its optimisers' tensor state and its torch
  generators' states, as a tensor file (:mod:`secure_vfl.tensor_file`: raw buffers and their
  layout under a JSON header; no pickle, so no code runs from a checkpoint);
- ``state.json``: the rest: its optimisers' parameter groups, its numpy generators' states, its
  accountant's releases (DP) and, at the label party, where the run stands
  (:class:`~secure_vfl.methods.base.TrainingProgress`: epoch, step, the epoch's batch order,
  the loss so far), its plan and epoch-order generators, its sampler's schedule (DP's Poisson
  sample) and the run's configuration;
- ``manifest.json``: the run id, the party, the step and the SHA-256 of both files. The label
  party's also lists the SHA-256 of every other party's manifest of that step: this ties the
  parties' checkpoints of one step together.

Each checkpoint is written whole under a temporary name, fsynced and renamed
(:func:`~secure_vfl.io.atomic_directory`). The label party writes last, which commits the
step; then every party drops its older checkpoints. A resumed run starts from the label
party's latest checkpoint, and every file of every party is checked against the manifests
before anything trains. A DP party's noise is not kept: a resumed run draws fresh noise from
the operating system, and its accountant goes on from the releases it had made, those of its
checkpoint and those its release journal ``<checkpoints>/<party>/releases.jsonl`` recorded
after it, up to the kill (:class:`ReleaseJournal`): their receivers saw them.

In a deployment the data parties live in other processes (:class:`PartiesElsewhere`): the label
party asks each by message to write or restore its own checkpoint in its own directory, and
only the manifests' SHA-256 come back (:mod:`secure_vfl.deployment`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch
from torch import Tensor

from secure_vfl import tensor_file
from secure_vfl.data.samplers import BatchSampler, PoissonSampler
from secure_vfl.errors import ConfigError, DataError, IntegrityError, ProtocolError, RunWarning
from secure_vfl.federation.parts import sha256, unwrapped
from secure_vfl.io import atomic_directory, atomic_write_text, check_keys, parse_json
from secure_vfl.methods.base import CHECKPOINT, StepCallback, TrainingProgress

if TYPE_CHECKING:
    from secure_vfl.federation.parties import DataParty
    from secure_vfl.methods.base import Method

SCHEMA = "secure-vfl/checkpoint"
VERSION = 2  # 2: tensors.safetensors (1: tensors.pt, by torch.save)
STATE_FILE = "state.json"
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
CHECKPOINTS_DIR = "checkpoints"
"""The checkpoints' directory inside a run's ``--out`` (unless ``--checkpoint-dir``)."""
_STEP = re.compile(r"step-(\d{8})")


def step_directory(root: Path, party: str, step: int) -> Path:
    """Where ``party`` keeps its checkpoint of ``step`` under ``root``."""
    return root / party / f"step-{step:08d}"


def written_steps(root: Path, party: str) -> list[int]:
    """The steps ``party`` holds a whole checkpoint of under ``root`` (renamed into place;
    temporaries of an interrupted write are not among them), in order."""
    directory = root / party
    if not directory.is_dir():
        return []
    found = (_STEP.fullmatch(child.name) for child in directory.iterdir() if child.is_dir())
    return sorted(int(match.group(1)) for match in found if match is not None)


def checkpoint_root(directory: Path) -> Path:
    """The checkpoints' directory of ``directory``: a run's ``--out`` (its ``checkpoints/``)
    or the checkpoints' directory itself."""
    inner = directory / CHECKPOINTS_DIR
    return inner if inner.is_dir() else directory


# -- one party's own state --------------------------------------------------------------------


def _generators(party: DataParty) -> dict[str, torch.Generator | np.random.Generator]:
    """The random generators the party holds as attributes (a role's own sampling)."""
    return {
        name: value
        for name, value in sorted(vars(party).items())
        if isinstance(value, torch.Generator | np.random.Generator)
    }


def party_state(party: DataParty) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``party`` alone holds, as (tensors, JSON): its modules, its optimisers, its random
    generators and its accountant's releases."""
    tensors: dict[str, Any] = {
        "modules": {
            name: {k: v.detach().clone() for k, v in unwrapped(module).state_dict().items()}
            for name, module in party.own_modules().items()
        },
        "optimizers": {},
        "generators": {},
    }
    meta: dict[str, Any] = {"optimizers": {}, "generators": {}}
    for name, optimizer in party.own_optimizers().items():
        tensors["optimizers"][name], meta["optimizers"][name] = _split_optimizer(
            optimizer.state_dict(), f"{party.name}'s optimiser {name!r}"
        )
    for name, generator in _generators(party).items():
        if isinstance(generator, torch.Generator):
            tensors["generators"][name] = generator.get_state()
        else:
            meta["generators"][name] = generator.bit_generator.state
    accountant = party.accountant
    meta["accountant"] = accountant.to_json() if accountant is not None else None
    meta["hooks"] = {key: hook.checkpoint_state() for key, hook in _kept_hooks(party).items()}
    meta["training_data"] = party.training_digest()
    return tensors, meta


class KeptHook(Protocol):
    """A message hook with state of its own that a party's checkpoint keeps (e.g. a deployed
    DP party's view of the batches it was asked for), under ``checkpoint_key``."""

    checkpoint_key: str

    def checkpoint_state(self) -> Any:
        """Its state, as JSON."""
        ...

    def restore_checkpoint(self, state: Any) -> None:
        """Take back the state :meth:`checkpoint_state` gave (ValueError if it does not fit)."""
        ...

    def replay(self, notes: Sequence[Any]) -> None:
        """Take back the notes it gave its ``journal`` (an attribute, called with each change
        of its state as JSON: a DP party's release journal keeps them), in order: a party
        rejoining the run after its process died (ValueError if one does not fit)."""
        ...


def _kept_hooks(party: DataParty) -> dict[str, KeptHook]:
    kept = {}
    for hook in (*party.incoming, *party.outgoing):
        key = getattr(hook, "checkpoint_key", None)
        if isinstance(key, str):
            kept[key] = cast(KeptHook, hook)
    return kept


def _split_optimizer(state: Mapping[str, Any], what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimiser's state dict as (its tensors, the rest as JSON)."""
    tensors: dict[str, dict[str, Tensor]] = {}
    rest: dict[str, dict[str, Any]] = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            target = tensors if isinstance(value, Tensor) else rest
            target.setdefault(str(index), {})[key] = value
    groups = state["param_groups"]
    if any(isinstance(v, Tensor) for group in groups for v in group.values()):
        raise ConfigError(f"{what}: plain-number parameter groups expected, found a tensor.")
    return tensors, {"state": rest, "param_groups": groups}


def _restore_optimizer(
    optimizer: torch.optim.Optimizer, tensors: Any, meta: Any, what: str
) -> None:
    """Put the checkpoint's state of an optimiser back, or refuse (IntegrityError) what this
    run's optimiser would not hold: parameter groups other than its own (they follow from the
    run's settings, which a resume repeats), per-parameter state that is neither a tensor of
    its parameter's shape (a scalar for ``step``) nor a finite number or None."""
    kept = meta.get("state") if isinstance(meta, Mapping) else None
    saved = meta.get("param_groups") if isinstance(meta, Mapping) else None
    parts: list[Mapping[str, Any]] = []
    for part in (kept, tensors):
        if not isinstance(part, Mapping) or not all(isinstance(v, Mapping) for v in part.values()):
            break
        parts.append(part)
    if len(parts) != 2 or not isinstance(saved, list):
        raise IntegrityError(f"{what}: its state and parameter groups expected; found otherwise.")
    live = as_json({"groups": optimizer.state_dict()["param_groups"]})["groups"]
    difference = None
    if len(saved) != len(live):
        difference = f"{len(live)} groups expected, found {len(saved)}"
    for i, (group, own) in enumerate(zip(saved, live, strict=False)):
        field = first_difference(group, own)
        if difference is None and field is not None:
            difference = f"group {i}, {field}"
    if difference is not None:
        raise IntegrityError(
            f"{what}: the parameter groups of this run's settings expected; they differ at "
            f"{difference}."
        )
    state: dict[int, dict[str, Any]] = {}
    for part in parts:
        for index, values in part.items():
            for key, value in values.items():
                if not (
                    isinstance(value, Tensor)
                    or value is None
                    or (type(value) in (int, float) and math.isfinite(value))
                ):
                    raise IntegrityError(
                        f"{what}: state {key!r} of parameter {index}: a tensor, a number or "
                        f"null expected, found {type(value).__name__}."
                    )
            state.setdefault(int(index), {}).update(values)
    optimizer.load_state_dict({"state": state, "param_groups": saved})
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            for key, value in optimizer.state.get(parameter, {}).items():
                shape = () if key == "step" else tuple(parameter.shape)  # Adam's step: a scalar
                if isinstance(value, Tensor) and tuple(value.shape) != shape:
                    raise IntegrityError(
                        f"{what}: state {key!r} of shape {shape} expected, found "
                        f"{tuple(value.shape)}."
                    )


def restore_party_state(
    party: DataParty,
    tensors: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    where: str,
    journal: Path | None = None,
    journal_into: Path | None = None,
    run_id: str = "",
    rejoining: bool = False,
) -> int:
    """Put a checkpoint's state back into ``party`` (the same modules, optimisers, generators
    and accountant as it was written from), or refuse with what differs (IntegrityError). A
    party with an accountant also takes the releases its journal under ``journal`` (the
    checkpoints' root) recorded after the checkpoint (:func:`lost_releases`) and restarts the
    journal, under ``journal_into`` (the root the run writes its checkpoints into from now on;
    ``journal`` by default); returns how many of those its accountant prices.

    ``rejoining``: the party rejoins run ``run_id``, which went on past that checkpoint. Unlike
    a resumed run, the run will not ask it again for the rows of the steps since, so its
    message hooks also take back every row its journal noted, over which those releases are
    priced."""
    digest = meta.get("training_data")  # absent from a checkpoint written before it was kept
    if digest is not None and digest != (found := party.training_digest()):
        raise IntegrityError(
            f"{where}: {party.name}'s checkpoint was trained on other rows: the SHA-256 of its "
            f"training data {str(digest)[:16]}... expected, found {found[:16]}... (its data file "
            "changed since?). Resume with the data the run had, or train anew."
        )
    modules = party.own_modules()
    saved = tensors.get("modules", {})
    _same_names(where, "modules", modules, saved)
    optimizers = party.own_optimizers()
    _same_names(where, "optimisers", optimizers, meta.get("optimizers", {}))
    generators = _generators(party)
    parts = (tensors.get("generators", {}), meta.get("generators", {}))
    if not all(isinstance(part, Mapping) for part in parts):
        raise IntegrityError(f"{where}: random generators by name expected; found otherwise.")
    saved_generators = {**parts[0], **parts[1]}
    _same_names(where, "random generators", generators, saved_generators)
    hooks = _kept_hooks(party)
    _same_names(where, "message hooks' states", hooks, meta.get("hooks", {}))
    try:
        for name, module in modules.items():
            unwrapped(module).load_state_dict(dict(saved[name]), strict=True)
        saved_optimizers = tensors.get("optimizers", {})
        if not isinstance(saved_optimizers, Mapping):
            raise IntegrityError(f"{where}: optimiser tensors by name expected.")
        for name, optimizer in optimizers.items():
            what = f"{where}: optimiser {name!r}"
            state = meta["optimizers"][name]
            _restore_optimizer(optimizer, saved_optimizers.get(name, {}), state, what)
        for name, generator in generators.items():
            if isinstance(generator, torch.Generator):
                generator.set_state(saved_generators[name])
            else:
                generator.bit_generator.state = saved_generators[name]
        for key, hook in hooks.items():
            hook.restore_checkpoint(meta["hooks"][key])
    except (RuntimeError, ValueError, KeyError, TypeError, OverflowError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise IntegrityError(f"{where}: the state does not fit {party.name} ({first}).") from None
    releases = meta.get("accountant")
    if (releases is None) != (party.accountant is None):
        raise IntegrityError(
            f"{where}: {'an accountant' if party.accountant is not None else 'no accountant'} "
            f"expected (this run's privacy), found {'none' if releases is None else 'one'}."
        )
    if party.accountant is None or releases is None:
        return 0
    if not isinstance(releases, list) or not all(isinstance(r, dict) for r in releases):
        raise IntegrityError(
            f"{where}: the accountant's releases as a list of objects expected, found "
            f"{json.dumps(releases)[:60]}."
        )
    # A process resumed into ``journal_into`` before (and killed again) journalled there from
    # this checkpoint's releases on: that journal holds the older one's releases and its own,
    # and is the one to go on from (the older one misses the second process's).
    if journal is not None and journal_into is not None:
        journal = journal_into if journal_path(journal_into, party.name).exists() else journal
    lost, notes = (
        ([], [])
        if journal is None
        else lost_releases(journal, party.name, run_id, releases, where=where)
    )
    try:
        added: int = party.accountant.restore(releases, lost=lost)
        if rejoining:
            _replay(party, notes)
    except (ConfigError, TypeError, ValueError, KeyError) as error:
        raise IntegrityError(
            f"{where}: the releases of the checkpoint or its journal do not fit {party.name} "
            f"({error})."
        ) from None
    if journal is not None:
        start_journal(journal_into or journal, party, run_id, notes=notes)
    if added:
        warnings.warn(  # a run warning: printed as one, and kept in result.json's warnings
            f"{party.name}: {added} release(s) of the killed run after {where} are priced too "
            "(their receivers saw them, and the resumed steps release about the same rows "
            "again)",
            RunWarning,
            stacklevel=2,
        )
    return added


# -- a DP party's release journal --------------------------------------------------------------

RELEASES_FILE = "releases.jsonl"
"""A checkpointed DP party's journal of its releases, beside its checkpoints."""


def journal_path(root: Path, party: str) -> Path:
    return root / party / RELEASES_FILE


class ReleaseJournal:
    """A checkpointed party's releases (its accountant's, as JSON), one line each, appended and
    fsynced as each is recorded, before the message carrying it leaves the party. A checkpoint
    keeps the releases made before it; the journal also those made after it, up to the kill,
    which their receivers saw: the resumed run prices them (:func:`lost_releases`)."""

    def __init__(self, root: Path, party: str, run_id: str) -> None:
        self.path = journal_path(root, party)
        self.run_id = run_id

    def start(
        self, releases: Sequence[Mapping[str, Any]], notes: Sequence[tuple[str, Any]] = ()
    ) -> None:
        """Write the journal anew, atomically, holding ``releases`` (the accountant's) and the
        message hooks' ``notes`` (key, note) kept from before."""
        lines = [self._line({"release": release}) for release in releases]
        lines += [self._line({"hook": key, "note": note}) for key, note in notes]
        atomic_write_text(self.path, "".join(lines))

    def append(self, release: Mapping[str, Any]) -> None:
        """Journal a release, fsynced: it leaves the party once this returns."""
        self._write(self._line({"release": release}), sync=True)

    def note(self, key: str, note: Any) -> None:
        """Journal a change of a message hook's state (the rows a step asked for). Not
        fsynced on its own: the step's releases, which come after it, sync it too."""
        self._write(self._line({"hook": key, "note": note}), sync=False)

    def _write(self, line: str, *, sync: bool) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line.encode("utf-8"))
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _line(self, record: Mapping[str, Any]) -> str:
        return json.dumps({"run": self.run_id, **record}, sort_keys=True) + "\n"


def lost_releases(
    root: Path, party: str, run_id: str, checkpointed: Sequence[Any], *, where: str
) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
    """The releases ``party``'s journal recorded after its ``checkpointed`` ones (those its
    checkpoint keeps, which the journal must begin with): the killed run's releases after its
    checkpoint; and the journal's notes, which the journal keeps on (:func:`_read_journal`)."""
    path = journal_path(root, party)
    releases, notes = _read_journal(root, party, run_id, where=where)
    if list(checkpointed) != releases[: len(checkpointed)]:
        raise IntegrityError(
            f"{path}: a journal that begins with the {len(checkpointed)} release(s) of {where} "
            f"expected; found {len(releases)} line(s) that do not."
        )
    return releases[len(checkpointed) :], notes


def _read_journal(
    root: Path, party: str, run_id: str, *, where: str
) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
    """The releases and the message hooks' notes (key, note) of ``party``'s journal of run
    ``run_id``, in order. A last line cut short by the kill is left out (its release had not
    left the party: a release leaves only once its line is whole); anything else that is not
    this run's journal is refused (IntegrityError)."""
    path = journal_path(root, party)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise IntegrityError(
            f"{where}: {party}'s release journal {path} expected (a DP party keeps one beside "
            "its checkpoints, for the releases its checkpoints do not hold); found none."
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise IntegrityError(f"{path}: a readable release journal expected ({error}).") from None
    releases, notes = [], []
    for number, line in enumerate(text.split("\n")[:-1], start=1):  # the rest: cut short
        try:
            record = parse_json(line, f"{path}, line {number}")
        except DataError:
            record = None
        keys = set(record) if isinstance(record, dict) else set()
        if not (
            (keys == {"run", "release"} and isinstance(record["release"], dict))
            or (keys == {"run", "hook", "note"} and isinstance(record["hook"], str))
        ):
            raise IntegrityError(
                f'{path}, line {number}: a release as {{"run": ..., "release": {{...}}}} or a '
                f'note as {{"run": ..., "hook": ..., "note": ...}} expected; found {line[:60]!r}.'
            )
        assert isinstance(record, dict)
        if record["run"] != run_id:
            raise IntegrityError(
                f"{path}, line {number}: a release of run {run_id} expected; found one of run "
                f"{str(record['run'])[:40]!r}."
            )
        if "release" in record:
            releases.append(record["release"])
        else:
            notes.append((record["hook"], record["note"]))
    return releases, notes


def rejoin_from_journal(root: Path, party: DataParty, run_id: str) -> int:
    """A DP party set up anew after its process died, rejoining run ``run_id``: its accountant
    takes every release its journal recorded in the run (its DP-SGD steps kept ``discarded``:
    their model died with the process and it trains a fresh one, but the messages it sent were
    computed with it: :meth:`~protocols.dp.PrivacyAccountant.restore`), its message hooks their
    notes (the rows each step asked for, over which those releases are priced), and the journal
    goes on. IntegrityError
    without a journal of the run: its releases would go unpriced. Returns the releases taken."""
    where = f"{party.name} rejoining run {run_id}"
    releases, notes = _read_journal(root, party.name, run_id, where=where)
    try:
        added: int = party.accountant.restore([], lost=releases)
        _replay(party, notes)
    except (ConfigError, TypeError, ValueError, KeyError) as error:
        raise IntegrityError(f"{where}: its journal does not fit it ({error}).") from None
    start_journal(root, party, run_id, notes=notes)
    return added


def _replay(party: DataParty, notes: Sequence[tuple[str, Any]]) -> None:
    """Each of ``party``'s kept message hooks takes back its notes (a hook holds the union of
    what it noted, so a note it holds already changes nothing)."""
    for key, hook in _kept_hooks(party).items():
        hook.replay([note for name, note in notes if name == key])


def start_journal(
    root: Path, party: DataParty, run_id: str, *, notes: Sequence[tuple[str, Any]] = ()
) -> None:
    """Attach a release journal to ``party``'s accountant (none: nothing to journal) and to
    its message hooks that keep one, written anew with the releases it holds (restored from a
    checkpoint, lost ones included) and ``notes`` kept from a process before."""
    accountant = party.accountant
    if accountant is None:
        return
    journal = ReleaseJournal(root, party.name, run_id)
    journal.start(accountant.to_json(), notes)
    accountant.journal = journal.append
    for key, hook in _kept_hooks(party).items():
        if hasattr(hook, "journal"):
            hook.journal = functools.partial(journal.note, key)


def _same_names(where: str, what: str, expected: Mapping[str, Any], found: Any) -> None:
    if not isinstance(found, Mapping) or sorted(expected) != sorted(found):
        names = sorted(found) if isinstance(found, Mapping) else type(found).__name__
        raise IntegrityError(f"{where}: {what} {sorted(expected)} expected, found {names}.")


# -- the label party's view of the run ----------------------------------------------------


def run_state(method: Method, progress: TrainingProgress) -> tuple[dict[str, Any], dict[str, Any]]:
    """Where the label party's run stands, as (tensors, JSON): ``progress``, its plan and
    epoch-order generators and its sampler's drawn schedule (a Poisson sampler's)."""
    fed = method.fed
    order = None if progress.order is None else [torch.from_numpy(b) for b in progress.order]
    tensors: dict[str, Any] = {"order": order, "plan_generator": fed.generator.get_state()}
    meta: dict[str, Any] = {
        "progress": {
            "epoch": progress.epoch,
            "step": progress.step,
            "batch": progress.batch,
            "total": progress.total,
            "count": progress.count,
            "losses": list(progress.losses),
        },
        "epoch_generator": fed.rng.bit_generator.state,
        "queries": fed.queries,
        "sampler": None,
        "dropped": list(fed.dropped),
        "faults": [dict(fault) for fault in fed.faults],
    }
    if isinstance(method.sampler, PoissonSampler):
        sampler = method.sampler
        tensors["schedule"] = [[torch.from_numpy(b) for b in epoch] for epoch in sampler.epochs]
        meta["sampler"] = {"kind": "poisson", "next_epoch": sampler.next_epoch}
    return tensors, meta


def dropped_parties(run: Mapping[str, Any]) -> list[str]:
    """The data parties lost before the label party's checkpoint ``run`` (its run position)
    was written: they hold no checkpoint of it, and stay lost in the resumed run."""
    dropped = run.get("dropped", [])
    if not (isinstance(dropped, list) and all(isinstance(name, str) for name in dropped)):
        raise TypeError(f"the dropped parties' names expected, found {dropped!r:.60}")
    return list(dropped)


def restore_run(
    method: Method,
    tensors: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    where: str,
    step: int,
) -> TrainingProgress:
    """Put the label party's run back where ``run_state`` found it, at ``step`` (its
    manifest's); the progress to go on from. IntegrityError when the checkpoint's sampler is
    not this run's or its position is not one this run reaches (:func:`_check_progress`)."""
    fed = method.fed
    try:
        position = meta["progress"]
        order = tensors["order"]
        losses = position["losses"]
        if not isinstance(losses, list):
            raise TypeError(f"the epochs' losses as a list expected, found {losses!r:.60}")
        if not (order is None or isinstance(order, list)):
            raise TypeError(f"the epoch's batch order as a list expected, found {type(order)}")
        progress = TrainingProgress(
            epoch=_integer(position, "epoch"),
            step=_integer(position, "step"),
            batch=_integer(position, "batch"),
            order=None if order is None else [t.numpy() for t in order],
            total=_number(position["total"], "loss total"),
            count=_integer(position, "count"),
            losses=[_number(loss, "epoch loss") for loss in losses],
        )
        fed.generator.set_state(tensors["plan_generator"])
        fed.rng.bit_generator.state = meta["epoch_generator"]
        fed.queries = int(meta["queries"])
        dropped, faults = dropped_parties(meta), meta.get("faults", [])
        if not isinstance(faults, list):
            raise TypeError(f"faults as a list of entries expected, found {faults!r:.60}")
        for fault in faults:
            rejoined = isinstance(fault, dict) and "restored" in fault
            keys = FAULT_KEYS | ({"restored": int} if rejoined else {})
            check_keys(fault, keys, refuse=lambda wrong: TypeError(f"a fault entry's {wrong}"))
        fed.restore_losses(dropped, faults)
    except (
        KeyError,
        TypeError,
        ValueError,
        RuntimeError,
        AttributeError,
        OverflowError,
        ProtocolError,
    ) as error:
        raise IntegrityError(
            f"{where}: a run position expected, found otherwise ({error})."
        ) from None
    restore_schedule(method.sampler, tensors, meta, where=where)
    try:
        _check_progress(progress, method.epoch_samplers(), step=step)
    except DataError as error:  # the epoch's batch order (after its Poisson schedule)
        raise IntegrityError(f"{where}: {error}") from None
    except ValueError as error:
        raise IntegrityError(
            f"{where}: a run position expected, found otherwise ({error})."
        ) from None
    if progress.order is not None:
        progress.order = [batch.astype(np.int64) for batch in progress.order]
    return progress


FAULT_KEYS: dict[str, type | tuple[type, ...]] = {
    "party": str,
    "step": int,
    "epoch": (int, type(None)),
    "phase": str,
    "what": str,
}
"""An entry of a run's ``faults`` (:class:`~secure_vfl.methods.base.Federation`), as a
checkpoint keeps it; a rejoined party's may say the step of the checkpoint it ``restored``."""


def _integer(position: Mapping[str, Any], name: str) -> int:
    value = position[name]
    if type(value) is not int:
        raise TypeError(f"an integer {name} expected, found {value!r:.40}")
    return value


def _number(value: Any, name: str) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"a number as the {name} expected, found {value!r:.40}")
    return float(value)


def _check_progress(
    progress: TrainingProgress, samplers: Sequence[BatchSampler], *, step: int
) -> None:
    """ValueError unless ``progress`` is a position this run's training reaches at ``step``
    (``samplers``: the sampler of each of its epochs, :meth:`~secure_vfl.methods.base.Method.
    epoch_samplers`): counts >= 0, one loss per finished epoch, an epoch of the run, the next
    batch within the epoch's order (0 before it is drawn) and the steps of the epochs before
    and of the batches done, the epoch's batch order as its sampler draws them (DataError),
    the rows of the batches done counted and a finite loss total."""
    counts = {"epoch": progress.epoch, "step": progress.step, "batch": progress.batch}
    negative = [f"{name} {value}" for name, value in counts.items() if value < 0]
    if negative or progress.count < 0:
        raise ValueError(f"counts >= 0 expected, found {', '.join(negative) or progress.count}")
    if len(progress.losses) != progress.epoch:
        raise ValueError(
            f"one loss per finished epoch expected, found {len(progress.losses)} for epoch "
            f"{progress.epoch}"
        )
    if progress.step != step:
        raise ValueError(f"step {step} (its manifest's) expected, found step {progress.step}")
    if progress.epoch >= len(samplers):
        raise ValueError(
            f"fewer finished epochs than the run's {len(samplers)} expected, found {progress.epoch}"
        )
    batches = 0 if progress.order is None else len(progress.order)
    if progress.batch > batches:
        raise ValueError(f"a batch of at most {batches} expected, found {progress.batch}")
    if progress.order is not None:  # DataError unless the sampler would have drawn it
        samplers[progress.epoch].check_order(progress.order)
    reached = sum(len(sampler) for sampler in samplers[: progress.epoch]) + progress.batch
    if progress.step != reached:
        raise ValueError(
            f"step {reached} after {progress.epoch} epoch(s) and {progress.batch} batch(es) of "
            f"this run expected, found step {progress.step}"
        )
    for k, loss in enumerate(progress.losses):  # NaN: an epoch of empty Poisson draws only
        if math.isinf(loss) or (math.isnan(loss) and not isinstance(samplers[k], PoissonSampler)):
            raise ValueError(f"a finite loss of epoch {k + 1} expected, found {loss}")
    rows = sum(len(batch) for batch in (progress.order or [])[: progress.batch])
    if progress.count > rows:  # fewer: rows a step skipped (FALSE-VFL: without a posterior)
        raise ValueError(
            f"a count of at most {rows} rows (those of the epoch's {progress.batch} batch(es) "
            f"done) expected, found {progress.count}"
        )
    if not math.isfinite(progress.total) or (rows == 0 and progress.total != 0):
        raise ValueError(
            f"a finite loss total{' of 0 over no rows' if rows == 0 else ''} expected, found "
            f"{progress.total}"
        )


def restore_schedule(
    sampler: Any, tensors: Mapping[str, Any], meta: Mapping[str, Any], *, where: str
) -> None:
    """Put the label party's checkpointed Poisson schedule (its run state ``tensors`` and
    ``meta``) back into ``sampler`` (a private run's :class:`PoissonSampler`; another sampler
    takes none); IntegrityError when the checkpoint's sampler is not this run's."""
    saved = meta.get("sampler")
    poisson = isinstance(sampler, PoissonSampler)
    if (saved is not None) != poisson:
        raise IntegrityError(
            f"{where}: {'a Poisson' if poisson else 'no'} sampler schedule expected (this run's "
            f"privacy), found {'none' if saved is None else 'one'}."
        )
    if isinstance(sampler, PoissonSampler):
        schedule = tensors.get("schedule")
        next_epoch = saved.get("next_epoch") if isinstance(saved, dict) else None
        if not (
            isinstance(schedule, list)
            and all(isinstance(epoch, list) for epoch in schedule)
            and isinstance(next_epoch, int)
        ):
            raise IntegrityError(
                f"{where}: a Poisson schedule and its next epoch expected; found "
                f"{type(schedule).__name__} and {next_epoch!r}."
            )
        try:
            sampler.restore(
                [[t.numpy() for t in epoch] for epoch in schedule], next_epoch=next_epoch
            )
        except (DataError, AttributeError, TypeError) as error:
            raise IntegrityError(f"{where}: {error}") from None


def resumed_schedule(point: ResumePoint) -> Callable[[Any], None]:
    """What puts the killed run's Poisson schedule, from the label party's checkpoint at
    ``point``, into a sampler: for a deployed label party, which plans every party's privacy
    (SIGMA calibrated to the schedule) before the run, and so before :func:`restore_run`."""
    where = str(step_directory(point.root, point.label.party, point.step))
    run = point.label.meta.get("run")
    tensors = point.label.tensors.get("run", {})

    def restore(sampler: Any) -> None:
        if not isinstance(run, dict):
            raise IntegrityError(f"{where}: the label party's run position expected; found none.")
        restore_schedule(sampler, tensors, run, where=where)

    return restore


# -- files --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedState:
    """One party's checkpoint of one step as read back and checked."""

    party: str
    step: int
    run_id: str
    tensors: dict[str, Any]
    meta: dict[str, Any]
    parties: dict[str, str]
    """At the label party: the SHA-256 of every other party's manifest of this step."""
    manifest_sha: str


def write_checkpoint(
    root: Path,
    party: str,
    *,
    run_id: str,
    step: int,
    tensors: Mapping[str, Any],
    meta: Mapping[str, Any],
    parties: Mapping[str, str] | None = None,
) -> str:
    """Write ``party``'s checkpoint of ``step`` atomically; return its manifest's SHA-256.

    A directory of that step left by a killed run (never committed: a resumed run starts from
    the latest committed step and writes only later ones) is replaced."""
    files = {
        TENSORS_FILE: tensor_file.dumps(dict(tensors)),
        STATE_FILE: (json.dumps(meta, sort_keys=True) + "\n").encode("utf-8"),
    }
    manifest = {
        "schema": SCHEMA,
        "version": VERSION,
        "run_id": run_id,
        "party": party,
        "step": step,
        "files": {name: sha256(data) for name, data in sorted(files.items())},
        "parties": dict(sorted((parties or {}).items())),
    }
    files[MANIFEST_FILE] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")

    def write(directory: Path) -> None:
        for name, data in files.items():
            (directory / name).write_bytes(data)

    target = step_directory(root, party, step)
    if target.exists():
        shutil.rmtree(target)
    atomic_directory(target, write)
    return sha256(files[MANIFEST_FILE])


def drop_older(root: Path, party: str, *, keep: int, also: int | None = None) -> None:
    """Remove ``party``'s checkpoints other than that of step ``keep`` (the one just committed)
    and of step ``also`` (a deployed party keeps the last committed one until its newer one is
    committed too), and what interrupted writes left."""
    directory = root / party
    if not directory.is_dir():
        return
    kept = {f"step-{step:08d}" for step in (keep, also) if step is not None}
    for child in directory.iterdir():
        if child.is_dir() and child.name not in kept:
            shutil.rmtree(child, ignore_errors=True)


def read_checkpoint(
    root: Path,
    party: str,
    step: int,
    *,
    run_id: str | None = None,
    manifest_sha: str | None = None,
) -> SavedState:
    """``party``'s checkpoint of ``step``, every file checked against its manifest, the
    manifest against ``manifest_sha`` (what the label party recorded) and its run, party and
    step against those expected; IntegrityError or DataError saying what was expected and
    what was found."""
    directory = step_directory(root, party, step)
    where = str(directory)
    if not directory.is_dir():
        raise IntegrityError(f"{where}: {party}'s checkpoint of step {step} expected; found none.")
    manifest_bytes = _file(directory, MANIFEST_FILE)
    found_sha = sha256(manifest_bytes)
    if manifest_sha is not None and found_sha != manifest_sha:
        raise IntegrityError(
            f"{where}: the manifest the label party recorded for step {step} expected (SHA-256 "
            f"{manifest_sha[:16]}...), found another ({found_sha[:16]}...): altered, or from "
            "another run."
        )
    manifest = parse_json(manifest_bytes, f"{where}/{MANIFEST_FILE}")
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise DataError(f"{where}/{MANIFEST_FILE}: a {SCHEMA!r} manifest expected.")
    if manifest.get("version") != VERSION:
        raise DataError(
            f"{where}: checkpoint version {VERSION} expected, found {manifest.get('version')!r} "
            "(written by another secure-vfl: train afresh)."
        )
    expected = {"party": party, "step": step} | ({"run_id": run_id} if run_id is not None else {})
    for key, value in expected.items():
        if manifest.get(key) != value:
            raise IntegrityError(
                f"{where}: a checkpoint of {key} {value!r} expected, found {manifest.get(key)!r}."
            )
    listed = manifest.get("files")
    if not isinstance(listed, dict) or sorted(listed) != sorted((STATE_FILE, TENSORS_FILE)):
        raise IntegrityError(
            f"{where}: a manifest listing {STATE_FILE} and {TENSORS_FILE} expected, found "
            f"{sorted(listed) if isinstance(listed, dict) else listed!r}."
        )
    contents = {}
    for name, digest in listed.items():
        data = _file(directory, name)
        if sha256(data) != digest:
            raise IntegrityError(
                f"{where}/{name}: the SHA-256 in the manifest ({str(digest)[:16]}...) expected, "
                f"found {sha256(data)[:16]}... (corrupt or truncated)."
            )
        contents[name] = data
    meta = parse_json(contents[STATE_FILE], f"{where}/{STATE_FILE}")
    tensors = _tensors(contents[TENSORS_FILE], f"{where}/{TENSORS_FILE}")
    parties = manifest.get("parties", {})
    if not isinstance(meta, dict) or not isinstance(parties, dict):
        raise DataError(f"{where}: a JSON object of state and of parties expected.")
    return SavedState(
        party=party,
        step=step,
        run_id=str(manifest.get("run_id")),
        tensors=tensors,
        meta=meta,
        parties={str(k): str(v) for k, v in parties.items()},
        manifest_sha=found_sha,
    )


def _file(directory: Path, name: str) -> bytes:
    path = directory / name
    if not path.is_file():
        found = (
            "a directory"
            if path.is_dir()
            else "a link to nothing"
            if path.is_symlink()
            else "none (truncated?)"
        )
        raise IntegrityError(f"{path}: a checkpoint file expected; found {found}.")
    return path.read_bytes()


def _tensors(data: bytes, where: str) -> dict[str, Any]:
    """The tensors (by name, in dicts and lists) of a tensor file: raw buffers, no code runs."""
    loaded = tensor_file.loads(data, where)
    if not isinstance(loaded, dict):
        raise IntegrityError(f"{where}: a mapping of tensors expected, found {type(loaded)}.")
    return loaded


# -- a run's checkpoints ---------------------------------------------------------------------


def first_difference(saved: Any, current: Any, path: str = "") -> str | None:
    """The first field (dotted path, in sorted key order) where two JSON values differ."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            if key not in saved or key not in current:
                return f"{path}{key}"
            found = first_difference(saved[key], current[key], f"{path}{key}.")
            if found is not None:
                return found
        return None
    return None if saved == current else path.rstrip(".") or "(the whole configuration)"


def _field(value: Any, path: str) -> Any:
    for key in path.split("."):
        value = value.get(key, "(absent)") if isinstance(value, dict) else value
    return value


def as_json(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` as JSON reads them back (tuples as lists, paths as text)."""
    return dict(json.loads(json.dumps(settings, default=str)))


@dataclass(frozen=True)
class ResumePoint:
    """The latest complete checkpoint of a run: the label party's state at ``step``, and the
    SHA-256 of every other party's manifest of that step."""

    root: Path
    label: SavedState

    @property
    def step(self) -> int:
        return self.label.step

    @property
    def run_id(self) -> str:
        return self.label.run_id

    @property
    def parties(self) -> list[str]:
        """Every party with a checkpoint of this step, the label party first."""
        return [self.label.party, *self.label.parties]

    @property
    def dropped(self) -> list[str]:
        """The data parties lost before this step (none hold a checkpoint of it)."""
        run = self.label.meta.get("run")
        try:
            return dropped_parties(run if isinstance(run, Mapping) else {})
        except TypeError as error:
            raise IntegrityError(f"{self.root}: {error}.") from None


def find_resume_point(
    directory: Path,
    *,
    label_party: str,
    settings: Mapping[str, Any],
    check_parties: bool = True,
    flag_names: Mapping[str, str] | None = None,
) -> ResumePoint:
    """The latest complete checkpoint under ``directory`` (a run's ``--out`` or its
    checkpoints' directory): the label party's latest, which commits its step. Refused
    (ConfigError) when there is none or its run's configuration differs from ``settings``
    (naming the first differing field, and the flag that sets it: ``flag_names`` by the field's
    last part, e.g. ``{"lr": "--lr"}``); with ``check_parties``, every other party's checkpoint
    of that step is read and checked too (IntegrityError or DataError otherwise)."""
    root = checkpoint_root(directory)
    steps = written_steps(root, label_party)
    if not steps:
        raise ConfigError(
            f"--resume {directory}: a checkpoint of the label party {label_party} expected under "
            f"{root / label_party}; found none."
        )
    label = read_checkpoint(root, label_party, steps[-1])
    saved = label.meta.get("settings")
    current = as_json(settings)
    differing = first_difference(saved, current)
    if differing is not None:
        flag = (flag_names or {}).get(differing.rsplit(".", 1)[-1])
        raise ConfigError(
            f"--resume {directory}: the same configuration as the checkpoint's run expected; "
            f"`{differing}`{f' ({flag})' if flag else ''} differs (checkpoint: "
            f"{_field(saved, differing)!r}, this run: {_field(current, differing)!r})."
        )
    point = ResumePoint(root=root, label=label)
    if check_parties:
        for party, digest in label.parties.items():
            read_checkpoint(root, party, label.step, run_id=label.run_id, manifest_sha=digest)
    return point


class PartiesElsewhere(Protocol):
    """The parties of a run that live in other processes (a deployment): each writes and
    restores its own checkpoint in its own directory when the label party asks by message;
    only its manifest's SHA-256 comes back. The label party's side of those messages."""

    @property
    def names(self) -> list[str]:
        """The parties elsewhere that hold state worth keeping."""
        ...

    def start(self, run_id: str, *, every: int, resume: ResumePoint | None) -> None:
        """Before anything trains: tell each party the run's checkpoints, and on ``resume``
        have it restore its own checkpoint of that step, checked against the manifest SHA-256
        the label party recorded for it."""
        ...

    def write(
        self, step: int, run_id: str, *, committed: int | None, parties: Sequence[str]
    ) -> dict[str, str]:
        """Each of ``parties`` writes its checkpoint of ``step`` and drops its older ones but
        that of step ``committed`` (the label party's last); their manifests' SHA-256."""
        ...


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """What a run asks of checkpoints: write one into ``directory`` every ``every`` steps (0:
    never), and/or resume from ``resume`` (found by :func:`find_resume_point`). ``settings``
    is the run's configuration, kept in the label party's checkpoint and required equal on
    resume; ``label_party`` names the party that drives the run; ``elsewhere``, the parties in
    other processes (a deployment), which write and restore their own when asked."""

    directory: Path
    every: int = 0
    resume: ResumePoint | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    label_party: str = "party-0"
    elsewhere: PartiesElsewhere | None = None
    fresh_run_id: str = field(default_factory=lambda: secrets.token_hex(8))

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ConfigError(
                f"`checkpoint_every` must be an integer >= 0 (0: never). Found {self.every!r}."
            )

    @property
    def run_id(self) -> str:
        """The run's id in every manifest: the resumed run's, or a fresh one."""
        return self.resume.run_id if self.resume is not None else self.fresh_run_id


class RunCheckpoints:
    """The composition root's side of checkpoints for one in-process run: it asks every party
    to write its own state at step boundaries (the label party last, committing the step) and,
    on resume, each party to restore its own."""

    def __init__(self, plan: CheckpointPlan) -> None:
        self.plan = plan
        self.run_id = plan.run_id
        self.settings = as_json(plan.settings)
        self.committed = self.resumed_step
        """The label party's latest committed step (its checkpoint's), None before the first."""

    @property
    def resumed_step(self) -> int | None:
        return self.plan.resume.step if self.plan.resume is not None else None

    def restore_run(self, method: Method) -> TrainingProgress:
        """Where training starts: fresh, or the label party's run as checkpointed (its sampler
        too, before a privacy layer calibrates noise to its schedule)."""
        point = self.plan.resume
        if point is None:
            return TrainingProgress()
        if method.fed.own.name != point.label.party:
            raise IntegrityError(
                f"{point.root}: a run driven by {method.fed.own.name} expected, found the "
                f"checkpoints of {point.label.party}."
            )
        where = str(step_directory(point.root, point.label.party, point.step))
        run = point.label.meta.get("run")
        if not isinstance(run, dict):
            raise IntegrityError(f"{where}: the label party's run position expected; found none.")
        tensors = point.label.tensors.get("run", {})
        return restore_run(method, tensors, run, where=where, step=point.step)

    def start_parties(self, parties: Sequence[DataParty]) -> None:
        """Every party of this process restores its own state from its checkpoint of the
        resumed step (the parties elsewhere have restored theirs when they were started), and
        each DP party journals its releases from now on (:class:`ReleaseJournal`): its journal
        of the killed run is read beside that checkpoint, and goes on in ``plan.directory``
        (another directory, where a resumed run writes its checkpoints elsewhere)."""
        point = self.plan.resume
        root = self.plan.directory
        if point is None:
            for party in parties:
                start_journal(root, party, self.run_id)
            return
        lost = point.dropped
        names = [party.name for party in parties]
        if self.plan.elsewhere is not None:
            names += self.plan.elsewhere.names
        if sorted(set(names) - set(lost)) != sorted(point.parties):
            raise IntegrityError(
                f"{point.root}: checkpoints of this run's parties {sorted(names)} expected "
                f"(less those lost before it: {sorted(lost) or 'none'}), found "
                f"{sorted(point.parties)}."
            )
        for party in parties:
            if party.name in lost:
                continue  # lost before the checkpoint: it stays lost, and holds none
            saved = (
                point.label
                if party.name == point.label.party
                else read_checkpoint(
                    point.root,
                    party.name,
                    point.step,
                    run_id=point.run_id,
                    manifest_sha=point.label.parties[party.name],
                )
            )
            where = str(step_directory(point.root, party.name, point.step))
            restore_party_state(  # the journal beside the checkpoint goes on beside the new ones
                party,
                saved.tensors,
                saved.meta,
                where=where,
                journal=point.root,
                journal_into=root,
                run_id=self.run_id,
            )

    def _write_elsewhere(
        self, elsewhere: PartiesElsewhere, step: int, method: Method
    ) -> dict[str, str]:
        """Each live party elsewhere writes its checkpoint of ``step``, asked one after the
        other; their manifests' SHA-256. A party whose process died since the step (the request
        fails and it no longer answers) is dropped as in a step
        (:meth:`~secure_vfl.methods.base.Federation.recover`, ``"phase": "checkpoint"``) and
        the step is committed without it; any other failure fails the run."""
        fed = method.fed
        manifests: dict[str, str] = {}
        for name in [name for name in fed.live() if name in elsewhere.names]:
            if name in fed.dropped:
                continue  # found lost while another party was asked
            try:
                manifests |= elsewhere.write(
                    step, self.run_id, committed=self.committed, parties=[name]
                )
            except ProtocolError as error:
                fed.recover(error, round=step - 1, abandoned=(), phase=CHECKPOINT)
        return {name: digest for name, digest in manifests.items() if name not in fed.dropped}

    def hook(
        self,
        on_step: StepCallback | None,
        *,
        method: Method,
        parties: Sequence[DataParty],
        progress: TrainingProgress,
    ) -> StepCallback | None:
        """``on_step``, after writing every party's checkpoint every ``plan.every`` steps."""
        every = self.plan.every
        if every == 0:
            return on_step

        def step_done(step: int, loss: float) -> None:
            if step % every == 0:
                self.write(step, method=method, parties=parties, progress=progress)
            if on_step is not None:
                on_step(step, loss)

        return step_done

    def write(
        self,
        step: int,
        *,
        method: Method,
        parties: Sequence[DataParty],
        progress: TrainingProgress,
    ) -> None:
        """Every party writes its checkpoint of ``step``, the label party last with the other
        manifests' SHA-256 (the commit); then each drops its older ones (a party elsewhere when
        it writes its next one: its last committed one is kept until then)."""
        root = self.plan.directory
        label = method.fed.own
        method.fed.flush(round=step - 1)  # the step's closing gradients, before its state is kept
        manifests = {}
        elsewhere = self.plan.elsewhere
        away = elsewhere.names if elsewhere is not None else []
        for party in parties:
            if party.name not in (label.name, *away) and party.name not in method.fed.dropped:
                tensors, meta = party_state(party)
                manifests[party.name] = write_checkpoint(
                    root, party.name, run_id=self.run_id, step=step, tensors=tensors, meta=meta
                )
        if elsewhere is not None:
            manifests |= self._write_elsewhere(elsewhere, step, method)
        tensors, meta = party_state(label)
        tensors["run"], meta["run"] = run_state(method, progress)
        meta["settings"] = self.settings
        write_checkpoint(
            root,
            label.name,
            run_id=self.run_id,
            step=step,
            tensors=tensors,
            meta=meta,
            parties=manifests,
        )
        self.committed = step
        for party in parties:
            drop_older(root, party.name, keep=step)
