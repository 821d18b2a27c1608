"""A deployed imputation on loopback: three clients, each its own `party serve` process with its
own client file, the label party coordinating over gRPC with mutual TLS, against `impute
--client-file` on the same files and seed. Every process started here is stopped by its pid when
the test ends, passed or failed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from test_deploy import PARTIES, PROCESS_SECONDS, Processes, write_federation

from protocols import tls
from secure_vfl.cli import main
from secure_vfl.federation.network import free_loopback_ports

pytestmark = pytest.mark.processes  # party processes, loopback endpoints, deadlines

CLIENTS = PARTIES[1:]  # the label party coordinates; the other three are the clients
FLAGS = ["--rounds", "3", "--local-epochs", "1", "--batch-size", "16", "--seed", "4", "--quiet"]


def write_client_files(directory: Path, *, rows: int = 48) -> None:
    """Three clients' files of five correlated features: each client lacks one of them, some of
    its cells are empty, and its ids are its own (an id column is not a feature)."""
    rng = np.random.default_rng(0)
    features = ["a", "b", "c", "d", "e"]
    for k, name in enumerate(CLIENTS):
        base = rng.normal(size=(rows, 1))
        values = base + 0.3 * rng.normal(size=(rows, len(features)))
        values[rng.random(values.shape) < 0.1] = np.nan
        frame = pd.DataFrame(values, columns=features).drop(columns=features[k + 1])
        frame.insert(0, "id", [f"{name}-{i}" for i in range(rows)])
        frame.to_csv(directory / f"{name}.csv", index=False)
    # The label party's `data` and `labels` files are named in the federation file but not
    # written: an imputation does not read them.


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deploy-impute")
    write_client_files(directory)
    tls.make_federation(directory / "certs", [*PARTIES, "aggregator"])
    return directory


def _result(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "result.json").read_text()))


@pytest.mark.usefixtures("one_thread")  # float sums in the order of one thread, as the clients'
@pytest.mark.parametrize("secure_agg", ["none", "masks"])
def test_three_clients_in_their_own_processes_impute_as_in_one(
    site: Path,
    processes: Processes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    secure_agg: str,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # every party process: torch on one thread
    flags = [*FLAGS, "--method", "fedhf", "--secure-agg", secure_agg]
    files = [arg for name in CLIENTS for arg in ("--client-file", str(site / f"{name}.csv"))]
    assert main(["impute", *files, *flags, "--out", str(tmp_path / "alone")]) == 0
    alone = _result(tmp_path / "alone")

    federation = write_federation(site, site / "certs", free_loopback_ports(5))
    servers = [processes.serve(federation, name) for name in (*CLIENTS, "aggregator")]
    label = processes.start(
        "impute",
        "--federation",
        str(federation),
        "--name",
        "bank",
        *flags,
        "--out",
        str(tmp_path / "deployed"),
        log="bank",
    )
    assert label.wait(timeout=PROCESS_SECONDS) == 0, processes.log("bank")
    codes = [server.wait(timeout=PROCESS_SECONDS) for server in servers]
    assert codes == [0, 0, 0, 0], [processes.log(name) for name in (*CLIENTS, "aggregator")]
    for name in CLIENTS:
        assert "set up by bank as an imputation client" in processes.log(name)
    result = _result(tmp_path / "deployed")

    # The same clients, splits, models and hidden entries: the same training, exactly.
    assert result["clients"] == alone["clients"]
    assert result["hidden_per_client"] == alone["hidden_per_client"]
    assert result["validation_curve"] == alone["validation_curve"]
    if secure_agg == "none":
        assert result["metrics"] == alone["metrics"]
    else:
        # In one process the yardstick's statistics are summed in the clear; deployed, through
        # the run's masks (fixed point): the same scores up to that precision.
        for name, rmse in alone["rmse_per_client"].items():
            assert result["rmse_per_client"][name] == pytest.approx(rmse, rel=1e-4)
    # Every party reported its bytes: the traffic counts the clients and the aggregator too.
    assert set(result["traffic"]["bytes"]) == {"bank", *CLIENTS, "aggregator"}
    assert result["config"]["federation"] == str(federation)
