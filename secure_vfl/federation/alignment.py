"""Sample alignment: from each party's ids to the shared sample list and availability mask.

An :class:`Aligner` takes only ids (each party's and the label party's), never features, so a
private set intersection protocol can stand behind the same interface as the plain join here.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from secure_vfl.errors import ConfigError, DataError
from secure_vfl.registry import Registry


@dataclass(frozen=True)
class Alignment:
    """The aligned samples and where each party holds them.

    ``sample_ids`` (N,): the label party's ids that were kept, sorted. ``rows`` (N, K) int64:
    the row of party k's table holding sample i, or -1 where party k does not hold it.
    ``label_rows`` (N,) int64: the row of the label table for each sample. ``dropped``: label
    ids held by no party (removed). ``mask`` (N, K) bool is ``rows >= 0``.
    """

    sample_ids: np.ndarray
    rows: np.ndarray
    label_rows: np.ndarray
    dropped: int = 0
    mask: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.sample_ids.shape[0]
        if self.rows.ndim != 2 or self.rows.shape[0] != n or self.rows.dtype != np.int64:
            raise DataError(
                f"`rows` must be int64 of shape ({n}, K). "
                f"Found {self.rows.dtype} {self.rows.shape}."
            )
        if self.label_rows.shape != (n,) or self.label_rows.dtype != np.int64:
            raise DataError(
                f"`label_rows` must be int64 of shape ({n},). "
                f"Found {self.label_rows.dtype} {self.label_rows.shape}."
            )
        object.__setattr__(self, "mask", self.rows >= 0)

    @property
    def parties(self) -> int:
        """Number of feature-holding parties K."""
        return int(self.rows.shape[1])

    def observed_fraction(self) -> np.ndarray:
        """(K,) float64: the share of aligned samples each party holds."""
        if self.mask.shape[0] == 0:
            return np.zeros(self.parties)
        return self.mask.mean(axis=0)


class Aligner(Protocol):
    """Aligns the parties' samples on the label party's ids, given only ids."""

    def align(self, party_ids: Sequence[np.ndarray], label_ids: np.ndarray) -> Alignment:
        """Return the samples held by the label party and at least one feature party."""
        ...


def check_unique_ids(ids: np.ndarray, who: str) -> None:
    if ids.ndim != 1:
        raise DataError(f"{who} ids must be 1-D. Found shape {ids.shape}.")
    if ids.dtype.kind == "O" and ids.size:  # numpy sorts them by comparing: text and numbers do not
        values = ids.tolist()
        text = isinstance(values[0], str)
        odd = next((value for value in values if _is_text_id(value) != text), None)
        if odd is None and not text:
            odd = next((value for value in values if not _is_number_id(value)), None)
        if odd is not None:
            raise DataError(
                f"{who} ids must be all text or all numbers. Found {type(odd).__name__} "
                f"{odd!r:.40} among {'text' if text else 'number'} ids."
            )
    unique, counts = np.unique(ids, return_counts=True)
    if unique.size != ids.size:
        repeated = unique[counts > 1][:3].tolist()
        raise DataError(f"{who} ids must be unique. Found repeats, e.g. {repeated}.")


def _is_text_id(value: object) -> bool:
    return isinstance(value, str)


def _is_number_id(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def id_kind(ids: np.ndarray) -> str:
    return "text" if ids.dtype.kind in "USO" else "number"


def checked_ids(
    party_ids: Sequence[np.ndarray], label_ids: np.ndarray
) -> tuple[list[np.ndarray], np.ndarray]:
    """The parties' and the label party's ids as arrays, refused unless there is at least one
    party, every party's ids are unique and all are of the label ids' kind."""
    if len(party_ids) == 0:
        raise DataError("expected the ids of at least one party. Found none.")
    label_ids = np.asarray(label_ids)
    check_unique_ids(label_ids, "label party")
    arrays = []
    for k, ids in enumerate(party_ids):
        ids = np.asarray(ids)
        check_unique_ids(ids, f"party {k}")
        if id_kind(ids) != id_kind(label_ids):
            raise DataError(
                f"party {k} ids must be of the same kind as the label ids "
                f"({id_kind(label_ids)}). Found {id_kind(ids)}."
            )
        arrays.append(ids)
    return arrays, label_ids


class JoinAligner:
    """Plain join on ids. Insecure: the aligner sees every party's full id list, so use it for
    tests and trusted settings only; a PSI aligner reveals only the intersection.

    Samples are the label ids present in at least one party (sorted); label ids held by no
    party are dropped and counted in :attr:`Alignment.dropped`. Party ids without a label are
    not part of the alignment.
    """

    def align(self, party_ids: Sequence[np.ndarray], label_ids: np.ndarray) -> Alignment:
        """Join each party's ids against the label party's ids."""
        party_ids, label_ids = checked_ids(party_ids, label_ids)
        label_order = np.argsort(label_ids, kind="stable")
        sorted_labels = label_ids[label_order]
        rows = np.full((sorted_labels.size, len(party_ids)), -1, dtype=np.int64)
        for k, ids in enumerate(party_ids):
            if ids.size == 0:
                continue
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            position = np.minimum(np.searchsorted(sorted_ids, sorted_labels), ids.size - 1)
            found = sorted_ids[position] == sorted_labels
            rows[found, k] = order[position[found]]
        kept = (rows >= 0).any(axis=1)
        return Alignment(
            sample_ids=sorted_labels[kept],
            rows=rows[kept],
            label_rows=label_order[kept].astype(np.int64),
            dropped=int((~kept).sum()),
        )


ALIGNERS: Registry[Callable[[], Aligner]] = Registry("aligner")
"""Aligners by name (``--align``): ``join`` here; importing ``protocols.psi`` adds ``psi``."""
ALIGNERS.register("join", JoinAligner)


def make_aligner(name: str) -> Aligner:
    """The aligner registered as ``name``; says which module registers the privacy-layer ones."""
    if name not in ALIGNERS:
        raise ConfigError(
            f"unknown aligner {name!r}; expected one of {', '.join(ALIGNERS.names())} "
            "(`psi` is registered by importing protocols.psi)."
        )
    return ALIGNERS.get(name)()
