"""The ``secure-vfl`` command line (also ``python -m secure_vfl``).

Every flag is validated before anything is written: a bad value prints one line saying what was
expected and what was found, and the command exits with status 2.

Building the parser imports nothing heavy (no torch, pandas or privacy layer), so ``--help`` and
``--version`` answer at once; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from secure_vfl.errors import ConfigError, OutputError, SecureVFLError, run_warnings
from secure_vfl.io import (
    check_directory,
    counted,
    make_parent,
    plain_integer,
    plain_number,
    writable_file,
)
from secure_vfl.runs import party_named

EXIT_USAGE = 2
DEFAULT_DELTA = 1e-5  # protocols.privacy.PrivacySpec's (this module imports protocols lazily)
LEARNING_RATE = 0.03  # train's default --lr (SGD)
REPRESENTATION_DIM = 128  # train's default --representation-dim (MethodConfig's)
NETWORK_SECONDS = 60.0  # the default --wait and --deadline of a deployment
EXIT_FAILED = 1  # sound, but not doable here: the system refused a file operation, a peer is gone
REFUSALS = frozenset(  # the errnos of such a refusal
    {
        errno.EACCES,
        errno.EPERM,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.ENAMETOOLONG,
        errno.EIO,
    }
)
ID_COLUMN = "id"
LABEL_COLUMN = "label"
"""The default id and label columns (``secure_vfl.data.party_files``'s, spelled out so that
building the parser does not import pandas)."""

METHOD_NAMES = (
    "combinatorial",
    "ensemble",
    "false-vfl-1",
    "false-vfl-2",
    "laser",
    "local",
    "plugvfl",
    "standard",
)
"""The names in ``secure_vfl.methods.METHODS``, spelled out so that building the parser does not
import torch (a test keeps the two equal)."""

IMPUTER_NAMES = ("dae", "fed-dae", "fed-mean", "fedhf", "knn", "mean", "mice")
"""The names in ``secure_vfl.methods.imputation.IMPUTERS`` (a test keeps the two equal)."""

REVOCATION_REASON_NAMES = (
    "key-compromise",
    "affiliation-changed",
    "superseded",
    "cessation-of-operation",
    "privilege-withdrawn",
)
"""The names in ``secure_vfl.federation.certificates.REVOCATION_REASONS``, spelled out so that
building the parser does not import cryptography (a test keeps the two equal)."""


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default after its help, unless the help already says it or there is
    none to show (an off switch, a flag whose default depends on other flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or default == []
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits with status 2, and shows every
    option's default in its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._words = list(sys.argv[1:] if args is None else args)  # what error() may quote
        return super().parse_known_args(args, namespace)

    def options(self) -> dict[str, str]:
        """Each of its flags' longest spelling, by the name it is stored under (``lr`` ->
        ``--lr``)."""
        return {
            action.dest: max(action.option_strings, key=len)
            for action in self._actions
            if action.option_strings
        }

    def error(self, message: str) -> NoReturn:
        flag = message.removeprefix("argument ").removesuffix(": expected one argument")
        words: list[str] = getattr(self, "_words", [])
        if flag != message:  # argparse took a value such as -1:0.1 for a flag
            given = (  # the flag as written (or abbreviated), followed by such a value
                (word, value)
                for word, value in itertools.pairwise(words)
                if word.startswith("--") and flag.startswith(word) and re.match(r"-[0-9.]", value)
            )
            word, value = next(given, ("", ""))
            if word:
                message += f": found {value}, taken for a flag; write {word}={value}"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_printable(message)}\n")


SECURE_AGGREGATORS = ["none", "masks", "paillier", "ckks"]
SETTING_FLAGS = {
    "train_missing": "--missing-train or --p-miss-train",
    "test_missing": "--missing-test or --p-miss-test",
    "adjacency": "--dp-adjacency",
    "party_files": "--party-file",
    "party_names": "--party-name",
}
"""The flags that set a run's settings stored under other names than theirs (the rest are
found by the name the flag's value is stored under: ``lr`` -> ``--lr``)."""
DP_FLAGS = {"embedding": "--dp-embeddings", "gradient": "--dp-gradients", "dp-sgd": "--dp-sgd"}


def _number(
    kind: Callable[[str], Any], what: str, check: Callable[[Any], bool]
) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
        if (isinstance(value, float) and not math.isfinite(value)) or not check(value):
            raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}")
        return value

    return parse


positive_int = _number(plain_integer, "a positive integer", lambda v: v >= 1)
non_negative_int = _number(plain_integer, "a non-negative integer", lambda v: v >= 0)
SEED_LIMIT = 2**32  # checks.SEED_LIMIT (spelt out: this module imports no numpy on start)
seed = _number(plain_integer, "an integer seed in [0, 2**32)", lambda v: 0 <= v < SEED_LIMIT)
probability = _number(plain_number, "a probability in [0, 1)", lambda v: 0 <= v < 1)
positive_float = _number(plain_number, "a positive finite number", lambda v: v > 0)
non_negative_float = _number(plain_number, "a non-negative finite number", lambda v: v >= 0)
parties_count = _number(
    plain_integer, "an integer number of parties in [2, 10]", lambda v: 2 <= v <= 10
)
clients_count = _number(
    plain_integer, "an integer number of clients in [2, 64]", lambda v: 2 <= v <= 64
)
share = _number(plain_number, "a share in (0, 1]", lambda v: 0 < v <= 1)
open_probability = _number(plain_number, "a probability in (0, 1)", lambda v: 0 < v < 1)
MAX_NETWORK_SECONDS = 1e6  # 11.6 days; the system's longest timeout is about 9.2e9 s
network_seconds = _number(
    plain_number,
    f"a positive number of seconds, at most {MAX_NETWORK_SECONDS:.0f}",
    lambda v: 0 < v <= MAX_NETWORK_SECONDS,
)


def round_range(text: str) -> tuple[int, int]:
    """``N`` or ``A-B`` (rounds A to B, both included; ASCII digits only) as (first, last)."""
    import re

    found = re.fullmatch(r"([0-9]{1,18})(?:-([0-9]{1,18}))?", text)
    bounds = (int(found[1]), int(found[2] or found[1])) if found else (-1, -1)
    if min(bounds) < 0 or bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(
            f"expected a round N or rounds A-B (integers, 0 <= A <= B), found {text!r}"
        )
    return bounds


def noise_spec(text: str) -> tuple[float, float]:
    from protocols.dp import parse_noise

    try:
        return parse_noise(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def statistics_noise_spec(text: str) -> tuple[float, float]:
    sigma, clip = noise_spec(text)
    if sigma == 0:
        raise argparse.ArgumentTypeError(
            f"SIGMA must be > 0 for a private release (without noise, drop --dp-statistics). "
            f"Found {text!r}."
        )
    return sigma, clip


def _attack_options(pairs: Sequence[tuple[str, float | str]]) -> dict[str, float | str]:
    """The ``--attack-option`` pairs as keyword parameters; a key given twice is refused (the
    last would silently win)."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ConfigError(
            f"each --attack-option KEY once expected. Found {', '.join(repeated)} repeated."
        )
    return dict(pairs)


def attack_option(text: str) -> tuple[str, float | str]:
    """``KEY=VALUE`` of ``--attack-option``: a parameter name and its value, a number where it
    reads as one (an int if written as one), else the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier() or not value:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. gamma=2. Found {text!r}.")
    digits = value.removeprefix("-")
    if digits.isascii() and digits.isdigit():  # isdigit alone takes '²', which int refuses
        return key, int(value)
    try:
        return key, plain_number(value)
    except ValueError:
        return key, value


def path_arg(text: str) -> Path:
    """A path; an empty one is refused (``Path("")`` is the current directory, where a run would
    spill its files)."""
    if not text:
        raise argparse.ArgumentTypeError(
            "expected a path, found an empty string (write . for the current directory)"
        )
    return Path(text)


def run_directory(text: str) -> Path:
    """A run's output directory: a path whose name is UTF-8, as the results store and the
    reports record it as text (a name of other bytes failed after the run, unrecorded)."""
    path = path_arg(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        import os

        raise argparse.ArgumentTypeError(
            f"expected a path in UTF-8 (the results store records it), found {os.fsencode(text)!r}"
        ) from None
    return path


def command_line(default: str) -> str:
    """The command this process runs, as a report records it: ``default`` when it was called
    from Python; an argument that is not UTF-8 shown with its bytes escaped."""
    import os

    if not sys.argv[1:]:
        return default
    shown = [os.fsencode(arg).decode("utf-8", "backslashreplace") for arg in sys.argv[1:]]
    return "secure-vfl " + " ".join(shown)


def column_name(text: str) -> str:
    """A column's name: not empty, nor only spaces (an empty one was taken as the default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a column name, found {text!r}")
    return text


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"expected an existing file, found {text!r}")
    return path


def file_path(text: str) -> Path:
    """A path to write one file at; a path that ends with a separator names a directory (which
    ``Path`` would drop, writing a file named as the directory)."""
    import os

    if text.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        raise argparse.ArgumentTypeError(
            f"expected a file path, found {text!r}, which ends with a separator (a directory)"
        )
    return path_arg(text)


def mechanism(text: str) -> str:
    from secure_vfl.data.missingness import parse_mechanism

    try:
        return parse_mechanism(text).label
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _insecure_noise_flag(group: Any) -> None:
    group.add_argument(
        "--insecure-reproducible-noise",
        action="store_true",
        help="INSECURE, for tests only: draw DP noise and the Poisson sample from --seed, so "
        "anyone who knows the seed can remove the noise (default: secure, OS-keyed AES-128-CTR)",
    )


def _column_flags(
    parser: argparse.ArgumentParser,
    *,
    label_help: str,
    id_default: str | None,
    label_default: str = LABEL_COLUMN,
    own_files: bool = False,
) -> None:
    """``--id-column`` and ``--label-column``: where the ids and the labels are. ``own_files``:
    they apply only to the user's own files, so each is None unless given (a run on a registered
    dataset refuses either, even spelt as its default) and the defaults are the help's."""
    parser.add_argument(
        "--id-column",
        type=column_name,
        default=None if own_files else id_default,
        metavar="NAME",
        help="the column holding the ids in every file; ids are compared as the text in the "
        "files (`0304` is not `304`)"
        + (f" (default: {id_default})" if id_default else " (default: the model's own)"),
    )
    parser.add_argument(
        "--label-column",
        type=column_name,
        default=None if own_files else label_default,
        metavar="NAME",
        help=f"{label_help} (default: {label_default})",
    )


def _own_file_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the user's own files: columns, party names, the missing-cell policy."""
    _column_flags(
        parser,
        label_help="the label file's column holding the labels",
        id_default=ID_COLUMN,
        own_files=True,
    )
    parser.add_argument(
        "--party-name",
        action="append",
        metavar="NAME",
        help="a party's name, one per --party-file in the same order (default: each file's "
        "stem in lower-case letters, digits and hyphens)",
    )
    parser.add_argument(
        "--missing-cells",
        choices=["mean-indicator", "refuse"],
        help="empty cells in party files: each party fills a cell with its training mean of the "
        "column and adds a 0/1 indicator column per column with an empty training cell "
        "(mean-indicator, the default), or an empty cell is an error (refuse)",
    )


def _training_flags(
    parser: argparse.ArgumentParser,
    *,
    out: str = "runs/METHOD-DATASET-sSEED",
    writes: str = "DIR/result.json, DIR/model/ and a killed run's checkpoints",
    capture: bool = True,
    psi: bool = True,
) -> Any:
    """The data, method, privacy and output flags of a training run (``train``, ``attack``,
    ``sweep``): ``out`` the default --out, ``writes`` what --overwrite replaces, ``capture``
    whether --capture is offered, ``psi`` whether --align offers PSI (only train aligns by
    it). Returns the group of data sources (one of them is required)."""
    parser.add_argument(
        "--method",
        required=True,
        choices=METHOD_NAMES,
        help="the VFL method: %(choices)s",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", help="a registered dataset (see `secure-vfl datasets`)")
    source.add_argument(
        "--party-file",
        type=existing_file,
        action="append",
        metavar="PATH",
        help="one CSV/Parquet file per party: the id column (--id-column) and that party's "
        "features",
    )
    parser.add_argument(
        "--label-file",
        type=existing_file,
        metavar="PATH",
        help="CSV/Parquet with the id and label columns (required with --party-file)",
    )
    _own_file_flags(parser)
    held_out = parser.add_mutually_exclusive_group()
    held_out.add_argument(
        "--test-file",
        type=existing_file,
        metavar="PATH",
        help="a label file (id and label columns) of held-out ids to evaluate on; their "
        "features come from the same party files, and every id of --label-file is trained on "
        "(default: none, see --test-fraction)",
    )
    held_out.add_argument(
        "--test-fraction",
        type=open_probability,
        metavar="F",
        help="with --party-file: evaluate on a stratified, seeded share F of the label file's "
        "rows (default 0.2 when neither this nor --test-file is given)",
    )
    other = " or PSI over X25519" if psi else ", the only one here (PSI is train's)"
    parser.add_argument(
        "--align",
        choices=["join", "psi"] if psi else ["join"],
        default="join",
        help=f"how party files are aligned by id: plain join (insecure){other}",
    )
    parser.add_argument(
        "--parties",
        type=parties_count,
        metavar="K",
        help="how many parties a --dataset is split among (default: 4): of a table's D "
        "columns each gets D // K in turn and the last D mod K go to none, as in the papers "
        "(train's result.json names them in left_out_columns; an image's patch grid leaves "
        "out its remainder pixels too); with --party-file it is the number of files, and a "
        "different K is refused",
    )
    missing_train = parser.add_mutually_exclusive_group()
    missing_train.add_argument(
        "--p-miss-train",
        type=probability,
        metavar="P",
        help="MCAR probability that a block is missing in training (default: 0)",
    )
    missing_train.add_argument(
        "--missing-train",
        type=mechanism,
        metavar="MECH",
        help="training missingness mechanism: mcar:P | mcar:P1,..,PK | beta | dirichlet:A | "
        "mar1 | mar2 | mnar:P (default: mcar:0, or --p-miss-train)",
    )
    parser.add_argument(
        "--p-miss-test",
        type=probability,
        action="append",
        metavar="P",
        help="MCAR test probability (repeatable; default 0 and 0.5)",
    )
    parser.add_argument(
        "--missing-test",
        type=mechanism,
        action="append",
        metavar="MECH",
        help="a test missingness mechanism, as --missing-train (repeatable; default: the "
        "--p-miss-test ones)",
    )
    parser.add_argument(
        "--heads",
        choices=["all", "active"],
        default=None,
        help="a head at every party (laser's default, the LASER paper's setting; what local, "
        "ensemble and combinatorial always have), or only at the label party (laser's "
        "single-label-party threat model; what standard, plugvfl and FALSE-VFL always have)",
    )
    parser.add_argument(
        "--batching",
        choices=["grouped", "mixed"],
        default="mixed",
        help="training batches of one observed set each (the LASER-VFL paper's) or mixed (LASER "
        "then samples a subset per sample); every method draws its batches so",
    )
    parser.add_argument(
        "--epochs", type=positive_int, default=20, metavar="N", help="training epochs"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=128, metavar="B", help="rows per step"
    )
    parser.add_argument(
        "--lr",
        type=positive_float,
        default=LEARNING_RATE,
        metavar="LR",
        help="SGD learning rate (FALSE-VFL keeps its own Adam rates)",
    )
    parser.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=0.0,
        metavar="W",
        help="L2 weight decay of every optimiser (SGD's, and FALSE-VFL's Adam: the FALSE-VFL "
        "paper uses 1e-4)",
    )
    parser.add_argument(
        "--max-update-norm",
        type=positive_float,
        default=None,
        metavar="NORM",
        help="every party clips the norm of its model's update to NORM before stepping (no "
        "privacy cost: it post-processes what it received); keeps noisy gradients "
        "(--dp-gradients) from blowing up a bottom model (default: no clipping)",
    )
    parser.add_argument(
        "--representation-dim",
        type=positive_int,
        default=REPRESENTATION_DIM,
        metavar="D",
        help="width of every bottom model's output",
    )
    parser.add_argument(
        "--top-model",
        choices=["linear", "none"],
        default="linear",
        help="mean-fusion methods: a linear head on the fused mean, or none (the fused mean is "
        "the logits; needs --representation-dim = the number of classes)",
    )
    latent = parser.add_argument_group("FALSE-VFL (--method false-vfl-1 / false-vfl-2)")
    latent.add_argument(
        "--kappa",
        type=positive_int,
        metavar="K",
        help="importance samples per row in the training bounds (default 10)",
    )
    latent.add_argument(
        "--inference-samples",
        type=positive_int,
        metavar="L",
        help="importance samples per row at prediction (default 50)",
    )
    parser.add_argument(
        "--labeled",
        type=positive_int,
        metavar="N",
        help="keep N training labels (a seeded random subset); the other rows are "
        "unlabelled (default: every label)",
    )
    parser.add_argument(
        "--aligned-labeled",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="keep N training samples of a registered dataset observed by every party, labelled "
        "first; the training missingness renders only the others missing (the FALSE-VFL "
        "paper's reserve: 100 tabular, 200 image; default 0)",
    )
    parser.add_argument(
        "--pretrain-epochs",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="SimSiam pretraining of every party's bottom model on its own rows (0: off)",
    )
    parser.add_argument(
        "--standard-incomplete",
        choices=["random", "zero"],
        default="random",
        help="what Standard VFL does on incomplete test samples",
    )
    parser.add_argument(
        "--secure-agg",
        choices=SECURE_AGGREGATORS,
        default="none",
        help="secure sums of representations (laser --heads active; false-vfl: the "
        "posterior terms, its likelihoods still cross in the clear): pairwise masks, Paillier "
        "or CKKS; the label party learns only sums over >= 2 other parties",
    )
    parser.add_argument(
        "--release",
        choices=["drop", "dp"],
        default="drop",
        help="under --secure-agg, what to do with a sample's subset whose only party besides "
        "the label party is one other, which no sum hides: drop it (default) or have that party "
        "send the row clipped and noised, a DP release it prices (--release-noise or "
        "--target-epsilon)",
    )
    privacy = parser.add_argument_group("differential privacy (protocols.dp, Opacus accountant)")
    privacy.add_argument(
        "--dp-embeddings",
        type=noise_spec,
        metavar="SIGMA:CLIP",
        help="clip + Gaussian noise on every representation (protects features; default: off)",
    )
    privacy.add_argument(
        "--dp-gradients",
        type=noise_spec,
        metavar="SIGMA:CLIP",
        help="clip + Gaussian noise on every gradient sent back (protects labels; default: off)",
    )
    privacy.add_argument(
        "--dp-sgd",
        type=noise_spec,
        metavar="SIGMA:CLIP",
        help="DP-SGD (Opacus) of every data party's bottom model (default: off)",
    )
    privacy.add_argument(
        "--release-noise",
        type=noise_spec,
        metavar="SIGMA:CLIP",
        help="the noise of --release dp: rows clipped to CLIP, Gaussian noise SIGMA x CLIP "
        "(default: none; with --target-epsilon alone, CLIP 1 and SIGMA calibrated)",
    )
    privacy.add_argument(
        "--target-epsilon",
        type=positive_float,
        metavar="E",
        help="calibrate SIGMA so that no party spends more than E (default: SIGMA as given)",
    )
    privacy.add_argument(
        "--delta",
        type=open_probability,
        metavar="D",
        help="the delta of every (epsilon, delta) reported, well below 1/n for n training "
        f"records (default: {DEFAULT_DELTA:g})",
    )
    parser.add_argument(
        "--seed",
        type=seed,
        default=0,
        metavar="S",
        help="seeds the split, the missingness and the models (DP noise comes from a secure "
        "source unless --insecure-reproducible-noise)",
    )
    privacy.add_argument(
        "--dp-adjacency",
        choices=["replace-one", "add-remove"],
        help="neighbouring datasets of the guarantees against the receivers of messages: "
        "replace one record (its features and, at the label party, its label; the default) "
        "or add/remove one record",
    )
    _insecure_noise_flag(privacy)
    parser.add_argument(
        "--out",
        type=run_directory,
        metavar="DIR",
        help=f"output directory (default {out})",
    )
    parser.add_argument(
        "--store",
        type=path_arg,
        metavar="PATH",
        help="SQLite results store (default: results.sqlite beside DIR)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace {writes}",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    if capture:
        _capture_option(parser)
    return source


def _checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpoints and resume")
    group.add_argument(
        "--checkpoint-every",
        type=positive_int,
        metavar="N",
        help="every party writes its own checkpoint every N training steps (default: none)",
    )
    group.add_argument(
        "--checkpoint-dir",
        type=path_arg,
        metavar="DIR",
        help="where the checkpoints go, one directory per party (default: --out's checkpoints/)",
    )
    group.add_argument(
        "--resume",
        type=path_arg,
        metavar="DIR",
        help="continue a killed run from its latest complete checkpoint in DIR (its --out, "
        "which is then also this run's unless --out is given, or its checkpoint directory); the "
        "other flags must be the killed run's own (default: none, a fresh run)",
    )


def build_parser() -> argparse.ArgumentParser:
    from secure_vfl.runs import package_version

    parser = _Parser(
        prog="secure-vfl",
        description="Privacy-hardened vertical federated learning: train, attack, impute and "
        "deploy across parties (exit 0 done, 1 refused by the system or a party gone, 2 a bad "
        "flag, value or file; README, Exit statuses).",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {package_version()}",
        help="print the installed version and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = commands.add_parser("train", help="train a VFL method and evaluate it")
    _deployment_flags(train, _training_flags(train))
    _checkpoint_flags(train)
    # A resume names the flag that set a setting it refuses (--lr for method_config.lr).
    train.set_defaults(flag_names={**train.options(), **SETTING_FLAGS})
    _party_command(commands)

    attack = commands.add_parser(
        "attack",
        help="train with an attacker in place, under defenses, and score attack and model",
        description="Train a federation in which one party plays an attack's role (with only "
        "its own view), under the given defenses; write the attack's metrics, the defended "
        "model's accuracy and VFLAIR's defense capability score (DCS) to DIR/result.json.",
    )
    chosen = attack.add_mutually_exclusive_group(required=True)
    chosen.add_argument(
        "--attack",
        metavar="NAME",
        help="direct-label-inference | norm-scoring | direction-scoring | "
        "passive-model-completion | active-model-completion | gradient-replacement-backdoor | "
        "feature-reconstruction | subset-differencing",
    )
    chosen.add_argument(
        "--suite",
        choices=["all"],
        help="every attack that applies to the task, undefended and under each --defense; "
        "writes DIR/suite.md with VFLAIR's T-DCS per attack kind and C-DCS per defense",
    )
    attack.add_argument(
        "--attack-option",
        action="append",
        type=attack_option,
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of the attack, e.g. target=1, gamma=2 or swap=target (repeatable; "
        "default: the attack's own defaults)",
    )
    attack.add_argument(
        "--attacker",
        metavar="PARTY",
        help="the party that attacks (default: the attack's own, party-1, a passive data "
        "party; party-0, the label party, for feature-reconstruction and subset-differencing)",
    )
    attack.add_argument(
        "--defense",
        action="append",
        default=[],
        metavar="SPEC",
        help="dp-gradients:SIGMA:CLIP | dp-embeddings:SIGMA:CLIP | dp-sgd:SIGMA:CLIP | "
        "secure-agg:BACKEND (the same mechanisms as train's flags) | "
        "gradient-sparsification:FRACTION | marvell:SCALE | norm-filter[:Z] (repeatable; "
        "default: none, the undefended run)",
    )
    attack.add_argument(
        "--control",
        action="store_true",
        help="the negative control: the attacker's signal is destroyed (it must sit at chance)",
    )
    attack.add_argument(
        "--cache",
        type=path_arg,
        metavar="DIR",
        help="where the undefended runs behind the DCS are kept (default: DIR/../.undefended)",
    )
    _training_flags(
        attack,
        out="runs/attack-NAME[-control]-METHOD-DATASET-sSEED[-DEFENSES], or "
        "runs/suite-METHOD-DATASET",
        writes="DIR/result.json (DIR/suite.json with --suite, and the suite's stored runs)",
        capture=False,
        psi=False,
    )

    sweep = commands.add_parser(
        "sweep",
        help="a privacy-utility sweep: one attack against a grid of defense settings",
        description="Run one attack against every setting of the defense templates (and "
        "undefended) at several seeds, as independent runs in parallel; write a table, the "
        "runs in the results store, and plots of main accuracy against epsilon and of the "
        "attack against main accuracy.",
    )
    sweep.add_argument("--attack", required=True, metavar="NAME", help="see `attack --help`")
    sweep.add_argument(
        "--attacker", metavar="PARTY", help="the party that attacks (default: the attack's own)"
    )
    sweep.add_argument(
        "--defense",
        action="append",
        default=[],
        metavar="TEMPLATE",
        help="a defense with placeholders, e.g. dp-gradients:SIGMA:0.01 (repeatable; default: "
        "none, only the undefended runs)",
    )
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME=V1,V2,..",
        help="the values of a placeholder, e.g. SIGMA=0,0.1,0.3,1,3 (repeatable; default: "
        "none, for templates without placeholders)",
    )
    sweep.add_argument(
        "--seeds",
        type=positive_int,
        default=3,
        metavar="N",
        help="runs per defense setting, seeds S..S+N-1",
    )
    sweep.add_argument(
        "--workers", type=positive_int, metavar="W", help="parallel runs (default: CPUs, <= 4)"
    )
    sweep.add_argument(
        "--executor",
        choices=["process", "ray"],
        default="process",
        help="worker processes on this machine, or Ray tasks (optional extra: secure-vfl[ray])",
    )
    _training_flags(
        sweep,
        out="runs/sweep-ATTACK-METHOD-DATASET",
        writes="DIR/sweep.json, its tables, plots and stored runs",
        capture=False,
        psi=False,
    )

    impute = commands.add_parser(
        "impute", help="federated imputation across clients with different feature schemas"
    )
    impute.add_argument(
        "--method", required=True, choices=IMPUTER_NAMES, help="the imputer: %(choices)s"
    )
    impute_source = impute.add_mutually_exclusive_group(required=True)
    impute_source.add_argument(
        "--dataset", help="an imputation dataset (see `secure-vfl datasets`)"
    )
    impute_source.add_argument(
        "--client-file",
        type=existing_file,
        action="append",
        metavar="PATH",
        help="one CSV/Parquet file per client: NaN = missing, absent column = unavailable",
    )
    _deployment_flags(impute, impute_source)
    _column_flags(
        impute,
        label_help="a column of the client files that is not a feature: kept out of the "
        "imputation and written back unchanged by --save-imputed",
        id_default=ID_COLUMN,
        own_files=True,
    )
    impute.add_argument(
        "--clients",
        type=clients_count,
        metavar="K",
        help="how many clients a --dataset is dealt to (default: 4); with --client-file it "
        "is the number of files, and a different K is refused",
    )
    impute.add_argument(
        "--availability",
        type=share,
        metavar="A",
        help="share of the features each client keeps, with --dataset (default: 0.6); "
        "client files have their own columns, so it is refused with --client-file",
    )
    impute.add_argument(
        "--rounds", type=positive_int, default=30, metavar="R", help="FedAvg rounds"
    )
    impute.add_argument(
        "--client-fraction",
        type=share,
        default=1.0,
        metavar="C",
        help="share of the clients sampled for each FedAvg round",
    )
    impute.add_argument(
        "--local-epochs",
        type=positive_int,
        default=2,
        metavar="E",
        help="epochs each client trains per round",
    )
    impute.add_argument(
        "--batch-size", type=positive_int, default=16, metavar="B", help="rows per local step"
    )
    impute.add_argument(
        "--lr", type=positive_float, default=1e-3, metavar="LR", help="Adam learning rate"
    )
    impute.add_argument(
        "--secure-agg",
        choices=SECURE_AGGREGATORS,
        default="none",
        help="how client sums (statistics, FedAvg updates) are formed: in the clear, or by "
        "pairwise masks, Paillier or CKKS (the server sees only sums)",
    )
    impute_privacy = impute.add_argument_group(
        "differential privacy of the graph statistics (protocols.dp_statistics)"
    )
    impute_privacy.add_argument(
        "--dp-statistics",
        type=statistics_noise_spec,
        metavar="SIGMA:CLIP",
        help="clip each row's contribution to L2 norm CLIP and add Gaussian noise of std "
        "SIGMA*CLIP to every statistics sum (shared among the clients under --secure-agg; "
        "default: off)",
    )
    impute_privacy.add_argument(
        "--target-epsilon",
        type=positive_float,
        metavar="E",
        help="calibrate SIGMA so that no client spends more than E on the statistics "
        "(default: SIGMA as given)",
    )
    impute_privacy.add_argument(
        "--feature-ranges",
        type=existing_file,
        metavar="FILE",
        help="declared per-feature ranges, CSV or Parquet (columns feature, lower, upper), "
        "that values are clipped to; default: the observed training ranges, which are not "
        "private",
    )
    impute_privacy.add_argument(
        "--delta",
        type=open_probability,
        metavar="D",
        help=f"the delta of every (epsilon, delta) reported (default: {DEFAULT_DELTA:g})",
    )
    _insecure_noise_flag(impute_privacy)
    impute.add_argument(
        "--seed",
        type=seed,
        default=0,
        metavar="S",
        help="seeds the client split, the hidden entries and the models (DP noise comes from a "
        "secure source unless --insecure-reproducible-noise)",
    )
    impute.add_argument(
        "--out",
        type=run_directory,
        metavar="DIR",
        help="output directory: result.json and, for a method that keeps a model, the "
        "saved imputer in model/, which `secure-vfl fill` uses (default "
        "runs/impute-METHOD-DATASET-sSEED)",
    )
    impute.add_argument(
        "--store",
        type=path_arg,
        metavar="PATH",
        help="SQLite results store (default: results.sqlite beside DIR)",
    )
    impute.add_argument(
        "--save-imputed",
        action="store_true",
        help="also write each client's imputed table to DIR/imputed/: its ids first (under "
        "the input's id column), its rows in the input's order, the label column unchanged, "
        "so it can feed `train`",
    )
    impute.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DIR/result.json and the saved imputer DIR/model/ (methods that keep "
        "one: `secure-vfl fill` uses it), and with --save-imputed the whole DIR/imputed/ folder",
    )
    impute.add_argument("--quiet", action="store_true", help="no progress bar")
    _capture_option(impute)

    datasets = commands.add_parser("datasets", help="list datasets, or install them")
    # Two subcommands, not a choice and a list: argparse left NAME after --all unread
    # ("install --all wine": unrecognized arguments).
    datasets_actions = datasets.add_subparsers(dest="action", metavar="{list,install}")
    datasets_actions.add_parser(
        "list", help="the datasets and whether each is installed (the default)"
    )
    install = datasets_actions.add_parser("install", help="install some datasets, or all")
    install.add_argument("names", nargs="*", metavar="NAME", help="the datasets to install")
    install.add_argument("--all", action="store_true", help="every dataset")

    psi = commands.add_parser(
        "psi", help="private set intersection of two id files (both roles in-process)"
    )
    psi.add_argument(
        "--mine", required=True, type=existing_file, help="CSV/Parquet: this side's ids"
    )
    psi.add_argument(
        "--theirs", required=True, type=existing_file, help="CSV/Parquet: the peer's ids"
    )
    psi.add_argument(
        "--id-column",
        type=column_name,
        default=ID_COLUMN,
        metavar="NAME",
        help="the column holding the ids in both files, compared as text (`0304` is not `304`)",
    )
    psi.add_argument(
        "--mode",
        choices=["intersection", "cardinality"],
        default="intersection",
        help="learn the common ids, or only how many there are",
    )
    psi.add_argument(
        "--out",
        type=file_path,
        metavar="FILE",
        help="write the intersecting ids here, one per line (default: only print the size)",
    )
    psi.add_argument("--overwrite", action="store_true", help="replace an existing --out FILE")
    psi.add_argument("--quiet", action="store_true", help="no progress bar")
    _capture_option(psi)

    predict = commands.add_parser(
        "predict",
        help="score new rows with a model saved by train",
        description="Load the federation saved by `train` (every party's own part, checked "
        "against the manifest's hashes), align the new rows of the given party files by id and "
        "predict from the blocks present: a party without a file, or without an id, is absent "
        "for that row. Writes id, the predicted label and one probability column per class.",
    )
    predict.add_argument(
        "--model",
        required=True,
        type=path_arg,
        metavar="RUN_DIR",
        help="a train run's --out directory (or its model/ directory, or that directory's "
        "manifest.json)",
    )
    predict.add_argument(
        "--party-file",
        action="append",
        type=party_file_spec,
        metavar="[PARTY=]PATH",
        help="a party's file of new rows: `id` and the columns it was trained on. PARTY is "
        "the stem of its training file (or party-K), by default this file's stem; a party "
        "without a file is absent for every row (repeatable; required without --federation; "
        "with it, at most one: the label party's own, default its `data` file)",
    )
    predict.add_argument(
        "--out",
        type=file_path,
        metavar="CSV",
        help="write the predictions here (default: print a summary)",
    )
    _column_flags(
        predict,
        label_help="the output's column of the predicted label",
        id_default=None,
        label_default="predicted",
    )
    predict.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    _deployment_flags(
        predict,
        predict,
        "a federation file (TOML): predict as its label party, every data party predicting "
        "with its own part of the model in its own process (`secure-vfl party serve --data "
        "NEW.csv`) (default: none, predict in this process from --party-file)",
    )
    predict.add_argument(
        "--align",
        choices=["join", "psi"],
        default="join",
        help="with --federation: `join` (each data party sends its ids; every id any party "
        "holds is predicted) or `psi` (DH-PSI with each data party, no id in the clear; the "
        "label party's own rows are predicted)",
    )
    predict.add_argument(
        "--secure-agg",
        choices=SECURE_AGGREGATORS,
        default="none",
        help="with --federation: how the representations of the new rows are summed: in the "
        "clear at the aggregation server, or sealed (pairwise masks, Paillier, CKKS) as in "
        "training",
    )
    _capture_option(predict)
    fill = commands.add_parser(
        "fill",
        help="fill the empty cells of new rows with an imputer saved by impute",
        description="Load the imputer saved by `impute` (a method that keeps a model: mean, "
        "fed-mean, dae, fed-dae, fedhf) and have each given client fill the empty cells of its "
        "file with its own part (checked against the manifest's hashes); no other party takes "
        "part. Each table is written in its file's own form: ids first, its rows in its order, "
        "every cell it had unchanged, the label column as it was.",
    )
    fill.add_argument(
        "--model",
        required=True,
        type=path_arg,
        metavar="RUN_DIR",
        help="an impute run's --out directory (or its model/ directory, or that directory's "
        "manifest.json)",
    )
    fill.add_argument(
        "--client-file",
        action="append",
        required=True,
        type=party_file_spec,
        metavar="[CLIENT=]PATH",
        help="a client's CSV/Parquet file of rows to fill: some of the feature columns it was "
        "trained with (an empty cell is filled; a column it lacks stays absent). CLIENT is the "
        "stem of its training file (or client-K of a dataset), by default this file's stem "
        "(repeatable)",
    )
    fill.add_argument(
        "--out",
        type=path_arg,
        default=Path("filled"),
        metavar="DIR",
        help="write each filled table to DIR/STEM.csv, STEM the file's stem (default: filled)",
    )
    fill.add_argument(
        "--id-column",
        type=column_name,
        metavar="NAME",
        help="the column holding the ids, written back unchanged (default: the one the imputer "
        "was trained with)",
    )
    fill.add_argument(
        "--label-column",
        type=column_name,
        metavar="NAME",
        help="a column of the files that is not a feature, written back unchanged (default: "
        "the one the imputer was trained with)",
    )
    fill.add_argument(
        "--overwrite", action="store_true", help="replace tables an earlier fill wrote in DIR"
    )
    runs = commands.add_parser(
        "runs",
        help="list the runs of a results store, compare run directories, or remove runs",
        description="Print a table of runs: method, secure-sum backend, DP mechanisms with "
        "their noise, the largest epsilon a party spent, accuracy per test missingness, time.",
    )
    runs_commands = runs.add_subparsers(dest="runs_command", required=True, parser_class=_Parser)
    runs_list = runs_commands.add_parser("list", help="every run in a results store")
    runs_list.add_argument(
        "--store",
        type=path_arg,
        default=Path("runs") / "results.sqlite",
        metavar="PATH",
        help="the SQLite results store (runs/results.sqlite: train's for runs under runs/)",
    )
    runs_remove = runs_commands.add_parser(
        "remove",
        help="take runs out of a results store (their files stay)",
        description="Delete the rows of the runs written into each DIR (a run, sweep or suite "
        "directory, which may be gone) from the results store, all or none; the directories' "
        "files are not touched.",
    )
    runs_remove.add_argument(
        "dirs", nargs="+", type=path_arg, metavar="DIR", help="run directories"
    )
    runs_remove.add_argument(
        "--store",
        type=path_arg,
        metavar="PATH",
        help="the SQLite results store (default: results.sqlite beside the directories, where "
        "their runs wrote it)",
    )
    runs_compare = runs_commands.add_parser(
        "compare", help="runs side by side, from their directories' result.json"
    )
    runs_compare.add_argument(
        "dirs",
        nargs="+",
        type=path_arg,
        metavar="DIR",
        help="run directories (train, attack or impute)",
    )
    capture = commands.add_parser(
        "capture",
        help="read a --capture file: every message, or who sent how much to whom",
        description="Read back a file that --capture wrote: what crossed the transport (the "
        "network's view; in a deployment, one party's). Tensors and arrays show as dtype and "
        "shape, never their values; every other field as it is, cut short (a loss, a tag, a "
        "deployment message's JSON body with ids and row numbers).",
    )
    capture_commands = capture.add_subparsers(
        dest="capture_command", required=True, parser_class=_Parser
    )
    capture_show = capture_commands.add_parser(
        "show",
        help="a line per message: round, batch, kind, sender -> receiver, bytes, fields",
    )
    capture_show.add_argument("file", type=existing_file, metavar="FILE", help="a capture file")
    capture_show.add_argument(
        "--kind",
        action="append",
        default=[],
        metavar="KIND",
        help="only messages of this kind (repeat for more; e.g. representation, sum, "
        "psi-request; default: every kind)",
    )
    capture_show.add_argument(
        "--party",
        metavar="NAME",
        help="only messages this party sent or received (default: every party's)",
    )
    capture_show.add_argument(
        "--rounds",
        type=round_range,
        metavar="N|A-B",
        help="only messages of round N, or of rounds A to B (default: every round); training "
        "steps count rounds from 0, and so do prediction passes and a deployment's set-up "
        "messages, each their own",
    )
    capture_summary = capture_commands.add_parser(
        "summary",
        help="messages and bytes by sender, receiver and kind, and per party",
    )
    capture_summary.add_argument("file", type=existing_file, metavar="FILE", help="a capture file")
    capture_summary.add_argument(
        "--rounds",
        type=round_range,
        metavar="N|A-B",
        help="only the messages of round N, or of rounds A to B (default: every round), as "
        "for show",
    )
    certs = commands.add_parser(
        "certs",
        help="certificates for mutual TLS between parties: make a set, check one, or revoke a "
        "party's",
    )
    certs_actions = certs.add_subparsers(dest="certs_action", required=True, parser_class=_Parser)
    init = certs_actions.add_parser(
        "init", help="a federation CA and a key and certificate per party (keys mode 0600)"
    )
    init.add_argument(
        "--out",
        required=True,
        type=path_arg,
        metavar="DIR",
        help="where the CA and parties' files go",
    )
    init.add_argument(
        "--party",
        required=True,
        action="append",
        metavar="NAME",
        help="a party (repeat; not 'ca', the CA's file name)",
    )
    init.add_argument(
        "--san",
        action="append",
        metavar="HOST",
        help="a host name (ASCII; an internationalised name in its xn-- form) or IP address the "
        "parties are reached at (repeat; default localhost and 127.0.0.1)",
    )
    init.add_argument(
        "--days",
        type=positive_int,
        default=365,
        help="validity of the party certificates in days (default 365; at most until the CA "
        "expires)",
    )
    check = certs_actions.add_parser(
        "check",
        help="say what is wrong with a set of certificates",
        description="Check a federation's certificates and keys: exit 0 and one line per party "
        "when all is well, exit 1 and one line per problem otherwise.",
    )
    check.add_argument(
        "--dir", required=True, type=path_arg, metavar="DIR", help="a directory made by certs init"
    )
    check.add_argument(
        "--party", action="append", metavar="NAME", help="check this party (default: every one)"
    )
    revoke = certs_actions.add_parser(
        "revoke",
        help="revoke a party's certificate: add it to the CA's revocation list DIR/crl.pem",
        description="Revoke party NAME's current certificate (DIR/NAME.pem), or the certificate "
        "file --cert FILE, by its serial number: "
        "write DIR/crl.pem, signed with DIR/ca.key, keeping the revocations already there. Hand "
        "every party the new crl.pem beside its ca.pem (a running party reads it within "
        "seconds, no restart): its server refuses the "
        "revoked certificate's calls, and a party with it does not start. A revoked certificate's "
        "holder can still answer at the party's address (clients cannot see a server's "
        "revocation): move the address, or make a new CA.",
    )
    revoke.add_argument(
        "--dir", required=True, type=path_arg, metavar="DIR", help="a directory made by certs init"
    )
    revoked = revoke.add_mutually_exclusive_group(required=True)
    revoked.add_argument(
        "--party", metavar="NAME", help="the party whose certificate (DIR/NAME.pem) is revoked"
    )
    revoked.add_argument(
        "--cert",
        type=existing_file,
        metavar="FILE",
        help="a certificate file of the CA to revoke: one kept from before its party's was "
        "issued again (its key may be out there)",
    )
    revoke.add_argument(
        "--reason",
        choices=REVOCATION_REASON_NAMES,
        help="why, recorded in the list (default: none recorded)",
    )
    return parser


def party_file_spec(text: str) -> tuple[str | None, Path]:
    """``[PARTY=]PATH`` of ``predict --party-file`` (and ``fill --client-file``): the party's
    name (None: not given) and an existing file. A name may hold ``=`` itself (a file stem
    does): the first ``=`` after which an existing file is named ends it."""
    if not Path(text).is_file():
        for at in (i for i, character in enumerate(text) if character == "="):
            if at and Path(text[at + 1 :]).is_file():
                return text[:at], existing_file(text[at + 1 :])
        name, sep, rest = text.partition("=")
        if sep and name:
            return name, existing_file(rest)  # refused, naming the path after the first `=`
    return None, existing_file(text)


def run_certs_command(args: argparse.Namespace) -> int:
    """`secure-vfl certs init|check|revoke`: make a federation's certificates, check a set (exit
    1 and one line per problem if anything is wrong), or revoke a party's certificate."""
    from protocols import tls

    if args.certs_action == "revoke":
        return _revoke(tls, args.dir, args.party, args.cert, args.reason)
    if args.certs_action == "init":
        hosts = tuple(args.san) if args.san else tls.DEFAULT_HOSTS
        with run_warnings() as noted:
            written = tls.make_federation(args.out, args.party, hosts=hosts, days=args.days)
        print(f"wrote {len(written)} files to {args.out}: {', '.join(p.name for p in written)}")
        print(f"hosts in every certificate: {', '.join(hosts)}; keys are mode 0600")
        _print_warnings(noted)
        return 0
    problems = tls.check_federation(args.dir, args.party)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    parties = args.party or tls.federation_parties(args.dir)
    for name in parties:
        expiry = tls.certificate_expiry(args.dir / f"{name}.pem")
        print(f"{name}: ok (valid until {expiry:%Y-%m-%d} UTC)")
    summary = tls.crl_summary(args.dir)
    if summary is not None:
        print(summary)
    return 0


def _is_current(directory: Path, name: str, serial: int) -> bool:
    """Whether party ``name``'s certificate in ``directory`` has the serial number ``serial``."""
    from secure_vfl.federation.certificates import UNREADABLE_PEM, parse_certificate

    try:
        return parse_certificate((directory / f"{name}.pem").read_bytes()).serial_number == serial
    except (OSError, *UNREADABLE_PEM):
        return False


def _revoke(
    tls: Any, directory: Path, name: str | None, certificate: Path | None, reason: str | None
) -> int:
    """`certs revoke`: revoke ``name``'s certificate (or the file ``certificate``) and say what
    to do next."""
    done = tls.revoke(directory, name, certificate=certificate, reason=reason)
    name = done.party
    if done.already:
        print(
            f"{name}'s certificate (serial {done.serial:x}) was {done.revoked} already; "
            f"{done.crl} is unchanged ({done.count} revoked)."
        )
        return 0
    print(
        f"{name}'s certificate (serial {done.serial:x}) {done.revoked}: {done.crl} now lists "
        f"{done.count} revoked certificate(s)."
    )
    print(
        f"Hand every party the new {done.crl.name}, beside its ca.pem (a running party reads "
        "it again within seconds, no restart): its server then refuses the calls made with this "
        f"certificate. Whoever holds its key can still answer at {name}'s address (clients "
        "cannot see a server's revocation): move it in the federation file, or make a new CA."
        + (
            ""
            if certificate is not None and not _is_current(directory, name, done.serial)
            else f" To admit {name} again, remove {directory / (name + '.pem')} and "
            f"{directory / (name + '.key')}, then `secure-vfl certs init --out {directory} "
            f"--party {name}`."
        )
    )
    return 0


def _capture_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--capture",
        type=path_arg,
        metavar="FILE",
        help="append every message that crosses the transport to FILE, one record each: a "
        "4-byte big-endian length, then the encoded message (what the network sees; in a "
        "deployment, what this party sends and receives; default: off)",
    )


_RUN_WRITES_WHOLE = ("model", "checkpoints", "imputed")
"""The folders of a run's ``--out`` that it writes whole (replacing whatever is in them)."""
_RUN_FILE_SUFFIXES = (".json", ".md", ".png")
"""The kinds of file a run writes at the top of its ``--out`` (result.json, plots, reports)."""


def _model_directory(model: Path) -> Path:
    """The folder of the saved model ``--model`` names: a run's folder (its ``model/``), the
    model's folder, or its manifest (the folder it is in)."""
    from secure_vfl.saved_model import MODEL_DIR

    if model.is_file():
        return model.parent
    return model / MODEL_DIR if (model / MODEL_DIR).is_dir() else model


def _refuse_captured_over(path: Path, args: argparse.Namespace, out: Path | None) -> None:
    """ConfigError for a capture where the command writes (``out``'s result.json, plots or
    reports, or anything in a folder it writes whole) or inside the saved model ``--model``
    names (its manifest lists every file: one more makes it refuse to load). A capture beside
    a run's outputs, not among them, is taken."""
    where = path.resolve()
    if out is not None and where.is_relative_to(out.resolve()):
        inside = where.relative_to(out.resolve()).parts
        top_file = len(inside) == 1 and where.suffix.lower() in _RUN_FILE_SUFFIXES
        if top_file or (len(inside) > 1 and inside[0] in _RUN_WRITES_WHOLE):
            raise ConfigError(
                f"--capture {path} is among what this command writes in --out {out} (its "
                f"{'files' if top_file else inside[0] + '/ folder'}), where it would be "
                "replaced; expected a path outside them (e.g. beside them, in --out)."
            )
    model = getattr(args, "model", None)
    if isinstance(model, Path) and where.is_relative_to(_model_directory(model).resolve()):
        raise ConfigError(
            f"--capture {path} is inside the model's folder {_model_directory(model)}, whose "
            "manifest lists every file (one more makes it refuse to load); expected a path "
            "outside it."
        )


@contextmanager
def _capture(
    path: Path | None, args: argparse.Namespace, *, out: Path | None = None
) -> Iterator[BinaryIO | None]:
    """The open capture file of ``--capture`` (appended to), or None. Refused when it is
    another path of the command (``args``: an input file, ``--out``, the store), which one
    would overwrite the other, or among what the run writes in ``out`` (its output folder,
    given or by default) or in the saved model it reads (:func:`_refuse_captured_over`); a
    file it made and nothing was written to (a run refused before any message) is removed
    (:func:`_close_capture`). A symbolic link is followed: to a file not there yet, that file is
    made (only in a folder that is there) and removed as one this command made."""
    if path is None:
        yield None
        return
    for flag, other in _path_arguments(args):  # first: an --out is a folder by now
        if other.resolve() == path.resolve():
            raise ConfigError(
                f"--capture {path} is also this command's {flag}; expected a file of its own "
                "(one would overwrite the other)."
            )
    _refuse_captured_over(path, args, out)
    if path.is_dir():
        raise ConfigError(f"--capture expects a file path. Found the directory {path}.")
    if path.is_symlink() and not path.exists():  # opened through the link, its file made here
        try:  # would not count as made by this command, and stayed, empty, after a refusal
            path = writable_file(path)
        except OutputError as error:
            raise OutputError(f"--capture {error}") from None
    make_parent(path)
    try:
        handle, made = _open_capture(path)
    except OSError as error:
        raise OutputError(
            f"--capture {path} cannot be opened: {error.strerror or error}; nothing was run."
        ) from None
    try:
        if path.is_file() and path.stat().st_size > 0:
            _cut_torn_tail(path, handle)
        yield handle
    except BaseException:
        with suppress(OSError):  # what a refused write left buffered fails again: said already
            _close_capture(path, handle, made=made)
        raise
    else:
        _close_capture(path, handle, made=made)  # each record was flushed as it came


def _open_capture(path: Path) -> tuple[BinaryIO, bool]:
    """``path`` opened to append to, and whether this command made the file: of commands
    started on one new path at once, exactly one did (the file is created exclusively)."""
    import os

    def exclusive(name: str, flags: int) -> int:
        return os.open(name, flags | os.O_EXCL, 0o666)

    try:
        return open(path, "ab", opener=exclusive), True
    except FileExistsError:
        return path.open("ab"), False


def _close_capture(path: Path, handle: BinaryIO, *, made: bool) -> None:
    """Close the capture ``handle`` on ``path``, removing the file first if this command made
    it (``made``) and no record was written to it (a run refused before any message): under
    the capture's lock, and only the file it made, still at ``path``. Another command may hold
    it open still; its next record makes the file anew (:func:`~secure_vfl.federation.channel.
    append_record`)."""
    import os

    from secure_vfl.federation.channel import capture_lock

    if made:
        with suppress(OSError), capture_lock(handle):  # else the empty file stays
            held = os.fstat(handle.fileno())
            if held.st_size == 0 and os.path.samestat(held, path.stat()):
                path.unlink()
    handle.close()


def _cut_torn_tail(path: Path, handle: BinaryIO) -> None:
    """Before a capture is appended to (``handle``, open on it): refuse a file that is not one
    (ConfigError), and cut a torn last record that a killed command left (warned of): appended
    after it, the records that follow would be read as its remainder, and the file could not
    be read past it. Under the capture's lock, which every command takes to append a record: a
    record another command is writing is whole before this one reads. A file that grows while
    it is read is still another's capture in progress (a writer that takes no lock, of an
    earlier release): it is left as it is."""
    import os

    from secure_vfl.errors import ProtocolError
    from secure_vfl.federation.channel import capture_lock, whole_records

    try:
        with capture_lock(handle):
            size = path.stat().st_size
            try:
                whole = whole_records(path)
            except ProtocolError as error:
                raise ConfigError(
                    f"--capture {error}; expected a capture to append to, or a new path."
                ) from None
            if whole < size and path.stat().st_size == size:
                os.ftruncate(handle.fileno(), whole)
                _print_warnings(
                    [
                        f"--capture {path} ended in a torn record (a command stopped while "
                        f"writing it): its last {size - whole} bytes were cut before this "
                        "run's records."
                    ]
                )
    except OSError as error:
        raise OutputError(
            f"--capture {path} cannot be opened: {error.strerror or error}; nothing was run."
        ) from None


def _path_arguments(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """Every path the command was given but ``--capture``, with its flag (a ``NAME=PATH``
    pair's path too)."""
    found = []
    for name, value in vars(args).items():
        if name == "capture":
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            item = item[-1] if isinstance(item, tuple) and item else item
            if isinstance(item, Path):
                found.append((f"--{name.replace('_', '-')}", item))
    return found


def _read_ids(path: Path, column: str) -> list[str]:
    """The ids of a PSI side: column ``column`` of the CSV or Parquet file ``path``, read as
    `train --align psi` reads a party file's (as text; an empty or repeated id is refused with
    the file, the id and its rows), and each of one line (the intersection is written one id a
    line)."""
    from secure_vfl.data.party_files import read_id_file

    ids: list[str] = read_id_file(path, id_column=column).tolist()
    # Any character str.splitlines() splits at (U+2028, \x85, \x1c, ... as well as \n, \r).
    broken = next((i for i, value in enumerate(ids) if value.splitlines() != [value]), None)
    if broken is not None:
        value = ids[broken]
        char = next(c for c in value if len(f"a{c}b".splitlines()) > 1)
        raise ConfigError(
            f"{path}: an id of one line expected, found a line break ({char!r}) in "
            f"{value[:40]!r} at data row {broken + 1}."
        )
    return ids


def run_psi_command(args: argparse.Namespace) -> int:
    """`secure-vfl psi`: DH-PSI of --mine against --theirs; --mine's side learns the result."""
    from tqdm import tqdm

    from protocols.psi import run_psi
    from secure_vfl.federation.channel import Channel, InProcessTransport
    from secure_vfl.io import atomic_write_text

    if args.mode == "cardinality" and args.out is not None:
        raise ConfigError("--out needs --mode intersection; cardinality mode reveals only a size.")
    if args.out is not None:
        _check_output_file(
            args.out,
            overwrite=args.overwrite,
            inputs=(args.mine, args.theirs),
            replaced="its ids would be replaced by the intersection",
        )
    with run_warnings() as noted:  # e.g. ids with spaces around them
        mine = _read_ids(args.mine, args.id_column)
        theirs = _read_ids(args.theirs, args.id_column)
    _print_warnings(noted)
    total = 2 * (len(mine) + len(theirs))  # each side's ids are masked by both sides
    bar = tqdm(
        total=total, desc="psi", unit="point", unit_scale=True, disable=_no_bar(args), leave=False
    )
    with bar, _capture(args.capture, args) as capture:
        channel = Channel(transport=InProcessTransport(capture=capture))
        result = run_psi(mine, theirs, mode=args.mode, channel=channel, progress=bar.update)
    print(f"intersection size: {result.size} (of {len(mine)} mine, {result.peer_size} theirs)")
    if result.indices is not None and args.out is not None:
        atomic_write_text(args.out, "".join(f"{mine[i]}\n" for i in result.indices))
        print(f"intersecting ids written to {args.out}")
    return 0


def _train_config(args: argparse.Namespace, *, secure_sums: bool = False) -> Any:
    """The training configuration of the flags (``secure_sums``: a run of secure sums even
    without --secure-agg, e.g. an attack's secure-agg defense)."""
    from secure_vfl.experiment import TrainConfig

    if args.party_file and args.label_file is None:
        raise ConfigError("--party-file needs --label-file PATH. Found no label file.")
    if args.label_file is not None and not args.party_file:
        raise ConfigError("--label-file goes with --party-file. Found a dataset instead.")
    own_file_flags = {
        "--party-name": bool(args.party_name),
        "--missing-cells": args.missing_cells is not None,
        "--id-column": args.id_column is not None,
        "--label-column": args.label_column is not None,
    }
    given = [flag for flag, used in own_file_flags.items() if used]
    if given and not args.party_file:
        raise ConfigError(
            f"{_flags_with_verb(given, 'applies', 'apply')} to --party-file (a registered "
            "dataset has its own columns). Found a dataset instead."
        )
    train_missing = args.missing_train or f"mcar:{args.p_miss_train or 0.0:g}"
    tests = [f"mcar:{p:g}" for p in args.p_miss_test or []] + list(args.missing_test or [])
    from secure_vfl.methods import EVERY_HEAD_METHODS, ONE_HEAD_METHODS, MethodConfig

    if args.heads == "all" and args.method in ONE_HEAD_METHODS:
        raise ConfigError(
            f"--heads all: {args.method} trains one head, the label party's. Expected --heads "
            "active or no --heads."
        )
    if args.heads == "active" and args.method in EVERY_HEAD_METHODS:
        raise ConfigError(
            f"--heads active: {args.method} trains a head at every party. Expected --heads all "
            "or no --heads."
        )
    if args.release == "dp" and args.method != "laser":  # else MethodConfig asked for --heads
        raise ConfigError(
            "--release dp releases the rows of LASER's subsets that a secure sum cannot hide; "
            f"expected --method laser --heads active. Found --method {args.method}."
        )
    method_config = MethodConfig(
        heads=args.heads or "all",
        batching=args.batching,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        representation_dim=args.representation_dim,
        top_model=args.top_model,
        standard_incomplete=args.standard_incomplete,
        secure_sums=secure_sums or args.secure_agg != "none",
        release=args.release,
        labeled=args.labeled,
        pretrain_epochs=args.pretrain_epochs,
        max_update_norm=args.max_update_norm,
    )
    false_vfl = None
    latent_flags = {"--kappa": args.kappa, "--inference-samples": args.inference_samples}
    if args.method.startswith("false-vfl"):
        from secure_vfl.methods.false_vfl import FalseVflConfig

        false_vfl = FalseVflConfig(
            kappa=args.kappa or 10, inference_samples=args.inference_samples or 50
        )
        if args.representation_dim != REPRESENTATION_DIM:  # it was recorded and did nothing
            raise ConfigError(
                f"--representation-dim applies to the split networks; {args.method}'s latent "
                "sizes are its own (FalseVflConfig's latent_dim and global_latent_dim). Found "
                f"--representation-dim {args.representation_dim}."
            )
    elif any(value is not None for value in latent_flags.values()):
        given = [flag for flag, value in latent_flags.items() if value is not None]
        raise ConfigError(
            f"{_flags_with_verb(given, 'applies', 'apply', joined=' and ')} to --method "
            f"false-vfl-1 or false-vfl-2. Found --method {args.method}."
        )
    if args.standard_incomplete != "random" and args.method != "standard":
        raise ConfigError(
            "--standard-incomplete applies to --method standard (how its top model treats a "
            f"sample some party lacks). Found --method {args.method}."
        )
    if args.lr != LEARNING_RATE and false_vfl is not None:
        raise ConfigError(
            f"--lr applies to the SGD of the other methods; {args.method} trains with its own "
            "Adam rates (FalseVflConfig). Found --lr with it."
        )
    return TrainConfig(
        false_vfl=false_vfl,
        method=args.method,
        dataset=args.dataset,
        party_files=tuple(args.party_file or ()),
        label_file=args.label_file,
        test_file=args.test_file,
        test_fraction=args.test_fraction,
        parties=_party_count(args),
        train_missing=train_missing,
        test_missing=tuple(tests) if tests else ("mcar:0", "mcar:0.5"),
        align=args.align,
        seed=args.seed,
        method_config=method_config,
        id_column=args.id_column or ID_COLUMN,
        label_column=args.label_column or LABEL_COLUMN,
        missing_cells=args.missing_cells or "mean-indicator",
        party_names=tuple(args.party_name or ()),
        aligned_labeled=args.aligned_labeled,
    )


def _party_count(args: argparse.Namespace) -> int:
    """K: ``--parties`` for a dataset (4 unless given); the number of files for own data, where
    a ``--parties`` that says otherwise is refused (a file forgotten or one too many)."""
    if not args.party_file:
        return int(args.parties) if args.parties is not None else 4
    given = len(args.party_file)
    if args.parties is not None and args.parties != given:
        files = (
            f"parties of {args.federation}"
            if getattr(args, "federation", None) is not None
            else "--party-file given (one party per file)"
        )
        raise ConfigError(
            f"--parties {args.parties} contradicts the {given} {files}; expected --parties "
            f"{given} or no --parties."
        )
    return given


_RUN_MARKERS = ("result.json", "sweep.json", "suite.json")
"""What a finished run, sweep or suite leaves in its folder: one kind per folder (the results
store keeps each folder's rows as one run's, sweep's or suite's)."""


def _check_output_dir(
    out: Path, marker: str, *, overwrite: bool, kind: str | None = None, lock: bool = False
) -> None:
    """Refuse, before any work, an output directory that cannot take ``out/marker``: a path
    that is not a directory this user may write in and cannot be made as one, a finished run
    without ``--overwrite``, or a folder that holds another kind of run (a sweep written over
    a training run would take its rows out of the results store; an attack's ``result.json``
    over a training run's would leave its model and plots beside it: ``kind``, the command's
    run, ``train``, ``attack`` or ``impute``). With ``lock`` (a run's own folder), take its
    lock first (:func:`_lock_out`): the checks then hold until the command ends."""
    check_directory("--out", out)
    if lock:
        _lock_out(out)
    if (out / marker).exists() and not overwrite:
        raise ConfigError(
            f"{out / marker} exists; expected a new --out directory (or --overwrite)."
        )
    found = _result_kind(out / marker) if kind is not None else None
    if found is not None and found != kind:
        raise ConfigError(
            f"{out} holds a {found} run ({out / marker}); --overwrite replaces a run of its own "
            f"kind. Expected a new --out directory for the {kind} run (or remove that one "
            "first)."
        )
    if marker in _RUN_MARKERS:
        other = next((m for m in _RUN_MARKERS if m != marker and (out / m).exists()), None)
        if other is not None:
            raise ConfigError(
                f"{out} holds another kind of run ({other}); expected a new --out directory "
                f"for the {marker.removesuffix('.json').replace('result', 'run')} (or remove "
                "that one first)."
            )
        for folder in out.resolve().parents:  # a run's folder is written, listed, removed whole
            held = _run_marker(folder)
            if held is not None:
                raise ConfigError(
                    f"--out {out} is inside the folder of another run, {folder} ({held}): "
                    "written there, it would be replaced, listed and removed with that run; "
                    "expected an --out outside it."
                )


def _run_marker(folder: Path) -> str | None:
    """Which of :data:`_RUN_MARKERS` shows ``folder`` to be a finished run, sweep or suite of
    this tool (its file read as one: another tool's ``result.json`` is not), or None."""
    for marker in _RUN_MARKERS:
        path = folder / marker
        if not path.is_file():
            continue
        if marker == "result.json":
            if _result_kind(path) is not None:
                return marker
            continue
        try:
            payload = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        keys = {"sweep.json": ("attack", "rows", "table"), "suite.json": ("runs",)}[marker]
        if isinstance(payload, dict) and all(key in payload for key in keys):
            return marker
    return None


def _result_kind(path: Path) -> str | None:
    """The kind of run whose ``result.json`` is at ``path`` (``train``, ``attack``, ``impute``);
    None where there is none or it does not read as one (it is replaced like any file)."""
    from secure_vfl.runs import result_kind

    try:
        payload = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return result_kind(payload)


def _check_output_file(
    path: Path,
    *,
    overwrite: bool,
    inputs: Sequence[Path],
    replaced: str,
) -> None:
    """Refuse, before any work, an output file that exists (without ``--overwrite``), is a
    directory, whose folder cannot be written or made, or that is one of the command's
    ``inputs`` (even with ``--overwrite``: ``replaced`` says what writing it would lose)."""
    if path.is_dir():
        raise ConfigError(f"--out {path} is a directory; expected a file path.")
    writable_file(path)  # a device or a pipe is refused: replacing it would not write to it
    where = path.resolve()
    for read in inputs:
        if where == Path(read).resolve():
            raise ConfigError(
                f"--out {path} is the input file {read}; expected another path ({replaced})."
            )
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists; expected a new --out file (or --overwrite).")
    check_directory(f"--out {path}: its folder", path.parent)


def _results_store(args: argparse.Namespace, out: Path) -> Any:
    """The results store of ``--store`` (default: results.sqlite beside ``out``), checked
    before any work: an existing file must be a results store this version can write."""
    from secure_vfl.store import ResultsStore

    store = ResultsStore(args.store or out.parent / "results.sqlite")
    store.check()
    return store


def _summary(result: Any, out: Path, payload: dict[str, Any]) -> str:
    from secure_vfl import runs

    labeled = result.config["method_config"]["labeled"]
    labeled_text = f", {labeled} labelled" if labeled is not None else ""
    if result.config.get("aligned_labeled"):
        labeled_text += f", {result.config['aligned_labeled']} kept aligned"
    if result.trained_on is not None:  # Standard VFL: only the samples every party holds
        ones = " labelled ones" if labeled is not None else ""
        labeled_text += f"; trained on the {result.trained_on}{ones} held by every party"
    lines = [
        f"{result.method} on {result.dataset} (train {result.config['train_missing']}, "
        f"{result.samples['train']} training samples{labeled_text}) in "
        f"{result.wall_time_s:.1f} s",
    ]
    table = [["test missingness", "accuracy %", "F1 x100"]]
    for name, values in result.metrics.items():
        table.append([name, f"{values['accuracy']:.2f}", f"{values['f1']:.2f}"])
    lines += runs.columns(table, right=(1, 2))  # a long missingness name widens its column
    if payload.get("classes"):
        mapping = ", ".join(f"{index} = {value}" for index, value in payload["classes"].items())
        lines.append(f"classes (index = label value): {mapping}")
    if payload.get("alignment") is not None:
        lines.extend(_alignment_lines(payload["alignment"]))
    if payload.get("columns"):
        lines.extend(_column_lines(payload["columns"]))
    if payload.get("left_out_columns"):
        lines.append(
            "left out of every block (columns mod parties, as in the papers): "
            + ", ".join(payload["left_out_columns"])
        )
    if payload.get("privacy") is not None:
        lines.extend(_privacy_lines(payload["privacy"]))
    lines.extend(_fault_lines(payload.get("faults", [])))
    checkpoints = payload.get("checkpoints") or {}
    if checkpoints.get("resumed_from_step") is not None:
        further = "" if checkpoints.get("every") else " (and wrote none: no --checkpoint-every)"
        lines.append(
            f"resumed from the checkpoints of step {checkpoints['resumed_from_step']} in "
            f"{checkpoints['directory']}{further}"
        )
    settings = payload["config"].get("privacy") or {}
    if settings.get("secure_agg", "none") != "none":
        lines.append(_release_line(settings, payload.get("privacy")))
    lines.append(f"result: {out / 'result.json'}")
    return "\n".join(lines)


def _fault_lines(faults: list[dict[str, Any]]) -> list[str]:
    """The summary's line on every fault of a deployed run: a party lost, or back."""
    lines = []
    for k, fault in enumerate(faults):
        when = f"at step {fault['step']} (epoch {fault['epoch']})"
        if fault.get("phase") == "evaluation":
            when = f"in the evaluation after step {fault['step']} (epoch {fault['epoch']})"
        if fault.get("phase") == "checkpoint":
            when = f"when asked for its checkpoint of step {fault['step']} (epoch {fault['epoch']})"
        if fault.get("phase") == "saving":
            lines.append(
                f"lost: {fault['party']} while the model was saved after step {fault['step']}; "
                "its part was not saved (the manifest lists it as lost)"
            )
            continue
        if fault["what"] == "rejoined":
            restored = fault.get("restored")
            start = f"from its checkpoint of step {restored}" if restored else "initial models"
            lines.append(
                f"rejoined: {fault['party']} {when}, set up anew ({start}); its block "
                "took part again from then on"
            )
            continue
        back = any(later["party"] == fault["party"] for later in faults[k + 1 :])
        until = "until it rejoined" if back else "from then on, in training and evaluation"
        if fault.get("phase") == "evaluation":
            until = "from then on"
        lines.append(f"lost: {fault['party']} {when}; its block was missing {until}")
    return lines


def _release_line(settings: dict[str, Any], privacy: dict[str, Any] | None) -> str:
    """The summary's line on what a secure sum could not hide: dropped, or DP-released."""
    if settings.get("release", "drop") == "drop" or privacy is None:
        return (
            "release drop: a sample's subset with one party besides the label party is never "
            "planned (such samples predict from the label party's block alone)"
        )
    entry = privacy["release"]
    rows = ", ".join(
        f"{name} {counts['train_rows']}"
        for name, counts in entry["exposed_releases"].items()
        if counts["train"]
    )
    return (
        f"release dp: rows no sum could hide sent clipped to {entry['clip']:g} with noise sigma "
        f"{entry['sigma']:.4g}, priced above (training rows released: {rows or 'none'})"
    )


def _alignment_lines(report: dict[str, Any]) -> list[str]:
    """The summary's alignment report: ids per file, the samples, the ids dropped and why."""
    label = report["label_file"]
    held = ", ".join(
        f"{name} {entry['ids']} ({entry['aligned']} aligned)"
        for name, entry in report["parties"].items()
    )
    dropped = report["dropped"]
    unlabelled = (
        f"{dropped['without_label']} party ids without a label, "
        f"{dropped['one_party_only_without_label']} of them at one party only"
        if dropped["without_label"] is not None
        else "party ids without a label: "
        + ", ".join(f"{n} {c}" for n, c in dropped["without_label_per_party"].items())
        + " (per party: PSI hides which are the same id)"
    )
    return [
        f"alignment: {label['ids']} labelled ids (label and test files); {held}",
        f"  {report['samples']} samples ({report['held_by_every_party']} held by every party); "
        f"dropped: {dropped['label_file_only']} labelled ids no party holds, {unlabelled}",
    ]


def _column_lines(columns: dict[str, dict[str, Any]]) -> list[str]:
    """The summary's column report: per party, what its preprocessing did to its columns."""
    lines = ["columns:"]
    for name, entry in columns.items():
        parts = [
            f"{counted(entry['columns'], 'column')} -> {counted(entry['inputs'], 'model input')}"
        ]
        if entry["encoded"]:
            encoded = ", ".join(f"{c} ({n} categories)" for c, n in entry["encoded"].items())
            parts.append(f"one-hot: {encoded}")
        indicators = entry["indicators"]
        if indicators:
            shown = ", ".join(indicators[:3])
            more = f" and {len(indicators) - 3} more" if len(indicators) > 3 else ""
            parts.append(
                f"missing cells filled with the training mean, indicators for {shown}{more}"
            )
        lines.append(f"  {name}: " + "; ".join(parts))
    return lines


def _privacy_lines(privacy: dict[str, Any]) -> list[str]:
    """The summary's privacy lines: each party's epsilon, its adjacency and sampling, its
    scope, and what no epsilon covers (the caveats of reproducible noise or observed ranges are
    run warnings, printed and kept in result.json with the others)."""
    spent = ", ".join(f"{p} {e:.2f}" for p, e in sorted(privacy["epsilon"].items()))
    sampling = privacy["sampling"]
    drawn = f", Poisson rate {sampling['rate']:.4g}" if sampling["kind"] == "poisson" else ""
    lines = [
        f"epsilon (delta {privacy['delta']:g}, {privacy['adjacency']}{drawn}; largest "
        f"guarantee per party, see result.json): {spent}"
    ]
    if privacy.get("scope"):
        lines.append(f"  note: {privacy['scope']}")
    unguarded = privacy.get("unguarded") or {}
    if unguarded:
        sent: dict[str, list[str]] = {}
        for party, kinds in unguarded.items():
            sent.setdefault(" and ".join(kinds), []).append(party)
        lines.append(
            "no DP guarantee (epsilon inf), sent without noise: "
            + "; ".join(f"the {what} of {', '.join(names)}" for what, names in sent.items())
        )
    unheard = [  # a deployed party lost mid-run: its releases died with its process
        name
        for name, whose in (privacy.get("accounted_by") or {}).items()
        if str(whose).startswith("none: it reported nothing")
    ]
    if unheard:
        lines.append(
            f"no epsilon for {', '.join(unheard)}: lost mid-run, it reported nothing (see "
            "faults); its releases before it was lost are not priced here"
        )
    return lines


def _impute_privacy_engine(args: argparse.Namespace) -> Any:
    """The privacy engine of ``impute``'s flags: the secure-sum backend and the statistics'
    DP with its accounting, chosen in one place (:class:`protocols.privacy.PrivacyEngine`)."""
    from protocols.privacy import PrivacyEngine, PrivacySpec

    if args.delta is not None and args.dp_statistics is None:
        raise ConfigError(
            "--delta sets the terms of DP guarantees; expected --dp-statistics SIGMA:CLIP with "
            "it. Found none."
        )
    return PrivacyEngine(
        PrivacySpec(
            secure_agg=args.secure_agg,
            dp_statistics=args.dp_statistics,
            feature_ranges=args.feature_ranges,
            target_epsilon=args.target_epsilon,
            delta=_delta(args),
            insecure_reproducible_noise=args.insecure_reproducible_noise,
            seed=args.seed,
        )
    )


def _privacy_spec(args: argparse.Namespace) -> Any:
    """The protection asked for by ``train``'s flags: alignment, secure sums, DP. ConfigError
    for --insecure-reproducible-noise with no DP mechanism in them nor among an attack's or
    a sweep's --defense specs (to which it reaches)."""
    from protocols.privacy import IDLE_REPRODUCIBLE_NOISE, PrivacySpec

    spec = PrivacySpec(
        align=args.align,
        secure_agg=args.secure_agg,
        dp_embeddings=args.dp_embeddings,
        dp_gradients=args.dp_gradients,
        dp_sgd=args.dp_sgd,
        target_epsilon=args.target_epsilon,
        delta=_delta(args),
        adjacency=args.dp_adjacency or "replace-one",
        insecure_reproducible_noise=args.insecure_reproducible_noise,
        seed=args.seed,
        release=args.release,
        release_noise=args.release_noise,
    )
    defended = any(text.startswith("dp-") for text in getattr(args, "defense", None) or ())
    if spec.insecure_reproducible_noise and not (spec.noise() or defended):
        raise ConfigError(IDLE_REPRODUCIBLE_NOISE)
    return spec


def _privacy_engine(args: argparse.Namespace) -> Any:
    """The privacy engine of ``train``'s flags: alignment, secure sums, DP and its accounting,
    chosen in one place (:class:`protocols.privacy.PrivacyEngine`)."""
    from protocols.privacy import PrivacyEngine

    spec = _privacy_spec(args)
    terms = _given(("--delta", args.delta), ("--dp-adjacency", args.dp_adjacency))
    if terms and not spec.noise():
        raise ConfigError(
            f"{' and '.join(terms)} set the terms of DP guarantees; expected a DP mechanism "
            "with them (--dp-embeddings, --dp-gradients, --dp-sgd or --release dp). Found none."
        )
    return PrivacyEngine(spec)


def _delta(args: argparse.Namespace) -> float:
    """``--delta``, or its default."""
    return float(args.delta) if args.delta is not None else DEFAULT_DELTA


def run_train(args: argparse.Namespace) -> int:
    if args.federation is not None:
        return run_train_deployed(args)
    _refuse_deployment_flags(args)
    import shutil

    from tqdm import tqdm

    from secure_vfl.checkpoints import CHECKPOINTS_DIR
    from secure_vfl.data.datasets import DATASETS
    from secure_vfl.experiment import prepare_data, run_training
    from secure_vfl.federation.channel import Channel, InProcessTransport
    from secure_vfl.io import atomic_write_json
    from secure_vfl.methods.base import in_process_parties
    from secure_vfl.models.simsiam import pretrain_progress
    from secure_vfl.plots import write_run_plots
    from secure_vfl.saved_model import MODEL_DIR, save_model

    engine = _privacy_engine(args)
    config = _train_config(args)
    engine.refuse(config)  # before any data
    if config.dataset is not None:
        spec = DATASETS.get(config.dataset)
        if not spec.is_installed():
            raise ConfigError(f"dataset {config.dataset!r} is not installed. {spec.install_hint()}")
    out = _run_out(
        args,
        _resumed_out(args) or Path("runs") / f"{config.method}-{config.data_name}-s{config.seed}",
    )
    if args.resume is not None and (out / "result.json").exists() and not args.overwrite:
        raise ConfigError(
            f"{out} holds a finished run ({out / 'result.json'}): nothing to resume. Expected "
            "--resume with the --out of a killed run."
        )
    _check_output_dir(out, "result.json", overwrite=args.overwrite, kind="train", lock=True)
    # a folder of the user's own there (no manifest) is not replaced unasked either
    _check_output_dir(out / MODEL_DIR, "", overwrite=args.overwrite)
    store = _results_store(args, out)
    checkpoints = _checkpoint_plan(args, config, out)  # a bad checkpoint: refused here
    channel = Channel()
    bar: Any = None
    trained: list[Any] = []  # the run's parties, each of which saves its own part

    pretraining = _PretrainingBars(args, config.method)  # bottom models pretrained first

    def on_start(total: int) -> None:
        nonlocal bar
        pretraining.close()
        bar = tqdm(total=total, desc=config.method, unit="step", disable=_no_bar(args), leave=False)

    def on_step(step: int, loss: float) -> None:
        bar.update(step - bar.n)  # a resumed run starts past step 0
        if step % 10 == 0 and not math.isnan(loss):  # NaN: an empty Poisson draw
            bar.set_postfix(loss=f"{loss:.3f}")

    parties = _file_party_names(config)  # result.parties' names, known before the run
    with _capture(args.capture, args, out=out) as capture, _printed_warnings(parties) as noted:
        # PSI's messages go to the capture too, but their bytes are not training traffic.
        alignment = Channel(transport=InProcessTransport(capture=capture))
        # PSI's points, both sides' of each data party's session (no total: sizes come later).
        psi = config.align == "psi"
        with tqdm(
            desc="psi",
            unit="point",
            unit_scale=True,
            disable=_no_bar(args) if psi else True,
            leave=False,
        ) as aligning:
            data = prepare_data(config, aligner=engine.aligner(alignment, progress=aligning.update))
        channel.transport = InProcessTransport(capture=capture)
        try:
            with pretrain_progress(pretraining):
                result = run_training(
                    config,
                    data=data,
                    channel=channel,
                    privacy=engine,
                    on_ready=lambda ready: trained.extend(in_process_parties(ready)),
                    on_start=on_start,
                    on_step=on_step,
                    checkpoints=checkpoints,
                )
        finally:
            pretraining.close()
            if bar is not None:
                bar.close()
    with _finishing():
        payload = result.to_json()
        payload["warnings"] = list(dict.fromkeys([*noted, *payload["warnings"]]))
        with _unfinished(out, "result.json"):
            plots = write_run_plots(payload, out)
            manifest = save_model(
                out / MODEL_DIR,
                trained,
                method=config.method,
                seed=config.seed,
                method_config=config.method_config,
                false_vfl=config.false_vfl,
                data=data,
                sources=data.party_names,
            )
            payload["model"] = {"directory": str(out / MODEL_DIR), "run_id": manifest.run_id}
            if checkpoints is not None:
                payload["checkpoints"] = _checkpoints_payload(checkpoints)
            atomic_write_json(out / "result.json", payload)
        if checkpoints is None and (out / CHECKPOINTS_DIR).is_dir():
            # --overwrite of a killed run without checkpoints of its own: the killed run's, which
            # no --resume can go on from beside a finished run, go with the run they belonged to
            shutil.rmtree(out / CHECKPOINTS_DIR)
        store.add(payload, kind="train", out_dir=out)
    print(_summary(result, out, payload))
    print(f"model: {out / MODEL_DIR} (secure-vfl predict --model {out} --party-file ...)")
    print("plots: " + ", ".join(str(path) for path in plots))
    _print_warnings(payload["warnings"], printed=noted)
    return 0


def _checkpoint_plan(
    args: argparse.Namespace,
    config: Any,
    out: Path,
    *,
    label_party: str = "party-0",
    check_parties: bool = True,
) -> Any:
    """The checkpoints ``train``'s flags ask for (None: none), and with ``--resume`` the
    checkpoint to go on from, found and checked (the configuration, and with
    ``check_parties`` every party's files: in a deployment each party checks its own) before
    any data is read."""
    from secure_vfl.checkpoints import (
        CHECKPOINTS_DIR,
        CheckpointPlan,
        find_resume_point,
    )

    if args.checkpoint_every is None and args.resume is None:
        if args.checkpoint_dir is not None:
            raise ConfigError(
                "--checkpoint-dir goes with --checkpoint-every N. Found no --checkpoint-every."
            )
        _refuse_stale_checkpoints(out / CHECKPOINTS_DIR, out, label_party, args.overwrite)
        return None
    if args.checkpoint_dir is not None:
        _check_checkpoint_dir(args.checkpoint_dir, make=bool(args.checkpoint_every))
    settings = _files_resolved(
        {**config.to_json(), "privacy": _privacy_settings(args)}, parties_here=check_parties
    )
    resume = None
    if args.resume is not None:
        if not Path(args.resume).is_dir():
            found = "a file" if Path(args.resume).exists() else "nothing there"
            raise ConfigError(
                f"--resume {args.resume}: the --out of a killed run (or its checkpoints "
                f"directory) expected; found {found}."
            )
        finished = Path(args.resume) / "result.json"
        if finished.exists() and not (Path(args.resume) / CHECKPOINTS_DIR).is_dir():
            raise ConfigError(
                f"--resume {args.resume}: it holds a finished run without checkpoints "
                f"({finished}): nothing to resume. Expected the --out of a killed run (one "
                "trained with --checkpoint-every N)."
            )
        resume = find_resume_point(
            args.resume,
            label_party=label_party,
            settings=settings,
            check_parties=check_parties,
            flag_names=getattr(args, "flag_names", None),
        )
    directory = args.checkpoint_dir or (
        resume.root if resume is not None else out / CHECKPOINTS_DIR
    )
    if directory.exists() and not directory.is_dir():
        where = (
            f"--checkpoint-dir {directory}"
            if args.checkpoint_dir is not None
            else f"{directory} (where the run's checkpoints go)"
        )
        raise ConfigError(f"{where}: a directory expected; found a file.")
    if args.checkpoint_every or resume is not None:  # a DP resume journals there too
        _lock_checkpoints(directory, out)
    if resume is None:  # a fresh run would replace a killed run's checkpoints
        _refuse_stale_checkpoints(directory, out, label_party, args.overwrite)
    else:  # so would a resumed one, writing into another run's --checkpoint-dir
        _refuse_another_runs_checkpoints(directory, resume, label_party, args.overwrite)
    return CheckpointPlan(
        directory=directory,
        every=args.checkpoint_every or 0,
        resume=resume,
        settings=settings,
        label_party=label_party,
    )


def _lock_checkpoints(directory: Path, out: Path) -> None:
    """Hold the lock of the checkpoint ``directory`` a run writes into (its checkpoints, or a
    resumed DP run's release journals) until the command ends, unless it lies inside ``out``
    (whose lock covers it): two runs resuming one killed run into two --out folders wrote into
    its checkpoints at once, each removing the other's older steps, and one failed
    ("party-1's checkpoint of step 8 expected; found none")."""
    from secure_vfl.io import lock_directory

    if directory.absolute().is_relative_to(out.absolute()):
        return
    release = lock_directory(directory, "--checkpoint-dir")
    held = HELD.get()
    if held is not None:
        held.append(release)


def _check_checkpoint_dir(directory: Path, *, make: bool) -> None:
    """Refuse, before any work, a ``--checkpoint-dir`` that cannot hold checkpoints
    (:func:`~secure_vfl.io.check_directory`; it failed at the first checkpoint, after training
    began), and with ``make`` (the run writes checkpoints) make it: the system may refuse what
    the permissions allow (``/proc/xyz``, to root). A failed command removes it again while it
    is empty (an output flag's path: :func:`_paths_to_make`)."""
    check_directory("--checkpoint-dir", directory)
    if make:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"--checkpoint-dir {directory}: a directory, or a path where one can be made, "
                f"expected; it cannot be made there ({error.strerror or error})."
            ) from None


def _files_resolved(settings: dict[str, Any], *, parties_here: bool) -> dict[str, Any]:
    """``settings`` with the run's files named by their absolute, resolved paths, as its
    checkpoints record them and a resume compares them: the same files given by relative or
    absolute paths (or through a link) are the same run's; their contents are compared apart
    (each party's training data by its SHA-256). Party files elsewhere (``parties_here``
    false: a deployment's, on their parties' machines) are kept as given."""

    def resolved(path: str | None) -> str | None:
        return None if path is None else str(Path(path).resolve())

    files = settings["party_files"]
    return {
        **settings,
        "party_files": [resolved(path) for path in files] if parties_here else files,
        "label_file": resolved(settings["label_file"]),
        "test_file": resolved(settings["test_file"]),
    }


def _refuse_stale_checkpoints(
    directory: Path, out: Path, label_party: str, overwrite: bool
) -> None:
    """Refuse a fresh run whose checkpoints would go where a killed run's are (``directory``),
    unless ``overwrite``: it would replace them, or (without --checkpoint-every) leave them
    beside a finished run that no --resume can go on from."""
    from secure_vfl.checkpoints import CHECKPOINTS_DIR, written_steps

    steps = written_steps(directory, label_party) if directory.is_dir() else []
    if steps and not overwrite:
        again = out if directory == out / CHECKPOINTS_DIR else directory
        raise ConfigError(
            f"{directory} holds the checkpoints of an earlier run (its last of step "
            f"{steps[-1]}); expected --resume {again} to go on from them, or --overwrite to "
            "start afresh and replace them."
        )


def _refuse_another_runs_checkpoints(
    directory: Path, resume: Any, label_party: str, overwrite: bool
) -> None:
    """Refuse a resumed run whose checkpoints would go where another run's are (``directory``,
    a --checkpoint-dir), unless ``overwrite``: its first checkpoint removed them without a word
    (a fresh run there is refused alike). The resumed run's own, from a resume into the same
    directory before, are its to go on with."""
    from secure_vfl.checkpoints import read_checkpoint, written_steps

    steps = written_steps(directory, label_party) if directory.is_dir() else []
    if not steps or overwrite or directory.resolve() == resume.root.resolve():
        return
    found = read_checkpoint(directory, label_party, steps[-1]).run_id
    if found != resume.run_id:
        raise ConfigError(
            f"--checkpoint-dir {directory} holds the checkpoints of another run (run {found}, "
            f"its last of step {steps[-1]}) than the resumed one (run {resume.run_id}); "
            "expected another directory, or --overwrite to replace them."
        )


def _resumed_out(args: argparse.Namespace) -> Path | None:
    """The killed run's own --out when ``--resume DIR`` names it (it holds the run's
    checkpoints) or its checkpoints directory: a resumed run without --out finishes where the
    killed one would have."""
    from secure_vfl.checkpoints import CHECKPOINTS_DIR

    if args.resume is None:
        return None
    resume = Path(args.resume)
    if (resume / CHECKPOINTS_DIR).is_dir():
        return resume
    if resume.name == CHECKPOINTS_DIR and resume.is_dir():
        return resume.parent
    return None


def _checkpoints_payload(checkpoints: Any) -> dict[str, Any]:
    """``result.json``'s ``checkpoints`` entry: where the label party's went, how often, and
    the step the run resumed from (None: a fresh run)."""
    return {
        "directory": str(checkpoints.directory),
        "every": checkpoints.every,
        "resumed_from_step": checkpoints.resume.step if checkpoints.resume else None,
    }


def _privacy_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The privacy flags of a training run as given (backend, alignment, every DP flag,
    target epsilon, delta, noise seed), for ``result.json``'s ``config.privacy``."""
    settings: dict[str, Any] = _privacy_spec(args).to_json()
    return settings


def _path_part(text: str) -> str:
    """``text`` as part of a directory name: ``dp-gradients:1:0.01`` -> ``dp-gradients-1-0.01``
    (a separator or any other character outside letters, digits, ``.``, ``_`` and ``-`` is a
    ``-``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)


def run_attack_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from attacks.runner import NOISE_DEFENSES, run_attack, spec_defenses
    from secure_vfl.io import atomic_write_json
    from secure_vfl.runs import provenance

    # A single attack's secure-agg defense makes its run one of secure sums, as --secure-agg
    # does (so --release dp may go with it); a suite's runs are each defended on their own.
    secure = args.suite is None and any(d.startswith("secure-agg:") for d in args.defense)
    if args.suite is not None and args.release == "dp":
        raise _release_refusal("--suite")
    config = _train_config(args, secure_sums=secure)
    if args.suite is not None:
        return _run_suite_command(args, config)
    noised = [d for d in args.defense if d.partition(":")[0] in NOISE_DEFENSES]
    if (
        args.target_epsilon is not None
        and noised
        and not (args.dp_embeddings or args.dp_gradients or args.dp_sgd)
    ):
        raise ConfigError(
            "--target-epsilon calibrates train's --dp-embeddings, --dp-gradients or --dp-sgd; a "
            "--defense spec's SIGMA is its own. Expected the mechanism as a flag (e.g. "
            f"--dp-gradients SIGMA:CLIP) or no --target-epsilon; found --defense {noised[0]}."
        )
    name = args.attack
    control = "-control" if args.control else ""  # beside the attack, not over it
    out = _run_out(
        args,
        Path("runs")
        / (
            f"attack-{name}{control}-{config.method}-{config.data_name}-s{config.seed}"
            + "".join(
                f"-{_path_part(defense)}"
                for defense in [*spec_defenses(_privacy_spec(args)), *args.defense]
            )
        ),
    )
    _check_output_dir(out, "result.json", overwrite=args.overwrite, kind="attack", lock=True)
    if args.cache is not None:  # before the training, whose reference it would keep
        check_directory("--cache", args.cache)
    store = _results_store(args, out)
    mapping = _file_party_names(config)
    bar: Any = None

    def on_start(total: int) -> None:
        nonlocal bar
        bar = tqdm(total=total, desc=name, unit="step", disable=_no_bar(args), leave=False)

    def on_step(step: int, loss: float) -> None:
        bar.update(1)

    try:
        with _printed_warnings(mapping) as noted, _named_errors(mapping):
            result = run_attack(
                config,
                name,
                options=_attack_options(args.attack_option),
                attacker=_internal_party(mapping, args.attacker),
                defenses=args.defense,
                privacy=_privacy_spec(args),
                control=args.control,
                cache=args.cache or out.parent / ".undefended",
                on_start=on_start,
                on_step=on_step,
            )
    finally:
        if bar is not None:
            bar.close()
    payload = _attack_relabelled(result.to_json(), mapping)
    if mapping:
        payload["parties"] = mapping
    # Both in the users' names already (the training's relabelled with the payload).
    payload["warnings"] = list(dict.fromkeys([*noted, *payload["training"].get("warnings", [])]))
    payload["provenance"] = provenance()
    with _finishing():
        atomic_write_json(out / "result.json", payload)
        entry = _attack_entry(payload, ", ".join(args.defense), privacy=_privacy_settings(args))
        if mapping:
            entry["parties"] = mapping
        store.add(
            {**entry, "provenance": payload["provenance"]}, kind=f"attack:{name}", out_dir=out
        )
    print(party_named(_attack_summary(result, out), mapping))
    _print_warnings(payload["warnings"], printed=noted)
    return 0


def _attack_relabelled(payload: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    """An attack run's ``payload`` (``result.json``, a sweep's row) in the users' party names,
    but for its training configuration (its paths are the user's own)."""
    if not mapping:
        return payload
    training = payload.get("training")
    relabelled = {key: party_named(value, mapping) for key, value in payload.items()}
    if isinstance(training, dict):
        relabelled["training"] = {
            key: party_named(value, mapping) if key in ("privacy", "traffic", "warnings") else value
            for key, value in training.items()
        }
    return relabelled


def _internal_party(mapping: dict[str, str], name: str | None) -> str | None:
    """The internal name (``party-k``) of the party the user calls ``name`` (its file's name,
    as train's outputs name it), or ``name`` as given."""
    return {user: internal for internal, user in mapping.items()}.get(name, name)  # type: ignore[arg-type]


@contextmanager
def _named_errors(mapping: dict[str, str]) -> Iterator[None]:
    """A ConfigError raised inside says the users' party names, not the internal ones."""
    try:
        yield
    except ConfigError as error:
        if not mapping or type(error) is not ConfigError:
            raise
        raise ConfigError(party_named(str(error), mapping)) from None


def _file_party_names(config: Any) -> dict[str, str]:
    """Each internal party name (``party-k``) by the user's name of its party file (empty for
    a registered dataset, whose parties have no other names)."""
    from secure_vfl.data.party_files import party_names

    if not config.party_files:
        return {}
    names = party_names(config.party_files, config.party_names or None)
    return {f"party-{k}": name for k, name in enumerate(names)}


def _release_refusal(found: str) -> ConfigError:
    """Why a sweep or a suite takes no --release dp: its undefended runs sum in the clear."""
    return ConfigError(
        "--release dp adds DP noise to what secure sums release, and the undefended runs of a "
        "sweep or suite have none: expected one `attack --attack NAME` with --defense "
        f"secure-agg:BACKEND and --release dp; found {found}."
    )


def run_sweep_command(args: argparse.Namespace) -> int:
    from attacks.base import DIVERGED, SCORED
    from attacks.sweep import parse_grid, run_sweep, unscored_line, write_sweep

    if args.release == "dp":
        raise _release_refusal("sweep")
    given = _given(
        ("--secure-agg", args.secure_agg if args.secure_agg != "none" else None),
        ("--dp-embeddings", args.dp_embeddings),
        ("--dp-gradients", args.dp_gradients),
        ("--dp-sgd", args.dp_sgd),
        ("--target-epsilon", args.target_epsilon),
    )
    if given:
        raise ConfigError(
            f"a sweep's defenses are its --defense templates; found {', '.join(given)} "
            "(e.g. --defense secure-agg:masks, --defense dp-gradients:SIGMA:0.01)."
        )
    config = _train_config(args)
    out = _run_out(args, Path("runs") / f"sweep-{args.attack}-{config.method}-{config.data_name}")
    _check_output_dir(out, "sweep.json", overwrite=args.overwrite, lock=True)
    store = _results_store(args, out)
    from tqdm import tqdm

    mapping = _file_party_names(config)
    bar = tqdm(total=0, desc=f"sweep {args.attack}", unit="run", disable=_no_bar(args), leave=False)
    try:
        with _named_errors(mapping):
            rows = run_sweep(
                config,
                args.attack,
                templates=args.defense,
                grid=parse_grid(args.grid),
                seeds=args.seeds,
                attacker=_internal_party(mapping, args.attacker),
                workers=args.workers,
                executor=args.executor,
                privacy=_privacy_spec(args),  # its DP accounting; the defenses are the templates
                cache=out.parent / ".undefended",
                on_start=lambda runs: bar.reset(total=runs),
                on_done=lambda: bar.update(1),
            )
    finally:
        bar.close()
    rows = [_attack_relabelled(row, mapping) for row in rows]
    command = command_line("secure-vfl sweep")
    with _finishing():
        with _unfinished(out, "sweep.json"):
            text, plots = write_sweep(rows, out, attack=args.attack, command=command)
        scored = []
        for row in rows:
            if row["status"] != SCORED:
                print(unscored_line(row), file=sys.stderr)
                continue
            _print_warnings([f"{row['defense']} seed {row['seed']}: {w}" for w in row["warnings"]])
            entry = _attack_entry(
                {**row, "main": {"accuracy": row["main_accuracy"]}}, row["defense"]
            )
            if mapping:  # the users' party names, as `attack` stores them
                entry["parties"] = mapping
            scored.append((entry, f"sweep:{args.attack}", f"{row['defense']} seed {row['seed']}"))
        store.replace_runs(out, scored)  # a sweep written again replaces all its runs
    print(text)
    print("plots: " + ", ".join(str(p) for p in plots))
    if not any(row["status"] == SCORED for row in rows):
        diverged = sum(row["status"] == DIVERGED for row in rows)
        print(
            f"secure-vfl: error: no run of the sweep was scored ({diverged} {DIVERGED}, "
            f"{len(rows) - diverged} not applicable); see {out / 'sweep.md'}.",
            file=sys.stderr,
        )
        return 1
    return 0


def _run_suite_command(args: argparse.Namespace, config: Any) -> int:
    from attacks import ATTACKS
    from attacks.base import DIVERGED, NOT_APPLICABLE
    from attacks.suite import markdown, run_suite, unscored_lines
    from secure_vfl.io import atomic_write_json, atomic_write_text

    out = _run_out(args, Path("runs") / f"suite-{config.method}-{config.data_name}")
    _check_output_dir(out, "suite.json", overwrite=args.overwrite, lock=True)
    privacy = _privacy_spec(args)
    if privacy.noise() or args.secure_agg != "none":
        raise ConfigError(
            "a suite's defenses are its --defense specs (each run on its own); found the "
            "privacy flags of train."
        )
    given = _given(
        ("--control", True if args.control else None),
        ("--attack-option", args.attack_option or None),
    )
    if given:
        raise ConfigError(
            f"{_flags_with_verb(given, 'goes', 'go', joined=' and ')} with one --attack (a "
            "suite runs each attack with its own parameters, each against its defenses); found "
            "--suite."
        )
    if args.cache is not None:
        check_directory("--cache", args.cache)
    store = _results_store(args, out)
    entries: list[tuple[dict[str, Any], str, str]] = []  # stored once the suite is written
    mapping = _file_party_names(config)

    def on_run(attack: str, defense: str, result: Any) -> None:
        payload = _attack_relabelled(result.to_json(), mapping)
        entry = _attack_entry(payload, defense)
        if mapping:  # the users' party names, as `attack` stores them
            entry["parties"] = mapping
        entries.append((entry, f"suite:{attack}", f"{attack} / {defense}"))
        if not args.quiet:
            counts = getattr(ATTACKS.get(attack), "counts", ())
            value = ", ".join(
                f"{k} {v:.0f}" if k in counts else f"{k} {v:.3f}"
                for k, v in payload["attack"].items()
            )
            print(f"{attack} / {defense}: main {100 * payload['main']['accuracy']:.2f} %, {value}")

    with _named_errors(mapping):
        report = run_suite(
            config,
            defenses=args.defense,
            attacker=_internal_party(mapping, args.attacker),
            privacy=privacy,
            cache=args.cache or out.parent / ".undefended",
            on_run=on_run,
        )
    if mapping:
        import dataclasses

        named = party_named(report.to_json(), mapping)
        report = dataclasses.replace(
            report, runs=named["runs"], skipped=named["skipped"], failed=named["failed"]
        )
    command = command_line("secure-vfl attack")
    text = markdown(report, command=command)
    with _finishing():
        with _unfinished(out, "suite.json"):
            atomic_write_text(out / "suite.md", text)
            atomic_write_json(out / "suite.json", report.to_json())
        store.replace_runs(out, entries)  # a suite written again replaces all its runs
    print(text)
    for line in [*unscored_lines(report, DIVERGED), *unscored_lines(report, NOT_APPLICABLE)]:
        print(line, file=sys.stderr)
    _print_warnings(
        [
            f"{run['attack']} / {run['defense']}: {party_named(warning, mapping)}"
            for run in report.runs
            for warning in run.get("warnings", [])
        ]
    )
    if not report.runs:
        diverged = sum(o["status"] == DIVERGED for o in report.unscored.values())
        print(
            f"secure-vfl: error: no run of the suite was scored ({diverged} {DIVERGED}, "
            f"{len(report.unscored) - diverged} {NOT_APPLICABLE}); see {out / 'suite.md'}.",
            file=sys.stderr,
        )
        return 1
    return 0


def _attack_entry(
    payload: dict[str, Any], defense: str, *, privacy: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The results store's entry of one attack run (``payload``: its ``training`` result, its
    ``main`` and ``attack`` metrics, ``performance``, ``chance``, ``dcs_chance`` and
    ``control``): the training result, its configuration with the ``defense`` (and
    ``privacy``: the privacy flags given), the metrics with the attack's score."""
    training = payload["training"]
    config = {**training["config"], "defense": defense, "control": bool(payload.get("control"))}
    config["options"] = payload.get("options") or {}  # the attack's non-default parameters
    config["attacker"] = payload.get("attacker")
    if privacy is not None:
        config["privacy"] = privacy
    score = {key: payload[key] for key in ("performance", "chance", "dcs_chance")}
    metrics = {"main": payload["main"], "attack": payload["attack"], "score": score}
    return {**training, "config": config, "metrics": metrics}


def _attack_summary(result: Any, out: Path) -> str:
    from attacks import ATTACKS

    counts = getattr(ATTACKS.get(result.attack_name), "counts", ())
    defenses = ", ".join(result.defenses) or "none"
    width = max([13, *(len(metric) for metric in result.attack)])
    lines = [
        f"{result.attack_name} by {result.attacker}"
        f"{' (negative control)' if result.control else ''}; defenses: {defenses}",
        f"{'main accuracy':<{width + 7}} {100 * result.main['accuracy']:.2f} % "
        f"(undefended {100 * result.undefended_accuracy:.2f} %)",
    ]
    for metric, value in result.attack.items():
        shown = f"{value:.0f}" if metric in counts else f"{value:.4f}"
        lines.append(f"attack {metric:<{width}} {shown}")
    lines.append(
        f"{'attack performance':<{width + 7}} {result.performance:.4f} (AP, what the DCS scores)"
    )
    lines.append(f"{'chance level':<{width + 7}} {result.chance:.4f}")
    lines.append(f"DCS {result.dcs:.4f}   DCS (AP* = chance) {result.dcs_chance:.4f}")
    if result.privacy is not None:
        lines.extend(_privacy_lines(result.privacy))
    lines.append(f"result: {out / 'result.json'}")
    return "\n".join(lines)


def run_impute(args: argparse.Namespace) -> int:
    if args.federation is not None:
        return run_impute_deployed(args)
    _refuse_deployment_flags(args)
    columns = _given(("--id-column", args.id_column), ("--label-column", args.label_column))
    if columns and args.dataset is not None:
        raise ConfigError(
            f"{_flags_with_verb(columns, 'applies', 'apply')} to --client-file (a registered "
            f"dataset has its own columns). Found --dataset {args.dataset}."
        )
    from tqdm import tqdm

    from secure_vfl import saved_imputer
    from secure_vfl.data.imputation import IMPUTATION_DATASETS
    from secure_vfl.experiment import ImputeRunConfig, prepare_imputation_task, run_imputation
    from secure_vfl.federation.channel import Channel, InProcessTransport
    from secure_vfl.federation.parts import sha256
    from secure_vfl.io import atomic_write_json
    from secure_vfl.runs import provenance
    from secure_vfl.saved_model import MANIFEST_FILE, MODEL_DIR

    engine = _impute_privacy_engine(args)
    config = ImputeRunConfig(
        method=args.method,
        dataset=args.dataset,
        client_files=tuple(args.client_file or ()),
        clients=_client_count(args),
        availability=args.availability if args.availability is not None else 0.6,
        seed=args.seed,
        id_column=args.id_column or ID_COLUMN,
        label_column=args.label_column or LABEL_COLUMN,
        impute_config=_impute_config(args),
    )
    if config.dataset is not None:
        spec = IMPUTATION_DATASETS.get(config.dataset)
        if not spec.is_installed():
            raise ConfigError(f"dataset {config.dataset!r} is not installed. {spec.install_hint()}")
    out = _run_out(
        args, Path("runs") / (f"impute-{config.method}-{config.data_name}-s{config.seed}")
    )
    _check_output_dir(out, "result.json", overwrite=args.overwrite, kind="impute", lock=True)
    keeps_model = saved_imputer.keeps_model(config.method)
    if keeps_model:  # a folder of the user's own there (no manifest) is not replaced unasked
        _check_output_dir(out / MODEL_DIR, "", overwrite=args.overwrite)
        _refuse_inside(
            out / MODEL_DIR, args.client_file or (), "the model folder", "it is saved whole"
        )
    elif args.overwrite and (out / MODEL_DIR).exists():  # it would outlive the run it was of
        raise ConfigError(
            f"{out / MODEL_DIR} holds the imputer of the run --overwrite replaces, and "
            f"{config.method} keeps no model to replace it with; expected another --out (or "
            "remove the folder)."
        )
    if args.save_imputed:  # a folder of the user's own, or one an older run left: not merged
        _check_output_dir(out / "imputed", "", overwrite=args.overwrite)
        _refuse_inside(
            out / "imputed",
            args.client_file or (),
            "--save-imputed's folder",
            "it is replaced whole",
        )
    elif args.overwrite and (out / "imputed").exists():  # it would outlive the run it was of
        raise ConfigError(
            f"{out / 'imputed'} holds the tables of the run --overwrite replaces; expected "
            "--save-imputed to replace them too (or remove the folder)."
        )
    store = _results_store(args, out)
    with _printed_warnings() as noted:
        task = prepare_imputation_task(config)
    bar: Any = None

    def on_start(rounds: int) -> None:
        nonlocal bar
        bar = tqdm(
            total=rounds, desc=config.method, unit="round", disable=_no_bar(args), leave=False
        )

    def on_round(round: int, rmse: float) -> None:
        bar.update(1)
        bar.set_postfix(val_rmse=f"{rmse:.3f}")

    with _capture(args.capture, args, out=out) as capture, _printed_warnings() as running:
        try:
            result, imputer = run_imputation(
                config,
                task=task,
                channel=Channel(transport=InProcessTransport(capture=capture)),
                privacy=engine,
                on_start=on_start,
                on_round=on_round,
            )
        finally:
            if bar is not None:
                bar.close()
    with _finishing():
        with _unfinished(out, "result.json"):
            if args.save_imputed:
                _save_imputed(out / "imputed", task, imputer)
            payload = result.to_json()
            payload["config"]["privacy"] = _impute_privacy_config(args)
            payload["provenance"] = provenance()
            payload["warnings"] = list(dict.fromkeys([*noted, *running]))
            payload["model"] = None
            if keeps_model:
                manifest = saved_imputer.save_imputer(
                    out / MODEL_DIR,
                    imputer,
                    task,
                    method=config.method,
                    seed=config.seed,
                    config=config.impute_config,
                    columns=(config.id_column, config.label_column),
                )
                payload["model"] = {
                    "directory": str(out / MODEL_DIR),
                    "run_id": manifest.run_id,
                    "manifest_sha256": sha256((out / MODEL_DIR / MANIFEST_FILE).read_bytes()),
                }
            atomic_write_json(out / "result.json", payload)
        store.add(payload, kind="impute", out_dir=out)
    print(_impute_summary(result, out))
    if keeps_model:
        print(f"model: {out / MODEL_DIR} (secure-vfl fill --model {out} --client-file ...)")
    return 0


def _print_warnings(warnings: Sequence[str], *, printed: Sequence[str] = ()) -> None:
    """Print ``warnings`` but those ``printed`` already (as they were raised,
    :func:`_printed_warnings`): what is left is the result's own (predictions collapsed)."""
    for warning in warnings:
        if warning in printed:
            continue
        print(f"secure-vfl: warning: {warning}", file=sys.stderr)


def _impute_privacy_config(args: argparse.Namespace) -> dict[str, Any]:
    """``result.json``'s ``config.privacy`` of an ``impute`` run: the protection asked for."""
    return {
        "secure_agg": args.secure_agg,
        "dp_statistics": args.dp_statistics,
        "target_epsilon": args.target_epsilon,
        "delta": _delta(args),
        "feature_ranges": str(args.feature_ranges) if args.feature_ranges else None,
    }


def _impute_summary(result: Any, out: Path) -> str:
    """What ``impute`` prints: the RMSE per client and overall, the privacy, the result."""
    from secure_vfl.runs import display_width, name_text, padded  # a client file's name chose it

    names = {name: name_text(name) for name in result.rmse_per_client}
    width = max(20, *(display_width(name) + 2 for name in names.values()))
    lines = [
        f"{result.method} on {result.dataset} ({len(result.clients)} clients) "
        f"in {result.wall_time_s:.1f} s",
        f"{'client':<{width}}{'RMSE (std units)':>18}{'hidden entries':>16}",
    ]
    for name, rmse in result.rmse_per_client.items():
        shown = "-" if rmse is None or rmse != rmse else f"{rmse:.4f}"  # no hidden entry: no score
        lines.append(f"{padded(names[name], width)}{shown:>18}{result.hidden_per_client[name]:>16}")
    hidden = sum(result.hidden_per_client.values())
    lines.append(f"{'all clients':<{width}}{result.rmse:>18.4f}{hidden:>16}")
    lines.extend(_feature_lines(result))
    if result.privacy is not None:
        lines.extend(_privacy_lines(result.privacy))
    for k, fault in enumerate(result.faults):
        if fault["what"] == "rejoined":
            lines.append(
                f"rejoined: {fault['party']} before round {fault['round']}, set up anew and sent "
                "the global model; it took part again from then on"
            )
            continue
        back = any(later["party"] == fault["party"] for later in result.faults[k + 1 :])
        lines.append(
            f"lost: {fault['party']} in round {fault['round']}; FedAvg went on over the other "
            + ("clients until it rejoined" if back else "clients, and it has no score")
        )
    lines.append(f"result: {out / 'result.json'}")
    return "\n".join(lines)


FEATURES_SHOWN = 12
"""The most features ``impute`` prints an RMSE line for; result.json has every one's."""


def _feature_lines(result: Any) -> list[str]:
    """The RMSE per feature, in std units and in the feature's own, up to FEATURES_SHOWN
    features (beyond that, where result.json has them)."""
    features = result.rmse_per_feature
    if len(features) > FEATURES_SHOWN:
        return [
            f"RMSE per feature ({len(features)} features): rmse_per_feature and "
            "rmse_per_feature_in_units in result.json"
        ]
    from secure_vfl.runs import display_width, name_text, padded  # a column's header chose it

    names = {feature: name_text(feature) for feature in features}
    width = max(20, *(display_width(name) + 2 for name in names.values()))
    lines = [f"{'feature':<{width}}{'RMSE (std units)':>18}{'RMSE (its units)':>18}{'hidden':>8}"]
    for feature, rmse in features.items():
        units = result.rmse_per_feature_in_units[feature]
        hidden = result.hidden_per_feature[feature]
        in_units = f"{units:.4g}" if abs(units) < 1e4 else f"{units:.0f}"  # no exponent
        shown = ("-", "-") if not hidden or rmse != rmse else (f"{rmse:.4f}", in_units)
        lines.append(f"{padded(names[feature], width)}{shown[0]:>18}{shown[1]:>18}{hidden:>8}")
    return lines


def _impute_config(args: argparse.Namespace) -> Any:
    """The FedAvg and training options of ``impute``'s flags; ConfigError for any of them
    given to a method that trains no model (mean, knn, mice, fed-mean), which would ignore it."""
    from secure_vfl.methods.imputation import ImputeConfig
    from secure_vfl.methods.imputation.base import changed_training_fields
    from secure_vfl.methods.imputation.fedhf import RECONSTRUCTIONS

    config = ImputeConfig(
        rounds=args.rounds,
        client_fraction=args.client_fraction,
        local_epochs=args.local_epochs,
        batch_size=args.batch_size,
        lr=args.lr,
    )
    if args.method not in RECONSTRUCTIONS.names():
        given = [f"--{name.replace('_', '-')}" for name in changed_training_fields(config)]
        if given:
            raise ConfigError(
                f"{_flags_with_verb(given, 'applies', 'apply')} to the methods that train a model "
                f"({', '.join(RECONSTRUCTIONS.names())}). Found --method {args.method}."
            )
    return config


def run_impute_deployed(args: argparse.Namespace) -> int:
    """`secure-vfl impute --federation FED --name LABEL`: the coordinator of a deployed
    imputation, every other party a client serving in its own process."""
    from tqdm import tqdm

    from secure_vfl.deployed_imputation import check_coordinator, impute_deployed
    from secure_vfl.experiment import ImputeRunConfig
    from secure_vfl.federation.federation_file import read_federation
    from secure_vfl.io import atomic_write_json
    from secure_vfl.runs import provenance

    _refuse_deployed_impute_flags(args)
    engine = _impute_privacy_engine(args)
    federation = read_federation(args.federation)
    clients = check_coordinator(args.method, federation, args.name)
    config = ImputeRunConfig(
        method=args.method,
        client_files=tuple(m.data for m in clients if m.data is not None),
        clients=len(clients),
        seed=args.seed,
        id_column=args.id_column or ID_COLUMN,
        label_column=args.label_column or LABEL_COLUMN,
        impute_config=_impute_config(args),
    )
    out = _run_out(args, Path("runs") / f"impute-{config.method}-deployed-s{config.seed}")
    _check_output_dir(out, "result.json", overwrite=args.overwrite, kind="impute", lock=True)
    store = _results_store(args, out)
    bar = tqdm(total=0, desc=config.method, unit="round", disable=_no_bar(args), leave=False)

    def on_round(round: int, rmse: float) -> None:
        bar.update(1)
        bar.set_postfix(val_rmse=f"{rmse:.3f}")

    try:
        with _capture(args.capture, args, out=out) as capture, _printed_warnings() as noted:
            result, kept = impute_deployed(
                config,
                federation,
                args.name,
                **_label_party_options(args),
                on_start=lambda rounds: bar.reset(total=rounds),
                on_round=on_round,
                save_imputed=args.save_imputed,
                privacy=engine if engine.private else None,
                capture=capture,
            )
    finally:
        bar.close()
    payload = result.to_json()
    payload["config"]["privacy"] = _impute_privacy_config(args)
    payload["config"]["federation"] = str(args.federation)
    payload["provenance"] = provenance()
    saved, model = kept["imputed"], kept["model"]
    if saved is not None:
        payload["imputed"] = saved
    payload["model"] = model
    payload["warnings"] = noted
    with _finishing():
        atomic_write_json(out / "result.json", payload)
        store.add(payload, kind="impute", out_dir=out)
    print(_impute_summary(result, out))
    if saved is not None:
        print(
            f"imputed tables: each client's in its own --imputed-dir, {saved['run']}/NAME.csv "
            f"({', '.join(saved['tables'])})"
        )
    savers = [name for name, part in model["clients"].items() if part["files"]]
    print(
        f"model: each client saved its own imputer in its own --model-dir, NAME/{model['run_id']} "
        f"({', '.join(savers)}): secure-vfl fill --model THAT_DIR --client-file ... on its machine"
    )
    unsaved = [
        f"{name} saved none ({part['why']})"
        for name, part in model["clients"].items()
        if "why" in part
    ]
    _print_warnings(unsaved)  # those raised in the run were printed then
    return 0


def _refuse_deployed_impute_flags(args: argparse.Namespace) -> None:
    """ConfigError, before any contact, for ``impute`` flags a deployment does not take."""
    if args.name is None:
        raise ConfigError("--federation needs --name NAME (the label party's). Found none.")
    refused = _given(("--clients", args.clients), ("--availability", args.availability))
    if refused:
        raise ConfigError(
            f"{', '.join(refused)} not offered with impute --federation: the clients are the "
            "federation file's parties, each reading its own file."
        )
    if args.insecure_reproducible_noise:
        raise ConfigError(
            "--insecure-reproducible-noise is refused with --federation: noise anyone with the "
            "seed can remove has no place on a network."
        )
    if args.dp_statistics is not None and args.feature_ranges is None:
        raise ConfigError(
            "--dp-statistics with --federation clips the clients' values to declared ranges: "
            "expected --feature-ranges CSV (observed ranges would take every client's extreme "
            "values, which are not private). Found none."
        )


def _client_count(args: argparse.Namespace) -> int:
    """K: ``--clients`` for a dataset (4 unless given); the number of files for client files,
    where ``--clients`` that says otherwise, or any ``--availability`` (the files' own columns
    say which features each client has), is refused."""
    if not args.client_file:
        return int(args.clients) if args.clients is not None else 4
    given = len(args.client_file)
    if args.clients is not None and args.clients != given:
        raise ConfigError(
            f"--clients {args.clients} contradicts the {given} --client-file given (one client "
            f"per file); expected --clients {given} or no --clients."
        )
    if args.availability is not None:
        raise ConfigError(
            "--availability deals a --dataset's features to clients; client files have their "
            f"own columns. Found --availability {args.availability:g} with --client-file."
        )
    return given


def _save_imputed(directory: Path, task: Any, imputer: Any) -> None:
    """Each client's rows with missing-but-available entries filled. A client file's table
    comes back in its own form (ids first under its id column, its rows in its order, its
    label column unchanged), so it can feed ``train``; a registered dataset's clients are
    written training rows, then test rows, with a ``split`` column. The folder is written
    whole beside ``directory`` and swapped in: every client's table or none, and no file of an
    older run's folder left beside them."""
    from secure_vfl.experiment import imputed_tables
    from secure_vfl.io import replace_directory

    frames = imputed_tables(task, imputer, as_written=True)

    def write(staged: Path) -> None:
        for name, frame in frames.items():
            frame.to_csv(staged / f"{name}.csv", index=False)

    replace_directory(directory, write)


def _party_tables(
    model: Any, specs: Sequence[tuple[str | None, Path]], id_column: str
) -> dict[str, Any]:
    """Each ``--party-file`` assigned to its party (by the name given, else by the file's
    stem) and read with ids from ``id_column``."""
    from secure_vfl.data.party_files import read_party_file

    tables: dict[str, Any] = {}
    for name, path in specs:
        party = model.manifest.parties[model.party_index(name or _party_of(model, path))]
        if party.source in tables:
            raise ConfigError(
                f"two files for party {party.source}: {tables[party.source][1]} and {path}; "
                "expected one file per party."
            )
        table = read_party_file(path, id_column=id_column, name=party.source)
        tables[party.source] = (table, str(path))
    return tables


def _party_of(model: Any, path: Path) -> str:
    """The party a file without ``PARTY=`` belongs to: the one its stem names (as is, or made
    safe as training made it)."""
    from secure_vfl.data.party_files import party_name

    parties = model.manifest.parties
    for stem in (path.stem, party_name(path.stem)):
        if any(stem in (entry.source, entry.name) for entry in parties):
            return stem
    raise ConfigError(
        f"unknown party file {path}: its stem names no party of this model; expected one of "
        f"{', '.join(entry.source for entry in parties)} (or --party-file PARTY={path})."
    )


def run_fill(args: argparse.Namespace) -> int:
    """`secure-vfl fill`: each client fills its new rows with its own part of a saved imputer."""
    from secure_vfl.io import atomic_write
    from secure_vfl.runs import columns
    from secure_vfl.saved_imputer import SavedImputer

    out: Path = args.out
    files = [path for _, path in args.client_file]
    stems = [path.stem for path in files]
    repeated = sorted({stem for stem in stems if stems.count(stem) > 1})
    if repeated:
        raise ConfigError(
            f"--out {out} takes one table per file stem; found {repeated[0]!r} twice "
            f"({', '.join(str(p) for p in files if p.stem == repeated[0])}): rename one."
        )
    check_directory("--out", out)
    targets = [out / f"{stem}.csv" for stem in stems]
    for target in targets:
        _check_output_file(
            target,
            overwrite=args.overwrite,
            inputs=files,
            replaced="the rows read would be replaced by their filled table",
        )
    imputer = SavedImputer.load(args.model)
    _refuse_inside(
        imputer.directory, targets, "the model's directory", "its manifest lists every file"
    )
    clients = [_client_of(imputer, name, path) for name, path in args.client_file]
    with run_warnings() as noted:
        filled = [
            imputer.fill(
                path,
                client=client,
                id_column=args.id_column or imputer.manifest.id_column,
                label_column=args.label_column or imputer.manifest.label_column,
                ids_required=args.id_column is not None,
            )
            for client, path in zip(clients, files, strict=True)
        ]
    for target, done in zip(targets, filled, strict=True):  # every table made: none half-done
        atomic_write(target, done.write_csv, replace=args.overwrite)
    manifest = imputer.manifest
    clients_held = len(manifest.clients)  # one where a deployed client kept its own part
    print(
        f"{manifest.method} imputer {manifest.run_id[:12]} ({clients_held} "
        f"client{'s' if clients_held != 1 else ''}, {len(manifest.features)} features)"
    )
    rows = [
        (done.client, str(path), str(done.rows), str(done.filled), str(target))
        for path, target, done in zip(files, targets, filled, strict=True)
    ]
    heading = ("client", "file", "rows", "filled cells", "written")
    print("\n".join(columns([heading, *rows], right=(2, 3))))
    _print_warnings(noted)
    return 0


def _client_of(imputer: Any, name: str | None, path: Path) -> str:
    """The client a file fills for: the one named, else the one its stem names."""
    names = [entry.name for entry in imputer.manifest.clients]
    if name is not None:
        return str(imputer.manifest.client(name).name)
    if path.stem in names:
        return path.stem
    raise ConfigError(
        f"unknown client file {path}: its stem names no client of this imputer; expected one "
        f"of {', '.join(names)} (or --client-file CLIENT={path})."
    )


def _refuse_inside(folder: Path, paths: Sequence[Path], what: str, why: str) -> None:
    """ConfigError if one of ``paths`` lies in ``folder`` (``what``, written whole: ``why``)."""
    where = folder.resolve()
    for path in paths:
        if Path(path).resolve().is_relative_to(where):
            raise ConfigError(
                f"{path} lies in {what} {folder} ({why}); expected a path outside it."
            )


def run_predict(args: argparse.Namespace) -> int:
    """`secure-vfl predict`: the saved federation scores the new rows of the given files."""
    from secure_vfl.saved_model import SavedModel

    if args.federation is not None:
        return run_predict_deployed(args)
    if not args.party_file:
        raise ConfigError(
            "predict needs --party-file [PARTY=]PATH (one per party present), or --federation "
            "FED --name LABEL for a deployed model. Found neither."
        )
    _refuse_deployment_flags(
        args,
        *_given(("--capture", args.capture)),
        *(["--align psi"] if args.align == "psi" else []),
        *([f"--secure-agg {args.secure_agg}"] if args.secure_agg != "none" else []),
    )
    out: Path | None = args.out
    if out is not None:
        _check_prediction_out(out, args, [path for _, path in args.party_file])
    model = SavedModel.load(args.model)
    id_column = args.id_column or model.id_column
    with run_warnings() as noted:
        predictions = model.predict(
            _party_tables(model, args.party_file, id_column),
            id_column=id_column,
            label_column=args.label_column,
        )
    if out is not None:
        predictions.write(out, replace=args.overwrite)
    print(_prediction_summary(model, predictions, out))
    _print_absent(model.absent)
    _print_warnings(noted)
    return 0


def _print_absent(absent: Mapping[str, str]) -> None:
    """A line for each party a prediction went without for every row, and why."""
    for party, why in absent.items():
        print(f"absent: {party} ({why}); predicted without its block")


def run_predict_deployed(args: argparse.Namespace) -> int:
    """`secure-vfl predict --federation FED --name LABEL --model RUN_DIR`: the label party of a
    prediction in which every data party predicts with its own part in its own process."""
    from secure_vfl.deployed_prediction import predict_deployed
    from secure_vfl.federation.federation_file import read_federation

    if args.name is None:
        raise ConfigError("--federation needs --name NAME (the label party's). Found none.")
    files = args.party_file or []
    if len(files) > 1 or any(party not in (None, args.name) for party, _ in files):
        found = ", ".join(f"{party or '(its stem)'}={path}" for party, path in files)
        raise ConfigError(
            "with --federation at most one --party-file, the label party's own new rows (each "
            f"data party serves its own: `party serve --data FILE`); found {found}."
        )
    federation = read_federation(args.federation)
    own = files[0][1] if files else federation.member(args.name).data
    out: Path | None = args.out
    if out is not None:
        _check_prediction_out(out, args, [own] if own is not None else [])
    with run_warnings() as noted, _capture(args.capture, args) as capture:
        done = predict_deployed(
            args.model,
            federation,
            args.name,
            own=own,
            id_column=args.id_column,
            label_column=args.label_column,
            capture=capture,
            psi=_psi_roles() if args.align == "psi" else None,
            **_label_party_options(args),
        )
    predictions = done.predictions
    if out is not None:
        predictions.write(out, replace=args.overwrite)
    print(_prediction_summary(done, predictions, out))
    _print_absent(done.absent)
    _print_warnings(noted)
    return 0


def _check_prediction_out(out: Path, args: argparse.Namespace, inputs: Sequence[Path]) -> None:
    """Refuse, before any work, a prediction's ``--out`` that :func:`_check_output_file`
    refuses, that lies inside the model's directory (the manifest lists the model's files: one
    more makes it refuse to load) or that is one of the ``inputs`` (even with --overwrite)."""

    if out.suffix.lower() not in (".csv", ".parquet", ".pq"):
        raise ConfigError(
            f"--out {out}: a .csv or .parquet file expected (the formats predictions are "
            f"written in); found suffix {out.suffix or '(none)'!r}."
        )
    _check_output_file(
        out,
        overwrite=args.overwrite,
        inputs=inputs,
        replaced="the rows read would be replaced by their predictions",
    )
    where = out.resolve()
    model = _model_directory(Path(args.model))
    if where.is_relative_to(model.resolve()):
        raise ConfigError(
            f"--out {out} is inside the model's directory {model}, whose manifest lists "
            "every file of the model (one more makes it refuse to load); expected a path "
            "outside it."
        )


def _prediction_summary(model: Any, predictions: Any, out: Path | None) -> str:
    from collections import Counter

    manifest = model.manifest
    held = predictions.mask.sum(axis=0)
    lines = [
        f"{manifest.method} model {manifest.run_id[:12]} ({len(manifest.parties)} parties): "
        f"{counted(len(predictions.ids), 'row')}",
        "rows held: "
        + ", ".join(f"{name} {int(n)}" for name, n in zip(predictions.parties, held, strict=True)),
    ]
    labels = predictions.labels()
    counts = Counter(label for label in labels if label is not None)
    predicted = ", ".join(f"{value} {counts[value]}" for value in predictions.classes)
    unscored = sum(label is None for label in labels)
    if unscored:
        predicted += (
            f"; no prediction for {counted(unscored, 'row')} ({manifest.method} cannot predict "
            "them from the blocks present; their cells are left empty)"
        )
    lines.append(f"predicted: {predicted}")
    if out is not None:
        lines.append(f"predictions: {out}")
    else:
        lines.append(predictions.frame().head(5).to_string(index=False))
    return "\n".join(lines)


def run_runs(args: argparse.Namespace) -> int:
    """`secure-vfl runs list|compare|remove`: a table of stored runs, or of the given run
    directories; or those directories' runs taken out of the store."""
    import dataclasses

    from secure_vfl.runs import summarise, summarise_run, table

    if args.runs_command == "compare":
        summaries = [summarise_run(directory) for directory in args.dirs]
        print(table([str(d) for d in args.dirs], summaries))
        return 0
    from secure_vfl.store import ResultsStore

    if args.runs_command == "remove" and args.store is None:
        parents = sorted({str(Path(directory).absolute().parent) for directory in args.dirs})
        if len(parents) > 1:
            raise ConfigError(
                f"runs remove: directories in one folder expected (their results store lies "
                f"beside them), or --store PATH; found them in {', '.join(parents)}."
            )
        args.store = Path(args.dirs[0]).absolute().parent / "results.sqlite"
    if not args.store.is_file():
        raise ConfigError(f"no results store at {args.store}; expected --store PATH of one.")
    store = ResultsStore(args.store)
    store.check(create=False)  # listing writes nothing
    if args.runs_command == "remove":
        for directory, count in store.remove(args.dirs).items():
            print(f"{directory}: {count} run{'s' if count != 1 else ''} removed from {args.store}")
        return 0
    rows = store.rows()
    if not rows:
        print(f"{args.store}: no runs.")
        return 0
    folder = args.store.absolute().parent
    names = [
        f"{row['id']} {row['kind']} {_stored_run_name(row['out_dir'], folder)}" for row in rows
    ]
    summaries = []
    for row in rows:
        try:
            summary = summarise(row, kind=row["kind"])
        except ConfigError as error:
            raise ConfigError(
                f"--store {args.store}: run {row['id']}: {error} Expected a results store "
                "written by secure-vfl."
            ) from None
        # the row's columns were summarised from the whole result (noise after calibration)
        summaries.append(
            dataclasses.replace(
                summary, backend=row["backend"], dp=row["dp"], epsilon=row["epsilon_max"]
            )
        )
    print(table(names, summaries))
    return 0


def run_capture(args: argparse.Namespace) -> int:
    """`secure-vfl capture show|summary FILE`: a capture's messages, one line each, or a table
    of who sent how much to whom."""
    import protocols.psi.messages  # noqa: F401  (registers the psi-* kinds with the codec)
    from secure_vfl.captures import show_lines, summary_lines

    if args.capture_command == "summary":
        print("\n".join(summary_lines(args.file, rounds=args.rounds)))
        return 0
    lines = show_lines(args.file, kinds=args.kind, party=args.party, rounds=args.rounds)
    if args.party is not None:  # a party the capture does not hold is refused after its lines
        lines = iter(list(lines))
    for line in lines:
        print(line)
    return 0


def _stored_run_name(out_dir: str | None, folder: Path) -> str:
    """A stored run's directory as ``runs list`` names it: its path from ``folder`` (the
    store's) where it lies inside it, else its last part; ``(gone)`` after it where the
    directory no longer exists (``runs remove`` takes such runs out)."""
    if out_dir is None:
        return "-"
    try:
        gone = not Path(out_dir).exists()
    except OSError:  # a path this system refuses now: it cannot be read either
        gone = True
    path = Path(out_dir)
    inside = path.is_relative_to(folder) and path != folder
    name = str(path.relative_to(folder)) if inside else path.name
    return f"{name}{' (gone)' if gone else ''}"


def run_datasets(args: argparse.Namespace) -> int:
    from secure_vfl.data.datasets import DATASETS, dataset_status, install_dataset
    from secure_vfl.data.imputation import (
        IMPUTATION_DATASETS,
        imputation_dataset_status,
        install_imputation_dataset,
    )
    from secure_vfl.runs import columns

    if args.action == "install":
        if args.all and args.names:
            raise ConfigError(
                f"datasets install takes NAME ... or --all, not both. Found --all and "
                f"{' '.join(args.names)}."
            )
        names = DATASETS.names() + IMPUTATION_DATASETS.names() if args.all else args.names
        if not names:
            raise ConfigError("datasets install needs NAME ... or --all. Found neither.")
        for name in names:
            if name not in DATASETS and name not in IMPUTATION_DATASETS:
                known = ", ".join(sorted(DATASETS.names() + IMPUTATION_DATASETS.names()))
                raise ConfigError(f"unknown dataset {name!r}; expected one of: {known}.")
        for name in names:
            if name in DATASETS:
                install_dataset(name)
            else:
                install_imputation_dataset(name)
        return 0
    rows = [("name", "use", "shape", "source", "installed")]
    hints = []
    status: list[tuple[str, str, str, str, bool, str]] = [
        (s.name, f"classification ({s.kind})", s.shape, s.source, ok, s.install_hint())
        for s, ok in dataset_status()
    ]
    status += [
        (s.name, "imputation", s.shape, s.source, ok, s.install_hint())
        for s, ok in imputation_dataset_status()
    ]
    for name, use, shape, source, installed, hint in status:
        rows.append((name, use, shape, source, "yes" if installed else "no"))
        if not installed:
            hints.append(f"  {name}: {hint}")
    print("\n".join(columns(rows)))
    if hints:
        print("\nto install a missing dataset:")
        print("\n".join(hints))
    return 0


# -- deployment: every party its own process (secure_vfl.deployment) --------------------------


def _deployment_flags(
    parser: argparse.ArgumentParser,
    source: Any,
    federation_help: str = "a federation file (TOML): run the label party of a deployment, "
    "every other party serving in its own process (`secure-vfl party serve`); its data come "
    "from the file",
) -> None:
    """``train --federation FED --name LABELPARTY``: run the label party of a deployment
    (``--federation`` is one more data ``source``)."""
    source.add_argument("--federation", type=existing_file, metavar="FED", help=federation_help)
    group = parser.add_argument_group("deployment (--federation)")
    group.add_argument(
        "--name",
        metavar="NAME",
        help="this party's name in the federation file (required with --federation; default: none)",
    )
    group.add_argument(
        "--wait",
        type=network_seconds,
        default=NETWORK_SECONDS,
        metavar="S",
        help="seconds the label party waits for every other party to accept a connection "
        "before it starts",
    )
    _network_flags(group)


def _network_flags(group: Any) -> None:
    group.add_argument(
        "--deadline",
        type=network_seconds,
        default=NETWORK_SECONDS,
        metavar="S",
        help="seconds a party waits for a peer's answer, or a serving party for the label "
        "party's next message, before it gives up",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="INSECURE: plaintext gRPC, no certificate checked (every party warns); the "
        "default is mutual TLS with the federation's certificates",
    )


def _party_command(commands: Any) -> None:
    party = commands.add_parser(
        "party", help="run one party of a deployment (every party its own process)"
    )
    actions = party.add_subparsers(dest="party_action", required=True, parser_class=_Parser)
    serve = actions.add_parser(
        "serve", help="serve as a data party (or the aggregator) until the label party ends the run"
    )
    serve.add_argument(
        "--federation", required=True, type=existing_file, metavar="FED", help="the federation file"
    )
    serve.add_argument("--name", required=True, metavar="NAME", help="this party's name in it")
    serve.add_argument(
        "--wait",
        type=network_seconds,
        default=600.0,
        metavar="S",
        help="seconds to wait for the label party to start (once it has, its first message "
        "is waited for while it accepts connections)",
    )
    serve.add_argument(
        "--align",
        choices=["any", "psi"],
        default="any",
        help="the alignments this party takes part in: `any` (the label party's choice: it "
        "sends its ids for the plain join, or runs PSI) or `psi` (it refuses to send its ids in "
        "the clear; the label party must run `train --align psi`)",
    )
    serve.add_argument(
        "--checkpoint-dir",
        type=path_arg,
        metavar="DIR",
        help="where this data party writes its own checkpoints (DIR/NAME/step-N/) when the label "
        "party runs `train --checkpoint-every N`, and, restarted after a crash with the same DIR, "
        "restores the last one committed when it rejoins; a party without one refuses such a "
        "run (default: none)",
    )
    serve.add_argument(
        "--resume",
        action="store_true",
        help="restore this party's own checkpoint from --checkpoint-dir when the label party "
        "runs `train --resume DIR`, and refuse a fresh run",
    )
    serve.add_argument(
        "--model-dir",
        type=path_arg,
        metavar="DIR",
        help="where this data party keeps its own part of each model the label party saves "
        "(DIR/NAME/RUN_ID/) (default: models/ beside its data file)",
    )
    serve.add_argument(
        "--imputed-dir",
        type=path_arg,
        metavar="DIR",
        help="where this imputation client writes its imputed table when the label party runs "
        "`impute --federation --save-imputed` (DIR/RUN_ID/NAME.csv) (default: imputed/ beside "
        "its data file)",
    )
    serve.add_argument(
        "--data",
        type=existing_file,
        metavar="CSV",
        help="the table this data party serves in this run instead of its `data` in the "
        "federation file: new rows for `predict --federation` (default: its `data`)",
    )
    _capture_option(serve)
    _network_flags(serve)


def _secure_sums(name: str) -> Any:
    """The secure-sum backend of ``--secure-agg NAME`` (None for none), from the privacy
    layer: what the deployment's core is handed (it never imports protocols itself)."""
    from protocols.privacy import PrivacyEngine, PrivacySpec

    return PrivacyEngine(PrivacySpec(secure_agg=name)).aggregator()


def _psi_roles(progress: Callable[[int], object] | None = None) -> Any:
    """The two sides of DH-PSI for a deployment (:class:`secure_vfl.deployment.PsiRoles`), the
    privacy layer's roles registered as ``psi-requester`` and ``psi-responder``; imported when
    a party first plays one. ``progress`` is told the requester's points as it masks them."""
    from secure_vfl.deployment import PsiRoles

    def requester(ids: Any, name: str) -> Any:
        from protocols.psi.session import psi_roles

        return psi_roles(None)[0](ids, name=name, progress=progress)

    def responder(ids: Any, name: str) -> Any:
        from protocols.psi.session import psi_roles

        return psi_roles(None)[1](ids, name=name)

    return PsiRoles(requester=requester, responder=responder)


def _served_privacy(name: str, part: Any, party: Any) -> Any:
    """A served data party's own DP mechanisms and accountant, from the privacy plan in its
    set-up (:func:`protocols.party_privacy.served_privacy`): what the deployment's core is
    handed (it never imports protocols itself)."""
    from protocols.party_privacy import served_privacy

    return served_privacy(name, part, party)


def _served_statistics(name: str, part: Any, client: Any, features: Sequence[str]) -> Any:
    """A served imputation client's own statistics mechanism and accountant, from the plan in
    its set-up (:func:`protocols.dp_statistics.served_statistics`)."""
    from protocols.dp_statistics import served_statistics

    return served_statistics(name, part, client, features=features)


def run_party_command(args: argparse.Namespace) -> int:
    """`secure-vfl party serve`: act as one party until the label party ends the run; exit 1
    if the run ends otherwise (it failed, its operator stopped it, or the label party fell
    silent for longer than --deadline: a TransportError, :func:`_exit_status`)."""
    from secure_vfl.deployment import INTERRUPTED, serve
    from secure_vfl.federation.federation_file import read_federation

    federation = read_federation(args.federation)
    with _capture(args.capture, args) as capture, _printed_warnings(every_time=True):
        outcome = serve(
            federation,
            args.name,
            secure_sums=_secure_sums,
            deadline=args.deadline,
            wait=args.wait,
            insecure=args.insecure,
            on_event=lambda line: print(line, flush=True),
            psi=_psi_roles(),
            psi_only=args.align == "psi",
            checkpoint_dir=args.checkpoint_dir,
            resume=args.resume,
            model_dir=args.model_dir,
            party_privacy=_served_privacy,
            imputed_dir=args.imputed_dir,
            statistics_privacy=_served_statistics,
            capture=capture,
            data=args.data,
        )
    if outcome == INTERRUPTED:
        print(
            "secure-vfl: the label party's operator stopped the run; start this party again "
            "for the next one (with --resume where the run wrote checkpoints).",
            file=sys.stderr,
        )
        return 1
    if outcome != "finished":
        print(
            f"secure-vfl: error: the label party ended the run: {_printable(outcome)}",
            file=sys.stderr,
        )
        return 1
    print(f"{args.name}: the run finished")
    return 0


@contextmanager
def _printed_warnings(
    parties: Mapping[str, str] | None = None, *, every_time: bool = False
) -> Iterator[list[str]]:
    """Print each :class:`~secure_vfl.errors.RunWarning` raised inside as it is raised
    (``secure-vfl: warning: ...``, above any progress bar), and collect its text in the list
    yielded, in the order raised (``result.json``'s warnings): a run may take minutes, and a
    served party runs until the label party ends it, so a warning (a party lost, new rows far
    outside a party's training range) is seen when it happens, not at the end nor once per line
    of code. A text raised again is neither printed nor listed again but ``every_time`` (a
    served party, whose every request is an event of its own). ``parties`` (internal name -> the
    user's) names the parties in each text as the run's result does. Other warnings are shown as
    usual, as they are raised."""
    import warnings

    from tqdm import tqdm

    from secure_vfl.errors import RunWarning

    noted: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always", RunWarning)
        shown = warnings.showwarning

        def show(message: Any, category: Any, *where: Any, **more: Any) -> None:
            with tqdm.external_write_mode(file=sys.stderr):  # a bar is cleared, then redrawn
                if issubclass(category, RunWarning):
                    text = party_named(str(message), parties or {})
                    if every_time or text not in noted:
                        noted.append(text)
                        _print_warnings([text])
                else:
                    shown(message, category, *where, **more)

        warnings.showwarning = show
        yield noted


def _refuse_deployment_flags(args: argparse.Namespace, *others: str) -> None:
    """ConfigError for the deployment's flags (--name, --wait, --deadline, --insecure, and the
    ``others`` given that the command takes only with --federation) in a run without
    --federation, where they would be ignored."""
    given = _given(("--name", args.name))
    given += [
        flag
        for flag, value in (("--wait", args.wait), ("--deadline", args.deadline))
        if value != NETWORK_SECONDS
    ]
    given += ["--insecure"] if args.insecure else []
    given += others
    if given:
        raise ConfigError(
            f"{_flags_with_verb(given, 'goes', 'go')} with --federation (a deployment); found "
            "no --federation."
        )


def _given(*flags: tuple[str, object]) -> list[str]:
    """The names of the ``(flag, value)`` pairs whose value was given (is not None)."""
    return [flag for flag, value in flags if value is not None]


def _flags_with_verb(flags: Sequence[str], one: str, several: str, *, joined: str = ", ") -> str:
    """``flags`` joined, then the verb that agrees with how many they are (``--lr applies``,
    ``--rounds, --lr apply``)."""
    return f"{joined.join(flags)} {one if len(flags) == 1 else several}"


def _refuse_deployed_flags(args: argparse.Namespace) -> None:
    """ConfigError, before any work, for ``train`` flags a deployment does not take."""
    if args.name is None:
        raise ConfigError("--federation needs --name NAME (the label party's). Found none.")
    if args.insecure_reproducible_noise:
        raise ConfigError(
            "--insecure-reproducible-noise is refused with --federation: noise anyone with the "
            "seed can remove has no place on a network."
        )
    files = _given(("--label-file", args.label_file), ("--test-file", args.test_file))
    if files:
        raise ConfigError(
            f"{', '.join(files)} not offered with --federation: the labels and every party's "
            "rows come from the federation file (each party reads only its own table)."
        )
    if args.party_name:  # before the files are taken from the federation file, which it counts
        raise ConfigError(
            "--party-name not offered with --federation: the parties' names are the "
            "federation file's."
        )
    columns = _given(("--id-column", args.id_column), ("--label-column", args.label_column))
    if columns:
        raise ConfigError(
            f"{', '.join(columns)} not offered with --federation yet: every party's file has "
            f"its ids in the column `{ID_COLUMN}`, and the label file its labels in "
            f"`{LABEL_COLUMN}`."
        )


def run_train_deployed(args: argparse.Namespace) -> int:
    """`secure-vfl train --federation FED --name LABEL`: the label party of a deployment."""
    from tqdm import tqdm

    from secure_vfl.deployment import refuse_undeployable, train_deployed
    from secure_vfl.federation.federation_file import read_federation
    from secure_vfl.io import atomic_write_json
    from secure_vfl.plots import write_run_plots
    from secure_vfl.saved_model import MODEL_DIR, read_manifest

    _refuse_deployed_flags(args)
    federation = read_federation(args.federation)
    federation.label_data()  # the key: ConfigError saying that training needs it
    args.party_file = [member.data for member in federation.parties]
    args.label_file = federation.labels()
    engine = _privacy_engine(args)  # registers the `psi` aligner that the config names
    config = _train_config(args)
    refuse_undeployable(config)
    engine.refuse(config)
    out = _run_out(args, Path("runs") / f"{config.method}-deployed-s{config.seed}")
    _check_output_dir(out, "result.json", overwrite=args.overwrite, kind="train", lock=True)
    # a folder of the user's own there (no manifest) is not replaced unasked either
    _check_output_dir(out / MODEL_DIR, "", overwrite=args.overwrite)
    store = _results_store(args, out)
    checkpoints = _checkpoint_plan(  # the label party's checkpoint; each party checks its own
        args, config, out, label_party=federation.label_party, check_parties=False
    )
    # PSI's points, the label party's side of each data party's session (no total: their sizes
    # come later); closed when training starts (a party PSI realigns later adds none).
    aligning = tqdm(
        desc="psi",
        unit="point",
        unit_scale=True,
        disable=_no_bar(args) if config.align == "psi" else True,
        leave=False,
    )

    bar: Any = None

    def started(total: int) -> None:
        nonlocal bar
        aligning.close()
        bar = tqdm(total=total, desc=config.method, unit="step", disable=_no_bar(args), leave=False)

    with _printed_warnings() as noted, _capture(args.capture, args, out=out) as capture:
        try:
            result = train_deployed(
                config,
                federation,
                args.name,
                **_label_party_options(args),
                on_start=started,
                on_step=lambda step, loss: bar.update(step - bar.n),  # resumed: past step 0
                psi=_psi_roles(progress=aligning.update),
                checkpoints=checkpoints,
                model_dir=out / MODEL_DIR,
                privacy=engine,
                capture=capture,
            )
        finally:
            aligning.close()
            if bar is not None:
                bar.close()
    manifest, _ = read_manifest(out / MODEL_DIR)
    payload = result.to_json()
    payload["config"]["federation"] = str(args.federation)
    payload["warnings"] = list(dict.fromkeys([*noted, *result.warnings]))
    payload["model"] = {"directory": str(out / MODEL_DIR), "run_id": manifest.run_id}
    if checkpoints is not None:
        payload["checkpoints"] = _checkpoints_payload(checkpoints)
    with _finishing():
        with _unfinished(out, "result.json"):
            plots = write_run_plots(payload, out)
            atomic_write_json(out / "result.json", payload)
        store.add(payload, kind="train", out_dir=out)
    print(_summary(result, out, payload))
    print(_deployed_model_line(manifest, out / MODEL_DIR))
    print("plots: " + ", ".join(str(path) for path in plots))
    _print_warnings(payload["warnings"], printed=noted)
    return 0


def _label_party_options(args: argparse.Namespace) -> dict[str, Any]:
    """What the label party of a deployment takes from the network and secure-sum flags."""
    return {
        "secure_agg": args.secure_agg,
        "secure_sums": _secure_sums,
        "deadline": args.deadline,
        "wait": args.wait,
        "insecure": args.insecure,
    }


def _deployed_model_line(manifest: Any, directory: Path) -> str:
    """Where a deployed run's model lies: the label party's part and the manifest here, every
    data party's part at that party, none for a party lost in training."""
    from secure_vfl.saved_model import KEPT_BY_PARTY, LOST

    kept = [e.name for e in manifest.parties if e.location == KEPT_BY_PARTY]
    lost = [e.name for e in manifest.parties if e.location == LOST]
    line = f"model: {directory} (manifest and {manifest.parties[0].name}'s part)"
    if kept:
        line += f"; kept by {', '.join(kept)} (each in its --model-dir, NAME/{manifest.run_id}/)"
    if lost:
        line += f"; no part of {', '.join(lost)} (lost in training)"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:  # what is still buffered must meet a closed pipe here, not at exit
            sys.stdout.flush()
    except BrokenPipeError:
        return _closed_pipe()


def _printable(text: str) -> str:
    """``text`` with every character a terminal would act on (escape sequences, carriage
    returns, other control characters) shown escaped, newlines and tabs kept: an error may quote
    what a file or another party chose."""
    if text.isprintable():
        return text
    return "".join(
        char if char.isprintable() or char in "\n\t" else repr(char)[1:-1] for char in text
    )


class _PretrainingBars:
    """One progress bar per party while it pretrains its bottom model (SimSiam, before training
    starts): the hook :func:`~secure_vfl.models.simsiam.pretrain_progress` installs."""

    def __init__(self, args: argparse.Namespace, method: str) -> None:
        self._disable = _no_bar(args)
        self._method = method
        self._bar: Any = None
        self._party = ""

    def __call__(self, party: str, done: int, total: int) -> None:
        from tqdm import tqdm

        if party != self._party or self._bar is None:
            self.close()
            self._party = party
            self._bar = tqdm(
                total=total,
                desc=f"{self._method} pretraining {party}",
                unit="batch",
                disable=self._disable,
                leave=False,
            )
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _no_bar(args: argparse.Namespace) -> bool | None:
    """tqdm's ``disable``: off with ``--quiet``; otherwise shown only when stderr is a terminal
    (None), so a log file gets no carriage-return frames."""
    return True if args.quiet else None


class Terminated(BaseException):
    """SIGTERM arrived (``kill``, systemd, docker, a batch scheduler): raised in the main thread,
    like KeyboardInterrupt on Ctrl-C, so that a file or directory being written is removed and
    a sweep's workers are stopped, rather than the process dying where it stands."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


STOPPED = "what it had written stays, each file whole; nothing half-written is left"


@contextmanager
def _finishing() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a command writes what it produced (the model, result.json,
    plots, the results store's rows): one that arrives then is acted on once the last of them
    is written (a second one stops it at once), so a stopped command leaves its run either
    unwritten or whole. Stopped between two of those files, it left a run that neither a rerun
    nor --resume would take (a model without result.json, a result.json without its store row,
    a sweep with part of its rows)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def stop(number: int) -> NoReturn:
        raise KeyboardInterrupt if number == signal.SIGINT else Terminated

    def hold(number: int, frame: object) -> None:
        if held:  # asked twice (writes that hang, a full NFS mount): stop where it stands
            stop(number)
        held.append(number)

    previous = {signum: signal.signal(signum, hold) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        stop(held[0])


@contextmanager
def _unfinished(out: Path, marker: str) -> Iterator[None]:
    """Where writing a run's outputs fails before its ``marker`` (``result.json``: what marks a
    finished run, written last) is written: say that the run is not finished, and how to go on
    (a model already written makes a rerun refuse without --overwrite). A written ``marker``
    with its plots or model missing read as a finished run, which a rerun refused."""
    try:
        yield
    except OutputError as error:
        raise OutputError(
            f"{error} This run is not finished (its {marker} was not written): run the "
            f"command again once it can write to {out}, with --overwrite if it refuses what this "
            "one left there."
        ) from error


class _LogLines(logging.Handler):
    """The packages' log records at WARNING and above as the command's own lines
    (``secure-vfl: warning: ...``, as its run warnings print), on the ``sys.stderr`` of the
    moment (as logging's last resort writes them, which tests capture). Installed for the
    command's run only: a library user's logging stays theirs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = _printable(record.getMessage())
            print(f"secure-vfl: {record.levelname.lower()}: {text}", file=sys.stderr, flush=True)
        except Exception:  # logging's own policy: a handler never raises
            self.handleError(record)


LOGGED_PACKAGES = ("secure_vfl", "protocols", "attacks")


@contextmanager
def _log_lines() -> Iterator[None]:
    handler = _LogLines()
    loggers = [logging.getLogger(name) for name in LOGGED_PACKAGES]
    for logger_ in loggers:
        logger_.addHandler(handler)
    try:
        yield
    finally:
        for logger_ in loggers:
            logger_.removeHandler(handler)


def _main(argv: Sequence[str] | None) -> int:
    with _log_lines():
        return _main_logged(argv)


def _main_logged(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    import signal
    import threading

    catch = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if catch else None
    made: list[Path] = []
    token = MADE.set(made)  # a default --out joins them (_run_out)
    held: list[Callable[[], None]] = []
    held_token = HELD.set(held)
    try:
        args = parser.parse_args(argv)  # in here: a flag's type may meet an OS refusal
        made += _paths_to_make(args)
        try:
            return _run_command(args)
        except BaseException:
            _release(held)  # first: a lock's file is what would keep its folder
            _remove_if_empty(made)
            raise
        finally:
            _release(held)
    except SecureVFLError as error:
        print(f"secure-vfl: error: {_printable(str(error))}", file=sys.stderr)
        return _exit_status(error)
    except BrokenPipeError:
        raise
    except OSError as error:  # the machine refused a file operation: say which, as tools do
        where = f"{error.filename}: " if error.filename else ""
        print(f"secure-vfl: error: {_printable(where)}{error.strerror or error}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"secure-vfl: interrupted; {STOPPED}.", file=sys.stderr)
        return 130
    except Terminated:
        print(f"secure-vfl: terminated; {STOPPED}.", file=sys.stderr)
        return 143
    finally:
        MADE.reset(token)
        HELD.reset(held_token)
        if catch and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_command(args: argparse.Namespace) -> int:
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "train": run_train,
        "impute": run_impute,
        "attack": run_attack_command,
        "sweep": run_sweep_command,
        "psi": run_psi_command,
        "predict": run_predict,
        "fill": run_fill,
        "runs": run_runs,
        "capture": run_capture,
        "certs": run_certs_command,
        "party": run_party_command,
        "datasets": run_datasets,
    }
    return commands[args.command](args)


def _exit_status(error: SecureVFLError) -> int:
    """EXIT_FAILED where what was asked could not be done here: a party it needs is gone (a
    TransportError), or the operating system refused a file operation behind ``error`` (an
    OSError of :data:`REFUSALS` among its causes: a file the user may not read, a full disk),
    whichever module turned it into a message; EXIT_USAGE for every other error."""
    from secure_vfl.errors import TransportError

    if isinstance(error, TransportError):
        return EXIT_FAILED
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in REFUSALS:
            return EXIT_FAILED
        seen = seen.__cause__ or seen.__context__
    return EXIT_USAGE


MADE: ContextVar[list[Path] | None] = ContextVar("made", default=None)
"""The paths the command running in :func:`_main` makes, which it removes again if it fails
and left them empty."""
OUTPUT_FLAGS = ("out", "store", "capture", "checkpoint_dir", "model_dir", "imputed_dir", "cache")


HELD: ContextVar[list[Callable[[], None]] | None] = ContextVar("held", default=None)
"""How to release the output folders' locks that the command running in :func:`_main` holds."""


def _lock_out(out: Path) -> None:
    """Take ``out``'s lock (:func:`secure_vfl.io.lock_directory`) until the command ends: then
    :func:`_main` releases it (outside it, the process's end does)."""
    from secure_vfl.io import lock_directory

    release = lock_directory(out, "--out")
    held = HELD.get()
    if held is not None:
        held.append(release)


def _release(held: list[Callable[[], None]]) -> None:
    while held:
        held.pop()()


def _run_out(args: argparse.Namespace, default: Path) -> Path:
    """``--out``, or ``default`` where it was not given: then noted, if it is new, among the
    paths that a failed command removes again when it left them empty (:func:`_main`)."""
    if args.out is not None:
        return Path(args.out)
    made = MADE.get()
    if made is not None:
        made.extend(_missing_top(default))
    return default


def _missing_top(path: Path) -> list[Path]:
    """The topmost path that writing ``path`` makes (itself or its highest missing folder);
    none where it exists, or where the system refuses the name."""
    try:
        if path.exists() or path.is_symlink():
            return []
        while path.parent != path and not path.parent.exists():
            path = path.parent
    except OSError:  # a name the system refuses: nothing can be made there
        return []
    return [path]


def _paths_to_make(args: argparse.Namespace) -> list[Path]:
    """For each output flag of ``args`` whose path does not exist yet, the topmost path that
    writing it makes (the path, or its highest missing folder)."""
    made = []
    for flag in OUTPUT_FLAGS:
        value = getattr(args, flag, None)
        if isinstance(value, (str, Path)):
            made += _missing_top(Path(value))
    return made


def _remove_if_empty(paths: Sequence[Path]) -> None:
    """Remove what a failed command made at ``paths`` and left without content: a folder with
    no file below it, or an empty file (an --out folder made for results never written, a
    results store the system would not let it fill)."""
    import shutil

    for path in paths:
        try:
            if path.is_symlink():
                continue
            if path.is_file() and path.stat().st_size == 0:
                path.unlink()
            elif path.is_dir() and all(
                inner.is_dir() and not inner.is_symlink() for inner in path.rglob("*")
            ):
                shutil.rmtree(path)
        except OSError:  # the system that failed the command may refuse this too
            continue


def _closed_pipe() -> int:
    """The reader of stdout went away (``secure-vfl ... | head``): stop quietly, as Unix tools
    do. Python would otherwise report the error again when it flushes stdout at exit, so
    stdout is pointed at devnull first."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing to redirect
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
