"""A receiver-side defense against backdoors and poisoning: drop contributions whose norm is
anomalous (the survey's norm-based filtering, section V).

:class:`NormFilter` is a channel layer installed in the ``incoming`` hooks of whoever receives
the parties' representations one by one: the label party in Standard VFL (it concatenates
them), the aggregation server in LASER (it sums them). It keeps, per sender, the norms of the
last ``window`` training rows it received (a few batches: norms drift as the models train) and
scores each new row by a robust z-score of its norm, ``|norm - median| / (1.4826 * MAD)``; a
row above ``threshold`` is zeroed (as if the sender did not hold it) and counted.
Prediction-phase rows are scored against the training reference and never enter it, so a
batch of queries cannot shift what counts as normal.

It can only act on what it sees: under secure aggregation the aggregator receives sealed
shares and the label party sealed sums, no individual representation, so there is nothing to
filter (:meth:`NormFilterDefense.install` refuses that combination).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque

import numpy as np
import torch

from attacks.defenses import HOOK_DEFENSES
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig
from secure_vfl.federation.channel import Channel, M
from secure_vfl.federation.messages import AGGREGATOR, RepresentationMessage, party_name

MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution times this is its standard deviation


class NormFilter:
    """Zero the representation rows whose norm's robust z-score against the sender's recent
    training rows exceeds ``threshold``; ``seen`` and ``dropped`` count rows per (sender,
    phase). It passes everything until a sender has sent ``warmup`` training rows."""

    def __init__(self, threshold: float = 4.0, *, window: int = 256, warmup: int = 64) -> None:
        if not (threshold > 0 and np.isfinite(threshold)):
            raise ConfigError(
                f"norm-filter's threshold must be a positive number. Found {threshold}."
            )
        self.threshold = threshold
        self.warmup = warmup
        self._norms: defaultdict[str, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self.seen: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.dropped: defaultdict[tuple[str, str], int] = defaultdict(int)

    def on_message(self, message: M) -> M:
        if not isinstance(message, RepresentationMessage):
            return message
        norms = torch.linalg.vector_norm(message.representation, dim=1).numpy()
        history = self._norms[message.sender]
        key = (message.sender, message.phase)
        self.seen[key] += len(norms)
        outlier = np.zeros(len(norms), dtype=bool)
        if len(history) >= self.warmup:
            reference = np.fromiter(history, dtype=np.float64)
            median = np.median(reference)
            spread = MAD_TO_SIGMA * np.median(np.abs(reference - median))
            outlier = np.abs(norms - median) > self.threshold * max(spread, 1e-12)
        if message.phase == "train":
            history.extend(norms.tolist())
        if not outlier.any():
            return message
        self.dropped[key] += int(outlier.sum())
        representation = message.representation.clone()
        representation[torch.from_numpy(outlier)] = 0.0
        return dataclasses.replace(message, representation=representation)

    def report(self) -> dict[str, dict[str, dict[str, int]]]:
        """Rows seen and dropped, by sender and phase."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (sender, phase), seen in sorted(self.seen.items()):
            out.setdefault(sender, {})[phase] = {
                "seen": seen,
                "dropped": self.dropped[(sender, phase)],
            }
        return out


class NormFilterDefense:
    """``norm-filter:Z``: one :class:`NormFilter` with threshold Z in the incoming hooks of the
    label party and of the aggregation server (whichever receives representations one by one
    filters them)."""

    def __init__(self, threshold: float) -> None:
        self.layer = NormFilter(threshold)
        self.spec = f"norm-filter:{threshold:g}"

    def check(self, config: TrainConfig) -> None:
        """ConfigError for FALSE-VFL: its parties send the mean and precision of a latent
        variable, not a representation whose norm says anything about poisoning; zeroing
        rows of them feeds the model a zero precision (with no attacker it dropped 15-19 % of
        the honest rows, and the training loss rose from 43 to 1900)."""
        if config.method.startswith("false-vfl"):
            raise ConfigError(
                f"norm-filter does not apply to {config.method}: its parties send the (mean, "
                "precision) of a latent variable, whose rows it cannot zero without corrupting "
                "the training; it filters the representations of the other methods."
            )

    def install(self, channel: Channel) -> None:
        """ConfigError under secure aggregation: the aggregation server then holds only the
        adding half of the scheme (sealed shares) and the label party only sums, so no receiver
        sees a party's representation and the filter would silently filter nothing."""
        server = channel.parties[AGGREGATOR]
        if getattr(server, "adder", None) is not None:
            raise ConfigError(
                "norm-filter cannot run under secure aggregation: it scores each party's "
                "representation, and there no receiver sees one (the aggregator holds sealed "
                "shares, the label party only sums). Choose one of the two."
            )
        for name in (party_name(0), AGGREGATOR):
            channel.parties[name].incoming.append(self.layer)

    def report(self) -> dict[str, dict[str, dict[str, int]]]:
        """Rows seen and dropped, by sender and phase."""
        return self.layer.report()


HOOK_DEFENSES.register("norm-filter", NormFilterDefense)
