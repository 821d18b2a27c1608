"""What a receiver may learn about one sample over a whole run, and the check that it learns
no single party's term.

A secure sum hides each contributor among the others *within one sum*. Over a run the receiver
collects many sums about the same sample (every training step of every epoch, every prediction
under every test split) and may combine them: from A+B, A+C and B+C it gets
A = ((A+B) + (A+C) - (B+C)) / 2. :func:`isolated_terms` is the worst-case audit of that: it
treats the sums as exact linear functions of fixed terms (a model that has stopped moving) and
asks, for every sample and party, whether some linear combination over the reals isolates the
party's term.

:class:`ReleaseBlocks` is the rule that passes that audit under a single label party (the
receiver): every sum it asks for about a sample is a union of fixed *blocks* of that sample's
other parties, each of >= 2 members, plus its own term. Why that is safe, and what
``release="dp"`` may add to it, is in the class's docstring.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

_TRAIN_STREAM, _FIXED_STREAM = 1, 2


def isolated_terms(released: np.ndarray, exposed: np.ndarray) -> np.ndarray:
    """(B, K) bool: which party's term of each sample some linear combination of its releases
    isolates.

    ``released`` (B, m, K): for sample b, the indicator vectors over the parties of the m clean
    parts of the sums the receiver got about it (zero rows pad; the receiver's own column must
    be zero: it knows its own term). ``exposed`` (B, K): the parties whose term of the sample
    the receiver also got as a DP release (clipped and noised, priced by that party's
    accountant). Such a release counts as the known vector e_j when auditing every *other*
    party (the worst case: the noise is no help to them) but not when auditing j itself, whose
    exposure is priced: party k of sample b is isolated iff
    e_k is in span(released[b] and e_j for the exposed j != k).
    """
    released = np.asarray(released, dtype=np.float64)
    exposed = np.asarray(exposed, dtype=bool)
    if released.ndim != 3 or exposed.shape != (released.shape[0], released.shape[2]):
        raise ValueError(
            f"released (B, m, K) and exposed (B, K) expected; found {released.shape} and "
            f"{exposed.shape}."
        )
    samples, _, parties = released.shape
    isolated = np.zeros((samples, parties), dtype=bool)
    identity = np.eye(parties)
    for k in range(parties):
        known = exposed.copy()
        known[:, k] = False
        # The exposures other than k's, as rows e_j (zero rows where not exposed).
        exposures = known[:, :, None] * identity[None]
        basis = np.concatenate([released, exposures], axis=1)
        target = np.broadcast_to(identity[k], (samples, 1, parties))
        with_target = np.concatenate([basis, target], axis=1)
        isolated[:, k] = _rank(with_target) == _rank(basis)
    return isolated


def _rank(stack: np.ndarray) -> np.ndarray:
    """Ranks of a (B, m, K) stack of small 0/1 matrices (B,); an all-zero matrix has rank 0."""
    if stack.shape[1] == 0:
        return np.zeros(stack.shape[0], dtype=np.int64)
    return np.asarray(np.linalg.matrix_rank(stack), dtype=np.int64)


def partition(others: np.ndarray, priority: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut each row's ``others`` (N, K) bool into blocks in the order of ``priority`` (N, K):
    consecutive pairs, the last three a triple when the count is odd (>= 3), a lone party a
    block of its own.

    Returns ``block`` (N, K) int64, each party's block number in its row (-1 outside
    ``others``), and ``exposable`` (N, K) bool, the members a DP release may expose (at most
    ``|block| - 2`` per block of >= 2, so a block's clean sum minus its exposures keeps >= 2
    unknown terms): the triple's last member and a lone party.
    """
    order = np.where(others, priority, np.inf)
    rank = order.argsort(axis=1).argsort(axis=1)
    count = others.sum(axis=1, keepdims=True)
    triple_last = others & (count % 2 == 1) & (count >= 3) & (rank == count - 1)
    block = np.where(triple_last, rank // 2 - 1, rank // 2)
    block = np.where(others, block, -1).astype(np.int64)
    exposable = others & ((count == 1) | triple_last)
    return block, exposable


@dataclass(frozen=True)
class BlockPlan:
    """What a batch may release to the receiver: ``slots`` (B, S, K) bool, slot 0 the
    receiver's own term (if observed), slot s >= 1 block s - 1's releasable part (the whole
    block if usable, its exposed members under DP, else nothing); ``exposed`` (B, K) bool, the
    parties whose row goes as a DP release; ``observed`` (B,), the size n of each row's
    observed set (what LASER's loss weights depend on)."""

    slots: Tensor
    exposed: Tensor
    observed: Tensor

    def parts(self) -> Tensor:
        """(S, B, K): the slots as the sums to ask for, those no row of the batch fills left
        out (the first kept for an empty batch). At each row they are disjoint and every task
        of :meth:`tasks` is a union of them, so the receiver adds each task's sum from theirs
        and every contributor enters one sum a step; each is itself a task wherever it is
        filled, so asking for them releases nothing the tasks would not."""
        parts = self.slots.transpose(0, 1)
        used = parts.flatten(1).any(dim=1)
        if not bool(used.any()):
            used[0] = True
        return parts[used].contiguous()

    def union(self) -> Tensor:
        """(B, K): every releasable part of each row together (prediction's selection)."""
        return self.slots.any(dim=1)

    def tasks(self) -> tuple[Tensor, Tensor]:
        """Every union of a row's non-empty slots, each weighted ``(2^n - 1) / (n |A(O)|)``:
        selection (1, T, B, K) and weights (1, T, B), the task slots no row of the batch uses
        left out.

        The slots are disjoint, so each union is a distinct subset S of the observed set O,
        and these are exactly the releasable subsets A(O). LASER's single-head loss of a row
        is ``(1 / n) sum_{S in O} CE(S) = ((2^n - 1) / n) E[CE(S)]``, S uniform over the
        non-empty subsets of O; this is the same with S uniform over A(O) instead (LASER's
        subset distribution conditioned on being releasable), evaluated exactly: no sampling,
        so no variance. Why not ``(1 / n) sum_{S in A(O)} CE(S)``, the objective merely
        restricted: its mass per row shrinks from (2^n - 1) / n to |A(O)| / n (3.75 to 0.75 for
        a fully observed row of 4 parties), which acts as a learning rate several times
        smaller than the plaintext run's with the same recipe (digits, 4 parties, 5 epochs, lr
        0.1: 62.7 % against 93.6 % at test MCAR 0). Conditioning keeps each row's mass, and so
        the recipe, as in plaintext.
        """
        slots = self.slots.shape[1]
        unions = torch.tensor(
            [
                [s in chosen for s in range(slots)]
                for size in range(1, slots + 1)
                for chosen in itertools.combinations(range(slots), size)
            ]
        )
        filled = self.slots.any(dim=2)  # (B, S)
        valid = (~unions.unsqueeze(1) | filled.unsqueeze(0)).all(dim=2)  # (T, B)
        selection = torch.einsum("ts,bsk->tbk", unions.float(), self.slots.float()) > 0
        selection &= valid.unsqueeze(-1)
        n = self.observed.float()
        releasable = valid.sum(dim=0).clamp(min=1)
        share = (2.0**n - 1) / (n.clamp(min=1) * releasable)
        weights = torch.where(valid & (n > 0), share, torch.zeros_like(n))
        used = valid.any(dim=1)
        if not bool(used.any()):
            used[0] = True  # one (all-zero) task keeps the shapes of an empty batch
        return selection[used].unsqueeze(0), weights[used].unsqueeze(0)


class ReleaseBlocks:
    """The safety rule for the sums a single receiver (the label party) gets about a sample.

    Every other party of a row belongs to one *block* of >= 2 parties (or, a lone party, a
    block of one), fixed for the whole run. A block is usable in a step or a prediction iff
    all its members are observed there (missingness, a dropped party); every sum asked for is
    a union of usable blocks of the row, with or without the receiver's own term.

    Why no combination isolates a party (over the reals, over the whole run): each sum's
    indicator vector over the other parties is a sum of block indicators, so any linear
    combination v of the sums is constant on every block. e_j is 1 at j and 0 at j's block
    mates, so it is not constant on j's block (>= 2 members) and is no such v; a block of one
    is never usable. This holds whatever the steps, epochs, test splits and drops do, as long
    as a sample's blocks never change; hence how they are drawn:

    - training rows: each row's observed others in the training mask as the run starts,
      shuffled by a generator seeded from ``seed`` and cut by :func:`partition`. The mask is
      the run's own and only loses columns (a dropped party), so the blocks stay put (a drop
      makes its blocks unusable). No state: the same seed and data give the same blocks, so
      a resumed or deployed run gets them for free.
    - every other split: one partition of *all* other parties for the run, from ``seed``. Test
      splits hold the same samples under different missingness, but their row numbers need not
      match (a sample with no observed block is left out of a split) and a split may come
      later (a deployment's new split), so nothing per row can key them; a partition that
      depends on neither row nor mask cannot differ between them. (Training rows are never
      predicted under another mask in a run: the train and test samples are disjoint.)
    - a training sample predicted again later (a saved model's prediction of an id it trained
      on, which only its id can tell): its training blocks, by :meth:`match`. The fixed
      partition would group its other parties another way, and a prediction sum minus a
      training sum could then isolate one party's term (docs/security-review.md, F29).

    Under ``expose`` (``release="dp"``) a block that is not usable may release its
    *exposable* members that are observed, each as a DP release of that party (clipped and
    noised inside it, priced by its accountant): a lone party, or one fixed member of a triple
    (:func:`partition`). At most ``|block| - 2`` members of a block of >= 2 are ever
    exposable, so a block's clean sum minus every exposure of its members still holds >= 2
    unknown terms: v is constant on the unexposed members, and an exposure (the known e_j,
    for everyone but j, whose exposure is priced) isolates no one else. An exposed party's
    row is flagged as a DP release in every sum of the request it enters, never sent clean.
    """

    def __init__(
        self, train_mask: np.ndarray, *, receiver: int, seed: int, expose: bool = False
    ) -> None:
        rows, parties = train_mask.shape
        others = np.asarray(train_mask, dtype=bool).copy()
        others[:, receiver] = False
        train_priority = np.random.default_rng([seed, _TRAIN_STREAM]).random((rows, parties))
        self._train = partition(others, train_priority)
        everyone = np.ones((1, parties), dtype=bool)
        everyone[0, receiver] = False
        fixed_priority = np.random.default_rng([seed, _FIXED_STREAM]).random((1, parties))
        self._fixed = partition(everyone, fixed_priority)
        self.receiver = receiver
        self.seed = seed
        self.expose = expose
        self.blocks = max(1, (parties - 1) // 2)
        self._matched: dict[str, np.ndarray] = {}  # by split: each row's training row, or -1

    def with_training(self, train_mask: np.ndarray) -> ReleaseBlocks:
        """The same rule for a run whose training mask was ``train_mask`` (N, K): what a
        rebuilt method, which has no training rows, needs to give a training sample its blocks
        (the same seed and mask give the same blocks)."""
        return ReleaseBlocks(train_mask, receiver=self.receiver, seed=self.seed, expose=self.expose)

    def match(self, split: str, train_rows: np.ndarray) -> None:
        """Row ``i`` of ``split`` (not training) is training sample ``train_rows[i]`` (-1: a
        sample the run did not train on): such a row's sums use its training blocks, every
        other row the fixed partition. ValueError for a training row this rule does not have."""
        if split == "train":
            raise ValueError("the training split's rows are the training samples already.")
        train_rows = np.asarray(train_rows, dtype=np.int64)
        count = self._train[0].shape[0]
        if train_rows.ndim != 1 or ((train_rows < -1) | (train_rows >= count)).any():
            raise ValueError(
                f"1-d training rows in [-1, {count}) expected, found shape {train_rows.shape} "
                f"in [{train_rows.min(initial=0)}, {train_rows.max(initial=0)}]."
            )
        self._matched[split] = train_rows

    def matched(self, split: str) -> int:
        """How many rows of ``split`` are training samples with their training blocks."""
        found = self._matched.get(split)
        return 0 if found is None else int((found >= 0).sum())

    def unused(self, split: str, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the rows of ``split`` (not training) whose observed sets are ``mask`` (N, K):
        which observed blocks no sum may use, (N, K) bool (a block whose mates are not all
        observed), and which rows are left with nothing to release (N,) bool (predicted from
        the receiver's prior)."""
        rows = torch.arange(mask.shape[0])
        union = self.plan(split, rows, torch.from_numpy(np.asarray(mask, dtype=bool))).union()
        used = union.numpy()
        return mask & ~used, np.asarray(~used.any(axis=1))

    def fixed_blocks(self) -> list[list[int]]:
        """The parties of each block of every split but training (the receiver in none)."""
        block = self._fixed[0][0]
        return [
            [int(k) for k in np.flatnonzero(block == b)]
            for b in range(self.blocks)
            if (block == b).any()
        ]

    def blocks_of(self, split: str, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The blocks of ``rows`` of ``split``: block (B, K) int64 (-1: the receiver, and a
        training row's parties not observed as the run started) and exposable (B, K) bool,
        as :func:`partition` returns them."""
        if split == "train":
            block, exposable = (torch.from_numpy(a[rows.numpy()]) for a in self._train)
            return block, exposable
        shape = (rows.numel(), self._fixed[0].shape[1])
        block, exposable = (torch.from_numpy(a).expand(*shape) for a in self._fixed)
        matched = self._matched.get(split)
        if matched is None:
            return block, exposable
        train = matched[rows.numpy()]
        again = torch.from_numpy(train >= 0)
        if not bool(again.any()):
            return block, exposable
        block, exposable = block.clone(), exposable.clone()
        block[again] = torch.from_numpy(self._train[0][train[train >= 0]])
        exposable[again] = torch.from_numpy(self._train[1][train[train >= 0]])
        return block, exposable

    def plan(self, split: str, rows: Tensor, mask: Tensor) -> BlockPlan:
        """The releasable parts of the batch ``rows`` of ``split`` whose observed sets are
        ``mask`` (B, K) now."""
        block, exposable = self.blocks_of(split, rows)
        own = torch.zeros_like(mask)
        own[:, self.receiver] = mask[:, self.receiver]
        slots, exposed = [own], torch.zeros_like(mask)
        for number in range(self.blocks):
            members = block == number
            usable = (members.sum(dim=1) >= 2) & ~(members & ~mask).any(dim=1)
            part = members & usable.unsqueeze(1)
            if self.expose:
                shown = members & exposable & mask & ~usable.unsqueeze(1)
                part |= shown
                exposed |= shown
            slots.append(part)
        return BlockPlan(torch.stack(slots, dim=1), exposed, mask.sum(dim=1))
