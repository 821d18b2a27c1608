"""The command line: bad input is refused in one line with exit 2; good input writes results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from test_cli_own_data import train_argv, write_case

from secure_vfl.cli import main
from secure_vfl.federation.channel import read_capture
from secure_vfl.store import ResultsStore

BAD_FLAGS = [
    (["--p-miss-train", "1.5"], "expected a probability in [0, 1), found '1.5'"),
    (["--p-miss-train", "abc"], "expected a probability in [0, 1), found 'abc'"),
    (["--p-miss-test", "-0.1"], "expected a probability in [0, 1), found '-0.1'"),
    (["--epochs", "0"], "expected a positive integer, found '0'"),
    (["--batch-size", "ten"], "expected a positive integer, found 'ten'"),
    (["--parties", "1"], "expected an integer number of parties in [2, 10], found '1'"),
    (["--parties", "11"], "found '11'"),
    (["--seed", "-3"], "expected an integer seed in [0, 2**32), found '-3'"),
    (["--seed", "4294967296"], "expected an integer seed in [0, 2**32), found '4294967296'"),
    (["--lr", "nan"], "expected a positive finite number, found 'nan'"),
    (["--target-epsilon", "inf"], "expected a positive finite number, found 'inf'"),
    (["--heads", "some"], "invalid choice: 'some'"),
    (["--batching", "random"], "invalid choice: 'random'"),
    (["--missing-train", "mcar:2"], "`p` must be in [0, 1). Found 2.0"),
    (["--missing-test", "weird"], "unknown missingness mechanism 'weird'"),
    (["--p-miss-train", "0.1", "--missing-train", "mar1"], "not allowed with argument"),
    # an empty path was the current directory (the run's files spilled there), an empty column
    # name the default one
    (["--out", ""], "expected a path, found an empty string (write . for the current directory)"),
    (["--checkpoint-dir", ""], "expected a path, found an empty string"),
    (["--resume", ""], "expected a path, found an empty string"),
    (["--id-column", ""], "expected a column name, found ''"),
    (["--label-column", "  "], "expected a column name, found '  '"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_FLAGS)
def test_bad_flags_are_refused_in_one_line_and_nothing_is_written(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)  # where an empty path wrote
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--method", "laser", "--dataset", "digits", "--out", str(out), *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert message in err
    assert not tmp_path.joinpath("run").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            ["--method", "laser", "--dataset", "no-such-data"],
            "unknown dataset 'no-such-data'; expected one of:",
        ),
        (["--method", "nope", "--dataset", "digits"], "invalid choice: 'nope'"),
        (
            ["--method", "laser", "--party-file", "missing.csv"],
            "expected an existing file, found 'missing.csv'",
        ),
    ],
)
def test_bad_names_and_paths_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: list[str], message: str
) -> None:
    argv = ["train", *source, "--out", str(tmp_path / "r")]
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_train_writes_result_json_and_a_store_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "laser-digits"
    argv = [
        "train",
        "--method",
        "laser",
        "--dataset",
        "digits",
        "--epochs",
        "5",
        "--p-miss-train",
        "0.2",
        "--p-miss-test",
        "0",
        "--p-miss-test",
        "0.5",
        "--out",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["method"] == "laser" and result["dataset"] == "digits"
    assert set(result["metrics"]) == {"mcar:0", "mcar:0.5"}
    assert result["metrics"]["mcar:0"]["accuracy"] > 60.0  # chance is 10 %
    assert len(result["epoch_loss"]) == 5 and result["wall_time_s"] > 0
    assert result["config"]["method_config"]["epochs"] == 5
    rows = ResultsStore(tmp_path / "results.sqlite").rows()
    assert len(rows) == 1 and rows[0]["metrics"] == result["metrics"]
    printed = capsys.readouterr().out
    assert "mcar:0.5" in printed and "accuracy" in printed
    # A second run into the same directory is refused unless asked to overwrite.
    assert main(argv) == 2
    assert "exists" in capsys.readouterr().err
    assert len(ResultsStore(tmp_path / "results.sqlite").rows()) == 1


IRIS = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]


def test_train_names_the_columns_equal_blocks_leave_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """iris over 3 parties: its fourth column goes to no party, as in the papers; the run
    says so in result.json and its summary (a note, not a warning)."""
    assert main([*IRIS, "--parties", "3", "--out", str(tmp_path / "three")]) == 0
    result = json.loads((tmp_path / "three" / "result.json").read_text())
    assert result["left_out_columns"] == ["petal width (cm)"] and result["warnings"] == []
    printed = capsys.readouterr()
    note = "left out of every block (columns mod parties, as in the papers): petal width (cm)"
    assert note in printed.out and "warning" not in printed.err
    assert main([*IRIS, "--parties", "2", "--out", str(tmp_path / "two")]) == 0
    assert "left_out_columns" not in json.loads((tmp_path / "two" / "result.json").read_text())
    assert "left out" not in capsys.readouterr().out


def test_train_warns_when_its_missingness_left_every_block_observed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mar1 on iris's four one-column blocks hides none: the run is mcar:0 under its name."""
    argv = [*IRIS, "--missing-train", "mar1", "--missing-test", "mcar:0"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    [warning] = json.loads((tmp_path / "run" / "result.json").read_text())["warnings"]
    assert warning.startswith("the training missingness mar1 left every block of all 120")
    assert "each of the 4 blocks has one column" in warning
    assert f"secure-vfl: warning: {warning}" in capsys.readouterr().err


def test_train_on_the_users_own_party_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 240
    ids = np.array([f"id{i:04d}" for i in range(n)])
    y = rng.integers(0, 2, size=n)
    x = rng.normal(size=(n, 6)) + y[:, None] * 1.5
    files = []
    for k in range(3):
        keep = rng.random(n) < 0.85
        frame = pd.DataFrame(
            {"id": ids[keep], f"a{k}": x[keep, 2 * k], f"b{k}": x[keep, 2 * k + 1]}
        )
        path = tmp_path / f"bank{k}.csv"
        frame.to_csv(path, index=False)
        files.append(path)
    labels = tmp_path / "labels.csv"
    pd.DataFrame({"id": ids, "label": np.where(y == 1, "yes", "no")}).to_csv(labels, index=False)
    argv = [
        "train",
        "--method",
        "laser",
        "--epochs",
        "3",
        "--label-file",
        str(labels),
        "--out",
        str(tmp_path / "own"),
        "--quiet",
    ]
    for path in files:
        argv += ["--party-file", str(path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "own" / "result.json").read_text())
    assert result["dataset"] == "own-files"
    assert result["metrics"]["mcar:0"]["accuracy"] > 70.0
    # PSI alignment reveals less but aligns the same samples: the same seed trains the same model.
    psi_argv = [a if a != str(tmp_path / "own") else str(tmp_path / "psi") for a in argv]
    capture = tmp_path / "psi.capture"
    assert main([*psi_argv, "--align", "psi", "--capture", str(capture)]) == 0
    with_psi = json.loads((tmp_path / "psi" / "result.json").read_text())
    assert with_psi["config"]["align"] == "psi"
    assert with_psi["metrics"] == result["metrics"]
    assert with_psi["samples"] == result["samples"]
    # The capture holds the alignment (PSI with each data party) before training; the traffic
    # report counts training only, as the plain run's does.
    kinds = [message.kind for message in read_capture(capture)]
    assert kinds[0] == "psi-request" and "psi-matches" in kinds
    assert kinds.index("represent-request") > max(i for i, k in enumerate(kinds) if "psi" in k)
    assert with_psi["traffic"]["bytes"] == result["traffic"]["bytes"]


def test_psi_alignment_is_for_party_files_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--method", "laser", "--dataset", "digits", "--align", "psi"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert "`align` applies to party files" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_party_files_need_a_label_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.csv"
    pd.DataFrame({"id": [1, 2], "x": [0.1, 0.2]}).to_csv(path, index=False)
    code = main(
        [
            "train",
            "--method",
            "laser",
            "--party-file",
            str(path),
            "--party-file",
            str(path),
            "--out",
            str(tmp_path / "r"),
        ]
    )
    assert code == 2
    assert "--label-file" in capsys.readouterr().err


def test_module_entry_point_and_dataset_listing_run() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "secure_vfl", "datasets"],
        capture_output=True,
        text=True,
        check=True,
    )
    for name in ("digits", "fashion-mnist", "satellite", "german-credit", "ozone", "chorizon"):
        assert name in completed.stdout


def test_a_runs_clock_starts_after_torch_has_imported_what_its_optimisers_need() -> None:
    """``wall_time_s`` times the run, not an import: the first optimiser a process makes
    imports torch's compiler stack (hundreds of modules, about a second here), which
    load_optimiser_machinery, called before a run's clock starts, has done already. A fresh
    interpreter, so that nothing else imported them first."""
    code = (
        "import sys, torch\n"
        "from secure_vfl.experiment import load_optimiser_machinery\n"
        "load_optimiser_machinery()\n"
        "before = set(sys.modules)\n"
        "params = [torch.zeros(2, requires_grad=True)]\n"
        "torch.optim.SGD(params, lr=0.1, momentum=0.9)\n"
        "torch.optim.Adam(params, lr=0.1)\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert completed.stdout.strip() == "[]", completed.stdout[:500]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # it said "`p` must be one rate or one rate per party (4)", naming neither flag
        (["--missing-train", "mcar:0.1,0.2"], "`train_missing` 'mcar:0.1,0.2': one MCAR rate"),
        (["--missing-test", "mcar:0,0,0"], "`test_missing` 'mcar:0,0,0': one MCAR rate, or one"),
        (  # it printed the whole list, not the repeated entry
            ["--missing-test", "mar1", "--missing-test", "mcar:0", "--missing-test", "mar1"],
            "each test missingness once expected. Found ['mar1'] repeated.",
        ),
    ],
)
def test_missingness_that_does_not_fit_the_run_names_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    out = tmp_path / "run"
    assert (
        main(["train", "--method", "laser", "--dataset", "digits", "--out", str(out), *extra]) == 2
    )
    assert message in capsys.readouterr().err and not out.exists()


def test_a_commands_log_records_print_as_its_warnings(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Faults, rejoins and a certificate that does not name its host printed bare ("bank: could
    not end the run at shop: ..."), beside run warnings prefixed `secure-vfl: warning:`."""
    import logging

    from secure_vfl.cli import _log_lines

    with _log_lines():
        logging.getLogger("secure_vfl.deployment").warning("%s: could not end the run", "bank")
        logging.getLogger("protocols.x").error("shown \x1b[2J escaped")
        logging.getLogger("secure_vfl.deployment").info("not shown")
    assert capsys.readouterr().err == (
        "secure-vfl: warning: bank: could not end the run\n"
        "secure-vfl: error: shown \\x1b[2J escaped\n"
    )
    assert "could not end the run" in caplog.text  # records still reach the logging tree
    logging.getLogger("secure_vfl.deployment").warning("a library user's logging: theirs")
    assert "secure-vfl: warning:" not in capsys.readouterr().err
    # every command runs with it
    import secure_vfl.cli as cli

    def logs(args: object) -> int:
        logging.getLogger("secure_vfl.methods.base").warning("party-2 is lost at step 3")
        return 0

    monkeypatch.setattr(cli, "_run_command", logs)
    assert main(["datasets"]) == 0
    assert capsys.readouterr().err == "secure-vfl: warning: party-2 is lost at step 3\n"


def test_a_served_party_prints_its_run_warnings_as_they_come(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`party serve` showed a RunWarning (a new row far outside its training range, say) as a
    raw Python warning with its source line, and the same one only once per line of code."""
    import warnings

    from secure_vfl.cli import _printed_warnings
    from secure_vfl.errors import RunWarning

    with _printed_warnings(every_time=True):  # as `party serve` calls it
        for _ in range(2):
            warnings.warn("rows far outside", RunWarning, stacklevel=1)
        assert capsys.readouterr().err == "secure-vfl: warning: rows far outside\n" * 2
        with pytest.warns(DeprecationWarning):  # other warnings as before
            warnings.warn("old", DeprecationWarning, stacklevel=1)


def test_a_run_warning_is_printed_on_a_line_of_its_own_above_the_progress_bar(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bar is cleared, the warning printed from the start of the line, the bar redrawn: it
    does not run on from the bar's text."""
    import warnings

    from tqdm import tqdm

    from secure_vfl.cli import _printed_warnings
    from secure_vfl.errors import RunWarning

    with _printed_warnings(), tqdm(total=2, desc="laser", file=sys.stderr, leave=False) as bar:
        bar.update(1)
        capsys.readouterr()
        warnings.warn("party-1 is lost", RunWarning, stacklevel=1)
        err = capsys.readouterr().err
    assert err.startswith("\r ")  # the bar's line cleared
    assert "\rsecure-vfl: warning: party-1 is lost\n\rlaser:" in err


def warning_at_step_1(
    callback: Any, text: str, capsys: pytest.CaptureFixture[str], seen: list[str]
) -> Any:
    """``callback`` (a run's per-step or per-round callback), made to raise the RunWarning
    ``text`` twice at step 1 (the same warning again: printed and listed once) and to add what
    stderr holds by step 2 to ``seen``."""
    import warnings

    from secure_vfl.errors import RunWarning

    def step(number: int, value: float) -> None:
        if number == 1:
            for _ in range(2):
                warnings.warn(text, RunWarning, stacklevel=1)
        elif number == 2:
            seen.append(capsys.readouterr().err)
        callback(number, value)

    return step


def test_train_prints_a_run_warning_as_it_is_raised_in_the_users_party_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A RunWarning raised at a training step was printed only after the run's summary, which
    may come minutes later. It is printed as raised, once, naming the party as result.json
    does (``shop``, not the internal ``party-1``), and listed in result.json once."""
    import secure_vfl.experiment as experiment

    build_method = experiment.build_method
    stderr_at_step_2: list[str] = []

    def built(*args: Any, **kwargs: Any) -> Any:
        method = build_method(*args, **kwargs)
        fit = method.fit

        def fit_warning(*, on_step: Any, progress: Any) -> Any:
            step = warning_at_step_1(on_step, "party-1 is slow at step 1", capsys, stderr_at_step_2)
            return fit(on_step=step, progress=progress)

        method.fit = fit_warning
        return method

    monkeypatch.setattr(experiment, "build_method", built)
    bank, shop, labels = write_case(tmp_path)
    assert main(train_argv(bank, shop, labels, tmp_path / "run")) == 0
    line = "secure-vfl: warning: shop is slow at step 1\n"
    [during] = stderr_at_step_2
    after = capsys.readouterr()
    assert during.count(line) == 1
    assert "accuracy" in after.out and "shop is slow" not in after.err  # not again at the end
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["warnings"].count("shop is slow at step 1") == 1


def test_attack_prints_a_run_warning_as_it_is_raised_and_lists_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """attack, too, printed the warnings raised during its training only after its summary."""
    import attacks.runner as runner

    run_attack = runner.run_attack
    stderr_at_step_2: list[str] = []

    def attacked(*args: Any, on_step: Any, **kwargs: Any) -> Any:
        step = warning_at_step_1(on_step, "party-1 is slow at step 1", capsys, stderr_at_step_2)
        return run_attack(*args, on_step=step, **kwargs)

    monkeypatch.setattr(runner, "run_attack", attacked)
    argv = ["attack", "--method", "laser", "--dataset", "breast-cancer", "--heads", "active"]
    argv += ["--epochs", "1", "--attack", "gradient-replacement-backdoor"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    line = "secure-vfl: warning: party-1 is slow at step 1\n"
    [during] = stderr_at_step_2
    after = capsys.readouterr()
    assert during.count(line) == 1
    assert "slow at step 1" not in after.err  # not again at the end
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["warnings"].count("party-1 is slow at step 1") == 1


def test_datasets_install_reads_names_and_all_in_any_order(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`datasets install --all wine` stopped at argparse ("unrecognized arguments: wine"): the
    names were read before --all. Now the names are read wherever they stand, and --all with
    names is refused, naming both; `datasets` alone lists."""
    import secure_vfl.data.datasets as datasets

    installed: list[str] = []
    monkeypatch.setattr(datasets, "install_dataset", installed.append)
    assert main(["datasets", "install", "wine", "iris"]) == 0
    assert main(["datasets", "install", "digits"]) == 0
    assert installed == ["wine", "iris", "digits"]
    assert main(["datasets", "install", "--all", "wine"]) == 2
    err = capsys.readouterr().err
    assert "datasets install takes NAME ... or --all, not both. Found --all and wine." in err
    assert installed == ["wine", "iris", "digits"]
    assert main(["datasets"]) == 0 and "breast-cancer" in capsys.readouterr().out
