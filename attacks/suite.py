"""The attack suite: every attack that applies to a task, undefended and under each defense,
scored as VFLAIR does (Zou et al., ICLR 2024): per (attack, defense) the DCS; per attack kind and
defense the T-DCS, the mean DCS of that kind's attacks; per defense the C-DCS, the mean of its
T-DCS over the kinds."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attacks.base import ATTACKS, EPSILON_NOTE
from attacks.runner import AttackResult, defense_as_taken, run_attack
from protocols.privacy import PrivacySpec
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ConfigError, DivergenceError, run_warnings
from secure_vfl.experiment import TrainConfig, build_method, prepare_data
from secure_vfl.federation.messages import AGGREGATOR

UNDEFENDED = "none"


@dataclass(frozen=True)
class SuiteReport:
    """Every run of a suite, the attacks skipped (with why) and the scores."""

    runs: list[dict[str, Any]]
    skipped: dict[str, str]
    failed: dict[str, str]  # "attack / defense" -> why (e.g. training diverged under DP noise)
    t_dcs: dict[str, dict[str, float]]  # defense -> kind -> T-DCS
    c_dcs: dict[str, float]  # defense -> C-DCS
    t_dcs_chance: dict[str, dict[str, float]]
    c_dcs_chance: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "skipped": self.skipped,
            "failed": self.failed,
            "t_dcs": self.t_dcs,
            "c_dcs": self.c_dcs,
            "t_dcs_chance": self.t_dcs_chance,
            "c_dcs_chance": self.c_dcs_chance,
        }


def applicable(
    config: TrainConfig, data: VerticalData, attacker: str | None = None
) -> dict[str, str | None]:
    """Every registered attack with None if it applies to this run played by ``attacker``
    (default: each attack's own), or why it does not."""
    verdicts: dict[str, str | None] = {}
    for name in ATTACKS.names():
        attack = ATTACKS.get(name)()
        try:
            attack.check(
                config, data, attacker if attacker is not None else attack.default_attacker
            )
        except ConfigError as error:
            verdicts[name] = str(error)
        else:
            verdicts[name] = None
    return verdicts


def _scores(
    runs: Sequence[dict[str, Any]], key: str
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    by: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        by.setdefault(run["defense"], {}).setdefault(run["kind"], []).append(run[key])
    t_dcs = {
        defense: {kind: statistics.fmean(values) for kind, values in kinds.items()}
        for defense, kinds in by.items()
    }
    c_dcs = {defense: statistics.fmean(kinds.values()) for defense, kinds in t_dcs.items()}
    return t_dcs, c_dcs


def run_suite(
    config: TrainConfig,
    *,
    defenses: Sequence[str] = (),
    attacker: str | None = None,
    attacks: Sequence[str] | None = None,
    privacy: PrivacySpec | None = None,
    cache: Path | None = None,
    on_run: Callable[[str, str, AttackResult], None] | None = None,
) -> SuiteReport:
    """Run every attack that applies to ``config`` (only those named in ``attacks``, if given)
    undefended and under each defense (one spec each, e.g. ``dp-gradients:1:0.01``) added to
    ``privacy`` (its DP accounting: delta, adjacency; default none);
    ``on_run(attack, defense, result)`` after each. An unknown attack or a malformed defense is
    refused (ConfigError) before anything runs; a defense that does not apply to a run is
    listed with why, as a run that diverges is."""
    for name, given in (("attacks", attacks), ("defenses", defenses)):
        if isinstance(given, str):  # its letters would be taken as names
            raise ConfigError(f"`{name}` must be a list of names. Found the str {given!r}.")
    if attacks is not None and not attacks:
        raise ConfigError("attacks: at least one attack name expected (None: every one). Found [].")
    for name in attacks or ():
        ATTACKS.get(name)  # an unknown name is refused before anything runs
    base = privacy if privacy is not None else PrivacySpec(seed=config.seed)
    taken: dict[Any, str] = {}
    for defense in defenses:  # a typo is refused, not listed as not applicable
        setting = defense_as_taken(defense, base)
        if setting in taken:  # run twice, both averaged into its scores, one store row lost
            raise ConfigError(
                f"each --defense once expected (one setting run twice would count twice in its "
                f"scores). Found {taken[setting]} and {defense}, the same setting."
            )
        taken[setting] = defense
    data = prepare_data(config)
    build_method(config, data)  # what every run would be refused for, refused once, here
    members = [*(f"party-{k}" for k in range(data.train.parties)), AGGREGATOR]
    if attacker is not None and attacker not in members:  # once, not once per attack
        raise ConfigError(
            f"attacker: a party of this run expected, one of {', '.join(members)}. Found "
            f"{attacker!r}."
        )
    verdicts = {
        name: why
        for name, why in applicable(config, data, attacker).items()
        if attacks is None or name in attacks
    }
    names = [name for name, why in verdicts.items() if why is None]
    if not names:
        raise ConfigError(
            "no attack applies to this run: "
            + "; ".join(f"{name}: {why}" for name, why in verdicts.items())
        )
    runs = []
    failed: dict[str, str] = {}
    for name in names:
        kind = ATTACKS.get(name)().kind
        for defense in (UNDEFENDED, *defenses):
            try:
                with run_warnings() as noted:
                    result = run_attack(
                        config,
                        name,
                        attacker=attacker,
                        defenses=[] if defense == UNDEFENDED else [defense],
                        privacy=base,
                        cache=cache,
                    )
            except DivergenceError as error:  # it says so, where, and what to try
                failed[f"{name} / {defense}"] = str(error)
                continue
            except ConfigError as error:  # the defense does not apply to this method
                failed[f"{name} / {defense}"] = f"not applicable: {error}"
                continue
            if on_run is not None:
                on_run(name, defense, result)
            attack = ATTACKS.get(name)()
            payload = result.to_json()
            runs.append(
                {
                    "attack": name,
                    "attacker": result.attacker,
                    "kind": kind,
                    "defense": defense,
                    "metric": attack.metric,
                    "value": result.attack[attack.metric],
                    # every metric, e.g. model completion's untrained control (its chance)
                    "metrics": dict(result.attack),
                    "performance": result.performance,
                    "chance": result.chance,
                    "main_accuracy": result.main["accuracy"],
                    "epsilon": payload["epsilon"],
                    "dcs": result.dcs,
                    "dcs_chance": result.dcs_chance,
                    # e.g. a model that predicts one class: its scores mean little
                    "warnings": list(dict.fromkeys([*noted, *payload["training"]["warnings"]])),
                }
            )
    t_dcs, c_dcs = _scores(runs, "dcs")
    t_chance, c_chance = _scores(runs, "dcs_chance")
    skipped = {name: why for name, why in verdicts.items() if why is not None}
    return SuiteReport(runs, skipped, failed, t_dcs, c_dcs, t_chance, c_chance)


def markdown(report: SuiteReport, *, command: str) -> str:
    """The suite's report: every run, then T-DCS per kind and C-DCS per defense."""
    lines = [
        "# Attack suite",
        "",
        f"Command: `{command}`",
        "",
        "| attack | attacker | defense | metric | value | AP | chance | main accuracy | epsilon "
        "| DCS | DCS (AP* = chance) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report.runs:
        epsilon = run["epsilon"]
        shown = (
            "-" if not epsilon else ", ".join(f"{p} {e:.2f}" for p, e in sorted(epsilon.items()))
        )
        lines.append(
            f"| {run['attack']} | {run['attacker']} | {run['defense']} | {run['metric']} | "
            f"{run['value']:.3f} | {run['performance']:.3f} | "
            f"{run['chance']:.3f} | {100 * run['main_accuracy']:.2f} | {shown} | "
            f"{run['dcs']:.3f} | {run['dcs_chance']:.3f} |"
        )
    kinds = sorted({run["kind"] for run in report.runs})
    lines += ["", EPSILON_NOTE]
    lines += (
        [
            "",
            "T-DCS per attack kind (mean DCS of its attacks) and C-DCS per defense (mean of its "
            "T-DCS); in brackets with AP* = the attacks' chance levels.",
            "",
            "| defense | " + " | ".join(kinds) + " | C-DCS |",
            "|---|" + "---|" * (len(kinds) + 1),
        ]
        if report.runs
        else ["", "No run was scored: no T-DCS or C-DCS."]
    )
    for defense, per_kind in report.t_dcs.items():
        cells = [
            f"{per_kind[k]:.3f} ({report.t_dcs_chance[defense][k]:.3f})" if k in per_kind else "-"
            for k in kinds
        ]
        lines.append(
            f"| {defense} | "
            + " | ".join(cells)
            + f" | {report.c_dcs[defense]:.3f} ({report.c_dcs_chance[defense]:.3f}) |"
        )
    warned = [(run, text) for run in report.runs for text in run.get("warnings", [])]
    if warned:
        lines += ["", "Warnings (a run's scores may mean little):", ""]
        lines += [f"- {run['attack']} / {run['defense']}: {text}" for run, text in warned]
    if report.failed:
        lines += ["", "Runs that failed or do not apply (not scored):", ""]
        lines += [f"- {run}: {why}" for run, why in report.failed.items()]
    if report.skipped:
        lines += ["", "Not applicable to this run:", ""]
        lines += [f"- {name}: {why}" for name, why in report.skipped.items()]
    return "\n".join(lines) + "\n"
