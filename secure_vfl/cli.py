"""The ``secure-vfl`` command line (also ``python -m secure_vfl``).

Every flag is validated before anything is written: a bad value prints one line saying what was
expected and what was found, and the command exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from secure_vfl import methods
from secure_vfl.errors import ConfigError, IntegrityError, SecureVFLError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


SECURE_AGGREGATORS = ["none", "masks", "paillier", "ckks"]
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


positive_int = _number(int, "a positive integer", lambda v: v >= 1)
non_negative_int = _number(int, "a non-negative integer", lambda v: v >= 0)
probability = _number(float, "a probability in [0, 1)", lambda v: 0 <= v < 1)
positive_float = _number(float, "a positive number", lambda v: v > 0)
parties_count = _number(int, "an integer number of parties in [2, 10]", lambda v: 2 <= v <= 10)
clients_count = _number(int, "an integer number of clients in [2, 64]", lambda v: 2 <= v <= 64)
share = _number(float, "a share in (0, 1]", lambda v: 0 < v <= 1)
open_probability = _number(float, "a probability in (0, 1)", lambda v: 0 < v < 1)


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


def _imputer_names() -> list[str]:
    from secure_vfl.methods.imputation import IMPUTERS

    return IMPUTERS.names()


def attack_option(text: str) -> tuple[str, float | str]:
    """``KEY=VALUE`` of ``--attack-option``: a parameter name and its value, a number where it
    reads as one (an int if written as one), else the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier() or not value:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. gamma=2. Found {text!r}.")
    if value.lstrip("-").isdigit():
        return key, int(value)
    try:
        return key, float(value)
    except ValueError:
        return key, value


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"expected an existing file, found {text!r}")
    return path


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
        "anyone who knows the seed can remove the noise (default: secure, OS-keyed ChaCha20)",
    )


def _training_flags(parser: argparse.ArgumentParser) -> None:
    """The data, method, privacy and output flags of a training run (``train`` and ``attack``)."""
    parser.add_argument("--method", required=True, choices=methods.METHODS.names())
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", help="a registered dataset (see `secure-vfl datasets`)")
    source.add_argument(
        "--party-file",
        type=existing_file,
        action="append",
        metavar="PATH",
        help="one CSV/Parquet file per party: an `id` column and that party's features",
    )
    parser.add_argument(
        "--label-file",
        type=existing_file,
        metavar="PATH",
        help="CSV/Parquet with `id` and `label` (with --party-file)",
    )
    parser.add_argument(
        "--align",
        choices=["join", "psi"],
        default="join",
        help="how party files are aligned by id: plain join (insecure) or PSI over X25519",
    )
    parser.add_argument("--parties", type=parties_count, default=4, metavar="K")
    missing_train = parser.add_mutually_exclusive_group()
    missing_train.add_argument(
        "--p-miss-train",
        type=probability,
        metavar="P",
        help="MCAR probability that a block is missing in training",
    )
    missing_train.add_argument(
        "--missing-train",
        type=mechanism,
        metavar="MECH",
        help="mcar:P | mcar:P1,..,PK | beta | dirichlet:A | mar1 | mar2 | mnar:P",
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
        help="a test missingness mechanism (repeatable)",
    )
    parser.add_argument("--heads", choices=["all", "active"], default="all")
    parser.add_argument("--batching", choices=["grouped", "mixed"], default="mixed")
    parser.add_argument("--epochs", type=positive_int, default=20, metavar="N")
    parser.add_argument("--batch-size", type=positive_int, default=128, metavar="B")
    parser.add_argument("--lr", type=positive_float, default=0.03)
    parser.add_argument(
        "--representation-dim",
        type=positive_int,
        default=128,
        metavar="D",
        help="width of every bottom model's output (default 128)",
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
        help="keep N training labels (a seeded random subset); the other rows are unlabelled",
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
        help="secure sums of representations (laser --heads active): pairwise masks, Paillier "
        "or CKKS; the label party learns only sums over >= 2 other parties",
    )
    privacy = parser.add_argument_group("differential privacy (protocols.dp, Opacus accountant)")
    privacy.add_argument(
        "--dp-embeddings",
        type=noise_spec,
        metavar="SIGMA:CLIP",
        help="clip + Gaussian noise on every representation (protects features)",
    )
    privacy.add_argument(
        "--dp-gradients",
        type=noise_spec,
        metavar="SIGMA:CLIP",
        help="clip + Gaussian noise on every gradient sent back (protects labels)",
    )
    privacy.add_argument(
        "--dp-sgd",
        type=noise_spec,
        metavar="SIGMA:CLIP",
        help="DP-SGD (Opacus) of every data party's bottom model",
    )
    privacy.add_argument(
        "--target-epsilon",
        type=positive_float,
        metavar="E",
        help="calibrate SIGMA so that no party spends more than E",
    )
    privacy.add_argument("--delta", type=open_probability, default=1e-5, metavar="D")
    privacy.add_argument(
        "--dp-adjacency",
        choices=["replace-one", "add-remove"],
        default="replace-one",
        help="neighbouring datasets of the guarantees against the receivers of messages: "
        "replace one record (its features and, at the label party, its label; the default) "
        "or add/remove one record",
    )
    _insecure_noise_flag(privacy)
    parser.add_argument("--seed", type=non_negative_int, default=0, metavar="S")
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="output directory (default runs/METHOD-DATASET-sSEED)",
    )
    parser.add_argument(
        "--store",
        type=Path,
        metavar="PATH",
        help="SQLite results store (default: results.sqlite beside DIR)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DIR/result.json")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    _capture_option(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="secure-vfl", description=__doc__.splitlines()[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = commands.add_parser("train", help="train a VFL method and evaluate it")
    _training_flags(train)

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
        help="a parameter of the attack, e.g. target=1, gamma=2 or swap=target (repeatable)",
    )
    attack.add_argument(
        "--attacker",
        default="party-1",
        metavar="PARTY",
        help="the party that attacks (default party-1, a passive data party)",
    )
    attack.add_argument(
        "--defense",
        action="append",
        default=[],
        metavar="SPEC",
        help="dp-gradients:SIGMA:CLIP | dp-embeddings:SIGMA:CLIP | dp-sgd:SIGMA:CLIP | "
        "secure-agg:BACKEND (the same mechanisms as train's flags) | "
        "gradient-sparsification:FRACTION | marvell:SCALE | norm-filter[:Z] (repeatable)",
    )
    attack.add_argument(
        "--control",
        action="store_true",
        help="the negative control: the attacker's signal is destroyed (it must sit at chance)",
    )
    attack.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="where the undefended runs behind the DCS are kept (default: DIR/../.undefended)",
    )
    _training_flags(attack)

    sweep = commands.add_parser(
        "sweep",
        help="a privacy-utility sweep: one attack against a grid of defense settings",
        description="Run one attack against every setting of the defense templates (and "
        "undefended) at several seeds, as independent runs in parallel; write a table, the "
        "runs in the results store, and plots of main accuracy against epsilon and of the "
        "attack against main accuracy.",
    )
    sweep.add_argument("--attack", required=True, metavar="NAME", help="see `attack --help`")
    sweep.add_argument("--attacker", default="party-1", metavar="PARTY")
    sweep.add_argument(
        "--defense",
        action="append",
        default=[],
        metavar="TEMPLATE",
        help="a defense with placeholders, e.g. dp-gradients:SIGMA:0.01 (repeatable)",
    )
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME=V1,V2,..",
        help="the values of a placeholder, e.g. SIGMA=0,0.1,0.3,1,3 (repeatable)",
    )
    sweep.add_argument("--seeds", type=positive_int, default=3, metavar="N")
    sweep.add_argument(
        "--workers", type=positive_int, metavar="W", help="parallel runs (default: CPUs, <= 4)"
    )
    sweep.add_argument(
        "--executor",
        choices=["process", "ray"],
        default="process",
        help="worker processes on this machine, or Ray tasks (optional extra: secure-vfl[ray])",
    )
    _training_flags(sweep)

    impute = commands.add_parser(
        "impute", help="federated imputation across clients with different feature schemas"
    )
    impute.add_argument("--method", required=True, choices=_imputer_names())
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
    impute.add_argument("--clients", type=clients_count, default=4, metavar="K")
    impute.add_argument(
        "--availability",
        type=share,
        default=0.6,
        metavar="A",
        help="share of the features each client keeps (with --dataset)",
    )
    impute.add_argument("--rounds", type=positive_int, default=30, metavar="R")
    impute.add_argument(
        "--client-fraction",
        type=share,
        default=1.0,
        metavar="C",
        help="share of the clients sampled for each FedAvg round",
    )
    impute.add_argument("--local-epochs", type=positive_int, default=2, metavar="E")
    impute.add_argument("--batch-size", type=positive_int, default=16, metavar="B")
    impute.add_argument("--lr", type=positive_float, default=1e-3)
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
        "SIGMA*CLIP to every statistics sum (shared among the clients under --secure-agg)",
    )
    impute_privacy.add_argument(
        "--target-epsilon",
        type=positive_float,
        metavar="E",
        help="calibrate SIGMA so that no client spends more than E on the statistics",
    )
    impute_privacy.add_argument(
        "--feature-ranges",
        type=existing_file,
        metavar="CSV",
        help="declared per-feature ranges (columns feature, lower, upper) that values are "
        "clipped to; default: the observed training ranges, which are not private",
    )
    impute_privacy.add_argument("--delta", type=open_probability, default=1e-5, metavar="D")
    _insecure_noise_flag(impute_privacy)
    impute.add_argument("--seed", type=non_negative_int, default=0, metavar="S")
    impute.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="output directory (default runs/impute-METHOD-DATASET-sSEED)",
    )
    impute.add_argument(
        "--store",
        type=Path,
        metavar="PATH",
        help="SQLite results store (default: results.sqlite beside DIR)",
    )
    impute.add_argument(
        "--save-imputed",
        action="store_true",
        help="also write each client's imputed table to DIR/imputed/",
    )
    impute.add_argument("--overwrite", action="store_true", help="replace DIR/result.json")
    impute.add_argument("--quiet", action="store_true", help="no progress bar")
    _capture_option(impute)

    datasets = commands.add_parser("datasets", help="list datasets, or install them")
    datasets.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    datasets.add_argument("names", nargs="*", metavar="NAME")
    datasets.add_argument("--all", action="store_true", help="with install: every dataset")

    psi = commands.add_parser(
        "psi", help="private set intersection of two id files (both roles in-process)"
    )
    psi.add_argument("--mine", required=True, type=existing_file, help="CSV: this side's ids")
    psi.add_argument("--theirs", required=True, type=existing_file, help="CSV: the peer's ids")
    psi.add_argument("--id-column", default="id", help="column holding the ids (default: id)")
    psi.add_argument("--mode", choices=["intersection", "cardinality"], default="intersection")
    psi.add_argument("--out", type=Path, help="write the intersecting ids here (one per line)")
    _capture_option(psi)
    return parser


def _capture_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--capture",
        type=Path,
        metavar="FILE",
        help="append every message that crosses the transport to FILE, one record each: a "
        "4-byte big-endian length, then the encoded message (what the network sees)",
    )


@contextmanager
def _capture(path: Path | None) -> Iterator[BinaryIO | None]:
    """The open capture file of ``--capture`` (appended to), or None."""
    if path is None:
        yield None
        return
    if path.is_dir():
        raise ConfigError(f"--capture expects a file path. Found the directory {path}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as handle:
        yield handle


def _read_ids(path: Path, column: str) -> list[str]:
    import csv

    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or column not in reader.fieldnames:
            raise ConfigError(
                f"expected a column {column!r} in {path}. Found columns {reader.fieldnames}."
            )
        return [row[column] for row in reader]


def run_psi_command(args: argparse.Namespace) -> int:
    """`secure-vfl psi`: DH-PSI of --mine against --theirs; --mine's side learns the result."""
    from protocols.psi import run_psi
    from secure_vfl.federation.channel import Channel, InProcessTransport
    from secure_vfl.io import atomic_write_text

    if args.mode == "cardinality" and args.out is not None:
        raise ConfigError("--out needs --mode intersection; cardinality mode reveals only a size.")
    mine = _read_ids(args.mine, args.id_column)
    theirs = _read_ids(args.theirs, args.id_column)
    with _capture(args.capture) as capture:
        channel = Channel(transport=InProcessTransport(capture=capture))
        result = run_psi(mine, theirs, mode=args.mode, channel=channel)
    print(f"intersection size: {result.size} (of {len(mine)} mine, {result.peer_size} theirs)")
    if result.indices is not None and args.out is not None:
        atomic_write_text(args.out, "".join(f"{mine[i]}\n" for i in result.indices))
        print(f"intersecting ids written to {args.out}")
    return 0


def _train_config(args: argparse.Namespace) -> Any:
    from secure_vfl.experiment import TrainConfig

    if args.party_file and args.label_file is None:
        raise ConfigError("--party-file needs --label-file PATH. Found no label file.")
    if args.label_file is not None and not args.party_file:
        raise ConfigError("--label-file goes with --party-file. Found a dataset instead.")
    train_missing = args.missing_train or f"mcar:{args.p_miss_train or 0.0:g}"
    tests = [f"mcar:{p:g}" for p in args.p_miss_test or []] + list(args.missing_test or [])
    method_config = methods.MethodConfig(
        heads=args.heads,
        batching=args.batching,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        representation_dim=args.representation_dim,
        top_model=args.top_model,
        standard_incomplete=args.standard_incomplete,
        secure_sums=args.secure_agg != "none",
        labeled=args.labeled,
        pretrain_epochs=args.pretrain_epochs,
    )
    false_vfl = None
    latent_flags = {"--kappa": args.kappa, "--inference-samples": args.inference_samples}
    if args.method.startswith("false-vfl"):
        from secure_vfl.methods.false_vfl import FalseVflConfig

        false_vfl = FalseVflConfig(
            kappa=args.kappa or 10, inference_samples=args.inference_samples or 50
        )
    elif any(value is not None for value in latent_flags.values()):
        given = [flag for flag, value in latent_flags.items() if value is not None]
        raise ConfigError(
            f"{', '.join(given)} apply to --method false-vfl-1 or false-vfl-2. "
            f"Found --method {args.method}."
        )
    return TrainConfig(
        false_vfl=false_vfl,
        method=args.method,
        dataset=args.dataset,
        party_files=tuple(args.party_file or ()),
        label_file=args.label_file,
        parties=args.parties if not args.party_file else len(args.party_file),
        train_missing=train_missing,
        test_missing=tuple(tests) if tests else ("mcar:0", "mcar:0.5"),
        align=args.align,
        seed=args.seed,
        method_config=method_config,
    )


def _summary(result: Any, out: Path) -> str:
    labeled = result.config["method_config"]["labeled"]
    labeled_text = f", {labeled} labelled" if labeled is not None else ""
    lines = [
        f"{result.method} on {result.dataset} (train {result.config['train_missing']}, "
        f"{result.samples['train']} training samples{labeled_text}) in "
        f"{result.wall_time_s:.1f} s",
        f"{'test missingness':<20}{'accuracy %':>12}{'F1 x100':>10}",
    ]
    for name, values in result.metrics.items():
        lines.append(f"{name:<20}{values['accuracy']:>12.2f}{values['f1']:>10.2f}")
    if result.privacy is not None:
        lines.extend(_privacy_lines(result.privacy))
    lines.append(f"result: {out / 'result.json'}")
    return "\n".join(lines)


def _privacy_lines(privacy: dict[str, Any]) -> list[str]:
    """The summary's privacy lines: each party's epsilon, its adjacency and sampling, and a
    warning when the noise was reproducible from the seed."""
    spent = ", ".join(f"{p} {e:.2f}" for p, e in sorted(privacy["epsilon"].items()))
    sampling = privacy["sampling"]
    drawn = f", Poisson rate {sampling['rate']:.4g}" if sampling["kind"] == "poisson" else ""
    lines = [
        f"epsilon (delta {privacy['delta']:g}, {privacy['adjacency']}{drawn}; largest "
        f"guarantee per party, see result.json): {spent}"
    ]
    if privacy["insecure_reproducible_noise"]:
        lines.append(
            "WARNING: --insecure-reproducible-noise: the noise is reproducible from the seed; "
            "these epsilons do not hold against anyone who knows it."
        )
    return lines


def _impute_privacy_engine(args: argparse.Namespace) -> Any:
    """The privacy engine of ``impute``'s flags: the secure-sum backend and the statistics'
    DP with its accounting, chosen in one place (:class:`protocols.privacy.PrivacyEngine`)."""
    from protocols.privacy import PrivacyEngine, PrivacySpec

    return PrivacyEngine(
        PrivacySpec(
            secure_agg=args.secure_agg,
            dp_statistics=args.dp_statistics,
            feature_ranges=args.feature_ranges,
            target_epsilon=args.target_epsilon,
            delta=args.delta,
            insecure_reproducible_noise=args.insecure_reproducible_noise,
            seed=args.seed,
        )
    )


def _privacy_spec(args: argparse.Namespace) -> Any:
    """The protection asked for by ``train``'s flags: alignment, secure sums, DP."""
    from protocols.privacy import PrivacySpec

    return PrivacySpec(
        align=args.align,
        secure_agg=args.secure_agg,
        dp_embeddings=args.dp_embeddings,
        dp_gradients=args.dp_gradients,
        dp_sgd=args.dp_sgd,
        target_epsilon=args.target_epsilon,
        delta=args.delta,
        adjacency=args.dp_adjacency,
        insecure_reproducible_noise=args.insecure_reproducible_noise,
        seed=args.seed,
    )


def _privacy_engine(args: argparse.Namespace) -> Any:
    """The privacy engine of ``train``'s flags: alignment, secure sums, DP and its accounting,
    chosen in one place (:class:`protocols.privacy.PrivacyEngine`)."""
    from protocols.privacy import PrivacyEngine

    return PrivacyEngine(_privacy_spec(args))


def run_train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from secure_vfl.data.datasets import DATASETS
    from secure_vfl.experiment import prepare_data, run_training
    from secure_vfl.federation.channel import Channel, InProcessTransport
    from secure_vfl.io import atomic_write_json
    from secure_vfl.store import ResultsStore

    engine = _privacy_engine(args)
    config = _train_config(args)
    engine.refuse(config.method, batching=config.method_config.batching)  # before any data
    if config.dataset is not None:
        spec = DATASETS.get(config.dataset)
        if not spec.is_installed():
            raise ConfigError(f"dataset {config.dataset!r} is not installed. {spec.install_hint()}")
    out: Path = args.out or Path("runs") / f"{config.method}-{config.data_name}-s{config.seed}"
    if (out / "result.json").exists() and not args.overwrite:
        raise ConfigError(
            f"{out / 'result.json'} exists; expected a new --out directory (or --overwrite)."
        )
    store = ResultsStore(args.store or out.parent / "results.sqlite")
    channel = Channel()
    bar: Any = None

    def on_start(total: int) -> None:
        nonlocal bar
        bar = tqdm(total=total, desc=config.method, unit="step", disable=args.quiet, leave=False)

    def on_step(step: int, loss: float) -> None:
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss:.3f}")

    with _capture(args.capture) as capture:
        # PSI's messages go to the capture too, but their bytes are not training traffic.
        alignment = Channel(transport=InProcessTransport(capture=capture))
        data = prepare_data(config, aligner=engine.aligner(alignment))
        channel.transport = InProcessTransport(capture=capture)
        try:
            result = run_training(
                config,
                data=data,
                channel=channel,
                privacy=engine,
                on_start=on_start,
                on_step=on_step,
            )
        except IntegrityError as error:
            if not engine.private:
                raise
            raise IntegrityError(
                f"training diverged under the DP noise ({error}); expected a smaller SIGMA, a "
                "CLIP on the scale of what is clipped (gradient rows are ~1/batch), or a lower "
                "--lr."
            ) from None
        finally:
            if bar is not None:
                bar.close()
    atomic_write_json(out / "result.json", result.to_json())
    store.add(result.to_json(), kind="train", out_dir=out)
    print(_summary(result, out))
    return 0


def run_attack_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from attacks.runner import run_attack
    from secure_vfl.io import atomic_write_json
    from secure_vfl.store import ResultsStore

    config = _train_config(args)
    if args.capture is not None:
        raise ConfigError("--capture applies to train, impute and psi; found it with attack.")
    if args.align != "join":
        raise ConfigError(f"attack runs on a registered dataset; found --align {args.align}.")
    if args.suite is not None:
        return _run_suite_command(args, config)
    name = args.attack
    out: Path = args.out or Path("runs") / f"attack-{name}-{config.method}-{config.data_name}"
    if (out / "result.json").exists() and not args.overwrite:
        raise ConfigError(
            f"{out / 'result.json'} exists; expected a new --out directory (or --overwrite)."
        )
    store = ResultsStore(args.store or out.parent / "results.sqlite")
    bar: Any = None

    def on_start(total: int) -> None:
        nonlocal bar
        bar = tqdm(total=total, desc=name, unit="step", disable=args.quiet, leave=False)

    def on_step(step: int, loss: float) -> None:
        bar.update(1)

    try:
        result = run_attack(
            config,
            name,
            options=dict(args.attack_option),
            attacker=args.attacker,
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
    payload = result.to_json()
    atomic_write_json(out / "result.json", payload)
    training = payload["training"]
    store.add(
        {**training, "metrics": {"main": payload["main"], "attack": payload["attack"]}},
        kind=f"attack:{name}",
        out_dir=out,
    )
    print(_attack_summary(result, out))
    return 0


def run_sweep_command(args: argparse.Namespace) -> int:
    from attacks.sweep import parse_grid, run_sweep, write_sweep
    from secure_vfl.store import ResultsStore

    config = _train_config(args)
    if args.capture is not None or args.align != "join":
        raise ConfigError("sweep runs on a registered dataset, without --capture or --align.")
    given = [
        flag
        for flag, value in (
            ("--secure-agg", args.secure_agg != "none"),
            ("--dp-embeddings", args.dp_embeddings is not None),
            ("--dp-gradients", args.dp_gradients is not None),
            ("--dp-sgd", args.dp_sgd is not None),
            ("--target-epsilon", args.target_epsilon is not None),
        )
        if value
    ]
    if given:
        raise ConfigError(
            f"a sweep's defenses are its --defense templates; found {', '.join(given)} "
            "(e.g. --defense secure-agg:masks, --defense dp-gradients:SIGMA:0.01)."
        )
    out: Path = args.out or Path("runs") / f"sweep-{args.attack}-{config.method}-{config.data_name}"
    if (out / "sweep.json").exists() and not args.overwrite:
        raise ConfigError(
            f"{out / 'sweep.json'} exists; expected a new --out directory (or --overwrite)."
        )
    store = ResultsStore(args.store or out.parent / "results.sqlite")
    rows = run_sweep(
        config,
        args.attack,
        templates=args.defense,
        grid=parse_grid(args.grid),
        seeds=args.seeds,
        attacker=args.attacker,
        workers=args.workers,
        executor=args.executor,
        cache=out.parent / ".undefended",
    )
    command = "secure-vfl " + " ".join(sys.argv[1:]) if sys.argv[1:] else "secure-vfl sweep"
    text, plots = write_sweep(rows, out, attack=args.attack, command=command)
    for row in rows:
        if row["failed"] is not None:
            print(f"{row['defense']} seed {row['seed']}: {row['failed']}", file=sys.stderr)
            continue
        training = row["training"]
        store.add(
            {
                **training,
                "config": {**training["config"], "defense": row["defense"]},
                "metrics": {"main": {"accuracy": row["main_accuracy"]}, "attack": row["attack"]},
            },
            kind=f"sweep:{args.attack}",
            out_dir=out,
        )
    print(text)
    print("plots: " + ", ".join(str(p) for p in plots))
    return 0


def _run_suite_command(args: argparse.Namespace, config: Any) -> int:
    from attacks.suite import markdown, run_suite
    from secure_vfl.io import atomic_write_json, atomic_write_text
    from secure_vfl.store import ResultsStore

    out: Path = args.out or Path("runs") / f"suite-{config.method}-{config.data_name}"
    if (out / "suite.json").exists() and not args.overwrite:
        raise ConfigError(
            f"{out / 'suite.json'} exists; expected a new --out directory (or --overwrite)."
        )
    if _privacy_spec(args).noise() or args.secure_agg != "none":
        raise ConfigError(
            "a suite's defenses are its --defense specs (each run on its own); found the "
            "privacy flags of train."
        )
    store = ResultsStore(args.store or out.parent / "results.sqlite")

    def on_run(attack: str, defense: str, result: Any) -> None:
        payload = result.to_json()
        training = payload["training"]
        store.add(
            {
                **training,
                "config": {**training["config"], "defense": defense},
                "metrics": {"main": payload["main"], "attack": payload["attack"]},
            },
            kind=f"suite:{attack}",
            out_dir=out,
        )
        if not args.quiet:
            value = ", ".join(f"{k} {v:.3f}" for k, v in payload["attack"].items())
            print(f"{attack} / {defense}: main {100 * payload['main']['accuracy']:.2f} %, {value}")

    report = run_suite(
        config,
        defenses=args.defense,
        attacker=args.attacker,
        cache=args.cache or out.parent / ".undefended",
        on_run=on_run,
    )
    command = "secure-vfl " + " ".join(sys.argv[1:]) if sys.argv[1:] else "secure-vfl attack"
    text = markdown(report, command=command)
    atomic_write_json(out / "suite.json", report.to_json())
    atomic_write_text(out / "suite.md", text)
    print(text)
    return 0


def _attack_summary(result: Any, out: Path) -> str:
    defenses = ", ".join(result.defenses) or "none"
    lines = [
        f"{result.attack_name} by {result.attacker}"
        f"{' (negative control)' if result.control else ''}; defenses: {defenses}",
        f"main accuracy        {100 * result.main['accuracy']:.2f} % "
        f"(undefended {100 * result.undefended_accuracy:.2f} %)",
    ]
    for metric, value in result.attack.items():
        lines.append(f"attack {metric:<13} {value:.4f}")
    lines.append(f"chance level         {result.chance:.4f}")
    lines.append(f"DCS {result.dcs:.4f}   DCS (AP* = chance) {result.dcs_chance:.4f}")
    if result.privacy is not None:
        lines.extend(_privacy_lines(result.privacy))
    lines.append(f"result: {out / 'result.json'}")
    return "\n".join(lines)


def run_impute(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from secure_vfl.data.imputation import IMPUTATION_DATASETS
    from secure_vfl.experiment import ImputeRunConfig, prepare_imputation_task, run_imputation
    from secure_vfl.federation.channel import Channel, InProcessTransport
    from secure_vfl.io import atomic_write_json
    from secure_vfl.methods.imputation import ImputeConfig
    from secure_vfl.store import ResultsStore

    engine = _impute_privacy_engine(args)
    config = ImputeRunConfig(
        method=args.method,
        dataset=args.dataset,
        client_files=tuple(args.client_file or ()),
        clients=args.clients,
        availability=args.availability,
        seed=args.seed,
        impute_config=ImputeConfig(
            rounds=args.rounds,
            client_fraction=args.client_fraction,
            local_epochs=args.local_epochs,
            batch_size=args.batch_size,
            lr=args.lr,
        ),
    )
    if config.dataset is not None:
        spec = IMPUTATION_DATASETS.get(config.dataset)
        if not spec.is_installed():
            raise ConfigError(f"dataset {config.dataset!r} is not installed. {spec.install_hint()}")
    out: Path = args.out or Path("runs") / (
        f"impute-{config.method}-{config.data_name}-s{config.seed}"
    )
    if (out / "result.json").exists() and not args.overwrite:
        raise ConfigError(
            f"{out / 'result.json'} exists; expected a new --out directory (or --overwrite)."
        )
    store = ResultsStore(args.store or out.parent / "results.sqlite")
    task = prepare_imputation_task(config)
    bar: Any = None

    def on_start(rounds: int) -> None:
        nonlocal bar
        bar = tqdm(total=rounds, desc=config.method, unit="round", disable=args.quiet, leave=False)

    def on_round(round: int, rmse: float) -> None:
        bar.update(1)
        bar.set_postfix(val_rmse=f"{rmse:.3f}")

    with _capture(args.capture) as capture:
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
    if args.save_imputed:
        _save_imputed(out / "imputed", task, imputer)
    atomic_write_json(out / "result.json", result.to_json())
    store.add(result.to_json(), kind="impute", out_dir=out)
    lines = [
        f"{result.method} on {result.dataset} ({len(result.clients)} clients) "
        f"in {result.wall_time_s:.1f} s",
        f"{'client':<20}{'RMSE (std units)':>18}{'hidden entries':>16}",
    ]
    for name, rmse in result.rmse_per_client.items():
        lines.append(f"{name:<20}{rmse:>18.4f}{result.hidden_per_client[name]:>16}")
    lines.append(
        f"{'all clients':<20}{result.rmse:>18.4f}{sum(result.hidden_per_client.values()):>16}"
    )
    if result.privacy is not None:
        lines.extend(_privacy_lines(result.privacy))
    lines.append(f"result: {out / 'result.json'}")
    print("\n".join(lines))
    return 0


def _save_imputed(directory: Path, task: Any, imputer: Any) -> None:
    """Each client's rows (training, then test) with missing-but-available entries filled."""
    import numpy as np
    import pandas as pd

    from secure_vfl.data.imputation import ClientData
    from secure_vfl.io import atomic_write

    for k, (train, test) in enumerate(zip(task.train, task.test, strict=True)):
        rows = ClientData(
            name=train.name,
            values=np.concatenate([train.values, test.values]),
            available=train.available,
        )
        imputed = imputer.impute(k, rows)
        columns = [f for f, keep in zip(task.features, train.available, strict=True) if keep]
        frame = pd.DataFrame(imputed[:, train.available], columns=columns)
        frame.insert(0, "split", ["train"] * train.n + ["test"] * test.n)

        def write(tmp: Path, frame: pd.DataFrame = frame) -> None:
            frame.to_csv(tmp, index=False)

        atomic_write(directory / f"{train.name}.csv", write)


def run_datasets(args: argparse.Namespace) -> int:
    from secure_vfl.data.datasets import DATASETS, dataset_status, install_dataset
    from secure_vfl.data.imputation import (
        IMPUTATION_DATASETS,
        imputation_dataset_status,
        install_imputation_dataset,
    )

    if args.action == "install":
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
    if args.names or args.all:
        raise ConfigError("names and --all go with `datasets install`. Found them with `list`.")
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
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    if hints:
        print("\nto install a missing dataset:")
        print("\n".join(hints))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return run_train(args)
        if args.command == "impute":
            return run_impute(args)
        if args.command == "attack":
            return run_attack_command(args)
        if args.command == "sweep":
            return run_sweep_command(args)
        if args.command == "psi":
            return run_psi_command(args)
        return run_datasets(args)
    except SecureVFLError as error:
        print(f"secure-vfl: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("secure-vfl: interrupted; nothing was written.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
