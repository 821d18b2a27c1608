"""The library's errors survive pickling (an error raised in a worker process of a sweep or a
Ray task reaches the caller pickled): each comes back of its class, with its text and the
party it names."""

from __future__ import annotations

import inspect
import pickle

import pytest

from secure_vfl import errors


def _made(cls: type[Exception]) -> Exception:
    """An instance of ``cls`` with every argument its constructor takes."""
    if cls is errors.NotSetUpError:
        return cls("shop", "shop was never set up for this run")
    if cls is errors.TransportError:
        return cls("telco could not be reached", "telco")
    return cls("something went wrong")


ERRORS = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, Exception) and cls.__module__ == errors.__name__
]


@pytest.mark.parametrize("cls", ERRORS, ids=[cls.__name__ for cls in ERRORS])
def test_every_error_comes_back_from_pickling_as_it_was(cls: type[Exception]) -> None:
    error = _made(cls)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error)
    assert getattr(back, "party", None) == getattr(error, "party", None)


def test_the_errors_that_name_a_party_are_among_those_checked() -> None:
    names = {cls.__name__ for cls in ERRORS}
    assert {"NotSetUpError", "TransportError", "VersionError", "ProtocolError"} <= names
