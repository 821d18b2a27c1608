"""What every learning method shares: its configuration, its interface and the training loop."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, cast

import numpy as np
import torch
from torch import Tensor, nn

from secure_vfl import checks
from secure_vfl.data.party_preprocessing import PartyPreprocessing
from secure_vfl.data.samplers import BatchSampler, make_sampler
from secure_vfl.data.vertical import (
    VerticalData,
    VerticalSplit,
    label_party_view,
    labeled_subset,
)
from secure_vfl.errors import ConfigError, ProtocolError, TransportError
from secure_vfl.federation.aggregator import SealingScheme, SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import (
    AGGREGATOR,
    AbortRequest,
    GradientMessage,
    HeadTask,
    KeyRequest,
    LossMessage,
    Message,
    PredictionMessage,
    PredictTask,
    RepresentationMessage,
    RepresentRequest,
    SealRequest,
    SumRequest,
    UpdateRequest,
    party_name,
)
from secure_vfl.federation.parties import (
    ROLES,
    DataParty,
    Head,
    Party,
    RoleFactory,
    make_aggregation_server,
    ticket_issuer,
)
from secure_vfl.federation.parts import ClassValue
from secure_vfl.federation.tickets import Contribution, TicketIssuer
from secure_vfl.models.networks import make_bottom
from secure_vfl.models.simsiam import pretrain_simsiam, progress_of
from secure_vfl.registry import Registry

logger = logging.getLogger(__name__)

Heads = Literal["all", "active"]
Batching = Literal["grouped", "mixed"]
Release = Literal["drop", "dp"]
StepCallback = Callable[[int, float], None]
PassResult = TypeVar("PassResult")
TRAINING, EVALUATION, SAVING = "training", "evaluation", "saving"
CHECKPOINT = "checkpoint"
"""The ``phase`` of a ``faults`` entry: a party lost in a training step, in the evaluation
after the step it names, or (a deployment) while the model was saved after it, so its part was
not saved, or when asked for its checkpoint of that step, so the commit of the step leaves it
out (a rejoin is always training)."""
MAX_REPRESENTATION_DIM = 65536
"""The widest bottom-model output: a batch of 128 such rows is 32 MiB on the wire (limit 64)."""
MAX_EPOCHS = 100_000
"""The most training (and pretraining) epochs: a DP-SGD run draws its whole Poisson schedule
before the first step, and 10**8 epochs of a 142-row training set ran out of memory there."""
PartyMaker = Callable[[int, RoleFactory, dict[str, Tensor], nn.Module], Party]


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """Hyper-parameters shared by the split-network methods (defaults: LASER reference, tabular,
    but for the batching).

    ``heads="all"`` gives every party labels and a head (the LASER paper); ``"active"`` keeps one
    label party (party 0) with a single head (the threat model's setting). ``batching="grouped"``
    forms batches of one observed set (the paper); ``"mixed"``, the default, samples subsets per
    sample.
    ``pretrain_epochs > 0`` pretrains every party's bottom model with SimSiam on its own
    training rows, labelled or not, before training (local: nothing is sent).
    ``secure_sums=True`` says the aggregator is a secure backend that releases only sums over
    0 or >= 2 parties besides the receiver: methods plan only such sums, or refuse to run.
    ``labeled`` keeps that many training labels (a seeded random subset, see
    :func:`~secure_vfl.data.vertical.labeled_subset`) and treats the other rows as unlabelled;
    ``None`` labels every training row. ``top_model="none"`` fuses without a trainable top
    model: the mean of the representations is the logits (``representation_dim`` must equal
    the number of classes; the mean-fusion methods only), so every party receives per-sample
    gradients of the loss itself, the setting of the survey's direct label inference.
    ``release`` is what a secure-sum run does with a sample's subset whose only contributor
    besides the label party is one party, which no sum can hide: ``"drop"`` never plans it;
    ``"dp"`` (LASER, ``heads="active"``, secure sums) plans it and has that party send the row
    as a DP release (clipped and noised inside it, priced by its accountant: the privacy
    layer installs the mechanism).
    """

    heads: Heads = "all"
    batching: Batching = "mixed"
    epochs: int = 20
    batch_size: int = 128
    lr: float = 0.03
    momentum: float = 0.8
    weight_decay: float = 0.0
    representation_dim: int = 128
    standard_incomplete: Literal["random", "zero"] = "random"
    plug_dropout: float = 0.5
    vectorised: bool = True
    secure_sums: bool = False
    pretrain_epochs: int = 0
    labeled: int | None = None
    top_model: Literal["linear", "none"] = "linear"
    release: Release = "drop"
    max_update_norm: float | None = None

    def __post_init__(self) -> None:
        checks.text("heads", self.heads, ("all", "active"))
        checks.text("top_model", self.top_model, ("linear", "none"))
        checks.text("batching", self.batching, ("grouped", "mixed"))
        checks.text("standard_incomplete", self.standard_incomplete, ("random", "zero"))
        checks.text("release", self.release, ("drop", "dp"))
        numbers = {
            "vectorised": checks.flag("vectorised", self.vectorised),
            "secure_sums": checks.flag("secure_sums", self.secure_sums),
            "epochs": checks.integer("epochs", self.epochs, low=1),
            "batch_size": checks.integer("batch_size", self.batch_size, low=1),
            "representation_dim": checks.integer(
                "representation_dim", self.representation_dim, low=1
            ),
            "pretrain_epochs": checks.integer("pretrain_epochs", self.pretrain_epochs, low=0),
            "lr": checks.real("lr", self.lr, low=0, low_open=True, high=checks.FLOAT32_MAX),
            "momentum": checks.real("momentum", self.momentum, low=0, high=1, high_open=True),
            "weight_decay": checks.real(
                "weight_decay", self.weight_decay, low=0, high=checks.FLOAT32_MAX
            ),
            "plug_dropout": checks.real(
                "plug_dropout", self.plug_dropout, low=0, high=1, high_open=True
            ),
        }
        if self.labeled is not None:
            numbers["labeled"] = checks.integer("labeled", self.labeled, low=1)
        if self.max_update_norm is not None:
            numbers["max_update_norm"] = checks.real(
                "max_update_norm", self.max_update_norm, low=0, low_open=True
            )
        checks.store(self, numbers)
        if self.release == "dp" and not (self.secure_sums and self.heads == "active"):
            raise ConfigError(
                "release='dp' releases, with DP noise, what a secure sum cannot hide, so it "
                "needs secure sums and the single label party: expected --secure-agg masks, "
                f"paillier or ckks and --heads active. Found secure_sums={self.secure_sums}, "
                f"heads={self.heads!r}."
            )
        if self.representation_dim > MAX_REPRESENTATION_DIM:
            raise ConfigError(
                f"`representation_dim` must be at most {MAX_REPRESENTATION_DIM}. Found "
                f"{self.representation_dim}."
            )
        for name in ("epochs", "pretrain_epochs"):
            if getattr(self, name) > MAX_EPOCHS:
                raise ConfigError(
                    f"`{name}` must be at most {MAX_EPOCHS}. Found {getattr(self, name)}."
                )


def labeled_rows(data: VerticalData, config: MethodConfig, seed: int) -> np.ndarray:
    """The training rows whose labels a method may use: all, or ``config.labeled`` of them
    drawn with the run's seed (the same rows for every method of a run): the rows every party
    keeps observed (``data.aligned_rows``, FALSE-VFL's reserve) first, the rest among the
    others. ConfigError when ``config.labeled`` leaves one class (it trained, and warned only
    of collapsed predictions) or is smaller than the reserve.
    """
    reserve = data.aligned_rows
    rng = np.random.default_rng(seed)
    if reserve is None or config.labeled is None or config.labeled > data.train.n:
        rows = labeled_subset(data.train.n, config.labeled, rng=rng)  # refuses too many
    elif config.labeled < reserve.size:
        raise ConfigError(
            f"the {reserve.size} samples kept aligned are labelled ones: expected --labeled "
            f"of at least {reserve.size}, found {config.labeled}."
        )
    else:
        others = np.setdiff1d(np.arange(data.train.n), reserve)
        drawn = others[rng.choice(others.size, size=config.labeled - reserve.size, replace=False)]
        rows = np.sort(np.concatenate([reserve, drawn])).astype(np.int64)
    if config.labeled is not None:
        classes = np.unique(data.train.labels[rows])
        if classes.size < 2:
            values = data.classes or tuple(range(data.num_classes))
            raise ConfigError(
                f"the {rows.size} labelled training sample(s) (--labeled {config.labeled}) hold "
                f"one class ({values[int(classes[0])]!r}); a classifier needs at least 2: "
                "expected a larger --labeled."
            )
    return rows


def training_rows(method: str, data: VerticalData, config: MethodConfig, seed: int) -> np.ndarray:
    """The training rows ``method`` draws its batches from: the labelled ones
    (:func:`labeled_rows`), and for Standard VFL only those every party holds."""
    rows = labeled_rows(data, config, seed)
    if method == "standard":  # Vanilla VFL: only the aligned (complete) labelled samples
        labelled = rows.size
        rows = rows[data.train.mask[rows].all(axis=1)]
        if not rows.size:  # it reported an untrained model's accuracy as Standard VFL's
            raise ConfigError(
                f"standard trains on the labelled samples every one of the {data.parties} "
                f"parties holds; found none of {labelled} (fewer parties or less training "
                "missingness would leave some; laser and plugvfl train on incomplete samples)."
            )
    return rows


def training_sampler(
    method: str, data: VerticalData, config: MethodConfig, seed: int
) -> BatchSampler:
    """The sampler of ``method``'s training batches (one-stage methods), as the method makes it,
    known before the method is built: a deployed label party plans a private run's Poisson
    sample from it before it sets the other parties up."""
    rows = training_rows(method, data, config, seed)
    return make_sampler(config.batching, data.train.mask, config.batch_size, rows=rows)


def refuse_secure_sums(config: MethodConfig, method: str, reason: str) -> None:
    """Raise ConfigError when ``config`` asks for secure sums that ``method`` cannot use."""
    if config.secure_sums:
        raise ConfigError(
            f"{method} cannot run under secure aggregation: {reason} Secure sums serve "
            "laser with heads='active'."
        )


def refuse_top_model(config: MethodConfig, method: str, head: str) -> None:
    """ConfigError unless ``config`` keeps the trainable top model ``method`` is built on."""
    if config.top_model != "linear":
        raise ConfigError(
            f"{method} classifies with {head}, a trainable top model; top_model="
            f"{config.top_model!r} applies to the mean-fusion methods (laser, local, ensemble)."
        )


def require_hiding_crowd(config: MethodConfig, parties: int, method: str) -> None:
    """Refuse secure sums with fewer than 3 parties: with the label party and one other, no
    sum can hide the other party's term, so it would never contribute."""
    if config.secure_sums and parties < 3:
        raise ConfigError(
            f"{method} under secure aggregation needs at least 3 parties (the label party and "
            f"two others whose terms hide each other). Found {parties}."
        )


class Method(Protocol):
    """A trainable VFL method: fit on the training split, predict on any test split."""

    name: str
    sampler: BatchSampler
    fed: Federation

    def train_step(self, rows: np.ndarray, round: int, batch_id: int) -> float:
        """One training step on the training rows ``rows``; returns its loss."""
        ...

    @property
    def total_steps(self) -> int:
        """How many training steps :meth:`fit` runs (for progress reporting)."""
        ...

    def epoch_samplers(self) -> list[BatchSampler]:
        """The sampler of every epoch :meth:`fit` trains, in order (a resumed run's position
        is checked against them)."""
        ...

    def fit(
        self, *, on_step: StepCallback | None = None, progress: TrainingProgress | None = None
    ) -> list[float]:
        """Train (from ``progress``, where a resumed run stands); return the mean training loss
        of every epoch."""
        ...

    def predict(self, split_name: str) -> np.ndarray:
        """Predicted class of every (sample, party): (N, K) int64, -1 where the party is absent."""
        ...

    def predict_proba(self, split_name: str) -> np.ndarray:
        """Class probabilities of every sample as the method combines its heads: (N, C)
        float32, NaN on a sample it makes no prediction for."""
        ...


class MethodFactory(Protocol):
    """Builds a method for the given data; each method's module registers one."""

    def __call__(
        self,
        data: VerticalData,
        config: MethodConfig,
        *,
        seed: int,
        channel: Channel | None = None,
        aggregator: SumBackend | None = None,
        roles: Mapping[str, str] | None = None,
    ) -> Method: ...


METHODS: Registry[MethodFactory] = Registry("method")


@dataclass(frozen=True)
class PartyModels:
    """What a method hands the parties at composition besides their bottom models: the heads
    ``heads[k][key]`` of party ``k`` and its further bottoms ``bottoms[(k, key)]``."""

    heads: dict[int, dict[str, nn.Module]]
    bottoms: dict[tuple[int, str], nn.Module] = dataclasses.field(default_factory=dict)


PartyModelsMaker = Callable[[MethodConfig, Sequence[tuple[int, ...]], int, int], PartyModels]
PARTY_MODELS: Registry[PartyModelsMaker] = Registry("party models")
"""Each method's seed rule for the heads and further bottoms of every party, by method name:
``maker(config, block_shapes, num_classes, seed)``. The method builds them from it, and so
does a party that builds itself in its own process (:mod:`secure_vfl.deployment`): the same
seed gives the same models."""


@dataclass
class Federation:
    """The label party's view of a run: what it knows of the data (labels, availability masks,
    its own block: :func:`~secure_vfl.data.vertical.label_party_view`), its own party object,
    every party's name, the channel it talks through and its own random generators (task
    sampling, epoch order).

    The label party (``party-0``) drives: everything it asks of another party, and everything
    it learns from one, is a message (:mod:`secure_vfl.federation.messages`). It holds no
    reference to another party's object.

    Faults (a deployment): a method whose parties may go missing (``tolerates_dropouts``,
    LASER's) lets :meth:`recover` and :meth:`update` drop a data party that can no longer be
    reached: its block becomes missing for every row of every split from then on, nothing is
    sent to it again, and ``faults`` records it (party, step and epoch counted from 1, the
    error). ``epoch_steps`` (the steps of an epoch) dates a fault's epoch. At every epoch
    boundary :meth:`rejoin` probes the dropped parties; one that answers (a restarted process)
    is set up anew and takes part again, and ``faults`` records that too (``"what":
    "rejoined"``, :data:`REJOINED`).
    """

    data: VerticalData
    names: list[str]
    own: DataParty
    channel: Channel
    generator: torch.Generator
    rng: np.random.Generator
    session: str = ""
    queries: int = 0
    aborts: int = 0
    """How many times it abandoned a step: each abort its own batch id, so no two are alike (a
    step that fails again is abandoned again) and a replayed one is refused as the replay it is."""
    scheme: str = ""
    tolerates_dropouts: bool = False
    epoch_steps: int = 0
    dropped: list[str] = dataclasses.field(default_factory=list)
    faults: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    receivers: list[str] = dataclasses.field(default_factory=list)
    """The parties secure sums are delivered to (their keys are set up with every session)."""
    lost_columns: dict[str, dict[str, np.ndarray]] = dataclasses.field(
        default_factory=dict, repr=False
    )
    """Each dropped party's availability column per split as the label party knew it when the
    party was lost: what it gets back if it rejoins (never more than was known)."""
    fit: Literal["new", "fitting", "trained"] = "new"
    """Where the method's one :meth:`~Method.fit` stands (``trained`` too for a model loaded
    from its saved parts); see :func:`fits_once`."""
    tickets: TicketIssuer = dataclasses.field(init=False, repr=False)
    """The tickets of the contributions it asks the parties to send the aggregation server
    (:mod:`~secure_vfl.federation.tickets`)."""

    def __post_init__(self) -> None:
        self.tickets = ticket_issuer(self.own)

    def ticket(
        self,
        kind: str,
        contributor: str,
        *,
        round: int,
        batch_id: int,
        phase: str,
        tag: str,
        deliver_to: str = "",
    ) -> bytes:
        """The ticket of the contribution (``kind``: ``representation`` or ``sealed``) it asks
        ``contributor`` for, in this session."""
        named = Contribution(
            kind=kind,
            session=self.session,
            contributor=contributor,
            round=round,
            batch_id=batch_id,
            phase=phase,
            tag=tag,
            deliver_to=deliver_to,
        )
        return self.tickets.mint(named)

    def live(self, names: Sequence[str] | None = None) -> list[str]:
        """``names`` (default: every data party) less those dropped."""
        return [
            name for name in (self.names if names is None else names) if name not in self.dropped
        ]

    def drop(self, name: str, *, round: int, what: str, phase: str = TRAINING) -> None:
        """Declare data party ``name`` lost at training step ``round`` (``phase``: in that
        step's training, or in the evaluation after it): its block is missing for every row of
        every split from now on (the availability masks say so, so no plan asks it for
        anything), and ``faults`` records it."""
        self._lose(name)
        epoch = round // self.epoch_steps + 1 if self.epoch_steps else None
        self.faults.append(
            {"party": name, "step": round + 1, "epoch": epoch, "phase": phase, "what": what}
        )
        logger.warning(
            "%s: %s is lost at step %d (epoch %s, %s); the run goes on without its block: %s",
            self.own.name,
            name,
            round + 1,
            epoch,
            phase,
            what,
        )

    def _lose(self, name: str) -> None:
        """Data party ``name``'s block is missing for every row of every split from now on."""
        if name == self.own.name or name not in self.names or name in self.dropped:
            raise ProtocolError(
                f"{self.own.name} can drop one of the data parties {self.live(self.names[1:])}; "
                f"found {name!r}."
            )
        column = self.names.index(name)
        splits = split_tensors(self.data)
        self.lost_columns[name] = {
            key: split.mask[:, column].copy() for key, split in splits.items()
        }
        for split in splits.values():
            split.mask[:, column] = False
        self.dropped.append(name)
        self.channel.lost_now.add(name)
        self.own.withdraw(name)

    def restore_losses(self, dropped: Sequence[str], faults: Sequence[Mapping[str, Any]]) -> None:
        """A resumed run: the parties ``dropped`` when its checkpoint was written stay lost
        (their blocks missing, as after :meth:`drop`), and ``faults`` is the run's record so
        far. ProtocolError for a name that is not a data party of this run. A party the
        channel knew absent when the federation was built (:attr:`Channel.absent`: left out of
        the key set-up) is counted dropped already; it is lost here as the others are."""
        absent = set(self.dropped)
        for name in dropped:
            if name in absent:  # once: a name listed twice is refused by _lose, as before
                absent.discard(name)
                self.dropped.remove(name)
            self._lose(name)
        self.faults = [dict(fault) for fault in faults]

    def rejoin(self, *, round: int) -> list[str]:
        """At an epoch boundary (training step ``round`` is next): probe every dropped data
        party (:meth:`~secure_vfl.federation.channel.Channel.returned`, all at once and quick:
        an address that refuses is not back, without waiting) and readmit each that answers
        again. A readmitted party is set up
        anew by the channel's readmission (a fresh process builds its initial models by the
        seed rule), its availability column is restored from :attr:`lost_columns`, and
        ``faults`` records it (``"what": "rejoined"``, dated by the first step it takes part
        in); then a new session opens (:meth:`open_key_session`). Returns the parties that
        rejoined. Nothing is probed if no party is lost or the channel has no readmission; a
        party that answers but cannot be set up stays lost (logged) and is probed again at
        the next epoch boundary."""
        readmit = self.channel.readmit
        if not self.dropped or readmit is None:
            return []
        rejoined = []
        for name in self.channel.returned(list(self.dropped), quick=True):
            try:
                restored = readmit(name)
            except ProtocolError as error:
                logger.warning(
                    "%s: %s answers again but could not be set up (%s); it stays lost",
                    self.own.name,
                    name,
                    error,
                )
                continue
            self.readmitted(name, round=round, restored=restored)
            rejoined.append(name)
        if rejoined:
            self.open_key_session(round=round)
        return rejoined

    def readmitted(self, name: str, *, round: int, restored: int = 0) -> None:
        """Take the lost data party ``name``, set up anew, back from training step ``round``
        on: its availability column as it was when it was lost, and a ``faults`` entry (with
        ``"restored"``, the step of the checkpoint it restored, if it did)."""
        column = self.names.index(name)
        splits = split_tensors(self.data)
        for key, held in self.lost_columns.pop(name).items():
            splits[key].mask[:, column] = held
        self.dropped.remove(name)
        self.channel.lost_now.discard(name)
        epoch = round // self.epoch_steps + 1 if self.epoch_steps else None
        fault = {"party": name, "step": round + 1, "epoch": epoch, "phase": TRAINING}
        self.faults.append(
            {**fault, "what": REJOINED, **({"restored": restored} if restored else {})}
        )
        logger.warning(
            "%s: %s rejoined, set up anew%s; its block takes part again from step %d (epoch %s)",
            self.own.name,
            name,
            f" from its checkpoint of step {restored}" if restored else "",
            round + 1,
            epoch,
        )

    def open_key_session(self, *, round: int) -> None:
        """A new session for every message and secure sum from now on: every sum context is
        bound to the session (:func:`~secure_vfl.federation.aggregator.sum_context`), so no mask
        of the old session can recur, and under a secure-sum scheme every live party announces
        its keys again (a rejoined party's are new; a key of the old session is refused from
        now on: :class:`~secure_vfl.federation.aggregator.KeySessions`). A party lost during the
        key set-up is dropped (:meth:`recover`) and the set-up runs again without it."""
        while True:
            self.session = secrets.token_hex(8)
            if not self.scheme:
                return
            try:
                self.set_up_keys(self.receivers)
                return
            except ProtocolError as error:
                self.recover(error, round=round)

    def recover(
        self,
        error: ProtocolError,
        *,
        round: int,
        abandoned: Sequence[int] | None = None,
        phase: str = TRAINING,
    ) -> None:
        """After ``error`` cut training step ``round`` short (or, with ``phase`` evaluation, a
        prediction pass after it): drop every data party that can no longer be reached and
        abandon the ``abandoned`` rounds (default: ``round``) at every other party
        (:class:`AbortRequest`) and forget this party's refusals of replies to them
        (:meth:`~secure_vfl.federation.channel.Channel.forget_refusals`), so the caller can
        retry without them. Re-raises ``error`` if no party was lost (a protocol error, not a
        fault); raises TransportError, naming it, if the aggregation server was (no sum can be
        served without it). A method that does not tolerate dropouts drops nobody: on a lost
        data party it raises TransportError naming the party and saying why the run stops."""
        peers = [name for name in self.live() if name != self.own.name]
        if not self.tolerates_dropouts:
            gone = self.channel.unreachable(peers)
            if gone:
                raise TransportError(
                    f"{', '.join(gone)} can no longer be reached ({error}). This method needs "
                    "every data party's representation of every row it trains on, so the run "
                    "stops; --method laser, local, ensemble, false-vfl-1 and false-vfl-2 go "
                    "on without a lost party, its block missing from then on.",
                    gone[0] if len(gone) == 1 else None,
                ) from error
            raise error
        lost = self.channel.unreachable([*peers, AGGREGATOR])
        if AGGREGATOR in lost:  # what the error says may be another party's refusal of it
            raise TransportError(
                f"the aggregation server can no longer be reached ({error}); no sum can be "
                "served without it, so the run stops.",
                AGGREGATOR,
            ) from error
        if not lost:
            raise error
        for name in lost:
            self.drop(name, round=round, what=str(error), phase=phase)
        for abandoned_round in [round] if abandoned is None else abandoned:
            self.aborts += 1
            self.send_or_drop(
                [
                    AbortRequest(**self.header(name, abandoned_round, self.aborts))
                    for name in [*self.live(), AGGREGATOR]
                ],
                round=round,
            )
        # A reply to the abandoned attempt that this party refused meanwhile (over the network:
        # one that came while it waited, whose handling sent to the lost party) is not the
        # retry's: its next wait must not raise it.
        for refusal in self.channel.forget_refusals():
            logger.info("%s: forgotten with the abandoned attempt: %s", self.own.name, refusal)

    def evaluation_pass(self, attempt: Callable[[], PassResult], *, round: int) -> PassResult:
        """Run the prediction pass ``attempt`` (it draws its query rounds from
        :meth:`next_query`). Should a data party be lost during it (a deployment: its process
        died), drop it (``faults`` dates it by the last training step ``round`` and says
        ``"phase": "evaluation"``), abandon the pass's queries at every other party and run the
        whole pass again without it, so that every prediction of the split comes from the
        blocks still held; what earlier passes predicted (other splits) stands. Each retry
        drops a party or re-raises (:meth:`recover`), so there are fewer retries than parties."""
        while True:
            first = self.queries
            try:
                return attempt()
            except ProtocolError as error:
                self.recover(
                    error,
                    round=round,
                    abandoned=range(first, self.queries),
                    phase=EVALUATION,
                )

    def send_or_drop(self, messages: Sequence[Message], *, round: int) -> None:
        """Send the label party's ``messages`` at once (:meth:`~secure_vfl.federation.parties.
        Party.send_all`, behind the closing gradients :meth:`update` held back); should
        receivers among the data parties turn out to be unreachable (dropouts tolerated), drop
        them instead of failing the step: the others have acted."""
        # Once each: a step's closing gradients held back and an update for an empty draw
        # after it go to the same parties (a party lost there is dropped once).
        receivers = list(dict.fromkeys(m.receiver for m in [*self.own.deferred, *messages]))
        try:
            if messages:
                self.own.send_all(messages)
            else:
                self.own.flush()
        except ProtocolError as error:
            others = [name for name in receivers if name not in (self.own.name, AGGREGATOR)]
            lost = self.channel.unreachable(others) if self.tolerates_dropouts and others else []
            if not lost:
                raise
            for name in lost:
                self.drop(name, round=round, what=str(error))

    def learn_split(self, name: str, mask: np.ndarray) -> None:
        """Learn which parties hold each sample of a new split ``name`` (its availability
        mask (N, K), from aligning ids), so this program can predict on it once every party
        holds its rows of it (:meth:`~secure_vfl.federation.parties.DataParty.hold_split`)."""
        if name == "train" or mask.dtype != np.bool_ or mask.shape[1:] != (len(self.names),):
            raise ConfigError(
                f"a new split's name other than 'train' and a bool mask (N, {len(self.names)}) "
                f"expected; found {name!r} and {mask.dtype} {mask.shape}."
            )
        n = mask.shape[0]
        empty = tuple(np.empty((n, 0), dtype=np.float32) for _ in self.names)
        self.data.tests[name] = VerticalSplit(
            blocks=empty, labels=np.zeros(n, dtype=np.int64), mask=mask
        )

    def next_query(self) -> int:
        """A fresh round number for one prediction pass (so no sum context is served twice)."""
        self.queries += 1
        return self.queries - 1

    def header(self, receiver: str, round: int, batch_id: int) -> dict[str, Any]:
        """The header of a message from the label party to ``receiver`` in this session."""
        return {
            "sender": self.own.name,
            "receiver": receiver,
            "round": round,
            "batch_id": batch_id,
            "session": self.session,
        }

    def request_representations(
        self,
        split: str,
        rows: Tensor,
        present: Tensor,
        *,
        reply_to: str,
        round: int,
        batch_id: int,
        train: bool,
        senders: Sequence[str] | None = None,
        tag: str = "",
        model: str = "",
        backward: bool | None = None,
        sums: Sequence[Message] = (),
        gradients_from: Sequence[str] = (),
    ) -> list[str]:
        """Ask each sender for its representations of its ``present`` rows of the batch, sent to
        ``reply_to``; ``present`` is (B, len(senders)), senders default to every party. With
        ``train`` the rows are priced as training records and, unless ``backward`` is False,
        each sender keeps its graph for a gradient. ``sums`` (plaintext sum requests,
        :meth:`sum_requests`) go out together with the requests: the aggregator serves each
        once the representations it sums are in, so a step waits once for both.
        ``gradients_from``: the parties besides the driver whose gradients each forward pass
        takes (the holders of the heads that train on it). Returns the names of the parties
        asked (those with a present row)."""
        senders = self.names if senders is None else senders
        phase = "train" if train else "predict"
        asked, requests = [], []
        for k, name in enumerate(senders):
            positions = torch.nonzero(present[:, k]).flatten()
            if positions.numel() == 0:
                continue
            ticket = b""
            if reply_to == AGGREGATOR and not self.scheme:  # (under a scheme: held, sealed)
                ticket = self.ticket(
                    "representation", name, round=round, batch_id=batch_id, phase=phase, tag=tag
                )
            requests.append(
                RepresentRequest(
                    **self.header(name, round, batch_id),
                    split=split,
                    rows=rows[positions].contiguous(),
                    positions=positions,
                    reply_to=reply_to,
                    tag=tag,
                    model=model,
                    phase=phase,
                    backward=train if backward is None else backward,
                    gradients_from=tuple(gradients_from),
                    ticket=ticket,
                )
            )
            asked.append(name)
        if reply_to == self.own.name:
            self.own.expect(
                "representation", senders=asked, round=round, batch_id=batch_id, tag=tag
            )
        self.own.send_all([*requests, *sums])
        return asked

    def take_representations(
        self, asked: Sequence[str], *, round: int, batch_id: int, tag: str = ""
    ) -> list[RepresentationMessage]:
        """The representations the label party asked for itself, in the order asked."""
        return [
            cast(
                RepresentationMessage,
                self.own.take(
                    "representation", sender=name, round=round, batch_id=batch_id, tag=tag
                ),
            )
            for name in asked
        ]

    def sum_requests(
        self,
        selection: Tensor,
        *,
        deliver_to: str,
        round: int,
        batch_id: int,
        tag: str,
        train: bool,
        source_tag: str = "",
        dp_rows: Tensor | None = None,
    ) -> list[Message]:
        """The messages that ask for the per-task sums ``selection`` (T, B, K): under a secure
        scheme a seal request to each selected contributor, then the sum request to the
        aggregator (which serves it once every share it sums is in).

        ``tag`` tells this sum apart from others with the same round and batch (training vs
        prediction, one task chunk vs another) so secure backends never reuse a mask context.
        ``dp_rows`` (B, K) tells each contributor which of its rows to send as a DP release (a
        sum where it is the only contributor besides the receiver; ``release="dp"``).
        """
        plan: dict[str, Any] = {
            "selection": selection,
            "parties": tuple(self.names),
            "deliver_to": deliver_to,
            "tag": tag,
            "source_tag": source_tag,
            "phase": "train" if train else "predict",
            "dp_rows": dp_rows,
        }
        sealers = []  # under a secure scheme, every contributor the selection names
        if self.scheme:
            sealers = [n for k, n in enumerate(self.names) if bool(selection[..., k].any())]
        seals = [
            SealRequest(
                **self.header(name, round, batch_id),
                **plan,
                ticket=self.ticket(
                    "sealed",
                    name,
                    round=round,
                    batch_id=batch_id,
                    phase=plan["phase"],
                    tag=tag,
                    deliver_to=deliver_to,
                ),
            )
            for name in sealers
        ]
        return [*seals, SumRequest(**self.header(AGGREGATOR, round, batch_id), **plan)]

    def assign_head_task(
        self,
        head_party: str,
        rows: Tensor,
        selection: Tensor,
        weights: Tensor,
        present: Tensor,
        *,
        normaliser: float,
        round: int,
        batch_id: int,
        tag: str,
        head: str = "",
        dp_rows: Tensor | None = None,
        hold: bool = False,
        send_sums: bool = True,
        parts: Tensor | None = None,
    ) -> list[Message]:
        """Tell ``head_party`` what its head ``head`` trains on; then ask for its sums (with
        ``dp_rows``, see :meth:`sum_requests`), or with ``send_sums`` False return those
        requests unsent (for :meth:`request_representations`). With ``hold`` (``head_party`` is
        the label party itself) the head keeps the gradients it owes the others for
        :meth:`update`. With ``parts`` (S, B, K; every task a union of them) the sums asked for
        are the parts', which the head adds up into its tasks' (:class:`HeadTask`)."""
        self.own.expect("loss", senders=[head_party], round=round, batch_id=batch_id, tag=tag)
        self.own.send(
            HeadTask(
                **self.header(head_party, round, batch_id),
                rows=rows,
                weights=weights.to(torch.float32).contiguous(),
                normaliser=float(normaliser),
                selection=selection,
                present=present,
                parties=tuple(self.names),
                tag=tag,
                head=head,
                hold=hold,
                parts=parts,
            )
        )
        sums = self.sum_requests(
            selection if parts is None else parts,
            deliver_to=head_party,
            round=round,
            batch_id=batch_id,
            tag=tag,
            train=True,
            source_tag=head,
            dp_rows=dp_rows,
        )
        if not send_sums:
            return sums
        self.own.send_all(sums)
        return []

    def predict_with(
        self,
        head_party: str,
        selection: Tensor,
        positions: Tensor,
        *,
        round: int,
        batch_id: int,
        tag: str,
        source_tag: str,
        head: str = "",
        probabilities: bool = False,
        dp_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The classes ``head_party``'s head ``head`` predicts for ``positions`` from the sum of
        ``selection`` (B, K) over the representations sent under ``source_tag``: (positions,
        predictions) as it answered; with ``probabilities``, its class probabilities
        (positions, classes) instead of the classes. ``dp_rows``: see :meth:`sum_requests`."""
        self.own.expect("prediction", senders=[head_party], round=round, batch_id=batch_id, tag=tag)
        self.own.send(
            PredictTask(
                **self.header(head_party, round, batch_id),
                positions=positions,
                tag=tag,
                head=head,
                probabilities=probabilities,
            )
        )
        self.own.send_all(
            self.sum_requests(
                selection.unsqueeze(0),
                deliver_to=head_party,
                round=round,
                batch_id=batch_id,
                tag=tag,
                train=False,
                source_tag=source_tag,
                dp_rows=dp_rows,
            )
        )
        answer = cast(
            PredictionMessage,
            self.own.take("prediction", sender=head_party, round=round, batch_id=batch_id, tag=tag),
        )
        self._check_prediction(answer, positions)
        if not probabilities:
            return answer.positions, answer.predictions
        if answer.probabilities is None:
            raise ProtocolError(
                f"{head_party}: class probabilities were asked for; its answer holds none."
            )
        return answer.positions, answer.probabilities

    def _check_prediction(self, answer: PredictionMessage, positions: Tensor) -> None:
        """Refuse (ProtocolError) a head's answer that is not one for ``positions``, the batch
        rows its predict task asked for, in the task's classes: a row left out was taken for a
        head with no prediction there, and other rows or widths failed in indexing."""
        where = f"{self.own.name}: {answer.sender}'s answer to its predict task {answer.tag!r}"
        if not torch.equal(answer.positions, positions):
            found = answer.positions.numel()
            raise ProtocolError(
                f"{where}: predictions for {positions.numel()} batch positions (those asked) "
                f"expected, found {found}{' others' if found == positions.numel() else ''}."
            )
        classes = self.data.num_classes
        predicted = answer.predictions
        if predicted.numel() and not 0 <= int(predicted.min()) <= int(predicted.max()) < classes:
            raise ProtocolError(
                f"{where}: classes in [0, {classes}) expected, found "
                f"[{int(predicted.min())}, {int(predicted.max())}]."
            )
        found_probabilities = answer.probabilities
        if found_probabilities is not None and found_probabilities.shape[1] != classes:
            raise ProtocolError(
                f"{where}: probabilities over its {classes} classes per row expected, found "
                f"shape {tuple(found_probabilities.shape)}."
            )

    def take_loss(self, head_party: str, *, round: int, batch_id: int, tag: str) -> float:
        """The loss ``head_party`` reported for its task ``tag`` of this step."""
        message = self.own.take("loss", sender=head_party, round=round, batch_id=batch_id, tag=tag)
        return cast(LossMessage, message).loss

    def send_gradients(self, messages: Sequence[GradientMessage]) -> None:
        """Send the label party's gradient messages (its own bottom's is handed over locally)."""
        self.own.send_all([dataclasses.replace(m, session=self.session) for m in messages])

    def set_up_keys(self, receivers: Sequence[str]) -> None:
        """Open the secure-sum session: every live party announces its public keys
        (pairwise-mask keys to the other contributors, receivers' encryption keys to the
        contributors and the aggregator). Only public keys cross."""
        self.receivers = list(receivers)
        live = self.live()
        self.own.send_all(
            [
                KeyRequest(
                    **self.header(name, 0, 0),
                    scheme=self.scheme,
                    contributors=tuple(live),
                    receivers=tuple(self.live(self.receivers)),
                )
                for name in (AGGREGATOR, *live)  # the server too: it takes the session's keys
            ]
        )

    def update(
        self,
        *,
        round: int,
        tag: str = "",
        heads: bool = False,
        parties: Sequence[str] | None = None,
        closing: Sequence[GradientMessage] = (),
    ) -> None:
        """Close a step: every party (or ``parties``) backpropagates what it received for ``(round,
        tag)`` and steps; with ``heads`` its head ``tag`` steps too. The label party's ``closing``
        gradients (its head's held ones, :meth:`assign_head_task`) are the last of the step
        (``step=True``, and ``heads``): their receivers get no separate update. They are held back
        (:meth:`~secure_vfl.federation.parties.Party.defer`) to go with the label party's next
        messages (the next step's requests: one delivery per party and a step that waits once less),
        or with :meth:`flush`. A party lost here is dropped (:meth:`send_or_drop`); the others'
        updates complete the step."""
        live = self.live(parties)
        last = [
            dataclasses.replace(m, step=True, heads=heads) for m in closing if m.receiver in live
        ]
        closed = {m.receiver for m in last}
        self.send_or_drop(
            [
                UpdateRequest(**self.header(name, round, 0), tag=tag, heads=heads)
                for name in live
                if name not in closed
            ],
            round=round,
        )
        self.own.defer(last)

    def pass_draw(self, *, round: int) -> None:
        """Step ``round`` drew no rows (an empty Poisson draw): every live party is told it
        passed, with nothing to backpropagate, as a party without rows in a draw is. What a
        party does then is its own: a DP-SGD party takes the noise-only step that its
        accountant prices for every draw, a plain optimiser has nothing to apply. A method
        that does not go on without a data party stops as its steps do
        (:func:`stops_on_a_lost_party`), naming the party lost here."""
        try:
            self.update(round=round)
        except ProtocolError as error:
            if not self.tolerates_dropouts:
                self.recover(error, round=round)  # raises, naming a lost party
            raise

    def flush(self, *, round: int) -> None:
        """Deliver the closing gradients :meth:`update` held back now (before the parties'
        state is read or kept: at the end of training, before a checkpoint); a party lost on
        the way is dropped at step ``round``, as in :meth:`update`."""
        if self.own.deferred:
            self.send_or_drop([], round=round)


REJOINED = "rejoined"
"""The ``what`` of a ``faults`` entry that records a lost party's return (:meth:`Federation.
rejoin`); every other entry records a loss, with the error."""


def lost_parties(faults: Sequence[Mapping[str, Any]]) -> list[str]:
    """The parties that ``faults`` (in order) leaves lost at the end: lost, and not rejoined
    since."""
    last = {fault["party"]: fault["what"] for fault in faults}
    return [party for party, what in last.items() if what != REJOINED]


def split_tensors(data: VerticalData) -> dict[str, VerticalSplit]:
    """Every split of ``data`` by name: ``"train"`` and each test mechanism's label."""
    return {"train": data.train, **data.tests}


def build_federation(
    data: VerticalData,
    config: MethodConfig,
    *,
    seed: int,
    channel: Channel | None,
    aggregator: SumBackend | None,
    bottoms: Sequence[nn.Module] | None = None,
    heads: Mapping[int, Mapping[str, nn.Module]] | None = None,
    models: Mapping[tuple[int, str], nn.Module] | None = None,
    roles: Mapping[str, str] | None = None,
    default_role: str = "data-party",
    label_role: str | None = None,
    make_party: PartyMaker | None = None,
) -> Federation:
    """One data party per block, each with a fresh bottom model and its own SGD optimiser, the
    heads ``heads[k][key]`` and further bottoms ``models[(k, key)]`` at party ``k`` (with the
    labels), and an aggregation server running ``aggregator``, all attached to ``channel``.
    Returns the label party's (party 0's) view.

    Each party is made by :func:`build_party`. A channel that does not host a party
    (:meth:`~secure_vfl.federation.channel.Channel.hosts`: over the network, another process)
    leaves it out: that process builds it with the same function and seeds
    (:mod:`secure_vfl.deployment`). Parties are named by ``channel.party_names`` (default
    ``party-0``, ``party-1``, ...).

    Party ``k`` plays the role registered under ``default_role`` (``label_role`` for the label
    party) in :data:`~secure_vfl.federation.parties.ROLES`; ``roles`` replaces a data party's
    (an attacker is a subclass of the role it plays): ``{"party-2": "my-curious-party"}``. The
    label party (``party-0``) drives the run and keeps its role. ``make_party(k, role, blocks,
    model)`` builds party ``k`` with the role's own arguments (by default ``role(name, blocks,
    model, sgd(model), heads=...)``).
    """
    roles = dict(roles or {})
    channel = channel if channel is not None else Channel()
    party_names = channel.party_names or [party_name(k) for k in range(data.train.parties)]
    if len(party_names) != data.train.parties:
        raise ConfigError(
            f"{data.train.parties} party names expected (one per block). Found {party_names}."
        )
    names = [*party_names, AGGREGATOR]
    unknown = sorted(set(roles) - set(names[1:]))
    if unknown:
        raise ConfigError(
            f"roles can replace {', '.join(names[1:])}; found {', '.join(unknown)} (the label "
            f"party {names[0]} drives the run and keeps its role)."
        )
    splits = split_tensors(data)
    labels = {n: torch.from_numpy(s.labels) for n, s in splits.items()}
    parties = []
    for k in range(data.train.parties):
        if not channel.hosts(party_names[k]):
            continue
        own_role = label_role if k == 0 and label_role is not None else default_role
        party = build_party(
            k,
            party_names[k],
            blocks={name: torch.from_numpy(split.blocks[k]) for name, split in splits.items()},
            observed=data.train.mask[:, k],
            labels=labels,
            config=config,
            seed=seed,
            role=ROLES.get(roles.get(party_names[k], own_role)),
            bottom=bottoms[k] if bottoms is not None else None,
            heads=(heads or {}).get(k, {}),
            models={key: m for (j, key), m in (models or {}).items() if j == k},
            make_party=make_party,
            preprocessing=data.preprocessing[k] if data.preprocessing is not None else None,
            classes=data.classes if k == 0 else None,
        )
        party.connect(channel)
        parties.append(party)
    if not parties or parties[0].name != party_names[0]:
        raise ConfigError(
            f"the label party {party_names[0]} drives the run, so its channel must host it."
        )
    federation = Federation(
        data=label_party_view(data),
        names=list(party_names),
        own=parties[0],
        channel=channel,
        generator=torch.Generator().manual_seed(seed),
        rng=np.random.default_rng(seed),
        session=secrets.token_hex(8),
    )
    federation.dropped = [name for name in party_names[1:] if name in channel.absent]
    server = None
    if channel.hosts(AGGREGATOR):
        server = make_aggregation_server(aggregator, roles.get(AGGREGATOR, "aggregation-server"))
        server.connect(channel)
    for member in [*parties, *([server] if server is not None else [])]:
        member.driver = party_names[0]  # its requests and plans come from the label party only
    if isinstance(aggregator, SealingScheme):  # (split: repeated for the type checker)
        # Each party makes its own halves (its keys never leave it); keys meet by messages.
        for party in parties:
            install_halves(party, aggregator)
        if server is not None:
            server.install(aggregator.scheme, aggregator.adder())
        federation.scheme = aggregator.scheme
        local = {party.name: party.receives_sums for party in parties}
        receivers = [
            name for k, name in enumerate(party_names) if local.get(name, k in (heads or {}))
        ]
        federation.set_up_keys(receivers)
    return federation


def build_party(
    k: int,
    name: str,
    *,
    blocks: Mapping[str, Tensor],
    observed: np.ndarray,
    labels: Mapping[str, Tensor],
    config: MethodConfig,
    seed: int,
    role: RoleFactory,
    bottom: nn.Module | None = None,
    heads: Mapping[str, nn.Module] | None = None,
    models: Mapping[str, nn.Module] | None = None,
    make_party: PartyMaker | None = None,
    preprocessing: PartyPreprocessing | None = None,
    classes: tuple[object, ...] | None = None,
) -> DataParty:
    """Data party ``k`` named ``name``, as every run makes it, in one process or in its own
    (:mod:`secure_vfl.deployment`): its ``blocks`` per split, its bottom model (``bottom``, or
    a fresh one seeded ``seed + k``, pretrained with SimSiam on its ``observed`` training rows
    with seed ``seed + 500 + k`` if ``config.pretrain_epochs``), its own SGD optimiser, its
    ``heads`` (with ``labels``) and further bottoms ``models``, playing ``role`` (built by
    ``make_party`` if given), with its own preprocessing and, at the label party, the
    original label values ``classes``."""
    if bottom is None:
        with isolated_seed(seed + k):
            bottom = make_bottom(tuple(blocks["train"].shape[1:]), out=config.representation_dim)
        if config.pretrain_epochs > 0:
            own_rows = blocks["train"][torch.from_numpy(np.asarray(observed, dtype=bool))]
            with isolated_seed(seed + 500 + k):
                pretrain_simsiam(
                    bottom,
                    own_rows,
                    width=config.representation_dim,
                    epochs=config.pretrain_epochs,
                    batch_size=config.batch_size,
                    lr=config.lr,
                    generator=torch.Generator().manual_seed(seed + 500 + k),
                    progress=progress_of(name),
                )
    own_heads = {
        key: Head(labels, module, _optimizer(module, config), width=config.representation_dim)
        for key, module in (heads or {}).items()
    }
    if make_party is None:
        party = role(name, dict(blocks), bottom, sgd(bottom, config), heads=own_heads)
    else:
        party = make_party(k, role, dict(blocks), bottom)
    if not isinstance(party, DataParty):
        raise ConfigError(
            f"{name} holds a feature block, so its role must be a DataParty; found "
            f"{type(party).__name__}."
        )
    party.max_update_norm = config.max_update_norm
    for key, model in (models or {}).items():
        party.add_model(key, model, sgd(model, config))
    # Its own preprocessing, and the label values at the label party (its saved part).
    party.preprocessing = preprocessing
    if classes is not None:
        party.classes = cast(tuple[ClassValue, ...], classes)
    return party


def install_halves(party: DataParty, scheme: SealingScheme) -> None:
    """Give ``party`` its own halves of ``scheme``, made here (its keys never leave it): a
    sender half, and a receiver half if sums are delivered to it (it holds a head)."""
    party.install(
        scheme.scheme, scheme.sender(), scheme.receiver() if party.receives_sums else None
    )


def sgd(module: nn.Module, config: MethodConfig) -> torch.optim.Optimizer:
    """The optimiser of the LASER reference: SGD with momentum."""
    return torch.optim.SGD(
        module.parameters(),
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
    )


def _optimizer(module: nn.Module, config: MethodConfig) -> torch.optim.Optimizer | None:
    """A head's optimiser; None for a head with no parameters (``top_model="none"``)."""
    return sgd(module, config) if next(module.parameters(), None) is not None else None


@contextmanager
def isolated_seed(seed: int) -> Iterator[None]:
    """Seed torch's global RNG (used by parameter initialisation) inside this block only."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def random_predictions(mask: np.ndarray, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random class for every observed (sample, party): (N, K), -1 where absent."""
    out = rng.integers(0, num_classes, size=mask.shape).astype(np.int64)
    out[~mask] = -1
    return out


def broadcast_prediction(prediction: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Every observed party reports the one joint ``prediction`` (N,): (N, K), -1 where absent."""
    out = np.repeat(prediction.astype(np.int64)[:, None], mask.shape[1], axis=1)
    out[~mask] = -1
    return out


def batches(n: int, size: int) -> list[Tensor]:
    """Consecutive index batches over ``n`` rows (evaluation order)."""
    return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]


@dataclass
class TrainingProgress:
    """Where a training run stands, as the label party drives it: the epoch, the training steps
    done (``step``, the next step's round), the next batch of the epoch, the epoch's batch
    order (None until it is drawn), the loss summed so far in the epoch over the ``count`` rows
    its steps trained on and the mean loss of every finished epoch. :func:`train_epochs` starts
    from it and keeps it up to date, so a checkpoint taken between two steps resumes exactly
    there."""

    epoch: int = 0
    step: int = 0
    batch: int = 0
    order: list[np.ndarray] | None = None
    total: float = 0.0
    count: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)


class _Driven(Protocol):
    """A method object whose label party drives through ``fed``."""

    fed: Federation


_DrivenT = TypeVar("_DrivenT", bound=_Driven)
TrainStep = Callable[[_DrivenT, np.ndarray, int, int], float]


def stops_on_a_lost_party(step: TrainStep[_DrivenT]) -> TrainStep[_DrivenT]:
    """Decorates the ``train_step(rows, round, batch_id)`` of a method that does not go on
    without a data party: a ProtocolError it raises goes through :meth:`Federation.recover`,
    which, when a data party can no longer be reached (a deployment: its process died), stops
    the run with an error that names the party and says why."""

    @functools.wraps(step)
    def train_step(method: _DrivenT, rows_np: np.ndarray, round: int, batch_id: int) -> float:
        try:
            return step(method, rows_np, round, batch_id)
        except ProtocolError as error:
            method.fed.recover(error, round=round)  # raises: this method has no dropouts
            raise

    return train_step


FitT = TypeVar("FitT", bound=Callable[..., list[float]])


def fits_once(fit: FitT) -> FitT:
    """Decorate a method's ``fit``: a method trains once (its parties' rounds move on; a second
    fit was refused as a replay of round 0), and :attr:`Federation.fit` says whether it has."""

    @functools.wraps(fit)
    def once(self: Any, *args: Any, **kwargs: Any) -> list[float]:
        if self.fed.fit != "new":
            raise ConfigError(
                f"{self.name}: fit() was called on this method already ({self.fed.fit}); a "
                "method trains once: build another (build_method, with a new Channel) to "
                "train again."
            )
        self.fed.fit = "fitting"
        losses: list[float] = fit(self, *args, **kwargs)
        self.fed.fit = "trained"
        return losses

    return cast(FitT, once)


def train_epochs(
    step: Callable[[np.ndarray, int, int], float],
    sampler: BatchSampler,
    *,
    epochs: int,
    rng: np.random.Generator,
    on_step: StepCallback | None,
    progress: TrainingProgress | None = None,
    on_epoch: Callable[[int], object] | None = None,
    on_empty: Callable[[int], object] | None = None,
    trained: Callable[[np.ndarray], int] = len,
) -> list[float]:
    """Run ``step(rows, round, batch_id)`` over every batch of every epoch; mean loss per epoch.

    Each epoch's batch order is drawn whole from ``rng`` before its first step (every sampler
    draws its order before its first batch, so this is the order it would yield lazily), and
    ``progress`` (a fresh one by default) says where to start and follows every step.
    ``on_epoch(round)`` is called at the start of every epoch but the first, before its order
    is drawn (``round``: the step that comes next; a lost party may rejoin there).

    A batch of no rows (a Poisson draw that came out empty) is a step all the same: instead of
    ``step``, ``on_empty(round)`` tells the parties it passed (:meth:`Federation.pass_draw`),
    and ``on_step`` sees a loss of NaN; the epoch's mean loss is over the rows drawn.

    ``trained(rows)``, asked after the step, is how many of the batch's rows it trained on
    (every one by default; FALSE-VFL under secure sums skips rows without a posterior): the
    step's loss is their mean and weighs that many rows, and a step that trained on none shows
    ``on_step`` a loss of NaN.
    """
    progress = progress if progress is not None else TrainingProgress()
    while progress.epoch < epochs:
        if progress.order is None:
            if on_epoch is not None and progress.epoch > 0:
                on_epoch(progress.step)
            progress.order = list(sampler.epoch(rng))
        while progress.batch < len(progress.order):
            rows = progress.order[progress.batch]
            if len(rows):
                loss = step(rows, progress.step, progress.batch)
                count = trained(rows)
                if count:
                    progress.total += loss * count
                    progress.count += count
                else:
                    loss = math.nan
            else:
                loss = math.nan
                if on_empty is not None:
                    on_empty(progress.step)
            progress.step += 1
            progress.batch += 1
            if on_step is not None:
                on_step(progress.step, loss)
        progress.losses.append(progress.total / progress.count if progress.count else float("nan"))
        progress.epoch += 1
        progress.order, progress.batch, progress.total, progress.count = None, 0, 0.0, 0
    return list(progress.losses)


def in_process_parties(channel: Channel) -> list[DataParty]:
    """The data parties attached to ``channel``, in order: what the composition root of an
    in-process run (the privacy setup, tests, benchmarks) installs things in. No party's own
    program reaches another party this way."""
    return [party for party in channel.parties.values() if isinstance(party, DataParty)]
