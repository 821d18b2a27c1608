"""What each protection costs, in one run, as ratios to the unprotected baseline.

1. Secure sums: median time of one sum for plain (``PlainAggregator.combine``) and, split as
   the parties run them, pairwise masks, Paillier (2048-bit, each sender's obfuscator pool
   stocked offline, the offline time reported apart) and CKKS: every contributor's sealing, the
   aggregation server's adding and the receiver's opening, one after the other in this process
   (the messages between them are not encoded: ``benchmarks/wire_costs.py`` prices that); on the
   issue's shapes: a 256 x 64 batch from 4 parties, and 4 tasks x 128 rows x 128.
2. PSI: our two-party intersection (X25519, both cores) against openmined-psi on the same ids,
   at 10^4, 10^5 and 10^6 ids per side (``benchmarks/psi_costs.py``).
3. Differential privacy: LASER (heads="active") training on Satellite, time with Gaussian noise
   on the gradients sent back (sigma 1, clip 0.01) and with DP-SGD of every bottom model
   (Opacus; sigma 1, clip 0.05), against the same run without protection; accuracy and the
   largest per-party epsilon beside.
4. Secure training: LASER (heads="active", the secure task planner) on the Fashion-MNIST CNN
   through plain, masks, CKKS and Paillier: step time, aggregation bytes per step, the model's
   distance to the plain one after the same steps, and (not Paillier) accuracy after training.

    python benchmarks/protocol_costs.py            # the committed configuration
    python benchmarks/protocol_costs.py --quick    # a smoke run: small sizes, Paillier-2048 kept
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from _shared import RESULTS, command_line, output_directory, quick_marked, write_outputs
from psi_costs import table as psi_table_lines
from psi_costs import target_line as psi_target_line

from secure_vfl.errors import IntegrityError
from secure_vfl.federation.aggregator import (
    AdderHalf,
    PlainAggregator,
    ReceiverHalf,
    SealingScheme,
    SenderHalf,
    SumBackend,
    SumMembers,
    sum_context,
)
from secure_vfl.federation.messages import AGGREGATOR, RepresentationMessage, party_name
from secure_vfl.io import counted
from secure_vfl.methods.base import in_process_parties

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


def time_plain(shape: tuple[int, int, int], repeats: int) -> float:
    """Median seconds of ``PlainAggregator.combine`` (what the aggregation server runs on the
    representations it receives in the clear) over fresh rounds."""
    aggregator = PlainAggregator()
    times = []
    for round in range(repeats):
        messages, selection = _batch(*shape, round=round)
        start = time.perf_counter()
        aggregator.combine(
            messages, selection, parties=PARTIES, receiver=RECEIVER, round=round, batch_id=0
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def split_halves(
    scheme: SealingScheme,
) -> tuple[dict[str, SenderHalf], AdderHalf, ReceiverHalf]:
    """Each party's own halves of ``scheme`` (a sender in every contributor, the adder in the
    aggregation server, the receiver in :data:`RECEIVER`), each told the public keys that the
    key set-up's messages would carry to it."""
    senders = {name: scheme.sender() for name in PARTIES}
    adder, receiver = scheme.adder(), scheme.receiver()
    for name, sender in senders.items():
        key = sender.public_key()
        for peer, other in senders.items():
            if key is not None and peer != name:
                other.learn(name, "sender", key)
        if key is not None:
            receiver.learn(name, "sender", key)
    key = receiver.public_key()
    if key is not None:
        adder.learn(RECEIVER, "receiver", key)
        for sender in senders.values():
            sender.learn(RECEIVER, "receiver", key)
    return senders, adder, receiver


def time_split(
    scheme: SealingScheme,
    shape: tuple[int, int, int],
    repeats: int,
    prepare: Callable[[dict[str, SenderHalf]], None] | None = None,
) -> float:
    """Median seconds of one secure sum over fresh rounds, with ``scheme``'s halves as the
    parties hold them: every contributor seals its values, the server adds the sealed shares,
    the receiver opens the sum (``prepare(senders)`` runs untimed before each round)."""
    senders, adder, receiver = split_halves(scheme)
    times = []
    for round in range(repeats):
        messages, selection = _batch(*shape, round=round)
        chosen = selection.numpy()
        tasks, rows, width = shape
        context = sum_context("protocol-costs", RECEIVER, round, 0, "")
        if prepare is not None:
            prepare(senders)
        start = time.perf_counter()
        shares = {
            name: senders[name].seal(
                message.representation.numpy(),
                chosen,
                column=k,
                parties=PARTIES,
                receiver=RECEIVER,
                context=context,
            )
            for k, (name, message) in enumerate(zip(PARTIES, messages, strict=True))
        }
        total = adder.add(
            shares, receiver=RECEIVER, shape=(tasks, rows, width), parties=len(PARTIES)
        )
        members = SumMembers(
            selection=chosen, parties=tuple(PARTIES), receiver=RECEIVER, context=context
        )
        receiver.open(total, members=members, width=width)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


SHAPES = ((1, 256, 64), (4, 128, 128))


def secure_sums(
    repeats: int, shapes: tuple[tuple[int, int, int], ...] = SHAPES
) -> list[dict[str, Any]]:
    from protocols.ckks import CkksAggregator
    from protocols.paillier import PaillierAggregator, PaillierSender
    from protocols.secagg import MaskingAggregator

    rows = []
    for shape in shapes:
        plain = time_plain(shape, repeats)
        masks = time_split(MaskingAggregator(), shape, repeats)
        ckks = time_split(CkksAggregator(), shape, repeats)
        paillier = PaillierAggregator()
        needed = paillier.layout(len(PARTIES)).ciphertexts(shape[0] * shape[1] * shape[2])
        offline: list[float] = []

        def stock(
            senders: dict[str, SenderHalf], n: int = needed, spent: list[float] = offline
        ) -> None:
            start = time.perf_counter()
            for sender in senders.values():
                cast(PaillierSender, sender).prepare(RECEIVER, obfuscators=n)
            spent.append(time.perf_counter() - start)

        paillier_s = time_split(paillier, shape, max(2, repeats // 3), prepare=stock)
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


def psi(sizes: tuple[int, ...], repeats: int = 3) -> list[dict[str, Any]]:
    """``benchmarks/psi_costs.py`` in its own interpreter (its memory figures need a process
    that has not loaded torch and this script's data): ``repeats`` up to 10^5 ids, 1 above."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(Path(__file__).with_name("psi_costs.py"))]
        command += ["--sizes", *map(str, sizes), "--repeats", str(repeats)]
        command += ["--repeats-above", "100000"]
        command += ["1", "--modes", "intersection", "--out", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        rows: list[dict[str, Any]] = json.loads((Path(out) / "psi_costs.json").read_text())["psi"]
    return rows


DP_PROTECTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "gradient noise": {"dp_gradients": (1.0, 0.01)},
    "dp-sgd, Opacus hooks": {"dp_sgd": (1.0, 0.05), "grad_sample_mode": "hooks"},
    "dp-sgd": {"dp_sgd": (1.0, 0.05)},
}
"""The DP section's protections: ``dp-sgd`` is the default (exact per-sample gradients of the
MLP bottoms' Linear layers), ``dp-sgd, Opacus hooks`` the same mechanism on Opacus' hooks."""


class StepMarks:
    """The time at which a run starts training and at which each of its steps ends."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def start(self, total: int) -> None:
        self.marks.append(time.perf_counter())

    def step(self, step: int, loss: float) -> None:
        self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        """Each step's duration, in order."""
        return [b - a for a, b in itertools.pairwise(self.marks)]


def dp_training(epochs: int, repeats: int) -> dict[str, Any]:
    """LASER (heads=active) on Satellite under each of :data:`DP_PROTECTIONS`, ``repeats``
    rounds of one run each, interleaved so that a change in the machine's load meets every
    protection alike: per protection the median run time (training, prediction and the privacy
    report), the median step time over every step but each run's first, the median accuracy
    and the largest per-party epsilon (the same every run: the accountant's, not the noise's)."""
    from protocols.privacy import PrivacyEngine, PrivacySpec
    from secure_vfl.experiment import TrainConfig, prepare_data, run_training
    from secure_vfl.methods import MethodConfig

    config = TrainConfig(
        method="laser",
        dataset="satellite",
        test_missing=("mcar:0",),
        method_config=MethodConfig(heads="active", epochs=epochs),
    )
    data = prepare_data(config)
    run_training(config, data=data)  # warm-up: the first run pays for lazy initialisation
    runs: dict[str, list[float]] = {name: [] for name in DP_PROTECTIONS}
    steps: dict[str, list[float]] = {name: [] for name in DP_PROTECTIONS}
    accuracy: dict[str, list[float]] = {name: [] for name in DP_PROTECTIONS}
    epsilon: dict[str, float | None] = {}
    diverged: dict[str, list[str]] = {name: [] for name in DP_PROTECTIONS}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for name, options in DP_PROTECTIONS.items():
            marks = StepMarks()
            try:
                result = run_training(
                    config,
                    data=data,
                    privacy=PrivacyEngine(PrivacySpec(**options)),
                    on_start=marks.start,
                    on_step=marks.step,
                )
            except IntegrityError as error:  # too much noise: counted, not timed
                diverged[name].append(str(error))
                continue
            runs[name].append(result.wall_time_s)
            steps[name] += marks.durations()[1:]  # the first step pays for lazy initialisation
            accuracy[name].append(result.metrics["mcar:0"]["accuracy"])
            epsilons = result.privacy["epsilon"] if result.privacy is not None else {}
            epsilon[name] = max(epsilons.values()) if epsilons else None
    return {
        "repeats": repeats,
        "epochs": epochs,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "rows": [
            {
                "protection": name,
                "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
                "seconds": statistics.median(runs[name]),
                "runs_s": runs[name],
                "step_s": statistics.median(steps[name]),
                "steps_timed": len(steps[name]),
                "accuracy": statistics.median(accuracy[name]),
                "max_epsilon": epsilon[name],
                "diverged": diverged[name],
            }
            for name, options in DP_PROTECTIONS.items()
            if runs[name]  # a protection whose every run diverged is listed below the table
        ],
        "all_diverged": {name: errors for name, errors in diverged.items() if not runs[name]},
    }


def dp_lines(dp: dict[str, Any], command: str) -> list[str]:
    """The DP section of the report (both ratios from the same interleaved runs)."""
    lines = [
        "## Differential privacy: LASER (heads=active) on Satellite, "
        + counted(dp["epochs"], "epoch"),
        "",
    ]
    before = ", ".join(f"{x:.2f}" for x in dp["load_average_before"])
    after = ", ".join(f"{x:.2f}" for x in dp["load_average_after"])
    run = "median wall time of a whole run" if dp["repeats"] > 1 else "wall time of its one run"
    lines += [
        f"Command: `{command}`. One thread; {counted(dp['repeats'], 'round')} of one run per "
        f"protection, interleaved. Run: {run} (training, prediction, the privacy report)"
        f"{'' if dp['repeats'] > 1 else ', no median'}; step: median time of a training step "
        "(every step but each run's first). Load average (1, 5, 15 min) before: "
        f"{before}; after: {after} (2 cores, shared).",
        "",
        "| protection | run | ratio | step | ratio | accuracy % | max epsilon (delta 1e-5) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = dp["rows"][0]
    for r in dp["rows"]:
        eps = f"{r['max_epsilon']:.2f}" if r["max_epsilon"] is not None else "–"
        lines.append(
            f"| {r['protection']} | {r['seconds']:.2f} s | {r['seconds'] / base['seconds']:.2f}x "
            f"| {1000 * r['step_s']:.1f} ms | {r['step_s'] / base['step_s']:.2f}x "
            f"| {r['accuracy']:.1f} | {eps} |"
        )
    notes = [
        f"{r['protection']}: {len(r['diverged'])} of {counted(dp['repeats'], 'run')} diverged "
        f"(not timed; first: {r['diverged'][0]})"
        for r in dp["rows"]
        if r["diverged"]
    ]
    notes += [
        f"{name}: every run diverged ({errors[0]})" for name, errors in dp["all_diverged"].items()
    ]
    for note in notes:  # each its own paragraph, after the table
        lines += ["", note]
    return lines


def _fashion_data(train: int, test: int, seed: int) -> Any:
    """Fashion-MNIST quadrants over 4 parties on a seeded subset, no block missing."""
    from laser_table import DatasetPlan, subsample

    from secure_vfl.data.datasets import load_dataset
    from secure_vfl.data.missingness import parse_mechanism
    from secure_vfl.data.vertical import make_vertical

    rng = np.random.default_rng(seed)
    plan = DatasetPlan("fashion-mnist", train, test, epochs=1, lr=0.03)
    split = subsample(load_dataset("fashion-mnist", rng=rng), plan, rng)
    none = parse_mechanism("mcar:0")
    return make_vertical(split, parties=4, train_missing=none, test_missing=[none], rng=rng)


def _backends() -> dict[str, Callable[[], SumBackend]]:
    from protocols.ckks import CkksAggregator
    from protocols.paillier import PaillierAggregator
    from protocols.secagg import MaskingAggregator

    return {
        "plain": PlainAggregator,
        "masks": MaskingAggregator,
        "ckks": CkksAggregator,
        "paillier": PaillierAggregator,
    }


def _aggregation_bytes(method: Any) -> int:
    """Bytes of the aggregation so far: the encoded messages to and from the aggregation server
    that crossed the transport (representations and sums in the clear, or sealed shares and
    sealed sums: each backend's halves run inside the parties)."""
    return sum(
        count
        for (sender, receiver, _), count in method.fed.channel.transport.bytes.items()
        if AGGREGATOR in (sender, receiver)
    )


def stock_pools(method: Any, aggregator: Any, batch: np.ndarray) -> float:
    """Stock every party's Paillier obfuscator pool with what the training step of ``batch``
    seals, as each party's offline phase; the seconds it took. A party seals its
    representation into the sums the step asks for, for each head (under the secure planner
    the parts, the blocks of the rows and the label party's own term, whose sums the head adds
    up into its tasks'), one obfuscator for each plaintext of the layout it puts a value in
    (one it enters no sum in is left empty)."""
    from secure_vfl.federation.aggregator import entered_items

    start = time.perf_counter()
    mask = torch.from_numpy(method.data.train.mask[batch])
    plan = method.plan(torch.from_numpy(batch), mask)
    heads = plan.selection.shape[0]  # (heads, tasks, rows, parties)
    slots = aggregator.layout(len(PARTIES)).slots
    width = method.config.representation_dim
    for k, party in enumerate(in_process_parties(method.fed.channel)):
        layouts = [plan.selection[h] if plan.parts is None else plan.parts for h in range(heads)]
        needed = sum(int(entered_items(s[..., k].numpy(), width, slots).sum()) for s in layouts)
        party.sealer.prepare(RECEIVER, obfuscators=needed)  # type: ignore[union-attr]
    return time.perf_counter() - start


def secure_training(
    steps: int, epochs: int, train: int, test: int, *, batch_size: int = 128, width: int = 128
) -> list[dict[str, Any]]:
    """LASER (heads=active, the secure planner) on the Fashion-MNIST CNN through each backend.

    Per backend: the median time of ``steps`` training steps (after one warm-up step) from the
    same seed and batches, the backends' steps interleaved, and the median of each step's ratio
    to the plain step; the aggregation bytes per step, and the largest parameter difference to
    the plain run after those steps; Paillier's obfuscator pools are stocked before each step,
    untimed (reported apart). Then, except for Paillier (minutes per epoch), a full
    training of ``epochs`` epochs for the accuracy delta. ``batch_size`` rows a step, each
    party's representation ``width`` wide.
    """
    from secure_vfl.experiment import TrainConfig, build_method, run_training
    from secure_vfl.methods import MethodConfig

    data = _fashion_data(train, test, seed=0)
    config = TrainConfig(
        method="laser",
        dataset="fashion-mnist",
        test_missing=("mcar:0",),
        method_config=MethodConfig(
            heads="active",
            secure_sums=True,
            epochs=epochs,
            lr=0.03,
            batch_size=batch_size,
            representation_dim=width,
        ),
    )
    # Every backend's method built first, then their steps interleaved (step i of each in turn,
    # the backends' order turning each step): a drift of the machine's speed over the minutes
    # the section takes then weighs on every backend alike, and each step's ratio to the plain
    # step is of two steps taken side by side.
    backends = _backends()
    methods, aggregators = {}, {}
    for name, make in backends.items():
        aggregators[name] = make()
        methods[name] = build_method(config, data, aggregator=aggregators[name])
    names = list(backends)
    batches = list(methods["plain"].sampler.epoch(np.random.default_rng(0)))[: steps + 1]
    times: dict[str, list[float]] = {name: [] for name in names}
    offline: dict[str, list[float]] = {name: [] for name in names}
    bytes_before: dict[str, int] = {}
    for step, batch in enumerate(batches):
        turn = step % len(names)
        for name in names[turn:] + names[:turn]:
            method = methods[name]
            if name == "paillier":  # each party's offline phase: stock its own sender's pool
                offline[name].append(stock_pools(method, cast(Any, aggregators[name]), batch))
            if step == 1:
                bytes_before[name] = _aggregation_bytes(method)
            start = time.perf_counter()
            method.train_step(batch, step, 0)
            if step > 0:  # the first step pays for lazy initialisation
                times[name].append(time.perf_counter() - start)
    rows: list[dict[str, Any]] = []
    reference: list[torch.Tensor] = []
    for name, make in backends.items():
        method = methods[name]
        step_bytes = (_aggregation_bytes(method) - bytes_before[name]) / len(times[name])
        parties = in_process_parties(cast(Any, method).fed.channel)
        parameters = [
            t.detach().clone()
            for module in [p.model for p in parties] + [parties[0].heads[""].module]
            for t in module.parameters()
        ]
        if name == "plain":
            reference = parameters
        row: dict[str, Any] = {
            "backend": name,
            "step_s": statistics.median(times[name]),
            # the median of each step's ratio to the plain step taken beside it
            "step_ratio": statistics.median(
                t / p for t, p in zip(times[name], times["plain"], strict=True)
            ),
            "aggregation_bytes_per_step": step_bytes,
            "max_parameter_difference": max(
                float((a - b).abs().max()) for a, b in zip(parameters, reference, strict=True)
            ),
        }
        if offline[name]:
            row["offline_s_per_step"] = statistics.median(offline[name])
        if name != "paillier":
            result = run_training(config, data=data, aggregator=make())
            row["accuracy"] = result.metrics["mcar:0"]["accuracy"]
            row["train_s"] = result.wall_time_s
        rows.append(row)
    return rows


@dataclasses.dataclass(frozen=True)
class RunSizes:
    """How much each section of a run measures."""

    repeats: int  # secure sums: fresh rounds per backend (Paillier: a third, at least 2)
    shapes: tuple[tuple[int, int, int], ...]  # secure sums: T x B x d
    steps: int  # secure training: timed steps per backend
    train_epochs: int  # secure training: epochs of the accuracy runs
    subset: tuple[int, int]  # secure training: Fashion-MNIST training and test rows
    psi_sizes: tuple[int, ...]  # ids per side
    psi_repeats: int  # up to 10^5 ids (1 above)
    dp_epochs: int
    dp_repeats: int
    batch_size: int = 128  # secure training
    width: int = 128  # secure training: the representation's width


def run_sizes(*, quick: bool) -> RunSizes:
    """The committed configuration's sizes, or a ``quick`` smoke run's."""
    if quick:
        # a smoke run: Paillier-2048's obfuscators (about 10 ms each) for small sums and
        # steps, 10^3 PSI ids, one DP run per protection
        return RunSizes(3, ((1, 32, 16),), 2, 1, (320, 80), (1000,), 1, 1, 1, 16, 32)
    return RunSizes(7, SHAPES, 10, 3, (10_000, 2000), (10_000, 100_000, 1_000_000), 3, 5, 7)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--only",
        choices=["dp", "training"],
        help="re-run one section (DP, or secure training) and keep the others from the "
        "committed results (the .json)",
    )
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    size = run_sizes(quick=args.quick)
    stem = "protocol_costs_quick" if args.quick else "protocol_costs"
    command = command_line("protocol_costs.py", argv)
    if args.only is not None:
        kept = args.out / f"{stem}.json"
        keeps = f"--only {args.only} keeps the other sections of {kept}"
        if not kept.is_file():
            parser.error(f"{keeps}; it does not exist.")
        try:
            payload = json.loads(kept.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            parser.error(f"{keeps}; it cannot be read: {error}")
        sections = ("command", "secure_sums", "secure_training", "psi", "dp")
        if not isinstance(payload, dict) or not all(key in payload for key in sections):
            parser.error(
                f"{keeps}; it holds no {', '.join(sections)} (the JSON protocol_costs.py writes "
                "expected)."
            )
    else:
        payload = {
            "command": command,
            "secure_sums": secure_sums(size.repeats, size.shapes),
            "psi": psi(size.psi_sizes, size.psi_repeats),
        }
    if args.only in (None, "training"):
        payload["secure_training"] = secure_training(
            size.steps,
            size.train_epochs,
            *size.subset,
            batch_size=size.batch_size,
            width=size.width,
        )
        payload["training_command"] = command
    if args.only in (None, "dp"):
        payload["dp"] = dp_training(size.dp_epochs, size.dp_repeats)
        payload["dp_command"] = command
    text = report(payload, size)
    text = quick_marked(text, args.quick)
    write_outputs(args.out, stem, text, payload)
    print(text)
    return 0


def report(payload: dict[str, Any], size: RunSizes) -> str:
    """The Markdown report of every section in ``payload`` (the secure-training section was
    run with ``size``'s)."""
    steps, train_epochs, subset = size.steps, size.train_epochs, size.subset
    sums, training, psi_table = payload["secure_sums"], payload["secure_training"], payload["psi"]
    lines = [
        "# Protocol costs",
        "",
        f"Command: `{payload['command'].strip()}`  ",
        "One thread; medians over fresh rounds. Ratios are to the plain (unprotected) run.",
        "",
        "## Secure sums: one sum (T x B x d, 4 parties, all selected): every party's sealing, the "
        "adding and the opening",
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
    plain_step = training[0]["step_s"]
    plain_bytes = training[0]["aggregation_bytes_per_step"]
    lines += [
        "",
        f"## Secure training: LASER (heads=active, secure planner), Fashion-MNIST CNN, "
        f"4 parties, {subset[0]} / {subset[1]} rows, batch {size.batch_size}, "
        f"representation width {size.width}",
        "",
        f"Command: `{payload.get('training_command', payload['command']).strip()}`. "
        f"Step time: median of {steps} steps after a warm-up, same seed and batches for every "
        "backend, the backends' steps interleaved (each step of every backend in turn); ratio: "
        "the median of each step's ratio to the plain step taken beside it; max |parameter - "
        "plain| after those steps. Accuracy: a full training of "
        f"{counted(train_epochs, 'epoch')} (Paillier's epochs take minutes of pool filling: not "
        "run).",
        "",
        "| backend | step | ratio | aggregation bytes / step | ratio | max param. diff | "
        "accuracy % | delta |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in training:
        accuracy = f"{r['accuracy']:.1f}" if "accuracy" in r else "–"
        delta = f"{r['accuracy'] - training[0]['accuracy']:+.1f}" if "accuracy" in r else "–"
        offline = (
            f" (+ {r['offline_s_per_step']:.1f} s offline pool)"
            if "offline_s_per_step" in r
            else ""
        )
        lines.append(
            f"| {r['backend']} | {1000 * r['step_s']:.0f} ms{offline} | "
            f"{r.get('step_ratio', r['step_s'] / plain_step):.2f}x | "
            f"{r['aggregation_bytes_per_step'] / 1e3:.0f} kB | "
            f"{r['aggregation_bytes_per_step'] / plain_bytes:.1f}x | "
            f"{r['max_parameter_difference']:.1e} | {accuracy} | {delta} |"
        )
    lines += [
        "",
        "## PSI: ours (X25519, both cores) against openmined-psi (P-256, RAW, one thread)",
        "",
        "Half the ids shared; each run in a fresh process; medians over repeats where there "
        "are several ("
        + ", ".join(f"{len(r['ours_seconds_all'])} at {r['ids']:,} ids" for r in psi_table)
        + "; of one, its only measurement).",
        "",
        *psi_table_lines(psi_table),
        "",
        psi_target_line(psi_table),
    ]
    dp_command = payload.get("dp_command", payload["command"]).strip()
    lines += ["", *dp_lines(payload["dp"], dp_command)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
