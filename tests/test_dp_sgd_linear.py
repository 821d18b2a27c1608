"""DP-SGD of Linear-only bottoms on exact per-sample gradients that are never formed: the clipped
sums and the noised update equal a per-sample loop and Opacus' hooks mode to float tolerance."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from protocols.dp_sgd import (
    LinearCaptures,
    _LinearDPOptimizer,
    _PartyDPOptimizer,
    clipped_linear_sums,
    linear_only,
    make_private_party,
)
from protocols.noise import SeededNoise
from secure_vfl.errors import ConfigError
from secure_vfl.federation.parties import DataParty
from secure_vfl.models.networks import ConvBottom, MLPBottom


def batch(seed: int, rows: int = 24, features: int = 9, out: int = 8) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, features, generator=generator), torch.randn(
        rows, out, generator=generator
    )


def loop_oracle(model: nn.Module, x: torch.Tensor, upstream: torch.Tensor, clip: float) -> list:
    """Row by row: the gradient of <model(x_i), g_i>, clipped to ``clip`` (Opacus' factor),
    summed; float64, one autograd call per row."""
    model = copy.deepcopy(model).double()
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        out = model(x[i : i + 1].double())
        grads = torch.autograd.grad(out, params, grad_outputs=upstream[i : i + 1].double())
        norm = torch.sqrt(torch.stack([(g * g).sum() for g in grads]).sum())
        factor = min(1.0, clip / (float(norm) + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads, strict=True)]
    return total


@pytest.mark.parametrize("clip", [0.05, 1.0, 100.0])  # every row clipped ... none clipped
def test_clipped_sums_equal_a_per_sample_loop(clip: float) -> None:
    torch.manual_seed(0)
    model = MLPBottom(9, hidden=16, out=8)
    captures = LinearCaptures(model)
    x, upstream = batch(1)
    model(x).backward(upstream)
    sums = clipped_linear_sums(captures, clip)
    expected = loop_oracle(model, x, upstream, clip)
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(sums[p].double(), want, rtol=1e-5, atol=1e-7)


def test_two_passes_before_a_step_are_separate_samples_as_in_opacus_hooks() -> None:
    torch.manual_seed(0)
    model = MLPBottom(9, hidden=16, out=8)
    twin = copy.deepcopy(model)
    opacus = DataParty(
        "party-1", {"train": torch.zeros(1, 9)}, twin, torch.optim.SGD(twin.parameters(), lr=1.0)
    )
    make_private_party(
        opacus,
        noise_multiplier=0.0,
        max_grad_norm=0.2,
        sample_rate=0.1,
        noise=SeededNoise(0),
        on_event=lambda event: None,
        grad_sample_mode="hooks",
    )
    captures = LinearCaptures(model)
    for seed, rows in ((1, 24), (2, 16)):  # two passes, the second over fewer rows
        x, upstream = batch(seed, rows=rows)
        model(x).backward(upstream)
        opacus.model(x).backward(upstream)
    sums = clipped_linear_sums(captures, 0.2)
    assert isinstance(opacus.optimizer, _PartyDPOptimizer)
    opacus.optimizer.pre_step()
    for p, q in zip(model.parameters(), opacus.model.parameters(), strict=True):
        torch.testing.assert_close(sums[p], q.grad, rtol=1e-5, atol=1e-7)


def private_step(
    model: nn.Module, mode: str, x: torch.Tensor, upstream: torch.Tensor | None
) -> tuple[list[torch.Tensor], DataParty, list[Any]]:
    """One DP-SGD step of ``model`` (a copy) in ``mode``, noise injected from seed 7, on the
    gradient ``upstream`` of its output on ``x`` (None: no gradient came)."""
    model = copy.deepcopy(model)
    party = DataParty("party-1", {"train": x}, model, torch.optim.SGD(model.parameters(), lr=0.5))
    events: list[Any] = []
    make_private_party(
        party,
        noise_multiplier=0.7,
        max_grad_norm=0.3,
        sample_rate=0.1,
        noise=SeededNoise(7),
        on_event=events.append,
        grad_sample_mode=mode,  # type: ignore[arg-type]
    )
    if upstream is not None:
        party.model(x).backward(upstream)
    assert party.optimizer is not None
    party.optimizer.step()
    party.optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in party.model.parameters()], party, events


def test_the_noised_update_equals_opacus_hooks_mode_for_the_same_noise() -> None:
    torch.manual_seed(0)
    model = MLPBottom(9, hidden=32, out=8)
    x, upstream = batch(3)
    fast, party, events = private_step(model, "auto", x, upstream)
    reference, _, reference_events = private_step(model, "hooks", x, upstream)
    assert isinstance(party.optimizer, _LinearDPOptimizer)  # auto chose the exact path
    for a, b, p0 in zip(fast, reference, model.parameters(), strict=True):
        assert not torch.equal(a, p0)  # the step moved it
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [(e.kind, e.noise_multiplier) for e in events] == [("dp-sgd", 0.7)]
    assert events == reference_events


@pytest.mark.parametrize("mode", ["linear", "hooks"])
def test_an_update_without_gradients_is_a_noise_only_step(mode: str) -> None:
    """A draw that brought the party no gradient (none of its records, or no row at all) is
    still one step, of zero clipped gradients plus the noise, as Opacus takes on an empty
    batch: SGD at learning rate 0.5 moves each parameter by -0.5 sigma C times the noise drawn,
    and the accountant is told of one release. (Skipping it, as before, took fewer steps than
    were priced, and how many fewer depended on the sample.)"""
    torch.manual_seed(0)
    model = MLPBottom(9, hidden=16, out=8)
    after, _, events = private_step(model, mode, torch.zeros(1, 9), None)
    expected = SeededNoise(7)
    for p, p0 in zip(after, model.parameters(), strict=True):
        noise = expected.gaussian(tuple(p.shape), dtype=p.dtype) * (0.7 * 0.3)
        torch.testing.assert_close(p, p0.detach() - 0.5 * noise)
    assert [(e.kind, e.noise_multiplier) for e in events] == [("dp-sgd", 0.7)]


def test_a_layer_without_bias_and_frozen_layers_are_handled() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 12, bias=False), nn.ReLU(), nn.Linear(12, 8))
    model[2].bias.requires_grad_(False)
    captures = LinearCaptures(model)
    x, upstream = batch(4)
    model(x).backward(upstream)
    sums = clipped_linear_sums(captures, 0.5)
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = loop_oracle(model, x, upstream, 0.5)
    for p, want in zip(trainable, expected, strict=True):
        torch.testing.assert_close(sums[p].double(), want, rtol=1e-5, atol=1e-7)


def test_prediction_passes_are_not_captured() -> None:
    model = MLPBottom(9, hidden=8, out=4)
    captures = LinearCaptures(model)
    x, _ = batch(5, out=4)
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert not captures.any_gradient()
    assert all(not captures._passes[layer] for layer in captures.layers)


def test_auto_keeps_opacus_for_other_bottoms_and_linear_refuses_them() -> None:
    conv = ConvBottom(1, out=8, width=4)
    assert linear_only(MLPBottom(4)) and not linear_only(conv)
    party = DataParty(
        "party-1",
        {"train": torch.zeros(2, 1, 7, 7)},
        conv,
        torch.optim.SGD(conv.parameters(), lr=0.1),
    )
    options: dict[str, Any] = {
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "sample_rate": 0.1,
        "noise": SeededNoise(0),
        "on_event": lambda event: None,
    }
    with pytest.raises(ConfigError, match="grad_sample_mode 'linear' needs a bottom model"):
        make_private_party(party, grad_sample_mode="linear", **options)
    with pytest.raises(ConfigError, match="grad_sample_mode"):
        make_private_party(party, grad_sample_mode="ghost", **options)  # type: ignore[arg-type]
    make_private_party(party, **options)
    assert type(party.optimizer) is _PartyDPOptimizer  # Opacus' hooks
    with pytest.raises(ConfigError, match="already private"):
        make_private_party(party, **options)
