"""What each protection costs, in one run, as ratios to the unprotected baseline.

1. Secure sums: median time of one ``Aggregator.combine`` for plain, pairwise masks, Paillier
   (2048-bit, each sender's obfuscator pool stocked offline, the offline time reported apart)
   and CKKS, on the issue's shapes: a 256 x 64 batch from 4 parties, and 4 tasks x 128 rows x 128.
2. PSI: a full two-party intersection of 10^4 and 10^5 ids (half overlapping), X25519.
3. Differential privacy: LASER (heads="active") training on Satellite, time with Gaussian noise
   on the gradients sent back (sigma 1, clip 0.01) and with DP-SGD of every bottom model
   (Opacus; sigma 1, clip 0.05), against the same run without protection; accuracy and the
   largest per-party epsilon beside.

    python benchmarks/protocol_costs.py            # the committed configuration
    python benchmarks/protocol_costs.py --quick    # a smoke run

Not yet here (see the open issue): training steps through the secure backends (LASER needs a
secure task planner first), the openmined-psi comparison, PSI at 10^6.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _shared import command_line, write_outputs

from secure_vfl.errors import IntegrityError
from secure_vfl.federation.aggregator import Aggregator, PlainAggregator
from secure_vfl.federation.messages import AGGREGATOR, RepresentationMessage, party_name

PARTIES = [party_name(k) for k in range(4)]
RECEIVER = party_name(0)


def _batch(tasks: int, rows: int, width: int, round: int) -> tuple[list[Any], torch.Tensor]:
    generator = torch.Generator().manual_seed(round)
    messages = [
        RepresentationMessage(
            sender=name,
            receiver=AGGREGATOR,
            round=round,
            batch_id=0,
            positions=torch.arange(rows),
            representation=torch.randn(rows, width, generator=generator),
        )
        for name in PARTIES
    ]
    return messages, torch.ones(tasks, rows, len(PARTIES), dtype=torch.bool)


def time_combine(
    aggregator: Aggregator,
    shape: tuple[int, int, int],
    repeats: int,
    prepare: Callable[[int], None] | None = None,
) -> float:
    """Median seconds of ``combine`` over fresh rounds (``prepare(round)`` runs untimed first)."""
    times = []
    for round in range(repeats):
        messages, selection = _batch(*shape, round=round)
        if prepare is not None:
            prepare(round)
        start = time.perf_counter()
        aggregator.combine(
            messages, selection, parties=PARTIES, receiver=RECEIVER, round=round, batch_id=0
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def secure_sums(repeats: int) -> list[dict[str, Any]]:
    from protocols.ckks import CkksAggregator
    from protocols.paillier import PaillierAggregator
    from protocols.secagg import MaskingAggregator

    rows = []
    for shape in ((1, 256, 64), (4, 128, 128)):
        plain = time_combine(PlainAggregator(), shape, repeats)
        masks = time_combine(MaskingAggregator(), shape, repeats)
        ckks = time_combine(CkksAggregator(), shape, repeats)
        paillier = PaillierAggregator()
        needed = paillier.layout(len(PARTIES)).ciphertexts(shape[0] * shape[1] * shape[2])
        offline: list[float] = []

        def stock(
            round: int,
            p: PaillierAggregator = paillier,
            n: int = needed,
            spent: list[float] = offline,
        ) -> None:
            start = time.perf_counter()
            p.prepare(PARTIES, RECEIVER, obfuscators=n)
            spent.append(time.perf_counter() - start)

        paillier_s = time_combine(paillier, shape, max(2, repeats // 3), prepare=stock)
        rows.append(
            {
                "shape": "x".join(map(str, shape)),
                "plain_s": plain,
                "masks_s": masks,
                "ckks_s": ckks,
                "paillier_s": paillier_s,
                "paillier_offline_s": statistics.median(offline[1:] or offline),
            }
        )
    return rows


def psi(sizes: list[int]) -> list[dict[str, Any]]:
    from protocols.psi import run_psi

    rows = []
    for n in sizes:
        mine = [f"id-{i}" for i in range(n)]
        theirs = [f"id-{i}" for i in range(n // 2, n + n // 2)]
        start = time.perf_counter()
        result = run_psi(mine, theirs, rng=np.random.default_rng(0))
        rows.append({"ids": n, "seconds": time.perf_counter() - start, "found": result.size})
    return rows


def dp_training(epochs: int) -> list[dict[str, Any]]:
    from protocols.dp import GradientNoise, PrivacyAccountant, make_private_party
    from secure_vfl.experiment import TrainConfig, prepare_data, run_training
    from secure_vfl.federation.channel import Channel
    from secure_vfl.methods import MethodConfig

    config = TrainConfig(
        method="laser",
        dataset="satellite",
        test_missing=("mcar:0",),
        method_config=MethodConfig(heads="active", epochs=epochs),
    )
    data = prepare_data(config)
    rate = config.method_config.batch_size / data.train.n
    run_training(config, data=data)  # warm-up: the first run pays for lazy initialisation
    rows: list[dict[str, Any]] = []
    for name in ("none", "gradient noise", "dp-sgd"):
        accountant = PrivacyAccountant()
        channel = Channel()
        if name == "gradient noise":
            channel.layers.append(
                GradientNoise(
                    1.0,
                    0.01,
                    sample_rate=rate,
                    generator=torch.Generator().manual_seed(2),
                    on_event=accountant.on_event,
                )
            )

        def private(method: Any, kind: str = name, acc: PrivacyAccountant = accountant) -> None:
            if kind == "dp-sgd":
                for party in method.fed.parties:
                    make_private_party(
                        party,
                        noise_multiplier=1.0,
                        max_grad_norm=0.05,
                        sample_rate=rate,
                        on_event=acc.on_event,
                    )

        try:
            result = run_training(config, data=data, channel=channel, on_built=private)
        except IntegrityError as error:  # too much noise: report it rather than a number
            rows.append({"protection": name, "diverged": str(error)})
            continue
        epsilons = accountant.epsilons(1e-5)
        rows.append(
            {
                "protection": name,
                "seconds": result.wall_time_s,
                "accuracy": result.metrics["mcar:0"]["accuracy"],
                "max_epsilon": max(epsilons.values()) if epsilons else None,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats, sizes, epochs = (3, [10_000], 1) if args.quick else (7, [10_000, 100_000], 5)

    sums, psi_rows, dp_rows = secure_sums(repeats), psi(sizes), dp_training(epochs)
    command = command_line("protocol_costs.py", argv)
    lines = [
        "# Protocol costs",
        "",
        f"Command: `{command.strip()}`  ",
        "One thread; medians over fresh rounds. Ratios are to the plain (unprotected) run.",
        "",
        "## Secure sums: one `combine` (T x B x d, 4 parties, all selected)",
        "",
        "| shape | plain | masks | Paillier 2048 (pool stocked) | Paillier offline pool | CKKS |",
        "|---|---|---|---|---|---|",
    ]
    for r in sums:
        p = r["plain_s"]
        lines.append(
            f"| {r['shape']} | {1000 * p:.2f} ms | {1000 * r['masks_s']:.2f} ms "
            f"({r['masks_s'] / p:.0f}x) | {r['paillier_s']:.3f} s | "
            f"{r['paillier_offline_s']:.1f} s "
            f"| {1000 * r['ckks_s']:.1f} ms ({r['ckks_s'] / p:.0f}x) |"
        )
    lines += [
        "",
        "## PSI: a two-party intersection (X25519, half the ids shared)",
        "",
        "| ids per side | seconds | intersection |",
        "|---|---|---|",
    ]
    lines += [f"| {r['ids']} | {r['seconds']:.2f} | {r['found']} |" for r in psi_rows]
    base = dp_rows[0]["seconds"]
    lines += [
        "",
        f"## Differential privacy: LASER (heads=active) on Satellite, {epochs} epochs",
        "",
        "| protection | time | ratio | accuracy % | max epsilon (delta 1e-5) |",
        "|---|---|---|---|---|",
    ]
    for r in dp_rows:
        if "diverged" in r:
            lines.append(f"| {r['protection']} | diverged | – | – | – |")
            continue
        eps = f"{r['max_epsilon']:.2f}" if r["max_epsilon"] is not None else "–"
        lines.append(
            f"| {r['protection']} | {r['seconds']:.2f} s | {r['seconds'] / base:.2f}x | "
            f"{r['accuracy']:.1f} | {eps} |"
        )
    text = "\n".join(lines) + "\n"
    stem = "protocol_costs_quick" if args.quick else "protocol_costs"
    write_outputs(
        args.out,
        stem,
        text,
        {"command": command, "secure_sums": sums, "psi": psi_rows, "dp": dp_rows},
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
