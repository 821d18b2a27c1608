"""One imputation client's saved part: what it needs to fill new rows of its own, alone.

A client writes its part into its own directory and reads it back from there; filling is a
local step (eq. 7 on its own rows), so no other party takes part. A part is

- ``part.json``: the schema, the client's name, its kind and the name of its tensor file;
- ``imputer.safetensors`` (:mod:`secure_vfl.tensor_file`: raw buffers under a JSON header, no
  pickle): the client's schema ``available`` (bool, one per feature of the federation) and

  - ``means``: its column means (``mean`` and ``fed-mean``), or
  - ``reconstruction``: the standardisation it was published (``mean``, ``std``, ``constant``),
    the feature graph (FedHF only) and its model's state (``dae``, ``fed-dae``, ``fedhf``).

Every file is checked against the SHA-256 the imputer's manifest lists for it before it is
parsed; a part that does not fit the architecture the manifest describes, or holds values that
are not finite, is refused (:class:`~secure_vfl.errors.IntegrityError`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from secure_vfl.data.imputation import ClientData
from secure_vfl.errors import DataError, IntegrityError, ProtocolError
from secure_vfl.federation.parts import first_difference, load_states, sha256, verified_bytes
from secure_vfl.io import atomic_write, atomic_write_json, check_document, parse_json
from secure_vfl.methods.imputation.base import imputation_rule
from secure_vfl.methods.imputation.statistics import Standardisation
from secure_vfl.models.feature_graph import FeatureGraph
from secure_vfl.tensor_file import SUFFIX, dumps, loads

PART_SCHEMA = "secure-vfl/imputer-part"
PART_VERSION = 1
PART_INDEX = "part.json"
TENSORS_FILE = f"imputer{SUFFIX}"
MEANS = "means"
RECONSTRUCTION = "reconstruction"

ModelBuilder = Callable[[FeatureGraph | None], nn.Module]
"""The architecture the manifest describes, built on the part's feature graph (None: a model
that reads none)."""


def write_part(
    directory: Path, *, client: str, kind: str, tensors: Mapping[str, Any]
) -> dict[str, str]:
    """Write one client's part into ``directory`` (each file atomically): ``tensors`` is its
    tensor file's tree. Returns the SHA-256 of each file written, for the manifest."""
    data = dumps(dict(tensors))

    def write(tmp: Path) -> None:
        tmp.write_bytes(data)

    atomic_write(directory / TENSORS_FILE, write)
    index = {
        "schema": PART_SCHEMA,
        "version": PART_VERSION,
        "client": client,
        "kind": kind,
        "tensors": TENSORS_FILE,
    }
    atomic_write_json(directory / PART_INDEX, index)
    return {TENSORS_FILE: sha256(data), PART_INDEX: sha256((directory / PART_INDEX).read_bytes())}


def means_tensors(available: np.ndarray, means: np.ndarray) -> dict[str, Any]:
    """The tensor tree of a column-means client."""
    return {
        "available": torch.from_numpy(available.copy()),
        "means": torch.from_numpy(np.asarray(means, dtype=np.float32).copy()),
    }


def reconstruction_tensors(
    available: np.ndarray,
    standardisation: Standardisation,
    graph: FeatureGraph | None,
    model: nn.Module,
) -> dict[str, Any]:
    """The tensor tree of a reconstruction client: its schema, standardisation, graph, model."""
    constant = standardisation.constant
    return {
        "available": torch.from_numpy(available.copy()),
        "mean": torch.from_numpy(np.asarray(standardisation.mean, dtype=np.float64).copy()),
        "std": torch.from_numpy(np.asarray(standardisation.std, dtype=np.float64).copy()),
        "constant": None if constant is None else torch.from_numpy(constant.copy()),
        "graph": None
        if graph is None
        else {
            "neighbours": torch.from_numpy(graph.neighbours.copy()),
            "weights": torch.from_numpy(graph.weights.copy()),
            "mask": torch.from_numpy(graph.mask.copy()),
        },
        "model": model.state_dict(),
    }


@dataclass(frozen=True, eq=False)
class ClientPart:
    """A client's saved imputer, loaded: it fills rows of its own (:meth:`impute`)."""

    client: str
    available: np.ndarray
    means: np.ndarray | None = None
    standardisation: Standardisation | None = None
    model: nn.Module | None = None

    def impute(self, rows: ClientData) -> np.ndarray:
        """Eq. 7 on ``rows`` (in the federation's features): observed values kept, the missing
        entries of the features ``rows`` has filled, the others NaN."""
        if self.means is not None:
            return imputation_rule(rows, np.broadcast_to(self.means, rows.values.shape))
        assert self.standardisation is not None and self.model is not None  # by the loader
        from secure_vfl.methods.imputation.clients import reconstruct  # it imports this module

        return reconstruct(self.model, self.standardisation, rows)


def read_part(
    directory: Path,
    files: Mapping[str, str],
    *,
    client: str,
    features: int,
    build: ModelBuilder | None,
) -> ClientPart:
    """Read client ``client``'s part from ``directory``, every file checked against ``files``
    (its manifest entry: name -> SHA-256) before it is parsed. ``features``: the federation's
    feature count; ``build``: the architecture of a reconstruction part (None: a means part is
    expected). IntegrityError for a missing, unlisted or altered file or a state that does not
    fit; DataError for a malformed one."""
    where = str(directory / PART_INDEX)
    index = check_document(
        parse_json(verified_bytes(directory, PART_INDEX, files, client), where),
        schema=PART_SCHEMA,
        versions=(PART_VERSION,),
        where=where,
    )
    expected_kind = MEANS if build is None else RECONSTRUCTION
    if index.get("client") != client or index.get("kind") != expected_kind:
        raise IntegrityError(
            f"{where}: the {expected_kind} part of {client} expected, found the "
            f"{index.get('kind')!r} part of {index.get('client')!r}."
        )
    if set(index) != {"schema", "version", "client", "kind", "tensors"}:
        raise IntegrityError(
            f"{where}: keys client, kind, schema, tensors and version expected, found "
            f"{sorted(index)}."
        )
    if index.get("tensors") != TENSORS_FILE or set(files) != {PART_INDEX, TENSORS_FILE}:
        raise IntegrityError(
            f"{client}: files {sorted([PART_INDEX, TENSORS_FILE])} expected in its part, the "
            f"manifest lists {sorted(files)} and part.json names {index.get('tensors')!r:.60}."
        )
    tensor_path = str(directory / TENSORS_FILE)
    tree = loads(verified_bytes(directory, TENSORS_FILE, files, client), tensor_path)
    keys = (
        {"available", "means"}
        if build is None
        else {"available", "mean", "std", "constant", "graph", "model"}
    )
    if not isinstance(tree, dict) or set(tree) != keys:
        found = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
        raise IntegrityError(f"{tensor_path}: entries {sorted(keys)} expected, found {found}.")
    available = _array(tree["available"], (features,), torch.bool, "available", tensor_path)
    if not available.any():
        raise IntegrityError(
            f"{tensor_path}: a schema of at least one feature expected, found none."
        )
    if build is None:
        means = _array(tree["means"], (features,), torch.float32, "means", tensor_path)
        return ClientPart(client=client, available=available, means=means)
    mean = _array(tree["mean"], (features,), torch.float64, "mean", tensor_path)
    std = _array(tree["std"], (features,), torch.float64, "std", tensor_path)
    constant = None
    if tree["constant"] is not None:
        constant = _array(tree["constant"], (features,), torch.bool, "constant", tensor_path)
    try:
        standardisation = Standardisation(mean=mean, std=std, constant=constant)
        graph = _graph(tree["graph"], features, tensor_path)
    except DataError as error:
        raise IntegrityError(f"{tensor_path}: {error}") from None
    state = tree["model"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise IntegrityError(f"{tensor_path}: model: a state of named tensors expected.")
    # The architecture the manifest describes, first without memory: a manifest edited to ask
    # for a vast network is refused by the saved state's shapes before it is built.
    try:
        with torch.device("meta"):
            differs = first_difference(build(graph).state_dict(), state)
    except (ProtocolError, DataError) as error:  # e.g. FedHF's model without its graph
        raise IntegrityError(f"{tensor_path}: {error}") from None
    if differs is not None:
        raise IntegrityError(
            f"{client}: the saved model does not fit the architecture the manifest describes "
            f"(its impute_config and features): {differs}."
        )
    model = build(graph)
    load_states({"model": model}, {"model": state}, party=client)
    model.eval()
    return ClientPart(
        client=client, available=available, standardisation=standardisation, model=model
    )


def _array(
    value: Any, shape: tuple[int, ...], dtype: torch.dtype, name: str, where: str
) -> np.ndarray:
    """A tensor entry as a numpy array, once its shape and dtype are as expected and its
    floating-point values finite."""
    if (
        not isinstance(value, Tensor)
        or tuple(value.shape) != shape
        or value.dtype != dtype
        or (value.is_floating_point() and not bool(value.isfinite().all()))
    ):
        found = (
            f"{value.dtype} {list(value.shape)}"
            if isinstance(value, Tensor)
            else type(value).__name__
        )
        raise IntegrityError(
            f"{where}: {name}: finite {dtype} of shape {list(shape)} expected, found {found} "
            "(or values that are not finite)."
        )
    return value.numpy()


def _graph(value: Any, features: int, where: str) -> FeatureGraph | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"neighbours", "weights", "mask"}:
        raise IntegrityError(f"{where}: graph: neighbours, weights and mask expected.")
    neighbours = value["neighbours"]
    if (
        not isinstance(neighbours, Tensor)
        or neighbours.ndim != 2
        or neighbours.shape[0] != features
    ):
        raise IntegrityError(f"{where}: graph: a neighbour table of {features} features expected.")
    shape = tuple(neighbours.shape)
    return FeatureGraph(
        neighbours=_array(neighbours, shape, torch.int64, "graph.neighbours", where),
        weights=_array(value["weights"], shape, torch.float32, "graph.weights", where),
        mask=_array(value["mask"], shape, torch.bool, "graph.mask", where),
    )
