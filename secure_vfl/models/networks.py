"""Small networks sized for a 2-core CPU: an MLP per tabular block, a CNN per image patch.

The LASER reference uses MLPs of width 128 for tabular data and linear heads on the mean of the
embeddings; we keep that. Images get a two-block CNN instead of a ResNet-18 (an epoch of a
ResNet-18 on Fashion-MNIST takes about a minute here, see REFERENCE.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from secure_vfl.errors import ConfigError


class MLPBottom(nn.Module):
    """``in -> hidden -> ... -> out`` with ReLU between layers (a party's tabular encoder)."""

    def __init__(self, in_features: int, *, hidden: int = 128, out: int = 128, depth: int = 3):
        super().__init__()
        if depth < 1:
            raise ConfigError(f"MLP depth must be >= 1. Found {depth}.")
        widths = [in_features] + [hidden] * (depth - 1) + [out]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            layers.append(nn.Linear(a, b))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.flatten(1))


class ConvBottom(nn.Module):
    """Two conv blocks and a linear map: works for patches from 7x7 up (a party's image encoder)."""

    def __init__(self, in_channels: int, *, out: int = 128, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d((2, 2)),
        )
        self.project = nn.Linear(8 * width, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.project(self.features(x).flatten(1))


class LinearHead(nn.Module):
    """A fusion head on one fused representation (LASER's g_k on the mean of embeddings)."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(torch.relu(x))


class ConcatHead(nn.Module):
    """A top model on the concatenation of K representations (Standard VFL, PlugVFL)."""

    def __init__(self, parties: int, in_features: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(parties * in_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` is (..., K, d); missing parties are zero rows."""
        return self.linear(torch.relu(x).flatten(-2))


def make_bottom(block_shape: Sequence[int], *, out: int = 128) -> nn.Module:
    """The default bottom model for a block of the given per-sample shape."""
    if len(block_shape) == 1:
        return MLPBottom(block_shape[0], out=out)
    if len(block_shape) == 3:
        return ConvBottom(block_shape[0], out=out)
    raise ConfigError(
        "a block must be (features,) or (channels, height, width); "
        f"found shape {tuple(block_shape)}."
    )


def parameter_count(module: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(math.prod(p.shape) for p in module.parameters() if p.requires_grad)
