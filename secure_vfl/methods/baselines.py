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
import warnings
from collections.abc import Iterator, Mapping, Sequence
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from secure_vfl.data.samplers import BatchSampler, loss_normaliser
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ConfigError, ProtocolError, RunWarning
from secure_vfl.federation.aggregator import SumBackend, dense_representations
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import AGGREGATOR
from secure_vfl.federation.parties import gradient_messages
from secure_vfl.methods.base import (
    METHODS,
    PARTY_MODELS,
    MethodConfig,
    PartyModels,
    StepCallback,
    TrainingProgress,
    batches,
    broadcast_prediction,
    build_federation,
    fits_once,
    isolated_seed,
    random_predictions,
    refuse_secure_sums,
    refuse_top_model,
    split_tensors,
    stops_on_a_lost_party,
    train_epochs,
    training_rows,
    training_sampler,
)
from secure_vfl.models.networks import ConcatHead, LinearHead, make_bottom


def concat_models(
    config: MethodConfig, shapes: Sequence[tuple[int, ...]], num_classes: int, seed: int
) -> PartyModels:
    """The concatenating methods' one head, at the label party, seeded ``seed + 1000``."""
    with isolated_seed(seed + 1000):
        head = ConcatHead(len(shapes), config.representation_dim, num_classes)
    return PartyModels({0: {"": head}})


def combinatorial_models(
    config: MethodConfig, shapes: Sequence[tuple[int, ...]], num_classes: int, seed: int
) -> PartyModels:
    """Combinatorial's bottom per (subset, member) and head per subset (at the subset's first
    party), seeded per subset ``j``: ``seed + 10000 + 100 j + k`` and ``seed + 20000 + j``."""
    bottoms: dict[tuple[int, str], nn.Module] = {}
    heads: dict[int, dict[str, nn.Module]] = {}
    for j, subset in enumerate(all_subsets(len(shapes))):
        for k in subset:
            with isolated_seed(seed + 10_000 + 100 * j + k):
                bottoms[(k, subset_tag(subset))] = make_bottom(
                    shapes[k], out=config.representation_dim
                )
        with isolated_seed(seed + 20_000 + j):
            head = LinearHead(config.representation_dim, num_classes)
        heads.setdefault(subset[0], {})[subset_tag(subset)] = head
    return PartyModels(heads, bottoms)


def all_subsets(parties: int) -> list[tuple[int, ...]]:
    """Every non-empty subset of the parties, by size then in lexicographic order."""
    return [
        subset
        for size in range(1, parties + 1)
        for subset in itertools.combinations(range(parties), size)
    ]


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
        aggregator: SumBackend | None = None,
        roles: Mapping[str, str] | None = None,
    ) -> None:
        refuse_secure_sums(
            config,
            name,
            "the label party concatenates every party's representation, there is no sum to hide "
            "them in.",
        )
        refuse_top_model(config, name, "a head on the concatenated representations")
        self.name = name
        self.config = config
        self.fed = build_federation(
            data,
            config,
            seed=seed,
            channel=channel,
            aggregator=aggregator,
            heads=concat_models(config, data.block_shapes, data.num_classes, seed).heads,
            roles=roles,
        )
        self.data = self.fed.data  # labels, masks and its own block only
        self.head = self.fed.own.heads[""]  # the label party's own head
        self.train_rows = training_rows(name, data, config, seed)
        self.sampler: BatchSampler = training_sampler(name, data, config, seed)

    def _inputs(
        self, split: str, rows: Tensor, mask: Tensor, *, round: int, batch_id: int, train: bool
    ) -> Tensor:
        """(B, K, d) representations at the label party, zeros where a block is absent."""
        asked = self.fed.request_representations(
            split,
            rows,
            mask,
            reply_to=self.fed.own.name,
            round=round,
            batch_id=batch_id,
            train=train,
        )
        messages = self.fed.take_representations(asked, round=round, batch_id=batch_id)
        for message in messages:  # the rows each was asked for, no other: its mask column
            expected = torch.nonzero(mask[:, self.fed.names.index(message.sender)]).flatten()
            if not torch.equal(message.positions, expected):
                found = message.positions.numel()
                raise ProtocolError(
                    f"{self.fed.own.name}: representations of {message.sender}'s "
                    f"{expected.numel()} rows asked for expected, found {found}"
                    f"{' others' if found == expected.numel() else ''} (round {round})."
                )
        dense, _ = dense_representations(messages, self.fed.names, rows.numel())
        return dense.permute(1, 0, 2)

    @stops_on_a_lost_party
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
        self.head.module.train()
        logits = self.head.module(inputs * keep.unsqueeze(-1).to(inputs.dtype))
        # The batch mean, or under Poisson sampling the sum over the expected batch size
        # (loss_normaliser); a factor of exactly 1 otherwise, which changes no bit.
        scale = rows.numel() / loss_normaliser(self.sampler, rows.numel())
        loss = F.cross_entropy(logits, self.head.labels("train", rows)) * scale
        loss.backward()
        assert inputs.grad is not None
        self.fed.send_gradients(
            gradient_messages(
                self.fed.own.name,
                inputs.grad.permute(1, 0, 2),
                mask,
                self.fed.names,
                round=round,
                batch_id=batch_id,
            )
        )
        self.fed.update(round=round)
        self.head.step()
        return loss.item()

    @property
    def total_steps(self) -> int:
        return len(self.sampler) * self.config.epochs

    def epoch_samplers(self) -> list[BatchSampler]:
        return [self.sampler] * self.config.epochs

    @fits_once
    def fit(
        self, *, on_step: StepCallback | None = None, progress: TrainingProgress | None = None
    ) -> list[float]:
        if self.train_rows.size == 0:
            return [float("nan")] * self.config.epochs
        self._warn_of_one_class()
        return train_epochs(
            self.train_step,
            self.sampler,
            epochs=self.config.epochs,
            rng=self.fed.rng,
            on_step=on_step,
            progress=progress,
            on_empty=lambda round: self.fed.pass_draw(round=round),
        )

    def _warn_of_one_class(self) -> None:
        """Warn (:class:`RunWarning`) when Standard VFL's training rows, the labelled ones every
        party holds, hold one class: its top model learns that class alone, which no number
        of epochs or learning rate changes."""
        classes = np.unique(self.data.train.labels[self.train_rows])
        if self.name != "standard" or classes.size > 1:
            return
        values = self.data.classes or tuple(range(self.data.num_classes))
        warnings.warn(
            f"standard trains on the labelled samples every one of the {self.data.parties} "
            f"parties holds, and the {self.train_rows.size} of them hold one class "
            f"({values[int(classes[0])]!r}): its top model learns that class alone. Expected "
            "complete samples of at least 2 classes: fewer parties or less training "
            "missingness would leave more (or --aligned-labeled N, a registered dataset); "
            "laser and plugvfl train on incomplete samples.",
            RunWarning,
            stacklevel=2,
        )

    def _logits(self, split_name: str) -> np.ndarray:
        """The top model's logits (N, C) on the concatenation, zeros for absent blocks."""
        split = split_tensors(self.data)[split_name]
        out = np.zeros((split.n, self.data.num_classes), dtype=np.float32)
        query = self.fed.next_query()
        for batch_id, rows in enumerate(batches(split.n, 1024)):
            mask = torch.from_numpy(split.mask[rows.numpy()])
            inputs = self._inputs(
                split_name, rows, mask, round=query, batch_id=batch_id, train=False
            )
            self.head.module.eval()
            with torch.no_grad():
                out[rows.numpy()] = self.head.module(inputs).numpy()
        return out

    @property
    def absent_block_refusal(self) -> str | None:
        """Why this method cannot predict with a party's block absent (None: it can)."""
        if self.name != "standard":
            return None
        instead = "guesses at random" if self.guesses_incomplete else "reads zeros"
        return (
            "its top model was trained only on samples that every party holds; where a block "
            f"is absent it {instead} (standard_incomplete={self.config.standard_incomplete!r})"
        )

    @property
    def guesses_incomplete(self) -> bool:
        """Whether this method guesses at random on incomplete samples (Standard VFL with
        ``standard_incomplete="random"``) rather than predicting from zeros."""
        return self.name == "standard" and self.config.standard_incomplete == "random"

    def predict(self, split_name: str) -> np.ndarray:
        split = split_tensors(self.data)[split_name]
        predicted = self._logits(split_name).argmax(axis=1)
        out = broadcast_prediction(predicted, split.mask)
        if self.guesses_incomplete:
            incomplete = ~split.mask.all(axis=1)
            guesses = random_predictions(split.mask, self.data.num_classes, self.fed.rng)
            out[incomplete] = guesses[incomplete]
        return out

    def predict_proba(self, split_name: str) -> np.ndarray:
        """Class probabilities (N, C) of the top model; NaN on the incomplete samples on which
        :meth:`predict` guesses at random (it makes no prediction there)."""
        split = split_tensors(self.data)[split_name]
        probabilities = torch.softmax(torch.from_numpy(self._logits(split_name)), dim=1).numpy()
        if self.guesses_incomplete:
            probabilities[~split.mask.all(axis=1)] = np.nan
        return probabilities


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
        aggregator: SumBackend | None = None,
        roles: Mapping[str, str] | None = None,
    ) -> None:
        refuse_secure_sums(
            config,
            "combinatorial",
            "its predictors over two parties hand the head party the other party's term.",
        )
        refuse_top_model(config, "combinatorial", "a linear head per subset")
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
        self.subsets = all_subsets(parties)
        models = combinatorial_models(config, data.block_shapes, data.num_classes, seed)
        self.fed = build_federation(
            data,
            config,
            seed=seed,
            channel=channel,
            aggregator=aggregator,
            heads=models.heads,
            models=models.bottoms,
            roles=roles,
        )
        self.data = self.fed.data  # labels, masks and its own block only
        self.train_rows = training_rows("combinatorial", data, config, seed)
        self.sampler = training_sampler("combinatorial", data, config, seed)

    def _ask(
        self,
        subset: tuple[int, ...],
        split: str,
        rows: Tensor,
        covered: Tensor,
        *,
        round: int,
        batch_id: int,
        train: bool,
        tag: str,
    ) -> tuple[Tensor, Tensor]:
        """Ask predictor ``subset``'s members for their representations of the ``covered``
        rows (sent to the aggregator under ``tag``); its sum selection (1, B, K) and who
        contributed (B, K)."""
        names = [self.fed.names[k] for k in subset]
        self.fed.request_representations(
            split,
            rows,
            covered.unsqueeze(1).expand(-1, len(subset)),
            reply_to=AGGREGATOR,
            round=round,
            batch_id=batch_id,
            train=train,
            senders=names,
            tag=tag,
            model=subset_tag(subset),
            gradients_from=names[:1] if train else (),  # its head's party
        )
        present = torch.zeros((rows.numel(), len(self.fed.names)), dtype=torch.bool)
        present[:, list(subset)] = covered.unsqueeze(1)
        return present.unsqueeze(0), present

    def _covering(self, subset: tuple[int, ...]) -> np.ndarray:
        """(N,) which training rows ``subset``'s parties all hold (its head's loss counts)."""
        return np.asarray(self.data.train.mask[:, list(subset)].all(axis=1))

    @stops_on_a_lost_party
    def train_step(self, rows_np: np.ndarray, round: int, batch_id: int) -> float:
        fed = self.fed
        rows = torch.from_numpy(rows_np)
        mask = torch.from_numpy(self.data.train.mask[rows_np])
        total = 0.0
        for subset in self.subsets:
            covered = mask[:, list(subset)].all(dim=1)
            if not bool(covered.any()):
                continue
            tag = subset_tag(subset)
            selection, present = self._ask(
                subset, "train", rows, covered, round=round, batch_id=batch_id, train=True, tag=tag
            )
            head_party = fed.names[subset[0]]
            fed.assign_head_task(
                head_party,
                rows,
                selection,
                covered.to(torch.float32).unsqueeze(0),
                present,
                normaliser=loss_normaliser(
                    self.sampler,
                    int(covered.sum()),
                    counted=partial(self._covering, subset),
                ),
                round=round,
                batch_id=batch_id,
                tag=tag + "/train",
                head=tag,
            )
            fed.update(round=round, tag=tag, heads=True, parties=[fed.names[k] for k in subset])
            total += fed.take_loss(head_party, round=round, batch_id=batch_id, tag=tag + "/train")
        return total

    @property
    def total_steps(self) -> int:
        return len(self.sampler) * self.config.epochs

    def epoch_samplers(self) -> list[BatchSampler]:
        return [self.sampler] * self.config.epochs

    @fits_once
    def fit(
        self, *, on_step: StepCallback | None = None, progress: TrainingProgress | None = None
    ) -> list[float]:
        self._warn_of_untrained()
        return train_epochs(
            self.train_step,
            self.sampler,
            epochs=self.config.epochs,
            rng=self.fed.rng,
            on_step=on_step,
            progress=progress,
        )

    def _warn_of_untrained(self) -> None:
        """Warn (:class:`RunWarning`) of the predictors no training row trains: those of the
        subsets that no labelled training row observes whole. Each would predict the samples
        observed by exactly its parties from its initial weights."""
        untrained = [
            subset for subset in self.subsets if not self._covering(subset)[self.train_rows].any()
        ]
        if not untrained:
            return
        named = ["{" + ", ".join(self.fed.names[k] for k in subset) + "}" for subset in untrained]
        more = len(named) - 4
        sets = " or of ".join(named[:4]) + (f" (and {more} more sets)" if more > 0 else "")
        warnings.warn(
            f"combinatorial trained {len(untrained)} of its {len(self.subsets)} predictors on "
            f"no sample: no labelled training sample is held by every party of {sets}; each "
            "predicts the samples whose observed set is exactly its parties from its initial "
            "weights. Expected less training missingness or fewer parties; laser shares each "
            "party's model across every set of parties, which incomplete samples then train.",
            RunWarning,
            stacklevel=2,
        )

    def predict(self, split_name: str) -> np.ndarray:
        split = split_tensors(self.data)[split_name]
        out = np.full(split.mask.shape, -1, dtype=np.int64)
        for idx, predicted in self._answers(split_name, probabilities=False):
            out[idx] = broadcast_prediction(predicted.numpy(), split.mask[idx])
        return out

    def predict_proba(self, split_name: str) -> np.ndarray:
        """Class probabilities (N, C) of the predictor of exactly each sample's observed set."""
        split = split_tensors(self.data)[split_name]
        out = np.full((split.n, self.data.num_classes), np.nan, dtype=np.float32)
        for idx, probabilities in self._answers(split_name, probabilities=True):
            out[idx] = probabilities.numpy()
        return out

    def _answers(
        self, split_name: str, *, probabilities: bool
    ) -> Iterator[tuple[np.ndarray, Tensor]]:
        """Each predictor's answers for the samples whose observed set is exactly its subset:
        (the split's rows, their classes or, with ``probabilities``, class probabilities)."""
        split = split_tensors(self.data)[split_name]
        query = self.fed.next_query()
        for batch_id, rows in enumerate(batches(split.n, 1024)):
            mask = torch.from_numpy(split.mask[rows.numpy()])
            for subset in self.subsets:
                exact = torch.ones(rows.numel(), dtype=torch.bool)
                for k in range(mask.shape[1]):
                    exact &= mask[:, k] if k in subset else ~mask[:, k]
                if not bool(exact.any()):
                    continue
                tag = f"{subset_tag(subset)}/predict/{split_name}"
                selection, _ = self._ask(
                    subset,
                    split_name,
                    rows,
                    exact,
                    round=query,
                    batch_id=batch_id,
                    train=False,
                    tag=tag,
                )
                positions, predicted = self.fed.predict_with(
                    self.fed.names[subset[0]],
                    selection[0],
                    torch.nonzero(exact).flatten(),
                    round=query,
                    batch_id=batch_id,
                    tag=tag,
                    source_tag=tag,
                    head=subset_tag(subset),
                    probabilities=probabilities,
                )
                yield rows.numpy()[positions.numpy()], predicted


METHODS.register("standard", partial(ConcatFusionMethod, name="standard"))
METHODS.register("plugvfl", partial(ConcatFusionMethod, name="plugvfl"))
METHODS.register("combinatorial", Combinatorial)
PARTY_MODELS.register("standard", concat_models)
PARTY_MODELS.register("plugvfl", concat_models)
PARTY_MODELS.register("combinatorial", combinatorial_models)
