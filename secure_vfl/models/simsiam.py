"""SimSiam (Chen and He, CVPR 2021): self-supervised pretraining of a party's bottom model.

FALSE-VFL's baselines may pretrain each party's bottom model on its own training rows, labelled
or not, before federated training. It is purely local: a party uses only its own block and
sends nothing. Two augmented views of each row pass through the bottom model and a projector
(z), a predictor maps one view's z to the other's (p); the loss is the negative cosine
similarity of p1 with stop-gradient(z2) and of p2 with stop-gradient(z1), halved.

Augmentations are generic, because blocks are tabular columns or image patches: every entry
is zeroed with probability ``drop`` and Gaussian noise of std ``noise`` is added (features
are standardised, images scaled to [0, 1]); image patches are also shifted by up to one pixel.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from secure_vfl.errors import ConfigError

PretrainProgress = Callable[[str, int, int], object]
"""Told ``(party, batches done, batches in all)`` after each batch of a party's pretraining."""

_PROGRESS: contextvars.ContextVar[PretrainProgress | None] = contextvars.ContextVar(
    "pretrain_progress", default=None
)


@contextlib.contextmanager
def pretrain_progress(progress: PretrainProgress) -> Iterator[None]:
    """Within the block, every party that pretrains its bottom model (a method built with
    ``pretrain_epochs``) reports each batch to ``progress`` (a progress bar: the CLI's), as
    training reports its steps; pretraining happens while the parties are made, before the
    training's own progress starts."""
    token = _PROGRESS.set(progress)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def progress_of(party: str) -> Callable[[int, int], object] | None:
    """The hook :func:`pretrain_simsiam` reports to for ``party``: the one installed by
    :func:`pretrain_progress` around this call, or None."""
    progress = _PROGRESS.get()
    if progress is None:
        return None
    return lambda done, total: progress(party, done, total)


def augment(
    x: Tensor, generator: torch.Generator, *, drop: float = 0.2, noise: float = 0.1
) -> Tensor:
    """One random view of the batch ``x`` (B, ...): dropout of entries, noise, image shifts."""
    keep = torch.rand(x.shape, generator=generator) >= drop
    view = x * keep + noise * torch.randn(x.shape, generator=generator)
    if x.dim() == 4:  # (B, C, H, W) image patches: a random shift of up to one pixel
        dy, dx = (int(v) for v in torch.randint(-1, 2, (2,), generator=generator))
        view = torch.roll(view, shifts=(dy, dx), dims=(2, 3))
    return view


class SimSiamHead(nn.Module):
    """The projector and predictor SimSiam puts on top of a bottom model of output width d."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.projector = nn.Sequential(
            nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width)
        )
        hidden = max(width // 4, 8)
        self.predictor = nn.Sequential(
            nn.Linear(width, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, width)
        )


def simsiam_loss(p1: Tensor, z1: Tensor, p2: Tensor, z2: Tensor) -> Tensor:
    """Symmetrised negative cosine similarity with stop-gradient on the targets (in [-1, 1])."""
    return -0.5 * (
        F.cosine_similarity(p1, z2.detach(), dim=-1).mean()
        + F.cosine_similarity(p2, z1.detach(), dim=-1).mean()
    )


def pretrain_simsiam(
    bottom: nn.Module,
    rows: Tensor,
    *,
    width: int,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    progress: Callable[[int, int], object] | None = None,
) -> list[float]:
    """Pretrain ``bottom`` in place on ``rows`` (a party's own block); mean loss per epoch.

    SGD with momentum 0.9 (SimSiam's optimiser); batches of fewer than 2 rows are skipped
    (batch norm needs two). ``bottom`` is left with no gradient: the last batch's would
    otherwise enter the first training step (and a run resumed from a checkpoint, pretrained
    again, would add it to the step after the checkpoint). ``progress(done, total)`` is told
    after every batch (skipped ones too) how many of the ``epochs`` x batches are done.
    """
    if epochs < 0:
        raise ConfigError(f"`pretrain_epochs` must be >= 0. Found {epochs}.")
    if rows.shape[0] < 2:
        raise ConfigError(
            "SimSiam pretraining needs at least 2 rows of the party's block. "
            f"Found {rows.shape[0]}."
        )
    head = SimSiamHead(width)
    parameters = [*bottom.parameters(), *head.parameters()]
    optimiser = torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    bottom.train()
    head.train()
    losses = []
    batches = math.ceil(rows.shape[0] / batch_size)
    done = 0
    for _ in range(epochs):
        order = torch.randperm(rows.shape[0], generator=generator)
        total, count = 0.0, 0
        for start in range(0, rows.shape[0], batch_size):
            done += 1
            batch = rows[order[start : start + batch_size]]
            if batch.shape[0] < 2:
                if progress is not None:
                    progress(done, epochs * batches)
                continue
            z1 = head.projector(bottom(augment(batch, generator)))
            z2 = head.projector(bottom(augment(batch, generator)))
            loss = simsiam_loss(head.predictor(z1), z1, head.predictor(z2), z2)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            total += loss.item() * batch.shape[0]
            count += batch.shape[0]
            if progress is not None:
                progress(done, epochs * batches)
        losses.append(total / max(count, 1))
    optimiser.zero_grad(set_to_none=True)
    return losses
