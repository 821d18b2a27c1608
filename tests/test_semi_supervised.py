"""The semi-supervised setting (``labeled``) and SimSiam pretraining, for every split method."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MakeData, synthetic_split

from secure_vfl.cli import main
from secure_vfl.data.missingness import parse_mechanism
from secure_vfl.data.vertical import VerticalData, make_vertical
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig, check_data
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import (
    build_federation,
    in_process_parties,
    labeled_rows,
    training_rows,
)
from secure_vfl.models.networks import make_bottom
from secure_vfl.models.simsiam import pretrain_progress, pretrain_simsiam

FAST = MethodConfig(epochs=2, batch_size=32, lr=0.05, labeled=60)
SPLIT_METHODS = ["laser", "local", "ensemble", "standard", "plugvfl", "combinatorial"]


@pytest.mark.parametrize("name", SPLIT_METHODS)
def test_methods_train_only_on_the_labelled_rows(make_data: MakeData, name: str) -> None:
    data = make_data(n=300)
    labeled = labeled_rows(data, FAST, seed=1)
    # Unlabelled rows get a class that does not exist: reading one would fail the loss.
    labels = data.train.labels.copy()
    unlabelled = np.setdiff1d(np.arange(data.train.n), labeled)
    labels[unlabelled] = data.num_classes + 7
    data = dataclasses.replace(data, train=dataclasses.replace(data.train, labels=labels))
    method = METHODS.get(name)(data, FAST, seed=1)
    drawn = np.concatenate(list(method.sampler.epoch(np.random.default_rng(0))))
    assert set(drawn.tolist()) <= set(labeled.tolist())
    if name == "standard":  # Vanilla VFL: the labelled rows every party holds
        complete = labeled[data.train.mask[labeled].all(axis=1)]
        assert sorted(drawn.tolist()) == complete.tolist()
    else:
        assert sorted(drawn.tolist()) == labeled.tolist()
    losses = method.fit()
    assert all(np.isfinite(losses))


def test_every_method_of_a_run_labels_the_same_rows(make_data: MakeData) -> None:
    data = make_data(n=300)
    first = labeled_rows(data, FAST, seed=4)
    assert first.size == 60 and np.array_equal(first, labeled_rows(data, FAST, seed=4))
    assert not np.array_equal(first, labeled_rows(data, FAST, seed=5))
    everything = labeled_rows(data, dataclasses.replace(FAST, labeled=None), seed=4)
    assert np.array_equal(everything, np.arange(data.train.n))
    with pytest.raises(ConfigError, match=r"`labeled` must be an integer in \[1, "):
        labeled_rows(data, dataclasses.replace(FAST, labeled=10**6), seed=4)


def test_simsiam_pretraining_lowers_its_loss_and_changes_the_bottom() -> None:
    generator = torch.Generator().manual_seed(0)
    # Rows on a low-dimensional structure: SimSiam can learn views that agree.
    rows = torch.randn(512, 3, generator=generator) @ torch.randn(3, 12, generator=generator)
    torch.manual_seed(0)
    bottom = make_bottom((12,), out=32)
    before = [p.detach().clone() for p in bottom.parameters()]
    losses = pretrain_simsiam(
        bottom, rows, width=32, epochs=15, batch_size=64, lr=0.05, generator=generator
    )
    assert losses[-1] < losses[0] - 0.4  # it fell 0.56-0.87 over seeds 0-8
    assert all(-1.0 <= loss <= 1.0 for loss in losses)
    assert all(p.grad is None for p in bottom.parameters())  # nothing left for training
    assert any(not torch.equal(a, b) for a, b in zip(before, bottom.parameters(), strict=True))


def test_pretraining_is_local_and_reproducible(make_data: MakeData) -> None:
    data = make_data(n=200)
    config = dataclasses.replace(FAST, pretrain_epochs=2)
    recording = RecordingLayer()
    pretrained = build_federation(
        data, config, seed=3, channel=Channel([recording]), aggregator=None
    )
    assert recording.messages == []  # a party pretrains on its own block, sending nothing
    again = build_federation(data, config, seed=3, channel=None, aggregator=None)
    plain = build_federation(
        data, dataclasses.replace(config, pretrain_epochs=0), seed=3, channel=None, aggregator=None
    )
    for a, b, c in zip(
        *(in_process_parties(f.channel) for f in (pretrained, again, plain)), strict=True
    ):
        pa, pb, pc = (list(p.model.parameters()) for p in (a, b, c))
        assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
        assert any(not torch.equal(x, z) for x, z in zip(pa, pc, strict=True))


def test_pretraining_reports_each_partys_batches_to_the_installed_progress(
    make_data: MakeData,
) -> None:
    """Pretraining ran before training's first step with no progress shown (the CLI's bar
    starts with training); each party now reports every batch, up to its epochs x batches."""
    data = make_data(n=200)
    config = dataclasses.replace(FAST, pretrain_epochs=3)
    reports: list[tuple[str, int, int]] = []
    with pretrain_progress(lambda party, done, total: reports.append((party, done, total))):
        federation = build_federation(data, config, seed=3, channel=None, aggregator=None)
    names = [party.name for party in in_process_parties(federation.channel)]
    assert [party for party, _, _ in reports] == sorted(
        (party for party, _, _ in reports), key=names.index
    )
    for k, name in enumerate(names):
        own = int(data.train.mask[:, k].sum())
        batches = -(-own // config.batch_size)
        done = [(d, t) for party, d, t in reports if party == name]
        assert done == [(i, 3 * batches) for i in range(1, 3 * batches + 1)], name
    reports.clear()
    build_federation(data, config, seed=3, channel=None, aggregator=None)  # outside the block
    assert reports == []


def test_combinatorial_refuses_pretraining(make_data: MakeData) -> None:
    config = dataclasses.replace(FAST, pretrain_epochs=1)
    with pytest.raises(ConfigError, match="SimSiam pretraining applies"):
        METHODS.get("combinatorial")(make_data(), config, seed=0)


def test_cli_labeled_run_records_its_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "semi"
    argv = ["train", "--method", "laser", "--dataset", "digits", "--heads", "active"]
    argv += ["--labeled", "150", "--pretrain-epochs", "1", "--epochs", "2", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    config = json.loads((out / "result.json").read_text())["config"]["method_config"]
    assert (config["labeled"], config["pretrain_epochs"]) == (150, 1)
    assert "training samples, 150 labelled)" in capsys.readouterr().out
    bad = ["train", "--method", "laser", "--dataset", "digits", "--labeled", "0"]
    with pytest.raises(SystemExit) as exit_info:
        main([*bad, "--out", str(tmp_path / "bad")])
    assert exit_info.value.code == 2 and "--labeled" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def aligned_data(aligned: int, *, n: int = 600) -> VerticalData:
    """4 parties, MCAR 0.5 in training, ``aligned`` samples kept observed by every party."""
    return make_vertical(
        synthetic_split(n=n, features=16, seed=2),
        parties=4,
        train_missing=parse_mechanism("mcar:0.5"),
        test_missing=[parse_mechanism("mcar:0")],
        rng=np.random.default_rng(2),
        aligned=aligned,
        aligned_rng=np.random.default_rng(9),
    )


def test_the_aligned_reserve_is_labelled_first_and_standard_vfl_trains_on_it() -> None:
    data = aligned_data(40)
    assert data.aligned_rows is not None and data.aligned_rows.size == 40
    labeled = labeled_rows(data, FAST, seed=1)  # FAST labels 60
    assert labeled.size == 60 and set(data.aligned_rows.tolist()) <= set(labeled.tolist())
    assert np.array_equal(labeled, labeled_rows(data, FAST, seed=1))
    # The other 20 are drawn among the rest by the seed, whatever their masks.
    assert not np.array_equal(labeled, labeled_rows(data, FAST, seed=2))
    everything = labeled_rows(data, dataclasses.replace(FAST, labeled=None), seed=1)
    assert np.array_equal(everything, np.arange(data.train.n))
    # Vanilla VFL keeps the complete labelled samples: the 40 and the few (1/16) of the rest.
    complete = training_rows("standard", data, FAST, seed=1)
    assert set(data.aligned_rows.tolist()) <= set(complete.tolist())
    assert complete.size < 40 + 10
    without = training_rows("standard", aligned_data(0), FAST, seed=1)
    assert without.size < 15
    with pytest.raises(ConfigError, match="the 40 samples kept aligned are labelled ones"):
        labeled_rows(data, dataclasses.replace(FAST, labeled=39), seed=1)


def test_cli_aligned_labeled_run_records_its_reserve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "reserve"
    argv = ["train", "--method", "standard", "--dataset", "digits", "--p-miss-train", "0.5"]
    argv += ["--labeled", "200", "--aligned-labeled", "100", "--epochs", "1", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["aligned_labeled"] == 100
    # standard trains on the labelled samples every party holds: the 100 kept aligned at least
    assert result["trained_on"] >= 100
    assert (
        f"200 labelled, 100 kept aligned; trained on the {result['trained_on']} labelled ones "
        "held by every party)"
    ) in capsys.readouterr().out
    for flags, refusal in (
        (["--labeled", "99"], "expected `labeled` of at least 100, found 99"),
        (
            ["--labeled", "6000", "--aligned-labeled", "5000"],
            r"`aligned_labeled` must be an integer in \[0, 1438\]",
        ),
    ):
        assert main([*argv, *flags, "--out", str(tmp_path / "bad")]) != 0
        assert re.search(refusal, capsys.readouterr().err)
    assert not (tmp_path / "bad").exists()


def test_an_aligned_reserve_is_refused_with_party_files_and_checked_against_given_data(
    tmp_path: Path,
) -> None:
    files = {name: tmp_path / f"{name}.csv" for name in ("a", "b", "labels")}
    for path in files.values():
        path.write_text("id,x\n1,0\n")
    with pytest.raises(ConfigError, match="the missingness of party files is what the files"):
        TrainConfig(
            method="laser",
            party_files=(files["a"], files["b"]),
            label_file=files["labels"],
            aligned_labeled=10,
        )
    config = TrainConfig(
        method="standard",
        dataset="synthetic",
        train_missing="mcar:0.5",
        method_config=dataclasses.replace(FAST, labeled=60),
        aligned_labeled=30,
    )
    with pytest.raises(ConfigError, match="aligned labelled samples 30 expected, found 40"):
        check_data(config, aligned_data(40))
    check_data(config, aligned_data(30))
