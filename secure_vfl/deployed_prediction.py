"""Prediction where the parts live: each data party loads its own part of a deployed model in
its own process and sends representations of its own new rows.

``secure-vfl predict --federation FED --name LABEL --model RUN_DIR`` runs the label party: it
reads the manifest that ``train --federation`` wrote (every party's part and its files'
SHA-256), loads its own part and reads its own new rows (``--party-file``, default its ``data``
file). Each data party serves its new rows (``party serve --data FILE``; default its ``data``
file) with its ``--model-dir``, where it kept its part; the aggregation server serves too. What
crosses, besides the prediction's messages of the in-process run (``represent-request`` in
phase ``predict``, representations, sums), is :class:`~secure_vfl.federation.messages.
DeploymentMessage` s, each a JSON object checked on arrival:

1. ``ids-request`` -> ``ids``: each reachable data party's ids (the plain join, as in training:
   the label party learns which ids each party holds). The rows predicted are every id any
   party holds; a party holds its own rows of them. With ``--align psi`` instead, ``psi`` ->
   ``psi-ready`` and a DH-PSI session with each data party (as in training): the label party's
   own rows are predicted, a party's rows are the sample positions its PSI matched.
2. ``predict-setup``: the model's run id, the method and its configuration, the seed, the
   party's index and the names, the block shapes, FALSE-VFL's options, the SHA-256 of each file
   of the party's part (from the manifest) and the party's row of every predicted id (-1: it
   holds none). The party builds its models by the method's seed rule, loads its own part from
   ``DIR/NAME/RUN_ID/``, every file checked against the manifest's hash (a part altered since
   the party reported its hashes is refused), and applies its own saved preprocessing to its new
   rows. The aggregation server is set up for plain sums.
3. The label party predicts from the blocks present (LASER; a method that cannot do without a
   block refuses before any set-up). A party lost in training (no part) or not reachable
   within ``--wait`` is absent for every row.
4. ``end`` -> ``report``, as in training.

Prediction runs in plain sums by default: the aggregation server then sees each party's
representations of the new rows. With ``--secure-agg masks`` (or ``paillier``, ``ckks``) each
data party makes its halves and the keys meet by messages, as in training: the server sees only
sealed shares, the label party only the sums it is owed.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from secure_vfl.data.party_files import PartyTable, read_party_file
from secure_vfl.deployment import (
    _DIGEST,
    _MODEL_ID,
    _PART_FILE,
    LATENT_METHODS,
    PsiAlignment,
    PsiRoles,
    SecureSums,
    ServedModel,
    _body,
    _deployment,
    _end,
    _endpoint,
    _row_mapping,
    _rows,
    _with_secure_sums,
    check_rosters,
    collect_ids,
    served_config,
    served_models,
    served_shapes,
    start_psi,
)
from secure_vfl.errors import ConfigError, DataError, IntegrityError, ProtocolError, RunWarning
from secure_vfl.federation.federation_file import Federation
from secure_vfl.federation.messages import AGGREGATOR, Message
from secure_vfl.federation.network import NetworkChannel
from secure_vfl.federation.parties import DataParty
from secure_vfl.federation.parts import Part, load_part, refuse_unfit
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.false_vfl import predict_as_saved
from secure_vfl.saved_model import (
    KEPT_BY_PARTY,
    LOST,
    PREDICT_SPLIT,
    PREDICTED_COLUMN,
    PartEntry,
    Predictions,
    load_party_part,
    output_id_column,
    predict_rows,
    read_manifest,
    read_party_part,
    rebuild_method,
    refuse_absent,
    refuse_unfit_parts,
    refuse_unlisted,
    refuse_unlisted_files,
    union_alignment,
    warn_disjoint,
)

logger = logging.getLogger(__name__)

PREDICT_SETUP_KEYS: dict[str, type | tuple[type, ...]] = {
    "run": str,
    "method": str,
    "method_config": dict,
    "seed": int,
    "index": int,
    "names": list,
    "num_classes": int,
    "block_shapes": list,
    "false_vfl": (dict, type(None)),
    "files": dict,
    "rows": list,
    "align": str,
    "secure_agg": str,
}
"""``predict-setup``: what a data party rebuilds and loads its part from, and its rows."""


# -- a data party: its own process ---------------------------------------------------------------


def build_predicting_party(
    name: str,
    message: Message,
    table: PartyTable,
    model: ServedModel,
    secure_sums: SecureSums,
    *,
    aligned: np.ndarray | None = None,
) -> DataParty:
    """Data party ``name`` as the ``predict-setup`` ``message`` describes it: its models by the
    method's seed rule, its own part of the model loaded from its model directory (each file
    checked against the manifest's SHA-256 the message carries), holding its rows of the
    predicted ids from its ``table`` after its own saved preprocessing. Under ``align: "psi"``
    the rows are sample positions, which it maps to its rows by ``aligned`` (what its PSI with
    the label party told it), as a training set-up's. ProtocolError for a set-up that does not
    fit (a run id or file name that is not one, rows beyond its table or alignment, a part it
    does not keep, that differs from the manifest's or beside which lies a file it does not
    list)."""
    body = _body(message, "predict-setup", PREDICT_SETUP_KEYS)
    run, files = body["run"], body["files"]
    if not _MODEL_ID.fullmatch(run):
        raise ProtocolError(
            f"predict-setup: a run id of 32 hex digits expected; found {run[:40]!r}."
        )
    if not files or not all(
        isinstance(v, str) and _PART_FILE.fullmatch(k) and _DIGEST.fullmatch(v)
        for k, v in files.items()
    ):
        raise ProtocolError(
            "predict-setup: a SHA-256 (64 hex digits) per plain file name expected; found "
            f"{sorted(files)[:5]}."
        )
    config = served_config("predict-setup", name, body)
    # Nothing trains: no labelled subset, no pretraining (as a model loaded in one process).
    config = dataclasses.replace(config, labeled=None, pretrain_epochs=0)
    shapes = served_shapes("predict-setup", body)
    to_rows = _row_mapping(body["align"], aligned, name, table.ids.size)
    n = table.ids.size if aligned is None else aligned.size
    rows = to_rows(_rows(body["rows"], "rows", low=-1, high=n), "rows")
    placeholder = {"train": np.zeros((1, *shapes[body["index"]]), dtype=np.float32)}
    held = {"train": np.zeros(1, dtype=np.int64)}

    def build() -> DataParty:
        return served_models(
            "predict-setup", name, body, config, placeholder, held, shapes, None, labels=None
        )

    if model.directory is None:
        raise ProtocolError(f"{name} keeps no model directory; it has no part to predict with.")
    directory = model.part_directory(run)
    try:
        part = load_part(directory, files, party=name)
        refuse_unlisted_files(directory, files, who=name)
        # The models the set-up asks for, first without memory: a set-up that asks for a vast
        # network is refused by its own part's shapes before it is built.
        with torch.device("meta"):
            refuse_unfit(build().own_modules(), part.states, party=name)
    except (DataError, IntegrityError) as error:
        raise ProtocolError(
            f"predict-setup: {name} cannot load its part of model {run} from {directory}: {error}"
        ) from None
    party = build()
    party.load_part(part)
    predict_as_saved(party, body["seed"], body["index"])
    party.hold_rows(PREDICT_SPLIT, table, rows, source=table.name)
    return _with_secure_sums(party, secure_sums(body["secure_agg"]))


# -- the label party ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeployedPredictions:
    """What a deployed prediction gives: the predictions, the model's manifest, and the data
    parties absent from it (lost in training, or not reachable), each with why."""

    predictions: Predictions
    manifest: Any
    absent: dict[str, str]


def predict_deployed(
    model: Path,
    federation: Federation,
    name: str,
    *,
    own: Path | None,
    id_column: str | None = None,
    label_column: str = PREDICTED_COLUMN,
    deadline: float,
    wait: float = 60.0,
    insecure: bool = False,
    capture: BinaryIO | None = None,
    psi: PsiRoles | None = None,
    secure_agg: str = "none",
    secure_sums: SecureSums | None = None,
) -> DeployedPredictions:
    """Predict the new rows the parties of ``federation`` serve with the model a deployed run saved
    at ``model`` (its run directory or ``model/``), as the label party ``name`` holding the new rows
    of the file ``own`` (ids in ``id_column``, default the one it was trained with; None: its block
    is absent; the predicted label under ``label_column``, output columns that collide refused
    before any id crosses): every data party loads its own part in its own process (module
    docstring). A data party lost in training, or not accepting a connection within ``wait``
    seconds, is absent for every row (ConfigError first if the method cannot predict without it).
    With ``psi`` (the roles of DH-PSI) no id crosses in the clear: the label party runs PSI with
    each data party, as ``train --align psi`` does, and predicts its own rows (it learns only which
    of its ids each party holds; a party learns which of its ids are predicted). Under
    ``secure_agg`` (a scheme ``secure_sums`` makes) the representations are sealed, as in training:
    the aggregation server sees only sealed shares and the label party only sums."""
    manifest, directory = read_manifest(Path(model))
    refuse_unlisted(manifest, directory)
    if name != federation.label_party:
        raise ConfigError(
            f"{name} is not the label party of {federation.path} ({federation.label_party} "
            f"is); {'the aggregation server' if name == AGGREGATOR else 'a data party'} runs "
            f"`secure-vfl party serve --federation {federation.path} --name {name}"
            f"{'' if name == AGGREGATOR else ' --data NEW_ROWS.csv'}`."
        )
    if manifest.method_config.get("release") == "dp":
        raise ConfigError(
            f"model {manifest.run_id[:12]} was trained with --release dp: its predictions ask "
            "parties for DP releases of the rows a secure sum cannot hide, which no party's "
            "accountant prices outside a training run (a deployed party refused them). Expected "
            "a model trained with --release drop; this one predicts in one process, its parts "
            f"copied beside its manifest (`predict --model {model} --party-file ...`)."
        )
    trained = [entry.name for entry in manifest.parties]
    if trained != federation.names:
        raise ConfigError(
            f"model {manifest.run_id[:12]} was trained by {', '.join(trained)} (in block "
            f"order); {federation.path} names {', '.join(federation.names)}."
        )
    here = [e.name for e in manifest.parties[1:] if e.location not in (KEPT_BY_PARTY, LOST)]
    if here:
        raise ConfigError(
            f"the parts of {', '.join(here)} lie beside the manifest, not at their parties: "
            "a model trained in one process predicts in one process (`predict --model "
            f"{model} --party-file ...`)."
        )
    absent = {e.name: "lost in training" for e in manifest.parties[1:] if e.location == LOST}
    backend = secure_sums(secure_agg) if secure_sums is not None else None
    if secure_agg != "none" and backend is None:
        raise ConfigError(f"--secure-agg {secure_agg} needs the secure-sum backends; found none.")
    endpoint = _endpoint(federation, name, insecure=insecure, deadline=deadline, capture=capture)
    outcome = "failed"
    try:
        expected = [n for n in federation.names[1:] if n not in absent]
        for late in endpoint.await_peers([*expected, AGGREGATOR], wait):
            if late == AGGREGATOR:
                raise ConfigError(
                    f"the aggregation server at {federation.member(AGGREGATOR).address} accepted "
                    f"no connection within {wait:g} s; it adds the representations: serve it."
                )
            absent[late] = f"not reachable within {wait:g} s"
            logger.warning("%s: %s is not reachable; it is absent from the prediction", name, late)
        check_rosters(endpoint, federation, [*(n for n in expected if n not in absent), AGGREGATOR])
        # Its own part, checked against the architecture first built without memory; refused
        # here, the run still ends at every party that waits for it.
        entry = manifest.parties[0]
        part = read_party_part(directory / entry.directory, entry, manifest)
        trained_secure = bool(manifest.method_config.get("secure_sums"))
        if backend is not None and trained_secure and part.training_samples is None:
            warnings.warn(
                f"model {manifest.run_id[:12]} keeps no record of the samples it trained on "
                "(saved by an earlier secure-vfl): predict new ids only with it, or train it "
                "again. A training sample would get its prediction's sums from one fixed "
                "grouping of the parties and had its training sums from another, and the label "
                "party could subtract one from the other to isolate a party's representation "
                "of it (docs/security-review.md, F29).",
                RunWarning,
                stacklevel=2,
            )
        refuse_unfit_parts(manifest, {0: part}, secure_sums=backend is not None)
        channel = NetworkChannel(endpoint)
        channel.party_names = federation.names
        # The label party's side only; under sealed sums only the sums they may release.
        method = rebuild_method(manifest, channel, secure_sums=backend is not None)
        refuse_absent(method, [*absent, *([] if own is not None else [federation.names[0]])])
        label = _own_part(channel, part, entry)
        id_column = output_id_column(label, id_column, label_column)
        table = None
        if own is not None:
            table = read_party_file(own, id_column=id_column, name=federation.names[0])
        # The set-up's answers wait here, not at the label party's actor.
        handler, endpoint.handler = endpoint.handler, None
        live = [n for n in federation.names[1:] if n not in absent]
        if psi is not None:
            if table is None:
                raise ConfigError(
                    "a prediction aligned by PSI predicts the label party's own rows: expected "
                    "its --party-file (or `data` file). Found none."
                )
            sample_ids, rows = _psi_rows(endpoint, federation, table, live, psi)
        else:
            ids = dict(zip(live, collect_ids(endpoint, federation, live)[0], strict=True))
            held = [ids.get(n) for n in federation.names[1:]]
            party_ids = [table.ids if table else None, *held]
            sample_ids, rows = union_alignment(party_ids)
            where = [f"{own} ({name})", *(f"{n}'s new rows" for n in federation.names[1:])]
            warn_disjoint(party_ids, where, rows)
        for k, party in enumerate(federation.names[1:], start=1):
            if party in live:
                body = _predict_setup(manifest, k, federation.names, rows[:, k], psi, secure_agg)
                endpoint.send(_deployment(name, party, "predict-setup", body))
        endpoint.send(_deployment(name, AGGREGATOR, "setup", {"secure_agg": secure_agg}))
        if backend is None:
            endpoint.handler = handler
        else:  # again, now that every party has its halves: their keys meet by messages
            channel = NetworkChannel(endpoint)
            channel.party_names = federation.names
            channel.absent = frozenset(absent)  # no key set-up with a party not served
            method = rebuild_method(manifest, channel, aggregator=backend, secure_sums=True)
            label = _own_part(channel, part, entry)
        label.hold_rows(PREDICT_SPLIT, table, rows[:, 0], source=str(own or ""))
        names = [e.source for e in manifest.parties]
        predictions = predict_rows(
            method, sample_ids, rows, names, id_column=id_column, label_column=label_column
        )
        outcome = "finished"
    finally:
        _end(endpoint, federation, outcome, lost=list(absent))
        endpoint.close()
    return DeployedPredictions(predictions, manifest, absent)


def _own_part(channel: NetworkChannel, part: Part, entry: PartEntry) -> DataParty:
    """The label party of ``channel``, holding its own ``part`` of the model (its manifest
    ``entry``'s)."""
    label = in_process_parties(channel)[0]
    load_party_part(label, part, entry)
    return label


def _psi_rows(
    endpoint: Any, federation: Federation, own: PartyTable, live: list[str], psi: PsiRoles
) -> tuple[np.ndarray, np.ndarray]:
    """The label party's rows, sorted by id, and (N, K) each party's place in them: the label
    party's rows of its table, and for every ``live`` data party the sample positions its PSI
    matched (-1 elsewhere, and for every other party), which the party maps to its own rows."""
    sessions, _ = start_psi(endpoint, federation, live)
    alignment, _ = PsiAlignment(endpoint, own, sessions, psi)(own.ids)
    rows = np.full((alignment.sample_ids.size, len(federation.names)), -1, dtype=np.int64)
    rows[:, 0] = alignment.rows[:, 0]
    for column, name in enumerate(live, start=1):
        rows[:, federation.names.index(name)] = alignment.rows[:, column]
    return alignment.sample_ids, rows


def _predict_setup(
    manifest: Any,
    k: int,
    names: list[str],
    rows: np.ndarray,
    psi: object = None,
    secure_agg: str = "none",
) -> dict[str, Any]:
    """Party ``k``'s ``predict-setup`` body: the model's terms, its rows (sample positions
    after ``psi``) and the secure-sum scheme."""
    entry = manifest.parties[k]
    secure = manifest.method_config.get("secure_sums") or secure_agg != "none"
    return {
        "run": manifest.run_id,
        "method": manifest.method,
        "method_config": {**manifest.method_config, "secure_sums": bool(secure)},
        "seed": manifest.seed,
        "index": k,
        "names": names,
        "num_classes": manifest.num_classes,
        "block_shapes": [list(shape) for shape in manifest.block_shapes],
        "false_vfl": manifest.false_vfl if manifest.method in LATENT_METHODS else None,
        "files": dict(entry.files),
        "rows": rows.tolist(),
        "align": "join" if psi is None else "psi",
        "secure_agg": secure_agg,
    }
