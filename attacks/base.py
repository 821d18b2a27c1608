"""What every attack is: a role an attacker plays, the side knowledge an auditor grants it, and
the metrics the auditor scores it by.

An attack is an *auditor's* experiment. The attacker is one party (or an observer of what one
party receives) with only its own view: it is the registered role it plays (a subclass of the
honest role, :data:`~secure_vfl.federation.parties.ROLES`), plugged in by name, never an
``if attack:`` inside a method. The auditor (:mod:`attacks.runner`) holds the ground truth: it
grants the attacker its side knowledge before training (:meth:`Attack.prepare`, e.g. a few
labelled rows) and scores what the attacker infers after training (:meth:`Attack.evaluate`).

Every attack has a positive control (undefended, it succeeds) and a negative control
(``control=True``: the signal it reads is destroyed, e.g. its observations are shuffled across
rows, and it must sit at chance); both are tested.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from secure_vfl.data.vertical import VerticalData, VerticalSplit
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig
from secure_vfl.federation.parties import Party
from secure_vfl.methods.base import PARTY_MODELS
from secure_vfl.methods.laser import OWN_HEAD_METHODS
from secure_vfl.registry import Registry


def party_index(name: str) -> int:
    """The block index ``k`` of party ``party-k``."""
    return int(name.rsplit("-", 1)[1])


EPSILON_NOTE = (
    "epsilon: the largest party's, over what its defense noised; what a party sends without "
    "noise has none (each run's result.json lists it: privacy.unguarded), so against those "
    "messages the run's worst party is at inf."
)
"""What a sweep's and a suite's epsilon column is, said under its table."""
SCORED, DIVERGED, NOT_APPLICABLE = "scored", "diverged", "not applicable"
"""A sweep's or a suite's run's ``status``: scored; its training diverged (``step`` says where,
where known: a result of its defense's setting); or its defense does not apply to the task."""


def status_text(outcome: Mapping[str, Any]) -> str:
    """A run's ``status`` (with its ``step``) as a sweep or a suite shows it: ``diverged at step
    12`` (``diverged`` where no step is known), ``not applicable`` or ``scored``."""
    if outcome["status"] == DIVERGED and outcome["step"] is not None:
        return f"{DIVERGED} at step {outcome['step']}"
    return str(outcome["status"])


def unscored_text(name: str, outcome: Mapping[str, Any], why: str) -> str:
    """The line that says why the run ``name`` was not scored: ``name (diverged at step 3):
    why``, or ``name: not applicable: why``."""
    if outcome["status"] == DIVERGED:
        return f"{name} ({status_text(outcome)}): {why}"
    return f"{name}: {why}"


def unscored_note(diverged_steps: Sequence[int | None], not_applicable: int) -> str:
    """What a table's cell adds for the runs not scored: `` (2 diverged at steps 3, 5; 1 not
    applicable)`` (the steps known of the runs that diverged), or nothing."""
    said = []
    if diverged_steps:
        steps = ", ".join(str(step) for step in diverged_steps if step is not None)
        at = f" at step{'s' if ',' in steps else ''} {steps}" if steps else ""
        said.append(f"{len(diverged_steps)} {DIVERGED}{at}")
    if not_applicable:
        said.append(f"{not_applicable} {NOT_APPLICABLE}")
    return f" ({'; '.join(said)})" if said else ""


def balanced_accuracy(predicted: np.ndarray, labels: np.ndarray) -> float:
    """The mean over the classes in ``labels`` of the share of that class's rows ``predicted``
    gets right (NaN without rows). A guess that ignores the row, random or constant, scores
    1/C whatever the classes' shares, where plain accuracy credits a constant guess with the
    majority class's share and a guess shuffled among the rows with the sum of the squared
    shares (0.70 and 0.58 at 70/30): neither is where a label inference without signal sits on
    an imbalanced task, and an attack below the majority share may still read labels."""
    if not len(labels):
        return float("nan")
    recalls = [float((predicted[labels == label] == label).mean()) for label in np.unique(labels)]
    return float(np.mean(recalls))


def refuse_label_holder(
    config: TrainConfig, data: VerticalData, attack: str, attacker: str
) -> None:
    """ConfigError when ``attacker`` holds a head under ``config``, and with it the labels, for
    an ``attack`` that infers labels its attacker does not hold. Who holds a head is the method's
    own seed rule: under standard, plugvfl and FALSE-VFL only the label party, whatever
    ``heads`` says; under laser, local, ensemble and combinatorial with ``heads='all'`` every
    party."""
    heads = PARTY_MODELS.get(config.method)(
        config.method_config, data.block_shapes, data.num_classes, config.seed
    ).heads
    if party_index(attacker) in heads:
        advice = (
            "run it with --heads active"
            if config.method == "laser"
            else "run it on a method whose head and labels stay with the label party "
            "(laser --heads active, standard, plugvfl, false-vfl-1 or false-vfl-2)"
        )
        raise ConfigError(
            f"{attack} infers labels that the attacker does not hold, but under "
            f"--method {config.method} (heads={config.method_config.heads!r}) {attacker} "
            f"holds a head, and with it the labels; {advice}."
        )


def refuse_own_head_methods(config: TrainConfig, attack: str, needs: str) -> None:
    """ConfigError for local and ensemble, whose parties each train a head on their own
    representation only: no gradient crosses a party boundary; ``needs`` says what ``attack``
    uses."""
    if config.method in OWN_HEAD_METHODS:
        raise ConfigError(
            f"{attack} {needs}; under --method {config.method} each party trains its own head "
            "on its own representation only, so no party receives another's gradient (run it "
            "on laser, standard, plugvfl or combinatorial)."
        )


def refuse_latent_methods(config: TrainConfig, attack: str, needs: str) -> None:
    """ConfigError for FALSE-VFL, whose parties exchange latent samples and likelihoods, not a
    split network's representations and their gradients; ``needs`` says what ``attack`` uses."""
    if config.method.startswith("false-vfl"):
        raise ConfigError(
            f"{attack} {needs}; {config.method}'s parties exchange latent samples and "
            "likelihoods instead."
        )


@dataclass(frozen=True)
class AttackContext:
    """What the auditor holds for one attack run: the ground truth (``data``, never handed to the
    attacker whole), the attacker's name, a seeded generator for the side knowledge it grants
    and for shuffles, whether this is the negative control, and after training what the
    federation scored on the attack's probe splits."""

    data: VerticalData
    attacker: str
    rng: np.random.Generator
    control: bool = False
    # the trained federation's accuracy in [0, 1] on each probe split (filled after training)
    probed: Mapping[str, float] = field(default_factory=dict)


class Attack(ABC):
    """One threat of the survey, as an auditor's experiment.

    ``role`` is the registered role the attacker plays (``None``: it replaces no role and only
    observes what its party receives, through that party's ``incoming`` hooks). ``metric`` is the
    headline metric, ``higher_is_better`` says which way success goes for it.
    """

    name: ClassVar[str]
    role: ClassVar[str | None]
    metric: ClassVar[str]
    passive: ClassVar[bool] = True  # it does not change what the attacker sends
    # The threat it belongs to (the suite's T-DCS averages over the attacks of one kind).
    kind: ClassVar[str] = "label-inference"
    # the party that plays it unless the user names another
    default_attacker: ClassVar[str] = "party-1"
    # its metrics that are counts or class labels, not scores (shown as whole numbers)
    counts: ClassVar[tuple[str, ...]] = ()

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        """Raise ConfigError if the attack does not apply to this run."""
        passive = [f"party-{k}" for k in range(1, data.train.parties)]
        if attacker not in passive:
            raise ConfigError(
                f"{self.name} is run by a passive data party, one of {', '.join(passive)}. "
                f"Found attacker {attacker!r}."
            )

    def prepare(self, party: Party, context: AttackContext) -> None:  # noqa: B027
        """Grant ``party`` its side knowledge before training (nothing by default)."""

    def probes(self, context: AttackContext) -> dict[str, VerticalSplit]:
        """Test splits, by name, that the auditor also has the trained federation predict (e.g.
        triggered rows relabelled as a backdoor's target); none by default. The attacker is
        queried on them as on any test split."""
        return {}

    @abstractmethod
    def evaluate(self, party: Party, context: AttackContext) -> dict[str, float]:
        """Score what ``party`` infers from its own view after training (``context.probed``:
        the federation's accuracy in [0, 1] on each split of :meth:`probes`); the headline
        metric is under ``self.metric``."""

    @abstractmethod
    def chance(self, context: AttackContext) -> float:
        """The headline metric of an attacker without signal (the negative control's level)."""

    def performance(self, metrics: dict[str, float]) -> float:
        """The attack performance AP in [0, 1] that the defense capability score uses."""
        return float(np.clip(metrics[self.metric], 0.0, 1.0))


ATTACKS: Registry[Callable[[], Attack]] = Registry("attack")


def register_attack(cls: type[Attack]) -> type[Attack]:
    """Register the attack class ``cls`` under its ``name``; usable as a class decorator."""
    ATTACKS.register(cls.name, cls)
    return cls
