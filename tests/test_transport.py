"""The transport puts every message on the wire: copies, byte counts and captures."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MakeData

from secure_vfl.cli import main
from secure_vfl.errors import ConfigError, ProtocolError, RegistryError
from secure_vfl.experiment import TrainConfig, run_training
from secure_vfl.federation import wire
from secure_vfl.federation.channel import (
    Channel,
    InProcessTransport,
    RecordingLayer,
    read_capture,
)
from secure_vfl.federation.messages import (
    GradientMessage,
    PredictTask,
    RepresentationMessage,
    RepresentRequest,
    SumRequest,
)
from secure_vfl.federation.parties import ROLES, DataParty, Party
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties

FAST = MethodConfig(epochs=1, batch_size=64, lr=0.05)


def _captured_run(make_data: MakeData, heads: str) -> tuple[RecordingLayer, bytes, Channel]:
    recorder = RecordingLayer()
    capture = io.BytesIO()
    channel = Channel([recorder], transport=InProcessTransport(capture=capture))
    config = MethodConfig(epochs=1, batch_size=64, lr=0.05, heads=heads)  # type: ignore[arg-type]
    method = METHODS.get("laser")(make_data(), config, seed=0, channel=channel)
    method.fit()
    method.predict("mcar:0")
    return recorder, capture.getvalue(), channel


@pytest.mark.parametrize("heads", ["all", "active"])
def test_the_capture_holds_every_message_that_crossed_in_order(
    make_data: MakeData, heads: str, tmp_path: Path
) -> None:
    recorder, captured, channel = _captured_run(make_data, heads)
    path = tmp_path / "run.capture"
    path.write_bytes(captured)
    messages = list(read_capture(path))
    assert [m.kind for m in messages] == recorder.kinds()
    assert [wire.encode(m) for m in messages] == [wire.encode(m) for m in recorder.messages]
    # The traffic count is exactly the captured bytes less the 4-byte record lengths.
    assert sum(channel.transport.bytes.values()) == len(captured) - 4 * len(messages)
    kinds = Counter(m.kind for m in messages)
    assert kinds["represent-request"] > 0 and kinds["sum"] > 0 and kinds["gradient"] > 0
    # The label party's head's gradients close the others' steps, their heads' too: with
    # every head at its party, one of the four heads' gradients; with its head alone, all.
    closing = [m for m in messages if m.kind == "gradient" and m.step]
    from_label_party = [m for m in messages if m.kind == "gradient" and m.sender == "party-0"]
    assert closing == from_label_party and all(m.heads for m in closing)
    if heads == "all":
        assert 0 < len(closing) < kinds["gradient"]
    else:
        assert kinds["update"] == 0 and len(closing) == kinds["gradient"]


def test_no_party_shares_a_tensor_with_another(make_data: MakeData) -> None:
    seen: dict[int, str] = {}
    kept: list[torch.Tensor] = []  # alive, so no address is reused for another tensor

    class Storages:
        """Notes the storage of every tensor each party receives."""

        def __init__(self, name: str) -> None:
            self.name = name

        def on_message(self, message):  # type: ignore[no-untyped-def]
            for value in vars(message).values():
                if isinstance(value, torch.Tensor) and value.numel():
                    kept.append(value)
                    owner = seen.setdefault(value.untyped_storage().data_ptr(), self.name)
                    assert owner == self.name, f"{message.kind}: a tensor {owner} also holds"
            return message

    method = METHODS.get("laser")(make_data(), FAST, seed=0)
    for party in method.fed.channel.parties.values():
        party.incoming.append(Storages(party.name))
    method.train_step(np.arange(64), 0, 0)
    assert len(seen) > 10


def _rows_message(sender: str, receiver: str, round: int = 1) -> RepresentationMessage:
    return RepresentationMessage(
        sender=sender,
        receiver=receiver,
        round=round,
        batch_id=0,
        positions=torch.arange(2),
        representation=torch.ones(2, 3),
    )


def test_a_message_the_receivers_codec_refuses_is_counted_and_captured_as_it_crossed() -> None:
    """In one process a message that crossed and that the receiver's codec refused (a diverged
    run's NaN) was neither counted nor captured; over the network the sender counts and
    captures it, as it crossed (what the network and an eavesdropper saw)."""
    from secure_vfl.errors import NonFiniteError

    capture = io.BytesIO()
    channel = Channel(transport=InProcessTransport(capture=capture))
    message = dataclasses.replace(
        _rows_message("party-1", "aggregator"), representation=torch.full((2, 3), float("nan"))
    )
    data = wire.encode(message)  # the sender's codec leaves values in tensors to the receiver
    with pytest.raises(NonFiniteError, match="representation from party-1 \\(round 1\\)"):
        channel.send(message)
    assert channel.transport.bytes == Counter({("party-1", "aggregator", "train"): len(data)})
    assert capture.getvalue() == struct.pack(">I", len(data)) + data


class _Forward(Party):
    """Passes a representation on to ``to``: at once, or (``after``) once it has acted."""

    def __init__(self, name: str, to: str, *, after: bool) -> None:
        super().__init__(name)
        self.to, self.after = to, after

    def on_representation(self, message: RepresentationMessage) -> None:
        forwarded = _rows_message(self.name, self.to, message.round)
        if self.after:
            self.send_after(forwarded)
        else:
            self.send(forwarded)


class _Refusing(Party):
    def on_representation(self, message: RepresentationMessage) -> None:
        if message.round == 13:
            raise ProtocolError("round 13 is not the round expected")
        self._inbox.append(message)


def test_in_one_process_a_reply_sent_after_acting_goes_before_the_send_returns() -> None:
    """Party.send_after in one process: the reply is delivered right after its sender has
    acted, before the send that caused it returns, in the order send gives, so take finds it;
    its refusal reaches that send's caller, as a nested send's would."""
    recorder = RecordingLayer()
    channel = Channel([recorder])
    bank = _Refusing("bank")
    for party in (bank, _Forward("shop", "aggregator", after=False)):
        party.connect(channel)
    _Forward("aggregator", "bank", after=True).connect(channel)
    bank.send(_rows_message("bank", "shop"))
    assert [(m.sender, m.receiver) for m in recorder.messages] == [
        ("bank", "shop"),
        ("shop", "aggregator"),
        ("aggregator", "bank"),
    ]
    assert bank.take("representation", sender="aggregator", round=1, batch_id=0).round == 1
    with pytest.raises(ProtocolError, match="round 13 is not the round expected"):
        bank.send(_rows_message("bank", "shop", round=13))
    with pytest.raises(ProtocolError, match="expected, found none"):
        bank.take("representation", sender="aggregator", round=2, batch_id=0)  # none waits


def test_a_message_answered_before_a_refusal_further_on_is_taken_all_the_same() -> None:
    """shop answered bank's message before the aggregator's reply to it was refused (its
    handler failed with that refusal): it acted, so the same message again is refused as a
    replay instead of acted on twice. bank's own refusal, before it acted, took nothing."""
    channel = Channel()
    bank = _Refusing("bank")
    for party in (bank, _Forward("shop", "aggregator", after=False)):
        party.connect(channel)
    _Forward("aggregator", "bank", after=False).connect(channel)
    with pytest.raises(ProtocolError, match="round 13 is not the round expected"):
        bank.send(_rows_message("bank", "shop", round=13))
    with pytest.raises(ProtocolError, match=r"^shop: a second representation from bank"):
        bank.send(_rows_message("bank", "shop", round=13))
    with pytest.raises(ProtocolError, match="round 13 is not the round expected"):
        channel.parties["aggregator"].send(_rows_message("aggregator", "bank", round=13))


def test_read_capture_refuses_a_truncated_record(tmp_path: Path) -> None:
    path = tmp_path / "bad.capture"
    path.write_bytes(struct.pack(">I", 100) + b"\x00" * 10)
    with pytest.raises(ProtocolError, match="a record of 100 bytes expected, found 10"):
        list(read_capture(path))
    path.write_bytes(b"\x00\x00")
    with pytest.raises(ProtocolError, match="truncated record length"):
        list(read_capture(path))
    path.write_bytes(struct.pack(">I", 5) + b"SVFL\x01")  # a whole record, not a message
    with pytest.raises(
        ProtocolError,
        match=r"bad.capture, record 1 \(at byte 0\): header: 6 bytes expected, found 5",
    ):
        list(read_capture(path))


def _record() -> bytes:
    """One capture record: a small representation message with its 4-byte length."""
    message = RepresentationMessage(
        sender="party-1", receiver="aggregator", round=0, batch_id=0, positions=torch.arange(2),
        representation=torch.zeros(2, 3),
    )  # fmt: skip
    data = wire.encode(message)
    return struct.pack(">I", len(data)) + data


def test_a_truncated_capture_record_is_named_by_its_number_and_byte(tmp_path: Path) -> None:
    """A torn record after whole ones was refused naming the file only, not which record, as
    a record the codec refuses is named."""
    record = _record()
    path = tmp_path / "torn.capture"
    at = 2 * len(record)
    for torn, refusal in (
        (record[:-1], f"a record of {len(record) - 4} bytes expected, found {len(record) - 5}"),
        (record[:3], "a truncated record length at the end of the file"),
    ):
        path.write_bytes(record + record + torn)
        with pytest.raises(ProtocolError) as refused:
            list(read_capture(path))
        assert str(refused.value) == f"{path}, record 3 (at byte {at}): {refusal}."


def test_a_capture_is_a_file_of_its_own_and_a_refused_run_leaves_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`psi --out F --capture F` lost the capture, `--capture` on the --mine file appended
    binary records to the user's CSV, `train --out D --capture D` trained and then failed; a
    run refused before any message left an empty capture file."""
    (tmp_path / "a.csv").write_text("id\na\nb\n", encoding="utf-8")
    (tmp_path / "b.csv").write_text("id\nb\nc\n", encoding="utf-8")
    psi = ["psi", "--mine", str(tmp_path / "a.csv"), "--theirs", str(tmp_path / "b.csv")]
    train = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    for argv, path, flag in (
        ([*psi, "--out", str(tmp_path / "same.txt")], tmp_path / "same.txt", "--out"),
        (psi, tmp_path / "a.csv", "--mine"),
        ([*train, "--out", str(tmp_path / "run")], tmp_path / "run", "--out"),
    ):
        assert main([*argv, "--capture", str(path)]) == 2
        assert f"--capture {path} is also this command's {flag}" in capsys.readouterr().err
    assert (tmp_path / "a.csv").read_text() == "id\na\nb\n"
    assert not (tmp_path / "same.txt").exists() and not (tmp_path / "run").exists()
    # Among what the run writes in its folder: replaced by result.json, or gone with the model
    # folder, exit 0 and nothing said. Beside them it is the user's file, and stays.
    run = tmp_path / "run"
    for inside in (run / "result.json", run / "model" / "c.bin", run / "checkpoints" / "c"):
        assert main([*train, "--out", str(run), "--capture", str(inside)]) == 2
        assert f"--capture {inside} is among what this command writes" in capsys.readouterr().err
    assert not run.exists()
    beside = run / "train.capture"
    assert main([*train, "--out", str(run), "--capture", str(beside)]) == 0
    size = beside.stat().st_size
    assert main([*train, "--out", str(run), "--overwrite", "--capture", str(beside)]) == 0
    assert beside.stat().st_size == 2 * size  # appended to, over a run written again
    # Inside the saved model a deployed prediction reads, named any of the three ways: its
    # manifest lists every file (the manifest's own path let one through).
    import argparse

    from secure_vfl.cli import _capture

    cut = run / "model" / "p.capture"
    for model in (run, run / "model", run / "model" / "manifest.json"):
        with (
            pytest.raises(ConfigError, match="is inside the model's folder"),
            _capture(cut, argparse.Namespace(model=model)),
        ):
            pass
    assert not cut.exists()
    capture = tmp_path / "refused.capture"  # ten parties for iris' four features
    assert main([*train, "--parties", "10", "--out", str(tmp_path / "r"), "--capture",
                 str(capture)]) == 2  # fmt: skip
    assert not capture.exists()


def test_a_dangling_capture_link_is_followed_and_a_refused_run_makes_nothing_where_it_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--capture LINK` where LINK names a file not there yet: a run refused before any message
    left an empty file where the link points (the file was opened through the link, so the
    command did not know it had made it), and a link into a missing folder was refused as a
    bare `No such file or directory`."""
    train = ["train", "--method", "laser", "--dataset", "iris", "--epochs", "1", "--quiet"]
    link, target = tmp_path / "link.capture", tmp_path / "elsewhere.capture"
    link.symlink_to(target)
    refused = [*train, "--parties", "10", "--out", str(tmp_path / "r"), "--capture", str(link)]
    assert main(refused) == 2  # ten parties for iris' four features
    assert "must be at most the number of features" in capsys.readouterr().err
    assert link.is_symlink() and not target.exists() and not (tmp_path / "r").exists()
    (tmp_path / "a.csv").write_text("id\na\nb\n", encoding="utf-8")
    (tmp_path / "b.csv").write_text("id\nb\nc\n", encoding="utf-8")
    psi = ["psi", "--mine", str(tmp_path / "a.csv"), "--theirs", str(tmp_path / "b.csv")]
    assert main([*psi, "--capture", str(link)]) == 0  # followed: the file it names is made
    assert link.is_symlink() and [m.kind for m in read_capture(target)] == [
        "psi-request",
        "psi-response",
    ]
    far = tmp_path / "far.capture"
    far.symlink_to(tmp_path / "nowhere" / "c.capture")
    assert main([*psi, "--capture", str(far)]) == 2
    assert (
        f"--capture {far}: a link to a file in a folder that is there (or a new path) expected, "
        f"found a symbolic link to {tmp_path / 'nowhere' / 'c.capture'}, whose folder "
        f"{tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    )
    assert far.is_symlink() and not (tmp_path / "nowhere").exists()


def test_the_label_party_holds_no_other_party(make_data: MakeData) -> None:
    method = METHODS.get("laser")(make_data(), FAST, seed=0)
    own = method.fed.own
    others = [p for p in in_process_parties(method.fed.channel) if p is not own]
    reachable = _walk(method, exclude={id(method.fed.channel)})
    ids = {id(v) for v in reachable}
    assert not any(id(p) in ids for p in others)
    assert not any(id(p.model) in ids for p in others)
    # Of the data, it keeps labels, availability masks and its own block only.
    arrays = [v for v in reachable if isinstance(v, np.ndarray)]
    blocks = [b for p in others for b in p._blocks.values()]
    assert not any(np.shares_memory(a, b.numpy()) for a in arrays for b in blocks)
    assert method.fed.data.train.blocks[0].size > 0
    assert all(b.size == 0 for b in method.fed.data.train.blocks[1:])


def _walk(root: object, *, exclude: set[int]) -> list[object]:
    """Every object reachable from ``root`` through attributes and containers."""
    seen: set[int] = set(exclude)
    found: list[object] = []
    stack = [root]
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, (str, bytes, int, float, torch.Tensor)):
            continue
        if isinstance(value, np.ndarray):
            seen.add(id(value))
            found.append(value)
            continue
        seen.add(id(value))
        found.append(value)
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set)):
            stack.extend(value)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            stack.extend(vars(value).values())
    return found


def test_cli_captures_train_impute_and_psi(tmp_path: Path) -> None:
    capture = tmp_path / "train.capture"
    argv = ["train", "--method", "laser", "--dataset", "digits", "--epochs", "1", "--quiet"]
    out = tmp_path / "run"
    assert main([*argv, "--out", str(out), "--capture", str(capture)]) == 0
    messages = list(read_capture(capture))
    traffic = json.loads((out / "result.json").read_text())["traffic"]
    sent = sum(c["train"] + c["predict"] for c in traffic["bytes"].values())
    assert sent == capture.stat().st_size - 4 * len(messages)
    # Each sender's bytes by phase are its messages' (the aggregator's sums for the test splits
    # were counted as training: a plain sum carried no phase).
    by_phase: Counter[tuple[str, str]] = Counter()
    for message in messages:
        by_phase[(message.sender, getattr(message, "phase", "train"))] += len(wire.encode(message))
    for sender, counts in traffic["bytes"].items():
        assert counts == {
            "train": by_phase[(sender, "train")],
            "predict": by_phase[(sender, "predict")],
        }
    assert traffic["bytes"]["aggregator"]["predict"] > 0
    (tmp_path / "a.csv").write_text("id\na\nb\nc\n", encoding="utf-8")
    (tmp_path / "b.csv").write_text("id\nc\nd\na\n", encoding="utf-8")
    psi = tmp_path / "psi.capture"
    argv = ["psi", "--mine", str(tmp_path / "a.csv"), "--theirs", str(tmp_path / "b.csv")]
    assert main([*argv, "--capture", str(psi)]) == 0
    assert [m.kind for m in read_capture(psi)] == ["psi-request", "psi-response"]
    assert main([*argv, "--capture", str(psi)]) == 0  # appended: a second run's records follow
    assert len(list(read_capture(psi))) == 4
    impute = tmp_path / "impute.capture"
    argv = ["impute", "--method", "fed-mean", "--dataset", "ozone", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "imp"), "--capture", str(impute)]) == 0
    kinds = Counter(m.kind for m in read_capture(impute))
    assert kinds["representation"] > 0 and kinds["sum"] > 0


def test_a_capture_torn_by_a_killed_command_is_cut_before_the_next_appends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Appended to after a torn last record (SIGKILL while writing it), a capture could no
    longer be read past that record (`magic bytes b'SVFL' expected, found b'\\x00...'`)."""
    (tmp_path / "a.csv").write_text("id\na\nb\nc\n", encoding="utf-8")
    (tmp_path / "b.csv").write_text("id\nc\nd\na\n", encoding="utf-8")
    argv = ["psi", "--mine", str(tmp_path / "a.csv"), "--theirs", str(tmp_path / "b.csv")]
    capture = tmp_path / "psi.capture"
    assert main([*argv, "--capture", str(capture)]) == 0
    whole = capture.read_bytes()
    first = 4 + struct.unpack(">I", whole[:4])[0]
    for torn in (whole[:3], whole[:6], whole[: first - 1]):  # its length, magic, message cut
        capture.write_bytes(whole + torn)
        assert main([*argv, "--capture", str(capture)]) == 0
        err = capsys.readouterr().err
        assert (
            f"ended in a torn record (a command stopped while writing it): its last {len(torn)} "
            "bytes were cut" in err
        )
        assert [m.kind for m in read_capture(capture)] == ["psi-request", "psi-response"] * 2
    # a file that is not a capture is refused, and left as it was
    notes = tmp_path / "notes.txt"
    notes.write_text("id,x\n1,2\n", encoding="utf-8")
    assert main([*argv, "--capture", str(notes)]) == 2
    assert "is not a capture file (it starts with b'id,x\\n1,2'" in capsys.readouterr().err
    assert notes.read_text(encoding="utf-8") == "id,x\n1,2\n"
    capture.write_bytes(whole + whole[: first - 1] + whole)  # appended to after a torn record
    assert main([*argv, "--capture", str(capture)]) == 2
    assert "is not a capture file (its record at byte" in capsys.readouterr().err


def test_records_another_command_appends_while_a_capture_is_checked_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two commands capturing into one file: the second's check for a torn last record read
    the file's size, then its records, then its size again, and cut everything the first
    appended in between as a torn record (a run appending while another starts lost MiBs)."""
    import argparse

    from secure_vfl.cli import _capture
    from secure_vfl.federation import channel

    message = RepresentationMessage(
        sender="party-1", receiver="aggregator", round=0, batch_id=0, positions=torch.arange(2),
        representation=torch.zeros(2, 3),
    )  # fmt: skip
    record = struct.pack(">I", len(wire.encode(message))) + wire.encode(message)
    scan = channel.whole_records
    appended = b""  # what the other command writes while the check reads (set below)

    def another_command_appends(path: Path) -> int:
        end = scan(path)
        with path.open("ab") as handle:  # the other command's write lands now
            handle.write(appended)
        return end

    monkeypatch.setattr(channel, "whole_records", another_command_appends)
    capture = tmp_path / "shared.capture"
    # After whole records, its next record; after its record half written, the other half.
    for before, appended in ((record, record), (record + record[:7], record[7:])):
        capture.write_bytes(before)
        with _capture(capture, argparse.Namespace()):
            pass
        assert capture.read_bytes() == before + appended
        assert "torn record" not in capsys.readouterr().err


_STALLING_WRITER = """
import sys
from secure_vfl.federation.channel import append_record

class Stalls:  # the capture file, whose writer stalls halfway through a record
    def __init__(self, handle):
        self.handle, self.name = handle, handle.name
    def fileno(self):
        return self.handle.fileno()
    def write(self, data):
        half = len(data) // 2
        self.handle.write(data[:half])
        self.handle.flush()
        print("half", flush=True)
        sys.stdin.readline()
        return self.handle.write(data[half:])
    def flush(self):
        self.handle.flush()

with open(sys.argv[1], "ab") as handle:
    append_record(Stalls(handle), bytes.fromhex(sys.argv[2]))
"""


def test_a_record_another_process_is_writing_is_not_cut_as_torn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command starting on a capture that another process was appending to, stalled halfway
    through a record, took the half record for a torn one (a killed command's) and cut it; the
    other half then followed the records before it, and the file could not be read past them."""
    import argparse
    import subprocess
    import sys
    import threading

    from secure_vfl.cli import _capture

    record = _record()
    capture = tmp_path / "shared.capture"
    capture.write_bytes(record)
    failures: list[BaseException] = []

    def another_command_starts() -> None:
        try:
            with _capture(capture, argparse.Namespace()):
                pass
        except BaseException as error:
            failures.append(error)

    writer = subprocess.Popen(
        [sys.executable, "-c", _STALLING_WRITER, str(capture), record[4:].hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "half\n"
        other = threading.Thread(target=another_command_starts)
        other.start()
        other.join(timeout=1)  # unlocked, it has cut the half record by now
        assert writer.stdin is not None
        writer.stdin.write("\n")
        writer.stdin.flush()
        assert writer.wait(timeout=60) == 0
        other.join(timeout=60)
        assert not other.is_alive() and failures == []
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert capture.read_bytes() == record + record
    assert [m.kind for m in read_capture(capture)] == ["representation"] * 2
    assert "torn record" not in capsys.readouterr().err


def test_a_run_refused_on_a_new_capture_keeps_another_runs_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs started on one new capture path: the one refused before any message removed
    the empty file it took for its own, which the other held open, and the other's records went
    to a file no name reached (its capture lost). Both took the file for theirs when each
    looked for it before either made it; and the one that did make it removed it under the
    other as well."""
    import argparse

    from secure_vfl import cli
    from secure_vfl.federation.channel import append_record

    message = RepresentationMessage(
        sender="party-1", receiver="aggregator", round=0, batch_id=0, positions=torch.arange(2),
        representation=torch.zeros(2, 3),
    )  # fmt: skip
    make_parent = cli.make_parent
    for other_starts_first in (True, False):
        capture = tmp_path / f"new-{other_starts_first}.capture"
        running = cli._capture(capture, argparse.Namespace())
        refused = cli._capture(capture, argparse.Namespace())
        held: list[Any] = []

        def the_other_starts_meanwhile(
            path: Path, running: Any = running, held: list[Any] = held
        ) -> None:
            monkeypatch.setattr(cli, "make_parent", make_parent)
            make_parent(path)
            held.append(running.__enter__())  # after the refused run looked for the file

        if other_starts_first:
            monkeypatch.setattr(cli, "make_parent", the_other_starts_meanwhile)
            refused.__enter__()
        else:  # the refused run made the file, the other opened it
            refused.__enter__()
            held.append(running.__enter__())
        refusal = ConfigError("refused before any message")
        assert refused.__exit__(ConfigError, refusal, None) is False  # raised on: refused
        append_record(held[0], wire.encode(message))
        running.__exit__(None, None, None)
        assert [m.kind for m in read_capture(capture)] == ["representation"]


class CuriousParty(DataParty):
    """A passive party that keeps every gradient it receives and notes when training ended."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.seen: list[torch.Tensor] = []
        self.trained = False

    def on_gradient(self, message):  # type: ignore[no-untyped-def]
        self.seen.append(message.gradient)
        super().on_gradient(message)

    def after_training(self) -> None:
        self.trained = True


ROLES.register("test-curious-party", CuriousParty)


def test_a_party_is_replaced_by_a_registered_role_without_changing_the_run(
    make_data: MakeData,
) -> None:
    data = make_data(test_missing=("mcar:0",))
    config = TrainConfig(method="laser", dataset="synthetic", method_config=FAST)
    honest = run_training(config, data=data)
    channel = Channel()
    curious = run_training(
        config, data=data, channel=channel, roles={"party-2": "test-curious-party"}
    )
    assert curious.metrics == honest.metrics and curious.epoch_loss == honest.epoch_loss
    party = channel.parties["party-2"]
    assert isinstance(party, CuriousParty) and party.trained
    assert len(party.seen) > 0 and all(g.shape[1] == FAST.representation_dim for g in party.seen)


def test_roles_refuse_unknown_names_and_the_label_party(make_data: MakeData) -> None:
    data = make_data()
    with pytest.raises(RegistryError, match="unknown role 'spy'"):
        METHODS.get("laser")(data, FAST, seed=0, roles={"party-1": "spy"})
    with pytest.raises(ConfigError, match="party-0 drives the run"):
        METHODS.get("laser")(data, FAST, seed=0, roles={"party-0": "test-curious-party"})


def _state(channel: Channel) -> list[object]:
    """Everything a bad message could change in any party: pending work, inboxes, parameters."""
    state: list[object] = []
    for party in channel.parties.values():
        state.append((party.name, len(party._inbox)))
        if isinstance(party, DataParty):
            state.append(sorted(party._pending))
            state.append(sorted((k, len(v)) for k, v in party._gradients.items()))
            state.append(sorted(party._tasks))
            state += [p.detach().clone() for m in party.models.values() for p in m.parameters()]
        else:
            state.append(getattr(party, "_batch", None))
            contributions = getattr(party, "_contributions", {})
            state += [(tag, sorted(contributions[tag])) for tag in sorted(contributions)]
    return state


def _same(a: list[object], b: list[object]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


def _bad_messages() -> dict[str, tuple[str, object]]:
    header = {"sender": "party-0", "receiver": "party-1", "round": 5, "batch_id": 0}
    rows = torch.arange(4)
    request = RepresentRequest(
        **header, split="train", rows=rows, positions=rows, reply_to="aggregator"
    )
    return {
        "rows the party does not hold": (
            "rows < ",
            dataclasses.replace(request, rows=torch.tensor([0, 1, 2, 10_000])),
        ),
        "a split the party does not hold": (
            "split 'nope'",
            dataclasses.replace(request, split="nope"),
        ),
        "a model the party does not hold": ("model 'm'", dataclasses.replace(request, model="m")),
        "a gradient with no forward pass": (
            "no pending forward pass",
            GradientMessage(**header, positions=rows, gradient=torch.ones(4, 8)),
        ),
        "a head task for a head it does not hold": (
            "holds no head named 'x'",
            PredictTask(**header, positions=rows, tag="t", head="x"),
        ),
        "a sum for a batch the server has moved past": (
            "a batch it has moved past",
            SumRequest(
                **{**header, "receiver": "aggregator", "round": 0},
                selection=torch.ones(1, 4, 4, dtype=torch.bool),
                parties=("party-0", "party-1", "party-2", "party-3"),
                deliver_to="party-0",
                tag="t",
            ),
        ),
        "a message in another party's name": (
            "a party sends only in its own name",
            dataclasses.replace(request, sender="party-2"),
        ),
        "a message to a party that does not exist": (
            "no such party",
            dataclasses.replace(request, receiver="party-9"),
        ),
    }


@pytest.mark.parametrize("case", list(_bad_messages()))
def test_a_bad_message_is_refused_and_changes_no_party(make_data: MakeData, case: str) -> None:
    config = MethodConfig(epochs=1, batch_size=64, lr=0.05, representation_dim=8)
    method = METHODS.get("laser")(make_data(), config, seed=0)
    method.train_step(np.arange(64), 0, 0)
    method.train_step(np.arange(64), 1, 0)
    method.fed.flush(round=1)  # the closing gradients it held go now, not with the bad message
    expected, message = _bad_messages()[case]
    before = _state(method.fed.channel)
    with pytest.raises(ProtocolError, match=expected):
        method.fed.own.send(message)  # type: ignore[arg-type]
    assert _same(before, _state(method.fed.channel))


def test_a_replayed_request_or_gradient_is_refused_and_changes_nothing(make_data: MakeData) -> None:
    config = MethodConfig(epochs=1, batch_size=64, lr=0.05, representation_dim=8)
    method = METHODS.get("laser")(make_data(), config, seed=0)
    rows = torch.arange(4)
    fed = method.fed
    request = RepresentRequest(
        sender="party-0",
        receiver="party-1",
        round=5,
        batch_id=0,
        session=fed.session,
        split="train",
        rows=rows,
        positions=rows,
        reply_to="aggregator",
        ticket=fed.ticket("representation", "party-1", round=5, batch_id=0, phase="train", tag=""),
    )
    own = method.fed.own
    own.send(request)
    before = _state(method.fed.channel)
    with pytest.raises(ProtocolError, match=r"a second represent-request .*\(a replay\?\)"):
        own.send(request)
    # Not the same messages (another session), for what was done all the same.
    with pytest.raises(ProtocolError, match="replayed request"):
        own.send(dataclasses.replace(request, session="other"))
    second = RepresentationMessage(
        sender="party-1",
        receiver="aggregator",
        round=5,
        batch_id=0,
        session=fed.session,
        positions=rows,
        representation=torch.zeros(4, 8),
        ticket=request.ticket,
    )
    sender = in_process_parties(method.fed.channel)[1]
    with pytest.raises(ProtocolError, match=r"a second representation .*\(a replay\?\)"):
        sender.send(second)
    with pytest.raises(ProtocolError, match="of session 'other'; the driver's session is"):
        sender.send(dataclasses.replace(second, session="other"))
    assert _same(before, _state(method.fed.channel))


@pytest.mark.parametrize("tag", [None, "never-used"], ids=["replayed", "under-a-new-tag"])
def test_a_contribution_for_a_past_batch_is_refused_and_changes_nothing(
    make_data: MakeData, tag: str | None
) -> None:
    """In the clear, a representation of a batch the aggregation server has moved past is
    refused before it can reset the batch it is collecting: replayed as it was, or under a tag
    that batch never had (no replay of bytes, but a message for the wrong round that must not
    take the server back there)."""
    config = MethodConfig(epochs=1, batch_size=64, lr=0.05, representation_dim=8)
    method = METHODS.get("laser")(make_data(), config, seed=0)
    recorder = RecordingLayer()
    method.fed.channel.layers.append(recorder)
    method.train_step(np.arange(64), 0, 0)
    old = next(m for m in recorder.messages if isinstance(m, RepresentationMessage))
    method.train_step(np.arange(64, 128), 1, 0)
    rows = torch.arange(4)
    fed = method.fed
    # the next batch has begun at the server: a representation of round 2 has arrived
    fed.own.send(
        RepresentRequest(
            sender="party-0",
            receiver="party-1",
            round=2,
            batch_id=0,
            session=fed.session,
            split="train",
            rows=rows,
            positions=rows,
            reply_to="aggregator",
            ticket=fed.ticket(
                "representation", "party-1", round=2, batch_id=0, phase="train", tag=""
            ),
        )
    )
    before = _state(method.fed.channel)
    assert ("", ["party-1"]) in before  # what the stale contribution must not reset
    stale = old
    if tag is not None:  # with the driver's ticket for that tag: no other check refuses it
        ticket = fed.ticket(
            "representation", old.sender, round=old.round, batch_id=0, phase="train", tag=tag
        )
        stale = dataclasses.replace(old, tag=tag, ticket=ticket)
    with pytest.raises(
        ProtocolError,
        match=r"a second representation .*\(a replay\?\)" if tag is None else "moved past",
    ):
        method.fed.channel.parties[old.sender].send(stale)
    assert _same(before, _state(method.fed.channel))
