"""The gradient-replacement backdoor of a passive data party (the survey's backdoor attacks).

Liu, Yi and Chen ("Backdoor attacks and defenses in feature-partitioned collaborative
learning", arXiv 2007.03608, 2020; the survey's [63]) let a passive party that cannot touch the
labels plant a backdoor through the gradients it receives: it knows a few clean rows of the
target class, stamps a trigger into its own features of some training rows (the poisoned rows),
and whenever the gradient for its known target rows comes back it trains its bottom model on the
poisoned rows with that gradient, amplified by ``gamma``, instead of theirs. Its bottom model
learns to map the trigger where the top model reads the target class.

The attacker plays :class:`BackdoorParty`, a :class:`DataParty` with that plan:

- training: a poisoned row is answered with the trigger stamped into its features, and the
  gradient that comes back for it is replaced by ``gamma`` times the mean gradient of the
  known target rows in the same batch (a batch without one is left honest); its bottom
  model backpropagates that from its own output on the triggered row. What it *sends* for a
  poisoned row is chosen by ``swap``: ``"own"`` (default) the representation of the row's
  clean features, so the label party sees what an honest party would send; ``"target"`` the
  representation of a known target row drawn at random (the label replacement of Zou et al.,
  "Defending batch-level label inference and replacement attacks in vertical federated
  learning", IEEE TBD 2022, the survey's [70]); ``"none"`` the triggered representation itself
  (the paper's forward pass).
- prediction: it stamps the trigger into every row of the probe split it is queried on.

The replacement uses the target rows' gradients of the same batch, as the paper does. Reusing the
last batch's mean in a batch without a target row (tried first) makes the attacker's updates open-
loop: under gradient DP the stale noise vector pushed its bottom model the same way step after step
until training overflowed (breast-cancer, LASER, seed 0, ``dp-gradients:1:0.05``, step 21).

Where this differs from the paper: the paper forwards the triggered representation; the default
here forwards the clean one, because both alternatives teach the top model against the
backdoor: ``"none"`` pairs the triggered representation with the row's true (mostly
non-target) label, ``"target"`` pairs the target rows' representations with it. Measured on
breast-cancer (Standard VFL, 3 epochs, seed 1, gamma 10): with ``"target"`` the top model's
margin for the target on the attacker's own target rows turned negative and the ASR was 0.

The auditor scores it on probe splits (:meth:`Attack.probes`): the test rows the attacker holds
whose true class is not the target, relabelled as the target, queried once with the trigger
(accuracy there is the attack success rate, ASR) and once without it (the poisoned model's own
rate of predicting the target for them). Clean accuracy is the main accuracy on the untouched
test rows. The negative control (``control=True``) never poisons training but still stamps the
trigger at test time: the model is then the honest one, and its ASR is the rate at which the
honest model already predicts the target for triggered rows (the honest ASR baseline).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from attacks.base import (
    Attack,
    AttackContext,
    party_index,
    refuse_latent_methods,
    refuse_own_head_methods,
    register_attack,
)
from secure_vfl import checks
from secure_vfl.data.vertical import VerticalData, VerticalSplit
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig
from secure_vfl.federation.messages import (
    GradientMessage,
    RepresentationMessage,
    RepresentRequest,
)
from secure_vfl.federation.parties import ROLES, DataParty, Party

TRIGGERED = "backdoor/triggered"
UNTRIGGERED = "backdoor/untriggered"
CLEAN = "backdoor/clean"
SWAPS = ("own", "target", "none")


@dataclass(frozen=True)
class Trigger:
    """A fixed pattern in the attacker's own features: ``columns`` of its flattened block set to
    ``value``."""

    columns: tuple[int, ...]
    value: float

    def stamp(self, x: Tensor) -> Tensor:
        """A copy of the rows ``x`` with the trigger stamped in."""
        stamped = x.clone()
        stamped.view(x.shape[0], -1)[:, list(self.columns)] = self.value
        return stamped


@dataclass(frozen=True)
class BackdoorPlan:
    """What the attacker does: its known ``target_rows`` and ``poisoned`` rows (of its training
    table), the ``trigger``, the amplification ``gamma``, the probe splits it stamps at test time
    (``triggered_splits``) and whether it poisons training at all (``poison``: False in the
    negative control)."""

    target_rows: Tensor
    poisoned: Tensor  # bool over the rows of its training table
    trigger: Trigger
    gamma: float
    swap: str
    triggered_splits: frozenset[str]
    poison: bool


class BackdoorParty(DataParty):
    """A data party that plants a backdoor by gradient replacement (see the module docstring).

    With no plan it behaves exactly as an honest :class:`DataParty`.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.plan: BackdoorPlan | None = None
        self.generator = torch.Generator()
        self.replaced = 0  # gradient rows it replaced
        self._answering: RepresentRequest | None = None
        self._poisoned_positions: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}

    def arm(self, plan: BackdoorPlan, *, seed: int) -> None:
        """Take the plan; ``seed`` seeds its own draw of the target row swapped in."""
        self.plan = plan
        self.generator.manual_seed(seed)

    def _poisoning(self, request: RepresentRequest) -> bool:
        return (
            self.plan is not None
            and self.plan.poison
            and request.split == "train"
            and request.phase == "train"
        )

    def block_rows(self, split: str, rows: Tensor) -> Tensor:
        x = super().block_rows(split, rows)
        plan = self.plan
        if plan is None:
            return x
        if split in plan.triggered_splits:
            return plan.trigger.stamp(x)
        if split == "train" and plan.poison:
            stamped = plan.poisoned[rows]
            if bool(stamped.any()):
                x = x.clone()
                x[stamped] = plan.trigger.stamp(x[stamped])
        return x

    def on_represent_request(self, request: RepresentRequest) -> None:
        self._answering = request
        try:
            super().on_represent_request(request)
        finally:
            self._answering = None

    def contribute(self, message: RepresentationMessage) -> None:
        request = self._answering
        if request is None or self.plan is None or not self._poisoning(request):
            super().contribute(message)
            return
        plan = self.plan
        poisoned = plan.poisoned[request.rows]
        target = torch.isin(request.rows, plan.target_rows)
        if request.backward:
            for stale in [k for k in self._poisoned_positions if k[0] < request.round]:
                del self._poisoned_positions[stale]
            self._poisoned_positions[(request.round, request.tag)] = (
                request.positions[poisoned],
                request.positions[target],
            )
        if bool(poisoned.any()) and plan.swap != "none":
            if plan.swap == "target":
                draw = torch.randint(
                    len(plan.target_rows), (int(poisoned.sum()),), generator=self.generator
                )
                clean = super().block_rows("train", plan.target_rows[draw])
            else:
                clean = super().block_rows("train", request.rows[poisoned])
            model = self.models[request.model]
            with torch.no_grad():
                swapped = model(clean)
            representation = message.representation.clone()
            representation[poisoned] = swapped
            message = dataclasses.replace(message, representation=representation)
        super().contribute(message)

    def on_gradient(self, message: GradientMessage) -> None:
        marked = self._poisoned_positions.get((message.round, message.tag))
        if marked is None or self.plan is None:
            super().on_gradient(message)
            return
        poisoned = torch.isin(message.positions, marked[0])
        target = torch.isin(message.positions, marked[1])
        if bool(poisoned.any()) and bool(target.any()):
            gradient = message.gradient.clone()
            gradient[poisoned] = self.plan.gamma * message.gradient[target].mean(dim=0)
            self.replaced += int(poisoned.sum())
            message = dataclasses.replace(message, gradient=gradient)
        super().on_gradient(message)


ROLES.register("backdoor-party", BackdoorParty)


def _backdoor_party(party: Party, attack: str) -> BackdoorParty:
    if not isinstance(party, BackdoorParty):
        raise ConfigError(
            f"{attack} plants a backdoor through the gradients a party receives; its attacker "
            f"must play 'backdoor-party'. Found {type(party).__name__}."
        )
    return party


@register_attack
class GradientReplacementBackdoor(Attack):
    """A passive party's backdoor by gradient replacement; ASR on triggered non-target rows.

    ``target`` is the target class, ``known`` how many of its training rows (held by the
    attacker) the auditor grants (all it holds, if fewer: metric ``known_rows``),
    ``poison_fraction`` the share of its other training rows it poisons, ``gamma`` the
    amplification of the replaced gradients, ``trigger_columns`` how many columns of its block
    the trigger sets, to ``trigger_value``.
    """

    name: ClassVar[str] = "gradient-replacement-backdoor"
    role: ClassVar[str | None] = "backdoor-party"
    metric: ClassVar[str] = "asr"
    passive: ClassVar[bool] = False
    kind: ClassVar[str] = "backdoor"
    counts: ClassVar[tuple[str, ...]] = ("poisoned_rows", "replaced_gradients", "known_rows")

    def __init__(
        self,
        *,
        target: int = 0,
        known: int = 10,
        poison_fraction: float = 0.1,
        gamma: float = 1.5,
        trigger_columns: int = 3,
        trigger_value: float = -5.0,
        swap: str = "own",
    ) -> None:
        if isinstance(target, bool) or not isinstance(target, int) or target < 0:
            raise ConfigError(f"{self.name}: `target` must be a class index >= 0. Found {target}.")
        if isinstance(known, bool) or not isinstance(known, int) or known < 1:
            raise ConfigError(f"{self.name} needs at least 1 known target row. Found {known}.")
        if not 0 < poison_fraction < 1:
            raise ConfigError(
                f"{self.name}: `poison_fraction` must be in (0, 1). Found {poison_fraction}."
            )
        if not (gamma > 0 and np.isfinite(gamma)):
            raise ConfigError(f"{self.name}: `gamma` must be a positive number. Found {gamma}.")
        if isinstance(trigger_columns, bool) or trigger_columns < 1:
            raise ConfigError(
                f"{self.name}: `trigger_columns` must be a positive integer. Found "
                f"{trigger_columns!r}."
            )
        if not (np.isfinite(trigger_value) and abs(trigger_value) <= checks.FLOAT32_MAX):
            raise ConfigError(
                f"{self.name}: `trigger_value` must be a finite float32 number (|value| <= "
                f"{checks.FLOAT32_MAX:.6g}: it is stamped into float32 features). Found "
                f"{trigger_value}."
            )
        if swap not in SWAPS:
            raise ConfigError(
                f"{self.name}: `swap` must be one of {', '.join(SWAPS)}. Found {swap!r}."
            )
        self.swap = swap
        self.target = target
        self.known = known
        self.poison_fraction = poison_fraction
        self.gamma = gamma
        self.trigger_columns = trigger_columns
        self.trigger_value = trigger_value

    def check(self, config: TrainConfig, data: VerticalData, attacker: str) -> None:
        super().check(config, data, attacker)
        refuse_latent_methods(
            config,
            self.name,
            "replaces the representation gradients a split network's data party receives",
        )
        refuse_own_head_methods(
            config, self.name, "replaces the gradients another party's head sends its attacker"
        )
        if self.target >= data.num_classes:
            raise ConfigError(
                f"{self.name}: target class {self.target} is not one of the "
                f"{data.num_classes} classes."
            )
        k = party_index(attacker)
        held = data.train.mask[:, k] & (data.train.labels == self.target)
        if not held.any():
            raise ConfigError(
                f"{self.name}: {attacker} holds no training row of target class {self.target}."
            )
        split, test = next(iter(data.tests.items()))
        if not (test.mask[:, k] & (test.labels != self.target)).any():
            raise ConfigError(
                f"{self.name}: {attacker} holds no row of test split {split!r} of a class other "
                f"than the target {self.target}, on which the backdoor is probed (its block is "
                "missing from them). Expected a first test split with fewer blocks missing."
            )
        width = int(np.prod(data.train.blocks[k].shape[1:]))
        if self.trigger_columns > width:
            raise ConfigError(
                f"{self.name}: a trigger of {self.trigger_columns} columns in a block of "
                f"{width} column{'s' if width != 1 else ''}: {attacker}'s block is too narrow. "
                f"Expected --attack-option trigger_columns=N with N <= {width}, or fewer "
                "parties, so that each holds more columns."
            )

    def probes(self, context: AttackContext) -> dict[str, VerticalSplit]:
        """The test rows the attacker holds whose class is not the target, labelled as the
        target: accuracy on them is the share predicted as the target. Probed with the trigger
        (:data:`TRIGGERED`) and without (:data:`UNTRIGGERED`); and the untouched main test
        split (:data:`CLEAN`: its accuracy is the main accuracy)."""
        k = party_index(context.attacker)
        test = next(iter(context.data.tests.values()))
        rows = np.flatnonzero(test.mask[:, k] & (test.labels != self.target))
        probe = test.subset(rows)
        probe = dataclasses.replace(probe, labels=np.full(len(rows), self.target, dtype=np.int64))
        return {TRIGGERED: probe, UNTRIGGERED: probe, CLEAN: test}

    def prepare(self, party: Party, context: AttackContext) -> None:
        attacker = _backdoor_party(party, self.name)
        data = context.data
        k = party_index(party.name)
        held = np.flatnonzero(data.train.mask[:, k])
        of_target = held[data.train.labels[held] == self.target]
        target_rows = np.sort(
            context.rng.choice(of_target, size=min(self.known, len(of_target)), replace=False)
        )
        others = np.setdiff1d(held, target_rows)
        count = max(1, round(self.poison_fraction * len(others)))
        poisoned = np.zeros(data.train.n, dtype=bool)
        poisoned[context.rng.choice(others, size=count, replace=False)] = True
        width = int(np.prod(data.train.blocks[k].shape[1:]))
        columns = np.sort(context.rng.choice(width, size=self.trigger_columns, replace=False))
        attacker.arm(
            BackdoorPlan(
                target_rows=torch.from_numpy(target_rows),
                poisoned=torch.from_numpy(poisoned),
                trigger=Trigger(tuple(int(c) for c in columns), self.trigger_value),
                gamma=self.gamma,
                swap=self.swap,
                triggered_splits=frozenset({TRIGGERED}),
                poison=not context.control,
            ),
            seed=int(context.rng.integers(2**31)),
        )

    def evaluate(self, party: Party, context: AttackContext) -> dict[str, float]:
        probed = context.probed
        attacker = _backdoor_party(party, self.name)
        if attacker.plan is None or TRIGGERED not in probed:
            raise ConfigError(f"{self.name}: the attacker was never armed or never probed.")
        return {
            "asr": probed[TRIGGERED],
            "untriggered_asr": probed[UNTRIGGERED],
            "clean_accuracy": probed[CLEAN],
            # the rows it poisoned: none in the negative control, which only plans them
            "poisoned_rows": float(attacker.plan.poisoned.sum()) if attacker.plan.poison else 0.0,
            "replaced_gradients": float(attacker.replaced),
            # what ``known`` granted: at most the target rows the attacker holds
            "known_rows": float(len(attacker.plan.target_rows)),
        }

    def chance(self, context: AttackContext) -> float:
        """The rate at which the same federation predicts the target for the probe rows without
        the trigger (:data:`UNTRIGGERED`): what the model does for them anyway, so that the ASR
        above it is the trigger's doing. The negative control's ASR sits there (the honest model
        meets the trigger); the target class's share of the rows, used before, was far above
        both (0.37 on breast-cancer against a control at 0.00) and scored a working backdoor
        as defended."""
        if UNTRIGGERED not in context.probed:
            raise ConfigError(f"{self.name}: its chance level needs the probed rows.")
        return float(context.probed[UNTRIGGERED])
