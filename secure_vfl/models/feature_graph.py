"""The global feature graph and the GNN imputer of FedHF-Impute (paper section III-B).

The graph has one node per global feature; each feature keeps its top-k neighbours by absolute
Pearson correlation, weighted by |corr| divided by the largest |corr| of the graph. The imputer
works over the feature dimension: one node state per (sample, feature), message passing along
the fixed graph, one scalar prediction per feature (eqs. 1-4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from secure_vfl.errors import ConfigError, DataError


@dataclass(frozen=True)
class FeatureGraph:
    """Top-k neighbour table of every feature: row ``i`` lists the sources ``j`` of edges j -> i.

    ``neighbours`` (F, k) int64, ``weights`` (F, k) float32 in [0, 1] (``w_ji`` of eq. 2) and
    ``mask`` (F, k) bool, False in the slots of a feature with fewer than k valid neighbours
    (those slots point at the feature itself with weight 0).
    """

    neighbours: np.ndarray
    weights: np.ndarray
    mask: np.ndarray

    def __post_init__(self) -> None:
        shape = self.neighbours.shape
        if self.neighbours.ndim != 2 or self.neighbours.dtype != np.int64:
            raise DataError(
                f"`neighbours` must be a 2-d int64 array (F, k). "
                f"Found {self.neighbours.ndim}-d {self.neighbours.dtype}."
            )
        for name, array, dtype in (
            ("weights", self.weights, np.float32),
            ("mask", self.mask, np.bool_),
        ):
            if array.shape != shape or array.dtype != dtype:
                raise DataError(
                    f"`{name}` must be a {np.dtype(dtype).name} array of shape {shape}. "
                    f"Found {array.dtype} of shape {array.shape}."
                )
        if self.neighbours.size and not (
            self.neighbours.min() >= 0 and self.neighbours.max() < shape[0]
        ):
            raise DataError(
                f"`neighbours` must index features 0..{shape[0] - 1}. "
                f"Found values in [{self.neighbours.min()}, {self.neighbours.max()}]."
            )
        if np.any(self.weights[~self.mask] != 0):
            raise DataError("`weights` must be 0 in the slots that `mask` marks invalid.")

    @property
    def features(self) -> int:
        return int(self.neighbours.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.neighbours.shape[1])

    @classmethod
    def from_correlation(cls, correlation: np.ndarray, *, top_k: int) -> FeatureGraph:
        """Keep, for each feature, its ``top_k`` neighbours by |corr| (NaN = no valid pair).

        Ties are broken by the lower feature index; the diagonal is never an edge. Weights are
        |corr| / max |corr| over the kept edges (all zero if no pair is valid).
        """
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ConfigError(f"`top_k` must be a positive integer. Found {top_k!r}.")
        if correlation.ndim != 2 or correlation.shape[0] != correlation.shape[1]:
            raise DataError(
                f"`correlation` must be a square (F, F) matrix. Found shape {correlation.shape}."
            )
        features = correlation.shape[0]
        strength = np.abs(np.asarray(correlation, dtype=np.float64))
        valid = np.isfinite(strength)
        np.fill_diagonal(valid, False)
        score = np.where(valid, strength, -1.0)
        order = np.argsort(-score, axis=1, kind="stable")
        slots = min(top_k, features)
        chosen = order[:, :slots]
        mask = np.take_along_axis(valid, chosen, axis=1)
        kept = np.where(mask, np.take_along_axis(score, chosen, axis=1), 0.0)
        pad = top_k - slots
        self_index = np.arange(features, dtype=np.int64)[:, None]
        neighbours = np.where(mask, chosen, self_index).astype(np.int64)
        if pad:
            neighbours = np.concatenate([neighbours, np.repeat(self_index, pad, axis=1)], axis=1)
            mask = np.concatenate([mask, np.zeros((features, pad), dtype=bool)], axis=1)
            kept = np.concatenate([kept, np.zeros((features, pad))], axis=1)
        largest = kept.max() if kept.size else 0.0
        weights = kept / largest if largest > 0 else np.zeros_like(kept)
        return cls(neighbours=neighbours, weights=weights.astype(np.float32), mask=mask)


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


class FeatureGraphImputer(nn.Module):
    """f_theta(x, m, a, G) of FedHF-Impute: feature-id embeddings and message passing over G.

    Input ``x`` (B, F) standardised values with 0 where not observed, ``observed`` (B, F) and
    ``available`` (F,) masks; output (B, F) predictions in standardised space. The graph is a
    buffer (shared once, never averaged); only the parameters travel in FedAvg.
    """

    def __init__(self, graph: FeatureGraph, *, hidden: int = 128, layers: int = 3) -> None:
        super().__init__()
        if hidden < 1 or layers < 0:
            raise ConfigError(
                f"`hidden` must be >= 1 and `layers` >= 0. Found hidden={hidden}, layers={layers}."
            )
        features = graph.features
        self.embedding = nn.Embedding(features, hidden)  # e_f, eq. 1
        # Unit expected norm, the scale of the standardised value beside it: the default N(0, 1)
        # (norm sqrt(d)) drowns x in eq. 1's input and training barely moves (see the tests).
        nn.init.normal_(self.embedding.weight, std=hidden**-0.5)
        self.input = _mlp(hidden + 3, hidden, hidden)  # MLP_in, eq. 1
        self.layers = nn.ModuleList(_mlp(2 * hidden, hidden, hidden) for _ in range(layers))
        self.output = _mlp(hidden, hidden, 1)  # MLP_out, eq. 4
        self.neighbours: Tensor
        self.edge_weights: Tensor
        self.register_buffer("neighbours", torch.from_numpy(graph.neighbours.copy()))
        edge_weights = np.where(graph.mask, graph.weights, 0.0).astype(np.float32)
        self.register_buffer("edge_weights", torch.from_numpy(edge_weights))

    def forward(self, x: Tensor, observed: Tensor, available: Tensor) -> Tensor:
        batch, features = x.shape
        if features != self.neighbours.shape[0]:
            raise DataError(
                f"the imputer was built for {self.neighbours.shape[0]} features; "
                f"found inputs with {features}."
            )
        tokens = torch.stack(
            [
                x,
                observed.to(x.dtype),
                available.to(x.dtype).expand(batch, features),
            ],
            dim=-1,
        )
        embedding = self.embedding.weight.unsqueeze(0).expand(batch, features, -1)
        h = self.input(torch.cat([embedding, tokens], dim=-1))  # eq. 1
        for layer in self.layers:
            gathered = h[:, self.neighbours]  # (B, F, k, d): h_j for every edge j -> i
            message = torch.einsum("bfkd,fk->bfd", gathered, self.edge_weights)  # eq. 2
            h = h + layer(torch.cat([h, message], dim=-1))  # eq. 3
        return self.output(h).squeeze(-1)  # eq. 4
