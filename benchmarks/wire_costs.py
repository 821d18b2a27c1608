"""What putting every message on the wire costs a LASER-VFL training step.

Every message between parties is encoded to bytes and decoded on receipt by the in-process
transport (:mod:`secure_vfl.federation.wire`). This measures, within one run, the share of a
LASER training step spent in that encoding and decoding, on Satellite with 4 parties (the
reference code's tabular setting: batch 128, the MLP bottoms), for both head settings, and the
messages and bytes a step puts on the wire. The target: at most 10 % of a step.

    python benchmarks/wire_costs.py            # the committed configuration
    python benchmarks/wire_costs.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from _shared import command_line, write_outputs

TARGET = 0.10


class _MessageCounter:
    """A channel layer that counts the messages that pass and keeps none of them (keeping them,
    as a recording layer does, would hold every step's tensors and make each new buffer a fresh
    page of memory, a cost a real run does not pay), but those of the step after ``keep()``."""

    def __init__(self) -> None:
        self.messages = 0
        self.kept: list[Any] | None = None

    def keep(self) -> None:
        self.kept = []

    def on_message(self, message: Any) -> Any:
        self.messages += 1
        if self.kept is not None:
            self.kept.append(message)
        return message


def back_to_back_seconds(messages: Sequence[Any], repeats: int) -> float:
    """The median over ``repeats`` of the seconds to encode and decode ``messages`` one after
    the other, with nothing between them: the codec's own work with its code and data in the
    processor's caches (in a step, each message follows the parties' computations)."""
    from secure_vfl.federation import wire

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for message in messages:
            wire.decode(wire.encode(message))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(heads: str, *, steps: int, repeats: int) -> dict[str, Any]:
    """Median over ``repeats`` of (codec seconds / step seconds) over ``steps`` steps each."""
    import torch

    from secure_vfl.experiment import TrainConfig, build_method, prepare_data
    from secure_vfl.federation.channel import Channel, InProcessTransport
    from secure_vfl.methods import MethodConfig

    torch.set_num_threads(1)
    config = TrainConfig(
        method="laser",
        dataset="satellite",
        parties=4,
        train_missing="mcar:0.1",
        test_missing=("mcar:0",),
        seed=0,
        method_config=MethodConfig(heads=cast(Any, heads)),
    )
    data = prepare_data(config)
    transport = InProcessTransport()
    counter = _MessageCounter()
    channel = Channel([counter], transport=transport)
    method = build_method(config, data, channel=channel)
    batches = list(method.sampler.epoch(np.random.default_rng(0)))
    method.train_step(batches[0], 0, 0)  # warm-up: lazy initialisation
    ratios, step_ms, codec_ms = [], [], []
    round = 1
    for _ in range(repeats):
        codec_before = transport.codec_seconds
        start = time.perf_counter()
        for i in range(steps):
            method.train_step(batches[(round + i) % len(batches)], round + i, 0)
        elapsed = time.perf_counter() - start
        codec = transport.codec_seconds - codec_before
        round += steps
        ratios.append(codec / elapsed)
        step_ms.append(1000 * elapsed / steps)
        codec_ms.append(1000 * codec / steps)
    sent = sum(transport.bytes.values())
    messages_per_step = counter.messages / round
    counter.keep()  # one more step's messages, carried again back to back
    method.train_step(batches[round % len(batches)], round, 0)
    assert counter.kept is not None
    warm_ms = 1000 * back_to_back_seconds(counter.kept, repeats=max(5, repeats))
    return {
        "heads": heads,
        "steps": steps,
        "repeats": repeats,
        "codec_share": statistics.median(ratios),
        "step_ms": statistics.median(step_ms),
        "codec_ms_per_step": statistics.median(codec_ms),
        "messages_per_step": messages_per_step,
        "bytes_per_step": sent / round,
        "back_to_back_codec_ms_per_step": warm_ms,
        "back_to_back_share": warm_ms / statistics.median(step_ms),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="10 steps x 2 repeats")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    steps, repeats = (10, 2) if args.quick else (args.steps, args.repeats)
    load_before = os.getloadavg()[0]
    rows = [measure(heads, steps=steps, repeats=repeats) for heads in ("all", "active")]
    load = (load_before, os.getloadavg()[0])
    lines = [
        "# Wire codec cost in a LASER step (Satellite, 4 parties, batch 128, 1 thread)",
        "",
        f"Command: `{command_line('wire_costs.py', argv)}`",
        "",
        "| heads | step (ms) | encode + decode (ms/step) | share of the step | messages/step "
        "| bytes/step | the same messages back to back (ms) | their share of the step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['heads']} | {row['step_ms']:.2f} | {row['codec_ms_per_step']:.3f} | "
            f"{100 * row['codec_share']:.1f} % | {row['messages_per_step']:.1f} | "
            f"{row['bytes_per_step'] / 1024:.1f} KiB | "
            f"{row['back_to_back_codec_ms_per_step']:.3f} | "
            f"{100 * row['back_to_back_share']:.1f} % |"
        )
    met = all(row["codec_share"] <= TARGET for row in rows)
    lines += [
        "",
        f"Target: encoding + decoding at most {100 * TARGET:.0f} % of a step: "
        f"{'met' if met else 'MISSED'}. Medians of {repeats} repeats of {steps} steps; the "
        "share is measured within each repeat (codec seconds / step seconds). Load average "
        f"(1 min) {load[0]:.1f} before and {load[1]:.1f} after, on {os.cpu_count()} CPUs: other "
        "work on the machine slows the step and the codec alike, not always in proportion.",
        "",
        "The last two columns carry one step's messages again, encoded and decoded one after "
        "the other with nothing between them (median of repeats), against the same step time: "
        "the codec's own work with its code and data in the processor's caches. In a step each "
        "message follows the parties' computations, which push the codec's code (the "
        "interpreter's, numpy's and torch's entry points it calls) out of those caches, and the "
        "difference between the two shares is what that costs; the target counts it.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        write_outputs(
            args.out, "wire_costs", text, {"rows": rows, "target": TARGET, "load_average": load}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
