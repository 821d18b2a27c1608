"""Label inference from the gradients a passive party receives (the survey's gradient-based
label inference).

The attacker plays :class:`GradientObserver`: an honest data party that also keeps every
gradient it is sent, with the rows of its own table each gradient row is for. It follows the
protocol exactly (a passive, honest-but-curious party); what it keeps is what any party in its
role receives.

- ``direct-label-inference`` (Fu et al., "Label inference attacks against vertical federated
  learning", USENIX Security 2022, the direct attack): with no trainable top model the gradient
  a party receives for a row is ``(softmax(z) - onehot(y)) / c``, negative at the label only, so
  the label is the index of the most negative entry. Scored by balanced accuracy (the mean recall
  over the classes, :func:`attacks.base.balanced_accuracy`; chance 1/C), plain accuracy beside it.
- ``norm-scoring`` (Li et al., "Label leakage and protection in two-party split learning", ICLR
  2022): on an imbalanced binary task the rows of the rare class get larger gradients; the norm
  of each row's gradient scores it, ROC-AUC per batch.
- ``direction-scoring`` (same paper): a row's gradient points the way a known row's of the
  same class does; the cosine with the gradient of a known positive in the batch scores it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from torch import Tensor

from attacks.base import (
    Attack,
    AttackContext,
    balanced_accuracy,
    party_index,
    refuse_label_holder,
    refuse_latent_methods,
    register_attack,
)
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ConfigError, ProtocolError
from secure_vfl.experiment import TrainConfig
from secure_vfl.federation.messages import GradientMessage, RepresentRequest
from secure_vfl.federation.parties import ROLES, DataParty, Party


@dataclass(frozen=True)
class Observation:
    """One gradient message as its receiver saw it: its own table's ``rows`` and the gradient
    rows for them."""

    round: int
    sender: str
    rows: np.ndarray
    gradient: np.ndarray


class GradientObserver(DataParty):
    """A data party that keeps every training gradient it receives, mapped to its own rows.

    It learns which rows of its table each batch position holds from the requests it answers
    (its own view), and the gradients from the messages it is sent.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.observations: list[Observation] = []
        self._requested: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}

    def on_represent_request(self, request: RepresentRequest) -> None:
        super().on_represent_request(request)
        if request.phase == "train" and request.backward:
            self._requested = {
                key: value for key, value in self._requested.items() if key[0] >= request.round
            }
            self._requested[(request.round, request.tag)] = (request.positions, request.rows)

    def on_gradient(self, message: GradientMessage) -> None:
        super().on_gradient(message)  # refuses what is not owed
        asked = self._requested.get((message.round, message.tag))
        if asked is None:
            raise ProtocolError(f"{self.name}: a gradient for rows it was never asked for.")
        positions, rows = asked
        index = torch.searchsorted(positions, message.positions)
        self.observations.append(
            Observation(
                round=message.round,
                sender=message.sender,
                rows=rows[index].numpy().copy(),
                gradient=message.gradient.numpy().copy(),
            )
        )


ROLES.register("gradient-observer", GradientObserver)


def _observer(party: Party, attack: str) -> GradientObserver:
    if not isinstance(party, GradientObserver):
        raise ConfigError(
            f"{attack} reads the gradients a party receives; its attacker must play "
            f"'gradient-observer'. Found {type(party).__name__}."
        )
    return party


def _shuffled(rows: np.ndarray, context: AttackContext) -> np.ndarray:
    """The scored ``rows`` of a batch, permuted among themselves under the negative control
    (each gradient then belongs to a random one of them: the signal is destroyed, the labels
    scored are the same)."""
    if context.control:
        return context.rng.permutation(rows)
    return rows


def _refuse_observer(config: TrainConfig, data: VerticalData, attack: str, attacker: str) -> None:
    """What every label inference needs: a split network's gradients, received by a party that
    does not hold the labels."""
    refuse_latent_methods(
        config, attack, "reads the representation gradients a split network's data party receives"
    )
    refuse_label_holder(config, data, attack, attacker)


def _refuse_top_model(config: TrainConfig, attack: str) -> None:
    if config.method_config.top_model != "none":
        raise ConfigError(
            f"{attack} reads labels from gradients of the loss itself, which a party receives "
            "only when there is no trainable top model: --top-model none with "
            "--representation-dim equal to the number of classes. Found top model "
            f"{config.method_config.top_model!r}."
        )


@register_attack
class DirectLabelInference(Attack):
    """The label of a row is the most negative entry of its loss gradient."""

    name: ClassVar[str] = "direct-label-inference"
    role: ClassVar[str | None] = "gradient-observer"
    metric: ClassVar[str] = "balanced_accuracy"
    counts: ClassVar[tuple[str, ...]] = ("rows",)

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        super().check(config, data, attacker)
        _refuse_observer(config, data, self.name, attacker)
        _refuse_top_model(config, self.name)

    def evaluate(self, party: Party, context: AttackContext) -> dict[str, float]:
        observer = _observer(party, self.name)
        labels = context.data.train.labels
        guessed: list[np.ndarray] = []
        truths: list[np.ndarray] = []
        inferred: dict[int, int] = {}
        for observation in observer.observations:
            rows = _shuffled(observation.rows, context)
            # A blank row (a defense zeroed it: sparsification of a binary task's two entries of
            # equal magnitude) is scored too, as a guess of class 0: scoring only the rows left
            # readable credited the attack with 1.0 while half of them were blank.
            guess = observation.gradient.argmin(axis=1)
            guessed.append(guess)
            truths.append(labels[rows])
            live = np.abs(observation.gradient).sum(axis=1) > 0
            for row, blank in zip(rows[~live].tolist(), guess[~live].tolist(), strict=True):
                inferred.setdefault(row, blank)  # a row's last readable guess wins
            inferred.update(zip(rows[live].tolist(), guess[live].tolist(), strict=True))
        if not inferred:
            raise ConfigError(f"{self.name}: {observer.name} received no gradient to read.")
        every_guess, every_truth = np.concatenate(guessed), np.concatenate(truths)
        rows = np.fromiter(inferred, dtype=np.int64)
        guesses = np.fromiter(inferred.values(), dtype=np.int64)
        return {  # over every gradient row received, blank ones included
            "balanced_accuracy": balanced_accuracy(every_guess, every_truth),
            "accuracy": float((every_guess == every_truth).mean()),
            "rows_accuracy": float((guesses == labels[rows]).mean()),  # last readable guess per row
            "rows": float(len(rows)),
        }

    def chance(self, context: AttackContext) -> float:
        """1/C, the balanced accuracy of a guess without signal, where the negative control
        sits (its gradients belong to random rows of their batch)."""
        return 1.0 / context.data.num_classes


def _binary_positive(data: VerticalData, attack: str) -> int:
    """The rare class of a binary task: the one whose gradients the scores single out."""
    if data.num_classes != 2:
        raise ConfigError(
            f"{attack} scores the rows of a binary task; found {data.num_classes} classes."
        )
    counts = np.bincount(data.train.labels, minlength=2)
    return int(counts.argmin())


def _batch_auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """ROC-AUC of ``scores`` for ``positive`` rows; None when the batch has one class only."""
    if positive.all() or not positive.any():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(roc_auc_score(positive, scores))


class _ScoringAttack(Attack):
    """Scores each row of each batch a party receives gradients for; ROC-AUC per batch."""

    role: ClassVar[str | None] = "gradient-observer"
    metric: ClassVar[str] = "auc"
    counts: ClassVar[tuple[str, ...]] = ("batches", "positive_class")

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        super().check(config, data, attacker)
        _refuse_observer(config, data, self.name, attacker)
        _binary_positive(data, self.name)

    def scores(
        self, observation: Observation, known: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Scores of the batch's rows and which rows are scored (None: the batch is skipped)."""
        raise NotImplementedError

    def known_rows(self, party: Party, context: AttackContext) -> np.ndarray:
        """The rows whose labels the attacker knows (none by default)."""
        return np.zeros(0, dtype=np.int64)

    def evaluate(self, party: Party, context: AttackContext) -> dict[str, float]:
        observer = _observer(party, self.name)
        labels = context.data.train.labels
        positive_class = _binary_positive(context.data, self.name)
        known = self.known_rows(party, context)
        aucs = []
        for observation in observer.observations:
            scored = self.scores(observation, known)
            if scored is None:
                continue
            scores, keep = scored
            # Permuted among the scored rows only: a known row's label is never scored.
            rows = _shuffled(observation.rows[keep], context)
            auc = _batch_auc(scores[keep], labels[rows] == positive_class)
            if auc is not None:
                aucs.append(auc)
        if not aucs:
            raise ConfigError(
                f"{self.name}: no batch {observer.name} received gradients for held rows of both "
                "classes."
            )
        auc = float(np.mean(aucs))
        return {
            "auc": auc,
            "auc_median": float(np.median(aucs)),
            "separation": max(auc, 1.0 - auc),
            "batches": float(len(aucs)),
            "positive_class": float(positive_class),
        }

    def chance(self, context: AttackContext) -> float:
        return 0.5

    def performance(self, metrics: dict[str, float]) -> float:
        """AP: how well the scores separate the classes either way round, ``max(AUC, 1 - AUC)``
        (``separation``). Scores that rank the rare class last leak its labels as well as
        scores that rank it first, to an attacker who knows which class is rarer (Li et al.'s
        does): an AUC of 0.08 is not a defense (it scored DCS 1 against chance)."""
        return float(metrics["separation"])


@register_attack
class NormScoring(_ScoringAttack):
    """A row's score is the L2 norm of its gradient."""

    name: ClassVar[str] = "norm-scoring"

    def scores(
        self, observation: Observation, known: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        norms = np.linalg.norm(observation.gradient, axis=1)
        return norms, np.ones(len(norms), dtype=bool)


@register_attack
class DirectionScoring(_ScoringAttack):
    """A row's score is the cosine of its gradient with a known positive's in the same batch.

    The auditor grants the attacker the labels of ``known`` rows of the rare class (default 10,
    among the rows the attacker holds); a batch without one of them is not scored, and the known
    rows themselves are never scored.
    """

    name: ClassVar[str] = "direction-scoring"

    def __init__(self, known: int = 10) -> None:
        if known < 1:
            raise ConfigError(f"{self.name} needs at least 1 known positive. Found {known}.")
        self.known = known
        self._known: np.ndarray = np.zeros(0, dtype=np.int64)

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        """Also ConfigError when ``known`` grants every row of the rare class the attacker
        holds: the known rows are never scored, so no batch would hold a scored positive."""
        super().check(config, data, attacker)
        positive = _binary_positive(data, self.name)
        held = int(
            (data.train.mask[:, party_index(attacker)] & (data.train.labels == positive)).sum()
        )
        if self.known >= held:
            raise ConfigError(
                f"{self.name}: known={self.known} grants every one of the {held} training rows "
                f"of the rare class {positive} that {attacker} holds, and known rows are never "
                f"scored, leaving no positive to score: expected known < {held} "
                "(--attack-option known=N)."
            )

    def prepare(self, party: Party, context: AttackContext) -> None:
        data = context.data
        positive = _binary_positive(data, self.name)
        k = party_index(party.name)
        held = np.flatnonzero((data.train.labels == positive) & data.train.mask[:, k])
        count = min(self.known, len(held))
        self._known = np.sort(context.rng.choice(held, size=count, replace=False))

    def known_rows(self, party: Party, context: AttackContext) -> np.ndarray:
        return self._known

    def scores(
        self, observation: Observation, known: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        is_known = np.isin(observation.rows, known)
        if not is_known.any():
            return None
        reference = observation.gradient[is_known].mean(axis=0)
        norms = np.linalg.norm(observation.gradient, axis=1) * np.linalg.norm(reference)
        cosine = observation.gradient @ reference / np.maximum(norms, 1e-30)
        return cosine, ~is_known
