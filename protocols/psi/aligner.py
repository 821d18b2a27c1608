"""PSI as the federation's sample alignment: :class:`PsiAligner`, registered as ``psi``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from protocols.psi.roles import PsiRequester, PsiResponder
from protocols.psi.session import exchange, fresh_session_id
from protocols.psi_kernel import CHUNK, ScalarPool, fresh_key
from secure_vfl.federation.alignment import ALIGNERS, Alignment, checked_ids
from secure_vfl.federation.channel import Channel


class PsiAligner:
    """An :class:`Aligner` that replaces the plain join with DH-PSI between the label party and
    each data party separately, so data parties never see each other's ids.

    The label party (requester) learns which of its ids each data party holds, hence the
    availability mask; each data party learns which of its ids are aligned and their sample
    positions (needed to feed its rows in sample order), and so the number N of aligned samples.
    Returns exactly what :class:`~secure_vfl.federation.alignment.JoinAligner` returns. One
    :class:`ScalarPool` of ``workers`` processes serves every session.
    """

    def __init__(
        self,
        *,
        rng: np.random.Generator | None = None,
        key_factory: Callable[[], bytes] = fresh_key,
        workers: int | None = None,
        chunk_size: int = CHUNK,
        channel: Channel | None = None,
    ) -> None:
        self.rng = rng
        self.key_factory = key_factory
        self.workers = workers
        self.chunk_size = chunk_size
        self.channel = channel if channel is not None else Channel()

    def align(self, party_ids: Sequence[np.ndarray], label_ids: np.ndarray) -> Alignment:
        """PSI of the label ids with each party's ids, then the aligned rows (label ids sorted)."""
        party_ids, label_ids = checked_ids(party_ids, label_ids)
        sessions: list[tuple[PsiRequester, PsiResponder]] = []
        with ScalarPool(self.workers) as pool:
            for k, ids in enumerate(party_ids):
                session = fresh_session_id()
                requester = PsiRequester(
                    label_ids,
                    name="label-party",
                    peer=f"party-{k}",
                    session_id=session,
                    key=self.key_factory(),
                    rng=self.rng,
                    workers=pool,
                    chunk_size=self.chunk_size,
                )
                responder = PsiResponder(
                    ids,
                    name=f"party-{k}",
                    peer="label-party",
                    session_id=session,
                    key=self.key_factory(),
                    rng=self.rng,
                    workers=pool,
                    chunk_size=self.chunk_size,
                )
                exchange(requester, responder, self.channel)
                sessions.append((requester, responder))
        held = np.zeros((label_ids.size, len(party_ids)), dtype=bool)
        for k, (requester, _) in enumerate(sessions):
            assert requester.result is not None and requester.result.indices is not None
            held[requester.result.indices, k] = True
        label_order = np.argsort(label_ids, kind="stable")
        kept = held[label_order].any(axis=1)
        label_rows = label_order[kept].astype(np.int64)
        sample_of = np.full(label_ids.size, -1, dtype=np.int64)
        sample_of[label_rows] = np.arange(label_rows.size, dtype=np.int64)
        rows = np.full((label_rows.size, len(party_ids)), -1, dtype=np.int64)
        for k, (requester, responder) in enumerate(sessions):
            message = self.channel.send(requester.matches(sample_of, int(label_rows.size)))
            rows[:, k] = responder.receive_matches(message)
        return Alignment(
            sample_ids=label_ids[label_rows],
            rows=rows,
            label_rows=label_order[kept].astype(np.int64),
            dropped=int((~kept).sum()),
        )


ALIGNERS.register("psi", PsiAligner)
