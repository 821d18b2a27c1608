"""PSI as the federation's sample alignment: :class:`PsiAligner`, registered as ``psi``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from protocols.psi.parties import PsiRequester, PsiResponder
from protocols.psi.session import fresh_session_id, party_generators
from protocols.psi_kernel import CHUNK, ScalarPool
from secure_vfl.federation.alignment import ALIGNERS, Alignment, checked_ids
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import party_name

LABEL_PARTY = "label-party"


class PsiAligner:
    """An :class:`Aligner` that replaces the plain join with DH-PSI between the label party and
    each data party separately, so data parties never see each other's ids.

    The label party (a :class:`PsiRequester`) learns which of its ids each data party holds,
    hence the availability mask; each data party (a :class:`PsiResponder`) learns, from the
    label party's matches message, which of its ids are aligned and their sample positions
    (needed to feed its rows in sample order), and so the number N of aligned samples. Returns
    exactly what :class:`~secure_vfl.federation.alignment.JoinAligner` returns.

    ``channel``: the network the parties are connected to for one alignment (a fresh in-process
    one per call by default). ``key_factory``: each party's secret scalar per session (tests;
    by default each party draws its own). ``rng`` seeds each party's shuffle generator (tests).
    One :class:`ScalarPool` of ``workers`` processes serves every party in turn; ``progress``
    is told the points of each of its tasks as it completes.
    """

    def __init__(
        self,
        *,
        rng: np.random.Generator | None = None,
        key_factory: Callable[[], bytes] | None = None,
        workers: int | None = None,
        chunk_size: int = CHUNK,
        channel: Channel | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> None:
        self.rng = rng
        self.progress = progress
        self.key_factory = key_factory
        self.workers = workers
        self.chunk_size = chunk_size
        self.channel = channel

    def align(self, party_ids: Sequence[np.ndarray], label_ids: np.ndarray) -> Alignment:
        """PSI of the label ids with each party's ids, then the aligned rows (label ids sorted):
        the label party's part from its own program, each data party's from that party."""
        party_ids, label_ids = checked_ids(party_ids, label_ids)
        channel = self.channel if self.channel is not None else Channel()
        generators = party_generators(self.rng, len(party_ids) + 1)
        with ScalarPool(self.workers, progress=self.progress) as pool:
            label_party = PsiRequester(
                label_ids,
                name=LABEL_PARTY,
                rng=generators[0],
                workers=pool,
                chunk_size=self.chunk_size,
            )
            label_party.connect(channel)
            data_parties: list[PsiResponder] = []
            sessions: dict[str, str] = {}
            for k, ids in enumerate(party_ids):
                party = PsiResponder(
                    ids,
                    name=party_name(k),
                    rng=generators[k + 1],
                    workers=pool,
                    chunk_size=self.chunk_size,
                )
                party.connect(channel)
                sessions[party.name] = fresh_session_id()
                party.accept(LABEL_PARTY, session_id=sessions[party.name], key=self._key())
                data_parties.append(party)
            label_rows, dropped = label_party_alignment(label_party, sessions, self._key)
        rows = np.zeros((label_rows.size, len(party_ids)), dtype=np.int64)
        for k, party in enumerate(data_parties):
            rows[:, k] = party.aligned_rows(LABEL_PARTY)
        return Alignment(
            sample_ids=label_ids[label_rows], rows=rows, label_rows=label_rows, dropped=dropped
        )

    def _key(self) -> bytes | None:
        return self.key_factory() if self.key_factory is not None else None


def label_party_alignment(
    label_party: PsiRequester,
    sessions: Mapping[str, str],
    key: Callable[[], bytes | None],
) -> tuple[np.ndarray, int]:
    """The label party's program: PSI with each data party (``sessions``: its session id by
    party name; ``key``: this party's scalar of each session, None for a fresh one), then the
    aligned samples (its ids held by at least one data party, sorted) and each data party told
    where its matched ids sit. Returns the label rows of the samples and how many of its ids no
    data party holds."""
    label_ids = np.asarray(label_party.ids)
    held = np.zeros((label_ids.size, len(sessions)), dtype=bool)
    for k, (peer, session_id) in enumerate(sessions.items()):
        result = label_party.intersect(peer, session_id=session_id, key=key())
        assert result.indices is not None  # intersection mode
        held[result.indices, k] = True
    label_order = np.argsort(label_ids, kind="stable")
    kept = held[label_order].any(axis=1)
    label_rows = label_order[kept].astype(np.int64)
    sample_of = np.full(label_ids.size, -1, dtype=np.int64)
    sample_of[label_rows] = np.arange(label_rows.size, dtype=np.int64)
    for peer in sessions:
        label_party.send_matches(peer, sample_of, int(label_rows.size))
    return label_rows, int((~kept).sum())


ALIGNERS.register("psi", PsiAligner)
