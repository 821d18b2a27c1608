"""What a receiver may learn about one sample over a whole run, and the check that it learns
no single party's term.

A secure sum hides each contributor among the others *within one sum*. Over a run the receiver
collects many sums about the same sample (every training step of every epoch, every prediction
under every test split) and may combine them: from A+B, A+C and B+C it gets
A = ((A+B) + (A+C) - (B+C)) / 2. :func:`isolated_terms` is the worst-case audit of that: it
treats the sums as exact linear functions of fixed terms (a model that has stopped moving) and
asks, for every sample and party, whether some linear combination over the reals isolates the
party's term.
"""

from __future__ import annotations

import numpy as np


def isolated_terms(released: np.ndarray, exposed: np.ndarray) -> np.ndarray:
    """(B, K) bool: which party's term of each sample some linear combination of its releases
    isolates.

    ``released`` (B, m, K): for sample b, the indicator vectors over the parties of the m clean
    parts of the sums the receiver got about it (zero rows pad; the receiver's own column must
    be zero: it knows its own term). ``exposed`` (B, K): the parties whose term of the sample
    the receiver also got as a DP release (clipped and noised, priced by that party's
    accountant). Such a release counts as the known vector e_j when auditing every *other*
    party (the worst case: the noise is no help to them) but not when auditing j itself, whose
    exposure is priced: party k of sample b is isolated iff
    e_k is in span(released[b] and e_j for the exposed j != k).
    """
    released = np.asarray(released, dtype=np.float64)
    exposed = np.asarray(exposed, dtype=bool)
    if released.ndim != 3 or exposed.shape != (released.shape[0], released.shape[2]):
        raise ValueError(
            f"released (B, m, K) and exposed (B, K) expected; found {released.shape} and "
            f"{exposed.shape}."
        )
    samples, _, parties = released.shape
    isolated = np.zeros((samples, parties), dtype=bool)
    identity = np.eye(parties)
    for k in range(parties):
        known = exposed.copy()
        known[:, k] = False
        # The exposures other than k's, as rows e_j (zero rows where not exposed).
        exposures = known[:, :, None] * identity[None]
        basis = np.concatenate([released, exposures], axis=1)
        target = np.broadcast_to(identity[k], (samples, 1, parties))
        with_target = np.concatenate([basis, target], axis=1)
        isolated[:, k] = _rank(with_target) == _rank(basis)
    return isolated


def _rank(stack: np.ndarray) -> np.ndarray:
    """Ranks of a (B, m, K) stack of small 0/1 matrices (B,); an all-zero matrix has rank 0."""
    if stack.shape[1] == 0:
        return np.zeros(stack.shape[0], dtype=np.int64)
    return np.asarray(np.linalg.matrix_rank(stack), dtype=np.int64)
