"""The command line documents itself: every option of every sub-command has a help text and
shows its default; `--version` reads the package metadata; building the parser (hence `--help`
and `--version`) imports no torch, pandas or privacy layer."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata

import pytest

from secure_vfl.cli import IMPUTER_NAMES, METHOD_NAMES, build_parser, main
from secure_vfl.methods import METHODS
from secure_vfl.methods.imputation import IMPUTERS


def options(
    parser: argparse.ArgumentParser, command: str = "secure-vfl"
) -> Iterator[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    """Every argument of ``parser`` and of its sub-commands, with the command it belongs to."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from options(sub, f"{command} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield command, parser, action


def in_required_choice(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    """Whether ``action`` is one of a required either-or (``--dataset`` | ``--party-file``)."""
    return any(
        group.required and action in group._group_actions
        for group in parser._mutually_exclusive_groups
    )


def test_every_option_of_every_command_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    missing_help, missing_default = [], []
    for command, sub, action in options(parser):
        name = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip():
            missing_help.append(f"{command} {name}")
            continue
        formatter = sub._get_formatter()
        text = formatter._expand_help(action)
        takes_value = action.nargs != 0
        optional = action.option_strings and not action.required
        if (
            takes_value
            and optional
            and not in_required_choice(sub, action)
            and "default" not in text
            and "required" not in text
        ):
            missing_default.append(f"{command} {name}")
    assert missing_help == [], f"options without a help text: {missing_help}"
    assert missing_default == [], f"options whose default is not shown: {missing_default}"


def test_defaults_are_shown_in_the_help_output(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "training epochs (default: 20)" in text
    assert "reported, well below 1/n for n training records (default: 1e-05)" in text
    assert "(default: 4)" in text  # --parties, said in words since it depends on the files


@pytest.mark.parametrize("command", ["attack", "sweep"])
def test_attack_and_sweep_offer_only_the_join_they_align_by(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Their help listed `--align {join,psi}`, and both refused `--align psi` (PSI is train's)."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--align {join} " in capsys.readouterr().out
    run = [command, "--attack", "norm-scoring", "--method", "laser", "--dataset", "wine"]
    with pytest.raises(SystemExit) as exit_info:
        main([*run, "--align", "psi"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"secure-vfl \w+: error: argument --align: invalid choice: 'psi' "
        r"\(choose from '?join'?\)\n",
        err,
    ), err
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--align {join,psi} " in capsys.readouterr().out


def test_version_comes_from_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"secure-vfl {metadata.version('secure-vfl')}"


def test_the_parsers_names_are_the_registries_names() -> None:
    assert list(METHOD_NAMES) == METHODS.names()
    assert list(IMPUTER_NAMES) == IMPUTERS.names()


def test_help_and_version_import_no_torch() -> None:
    probe = (
        "import sys\n"
        "from secure_vfl.cli import main\n"
        "for argv in (['--help'], ['--version'], ['train', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = [m for m in ('torch', 'pandas', 'protocols', 'attacks', 'matplotlib')\n"
        "         if m in sys.modules]\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert "HEAVY []" in completed.stderr
