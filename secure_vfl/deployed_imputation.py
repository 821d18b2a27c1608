"""A deployed imputation run: each client its own process, the label party coordinating.

``secure-vfl impute --federation FED --name LABEL --method fedhf`` runs the coordinator (the
FedAvg server) in the label party's process; every other party of the federation file serves
as one client (``secure-vfl party serve``, its ``data`` file its client file), and the
aggregation server adds their sums. The label party holds no client rows: its own ``data`` file,
if it has one, is not read. What crosses besides the in-process run's messages
(:mod:`secure_vfl.methods.imputation.federation`) is two
:class:`~secure_vfl.federation.messages.DeploymentMessage` s per client, each a JSON object
checked on arrival:

1. ``columns-request`` (the id and label column names, which are not features) -> ``columns``:
   the client's feature columns, in its file's order, and its row count. The label party unites
   the schemas in the federation file's order, as ``impute --client-file`` does in the order of
   its files.
2. ``impute-setup``: the method, its configuration, the seed, the client's index, the
   federation's features, the test fraction and the secure-sum scheme. The client places its
   file in the features, splits its rows into train and test with its own generator
   (:func:`~secure_vfl.data.imputation.split_rng`), builds its model by the method's seed rule
   and makes its secure-sum halves itself (:func:`build_served_client`).

The run is then the in-process one, message for message: the statistics, FedAvg, and the
score, which each client computes on its own test rows (:class:`~secure_vfl.federation.
messages.ScoreRequest`). The yardstick of the scores (the global per-feature std of the
training rows, which the in-process evaluator computes with exact sums of its own) is the
standardisation the method collected, exact without DP. So the same seed and files give the
in-process run's RMSEs and curve (plain sums exactly; masked sums up to their fixed-point
precision in the yardstick). ``end`` is answered by each party's ``report``
as in training. Only the FedAvg methods are offered (a per-client method has nothing to
federate). With ``--save-imputed`` each client writes its imputed table in its own process
(``impute-save``). At the end each client saves its own imputer there (``save``: its part and a
manifest listing it alone, in its model directory), to fill new rows of its own with alone.

A client lost in the rounds is dropped and FedAvg goes on over the others; one whose operator
restarts it is readmitted before a later round: it is sent its ``impute-setup`` again
(:func:`_readmission`), then the statistics and the global model
(:meth:`~secure_vfl.methods.imputation.federation.ImputationFederation.rejoin`). Not under DP
statistics: its first process's releases died with it, unreported.

Under DP statistics the ``impute-setup`` carries the plan of the clients' mechanisms (a
``privacy`` part, :class:`protocols.dp_statistics.StatisticsPlan`): each client makes its own
mechanism and accountant from it (the composition root's factory, :data:`StatisticsPrivacyFactory`)
and reports what it priced in its ``report``; the coordinator knows the public terms from the
plan. The yardstick is then the released standardisation.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import numpy as np

from secure_vfl.data.imputation import (
    ClientData,
    ClientFile,
    client_file_columns,
    split_client_file,
    split_rng,
    warn_alike_features,
)
from secure_vfl.data.party_files import LABEL_COLUMN
from secure_vfl.deployment import (
    MAX_LAYER_WIDTH,
    MAX_LAYERS,
    MAX_LOCAL_EPOCHS,
    SETUP_DEADLINE,
    SecureSums,
    ServedPrivacy,
    _ask_save,
    _body,
    _deployment,
    _end,
    _endpoint,
    _with_reports,
    check_requested,
    check_rosters,
)
from secure_vfl.errors import ConfigError, DataError, ProtocolError, TransportError
from secure_vfl.experiment import (
    ImputeResult,
    ImputeRunConfig,
    fit_and_score,
    load_optimiser_machinery,
    traffic_report,
)
from secure_vfl.federation.aggregator import PlainAggregator, SealingScheme
from secure_vfl.federation.federation_file import Federation, Member
from secure_vfl.federation.messages import AGGREGATOR, Message
from secure_vfl.federation.network import NetworkChannel
from secure_vfl.io import atomic_write, shown, shown_names
from secure_vfl.methods.imputation import ImputeConfig
from secure_vfl.methods.imputation.clients import ImputationClient, TrainingPlan
from secure_vfl.methods.imputation.evaluation import TEST_FRACTION, scores_of
from secure_vfl.methods.imputation.federation import Coordinator, ImputationFederation
from secure_vfl.methods.imputation.fedhf import RECONSTRUCTIONS, reconstruction_imputer
from secure_vfl.methods.imputation.statistics import ReleaseTerms
from secure_vfl.saved_model import KEPT_BY_PARTY, LOST, new_run_id

logger = logging.getLogger(__name__)

COLUMNS_REQUEST_KEYS: dict[str, type | tuple[type, ...]] = {"id_column": str, "label_column": str}
"""``columns-request``: the columns of the client files that are not features."""
COLUMNS_KEYS: dict[str, type | tuple[type, ...]] = {"columns": list, "rows": int, "label": bool}
"""``columns``: the client's feature columns in its file's order, its row count, and whether its
file has the label column asked about."""
IMPUTE_SETUP_KEYS: dict[str, type | tuple[type, ...]] = {
    "method": str,
    "config": dict,
    "seed": int,
    "index": int,
    "features": list,
    "test_fraction": float,
    "secure_agg": str,
    "id_column": str,
    "label_column": str,
    "privacy": (dict, type(None)),
}
"""``impute-setup``: what a client builds its part of the run from (``privacy``: the plan of
its statistics mechanism, :class:`protocols.dp_statistics.StatisticsPlan`; None: no DP)."""
IMPUTE_SAVE_KEYS: dict[str, type | tuple[type, ...]] = {"run": str}
"""``impute-save``: the run id under which each client writes its imputed table."""
IMPUTE_SAVED_KEYS: dict[str, type | tuple[type, ...]] = {"run": str, "rows": int, "sha256": str}
"""``impute-saved``: the run, the rows written and the table's SHA-256."""
_RUN_ID = re.compile(r"[0-9a-f]{16}")

StatisticsPrivacyFactory = Callable[[str, Any, ImputationClient, Sequence[str]], ServedPrivacy]
"""A client's own statistics mechanism from (its name, the ``privacy`` part of its
``impute-setup``, the client built, the run's features), installed in the client
(:func:`protocols.dp_statistics.served_statistics`); ProtocolError for a malformed part. Handed
in by the composition root: the core never imports the privacy layer."""


class StatisticsPlan(Protocol):
    """A deployed imputation's statistics plan (:class:`protocols.dp_statistics.StatisticsPlan`):
    what goes to every client, and what the coordinator knows of their mechanisms."""

    def to_json(self) -> dict[str, Any]: ...

    def terms(self) -> ReleaseTerms: ...


if TYPE_CHECKING:

    class DeployedStatisticsPrivacy(Protocol):
        """What the label party of a deployed imputation needs of the privacy layer
        (:class:`protocols.privacy.PrivacyEngine`): the clients' plan before they are set up,
        their reports at the end, and the run's privacy entry."""

        def statistics_plan(
            self, features: Sequence[str], clients: Sequence[str], *, records: int | None = None
        ) -> StatisticsPlan | None: ...

        def take_statistics_reports(self, reports: Mapping[str, Any]) -> None: ...

        def report(self) -> dict[str, Any] | None: ...


def deployable_methods() -> list[str]:
    """The imputation methods ``impute --federation`` runs: the FedAvg reconstructions."""
    import secure_vfl.methods.imputation.baselines  # noqa: F401  (registers fed-dae)

    return [name for name in RECONSTRUCTIONS.names() if RECONSTRUCTIONS.get(name).federated]


# -- a client: its own process ------------------------------------------------------------------


def _distinct_columns(topic: str, body: Mapping[str, Any]) -> None:
    """Refuse a ``topic`` body whose id column is its label column (ProtocolError), as one
    process refuses the pair: the id column is no label."""
    if body["id_column"] == body["label_column"]:
        raise ProtocolError(
            f"{topic}: distinct id and label columns expected; found {shown(body['id_column'])} "
            "as both."
        )


def served_columns(member: Member, message: Message) -> dict[str, Any]:
    """The ``columns`` answer of the client ``member`` to a ``columns-request``."""
    body = _body(message, "columns-request", COLUMNS_REQUEST_KEYS)
    _distinct_columns("columns-request", body)
    path = _client_file(member)
    columns, rows, label = client_file_columns(
        path, id_column=body["id_column"], label_column=body["label_column"]
    )
    return {"columns": list(columns), "rows": rows, "label": label}


@dataclasses.dataclass
class ServedClient:
    """A client's part of a deployed imputation, in its own process: its actor, its rows and
    its file's own form (to write its imputed table back)."""

    party: ImputationClient
    train: ClientData
    test: ClientData
    file: ClientFile
    features: tuple[str, ...]
    method: str
    seed: int
    config: ImputeConfig
    columns: tuple[str, str]
    """The id and label columns of its file."""
    privacy: ServedPrivacy | None = None
    """Its own statistics mechanism and accountant (None: no DP), reported at the end."""

    def save_model(self, directory: Path, run: str) -> dict[str, str]:
        """Write its own imputer into the fresh ``directory``: its part and a manifest that
        lists it alone (:func:`~secure_vfl.saved_imputer.write_imputer`), so that it fills new
        rows of its own with ``secure-vfl fill --model DIRECTORY`` on its machine, no other
        party taking part. Returns the manifest's SHA-256 (which pins every file's), for the
        ``saved`` answer."""
        from secure_vfl.saved_imputer import MANIFEST_FILE, SavedClient, write_imputer

        client = SavedClient(
            name=self.party.name,
            columns=tuple(str(c) for c in self.file.features.columns),
            forms=self.file.cell_forms(),
            write=self.party.save_part,
        )
        write_imputer(
            directory,
            [client],
            run_id=run,
            method=self.method,
            seed=self.seed,
            config=self.config,
            data="client-files",
            features=self.features,
            columns=self.columns,
        )
        return {MANIFEST_FILE: hashlib.sha256((directory / MANIFEST_FILE).read_bytes()).hexdigest()}

    def save(self, directory: Path, message: Message) -> tuple[dict[str, Any], Path]:
        """Write its imputed table (its file's rows in its order, the ids first, every cell
        it had unchanged, its empty cells imputed by its model) to ``directory/RUN/NAME.csv``,
        atomically. Returns the ``impute-saved`` answer (the run, the rows and the file's
        SHA-256; its place on this machine stays here) and the file's path."""
        body = _body(message, "impute-save", IMPUTE_SAVE_KEYS)
        if not _RUN_ID.fullmatch(body["run"]):
            raise ProtocolError(
                f"impute-save: a run id of 16 hex digits expected, found {body['run'][:40]!r}."
            )
        rows = ClientData(
            self.train.name,
            np.concatenate([self.train.values, self.test.values]),
            self.train.available,
        )
        imputed = self.party.impute(rows)
        frame = self.file.imputed_frame(
            imputed[: self.train.n], imputed[self.train.n :], self.features, as_written=True
        )
        path = directory / body["run"] / f"{self.party.name}.csv"

        def write(tmp: Path) -> None:
            frame.to_csv(tmp, index=False)

        atomic_write(path, write)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        return {"run": body["run"], "rows": len(frame), "sha256": digest}, path


def build_served_client(
    member: Member,
    message: Message,
    secure_sums: SecureSums,
    statistics_privacy: StatisticsPrivacyFactory | None = None,
    *,
    clients: int,
) -> ServedClient:
    """Client ``member``'s part of the run its ``impute-setup`` describes: its file placed in
    the federation's features, its own train/test split, its training plan by the method's
    seed rule, its own secure-sum halves and, when the set-up carries a privacy plan, its own
    statistics mechanism made by ``statistics_privacy`` (ProtocolError without one, or for a
    plan whose noise is shared among other than the run's ``clients`` under secure sums, or
    other than 1 without: each client's share would be too small for the guarantee it
    reports)."""
    body = _body(message, "impute-setup", IMPUTE_SETUP_KEYS)
    _distinct_columns("impute-setup", body)
    method = body["method"]
    if method not in deployable_methods():
        raise ProtocolError(
            f"impute-setup: a method in {deployable_methods()} expected, found {method!r}."
        )
    features = body["features"]
    if not all(isinstance(f, str) for f in features):
        raise ProtocolError("impute-setup: `features` must be a list of column names.")
    named_twice = sorted(f for f, n in collections.Counter(features).items() if n > 1)
    if named_twice:
        raise ProtocolError(
            "impute-setup: `features` must name distinct columns; found "
            f"{shown_names(named_twice)} more than once."
        )
    index, seed = body["index"], body["seed"]
    if index < 0 or seed < 0:
        raise ProtocolError(
            f"impute-setup: an index and a seed >= 0 expected, found {index} and {seed}."
        )
    limits = {
        "hidden": MAX_LAYER_WIDTH,
        "top_k": MAX_LAYER_WIDTH,
        "layers": MAX_LAYERS,
        "local_epochs": MAX_LOCAL_EPOCHS,
    }
    check_requested("impute-setup", body["config"], limits)
    try:
        config = ImputeConfig(**body["config"])
    except (TypeError, ConfigError) as error:
        raise ProtocolError(f"impute-setup: `config` of ImputeConfig's fields: {error}") from None
    train, test, file = split_client_file(
        _client_file(member),
        name=member.name,
        features=features,
        test_fraction=body["test_fraction"],
        rng=split_rng(seed, index),
        id_column=body["id_column"],
        label_column=body["label_column"],
    )
    recipe = RECONSTRUCTIONS.get(method)
    plan = TrainingPlan(
        config=config, make_model=recipe.models(config, len(features)), shared_init=True
    )
    client = ImputationClient(
        train, test=test, training=plan.for_client(index, seed), coordinator=message.sender
    )
    backend = secure_sums(body["secure_agg"])
    if isinstance(backend, SealingScheme):
        client.install(backend.scheme, backend.sender(), None)
    privacy = None
    if body["privacy"] is not None:
        if statistics_privacy is None:
            raise ProtocolError(
                f"impute-setup: {member.name} was sent a statistics plan, but this process "
                "offers no DP mechanisms."
            )
        _check_shares(body["privacy"], clients if body["secure_agg"] != "none" else 1)
        privacy = statistics_privacy(member.name, body["privacy"], client, features)
    return ServedClient(
        client,
        train,
        test,
        file,
        tuple(features),
        method=method,
        seed=seed,
        config=config,
        columns=(body["id_column"], body["label_column"]),
        privacy=privacy,
    )


def _client_file(member: Member) -> Path:
    if member.data is None:
        raise ProtocolError(f"{member.name} holds no data file; it has no rows to impute.")
    return member.data


# -- the label party: the coordinator ----------------------------------------------------------


def _check_shares(plan: Any, expected: int) -> None:
    """ProtocolError unless the statistics ``plan`` shares its noise among ``expected``
    clients (the federation's, under secure sums; 1, each adding all of it, without)."""
    shares = plan.get("shares") if isinstance(plan, dict) else None
    if shares != expected:
        raise ProtocolError(
            f"impute-setup: the privacy plan shares the statistics' noise among {shares!r} "
            f"clients; expected {expected} (the federation's clients under secure sums, 1 "
            "without): a larger count would shrink this client's noise below what its "
            "guarantee is priced at."
        )


def check_coordinator(method: str, federation: Federation, name: str) -> list[Member]:
    """The clients of a deployed imputation that ``name`` coordinates with ``method``;
    ConfigError, before any contact, for a method not offered deployed, a ``name`` that is not
    the federation's label party, or fewer than 2 clients."""
    if method not in deployable_methods():
        raise ConfigError(
            f"--method {method} is not offered with --federation; expected one of "
            f"{', '.join(deployable_methods())} (a per-client method has nothing to federate: "
            "each client runs it alone with `impute --client-file`)."
        )
    if name != federation.label_party:
        raise ConfigError(
            f"{name} is not the label party of {federation.path} ({federation.label_party} "
            f"is); a client runs `secure-vfl party serve --federation {federation.path} --name "
            f"{name}`."
        )
    clients = [m for m in federation.parties if m.name != name]
    if len(clients) < 2:
        raise ConfigError(
            f"federated imputation needs at least 2 clients besides the coordinator {name}. "
            f"Found {len(clients)} in {federation.path}: "
            f"{', '.join(m.name for m in clients) or 'none'}."
        )
    return clients


def impute_deployed(
    config: ImputeRunConfig,
    federation: Federation,
    name: str,
    *,
    secure_agg: str,
    secure_sums: SecureSums,
    deadline: float,
    wait: float = 60.0,
    insecure: bool = False,
    on_start: Callable[[int], None] | None = None,
    on_round: Callable[[int, float], None] | None = None,
    save_imputed: bool = False,
    privacy: DeployedStatisticsPrivacy | None = None,
    capture: BinaryIO | None = None,
) -> tuple[ImputeResult, dict[str, Any]]:
    """Run ``config`` (a FedAvg reconstruction method over the federation's client files) as
    the coordinator in the label party ``name``'s process: every other party is a client in its
    own process. Returns the :class:`~secure_vfl.experiment.ImputeResult`, its traffic
    counting every party's bytes (each reports its own), and what the clients saved in their
    own processes: ``model``, the run id of the imputers every client saved (each its own, to
    fill new rows with alone) and per client where it lies and its manifest's SHA-256, and with
    ``save_imputed`` ``imputed`` (else None), the run id of the imputed tables and per client
    its rows and the table's SHA-256 (``impute-save``). With ``privacy`` (the
    label party's privacy engine) the statistics are released under DP: each client makes its
    own mechanism from the engine's plan in its own process and reports what its accountant
    priced at the end, which the result's privacy entry lists. ``capture`` records every message
    that crosses the label party's endpoint."""
    clients = check_coordinator(config.method, federation, name)
    endpoint = _endpoint(federation, name, insecure=insecure, deadline=deadline, capture=capture)
    outcome = "failed"
    reports: dict[str, Counter[tuple[str, str, str]]] = {}
    entries: dict[str, Any] = {}
    plan: StatisticsPlan | None = None
    saved: dict[str, Any] | None = None
    model: dict[str, Any] = {}
    gone: list[str] = []  # clients whose process died while saving its imputer
    view: ImputationFederation | None = None
    late: list[str] = []
    try:
        late = endpoint.await_peers_or_warn(list(federation.addresses(but=name)), wait)
        check_rosters(endpoint, federation, [m.name for m in federation.members[1:]])
        schemas = _columns(endpoint, clients, config)
        features = list(dict.fromkeys(f for columns, _ in schemas.values() for f in columns))
        warn_alike_features({client: columns for client, (columns, _) in schemas.items()})
        if len(features) < 2:
            raise ConfigError(
                f"the clients' files together must have at least 2 feature columns. Found "
                f"{features}."
            )
        if privacy is not None:
            trained = sum(n - round(TEST_FRACTION * n) for _, n in schemas.values())
            plan = privacy.statistics_plan(
                features, [member.name for member in clients], records=trained
            )
        bodies = {}
        for index, member in enumerate(clients):
            bodies[member.name] = body = {
                "method": config.method,
                "config": dataclasses.asdict(config.impute_config),
                "seed": config.seed,
                "index": index,
                "features": features,
                "test_fraction": TEST_FRACTION,
                "secure_agg": secure_agg,
                "id_column": config.id_column,
                "label_column": config.label_column,
                "privacy": plan.to_json() if plan is not None else None,
            }
            try:
                endpoint.send(
                    _deployment(name, member.name, "impute-setup", body),
                    deadline=max(deadline, SETUP_DEADLINE),
                )
            except TransportError as error:  # gone while it set up: said as a loss below is
                if error.party != member.name:
                    raise
                raise TransportError(
                    f"{member.name} lost before FedAvg's first round, while it was set up: start "
                    f"it again and rerun (a client lost in a later round is dropped and FedAvg "
                    f"goes on). {error}",
                    member.name,
                ) from error
        endpoint.send(_deployment(name, AGGREGATOR, "setup", {"secure_agg": secure_agg}))
        aggregator = secure_sums(secure_agg) or PlainAggregator()
        channel = NetworkChannel(endpoint)
        coordinator = Coordinator(name)
        coordinator.connect(channel)
        if plan is None:  # under DP a lost client's releases died with it, unreported
            channel.readmit = _readmission(endpoint, bodies, deadline=deadline)
        view = ImputationFederation(
            own=coordinator,
            names=[member.name for member in clients],
            features=len(features),
            channel=channel,
            session=secrets.token_hex(8),
            release_terms=plan.terms() if plan is not None else None,
        )
        load_optimiser_machinery()
        start = time.perf_counter()
        try:
            if isinstance(aggregator, SealingScheme):
                coordinator.install(aggregator.scheme, None, aggregator.receiver())
                view.scheme = aggregator.scheme
                view.set_up_keys()
            imputer = reconstruction_imputer(
                config.method, None, config.impute_config, seed=config.seed, federation=view
            )
        except ProtocolError as error:  # FedAvg drops a client lost later; not one lost here
            # What failed may be another party's refusal of it (its key could not reach the
            # lost one): a probe says who is gone, as FedAvg's recovery does.
            lost = channel.unreachable([*view.roster, AGGREGATOR])
            if not lost:  # a protocol error, or a party late but there: as it is
                raise
            raise TransportError(
                f"{', '.join(lost)} lost before FedAvg's first round, while the federation set "
                "up its secure sums or computed the clients' statistics, which need every "
                "party: start it again and rerun (a client lost in a later round is dropped "
                f"and FedAvg goes on). {error}",
                lost[0] if len(lost) == 1 else None,
            ) from error
        _check_observed(features, imputer.counts if plan is None else None)
        # The yardstick: the statistics of the training rows the method collected. Without DP
        # they are exact, as the in-process evaluator computes them; under DP they are the
        # released ones (nothing exact about the clients' rows leaves them).
        yardstick = imputer.standardisation
        if on_start is not None:
            on_start(config.impute_config.rounds)
        curve, scores = fit_and_score(
            imputer,
            lambda: scores_of(
                imputer.score(yardstick, seed=config.seed, fraction=TEST_FRACTION),
                features=features,
                std=yardstick.std,
            ),
            rounds=config.impute_config.rounds,
            on_round=on_round,
        )
        rows = {member.name: schemas[member.name][1] for member in clients}
        result = ImputeResult(
            method=config.method,
            dataset=config.data_name,
            config={
                **config.to_json(),
                "clients": len(clients),
                "availability": sum(len(c) for c, _ in schemas.values())
                / (len(features) * len(clients)),
            },
            **scores,
            validation_curve=list(curve),
            wall_time_s=time.perf_counter() - start,
            clients={
                member.name: {
                    "train_rows": rows[member.name] - round(TEST_FRACTION * rows[member.name]),
                    "test_rows": round(TEST_FRACTION * rows[member.name]),
                    "available_features": len(schemas[member.name][0]),
                }
                for member in clients
            },
            aggregator=type(aggregator).__name__,
            traffic=traffic_report(
                aggregator, train_steps=config.impute_config.rounds, channel=channel
            ),
            faults=list(view.faults),
        )
        live = [m for m in clients if m.name in view.names]
        if save_imputed:
            saved = _save_each(endpoint, live)
        lost = [n for n in view.roster if n not in view.names]
        model = _save_models(endpoint, channel, live, lost=lost, gone=gone)
        outcome = "finished"
    finally:
        lost = [n for n in view.roster if n not in view.names] if view is not None else []
        reports, entries = _end(endpoint, federation, outcome, lost=[*lost, *gone], late=late)
        endpoint.close()
    result = dataclasses.replace(result, traffic=_with_reports(result.traffic, reports))
    if plan is not None:
        assert privacy is not None
        privacy.take_statistics_reports(entries)
        result = dataclasses.replace(result, privacy=privacy.report())
    return result, {"imputed": saved, "model": model}


def _readmission(
    endpoint: Any, bodies: Mapping[str, Mapping[str, Any]], *, deadline: float
) -> Callable[[str], int]:
    """How the coordinator sets a lost client that answers again up anew (a new ``party
    serve`` process of the same name, certificate and address, started by its operator): the
    ``impute-setup`` it had at the start of the run, from which it builds itself as it did then
    (its rows, split, initial model and secure-sum halves). ProtocolError if it refuses."""

    def readmit(client: str) -> int:
        message = _deployment(endpoint.name, client, "impute-setup", dict(bodies[client]))
        endpoint.send(message, deadline=max(deadline, SETUP_DEADLINE))
        return 0  # no checkpoint: it starts from the global model it is sent

    return readmit


def _save_each(endpoint: Any, clients: Sequence[Member]) -> dict[str, Any]:
    """Have every client write its imputed table in its own process, under one run id."""
    run = secrets.token_hex(8)
    tables = {}
    endpoint.handler = None  # the answers are the label party's, no longer the coordinator's
    for member in clients:
        endpoint.send(_deployment(endpoint.name, member.name, "impute-save", {"run": run}))
        body = _body(
            endpoint.receive(sender=member.name, kind="deployment"),
            "impute-saved",
            IMPUTE_SAVED_KEYS,
        )
        if body["run"] != run:
            raise ProtocolError(
                f"impute-saved from {member.name}: run {run} expected, found {body['run'][:40]!r}."
            )
        tables[member.name] = {"rows": body["rows"], "sha256": body["sha256"]}
    return {"run": run, "tables": tables}


def _save_models(
    endpoint: Any,
    channel: NetworkChannel,
    clients: Sequence[Member],
    *,
    lost: Sequence[str],
    gone: list[str],
) -> dict[str, Any]:
    """Have every client save its own imputer in its own process, under one model run id
    (``save``, answered by ``saved`` with its manifest's SHA-256): each fills new rows of its
    own there with ``secure-vfl fill``; nothing of a model leaves its process. A client lost in
    the rounds saves none. A client that could not save (its model directory refused the
    write; its process died meanwhile: added to ``gone``) is listed ``unsaved`` with why, and
    the run keeps its result: the others' imputers and every score stand."""
    run = new_run_id()
    endpoint.handler = None  # the answers are the label party's, no longer the coordinator's
    kept: dict[str, Any] = {}
    for member in clients:
        try:
            kept[member.name] = {
                "location": KEPT_BY_PARTY,
                "files": _ask_save(endpoint, member.name, run),
            }
        except ProtocolError as error:
            gone.extend(channel.unreachable([member.name]))
            logger.warning("%s saved no imputer: %s", member.name, error)
            kept[member.name] = {"location": UNSAVED, "files": {}, "why": str(error)}
    kept.update({name: {"location": LOST, "files": {}} for name in lost})
    return {"run_id": run, "clients": kept}


UNSAVED = "unsaved"
"""A client that took part to the end but could not save its imputer (``result.json``)."""


def _check_observed(features: Sequence[str], counts: np.ndarray | None) -> None:
    """Refuse a feature column that some client has but no client has a value of in its
    training rows (``counts``: the exact counts of the statistics; None under DP, where they
    are noisy), as one process refuses it when it reads the files: it would be imputed from
    nothing."""
    if counts is None:
        return
    unobserved = [
        repr(feature) for feature, count in zip(features, counts, strict=True) if count == 0
    ]
    if unobserved:
        raise DataError(
            "every feature column needs a value in some client's training rows, to impute it "
            f"from; found none of {', '.join(unobserved)}: drop the column or add its values."
        )


def _columns(
    endpoint: Any, clients: Sequence[Member], config: ImputeRunConfig
) -> Mapping[str, tuple[list[str], int]]:
    """Each client's feature columns and row count (its ``columns`` answer), in order.
    ConfigError if a label column named otherwise than ``label`` is in no client's file (each
    client would impute its own label column as a feature), as an in-process run refuses."""
    request = {"id_column": config.id_column, "label_column": config.label_column}
    schemas: dict[str, tuple[list[str], int]] = {}
    labelled = []
    for member in clients:
        endpoint.send(_deployment(endpoint.name, member.name, "columns-request", request))
        body = _body(
            endpoint.receive(sender=member.name, kind="deployment"), "columns", COLUMNS_KEYS
        )
        if not all(isinstance(c, str) for c in body["columns"]) or body["rows"] < 1:
            raise ProtocolError(
                f"columns from {member.name}: column names and a row count >= 1 expected."
            )
        schemas[member.name] = (body["columns"], body["rows"])
        labelled += [member.name] if body["label"] else []
    if config.label_column != LABEL_COLUMN and not labelled:
        raise ConfigError(
            f"a label column `{config.label_column}` (--label-column) must be in at least one "
            f"client file. Found it in none of {', '.join(schemas)}'s (their feature columns: "
            + "; ".join(f"{name} {columns}" for name, (columns, _) in schemas.items())
            + ")."
        )
    return schemas
