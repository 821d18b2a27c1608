"""A capture file read back as people read it: ``secure-vfl capture show`` and ``capture summary``.

``--capture FILE`` appends every message that crosses the transport to FILE: what the network,
or an eavesdropper on it, sees; in a deployment, what one party sent and received. ``show``
prints one line a message (round and batch, kind, sender and receiver, encoded size, and each
of its fields: a tensor or an array as its dtype and shape, never its values; any other field,
a loss, a tag, a deployment message's JSON body with its ids and row numbers, as it is, cut
short); ``summary`` prints how many messages and bytes of each kind each party sent to each
other. Messages are in the order the file recorded them: in a deployment a party records a
message it sent once it was delivered, so the answer to it can come first. Bytes after the
last whole record (a record still being written, or the torn one a stopped run left) are not
read, and the output says so.

The privacy layer's message kinds (``psi-*``) are read once ``protocols.psi`` is imported, as
the command line does.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from torch import Tensor

from secure_vfl.errors import ConfigError
from secure_vfl.federation import wire
from secure_vfl.federation.channel import NonFiniteRecord, capture_records, whole_records
from secure_vfl.federation.messages import Message
from secure_vfl.io import counted
from secure_vfl.runs import columns, name_text, padded

_HEADER = frozenset(wire.HEADER_FIELDS)
_ITEMS_SHOWN = 4  # a longer tuple shows its first items and its length


def field_text(value: object) -> str:
    """One field of a message as ``show`` prints it: a tensor or an array as its dtype and
    shape, bytes as their count, a string quoted (escaped and cut short: another party chose
    it), a tuple item by item."""
    if isinstance(value, Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"{value.dtype.name}{list(value.shape)}"
    if isinstance(value, bytes):
        return f"bytes[{len(value)}]"
    if isinstance(value, tuple):
        items = [field_text(item) for item in value[:_ITEMS_SHOWN]]
        if len(value) > _ITEMS_SHOWN:
            items.append(f"... {len(value)} items")
        return f"({', '.join(items)}{',' if len(value) == 1 else ''})"
    return wire.shown(value)


def content(message: Message) -> str:
    """A message's own fields (not its header) as ``name=value``, those that are None left out."""
    return " ".join(
        f"{field.name}={field_text(value)}"
        for field in dataclasses.fields(message)
        if field.name not in _HEADER and (value := getattr(message, field.name)) is not None
    )


def byte_size(count: int) -> str:
    """``count`` bytes for a reader: ``812 B``, ``4.3 KiB``, ``1.2 MiB``, ``3.0 GiB``."""
    if count < 1024:
        return f"{count} B"
    value = count / 1024
    for unit in ("KiB", "MiB"):
        if round(value, 1) < 1024:  # 1048575 bytes is 1.0 MiB, not 1024.0 KiB
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _records(path: Path) -> tuple[Iterator[tuple[int, Message | NonFiniteRecord]], int]:
    """The whole records of the capture ``path`` (encoded size, message; a message refused for
    non-finite values only, a diverged run's, as its header and the refusal) and how many bytes
    follow them. ConfigError where there is no file; ProtocolError where it is not a capture."""
    if not path.is_file():
        found = "a directory" if path.is_dir() else "nothing"
        raise ConfigError(f"a capture file (--capture FILE) expected at {path}, found {found}.")
    end = whole_records(path)
    return capture_records(path, end=end, non_finite=True), max(path.stat().st_size - end, 0)


def _header(record: Message | NonFiniteRecord) -> Message | wire.Header:
    """What a record's header says (a message is its own header)."""
    return record.header if isinstance(record, NonFiniteRecord) else record


def _non_finite_line(count: int) -> list[str]:
    if not count:
        return []
    return [
        f"{counted(count, 'message')} with non-finite values (a run that diverged: what "
        "crossed, as it crossed), shown by header only: no party would take it."
    ]


def _after_records(torn: int) -> list[str]:
    if not torn:
        return []
    return [
        f"the last {torn} bytes are not a whole record (one still being written, or the torn "
        "record of a run stopped while writing it): not read."
    ]


def _check_kinds(kinds: Sequence[str]) -> None:
    known = wire.kinds()
    for kind in kinds:
        if kind not in known:
            raise ConfigError(
                f"--kind: a message kind in ({', '.join(known)}) expected, found {kind!r}."
            )


def show_lines(
    path: Path,
    *,
    kinds: Sequence[str] = (),
    party: str | None = None,
    rounds: tuple[int, int] | None = None,
) -> Iterator[str]:
    """``secure-vfl capture show``: a line per message of the capture ``path`` in the order
    it recorded them, numbered from 1, those of ``kinds`` only (empty: all), sent or received
    by ``party`` only (None: any) and of the rounds ``rounds`` (first, last; None: all); a line
    naming each session where it changes to another one;
    then how many messages and bytes there were. ConfigError, after the lines, where ``party``
    sent and received nothing in the file (naming the parties that did)."""
    _check_kinds(kinds)
    records, torn = _records(path)
    parties: set[str] = set()
    yield _show_row("#", "round", "batch", "kind", "sender -> receiver", "bytes", "fields")
    session = ""
    shown = shown_bytes = total = non_finite = 0
    for number, (size, record) in enumerate(records, start=1):
        message = _header(record)
        total += 1
        parties.update((message.sender, message.receiver))
        if kinds and message.kind not in kinds:
            continue
        if party is not None and party not in (message.sender, message.receiver):
            continue
        if rounds is not None and not rounds[0] <= message.round <= rounds[1]:
            continue
        if message.session and message.session != session:  # deployment control has none
            session = message.session
            yield f"session {wire.shown(session)}:"
        shown += 1
        shown_bytes += size
        route = f"{name_text(message.sender)} -> {name_text(message.receiver)}"
        if isinstance(record, NonFiniteRecord):
            non_finite += 1
            fields = f"non-finite values, not decoded: {record.reason}"
        else:
            fields = content(record)
        yield _show_row(number, message.round, message.batch_id, message.kind, route, size, fields)
    filtered = kinds or party is not None or rounds is not None
    tally = f"{shown} of {counted(total, 'message')}" if filtered else ""
    yield f"{tally or counted(total, 'message')}, {byte_size(shown_bytes)} encoded."
    yield from _non_finite_line(non_finite)
    yield from _after_records(torn)
    if party is not None and party not in parties:
        named = ", ".join(name_text(name) for name in sorted(parties)) or "none"
        raise ConfigError(
            f"--party: a party of the capture ({named}) expected, found {name_text(party)!r} "
            "(in one process the data parties are party-0, party-1, ... in the order of their "
            "blocks, whatever their files are called)."
        )


def _show_row(*cells: object) -> str:
    """One line of ``show``: number, round, batch, kind, route, bytes and fields."""
    number, round, batch, kind, route, size, fields = cells
    route = padded(str(route), 30)  # names another party chose: in any script
    return f"{number:>6}  {round:>5}  {batch:>5}  {kind:<20} {route} {size:>9}  {fields}"


@dataclasses.dataclass
class _Flow:
    """The messages of one kind from one party to another."""

    messages: int = 0
    bytes: int = 0
    first_round: int | None = None
    last_round: int = 0

    def add(self, size: int, round: int) -> None:
        self.messages += 1
        self.bytes += size
        self.first_round = round if self.first_round is None else min(self.first_round, round)
        self.last_round = max(self.last_round, round)


def summary_lines(path: Path, *, rounds: tuple[int, int] | None = None) -> list[str]:
    """``secure-vfl capture summary``: the messages and bytes of the capture ``path`` by sender,
    receiver and kind (with the rounds they span), then what each party sent and received; of
    the rounds ``rounds`` only (first, last; None: all)."""
    records, torn = _records(path)
    every = 0
    flows: dict[tuple[str, str, str], _Flow] = {}
    sent: Counter[str] = Counter()
    received: Counter[str] = Counter()
    sent_bytes: Counter[str] = Counter()
    received_bytes: Counter[str] = Counter()
    sessions: set[str] = set()
    non_finite = 0
    for size, record in records:
        message = _header(record)
        every += 1
        if rounds is not None and not rounds[0] <= message.round <= rounds[1]:
            continue
        key = (message.sender, message.receiver, message.kind)
        flows.setdefault(key, _Flow()).add(size, message.round)
        sent[message.sender] += 1
        sent_bytes[message.sender] += size
        received[message.receiver] += 1
        received_bytes[message.receiver] += size
        if message.session:  # a deployment's control messages belong to none
            sessions.add(message.session)
        non_finite += isinstance(record, NonFiniteRecord)
    total = sum(flow.messages for flow in flows.values())
    size = sum(flow.bytes for flow in flows.values())
    if rounds is None:
        tally = counted(total, "message")
    else:
        shown = (
            f"round {rounds[0]}" if rounds[0] == rounds[1] else f"rounds {rounds[0]}-{rounds[1]}"
        )
        tally = f"{total} of {counted(every, 'message')} ({shown})"
    lines = [f"{path}: {tally}, {byte_size(size)} encoded, {counted(len(sessions), 'session')}."]
    if flows:
        rows = [("sender -> receiver", "kind", "messages", "bytes", "rounds")]
        for (sender, receiver, kind), flow in sorted(flows.items()):
            span = (
                str(flow.last_round)
                if flow.first_round == flow.last_round
                else f"{flow.first_round}-{flow.last_round}"
            )
            route = f"{name_text(sender)} -> {name_text(receiver)}"
            rows.append((route, kind, str(flow.messages), byte_size(flow.bytes), span))
        lines += ["", *columns(rows, right=(2, 3))]
        parties = sorted(set(sent) | set(received))
        rows = [("party", "sent", "sent bytes", "received", "received bytes")]
        rows += [
            (
                name_text(name),
                str(sent[name]),
                byte_size(sent_bytes[name]),
                str(received[name]),
                byte_size(received_bytes[name]),
            )
            for name in parties
        ]
        lines += ["", *columns(rows, right=(1, 2, 3, 4))]
    return lines + _non_finite_line(non_finite) + _after_records(torn)
