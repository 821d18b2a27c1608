"""The attack suite: every attack that applies to a task, undefended and under each defense,
scored as VFLAIR does (Zou et al., ICLR 2024): per (attack, defense) the DCS; per attack kind and
defense the T-DCS, the mean DCS of that kind's attacks; per defense the C-DCS, the mean of its
T-DCS over the kinds.

A run not scored is ``diverged`` (its training did not survive the defense's setting: a result,
said with the step where it diverged) or ``not applicable`` (the defense does not apply to the
task); the report's ``unscored`` says which, its lists and its T-DCS table too.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attacks.base import (
    ATTACKS,
    DIVERGED,
    EPSILON_NOTE,
    NOT_APPLICABLE,
    unscored_note,
    unscored_text,
)
from attacks.runner import AttackResult, defense_as_taken, run_attack
from protocols.privacy import PrivacySpec
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ConfigError, DivergenceError, run_warnings
from secure_vfl.experiment import TrainConfig, build_method, prepare_data
from secure_vfl.federation.messages import AGGREGATOR

UNDEFENDED = "none"


@dataclass(frozen=True)
class SuiteReport:
    """Every run of a suite, the attacks skipped (with why), the runs not scored (with why,
    and whether they diverged or do not apply) and the scores."""

    runs: list[dict[str, Any]]
    skipped: dict[str, str]
    failed: dict[str, str]  # "attack / defense" -> why it was not scored
    # "attack / defense" -> {"status": DIVERGED or NOT_APPLICABLE, "step": where it diverged}
    unscored: dict[str, dict[str, Any]]
    t_dcs: dict[str, dict[str, float]]  # defense -> kind -> T-DCS
    c_dcs: dict[str, float]  # defense -> C-DCS
    t_dcs_chance: dict[str, dict[str, float]]
    c_dcs_chance: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "skipped": self.skipped,
            "failed": self.failed,
            "unscored": self.unscored,
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
    refused (ConfigError) before anything runs; a run whose training diverges, or whose defense
    does not apply, is not scored but listed with why (and which it is, in ``unscored``)."""
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
    unscored: dict[str, dict[str, Any]] = {}
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
                unscored[f"{name} / {defense}"] = {"status": DIVERGED, "step": error.step}
                continue
            except ConfigError as error:  # the defense does not apply to this method
                failed[f"{name} / {defense}"] = f"not applicable: {error}"
                unscored[f"{name} / {defense}"] = {"status": NOT_APPLICABLE, "step": None}
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
    return SuiteReport(runs, skipped, failed, unscored, t_dcs, c_dcs, t_chance, c_chance)


def unscored_lines(report: SuiteReport, status: str) -> list[str]:
    """Each run of ``report`` not scored for ``status`` (diverged, not applicable), with why:
    ``attack / defense (diverged at step 3): training diverged ...``."""
    return [
        unscored_text(run, outcome, report.failed[run])
        for run, outcome in report.unscored.items()
        if outcome["status"] == status
    ]


def _defense_note(report: SuiteReport, defense: str) -> str:
    """What the T-DCS table says of ``defense``'s runs not scored, its scores being over the
    others: `` (1 diverged at step 3; 2 not applicable)``, or nothing."""
    mine: list[Mapping[str, Any]] = [
        outcome for run, outcome in report.unscored.items() if run.split(" / ", 1)[1] == defense
    ]
    return unscored_note(
        [m["step"] for m in mine if m["status"] == DIVERGED],
        sum(m["status"] == NOT_APPLICABLE for m in mine),
    )


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
            f"| {defense}{_defense_note(report, defense)} | "
            + " | ".join(cells)
            + f" | {report.c_dcs[defense]:.3f} ({report.c_dcs_chance[defense]:.3f}) |"
        )
    if report.runs:  # a defense no run of which was scored: its row, with why
        unscored = dict.fromkeys(run.split(" / ", 1)[1] for run in report.unscored)
        for defense in (d for d in unscored if d not in report.t_dcs):
            lines.append(
                f"| {defense}{_defense_note(report, defense)} |" + " - |" * (len(kinds) + 1)
            )
    warned = [(run, text) for run in report.runs for text in run.get("warnings", [])]
    if warned:
        lines += ["", "Warnings (a run's scores may mean little):", ""]
        lines += [f"- {run['attack']} / {run['defense']}: {text}" for run, text in warned]
    diverged = unscored_lines(report, DIVERGED)
    if diverged:
        lines += ["", "Runs that diverged (a result of the defense's setting, not scored):", ""]
        lines += [f"- {line}" for line in diverged]
    not_applicable = unscored_lines(report, NOT_APPLICABLE)
    if not_applicable:
        lines += ["", "Runs not scored (the defense does not apply):", ""]
        lines += [f"- {line}" for line in not_applicable]
    if report.skipped:
        lines += ["", "Not applicable to this run:", ""]
        lines += [f"- {name}: {why}" for name, why in report.skipped.items()]
    return "\n".join(lines) + "\n"
