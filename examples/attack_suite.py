"""Attack suite demo: which label-inference attacks work on a bank's credit model, and what each
defense buys against what it costs.

Four organisations train Standard VFL (a top model on the concatenated representations, the
split-learning setting of the label-leakage literature) on German credit (1000 applicants, 30 %
bad credit): the bank (party-0) holds the labels, party-1 is curious. Norm and direction scoring
run undefended and under each defense; the suite scores each pair with VFLAIR's defense
capability score (DCS) and prints T-DCS per attack kind and C-DCS per defense, then saves a bar
plot of every run's attack metric and main accuracy. About 11 s on 2 idle cores.

    python examples/attack_suite.py [--epochs N] [--seed S] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attacks.suite import markdown, run_suite
from secure_vfl.cli import positive_int, seed
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig
from secure_vfl.io import atomic_write, check_directory
from secure_vfl.methods import MethodConfig

DEFENSES = ("dp-gradients:1:0.01", "marvell:4", "gradient-sparsification:0.9")
ATTACKS = ("direction-scoring", "norm-scoring")  # the label-leakage attacks of the demo


def plot(runs: list[dict[str, object]], path: Path) -> None:
    """Per attack, one bar per defense: the attack's metric, and the main accuracy beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = list(dict.fromkeys(str(run["attack"]) for run in runs))
    defenses = list(dict.fromkeys(str(run["defense"]) for run in runs))
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    width = 0.8 / len(defenses)
    for panel, (key, title) in zip(
        axes,
        (("value", "attack AUC (0.5 = chance)"), ("main_accuracy", "main accuracy")),
        strict=True,
    ):
        for j, defense in enumerate(defenses):
            scored = {str(r["attack"]): float(r[key]) for r in runs if r["defense"] == defense}  # type: ignore[arg-type]
            values = [scored.get(a, 0.0) for a in attacks]  # a run that diverged: no bar
            positions = [i + j * width for i in range(len(attacks))]
            panel.bar(positions, values, width, label=defense)
        panel.set_xticks([i + 0.4 - width / 2 for i in range(len(attacks))], attacks)
        panel.set_title(title)
        panel.set_ylim(0, 1.05)
    axes[0].axhline(0.5, color="grey", ls=":")
    axes[1].legend(fontsize=7)
    figure.tight_layout()
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--epochs", type=positive_int, default=5, help="epochs of every run")
    parser.add_argument("--seed", type=seed, default=0, help="seeds the split and the models")
    parser.add_argument(
        "--out", type=Path, default=Path("runs") / "attack-suite-demo", help="output directory"
    )
    args = parser.parse_args()
    try:  # before the runs, not when their first file is written
        check_directory("--out", args.out)
    except ConfigError as error:
        parser.error(str(error))
    config = TrainConfig(
        method="standard",
        dataset="german-credit",
        parties=4,
        seed=args.seed,
        method_config=MethodConfig(heads="active", epochs=args.epochs, batch_size=64),
    )
    report = run_suite(config, defenses=DEFENSES, attacks=ATTACKS, cache=args.out / ".undefended")
    command = f"python examples/attack_suite.py --epochs {args.epochs} --seed {args.seed}"
    print(markdown(report, command=command))
    plot(report.runs, args.out / "attack_suite.png")
    print(f"plot: {args.out / 'attack_suite.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
