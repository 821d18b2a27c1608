"""Shared fixtures: small synthetic vertical datasets that train in well under a second, torch
on one thread for tests that compare trained models bit for bit, and DP noise keyed per test."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

import protocols.noise
from secure_vfl.data.datasets import DatasetSplit, LabeledArrays
from secure_vfl.data.missingness import parse_mechanism
from secure_vfl.data.vertical import VerticalData, make_vertical
from secure_vfl.federation.releases import BlockPlan, ReleaseBlocks

if TYPE_CHECKING:
    from test_deploy import Processes


def synthetic_split(
    *, n: int = 600, features: int = 16, classes: int = 3, seed: int = 0
) -> DatasetSplit:
    """Gaussian classes whose signal is spread over every block, so each party is informative."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.5, size=(classes, features))
    y = rng.integers(0, classes, size=n)
    x = (centres[y] + rng.normal(0.0, 1.0, size=(n, features))).astype(np.float32)
    cut = int(0.75 * n)
    return DatasetSplit(
        name="synthetic",
        kind="tabular",
        train=LabeledArrays(x[:cut], y[:cut].astype(np.int64)),
        test=LabeledArrays(x[cut:], y[cut:].astype(np.int64)),
        num_classes=classes,
    )


MakeData = Callable[..., VerticalData]


@pytest.fixture
def make_data() -> MakeData:
    def make(
        *,
        parties: int = 4,
        train_missing: str = "mcar:0.3",
        test_missing: tuple[str, ...] = ("mcar:0", "mcar:0.5"),
        n: int = 600,
        seed: int = 0,
    ) -> VerticalData:
        return make_vertical(
            synthetic_split(n=n, features=4 * parties, seed=seed),
            parties=parties,
            train_missing=parse_mechanism(train_missing),
            test_missing=[parse_mechanism(t) for t in test_missing],
            rng=np.random.default_rng(seed),
        )

    return make


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread inside the test: training then repeats bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _KeyStream:
    """Stands in for :mod:`secrets` in :mod:`protocols.noise`: keys from a stream seeded by the
    test's name, so a test's DP noise and Poisson samples are the same on every run (a run that
    diverges under one draw of the noise diverges every time, here and in CI) while two
    generators made in one test still get different keys."""

    def __init__(self, name: str) -> None:
        self._random = random.Random(hashlib.sha256(name.encode()).digest())

    def randbits(self, bits: int) -> int:
        return self._random.getrandbits(bits)


@pytest.fixture(autouse=True)
def noise_keyed_per_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process DP noise keyed from the test's name instead of operating-system entropy
    (processes a test starts still draw from the OS); ``@pytest.mark.os_entropy`` opts out, for
    the tests of the secure source itself."""
    if request.node.get_closest_marker("os_entropy") is None:
        monkeypatch.setattr(protocols.noise, "secrets", _KeyStream(request.node.nodeid))


@pytest.fixture
def fresh_subsets_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Secure planning as it was before the blocks (a deliberately unsafe planner, for positive
    controls): every step and prediction a fresh random subset of >= 2 observed other parties,
    and under dp a lone observed other party exposed. Over a run its sums isolate parties."""
    generator = torch.Generator().manual_seed(0)

    def fresh_subsets(
        self: ReleaseBlocks, split: str, rows: torch.Tensor, mask: torch.Tensor
    ) -> BlockPlan:
        others = mask.clone()
        others[:, self.receiver] = False
        count = others.sum(dim=1)
        draw = torch.rand(count.shape, generator=generator)
        size = (draw * (count - 1) + 2).floor().clamp(max=count)
        priority = torch.where(others, torch.rand(mask.shape, generator=generator), 2.0)
        rank = priority.argsort(dim=1).argsort(dim=1)
        chosen = others & (rank < size.unsqueeze(1)) & (count >= 2).unsqueeze(1)
        exposed = others & (count == 1).unsqueeze(1) & self.expose
        own = torch.zeros_like(mask)
        own[:, self.receiver] = mask[:, self.receiver]
        fresh = (own | chosen | exposed).unsqueeze(1)  # one sum per sample and step
        return BlockPlan(fresh, exposed, mask.sum(dim=1))

    monkeypatch.setattr(ReleaseBlocks, "plan", fresh_subsets)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts deployment processes (the ``processes`` fixture) is marked
    ``processes``: scripts/check.sh runs those one at a time, after the others."""
    for item in items:
        if "processes" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.processes)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """The processes a deployment test starts (logs under ``tmp_path``), every one stopped by
    its pid when the test ends, passed or failed."""
    from test_deploy import Processes

    started = Processes(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


LABEL_LEAK_RUN = [
    *["--method", "laser", "--dataset", "digits", "--heads", "active"],
    *["--top-model", "none", "--representation-dim", "10", "--epochs", "1"],
]
"""A one-epoch LASER run on digits whose label party has no top model: the run the attack
tests share (direct label inference reads every label from its gradients)."""
