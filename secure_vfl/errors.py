"""The exception hierarchy of secure-vfl.

Every error a user can act on derives from :class:`SecureVFLError`, and its message says what was
expected and what was found (``"`p_miss` must be in [0, 1). Found 1.5."``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


class SecureVFLError(Exception):
    """Base class of every error raised on purpose by secure-vfl."""


class ConfigError(SecureVFLError, ValueError):
    """A configuration value or command-line flag is out of range or of the wrong kind."""


class DataError(SecureVFLError, ValueError):
    """A dataset, data file or array does not have the expected format, shape or content."""


class DatasetNotInstalledError(DataError):
    """A registered dataset's files are missing here; the message says how to install them."""


class OutputError(SecureVFLError):
    """A result, model, checkpoint or capture cannot be written where it was asked to go (the
    path, its permissions, the disk); what was being written is left unwritten."""


class ProtocolError(SecureVFLError):
    """A message breaks the protocol: wrong schema, sender, batch, shape or dtype."""


class TransportError(ProtocolError):
    """A message did not get through in time: its receiver could not be reached (after bounded
    retries) or did not act on it before the deadline, or nothing arrived that a party waited
    for. Unlike a refusal, the peer may simply be gone (a crashed or partitioned party).
    ``party`` names the peer where the error reports it lost: not reachable at all (nothing
    listens at its address), or found so after the failure; not one that is merely late or
    refuses this party's certificate, which may still be running. What reports the failure
    then need not warn of that party again."""

    def __init__(self, message: str, party: str | None = None) -> None:
        super().__init__(message)
        self.party = party


class VersionError(ProtocolError):
    """Bytes of another version of the wire format or of a message kind's schema: written by
    another release of secure-vfl (a party not upgraded with the others, an older capture)."""


class NotSetUpError(ProtocolError):
    """A party was sent a message of a run that never set it up: in a deployment, its process
    was restarted (by its operator or a supervisor) before the label party noticed the crash,
    and what the run had given the party died with the process it replaced. ``party`` names
    that party. Its sender takes it for a lost party (which may rejoin, as a restarted one
    does), not the message for a broken protocol."""

    def __init__(self, party: str, message: str) -> None:
        super().__init__(message)
        self.party = party

    def __reduce__(self) -> tuple[type[NotSetUpError], tuple[str, str]]:
        # Rebuilt from (party, message): the default passes the message alone, which the
        # constructor refuses (an error carried from a worker process could not be read back).
        return type(self), (self.party, str(self))


class IntegrityError(ProtocolError):
    """A message's content is corrupt: non-finite values, a tampered or replayed payload."""


class _AtStep(IntegrityError):
    """An error of a training step: ``step`` is its number where the raiser knows it (None at
    prediction, or where no step is known), for a caller to report without reading the
    message (a sweep's table says at which step a setting diverged)."""

    def __init__(self, message: str, *, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class NonFiniteError(_AtStep):
    """A message holds NaN or infinite values where values must be finite: in training, the sign
    that it diverged (:func:`~secure_vfl.experiment.run_training` says so, and what to try)."""


class OutOfRangeError(ProtocolError):
    """A value a party was about to seal into a secure sum is outside what the sum's encoding
    holds, or not finite: ``found`` says what it was and ``limit`` what the encoding holds, so
    that the sealing party can report its own values' divergence in its own words."""

    def __init__(self, message: str, found: str = "", limit: str = "") -> None:
        super().__init__(message)
        self.found, self.limit = found, limit


class DivergenceError(_AtStep):
    """Training diverged: a value a party was about to send or seal (a representation, a
    gradient) is non-finite, or beyond the range the run's secure sums were sized for. The
    message says at which step (``step``, where known), which party, and what to try."""


class RegistryError(SecureVFLError, KeyError):
    """A name is registered twice, or looked up and not found."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RunWarning(UserWarning):
    """A run goes on, but its result deserves a look: data that cannot be split as asked, a
    model whose predictions collapsed to one class. The CLI prints each one and lists it in
    ``result.json``'s ``warnings``."""


@contextmanager
def run_warnings() -> Iterator[list[str]]:
    """Collect the :class:`RunWarning` messages raised inside, each time it is raised, into the
    list yielded; other warnings are shown as usual when the block ends."""
    noted: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RunWarning)
        yield noted
    for warning in caught:
        if issubclass(warning.category, RunWarning):
            noted.append(str(warning.message))
        else:
            warnings.showwarning(
                warning.message, warning.category, warning.filename, warning.lineno
            )
