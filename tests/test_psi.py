"""DH-PSI over X25519 (protocols/psi/ and protocols/psi_kernel.py): correctness against a
plaintext oracle, what the requester learns, refusal of degenerate or replayed messages, either
side replaced by a registered role, and the PSI aligner contract."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from reachability import reachable
from test_alignment import AlignerContract

from protocols.psi import (
    CHUNK,
    POINT_BYTES,
    ROUND_MATCHES,
    ROUND_RESPONSE,
    PsiAligner,
    PsiMatchMessage,
    PsiNext,
    PsiRequest,
    PsiRequester,
    PsiResponder,
    PsiResponse,
    RequesterSession,
    ResponderSession,
    ScalarPool,
    hash_ids,
    hash_to_point,
    mask_points,
    run_psi,
)
from secure_vfl.errors import ConfigError, DataError, IntegrityError, ProtocolError, RegistryError
from secure_vfl.federation.alignment import JoinAligner
from secure_vfl.federation.channel import (
    Channel,
    InProcessTransport,
    RecordingLayer,
    read_capture,
)
from secure_vfl.federation.messages import Message
from secure_vfl.federation.parties import ROLES, Party

KEY_A = bytes(range(1, 33))
KEY_B = bytes(range(101, 133))


def _points(payload: bytes) -> list[bytes]:
    return [payload[i : i + POINT_BYTES] for i in range(0, len(payload), POINT_BYTES)]


def _next(requester: RequesterSession, batch_id: int) -> PsiNext:
    """The requester's ask for response ``batch_id`` (built here to replay or reorder it)."""
    return PsiNext(**requester._header(ROUND_RESPONSE, batch_id))  # type: ignore[arg-type]


def _parties(mine, theirs, channel, *, workers=1, session="s", mode="intersection"):
    """A requester and a responder party on ``channel``, the responder's session accepted."""
    requester = PsiRequester(mine, workers=workers)
    responder = PsiResponder(theirs, workers=workers)
    requester.connect(channel)
    responder.connect(channel)
    responder.accept("requester", session_id=session, mode=mode, key=KEY_B)
    return requester, responder


def test_each_party_is_told_the_points_its_own_pool_masks():
    """A deployed party has its own pool: its progress counts its own multiplications, its ids
    and the peer's (each side masks both), over every session it runs."""
    mine, theirs, others = list(range(300)), list(range(200, 450)), list(range(100, 160))
    told: dict[str, list[int]] = {"requester": [], "responder": [], "other": []}
    channel = Channel()
    requester = PsiRequester(mine, workers=1, chunk_size=64, progress=told["requester"].append)
    responder = PsiResponder(theirs, workers=1, chunk_size=64, progress=told["responder"].append)
    other = PsiResponder(others, name="other", workers=1, progress=told["other"].append)
    for party in (requester, responder, other):
        party.connect(channel)
    responder.accept("requester", session_id="s", key=KEY_B)
    other.accept("requester", session_id="t")
    assert requester.intersect("responder", session_id="s", key=KEY_A).size == 100
    assert requester.intersect("other", session_id="t").size == 60
    assert sum(told["requester"]) == 2 * len(mine) + len(theirs) + len(others)
    assert len(told["requester"]) > 2  # a chunk at a time
    assert sum(told["responder"]) == len(theirs) + len(mine)
    assert sum(told["other"]) == len(others) + len(mine)


def _pair(mine, theirs, *, mode="intersection", session="s1", seed=0):
    rng = np.random.default_rng(seed)
    requester = RequesterSession(mine, session_id=session, mode=mode, key=KEY_A, rng=rng)
    responder = ResponderSession(theirs, session_id=session, mode=mode, key=KEY_B, rng=rng)
    return requester, responder


def test_psi_reveals_only_intersection():
    mine = [f"user-{i}" for i in range(0, 300)]
    theirs = [f"user-{i}" for i in range(200, 450)]
    recorder = RecordingLayer()
    transcript = recorder.messages
    result = run_psi(
        mine,
        theirs,
        key_mine=KEY_A,
        key_theirs=KEY_B,
        rng=np.random.default_rng(1),
        channel=Channel([recorder]),
    )
    request, response = transcript
    assert isinstance(response, PsiResponse) and response.receiver == "requester"
    # A recovers exactly the intersection.
    assert result.indices is not None
    assert [mine[i] for i in result.indices] == [f"user-{i}" for i in range(200, 300)]
    assert result.size == 100 and result.peer_size == len(theirs)
    # A's view of B's set is |B| masked values, none of them B's raw hashed ids.
    view = _points(response.own_points)
    assert len(view) == len(theirs)
    # Both sides send their masked ids shuffled, so positions say nothing about id order.
    in_b_order = _points(mask_points(KEY_B, hash_ids(theirs, len(theirs))).tobytes())
    assert sorted(in_b_order) == sorted(view)
    assert sum(a == b for a, b in zip(in_b_order, view, strict=True)) < 10
    in_a_order = _points(mask_points(KEY_A, hash_ids(mine, len(mine))).tobytes())
    assert sum(a == b for a, b in zip(in_a_order, _points(request.points), strict=True)) < 10
    raw_theirs = {hash_to_point(y) for y in theirs}
    assert raw_theirs.isdisjoint(view)
    # What A can compute from its own ids with its own key: H(x), a·H(x), a·a·H(x).
    hashed = hash_ids(mine, len(mine))
    once = mask_points(KEY_A, hashed)
    twice = mask_points(KEY_A, once)
    computable = {p for a in (hashed, once, twice) for p in _points(a.tobytes())}
    outside = [f"user-{i}" for i in range(300, 450)]
    outside_masked = mask_points(KEY_B, hash_ids(outside, len(outside)))
    assert set(_points(outside_masked.tobytes())) <= set(view)
    assert computable.isdisjoint(view)
    # After A's own masking, B's non-intersecting values match nothing of A's.
    doubled_outside = mask_points(KEY_A, outside_masked)
    doubled_mine = set(_points(response.peer_points))
    assert doubled_mine.isdisjoint(_points(doubled_outside.tobytes()))


def test_cardinality_mode_reveals_only_the_size():
    n = 2000
    mine = np.arange(n)
    theirs = np.arange(n // 2, n + 700)
    recorder = RecordingLayer()
    transcript = recorder.messages
    result = run_psi(
        mine,
        theirs,
        mode="cardinality",
        key_mine=KEY_A,
        key_theirs=KEY_B,
        rng=np.random.default_rng(7),
        channel=Channel([recorder]),
    )
    assert result.size == n // 2 and result.indices is None
    request, response = transcript
    in_request_order = mask_points(KEY_B, np.frombuffer(request.points, dtype="S32"))
    returned = np.frombuffer(response.peer_points, dtype="S32")
    assert sorted(_points(in_request_order.tobytes())) == sorted(_points(returned.tobytes()))
    fixed_points = int((in_request_order == returned).sum())
    assert fixed_points < n // 100  # a random shuffle: the positions tell A nothing

    requester, responder = _pair(mine, theirs)  # intersection mode keeps A's order
    [request] = requester.requests()
    response = responder.respond(request)
    in_request_order = mask_points(KEY_B, np.frombuffer(request.points, dtype="S32"))
    assert response.peer_points == in_request_order.tobytes()


def test_double_masking_commutes_and_keys_and_hash_are_consistent():
    ids = [f"id-{i}" for i in range(50)] + [7, 7.0, "ü"]
    hashed = hash_ids(ids, len(ids))
    ab = mask_points(KEY_B, mask_points(KEY_A, hashed))
    ba = mask_points(KEY_A, mask_points(KEY_B, hashed))
    assert ab.tobytes() == ba.tobytes()
    assert set(_points(mask_points(KEY_A, hashed).tobytes())).isdisjoint(
        _points(mask_points(KEY_B, hashed).tobytes())
    )
    assert hash_to_point("id-3") == hash_to_point("id-3") == _points(hashed.tobytes())[3]
    assert hash_to_point("id-3") != hash_to_point("id-4")
    assert hash_to_point(7) == hash_to_point(7.0) == hash_to_point(np.int64(7))
    assert hash_to_point(7) not in {hash_to_point("#7"), hash_to_point("7"), hash_to_point(b"#7")}
    assert all(p[31] < 0x80 for p in (hash_to_point(x) for x in ids))


def test_a_text_id_never_matches_a_number():
    """Numbers were hashed as the text `#` + digits: the text id `#7` matched the number 7 (a
    wrong intersection), and one side holding both was refused as a peer sending repeats."""
    result = run_psi(["#7", "#7.5", "x"], [7, 7.5, "y"], workers=1)
    assert result.size == 0
    assert run_psi(["#7", 7, "x"], [7, "x"], workers=1).indices.tolist() == [1, 2]


def test_parallel_masking_equals_serial_and_names_the_bad_point():
    hashed = hash_ids(range(2 * CHUNK + 5), 2 * CHUNK + 5)
    serial = mask_points(KEY_A, hashed, workers=1)
    assert mask_points(KEY_A, hashed, workers=2).tobytes() == serial.tobytes()
    bad = hashed.copy()
    bad[CHUNK + 3] = bytes(POINT_BYTES)
    with pytest.raises(IntegrityError, match=f"point {CHUNK + 3} is of low order"):
        mask_points(KEY_A, bad, workers=2)


@pytest.mark.parametrize("low_order", [bytes(32), (1).to_bytes(32, "little")])
def test_low_order_point_refused_without_state_change(low_order):
    mine, theirs = [f"a{i}" for i in range(20)], [f"a{i}" for i in range(10, 40)]
    requester, responder = _pair(mine, theirs)
    [request] = requester.requests()
    points = _points(request.points)
    points[4] = low_order
    bad = dataclasses.replace(request, points=b"".join(points))
    with pytest.raises(IntegrityError, match="point 4 is of low order"):
        responder.respond(bad)
    response = responder.respond(request)  # state unchanged: the genuine request still works

    own = _points(response.own_points)
    own[2] = low_order
    with pytest.raises(IntegrityError, match="point 2 is of low order"):
        requester.receive(dataclasses.replace(response, own_points=b"".join(own)))
    assert requester.result is None
    assert requester.receive(response).size == 10


def test_malformed_points_refused():
    requester, responder = _pair(["x", "y"], ["y", "z"])
    [request] = requester.requests()
    with pytest.raises(ProtocolError, match=r"32-byte points expected\. Found 63 bytes"):
        responder.respond(dataclasses.replace(request, points=request.points[:-1]))
    with pytest.raises(ProtocolError, match=r"32-byte points expected\. Found 31 bytes"):
        responder.respond(dataclasses.replace(request, points=request.points[:31]))
    duplicated = request.points[:32] * 2
    with pytest.raises(IntegrityError, match="distinct masked values expected"):
        responder.respond(dataclasses.replace(request, points=duplicated))
    response = responder.respond(request)
    with pytest.raises(ProtocolError, match="2 doubly masked points expected"):
        requester.receive(dataclasses.replace(response, peer_points=response.peer_points[:32]))
    assert requester.receive(response).size == 1


def test_tampered_masked_value_does_not_match_or_is_refused():
    ids = [f"same-{i}" for i in range(50)]
    requester, responder = _pair(ids, ids)
    response = responder.respond(next(requester.requests()))
    own = bytearray(response.own_points)
    own[0] ^= 0x01  # another valid point: its id simply no longer matches
    result = requester.receive(dataclasses.replace(response, own_points=bytes(own)))
    assert result.size == 49 and result.indices is not None and len(result.indices) == 49

    requester, responder = _pair(ids, ids)
    response = responder.respond(next(requester.requests()))
    own = bytearray(response.own_points)
    own[31] ^= 0x80  # top bit set: never produced by X25519, refused
    with pytest.raises(IntegrityError, match="point 0 is not a canonical u-coordinate"):
        requester.receive(dataclasses.replace(response, own_points=bytes(own)))
    assert requester.result is None


def test_message_from_another_session_or_replayed_refused():
    requester, _ = _pair(["x", "y"], ["y"], session="session-1")
    _, other_responder = _pair(["x", "y"], ["y"], session="session-2")
    [request] = requester.requests()
    with pytest.raises(ProtocolError, match="session id 'session-2' expected, found 'session-1'"):
        other_responder.respond(request)
    requester2, responder2 = _pair(["x", "y"], ["y"], session="session-2")
    [request2] = requester2.requests()
    response2 = responder2.respond(request2)
    with pytest.raises(ProtocolError, match="session id 'session-1' expected"):
        requester.receive(response2)
    with pytest.raises(ProtocolError, match="one request per session"):
        responder2.respond(request2)
    with pytest.raises(ProtocolError, match="round 1 expected, found 0"):
        requester.receive(dataclasses.replace(response2, round=0, session="session-1"))
    assert requester.result is None
    assert requester2.receive(response2).size == 1


def test_message_without_a_session_refused():
    requester, responder = _pair(["x", "y"], ["y"], session="s1")
    [request] = requester.requests()
    assert request.session == "s1"
    with pytest.raises(ProtocolError, match="psi-request from requester: a session id expected"):
        responder.respond(dataclasses.replace(request, session=""))
    response = responder.respond(request)  # state unchanged: the genuine request still works
    assert requester.receive(response).size == 1


def test_psi_kernel_imports_without_torch():
    """A spawned or forkserver worker imports only the kernel to run its tasks: no torch."""
    code = "import sys, protocols.psi_kernel; assert 'torch' not in sys.modules"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@pytest.mark.parametrize("kind", ["number", "text"])
def test_psi_aligner_equals_join_aligner(kind):
    rng = np.random.default_rng(3)
    universe = rng.choice(5000, size=1200, replace=False)
    label = rng.choice(universe, size=500, replace=False)
    parties = [rng.choice(universe, size=size, replace=False) for size in (400, 150, 300)]
    if kind == "text":
        label = np.array([f"patient-{i}" for i in label])
        parties = [np.array([f"patient-{i}" for i in ids]) for ids in parties]
    keys = np.random.default_rng(4)
    done: list[int] = []  # a progress bar's updates: each session's points, both sides'
    psi = PsiAligner(
        rng=np.random.default_rng(5), key_factory=lambda: keys.bytes(32), progress=done.append
    )
    got = psi.align(parties, label)
    assert sum(done) == sum(2 * (len(label) + len(ids)) for ids in parties)
    expected = JoinAligner().align(parties, label)
    assert np.array_equal(got.sample_ids, expected.sample_ids)
    assert np.array_equal(got.rows, expected.rows)
    assert np.array_equal(got.label_rows, expected.label_rows)
    assert np.array_equal(got.mask, expected.mask)
    assert got.dropped == expected.dropped > 0
    assert 0 < got.mask.sum() < got.mask.size  # partial overlaps


class TestPsiAligner(AlignerContract):
    def make_aligner(self) -> PsiAligner:
        return PsiAligner(workers=1)


def test_psi_aligner_data_parties_never_see_each_others_ids():
    recorder = RecordingLayer()
    transcript = recorder.messages
    label = np.array(["a", "b", "c", "d"])
    parties = [np.array(["a", "x"]), np.array(["b", "c", "y"])]
    PsiAligner(channel=Channel([recorder])).align(parties, label)
    received: dict[str, int] = {}
    for message in transcript:
        assert "label-party" in (message.sender, message.receiver)
        received[message.receiver] = received.get(message.receiver, 0) + 1
    assert received == {"party-0": 2, "party-1": 2, "label-party": 2}


def test_cli_psi_writes_the_intersection(tmp_path, capsys):
    from secure_vfl.cli import main

    (tmp_path / "mine.csv").write_text("id,x\na,1\nb,2\nc,3\n", encoding="utf-8")
    (tmp_path / "theirs.csv").write_text("id\nc\nd\na\n", encoding="utf-8")
    out = tmp_path / "common.txt"
    args = ["psi", "--mine", str(tmp_path / "mine.csv"), "--theirs", str(tmp_path / "theirs.csv")]
    assert main([*args, "--out", str(out)]) == 0
    assert "intersection size: 2 (of 3 mine, 3 theirs)" in capsys.readouterr().out
    assert out.read_text(encoding="utf-8") == "a\nc\n"
    assert main([*args, "--id-column", "name"]) == 2
    assert "must have an id column `name` (--id-column)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "theirs.csv: a header and rows expected; found an empty file."),
        (b'id\n"unterminated\n', "a double quote opens a value in data row 1 and is never closed"),
        (b"\xff\xfeid\na\n", "could not be read as UTF-8 text (utf-8: invalid start byte)"),
    ],
)
def test_psi_command_refuses_an_unreadable_id_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    from secure_vfl.cli import main

    (tmp_path / "mine.csv").write_text("id\na\nb\n", encoding="utf-8")
    (tmp_path / "theirs.csv").write_bytes(content)
    argv = ["psi", "--mine", str(tmp_path / "mine.csv"), "--theirs", str(tmp_path / "theirs.csv")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "theirs.csv" in err


def test_psi_command_writes_only_the_intersection(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from secure_vfl.cli import main

    (tmp_path / "mine.csv").write_text("id,x\na,1\nb,2\nc,3\nd,4\n", encoding="utf-8")
    (tmp_path / "theirs.csv").write_text("id\nc\nz\na\ny\nq\n", encoding="utf-8")
    out = tmp_path / "common.txt"
    argv = ["psi", "--mine", str(tmp_path / "mine.csv"), "--theirs", str(tmp_path / "theirs.csv")]
    assert main([*argv, "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8").split() == ["a", "c"]
    assert "intersection size: 2 (of 4 mine, 5 theirs)" in capsys.readouterr().out
    assert main([*argv, "--mode", "cardinality"]) == 0
    assert "intersection size: 2" in capsys.readouterr().out
    assert main([*argv, "--mode", "cardinality", "--out", str(tmp_path / "no.txt")]) == 2
    assert "--out needs --mode intersection" in capsys.readouterr().err
    assert not (tmp_path / "no.txt").exists()
    assert (
        main(
            [
                "psi",
                "--mine",
                str(tmp_path / "mine.csv"),
                "--theirs",
                str(tmp_path / "theirs.csv"),
                "--id-column",
                "key",
            ]
        )
        == 2
    )
    assert "must have an id column `key` (--id-column)" in capsys.readouterr().err


def test_psi_command_reads_csv_and_parquet_ids_as_train_reads_party_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`psi --theirs shop.parquet` was refused as not UTF-8 CSV, though `train --align psi`
    reads Parquet party files: both read ids as party files are read, as text."""
    from secure_vfl.cli import main
    from secure_vfl.data.party_files import read_party_file

    (tmp_path / "bank.csv").write_text("id,x\n0304,1\n304,2\n7,3\nb,4\n", encoding="utf-8")
    shop = tmp_path / "shop.parquet"
    pd.DataFrame({"id": [304, 7, 8], "y": [0.5, 1.5, 2.5]}).to_parquet(shop)
    out = tmp_path / "common.txt"
    argv = ["psi", "--mine", str(tmp_path / "bank.csv"), "--theirs", str(shop)]
    assert main([*argv, "--out", str(out)]) == 0
    assert "intersection size: 2 (of 4 mine, 3 theirs)" in capsys.readouterr().out
    assert out.read_text(encoding="utf-8") == "304\n7\n"  # `0304` is not `304`
    assert read_party_file(shop).ids.tolist() == ["304", "7", "8"]  # the ids train aligns
    pd.DataFrame({"id": ["c", None]}).to_parquet(shop)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{shop}: every row must have an id. Found 1 empty (first at data row 2)" in err


@pytest.mark.parametrize("out", ["sub/dir/", "sub/"])
def test_psi_command_refuses_an_out_that_names_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str
) -> None:
    """`--out sub/dir/` wrote a file named `dir`: a path ending with a separator is a directory."""
    from secure_vfl.cli import main

    (tmp_path / "mine.csv").write_text("id\na\nb\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    argv = ["psi", "--mine", str(tmp_path / "mine.csv"), "--theirs", str(tmp_path / "mine.csv")]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", f"{tmp_path}/{out}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --out: expected a file path, found '{tmp_path}/{out}', which ends" in err
    assert err.count("\n") == 1 and list((tmp_path / "sub").iterdir()) == []
    assert main([*argv, "--out", str(tmp_path / "sub")]) == 2  # a directory given without a /
    assert "is a directory; expected a file path" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["intersection", "cardinality"])
def test_chunked_psi_equals_one_chunk(mode):
    rng = np.random.default_rng(11)
    mine = rng.choice(10_000, size=700, replace=False)
    theirs = rng.choice(10_000, size=450, replace=False)
    whole = run_psi(mine, theirs, mode=mode, workers=1, chunk_size=CHUNK)
    recorder = RecordingLayer()
    transcript = recorder.messages
    done: list[int] = []  # what a progress bar is told: every point each side masks, once
    chunked = run_psi(
        mine,
        theirs,
        mode=mode,
        workers=1,
        chunk_size=64,
        channel=Channel([recorder]),
        progress=done.append,
    )
    assert sum(done) == 2 * (len(mine) + len(theirs)) and len(done) > 2
    assert chunked.size == whole.size == np.isin(mine, theirs).sum() > 0
    assert chunked.peer_size == whole.peer_size == len(theirs)
    if mode == "intersection":
        assert np.array_equal(chunked.indices, whole.indices)
        assert np.array_equal(chunked.indices, np.flatnonzero(np.isin(mine, theirs)))
    requests = [m for m in transcript if isinstance(m, PsiRequest)]
    responses = [m for m in transcript if isinstance(m, PsiResponse)]
    assert [m.batch_id for m in requests] == list(range(11))  # ceil(700 / 64)
    assert [m.batch_id for m in responses] == list(range(len(responses)))
    assert sum(len(m.own_points) for m in responses) == POINT_BYTES * len(theirs)
    assert all(len(m.points) <= 64 * POINT_BYTES for m in requests)
    if mode == "cardinality":  # A's doubled points come back only after its last chunk...
        last_request = transcript.index(requests[-1])
        before = transcript[:last_request]
        assert all(not m.peer_points for m in before if isinstance(m, PsiResponse))
        # ...shuffled over all of them, not chunk by chunk.
        first = mask_points(KEY_B, np.frombuffer(requests[0].points, dtype="S32"), workers=1)
        returned = next(m for m in responses if m.peer_points)
        assert set(_points(first.tobytes())) != set(_points(returned.peer_points))
    aligned = PsiAligner(chunk_size=64, workers=1).align([mine, theirs], mine)
    assert np.array_equal(aligned.rows, JoinAligner().align([mine, theirs], mine).rows)


def test_two_workers_give_what_one_gives():
    mine = [f"user-{i}" for i in range(2500)]
    theirs = [f"user-{i}" for i in range(1200, 3500)]
    results = []
    for workers in (1, 2):
        with ScalarPool(workers) as pool:
            requester, _ = _parties(mine, theirs, Channel(), workers=pool)
            results.append(requester.intersect("responder", session_id="s", key=KEY_A))
            assert pool.running == (workers == 2)
    one, two = results
    assert one.size == two.size == 1300
    assert np.array_equal(one.indices, two.indices)
    assert np.array_equal(two.indices, np.arange(1200, 2500))


def test_chunks_repeated_replayed_or_beyond_the_total_refused():
    mine, theirs = [f"c{i}" for i in range(10)], [f"c{i}" for i in range(5, 30)]
    requester = RequesterSession(mine, session_id="s", key=KEY_A, chunk_size=4, workers=1)
    responder = ResponderSession(theirs, session_id="s", key=KEY_B, chunk_size=4, workers=1)
    first, second, third = requester.requests()
    assert (first.total, len(third.points)) == (10, 2 * POINT_BYTES)
    with pytest.raises(ProtocolError, match="batch_id 0 expected, found 1"):
        responder.respond(second)  # out of order
    answer = responder.respond(first)
    with pytest.raises(ProtocolError, match="batch_id 1 expected, found 0"):
        responder.respond(first)  # replayed
    repeat = dataclasses.replace(second, points=second.points[:96] + first.points[:32])
    with pytest.raises(IntegrityError, match="distinct masked values expected"):
        responder.respond(repeat)  # a point of the first chunk again
    with pytest.raises(ProtocolError, match="10 points announced before, found 11"):
        responder.respond(dataclasses.replace(second, total=11))
    other = next(RequesterSession(["z1", "z2", "z3", "z4"], session_id="s", workers=1).requests())
    with pytest.raises(ProtocolError, match=r"10 in all, expected; found 8 in this one \(12 so"):
        responder.respond(dataclasses.replace(second, points=second.points + other.points))
    with pytest.raises(ProtocolError, match="response 1 asked for before A's last request"):
        responder.answer(_next(requester, 1))  # out of turn: a request chunk is due
    answers = [answer, responder.respond(second), responder.respond(third)]
    with pytest.raises(ProtocolError, match="batch_id 3 expected, found 2"):
        responder.answer(_next(requester, 2))  # replayed
    answers += [responder.answer(_next(requester, i)) for i in range(3, 7)]
    assert len(answers) == 7  # ceil(25 / 4) chunks of the responder's own ids, one per message
    with pytest.raises(ProtocolError, match=r"the whole response \(7 chunks\) was sent"):
        responder.answer(_next(requester, 7))

    assert requester.receive(answers[0]) is None
    with pytest.raises(ProtocolError, match="batch_id 1 expected, found 0"):
        requester.receive(answers[0])
    with pytest.raises(ProtocolError, match="25 own points announced before, found 24"):
        requester.receive(dataclasses.replace(answers[1], own_total=24))
    doubled_again = dataclasses.replace(answers[1], peer_points=answers[0].peer_points)
    with pytest.raises(IntegrityError, match=r"\(A's points\): distinct masked values expected"):
        requester.receive(doubled_again)
    own_again = dataclasses.replace(answers[1], own_points=answers[0].own_points)
    with pytest.raises(IntegrityError, match=r"\(its own points\): distinct masked values"):
        requester.receive(own_again)
    results = [requester.receive(a) for a in answers[1:]]
    assert results[:-1] == [None] * 5 and results[-1] is not None
    assert results[-1].size == 5 and list(results[-1].indices) == [5, 6, 7, 8, 9]


@pytest.mark.parametrize("total", [2**55, 2**62])
def test_a_cardinality_request_announcing_more_points_than_memory_holds_refused(total):
    """In cardinality mode B made room for the announced total on A's first chunk: a total beyond
    memory raised numpy's MemoryError (or ValueError) instead of a refusal."""
    requester = RequesterSession(
        ["a", "b"], session_id="s", key=KEY_A, mode="cardinality", workers=1
    )
    responder = ResponderSession(
        ["a", "c"], session_id="s", key=KEY_B, mode="cardinality", workers=1
    )
    (request,) = requester.requests()
    with pytest.raises(
        ProtocolError, match=f"a total of points this party can hold expected.*{total}"
    ):
        responder.respond(dataclasses.replace(request, total=total))
    requester.receive(responder.respond(request))  # nothing refused changed B's state
    while requester.result is None:
        requester.receive(responder.answer(requester.next_request()))
    assert requester.result.size == 1


def test_matches_out_of_turn_replayed_or_repeating_refused():
    mine, theirs = [f"m{i}" for i in range(10)], [f"m{i}" for i in range(4, 30)]
    requester = RequesterSession(mine, session_id="s", key=KEY_A, chunk_size=8, workers=1)
    responder = ResponderSession(theirs, session_id="s", key=KEY_B, chunk_size=8, workers=1)
    for request in requester.requests():
        requester.receive(responder.respond(request))
    one = np.zeros(1, dtype=np.int64)
    early = PsiMatchMessage(
        samples=1,
        sample_positions=one,
        peer_positions=one,
        **requester._header(ROUND_MATCHES),  # type: ignore[arg-type]
    )
    with pytest.raises(ProtocolError, match="matches only after the whole response was sent"):
        responder.receive_matches(early)  # B's own ids are still streaming
    while requester.result is None:
        requester.receive(responder.answer(requester.next_request()))
    with pytest.raises(ProtocolError, match="only between the last request chunk and the result"):
        requester.next_request()
    matches = requester.matches(np.arange(len(mine), dtype=np.int64), len(mine))
    repeated = dataclasses.replace(
        matches, peer_positions=np.full_like(matches.peer_positions, matches.peer_positions[0])
    )
    with pytest.raises(ProtocolError, match="distinct peer positions expected"):
        responder.receive_matches(repeated)
    with pytest.raises(ProtocolError, match="round 2 expected, found 1"):
        responder.receive_matches(dataclasses.replace(matches, round=ROUND_RESPONSE))
    assert responder.rows is None  # nothing refused changed its state
    rows = responder.receive_matches(matches)
    held = rows >= 0
    assert [theirs[r] for r in rows[held]] == [mine[i] for i in np.flatnonzero(held)]
    with pytest.raises(ProtocolError, match="one matches message per session"):
        responder.receive_matches(matches)  # replayed
    assert responder.rows is rows


@pytest.mark.parametrize(
    ("samples", "error"),
    [
        (-1, r"samples must be an integer >= 0, found -1"),
        (2**40, r"at most 10 aligned samples expected \(its ids\), found 1099511627776"),
    ],
)
def test_matches_for_a_negative_or_impossible_number_of_samples_refused(samples, error):
    """B made its row array of `samples` before checking it: a negative count raised numpy's
    ValueError and a huge one a MemoryError; aligned samples are some of A's ids."""
    mine, theirs = [f"m{i}" for i in range(10)], [f"m{i}" for i in range(4, 30)]
    requester = RequesterSession(mine, session_id="s", key=KEY_A, chunk_size=8, workers=1)
    responder = ResponderSession(theirs, session_id="s", key=KEY_B, chunk_size=8, workers=1)
    for request in requester.requests():
        requester.receive(responder.respond(request))
    while requester.result is None:
        requester.receive(responder.answer(requester.next_request()))
    matches = requester.matches(np.arange(len(mine), dtype=np.int64), len(mine))
    none = np.zeros(0, dtype=np.int64)
    with pytest.raises(ProtocolError, match=error):
        responder.receive_matches(
            dataclasses.replace(
                matches, samples=samples, sample_positions=none, peer_positions=none
            )
        )
    assert responder.rows is None
    assert responder.receive_matches(matches).shape == (len(mine),)


def test_each_secret_scalar_and_generator_is_reachable_from_its_own_party_only():
    channel = Channel()
    label = np.array([f"p{i}" for i in range(40)])
    parties = [np.array([f"p{i}" for i in range(k, 60, k + 2)]) for k in range(3)]
    PsiAligner(workers=1, channel=channel).align(parties, label)
    everyone = channel.parties
    keys = {name: {s._key for s in party._sessions.values()} for name, party in everyone.items()}
    assert [len(keys[name]) for name in sorted(everyone)] == [3, 1, 1, 1]  # label-party first
    views = {name: reachable(party, stop={id(channel)}) for name, party in everyone.items()}
    generators: dict[int, list[str]] = {}
    for name, view in views.items():
        held = {v for v in view if isinstance(v, bytes) and len(v) == POINT_BYTES}
        assert keys[name] <= held  # found where it lives: the test is not vacuous
        others = set().union(*(keys[other] for other in everyone if other != name))
        assert held.isdisjoint(others), f"{name} reaches another party's scalar"
        assert not any(isinstance(v, X25519PrivateKey) for v in view)
        reached = {id(v) for v in view}
        assert not any(id(p) in reached for other, p in everyone.items() if other != name)
        for value in view:
            if isinstance(value, np.random.Generator):
                generators.setdefault(id(value), []).append(name)
    assert len(generators) >= len(everyone)
    assert all(len(names) == 1 for names in generators.values()), generators


@pytest.mark.parametrize("mode", ["intersection", "cardinality"])
def test_psi_parties_exchange_only_through_the_channel(mode, tmp_path):
    recorder = RecordingLayer()
    capture = io.BytesIO()
    channel = Channel([recorder], transport=InProcessTransport(capture=capture))
    mine = [f"u{i}" for i in range(40)]
    theirs = [f"u{i}" for i in range(25, 150)]  # more own chunks than requests: B is asked
    requester = InboxWatcher(mine, workers=1, chunk_size=16)
    responder = PsiResponder(theirs, workers=1, chunk_size=16)
    requester.connect(channel)
    responder.connect(channel)
    responder.accept("requester", session_id="s", mode=mode)
    result = requester.intersect("responder", session_id="s", mode=mode)
    assert result.size == 15 and result.peer_size == len(theirs)
    path = tmp_path / "psi.capture"
    path.write_bytes(capture.getvalue())
    assert [m.kind for m in read_capture(path)] == recorder.kinds()
    asked = [m for m in recorder.messages if m.sender == "requester"]
    answered = [m for m in recorder.messages if m.sender == "responder"]
    assert {m.receiver for m in asked} == {"responder"} and {m.receiver for m in answered} == {
        "requester"
    }
    assert [m.kind for m in asked] == ["psi-request"] * 3 + ["psi-next"] * (len(asked) - 3)
    assert len(answered) == len(asked) == 8  # one response per message: ceil(125 / 16)
    assert requester.most_waiting == 1  # so no more than one response is ever held
    for party, other in ((requester, responder), (responder, requester)):
        assert id(other) not in {id(v) for v in reachable(party, stop={id(channel)})}


class InboxWatcher(PsiRequester):
    """A requester that notes the most messages ever waiting in its inbox."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.most_waiting = 0

    def receive(self, message):  # type: ignore[no-untyped-def]
        super().receive(message)
        self.most_waiting = max(self.most_waiting, len(self._inbox))


class ReplayingResponder(PsiResponder):
    """A responder that sends every response twice (the second in batch ``again``, if set)."""

    again: int | None = None

    def send(self, message):  # type: ignore[no-untyped-def]
        super().send(message)
        if self.again is not None:
            message = dataclasses.replace(message, batch_id=self.again)
        super().send(message)


def test_a_party_refuses_a_replayed_or_unasked_message_and_keeps_its_state():
    channel = Channel()
    requester, responder = _parties(["a", "b", "c"], ["b", "c", "d"], channel)
    intruder = PsiRequester(["b"], name="intruder", workers=1)
    intruder.connect(channel)
    with pytest.raises(ProtocolError, match="accepted no session with it"):
        intruder.intersect("responder", session_id="s")
    assert requester.intersect("responder", session_id="s", key=KEY_A).size == 2
    requester.send_matches("responder", np.array([-1, 0, 1]), 2)
    assert responder.aligned_rows("requester").tolist() == [0, 1]
    # A second, other one: the same message as far as its header goes, so refused as a
    # replay; in another batch, refused by the session all the same.
    with pytest.raises(ProtocolError, match=r"a second psi-matches .*\(a replay\?\)"):
        requester.send_matches("responder", np.array([0, 1, -1]), 2)
    other = requester._sessions["responder"].matches(np.array([0, 1, -1]), 2)
    with pytest.raises(ProtocolError, match="one matches message per session"):
        requester.send(dataclasses.replace(other, batch_id=1))
    assert responder.aligned_rows("requester").tolist() == [0, 1]
    with pytest.raises(ProtocolError, match="one session with responder expected"):
        requester.intersect("responder", session_id="s")
    with pytest.raises(ProtocolError, match="ran no session with it"):
        requester.send_matches("intruder", np.array([0, 1, 2]), 3)

    replaying = Channel()
    requester = PsiRequester(["a", "b"], workers=1)
    responder = ReplayingResponder(["b"], workers=1)
    requester.connect(replaying)
    responder.connect(replaying)
    responder.accept("requester", session_id="s")
    with pytest.raises(ProtocolError, match=r"a second psi-response .*\(a replay\?\)"):
        requester.intersect("responder", session_id="s")
    assert requester._sessions["responder"].responses == 0  # the response was not taken in
    # Sent again as another message (another batch id): one more than its request asked for,
    # refused as a reply the requester did not ask for.
    replaying = Channel()
    requester = PsiRequester(["a", "b"], workers=1)
    responder = ReplayingResponder(["b"], workers=1)
    responder.again = 1
    requester.connect(replaying)
    responder.connect(replaying)
    responder.accept("requester", session_id="s")
    with pytest.raises(ProtocolError, match="a psi-response from responder for round 1, batch 1 "):
        requester.intersect("responder", session_id="s")
    assert requester._sessions["responder"].responses == 0


class _KeepsWhatItReceives(Party):
    """A side that keeps every message delivered to it (what a curious party would study)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.received: list[Message] = []

    def receive(self, message: Message) -> None:
        self.received.append(message)
        super().receive(message)


class _RecordingRequester(_KeepsWhatItReceives, PsiRequester):
    pass


class _RecordingResponder(_KeepsWhatItReceives, PsiResponder):
    pass


ROLES.register("test-recording-psi-requester", _RecordingRequester)
ROLES.register("test-recording-psi-responder", _RecordingResponder)


def test_both_sides_of_psi_are_registered_roles() -> None:
    assert ROLES.get("psi-requester") is PsiRequester
    assert ROLES.get("psi-responder") is PsiResponder


@pytest.mark.parametrize(
    ("side", "role", "kinds"),
    [
        ("requester", "test-recording-psi-requester", {"psi-response"}),
        ("responder", "test-recording-psi-responder", {"psi-request", "psi-next"}),
    ],
)
def test_a_registered_role_replaces_a_side_and_sees_only_its_own_messages(
    side: str, role: str, kinds: set[str]
) -> None:
    mine = [f"user-{i}" for i in range(0, 200)]
    theirs = [f"user-{i}" for i in range(100, 500)]  # a longer stream: the requester asks on
    options = {"key_mine": KEY_A, "key_theirs": KEY_B, "workers": 1, "chunk_size": 64}
    honest = run_psi(mine, theirs, rng=np.random.default_rng(5), **options)  # type: ignore[arg-type]
    recorder = RecordingLayer()
    channel = Channel([recorder])
    result = run_psi(
        mine,
        theirs,
        rng=np.random.default_rng(5),
        channel=channel,
        roles={side: role},
        **options,  # type: ignore[arg-type]
    )
    assert result.indices is not None and honest.indices is not None
    assert np.array_equal(result.indices, honest.indices) and result.size == honest.size == 100
    parties = channel.parties
    replaced = parties[side]
    assert type(replaced) is ROLES.get(role)
    assert {type(p) for name, p in parties.items() if name != side} <= {PsiRequester, PsiResponder}
    # It got exactly the messages addressed to it, in the order they crossed, and no other.
    addressed = [m for m in recorder.messages if m.receiver == side]
    assert replaced.received == addressed  # type: ignore[attr-defined]
    assert {m.kind for m in addressed} == kinds and len(addressed) > 2
    assert len(addressed) < len(recorder.messages)


def test_psi_roles_refuse_unknown_names_parties_and_sides() -> None:
    ids = ["a", "b"]
    with pytest.raises(
        RegistryError, match=r"unknown role 'spy'; expected one of: .*psi-responder"
    ):
        run_psi(ids, ids, workers=1, roles={"responder": "spy"})
    with pytest.raises(ConfigError, match="can replace the requester and the responder of a PSI"):
        run_psi(ids, ids, workers=1, roles={"label-party": "psi-requester"})
    with pytest.raises(ConfigError, match=r"responder of a PSI run plays a PsiResponder .* is Psi"):
        run_psi(ids, ids, workers=1, roles={"responder": "psi-requester"})
    with pytest.raises(
        ConfigError, match=r"requester of a PSI run plays a PsiRequester .* DataParty"
    ):
        run_psi(ids, ids, workers=1, roles={"requester": "data-party"})


def test_run_psi_refuses_text_no_ids_and_repeated_ids_first() -> None:
    """`run_psi("abc", "bcd")` matched characters (size 2), `run_psi([], ...)` failed inside
    numpy, and one's own repeated id was reported as a peer's tampering (IntegrityError)."""
    with pytest.raises(ConfigError, match=r"a list \(or array\) of ids expected\. Found str: each"):
        run_psi("abc", ["b"], workers=1)  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"requester.s ids: at least one id expected\. Found none"):
        run_psi([], ["a"], workers=1)
    with pytest.raises(DataError, match=r"responder's ids: distinct ids expected .* 1 repeats"):
        run_psi(["a"], np.array(["a", "b", "a"]), workers=1)
