"""The auditor: train a federation with an attacker in place, under the chosen defenses, and
score the attack and the defended model together.

A defense is a spec ``NAME[:PARAM...]`` (the CLI's ``--defense``): the privacy layer's
mechanisms (``dp-gradients:SIGMA:CLIP``, ``dp-embeddings:SIGMA:CLIP``, ``dp-sgd:SIGMA:CLIP``,
``secure-agg:BACKEND``) installed by :class:`protocols.privacy.PrivacyEngine` exactly as in
``train``, and the hook defenses of :mod:`attacks.defenses` (``gradient-sparsification:FRACTION``,
``marvell:SCALE``, and :mod:`attacks.norm_filter`'s ``norm-filter:Z``), installed inside the
parties they protect before training.

The score is VFLAIR's defense capability score (Zou et al., "VFLAIR: a research library and
benchmark for vertical federated learning", ICLR 2024)::

    DCS = 1 / (1 + sqrt((1 - b) * max(AP - AP*, 0)^2 + b * max(MP* - MP, 0)^2)),  b = 0.5

with AP the attack performance, MP the defended model's main accuracy (both in [0, 1]), MP* the
main accuracy of the same federation undefended and honest (its own run, cached) and AP* = 0 as
in VFLAIR (``dcs``) or the attack's chance level (``dcs_chance``: a defense that brings a binary
attack to chance then scores as well as it should).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import re
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from attacks.base import ATTACKS, Attack, AttackContext
from attacks.defenses import HOOK_DEFENSES, HookDefense, parse_hook_defense
from protocols.dp import parse_noise
from protocols.privacy import SECURE_AGGS, PrivacyEngine, PrivacySpec
from secure_vfl import checks
from secure_vfl.errors import ConfigError, OutputError, RunWarning
from secure_vfl.experiment import TrainConfig, TrainResult, prepare_data, run_training
from secure_vfl.federation.channel import Channel
from secure_vfl.io import atomic_write_json
from secure_vfl.methods.base import StepCallback

BALANCE = 0.5  # VFLAIR's b
NOISE_DEFENSES = {
    "dp-gradients": "dp_gradients",
    "dp-embeddings": "dp_embeddings",
    "dp-sgd": "dp_sgd",
}
DEFENSES = (*NOISE_DEFENSES, "secure-agg")


def defense_as_taken(text: str, spec: PrivacySpec) -> tuple[PrivacySpec, Any]:
    """The one defense ``text`` as a run takes it, over the base ``spec``: the privacy spec it
    makes and, for a hook defense, its name and number (its default where none is given), so
    that two texts of one setting compare equal (``dp-gradients:1:0.01`` and ``:0.010``,
    ``marvell:4`` and ``marvell:4.0``) and two settings apart do not (``4.0000001``).
    ConfigError as :func:`parse_defenses`."""
    from attacks.defenses import HOOK_DEFAULTS

    taken, hooks = parse_defenses([text], spec)
    if not hooks:
        return taken, None
    name, _, param = text.partition(":")
    return taken, (name, float(param) if param else HOOK_DEFAULTS[name])


def parse_defenses(
    texts: Sequence[str], spec: PrivacySpec
) -> tuple[PrivacySpec, list[HookDefense]]:
    """The privacy spec with the privacy layer's defenses among ``texts`` added, and the hook
    defenses (:mod:`attacks.defenses`) among them; ConfigError for an unknown defense, bad
    parameters, or a defense given twice."""
    hooks: list[HookDefense] = []
    for text in checks.texts("defenses", texts):
        name = text.partition(":")[0]
        if name in HOOK_DEFENSES:
            if any(hook.spec.partition(":")[0] == name for hook in hooks):
                raise ConfigError(f"defense {name} given twice (found {text!r}).")
            hooks.append(parse_hook_defense(text))
        else:
            spec = apply_defense(spec, text)
    return spec, hooks


def make_attack(name: str, options: Mapping[str, float | str]) -> Attack:
    """The attack registered as ``name``, made with the keyword parameters ``options``;
    ConfigError for a parameter it does not take, or a value of a type it cannot use."""
    factory = ATTACKS.get(name)
    parameters = inspect.signature(factory, eval_str=True).parameters
    # What an option's value (a number or text) can set; the others take objects, from Python.
    options_taken = [key for key, p in parameters.items() if _settable(p.annotation)]
    objects = [key for key in parameters if key not in options_taken]
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        takes = f"the parameters ({', '.join(options_taken)})" if options_taken else "no parameters"
        python = f" (from Python also {', '.join(objects)})" if objects else ""
        raise ConfigError(f"{name} takes {takes}{python}. Found {', '.join(unknown)}.")
    for key, value in options.items():
        declared = parameters[key].annotation
        if declared is not inspect.Parameter.empty and not _of_type(value, declared):
            python = ", from Python only" if key in objects else ""
            raise ConfigError(
                f"{name}: {key} takes {_type_name(declared)}{python}. Found {key}={value!r}."
            )
    try:
        return factory(**options)
    except TypeError as error:  # e.g. text where a number is compared
        given = ", ".join(f"{key}={value!r}" for key, value in sorted(options.items()))
        raise ConfigError(
            f"{name}: values of the types its parameters take expected. Found {given} ({error})."
        ) from None


def check_attack_arguments(config: object, privacy: object) -> None:
    """ConfigError unless ``config`` is a TrainConfig and ``privacy`` a PrivacySpec or None
    (an attack makes its own engine: its defenses join the spec)."""
    checks.instance("config", config, TrainConfig)
    if privacy is not None:
        hint = " (an attack adds its defenses to the spec; run_training takes the engine)"
        checks.instance("privacy", privacy, PrivacySpec, hint)


def attack_parameters(name: str, options: Mapping[str, float | str]) -> dict[str, Any]:
    """Every parameter of the attack ``name`` made with ``options``: its value, or its default
    where not given (as JSON: a value that is not a number, text, a bool or None as its text)."""
    bound = inspect.signature(ATTACKS.get(name)).bind(**options)
    bound.apply_defaults()
    return {
        key: value if value is None or isinstance(value, bool | int | float | str) else str(value)
        for key, value in bound.arguments.items()
    }


def changed_parameters(name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Those of ``parameters`` (:func:`attack_parameters`) that differ from the attack's
    defaults: what tells two runs of it apart."""
    defaults = attack_parameters(name, {})
    return {key: value for key, value in parameters.items() if defaults.get(key) != value}


def _settable(hint: Any) -> bool:
    """Whether an option's value (a number or text) can be of the declared type ``hint``."""
    return hint is inspect.Parameter.empty or any(_of_type(v, hint) for v in (1, 1.0, "x"))


def _of_type(value: object, hint: Any) -> bool:
    """Whether ``value`` is a value of the declared type ``hint``: an int (not a bool) for int,
    a finite number for float, else an instance of one of the hint's classes."""
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if typing.get_args(hint):  # a union, e.g. Completion | None
        return any(_of_type(value, arg) for arg in typing.get_args(hint))
    return not isinstance(hint, type) or isinstance(value, hint)


def _type_name(hint: Any) -> str:
    names = {int: "an integer", float: "a finite number", str: "text"}
    if hint in names:
        return names[hint]
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
    return " or ".join(names.get(arg, f"a {getattr(arg, '__name__', arg)} object") for arg in args)


def apply_defense(spec: PrivacySpec, text: str) -> PrivacySpec:
    """``spec`` with the privacy layer's defense ``text`` (``NAME[:PARAM...]``) added;
    ConfigError for an unknown defense, bad parameters, or a mechanism given twice."""
    name, _, params = text.partition(":")
    if name in NOISE_DEFENSES:
        attribute = NOISE_DEFENSES[name]
        if getattr(spec, attribute) is not None:
            raise ConfigError(f"defense {name} given twice (found {text!r}).")
        try:
            noise: dict[str, Any] = {attribute: parse_noise(params)}
        except ConfigError as error:  # it names neither the defense nor the spec
            raise ConfigError(f"defense {name}: {error}") from None
        return replace(spec, **noise)
    if name == "secure-agg":
        if params not in SECURE_AGGS or params == "none":
            backends = ", ".join(b for b in SECURE_AGGS if b != "none")
            raise ConfigError(f"secure-agg:BACKEND with BACKEND in {backends}. Found {text!r}.")
        if spec.secure_agg != "none":
            raise ConfigError(f"defense secure-agg given twice (found {text!r}).")
        return replace(spec, secure_agg=params)
    known = ", ".join([*DEFENSES, *HOOK_DEFENSES.names()])
    raise ConfigError(f"a defense in ({known}) expected. Found {text!r}.")


@contextmanager
def _defense_flags(defenses: Sequence[str], base: PrivacySpec) -> Iterator[None]:
    """A ConfigError raised inside names what it found as the ``--defense`` that gave it, not
    as train's flag: ``Found --dp-gradients.`` reads ``Found --defense dp-gradients:1:1.``
    where the mechanism came from ``defenses`` (and not from ``base``)."""
    try:
        yield
    except ConfigError as error:
        expected, found, tail = str(error).rpartition("Found ")
        if not found:
            raise
        for text in defenses:
            name = text.partition(":")[0]
            if name in NOISE_DEFENSES and getattr(base, NOISE_DEFENSES[name]) is None:
                tail = re.sub(rf"--{name}(?![\w-])", f"--defense {text}", tail)
        if expected + found + tail == str(error):
            raise
        raise ConfigError(expected + found + tail) from None


def spec_defenses(spec: PrivacySpec) -> list[str]:
    """The privacy layer's mechanisms that ``spec`` turns on, written as ``--defense`` specs
    (``dp-gradients:1:0.01``, ``secure-agg:masks``): what a run given ``train``'s privacy flags
    is defended by."""
    given = [
        f"{name}:{noise[0]:g}:{noise[1]:g}"
        for name, attribute in NOISE_DEFENSES.items()
        if (noise := getattr(spec, attribute)) is not None
    ]
    if given and spec.target_epsilon is not None:  # each SIGMA calibrated to it
        given.append(f"target-epsilon:{spec.target_epsilon:g}")
    return given + ([f"secure-agg:{spec.secure_agg}"] if spec.secure_agg != "none" else [])


def dcs(attack: float, main: float, *, attack_star: float, main_star: float) -> float:
    """VFLAIR's defense capability score of one (attack performance, main accuracy) pair."""
    gap = (1 - BALANCE) * max(attack - attack_star, 0.0) ** 2
    cost = BALANCE * max(main_star - main, 0.0) ** 2
    return 1.0 / (1.0 + math.sqrt(gap + cost))


@dataclass(frozen=True, kw_only=True)
class AttackResult:
    """One attack run: the attack's metrics, the defended model's, and their scores."""

    attack_name: str
    attacker: str
    parameters: dict[str, Any]  # the attack's, defaults included (attack_parameters)
    defenses: list[str]  # train's privacy flags as defense specs, then --defense's
    control: bool
    main: dict[str, float]
    attack: dict[str, float]
    performance: float  # AP in [0, 1], from the attack's metrics: what the DCS scores
    chance: float
    dcs: float
    dcs_chance: float
    undefended_accuracy: float
    privacy: dict[str, Any] | None
    # what each hook defense with a report did (the norm filter: rows seen and dropped)
    defense_reports: dict[str, Any]
    training: dict[str, Any] = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        epsilon = self.privacy["epsilon"] if self.privacy else None
        return {
            "attack_name": self.attack_name,
            "attacker": self.attacker,
            "parameters": self.parameters,
            "options": changed_parameters(self.attack_name, self.parameters),
            "defenses": self.defenses,
            "control": self.control,
            "main": self.main,
            "attack": self.attack,
            "performance": self.performance,
            "chance": self.chance,
            "epsilon": epsilon,
            "dcs": self.dcs,
            "dcs_chance": self.dcs_chance,
            "undefended_accuracy": self.undefended_accuracy,
            "privacy": self.privacy,
            "defense_reports": self.defense_reports,
            "training": self.training,
        }


def _main_accuracy(result: TrainResult) -> float:
    """The test accuracy (in [0, 1]) on the first test missingness (no blocks missing by
    default)."""
    return next(iter(result.metrics.values()))["accuracy"] / 100


def undefended_accuracy(config: TrainConfig, *, cache: Path | None = None) -> float:
    """MP*: the main accuracy of the honest, undefended federation of ``config``; cached in
    ``cache/<hash>.json`` when ``cache`` is given, under the config and the SHA-256 of each
    party and label file it reads (a file edited in place is a new federation)."""
    described = json.loads(json.dumps(config.to_json()))
    files = [*config.party_files, *([config.label_file] if config.label_file else [])]
    if files:
        described["file_sha256"] = {str(path): _sha256(path) for path in files}
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]
    path = cache / f"{key}.json" if cache is not None else None
    if path is not None and path.exists():
        try:
            stored = json.loads(path.read_text())
            if isinstance(stored, dict) and stored.get("config") == described:
                cached = float(stored["accuracy"])
                if 0 <= cached <= 1:  # (NaN is not)
                    return cached
        except (OSError, ValueError, KeyError, TypeError):
            pass  # an unreadable cache entry is recomputed and replaced
    accuracy = _main_accuracy(run_training(config))
    if path is not None:
        try:
            atomic_write_json(path, {"config": described, "accuracy": accuracy})
        except (OutputError, OSError) as error:  # only a cache: the run stands without it
            warnings.warn(
                f"the undefended accuracy was not cached ({error}); a later run trains the "
                "undefended federation again",
                RunWarning,
                stacklevel=2,
            )
    return accuracy


def _sha256(path: Path) -> str:
    with Path(path).open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def run_attack(
    config: TrainConfig,
    attack: str,
    *,
    options: Mapping[str, float | str] | None = None,
    attacker: str | None = None,
    defenses: Sequence[str] = (),
    privacy: PrivacySpec | None = None,
    control: bool = False,
    cache: Path | None = None,
    channel: Channel | None = None,
    on_start: Callable[[int], None] | None = None,
    on_step: StepCallback | None = None,
) -> AttackResult:
    """Train ``config`` with ``attacker`` playing ``attack``'s role (made with ``options``, its
    keyword parameters) under ``defenses`` (added to ``privacy``, default none), then score the
    attack and the defended model. ``control`` runs the negative control (the attacker's signal
    destroyed). ``cache`` keeps MP* between runs. The federation also predicts the attack's
    probe splits (:meth:`Attack.probes`), after the test splits, for its scoring."""
    check_attack_arguments(config, privacy)
    if options is not None:
        checks.instance("options", options, Mapping, " of parameter names to values")
    made = make_attack(attack, options or {})
    attacker = attacker if attacker is not None else made.default_attacker
    base = privacy if privacy is not None else PrivacySpec(seed=config.seed)
    spec, hooks = parse_defenses(defenses, base)
    if spec.secure_agg != "none" and not config.method_config.secure_sums:
        config = replace(config, method_config=replace(config.method_config, secure_sums=True))
    if spec.insecure_reproducible_noise and not spec.noise():
        # nothing to make reproducible in this run (a suite's or a sweep's undefended one)
        spec = replace(spec, insecure_reproducible_noise=False)
    engine = PrivacyEngine(spec)
    with _defense_flags(defenses, base):
        engine.refuse(config)
    for hook in hooks:  # a defense refuses, before any work, a run it cannot protect
        if (check := getattr(hook, "check", None)) is not None:
            check(config)
    data = prepare_data(config)
    made.check(config, data, attacker)
    context = AttackContext(
        data=data,
        attacker=attacker,
        rng=np.random.default_rng([config.seed, 1_000_003]),
        control=control,
    )
    probes = made.probes(context)
    clash = sorted(set(probes) & set(data.tests))
    if clash:
        raise ConfigError(f"{attack}'s probe splits {clash} clash with the test splits.")
    channel = channel if channel is not None else Channel()

    def on_ready(ready: Channel) -> None:
        for hook in hooks:
            hook.install(ready)
        made.prepare(ready.parties[attacker], context)

    result = run_training(
        config,
        data=replace(data, tests={**data.tests, **probes}),
        channel=channel,
        privacy=engine,
        roles={attacker: made.role} if made.role is not None else None,
        on_ready=on_ready,
        on_start=on_start,
        on_step=on_step,
    )
    probed = {name: result.metrics[name]["accuracy"] / 100 for name in probes}
    context = replace(context, probed=probed)
    metrics = made.evaluate(channel.parties[attacker], context)
    main = _main_accuracy(result)
    defended = spec.secure_agg != "none" or bool(spec.noise()) or bool(hooks)
    honest = made.passive and not defended
    reference = main if honest else undefended_accuracy(_undefended(config), cache=cache)
    performance = made.performance(metrics)
    chance = made.chance(context)
    return AttackResult(
        attack_name=attack,
        attacker=attacker,
        parameters=attack_parameters(attack, options or {}),
        defenses=[*spec_defenses(base), *defenses],  # train's flags are defenses too
        control=control,
        main={"accuracy": main},
        attack=metrics,
        performance=performance,
        chance=chance,
        dcs=dcs(performance, main, attack_star=0.0, main_star=reference),
        dcs_chance=dcs(performance, main, attack_star=chance, main_star=reference),
        undefended_accuracy=reference,
        privacy=result.privacy,
        defense_reports={
            hook.spec: report() for hook in hooks if (report := getattr(hook, "report", None))
        },
        training=result.to_json(named=False),  # named with the whole record
    )


def _undefended(config: TrainConfig) -> TrainConfig:
    """``config`` without secure sums, and so without their DP release of what a sum cannot
    hide (the defenses are the privacy layer's, not the method's)."""
    undefended = replace(config.method_config, secure_sums=False, release="drop")
    return replace(config, method_config=undefended)
