"""Privacy-utility sweeps: one attack against a grid of defense settings, over several seeds.

A defense *template* names its parameters by placeholders, ``dp-gradients:SIGMA:0.01``, and
``--grid SIGMA=0,0.1,1`` gives their values; every (setting, seed) is an independent run of
:func:`attacks.runner.run_attack`, so they run in parallel worker processes (or as Ray tasks
with ``executor="ray"``, an optional extra). The undefended federation is always one of the
settings: it is the reference every defense is priced against.

Outputs: ``sweep.json`` (every run), ``sweep.md`` (means and standard deviations over seeds per
setting) and two plots: main accuracy against epsilon, and the attack's headline metric against
main accuracy, one series per defense template.

A run is ``scored``, ``diverged`` (training did not survive the setting: a result, said with the
step where it diverged) or ``not applicable`` (the defense does not apply to the task); each
place the sweep shows a run or a setting says which.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from attacks.base import (
    ATTACKS,
    DIVERGED,
    EPSILON_NOTE,
    NOT_APPLICABLE,
    SCORED,
    unscored_note,
    unscored_text,
)
from protocols.privacy import PrivacySpec
from secure_vfl import checks
from secure_vfl.errors import ConfigError, DivergenceError, run_warnings
from secure_vfl.experiment import TrainConfig, build_method, prepare_data
from secure_vfl.io import atomic_write, atomic_write_json, atomic_write_text, plain_number

PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
UNDEFENDED = "none"
MAX_RUNS = 100_000
"""The most runs (settings x seeds) a sweep takes: more is a typo, not a sweep."""


@dataclass(frozen=True)
class Setting:
    """One point of the grid: the template it comes from, its parameter values, and the concrete
    defense spec (``"none"``: undefended)."""

    template: str
    values: tuple[tuple[str, float], ...]
    defense: str

    @property
    def label(self) -> str:
        return ", ".join(f"{name}={number(value)}" for name, value in self.values) or self.defense


def number(value: float) -> str:
    """``value`` written short (``1``, ``0.1``, ``1e-05``), but never rounded: two values of a
    grid stay two settings (``0.1000001``)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def parse_grid(items: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """``["SIGMA=0,0.1,1", ...]`` as ``{"SIGMA": (0.0, 0.1, 1.0)}``; ConfigError otherwise."""
    grid: dict[str, tuple[float, ...]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not PLACEHOLDER.match(name):
            raise ConfigError(
                f"--grid NAME=V1,V2,... with NAME in capitals (a placeholder of a --defense "
                f"template). Found {item!r}."
            )
        if name in grid:
            raise ConfigError(f"--grid {name} given twice.")
        try:
            parsed = tuple(plain_number(v) for v in values.split(","))
        except ValueError:
            raise ConfigError(f"--grid {name}: numbers expected. Found {values!r}.") from None
        if not all(math.isfinite(v) for v in parsed):
            raise ConfigError(f"--grid {name}: finite numbers expected. Found {values!r}.")
        if len(set(parsed)) < len(parsed):  # the same setting twice would count as two seeds
            repeated = sorted({v for v in parsed if parsed.count(v) > 1})
            raise ConfigError(
                f"--grid {name}: distinct values expected. Found "
                f"{', '.join(map(number, repeated))} repeated in {values!r}."
            )
        grid[name] = parsed
    return grid


def settings_count(templates: Sequence[str], grid: Mapping[str, Sequence[float]]) -> int:
    """How many settings :func:`expand` makes of ``templates`` and ``grid`` (the undefended one
    included), counted without making them: each template, the product of its placeholders'
    value counts (one without values counts none, for :func:`expand` to refuse)."""
    total = 1
    for template in templates:
        names = dict.fromkeys(p for p in template.split(":")[1:] if PLACEHOLDER.match(p))
        total += math.prod(len(grid.get(name, ())) for name in names)
    return total


def expand(templates: Sequence[str], grid: Mapping[str, Sequence[float]]) -> list[Setting]:
    """The undefended setting, then every template at every combination of the values of the
    placeholders it names. ConfigError for a placeholder without values, or values no template
    uses."""
    repeated = sorted(t for t, n in Counter(templates).items() if n > 1)
    if repeated:
        raise ConfigError(
            f"each --defense once expected (a setting given twice would count its runs as more "
            f"seeds). Found {', '.join(repeated)} repeated."
        )
    for name, points in grid.items():  # as parse_grid refuses them, for a grid made in Python
        if len(set(points)) < len(points):
            raise ConfigError(
                f"grid {name}: distinct values expected (the same setting twice would count as "
                f"two seeds). Found {list(points)}."
            )
    settings = [Setting(UNDEFENDED, (), UNDEFENDED)]
    used: set[str] = set()
    for template in templates:
        parts = template.split(":")
        names = list(dict.fromkeys(part for part in parts[1:] if PLACEHOLDER.match(part)))
        missing = [name for name in names if name not in grid]
        if missing:
            raise ConfigError(
                f"--defense {template}: no --grid values for {', '.join(missing)}; expected "
                f"e.g. --grid {missing[0]}=0,0.1,1."
            )
        used.update(names)
        for combination in itertools.product(*(grid[name] for name in names)):
            values = dict(zip(names, combination, strict=True))
            concrete = ":".join(number(values[part]) if part in values else part for part in parts)
            settings.append(Setting(template, tuple(values.items()), concrete))
    unused = sorted(set(grid) - used)
    if unused:
        raise ConfigError(f"--grid {', '.join(unused)}: no --defense template names it.")
    counts = Counter(setting.defense for setting in settings)
    twice = sorted(defense for defense, n in counts.items() if n > 1)
    if twice:
        raise ConfigError(
            "each setting once expected (a setting given twice would count its runs as more "
            f"seeds). Found {', '.join(twice)} from more than one --defense and --grid."
        )
    return settings


def _run_point(job: dict[str, Any]) -> dict[str, Any]:
    """One run, in a worker: the attack under one setting and seed (a top-level function, so a
    process pool can call it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the caller's count again after the run (one worker: its process)
    try:
        return _attack_row(job)
    finally:
        torch.set_num_threads(threads)


def _attack_row(job: dict[str, Any]) -> dict[str, Any]:
    """The row of one run of :func:`_run_point`."""
    from attacks.runner import run_attack

    setting: Setting = job["setting"]
    config: TrainConfig = job["config"]
    row: dict[str, Any] = {
        "template": setting.template,
        "setting": setting.label,
        "defense": setting.defense,
        "values": dict(setting.values),
        "seed": config.seed,
    }
    try:
        with run_warnings() as noted:
            result = run_attack(
                config,
                job["attack"],
                attacker=job["attacker"],
                defenses=[] if setting.defense == UNDEFENDED else [setting.defense],
                privacy=job["privacy"],
                cache=job["cache"],
            )
    except DivergenceError as error:  # it says so, where, and what to try
        return {**row, "status": DIVERGED, "step": error.step, "failed": str(error)}
    except ConfigError as error:  # the defense does not apply to this task (as in a suite)
        return {**row, "status": NOT_APPLICABLE, "step": None, "failed": f"not applicable: {error}"}
    payload = result.to_json()
    epsilon = payload["epsilon"]
    return {
        **row,
        "status": SCORED,
        "step": None,
        "failed": None,
        "attacker": payload["attacker"],  # who attacked (its default where none was given)
        "main_accuracy": payload["main"]["accuracy"],
        "attack": payload["attack"],
        "performance": payload["performance"],
        "chance": payload["chance"],
        "epsilon": max(epsilon.values()) if epsilon else None,
        "dcs": payload["dcs"],
        "dcs_chance": payload["dcs_chance"],
        "training": payload["training"],
        # the run's own (e.g. a model that predicts one class) with what was noted during it
        "warnings": list(dict.fromkeys([*noted, *payload["training"]["warnings"]])),
    }


def _executor_map(
    jobs: list[dict[str, Any]],
    *,
    workers: int,
    executor: str,
    on_done: Callable[[], None] | None = None,
) -> Callable[[], list[dict[str, Any]]]:
    done = on_done if on_done is not None else (lambda: None)
    if executor == "process":

        def run_processes() -> list[dict[str, Any]]:
            # spawn: a fresh interpreter per worker (forking a process that has run torch's
            # thread pools can deadlock). Leaving the pool terminates its workers, also on
            # Ctrl-C or SIGTERM sent to this process alone (a process pool executor would wait
            # for their runs, and could hang at exit joining them).
            pool = get_context("spawn").Pool(workers) if workers > 1 else None
            with pool if pool is not None else contextlib.nullcontext():
                ran = pool.imap(_run_point, jobs, chunksize=1) if pool else map(_run_point, jobs)
                rows = []
                for row in ran:
                    rows.append(row)
                    done()
            return rows

        return run_processes
    if executor == "ray":
        try:
            import ray
        except ImportError:
            raise ConfigError(
                "--executor ray needs Ray: pip install 'secure-vfl[ray]' (an optional extra)."
            ) from None

        def run_ray() -> list[dict[str, Any]]:
            started = not ray.is_initialized()
            if started:
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
            try:
                remote = ray.remote(num_cpus=1)(_run_point)
                rows = list(ray.get([remote.remote(job) for job in jobs]))
                for _ in rows:
                    done()
                return rows
            finally:
                if started:
                    ray.shutdown()

        return run_ray
    raise ConfigError(f"--executor process or ray expected. Found {executor!r}.")


def run_sweep(
    config: TrainConfig,
    attack: str,
    *,
    templates: Sequence[str],
    grid: Mapping[str, Sequence[float]],
    seeds: int = 3,
    attacker: str | None = None,
    workers: int | None = None,
    executor: str = "process",
    privacy: PrivacySpec | None = None,
    cache: Path | None = None,
    on_start: Callable[[int], None] | None = None,
    on_done: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Every setting of ``templates`` x ``grid`` (and the undefended one) at ``seeds`` seeds
    (``config.seed``, ``config.seed + 1``, ...), run independently; one row per run.
    ``privacy``: what every run's defense is added to (its DP accounting: delta, adjacency;
    default none). ``on_start(runs)`` is called once the runs are known, ``on_done()`` as each
    ends (in order, with the process executor; all at the end with Ray). An unknown attack, one
    that does not apply to ``config`` or a malformed setting is refused (ConfigError) before
    anything runs; a defense that does not apply to the task is a failed row with why."""
    from attacks.runner import check_attack_arguments, defense_as_taken, make_attack

    check_attack_arguments(config, privacy)
    if isinstance(templates, str) or not isinstance(templates, Sequence):
        raise ConfigError(
            f"`templates` must be a list of defense templates. Found {type(templates).__name__}."
        )
    checks.instance("grid", grid, Mapping, " of placeholder names to value lists")
    for name, values in grid.items():
        if isinstance(values, str) or not isinstance(values, Sequence):
            raise ConfigError(
                f"`grid` {name!r}: a list of values expected. Found {type(values).__name__}."
            )
    if checks.integer("seeds", seeds) < 1:
        raise ConfigError(f"--seeds must be >= 1. Found {seeds}.")
    if config.seed + seeds > checks.SEED_LIMIT:  # before a list of that many runs is made
        raise ConfigError(
            f"--seeds: seeds {config.seed}..{config.seed + seeds - 1} must be below 2**32; "
            f"at most {checks.SEED_LIMIT - config.seed} from --seed {config.seed}. Found {seeds}."
        )
    planned = settings_count(templates, grid)
    if planned * seeds > MAX_RUNS:  # before the settings are made (a 1000 x 1000 grid's took
        raise ConfigError(  # minutes before this said no)
            f"a sweep of at most {MAX_RUNS} runs expected; found {planned} settings x "
            f"{seeds} seeds = {planned * seeds}."
        )
    settings = expand(templates, grid)
    workers = workers if workers is not None else max(1, min(os.cpu_count() or 1, 4))
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1. Found {workers}.")
    base = privacy if privacy is not None else PrivacySpec(seed=config.seed)
    parsed: dict[Any, str] = {}  # each setting as the runs take it (its values' numbers): text
    for setting in settings[1:]:  # e.g. a negative CLIP from the grid, or a misspelt name
        try:
            taken = defense_as_taken(setting.defense, base)
        except ConfigError as error:  # say which setting the grid made
            raise ConfigError(f"--defense setting {setting.defense!r}: {error}") from None
        if taken in parsed:  # dp-gradients:1:0.01 and dp-gradients:1:0.010, marvell:4 and 4.0
            raise ConfigError(
                f"each setting once expected (a setting given twice would count its runs as "
                f"more seeds). Found {parsed[taken]} and {setting.defense}, the same setting."
            )
        parsed[taken] = setting.defense
    made = make_attack(attack, {})
    data = prepare_data(config)
    build_method(config, data)  # what every run would be refused for, refused once, here
    made.check(config, data, attacker if attacker is not None else made.default_attacker)
    jobs = [
        {
            "setting": setting,
            "config": replace(config, seed=config.seed + offset),
            "attack": attack,
            "attacker": attacker,
            "privacy": replace(base, seed=config.seed + offset),
            "cache": cache,
        }
        for setting in settings
        for offset in range(seeds)
    ]
    if on_start is not None:
        on_start(len(jobs))
    # never more workers than runs: each is a fresh interpreter
    workers = min(workers, len(jobs))
    return _executor_map(jobs, workers=workers, executor=executor, on_done=on_done)()


def unscored_line(row: Mapping[str, Any]) -> str:
    """The line that says why a run was not scored: its setting, seed, status and error."""
    return unscored_text(f"{row['defense']} seed {row['seed']}", row, row["failed"])


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.inf, 0.0
    return statistics.fmean(finite), statistics.pstdev(finite) if len(finite) > 1 else 0.0


def summarise(rows: Sequence[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """Per setting, in the order first seen: means and standard deviations over seeds."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["template"], row["setting"]), []).append(row)
    table = []
    for (template, setting), group in groups.items():
        members = [m for m in group if m["status"] == SCORED]
        unscored = {
            "failed": len(group) - len(members),  # not scored, for whatever reason
            "diverged": sum(m["status"] == DIVERGED for m in group),
            "diverged_steps": [m["step"] for m in group if m["status"] == DIVERGED],
            "not_applicable": sum(m["status"] == NOT_APPLICABLE for m in group),
        }
        if not members:
            table.append({"template": template, "setting": setting, "seeds": 0, **unscored})
            continue
        main, main_sd = _mean_sd([m["main_accuracy"] for m in members])
        attack, attack_sd = _mean_sd([m["attack"][metric] for m in members])
        # AP (what the DCS scores) per run, then averaged: an AUC of 0.1 and one of 0.9 are two
        # strong attacks, not a mean at chance
        performance, performance_sd = _mean_sd([m["performance"] for m in members])
        epsilons = [m["epsilon"] for m in members if m["epsilon"] is not None]
        table.append(
            {
                "template": template,
                "setting": setting,
                "seeds": len(members),
                "main_accuracy": main,
                "main_accuracy_sd": main_sd,
                "attack": attack,
                "attack_sd": attack_sd,
                "performance": performance,
                "performance_sd": performance_sd,
                "epsilon": statistics.fmean(epsilons) if epsilons else None,
                "dcs": statistics.fmean(m["dcs"] for m in members),
                "dcs_chance": statistics.fmean(m["dcs_chance"] for m in members),
                "chance": statistics.fmean(m["chance"] for m in members),
                **unscored,
            }
        )
    return table


def markdown(
    table: Sequence[dict[str, Any]],
    *,
    attack: str,
    metric: str,
    command: str,
    diverged: Sequence[str] = (),
    failures: Sequence[str] = (),
) -> str:
    """The table of means over seeds, then ``diverged`` (each run whose training diverged,
    with where) and ``failures`` (each run whose defense does not apply, with why)."""
    lines = [
        f"# Privacy-utility sweep: {attack}",
        "",
        f"Command: `{command}`",
        "",
        f"| defense | setting | seeds | main accuracy | attack {metric} | attack AP | epsilon "
        "| DCS | DCS (AP* = chance) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        failed = unscored_note(row["diverged_steps"], row["not_applicable"])
        if not row["seeds"]:
            lines.append(
                f"| {row['template']} | {row['setting']} | 0{failed} | - | - | - | - | - | - |"
            )
            continue
        epsilon = row["epsilon"]
        shown = "-" if epsilon is None else ("inf" if math.isinf(epsilon) else f"{epsilon:.2f}")

        def spread(key: str, digits: int, scale: float = 1.0, row: dict[str, Any] = row) -> str:
            # one seed scored has no spread to show (0 would say the seeds agreed)
            sd = "-" if row["seeds"] < 2 else f"{scale * row[f'{key}_sd']:.{digits}f}"
            return f"{scale * row[key]:.{digits}f} ± {sd}"

        lines.append(
            f"| {row['template']} | {row['setting']} | {row['seeds']}{failed} | "
            f"{spread('main_accuracy', 2, 100)} | {spread('attack', 3)} | "
            f"{spread('performance', 3)} | {shown} | "
            f"{row['dcs']:.3f} | {row['dcs_chance']:.3f} |"
        )
    lines += ["", EPSILON_NOTE]
    if diverged:
        lines += ["", "Runs that diverged (a result of the setting, not scored):", ""]
        lines += [f"- {line}" for line in diverged]
    if failures:
        lines += ["", "Runs not scored (the defense does not apply):", ""]
        lines += [f"- {failure}" for failure in failures]
    return "\n".join(lines) + "\n"


def plot(table: Sequence[dict[str, Any]], out: Path, *, attack: str, metric: str) -> list[Path]:
    """``utility_epsilon.png`` (main accuracy against epsilon; a setting whose epsilon is
    unbounded, e.g. SIGMA 0, is drawn at the right edge) and ``attack_utility.png`` (the
    attack's performance AP, which the DCS scores, against main accuracy); written
    atomically. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lost = [row["setting"] for row in table if not row["seeds"] and row["diverged"]]
    lost_note = f"{DIVERGED}, not drawn: {', '.join(lost)}" if lost else ""
    table = [row for row in table if row["seeds"]]  # settings whose every run failed: none
    series: dict[str, list[dict[str, Any]]] = {}
    for row in table:
        series.setdefault(row["template"], []).append(row)
    paths = []

    figure, axes = plt.subplots(figsize=(6, 4))
    finite = [
        r["epsilon"] for r in table if r["epsilon"] is not None and math.isfinite(r["epsilon"])
    ]
    edge = 10 * max(finite) if finite else 10.0
    for template, rows in series.items():
        points = [
            (edge if math.isinf(r["epsilon"]) else r["epsilon"], 100 * r["main_accuracy"])
            for r in rows
            if r["epsilon"] is not None
        ]
        if points:
            points.sort()
            axes.plot(*zip(*points, strict=True), marker="o", label=template)
        for r in rows:
            if r["epsilon"] is not None and math.isinf(r["epsilon"]):
                axes.annotate(
                    f"{r['setting']} (epsilon = inf)",
                    (edge, 100 * r["main_accuracy"]),
                    fontsize=6,
                    xytext=(-4, -10),
                    textcoords="offset points",
                    ha="right",
                )
    undefended = [r for r in table if r["template"] == UNDEFENDED]
    if undefended:
        axes.axhline(
            100 * undefended[0]["main_accuracy"], color="grey", ls="--", label="undefended"
        )
    axes.set_xscale("log")
    unbounded = any(r["epsilon"] is not None and math.isinf(r["epsilon"]) for r in table)
    if unbounded:  # at the right edge, whatever else is drawn (with nothing finite, alone)
        low = min(finite) / 2 if finite else edge / 100
        axes.set_xlim(low, edge * 1.2)
    axes.set_xlabel(
        "epsilon of what is noised (largest party's"
        + ("; inf at the right edge)" if unbounded else ")")
    )
    axes.set_ylabel("main accuracy (%)")
    axes.set_title(f"{attack}: utility against privacy")
    priceless = [
        t
        for t, rows in series.items()
        if t != UNDEFENDED and all(r["epsilon"] is None for r in rows)
    ]
    if priceless:  # e.g. Marvell: no formal guarantee, so no point on this axis
        axes.text(
            0.01,
            0.01,
            f"no epsilon, not drawn: {', '.join(priceless)} (see attack_utility.png)",
            transform=axes.transAxes,
            fontsize=6,
            color="grey",
        )
    _note(axes, lost_note, 0.06 if priceless else 0.01)
    _legend(axes)
    figure.tight_layout()
    paths.append(_save(figure, out / "utility_epsilon.png"))
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    for template, rows in series.items():
        xs = [100 * r["main_accuracy"] for r in rows]
        ys = [r["performance"] for r in rows]
        axes.plot(xs, ys, marker="o", ls="" if template == UNDEFENDED else "-", label=template)
        for r, x, y in zip(rows, xs, ys, strict=True):
            if r["template"] != UNDEFENDED:
                axes.annotate(
                    r["setting"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points"
                )
    chances = [(100 * r["main_accuracy"], r["chance"]) for r in table if r["chance"] is not None]
    if len({round(chance, 9) for _, chance in chances}) == 1:
        axes.axhline(chances[0][1], color="grey", ls=":", label="chance")
    elif chances:  # a level per setting (a backdoor's under DP; model completion's untrained
        # model): each point is judged against its own, not the undefended one's
        axes.plot(
            *zip(*chances, strict=True),
            ls="",
            marker="_",
            markersize=14,
            color="grey",
            label="chance (each setting's)",
        )
    axes.set_xlabel("main accuracy (%)")
    axes.set_ylabel(f"attack performance (AP, from its {metric})")
    axes.set_title(f"{attack}: attack against utility, per defense")
    _note(axes, lost_note, 0.01)
    _legend(axes)
    figure.tight_layout()
    paths.append(_save(figure, out / "attack_utility.png"))
    plt.close(figure)
    return paths


def _note(axes: Any, text: str, height: float) -> None:
    """``text`` small and grey at the bottom left of ``axes`` (``height`` up), where there is
    any: the settings a plot leaves out, and why."""
    if text:
        axes.text(0.01, height, text, transform=axes.transAxes, fontsize=6, color="grey")


def _legend(axes: Any) -> None:
    """A legend, where something is drawn (every run failed: an empty plot, and no warning)."""
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8)


def _save(figure: Any, path: Path) -> Path:
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))
    return path


def write_sweep(
    rows: Sequence[dict[str, Any]], out: Path, *, attack: str, command: str
) -> tuple[str, list[Path]]:
    """Write ``sweep.md``, the plots and, last, ``sweep.json`` (what marks a finished sweep)
    into ``out``; return the Markdown table and the plot paths."""
    metric = ATTACKS.get(attack)().metric
    table = summarise(rows, metric)
    diverged = [unscored_line(row) for row in rows if row["status"] == DIVERGED]
    failures = [unscored_line(row) for row in rows if row["status"] == NOT_APPLICABLE]
    text = markdown(
        table, attack=attack, metric=metric, command=command, diverged=diverged, failures=failures
    )
    atomic_write_text(out / "sweep.md", text)
    plots = plot(table, out, attack=attack, metric=metric)
    atomic_write_json(
        out / "sweep.json",
        {
            "attack": attack,
            "metric": metric,
            "rows": list(rows),
            "table": table,
            "command": command,
        },
    )
    return text, plots
