"""One party's half of a private training run: its plan, its mechanisms, its accountant, and
the guarantees they give.

The label party's :class:`~protocols.privacy.PrivacyEngine` decides a run's plan (SIGMA,
calibrated for a target epsilon; CLIP; the Poisson rate and steps it drew) and gives every
party its :class:`PartyPlan`: what that party needs for *its* mechanisms and nothing more (no
other party's noise, not the sample). A :class:`PartyPrivacy` built from it installs the
mechanisms inside the party (embedding noise, gradient noise at a head holder, DP-SGD of its
bottom model, the noise of exposed rows under ``--release dp``), keeps the party's own
:class:`~protocols.dp.PrivacyAccountant` and prices its releases as the
:class:`~protocols.dp.Guarantee` s of :mod:`protocols.dp`.

In one process the engine makes one per party, each reading the run's Poisson schedule. In a
deployment (``secure-vfl train --federation``) the plan travels in each data party's ``setup``
(:meth:`PartyPlan.to_json`, checked on arrival by :meth:`PartyPlan.from_json`), the data party
builds its own half in its own process (:func:`served_privacy`), drawing its noise from its
own operating-system entropy, and sends what its accountant priced back in its end-of-run
report (:meth:`PartyPrivacy.entry`), which the label party checks (:func:`read_entry`) and
lists as that party's own figures. A data party never sees the whole Poisson sample: it prices
each step over the training rows it was asked for (:class:`RequestedRows`). Those are its
records of the batch, so its figure is the in-process one whenever it was asked for every
batch row it holds (and never above it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from protocols.dp import (
    ADJACENCIES,
    GRAD_SAMPLE_MODES,
    Adjacency,
    EmbeddingNoise,
    ExposureNoise,
    GradientNoise,
    Guarantee,
    PrivacyAccountant,
)
from protocols.noise import NoiseSource, noise_source
from protocols.sum_range import DivergenceGuard, RangedHalf, SumRange
from secure_vfl.errors import ConfigError, ProtocolError
from secure_vfl.federation.messages import Message, RepresentRequest
from secure_vfl.federation.parties import DataParty
from secure_vfl.io import check_keys, decimal

Noise = tuple[float, float]
PARTY_MECHANISMS: tuple[str, ...] = ("embedding", "gradient", "dp-sgd", "exposure")
"""The mechanisms a party's plan may hold (those of training; see ``MECHANISMS``)."""
SECURE_SOURCE = "AES-128-CTR keyed with 128 bits of operating-system entropy"
STREAMS: Mapping[str, int] = {"dp-sgd": 10, "embedding": 100, "gradient": 200, "exposure": 400}
"""Each mechanism's noise stream (offset by the party's index): only the insecure reproducible
option derives noise from (seed, stream); every other source is fresh OS entropy."""
M = TypeVar("M", bound=Message)
_RowLayer = TypeVar("_RowLayer", EmbeddingNoise, GradientNoise, ExposureNoise)


@dataclass(frozen=True, kw_only=True)
class PartyPlan:
    """What one party needs to protect and price its own releases.

    ``noise`` holds its mechanisms only (kind -> (SIGMA, CLIP), SIGMA as calibrated);
    ``sample_rate`` and ``draws`` are the Poisson sample's rate and draws (empty ones included),
    ``epoch_ends`` the steps done at the end of every epoch, ``records`` the training rows its
    records are indexed in; ``delta`` and ``adjacency`` those of the run's guarantees,
    ``grad_sample_mode`` how its DP-SGD gets per-sample gradients and ``value_range`` what its
    secure-sum halves are sized for (the label party's opener decodes with the same)."""

    noise: Mapping[str, Noise]
    sample_rate: float
    draws: int
    epoch_ends: tuple[int, ...]
    records: int
    delta: float
    adjacency: str
    grad_sample_mode: str
    value_range: SumRange

    @property
    def steps_per_epoch(self) -> int:
        return self.draws // len(self.epoch_ends)

    def to_json(self) -> dict[str, Any]:
        """The plan as the ``privacy`` part of a deployed ``setup`` body."""
        return {
            "noise": {kind: [sigma, clip] for kind, (sigma, clip) in self.noise.items()},
            "sample_rate": self.sample_rate,
            "draws": self.draws,
            "epoch_ends": list(self.epoch_ends),
            "records": self.records,
            "delta": self.delta,
            "adjacency": self.adjacency,
            "grad_sample_mode": self.grad_sample_mode,
            "value_range": {
                "value_bound": self.value_range.value_bound,
                "contributors": self.value_range.contributors,
                "clipped": self.value_range.clipped,
            },
        }

    @classmethod
    def from_json(cls, body: Any) -> PartyPlan:
        """The plan of a ``setup``'s ``privacy`` part; ProtocolError, saying what was expected
        and found, for anything else."""
        fields = _keys(body, "privacy", PLAN_KEYS)
        noise = _noise(fields["noise"])
        rate, draws, records = fields["sample_rate"], fields["draws"], fields["records"]
        _expect(0 < rate <= 1, "`sample_rate` in (0, 1]", rate)
        _expect(draws >= 1 and records >= 1, "`draws` and `records` >= 1", (draws, records))
        ends = fields["epoch_ends"]
        _expect(
            bool(ends)
            and all(_is_int(e) for e in ends)
            and list(ends) == sorted(ends)
            and ends[0] >= 0
            and ends[-1] <= draws
            and draws % len(ends) == 0,
            "`epoch_ends`: a non-empty, non-decreasing list of steps <= draws, one per epoch of "
            "draws / epochs draws",
            ends,
        )
        _expect(0 < fields["delta"] < 1, "`delta` in (0, 1)", fields["delta"])
        _expect(
            fields["adjacency"] in ADJACENCIES, f"`adjacency` in {ADJACENCIES}", fields["adjacency"]
        )
        _expect(
            fields["grad_sample_mode"] in GRAD_SAMPLE_MODES,
            f"`grad_sample_mode` in {GRAD_SAMPLE_MODES}",
            fields["grad_sample_mode"],
        )
        span = _keys(fields["value_range"], "privacy.value_range", RANGE_KEYS)
        try:
            value_range = SumRange(span["value_bound"], span["contributors"], span["clipped"])
        except ConfigError as error:
            raise ProtocolError(f"setup: the `privacy` part: {error}") from None
        return cls(
            noise=noise,
            sample_rate=float(rate),
            draws=draws,
            epoch_ends=tuple(ends),
            records=records,
            delta=float(fields["delta"]),
            adjacency=fields["adjacency"],
            grad_sample_mode=fields["grad_sample_mode"],
            value_range=value_range,
        )


PLAN_KEYS: Mapping[str, type | tuple[type, ...]] = {
    "noise": dict,
    "sample_rate": (int, float),
    "draws": int,
    "epoch_ends": list,
    "records": int,
    "delta": float,
    "adjacency": str,
    "grad_sample_mode": str,
    "value_range": dict,
}
RANGE_KEYS: Mapping[str, type | tuple[type, ...]] = {
    "value_bound": (int, float),
    "contributors": int,
    "clipped": bool,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _keys(body: Any, what: str, expected: Mapping[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """``body`` as a dict with exactly the keys ``expected``, each of its type."""
    return check_keys(
        body, expected, refuse=lambda wrong: ProtocolError(f"setup: the `{what}` part: {wrong}.")
    )


def _expect(holds: bool, expected: str, found: Any) -> None:
    if not holds:
        raise ProtocolError(f"setup: the `privacy` part: {expected} expected; found {found!r}.")


def _noise(value: Mapping[str, Any]) -> dict[str, Noise]:
    """The mechanisms of a plan: known kinds, each [SIGMA >= 0, CLIP > 0], finite. None at all
    is a plan that only sizes the party's secure-sum halves to the run's range (under
    `--dp-gradients` alone a data party releases nothing noised, but its sums are added to
    noised ones: sized otherwise, they decoded 4x too large under Paillier)."""
    noise = {}
    for kind, pair in value.items():
        _expect(kind in PARTY_MECHANISMS, f"a mechanism of {PARTY_MECHANISMS}", kind)
        ok = (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair)
        )
        _expect(ok, f"`noise.{kind}` as [SIGMA, CLIP]", pair)
        sigma, clip = float(pair[0]), float(pair[1])
        _expect(
            math.isfinite(sigma) and sigma >= 0 and math.isfinite(clip) and clip > 0,
            f"`noise.{kind}` with SIGMA >= 0 and CLIP > 0, both finite",
            pair,
        )
        noise[kind] = (sigma, clip)
    return noise


class RequestedRows:
    """Incoming hook of a deployed data party: the training rows each step asked it for, its
    view of the Poisson schedule (it never sees the whole sample). ProtocolError for a training
    request outside the plan's steps or records, on arrival; the rows of a request are kept
    once the party accepts it (:meth:`on_accepted`): one it refuses released nothing."""

    def __init__(self, steps: int, records: int) -> None:
        self.steps = steps
        self.records = records
        self._rows: dict[int, list[np.ndarray]] = {}
        self.journal: Callable[[Any], None] | None = None
        """Called with each training request's step and rows (a DP party's release journal
        keeps them: :meth:`replay` takes them back when the party rejoins)."""

    def on_message(self, message: M) -> M:
        if isinstance(message, RepresentRequest) and message.phase == "train":
            rows = message.rows.numpy()
            if not 0 <= message.round < self.steps or (rows.size and rows.max() >= self.records):
                raise ProtocolError(
                    f"{message.receiver}: a training request of step {message.round} for rows "
                    f"up to {rows.max(initial=-1)}; the privacy plan has {self.steps} steps over "
                    f"{self.records} records."
                )
        return message

    def on_accepted(self, message: Message) -> None:
        """Keep (and journal) the rows of a training request the party acts on."""
        if isinstance(message, RepresentRequest) and message.phase == "train":
            rows = message.rows.numpy()
            self._rows.setdefault(message.round, []).append(rows.astype(np.int64))
            if self.journal is not None:
                self.journal({"step": message.round, "rows": rows.tolist()})

    checkpoint_key = "requested-rows"
    """Its view of the batches so far is part of the party's checkpoint: a resumed party prices
    the steps before the checkpoint over the rows they used."""

    def checkpoint_state(self) -> dict[str, list[int]]:
        return {
            str(step): np.unique(np.concatenate(rows)).tolist()
            for step, rows in sorted(self._rows.items())
        }

    def restore_checkpoint(self, state: Any) -> None:
        """The rows of the steps before the checkpoint (ValueError, naming the step, for rows
        or a step outside the plan)."""
        if not isinstance(state, dict):
            raise ValueError(f"requested rows by step expected, found {type(state).__name__}")
        restored = {}
        for step, rows in state.items():
            self._check(step, rows)
            restored[int(step)] = [np.array(rows, dtype=np.int64)]
        self._rows = restored

    def _check(self, step: str, rows: Any) -> None:
        number = decimal(step)
        if not (
            number is not None
            and number < self.steps
            and isinstance(rows, list)
            and all(type(row) is int and 0 <= row < self.records for row in rows)
        ):
            raise ValueError(
                f"requested rows of step {step[:20]!r}: a step below {self.steps} and rows "
                f"below {self.records} expected"
            )

    def replay(self, notes: Sequence[Any]) -> None:
        """The rows of the training requests its journal kept (``{"step", "rows"}`` each),
        added to those it holds: a party rejoining the run after its process died prices the
        releases of its first process over them (ValueError for one outside the plan)."""
        for note in notes:
            step = note.get("step") if isinstance(note, dict) else None
            if not isinstance(step, int) or isinstance(step, bool):
                raise ValueError(f"a journal note of a step's rows expected, found {note!r:.60}")
            self._check(str(step), note.get("rows"))
            self._rows.setdefault(step, []).append(np.array(note["rows"], dtype=np.int64))

    def schedule(self) -> list[np.ndarray]:
        """Per step, the rows it was asked for (empty where it was asked for none)."""
        return [
            np.unique(np.concatenate(self._rows[step]))
            if step in self._rows
            else np.zeros(0, dtype=np.int64)
            for step in range(self.steps)
        ]


class PartyPrivacy:
    """Party ``name``'s half of a private run: installs its :class:`PartyPlan`'s mechanisms
    inside it (:meth:`install`), each drawing from ``noise(stream)``, with the party's own
    accountant, and prices that accountant's releases (:meth:`guarantees`, :meth:`entry`)
    over ``schedule()`` (the rows each step used); ``sampling`` says how the sample was drawn
    and ``source`` where the noise comes from."""

    def __init__(
        self,
        name: str,
        plan: PartyPlan,
        *,
        noise: Callable[[int], NoiseSource],
        schedule: Callable[[], Sequence[np.ndarray]],
        sampling: str,
        source: str,
    ) -> None:
        self.name = name
        self.plan = plan
        self.accountant = PrivacyAccountant(
            planned={kind: sigma for kind, (sigma, _) in plan.noise.items()}
        )
        self._noise = noise
        self._schedule = schedule
        self.sampling = sampling
        self.source = source

    def install(self, party: DataParty) -> None:
        """Every mechanism of the plan inside ``party``, recording into its own accountant,
        then its secure-sum halves sized for the run's range and a divergence guard as its last
        outgoing hook. ConfigError for gradient noise at a party that holds no head."""
        noise, accountant = self.plan.noise, self.accountant
        party.accountant = accountant
        if "embedding" in noise:
            layer = self._row_noise("embedding", EmbeddingNoise)
            party.incoming.append(layer.requests)  # notes the rows each request asks for
            party.outgoing.append(layer)
        if "gradient" in noise:
            if not party.heads:
                raise ConfigError(
                    f"{party.name}: gradient noise protects the labels a head sends back; "
                    "this party holds no head."
                )
            party.outgoing.append(self._row_noise("gradient", GradientNoise))
        if "exposure" in noise:
            exposure = self._row_noise("exposure", ExposureNoise)
            party.incoming.append(exposure)  # notes the rows each accepted request asks for
            party.exposure = exposure
        if "dp-sgd" in noise:
            from protocols.dp_sgd import make_private_party  # Opacus: only where DP-SGD runs

            sigma, clip = noise["dp-sgd"]
            make_private_party(
                party,
                noise_multiplier=sigma,
                max_grad_norm=clip,
                sample_rate=self.plan.sample_rate,
                noise=self._noise(STREAMS["dp-sgd"]),
                on_event=accountant.on_event,
                grad_sample_mode=self.plan.grad_sample_mode,  # type: ignore[arg-type]
            )
        for half in (party.sealer, party.opener):
            if isinstance(half, RangedHalf):
                half.use_range(self.plan.value_range)
        party.outgoing.append(DivergenceGuard(self.plan.value_range))

    def _row_noise(self, kind: str, layer: type[_RowLayer]) -> _RowLayer:
        sigma, clip = self.plan.noise[kind]
        return layer(
            sigma,
            clip,
            sample_rate=self.plan.sample_rate,
            noise=self._noise(STREAMS[kind]),
            on_event=self.accountant.on_event,
        )

    def guarantees(self) -> list[Guarantee]:
        """Its guarantees: against the receivers of its training messages, against an observer
        of its model (DP-SGD), and for the test records of its prediction-time releases."""
        adjacency: Adjacency = self.plan.adjacency  # type: ignore[assignment]
        predicted = self.accountant.prediction_guarantee(
            self.name, adjacency=adjacency, delta=self.plan.delta
        )
        held = self._training(self.accountant, self._schedule(), draws=self.plan.draws)
        return held + ([predicted] if predicted is not None else [])

    def _training(
        self, accountant: PrivacyAccountant, schedule: Sequence[np.ndarray], *, draws: int
    ) -> list[Guarantee]:
        """The guarantees of ``accountant``'s training releases: against the receivers of its
        messages, and (DP-SGD over ``draws`` draws) against an observer of its model."""
        plan = self.plan
        found = [
            accountant.message_guarantee(
                self.name,
                schedule=schedule,
                records=plan.records,
                adjacency=plan.adjacency,  # type: ignore[arg-type]
                delta=plan.delta,
                sampling=self.sampling,
            ),
            accountant.model_guarantee(
                self.name,
                sample_rate=plan.sample_rate,
                draws=draws,
                delta=plan.delta,
                sampling=self.sampling,
            ),
        ]
        return [g for g in found if g is not None]

    def epsilon_per_epoch(self) -> list[float]:
        """Its headline epsilon (the largest training guarantee) after every epoch, from its
        releases of the steps before the epoch's end, priced as the final figure is (DP-SGD
        composed over the draws made so far)."""
        schedule = self._schedule()
        curve = []
        for end in self.plan.epoch_ends:
            prefix = PrivacyAccountant(accountant=self.accountant.accountant)
            prefix.events = [
                e for e in self.accountant.events if e.phase == "train" and e.round < end
            ]
            draws = sum(
                1
                for e in prefix.events
                if e.party == self.name and e.kind == "dp-sgd" and not e.discarded
            )
            held = self._training(prefix, schedule, draws=draws)
            if held:
                curve.append(max(g.epsilon for g in held))
        return curve

    def entry(self) -> dict[str, Any]:
        """What its accountant priced, as JSON (what a deployed data party reports about
        itself at the end of the run; :func:`read_entry` checks it)."""
        accountant = self.accountant
        return {
            "guarantees": [g.to_json() for g in self.guarantees()],
            "epsilon_per_epoch": self.epsilon_per_epoch(),
            "releases": {
                **accountant.releases(self.name),
                **{
                    f"predict-{kind}": count
                    for kind, count in accountant.releases(self.name, phase="predict").items()
                },
            },
            "exposed": {
                "train": accountant.releases(self.name).get("exposure", 0),
                "predict": accountant.releases(self.name, phase="predict").get("exposure", 0),
                "train_rows": sum(
                    len(e.rows)
                    for e in accountant.events
                    if e.kind == "exposure" and e.phase == "train"
                ),
            },
            "noise_source": self.source,
        }


def served_privacy(name: str, part: Any, party: DataParty) -> PartyPrivacy:
    """A deployed data party's own half, from the ``privacy`` part of its ``setup`` (checked:
    ProtocolError), installed in ``party``: its noise from fresh operating-system entropy
    (never from the seed: a deployment refuses reproducible noise), each step priced over the
    training rows it was asked for (:class:`RequestedRows`)."""
    plan = PartyPlan.from_json(part)
    requested = RequestedRows(plan.epoch_ends[-1], plan.records)
    half = PartyPrivacy(
        name,
        plan,
        noise=lambda stream: noise_source(None),
        schedule=requested.schedule,
        sampling=sampling_text(
            plan.sample_rate,
            plan.draws,
            plan.steps_per_epoch,
            "the label party's secure generator (a deployment refuses reproducible noise)",
        ),
        source=SECURE_SOURCE,
    )
    party.incoming.insert(0, requested)
    try:
        half.install(party)
    except ConfigError as error:
        raise ProtocolError(f"setup: {name} cannot take its privacy plan: {error}") from None
    return half


def sampling_text(rate: float, draws: int, steps_per_epoch: int, drawn_from: str) -> str:
    """How a private run's batches were sampled, as its guarantees state it."""
    return (
        f"Poisson, rate {rate:.6g}, {draws} draws ({steps_per_epoch} per epoch), drawn from "
        f"{drawn_from}"
    )


_GUARANTEE_TYPES: Mapping[str, type | tuple[type, ...]] = {
    "mechanisms": list,
    "amplification": bool,
    "epsilon": (int, float),
    "delta": (int, float),
    "noise_multiplier": (int, float),
    "releases": int,
}
GUARANTEE_FIELDS: Mapping[str, type | tuple[type, ...]] = {
    field.name: _GUARANTEE_TYPES.get(field.name, str) for field in dataclasses.fields(Guarantee)
}
ENTRY_KEYS: Mapping[str, type | tuple[type, ...]] = {
    "guarantees": list,
    "epsilon_per_epoch": list,
    "releases": dict,
    "exposed": dict,
    "noise_source": str,
}


def check_guarantees(
    guarantees: list[Any], *, delta: float, refuse: Callable[[str], ProtocolError]
) -> None:
    """Check a party's reported guarantees (:meth:`~protocols.dp.Guarantee.to_json` each) as
    another party's bytes: raise ``refuse(what is wrong)`` for one with other fields or types,
    an epsilon that is not a number >= 0, or another delta than the run's."""
    for guarantee in guarantees:
        if not isinstance(guarantee, dict) or set(guarantee) != set(GUARANTEE_FIELDS):
            raise refuse(f"a guarantee with the fields {sorted(GUARANTEE_FIELDS)} expected")
        for key, kind in GUARANTEE_FIELDS.items():
            if not isinstance(guarantee[key], kind) or (
                isinstance(guarantee[key], bool) and kind is not bool
            ):
                raise refuse(f"a guarantee's `{key}` of type {kind} expected")
        if not guarantee["epsilon"] >= 0:  # NaN fails too
            raise refuse(f"an epsilon >= 0 expected, found {guarantee['epsilon']!r}")
        if guarantee["delta"] != delta:
            raise refuse(
                f"guarantees at the run's delta {delta:g} expected, found {guarantee['delta']!r}"
            )


def read_entry(name: str, entry: Any, *, delta: float) -> dict[str, Any]:
    """Party ``name``'s report about itself (:meth:`PartyPrivacy.entry`), checked as another
    party's bytes: ProtocolError for a malformed one, an epsilon that is not a number >= 0, or
    a guarantee at another delta than the run's."""

    def refuse(what: str) -> ProtocolError:
        return ProtocolError(f"report from {name}: its privacy entry: {what}.")

    check_keys(entry, ENTRY_KEYS, refuse=refuse)
    check_guarantees(entry["guarantees"], delta=delta, refuse=refuse)
    if not all(isinstance(e, (int, float)) and e >= 0 for e in entry["epsilon_per_epoch"]):
        raise refuse("`epsilon_per_epoch` as numbers >= 0 expected")
    counts = [*entry["releases"].values(), *entry["exposed"].values()]
    if not all(_is_int(c) and c >= 0 for c in counts) or set(entry["exposed"]) != {
        "train",
        "predict",
        "train_rows",
    }:
        raise refuse("`releases` and `exposed` (train, predict, train_rows) as counts expected")
    return entry
