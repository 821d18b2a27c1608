"""The baselines of the LASER-VFL paper that are not LASER's own machinery.

- Standard VFL: a top model on the concatenation of all K representations, trained only on the
  fully observed samples; on incomplete test samples it predicts at random (LASER paper) or
  zero-imputes the missing representations (FALSE-VFL paper), by ``standard_incomplete``.
- PlugVFL (Sun et al.): the same concatenation model trained on every sample with zeros for the
  missing blocks, plus party-wise dropout of the passive parties' representations.
- Combinatorial: an independent predictor (own bottoms and head) for every non-empty subset of
  parties, each trained on the samples that observe its whole subset; inference uses the predictor
  of exactly the observed set. Its cost grows as 2^K, which is the paper's point.

Local and Ensemble share LASER's code (:mod:`secure_vfl.methods.laser`).
"""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from secure_vfl.data.samplers import BatchSampler, make_sampler
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ConfigError
from secure_vfl.federation.aggregator import Aggregator, dense_representations
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import AGGREGATOR, party_name
from secure_vfl.federation.parties import DataParty, HeadParty, gradient_messages
from secure_vfl.methods.base import (
    METHODS,
    MethodConfig,
    StepCallback,
    batches,
    broadcast_prediction,
    build_federation,
    head_party,
    isolated_seed,
    labeled_rows,
    random_predictions,
    refuse_secure_sums,
    sgd,
    split_tensors,
    train_epochs,
)
from secure_vfl.models.networks import ConcatHead, LinearHead, make_bottom


class ConcatFusionMethod:
    """Bottoms at the data parties; the label party (party 0) concatenates and classifies."""

    def __init__(
        self,
        data: VerticalData,
        config: MethodConfig,
        *,
        seed: int,
        name: str,
        channel: Channel | None = None,
        aggregator: Aggregator | None = None,
    ) -> None:
        refuse_secure_sums(
            config,
            name,
            "the label party concatenates every party's representation, there is no sum to hide "
            "them in.",
        )
        self.name = name
        self.config = config
        self.data = data
        self.fed = build_federation(data, config, seed=seed, channel=channel, aggregator=aggregator)
        with isolated_seed(seed + 1000):
            head = ConcatHead(data.train.parties, config.representation_dim, data.num_classes)
        self.label_party: HeadParty = head_party(party_name(0), data, head, config)
        mask = data.train.mask
        self.train_rows = labeled_rows(data, config, seed)
        if name == "standard":  # Vanilla VFL: only the aligned (complete) labelled samples
            self.train_rows = self.train_rows[mask[self.train_rows].all(axis=1)]
        self.sampler: BatchSampler = make_sampler(
            config.batching, mask, config.batch_size, rows=self.train_rows
        )

    def _inputs(
        self, split: str, rows: Tensor, mask: Tensor, *, round: int, batch_id: int, train: bool
    ) -> Tensor:
        """(B, K, d) representations at the label party, zeros where a block is absent."""
        messages = self.fed.send_representations(
            split,
            rows,
            mask,
            receiver=self.label_party.name,
            round=round,
            batch_id=batch_id,
            train=train,
        )
        dense, _ = dense_representations(messages, self.fed.names, rows.numel())
        return dense.permute(1, 0, 2)

    def train_step(self, rows_np: np.ndarray, round: int, batch_id: int) -> float:
        rows = torch.from_numpy(rows_np)
        mask = torch.from_numpy(self.data.train.mask[rows_np])
        inputs = self._inputs("train", rows, mask, round=round, batch_id=batch_id, train=True)
        inputs.requires_grad_(True)
        keep = mask
        if self.name == "plugvfl" and self.config.plug_dropout > 0:
            drop = torch.rand(mask.shape, generator=self.fed.generator) < self.config.plug_dropout
            drop[:, 0] = False  # the active (label) party never drops out
            keep = mask & ~drop
        self.label_party.head.train()
        logits = self.label_party.head(inputs * keep.unsqueeze(-1).to(inputs.dtype))
        loss = F.cross_entropy(logits, self.label_party.labels("train", rows))
        loss.backward()
        assert inputs.grad is not None
        messages = gradient_messages(
            self.label_party.name,
            inputs.grad.permute(1, 0, 2),
            mask,
            self.fed.names,
            round=round,
            batch_id=batch_id,
        )
        received = self.fed.deliver_gradients(messages, round=round, batch_id=batch_id)
        self.fed.apply_gradients(received, round=round)
        self.label_party.step()
        return loss.item()

    @property
    def total_steps(self) -> int:
        return len(self.sampler) * self.config.epochs

    def fit(self, *, on_step: StepCallback | None = None) -> list[float]:
        if self.train_rows.size == 0:
            return [float("nan")] * self.config.epochs
        return train_epochs(
            self.train_step,
            self.sampler,
            epochs=self.config.epochs,
            rng=self.fed.rng,
            on_step=on_step,
        )

    def predict(self, split_name: str) -> np.ndarray:
        split = split_tensors(self.data)[split_name]
        out = np.full(split.mask.shape, -1, dtype=np.int64)
        for batch_id, rows in enumerate(batches(split.n, 1024)):
            mask = torch.from_numpy(split.mask[rows.numpy()])
            inputs = self._inputs(split_name, rows, mask, round=0, batch_id=batch_id, train=False)
            self.label_party.head.eval()
            with torch.no_grad():
                predicted = self.label_party.head(inputs).argmax(dim=-1).numpy()
            out[rows.numpy()] = broadcast_prediction(predicted, mask.numpy())
        if self.name == "standard" and self.config.standard_incomplete == "random":
            incomplete = ~split.mask.all(axis=1)
            guesses = random_predictions(split.mask, self.data.num_classes, self.fed.rng)
            out[incomplete] = guesses[incomplete]
        return out


def subset_tag(subset: tuple[int, ...]) -> str:
    """The tag of a Combinatorial predictor's messages, e.g. ``"subset:0,2"``."""
    return "subset:" + ",".join(str(k) for k in subset)


class Combinatorial:
    """One independent mean-fusion predictor per non-empty subset of parties (2^K - 1 of them).

    Predictor J has its own bottom model at every party of J and its own linear head, held by
    the party of J with the smallest index (every party holds labels, as in the paper).
    """

    max_parties = 8

    def __init__(
        self,
        data: VerticalData,
        config: MethodConfig,
        *,
        seed: int,
        channel: Channel | None = None,
        aggregator: Aggregator | None = None,
    ) -> None:
        refuse_secure_sums(
            config,
            "combinatorial",
            "its predictors over two parties hand the head party the other party's term.",
        )
        if config.pretrain_epochs:
            raise ConfigError(
                "combinatorial keeps 2^K - 1 bottom models per run; SimSiam pretraining applies "
                f"to methods with one per party. Found pretrain_epochs={config.pretrain_epochs}."
            )
        parties = data.train.parties
        if config.heads != "all":
            raise ConfigError(
                f"combinatorial trains a head at every party, so it needs heads='all'. "
                f"Found {config.heads!r}."
            )
        if parties > self.max_parties:
            raise ConfigError(
                f"combinatorial trains 2^K - 1 predictors; K must be <= {self.max_parties}. "
                f"Found K={parties}."
            )
        self.name = "combinatorial"
        self.config = config
        self.data = data
        self.fed = build_federation(data, config, seed=seed, channel=channel, aggregator=aggregator)
        splits = split_tensors(data)
        self.subsets = [
            subset
            for size in range(1, parties + 1)
            for subset in itertools.combinations(range(parties), size)
        ]
        self.members: dict[tuple[int, ...], list[DataParty]] = {}
        self.heads: dict[tuple[int, ...], HeadParty] = {}
        for j, subset in enumerate(self.subsets):
            members = []
            for k in subset:
                with isolated_seed(seed + 10_000 + 100 * j + k):
                    model = make_bottom(
                        data.train.blocks[k].shape[1:], out=config.representation_dim
                    )
                blocks = {n: torch.from_numpy(s.blocks[k]) for n, s in splits.items()}
                members.append(DataParty(party_name(k), blocks, model, sgd(model, config)))
            self.members[subset] = members
            with isolated_seed(seed + 20_000 + j):
                head = LinearHead(config.representation_dim, data.num_classes)
            self.heads[subset] = head_party(party_name(subset[0]), data, head, config)
        self.sampler = make_sampler(
            config.batching,
            data.train.mask,
            config.batch_size,
            rows=labeled_rows(data, config, seed),
        )

    def _means(
        self,
        subset: tuple[int, ...],
        split: str,
        rows: Tensor,
        covered: Tensor,
        *,
        round: int,
        batch_id: int,
        train: bool,
    ) -> Tensor:
        """Predictor ``subset``'s mean representation of the ``covered`` rows of the batch."""
        members = self.members[subset]
        messages = self.fed.send_representations(
            split,
            rows,
            covered.unsqueeze(1).expand(-1, len(members)),
            receiver=AGGREGATOR,
            round=round,
            batch_id=batch_id,
            train=train,
            senders=members,
            tag=subset_tag(subset),
        )
        selection = torch.zeros((1, rows.numel(), len(self.fed.names)), dtype=torch.bool)
        selection[0][:, list(subset)] = covered.unsqueeze(1)
        means, _ = self.fed.means(
            messages,
            selection,
            receiver=self.heads[subset].name,
            round=round,
            batch_id=batch_id,
            tag=subset_tag(subset) + ("/train" if train else f"/predict/{split}"),
        )
        return means[0, covered]

    def train_step(self, rows_np: np.ndarray, round: int, batch_id: int) -> float:
        rows = torch.from_numpy(rows_np)
        mask = torch.from_numpy(self.data.train.mask[rows_np])
        total = 0.0
        for subset in self.subsets:
            covered = mask[:, list(subset)].all(dim=1)
            if not bool(covered.any()):
                continue
            head = self.heads[subset]
            means = self._means(
                subset, "train", rows, covered, round=round, batch_id=batch_id, train=True
            )
            means.requires_grad_(True)
            head.head.train()
            positions = torch.nonzero(covered).flatten()
            loss = F.cross_entropy(head.head(means), head.labels("train", rows[positions]))
            loss.backward()
            assert means.grad is not None
            dense = torch.zeros(len(self.fed.names), rows.numel(), means.shape[1])
            present = torch.zeros(rows.numel(), len(self.fed.names), dtype=torch.bool)
            for k in subset:
                dense[k, positions] = means.grad / len(subset)
                present[:, k] = covered
            tag = subset_tag(subset)
            messages = gradient_messages(
                head.name, dense, present, self.fed.names, round=round, batch_id=batch_id, tag=tag
            )
            received = self.fed.deliver_gradients(messages, round=round, batch_id=batch_id)
            for party in self.members[subset]:
                party.backward(received[party.name], round=round, tag=tag)
                party.step()
            head.step()
            total += loss.item()
        return total

    @property
    def total_steps(self) -> int:
        return len(self.sampler) * self.config.epochs

    def fit(self, *, on_step: StepCallback | None = None) -> list[float]:
        return train_epochs(
            self.train_step,
            self.sampler,
            epochs=self.config.epochs,
            rng=self.fed.rng,
            on_step=on_step,
        )

    def predict(self, split_name: str) -> np.ndarray:
        split = split_tensors(self.data)[split_name]
        out = np.full(split.mask.shape, -1, dtype=np.int64)
        for batch_id, rows in enumerate(batches(split.n, 1024)):
            mask = torch.from_numpy(split.mask[rows.numpy()])
            for subset in self.subsets:
                exact = torch.ones(rows.numel(), dtype=torch.bool)
                for k in range(mask.shape[1]):
                    exact &= mask[:, k] if k in subset else ~mask[:, k]
                if not bool(exact.any()):
                    continue
                means = self._means(
                    subset, split_name, rows, exact, round=0, batch_id=batch_id, train=False
                )
                head = self.heads[subset]
                head.head.eval()
                with torch.no_grad():
                    predicted = head.head(means).argmax(dim=-1).numpy()
                idx = rows.numpy()[exact.numpy()]
                out[idx] = broadcast_prediction(predicted, split.mask[idx])
        return out


METHODS.register("standard", partial(ConcatFusionMethod, name="standard"))
METHODS.register("plugvfl", partial(ConcatFusionMethod, name="plugvfl"))
METHODS.register("combinatorial", Combinatorial)
