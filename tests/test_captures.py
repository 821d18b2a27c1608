"""`secure-vfl capture show|summary`: a capture read back, every message and every byte counted,
tensors as dtype and shape, never their values."""

from __future__ import annotations

import dataclasses
import io
import re
import struct
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import MakeData

from secure_vfl.captures import byte_size, field_text, show_lines, summary_lines
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError, ProtocolError, VersionError
from secure_vfl.federation import wire
from secure_vfl.federation.channel import (
    Channel,
    InProcessTransport,
    RecordingLayer,
    append_record,
    read_capture,
)
from secure_vfl.federation.messages import Message, RepresentationMessage, ScoreMessage
from secure_vfl.methods import METHODS, MethodConfig

_LINE = re.compile(
    r"^ *(?P<number>\d+) +(?P<round>\d+) +(?P<batch>\d+)  (?P<kind>\S+) +(?P<sender>\S+) -> "
    r"(?P<receiver>\S+) +(?P<bytes>\d+)  (?P<fields>.*)$"
)


@pytest.fixture
def laser_capture(make_data: MakeData, tmp_path: Path) -> tuple[Path, RecordingLayer]:
    """A capture of one LASER epoch and prediction, and what a recording layer saw of it."""
    recorder = RecordingLayer()
    capture = io.BytesIO()
    channel = Channel([recorder], transport=InProcessTransport(capture=capture))
    config = MethodConfig(epochs=1, batch_size=64, lr=0.05)
    method = METHODS.get("laser")(make_data(), config, seed=0, channel=channel)
    method.fit()
    method.predict("mcar:0")
    path = tmp_path / "run.capture"
    path.write_bytes(capture.getvalue())
    return path, recorder


def _message_lines(lines: list[str]) -> list[re.Match[str]]:
    matches = [_LINE.match(line) for line in lines[1:]]
    return [match for match in matches if match is not None]


def test_show_has_a_line_per_message_in_order_with_shapes_and_never_values(
    laser_capture: tuple[Path, RecordingLayer],
) -> None:
    path, recorder = laser_capture
    lines = list(show_lines(path))
    rows = _message_lines(lines)
    assert [row["kind"] for row in rows] == recorder.kinds()
    assert [int(row["number"]) for row in rows] == list(range(1, len(rows) + 1))
    messages = list(read_capture(path))
    assert [(row["sender"], row["receiver"]) for row in rows] == [
        (m.sender, m.receiver) for m in messages
    ]
    assert [int(row["round"]) for row in rows] == [m.round for m in messages]
    # every encoded byte is counted: the file is the records' lengths and their bytes
    assert sum(int(row["bytes"]) for row in rows) == path.stat().st_size - 4 * len(rows)
    assert messages[0].kind == "ticket-key"  # the session's first, then the first step's
    first = messages[1]
    assert isinstance(first, RepresentationMessage)
    shape = list(first.representation.shape)
    assert f"representation=float32{shape}" in rows[1]["fields"]
    value = f"{first.representation[0, 0].item():.4f}"[:6]
    assert value not in "\n".join(lines)
    assert (
        lines[-1]
        == f"{len(rows)} messages, {byte_size(sum(int(r['bytes']) for r in rows))} encoded."
    )


def test_show_keeps_the_kinds_and_the_party_asked_for(
    laser_capture: tuple[Path, RecordingLayer],
) -> None:
    path, _ = laser_capture
    messages = list(read_capture(path))
    assert [m.kind for m in read_capture(str(path))] == [m.kind for m in messages]  # str paths too
    lines = list(show_lines(path, kinds=["gradient", "sum"], party="party-2"))
    rows = _message_lines(lines)
    expected = [
        m for m in messages if m.kind in ("gradient", "sum") and "party-2" in (m.sender, m.receiver)
    ]
    assert 0 < len(rows) == len(expected) < len(messages)
    assert [(r["kind"], r["sender"], r["receiver"]) for r in rows] == [
        (m.kind, m.sender, m.receiver) for m in expected
    ]
    assert lines[-1].startswith(f"{len(expected)} of {len(messages)} messages, ")
    with pytest.raises(
        ConfigError, match=r"--kind: a message kind in \(.*\) expected, found 'sums'"
    ):
        list(show_lines(path, kinds=["sums"]))


def test_show_keeps_the_rounds_asked_for(
    laser_capture: tuple[Path, RecordingLayer], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = laser_capture
    messages = list(read_capture(path))
    for first, last in ((2, 2), (1, 3)):
        expected = [m for m in messages if first <= m.round <= last]
        rows = _message_lines(list(show_lines(path, rounds=(first, last))))
        assert 0 < len(rows) == len(expected) < len(messages)
        assert {int(r["round"]) for r in rows} == set(range(first, last + 1))
    # summary: the same rounds' messages, and bytes, counted by flow and by party
    round_2 = [m for m in read_capture(path) if m.round == 2]
    summary = summary_lines(path, rounds=(2, 2))
    assert summary[0].startswith(f"{path}: {len(round_2)} of {len(messages)} messages (round 2), ")
    heading = next(i for i, line in enumerate(summary) if line.startswith("party "))
    sent = {line.split()[0]: int(line.split()[1]) for line in summary[heading + 1 :]}
    senders = Counter(m.sender for m in round_2)
    assert sent == {name: senders[name] for name in sent} and set(senders) <= set(sent)
    assert main(["capture", "show", str(path), "--rounds", "1-3", "--kind", "sum"]) == 0
    out = capsys.readouterr().out.splitlines()
    sums = [m for m in messages if 1 <= m.round <= 3 and m.kind == "sum"]
    assert out[-1].startswith(f"{len(sums)} of {len(messages)} messages, ")
    for bad in ("3-1", "-1", "a", "1-", "2.5", " 1", "+1", "1_000", "1-2-3", "\u0661"):
        with pytest.raises(SystemExit) as refused:
            main(["capture", "show", str(path), "--rounds", bad])
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert (
            f"--rounds: expected a round N or rounds A-B (integers, 0 <= A <= B), found {bad!r}"
            in err
        )


def test_summary_counts_every_flow_and_what_each_party_sent_and_received(
    laser_capture: tuple[Path, RecordingLayer],
) -> None:
    path, _ = laser_capture
    sizes = Counter[tuple[str, str, str]]()
    count = Counter[tuple[str, str, str]]()
    with path.open("rb") as handle:
        while header := handle.read(4):
            data = handle.read(struct.unpack(">I", header)[0])
            sizes[_route(data)] += len(data)
    for message in read_capture(path):
        count[(message.sender, message.receiver, message.kind)] += 1
    lines = summary_lines(path)
    assert lines[0] == (
        f"{path}: {sum(count.values())} messages, {byte_size(sum(sizes.values()))} encoded, "
        "1 session."
    )
    flows = {}
    for line in lines:
        match = re.match(r"^(\S+) -> (\S+) +(\S+) +(\d+) +(\d+(?:\.\d)? (?:B|KiB|MiB)) ", line)
        if match:
            sender, receiver, kind, messages, size = match.groups()
            flows[(sender, receiver, kind)] = (int(messages), size)
    assert flows == {key: (count[key], byte_size(sizes[key])) for key in count}
    sent = Counter[str]()
    for (sender, _, _), number in count.items():
        sent[sender] += number
    for party, number in sent.items():
        assert any(re.match(rf"^{party} +{number} ", line) for line in lines), party


def _route(data: bytes) -> tuple[str, str, str]:
    message = wire.decode(data)
    return message.sender, message.receiver, message.kind


def test_bytes_after_the_last_whole_record_are_left_out_and_said(
    laser_capture: tuple[Path, RecordingLayer],
) -> None:
    path, _ = laser_capture
    whole = list(show_lines(path))
    path.write_bytes(path.read_bytes() + b"\x00\x00\x01\x00SVFL")  # a record being written
    torn = list(show_lines(path))
    assert torn[:-1] == whole
    assert torn[-1].startswith("the last 8 bytes are not a whole record")
    assert summary_lines(path)[-1] == torn[-1]


def test_a_message_with_non_finite_values_is_shown_by_its_header_and_counted(
    laser_capture: tuple[Path, RecordingLayer], capsys: pytest.CaptureFixture[str]
) -> None:
    """A capture of a run that diverged ends in the message that carried the NaN, as it
    crossed; the codec refuses it, and show stopped there (exit 2). It is shown by its header,
    what was refused said, and counted in show and summary alike; a record refused for anything
    else still stops the reading."""
    path, recorder = laser_capture
    last = recorder.messages[-1]
    diverged = RepresentationMessage(
        sender="party-2",
        receiver="aggregator",
        round=7,
        batch_id=3,
        session=last.session,
        positions=torch.arange(2),
        representation=torch.tensor([[1.0, float("nan")], [0.0, 2.0]]),
    )
    data = wire.encode(diverged)
    with path.open("ab") as handle:
        append_record(handle, data)
    lines = list(show_lines(path))
    row = _message_lines(lines)[-1]
    assert (row["round"], row["batch"], row["kind"]) == ("7", "3", "representation")
    assert (row["sender"], row["receiver"], row["bytes"]) == (
        "party-2",
        "aggregator",
        str(len(data)),
    )
    assert row["fields"].startswith("non-finite values, not decoded: representation from party-2")
    count = len(recorder.messages) + 1
    assert lines[-2].startswith(f"{count} messages, ")
    assert lines[-1].startswith("1 message with non-finite values (a run that diverged")
    summary = summary_lines(path)
    assert summary[0].startswith(f"{path}: {count} messages")
    assert summary[-1] == lines[-1]
    assert main(["capture", "show", str(path), "--kind", "representation"]) == 0
    assert "non-finite values, not decoded" in capsys.readouterr().out
    with pytest.raises(ProtocolError, match=r"record .*finite values expected"):
        list(read_capture(path))  # a reader that acts on messages still refuses it
    with path.open("ab") as handle:
        append_record(handle, wire.encode(last)[:-3])  # a whole record, its message cut short
    with pytest.raises(ProtocolError, match="truncated"):
        list(show_lines(path))


def test_what_is_not_a_capture_is_refused_naming_it(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("id,x\n1,2\n", encoding="utf-8")
    with pytest.raises(ProtocolError, match=r"notes\.txt is not a capture file"):
        summary_lines(notes)
    with pytest.raises(ConfigError, match=r"capture file .* expected at .*, found a directory"):
        list(show_lines(tmp_path))
    empty = tmp_path / "empty.capture"
    empty.touch()
    assert summary_lines(empty) == [f"{empty}: 0 messages, 0 B encoded, 0 sessions."]


def test_a_capture_of_another_release_is_refused_saying_so(tmp_path: Path) -> None:
    """A record of an older message schema (or wire version): refused as before, and the error
    says that another release wrote the file, not only which version it expected."""
    message = RepresentationMessage(
        sender="party-1", receiver="aggregator", round=0, batch_id=0, positions=torch.arange(2),
        representation=torch.zeros(2, 3),
    )  # fmt: skip
    for field, value in (("schema_version", message.schema_version - 1), (None, None)):
        path = tmp_path / f"{field}.capture"
        data = wire.encode(dataclasses.replace(message, **{field: value}) if field else message)
        if field is None:  # the wire format's version: the u16 after the magic bytes
            at = len(wire.MAGIC)
            data = data[:at] + struct.pack("<H", wire.WIRE_VERSION + 1) + data[at + 2 :]
        path.write_bytes(struct.pack(">I", len(data)) + data)
        with pytest.raises(VersionError) as refused:
            summary_lines(path)
        assert "version" in str(refused.value) and "expected, found" in str(refused.value)
        assert str(refused.value).endswith(
            "The file was captured by another release of secure-vfl; read it with that release."
        ), refused.value


def _write_records(path: Path, messages: list[Message]) -> None:
    with path.open("ab") as handle:
        for message in messages:
            append_record(handle, wire.encode(message))


def test_names_another_party_chose_are_escaped_and_a_party_not_in_the_file_is_refused(
    tmp_path: Path,
) -> None:
    """A client file's name is a party's name: `capture show` printed its escape sequences
    raw; `--party bank` in a run whose messages say party-1 matched nothing, silently."""
    odd = "e\x1b[31mRED\x1b[0m"
    path = tmp_path / "odd.capture"
    header = {"round": 1, "batch_id": 0}
    _write_records(
        path,
        [
            ScoreMessage(sender=odd, receiver="server", sse=1.0, count=2, **header),
            ScoreMessage(sender="b", receiver="server", sse=0.5, count=1, session="s1", **header),
        ],
    )
    printed = "\n".join([*show_lines(path), *summary_lines(path)])
    assert "\x1b" not in printed and "e\\x1b[31mRED\\x1b[0m -> server" in printed
    # one session (the first message has none, as a deployment's control messages), one message
    assert summary_lines(path)[0] == f"{path}: 2 messages, {byte_size(path.stat().st_size - 8)} " \
        "encoded, 1 session."  # fmt: skip
    lines = list(show_lines(path))
    assert [line for line in lines if line.startswith("session")] == ["session 's1':"]
    shown = show_lines(path, party="b")
    assert [next(shown) for _ in range(4)][-1] == "1 of 2 messages, " + byte_size(
        int(_LINE.match(lines[-2])["bytes"])  # type: ignore[index]
    ) + " encoded."
    with pytest.raises(
        ConfigError,
        match=r"--party: a party of the capture \(b, e\\x1b\[31mRED\\x1b\[0m, server\) "
        r"expected, found 'bank'",
    ):
        list(show_lines(path, party="bank"))


def test_fields_another_party_chose_are_escaped_and_cut_short() -> None:
    assert field_text("\x1b[2J") == "'\\x1b[2J'"  # a terminal clear-screen, shown, not acted on
    assert len(field_text("x" * 500)) < 100
    assert field_text(("a", "b")) == "('a', 'b')"
    assert field_text(("a",)) == "('a',)"
    assert field_text(tuple("abcdef")) == "('a', 'b', 'c', 'd', ... 6 items)"
    assert field_text(b"\x00" * 96) == "bytes[96]"
    sizes = (0, 1023, 1024, 1536, 2**20 - 1, 5 * 2**20, 3 * 2**30)
    assert [byte_size(n) for n in sizes] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "1.0 MiB",  # not 1024.0 KiB
        "5.0 MiB",
        "3.0 GiB",
    ]


def test_the_command_line_reads_a_psi_capture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The psi-* kinds are the privacy layer's: the command registers them before reading."""
    (tmp_path / "a.csv").write_text("id\na\nb\nc\n", encoding="utf-8")
    (tmp_path / "b.csv").write_text("id\nc\nd\na\n", encoding="utf-8")
    capture = tmp_path / "psi.capture"
    argv = ["psi", "--mine", str(tmp_path / "a.csv"), "--theirs", str(tmp_path / "b.csv")]
    assert main([*argv, "--capture", str(capture), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["capture", "show", str(capture)]) == 0
    out = capsys.readouterr().out
    rows = _message_lines(out.splitlines())
    assert [(r["kind"], r["sender"], r["receiver"]) for r in rows] == [
        ("psi-request", "requester", "responder"),
        ("psi-response", "responder", "requester"),
    ]
    assert "points=bytes[96] total=3" in rows[0]["fields"]
    assert main(["capture", "summary", str(capture)]) == 0
    assert "requester -> responder  psi-request" in capsys.readouterr().out
    assert main(["capture", "show", str(capture), "--kind", "psi-reqest"]) == 2
    assert "found 'psi-reqest'" in capsys.readouterr().err
    # A party the capture does not hold: refused, with no table printed before the refusal.
    assert main(["capture", "show", str(capture), "--party", "bogus"]) == 2
    refused = capsys.readouterr()
    assert "found 'bogus'" in refused.err and refused.out == ""
    assert main(["capture", "summary", str(tmp_path / "a.csv")]) == 2
    assert "a.csv is not a capture file" in capsys.readouterr().err
