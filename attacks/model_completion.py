"""Label inference by model completion (Fu et al., "Label inference attacks against vertical
federated learning", USENIX Security 2022, the passive and active attacks).

A passive party's bottom model is trained by the federation to extract what its block says
about the labels. After training the attacker copies it, puts a small head on it and fits the
head on a few labelled rows (the auditor grants them: ``known`` per class, among the training
rows it holds) and its own unlabelled training rows; the completed model then reads the label
of any row it holds from its own block alone. The bottom model is kept as trained: Fu et al.
fine-tune it too, but with 40 labels that measured no better here and erased the gap to an
untrained bottom model (digits over 4 parties, Standard VFL, 5 epochs: 0.62 against 0.62),
since fine-tuning then forgets what the federation taught it.

- ``passive-model-completion``: the attacker follows the protocol exactly (an honest data
  party); the attack is all after training.
- ``active-model-completion``: the attacker also plays :class:`MaliciousOptimiserParty`, whose
  optimiser takes ``scale`` times the step the honest one would, so its bottom model learns
  faster and the label party's top model comes to rely on it more; it sends only well-formed
  messages (its representations, from its own bottom model). Then it completes its model as
  the passive attack does.

The semi-supervised step is self-training with confidence-thresholded pseudo-labels (Lee,
"Pseudo-label", ICML workshop 2013) instead of the paper's MixMatch: MixMatch and consistency
regularisation need data augmentations, which a party's column block of a tabular dataset has
none of, whereas pseudo-labelling needs nothing but the model's own confident predictions.

It is scored by balanced accuracy (the mean recall over the classes): the granted rows are
balanced, so a completion without signal guesses the classes alike and its plain accuracy sits
below the majority class's share on an imbalanced task, where a completion that reads labels can
sit too. Its controls: ``untrained_balanced_accuracy`` is the same completion started from a
freshly initialised bottom model of the same architecture (what the federation's training taught
the bottom model is the attack's signal), and the negative control (``control=True``) shuffles
the granted labels among the granted rows, so the completed model learns no labels and sits at
chance, 1/C. The untrained completion is the attack's no-signal level, AP* of the DCS against
chance (:meth:`PassiveModelCompletion.chance` says why). One shuffle
leaves about a tenth of the granted rows with their own class, and which ones moves the control
by up to 0.05 either side of chance (digits, 40 rows); the control therefore completes the model
once for each of ``CONTROL_SHUFFLES`` independent shuffles and reports the mean.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig
from secure_vfl.federation.messages import UpdateRequest
from secure_vfl.federation.parties import ROLES, DataParty, Party
from secure_vfl.methods.base import isolated_seed
from secure_vfl.models.networks import LinearHead

CONTROL_SHUFFLES = 8  # independent shuffles of the granted labels the negative control averages


class MaliciousOptimiserParty(DataParty):
    """A data party whose optimiser steps ``step_scale`` times as far as the honest one would
    (1: honest), on its bottom models only: after the honest update it moves every parameter
    from where it was by ``step_scale`` times the honest step.

    Fu et al.'s malicious optimiser scales the attacker's gradients adaptively within bounds; a
    constant factor is the simplest form of the same idea, and it is optimiser-agnostic.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.step_scale = 1.0

    def on_update(self, message: UpdateRequest) -> None:
        before = {
            key: [p.detach().clone() for p in model.parameters()]
            for key, model in self.models.items()
        }
        super().on_update(message)
        with torch.no_grad():
            for key, model in self.models.items():
                for parameter, old in zip(model.parameters(), before[key], strict=True):
                    parameter.copy_(old + self.step_scale * (parameter - old))


ROLES.register("malicious-optimiser-party", MaliciousOptimiserParty)


@dataclass(frozen=True)
class Completion:
    """How the attacker fine-tunes the head of its completed model.

    ``rounds`` of self-training: each trains the head for ``steps`` Adam steps (learning rate
    ``lr``) on the known rows and, from the second round, on a batch of ``batch_size`` of the
    unlabelled rows whose prediction is at least ``threshold`` confident, labelled with that
    prediction (weighted ``pseudo_weight``).
    """

    rounds: int = 4
    steps: int = 100
    lr: float = 1e-2
    threshold: float = 0.9
    pseudo_weight: float = 1.0
    batch_size: int = 128

    def __post_init__(self) -> None:
        for name in ("rounds", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be >= 1. Found {getattr(self, name)}.")
        if not self.lr > 0:
            raise ConfigError(f"`lr` must be > 0. Found {self.lr}.")
        if not 0 < self.threshold <= 1:
            raise ConfigError(f"`threshold` must be in (0, 1]. Found {self.threshold}.")
        if not self.pseudo_weight >= 0:
            raise ConfigError(f"`pseudo_weight` must be >= 0. Found {self.pseudo_weight}.")


def fresh_copy(model: nn.Module, seed: int) -> nn.Module:
    """A copy of ``model``'s architecture with freshly initialised parameters (every submodule
    with a ``reset_parameters``, as torch's layers have, is reset under ``seed``)."""
    fresh = copy.deepcopy(model)
    with isolated_seed(seed):
        for module in fresh.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return fresh


def complete_model(
    bottom: nn.Module,
    known_x: Tensor,
    known_y: Tensor,
    unlabelled_x: Tensor,
    *,
    num_classes: int,
    seed: int,
    settings: Completion,
) -> nn.Module:
    """``bottom`` (kept as it is) with a head on top that self-training fits to the known rows
    and the confidently pseudo-labelled unlabelled ones (see :class:`Completion`)."""
    bottom = copy.deepcopy(bottom).eval()
    with torch.no_grad():
        known_z, unlabelled_z = bottom(known_x), bottom(unlabelled_x)
    with isolated_seed(seed):
        head = LinearHead(known_z.shape[1], num_classes)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(head.parameters(), lr=settings.lr)
    pseudo_z, pseudo_y = unlabelled_z[:0], known_y[:0]
    for round_ in range(settings.rounds):
        if round_ > 0:
            with torch.no_grad():
                confidence, labels = F.softmax(head(unlabelled_z), dim=1).max(dim=1)
            keep = confidence >= settings.threshold
            pseudo_z, pseudo_y = unlabelled_z[keep], labels[keep]
        for _ in range(settings.steps):
            loss = F.cross_entropy(head(known_z), known_y)
            if len(pseudo_y):
                size = min(settings.batch_size, len(pseudo_y))
                pick = torch.randint(len(pseudo_y), (size,), generator=generator)
                loss = loss + settings.pseudo_weight * F.cross_entropy(
                    head(pseudo_z[pick]), pseudo_y[pick]
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return nn.Sequential(bottom, head).eval()


def _predict(model: nn.Module, x: Tensor) -> np.ndarray:
    with torch.no_grad():
        return np.asarray(model(x).argmax(dim=1).numpy(), dtype=np.int64)


def _data_party(party: Party, attack: str) -> DataParty:
    if not isinstance(party, DataParty):
        raise ConfigError(
            f"{attack} completes a data party's bottom model; found {type(party).__name__}."
        )
    return party


@register_attack
class PassiveModelCompletion(Attack):
    """The attacker's trained bottom model, completed with a head on ``known`` labelled rows
    per class and its unlabelled training rows, labels the rows it holds.

    Metrics: ``balanced_accuracy`` (the headline: the mean recall over the classes, chance 1/C
    whatever their shares; :func:`attacks.base.balanced_accuracy`) and ``accuracy`` on the test
    rows it holds (first test split), ``train_accuracy`` on the training rows it holds (the
    known rows excluded; absent when every one was granted), ``untrained_balanced_accuracy`` and
    ``untrained_accuracy`` of the same completion from a freshly initialised bottom model,
    ``known`` the number of granted rows. The granted rows are balanced (``known`` per class),
    so a completion without signal is no likelier to guess the majority class than another:
    on an imbalanced task its plain accuracy sits below the majority class's share, which an
    attack that reads labels may not reach either (German credit, 70/30).
    """

    name: ClassVar[str] = "passive-model-completion"
    role: ClassVar[str | None] = None  # an honest party of any method: it replaces no role
    metric: ClassVar[str] = "balanced_accuracy"
    counts: ClassVar[tuple[str, ...]] = ("known",)

    def __init__(self, known: int = 4, settings: Completion | None = None) -> None:
        if known < 1:
            raise ConfigError(f"{self.name} needs at least 1 known row per class. Found {known}.")
        self.known = known
        self.settings = settings if settings is not None else Completion()
        self._known_rows = np.zeros(0, dtype=np.int64)
        self._label_sets: list[np.ndarray] = []  # the granted labels; one set per shuffle
        self._untrained: float | None = None  # untrained_balanced_accuracy, once evaluated

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        super().check(config, data, attacker)
        refuse_label_holder(config, data, self.name, attacker)
        k = party_index(attacker)
        if not data.train.mask[:, k].any():
            raise ConfigError(f"{self.name}: {attacker} holds no training row.")
        test_name, test = next(iter(data.tests.items()))
        if not test.mask[:, k].any():  # the completed model is scored on those rows
            raise ConfigError(
                f"{self.name}: the completed model is scored on the rows of the first test split "
                f"that {attacker} holds; expected at least one. Found none in {test_name!r} "
                "(its missingness: --missing-test)."
            )

    def prepare(self, party: Party, context: AttackContext) -> None:
        """Grant ``known`` labelled rows per class among the training rows the attacker holds;
        under the negative control their labels are shuffled among them, ``CONTROL_SHUFFLES``
        times independently."""
        train = context.data.train
        held = train.mask[:, party_index(party.name)]
        chosen = []
        for label in range(context.data.num_classes):
            rows = np.flatnonzero(held & (train.labels == label))
            chosen.append(context.rng.choice(rows, size=min(self.known, len(rows)), replace=False))
        self._known_rows = np.sort(np.concatenate(chosen)).astype(np.int64)
        labels = train.labels[self._known_rows]
        self._label_sets = (
            [context.rng.permutation(labels) for _ in range(CONTROL_SHUFFLES)]
            if context.control
            else [labels]
        )

    def evaluate(self, party: Party, context: AttackContext) -> dict[str, float]:
        attacker = _data_party(party, self.name)
        data = context.data
        k = party_index(party.name)
        if len(self._known_rows) == 0:
            raise ConfigError(f"{self.name}: no rows were granted (prepare was not called).")
        held_train = np.flatnonzero(data.train.mask[:, k])
        unknown = np.setdiff1d(held_train, self._known_rows)
        test_name, test = next(iter(data.tests.items()))
        held_test = np.flatnonzero(test.mask[:, k])

        def rows(split: str, index: np.ndarray) -> Tensor:
            return attacker.block_rows(split, torch.from_numpy(index))

        known_x, unknown_x = rows("train", self._known_rows), rows("train", unknown)
        test_x = rows(test_name, held_test)
        seed = int(context.rng.integers(2**31))
        fresh = fresh_copy(attacker.model, seed)

        def complete(bottom: nn.Module, known_y: Tensor) -> nn.Module:
            return complete_model(
                bottom,
                known_x,
                known_y,
                unknown_x,
                num_classes=data.num_classes,
                seed=seed,
                settings=self.settings,
            )

        scores: dict[str, list[float]] = {}
        for labels in self._label_sets:  # one set, or the control's shuffles
            known_y = torch.from_numpy(labels)
            trained, untrained = complete(attacker.model, known_y), complete(fresh, known_y)
            truth = test.labels[held_test]
            predicted, untrained_predicted = _predict(trained, test_x), _predict(untrained, test_x)
            values = {
                "balanced_accuracy": balanced_accuracy(predicted, truth),
                "accuracy": _accuracy(predicted, truth),
                "untrained_balanced_accuracy": balanced_accuracy(untrained_predicted, truth),
                "untrained_accuracy": _accuracy(untrained_predicted, truth),
            }
            if len(unknown):  # none when every training row it holds was granted
                values["train_accuracy"] = _accuracy(
                    _predict(trained, unknown_x), data.train.labels[unknown]
                )
            for name, value in values.items():
                scores.setdefault(name, []).append(value)
        metrics = {name: float(np.mean(values)) for name, values in scores.items()}
        self._untrained = metrics["untrained_balanced_accuracy"]
        return metrics | {"known": float(len(self._known_rows))}

    def chance(self, context: AttackContext) -> float:
        """The same run's ``untrained_balanced_accuracy``: what this attacker reaches from its own
        block and granted labels with nothing the federation taught it. No defense of the
        protocol can take that from it, so it is where a perfect defense leaves the attack (as
        the backdoor's level is the same run's untriggered rate); against 1/C, or the majority
        class's share used before, the DCS charged a defense for the attacker's own data (digits,
        2 parties: 0.53 untrained against 0.10). Under the negative control, whose granted labels
        are shuffled, it sits at 1/C with the control. Scoring the gain over it instead would
        change AP itself: VFLAIR's DCS (AP* = 0) would no longer score the attack's success, and
        a gain divided by ``1 - untrained`` does not compare across tasks; so AP stays the
        balanced accuracy and the untrained completion is AP* of ``dcs_chance``."""
        if self._untrained is None:
            raise ConfigError(f"{self.name}: its chance level needs the attack evaluated first.")
        return self._untrained


def _accuracy(predicted: np.ndarray, labels: np.ndarray) -> float:
    return float((predicted == labels).mean()) if len(labels) else float("nan")


@register_attack
class ActiveModelCompletion(PassiveModelCompletion):
    """Model completion after training with a malicious optimiser: the attacker's steps are
    ``scale`` times the honest ones (set in :meth:`prepare`), so the top model relies more on
    its bottom model."""

    name: ClassVar[str] = "active-model-completion"
    role: ClassVar[str | None] = "malicious-optimiser-party"
    passive: ClassVar[bool] = False

    def __init__(
        self, known: int = 4, settings: Completion | None = None, *, scale: float = 3.0
    ) -> None:
        super().__init__(known, settings)
        if not scale >= 1:
            raise ConfigError(f"{self.name} scales its steps up: scale >= 1. Found {scale}.")
        self.scale = scale

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        super().check(config, data, attacker)
        refuse_latent_methods(
            config,
            self.name,
            "trains as a malicious split-network data party (passive-model-completion applies)",
        )

    def prepare(self, party: Party, context: AttackContext) -> None:
        if not isinstance(party, MaliciousOptimiserParty):
            raise ConfigError(
                f"{self.name} trains with a malicious optimiser; its attacker must play "
                f"'malicious-optimiser-party'. Found {type(party).__name__}."
            )
        party.step_scale = self.scale
        super().prepare(party, context)
