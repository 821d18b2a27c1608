"""One run from a configuration to a result: data, parties, training or imputation, evaluation."""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import pandas as pd
import torch

from secure_vfl import checks, methods
from secure_vfl.checkpoints import CheckpointPlan, RunCheckpoints
from secure_vfl.data.datasets import load_dataset
from secure_vfl.data.imputation import (
    ClientData,
    ImputationTask,
    load_imputation_dataset,
    make_imputation_task,
    make_task_from_client_files,
)
from secure_vfl.data.missingness import parse_mechanism
from secure_vfl.data.party_files import ID_COLUMN, LABEL_COLUMN, party_names
from secure_vfl.data.party_preprocessing import DEFAULT_MISSING_POLICY, MISSING_POLICIES
from secure_vfl.data.samplers import BatchSampler
from secure_vfl.data.vertical import (
    VerticalData,
    column_report,
    make_vertical,
    vertical_from_party_files,
)
from secure_vfl.errors import ConfigError, DataError, DivergenceError, NonFiniteError
from secure_vfl.federation.aggregator import PlainAggregator, SealingScheme, SumBackend
from secure_vfl.federation.alignment import Aligner, make_aligner
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parties import DataParty
from secure_vfl.methods.base import StepCallback, in_process_parties
from secure_vfl.methods.baselines import ConcatFusionMethod
from secure_vfl.methods.false_vfl import FalseVflConfig, FalseVflMethod
from secure_vfl.methods.imputation import (
    IMPUTERS,
    ImputeConfig,
    Imputer,
    StatisticsPrivacyFactory,
    federated_statistics,
)
from secure_vfl.methods.imputation.evaluation import check_scorable
from secure_vfl.methods.imputation.evaluation import evaluate as evaluate_imputer
from secure_vfl.methods.imputation.fedhf import RECONSTRUCTIONS
from secure_vfl.methods.imputation.statistics import FeatureScaleError
from secure_vfl.metrics import accuracy, f1
from secure_vfl.runs import party_named, provenance

DEFAULT_PARTIES = 4  # how many parties a registered dataset is split among unless told


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run; validated on construction, but for the dataset's
    name, which loading the data checks (a run given its data, ``run_training(config,
    data=...)``, may name data no registry holds). Under standard, plugvfl and FALSE-VFL only
    the label party holds a head: their ``method_config.heads`` is set to ``"active"``.

    With party files, the test rows are the ids of ``test_file`` (a label file of held-out ids,
    their features in the same party files), or a stratified ``test_fraction`` of the label
    file's rows (default 0.2); a registered dataset keeps its own split.

    ``aligned_labeled`` training samples of a registered dataset stay observed by every party
    (the training missingness renders only the others missing) and are labelled first: the
    FALSE-VFL paper's reserve of fully aligned labelled samples (its section 5: 100 tabular,
    200 image), which Standard VFL, training only on complete labelled samples, relies on.
    """

    method: str
    dataset: str | None = None
    party_files: tuple[Path, ...] = ()
    label_file: Path | None = None
    test_file: Path | None = None
    test_fraction: float | None = None
    parties: int = DEFAULT_PARTIES  # with party files: the number of files
    train_missing: str = "mcar:0"
    test_missing: tuple[str, ...] = ("mcar:0",)
    align: str = "join"
    seed: int = 0
    method_config: methods.MethodConfig = field(default_factory=methods.MethodConfig)
    false_vfl: FalseVflConfig | None = None
    id_column: str = ID_COLUMN
    label_column: str = LABEL_COLUMN
    missing_cells: str = DEFAULT_MISSING_POLICY
    party_names: tuple[str, ...] = ()
    aligned_labeled: int = 0

    def __post_init__(self) -> None:
        self._check_types()
        self._check_own_file_options()
        if self.false_vfl is not None and not self.method.startswith("false-vfl"):
            raise ConfigError(
                f"`false_vfl` options apply to false-vfl-1 and false-vfl-2. "
                f"Found method {self.method!r}."
            )
        if self.method not in methods.METHODS:
            raise ConfigError(
                f"`method` must be one of {', '.join(methods.METHODS.names())}. "
                f"Found {self.method!r}."
            )
        if self.method in methods.ONE_HEAD_METHODS and self.method_config.heads != "active":
            # what is true of the run, and what its result and saved model record
            heads = replace(self.method_config, heads="active")
            checks.store(self, {"method_config": heads})
        own_files = bool(self.party_files) or self.label_file is not None
        if (self.dataset is None) == (not own_files):
            raise ConfigError(
                "give either a dataset name or party files with a label file, not both. "
                f"Found dataset={self.dataset!r}, {len(self.party_files)} party files."
            )
        if own_files and (self.label_file is None or len(self.party_files) < 2):
            raise ConfigError(
                "own data needs at least 2 party files and one label file. Found "
                f"{len(self.party_files)} party files and label file {self.label_file}."
            )
        self._check_test_rows()
        if self.dataset is not None and not 2 <= self.parties <= 10:
            raise ConfigError(f"`parties` must be in [2, 10]. Found {self.parties}.")
        if not self.test_missing:
            raise ConfigError("at least one test missingness is needed. Found none.")
        if len(set(self.test_missing)) != len(self.test_missing):
            repeated = sorted({t for t in self.test_missing if self.test_missing.count(t) > 1})
            raise ConfigError(f"each test missingness once expected. Found {repeated} repeated.")
        parties = self.parties if self.dataset is not None else len(self.party_files)
        for field_name, texts in (
            ("train_missing", (self.train_missing,)),
            ("test_missing", self.test_missing),
        ):
            for text in texts:
                try:
                    mechanism = parse_mechanism(text)
                except ConfigError as error:  # say which field: it names only the parameter
                    raise ConfigError(f"`{field_name}` {text!r}: {error}") from None
                rates = len(mechanism.params)
                if mechanism.name == "mcar" and rates > 1 and rates != parties:
                    raise ConfigError(
                        f"`{field_name}` {text!r}: one MCAR rate, or one per party ({parties}), "
                        f"expected. Found {rates} rates."
                    )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"`seed` must be a non-negative integer. Found {self.seed!r}.")
        if self.align != "join" and self.dataset is not None:
            raise ConfigError(
                f"`align` applies to party files (a registered dataset is aligned already). "
                f"Found align={self.align!r} with dataset {self.dataset!r}."
            )
        make_aligner(self.align)  # refuses an unknown name before anything runs
        self._check_aligned_labeled()

    def _check_types(self) -> None:
        """Each field of its type (ConfigError naming it), numbers and paths stored as Python's
        own ints and :class:`~pathlib.Path` (a config writes as JSON)."""
        checks.text("method", self.method)
        if self.dataset is not None:
            checks.text("dataset", self.dataset)
        files = checks.paths("party_files", self.party_files)
        parties = checks.integer("parties", self.parties)
        values: dict[str, object] = {
            "party_files": files,
            "parties": parties,
            "seed": checks.seed("seed", self.seed),
            "test_missing": checks.texts("test_missing", self.test_missing),
            "party_names": checks.texts("party_names", self.party_names),
            "aligned_labeled": checks.integer("aligned_labeled", self.aligned_labeled, low=0),
        }
        if files and parties != len(files):  # one party per file: the default means theirs
            if parties != DEFAULT_PARTIES:
                raise ConfigError(
                    f"`parties` {parties} contradicts the {len(files)} party files (one party "
                    f"per file); expected {len(files)} or the default."
                )
            values["parties"] = len(files)
        for name in ("label_file", "test_file"):
            if getattr(self, name) is not None:
                values[name] = checks.path(name, getattr(self, name))
        if self.test_fraction is not None:
            values["test_fraction"] = checks.real(
                "test_fraction", self.test_fraction, low=0, high=1, low_open=True, high_open=True
            )
        for name in ("train_missing", "align", "id_column", "label_column", "missing_cells"):
            checks.text(name, getattr(self, name))
        checks.instance("method_config", self.method_config, methods.MethodConfig)
        if self.false_vfl is not None:
            checks.instance("false_vfl", self.false_vfl, FalseVflConfig)
        checks.store(self, values)

    def _check_own_file_options(self) -> None:
        """Column names, the missing-cell policy and party names: valid, and only with party
        files where they differ from the defaults."""
        if self.dataset is not None:
            given = [
                f"`{name}`"
                for name, value, default in (
                    ("id_column", self.id_column, ID_COLUMN),
                    ("label_column", self.label_column, LABEL_COLUMN),
                    ("missing_cells", self.missing_cells, DEFAULT_MISSING_POLICY),
                    ("party_names", self.party_names, ()),
                )
                if value != default
            ]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to party "
                    f"files (a registered dataset has its own columns). Found dataset "
                    f"{self.dataset!r}."
                )
        if self.missing_cells not in MISSING_POLICIES:
            raise ConfigError(
                f"`missing_cells` must be one of {', '.join(MISSING_POLICIES)}. Found "
                f"{self.missing_cells!r}."
            )
        for name, value in (("id_column", self.id_column), ("label_column", self.label_column)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"`{name}` must be a column name. Found {value!r}.")
        if self.id_column == self.label_column:
            raise ConfigError(
                f"the id and label columns must differ. Found both {self.id_column!r}."
            )
        if self.party_names:
            party_names(self.party_files, self.party_names)

    def _check_aligned_labeled(self) -> None:
        if not self.aligned_labeled:
            return
        if self.dataset is None:
            raise ConfigError(
                "`aligned_labeled` keeps samples of a registered dataset out of its simulated "
                "training missingness; the missingness of party files is what the files hold. "
                f"Found party files with aligned_labeled={self.aligned_labeled}."
            )
        labeled = self.method_config.labeled
        if labeled is not None and labeled < self.aligned_labeled:
            raise ConfigError(
                f"the {self.aligned_labeled} samples kept aligned are labelled ones: expected "
                f"`labeled` of at least {self.aligned_labeled}, found {labeled}."
            )

    def _check_test_rows(self) -> None:
        given = [
            name
            for name, value in (
                ("test_file", self.test_file),
                ("test_fraction", self.test_fraction),
            )
            if value is not None
        ]
        if given and self.dataset is not None:
            raise ConfigError(
                f"{' and '.join(f'`{g}`' for g in given)} "
                f"{'applies' if len(given) == 1 else 'apply'} to party files (a registered "
                f"dataset keeps its own split). Found dataset {self.dataset!r}."
            )
        if len(given) == 2:
            raise ConfigError(
                "give either held-out ids (`test_file`) or a `test_fraction`, not both. Found "
                f"{self.test_file} and {self.test_fraction}."
            )

    @property
    def data_name(self) -> str:
        return self.dataset if self.dataset is not None else "own-files"

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["party_files"] = [str(p) for p in self.party_files]
        payload["label_file"] = str(self.label_file) if self.label_file else None
        payload["test_file"] = str(self.test_file) if self.test_file else None
        payload["test_missing"] = list(self.test_missing)
        payload["party_names"] = list(self.party_names)
        return payload


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What a run produced: metrics per test missingness, the loss curve and the cost."""

    method: str
    dataset: str
    config: dict[str, Any]
    metrics: dict[str, dict[str, float]]
    epoch_loss: list[float]
    wall_time_s: float
    samples: dict[str, int]
    dropped: dict[str, int]
    privacy: dict[str, Any] | None = None
    traffic: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    """Every data party lost during training (a deployment): its name, the step and epoch
    (from 1) from which its block was missing, and the error that revealed it."""
    parties: dict[str, str] = field(default_factory=dict)
    """Each party's actor name (``party-k`` in one process) -> the users' name for it (its
    party file's stem or ``--party-name``; the same name for a registered dataset's parties
    and for a deployment's, whose actors carry the federation file's names)."""
    alignment: dict[str, Any] | None = None
    """Party files' alignment report (None for a registered dataset)."""
    columns: dict[str, dict[str, Any]] | None = None
    """Each party's columns as its preprocessing turned them into model inputs, by the users'
    party names (party files only)."""
    left_out_columns: list[str] = field(default_factory=list)
    """A dataset's columns that no party's block holds."""
    classes: dict[str, Any] | None = None
    """Each label index -> the label file's value it stands for (None for a registered
    dataset, whose labels are the indices)."""
    provenance: dict[str, Any] | None = None
    """The package version and git commit that ran (:func:`secure_vfl.runs.provenance`)."""
    trained_on: int | None = None
    """How many of the training samples Standard VFL trained on: the labelled ones every party
    holds (``samples["train"]`` counts the whole split); None for the other methods."""

    def to_json(self, *, named: bool = True) -> dict[str, Any]:
        """``result.json``'s fields; ``columns``, ``left_out_columns``, ``classes`` and
        ``trained_on`` only where the run has them. ``named``: the per-party figures (privacy,
        traffic) and the texts (warnings, guarantees) in the users' party names
        (``parties``); else in the actors', without ``parties`` (for a record that is named as
        a whole later, as an attack's is)."""
        payload = asdict(self)
        if named:
            for key in ("privacy", "traffic", "warnings"):
                payload[key] = party_named(payload[key], self.parties)
        else:
            del payload["parties"]
        for key in ("columns", "left_out_columns", "classes"):
            if not payload[key]:
                del payload[key]
        if payload["trained_on"] is None:
            del payload["trained_on"]
        return payload


def _about_data(data: VerticalData) -> dict[str, Any]:
    """What a result says of its data beyond the figures (:class:`TrainResult`'s fields from
    ``parties`` to ``classes``)."""
    actors = [f"party-{k}" for k in range(data.parties)]
    names = list(data.party_names or actors)
    about: dict[str, Any] = {
        "parties": dict(zip(actors, names, strict=True)),
        "alignment": data.alignment,
        "left_out_columns": list(data.left_out_columns),
    }
    if data.party_names is not None and data.preprocessing is not None:
        about["columns"] = column_report(names, data.preprocessing)
    if data.classes is not None:  # the label file's values (a registered dataset has indices)
        about["classes"] = {
            str(index): value.item() if hasattr(value, "item") else value
            for index, value in enumerate(data.classes)
        }
    return about


@functools.cache
def load_optimiser_machinery() -> None:
    """Make, and drop, one torch optimiser. The first that a process makes imports torch's
    compiler stack (``torch._dynamo``: about a second on a small machine), which a run's
    ``wall_time_s`` would otherwise count as training, and only in a process's first run.
    Called before a run's clock starts."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


def prepare_data(config: TrainConfig, *, aligner: Aligner | None = None) -> VerticalData:
    """The vertical data of a run: a registered dataset partitioned, or the user's own files
    aligned by ``aligner`` (by default the one registered as ``config.align``)."""
    checks.instance("config", config, TrainConfig)
    rng = np.random.default_rng(config.seed)
    train_missing = parse_mechanism(config.train_missing)
    test_missing = [parse_mechanism(text) for text in config.test_missing]
    if config.dataset is not None:
        split = load_dataset(config.dataset, rng=rng)
        return make_vertical(
            split,
            parties=config.parties,
            train_missing=train_missing,
            test_missing=test_missing,
            rng=rng,
            aligned=config.aligned_labeled,
            aligned_rng=aligned_generator(config.seed),
        )
    assert config.label_file is not None
    return vertical_from_party_files(
        config.party_files,
        config.label_file,
        aligner=aligner if aligner is not None else make_aligner(config.align),
        train_missing=train_missing,
        test_missing=test_missing,
        test_fraction=config.test_fraction if config.test_fraction is not None else 0.2,
        test_file=config.test_file,
        rng=rng,
        id_column=config.id_column,
        label_column=config.label_column,
        missing_cells=config.missing_cells,
        party_names=config.party_names or None,
        cross_party_counts=config.align == "join",
    )


def aligned_generator(seed: int) -> np.random.Generator:
    """The generator that draws a run's reserve of aligned samples (``aligned_labeled``): a
    stream of its own, so that the masks and splits are those of the run without one."""
    return np.random.default_rng([seed, 1])


def check_data(config: TrainConfig, data: VerticalData) -> None:
    """ConfigError unless ``data``, given to a run of ``config``, is the data ``config``
    describes, as far as it shows: the number of parties, the test splits, among which
    ``data`` may hold more (an auditor's probes), and the dataset where ``data`` is a registered
    one's, since the run's result records ``config`` and scores every split of ``data``.
    (Another name, and the training missingness, are not compared: tests and benchmarks train
    a config on data of the same shape made for them.)"""
    from secure_vfl.data.datasets import DATASETS

    parties = config.parties if config.dataset is not None else len(config.party_files)
    tests = [parse_mechanism(text).label for text in config.test_missing]
    aligned = 0 if data.aligned_rows is None else data.aligned_rows.size
    registered = config.dataset is not None and data.name in DATASETS.names()
    wrong = [
        f"{what} {expected} expected, found {found}"
        for what, expected, found, agree in (
            ("dataset", config.dataset, data.name, not registered or data.name == config.dataset),
            ("parties", parties, data.parties, parties == data.parties),
            ("test splits", tests, list(data.tests), set(tests) <= set(data.tests)),
            (
                "aligned labelled samples",
                config.aligned_labeled,
                aligned,
                config.aligned_labeled == aligned,
            ),
        )
        if not agree
    ]
    if wrong:
        raise ConfigError(
            f"the data given to the run is not the data of its config: {'; '.join(wrong)}."
        )


def build_method(
    config: TrainConfig,
    data: VerticalData,
    *,
    channel: Channel | None = None,
    aggregator: SumBackend | None = None,
    roles: Mapping[str, str] | None = None,
) -> methods.Method:
    """The configured method, built on ``data``, its parties talking through ``channel`` and
    summing through ``aggregator`` (plain by default); ``roles`` replaces parties by registered
    roles (see :func:`~secure_vfl.methods.base.build_federation`)."""
    return make_method(
        config.method,
        data,
        config.method_config,
        seed=config.seed,
        false_vfl=config.false_vfl,
        channel=channel,
        aggregator=aggregator,
        roles=roles,
    )


def make_method(
    name: str,
    data: VerticalData,
    method_config: methods.MethodConfig,
    *,
    seed: int,
    false_vfl: FalseVflConfig | None = None,
    channel: Channel | None = None,
    aggregator: SumBackend | None = None,
    roles: Mapping[str, str] | None = None,
) -> methods.Method:
    """The method registered as ``name`` (``false_vfl``: FALSE-VFL's options) on ``data``."""
    if name.startswith("false-vfl"):
        return FalseVflMethod(
            data,
            method_config,
            seed=seed,
            variant=1 if name == "false-vfl-1" else 2,
            name=name,
            channel=channel,
            aggregator=aggregator,
            false_vfl=false_vfl,
            roles=roles,
        )
    factory = methods.METHODS.get(name)
    return factory(
        data, method_config, seed=seed, channel=channel, aggregator=aggregator, roles=roles
    )


def traffic_report(
    aggregator: SumBackend, *, train_steps: int, channel: Channel | None = None
) -> dict[str, Any]:
    """Bytes each party (and the aggregator) put on the wire, per phase and per training step
    (a FedAvg round for imputation), and the seconds spent in protection (secure sums, the
    parties' hooks such as DP noise, and the channel's layers). ``train_steps``: the steps
    whose bytes ``channel`` counts (a resumed run's: those after its checkpoint).

    Bytes are the encoded messages that crossed ``channel``'s transport: under a secure scheme
    split at the party boundary (every method: each half runs inside its own party) they are the
    sealed shares and sums themselves.
    """
    secure = not isinstance(aggregator, PlainAggregator)
    sent: Counter[tuple[str, str]] = Counter()
    parties = list(channel.parties.values()) if channel is not None else []
    if channel is not None:
        for (sender, _, phase), count in channel.transport.bytes.items():
            sent[(sender, phase)] += count
    totals: dict[str, dict[str, int]] = {}
    for (endpoint, phase), count in sent.items():
        totals.setdefault(endpoint, {"train": 0, "predict": 0})[phase] += count
    layers = dict(channel.layer_seconds) if channel is not None else {}
    halves = sum(
        half.seconds
        for party in parties
        for half in (getattr(party, name, None) for name in ("sealer", "opener", "adder"))
        if half is not None
    )
    hooks = sum(party.hook_seconds for party in parties)
    whole = 0.0 if isinstance(aggregator, SealingScheme) else aggregator.cost.seconds
    aggregation = whole + halves
    return {
        "aggregator": type(aggregator).__name__,
        "train_steps": train_steps,
        "bytes": dict(sorted(totals.items())),
        "bytes_per_step": {
            endpoint: per_phase["train"] / max(train_steps, 1)
            for endpoint, per_phase in sorted(totals.items())
        },
        "aggregation_s": aggregation,
        "channel_layers_s": layers,
        "party_hooks_s": hooks,
        "protection_s": (aggregation if secure else 0.0) + hooks + sum(layers.values()),
    }


def evaluate(method: methods.Method, data: VerticalData) -> dict[str, dict[str, float]]:
    """Accuracy and F1 (both x100) on every test split."""
    return score(predict_tests(method, data), data)


def predict_tests(method: methods.Method, data: VerticalData) -> dict[str, np.ndarray]:
    """Every test split's predictions ((N, K), -1 where a party is absent), by split name."""
    return {name: method.predict(name) for name in data.tests}


def score(predictions: Mapping[str, np.ndarray], data: VerticalData) -> dict[str, dict[str, float]]:
    """Accuracy and F1 (both x100) of ``predictions`` on their test splits."""
    return {
        name: {
            "accuracy": accuracy(predicted, data.tests[name].labels),
            "f1": f1(predicted, data.tests[name].labels, data.num_classes),
        }
        for name, predicted in predictions.items()
    }


def collapse_warnings(
    predictions: Mapping[str, np.ndarray], data: VerticalData, *, noised: bool = False
) -> list[str]:
    """A warning for every test split on which the model predicts one class only while its
    labels hold several: a model that learned nothing but a constant (too few epochs, too
    high a learning rate, too much DP noise where the run was ``noised``), whose accuracy is
    the class's share."""
    warnings = []
    classes = data.classes if data.classes is not None else tuple(range(data.num_classes))
    for name, predicted in predictions.items():
        made = np.unique(predicted[predicted >= 0])
        present = np.unique(data.tests[name].labels)
        if made.size == 1 and present.size > 1:
            warnings.append(
                f"predictions on test split {name!r} collapsed to one class (label "
                f"{classes[int(made[0])]!r} for every sample, {present.size} classes in the "
                f"labels); expected more --epochs{',' if noised else ' or'} another --lr"
                f"{' or less DP noise' if noised else ''}."
            )
    return warnings


def target_warnings(privacy: Mapping[str, Any] | None) -> list[str]:
    """A warning when a run's privacy report (``result.json``'s ``privacy``) says its target
    epsilon was exceeded (``within_target`` false), naming the parties and their epsilons."""
    if privacy is None or privacy.get("within_target") is not False:
        return []
    target = privacy["target_epsilon"]
    over = ", ".join(
        f"{party} {epsilon:.2f}"
        for party, epsilon in sorted(privacy["epsilon"].items())
        if epsilon > target
    )
    return [
        f"the target epsilon {target:g} was exceeded: {over} (each party's guarantees in "
        "result.json's privacy; e.g. a resumed run prices the killed run's releases after its "
        "last checkpoint again, which the calibration did not plan)."
    ]


@runtime_checkable
class PrivacyLayer(Protocol):
    """What a training run needs of its privacy entry object (``protocols.privacy.
    PrivacyEngine``; :class:`ImputationPrivacyLayer` for imputation): the core names this
    interface and never imports the privacy layer."""

    def refuse(self, config: TrainConfig) -> None:
        """Raise ConfigError if the run ``config`` disagrees with the chosen protection (its
        alignment, its secure sums) or its method cannot host the chosen mechanisms."""
        ...

    def aggregator(self) -> SumBackend | None:
        """The secure-sum backend (None: plain sums)."""
        ...

    def sampler(self, sampler: BatchSampler, *, n: int, epochs: int) -> BatchSampler:
        """The sampler the run trains with, given the method's own over a training set of ``n``
        rows (a DP run's Poisson sampler; ``sampler`` itself without DP)."""
        ...

    def make_private(
        self,
        parties: list[DataParty],
        *,
        method: str,
        method_config: methods.MethodConfig,
        predictions: int,
        resumed_at: int = 0,
    ) -> None:
        """Install each mechanism inside the party it protects, with that party's accountant
        (``predictions``: the test splits the run predicts, whose releases a target epsilon
        covers too; ``resumed_at``: the step a resumed run goes on from)."""
        ...

    def report(self) -> dict[str, Any] | None:
        """``result.json``'s privacy entry (None when no DP mechanism ran)."""
        ...

    def settings(self) -> dict[str, Any]:
        """The protection chosen, as JSON: ``result.json``'s ``config.privacy``."""
        ...

    def divergence_advice(self) -> str:
        """What to try when training under this protection diverged (non-finite values)."""
        ...


DIVERGENCE_ADVICE = (
    "try a lower --lr, fewer --epochs, or --max-update-norm NORM to clip each update"
)
"""What to try when a run without DP noise diverged."""
IMPUTATION_ADVICE = "try a lower --lr or fewer --local-epochs"
"""What to try when an imputation diverged."""


def refuse_empty_splits(data: VerticalData) -> None:
    """DataError, before any training, for a training split that holds no sample, or samples
    of one class only (the others lost all their blocks to the training missingness: the run
    trained on nothing, every epoch's loss null, or a constant, and printed the model's
    accuracy), or a test split that holds none (every one lost all its blocks to the test
    missingness, or none was set aside): its metrics would be NaN (printed, with numpy's
    warnings, and the run exited 0)."""
    classes = np.unique(data.train.labels)
    if classes.size < 2:
        dropped = data.dropped.get("train", 0)
        held = (
            "no sample"
            if data.train.n == 0
            else f"{data.train.n} sample(s), all of one class "
            f"({(data.classes or tuple(range(data.num_classes)))[int(classes[0])]!r})"
        )
        raise DataError(
            f"the training split holds {held} ({dropped} dropped for having no observed "
            "block); expected a training missingness that leaves samples of at least 2 "
            "classes (--missing-train, --p-miss-train)."
        )
    for name, split in data.tests.items():
        if split.n == 0:
            dropped = data.dropped.get(name, 0)
            why = (
                f"{dropped} dropped for having no observed block"
                if dropped
                else f"no row was set aside for testing, of {data.train.n} aligned"
            )
            raise DataError(
                f"test split {name!r} holds no sample ({why}); expected a test missingness "
                "that leaves some (--missing-test, --p-miss-test) or more test rows "
                "(--test-fraction, --test-file)."
            )


_ENGINE_HINT = " (protocols.privacy.PrivacyEngine(spec), not the spec itself)"


def run_training(
    config: TrainConfig,
    *,
    data: VerticalData | None = None,
    channel: Channel | None = None,
    aggregator: SumBackend | None = None,
    privacy: PrivacyLayer | None = None,
    roles: Mapping[str, str] | None = None,
    on_ready: Callable[[Channel], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    on_step: StepCallback | None = None,
    checkpoints: CheckpointPlan | None = None,
) -> TrainResult:
    """Train ``config.method`` and evaluate it on every test missingness.

    The composition root adds protection without the core knowing it: ``privacy`` (a
    :class:`PrivacyLayer`, e.g. ``protocols.privacy.PrivacyEngine``) chooses the secure-sum
    backend and installs its mechanisms inside each party once the parties exist, and its
    report fills ``result.privacy``; ``aggregator`` overrides the backend (plain by default);
    ``channel`` carries the parties' messages; ``roles`` replaces parties by registered roles
    (attackers, defenders); ``on_ready(channel)`` is called once the parties exist and are
    protected, before training (an auditor grants an attacker its side knowledge there);
    ``on_start(total_steps)`` is called once before training.
    ``result.traffic`` counts the bytes that crossed ``channel``'s transport.
    ``checkpoints`` (:class:`~secure_vfl.checkpoints.CheckpointPlan`) has every party write its
    own checkpoint at step boundaries, and/or resumes a killed run: the label party's run
    position and sampler are restored before the privacy layer calibrates to the schedule, each
    party's own state once its mechanisms are installed.
    """
    checks.instance("config", config, TrainConfig)
    if data is not None:
        checks.instance("data", data, VerticalData, " (prepare_data(config))")
    if privacy is not None:
        checks.instance("privacy", privacy, PrivacyLayer, _ENGINE_HINT)
        privacy.refuse(config)
    if data is None:
        data = prepare_data(config)
    else:
        check_data(config, data)
    refuse_empty_splits(data)
    channel = channel if channel is not None else Channel()
    if aggregator is None and privacy is not None:
        aggregator = privacy.aggregator()
    aggregator = aggregator if aggregator is not None else PlainAggregator()
    load_optimiser_machinery()
    start = time.perf_counter()
    method = build_method(config, data, channel=channel, aggregator=aggregator, roles=roles)
    if privacy is not None:
        method.sampler = privacy.sampler(
            method.sampler,
            n=data.train.n,
            epochs=config.method_config.epochs,
        )
    run_checkpoints = RunCheckpoints(checkpoints) if checkpoints is not None else None
    progress = run_checkpoints.restore_run(method) if run_checkpoints is not None else None
    resumed_at = progress.step if progress is not None else 0  # fit moves progress on
    if privacy is not None:
        privacy.make_private(
            in_process_parties(channel),
            method=config.method,
            method_config=config.method_config,
            predictions=len(data.tests),  # each test record is released once per split
            resumed_at=resumed_at,
        )
    steps = method.total_steps
    step_done = on_step
    if run_checkpoints is not None and progress is not None:
        run_checkpoints.start_parties(in_process_parties(channel))
        step_done = run_checkpoints.hook(
            step_done, method=method, parties=in_process_parties(channel), progress=progress
        )
    if on_ready is not None:
        on_ready(channel)
    if on_start is not None:
        on_start(steps)
    try:  # the last steps may leave a model non-finite: its first use after training shows it
        losses = method.fit(on_step=step_done, progress=progress)
        for party in channel.parties.values():
            party.after_training()
        predictions = predict_tests(method, data)
    except NonFiniteError as error:  # a party's values ran off to NaN or infinity
        advice = privacy.divergence_advice() if privacy is not None else DIVERGENCE_ADVICE
        raise DivergenceError(
            f"training diverged: {str(error).rstrip('.')}; {advice}.", step=error.step
        ) from None
    report = privacy.report() if privacy is not None else None
    return TrainResult(
        method=config.method,
        dataset=config.data_name,
        config={
            **config.to_json(),
            "privacy": privacy.settings() if privacy is not None else None,
        },
        metrics=score(predictions, data),
        epoch_loss=losses,
        wall_time_s=time.perf_counter() - start,
        samples={"train": data.train.n, **{name: s.n for name, s in data.tests.items()}},
        dropped=dict(data.dropped),
        privacy=report,
        traffic=traffic_report(aggregator, train_steps=steps - resumed_at, channel=channel),
        warnings=[
            *collapse_warnings(predictions, data, noised=report is not None),  # DP ran
            *target_warnings(report),
        ],
        faults=list(method.fed.faults),
        **_about_data(data),
        provenance=provenance(),
        trained_on=(
            int(method.train_rows.size)
            if isinstance(method, ConcatFusionMethod) and method.name == "standard"
            else None
        ),
    )


@dataclass(frozen=True, kw_only=True)
class ImputeRunConfig:
    """Everything that defines an imputation run; validated on construction."""

    method: str
    dataset: str | None = None
    client_files: tuple[Path, ...] = ()
    clients: int = 4
    availability: float = 0.6
    seed: int = 0
    impute_config: ImputeConfig = field(default_factory=ImputeConfig)
    id_column: str = ID_COLUMN
    label_column: str = LABEL_COLUMN

    def __post_init__(self) -> None:
        checks.text("method", self.method)
        if self.dataset is not None:
            checks.text("dataset", self.dataset)
        files = checks.paths("client_files", self.client_files)
        if len(files) == 1:  # before `clients`, which one file makes 1
            raise ConfigError("federated imputation needs at least 2 client files. Found 1.")
        checks.store(
            self,
            {
                "client_files": files,
                "clients": checks.integer("clients", self.clients, low=2),
                "availability": checks.real(
                    "availability", self.availability, low=0, high=1, low_open=True
                ),
                "seed": checks.seed("seed", self.seed),
            },
        )
        checks.instance("impute_config", self.impute_config, ImputeConfig)
        for name in ("id_column", "label_column"):
            if not checks.text(name, getattr(self, name)):
                raise ConfigError(f"`{name}` must be a column name. Found ''.")
        if self.id_column == self.label_column:
            raise ConfigError(
                f"the id and label columns must differ. Found both {self.id_column!r}."
            )
        if self.dataset is not None and (self.id_column, self.label_column) != (
            ID_COLUMN,
            LABEL_COLUMN,
        ):
            raise ConfigError(
                "`id_column` and `label_column` apply to client files (a registered dataset "
                f"has its own columns). Found dataset {self.dataset!r}."
            )
        if self.method not in IMPUTERS:
            raise ConfigError(
                f"`method` must be one of {', '.join(IMPUTERS.names())}. Found {self.method!r}."
            )
        if (self.dataset is None) == (not self.client_files):
            raise ConfigError(
                "give either a dataset name or client files, not both. "
                f"Found dataset={self.dataset!r}, {len(self.client_files)} client files."
            )

    @property
    def data_name(self) -> str:
        return self.dataset if self.dataset is not None else "client-files"

    @property
    def trains(self) -> bool:
        """Whether the method trains a model (FedHF and its neural baselines): it alone uses
        the training settings of ``impute_config`` (rounds, local epochs, ...), which the
        others ignore (one config may serve every method, as in ``benchmarks/fedhf_table.py``)."""
        return self.method in RECONSTRUCTIONS.names()

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["client_files"] = [str(p) for p in self.client_files]
        return payload


@dataclass(frozen=True, kw_only=True)
class ImputeResult:
    """RMSE on the hidden test entries (standardised space), the validation curve and the cost."""

    method: str
    dataset: str
    config: dict[str, Any]
    rmse: float
    rmse_client_mean: float
    rmse_client_std: float
    rmse_per_client: dict[str, float]
    hidden_per_client: dict[str, int]
    rmse_per_feature: dict[str, float]
    """Per feature, over every client's hidden entries of it (NaN where none was hidden)."""
    rmse_per_feature_in_units: dict[str, float]
    """The same in the feature's own units: times its std (the evaluator's yardstick)."""
    hidden_per_feature: dict[str, int]
    validation_curve: list[float]
    wall_time_s: float
    clients: dict[str, dict[str, int]]
    aggregator: str = "PlainAggregator"
    privacy: dict[str, Any] | None = None
    traffic: dict[str, Any] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    """Every client lost during the run (a deployment): its name, the FedAvg round (from 1)
    from which it took no part, and the error that revealed it; and every one readmitted after
    a restart (``"what": "rejoined"``, the round from which it took part again). A client lost
    and not back has no score."""

    @property
    def metrics(self) -> dict[str, Any]:
        return {
            "rmse": self.rmse,
            "rmse_client_mean": self.rmse_client_mean,
            "rmse_client_std": self.rmse_client_std,
            "rmse_per_client": self.rmse_per_client,
        }

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "metrics": self.metrics}


def prepare_imputation_task(config: ImputeRunConfig) -> ImputationTask:
    """The clients of a run: a registered dataset dealt to clients, or the user's own files."""
    checks.instance("config", config, ImputeRunConfig)
    if config.dataset is not None:
        frame = load_imputation_dataset(config.dataset)
        return make_imputation_task(
            frame,
            name=config.dataset,
            clients=config.clients,
            availability=config.availability,
            rng=np.random.default_rng(config.seed),
        )
    return make_task_from_client_files(
        config.client_files,
        seed=config.seed,
        id_column=config.id_column,
        label_column=config.label_column,
    )


@runtime_checkable
class ImputationPrivacyLayer(Protocol):
    """What an imputation run needs of its privacy entry object, as :class:`PrivacyLayer` is
    for training (``protocols.privacy.PrivacyEngine`` is both): the core names this interface
    and never imports the privacy layer."""

    def aggregator(self) -> SumBackend | None:
        """The secure-sum backend (None: plain sums)."""
        ...

    def statistics_mechanisms(self, task: ImputationTask) -> StatisticsPrivacyFactory | None:
        """The factory of each client's own statistics mechanism for ``task``, which the
        federation installs inside every client (None: statistics are released exactly).
        ConfigError if the privacy asked for cannot protect an imputation run."""
        ...

    def report(self) -> dict[str, Any] | None:
        """``result.json``'s privacy entry (None when no DP mechanism ran)."""
        ...


def run_imputation(
    config: ImputeRunConfig,
    *,
    task: ImputationTask | None = None,
    aggregator: SumBackend | None = None,
    channel: Channel | None = None,
    privacy: ImputationPrivacyLayer | None = None,
    roles: Mapping[str, str] | None = None,
    on_start: Callable[[int], None] | None = None,
    on_round: Callable[[int, float], None] | None = None,
) -> tuple[ImputeResult, Imputer]:
    """Fit ``config.method`` on the clients' training rows and score it on hidden test entries.

    Every sum the clients send (statistics, model updates, validation errors) goes through the
    secure-sum backend that ``privacy`` (a :class:`ImputationPrivacyLayer`, e.g.
    ``protocols.privacy.PrivacyEngine``) chooses, split between the clients, the aggregation
    server and the coordinator; ``aggregator`` overrides it (plain by default). ``privacy`` also
    makes each client's own mechanism, which clips and noises the statistics that client
    releases, and its report fills ``result.privacy`` after the fit; ``roles`` replaces clients
    by registered roles (attackers, defenders); ``channel`` carries every message (its transport
    counts the bytes in ``result.traffic``); ``on_start(rounds)`` is called once before the fit
    and ``on_round(round, validation_rmse)`` after each round. The scoring standardisation comes
    from exact federated statistics, the same for every method and privacy setting, so RMSEs are
    comparable across both: it is the evaluator's yardstick, not a release of the method.
    """
    checks.instance("config", config, ImputeRunConfig)
    if privacy is not None:
        checks.instance("privacy", privacy, ImputationPrivacyLayer, _ENGINE_HINT)
    if task is None:
        task = prepare_imputation_task(config)
    else:
        checks.instance("task", task, ImputationTask, " (prepare_imputation_task(config))")
        check_task(config, task)
    check_scorable(task)  # before the training, not after it
    mechanisms = privacy.statistics_mechanisms(task) if privacy is not None else None
    if aggregator is None and privacy is not None:
        aggregator = privacy.aggregator()
    load_optimiser_machinery()
    start = time.perf_counter()
    try:  # a feature too large for the statistics' sums is refused by its name
        # The evaluator's own exact statistics (its yardstick, not a release of the method).
        statistics = federated_statistics(task.train, tag="statistics/eval")
        aggregator = aggregator if aggregator is not None else PlainAggregator()
        channel = channel if channel is not None else Channel()
        imputer = IMPUTERS.get(config.method)(
            task,
            config.impute_config,
            seed=config.seed,
            aggregator=aggregator,
            channel=channel,
            privacy=mechanisms,
            roles=roles,
        )
        if on_start is not None:
            on_start(config.impute_config.rounds)
        curve, scores = fit_and_score(
            imputer,
            lambda: evaluate_imputer(
                imputer, task, standardisation=statistics.standardisation, seed=config.seed
            ),
            rounds=config.impute_config.rounds,
            on_round=on_round,
        )
    except FeatureScaleError as error:
        raise error.naming(task.features) from None
    result = ImputeResult(
        method=config.method,
        dataset=config.data_name,
        config=_imputation_config(config, task),
        **scores,
        validation_curve=list(curve),
        wall_time_s=time.perf_counter() - start,
        clients={
            train.name: {
                "train_rows": train.n,
                "test_rows": test.n,
                "available_features": int(train.available.sum()),
            }
            for train, test in zip(task.train, task.test, strict=True)
        },
        aggregator=type(aggregator).__name__,
        privacy=privacy.report() if privacy is not None else None,
        traffic=traffic_report(
            aggregator,
            train_steps=config.impute_config.rounds if config.trains else 1,
            channel=channel,
        ),
    )
    return result, imputer


def imputed_tables(
    task: ImputationTask, imputer: Imputer, *, as_written: bool = False
) -> dict[str, pd.DataFrame]:
    """Each client's rows with its missing-but-available entries filled by a fitted
    ``imputer``, by client name. A client file's table comes back in its own form (ids first
    under its id column, its rows in its order, every cell it had unchanged, its label column
    as it was), so it can feed ``train``; a registered dataset's clients have no ids: their
    training rows, then their test rows, with a ``split`` column. ``as_written``: a client
    file's cells as the file writes them (what ``impute --save-imputed`` writes; see
    :meth:`~secure_vfl.data.imputation.ClientFile.imputed_frame`)."""
    checks.instance("task", task, ImputationTask, " (prepare_imputation_task)")
    tables = {}
    for k, (train, test) in enumerate(zip(task.train, task.test, strict=True)):
        rows = ClientData(
            name=train.name,
            values=np.concatenate([train.values, test.values]),
            available=train.available,
        )
        imputed = imputer.impute(k, rows)
        if task.files is not None:
            frame = task.files[k].imputed_frame(
                imputed[: train.n], imputed[train.n :], task.features, as_written=as_written
            )
        else:
            columns = [f for f, keep in zip(task.features, train.available, strict=True) if keep]
            frame = pd.DataFrame(imputed[:, train.available], columns=columns)
            frame.insert(0, "split", ["train"] * train.n + ["test"] * test.n)
        tables[train.name] = frame
    return tables


Score = TypeVar("Score")


def fit_and_score(
    imputer: Imputer,
    score: Callable[[], Score],
    *,
    rounds: int,
    on_round: Callable[[int, float], None] | None,
) -> tuple[list[float], Score]:
    """``imputer.fit`` over ``rounds`` FedAvg rounds, then ``score()``; a client's values that
    ran off to NaN or infinity, or past what its secure sums encode, raise DivergenceError,
    with the FedAvg round (its ``step``; None where it diverged after the last, in scoring)
    and what to try (a message's own round counts messages, not FedAvg rounds, and is left
    out)."""
    done = 0

    def round_done(round: int, rmse: float) -> None:
        nonlocal done
        done = round
        if on_round is not None:
            on_round(round, rmse)

    try:
        curve = imputer.fit(on_round=round_done)
        return list(curve), score()
    except NonFiniteError as error:
        step = None if done >= rounds else done + 1
        when = "after its last FedAvg round" if step is None else f"in FedAvg round {step}"
        said = str(error).rstrip(".")
        if error.step is not None:  # the message's own round, which counts messages: not said
            said = said.replace(f" (round {error.step})", "", 1)
        raise DivergenceError(
            f"imputation diverged {when}: {said}; {IMPUTATION_ADVICE}.", step=step
        ) from None
    except DivergenceError as error:  # a client's update past what its secure sums encode
        if error.step is not None or done >= rounds:
            raise
        raise DivergenceError(f"in FedAvg round {done + 1}, {error}", step=done + 1) from None


def check_task(config: ImputeRunConfig, task: ImputationTask) -> None:
    """ConfigError unless ``task``, given to a run of ``config``, has the clients ``config``
    describes (``clients``, or one per client file): the run's result records ``config``. (Its
    name is not compared, as :func:`check_data` does not.)"""
    clients = len(config.client_files) if config.client_files else config.clients
    if len(task.train) != clients:
        given = f"{clients} client files" if config.client_files else f"clients={clients}"
        raise ConfigError(
            f"the task given to the run is not the task of its config: {given} expected, "
            f"found a task of {len(task.train)} clients."
        )


def _imputation_config(config: ImputeRunConfig, task: ImputationTask) -> dict[str, Any]:
    """``config`` as ``result.json`` keeps it. For client files, the number of clients and the
    availability are the files' own (how many there are; the mean share of the features each
    client has), not the defaults that deal a registered dataset to clients."""
    payload = config.to_json()
    if config.client_files:
        payload["clients"] = len(task.train)
        payload["availability"] = float(np.mean([client.available.mean() for client in task.train]))
    return payload
