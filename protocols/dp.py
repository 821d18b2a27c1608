"""Differential privacy: clipped Gaussian releases as channel layers, DP-SGD, and their accountant.

Mechanisms and accounting are kept apart (as Opacus keeps its math in ``accountants/``): each
mechanism emits one small immutable :class:`GaussianRelease` event per noisy release, and a
:class:`PrivacyAccountant` groups the events per party and prices each party's sequence with
Opacus' RDP (Mironov, 2017; Mironov et al., 2019) or PRV (Gopi et al., 2021) accountant.

Mechanisms (the Gaussian mechanism, Dwork & Roth 2014, Thm A.1, on rows clipped to L2 norm C):

- :class:`EmbeddingNoise` clips every row of a data party's representations and adds
  N(0, (sigma C)^2) per coordinate; it protects that party's features from the receiver, and the
  privacy is spent by the sending data party.
- :class:`GradientNoise` does the same to the gradients a head sends back; they carry its labels,
  so it protects them from the data party receiving them, and the privacy is spent by the head
  (label) party. A gradient the label party sends to its own bottom model crosses no boundary
  and is left alone.
- :func:`make_private_party` runs DP-SGD (Abadi et al., CCS 2016) on a data party's bottom model
  with Opacus in the split pattern: ``representation.backward(grad)`` yields per-sample gradients,
  which are clipped and noised at each optimiser step.

Caveats stated, not hidden:

- Opacus' accountants assume Poisson sampling with rate ``sample_rate``; our samplers shuffle the
  training rows into fixed-size batches, so the amplification-by-subsampling bound is the usual
  approximation (as in most DP-SGD practice), not a proof for this sampler.
- Adjacency is add/remove of one record (Opacus' convention): a record changes one clipped row
  by at most C. For label-only adjacency (one label replaced), a gradient row can move by 2C, so
  the effective noise multiplier of a :class:`GradientNoise` release is sigma / 2.
- Every release that crosses the channel is noised, but only releases of training records
  (messages with ``phase == "train"``) are recorded: representations sent at prediction time
  concern the rows being predicted, not the training records the accountant protects.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from opacus import GradSampleModule
from opacus.accountants import IAccountant, PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.optimizers import DPOptimizer
from torch import Tensor

from secure_vfl.errors import ConfigError
from secure_vfl.federation.messages import GradientMessage, Message, RepresentationMessage
from secure_vfl.federation.parties import DataParty

ReleaseKind = Literal["embedding", "gradient", "dp-sgd", "statistics"]
AccountantName = Literal["rdp", "prv"]

_KINDS: tuple[str, ...] = ("embedding", "gradient", "dp-sgd", "statistics")
_ACCOUNTANTS: Mapping[str, type[IAccountant]] = {"rdp": RDPAccountant, "prv": PRVAccountant}

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class GaussianRelease:
    """One noisy release: a subsampled Gaussian mechanism whose privacy ``party`` spends.

    ``noise_multiplier`` is the noise std over the L2 sensitivity (the clip norm);
    ``sample_rate`` the fraction of the party's records the release touches.
    """

    party: str
    noise_multiplier: float
    sample_rate: float
    kind: ReleaseKind

    def __post_init__(self) -> None:
        if not self.party:
            raise ConfigError("A release must name the party that spends it. Found ''.")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ConfigError(
                f"`noise_multiplier` must be a finite number >= 0. Found {self.noise_multiplier}."
            )
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"`sample_rate` must be in (0, 1]. Found {self.sample_rate}.")
        if self.kind not in _KINDS:
            raise ConfigError(f"`kind` must be one of {', '.join(_KINDS)}. Found {self.kind!r}.")


EventCallback = Callable[[GaussianRelease], None]


class PrivacyAccountant:
    """Records releases (pass :meth:`on_event` to the mechanisms) and prices them per party.

    Each party's releases compose on their own: a party's epsilon covers its own records only.
    ``accountant`` names Opacus' accountant used for pricing: ``"rdp"`` (default) or ``"prv"``.
    """

    def __init__(self, *, accountant: AccountantName = "rdp") -> None:
        if accountant not in _ACCOUNTANTS:
            raise ConfigError(
                f"`accountant` must be one of {', '.join(_ACCOUNTANTS)}. Found {accountant!r}."
            )
        self.accountant = accountant
        self.events: list[GaussianRelease] = []

    def on_event(self, event: GaussianRelease) -> None:
        """Record one release."""
        self.events.append(event)

    def parties(self) -> list[str]:
        """The parties that have spent privacy, in order of their first release."""
        return list(dict.fromkeys(e.party for e in self.events))

    def history(self, party: str) -> list[tuple[float, float, int]]:
        """``party``'s releases as Opacus' history: (noise multiplier, sample rate, steps) runs."""
        runs: list[tuple[float, float, int]] = []
        for event in self.events:
            if event.party != party:
                continue
            if runs and runs[-1][:2] == (event.noise_multiplier, event.sample_rate):
                sigma, rate, steps = runs[-1]
                runs[-1] = (sigma, rate, steps + 1)
            else:
                runs.append((event.noise_multiplier, event.sample_rate, 1))
        return runs

    def epsilon(self, party: str, delta: float) -> float:
        """The epsilon ``party`` has spent at ``delta``: 0 with no release, inf if one was
        noiseless."""
        if not 0 < delta < 1:
            raise ConfigError(f"`delta` must be in (0, 1). Found {delta}.")
        history = self.history(party)
        if not history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in history):
            return math.inf
        pricer = _ACCOUNTANTS[self.accountant]()
        pricer.history = history
        return float(pricer.get_epsilon(delta=delta))

    def epsilons(self, delta: float) -> dict[str, float]:
        """The epsilon of every party that has released something, at ``delta``."""
        return {party: self.epsilon(party, delta) for party in self.parties()}


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    *,
    sample_rate: float,
    steps: int,
    accountant: AccountantName = "rdp",
) -> float:
    """The smallest noise multiplier (to Opacus' search tolerance) whose ``steps`` releases at
    ``sample_rate`` spend at most ``target_epsilon`` at ``delta`` (Opacus'
    ``get_noise_multiplier``)."""
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ConfigError(f"`target_epsilon` must be a positive number. Found {target_epsilon}.")
    if not 0 < delta < 1:
        raise ConfigError(f"`delta` must be in (0, 1). Found {delta}.")
    if not 0 < sample_rate <= 1:
        raise ConfigError(f"`sample_rate` must be in (0, 1]. Found {sample_rate}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"`steps` must be a positive integer. Found {steps!r}.")
    if accountant not in _ACCOUNTANTS:
        raise ConfigError(
            f"`accountant` must be one of {', '.join(_ACCOUNTANTS)}. Found {accountant!r}."
        )
    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
            epsilon_tolerance=0.005 * target_epsilon,
        )
    )


def parse_noise(text: str) -> tuple[float, float]:
    """Parse the CLI form ``"SIGMA:CLIP"`` (e.g. ``"1.1:1.0"``) into (noise multiplier, clip)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise ConfigError(f"Noise must be given as SIGMA:CLIP, e.g. 1.1:1.0. Found {text!r}.")
    try:
        sigma, clip = float(parts[0]), float(parts[1])
    except ValueError:
        raise ConfigError(
            f"Noise SIGMA:CLIP must be two numbers, e.g. 1.1:1.0. Found {text!r}."
        ) from None
    _check_noise(sigma, clip)
    return sigma, clip


def _check_noise(noise_multiplier: float, clip: float) -> None:
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ConfigError(
            f"The noise multiplier must be a finite number >= 0. Found {noise_multiplier}."
        )
    if not (clip > 0 and math.isfinite(clip)):
        raise ConfigError(f"The clip norm must be a positive number. Found {clip}.")


def clip_rows(rows: Tensor, clip: float) -> Tensor:
    """Scale every row whose L2 norm exceeds ``clip`` down to norm ``clip``; others unchanged."""
    norms = rows.norm(dim=1, keepdim=True)
    factor = torch.where(norms > clip, clip / norms.clamp(min=1e-12), torch.ones_like(norms))
    return rows * factor


class _RowNoise:
    """Clip each row to ``clip`` and add N(0, (noise_multiplier * clip)^2) per coordinate."""

    def __init__(
        self,
        noise_multiplier: float,
        clip: float,
        *,
        sample_rate: float,
        generator: torch.Generator,
        on_event: EventCallback,
    ) -> None:
        _check_noise(noise_multiplier, clip)
        if not 0 < sample_rate <= 1:
            raise ConfigError(f"`sample_rate` must be in (0, 1]. Found {sample_rate}.")
        self.noise_multiplier = float(noise_multiplier)
        self.clip = float(clip)
        self.sample_rate = float(sample_rate)
        self.generator = generator
        self.on_event = on_event

    def privatise(self, rows: Tensor) -> Tensor:
        """Clipped rows plus Gaussian noise, as a new tensor."""
        clipped = clip_rows(rows, self.clip)
        noise = torch.randn(
            clipped.shape, generator=self.generator, dtype=clipped.dtype, device=clipped.device
        )
        return clipped + noise * (self.noise_multiplier * self.clip)

    def release(self, party: str, kind: ReleaseKind) -> None:
        self.on_event(GaussianRelease(party, self.noise_multiplier, self.sample_rate, kind))


class EmbeddingNoise(_RowNoise):
    """Channel layer: Gaussian mechanism on every representation message (protects features).

    One :class:`GaussianRelease` of kind ``"embedding"`` per training message, spent by its
    sender. Other messages, and a party's message to itself (a label party's own block in a
    concatenation model), pass unchanged; the message passed in is never mutated.
    """

    def on_message(self, message: M) -> M:
        if not isinstance(message, RepresentationMessage) or message.sender == message.receiver:
            return message
        noisy = dataclasses.replace(message, representation=self.privatise(message.representation))
        if message.phase == "train":
            self.release(message.sender, "embedding")
        return noisy


class GradientNoise(_RowNoise):
    """Channel layer: Gaussian mechanism on every gradient message (protects the head's labels).

    One :class:`GaussianRelease` of kind ``"gradient"`` per message, spent by its sender (the
    label party). A gradient a party sends to itself (the label party's own bottom model)
    crosses no boundary and passes unchanged, unrecorded.
    """

    def on_message(self, message: M) -> M:
        if not isinstance(message, GradientMessage) or message.sender == message.receiver:
            return message
        noisy = dataclasses.replace(message, gradient=self.privatise(message.gradient))
        if message.phase == "train":
            self.release(message.sender, "gradient")
        return noisy


class _PartyDPOptimizer(DPOptimizer):
    """Opacus' DP optimiser that reports each noisy step as an event and skips empty steps.

    A step without per-sample gradients (the party sent nothing this round, or its gradient
    never came) releases nothing. The hooks' state of forward passes that never got a gradient
    (activations, forward counters) is reset at ``zero_grad``, so a later backward pass is
    neither paired with a stale forward nor left unpromoted.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        module: GradSampleModule,
        party: str,
        sample_rate: float,
        on_event: EventCallback,
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        self._module = module
        self._party = party
        self._sample_rate = sample_rate
        self._on_event = on_event

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if all(getattr(p, "grad_sample", None) is None for p in self.params):
            return None
        result = super().step(closure)
        self._on_event(
            GaussianRelease(self._party, self.noise_multiplier, self._sample_rate, "dp-sgd")
        )
        return result

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none)
        # Opacus pairs each backward with a pending forward and counts forwards per parameter,
        # promoting per-sample gradients only when the count returns to 0: a forward whose
        # gradient never came would otherwise leave every later backward unpromoted.
        for submodule in self._module.modules():
            if hasattr(submodule, "activations"):
                submodule.activations = []
            if hasattr(submodule, "max_batch_len"):
                del submodule.max_batch_len
        for p in self.params:
            p._forward_counter = 0
            if hasattr(p, "_current_grad_sample"):
                del p._current_grad_sample


def make_private_party(
    party: DataParty,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    sample_rate: float,
    on_event: EventCallback,
    generator: torch.Generator | None = None,
) -> DataParty:
    """Make ``party``'s bottom model train by DP-SGD (Opacus), in place; returns ``party``.

    The model is wrapped in ``GradSampleModule`` so the backward pass the party starts from the
    gradients it receives (``representation.backward(grad)``) computes per-sample gradients;
    its optimiser is replaced by Opacus' ``DPOptimizer`` over the same base optimiser, which
    clips each sample's gradient to ``max_grad_norm``, sums, and adds N(0, (sigma C)^2).

    Reductions are ``"sum"``: the received gradients are already those of the head's batch mean,
    so each row's gradient is that sample's contribution as is (no rescaling by the number of
    rows the party happened to observe, which varies per batch); ``max_grad_norm`` is therefore
    on the scale of the head's mean loss. One ``"dp-sgd"`` event per optimiser step.
    """
    # The bottom model's input needs no gradient, so torch notes that its full backward hook
    # fires on outputs only; that is what the split pattern wants, not a problem to show users.
    warnings.filterwarnings(
        "ignore",
        message="Full backward hook is firing when gradients are computed with respect to module",
        category=UserWarning,
    )
    _check_noise(noise_multiplier, max_grad_norm)
    if not 0 < sample_rate <= 1:
        raise ConfigError(f"`sample_rate` must be in (0, 1]. Found {sample_rate}.")
    if party.optimizer is None:
        raise ConfigError(f"{party.name}: DP-SGD needs the party's optimiser; found none.")
    if isinstance(party.model, GradSampleModule):
        raise ConfigError(f"{party.name}: the bottom model is already private.")
    module = GradSampleModule(party.model, loss_reduction="sum")
    base = party.optimizer
    party.model = module
    party.optimizer = _PartyDPOptimizer(
        base,
        module=module,
        party=party.name,
        sample_rate=sample_rate,
        on_event=on_event,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=None,
        loss_reduction="sum",
        generator=generator,
    )
    return party
