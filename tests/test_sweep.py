"""Privacy-utility sweeps: the grid of defense settings, independent runs in parallel worker
processes, the table, the stored runs and the plots."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LABEL_LEAK_RUN

from attacks.sweep import expand, parse_grid, run_sweep, settings_count, summarise, write_sweep
from protocols.privacy import PrivacySpec
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig
from secure_vfl.methods import MethodConfig
from secure_vfl.store import ResultsStore

PNG = b"\x89PNG\r\n\x1a\n"


def _config() -> TrainConfig:
    return TrainConfig(
        method="laser",
        dataset="digits",
        parties=4,
        seed=0,
        method_config=MethodConfig(
            heads="active", epochs=1, top_model="none", representation_dim=10
        ),
    )


def test_templates_expand_over_the_grid_after_the_undefended_setting() -> None:
    grid = parse_grid(["SIGMA=0,1", "CLIP=0.01,0.1"])
    settings = expand(["dp-gradients:SIGMA:CLIP", "secure-agg:masks"], grid)
    assert [s.defense for s in settings] == [
        "none",
        "dp-gradients:0:0.01",
        "dp-gradients:0:0.1",
        "dp-gradients:1:0.01",
        "dp-gradients:1:0.1",
        "secure-agg:masks",
    ]
    assert settings[2].label == "SIGMA=0, CLIP=0.1"
    # counted without being made, as the run limit is checked
    assert settings_count(["dp-gradients:SIGMA:CLIP", "secure-agg:masks"], grid) == len(settings)


def test_a_placeholder_named_twice_is_one_value_and_close_values_stay_apart() -> None:
    # S:S gave four settings (0.5:0.5 twice), and 0.1000001 and 0.1000002 both ran as 0.1.
    settings = expand(["dp-gradients:S:S"], parse_grid(["S=0.5,1"]))
    assert [s.defense for s in settings] == ["none", "dp-gradients:0.5:0.5", "dp-gradients:1:1"]
    close = expand(["gradient-sparsification:F"], parse_grid(["F=0.1000001,0.1000002"]))
    assert [s.defense for s in close[1:]] == [
        "gradient-sparsification:0.1000001",
        "gradient-sparsification:0.1000002",
    ]
    assert [s.label for s in close[1:]] == ["F=0.1000001", "F=0.1000002"]


@pytest.mark.parametrize(
    ("grid", "templates", "expected"),
    [
        (["sigma=1"], ["dp-gradients:sigma:1"], "NAME in capitals"),
        (["SIGMA"], ["dp-gradients:SIGMA:1"], "NAME=V1,V2"),
        (["SIGMA=1,x"], ["dp-gradients:SIGMA:1"], "numbers expected"),
        (["SIGMA=1,inf"], ["dp-gradients:SIGMA:1"], "finite numbers"),
        (["SIGMA=1", "SIGMA=2"], ["dp-gradients:SIGMA:1"], "given twice"),
        ([], ["dp-gradients:SIGMA:1"], "no --grid values for SIGMA"),
        (["SIGMA=1"], ["dp-gradients:1:1"], "no --defense template names it"),
        # the same setting twice would be counted as two seeds of one
        (["SIGMA=1,1"], ["dp-gradients:SIGMA:1"], "distinct values expected. Found 1 repeated"),
        (["SIGMA=1,2,1e0"], ["dp-gradients:SIGMA:1"], "Found 1 repeated"),
        ([], ["norm-filter", "norm-filter"], "each --defense once expected.* norm-filter"),
        # two templates (or a placeholder named twice) made one setting, its runs two seeds
        (["S=4"], ["marvell:4", "marvell:S"], "each setting once expected.* Found marvell:4"),
    ],
)
def test_a_bad_grid_is_refused_before_anything_runs(
    grid: list[str], templates: list[str], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        expand(templates, parse_grid(grid))
    with pytest.raises(ConfigError, match=r"grid SIGMA: distinct values expected"):
        expand(["dp-gradients:SIGMA:1"], {"SIGMA": [1.0, 1.0]})  # a grid made in Python


def test_the_sweep_command_refuses_train_flags_saying_what_to_give_instead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--release dp asked for --secure-agg masks, which a sweep refuses in turn."""
    argv = ["sweep", "--attack", "direct-label-inference", *LABEL_LEAK_RUN]
    for extra, expected in [
        (["--secure-agg", "masks"], "a sweep's defenses are its --defense templates; found "),
        (
            ["--defense", "secure-agg:masks", "--release", "dp", "--release-noise", "1:1"],
            "the undefended runs of a sweep or suite have none: expected one `attack --attack",
        ),
    ]:
        assert main([*argv, *extra, "--out", str(tmp_path / "sweep")]) == 2
        assert expected in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()


def test_a_sweep_in_worker_processes_equals_one_in_this_process(tmp_path: Path) -> None:
    kwargs = {
        "templates": ["dp-gradients:SIGMA:0.01"],
        "grid": {"SIGMA": (3.0,)},
        "seeds": 1,
        "cache": tmp_path / "cache",
    }
    parallel = run_sweep(_config(), "direct-label-inference", workers=2, **kwargs)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # one worker runs in this process: it left torch at one thread
        serial = run_sweep(_config(), "direct-label-inference", workers=1, **kwargs)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert [r["defense"] for r in parallel] == ["none", "dp-gradients:3:0.01"]
    # the seed fixes everything but the DP noise (drawn fresh from the OS in every run): the
    # undefended runs are the same wherever they run, the defended ones equally private
    assert parallel[0]["attack"] == serial[0]["attack"]
    assert parallel[0]["main_accuracy"] == serial[0]["main_accuracy"]
    undefended, defended = parallel
    assert undefended["attack"]["accuracy"] >= 0.99 and undefended["epsilon"] is None
    for row in (defended, serial[1]):
        assert row["attack"]["accuracy"] < 0.5 and 0 < row["epsilon"] < math.inf
    table = summarise(parallel, "balanced_accuracy")
    assert table[1]["attack"] == defended["attack"]["balanced_accuracy"]
    text, plots = write_sweep(
        parallel, tmp_path / "out", attack="direct-label-inference", command="test"
    )
    assert "| dp-gradients:SIGMA:0.01 | SIGMA=3 | 1 |" in text
    assert all(path.read_bytes().startswith(PNG) for path in plots)
    stored = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert len(stored["rows"]) == 2 and stored["metric"] == "balanced_accuracy"


def test_sweep_command_writes_table_plots_and_store_rows(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = [
        "sweep",
        "--attack",
        "direct-label-inference",
        *LABEL_LEAK_RUN,
        "--defense",
        "dp-gradients:SIGMA:0.01",
        "--grid",
        "SIGMA=1",
        "--seeds",
        "2",
        "--workers",
        "1",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert (out / "sweep.md").read_text().count("\n| ") == 3  # header + 2 settings
    assert (out / "utility_epsilon.png").read_bytes().startswith(PNG)
    assert (out / "attack_utility.png").read_bytes().startswith(PNG)
    rows = ResultsStore(tmp_path / "results.sqlite").rows()
    assert len(rows) == 4 and {r["kind"] for r in rows} == {"sweep:direct-label-inference"}
    assert {r["config"]["defense"] for r in rows} == {"none", "dp-gradients:1:0.01"}
    assert main(argv) == 2  # the same --out again: refused, nothing rerun
    assert main([*argv[:-2], "--dp-sgd", "1:1", "--out", str(tmp_path / "x")]) == 2


def test_a_run_warning_of_a_worker_is_printed_with_its_setting_and_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker's RunWarnings (here: SIGMA 0 adds no noise) came out as raw Python warnings, one
    per worker process, naming no setting, and were not kept with the sweep."""
    out = tmp_path / "sweep"
    argv = ["sweep", "--attack", "direct-label-inference", *LABEL_LEAK_RUN, "--defense"]
    argv += ["dp-gradients:SIGMA:0.01", "--grid", "SIGMA=0", "--seeds", "1", "--workers", "1"]
    assert main([*argv, "--quiet", "--out", str(out)]) == 0
    rows = {row["defense"]: row for row in json.loads((out / "sweep.json").read_text())["rows"]}
    [unbounded] = [w for w in rows["dp-gradients:0:0.01"]["warnings"] if "epsilon is inf" in w]
    assert "(--dp-gradients SIGMA 0: no noise)" in unbounded
    assert not any("epsilon is inf" in w for w in rows["none"]["warnings"])
    printed = capsys.readouterr().err
    assert f"secure-vfl: warning: dp-gradients:0:0.01 seed 0: {unbounded}" in printed
    assert "RunWarning" not in printed


def test_a_runs_own_warnings_are_in_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's result warnings (a model that predicts one class) were left out of its row,
    which kept only what was noted while it ran: the sweep printed nothing."""
    import attacks.runner
    import attacks.sweep as sweep

    real = attacks.runner.run_attack
    collapsed = "predictions on test split 'mcar:0' collapsed to one class (stand-in)"

    def warned(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        result.training["warnings"].append(collapsed)
        return result

    monkeypatch.setattr(attacks.runner, "run_attack", warned)
    [setting] = sweep.expand([], {})
    job = {
        "setting": setting,
        "config": _config(),
        "attack": "direct-label-inference",
        "attacker": None,
        "privacy": None,
        "cache": None,
    }
    assert collapsed in sweep._attack_row(job)["warnings"]


def test_the_ray_executor_is_an_optional_extra() -> None:
    if importlib.util.find_spec("ray") is not None:
        rows = run_sweep(
            _config(),
            "direct-label-inference",
            templates=[],
            grid={},
            seeds=1,
            workers=1,
            executor="ray",
        )
        assert rows[0]["attack"]["accuracy"] >= 0.99
    else:
        with pytest.raises(ConfigError, match=r"secure-vfl\[ray\]"):
            run_sweep(
                _config(), "direct-label-inference", templates=[], grid={}, seeds=1, executor="ray"
            )


def test_a_diverged_run_is_counted_not_averaged(tmp_path: Path) -> None:
    ok = {
        "template": "dp-gradients:SIGMA:0.01",
        "setting": "SIGMA=1",
        "defense": "d",
        "seed": 0,
        "status": "scored",
        "step": None,
        "failed": None,
        "main_accuracy": 0.7,
        "attack": {"auc": 0.6},
        "performance": 0.6,
        "chance": 0.5,
        "epsilon": 2.0,
        "dcs": 0.8,
        "dcs_chance": 0.9,
    }
    diverged = {"status": "diverged", "failed": "training diverged: non-finite"}
    rows = [
        ok,
        {**ok, "seed": 1, **diverged, "step": 4},
        {**ok, "setting": "SIGMA=3", **diverged, "step": None},
    ]
    table = summarise(rows, "auc")
    assert table[0]["seeds"] == 1 and table[0]["failed"] == 1 and table[0]["attack"] == 0.6
    assert table[0]["diverged"] == 1 and table[0]["diverged_steps"] == [4]
    assert table[1] == {"template": ok["template"], "setting": "SIGMA=3", "seeds": 0, "failed": 1,
                        "diverged": 1, "diverged_steps": [None], "not_applicable": 0}  # fmt: skip
    text, plots = write_sweep(rows, tmp_path, attack="norm-scoring", command="test")
    assert "| SIGMA=1 | 1 (1 diverged at step 4) |" in text
    assert "| SIGMA=3 | 0 (1 diverged) |" in text  # where no step is known
    # one seed scored has no spread: "± 0.00" said the seeds agreed
    assert "| 1 (1 diverged at step 4) | 70.00 ± - | 0.600 ± - | 0.600 ± - | 2.00 |" in text
    # each run not scored, with why
    assert "- d seed 1 (diverged at step 4): training diverged: non-finite" in text
    assert all(path.exists() for path in plots)

    # AUCs of 0.1 and 0.9 are two strong attacks (AP 0.9 each), not a mean at chance
    flipped = [{**ok, "attack": {"auc": 0.1}, "performance": 0.9}, {**ok, "attack": {"auc": 0.9},
               "performance": 0.9, "seed": 1}]  # fmt: skip
    (row,) = summarise(flipped, "auc")
    assert row["attack"] == pytest.approx(0.5) and row["performance"] == pytest.approx(0.9)
    text, _ = write_sweep(flipped, tmp_path, attack="norm-scoring", command="test")
    assert "| attack auc | attack AP |" in text and "| 0.500 ± 0.400 | 0.900 ± 0.000 |" in text


def test_a_grid_over_the_run_limit_is_refused_before_its_settings_are_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 399 x 399 grid took 2.5 minutes of CPU (its settings made, then checked for repeats
    pairwise) before the limit refused it; it is counted first now, and the settings it would
    make are never made."""
    from attacks import sweep

    def made(*_: object) -> None:
        raise AssertionError("the settings were made")

    monkeypatch.setattr(sweep, "expand", made)
    values = tuple(float(v) for v in range(1, 400))
    with pytest.raises(ConfigError, match=r"at most 100000 runs expected; found 159202 settings"):
        run_sweep(
            _config(),
            "direct-label-inference",
            templates=["dp-gradients:SIGMA:CLIP"],
            grid={"SIGMA": values, "CLIP": values},
        )
    templates = ["dp-gradients:SIGMA:0.01", "marvell", "norm-filter:S"]
    grid = {"SIGMA": (1.0, 2.0), "S": (1.0, 2.0, 3.0)}
    assert sweep.settings_count(templates, grid) == 1 + 2 + 1 + 3


def test_a_malformed_setting_or_an_attack_that_does_not_apply_is_refused_before_any_run() -> None:
    """A negative CLIP from the grid, or a misspelt name, was found in a worker after the runs
    before it had trained (and then every finished run was thrown away)."""

    def started(runs: int) -> None:
        raise AssertionError("runs were started")

    cases = [
        (
            "direct-label-inference",
            ["dp-gradients:1:CLIP"],
            {"CLIP": (0.01, -1.0)},
            "--defense setting 'dp-gradients:1:-1': ",  # which one the grid made: it said only
        ),
        (
            "direct-label-inference",
            ["dp-gradients:1:CLIP"],
            {"CLIP": (0.01, -1.0)},
            "clip norm (CLIP) must be a positive",  # ... why
        ),
        ("direct-label-inference", ["bogus:X"], {"X": (1.0,)}, "a defense in ("),
        ("norm-scoring", ["marvell:4"], {}, "binary task"),  # digits has 10 classes
        # One setting written two ways: two rows, its runs counted as more seeds.
        (
            "direct-label-inference",
            ["dp-gradients:1:0.01", "dp-gradients:1:0.010"],
            {},
            "Found dp-gradients:1:0.01 and dp-gradients:1:0.010, the same setting.",
        ),
        (
            "direct-label-inference",
            ["norm-filter", "norm-filter:4"],
            {},
            "Found norm-filter and norm-filter:4, the same setting.",
        ),
        (
            "direct-label-inference",
            ["norm-filter:4", "norm-filter:4.0000001", "norm-filter:4.00"],
            {},
            "Found norm-filter:4 and norm-filter:4.00, the same setting.",
        ),
        (
            "direct-label-inference",
            ["dp-gradients:SIGMA:0.01", "dp-gradients:1.0:0.01"],
            {"SIGMA": (1.0, 2.0)},
            "Found dp-gradients:1:0.01 and dp-gradients:1.0:0.01, the same setting.",
        ),
    ]
    for attack, templates, grid, expected in cases:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            run_sweep(
                _config(), attack, templates=templates, grid=grid, workers=1, on_start=started
            )
    # A setting every run shares that its method refuses, and an empty attacker: every run was
    # written up as "not applicable" (report, plots, store rows), then the sweep exited 1.
    default_width = replace(
        _config(), method_config=replace(_config().method_config, representation_dim=128)
    )
    for config, attacker, expected in [
        (default_width, None, "representation_dim must equal the 10 classes. Found 128."),
        (_config(), "", "Found attacker ''"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            run_sweep(
                config, "direct-label-inference", templates=[], grid={}, attacker=attacker,
                on_start=started,
            )  # fmt: skip


def test_a_diverged_setting_is_shown_as_diverged_with_its_step_wherever_the_sweep_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A setting whose training diverged (here: noise of std 1e30 overflows at the first step)
    was "failed" in the table, as one whose defense does not apply: a result of that setting
    read as a fault. Its rows, the table, the list under it, the plots and what the command
    prints say "diverged" and at which step."""
    import attacks.sweep

    notes: list[str] = []

    def save(figure: Any, path: Path) -> Path:
        notes.extend(text.get_text() for axes in figure.axes for text in axes.texts)
        path.write_bytes(PNG)
        return path

    monkeypatch.setattr(attacks.sweep, "_save", save)
    out = tmp_path / "sweep"
    argv = ["sweep", "--attack", "direct-label-inference", *LABEL_LEAK_RUN, "--defense"]
    argv += ["dp-gradients:SIGMA:0.01", "--grid", "SIGMA=1,1e30", "--seeds", "1", "--workers", "1"]
    assert main([*argv, "--quiet", "--out", str(out)]) == 0
    stored = json.loads((out / "sweep.json").read_text())
    rows = {row["setting"]: row for row in stored["rows"]}
    assert rows["SIGMA=1e+30"]["status"] == "diverged" and rows["SIGMA=1e+30"]["step"] == 1
    assert rows["SIGMA=1"]["status"] == "scored" and rows["SIGMA=1"]["step"] is None
    table = {row["setting"]: row for row in stored["table"]}
    assert table["SIGMA=1e+30"]["diverged"] == 1 and table["SIGMA=1e+30"]["seeds"] == 0
    assert table["SIGMA=1"]["diverged"] == 0
    text = (out / "sweep.md").read_text()
    assert "| SIGMA=1e+30 | 0 (1 diverged at step 1) |" in text and "failed" not in text
    assert "- dp-gradients:1e+30:0.01 seed 0 (diverged at step 1): training diverged" in text
    assert any("diverged, not drawn: SIGMA=1e+30" in note for note in notes), notes
    printed = capsys.readouterr()
    assert "dp-gradients:1e+30:0.01 seed 0 (diverged at step 1): training diverged" in printed.err
    assert "| SIGMA=1e+30 | 0 (1 diverged at step 1) |" in printed.out


def test_a_defense_that_does_not_apply_is_a_failed_row_and_the_accounting_reaches_each_run(
    tmp_path: Path,
) -> None:
    """Marvell on a 10-class task (one error, after other settings had trained, ended the whole
    sweep); --delta and --dp-adjacency reached no run."""
    rows = run_sweep(
        _config(),
        "direct-label-inference",
        templates=["marvell:4", "dp-gradients:1:0.01"],
        grid={},
        seeds=1,
        workers=1,
        privacy=PrivacySpec(delta=1e-3, adjacency="add-remove"),
        cache=tmp_path / "cache",
    )
    undefended, marvell, noised = rows
    assert undefended["failed"] is None and noised["failed"] is None
    assert marvell["failed"].startswith("not applicable: marvell protects binary tasks")
    privacy = noised["training"]["privacy"]
    assert privacy["delta"] == 1e-3 and privacy["adjacency"].startswith("add or remove")
    text, _ = write_sweep(rows, tmp_path / "out", attack="direct-label-inference", command="t")
    assert "- marvell:4 seed 0: not applicable: marvell protects binary tasks" in text


def test_seeds_past_the_seed_range_are_refused_and_workers_never_outnumber_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--seeds 99999999999` built its list of runs (memory growing without a word), and
    `--workers 99999999999` asked for that many worker processes."""
    import attacks.sweep

    def started(runs: int) -> None:
        raise AssertionError("runs were started")

    with pytest.raises(ConfigError, match=re.escape("at most 4294967296 from --seed 0")):
        run_sweep(
            _config(),
            "direct-label-inference",
            templates=[],
            grid={},
            seeds=10**11,
            on_start=started,
        )
    # Within the seed range, and far past any sweep: it built a list of 2**32 runs, silently.
    with pytest.raises(ConfigError, match=re.escape("found 3 settings x 50000 seeds = 150000")):
        run_sweep(
            _config(),
            "direct-label-inference",
            templates=["dp-gradients:1:CLIP"],
            grid={"CLIP": (0.1, 1.0)},
            seeds=50_000,
            on_start=started,
        )
    asked = []

    def executor_map(jobs: list[object], *, workers: int, **kwargs: object) -> object:
        asked.append((len(jobs), workers))
        return list

    monkeypatch.setattr(attacks.sweep, "_executor_map", executor_map)
    run_sweep(_config(), "direct-label-inference", templates=[], grid={}, seeds=2, workers=10**11)
    assert asked == [(2, 2)]


def test_the_attack_utility_plot_judges_each_setting_against_its_own_chance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backdoor's chance under DP (0.000) is not its undefended one (0.232): one line at the
    first row's chance judged every defended point against the wrong level."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from attacks.sweep import plot

    lines: list[float] = []

    def axhline(self: Axes, y: float, **options: Any) -> None:
        if options.get("label") == "chance":
            lines.append(y)

    monkeypatch.setattr(Axes, "axhline", axhline)
    row = {"template": "none", "setting": "none", "seeds": 1, "main_accuracy": 0.9}
    row |= {"performance": 0.9, "epsilon": None, "chance": 0.232}
    defended = row | {"template": "dp-gradients:S:1", "setting": "S=1", "main_accuracy": 0.8}
    plot([row, defended | {"chance": 0.0}], tmp_path, attack="backdoor", metric="asr")
    assert lines == []  # each point's own level is drawn instead
    plot([row, defended | {"chance": 0.232}], tmp_path, attack="backdoor", metric="asr")
    assert lines == [0.232]
    assert (tmp_path / "attack_utility.png").stat().st_size > 0


@pytest.mark.parametrize("finite", [[], [0.5, 8.0]], ids=["inf-alone", "inf-and-finite"])
def test_an_unbounded_epsilon_is_drawn_at_the_right_edge_of_the_utility_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finite: list[float]
) -> None:
    """With no finite epsilon, the setting of epsilon inf stood in the middle of the axis while
    its label said it was drawn at the right edge."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from attacks.sweep import plot

    drawn: dict[str, Any] = {}
    plotted = Axes.plot

    def keep(self: Axes, *args: Any, **options: Any) -> Any:
        if drawn.setdefault("axes", self) is self:  # utility_epsilon.png's, the first
            drawn.setdefault("x", []).extend(args[0])
        return plotted(self, *args, **options)

    monkeypatch.setattr(Axes, "plot", keep)
    row = {"template": "dp-gradients:S:1", "seeds": 1, "main_accuracy": 0.8}
    row |= {"performance": 0.9, "chance": 0.5}
    rows = [row | {"setting": "S=0", "epsilon": math.inf}]
    rows += [row | {"setting": f"S={e}", "epsilon": e} for e in finite]
    plot(rows, tmp_path, attack="direct-label-inference", metric="auc")
    low, high = drawn["axes"].get_xlim()
    edge = max(drawn["x"])
    assert edge not in finite  # the unbounded one
    assert math.log(high / edge) < 0.25 * math.log(high / low)  # near the right edge
    assert min(finite, default=edge) > low
