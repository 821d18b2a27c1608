"""FALSE-VFL-I and FALSE-VFL-II: latent-variable VFL with any alignment and unlabelled rows.

The model (paper section 3.3): every data party k encodes its block into the mean and diagonal
precision of its factor of q(h | x_obs) and decodes p(x^k | h); the label party (party 0, which
also holds block 0) holds q(z | h), p(h | z) and the discriminator p(y | h). The posterior
aggregates only the observed parties (paper eq. 1): mean = average of their means, precision =
sum of their precisions. Eq. 1 writes covariances, Sigma = (sum_k Sigma_k^-1)^-1; with diagonal
outputs that is exactly the sum of per-coordinate precisions used here, so there is no
discrepancy, only the choice to let encoders output precisions rather than variances.

Training is two-stage (section 4): stage 1 maximises the kappa-sample importance-weighted bound
L_kappa of log p(x_obs) over every training row, labelled or not, with respect to Theta_g; stage
2 freezes Theta_g and maximises L'_kappa, the bound of log p(y, x_obs), over the labelled rows
with respect to the discriminator only. Prediction is self-normalised importance sampling over L
samples whose weights are computed without the label (section 3.4).

FALSE-VFL-II (appendix A.2) adds p(m^k | x^k) at every party: an observed block adds
log p(m^k = 0 | x^k); a missing block is drawn from the party's decoder, x~^k ~ p(x^k | h_j)
(reparameterised, from the party's own generator), and adds log p(m^k = 1 | x~^k). The draw's
density cancels between the model and the proposal, so only the mask term enters the weight.

Parties are actors (:class:`LatentParty`, :class:`LatentLabelParty`); the label party's program
(:class:`FalseVflMethod`) drives. Communication, in the pattern of section 3.5, every message
encoded on the wire:

1. the label party asks each party with observed rows (a ``RepresentRequest``) for
   concat[mean, precision] of those rows; each sends it to the aggregator (a
   ``RepresentationMessage``; under a secure-sum scheme it keeps it and sends only its sealed
   share on a ``SealRequest``), and the aggregator answers the label party's ``SumRequest``
   (one task, selection = the observed set) with their sums. A secure backend therefore
   protects the per-party (mean, precision) exactly as it protects LASER's representations.
2. the label party draws h_1..h_S from q(h | x_obs) and sends each party a ``LatentMessage`` for
   its observed rows (FALSE-VFL-II: for every row of the batch, missing ones included), naming
   the rows of the party's table they are;
3. each party returns one scalar per row and sample, log p(x^k | h_j) (+ its mask term in
   FALSE-VFL-II), as a ``LikelihoodMessage`` (the paper says "probabilities"; their logs carry
   the same information without underflow);
4. stage 1 only, backward: the label party sends each party the gradient of the loss with respect
   to its log-likelihoods (``GradientMessage``, tag ``.../likelihood``); the party backpropagates
   through its decoder and returns the gradient with respect to the h it received
   (``LatentGradientMessage``) -- the paper leaves this implicit, but without it the decoders'
   pull on h never reaches the encoders; the label party adds the returned gradients to its own,
   backpropagates through the reparameterisation and the aggregated sums, and sends each party
   the gradient with respect to its (mean, precision) (``GradientMessage``, tag
   ``.../posterior``), then an ``UpdateRequest``: the party backpropagates it through its encoder
   and steps its optimiser. Stage 2 and prediction exchange no gradients.

No party reads another party's tensors; only the label party holds labels, and only of the
labelled training rows (``MethodConfig.labeled``). What the pattern still reveals, by design of
the paper: the label party sees each party's per-sample log-likelihoods and, in stage 1, the
gradient of each party's decoder term with respect to h; each party sees the latent samples.
A party's outgoing hooks see every message it sends, but the DP mechanisms written for
representation and gradient messages would noise steps 1 and 4 only, not the likelihood and
latent-gradient messages, which carry feature information too (so FALSE-VFL refuses DP flags).

A data party lost mid-training (a deployment: its process died) is a missing block, as in
LASER: the driver drops it (:meth:`~secure_vfl.methods.base.Federation.recover`), every other
party discards what the broken step left (kept likelihoods, gradients already in its decoder
or the label-side model) and the step is retried under a fresh batch id, each row's posterior
over the parties still observed (eq. 1 over the rest; FALSE-VFL-II leaves the lost block out of
the weight rather than ask for its mask term). A row whose every block was lost is predicted
from the prior. Stage 2's rounds run on after stage 1's, so a fault names the run's step.

Under secure sums (``MethodConfig.secure_sums``) the label party may only receive sums from which
no combination over the whole run isolates another party's term: a row's posterior sums its own
block and the row's usable blocks of >= 2 other parties (fixed for the run,
:class:`~secure_vfl.federation.releases.ReleaseBlocks`), so a row observed by the label party and
exactly one other party uses the label party's block alone, and a row with neither has no
posterior: it is skipped in training and predicted from the prior p(h)
(:meth:`FalseVflMethod.posterior_selection`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from secure_vfl import checks
from secure_vfl.data.party_preprocessing import PartyPreprocessing
from secure_vfl.data.samplers import BatchSampler, make_sampler
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ConfigError, ProtocolError
from secure_vfl.federation.aggregator import SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import (
    AGGREGATOR,
    AbortRequest,
    GradientMessage,
    LatentGradientMessage,
    LatentMessage,
    LikelihoodMessage,
    Message,
    SumMessage,
    UpdateRequest,
    party_name,
)
from secure_vfl.federation.parties import ROLES, DataParty, Party, RoleFactory, SumLayout
from secure_vfl.federation.releases import ReleaseBlocks
from secure_vfl.methods.base import (
    MAX_REPRESENTATION_DIM,
    METHODS,
    PARTY_MODELS,
    MethodConfig,
    PartyModels,
    StepCallback,
    TrainingProgress,
    broadcast_prediction,
    build_federation,
    build_party,
    fits_once,
    isolated_seed,
    labeled_rows,
    refuse_top_model,
    require_hiding_crowd,
    split_tensors,
    train_epochs,
)
from secure_vfl.models.latent import (
    MIN_PRECISION,
    Draws,
    LabelSideModel,
    PartyLatentModel,
    gaussian_log_prob,
    generator_draws,
    row_shared_draws,
)

Variant = Literal[1, 2]
_PREDICT_BATCH = 256


MAX_SAMPLES = 10_000
"""The most latent samples per row (``kappa``, ``inference_samples``): a batch holds them all
at once, 16 KiB per row and sample at the default sizes and batch (10^8 asked 1.6 TB)."""


@dataclass(frozen=True, kw_only=True)
class FalseVflConfig:
    """FALSE-VFL's own hyper-parameters: kappa and L (``inference_samples``) as the paper's
    Table 11; sizes and learning rates scaled to short CPU runs (the paper trains h of 128-256
    and z of 32-64 dimensions with Adam at 5e-5 to 2e-3 for 150-500 epochs).

    ``pretrain_epochs`` / ``train_epochs`` default to ``MethodConfig.epochs`` for each stage.
    Both stages use Adam (as the paper) with these learning rates and
    ``MethodConfig.weight_decay``; ``MethodConfig.lr`` and ``momentum`` (SGD's) are not used.
    """

    kappa: int = 10
    inference_samples: int = 50
    latent_dim: int = 32
    global_latent_dim: int = 16
    hidden: int = 128
    pretrain_epochs: int | None = None
    train_epochs: int | None = None
    pretrain_lr: float = 3e-3
    train_lr: float = 3e-3

    def __post_init__(self) -> None:
        counts = ("kappa", "inference_samples", "latent_dim", "global_latent_dim", "hidden")
        epochs = ("pretrain_epochs", "train_epochs")  # None: the method's own epochs
        values: dict[str, object] = {
            name: checks.integer(name, getattr(self, name), low=1)
            for name in (*counts, *epochs)
            if name in counts or getattr(self, name) is not None
        }
        for name in ("latent_dim", "global_latent_dim", "hidden"):  # a layer's width
            if values[name] > MAX_REPRESENTATION_DIM:  # type: ignore[operator]
                raise ConfigError(
                    f"`{name}` must be at most {MAX_REPRESENTATION_DIM}. Found {values[name]}."
                )
        for name in ("pretrain_lr", "train_lr"):
            values[name] = checks.real(name, getattr(self, name), low=0, low_open=True)
        for name in ("kappa", "inference_samples"):  # each row's samples are held at once
            if values[name] > MAX_SAMPLES:  # type: ignore[operator]
                raise ConfigError(
                    f"`{name}` must be at most {MAX_SAMPLES} latent samples per row (the "
                    f"paper's runs: kappa 10, L 50). Found {values[name]}."
                )
        checks.store(self, values)


def _phase(split: str) -> str:
    """Releases about training rows are priced as training releases, whatever the stage."""
    return "train" if split == "train" else "predict"


LIKELIHOOD = "/likelihood"
"""Suffix of the tag of a gradient on the log-likelihoods a party returned (step 4)."""
_POSTERIOR = "/posterior"
"""Suffix of the tag of the posterior factors (step 1) and of their gradients (step 4)."""


class LatentParty(DataParty):
    """A data party of FALSE-VFL: its block, which rows it holds, its encoder/decoder/missingness
    model (:class:`~secure_vfl.models.latent.PartyLatentModel`, its "bottom model": it sends
    concat[mean, precision] like a representation), its optimiser and its own generator (the
    draws x~ of FALSE-VFL-II). Beyond a data party's messages it answers latent samples with
    log-likelihoods and a gradient on those with the gradient on the samples.
    """

    def __init__(
        self,
        name: str,
        blocks: Mapping[str, Tensor],
        model: PartyLatentModel,
        optimizer: torch.optim.Optimizer,
        *,
        observed: Mapping[str, Tensor],
        generator: torch.Generator,
    ) -> None:
        super().__init__(name, blocks, model, optimizer)
        self._observed = dict(observed)
        self.generator = generator
        self.shared_draws: int | None = None
        """A seed where the party serves a saved model's prediction: its draws x~ (FALSE-VFL-II)
        at prediction are then the same for every row (:func:`row_shared_draws`), so what it
        answers for a row depends on the row alone (None: from its generator, as in training
        and training-time evaluation)."""
        self._likelihood_pending: dict[tuple[int, str], tuple[Tensor, Tensor, Tensor]] = {}

    @property
    def latent_model(self) -> PartyLatentModel:
        """The party's encoder, decoder and missingness model."""
        model = self.models[""]
        assert isinstance(model, PartyLatentModel)
        return model

    def on_latent(self, message: LatentMessage) -> None:
        """log p(x^k | h_j) per row and sample; FALSE-VFL-II adds log p(m^k | x^k or x~^k).

        A row this party does not hold is only ever scored through its missingness model.
        """
        x_rows = self.block_rows(message.split, message.rows)
        held = self._observed[message.split][message.rows]
        key = (message.round, message.tag)
        if message.backward and key in self._likelihood_pending:
            raise ProtocolError(
                f"{self.name}: second latent samples for round {message.round}, tag "
                f"{message.tag!r} (a replayed message?)."
            )
        model = self.latent_model
        width = model.encoder.latent
        if message.samples.shape[2] != width:
            raise ProtocolError(
                f"{self.name}: latent samples of width {width} expected, found "
                f"{message.samples.shape[2]} from {message.sender} for round {message.round}."
            )
        missingness = model.missingness
        if missingness is None and not bool(held.all()):
            raise ProtocolError(
                f"{self.name}: latent samples for rows it does not hold, but it has no "
                "missingness model (FALSE-VFL-I scores observed rows only)."
            )
        if message.backward:
            self._forget_unfinished(message.round)
        train = message.backward
        h = message.samples.clone().requires_grad_(True) if train else message.samples
        with torch.set_grad_enabled(train):
            log_likelihood = torch.zeros(h.shape[:2])
            observed = torch.nonzero(held).flatten()
            if observed.numel():
                x = x_rows[observed].flatten(1)
                value = model.decoder.log_prob(x.unsqueeze(1), h[observed])
                if missingness is not None:
                    value = value + missingness.log_prob(x, missing=False).unsqueeze(1)
                log_likelihood = log_likelihood.index_put((observed,), value)
            missing = torch.nonzero(~held).flatten()
            if missing.numel() and missingness is not None:
                drawn = model.decoder.sample(h[missing], self._draws(train))
                value = missingness.log_prob(drawn, missing=True)
                log_likelihood = log_likelihood.index_put((missing,), value)
        if train:
            self._likelihood_pending[key] = (h, log_likelihood, message.positions)
        self.send(
            LikelihoodMessage(
                **self.reply_header(message),
                positions=message.positions,
                tag=message.tag,
                phase=message.phase,
                log_likelihood=log_likelihood.detach(),
            )
        )

    def _draws(self, train: bool) -> Draws:
        """The draws of a pass: shared by every row in a saved model's prediction (fresh from
        :attr:`shared_draws` each time), else the party's generator's."""
        if self.shared_draws is not None and not train:
            return row_shared_draws(self.shared_draws)
        return generator_draws(self.generator)

    def _forget_unfinished(self, round: int) -> None:
        """Before step ``round``'s likelihoods: what an earlier step whose update never reached
        this party (the driver closed it without it: a party lost at the update) left here --
        its likelihoods, the gradients received for it and the decoder gradients, which that
        update would have applied -- is discarded, not carried into this step."""
        unfinished = [
            _drop_before(store, round)
            for store in (self._likelihood_pending, self._pending, self._gradients)
        ]
        if any(unfinished):
            self.latent_model.zero_grad(set_to_none=True)

    def on_gradient(self, message: GradientMessage) -> None:
        if self.driver not in (None, message.sender):  # its encoder's and decoder's alike
            raise ProtocolError(
                f"{self.name}: a gradient from {message.sender}; under FALSE-VFL only the run's "
                f"driver, {self.driver}, sends gradients."
            )
        if message.tag.endswith(LIKELIHOOD):
            self._latent_gradient(message, message.tag.removesuffix(LIKELIHOOD))
        else:
            super().on_gradient(message)

    def _latent_gradient(self, message: GradientMessage, tag: str) -> None:
        """Backpropagate the loss gradient on the returned log-likelihoods into the decoder (and
        missingness model); answer with the gradient with respect to the latent samples."""
        entry = self._likelihood_pending.get((message.round, tag))
        if entry is None:
            raise ProtocolError(
                f"{self.name}: a likelihood gradient for round {message.round} (tag {tag!r}) "
                "but no pending likelihoods."
            )
        h, log_likelihood, positions = entry
        if not torch.equal(message.positions, positions) or (
            message.gradient.shape != log_likelihood.shape
        ):
            raise ProtocolError(
                f"{self.name}: a gradient for the {positions.numel()} rows of "
                f"{log_likelihood.shape[1]} samples sent expected, found "
                f"{message.positions.numel()} rows of shape {tuple(message.gradient.shape)}."
            )
        del self._likelihood_pending[(message.round, tag)]
        log_likelihood.backward(message.gradient)
        assert h.grad is not None
        self.send(
            LatentGradientMessage(
                **self.reply_header(message),
                positions=positions,
                tag=tag,
                phase=message.phase,
                gradient=h.grad.detach(),
            )
        )

    def hold_split(self, split: str, block: Tensor, held: Tensor) -> None:
        """Hold a new split's block and which of its rows it holds (scored by its decoder)."""
        super().hold_split(split, block, held)
        self._observed[split] = held

    def on_update(self, message: UpdateRequest) -> None:
        super().on_update(message)
        for stale in [k for k in self._likelihood_pending if k[0] <= message.round]:
            del self._likelihood_pending[stale]

    def on_abort(self, request: AbortRequest) -> None:
        """Discard the abandoned step ``request.round`` (a party was lost): besides a data
        party's forward passes and gradients, the likelihoods kept for their gradient and what
        a likelihood gradient already put into its decoder (and missingness model), so that
        nothing of the step is applied when the retry's update comes. Between two updates its
        model's gradients are the current step's only (every update clears them)."""
        super().on_abort(request)
        for key in [key for key in self._likelihood_pending if key[0] == request.round]:
            del self._likelihood_pending[key]
        self.latent_model.zero_grad(set_to_none=True)


class LatentLabelParty(LatentParty):
    """The label party of FALSE-VFL: a data party (it holds block 0) that also holds the labels
    of the labelled training rows, q(z|h), p(h|z), p(y|h), their optimisers and the generator
    of its draws of h and z. The method object is its program; it is owed the posterior sums."""

    def __init__(
        self,
        name: str,
        blocks: Mapping[str, Tensor],
        model: PartyLatentModel,
        optimizer: torch.optim.Optimizer,
        *,
        observed: Mapping[str, Tensor],
        generator: torch.Generator,
        labels: Tensor,
        label_model: LabelSideModel,
        generative_optimizer: torch.optim.Optimizer,
        discriminator_optimizer: torch.optim.Optimizer,
        latent_generator: torch.Generator,
    ) -> None:
        super().__init__(name, blocks, model, optimizer, observed=observed, generator=generator)
        self._labels = labels
        self.label_model = label_model
        self.generative_optimizer = generative_optimizer
        self.discriminator_optimizer = discriminator_optimizer
        self.latent_generator = latent_generator

    @property
    def receives_sums(self) -> bool:
        return True

    def own_modules(self) -> dict[str, torch.nn.Module]:
        """Its encoder/decoder and its label-side model q(z|h), p(h|z), p(y|h)."""
        return {**super().own_modules(), "label-model": self.label_model}

    def own_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Its encoder/decoder's, and the label-side model's of each stage."""
        return {
            **super().own_optimizers(),
            "label-model/generative": self.generative_optimizer,
            "label-model/discriminator": self.discriminator_optimizer,
        }

    def on_abort(self, request: AbortRequest) -> None:
        """Discard the abandoned step as a data party does, and what its own backward pass put
        into the label-side model (the retry computes it again)."""
        super().on_abort(request)
        self.label_model.zero_grad(set_to_none=True)

    def labels(self, rows: Tensor) -> Tensor:
        """Labels of training ``rows``; refuses rows whose label it does not hold."""
        labels = self._labels[rows]
        if bool((labels < 0).any()):
            raise ProtocolError(f"{self.name}: asked for the label of an unlabelled row.")
        return labels


def _check_reply(
    receiver: str,
    reply: LikelihoodMessage | LatentGradientMessage,
    positions: Tensor,
    values: Tensor,
    shape: Sequence[int],
) -> None:
    """Refuse (ProtocolError) a party's log-likelihoods or latent gradient ``values`` that do not
    answer the latent samples it was sent: the batch ``positions`` they were for, each with
    ``shape`` (its samples, and for a gradient the latent width). Taken as they came, a row left
    out was weighed without the party's term and other shapes failed in torch."""
    found = (reply.positions.tolist(), tuple(values.shape[1:]))
    if found != (positions.tolist(), tuple(shape)):
        sent, answered = _positions_text(positions), _positions_text(reply.positions)
        if found[0] != positions.tolist() and answered == sent:
            answered += " (others between)"
        raise ProtocolError(
            f"{receiver}: a {reply.kind} reply from {reply.sender} for the {sent} it was "
            f"sent latent samples for, shape {tuple(shape)} per row, expected; found "
            f"{answered}, shape {found[1]} per row."
        )


def _positions_text(positions: Tensor) -> str:
    """``positions`` for an error message: how many, the first and the last."""
    if positions.numel() == 0:
        return "no batch positions"
    return f"{positions.numel()} batch positions {int(positions[0])} to {int(positions[-1])}"


def _drop_before(store: dict[tuple[int, str], Any], round: int) -> bool:
    """Delete the entries of ``store`` (keyed by round and tag) of rounds before ``round``;
    whether there were any."""
    stale = [key for key in store if key[0] < round]
    for key in stale:
        del store[key]
    return bool(stale)


ROLES.register("latent-party", LatentParty)
ROLES.register("latent-label-party", LatentLabelParty)

VARIANTS: dict[str, Variant] = {"false-vfl-1": 1, "false-vfl-2": 2}
"""FALSE-VFL's variant by its registered method name."""


def latent_model(
    k: int,
    shapes: Sequence[tuple[int, ...]],
    options: FalseVflConfig,
    variant: Variant,
    seed: int,
) -> PartyLatentModel:
    """Party ``k``'s encoder and decoder (and FALSE-VFL-II's missingness model) for its block of
    shape ``shapes[k]``, initialised under seed ``seed + k``: the seed rule of every run, in one
    process or in the party's own (:mod:`secure_vfl.deployment`)."""
    with isolated_seed(seed + k):
        return PartyLatentModel(
            shapes[k], options.latent_dim, hidden=options.hidden, missingness=variant == 2
        )


def _adam(
    parameters: Iterable[torch.nn.Parameter], lr: float, config: MethodConfig
) -> torch.optim.Optimizer:
    """Adam, as the paper trains both stages, with the run's weight decay."""
    return torch.optim.Adam(parameters, lr=lr, weight_decay=config.weight_decay)


def make_latent_party(
    k: int,
    name: str,
    role: RoleFactory,
    blocks: dict[str, Tensor],
    model: torch.nn.Module,
    *,
    observed: Mapping[str, Tensor],
    config: MethodConfig,
    options: FalseVflConfig,
    seed: int,
    **label_side: object,
) -> Party:
    """Party ``k`` of FALSE-VFL playing ``role``: its ``blocks`` and which of their rows it holds
    (``observed``, per split), its ``model``, its own Adam optimiser (stage 1's learning rate)
    and its own generator, seeded ``seed + 100 + k`` (FALSE-VFL-II's draws x~). The label party
    takes its ``label_side`` too (labels, label-side model, their optimisers and generator)."""
    optimizer = _adam(model.parameters(), options.pretrain_lr, config)
    generator = torch.Generator().manual_seed(seed + 100 + k)
    return role(
        name, blocks, model, optimizer, observed=observed, generator=generator, **label_side
    )


def predict_as_saved(party: Party, seed: int, index: int) -> None:
    """Make ``party``, block ``index`` of a model saved with ``seed``, serve its prediction:
    a FALSE-VFL data party then draws the same for every row, from the seed and its index
    (:attr:`LatentParty.shared_draws`), in one process or its own; any other has no draws."""
    if isinstance(party, LatentParty):
        party.shared_draws = seed + 1 + index


@contextmanager
def draws_as_saved(method: object, parties: Sequence[Party]) -> Iterator[None]:
    """While it lasts, a FALSE-VFL ``method`` still in memory (``parties``: its in-process
    parties, in block order) predicts new rows as its saved model does: every row with the
    same draws, from its seed (:attr:`FalseVflMethod.shared_draws`, :func:`predict_as_saved`),
    so a row's prediction is a function of the row alone and equals the saved model's. Its
    test splits keep their per-row draws afterwards; any other method is left as it is."""
    if not isinstance(method, FalseVflMethod) or method.shared_draws:
        yield
        return
    method.shared_draws = True
    for index, party in enumerate(parties):
        predict_as_saved(party, method.seed, index)
    try:
        yield
    finally:
        method.shared_draws = False
        for party in parties:
            if isinstance(party, LatentParty):
                party.shared_draws = None


def build_latent_party(
    k: int,
    name: str,
    *,
    method: str,
    blocks: Mapping[str, Tensor],
    observed: Mapping[str, Tensor],
    shapes: Sequence[tuple[int, ...]],
    config: MethodConfig,
    options: FalseVflConfig,
    seed: int,
    preprocessing: PartyPreprocessing | None = None,
) -> DataParty:
    """Data party ``k`` (not the label party) of the FALSE-VFL ``method``, built in its own
    process (:mod:`secure_vfl.deployment`) from its ``blocks`` and which of their rows it holds
    (``observed``, per split), by the seed rule of :class:`FalseVflMethod`: the same model,
    optimiser and generator as in one process. It holds no label."""
    if method not in VARIANTS or not 1 <= k < len(shapes):
        raise ConfigError(
            f"a FALSE-VFL method ({', '.join(VARIANTS)}) and a data party's index in "
            f"[1, {len(shapes)}) expected; found {method!r} and {k}."
        )

    def make_party(
        k: int, role: RoleFactory, blocks: dict[str, Tensor], model: torch.nn.Module
    ) -> Party:
        return make_latent_party(
            k,
            name,
            role,
            blocks,
            model,
            observed=observed,
            config=config,
            options=options,
            seed=seed,
        )

    return build_party(
        k,
        name,
        blocks=blocks,
        observed=observed["train"].numpy(),
        labels={},
        config=config,
        seed=seed,
        role=ROLES.get("latent-party"),
        bottom=latent_model(k, shapes, options, VARIANTS[method], seed),
        make_party=make_party,
        preprocessing=preprocessing,
    )


def no_party_models(
    config: MethodConfig, shapes: Sequence[tuple[int, ...]], num_classes: int, seed: int
) -> PartyModels:
    """FALSE-VFL hands no party a head or a further bottom: the discriminator and the global
    latent model stay with the label party, and no data party is given a label."""
    return PartyModels({})


@dataclass
class _Forward:
    """One forward pass through the seam, as the label party sees it.

    ``log_weights`` (B, S) is log p(x_obs, [m,] h_j, z_j) - log q(h_j, z_j | x_obs): no label.
    """

    log_weights: Tensor
    samples: Tensor
    samples_graph: Tensor
    sums: Tensor
    likelihoods: dict[str, tuple[Tensor, Tensor]]
    posterior_positions: dict[str, Tensor]


@dataclass(frozen=True)
class Inference:
    """SNIS prediction: class probabilities (N, C) and the label-free weights (N, L) behind them."""

    probabilities: np.ndarray
    weights: np.ndarray


class FalseVflMethod:
    """FALSE-VFL-I (``variant=1``, MAR) or FALSE-VFL-II (``variant=2``, MNAR) through the seam.

    This object is the label party's (``party-0``'s) program: it plans each step and asks the
    other parties, through messages only, for posterior factors, likelihoods and updates; its
    own state is :attr:`label_party`. ``sampler`` covers every training row (stage 1);
    ``labeled_sampler`` the labelled rows (stage 2). ``fit`` runs both stages; ``train_step``
    runs one step of the current stage. ``MethodConfig.heads`` does not apply: the paper's
    setting has one label party (party 0), as Standard VFL and PlugVFL here.
    ``representation_dim`` does not apply either: the latent sizes are ``false_vfl.latent_dim``
    and ``global_latent_dim``. ``roles`` replaces data parties by roles registered in
    :data:`~secure_vfl.federation.parties.ROLES` (subclasses of :class:`LatentParty`).
    """

    def __init__(
        self,
        data: VerticalData,
        config: MethodConfig,
        *,
        seed: int,
        variant: Variant,
        name: str,
        channel: Channel | None = None,
        aggregator: SumBackend | None = None,
        false_vfl: FalseVflConfig | None = None,
        roles: Mapping[str, str] | None = None,
    ) -> None:
        require_hiding_crowd(config, data.parties, name)
        refuse_top_model(config, name, "a discriminator on the latent samples")
        if config.pretrain_epochs:  # it was recorded and silently not done
            raise ConfigError(
                f"{name} has no bottom model for SimSiam to pretrain (its own stage 1 pretrains "
                "the generative model, for --epochs); pretrain_epochs applies to the split "
                f"networks (laser, local, standard, ensemble, plugvfl). Found pretrain_epochs="
                f"{config.pretrain_epochs}."
            )
        self.name = name
        self.config = config
        self.options = false_vfl if false_vfl is not None else FalseVflConfig()
        self.variant = variant
        self.seed = seed
        self.shared_draws = False
        """Whether prediction scores every row with the same L latent draws (a saved model's
        prediction of new rows: a row's probabilities are then a function of the row alone,
        the same on every call and whatever other rows come with it) rather than each row
        with its own (training-time evaluation of a test split, as the papers do). Either way
        a row's SNIS estimate is over L independent draws."""
        options = self.options
        models = [
            latent_model(k, data.block_shapes, options, variant, seed) for k in range(data.parties)
        ]
        self.labeled_rows = labeled_rows(data, config, seed)
        labels = torch.full((data.train.n,), -1, dtype=torch.int64)
        labels[self.labeled_rows] = torch.from_numpy(data.train.labels[self.labeled_rows])
        with isolated_seed(seed + 1000):
            label_model = LabelSideModel(
                options.latent_dim,
                options.global_latent_dim,
                data.num_classes,
                hidden=options.hidden,
            )
        splits = split_tensors(data)
        names = (channel.party_names if channel is not None else None) or [
            party_name(k) for k in range(data.parties)
        ]

        def make_party(
            k: int, role: RoleFactory, blocks: dict[str, Tensor], model: torch.nn.Module
        ) -> Party:
            observed = {n: torch.from_numpy(s.mask[:, k]) for n, s in splits.items()}
            label_side = {}
            if k == 0:
                label_side = {
                    "labels": labels,
                    "label_model": label_model,
                    "generative_optimizer": _adam(
                        label_model.generative_parameters(), options.pretrain_lr, config
                    ),
                    "discriminator_optimizer": _adam(
                        label_model.discriminator.parameters(), options.train_lr, config
                    ),
                    "latent_generator": torch.Generator().manual_seed(seed),
                }
            return make_latent_party(
                k,
                names[k],
                role,
                blocks,
                model,
                observed=observed,
                config=config,
                options=options,
                seed=seed,
                **label_side,
            )

        self.fed = build_federation(
            data,
            config,
            seed=seed,
            channel=channel,
            aggregator=aggregator,
            bottoms=models,
            roles=roles,
            default_role="latent-party",
            label_role="latent-label-party",
            make_party=make_party,
        )
        if not isinstance(self.fed.own, LatentLabelParty):
            raise ConfigError(
                f"{name}'s label party must be a LatentLabelParty; found "
                f"{type(self.fed.own).__name__}."
            )
        self.label_party: LatentLabelParty = self.fed.own
        self.data = self.fed.data  # labels, masks and its own block only
        self.sampler: BatchSampler = make_sampler(
            config.batching, data.train.mask, config.batch_size
        )
        self.labeled_sampler: BatchSampler = make_sampler(
            config.batching, data.train.mask, config.batch_size, rows=self.labeled_rows
        )
        self.stage: Literal[1, 2] = 1
        self.fed.tolerates_dropouts = True  # a lost party is a missing block
        self.fed.epoch_steps = len(self.sampler)  # stage 1's; train_step dates stage 2's faults
        self.blocks: ReleaseBlocks | None = None
        self._step_rows = 0  # the rows the last training attempt trained on
        if config.secure_sums:
            self.blocks = ReleaseBlocks(data.train.mask, receiver=0, seed=seed)

    @property
    def names(self) -> list[str]:
        return self.fed.names

    @property
    def total_steps(self) -> int:
        """Training steps of both stages (for progress reporting)."""
        return len(self.sampler) * self._epochs(1) + len(self.labeled_sampler) * self._epochs(2)

    def epoch_samplers(self) -> list[BatchSampler]:
        """Stage 1's epochs over every training row, then stage 2's over the labelled ones."""
        return [self.sampler] * self._epochs(1) + [self.labeled_sampler] * self._epochs(2)

    def _epochs(self, stage: int) -> int:
        chosen = self.options.pretrain_epochs if stage == 1 else self.options.train_epochs
        return chosen if chosen is not None else self.config.epochs

    # ---- the seam ----------------------------------------------------------------------

    def posterior_selection(self, split: str, rows: Tensor, mask: Tensor) -> Tensor:
        """(B, K): the parties whose (mean, precision) enter the posterior of ``rows`` of
        ``split``, observed as ``mask``.

        The observed set, except under secure sums (``MethodConfig.secure_sums``), where the
        label party may only receive sums from which nothing over the whole run isolates one
        other party: its own block and every usable block of the row
        (:class:`~secure_vfl.federation.releases.ReleaseBlocks`; FALSE-VFL plans no DP
        release). A row with neither gets no posterior (skipped in training, predicted from
        the prior p(h) at test time).
        """
        if self.blocks is None:
            return mask
        return self.blocks.plan(split, rows, mask).union()

    def _with_posterior(self, split: str, rows: np.ndarray) -> np.ndarray:
        """The rows of ``rows`` that have a posterior (all of them without secure sums)."""
        mask = torch.from_numpy(split_tensors(self.data)[split].mask[rows])
        selection = self.posterior_selection(split, torch.from_numpy(rows), mask)
        return rows[selection.any(dim=1).numpy()]

    def _posterior(
        self,
        split: str,
        rows: Tensor,
        selection: Tensor,
        *,
        round: int,
        batch_id: int,
        tag: str,
        train: bool,
    ) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        """Step 1: the selected parties' (mean, precision), summed by the aggregator for the
        label party. ``selection`` (B, K) is the observed set (see :meth:`posterior_selection`).

        Returns the delivered sums (B, 2 d_h) (a leaf with gradient when ``train``), the posterior
        mean (average of the selected means) and precision (sum of selected precisions), and
        each sending party's positions.
        """
        fed = self.fed
        source = tag + _POSTERIOR
        training_rows = split == "train"
        sum_requests = fed.sum_requests(
            selection.unsqueeze(0),
            deliver_to=self.label_party.name,
            round=round,
            batch_id=batch_id,
            tag=tag,
            train=training_rows,
            source_tag=source,
        )
        # The sum request (and under a secure scheme each party's seal request) goes with the
        # representation requests: the aggregator serves the sum once the representations
        # (shares) it sums are in, and a party acts on its messages in their order (over the
        # network, one delivery), so it seals what it has just computed.
        self.label_party.expect_sums(
            SumLayout(
                selection=selection.unsqueeze(0),
                parties=tuple(fed.names),
                width=2 * self.options.latent_dim,  # each party's (mean, precision)
            ),
            round=round,
            batch_id=batch_id,
            tag=tag,
        )
        asked = fed.request_representations(
            split,
            rows,
            selection,
            reply_to=AGGREGATOR,
            round=round,
            batch_id=batch_id,
            train=training_rows,
            tag=source,
            backward=train,
            sums=sum_requests,
        )
        summed = cast(
            SumMessage,
            self.label_party.take(
                "sum", sender=AGGREGATOR, round=round, batch_id=batch_id, tag=tag
            ),
        )
        positions_by_party = {
            name: torch.nonzero(selection[:, fed.names.index(name)]).flatten() for name in asked
        }
        sums = summed.sums[0].clone().requires_grad_(train)
        latent = self.options.latent_dim
        counts = summed.counts[0].clamp(min=1).unsqueeze(-1).to(sums.dtype)
        mean = sums[:, :latent] / counts
        precision = sums[:, latent:].clamp(min=MIN_PRECISION)
        return sums, mean, precision, positions_by_party

    def _forward(
        self,
        split: str,
        rows: Tensor,
        mask: Tensor,
        samples: int,
        *,
        round: int,
        batch_id: int,
        tag: str,
        train: bool,
        draws: Draws | None = None,
    ) -> _Forward:
        """Steps 1-3 of the protocol and the label party's label-free log importance weights,
        on standard normal ``draws`` (default: the label party's latent generator's).

        Every row must have a posterior (a non-empty :meth:`posterior_selection`). FALSE-VFL-I
        asks the selected parties for their likelihoods; FALSE-VFL-II also asks the parties
        missing a row for their mask term. A block left out of a row's posterior under secure
        sums is left out of its weight too (x^k and m^k marginalised), so the bound stays valid.
        """
        fed = self.fed
        label = self.label_party
        selection = self.posterior_selection(split, rows, mask)
        sums, mean, precision, posterior_positions = self._posterior(
            split, rows, selection, round=round, batch_id=batch_id, tag=tag, train=train
        )
        scored = selection
        if self.variant == 2:  # a missing block is scored by its party's missingness model
            live = torch.tensor([name not in fed.dropped for name in fed.names])
            scored = selection | (~mask & live)  # a lost party's block: left out (marginalised)
        scale = precision.rsqrt().unsqueeze(1)
        draws = draws if draws is not None else generator_draws(label.latent_generator)
        noise = draws((rows.shape[0], samples, mean.shape[1]))
        samples_graph = mean.unsqueeze(1) + noise * scale
        sent = samples_graph.detach()
        asked: dict[str, Tensor] = {}  # each party asked and the positions it was sent
        for k, name in enumerate(fed.names):
            positions = torch.nonzero(scored[:, k]).flatten()
            if positions.numel() == 0:
                continue
            label.expect("likelihood", senders=[name], round=round, batch_id=batch_id, tag=tag)
            label.send(
                LatentMessage(
                    **fed.header(name, round, batch_id),
                    positions=positions,
                    tag=tag,
                    phase=_phase(split),
                    samples=sent[positions].contiguous(),
                    split=split,
                    rows=rows[positions].contiguous(),
                    backward=train,
                )
            )
            asked[name] = positions
        total = torch.zeros(rows.shape[0], samples)
        likelihoods: dict[str, tuple[Tensor, Tensor]] = {}
        for name, positions in asked.items():
            reply = cast(
                LikelihoodMessage,
                label.take("likelihood", sender=name, round=round, batch_id=batch_id, tag=tag),
            )
            _check_reply(label.name, reply, positions, reply.log_likelihood, (samples,))
            value = reply.log_likelihood.clone().requires_grad_(train)
            likelihoods[name] = (reply.positions, value)
            total = total.index_add(0, reply.positions, value)
        with torch.set_grad_enabled(train):
            h = sent.clone().requires_grad_(train)
            log_q = gaussian_log_prob(h, mean.unsqueeze(1), scale)
            log_weights = total + label.label_model.latent_log_ratio(h, draws) - log_q
        return _Forward(
            log_weights=log_weights,
            samples=h,
            samples_graph=samples_graph,
            sums=sums,
            likelihoods=likelihoods,
            posterior_positions=posterior_positions,
        )

    # ---- training ----------------------------------------------------------------------

    def train_step(self, rows_np: np.ndarray, round: int, batch_id: int) -> float:
        """One step of the current stage on the training ``rows_np`` that have a posterior;
        returns the negative bound per sample (-L_kappa in stage 1, -L'_kappa in stage 2).

        A data party lost during the step (a deployment: its process died) is dropped and the
        step retried without it, as LASER's: every other party first discards what the attempt
        left (:meth:`~secure_vfl.methods.base.Federation.recover`), and the retry, under a fresh
        batch id, aggregates the posterior of each row over the parties still observed (a lost
        block is a missing block: paper eq. 1 over the rest). A party lost at stage 1's update
        is dropped there and the others complete the step.
        """
        fed = self.fed
        faults = len(fed.faults)
        sampler = self.sampler if self.stage == 1 else self.labeled_sampler
        for attempt in itertools.count():
            try:
                loss, closing = self._attempt(rows_np, round, batch_id + attempt * len(sampler))
                break
            except ProtocolError as error:
                fed.recover(error, round=round)
        if closing is not None:
            fed.update(round=round, tag=f"stage1{_POSTERIOR}", closing=closing)
            self.label_party.generative_optimizer.step()
            self.label_party.generative_optimizer.zero_grad(set_to_none=True)
        for fault in fed.faults[faults:]:
            fault["epoch"] = self._epoch(round)
        return loss

    def _trained_rows(self, rows_np: np.ndarray) -> int:
        """How many of the training ``rows_np`` the step just taken trained on: those with a
        posterior (all of them without secure sums), the rows its loss is the mean over, as its
        last attempt found them (its plan is not made again)."""
        return self._step_rows

    def _attempt(
        self, rows_np: np.ndarray, round: int, batch_id: int
    ) -> tuple[float, list[GradientMessage] | None]:
        """One attempt at a step, up to its update: its loss, and the gradients that close the
        other parties' steps (stage 1 on rows that have a posterior), or None if nobody
        updates."""
        rows_np = self._with_posterior("train", rows_np)
        self._step_rows = int(rows_np.size)
        if rows_np.size == 0:
            return 0.0, None
        rows = torch.from_numpy(rows_np)
        mask = torch.from_numpy(self.data.train.mask[rows_np])
        pretraining = self.stage == 1
        tag = f"stage{self.stage}"
        forward = self._forward(
            "train",
            rows,
            mask,
            self.options.kappa,
            round=round,
            batch_id=batch_id,
            tag=tag,
            train=pretraining,
        )
        if pretraining:
            return self._pretrain_backward(forward, round=round, batch_id=batch_id, tag=tag)
        return self._discriminator_update(forward, rows), None

    def _epoch(self, round: int) -> int:
        """The epoch (from 1, counted across both stages as :meth:`fit`'s losses are) of the
        training step ``round`` (rounds run on across both stages)."""
        stage_one = len(self.sampler) * self._epochs(1)
        if round < stage_one:
            return round // len(self.sampler) + 1
        return self._epochs(1) + (round - stage_one) // len(self.labeled_sampler) + 1

    def _pretrain_backward(
        self, forward: _Forward, *, round: int, batch_id: int, tag: str
    ) -> tuple[float, list[GradientMessage]]:
        """Stage 1 up to the update: the gradient of -L_kappa(Theta_g) on a batch of any
        training rows (paper section 3.4), sent back through the seam (step 4); the update
        (:meth:`train_step`) applies it. Returns the loss and the gradients w.r.t. the other
        parties' posterior factors, which close their steps (sent by the update, once the
        attempt has succeeded); the label party's own goes at once."""
        fed = self.fed
        label = self.label_party
        kappa = self.options.kappa
        bound = torch.logsumexp(forward.log_weights, dim=1) - math.log(kappa)
        loss = -bound.mean()
        loss.backward(retain_graph=True)  # the reparameterisation is backpropagated again below
        assert forward.samples.grad is not None
        samples_grad = forward.samples.grad.clone()
        likelihood_gradients: list[Message] = []
        for name, (positions, value) in forward.likelihoods.items():
            assert value.grad is not None
            likelihood_gradients.append(
                GradientMessage(
                    **fed.header(name, round, batch_id),
                    positions=positions,
                    tag=tag + LIKELIHOOD,
                    gradient=value.grad.detach(),
                )
            )
        label.expect(
            "latent-gradient",
            senders=list(forward.likelihoods),
            round=round,
            batch_id=batch_id,
            tag=tag,
        )
        label.send_all(likelihood_gradients)
        for name in forward.likelihoods:
            reply = cast(
                LatentGradientMessage,
                label.take("latent-gradient", sender=name, round=round, batch_id=batch_id, tag=tag),
            )
            positions = forward.likelihoods[name][0]
            _check_reply(label.name, reply, positions, reply.gradient, samples_grad.shape[1:])
            samples_grad.index_add_(0, reply.positions, reply.gradient)
        forward.samples_graph.backward(samples_grad)
        assert forward.sums.grad is not None
        closing = []
        for name, positions in forward.posterior_positions.items():
            gradient = GradientMessage(
                **fed.header(name, round, batch_id),
                positions=positions,
                tag=tag + _POSTERIOR,
                gradient=forward.sums.grad[positions].detach().contiguous(),
            )
            if name == label.name:
                label.send(gradient)
            else:
                closing.append(gradient)
        return loss.item(), closing

    def _discriminator_update(self, forward: _Forward, rows: Tensor) -> float:
        """Stage 2: ascend L'_kappa(phi) on labelled rows with Theta_g frozen (no gradients out)."""
        label = self.label_party
        kappa = self.options.kappa
        logits = label.label_model.discriminator(forward.samples)
        labels = label.labels(rows)
        log_py = -F.cross_entropy(
            logits.flatten(0, 1), labels.repeat_interleave(kappa), reduction="none"
        ).view(-1, kappa)
        bound = torch.logsumexp(forward.log_weights + log_py, dim=1) - math.log(kappa)
        loss = -bound.mean()
        label.discriminator_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        label.discriminator_optimizer.step()
        label.discriminator_optimizer.zero_grad(set_to_none=True)
        return loss.item()

    @fits_once
    def fit(
        self, *, on_step: StepCallback | None = None, progress: TrainingProgress | None = None
    ) -> list[float]:
        """Stage 1 on every training row, then stage 2 on the labelled rows.

        Returns the mean loss of every epoch: first the stage-1 epochs (-L_kappa per sample),
        then the stage-2 epochs (-L'_kappa per sample). ``on_step`` sees rounds counted across
        both stages. ``progress`` counts epochs and steps across both stages too, so a
        checkpoint taken in either resumes there (stage 2 once ``progress.epoch`` has passed
        stage 1's epochs).

        A data party lost in stage 1 may rejoin at a stage-1 epoch boundary
        (:meth:`~secure_vfl.methods.base.Federation.rejoin`: set up anew, its initial models)
        and trains along for the rest of stage 1. Stage 2 trains only the label party's
        discriminator on the posteriors: a party that came back then would bring an encoder
        that never trained, so nobody is probed from stage 2 on.
        """
        progress = progress if progress is not None else TrainingProgress()
        first = self._epochs(1)
        self.stage = 1
        train_epochs(
            self.train_step,
            self.sampler,
            epochs=first,
            rng=self.fed.rng,
            on_step=on_step,
            progress=progress,
            on_epoch=lambda round: self.fed.rejoin(round=round),
            trained=self._trained_rows,
        )
        # Stage 2 goes on with the same progress: its epochs after stage 1's, its steps' rounds
        # after stage 1's (no two steps of a run share one: a fault names the run's step).
        self.stage = 2
        losses = train_epochs(
            self.train_step,
            self.labeled_sampler,
            epochs=first + self._epochs(2),
            rng=self.fed.rng,
            on_step=on_step,
            progress=progress,
            trained=self._trained_rows,
        )
        self.fed.flush(round=progress.step - 1)  # stage 1's last closing gradients, if held
        return losses

    # ---- evaluation --------------------------------------------------------------------

    def posterior(self, split_name: str, rows: np.ndarray) -> tuple[Tensor, Tensor]:
        """The aggregated q(h | x_obs) of ``rows`` as the label party gets it: (mean, precision)."""
        mask = torch.from_numpy(split_tensors(self.data)[split_name].mask[rows])
        with torch.no_grad():
            _, mean, precision, _ = self._posterior(
                split_name,
                torch.from_numpy(rows),
                self.posterior_selection(split_name, torch.from_numpy(rows), mask),
                round=self.fed.next_query(),
                batch_id=0,
                tag=f"posterior/{split_name}",
                train=False,
            )
        return mean, precision

    def log_weights(self, split_name: str, rows: np.ndarray, samples: int) -> Tensor:
        """Label-free log importance weights (B, samples) of ``rows``, through the seam."""
        mask = torch.from_numpy(split_tensors(self.data)[split_name].mask[rows])
        with torch.no_grad():
            return self._forward(
                split_name,
                torch.from_numpy(rows),
                mask,
                samples,
                round=self.fed.next_query(),
                batch_id=0,
                tag=f"weights/{split_name}",
                train=False,
            ).log_weights

    def bound(self, split_name: str, rows: np.ndarray, samples: int) -> Tensor:
        """One draw of the importance-weighted bound log R_samples(x_obs[, m]) per row (B,)."""
        log_weights = self.log_weights(split_name, rows, samples)
        return torch.logsumexp(log_weights, dim=1) - math.log(samples)

    def infer(self, split_name: str) -> Inference:
        """SNIS over L samples: p(y | x_obs) ~ sum_l w_l p(y | h_l), with label-free weights w.
        A data party lost during the pass is dropped and the pass runs again without it
        (:meth:`~secure_vfl.methods.base.Federation.evaluation_pass`)."""
        fed = self.fed
        faults = len(fed.faults)
        last = self.total_steps - 1
        inference = fed.evaluation_pass(lambda: self._infer(split_name), round=last)
        for fault in fed.faults[faults:]:
            fault["epoch"] = self._epoch(last)
        return inference

    def _infer(self, split_name: str) -> Inference:
        split = split_tensors(self.data)[split_name]
        samples = self.options.inference_samples
        round = self.fed.next_query()
        probabilities = np.zeros((split.n, self.data.num_classes), dtype=np.float32)
        weights = np.zeros((split.n, samples), dtype=np.float32)
        label = self.label_party
        with_posterior = self._with_posterior(split_name, np.arange(split.n))
        without = np.setdiff1d(np.arange(split.n), with_posterior)
        for batch_id, start in enumerate(range(0, with_posterior.size, _PREDICT_BATCH)):
            rows = torch.from_numpy(with_posterior[start : start + _PREDICT_BATCH])
            mask = torch.from_numpy(split.mask[rows.numpy()])
            with torch.no_grad():
                forward = self._forward(
                    split_name,
                    rows,
                    mask,
                    samples,
                    round=round,
                    batch_id=batch_id,
                    tag=f"predict/{split_name}",
                    train=False,
                    draws=self._prediction_draws(),
                )
                normalised = torch.softmax(forward.log_weights, dim=1)
                class_probabilities = torch.softmax(
                    label.label_model.discriminator(forward.samples), dim=-1
                )
                mixed = torch.einsum("bl,blc->bc", normalised, class_probabilities)
            probabilities[rows.numpy()] = mixed.numpy()
            weights[rows.numpy()] = normalised.numpy()
        if without.size:  # no releasable posterior: the prior, where all weights are equal
            with torch.no_grad():
                prior = label.label_model.prior_samples(
                    without.size, samples, self._prediction_draws()
                )
                class_probabilities = torch.softmax(label.label_model.discriminator(prior), dim=-1)
            probabilities[without] = class_probabilities.mean(dim=1).numpy()
            weights[without] = 1.0 / samples
        return Inference(probabilities=probabilities, weights=weights)

    def _prediction_draws(self) -> Draws:
        """A prediction batch's draws: per row, or under :attr:`shared_draws` the same for
        every row and every batch (fresh from the method's seed each time)."""
        if self.shared_draws:
            return row_shared_draws(self.seed)
        return generator_draws(self.label_party.latent_generator)

    def predict_proba(self, split_name: str) -> np.ndarray:
        """The SNIS class probabilities (N, C) of :meth:`infer` (random: L latent draws)."""
        return self.infer(split_name).probabilities

    def predict(self, split_name: str) -> np.ndarray:
        """The label party's SNIS prediction, reported by every observed party: (N, K). A
        sample whose every block was lost (a dropped party) is predicted from the prior and
        reported by the label party."""
        split = split_tensors(self.data)[split_name]
        predicted = self.infer(split_name).probabilities.argmax(axis=1)
        out = broadcast_prediction(predicted, split.mask)
        lost = ~split.mask.any(axis=1)
        out[lost, 0] = predicted[lost]
        return out


for _name, _variant in VARIANTS.items():
    METHODS.register(_name, partial(FalseVflMethod, variant=_variant, name=_name))
    PARTY_MODELS.register(_name, no_party_models)
