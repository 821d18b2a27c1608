"""Secure training demo: four organisations train one model on their own files, privately.

Each party gets a file with its own columns of scikit-learn's digits (bundled, offline) under
customer ids, in its own row order and missing some customers; the label party (party-0) also
holds the labels. The same LASER-VFL run (single label party, ``--heads active``) is trained
three times through the ``secure-vfl train`` command:

- in plaintext: ids joined in the clear, representations summed in the clear, no noise;
- with PSI over X25519 for the alignment and secure sums (pairwise masks by default, or
  Paillier / CKKS): the label party learns only sums of fixed blocks of >= 2 other parties
  per sample, so that no combination over the run gives one party's term; LASER trains on the
  unions of each sample's usable blocks and predicts from all of them (the
  ``--release drop`` policy, the default: what a sum cannot hide is dropped; ``--release dp``
  sends it as a DP release instead, which measured worse at epsilon <= 8,
  ``benchmarks/results/release_frontier.md``);
- the same plus differential privacy on the gradients sent back to the data parties (label
  privacy), calibrated so that the label party spends at most ``--target-epsilon`` on its
  labels. The representations get no noise (the secure sums hide them, no DP does), so the
  worst party's epsilon stays inf; the table shows both.

All three train with SGD at learning rate 0.05. The DP run's parties also clip the norm of
each update they step with (``--max-update-norm 1``, post-processing of what they received, so
no privacy cost): without it the noise that ``--target-epsilon 8`` calls for (a gradient
multiplier about 10 for ten epochs, priced per record under replace-one adjacency) blows the
bottom models up within three epochs, and the run stops as diverged. It prints accuracy,
epsilon, bytes per training step and time side by side: about 13 s in all with masks, two
minutes with CKKS (its secure runs about a minute each) on 2 cores.
Paillier (2048-bit) takes about 9 s a training step here, mostly the senders' r^n
obfuscators: around 20 minutes for the default 10 epochs.

    python examples/secure_training_demo.py [--secure-agg masks|paillier|ckks] [--epochs N]
        [--target-epsilon E] [--seed S] [--workdir DIR [--overwrite]]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.datasets import load_digits

from secure_vfl.cli import main as secure_vfl
from secure_vfl.cli import positive_float, positive_int, seed
from secure_vfl.errors import ConfigError
from secure_vfl.io import atomic_write, check_directory
from secure_vfl.runs import columns as table_columns

PARTIES = 4
HELD = 0.9  # share of the customers each data party holds


def write_party_files(directory: Path, rng: np.random.Generator) -> tuple[list[Path], Path]:
    """One CSV per party (``id`` + its columns, its own subset and order) and a label file."""
    features, labels = load_digits(return_X_y=True)
    ids = np.array([f"cust-{i:05d}" for i in range(len(labels))])
    columns = np.array_split(np.arange(features.shape[1]), PARTIES)
    paths = []
    for k, cols in enumerate(columns):
        held = np.sort(rng.choice(len(ids), size=int(HELD * len(ids)), replace=False))
        order = rng.permutation(held)
        table = pd.DataFrame(features[np.ix_(order, cols)], columns=[f"pixel_{c}" for c in cols])
        table.insert(0, "id", ids[order])
        path = directory / f"party-{k}.csv"
        atomic_write(path, partial(_write_csv, table))
        paths.append(path)
    label_path = directory / "labels.csv"
    frame = pd.DataFrame({"id": ids, "label": labels}).sample(frac=1.0, random_state=0)
    atomic_write(label_path, partial(_write_csv, frame))
    return paths, label_path


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    frame.to_csv(path, index=False)


def train(argv: list[str]) -> tuple[dict[str, Any], float]:
    """Run ``secure-vfl train`` quietly; its result.json and its training's seconds (the run's
    own ``wall_time_s``: the whole call would also count, in the first run only, the one-off
    imports, and made the plaintext run look the slowest)."""
    with contextlib.redirect_stdout(io.StringIO()):
        code = secure_vfl(argv)
    if code != 0:
        raise SystemExit(f"secure-vfl train {' '.join(argv)} failed with status {code}")
    out = Path(argv[argv.index("--out") + 1])
    result = json.loads((out / "result.json").read_text())
    return result, float(result["wall_time_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--secure-agg", choices=["masks", "paillier", "ckks"], default="masks")
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--target-epsilon", type=positive_float, default=8.0)
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--workdir", type=Path, help="keep the files and results here")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the files and runs an earlier demo left in --workdir",
    )
    args = parser.parse_args()
    if args.workdir is not None:
        try:  # before the runs, not when their first file is written
            check_directory("--workdir", args.workdir)
        except ConfigError as error:
            parser.error(str(error))
        names = [f"party-{k}.csv" for k in range(PARTIES)] + ["labels.csv"]
        names += [f"run-{i}" for i in range(3)]
        existing = [str(args.workdir / name) for name in names if (args.workdir / name).exists()]
        if existing and not args.overwrite:
            parser.error(
                f"{', '.join(existing[:3])}{' ...' if len(existing) > 3 else ''} exist; expected "
                "a new --workdir (or --overwrite to replace them)."
            )

    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        party_files, label_file = write_party_files(workdir, np.random.default_rng(args.seed))
        common = ["train", "--method", "laser", "--heads", "active", "--quiet", "--overwrite"]
        common += ["--label-file", str(label_file), "--seed", str(args.seed)]
        common += ["--epochs", str(args.epochs), "--lr", "0.05"]
        common += ["--p-miss-test", "0", "--p-miss-test", "0.5"]
        for path in party_files:
            common += ["--party-file", str(path)]
        print(
            f"{PARTIES} parties, each holding {HELD:.0%} of 1797 customers (digits, 64 pixels "
            f"split 16 per party); label party: party-0"
        )
        secure = ["--align", "psi", "--secure-agg", args.secure_agg]
        noise = ["--dp-gradients", "1.0:0.002", "--target-epsilon", str(args.target_epsilon)]
        noise += ["--max-update-norm", "1.0"]  # else the noisy gradients blow the bottoms up
        runs = {
            "plaintext": ["--align", "join"],
            "PSI + secure sums": secure,
            "PSI + secure sums + DP": [*secure, *noise],
        }
        results = {
            name: train([*common, *flags, "--out", str(workdir / f"run-{i}")])
            for i, (name, flags) in enumerate(runs.items())
        }
    print(report(results, args.secure_agg))


def report(results: dict[str, tuple[dict[str, Any], float]], agg: str) -> str:
    """The side-by-side table: one column per run."""

    def column(result: dict[str, Any], seconds: float) -> list[str]:
        privacy = result["privacy"]
        traffic = result["traffic"]
        cells = [
            "PSI" if result["config"]["align"] == "psi" else "join (clear)",
            agg if result["config"]["method_config"]["secure_sums"] else "plain",
            result["config"]["privacy"].get("release", "drop")
            if result["config"]["method_config"]["secure_sums"]
            else "-",
            f"sigma {privacy['noise']['gradient']['sigma']:.2f}" if privacy else "none",
            str(result["samples"]["train"]),
        ]
        cells += [f"{values['accuracy']:.1f} %" for values in result["metrics"].values()]
        cells += [
            _worst_epsilon(privacy),
            f"{max(privacy['epsilon'].values()):.2f}" if privacy and privacy["epsilon"] else "-",
            f"{sum(traffic['bytes_per_step'].values()) / 1e3:.0f} kB",
            f"{seconds:.1f} s",
            f"{traffic['protection_s']:.2f} s",
        ]
        return cells

    first = next(iter(results.values()))[0]
    deltas = [r["privacy"]["delta"] for r, _ in results.values() if r["privacy"]]
    names = ["alignment", "sums of representations", "what a sum cannot hide"]
    names += ["noise on gradients", "training samples"]
    names += [f"accuracy, test {name}" for name in first["metrics"]]
    names += [
        f"epsilon, worst party (delta {deltas[0]:g})" if deltas else "epsilon, worst party",
        "epsilon of what is noised",
        "bytes per training step",
        "time (training)",
        "  of which protection",
    ]
    cells = [column(result, seconds) for result, seconds in results.values()]
    rows = [["", *results], *([name, *(cell[i] for cell in cells)] for i, name in enumerate(names))]
    return "\n".join(table_columns(rows))


def _worst_epsilon(privacy: dict[str, Any] | None) -> str:
    """The largest epsilon of any party: inf without DP, and inf where a party's releases have
    no guarantee (they cross in the clear: the secure sums hide them, no noise does)."""
    if not privacy or privacy.get("unguarded"):
        return "inf"
    return f"{max(privacy['epsilon'].values()):.2f}"


if __name__ == "__main__":
    main()
