"""The plots of one training run, written as PNG beside its ``result.json``.

Drawn on matplotlib's Agg canvas directly (no pyplot, so no global backend is switched and no
window can open) and written atomically, like every result file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from secure_vfl.io import atomic_write

LOSS_PLOT = "loss.png"
ACCURACY_PLOT = "accuracy.png"
EPSILON_PLOT = "epsilon.png"


def write_run_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """``loss.png`` (mean training loss per epoch), ``accuracy.png`` (test accuracy per test
    missingness) and, when DP ran, ``epsilon.png`` (each party's epsilon after every epoch)
    for a ``train`` result payload, in ``out``; returns the paths written."""
    title = f"{result['method']} on {result['dataset']}"
    config = result.get("config") or {}
    latent = config.get("false_vfl")  # two stages, one after the other in epoch_loss
    first = None
    if isinstance(latent, dict):
        epochs = (config.get("method_config") or {}).get("epochs")
        first = latent.get("pretrain_epochs") or epochs
    paths = [
        _loss(result["epoch_loss"], out / LOSS_PLOT, title=title, first_stage=first),
        _accuracy(result["metrics"], out / ACCURACY_PLOT, title=title),
    ]
    privacy = result.get("privacy") or {}
    curves = privacy.get("epsilon_per_epoch") or {}
    if any(curves.values()):
        paths.append(_epsilon(curves, privacy["delta"], out / EPSILON_PLOT, title=title))
    else:  # a run it replaces may have drawn one (--overwrite): it would not be this run's
        (out / EPSILON_PLOT).unlink(missing_ok=True)
    return paths


def _figure(*, epochs: bool = False) -> tuple[Any, Any]:
    """A figure on the Agg canvas and its axes (whole-numbered x ticks when x is epochs)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6, 4))
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    if epochs:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    return figure, axes


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))
    return path


def _loss(losses: list[float], path: Path, *, title: str, first_stage: int | None = None) -> Path:
    """The loss per epoch; a two-stage run's (FALSE-VFL: ``first_stage`` epochs of the bound of
    the features, then the labelled bound) as two curves, which measure different things."""
    figure, axes = _figure(epochs=True)
    epochs = list(range(1, len(losses) + 1))
    if isinstance(first_stage, int) and 0 < first_stage < len(losses):
        axes.plot(epochs[:first_stage], losses[:first_stage], marker="o", label="stage 1: -L_kappa")
        axes.plot(
            epochs[first_stage:], losses[first_stage:], marker="o", label="stage 2: -L'_kappa"
        )
        axes.legend(fontsize=8)
    else:
        axes.plot(epochs, losses, marker="o")
    axes.set_xlabel("epoch")
    axes.set_ylabel("mean training loss")
    axes.set_title(f"{title}: training loss")
    return _save(figure, path)


def _accuracy(metrics: dict[str, dict[str, float]], path: Path, *, title: str) -> Path:
    figure, axes = _figure()
    names = list(metrics)
    values = [metrics[name]["accuracy"] for name in names]
    bars = axes.bar(range(len(names)), values)
    axes.bar_label(bars, fmt="%.1f")
    axes.set_xticks(range(len(names)), names)
    axes.set_ylim(0, 105)
    axes.set_xlabel("test missingness")
    axes.set_ylabel("accuracy (%)")
    axes.set_title(f"{title}: test accuracy")
    return _save(figure, path)


def _epsilon(curves: dict[str, list[float]], delta: float, path: Path, *, title: str) -> Path:
    figure, axes = _figure(epochs=True)
    for party, curve in sorted(curves.items()):
        axes.plot(range(1, len(curve) + 1), curve, marker="o", label=party)
    axes.set_xlabel("epoch")
    axes.set_ylabel(f"epsilon spent (delta {delta:g})")
    axes.set_title(f"{title}: privacy spent")
    axes.legend(fontsize=8)
    return _save(figure, path)
