"""`secure-vfl train --secure-agg`: secure sums end to end, and the traffic every run reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from protocols.secagg import MaskingAggregator
from secure_vfl.cli import main
from secure_vfl.experiment import TrainConfig, prepare_data, run_training
from secure_vfl.federation import wire
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import AGGREGATOR, SealedMessage, SealRequest
from secure_vfl.methods import MethodConfig

BASE = [
    "train",
    "--method",
    "laser",
    "--dataset",
    "digits",
    "--quiet",
    "--epochs",
    "3",
    "--lr",
    "0.1",
]


def test_masked_training_reports_protection_time(tmp_path: Path) -> None:
    out = tmp_path / "masks"
    argv = [*BASE, "--heads", "active", "--secure-agg", "masks", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["method_config"]["secure_sums"] is True
    assert result["metrics"]["mcar:0"]["accuracy"] > 50.0  # chance is 10 %
    traffic = result["traffic"]
    assert traffic["aggregator"] == "MaskingAggregator"
    assert traffic["protection_s"] > 0 and traffic["protection_s"] == traffic["aggregation_s"]


def test_masked_traffic_is_the_sealed_shares_that_crossed_and_nothing_in_the_clear() -> None:
    config = TrainConfig(
        method="laser",
        dataset="digits",
        method_config=MethodConfig(heads="active", epochs=2, secure_sums=True),
    )
    data = prepare_data(config)
    recorder = RecordingLayer()
    result = run_training(
        config, data=data, channel=Channel([recorder]), aggregator=MaskingAggregator()
    )
    # No representation reaches the aggregator in the clear: only public keys and sealed shares
    # (and the driver's requests: the key session, the sums, the key of its tickets).
    to_aggregator = {(m.kind, m.sender) for m in recorder.messages if m.receiver == AGGREGATOR}
    assert {kind for kind, _ in to_aggregator} == {
        "key-request",
        "public-key",
        "sealed",
        "sum-request",
        "ticket-key",
    }
    driven = {s for kind, s in to_aggregator if kind.endswith("-request") or kind == "ticket-key"}
    assert driven == {"party-0"}
    # The only key it is told is the receiver's (party-0's), announced with the self-masks'.
    assert {sender for kind, sender in to_aggregator if kind == "public-key"} == {"party-0"}
    assert "representation" not in {m.kind for m in recorder.messages}
    width = config.method_config.representation_dim
    steps = result.traffic["train_steps"]
    for k in range(1, data.train.parties):
        sent = [m for m in recorder.messages if m.sender == f"party-{k}"]
        assert {m.kind for m in sent} == {"public-key", "sealed"}
        sealed = [m for m in sent if isinstance(m, SealedMessage) and m.phase == "train"]
        # Every union of a sample's blocks in one request per step: one masked uint64
        # (T, B, d) share per step, T sums over every row of the batch.
        assert len(sealed) == steps
        asked = {
            (m.round, m.batch_id): tuple(m.selection.shape[:2])
            for m in recorder.messages
            if isinstance(m, SealRequest) and m.receiver == f"party-{k}" and m.phase == "train"
        }
        assert sum(asked[(m.round, m.batch_id)][1] for m in sealed) == 2 * data.train.n
        for m in sealed:
            tasks, batch = asked[(m.round, m.batch_id)]
            assert tasks >= 1 and len(m.payload[0]) == tasks * batch * width * 8
        # The report counts exactly what crossed: encoded messages, headers and keys included.
        encoded = sum(len(wire.encode(m)) for m in sent if getattr(m, "phase", "train") == "train")
        assert result.traffic["bytes"][f"party-{k}"]["train"] == encoded


@pytest.mark.parametrize("heads", ["all"])
def test_secure_sums_refuse_a_head_that_would_learn_a_party(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], heads: str
) -> None:
    out = tmp_path / "refused"
    argv = [*BASE, "--heads", heads, "--secure-agg", "masks", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot run under secure aggregation" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_plain_traffic_counts_every_representation_the_parties_send() -> None:
    config = TrainConfig(
        method="laser",
        dataset="digits",
        train_missing="mcar:0.3",
        method_config=MethodConfig(heads="active", epochs=2),
    )
    data = prepare_data(config)
    recorder = RecordingLayer()
    result = run_training(config, data=data, channel=Channel([recorder]))
    width = config.method_config.representation_dim
    for k in range(1, data.train.parties):
        sent = [
            m
            for m in recorder.messages
            if m.sender == f"party-{k}" and getattr(m, "phase", "train") == "train"
        ]
        assert {m.kind for m in sent} == {"representation"}
        # Every epoch each party sends its observed rows: float32 values and int64 positions ...
        observed = int(data.train.mask[:, k].sum())
        payload = sum(m.representation.numel() * 4 + m.positions.numel() * 8 for m in sent)
        assert payload == 2 * observed * (width * 4 + 8)
        # ... and the traffic report counts them as encoded on the wire, headers included.
        encoded = sum(len(wire.encode(m)) for m in sent)
        assert result.traffic["bytes"][f"party-{k}"]["train"] == encoded > payload
    # No protection: the only layer timed is the test's recorder; plain sums cost nothing.
    assert list(result.traffic["channel_layers_s"]) == ["RecordingLayer"]
    assert result.traffic["protection_s"] == result.traffic["channel_layers_s"]["RecordingLayer"]


def test_secure_and_plain_runs_with_the_secure_planner_train_the_same_model() -> None:
    config = TrainConfig(
        method="laser",
        dataset="digits",
        train_missing="mcar:0.3",
        method_config=MethodConfig(heads="active", epochs=2, secure_sums=True),
    )
    data = prepare_data(config)
    plain = run_training(config, data=data)
    secure = run_training(config, data=data, aggregator=MaskingAggregator())
    for name, values in plain.metrics.items():
        assert np.isclose(values["accuracy"], secure.metrics[name]["accuracy"], atol=0.5)
    assert secure.traffic["aggregator"] == "MaskingAggregator"


def test_dp_noise_runs_inside_the_party_so_sealed_shares_are_noised_and_priced(
    tmp_path: Path,
) -> None:
    """Under a split secure sum a representation never crosses in the clear: the embedding
    noise must still be applied (inside the party, before sealing) and priced the same."""
    releases = {}
    for name, extra in {"plain": [], "masks": ["--secure-agg", "masks"]}.items():
        out = tmp_path / name
        argv = [*BASE, "--heads", "active", "--epochs", "1", "--out", str(out)]
        assert main([*argv, "--dp-embeddings", "1.0:1.0", *extra]) == 0
        result = json.loads((out / "result.json").read_text())
        releases[name] = result["privacy"]["releases"]
        assert result["traffic"]["party_hooks_s"] > 0
    assert releases["masks"] == releases["plain"]
    assert all(counts["embedding"] > 0 for counts in releases["masks"].values())
