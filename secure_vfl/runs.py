"""Runs side by side: where a run came from, and the one-line summary that tells runs apart.

A run's ``result.json`` (and its row in the results store) carries its whole configuration;
:func:`summarise` reduces it to what distinguishes runs in a table: method, secure-sum backend,
the DP mechanisms with their noise, the largest epsilon a party spent, accuracy per test
missingness and wall time. ``secure-vfl runs list`` and ``runs compare`` print these tables.
"""

from __future__ import annotations

import math
import re
import subprocess
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from secure_vfl.errors import ConfigError
from secure_vfl.io import parse_json

_BACKENDS = {
    "PlainAggregator": "none",
    "MaskingAggregator": "masks",
    "PaillierAggregator": "paillier",
    "CkksAggregator": "ckks",
}
"""Secure-sum backends by the aggregator class a result's ``traffic`` names (for results
written before the privacy settings were kept in ``config.privacy``)."""

_DP_FLAGS = (
    ("dp_embeddings", "embedding", "embeddings"),
    ("dp_gradients", "gradient", "gradients"),
    ("dp_sgd", "dp-sgd", "dp-sgd"),
    ("dp_statistics", "statistics", "statistics"),
    ("release_noise", "exposure", "release"),  # --release dp: what a secure sum cannot hide
)
"""(privacy setting, privacy report's noise kind, name shown) of every DP mechanism."""


def package_version() -> str:
    """The installed package's version, or the source tree's when it runs uninstalled
    (``secure_vfl.__version__``)."""
    from secure_vfl import __version__

    return __version__


def party_named(value: Any, parties: Mapping[str, str]) -> Any:
    """``value`` in the users' party names at any depth: dictionary keys found in ``parties``
    (actor name -> user's name) renamed, and every actor name ``party-k`` in a text (a
    guarantee's "against party-1") replaced."""
    if isinstance(value, dict):
        return {parties.get(k, k): party_named(v, parties) for k, v in value.items()}
    if isinstance(value, list):
        return [party_named(v, parties) for v in value]
    if isinstance(value, str):
        return _ACTOR_NAME.sub(lambda m: parties.get(m.group(0), m.group(0)), value)
    return value


_ACTOR_NAME = re.compile(r"\bparty-\d+\b")


def provenance() -> dict[str, Any]:
    """The package version and, when the code runs from a git checkout of this project, the
    commit it runs from and whether its tracked files differ from that commit (both None
    otherwise: an installed package, or no git). A run from edited code named only its commit,
    as if it were that commit's."""
    commit, modified = git_state(Path(__file__).resolve().parent.parent)
    return {"version": package_version(), "git_commit": commit, "git_modified": modified}


def git_state(source: Path) -> tuple[str | None, bool | None]:
    """``git rev-parse HEAD`` of the checkout whose top level is ``source`` (not, say, a
    project whose virtualenv holds the package), and whether a tracked file differs from it
    (staged or not; files git does not track do not count; None where git cannot tell);
    (None, None) where there is no such checkout. Reads only: git takes no lock on the index
    (a ``git add`` the user runs meanwhile is not refused)."""
    source = source.resolve()
    try:
        lines = _git(source, "rev-parse", "--show-toplevel", "HEAD").splitlines()
    except (OSError, subprocess.SubprocessError):
        return None, None
    if len(lines) != 2 or Path(lines[0]).resolve() != source:
        return None, None
    try:
        changes = _git(source, "--no-optional-locks", "status", "--porcelain", "-uno")
    except (OSError, subprocess.SubprocessError):
        return lines[1], None
    return lines[1], bool(changes.strip())


def _git(source: Path, *command: str) -> str:
    return subprocess.run(
        ["git", "-C", str(source), *command],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout


@dataclass(frozen=True)
class RunSummary:
    """What tells one run from another: ``backend`` (none, masks, paillier, ckks), ``dp``
    (the DP mechanisms as ``name SIGMA:CLIP``, or none), ``epsilon`` (the largest spent by a
    party, None without DP; inf where a party has no guarantee, its releases in the clear),
    ``accuracy`` (%, per test missingness)."""

    kind: str
    method: str
    dataset: str
    backend: str
    dp: str
    epsilon: float | None
    accuracy: dict[str, float] = field(default_factory=dict)
    wall_time_s: float | None = None
    seed: int | None = None
    parties: tuple[str, ...] = ()
    trained: str = ""
    """How it was trained where runs may differ: training missingness, epochs, labelled rows,
    SimSiam pretraining (e.g. ``mcar:0.5, 5 epochs, 20 labelled``)."""
    attack: str = ""
    """An attack run's attack (``norm-scoring``; ``norm-scoring, control`` for its negative
    control); empty for a training run."""
    defense: str = ""
    """An attack run's defenses other than DP and secure sums (which ``dp`` and ``backend``
    show), e.g. ``marvell:4``."""
    score: tuple[float, float, float] | None = None
    """An attack run's attack performance AP, its chance level and its DCS against chance
    (None where the run did not record them)."""
    resumed: bool = False
    """Whether the run resumed a killed one (its time is the resumed part's only)."""
    rmse: float | None = None
    """An imputation run's RMSE over every client's hidden test entries (standardised units)."""
    settings: tuple[tuple[str, str], ...] = ()
    """The other settings it was trained with, as ``(flag, value)`` in the flags' words
    (``("lr", "0.1")``, ``("batch-size", "32")``): a table shows those that differ between
    its runs."""


def summarise(payload: dict[str, Any], *, kind: str = "train") -> RunSummary:
    """The summary of a ``result.json`` payload of ``train`` (or of ``attack``, whose training
    run is summarised, with its defenses), or of a results-store entry of either."""
    if "training" in payload:  # an attack's result.json
        training = dict(_object(payload, "training"))
        training["metrics"] = {  # as the results store keeps them: `runs list` and `compare` agree
            "main": _object(payload, "main"),
            "attack": _object(payload, "attack"),
            "score": {key: payload.get(key) for key in ("performance", "chance", "dcs_chance")},
        }
        defenses = payload.get("defenses") or []
        if not (isinstance(defenses, list) and all(isinstance(d, str) for d in defenses)):
            raise ConfigError(f"defenses: a list of names expected, found {defenses!r:.60}.")
        config = _object(training, "config", "training.config")
        training["config"] = {
            **config,
            "defense": ", ".join(defenses),
            "control": payload.get("control") is True,
            "options": payload.get("options") or {},
            "attacker": payload.get("attacker"),
        }
        return summarise(training, kind=f"attack:{payload.get('attack_name', '?')}")
    config = _object(payload, "config")
    settings = _object(config, "privacy", "config.privacy")
    report = _object(payload, "privacy")
    epsilon = _object(report, "epsilon", "privacy.epsilon")
    if not all(_is_number(value) for value in epsilon.values()):
        raise ConfigError(f"privacy.epsilon: a number per party expected, found {epsilon!r:.80}.")
    wall_time_s = payload.get("wall_time_s")
    if wall_time_s is not None and not _is_number(wall_time_s):
        raise ConfigError(f"wall_time_s: a number expected, found {wall_time_s!r:.40}.")
    seed = config.get("seed")
    if seed is not None and not (_is_number(seed) and isinstance(seed, int)):
        raise ConfigError(f"config.seed: an integer expected, found {seed!r:.40}.")
    method = str(payload.get("method", config.get("method", "?")))
    dp = _dp(config, settings, report)
    return RunSummary(
        kind=kind,
        method=method,
        dataset=str(payload.get("dataset", "?")),
        backend=_backend(config, settings, _object(payload, "traffic")),
        dp=dp,
        epsilon=math.inf if report.get("unguarded") else max(epsilon.values(), default=None),
        accuracy=_accuracy(_object(payload, "metrics")),
        wall_time_s=wall_time_s,
        seed=seed,
        parties=_user_party_names(payload.get("parties")),
        trained=_trained(config),
        resumed=_object(payload, "checkpoints").get("resumed_from_step") is not None,
        rmse=_rmse(_object(payload, "metrics")),
        settings=_settings(config, method, dp=dp != "none"),
        **_attack_columns(kind, config, _object(payload, "metrics")),
    )


_ATTACK_KINDS = ("attack", "suite", "sweep")  # the kinds of run whose name follows a colon


def _attack_columns(kind: str, config: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    """An attack run's ``attack``, ``defense`` and ``score`` (none for a training run)."""
    family, _, name = kind.partition(":")
    if family not in _ATTACK_KINDS or not name:
        return {}
    control = ", control" if config.get("control") is True else ""
    options = config.get("options")  # the attack's parameters that differ from its defaults
    if isinstance(options, dict) and options:
        name += " (" + ", ".join(f"{key}={value}" for key, value in sorted(options.items())) + ")"
    others = [
        defense
        for defense in str(config.get("defense") or "").split(", ")
        if defense and defense != "none" and not defense.startswith(("dp-", "secure-agg:"))
    ]
    score = _object(metrics, "score", "metrics.score")
    values = [score.get(key) for key in ("performance", "chance", "dcs_chance")]
    return {
        "attack": name + control,
        "defense": ", ".join(others),
        "score": tuple(values) if all(map(_is_number, values)) else None,
    }


def _trained(config: dict[str, Any]) -> str:
    """The training settings a comparison of methods turns on (the papers' tables are laid out
    by training missingness), as far as the configuration records them."""
    method = config.get("method_config")
    method = method if isinstance(method, dict) else {}
    parts = [str(config["train_missing"])] if config.get("train_missing") else []
    if type(method.get("epochs")) is int:
        parts.append(f"{method['epochs']} epoch{'s' if method['epochs'] != 1 else ''}")
    if type(method.get("labeled")) is int:
        parts.append(f"{method['labeled']} labelled")
    if type(config.get("aligned_labeled")) is int and config["aligned_labeled"]:
        parts.append(f"{config['aligned_labeled']} kept aligned")
    if method.get("pretrain_epochs"):
        parts.append(f"pretrained {method['pretrain_epochs']}")
    return ", ".join(parts)


# Where a run's configuration keeps its settings, and those that other columns show (the
# training missingness, epochs, labelled rows and pretraining: `trained`; the seed, the secure
# sums and the DP release) or that change how it runs, not what it learns.
_SETTING_GROUPS = ("method_config", "false_vfl", "impute_config")
_SHOWN_ELSEWHERE = frozenset(
    {"epochs", "labeled", "pretrain_epochs", "secure_sums", "vectorised", "release"}
)
_RUN_SETTINGS = ("parties", "clients", "availability", "attacker")
_OWN_FILE_SETTINGS = ("align", "test_file", "test_fraction", "missing_cells")
_DP_SETTINGS = {"delta": "delta", "adjacency": "dp-adjacency"}  # in config.privacy: its flag
# Which methods use a setting that not every method uses; a run of another method records its
# default, as the commands refuse another value (tests/test_cli_runs.py checks these lists
# against the methods' own).
MEAN_FUSION_METHODS = ("laser", "local", "ensemble")  # top_model
TRAINED_IMPUTERS = ("dae", "fed-dae", "fedhf")  # every setting of impute_config


def _uses(method: str, key: str) -> bool:
    """Whether a run of ``method`` uses its configuration's setting ``key``."""
    if key == "plug_dropout":
        return method == "plugvfl"
    if key == "standard_incomplete":
        return method == "standard"
    if key == "top_model":
        return method in MEAN_FUSION_METHODS
    if key in ("lr", "momentum", "representation_dim"):  # FALSE-VFL: its own Adam and latents
        return not method.startswith("false-vfl")
    return True


def _settings(config: dict[str, Any], method: str, *, dp: bool) -> tuple[tuple[str, str], ...]:
    """The settings of a run's configuration that no other column shows and its method uses,
    as (flag, value): those of its own files where it ran on some, and the DP accounting's
    where a DP mechanism ran."""
    found = [(key, config[key]) for key in _RUN_SETTINGS if config.get(key) is not None]
    if config.get("party_files"):
        found += [(key, config.get(key)) for key in _OWN_FILE_SETTINGS]
    for group in _SETTING_GROUPS:
        values = config.get(group)
        if not isinstance(values, dict):
            continue
        if group == "impute_config" and method not in TRAINED_IMPUTERS:
            continue
        found += [
            (key, value)
            for key, value in values.items()
            if key not in _SHOWN_ELSEWHERE and _uses(method, key)
        ]
    shown = [(key.replace("_", "-"), _setting_text(value)) for key, value in found]
    privacy = config.get("privacy")
    if dp and isinstance(privacy, dict):
        shown += [
            (flag, _setting_text(privacy[key]))
            for key, flag in _DP_SETTINGS.items()
            if key in privacy
        ]
    return tuple(shown)


def _setting_text(value: Any) -> str:
    """A setting's value as its flag takes it: a float in the fewest digits that read back as
    it (0.1 and 0.1000004 differ), None as ``none``."""
    if value is None:
        return "none"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _differing(summaries: Sequence[RunSummary]) -> list[str]:
    """The settings (flags) that two of ``summaries`` hold with different values."""
    values: dict[str, set[str]] = {}
    for summary in summaries:
        for flag, value in summary.settings:
            values.setdefault(flag, set()).add(value)
    return [flag for flag, seen in values.items() if len(seen) > 1]


def _object(mapping: dict[str, Any], key: str, name: str | None = None) -> dict[str, Any]:
    """``mapping[key]``, an object ({} where it is absent or null); ConfigError naming the
    field (``name``, by default ``key``) for anything else."""
    value = mapping.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{name or key}: an object expected, found {type(value).__name__} {value!r:.40}."
        )
    return value


def _is_number(value: Any) -> bool:
    """An int or float (not a bool) that a float holds: JSON's integers have no bound, and one
    of 400 digits failed the table's formatting with an OverflowError."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _user_party_names(mapping: Any) -> tuple[str, ...]:
    """The users' names of a run's parties (``result.json``'s ``parties``: actor name ->
    user's name; a deployed run's actors carry the users' names), or none where they are the
    internal names ``party-0``, ``party-1``, ... (a registered dataset)."""
    if not isinstance(mapping, dict):
        return ()
    names = [str(name) for name in mapping.values()]
    if names == [f"party-{k}" for k in range(len(names))]:
        return ()
    return tuple(names)


def _backend(config: dict[str, Any], settings: dict[str, Any], traffic: dict[str, Any]) -> str:
    if settings.get("secure_agg") not in (None, "", "none"):
        return str(settings["secure_agg"])
    for defense in str(config.get("defense") or "").split(", "):
        if defense.startswith("secure-agg:"):
            return defense.partition(":")[2]
    return _BACKENDS.get(str(traffic.get("aggregator")), "none")


def _dp(config: dict[str, Any], settings: dict[str, Any], report: dict[str, Any]) -> str:
    """The DP mechanisms that ran, with the noise actually used (after a target epsilon's
    calibration), from the privacy report; else as given in the settings or defenses."""
    noise = _object(report, "noise", "privacy.noise")
    parts = []
    for setting, reported, shown in _DP_FLAGS:
        used = _object(noise, reported, f"privacy.noise.{reported}")
        pair = (used.get("sigma"), used.get("clip")) if used else settings.get(setting)
        if pair is None:
            continue
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(map(_is_number, pair))):
            where = f"privacy.noise.{reported}" if used else f"config.privacy.{setting}"
            raise ConfigError(f"{where}: a sigma and a clip expected, found {pair!r:.60}.")
        sigma, clip = pair
        parts.append(f"{shown} {sigma:g}:{clip:g}")
    for defense in str(config.get("defense") or "").split(", "):
        if defense.startswith("dp-") and not parts:
            parts.append(defense)
    target = settings.get("target_epsilon")
    if target is not None:
        if not _is_number(target):
            raise ConfigError(
                f"config.privacy.target_epsilon: a number expected, found {target!r:.40}."
            )
        parts.append(f"target {target:g}")
    return ", ".join(parts) or "none"


def _rmse(metrics: dict[str, Any]) -> float | None:
    """An imputation run's RMSE (None for any other run)."""
    value = metrics.get("rmse")
    return float(value) if isinstance(value, int | float) and _is_number(value) else None


def _accuracy(metrics: dict[str, Any]) -> dict[str, float]:
    """Accuracy (%) per test missingness of a training run's metrics; an attack run's main
    accuracy under ``main`` and, where its metric is an accuracy, the attack's under ``attack``
    (both shares, shown as % like the others)."""
    accuracy = {}
    for name, values in metrics.items():
        if isinstance(values, dict) and isinstance(values.get("accuracy"), int | float):
            share = name in ("main", "attack")
            accuracy[name] = float(values["accuracy"]) * (100 if share else 1)
    return accuracy


def result_kind(payload: Any) -> str | None:
    """The command whose ``result.json`` ``payload`` is (``train``, ``attack``, ``impute``), or
    None where it is none of theirs."""
    if not isinstance(payload, dict):
        return None
    if "attack_name" in payload or "training" in payload:
        return "attack"
    if "epoch_loss" in payload:
        return "train"
    return "impute" if "rmse" in payload else None


def read_run(directory: Path) -> dict[str, Any]:
    """The ``result.json`` of a run directory; ConfigError if there is none or it is not a
    result of ``train``, ``attack`` or ``impute``."""
    path = Path(directory) / "result.json"
    if not Path(directory).is_dir():
        found = "a file" if Path(directory).exists() else "nothing there"
        raise ConfigError(f"{directory}: a run directory expected, found {found}.")
    if not path.is_file():
        raise ConfigError(f"{directory} holds no result.json; expected a run directory.")
    payload = parse_json(path.read_bytes(), str(path), error=ConfigError)
    if result_kind(payload) is None:
        raise ConfigError(
            f"{path} is not the result of a run (train, attack or impute); expected one."
        )
    return payload


def summarise_run(directory: Path) -> RunSummary:
    """The summary of the run in ``directory`` (:func:`read_run`, :func:`summarise`);
    ConfigError naming its ``result.json`` and the field that does not read."""
    payload = read_run(directory)
    try:  # an attack's kind is its payload's (summarise reads its attack's name there)
        if result_kind(payload) == "train":
            _check_accuracies(_object(payload, "metrics"))
        return summarise(payload, kind="impute" if result_kind(payload) == "impute" else "train")
    except ConfigError as error:
        raise ConfigError(f"{Path(directory) / 'result.json'}: {error}") from None


def _check_accuracies(metrics: dict[str, Any]) -> None:
    """A training run's ``metrics``: an object with a number ``accuracy`` per test missingness,
    at least one (ConfigError otherwise: a run without them showed "-" in every column)."""
    if not metrics:
        raise ConfigError("metrics: an accuracy per test missingness expected, found none.")
    for name, values in metrics.items():
        found = values.get("accuracy") if isinstance(values, dict) else values
        if not (_is_number(found) and math.isfinite(cast(float, found))):
            raise ConfigError(f"metrics.{name}.accuracy: a number expected, found {found!r:.40}.")


def table(names: list[str], summaries: list[RunSummary]) -> str:
    """A plain-text table, one line per run: name, method, the dataset, the training settings,
    the seed and the other settings where the runs do not all share them, backend, DP,
    epsilon, accuracy per test missingness (a column each, over all runs), time, and the
    parties' names where a run names them (runs on the users' own files)."""
    # One order whatever the runs' order (else `runs list` and `runs compare` of the same runs
    # ordered them apart): an attack run's main task first, its attack's accuracy last.
    tests = sorted({name for s in summaries for name in s.accuracy}, key=_test_order)
    named = any(s.parties for s in summaries)
    mixed = len({s.dataset for s in summaries}) > 1  # else the accuracies compare like for like
    varied = len({s.trained for s in summaries}) > 1  # training settings, where they differ
    seeded = len({s.seed for s in summaries}) > 1  # a sweep's seeds: else rows look repeated
    differing = _differing(summaries)  # e.g. lr 0.1 against lr 0.03: else rows look alike
    attacks = any(s.attack for s in summaries)
    header = ["run", "method", *(["dataset"] if mixed else []), *(["trained"] if varied else [])]
    header += ["seed"] if seeded else []
    header += ["settings"] if differing else []
    header += ["attack", "defense"] if attacks else []
    header += ["backend", "dp", "epsilon"]
    header += [*[f"acc {t}" for t in tests]]
    imputed = any(s.rmse is not None for s in summaries)
    header += ["RMSE"] if imputed else []
    header += ["AP", "chance", "DCS vs chance"] if attacks else []
    header += ["time s"]
    rows = [header + (["parties"] if named else [])]
    for name, summary in zip(names, summaries, strict=True):
        epsilon = "-" if summary.epsilon is None else _number(summary.epsilon)
        accuracy = [f"{summary.accuracy[t]:.2f}" if t in summary.accuracy else "-" for t in tests]
        time = "-" if summary.wall_time_s is None else f"{summary.wall_time_s:.1f}"
        time += " (resumed)" if summary.resumed else ""
        row = [name, summary.method, *([summary.dataset] if mixed else [])]
        row += [summary.trained or "-"] if varied else []
        row += ["-" if summary.seed is None else str(summary.seed)] if seeded else []
        if differing:
            own = dict(summary.settings)
            row.append(", ".join(f"{flag} {own[flag]}" for flag in differing if flag in own) or "-")
        row += [summary.attack or "-", summary.defense or "-"] if attacks else []
        row += [summary.backend, summary.dp, epsilon, *accuracy]
        row += ["-" if summary.rmse is None else f"{summary.rmse:.4f}"] if imputed else []
        if attacks:
            row += [f"{v:.3f}" for v in summary.score] if summary.score else ["-"] * 3
        row.append(time)
        if named:
            row.append(", ".join(summary.parties) or "-")
        rows.append(row)
    return "\n".join(columns(rows))


def _test_order(name: str) -> tuple[int, list[tuple[int, float, str]]]:
    """A test split's place among the table's columns: ``main`` first, ``attack`` last, the
    others by their text, the numbers in it by value (``mcar:0.1``, ``mcar:0.25``,
    ``mcar:0.5``; split by :func:`re.split`, texts at even places and numbers at odd ones)."""
    parts = [
        (0, float(part), "") if index % 2 else (1, 0.0, part)
        for index, part in enumerate(re.split(r"(\d+(?:\.\d+)?)", name))
    ]
    return {"main": 0, "attack": 2}.get(name, 1), parts


def columns(rows: Sequence[Sequence[str]], *, right: Sequence[int] = ()) -> list[str]:
    """``rows`` (the first a heading) as lines of columns two spaces apart, each as wide as its
    widest cell on a terminal (:func:`display_width`), those at the indices ``right`` aligned
    right, the others left; a cell's characters a terminal would act on escaped
    (:func:`name_text`: a run's directory, a party's name may hold any)."""
    cells = [[name_text(cell) for cell in row] for row in rows]
    widths = [max(display_width(row[i]) for row in cells) for i in range(len(cells[0]))]
    return [
        "  ".join(
            padded(cell, width, right=i in right)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    ]


def name_text(name: str) -> str:
    """A party's, a client's, a feature's or a run's name as a table prints it: every character
    a terminal would act on escaped, line breaks and tabs too (another party, a file's name or a
    column's header chose it)."""
    return name if name.isprintable() else repr(name)[1:-1]


def display_width(text: str) -> int:
    """How many columns a terminal gives ``text``: two for each wide character (Chinese,
    Japanese, Korean, most emoji), none for a combining mark, a format character or a Korean
    vowel or final consonant that joins the letter before it (Hangul written as letters, as
    macOS names files), one for any other. A name or a column header may be in any script;
    counting characters left the columns after a wide one out of line."""
    if text.isascii():
        return len(text)
    return sum(_char_width(char) for char in unicodedata.normalize("NFC", text))


def _char_width(char: str) -> int:
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    if "\u1160" <= char <= "\u11ff" or "\ud7b0" <= char <= "\ud7ff":  # Hangul jungseong, jongseong
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def padded(text: str, width: int, *, right: bool = False) -> str:
    """``text`` with spaces to ``width`` terminal columns (:func:`display_width`), on its left
    with ``right``, else on its right."""
    fill = " " * max(0, width - display_width(text))
    return fill + text if right else text + fill


def _number(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}"
