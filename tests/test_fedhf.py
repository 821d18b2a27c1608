"""FedHF-Impute: the GNN's message passing, block masking, FedAvg through the seam, training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from secure_vfl.data.imputation import ClientData, ImputationTask
from secure_vfl.federation.aggregator import PlainAggregator
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import RepresentationMessage, SumMessage
from secure_vfl.methods.imputation import (
    IMPUTERS,
    ImputeConfig,
    Imputer,
    block_mask,
    evaluate,
    federated_average,
    federated_statistics,
    masked_mse,
)
from secure_vfl.methods.imputation.fedhf import (
    ClientShard,
    ReconstructionClient,
    flat_parameters,
)
from secure_vfl.models.feature_graph import FeatureGraph, FeatureGraphImputer

# Small and quick: enough rounds for the GNN to leave its initial plateau on synthetic data.
QUICK = ImputeConfig(rounds=8, local_epochs=4, hidden=64, lr=2e-3)


def synthetic_task(
    *,
    seed: int = 0,
    clients: int = 4,
    features: int = 12,
    rank: int = 2,
    rows: int = 120,
    test_rows: int = 40,
    noise: float = 0.1,
    missing: float = 0.3,
    availability: float = 0.6,
) -> ImputationTask:
    """Low-rank latent factors + small noise on raw scales far from standard, 30 % MCAR missing,
    each client keeping a random 60 % of the features."""
    rng = np.random.default_rng(seed)
    loadings = rng.normal(size=(rank, features))
    offset = rng.uniform(-50, 50, size=features)
    scale = rng.uniform(0.5, 20, size=features)
    keep = round(availability * features)

    def rows_of(n: int, available: np.ndarray) -> np.ndarray:
        x = rng.normal(size=(n, rank)) @ loadings + noise * rng.normal(size=(n, features))
        x = (x * scale + offset).astype(np.float32)
        x[rng.random(x.shape) < missing] = np.nan
        x[:, ~available] = np.nan
        return x

    train, test = [], []
    for k in range(clients):
        available = np.zeros(features, dtype=bool)
        available[rng.choice(features, size=keep, replace=False)] = True
        train.append(ClientData(f"client-{k}", rows_of(rows, available), available))
        test.append(ClientData(f"client-{k}", rows_of(test_rows, available), available.copy()))
    names = tuple(f"f{i}" for i in range(features))
    return ImputationTask("synthetic", names, tuple(train), tuple(test))


def _chain_graph(features: int) -> FeatureGraph:
    """0 - 1 - 2 - ... a path, plus the last feature isolated, for message-passing checks."""
    correlation = np.full((features, features), np.nan)
    for i in range(features - 2):
        correlation[i, i + 1] = correlation[i + 1, i] = 0.5 + 0.1 * i
    return FeatureGraph.from_correlation(correlation, top_k=2)


def test_message_passing_matches_a_loop_over_edges() -> None:
    """Eqs. 1-4 written edge by edge must give the vectorised forward's output."""
    graph = _chain_graph(5)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = FeatureGraphImputer(graph, hidden=8, layers=2)
    x = torch.randn(3, 5)
    observed = torch.rand(3, 5) > 0.3
    available = torch.tensor([True, True, False, True, True])
    expected = torch.zeros(3, 5)
    with torch.no_grad():
        for b in range(3):
            h = []
            for f in range(5):
                tokens = torch.tensor([x[b, f], float(observed[b, f]), float(available[f])])
                h.append(model.input(torch.cat([model.embedding.weight[f], tokens])))
            for layer in model.layers:
                message = [torch.zeros(8) for _ in range(5)]
                for i in range(5):
                    for slot in range(graph.top_k):
                        if graph.mask[i, slot]:
                            j = int(graph.neighbours[i, slot])
                            message[i] += float(graph.weights[i, slot]) * h[j]
                h = [h[i] + layer(torch.cat([h[i], message[i]])) for i in range(5)]
            for f in range(5):
                expected[b, f] = model.output(h[f])[0]
        got = model(x, observed, available)
    assert torch.allclose(got, expected, atol=1e-5)


def test_information_flows_only_along_graph_edges() -> None:
    """With L layers, feature i's prediction depends on j only within L hops; never for an
    isolated feature."""
    graph = _chain_graph(6)  # path 0-1-2-3-4, feature 5 isolated
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = FeatureGraphImputer(graph, hidden=16, layers=2)
    x = torch.zeros(1, 6)
    observed = torch.ones(1, 6, dtype=torch.bool)
    available = torch.ones(6, dtype=torch.bool)
    base = model(x, observed, available).detach()
    x[0, 0] = 3.0
    moved = (model(x, observed, available).detach() - base).abs()[0] > 1e-7
    assert moved.tolist() == [True, True, True, False, False, False]


def test_block_mask_hides_a_quarter_of_available_features_and_only_observed_entries() -> None:
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    available = torch.from_numpy(rng.random(20) < 0.6)
    available[:2] = True
    count = int(available.sum())
    expected = max(1, int(0.25 * count + 0.5))
    chosen = torch.zeros(20)
    for _ in range(400):
        observed = torch.from_numpy(rng.random((16, 20)) < 0.7) & available
        omega = block_mask(observed, available, 0.25, generator)
        assert not bool((omega & ~observed).any())
        assert not bool(omega[:, ~available].any())
        features = torch.zeros(20, dtype=torch.bool)
        # the blocked features are those with any hidden entry; all their observed entries go
        features |= omega.any(dim=0)
        assert torch.equal(omega, observed & features.unsqueeze(0))
        assert int(features.sum()) <= expected
        chosen += features.float()
    # every available feature gets blocked about 25 % of the time, none of the others
    share = chosen[available] / 400
    assert float(share.min()) > 0.15 and float(share.max()) < 0.45
    assert float(chosen[~available].sum()) == 0.0


def test_block_mask_blocks_at_least_one_feature() -> None:
    available = torch.tensor([False, True, False, True])
    observed = torch.ones(5, 4, dtype=torch.bool)
    omega = block_mask(observed, available, 0.01, torch.Generator().manual_seed(0))
    assert int(omega.any(dim=0).sum()) == 1


def test_masked_loss_counts_only_the_corrupted_entries() -> None:
    prediction = torch.zeros(4, 3, requires_grad=True)
    target = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]])
    omega = torch.zeros(4, 3, dtype=torch.bool)
    omega[0, 1] = omega[2, 2] = True
    loss = masked_mse(prediction, target, omega)
    assert float(loss.detach()) == pytest.approx((2.0**2 + 9.0**2) / 2)
    loss.backward()
    assert prediction.grad is not None
    assert bool((prediction.grad[~omega] == 0).all()) and bool((prediction.grad[omega] != 0).all())


class _RecordingModel(nn.Module):
    """A linear reconstruction model that keeps its inputs and the loss gradient it receives."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.calls: list[tuple[Tensor, Tensor]] = []
        self.gradients: list[Tensor] = []

    def forward(self, x: Tensor, observed: Tensor, available: Tensor) -> Tensor:
        self.calls.append((x.detach().clone(), observed.clone()))
        out = self.linear(x)
        out.register_hook(lambda grad: self.gradients.append(grad.clone()))
        return out


def test_local_training_corrupts_exactly_one_block_and_learns_only_on_it() -> None:
    rng = np.random.default_rng(0)
    n, features = 37, 8
    available = torch.tensor([True] * 6 + [False] * 2)
    observed = torch.from_numpy(rng.random((n, features)) < 0.7) & available
    values = torch.from_numpy(rng.normal(size=(n, features)).astype(np.float32)) * observed
    shard = ClientShard(
        name="client-0",
        values=values,
        observed=observed,
        available=available,
        validation=torch.zeros(n, features, dtype=torch.bool),
        targets=torch.zeros(n, features),
    )
    model = _RecordingModel(features)
    config = ImputeConfig(batch_size=16)
    client = ReconstructionClient(shard, model, config, torch.Generator().manual_seed(0))
    client.train(1)
    assert [x.shape[0] for x, _ in model.calls] == [16, 16, 5]  # the short batch is kept
    rows_seen: list[int] = []
    for (x, m), gradient in zip(model.calls, model.gradients, strict=True):
        # find each batch row in the shard by its entries that stayed observed
        rows = [
            int(
                torch.nonzero(
                    (values[:, m[b]] == x[b, m[b]]).all(dim=1) & (observed >= m[b]).all(1)
                )[0]
            )
            for b in range(x.shape[0])
        ]
        rows_seen += rows
        assert not bool((m & ~observed[rows]).any())
        omega = observed[rows] & ~m
        blocked = omega.any(dim=0)
        assert int(blocked.sum()) == round(0.25 * 6)  # 2 of the 6 available features
        assert not bool(blocked[~available].any())
        assert torch.equal(omega, observed[rows] & blocked)  # every observed entry of the block
        assert bool((x[omega] == 0).all()) and torch.equal(x[~omega], values[rows][~omega])
        assert torch.equal(gradient != 0, omega)  # the loss sees exactly Omega
    assert sorted(rows_seen) == list(range(n))


def test_federated_average_weights_by_sample_counts_through_the_seam() -> None:
    recorder = RecordingLayer()
    channel = Channel([recorder])
    theta_small = torch.tensor([1.0, -2.0, 8.0])
    theta_large = torch.tensor([5.0, 2.0, 0.0])
    averaged = federated_average(
        PlainAggregator(),
        channel,
        {"client-0": (1, theta_small), "client-1": (3, theta_large)},
        total_rows=4,
        receiver="server",
        round=4,
    )
    assert averaged is not None
    assert torch.equal(averaged, torch.tensor([4.0, 1.0, 2.0]))  # (1*a + 3*b) / 4 exactly
    sent = [m for m in recorder.messages if isinstance(m, RepresentationMessage)]
    assert [m.sender for m in sent] == ["client-0", "client-1"]
    # each client sends its share n_k / N of theta: never larger than theta itself
    assert torch.equal(sent[0].representation[0], torch.tensor([0.25, -0.5, 2.0, 0.25]))
    assert torch.equal(sent[1].representation[0], torch.tensor([3.75, 1.5, 0.0, 0.75]))
    summed = [m for m in recorder.messages if isinstance(m, SumMessage)]
    assert len(summed) == 1 and summed[0].receiver == "server" and summed[0].round == 4


def test_fedhf_model_updates_travel_only_through_the_seam_with_client_sampling() -> None:
    task = synthetic_task(rows=20, test_rows=5, features=6)
    recorder = RecordingLayer()
    config = ImputeConfig(rounds=3, local_epochs=1, hidden=8, layers=1, client_fraction=0.5)
    imputer = IMPUTERS.get("fedhf")(task, config, seed=0, channel=Channel([recorder]))
    statistics_messages = len(recorder.messages)
    # three statistics exchanges and the row count N: 4 clients + the sum each
    assert statistics_messages == 4 * (4 + 1)
    imputer.fit()
    size = flat_parameters(FeatureGraphImputer(_chain_graph(6), hidden=8, layers=1)).numel()
    updates = [
        m
        for m in recorder.messages[statistics_messages:]
        if isinstance(m, RepresentationMessage) and m.representation.shape[1] == size + 1
    ]
    assert len(updates) == 3 * 2  # client_fraction 0.5: two of the four clients per round
    rounds = [m.round for m in updates]
    assert rounds == [0, 0, 1, 1, 2, 2]
    assert all(float(m.representation[0, -1]) == 0.25 for m in updates)  # n_k / N rides along


@pytest.fixture(scope="module")
def trained_fedhf() -> tuple[ImputationTask, Imputer, list[float]]:
    task = synthetic_task(seed=0)
    imputer = IMPUTERS.get("fedhf")(task, QUICK, seed=0)
    curve = imputer.fit()
    return task, imputer, curve


def test_fedhf_validation_curve_decreases(trained_fedhf) -> None:
    _, _, curve = trained_fedhf
    assert len(curve) == QUICK.rounds
    assert curve[-1] < 0.92 * curve[0]
    assert min(curve[-3:]) < min(curve[:3])


def test_fedhf_beats_column_means_on_correlated_data(trained_fedhf) -> None:
    task, imputer, _ = trained_fedhf
    standardisation = federated_statistics(task.train).standardisation
    fedhf = evaluate(imputer, task, standardisation=standardisation, seed=0)
    for name in ("mean", "fed-mean"):
        baseline = IMPUTERS.get(name)(task, QUICK, seed=0)
        scores = evaluate(baseline, task, standardisation=standardisation, seed=0)
        assert fedhf["rmse"] < 0.9 * scores["rmse"], (name, fedhf["rmse"], scores["rmse"])
