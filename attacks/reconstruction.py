"""Feature reconstruction by the label party (the survey's data reconstruction, section V): an
inverse model maps what a party sent for a row back to that party's features.

The attacker is the label party ``party-0``, which drives the run: it plans every batch, so it
knows the rows of every representation or sum it is sent. It keeps its role; an observer
(:class:`RepresentationLog`, a channel layer on its ``incoming`` and ``outgoing`` hooks) keeps
what it sends and receives, nothing else. The auditor grants it an auxiliary set: a fraction of
the victim's training rows, their ids and their features. From the rows of that set it observed
it learns an inverse model (representation -> the victim's features, a small MLP: the decoder
of Zhang et al., "Privacy-preserving federated learning on partitioned attributes", 2021, as the
survey describes it; He et al., "Model inversion attacks against collaborative inference",
ACSAC 2019, the black-box inverse network), then reconstructs the victim's features of every
other row it observed.

- ``feature-reconstruction``: concatenation VFL (Standard VFL, PlugVFL), where the label party
  receives each party's representation of each row itself. A row's representation is the last
  one received for it in training (the bottom model at the end of training, within one epoch
  of drift for every row, as for the auxiliary rows).
- ``subset-differencing``: LASER with a single label party under a secure sum, where it
  receives only sums over 0 or >= 2 parties besides itself. Per sample it keeps its last
  ``window`` sums (under a secure sum one per step the sample is in: one per epoch) and the
  subsets it planned for them; its own term it knows (it sent it). If the victim's indicator
  lies in the span of the other parties' subset indicators, least squares over those sums
  isolates the victim's representation, exactly only if the models did not move between the
  steps (docs/privacy.md, "Secure aggregation": the leak the single-step planner leaves). The
  inverse model is learnt on the isolated estimates of the auxiliary rows. Where no sample's
  sums determine the victim's term (under secure sums the planner's block rule: with 4 parties
  every sum of a sample holds all three data parties), it inverts the sums themselves: the
  inverse model maps a sample's last sum that holds the victim's term (its own term taken out),
  and which parties that sum holds, to the victim's features, learnt on the auxiliary rows in
  the same way. A sum of the victim's representation and others' still says much of the victim's
  features (breast-cancer, 4 parties, 10 epochs, seed 0: gain 0.87): secure sums hide which
  party sent what, not what a sum over the parties' blocks reveals of each block. ``from_sums``
  says which path scored (1: the sums, 0: the isolated terms).

An honest-but-curious aggregation server is not an attacker here: it receives representations
(or masked shares) at positions of a batch but never the row ids (the label party's requests
go to the data parties), so it cannot pair them with an auxiliary set's rows.

Metrics: ``mse`` of the reconstructed rows' features, ``mse_baseline`` of guessing the
auxiliary set's column means, and ``gain = 1 - mse / mse_baseline`` (the headline; the attack
performance is ``max(0, gain)``, 0 at chance). Where the parties' features are correlated, the
label party's own block already says something of the victim's: ``mse_own`` is the error of
the same inverse model learnt on the auxiliary rows from the label party's own features
instead, and ``gain_over_own = 1 - mse / mse_own`` what the messages add to that (negative where
they say less than its own block). The negative control shuffles the
representations across rows before the inverse model sees them.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from attacks.base import Attack, AttackContext, register_attack
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig
from secure_vfl.federation.aggregator import sum_members
from secure_vfl.federation.messages import (
    HeadTask,
    Message,
    RepresentationMessage,
    RepresentRequest,
    SealedSumMessage,
    SumMessage,
)
from secure_vfl.federation.parties import Party, SecureSumParty

M = TypeVar("M", bound=Message)

LABEL_PARTY = "party-0"
CONCATENATION_METHODS = ("standard", "plugvfl")


@dataclass
class SumObservation:
    """What the label party learnt about one sample in one training step: the other parties
    whose terms its sum holds (``others``, a bool over every party, its own column False)
    and that sum with its own term taken out."""

    round: int
    others: np.ndarray
    value: np.ndarray


@dataclass
class RepresentationLog:
    """The label party's observer: a channel layer on its own hooks that keeps, by row, what it
    receives (representations from ``victim``, sums of its head tasks) and the rows and its own
    terms it sends. It passes every message on unchanged.

    ``label_party`` is the party it observes: a sealed sum is opened with that party's own key
    (what the party itself does on receipt).
    """

    victim: str
    label_party: SecureSumParty | None = None
    representations: dict[int, np.ndarray] = field(default_factory=dict)
    sums: dict[int, list[SumObservation]] = field(default_factory=dict)
    _requests: dict[tuple[int, int, str], RepresentRequest] = field(default_factory=dict)
    _tasks: dict[tuple[int, int, str], HeadTask] = field(default_factory=dict)
    _own: dict[tuple[int, int], RepresentationMessage] = field(default_factory=dict)

    def on_message(self, message: M) -> M:
        if isinstance(message, RepresentRequest) and message.phase == "train":
            if message.receiver == self.victim:
                self._forget(message.round)
                self._requests[(message.round, message.batch_id, message.tag)] = message
        elif isinstance(message, RepresentationMessage) and message.phase == "train":
            if message.sender == LABEL_PARTY:
                self._own[(message.round, message.batch_id)] = message
            elif message.sender == self.victim:
                self._keep_representation(message)
        elif isinstance(message, HeadTask):
            self._forget(message.round)
            self._tasks[(message.round, message.batch_id, message.tag)] = message
        elif isinstance(message, SealedSumMessage) and message.phase == "train":
            self._keep_sums(message, self._open(message))
        elif isinstance(message, SumMessage):
            self._keep_sums(message, message.sums.numpy())
        return message

    def _forget(self, round: int) -> None:
        """Drop what belongs to steps before ``round`` (each step's messages arrive in it)."""
        self._requests = {k: v for k, v in self._requests.items() if k[0] >= round}
        self._tasks = {k: v for k, v in self._tasks.items() if k[0] >= round}
        self._own = {k: v for k, v in self._own.items() if k[0] >= round}

    def _keep_representation(self, message: RepresentationMessage) -> None:
        request = self._requests.get((message.round, message.batch_id, message.tag))
        if request is None:
            return
        index = torch.searchsorted(request.positions, message.positions)
        rows = request.rows[index].tolist()
        values = message.representation.numpy()
        for row, value in zip(rows, values, strict=True):
            self.representations[row] = value.copy()

    def _open(self, message: SealedSumMessage) -> np.ndarray:
        opener = self.label_party.opener if self.label_party is not None else None
        if opener is None:
            raise ConfigError(f"{LABEL_PARTY} received sealed sums but holds no key to open them.")
        return opener.open(message.payload, members=sum_members(message), width=message.width)

    def _keep_sums(self, message: SumMessage | SealedSumMessage, sums: np.ndarray) -> None:
        task = self._tasks.get((message.round, message.batch_id, message.tag))
        if task is None:
            return
        own_column = task.parties.index(LABEL_PARTY)
        own = np.zeros((sums.shape[1], sums.shape[2]), dtype=np.float64)
        own_known = np.zeros(sums.shape[1], dtype=bool)
        mine = self._own.get((message.round, message.batch_id))
        if mine is not None:
            own[mine.positions.numpy()] = mine.representation.numpy()
            own_known[mine.positions.numpy()] = True
        # (T, B, K): what each sum it got is over, its task's or, delivered per part, its part's
        selection = (task.selection if task.parts is None else task.parts).numpy()
        rows = task.rows.tolist()
        for t in range(selection.shape[0]):
            for position, row in enumerate(rows):
                subset = selection[t, position]
                if not subset.any() or (subset[own_column] and not own_known[position]):
                    continue
                value = sums[t, position].astype(np.float64)
                if subset[own_column]:
                    value = value - own[position]
                others = subset.copy()
                others[own_column] = False
                self.sums.setdefault(row, []).append(
                    SumObservation(round=message.round, others=others, value=value)
                )


WEIGHT_DECAYS = (1e-3, 1e-2, 1e-1, 1.0)


def fit_inverse(
    representations: np.ndarray,
    features: np.ndarray,
    queries: np.ndarray,
    *,
    generator: torch.Generator,
    folds: int = 3,
) -> np.ndarray:
    """The features an inverse model learnt on the pairs ``(representations, features)``
    predicts for ``queries``. Its weight decay is the one of :data:`WEIGHT_DECAYS` with the
    lowest ``folds``-fold cross-validated error on the pairs: the attacker tunes on its own
    auxiliary set, so an inverse model without signal falls back to the features' means rather
    than fitting noise."""
    order = torch.randperm(len(representations), generator=generator).numpy()
    parts = np.array_split(order, min(folds, len(order)))
    errors = []
    for weight_decay in WEIGHT_DECAYS:
        error = 0.0
        for held in parts:
            kept = np.setdiff1d(order, held)
            predicted = _inverse_model(
                representations[kept],
                features[kept],
                representations[held],
                weight_decay=weight_decay,
                generator=generator,
            )
            error += float(((predicted - features[held]) ** 2).sum())
        errors.append(error)
    best = WEIGHT_DECAYS[int(np.argmin(errors))]
    return _inverse_model(
        representations, features, queries, weight_decay=best, generator=generator
    )


def _inverse_model(
    representations: np.ndarray,
    features: np.ndarray,
    queries: np.ndarray,
    *,
    weight_decay: float,
    generator: torch.Generator,
    hidden: int = 64,
    steps: int = 300,
) -> np.ndarray:
    """One inverse model (representation -> features, one hidden layer) fitted to the pairs by
    full-batch Adam, inputs and outputs standardised on the pairs; its predictions for
    ``queries``."""
    z = torch.as_tensor(representations, dtype=torch.float32)
    x = torch.as_tensor(features, dtype=torch.float32)
    z_mean, z_std = z.mean(dim=0), _scale(z)
    x_mean, x_std = x.mean(dim=0), _scale(x)
    first = nn.Linear(z.shape[1], hidden)
    last = nn.Linear(hidden, x.shape[1])
    for layer in (first, last):
        bound = 1 / np.sqrt(layer.in_features)
        with torch.no_grad():
            layer.weight.uniform_(-bound, bound, generator=generator)
            layer.bias.zero_()
    model = nn.Sequential(first, nn.ReLU(), last)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    inputs, targets = (z - z_mean) / z_std, (x - x_mean) / x_std
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(inputs) - targets) ** 2).mean()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        query = (torch.as_tensor(queries, dtype=torch.float32) - z_mean) / z_std
        predicted: Tensor = model(query) * x_std + x_mean
    return predicted.numpy().astype(np.float64)


def _scale(values: Tensor) -> Tensor:
    """The columns' standard deviations, at least 1e-6; 1 for a single row (undefined)."""
    if len(values) < 2:
        return torch.ones(values.shape[1])
    return values.std(dim=0).clamp(min=1e-6)


class _ReconstructionAttack(Attack):
    """What both reconstructions share: the label party as attacker, the auxiliary set the
    auditor grants, the inverse model and the scoring."""

    role: ClassVar[str | None] = None
    metric: ClassVar[str] = "gain"
    kind: ClassVar[str] = "reconstruction"
    counts: ClassVar[tuple[str, ...]] = (
        "isolated",
        "from_sums",
        "samples",
        "reconstructed_rows",
        "auxiliary_rows",
    )
    default_attacker: ClassVar[str] = LABEL_PARTY

    def __init__(self, victim: int = 1, auxiliary: float = 0.1) -> None:
        if not 0 < auxiliary < 1:
            raise ConfigError(
                f"the auxiliary share of the victim's rows must be in (0, 1). Found {auxiliary}."
            )
        self.victim = victim
        self.auxiliary = auxiliary
        self.log: RepresentationLog | None = None
        self._auxiliary_rows = np.zeros(0, dtype=np.int64)

    @property
    def victim_name(self) -> str:
        return f"party-{self.victim}"

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        if attacker != LABEL_PARTY:
            raise ConfigError(
                f"{self.name} is run by the label party {LABEL_PARTY}, the only party that knows "
                f"the rows of what it is sent (an aggregation server never learns row ids). "
                f"Found attacker {attacker!r}."
            )
        if not 1 <= self.victim < data.train.parties:
            passive = ", ".join(f"{k} (party-{k})" for k in range(1, data.train.parties))
            raise ConfigError(
                f"{self.name}'s victim: the index of a passive party expected, one of {passive}. "
                f"Found victim={self.victim}."
            )
        if len(data.block_shapes[self.victim]) != 1:
            raise ConfigError(
                f"{self.name} reconstructs tabular feature blocks; the victim's block has shape "
                f"{data.block_shapes[self.victim]}."
            )
        held = data.train.blocks[self.victim][data.train.mask[:, self.victim]]
        if self._granted(len(held)) >= len(held):
            raise ConfigError(
                f"{self.name}: auxiliary={self.auxiliary:g} grants "
                f"{self._granted(len(held))} of party-{self.victim}'s {len(held)} training rows, "
                "leaving none to reconstruct: expected a smaller share "
                "(--attack-option auxiliary=F)."
            )
        if len(held) and not (held != held[:1]).any():
            raise ConfigError(
                f"{self.name}: a victim whose features vary expected; party-{self.victim}'s "
                f"{held.shape[1]} features are the same in each of its {len(held)} training "
                "rows, so there is nothing to reconstruct (the baseline's column means are "
                "exact)."
            )

    def _granted(self, held: int) -> int:
        """How many of the victim's ``held`` training rows the auxiliary set grants."""
        return max(2, round(self.auxiliary * held))

    def prepare(self, party: Party, context: AttackContext) -> None:
        """Grant the auxiliary set (a share of the victim's training rows) and install the
        observer on the label party's own hooks: first among its incoming layers, so that it
        keeps what arrives before any layer of the party's own acts on it (the norm filter,
        which the label party runs, zeroes rows it would otherwise log as zeros: a curious party
        keeps the message as received), and last among its outgoing ones, so that it keeps its
        own terms as they were sent (what the sums it receives hold)."""
        held = np.flatnonzero(context.data.train.mask[:, self.victim])
        count = self._granted(len(held))
        self._auxiliary_rows = np.sort(context.rng.choice(held, size=count, replace=False))
        self.log = RepresentationLog(
            victim=self.victim_name,
            label_party=party if isinstance(party, SecureSumParty) else None,
        )
        party.incoming.insert(0, self.log)
        party.outgoing.append(self.log)

    @abstractmethod
    def observed(self, log: RepresentationLog) -> dict[int, np.ndarray]:
        """The victim's representation of each row the attacker holds one for."""

    def evaluate(self, party: Party, context: AttackContext) -> dict[str, float]:
        if self.log is None:
            raise ConfigError(f"{self.name}: evaluated before it was prepared.")
        return self._score(self.observed(self.log), context)

    def _score(self, observed: dict[int, np.ndarray], context: AttackContext) -> dict[str, float]:
        """Learn the inverse model on the auxiliary rows of ``observed`` (what the attacker holds
        of each row: the victim's representation, an isolated term or a sum) and score its
        reconstruction of the victim's features of the other rows; under the negative control
        ``observed`` is shuffled across rows first."""
        rows = np.fromiter(sorted(observed), dtype=np.int64, count=len(observed))
        if len(rows):
            representations = np.stack([observed[int(row)] for row in rows])
        else:
            representations = np.zeros((0, 1))
        if context.control:
            representations = representations[context.rng.permutation(len(rows))]
        known = np.isin(rows, self._auxiliary_rows)
        if known.sum() < 2 or (~known).sum() < 1:
            advice = "train longer or grant more rows" if known.sum() < 2 else "grant fewer rows"
            raise ConfigError(
                f"{self.name}: {known.sum()} auxiliary rows and {(~known).sum()} others "
                f"observed; it needs >= 2 and >= 1 ({advice}: --attack-option auxiliary=F)."
            )
        features = context.data.train.blocks[self.victim].astype(np.float64)
        seed = int(context.rng.integers(2**31))
        generator = torch.Generator().manual_seed(seed)
        reconstructed = fit_inverse(
            representations[known],
            features[rows[known]],
            representations[~known],
            generator=generator,
        )
        truth = features[rows[~known]]
        baseline = features[self._auxiliary_rows].mean(axis=0)
        mse = float(((reconstructed - truth) ** 2).mean())
        mse_baseline = float(((baseline - truth) ** 2).mean())
        # what the label party knew already: the victim's features regressed on its own block
        own = self._own_view(context)
        from_own = fit_inverse(
            own[rows[known]],
            features[rows[known]],
            own[rows[~known]],
            generator=torch.Generator().manual_seed(seed),
        )
        mse_own = float(((from_own - truth) ** 2).mean())
        return {
            "gain": _gain(mse, mse_baseline),
            "gain_over_own": _gain(mse, mse_own),
            "mse": mse,
            "mse_baseline": mse_baseline,
            "mse_own": mse_own,
            "reconstructed_rows": float((~known).sum()),
            "auxiliary_rows": float(known.sum()),
        }

    @staticmethod
    def _own_view(context: AttackContext) -> np.ndarray:
        """The label party's own features of every training row (flattened), and whether it
        holds the row: what it knows of a row without any message."""
        train = context.data.train
        own = train.blocks[0].reshape(len(train.labels), -1).astype(np.float64)
        return np.hstack([own, train.mask[:, :1].astype(np.float64)])

    def chance(self, context: AttackContext) -> float:
        """An inverse model without signal guesses the features' means: no gain."""
        return 0.0

    def performance(self, metrics: dict[str, float]) -> float:
        """``max(0, 1 - mse / mse_baseline)``: 0 at the column-mean guess, 1 exact."""
        return float(np.clip(_gain(metrics["mse"], metrics["mse_baseline"]), 0.0, 1.0))


def _gain(mse: float, mse_baseline: float) -> float:
    """``1 - mse / mse_baseline``; 0 where the baseline is exact (every reconstructed row's
    features equal the auxiliary set's means): nothing was left to gain."""
    return 1 - mse / mse_baseline if mse_baseline > 0 else 0.0


@register_attack
class FeatureReconstruction(_ReconstructionAttack):
    """The label party of concatenation VFL inverts the victim's representations."""

    name: ClassVar[str] = "feature-reconstruction"

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        super().check(config, data, attacker)
        if config.method not in CONCATENATION_METHODS:
            raise ConfigError(
                f"{self.name} reads each party's representation at the label party, which only "
                f"the concatenation methods ({', '.join(CONCATENATION_METHODS)}) send it; under "
                "LASER it receives sums (see subset-differencing). "
                f"Found --method {config.method}."
            )

    def observed(self, log: RepresentationLog) -> dict[int, np.ndarray]:
        return log.representations


@register_attack
class SubsetDifferencing(_ReconstructionAttack):
    """The label party of secure LASER isolates the victim's term from sums over different
    subsets in different steps, then inverts it; where no sample's term can be isolated, it
    inverts the sums that hold it."""

    name: ClassVar[str] = "subset-differencing"

    def __init__(self, victim: int = 1, auxiliary: float = 0.1, window: int = 5) -> None:
        super().__init__(victim, auxiliary)
        if window < 1:
            raise ConfigError(f"the window must be >= 1 step per sample. Found {window}.")
        self.window = window
        self._samples = 0
        self._isolated = 0

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        super().check(config, data, attacker)
        method = config.method_config
        if config.method != "laser" or method.heads != "active":
            raise ConfigError(
                f"{self.name} differences the sums a single label party receives: --method "
                f"laser --heads active. Found --method {config.method} --heads {method.heads}."
            )
        if method.secure_sums and data.train.parties < 4:
            raise ConfigError(
                f"{self.name} under secure sums needs >= 4 parties: with the label party and "
                "two others, the only releasable sums hold both others, so neither is ever "
                f"isolated. Found {data.train.parties}."
            )

    def observed(self, log: RepresentationLog) -> dict[int, np.ndarray]:
        victim = self.victim
        isolated: dict[int, np.ndarray] = {}
        for row, observations in log.sums.items():
            recent = observations[-self.window :]
            design = np.stack([o.others for o in recent]).astype(np.float64)
            target = np.stack([o.value for o in recent])
            used = np.asarray(design.any(axis=0))
            if not used[victim]:
                continue
            columns = np.flatnonzero(used)
            design = design[:, columns]
            probe = np.zeros(len(columns))
            probe[np.searchsorted(columns, victim)] = 1.0
            rank = np.linalg.matrix_rank(design)
            if np.linalg.matrix_rank(np.vstack([design, probe])) != rank:
                continue  # the victim's term is not determined by these sums
            solution, *_ = np.linalg.lstsq(design, target, rcond=None)
            isolated[row] = solution[np.searchsorted(columns, victim)]
        self._samples = len(log.sums)
        self._isolated = len(isolated)
        return isolated

    def summed(self, log: RepresentationLog) -> dict[int, np.ndarray]:
        """Per sample, its last sum that holds the victim's term (its own term taken out), with
        the indicator of the parties that sum holds appended: what the inverse model reads where
        no term is isolated."""
        summed: dict[int, np.ndarray] = {}
        for row, observations in log.sums.items():
            holding = [o for o in observations if o.others[self.victim]]
            if holding:
                last = holding[-1]
                summed[row] = np.concatenate([last.value, last.others.astype(np.float64)])
        return summed

    def evaluate(self, party: Party, context: AttackContext) -> dict[str, float]:
        """Score the isolated terms; where none was isolated, the sums that hold the victim's
        term (``from_sums`` 1)."""
        if self.log is None:
            raise ConfigError(f"{self.name}: evaluated before it was prepared.")
        isolated = self.observed(self.log)
        counts = {"isolated": float(self._isolated), "samples": float(self._samples)}
        if isolated:
            return {**self._score(isolated, context), **counts, "from_sums": 0.0}
        summed = self.summed(self.log)
        if not summed:
            raise ConfigError(
                f"{self.name}: none of the sums of the {self._samples} samples "
                f"{context.attacker} received holds {self.victim_name}'s term: there is nothing "
                "to invert (train longer, or choose a victim that holds training rows)."
            )
        return {**self._score(summed, context), **counts, "from_sums": 1.0}
