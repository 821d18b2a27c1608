"""LASER-VFL (Valdeira et al.): one head per party on the mean of any subset of representations.

Training samples tasks per batch: for each observed head k and each size s = 1..n (n = number of
observed blocks of the sample) one subset of the observed set of size s that contains k, weighted
``a_s = C(n-1, s-1) / s`` (paper eq. 6), which makes the sampled loss an unbiased estimate of
eq. 5. Sampling, fusion and the head's loss are vectorised over sizes and samples: one aggregator
call and one head evaluation per head and batch, whatever the batch's observed sets.

The same machinery gives the Local and Ensemble baselines (tasks restricted to ``{k}``).

Under secure aggregation (``MethodConfig.secure_sums``) the single label party (``heads="active"``)
may only receive sums from which *no combination over the whole run* gives one other party's
term: a sum over its own block and one other party's would hand it that term, and so would
sums of the same sample that overlap differently in different steps, epochs or test splits
(A+B, A+C and B+C give A). Every sum it asks for about a sample is therefore a union of that
sample's fixed *blocks* of >= 2 other parties that are wholly observed there, with or without
its own term (:class:`~secure_vfl.federation.releases.ReleaseBlocks`, where the rule and why it
is safe are stated; ``tests/test_release_audit.py`` audits whole runs). Training evaluates the
head on every such union of a sample's usable blocks, in one sum request per step that asks
for each block's sum once (the head adds the unions from them: each contributor seals its row
into one sum), each weighted ``(2^n - 1) / (n |A|)`` (n = |observed set|, A its releasable
subsets): LASER's single-head objective with its subset distribution conditioned on being
releasable, exactly, so a row keeps its plaintext loss mass
(:meth:`~secure_vfl.federation.releases.BlockPlan.tasks` says why not the objective merely
restricted to A). Prediction uses the union of all usable blocks (plus its own). A sample
whose other parties are in no usable block gets its own block alone (its prior, without one).
``heads="all"`` cannot be made secure this way: LASER's head k must be trained on, and predict
from, the pair {k, j}, and a sum of two terms one of which the receiver holds is the other term
in the clear.

With ``MethodConfig.release="dp"`` a block that is not usable may add its *exposable* members
that are observed (a lone other party of a training row, or one fixed member of a triple) as DP
releases: the label party flags their rows in its seal requests and each such party sends them
clipped and noised in every sum of that request, priced by its accountant. A block never has
more than ``|block| - 2`` exposable members, so no exposure, with the clean sums, gives another
party's term.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from secure_vfl.data.samplers import BatchSampler, loss_normaliser
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ConfigError, ProtocolError
from secure_vfl.federation.aggregator import SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import AGGREGATOR, Message
from secure_vfl.federation.releases import ReleaseBlocks
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
    require_hiding_crowd,
    split_tensors,
    train_epochs,
    training_sampler,
)
from secure_vfl.models.networks import LinearHead

Planner = Literal["laser", "local"]


def _binomials(size: int) -> Tensor:
    """table[n, s] = C(n, s) for 0 <= n, s <= size."""
    return torch.tensor(
        [[math.comb(n, s) for s in range(size + 1)] for n in range(size + 1)], dtype=torch.float32
    )


def laser_weights(observed: Tensor, sizes: Tensor) -> Tensor:
    """Loss weight ``a_s = C(n-1, s-1) / s`` of a sampled task of size ``s`` (paper eq. 6).

    ``n`` is the sample's number of observed blocks; sizes above ``n`` weigh 0. The same weight
    serves a single head (``heads="active"``) that draws its size-s subset from all C(n, s)
    subsets: ``C(n, s) / n`` equals ``C(n-1, s-1) / s``, so the single head's sampled loss
    estimates LASER's objective averaged over the n observed heads.
    """
    table = _binomials(int(max(int(observed.max()), int(sizes.max()))))
    n = observed.long()
    s = sizes.long()
    valid = (s >= 1) & (s <= n)
    weight = table[(n - 1).clamp(min=0), (s - 1).clamp(min=0)] / s.clamp(min=1)
    return torch.where(valid, weight, torch.zeros_like(weight))


class StepPlan(NamedTuple):
    """A step's tasks: selection (H, T, B, K) and weights (H, T, B); the rows (B, K) sent as DP
    releases (``release="dp"``); and under secure sums the parts (S, B, K) whose sums the head
    adds up into its tasks' (:class:`~secure_vfl.federation.messages.HeadTask`)."""

    selection: Tensor
    weights: Tensor
    dp_rows: Tensor | None = None
    parts: Tensor | None = None


def sample_tasks(
    mask: Tensor, heads: list[int] | None, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Draw LASER's tasks for a batch with per-sample observed sets ``mask`` (B, K).

    Returns ``selection`` (H, K, B, K) bool — for head ``h``, size slot ``s`` (size s + 1) and
    sample ``b``, which parties enter the mean — and ``weights`` (H, K, B). With ``heads=None`` a
    single head draws subsets that need not contain any given party (``heads="active"``).
    Subsets are uniform: random priorities, the head's own block first, unobserved blocks last,
    and the s + 1 smallest taken.
    """
    batch, parties = mask.shape
    head_list = heads if heads is not None else [-1]
    priority = torch.rand((len(head_list), parties, batch, parties), generator=generator)
    for i, h in enumerate(head_list):
        if h >= 0:
            priority[i, :, :, h] = -1.0
    priority = torch.where(
        mask.view(1, 1, batch, parties), priority, torch.full_like(priority, 2.0)
    )
    rank = priority.argsort(dim=-1).argsort(dim=-1)
    sizes = torch.arange(1, parties + 1).view(1, parties, 1)
    observed = mask.sum(dim=1).view(1, 1, batch)
    weights = laser_weights(
        observed.expand(len(head_list), parties, batch),
        sizes.expand(len(head_list), parties, batch),
    )
    if heads is not None:
        head_observed = mask[:, heads].T.reshape(len(head_list), 1, batch)
        weights = weights * head_observed
    selection = (rank < sizes.unsqueeze(-1)) & mask.view(1, 1, batch, parties)
    selection &= (weights > 0).unsqueeze(-1)
    return selection, weights


def local_tasks(mask: Tensor, heads: list[int]) -> tuple[Tensor, Tensor]:
    """One task per head: its own block alone, on the samples it observes (Local, Ensemble)."""
    batch, parties = mask.shape
    selection = torch.zeros((len(heads), 1, batch, parties), dtype=torch.bool)
    for i, h in enumerate(heads):
        selection[i, 0, :, h] = mask[:, h]
    weights = selection.any(dim=-1).float()
    return selection, weights


def _top_model(config: MethodConfig, num_classes: int) -> nn.Module:
    """A linear head on the fused mean, or none: the fused mean is the logits."""
    if config.top_model == "none":
        return nn.Identity()
    return LinearHead(config.representation_dim, num_classes)


def mean_fusion_models(
    config: MethodConfig, shapes: Sequence[tuple[int, ...]], num_classes: int, seed: int
) -> PartyModels:
    """The heads of the mean-fusion methods: head ``h`` at party ``h`` (``heads="all"``) or
    one at the label party (``"active"``), seeded ``seed + 1000 + h``."""
    heads: dict[int, dict[str, nn.Module]] = {}
    for h in range(len(shapes)) if config.heads == "all" else [0]:
        with isolated_seed(seed + 1000 + h):
            heads[h] = {"": _top_model(config, num_classes)}
    return PartyModels(heads)


class MeanFusionMethod:
    """Bottoms at the data parties, linear heads on the mean of a selected subset of them.

    This object is the label party's (``party-0``'s) program: it plans each step and asks the
    other parties, through messages, for representations, sums, head updates and predictions.
    Head ``k`` lives at party ``k`` (``heads="all"``) or only at the label party (``"active"``).
    """

    def __init__(
        self,
        data: VerticalData,
        config: MethodConfig,
        *,
        seed: int,
        planner: Planner,
        name: str,
        channel: Channel | None = None,
        aggregator: SumBackend | None = None,
        roles: Mapping[str, str] | None = None,
    ) -> None:
        if planner == "local" and config.heads != "all":
            raise ConfigError(
                f"{name} trains a head at every party, so it needs heads='all'. "
                f"Found {config.heads!r}."
            )
        if config.secure_sums and (planner == "local" or config.heads != "active"):
            raise ConfigError(
                f"{name} with heads={config.heads!r} cannot run under secure aggregation: a head "
                "that holds a block and receives its sum with one other party's term learns "
                "that term. Use --method laser --heads active."
            )
        require_hiding_crowd(config, data.train.parties, name)
        self.name = name
        self.config = config
        self.planner = planner
        parties = data.train.parties
        self.head_index = list(range(parties)) if config.heads == "all" else [0]
        if config.top_model == "none" and config.representation_dim != data.num_classes:
            raise ConfigError(
                f"{name} with top_model='none' reads the fused representations as logits, so "
                f"representation_dim must equal the {data.num_classes} classes. Found "
                f"{config.representation_dim}."
            )
        self.fed = build_federation(
            data,
            config,
            seed=seed,
            channel=channel,
            aggregator=aggregator,
            heads=mean_fusion_models(config, data.block_shapes, data.num_classes, seed).heads,
            roles=roles,
        )
        self.data = self.fed.data  # labels, masks and its own block only
        self.fed.tolerates_dropouts = True  # a lost party is a missing block
        self.sampler = training_sampler("laser", data, config, seed)
        self.fed.epoch_steps = len(self.sampler)
        self.blocks: ReleaseBlocks | None = None
        if config.secure_sums:
            self.blocks = ReleaseBlocks(
                data.train.mask, receiver=0, seed=seed, expose=config.release == "dp"
            )

    def plan(self, rows: Tensor, mask: Tensor) -> StepPlan:
        """Selection (H, T, B, K) and weights (H, T, B) of this batch's tasks; under
        ``release="dp"`` the rows (B, K) their parties send as DP releases (else None).

        Under secure sums the tasks are every union of the rows' usable blocks
        (:class:`~secure_vfl.federation.releases.ReleaseBlocks`), weighted as
        :meth:`~secure_vfl.federation.releases.BlockPlan.tasks` says, and the sums asked for
        are the blocks' (``parts``, S x B x K), from which the head adds up its tasks': each
        party seals its representation once a step, into its own block's sum.
        """
        if self.planner == "local":
            return StepPlan(*local_tasks(mask, self.head_index))
        if self.blocks is not None:
            plan = self.blocks.plan("train", rows, mask)
            selection, weights = plan.tasks()
            return StepPlan(selection, weights, self._dp_rows(plan.exposed), plan.parts())
        heads = self.head_index if self.config.heads == "all" else None
        return StepPlan(*sample_tasks(mask, heads, self.fed.generator))

    def _dp_rows(self, exposed: Tensor) -> Tensor | None:
        """Under ``release="dp"`` the rows its plan exposes (which their parties send as DP
        releases, in every sum of the request); else None (any sum that would hand the
        receiver one party's row alone is refused by every party and the aggregator)."""
        return exposed if self.config.release == "dp" else None

    def train_step(self, rows_np: np.ndarray, round: int, batch_id: int) -> float:
        """One step of Algorithm 1, as messages: representations to the aggregator, each head's
        task and sums to its party, gradients back, then every party updates.

        A data party lost before the update (a deployment: its process died) is dropped and
        the step is retried without it: every other party first discards what the attempt
        left (:meth:`~secure_vfl.methods.base.Federation.recover`), so nothing of it is
        applied, and the retry plans on the masks without the lost block, under a fresh batch
        id (every sum context of the abandoned attempt stays spent). Its loss is therefore
        LASER's unbiased estimate for the batch as it now is, as in every later step; a
        skipped step would instead leave its rows out of the epoch. A party lost at the update
        is dropped there and the others complete the step.

        When the label party's own head trains one task of the step (with the vectorised plan:
        under ``heads="active"`` the step's only task, under ``"all"`` one of the heads'), the
        head holds the gradients it owes the other parties
        (:attr:`~secure_vfl.federation.messages.HeadTask.hold`) and they close those parties'
        steps, their heads' too (:meth:`~secure_vfl.methods.base.Federation.update`): one
        message per party instead of a gradient and an update, released only once the attempt
        has succeeded and
        sent ahead of the party's next request (over the network, in the same delivery), so a
        step waits for its receivers once less. A party found lost there is dropped in the next
        step, which is retried without it; the step it closed stands for the others.
        """
        fed = self.fed
        for attempt in itertools.count():
            attempt_batch = batch_id + attempt * len(self.sampler)
            try:
                loss, held = self._attempt(rows_np, round, attempt_batch)
                break
            except ProtocolError as error:
                fed.recover(error, round=round)
        closing = fed.own.held_gradients(round, attempt_batch) if held else []
        fed.update(round=round, heads=True, closing=closing)
        return loss

    def _attempt(self, rows_np: np.ndarray, round: int, batch_id: int) -> tuple[float, bool]:
        """One attempt at a step, up to its losses (the update closes it); and whether the
        label party's head holds the gradients of its task."""
        fed = self.fed
        rows = torch.from_numpy(rows_np)
        mask = torch.from_numpy(self.data.train.mask[rows_np])
        selection, weights, dp_rows, parts = self.plan(rows, mask)
        tasks: list[tuple[int, str, slice]] = []
        for i in range(len(self.head_index)):
            # Under secure sums a step's sums are one request (each exposure sealed once).
            if self.config.vectorised or self.blocks is not None:
                chunks = {"train": slice(None)}
            else:
                chunks = {f"train/size-{t + 1}": slice(t, t + 1) for t in range(selection.shape[1])}
            tasks += [
                (i, tag, chunk)
                for tag, chunk in chunks.items()
                if bool((weights[i, chunk] > 0).any())
            ]
        # The label party's own head holds the gradients it owes the others when it trains one
        # task this step: they close those parties' steps (:meth:`train_step`).
        own = [task for task in tasks if fed.names[self.head_index[task[0]]] == fed.own.name]
        held = own[0] if len(own) == 1 else None
        # One task: its sum request (and under a secure scheme each party's seal request) goes
        # out with the representation requests, so the step waits once for all of them: the
        # aggregator serves the sum once the representations (shares) it sums are in, and a
        # party acts on its messages in their order (over the network, one delivery), so it
        # seals what it has just computed.
        together = len(tasks) == 1

        def assign(i: int, tag: str, chunk: slice) -> list[Message]:
            return fed.assign_head_task(
                fed.names[self.head_index[i]],
                rows,
                selection[i, chunk],
                weights[i, chunk],
                mask,
                normaliser=self._normaliser(self.head_index[i], mask),
                round=round,
                batch_id=batch_id,
                tag=tag,
                dp_rows=dp_rows,
                hold=(i, tag, chunk) == held,
                send_sums=not together,
                parts=parts,
            )

        sums = assign(*tasks[0]) if together else []
        fed.request_representations(
            "train",
            rows,
            mask,
            reply_to=AGGREGATOR,
            round=round,
            batch_id=batch_id,
            train=True,
            sums=sums,
            gradients_from=[fed.names[self.head_index[i]] for i, _, _ in tasks],
        )
        if not together:
            for task in tasks:
                assign(*task)
        loss = sum(
            fed.take_loss(fed.names[self.head_index[i]], round=round, batch_id=batch_id, tag=tag)
            for i, tag, _ in tasks
        )
        return loss, held is not None

    def _normaliser(self, head: int, mask: Tensor) -> float:
        """What head ``head``'s summed loss of the batch (availability ``mask``) is divided
        by: LASER's objective is a mean over the batch's samples; a Local or Ensemble head
        trains its party's own model on the samples it observes, a mean over those (the same
        under grouped batching, where a party observes all of a batch or none of it; under
        mixed batching dividing by the batch scaled each head's step by its observed share)."""
        if self.planner != "local":
            return loss_normaliser(self.sampler, mask.shape[0])
        return loss_normaliser(
            self.sampler,
            int(mask[:, head].sum()),
            counted=lambda: np.asarray(self.data.train.mask[:, head]),
        )

    @property
    def total_steps(self) -> int:
        return len(self.sampler) * self.config.epochs

    def epoch_samplers(self) -> list[BatchSampler]:
        return [self.sampler] * self.config.epochs

    @fits_once
    def fit(
        self, *, on_step: StepCallback | None = None, progress: TrainingProgress | None = None
    ) -> list[float]:
        progress = progress if progress is not None else TrainingProgress()
        losses = train_epochs(
            self.train_step,
            self.sampler,
            epochs=self.config.epochs,
            rng=self.fed.rng,
            on_step=on_step,
            progress=progress,
            on_epoch=lambda round: self.fed.rejoin(round=round),
            on_empty=lambda round: self.fed.pass_draw(round=round),
        )
        self.fed.flush(round=progress.step - 1)  # the last step's closing gradients
        return losses

    def head_predictions(self, split_name: str) -> np.ndarray:
        """Each head's prediction from exactly the observed set (Algorithm 2): (N, K), -1 absent.

        With a single head (``heads="active"``) every observed party reports the label party's
        prediction; under secure sums it predicts from the union of the usable blocks, and
        a sample with nothing releasable gets the head's answer to a zero mean (its prior).
        """
        answers = self._answers(split_name, probabilities=False)
        split = split_tensors(self.data)[split_name]  # its mask as the answers saw it
        out = np.full(split.mask.shape, -1, dtype=np.int64)
        for h, idx, predicted in answers:
            if self.config.heads == "all":
                out[idx, h] = predicted.numpy()
            else:
                out[idx] = broadcast_prediction(predicted.numpy(), split.mask[idx])
                lost = ~split.mask[idx].any(axis=1)  # every block it had was lost
                out[idx[lost], h] = predicted.numpy()[lost]
        return out

    def head_probabilities(self, split_name: str) -> np.ndarray:
        """Each head's class probabilities from the same observed sets as
        :meth:`head_predictions`: (N, H, C) over the heads of ``head_index``, NaN where a head
        makes no prediction."""
        answers = self._answers(split_name, probabilities=True)
        split = split_tensors(self.data)[split_name]
        out = np.full((split.n, len(self.head_index), self.data.num_classes), np.nan, np.float32)
        for h, idx, probabilities in answers:
            out[idx, self.head_index.index(h)] = probabilities.numpy()
        return out

    def predict_proba(self, split_name: str) -> np.ndarray:
        """Class probabilities (N, C): the mean of the predicting heads' probabilities (one head
        with ``heads="active"``; with ``"all"`` every observed party's head, each from the
        observed set, as LASER-VFL's Algorithm 2; Local and Ensemble: each from its own block)."""
        return np.nanmean(self.head_probabilities(split_name), axis=1)

    def _answers(
        self, split_name: str, *, probabilities: bool
    ) -> list[tuple[int, np.ndarray, Tensor]]:
        """Every head's answers on the split (:meth:`_head_answers`), from the blocks still
        held: a data party lost during the pass is dropped and the pass runs again without
        it (:meth:`~secure_vfl.methods.base.Federation.evaluation_pass`)."""
        return self.fed.evaluation_pass(
            lambda: list(self._head_answers(split_name, probabilities=probabilities)),
            round=self.total_steps - 1,
        )

    def _head_answers(
        self, split_name: str, *, probabilities: bool
    ) -> Iterator[tuple[int, np.ndarray, Tensor]]:
        """Every head's answers, batch by batch: (head index, the split's rows it answered for,
        its classes or, with ``probabilities``, its class probabilities)."""
        fed = self.fed
        split = split_tensors(self.data)[split_name]
        source = f"predict/{split_name}"
        query = fed.next_query()
        for batch_id, rows in enumerate(batches(split.n, 1024)):
            mask = torch.from_numpy(split.mask[rows.numpy()])
            # Samples whose every block was lost (a dropped party): the label party's head
            # answers for them from the empty set (a zero mean: its prior).
            orphans = ~mask.any(dim=1)
            fed.request_representations(
                split_name,
                rows,
                mask,
                reply_to=AGGREGATOR,
                round=query,
                batch_id=batch_id,
                train=False,
                tag=source,
            )
            dp_rows = None
            for h in self.head_index:
                if self.planner == "local":
                    selection = torch.zeros_like(mask)
                    selection[:, h] = mask[:, h]
                elif self.config.heads == "all":
                    selection = mask & mask[:, h : h + 1]
                elif self.blocks is not None:
                    plan = self.blocks.plan(split_name, rows, mask)
                    selection, dp_rows = plan.union(), self._dp_rows(plan.exposed)
                else:
                    selection = mask
                if self.config.heads == "all":
                    answered = selection.any(dim=1)
                    if h == 0:
                        answered = answered | orphans
                    positions = torch.nonzero(answered).flatten()
                    if positions.numel() == 0:
                        continue
                else:
                    positions = torch.arange(rows.numel())
                positions, predicted = fed.predict_with(
                    fed.names[h],
                    selection,
                    positions,
                    round=query,
                    batch_id=batch_id,
                    tag=f"predict/{split_name}",
                    source_tag=source,
                    probabilities=probabilities,
                    dp_rows=dp_rows,
                )
                yield h, rows.numpy()[positions.numpy()], predicted

    def predict(self, split_name: str) -> np.ndarray:
        if self.name != "ensemble":
            return self.head_predictions(split_name)
        return majority_vote(self.head_predictions(split_name), self.data.num_classes, self.fed.rng)


def majority_vote(
    predictions: np.ndarray, num_classes: int, rng: np.random.Generator
) -> np.ndarray:
    """Ensemble: the observed parties' majority class, ties broken at random, reported by all."""
    observed = predictions >= 0
    votes = np.zeros((predictions.shape[0], num_classes))
    for k in range(predictions.shape[1]):
        rows = np.nonzero(observed[:, k])[0]
        np.add.at(votes, (rows, predictions[rows, k]), 1.0)
    tie_break = rng.random(votes.shape) * 0.5
    winner = np.argmax(votes + tie_break, axis=1)
    return broadcast_prediction(winner, observed)


METHODS.register("laser", partial(MeanFusionMethod, planner="laser", name="laser"))
for _name in ("laser", "local", "ensemble"):
    PARTY_MODELS.register(_name, mean_fusion_models)
OWN_HEAD_METHODS = ("local", "ensemble")
"""The methods whose every party trains its own head on its own representation only."""
for _name in OWN_HEAD_METHODS:
    METHODS.register(_name, partial(MeanFusionMethod, planner="local", name=_name))
