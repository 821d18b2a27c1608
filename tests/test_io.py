"""Atomic writes leave either the whole new file or the old one, never a half-written file."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from secure_vfl.errors import ConfigError, DataError, OutputError, ProtocolError
from secure_vfl.io import (
    atomic_directory,
    atomic_write,
    atomic_write_json,
    atomic_write_text,
    check_directory,
    check_keys,
    counted,
    decimal,
    parse_json,
    replace_directory,
)
from secure_vfl.saved_model import find_manifest


def test_atomic_write_json_writes_readable_ordinary_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "result.json"
    atomic_write_json(target, {"b": 1, "a": [1, 2]})
    assert json.loads(target.read_text()) == {"a": [1, 2], "b": 1}
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


def test_json_results_are_json_every_reader_takes_even_with_an_infinite_epsilon(
    tmp_path: Path,
) -> None:
    target = tmp_path / "result.json"
    payload = {"epsilon": {"party-0": math.inf}, "low": -math.inf, "none": math.nan}
    atomic_write_json(target, {**payload, "curve": [0.5, math.inf], "text": "Infinity"})
    text = target.read_text()

    def refuse(constant: str) -> None:  # what a strict reader (jq, JavaScript) refuses
        raise AssertionError(f"{constant} is not JSON")

    strict = json.loads(text, parse_constant=refuse)
    assert strict["epsilon"] == {"party-0": math.inf} and strict["low"] == -math.inf
    assert strict["none"] is None and strict["curve"] == [0.5, math.inf]
    assert strict["text"] == "Infinity"  # a string is left as it is


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "result.json"
    target.write_text("old")

    def failing(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, failing)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_atomic_write_follows_a_link_and_refuses_what_is_not_a_regular_file(
    tmp_path: Path,
) -> None:
    target = tmp_path / "target.csv"
    target.write_text("old")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"  # the link kept, its file replaced
    pipe = tmp_path / "pipe"  # not a device such as /dev/null: a regression would replace it
    os.mkfifo(pipe)
    with pytest.raises(OutputError, match=r"a regular file .* expected, found a named pipe"):
        atomic_write_text(pipe, "x")
    assert stat.S_ISFIFO(pipe.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.csv", "pipe", "target.csv"]


def test_a_dangling_link_is_written_as_a_live_one_but_never_makes_folders_elsewhere(
    tmp_path: Path,
) -> None:
    """A link to a file not there yet is followed as a live link is (the file it names is
    written, the link kept), but only into a folder that exists: the user's path implies no
    folder where the link points, and writing made the link's whole target tree."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(elsewhere / "result.json")
    atomic_write_text(link, "new")
    assert link.is_symlink() and (elsewhere / "result.json").read_text() == "new"
    far = tmp_path / "far.json"
    far.symlink_to(tmp_path / "nowhere" / "deep" / "result.json")
    with pytest.raises(
        OutputError,
        match=r"far\.json: a link to a file in a folder that is there .* found a "
        r"symbolic link to .*nowhere/deep/result\.json, whose folder .* does not exist; nothing",
    ):
        atomic_write_text(far, "x")
    assert far.is_symlink() and not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "far.json", "link.json"]


def test_a_link_loop_is_an_output_error_not_a_runtime_error(tmp_path: Path) -> None:
    """Python 3.11 resolves a link loop to RuntimeError, which reached the user raw."""
    (tmp_path / "a.json").symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(tmp_path / "a.json")
    with pytest.raises(OutputError, match=r"a\.json cannot be written: .*loop.*nothing was"):
        atomic_write_text(tmp_path / "a.json", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]


def test_a_path_that_cannot_be_written_is_an_output_error_that_leaves_nothing(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match=f"its folder .* cannot be made \\({blocker} is not"):
        atomic_write_text(blocker / "sub" / "result.json", "{}")
    with pytest.raises(OutputError, match="File name too long; nothing was written"):
        atomic_write_text(tmp_path / ("a" * 300), "{}")
    with pytest.raises(OutputError, match="cannot be made"):
        atomic_directory(blocker / "step-1", lambda directory: None)

    def failing(tmp: Path) -> None:  # the disk fills up mid-write
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputError, match="No space left on device; nothing was written"):
        atomic_write(tmp_path / "result.json", failing)
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_check_directory_takes_what_exists_or_can_be_made_and_says_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "there").mkdir()
    for given in (tmp_path / "there", tmp_path / "new" / "deeper"):
        check_directory("--out", given)
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    with pytest.raises(ConfigError, match=f"--out {re.escape(str(a_file))} is a file; a dir"):
        check_directory("--out", a_file)
    under = a_file / "run" / "deeper"
    with pytest.raises(ConfigError, match=f"lies under {re.escape(str(a_file))}, a file;"):
        check_directory("--out", under)
    # A folder this user may not write in (root may write anywhere: the check is os.access).
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path / "there")
    check_directory("--out", tmp_path / "new")
    with pytest.raises(ConfigError, match=r"may write in expected; .* is not writable \(it would"):
        check_directory("--out", tmp_path / "there" / "run")
    with pytest.raises(ConfigError, match=r"is not writable\.$"):
        check_directory("--out", tmp_path / "there")
    assert a_file.read_text() == "mine" and not (tmp_path / "new").exists()


def test_check_directory_refuses_a_name_the_file_system_cannot_take(tmp_path: Path) -> None:
    """A name of 300 characters ended the command with exit 1 and the whole name echoed."""
    with pytest.raises(ConfigError, match=r"\.\.\. \(\d+ characters\): a path this system can use"):
        check_directory("--out", tmp_path / ("a" * 300))


def test_atomic_directory_is_whole_under_its_name_or_absent(tmp_path: Path) -> None:
    target = tmp_path / "checkpoints" / "step-00000010"

    def failing(directory: Path) -> None:
        (directory / "state.json").write_text("{}")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_directory(target, failing)
    assert not target.exists() and list(target.parent.iterdir()) == []

    def whole(directory: Path) -> None:
        (directory / "state.json").write_text("{}")
        (directory / "tensors.safetensors").write_bytes(b"\0" * 10)

    atomic_directory(target, whole)
    assert sorted(p.name for p in target.iterdir()) == ["state.json", "tensors.safetensors"]
    assert [p.name for p in target.parent.iterdir()] == ["step-00000010"]


def test_replace_directory_keeps_none_of_the_old_files_and_the_old_one_on_failure(
    tmp_path: Path,
) -> None:
    target = tmp_path / "model"

    def old(directory: Path) -> None:
        (directory / "manifest.json").write_text("old")
        (directory / "party-2").mkdir()
        (directory / "party-2" / "part.bin").write_text("old")

    replace_directory(target, old)  # nothing there yet
    with pytest.raises(RuntimeError, match="killed"):
        replace_directory(target, lambda directory: (_ for _ in ()).throw(RuntimeError("killed")))
    assert (target / "party-2" / "part.bin").read_text() == "old"  # untouched by the failure
    replace_directory(target, lambda directory: (directory / "manifest.json").write_text("new"))
    assert [p.name for p in target.iterdir()] == ["manifest.json"]
    assert (target / "manifest.json").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staged or old copy left


KILLED_SAVE = """
import os, shutil, signal, sys
from pathlib import Path
from secure_vfl.io import replace_directory
renames, real = [0], os.rename
def rename(source, target):
    renames[0] += 1
    if renames[0] == 2 and sys.argv[2] == "between":  # no handler runs
        os.kill(os.getpid(), signal.SIGKILL)
    real(source, target)
def rmtree(path, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
os.rename = rename
if sys.argv[2] == "after":
    shutil.rmtree = rmtree
replace_directory(Path(sys.argv[1]), lambda d: (d / "manifest.json").write_text("second"))
"""


@pytest.mark.parametrize("killed", ["between", "after"])
def test_a_save_killed_between_or_after_its_renames_is_finished_by_the_next(
    tmp_path: Path, killed: str
) -> None:
    """SIGKILL between the renames (the old model moved aside, the new one not yet in) left
    nothing at the path and the old model hidden beside it for good; after them, the old one
    stayed beside the new. The next save puts the old one back first, or removes it, and the
    staged new one; a reader is told where the old one is."""
    target = tmp_path / "model"
    replace_directory(target, lambda d: (d / "manifest.json").write_text("first"))
    run = [sys.executable, "-c", KILLED_SAVE, str(target), killed]
    assert subprocess.run(run, timeout=120, check=False).returncode == -signal.SIGKILL
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "model")
    old = left[-1]
    assert re.fullmatch(r"\.model\.\d+-\w+\.old", old), left
    if killed == "between":
        assert not target.exists() and len(left) == 2  # and the staged new one
        with pytest.raises(DataError, match=f"at {re.escape(str(tmp_path / old))}: the next"):
            find_manifest(target)
    else:
        assert (target / "manifest.json").read_text() == "second" and len(left) == 1
    with pytest.raises(RuntimeError, match="refused"):  # a save that fails still finishes it
        replace_directory(target, lambda d: (_ for _ in ()).throw(RuntimeError("refused")))
    expected = "first" if killed == "between" else "second"
    assert (target / "manifest.json").read_text() == expected
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.fixture
def live_pid() -> Iterator[int]:
    """The id of another process that runs while the test does (a writer still writing)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_live_writers_staged_directories_are_left_alone(tmp_path: Path, live_pid: int) -> None:
    """And a name of this process's own id is an earlier process's (a container's entry point
    is process 1 every time): it was kept for good, since that process seemed to run."""
    target = tmp_path / "model"
    replace_directory(target, lambda d: (d / "manifest.json").write_text("first"))
    live = tmp_path / f".model.{live_pid}-abcdefgh.new"
    dead = tmp_path / ".model.999999999-abcdefgh.tmp"
    earlier = tmp_path / f".model.{os.getpid()}-abcdefgh.old"  # model is there: its new got in
    for path in (live, dead, earlier):
        path.mkdir()
    replace_directory(target, lambda d: (d / "manifest.json").write_text("second"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "model"]


def test_a_target_that_was_a_link_is_put_back_as_the_link(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "manifest.json").write_text("first")
    old = tmp_path / ".model.999999999-abcdefgh.old"  # killed between the renames
    old.symlink_to("elsewhere")
    assert f"at {old}: the next" in _no_model(tmp_path / "model")
    with pytest.raises(RuntimeError, match="refused"):
        replace_directory(
            tmp_path / "model", lambda d: (_ for _ in ()).throw(RuntimeError("refused"))
        )
    assert os.readlink(tmp_path / "model") == "elsewhere"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "model"]


def _no_model(path: Path) -> str:
    with pytest.raises(DataError) as refused:
        find_manifest(path)
    return str(refused.value)


def test_atomic_write_syncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import secure_vfl.io

    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        kind = "directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(f"fsync {kind}")
        real_fsync(fd)

    def replace(source: str | Path, target: str | Path) -> None:
        events.append("rename")
        real_replace(source, target)

    monkeypatch.setattr(secure_vfl.io.os, "fsync", fsync)
    monkeypatch.setattr(secure_vfl.io.os, "replace", replace)
    atomic_write_json(tmp_path / "result.json", {"a": 1})
    assert events == ["fsync file", "rename", "fsync directory"]
    assert json.loads((tmp_path / "result.json").read_text()) == {"a": 1}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (b'{"a": 1', "Expecting"),
        (b"\xff{}", "codec can't decode"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
        # Python keeps the last, another reader the first: two documents in one.
        (b'{"run": "a", "files": {}, "run": "b"}', "the name 'run' given twice in one object"),
        (b'[{"x": {"k": 1, "k": 1}}]', "the name 'k' given twice"),
        # Python's int() reads at most 4300 digits and raises a ValueError of its own.
        (b'{"version": ' + b"9" * 5000 + b"}", "a number of more than 4300 digits"),
    ],
)
def test_parse_json_refuses_what_is_not_json_with_the_error_asked_for(
    text: str | bytes, reason: str
) -> None:
    with pytest.raises(DataError, match=rf"^where: JSON expected \(.*{reason}"):
        parse_json(text, "where")
    with pytest.raises(ProtocolError, match=r"^where: JSON expected"):
        parse_json(text, "where", error=ProtocolError)


def test_parse_json_reads_text_and_utf8_bytes() -> None:
    assert parse_json('{"é": [1, 2.5, null]}', "w") == {"é": [1, 2.5, None]}
    assert parse_json('{"é": true}'.encode(), "w") == {"é": True}


def test_check_keys_wants_each_key_of_its_type_and_a_bool_only_where_asked() -> None:
    types: dict[str, type | tuple[type, ...]] = {"n": int, "x": float, "note": (str, type(None))}

    def refuse(wrong: str) -> ProtocolError:
        return ProtocolError(wrong)

    good = {"n": 3, "x": 0.5, "note": None}
    assert check_keys(good, types, refuse=refuse) is good
    cases = [
        ({**good, "n": True}, "`n` of type int expected, found bool true"),
        ({**good, "x": False}, "`x` of type float expected, found bool false"),
        ({**good, "note": 1}, "`note` of type str or null expected, found int 1"),
        ({"n": 3}, "keys ['n', 'note', 'x'] expected, found ['n']"),
        ([1], "keys ['n', 'note', 'x'] expected, found list"),
    ]
    for body, message in cases:
        with pytest.raises(ProtocolError, match=re.escape(message)):
            check_keys(body, types, refuse=refuse)
    # Not exact: absent keys are the reader's to refuse; present ones are still checked.
    assert check_keys({"n": 3, "other": []}, types, refuse=refuse, exact=False) == {
        "n": 3,
        "other": [],
    }
    with pytest.raises(ProtocolError, match="`n` of type int expected"):
        check_keys({"n": "3"}, types, refuse=refuse, exact=False)


def test_decimal_reads_ascii_digits_only_and_only_as_many_as_asked() -> None:
    assert decimal("0") == 0
    assert decimal("123456789012345678") == 123456789012345678
    assert decimal("65535", digits=5) == 65535
    # str.isdigit takes each of these; int refuses the first two, the rest are not decimals.
    for text in ("\u00b2", "9" * 5000, "1234567890123456789", "123456", "", "-1", " 1", "1.0"):
        assert decimal(text, digits=5 if text == "123456" else 18) is None, text


def test_a_killed_writes_temporary_file_goes_with_the_next_write_of_its_file(
    tmp_path: Path, live_pid: int
) -> None:
    """SIGKILL while writing left ``.result.json.XXXX.tmp`` for good (its name said nothing of
    its writer); now the next write of the file removes a dead writer's, not a live one's."""
    dead = tmp_path / ".result.json.999999999-abcdefgh.tmp"
    older = tmp_path / ".result.json.abcd1234.tmp"  # named before writers gave their id
    live = tmp_path / f".result.json.{live_pid}-abcdefgh.tmp"
    other = tmp_path / ".other.json.999999999-abcdefgh.tmp"
    longer = tmp_path / ".result.json.bak.999999999-abcdefgh.tmp"  # result.json.bak's
    mine = tmp_path / ".result.json.12-notes.tmp"  # a user's file, not a temporary's name
    for path in (dead, older, live, other, longer, mine):
        path.write_text("{")
    atomic_write_json(tmp_path / "result.json", {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, other.name, longer.name, mine.name, "result.json"]
    )


def test_a_write_that_must_not_replace_keeps_a_file_written_meanwhile(tmp_path: Path) -> None:
    # Two commands checked that `out.csv` was free; the first wrote it, then the second
    # finished: without --overwrite the second's table must not replace the first's.
    path = tmp_path / "out.csv"

    def write(tmp: Path) -> None:
        path.write_text("the other command's table\n")  # lands between the check and the link
        tmp.write_text("this command's table\n")

    with pytest.raises(ConfigError, match=r"out\.csv exists \(written since this command"):
        atomic_write(path, write, replace=False)
    assert path.read_text() == "the other command's table\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]  # no temporary left
    atomic_write(tmp_path / "new.csv", lambda tmp: tmp.write_text("x\n"), replace=False)
    assert (tmp_path / "new.csv").read_text() == "x\n"
    atomic_write(path, lambda tmp: tmp.write_text("replaced\n"))  # the default replaces
    assert path.read_text() == "replaced\n"


def test_counted_says_one_noun_and_every_other_count_in_the_plural() -> None:
    """A --quick run's reports said "1 epochs", "1 repeats" and "1 rounds"."""
    assert counted(1, "epoch") == "1 epoch"
    assert [counted(n, "repeat") for n in (0, 2, 10)] == ["0 repeats", "2 repeats", "10 repeats"]
    assert counted(1, "party", "parties") == "1 party"
    assert counted(3, "party", "parties") == "3 parties"
