"""Three organisations' own files to try `train` and `predict` on (breast-cancer columns).

Writes into DIR: `bank.csv`, `retailer.csv`, `insurer.csv` (an `id` column and ten of
scikit-learn's bundled breast-cancer columns each), `labels.csv` (`id`, `label` as the text
"benign"/"malignant") for 380 ids, `held_out.csv` with 80 more ids for `--test-file`, and
`new/` with the other 109 ids as new rows to score: each file in its own row order, and the
retailer's without 10 of them. Each file is written whole or not at all, and files already
in DIR are kept unless `--overwrite`. Offline; takes a second.

With `--messy` the files are as users often have them: the ids in a column `customer` and the
labels in `outcome`, the bank's first column a text category (`segment`: low, mid, high; three
new rows show `vip`, never seen in training) and about 5 % of the retailer's cells empty
(train with `--id-column customer --label-column outcome`).

    python examples/own_party_files.py --out DIR [--seed S] [--messy] [--overwrite]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.datasets import load_breast_cancer

from secure_vfl.cli import seed
from secure_vfl.errors import ConfigError, OutputError
from secure_vfl.io import atomic_write, check_directory, writable_file

PARTIES = ("bank", "retailer", "insurer")


def write_party_files(
    out: Path, *, seed: int = 0, messy: bool = False, replace: bool = True
) -> None:
    """Write the training, held-out and new rows of the three parties into ``out`` (with
    ``messy``: named id and label columns, a categorical column, empty cells), each file whole
    or not at all; ``replace=False`` keeps a file another process wrote there meanwhile
    (ConfigError)."""

    def write_csv(frame: pd.DataFrame, path: Path) -> None:
        atomic_write(path, lambda tmp: frame.to_csv(tmp, index=False), replace=replace)

    bunch = load_breast_cancer(as_frame=True)
    features, target = bunch.data, bunch.target.to_numpy()
    ids = np.array([f"p{i:04d}" for i in range(len(features))])
    order = np.random.default_rng(seed).permutation(len(features))
    train, held_out, new = order[:380], order[380:460], order[460:]
    id_column, label_column = ("customer", "outcome") if messy else ("id", "label")
    columns = np.array_split(np.array(features.columns), len(PARTIES))
    for k, (name, own) in enumerate(zip(PARTIES, columns, strict=True)):
        frame = features[list(own)].copy()
        if messy:
            frame = _as_users_have_it(frame, name, new, np.random.default_rng(seed + 100 + k))
        frame.insert(0, id_column, ids)
        write_csv(frame.iloc[np.concatenate([train, held_out])], out / f"{name}.csv")
        rows = frame.iloc[new]
        if name == "retailer":
            rows = rows.iloc[10:]
        write_csv(rows.sample(frac=1.0, random_state=seed + k), out / "new" / f"{name}.csv")
    labels = pd.DataFrame(
        {id_column: ids, label_column: np.where(target == 1, "benign", "malignant")}
    )
    write_csv(labels.iloc[train], out / "labels.csv")
    write_csv(labels.iloc[held_out], out / "held_out.csv")


def _as_users_have_it(
    frame: pd.DataFrame, name: str, new: np.ndarray, rng: np.random.Generator
) -> pd.DataFrame:
    """The bank's first column as a text category (three new rows in one training never saw);
    about 5 % of the retailer's cells empty."""
    frame = frame.copy()
    if name == "bank":
        first = frame.columns[0]
        segment = pd.qcut(frame[first], 3, labels=["low", "mid", "high"]).astype(str)
        segment.iloc[new[:3]] = "vip"
        frame = frame.drop(columns=first)
        frame.insert(0, "segment", segment)
    if name == "retailer":
        frame = frame.mask(rng.random(frame.shape) < 0.05)
    return frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the files an earlier run wrote there"
    )
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument(
        "--messy",
        action="store_true",
        help="named id and label columns, a categorical column and empty cells",
    )
    args = parser.parse_args()
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file; expected a directory (or a new path).")
    targets = [args.out / f"{name}.csv" for name in (*PARTIES, "labels", "held_out")]
    targets += [args.out / "new" / f"{name}.csv" for name in PARTIES]
    try:  # before any file is written: a folder or a pipe in a file's place, or no folder
        check_directory("--out", args.out)
        check_directory("--out", args.out / "new")
        for path in targets:
            writable_file(path)
    except (ConfigError, OutputError) as error:
        parser.error(str(error))
    existing = [str(path) for path in targets if path.exists()]
    if existing and not args.overwrite:
        parser.error(
            f"{', '.join(existing[:3])}{' ...' if len(existing) > 3 else ''} exist; expected a "
            "new --out directory (or --overwrite to replace them)."
        )
    try:
        write_party_files(args.out, seed=args.seed, messy=args.messy, replace=args.overwrite)
    except (ConfigError, OutputError) as error:  # e.g. a file written there meanwhile
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    print(f"party files, labels and new rows written to {args.out}")


if __name__ == "__main__":
    main()
