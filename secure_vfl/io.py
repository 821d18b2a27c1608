"""Atomic file writes (results and checkpoints are either whole or absent, never half-written)
and reading JSON that another party or a file on disk holds."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import math
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from secure_vfl.errors import ConfigError, DataError, OutputError, SecureVFLError


def atomic_write(
    path: Path,
    write: Callable[[Path], None],
    *,
    mode: int | None = None,
    replace: bool = True,
) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it and rename it into
    place (then fsync the directory): ``path`` holds the old content or the whole new one, even
    if the machine loses power in between.

    The file gets ``mode`` (a private key: 0o600, which it has from its creation on, so it is
    never readable by others), or by default that of an ordinary file under the umask. A
    symbolic link is followed (the file it names is replaced or, not there yet, made; the link
    kept), but no folder is made where it points (:func:`writable_file`); anything else that is
    not a regular file (a device, a pipe, a directory) is refused, as is a path that cannot be
    written (OutputError). ``replace=False``: a file at ``path`` is kept, even one
    another process wrote after the caller checked there was none (ConfigError); the new file
    is linked into place, which fails where one is there (on a file system without hard
    links it is renamed, and that last check is lost)."""
    target = writable_file(path)
    if target == path:  # a link's file goes in a folder that is there (writable_file)
        make_parent(path)
    path = target
    for stale in left_beside(path, ".tmp", directories=False):  # a killed write's
        stale.unlink(missing_ok=True)
    try:
        fd, tmp_name = tempfile.mkstemp(
            prefix=temporary_prefix(path), suffix=".tmp", dir=path.parent
        )
    except OSError as error:
        raise unwritable(path, error) from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask  # mkstemp creates 0600; results are ordinary files
        tmp.chmod(mode)
        _fsync(tmp, os.O_RDONLY)
        if replace:
            os.replace(tmp, path)
        else:
            _link_into_place(tmp, path)
        fsync_directory(path.parent)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise unwritable(path, error) from error
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _link_into_place(tmp: Path, path: Path) -> None:
    """Put ``tmp`` at ``path`` unless a file is there (ConfigError), then remove ``tmp``."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise ConfigError(
            f"{path} exists (written since this command checked it, by another one?); "
            "expected a new --out file (or --overwrite)."
        ) from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        os.replace(tmp, path)  # no hard links here
        return
    tmp.unlink()


def writable_file(path: Path) -> Path:
    """The file that writing ``path`` replaces: ``path`` itself, or the file a symbolic link at
    ``path`` names, there or not yet. OutputError if something other than a regular file is
    there (a device such as /dev/null, a pipe, a socket, a directory): replacing it would not
    write to it; or if the link names a file in a folder that is not there: the user's path
    implies no folder where a link points, and one made there would be a surprise."""
    try:
        if path.is_symlink():
            named = path.resolve()
            if not named.parent.is_dir():
                missing = "is not a folder" if named.parent.exists() else "does not exist"
                raise OutputError(
                    f"{path}: a link to a file in a folder that is there (or a new path) "
                    f"expected, found a symbolic link to {named}, whose folder {named.parent} "
                    f"{missing}; nothing was written."
                )
            path = named
        there = path.exists()
    except OSError as error:  # e.g. a name too long for the file system
        raise unwritable(path, error) from None
    except RuntimeError:  # a link loop: Python before 3.13 resolves it to RuntimeError
        raise unwritable(path, OSError(errno.ELOOP, "a loop of symbolic links")) from None
    if there and not path.is_file():
        raise OutputError(
            f"{path}: a regular file (or a new path) expected, found {file_kind(path)}; "
            "nothing was written."
        )
    return path


def file_kind(path: Path) -> str:
    """What ``path`` is, in words, where it is not a regular file (a directory, a device...)."""
    for test, kind in (
        (Path.is_dir, "a directory"),
        (Path.is_char_device, "a character device"),
        (Path.is_block_device, "a block device"),
        (Path.is_fifo, "a named pipe"),
        (Path.is_socket, "a socket"),
    ):
        if test(path):
            return kind
    return "something that is not a regular file"


def shown(value: object) -> str:
    """``repr(value)``, cut short: a file or a peer chooses the names that errors quote."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def shown_names(names: Sequence[object], limit: int = 10) -> str:
    """The first ``limit`` of ``names`` as a list, each :func:`shown`, and how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"[{', '.join(shown(name) for name in names[:limit])}]{more}"


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` and ``noun`` as a reader says them: ``1 epoch``, ``0 epochs``, ``2 epochs``
    (``plural`` where an added s does not make it: ``3 parties``)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def _shortened(text: str) -> str:
    """``text``, cut short past 120 characters (a path as long as the system refuses)."""
    return text if len(text) <= 120 else f"{text[:80]}... ({len(text)} characters)"


def check_directory(option: str, directory: Path) -> None:
    """ConfigError, before any work, unless ``directory`` (given with ``option``) is a directory
    this process may write in, or can be made as one: its nearest existing ancestor is such a
    directory. Otherwise the command would fail only when it first writes there, after its work."""
    try:
        if directory.exists():
            ancestor, made = directory, ""
        else:
            ancestor = next((p for p in directory.parents if p.exists()), Path("."))
            made = " (it would be made there)"
    except OSError as error:  # e.g. a name longer than the file system takes
        raise ConfigError(
            f"{option} {_shortened(str(directory))}: a path this system can use expected; "
            f"{error.strerror or error}."
        ) from None
    if not ancestor.is_dir():
        kind = "a file" if ancestor.is_file() else file_kind(ancestor)
        where = "is" if ancestor == directory else f"lies under {ancestor},"
        raise ConfigError(
            f"{option} {directory} {where} {kind}; a directory, or a path where one can be "
            "made, expected."
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        refusal = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(ancestor))
        raise ConfigError(
            f"{option} {directory}: a directory this user may write in expected; {ancestor} is "
            f"not writable{made}."
        ) from refusal


def make_parent(path: Path) -> None:
    """Make the folders ``path`` lies in, or say why they cannot be (OutputError)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        found = next((p for p in path.parents if p.exists()), None)
        reason = (
            f"{found} is not a folder"
            if found is not None and not found.is_dir()
            else error.strerror or type(error).__name__
        )
        raise OutputError(
            f"{path} cannot be written: its folder {path.parent} cannot be made ({reason}); "
            "nothing was written."
        ) from None


def unwritable(path: Path, error: OSError) -> OutputError:
    """The OutputError of a write to ``path`` that the system refused with ``error``."""
    reason = error.strerror or type(error).__name__
    return OutputError(f"{path} cannot be written: {reason}; nothing was written.")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""

    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    atomic_write(path, write)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict, refusing a name given twice: Python's parser keeps the
    last, another reader may keep the first, and the document would mean two things."""
    members = dict(pairs)
    if len(members) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _DuplicateKey(f"the name {name!r:.60} given twice in one object")
            seen.add(name)
    return members


def parse_json(text: str | bytes, where: str, *, error: type[SecureVFLError] = DataError) -> Any:
    """The JSON document ``text`` (str, or UTF-8 bytes), or ``error`` saying why it is not one
    at ``where``: malformed, not UTF-8, an object that names a member twice, an integer longer
    than ``int`` reads, or nested deeper than the parser goes (the last two raise ValueError and
    RecursionError, not a JSON error)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, _DuplicateKey) as problem:
        raise error(f"{where}: JSON expected ({problem}).") from None
    except ValueError:  # an integer longer than int() reads (sys.get_int_max_str_digits)
        limit = sys.get_int_max_str_digits()
        raise error(f"{where}: JSON expected (a number of more than {limit} digits).") from None
    except RecursionError:
        raise error(f"{where}: JSON expected (nested too deeply to read).") from None


def check_keys(
    body: Any,
    expected: Mapping[str, type | tuple[type, ...]],
    *,
    refuse: Callable[[str], Exception],
    exact: bool = True,
) -> dict[str, Any]:
    """``body``, checked as JSON read from another party or a file: a dict with the keys
    ``expected`` (exactly those, or with ``exact=False`` any of them, the rest left to whoever
    reads it), each of its type, a bool only where a bool is expected; else raise
    ``refuse(what is wrong)``."""
    if not isinstance(body, dict) or (exact and set(body) != set(expected)):
        found = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise refuse(f"keys {sorted(expected)} expected, found {found}")
    for key, kind in expected.items():
        if key not in body:
            continue
        value = body[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            name = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise refuse(
                f"`{key}` of type {name} expected, found {type(value).__name__} "
                f"{json.dumps(value, default=str)[:60]}"
            )
    return body


def check_document(
    payload: Any, *, schema: str, versions: Sequence[int], where: str, what: str = ""
) -> dict[str, Any]:
    """``payload``, a JSON document read from a file, once it names ``schema`` and one of the
    ``versions`` this code reads; DataError naming ``where`` (and ``what`` the document is, as
    in "manifest version 2 expected") otherwise."""
    if not isinstance(payload, dict) or payload.get("schema") != schema:
        raise DataError(f"{where}: a {schema!r} document expected.")
    if payload.get("version") not in versions:
        read = "it" if len(versions) == 1 else "those"
        raise DataError(
            f"{where}: {what + ' ' if what else ''}version {' or '.join(map(str, versions))} "
            f"expected (this secure-vfl reads only {read}), found {payload.get('version')!r}."
        )
    return payload


def decimal(text: str, digits: int = 18) -> int | None:
    """The number ``text`` writes in ASCII decimal digits, at most ``digits`` of them; None for
    anything else (``str.isdigit`` also takes digits ``int`` refuses, such as '²', and ``int``
    refuses more than 4300 digits: a peer's metadata or a file may hold either)."""
    if 0 < len(text) <= digits and text.isascii() and text.isdigit():
        return int(text)
    return None


# A number as a person types one: ASCII digits, a sign, a point, an exponent, or inf/nan (which
# the callers' range checks refuse where they must). Python's float() and int() also take '1_0'
# (10) and other scripts' digits, which read here as a mistake, not as a number.
_FLOAT_TEXT = re.compile(
    r"\s*[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan)\s*",
    re.IGNORECASE,
)
_INT_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")


def plain_number(text: str) -> float:
    """The float ``text`` writes in plain decimal (``1.5``, ``-2e-3``, ``inf``); ValueError for
    anything else, as ``float`` raises, so a caller can take it in ``float``'s place."""
    if not _FLOAT_TEXT.fullmatch(text):
        raise ValueError(f"not a plain decimal number: {text!r}")
    return float(text)


def plain_integer(text: str) -> int:
    """The int ``text`` writes in ASCII decimal digits, with a sign; ValueError for anything
    else (``int`` takes ``1_000`` and other scripts' digits), as ``int`` raises."""
    if len(text) > 4000 or not _INT_TEXT.fullmatch(text):
        raise ValueError(f"not a plain decimal integer: {text[:40]!r}")
    return int(text)


def atomic_write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON to ``path`` atomically (:func:`json_text`)."""
    atomic_write_text(path, json_text(payload) + "\n")


def json_text(payload: Any) -> str:
    """``payload`` as indented JSON that every JSON reader takes. Python's ``json`` writes an
    infinite float as ``Infinity``, which is not JSON (jq, JavaScript and most others refuse
    the file); here it is the number ``1e999`` (``-1e999``), which JSON allows and which Python
    and JavaScript read back as infinity (an epsilon of a run without noise). NaN, which JSON
    cannot write, is ``null``."""
    marker = f"non-finite-{uuid.uuid4().hex}"

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None if math.isnan(value) else f"{marker}{'+' if value > 0 else '-'}"
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [finite(item) for item in value]
        return value

    text = json.dumps(finite(payload), indent=2, sort_keys=True, allow_nan=False)
    return text.replace(f'"{marker}+"', "1e999").replace(f'"{marker}-"', "-1e999")


def temporary_prefix(path: Path) -> str:
    """The start of the name of a file or directory staged beside ``path``: hidden, and with this
    process's id, so that a later write can tell one a killed process left (no handler ran to
    remove it) from one another process is writing (:func:`writer_alive`)."""
    return f".{path.name}.{os.getpid()}-"


def writer_alive(name: str) -> bool:
    """Whether the process whose id a staged name carries (``.NAME.PID-XXXXXXXX.tmp``, ``.new``,
    ``.old``) still runs; False for a name with no id (staged by an older version), and for
    this process's own id: a process writes one path once at a time, and a name of its id
    that is there before it writes was left by an earlier process of the same id (a
    container's entry point is process 1 every time)."""
    found = re.search(r"\.(\d+)-[a-z0-9_]{8}\.(?:tmp|new|old)$", name)
    if found is None or int(found.group(1)) == os.getpid():
        return False
    try:
        os.kill(int(found.group(1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process runs under that id
        return True
    return True


def left_beside(
    path: Path, suffix: str, *, directories: bool = True, links: bool = False
) -> list[Path]:
    """The directories (or with ``directories=False`` the files) staged for ``path`` itself
    (``.NAME.PID-XXXXXXXX`` + ``suffix``, or the names of before writers gave their id; not
    those of ``NAME.more``) that a write of it killed before its end left (no live writer's:
    :func:`writer_alive`), in name order; with ``links``, symbolic links to directories too
    (``path`` was one, moved aside)."""
    kind = Path.is_dir if directories else Path.is_file
    stamp = r"(?:\d+-[a-z0-9_]{8}|[a-z0-9_]{8}|[0-9a-f]{32})"  # mkstemp's; uuid4's before
    own = re.compile(rf"\.{re.escape(path.name)}\.{stamp}{re.escape(suffix)}")
    try:
        found = path.parent.glob(f".{glob.escape(path.name)}.*{suffix}")
        return sorted(
            p
            for p in found
            if own.fullmatch(p.name)
            and kind(p)
            and (links or not p.is_symlink())
            and not writer_alive(p.name)
        )
    except OSError:  # a folder this user may not list: nothing of its own there to finish
        return []


def finish_interrupted(path: Path) -> None:
    """Finish what a write of ``path`` killed before its end left beside it (SIGKILL, a power
    cut: no handler ran), before ``path`` is written again: killed between
    :func:`replace_directory`'s two renames, the old directory (``.NAME.*.old``) goes back to
    ``path``, where nothing is; an old one whose new one got in is removed, and so are staged
    directories (``.new``, ``.tmp``)."""
    for old in left_beside(path, ".old", links=True):  # path may have been a link
        if not (path.exists() or path.is_symlink()):
            os.rename(old, path)
        elif old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old)
    for staged in [*left_beside(path, ".new"), *left_beside(path, ".tmp")]:
        shutil.rmtree(staged)


def _staged(path: Path, write: Callable[[Path], None], suffix: str) -> Path:
    """A fresh directory beside ``path`` (``.NAME.PID-XXXX`` + ``suffix``) that ``write`` filled,
    with every file in it and itself fsynced; removed again if anything fails."""
    make_parent(path)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=temporary_prefix(path), suffix=suffix, dir=path.parent))
    except OSError as error:
        raise unwritable(path, error) from None
    with _removed_on_failure(tmp, path):
        write(tmp)
        for child in tmp.iterdir():
            _fsync(child, os.O_RDONLY)
        _fsync(tmp, os.O_RDONLY | os.O_DIRECTORY)
    return tmp


@contextmanager
def _removed_on_failure(tmp: Path, path: Path) -> Iterator[None]:
    """Remove the directory ``tmp`` staged for ``path`` where the block fails (an OSError
    raised as OutputError naming ``path``)."""
    try:
        yield
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise unwritable(path, error) from error
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_directory(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a fresh directory beside ``path``, fsync every file in it and the
    directory, and rename it to ``path`` (which must not exist): a checkpoint is either whole
    under its name or absent, even if the machine loses power in between."""
    tmp = _staged(path, write, ".tmp")
    with _removed_on_failure(tmp, path):
        os.rename(tmp, path)
        fsync_directory(path.parent)


def replace_directory(path: Path, write: Callable[[Path], None]) -> None:
    """As :func:`atomic_directory`, but ``path`` may hold an older directory: the new one is
    written whole beside it, swapped in, and the old one removed, so that no file of the old
    one survives beside the new (a model saved over another). A kill between the two renames
    leaves the old directory beside ``path`` under a hidden name (``.NAME.PID-XXXX.old``) and
    nothing at ``path``; the next write of ``path`` puts it back first
    (:func:`finish_interrupted`)."""
    finish_interrupted(path)
    if not (path.exists() or path.is_symlink()):
        atomic_directory(path, write)
        return
    staged = _staged(path, write, ".new")
    old = staged.with_name(staged.name.removesuffix(".new") + ".old")
    try:
        os.rename(path, old)
    except OSError as error:
        shutil.rmtree(staged, ignore_errors=True)
        raise unwritable(path, error) from error
    try:
        os.rename(staged, path)
    except BaseException:
        os.rename(old, path)
        shutil.rmtree(staged, ignore_errors=True)
        raise
    fsync_directory(path.parent)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def remove_directory(path: Path) -> None:
    """Remove the directory ``path`` so that it is whole or gone, never half there: renamed
    aside first, to a hidden ``.NAME.PID-XXXXXXXX.tmp`` that :func:`finish_interrupted`
    removes should a kill stop the removal, then removed."""
    aside = path.with_name(f"{temporary_prefix(path)}{secrets.token_hex(4)}.tmp")
    try:
        os.rename(path, aside)
        fsync_directory(path.parent)
        shutil.rmtree(aside)
    except OSError as error:
        raise unwritable(path, error) from error


LOCK_FILE = ".secure-vfl.lock"
"""The file in an output directory whose lock (``flock``) the command writing there holds."""


def lock_directory(directory: Path, option: str) -> Callable[[], None]:
    """Take the lock of ``directory`` (made if it is missing) for this process: an exclusive
    ``flock`` on its :data:`LOCK_FILE`, which the system drops when the process ends, however
    it ends. Returns the function that releases it and removes the file. ConfigError, naming
    the holder, when another command holds it: two runs writing one ``--out`` at once would
    each replace the other's files, and the later one would win unasked (neither found a
    finished run there when it started)."""
    import fcntl

    path = directory / LOCK_FILE
    make_parent(path)
    for _ in range(8):  # the holder may remove the file between our open and our lock
        try:  # never through a link: it would truncate the file the link names
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as error:
            if error.errno == errno.ELOOP:
                error = OSError(errno.ELOOP, "a symbolic link, where a lock file of its own is")
            raise unwritable(path, error) from None
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
            os.close(fd)
            kind = "a hard link of another file" if stat.S_ISREG(found.st_mode) else file_kind(path)
            raise OutputError(
                f"{path}: a lock file of its own expected (a plain file, one name); found "
                f"{kind}. Remove it, or choose another {option}."
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f"process {holder}" if holder.isdigit() else "another process"
            raise ConfigError(
                f"{option} {directory}: a folder no other command writes in expected; "
                f"{who} is writing there (it holds {path}). Wait for it to finish, or choose "
                f"another {option}."
            ) from None
        except OSError as error:
            os.close(fd)
            raise unwritable(path, error) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # we locked a file its last holder had removed: take the one there now
    else:
        raise OutputError(f"{path}: its lock could not be taken (it was replaced 8 times).")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release() -> None:
        with contextlib.suppress(OSError):  # then the empty file stays; the lock goes anyway
            path.unlink(missing_ok=True)  # while held: one that locks it after finds it gone
        os.close(fd)

    return release


def fsync_directory(path: Path) -> None:
    """Make the renames in the directory ``path`` durable."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
