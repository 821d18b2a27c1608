"""Diffie-Hellman private set intersection (PSI) over X25519, and a PSI-backed :class:`Aligner`.

Protocol (two parties, semi-honest). Each id ``x`` is hashed to a Curve25519 u-coordinate
``H(x)`` (BLAKE2b-256 with a domain-separation tag, top bit cleared as RFC 7748 decoding does).
Party A (the *requester*, who learns the result) holds secret scalar ``a``, party B (the
*responder*) holds ``b``; masking is the X25519 function ``a·P`` (clamped scalar multiplication
of the u-coordinate ``P``), and double masking commutes: ``a·(b·H(x)) == b·(a·H(x))``.

1. A -> B (:class:`PsiRequest`, one message per chunk of ``chunk_size`` points): ``a·H(x)`` for
   all of A's ids, in a random order A remembers.
2. B -> A (:class:`PsiResponse`, a stream of chunks): ``b·(a·H(x))`` for A's values (chunk by
   chunk in the same order in ``intersection`` mode; after A's last chunk, shuffled over all of
   them in ``cardinality`` mode) and, interleaved, ``b·H(y)`` for B's ids in a random order.
3. A computes ``a·(b·H(y))`` and intersects the doubly masked sets. In ``intersection`` mode A
   learns which of its ids B holds; in ``cardinality`` mode only how many.

Security argument (sketch). Under the decisional Diffie-Hellman assumption on Curve25519 and its
quadratic twist (hashed ids may land on either; X25519 is twist-secure and its clamped scalars
clear both cofactors), with ``H`` modelled as a random oracle, ``b·H(y)`` for an id ``y`` A does
not hold is indistinguishable from a random point to A, and ``a·H(x)`` hides A's ids from B.
What each side learns: A learns |B| and the intersection (or only its size); B learns |A| only.
Chunking reveals nothing more: chunk sizes follow from |A|, |B| and ``chunk_size``, and both
sides shuffle over their whole set before chunking. Used by :class:`PsiAligner`, B additionally
learns which of its ids are aligned (step 4, :class:`PsiMatchMessage`), which aligned VFL
training needs anyway. Not protected: a malicious party may choose its ids (inputs) freely; every
party learns the set sizes.

Flow control: B answers each message of A with exactly one response and sends nothing unasked;
once its request chunks are all sent, A asks for each further response (:class:`PsiNext`). So at
most one response is in flight, and memory stays bounded on both sides whatever the transport.

Refused from a peer, with no state change: points that are not 32 bytes, non-canonical encodings
(which an honest party never sends), low-order points (the shared secret is all zero), duplicate
masked values (across chunks too), chunks that do not fit the announced totals (in cardinality
mode, a total beyond memory too), messages from another session, round, sender, chunk or mode
(replays), responses asked for out of turn or twice, and matches out of turn, twice, with
repeated positions or for more samples than A has ids.

Parties are actors (:class:`~secure_vfl.federation.parties.Party`): :class:`PsiRequester` and
:class:`PsiResponder` each own their ids, shuffle generator and per-session secret scalar, and
meet only through a :class:`~secure_vfl.federation.channel.Channel`. Both are replaceable roles,
registered on import as ``psi-requester`` and ``psi-responder`` (``run_psi(..., roles=...)``).

Modules: :mod:`protocols.psi_kernel` (hashing, scalar multiplication over worker processes,
point checks, digests; torch-free, so it sits outside this package), :mod:`.messages`,
:mod:`.roles` (each role's session: its checks and its memory), :mod:`.parties` (the two
parties), :mod:`.session` (:func:`run_psi`: one run in-process) and :mod:`.aligner`
(:class:`PsiAligner`, registered as the ``psi`` aligner on import).
"""

from protocols.psi.aligner import PsiAligner
from protocols.psi.messages import (
    MODES,
    PsiMatchMessage,
    PsiMessage,
    PsiMode,
    PsiNext,
    PsiRequest,
    PsiResponse,
)
from protocols.psi.parties import PsiRequester, PsiResponder
from protocols.psi.roles import (
    LOOKUP_BLOCK,
    ROUND_MATCHES,
    ROUND_REQUEST,
    ROUND_RESPONSE,
    PsiResult,
    RequesterSession,
    ResponderSession,
)
from protocols.psi.session import fresh_session_id, run_psi
from protocols.psi_kernel import (
    CHUNK,
    DIGEST_BYTES,
    HASH_TAG,
    POINT_BYTES,
    TASK_POINTS,
    Ids,
    ScalarPool,
    decode_points,
    digests,
    fresh_key,
    hash_ids,
    hash_to_point,
    mask_points,
)

__all__ = [
    "CHUNK",
    "DIGEST_BYTES",
    "HASH_TAG",
    "LOOKUP_BLOCK",
    "MODES",
    "POINT_BYTES",
    "ROUND_MATCHES",
    "ROUND_REQUEST",
    "ROUND_RESPONSE",
    "TASK_POINTS",
    "Ids",
    "PsiAligner",
    "PsiMatchMessage",
    "PsiMessage",
    "PsiMode",
    "PsiNext",
    "PsiRequest",
    "PsiRequester",
    "PsiResponder",
    "PsiResponse",
    "PsiResult",
    "RequesterSession",
    "ResponderSession",
    "ScalarPool",
    "decode_points",
    "digests",
    "fresh_key",
    "fresh_session_id",
    "hash_ids",
    "hash_to_point",
    "mask_points",
    "run_psi",
]
