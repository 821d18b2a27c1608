"""The deep latent variable model of FALSE-VFL (paper section 3.3, figure 2, appendix A.2).

Feature side, one of each per data party k: an encoder giving the mean and diagonal precision of
its factor of q(h | x^k), a decoder p(x^k | h) and, for FALSE-VFL-II, a missingness model
p(m^k | x^k). Label side, at the label party: the global encoder q(z | h), the global decoder
p(h | z) and the discriminator p(y | h). All are small MLPs over flattened blocks, sized for a
2-core CPU, with the depths of the paper's Table 6 MLP column (party encoder and decoder 2 layers,
missingness model, global encoder and decoder 3, discriminator 2); image patches get the
baselines' two-block CNN as encoder (the paper: ResNet-18) and an MLP decoder (the paper: a
transposed CNN).

Choices the paper leaves open:
- p(x^k | h) is a diagonal Gaussian whose mean is an MLP of h and whose per-feature scale is a
  learned parameter (homoscedastic; ``softplus + MIN_SCALE``). A scale that depends on h can
  collapse onto a single training point and blow the likelihood up. Blocks are standardised, so
  a floor of 0.1 costs little, and it keeps constant features (image borders) from dominating
  the importance weights with near-zero scales.
- q(z | h) and p(h | z) are diagonal Gaussians with MLP means and softplus scales; p(z) = N(0, I).
- A party's precision is ``softplus + MIN_PRECISION`` per coordinate, so every observed party
  tightens the aggregated posterior (appendix B.2).
- p(m^k | x^k) is one Bernoulli per block (m^k = 1: block missing) with an MLP logit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from secure_vfl.models.networks import ConvBottom

MIN_SCALE = 0.1
MIN_PRECISION = 1e-3
_LOG_2PI = math.log(2.0 * math.pi)


def gaussian_log_prob(x: Tensor, mean: Tensor, scale: Tensor) -> Tensor:
    """log N(x; mean, diag(scale^2)), summed over the last dimension."""
    z = (x - mean) / scale
    return (-0.5 * z.pow(2) - scale.log() - 0.5 * _LOG_2PI).sum(dim=-1)


def mlp(widths: Sequence[int]) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them (none after the last)."""
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


Draws = Callable[[tuple[int, ...]], Tensor]
"""Standard normal draws of a given shape (rows first)."""


def generator_draws(generator: torch.Generator) -> Draws:
    """Independent draws from ``generator``, every row its own."""
    return lambda shape: torch.randn(shape, generator=generator)


def row_shared_draws(seed: int) -> Draws:
    """Draws that are the same for every row: each call draws one row's worth, (1, ...), from
    a generator seeded with ``seed`` (the k-th call its k-th draws), and broadcasts it to the
    rows. Used from a fresh one per batch, it makes what a row's values are computed from a
    function of the row alone, not of its place among the others or of earlier calls."""
    generator = torch.Generator().manual_seed(seed)
    return lambda shape: torch.randn((1, *shape[1:]), generator=generator).expand(shape)


class PartyEncoder(nn.Module):
    """x^k -> (mean, diagonal precision) of party k's factor of q(h | x_obs) (paper eq. 1).

    Tabular blocks get a 2-layer MLP; image patches (C, H, W) the same two-block CNN as the
    baselines' bottom models (:class:`~secure_vfl.models.networks.ConvBottom`), so that FALSE-VFL
    and the baselines it is compared with share their feature extractor, as in the paper
    (ResNet-18 for both there).
    """

    def __init__(self, block_shape: Sequence[int], latent: int, *, hidden: int) -> None:
        super().__init__()
        if len(block_shape) == 3:
            self.net: nn.Module = nn.Sequential(
                ConvBottom(block_shape[0], out=hidden), nn.ReLU(), nn.Linear(hidden, 2 * latent)
            )
            self.flatten = False
        else:
            self.net = mlp([math.prod(block_shape), hidden, 2 * latent])
            self.flatten = True
        self.latent = latent

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = self.net(x.flatten(1) if self.flatten else x)
        mean, raw = out.split(self.latent, dim=-1)
        return mean, F.softplus(raw) + MIN_PRECISION


class PartyDecoder(nn.Module):
    """p(x^k | h): a diagonal Gaussian with an MLP mean and learned per-feature scales."""

    def __init__(self, latent: int, features: int, *, hidden: int) -> None:
        super().__init__()
        self.net = mlp([latent, hidden, features])
        self.raw_scale = nn.Parameter(torch.zeros(features))

    def scale(self) -> Tensor:
        return F.softplus(self.raw_scale) + MIN_SCALE

    def log_prob(self, x: Tensor, h: Tensor) -> Tensor:
        """log p(x | h) for flattened ``x`` (..., D) broadcast against ``h`` (..., d_h)."""
        return gaussian_log_prob(x, self.net(h), self.scale())

    def sample(self, h: Tensor, draws: Draws) -> Tensor:
        """A reparameterised draw x ~ p(x | h) (..., D); gradients flow to ``h`` and the decoder."""
        mean = self.net(h)
        return mean + self.scale() * draws(tuple(mean.shape))


class MissingnessModel(nn.Module):
    """p(m^k | x^k): a Bernoulli on whether block k is missing (FALSE-VFL-II, appendix A.2)."""

    def __init__(self, features: int, *, hidden: int) -> None:
        super().__init__()
        self.net = mlp([features, hidden, hidden, 1])

    def log_prob(self, x: Tensor, missing: bool) -> Tensor:
        """log p(m^k = missing | x) for flattened ``x`` (..., D): shape (...)."""
        logit = self.net(x).squeeze(-1)
        return F.logsigmoid(logit) if missing else F.logsigmoid(-logit)


class PartyLatentModel(nn.Module):
    """Everything one data party holds: its encoder, decoder and (variant II) missingness model."""

    def __init__(
        self, block_shape: Sequence[int], latent: int, *, hidden: int, missingness: bool
    ) -> None:
        super().__init__()
        features = math.prod(block_shape)
        self.encoder = PartyEncoder(block_shape, latent, hidden=hidden)
        self.decoder = PartyDecoder(latent, features, hidden=hidden)
        self.missingness = MissingnessModel(features, hidden=hidden) if missingness else None

    def forward(self, x: Tensor) -> Tensor:
        """What the party sends for the posterior: concat[mean, precision] of its factor."""
        return torch.cat(self.encoder(x), dim=-1)


class GaussianMap(nn.Module):
    """An MLP giving the mean and scale of a diagonal Gaussian over ``out`` given ``inp``."""

    def __init__(self, inp: int, out: int, *, hidden: int) -> None:
        super().__init__()
        self.net = mlp([inp, hidden, hidden, 2 * out])
        self.out = out

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean, raw = self.net(x).split(self.out, dim=-1)
        return mean, F.softplus(raw) + MIN_SCALE


class LabelSideModel(nn.Module):
    """The label party's modules: q(z | h), p(h | z) and the discriminator p(y | h)."""

    def __init__(self, latent: int, global_latent: int, classes: int, *, hidden: int) -> None:
        super().__init__()
        self.global_latent = global_latent
        self.global_encoder = GaussianMap(latent, global_latent, hidden=hidden)
        self.global_decoder = GaussianMap(global_latent, latent, hidden=hidden)
        self.discriminator = mlp([latent, hidden, classes])

    def generative_parameters(self) -> list[nn.Parameter]:
        """The label side's share of Theta_g (trained in stage 1, frozen in stage 2)."""
        return [*self.global_encoder.parameters(), *self.global_decoder.parameters()]

    def prior_samples(self, n: int, samples: int, draws: Draws) -> Tensor:
        """h ~ p(h) = integral of p(h | z) p(z) dz: (n, samples, d_h), by ancestral sampling."""
        z = draws((n, samples, self.global_latent))
        mean, scale = self.global_decoder(z)
        return mean + scale * draws(tuple(mean.shape))

    def latent_log_ratio(self, h: Tensor, draws: Draws) -> Tensor:
        """log p(h | z) + log p(z) - log q(z | h) with z ~ q(z | h) reparameterised: (...)."""
        z_mean, z_scale = self.global_encoder(h)
        z = z_mean + z_scale * draws(tuple(z_mean.shape))
        h_mean, h_scale = self.global_decoder(z)
        prior = gaussian_log_prob(z, torch.zeros_like(z), torch.ones_like(z))
        return gaussian_log_prob(h, h_mean, h_scale) + prior - gaussian_log_prob(z, z_mean, z_scale)
