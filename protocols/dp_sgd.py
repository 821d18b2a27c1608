"""DP-SGD inside a party: its bottom model trained by Opacus' DP optimiser, per-sample gradients
either exact for ``nn.Linear``-only models (:class:`LinearCaptures`) or from Opacus' hooks.

Kept apart from :mod:`protocols.dp` (the releases and their accounting) because importing Opacus
takes seconds: a party that runs no DP-SGD, and every process of a run without DP, never
imports this module or Opacus.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from protocols._opacus import (
    DPOptimizer,
    GradSampleModule,
    _check_processed_flag,
    _mark_as_processed,
)
from protocols.dp import (
    GRAD_SAMPLE_MODES,
    EventCallback,
    GaussianRelease,
    GradSampleMode,
    _check_noise,
)
from protocols.noise import NoiseSource
from secure_vfl.errors import ConfigError
from secure_vfl.federation.messages import GradientMessage, Message, UpdateRequest
from secure_vfl.federation.parties import DataParty

M = TypeVar("M", bound=Message)


class StepTracker:
    """An incoming hook of a DP-SGD party: remembers the training step its last
    :class:`UpdateRequest` (or a gradient that closes the step, ``GradientMessage.step``)
    closes, so the optimiser's release is charged to that step."""

    def __init__(self) -> None:
        self.round = 0

    def on_message(self, message: M) -> M:
        if isinstance(message, UpdateRequest) or (
            isinstance(message, GradientMessage) and message.step
        ):
            self.round = message.round
        return message


class _PartyDPOptimizer(DPOptimizer):
    """Opacus' DP optimiser that draws its noise from a :class:`~protocols.noise.NoiseSource`
    and reports each noisy step as an event of the step ``tracker`` saw closed.

    Every update the driver sends closes one Poisson draw, and every draw takes one noisy
    step: one without per-sample gradients (a draw without the party's records, an empty draw,
    or a gradient that never came) is a noise-only step, as Opacus takes on an empty batch, so
    the steps taken are the ones the accountant prices whatever the sample held (a skipped
    step would tell an observer of the model that a draw missed the party's records). The
    hooks' state of forward passes that never got a gradient (activations, forward counters)
    is reset at ``zero_grad``, so a later backward pass is neither paired with a stale forward
    nor left unpromoted.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        module: nn.Module,
        party: str,
        sample_rate: float,
        noise: NoiseSource,
        tracker: StepTracker,
        on_event: EventCallback,
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        self._module = module
        self._party = party
        self._sample_rate = sample_rate
        self._noise = noise
        self._tracker = tracker
        self._on_event = on_event

    def add_noise(self) -> None:
        """Opacus' ``add_noise`` with the noise drawn from the party's noise source: the sum of
        clipped per-sample gradients plus N(0, (sigma C)^2) per coordinate."""
        std = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            summed = p.summed_grad
            _check_processed_flag(summed)
            draws = self._noise.gaussian(tuple(summed.shape), dtype=summed.dtype)
            p.grad = (summed + draws.to(summed.device) * std).view_as(p)
            _mark_as_processed(summed)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if all(getattr(p, "grad_sample", None) is None for p in self.params):
            result = self._noisy_step({})
        else:
            result = super().step(closure)
            self._released()
        return result

    def _noisy_step(self, sums: dict[Tensor, Tensor]) -> float | None:
        """Step on ``sums`` (each parameter's sum of clipped per-sample gradients; zero for
        one not in it: a noise-only step) plus the noise, and report the release."""
        for p in self.params:
            summed = sums.get(p)
            p.summed_grad = torch.zeros_like(p) if summed is None else summed.to(p.dtype)
        self.add_noise()
        result = self.original_optimizer.step()
        self._released()
        return result

    def _released(self) -> None:
        self._on_event(
            GaussianRelease(
                self._party, self.noise_multiplier, self._sample_rate, "dp-sgd", self._tracker.round
            )
        )

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none)
        # Opacus pairs each backward with a pending forward and counts forwards per parameter,
        # promoting per-sample gradients only when the count returns to 0: a forward whose
        # gradient never came would otherwise leave every later backward unpromoted.
        for submodule in self._module.modules():
            if hasattr(submodule, "activations"):
                submodule.activations = []  # type: ignore[assignment]
            if hasattr(submodule, "max_batch_len"):
                del submodule.max_batch_len
        for p in self.params:
            p._forward_counter = 0
            if hasattr(p, "_current_grad_sample"):
                del p._current_grad_sample


class LinearCaptures:
    """What exact per-sample gradients of a model's ``nn.Linear`` layers need, captured by hooks:
    each layer's input ``A`` (rows, in) on every training forward pass, and the gradient ``G``
    (rows, out) of its output when the backward pass reaches it.

    Row i's gradient of a layer is the outer product ``G_i A_i^T`` (weight) and ``G_i`` (bias),
    so its squared norm is ``|G_i|^2 (|A_i|^2 + 1)`` without forming it (Goodfellow 2015), and
    the sum of the rows' gradients, each scaled by c_i, is ``(c G)^T A``: one matrix product,
    as in a plain backward pass. Forward passes without a gradient (prediction, or a training
    pass whose gradient never came) are not used.
    """

    def __init__(self, module: nn.Module) -> None:
        self.layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
        self._passes: dict[nn.Linear, list[list[Tensor | None]]] = {m: [] for m in self.layers}
        for layer in self.layers:
            layer.register_forward_hook(self._forward)

    def _forward(self, layer: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if not (layer.training and torch.is_grad_enabled() and output.requires_grad):
            return
        entry: list[Tensor | None] = [inputs[0].detach(), None]
        self._passes[layer].append(entry)  # type: ignore[index]

        def keep(grad: Tensor) -> None:
            entry[1] = grad.detach() if entry[1] is None else entry[1] + grad.detach()

        output.register_hook(keep)

    def completed(self, layer: nn.Linear) -> list[tuple[Tensor, Tensor]]:
        """The (A, G) of ``layer``'s forward passes whose gradient came."""
        return [(a, g) for a, g in self._passes[layer] if a is not None and g is not None]

    def any_gradient(self) -> bool:
        return any(self.completed(layer) for layer in self.layers)

    def clear(self) -> None:
        for passes in self._passes.values():
            passes.clear()


def linear_only(module: nn.Module) -> bool:
    """Whether every trainable parameter of ``module`` is a weight or bias of an ``nn.Linear``
    (what :class:`LinearCaptures` computes exact per-sample gradients for)."""
    covered = {id(p) for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    trainable = [p for p in module.parameters() if p.requires_grad]
    return bool(trainable) and all(id(p) in covered for p in trainable)


def _clip_factors(squared_norms: Tensor, max_grad_norm: float) -> Tensor:
    """Opacus' per-sample clip factor: min(1, C / (norm + 1e-6))."""
    return (max_grad_norm / (squared_norms.sqrt() + 1e-6)).clamp(max=1.0)


def clipped_linear_sums(captures: LinearCaptures, max_grad_norm: float) -> dict[Tensor, Tensor]:
    """The sum over rows of each row's gradient clipped to ``max_grad_norm`` (its norm over every
    Linear parameter), per parameter, from the captured passes.

    One pass of 2-d inputs (a bottom MLP's step) never forms a per-sample gradient: the norms
    come from |G_i|^2 (|A_i|^2 + 1) and the sums from (c G)^T A. Otherwise (inputs with more
    dimensions, or several passes, whose rows are separate samples as Opacus' hooks treat
    passes that each had their backward) the per-sample gradients are formed, then clipped.
    """
    layers = [layer for layer in captures.layers if captures.completed(layer)]
    passes = [captures.completed(layer) for layer in layers]
    trained = [
        (layer.weight.requires_grad, layer.bias is not None and layer.bias.requires_grad)
        for layer in layers
    ]
    if all(len(p) == 1 and p[0][0].dim() == 2 for p in passes):
        squared = sum(
            (g * g).sum(1) * (weight * (a * a).sum(1) + bias)
            for (weight, bias), [(a, g)] in zip(trained, passes, strict=True)
        )
        factors = _clip_factors(torch.as_tensor(squared), max_grad_norm)
        sums: dict[Tensor, Tensor] = {}
        for layer, (weight, bias), [(a, g)] in zip(layers, trained, passes, strict=True):
            scaled = g * factors[:, None].to(g.dtype)
            if weight:
                sums[layer.weight] = scaled.T @ a
            if bias:
                sums[layer.bias] = scaled.sum(0)
        return sums
    samples: dict[Tensor, Tensor] = {}
    for layer, (weight, bias), completed in zip(layers, trained, passes, strict=True):
        if weight:
            weights = [torch.einsum("b...o,b...i->boi", g, a) for a, g in completed]
            samples[layer.weight] = torch.cat(weights)
        if bias:
            biases = [g.reshape(g.shape[0], -1, g.shape[-1]).sum(1) for _, g in completed]
            samples[layer.bias] = torch.cat(biases)
    norms = torch.stack([s.reshape(s.shape[0], -1).pow(2).sum(1) for s in samples.values()])
    factors = _clip_factors(norms.sum(0), max_grad_norm)
    return {p: torch.einsum("i,i...->...", factors.to(s.dtype), s) for p, s in samples.items()}


class _LinearDPOptimizer(_PartyDPOptimizer):
    """The party's DP optimiser on exact per-sample gradients of a Linear-only model
    (:class:`LinearCaptures`): the same clipping, noise, accounting and noise-only steps as
    :class:`_PartyDPOptimizer`, without Opacus' per-sample gradient tensors."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, captures: LinearCaptures, **kwargs: Any
    ):
        super().__init__(optimizer, **kwargs)
        self._captures = captures

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if closure is not None:
            with torch.enable_grad():
                closure()
        captured = self._captures.any_gradient()
        return self._noisy_step(
            clipped_linear_sums(self._captures, self.max_grad_norm) if captured else {}
        )

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in self.params:
            p.grad_sample = None
            p.summed_grad = None
        self.original_optimizer.zero_grad(set_to_none)
        self._captures.clear()


def make_private_party(
    party: DataParty,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    sample_rate: float,
    noise: NoiseSource,
    on_event: EventCallback,
    grad_sample_mode: GradSampleMode = "auto",
) -> DataParty:
    """Make ``party``'s bottom model train by DP-SGD (Opacus), in place; returns ``party``.

    The backward pass the party starts from the gradients it receives
    (``representation.backward(grad)``) yields per-sample gradients; its optimiser is replaced
    by Opacus' ``DPOptimizer`` over the same base optimiser, which clips each sample's gradient
    to ``max_grad_norm``, sums, and adds N(0, (sigma C)^2). ``grad_sample_mode`` says how the
    per-sample gradients are had: ``"hooks"`` wraps the model in Opacus' ``GradSampleModule``
    (any layer Opacus supports); ``"linear"`` computes them exactly for a model whose every
    trainable parameter is in an ``nn.Linear`` (the MLP bottoms) without forming them
    (:class:`LinearCaptures`, same clipped sums to float rounding, a fraction of the time);
    ``"auto"`` (default) takes ``"linear"`` where it applies, else ``"hooks"``.

    Reductions are ``"sum"``: the received gradients are already those of the head's batch mean,
    so each row's gradient is that sample's contribution as is (no rescaling by the number of
    rows the party happened to observe, which varies per batch); ``max_grad_norm`` is therefore
    on the scale of the head's mean loss. One optimiser step per update the party receives
    (every draw; noise only where no gradient came) and one ``"dp-sgd"`` event per step,
    charged to the step its :class:`UpdateRequest` closes (a :class:`StepTracker` in the
    party's incoming hooks). The noise comes from ``noise`` (Opacus' own generator is not
    used).
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
    if isinstance(party.model, GradSampleModule) or isinstance(party.optimizer, _PartyDPOptimizer):
        raise ConfigError(f"{party.name}: the bottom model is already private.")
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ConfigError(
            f"`grad_sample_mode` must be one of {', '.join(GRAD_SAMPLE_MODES)}. "
            f"Found {grad_sample_mode!r}."
        )
    linear = linear_only(party.model)
    if grad_sample_mode == "linear" and not linear:
        raise ConfigError(
            f"{party.name}: grad_sample_mode 'linear' needs a bottom model whose every "
            f"trainable parameter is in an nn.Linear; found {type(party.model).__name__} with "
            "others (use 'hooks' or 'auto')."
        )
    base = party.optimizer
    tracker = StepTracker()
    party.incoming.append(tracker)
    common: dict[str, Any] = {
        "party": party.name,
        "sample_rate": sample_rate,
        "noise": noise,
        "tracker": tracker,
        "on_event": on_event,
        "noise_multiplier": noise_multiplier,
        "max_grad_norm": max_grad_norm,
        "expected_batch_size": None,
        "loss_reduction": "sum",
    }
    if linear and grad_sample_mode != "hooks":
        captures = LinearCaptures(party.model)
        party.optimizer = _LinearDPOptimizer(base, captures=captures, module=party.model, **common)
        return party
    module = GradSampleModule(party.model, loss_reduction="sum")
    party.model = module
    party.optimizer = _PartyDPOptimizer(base, module=module, **common)
    return party
