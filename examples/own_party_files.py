"""Three organisations' own files to try `train` and `predict` on (breast-cancer columns).

Writes into DIR: `bank.csv`, `retailer.csv`, `insurer.csv` (an `id` column and ten of
scikit-learn's bundled breast-cancer columns each), `labels.csv` (`id`, `label` as the text
"benign"/"malignant") for 380 ids, `held_out.csv` with 80 more ids for `--test-file`, and
`new/` with the other 109 ids as new rows to score: each file in its own row order, and the
retailer's without 10 of them. Offline; takes a second.

    python examples/own_party_files.py --out DIR [--seed S]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.datasets import load_breast_cancer

PARTIES = ("bank", "retailer", "insurer")


def write_party_files(out: Path, *, seed: int = 0) -> None:
    """Write the training, held-out and new rows of the three parties into ``out``."""
    bunch = load_breast_cancer(as_frame=True)
    features, target = bunch.data, bunch.target.to_numpy()
    ids = np.array([f"p{i:04d}" for i in range(len(features))])
    order = np.random.default_rng(seed).permutation(len(features))
    train, held_out, new = order[:380], order[380:460], order[460:]
    (out / "new").mkdir(parents=True, exist_ok=True)
    columns = np.array_split(np.array(features.columns), len(PARTIES))
    for k, (name, own) in enumerate(zip(PARTIES, columns, strict=True)):
        frame = features[list(own)].copy()
        frame.insert(0, "id", ids)
        frame.iloc[np.concatenate([train, held_out])].to_csv(out / f"{name}.csv", index=False)
        rows = frame.iloc[new]
        if name == "retailer":
            rows = rows.iloc[10:]
        rows.sample(frac=1.0, random_state=seed + k).to_csv(
            out / "new" / f"{name}.csv", index=False
        )
    labels = pd.DataFrame({"id": ids, "label": np.where(target == 1, "benign", "malignant")})
    labels.iloc[train].to_csv(out / "labels.csv", index=False)
    labels.iloc[held_out].to_csv(out / "held_out.csv", index=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_party_files(args.out, seed=args.seed)
    print(f"party files, labels and new rows written to {args.out}")


if __name__ == "__main__":
    main()
