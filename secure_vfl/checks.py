"""Checks of the values a library user puts in a configuration object: the type and the range,
each refusal a ConfigError that names the field, what was expected and what was found.

Numbers of numpy's types are taken (a grid from ``np.arange`` is common) and stored as Python's
own, so that a configuration always writes as JSON; a bool is never taken for a number, nor a
number or a string for a bool.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np

from secure_vfl.errors import ConfigError


def _found(value: object) -> str:
    return repr(value) if isinstance(value, str | Real) else type(value).__name__


def integer(name: str, value: object, *, low: int | None = None) -> int:
    """``value`` as an int, if it is an integer (not a bool) of at least ``low``."""
    expected = (
        "an integer"
        if low is None
        else "a positive integer"
        if low == 1
        else f"an integer >= {low}"
    )
    if isinstance(value, bool | np.bool_) or not isinstance(value, Integral):
        raise ConfigError(f"`{name}` must be {expected}. Found {_found(value)}.")
    number = int(value)
    if low is not None and number < low:
        raise ConfigError(f"`{name}` must be {expected}. Found {number}.")
    return number


FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest float32: what a setting the models compute with in float32 (a learning rate, a
weight decay) may be at most; torch refuses a larger one mid-step."""
SEED_LIMIT = 2**32  # what every generator takes, and well inside a results store's integers


def seed(name: str, value: object) -> int:
    """``value`` as an int, if it is an integer seed in [0, 2**32) (the command line's range)."""
    number = integer(name, value, low=0)
    if number >= SEED_LIMIT:
        raise ConfigError(f"`{name}` must be an integer seed in [0, 2**32). Found {number}.")
    return number


def real(
    name: str,
    value: object,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a float, if it is a finite real number (not a bool) in the interval from
    ``low`` to ``high`` (each end closed unless said open)."""
    unbounded = high in (math.inf, FLOAT32_MAX)  # a float32 cap is named after the rest
    if unbounded and low == -math.inf:
        expected = "a finite number"
    elif unbounded and low == 0 and low_open:
        expected = "a positive number"
    elif unbounded:
        expected = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        opens, closes = "(" if low_open else "[", ")" if high_open else "]"
        expected = f"in {opens}{low:g}, {high:g}{closes}"
    if high == FLOAT32_MAX:
        expected += f", at most {FLOAT32_MAX:.6g} (float32's largest)"
    if isinstance(value, bool | np.bool_) or not isinstance(value, Real):
        raise ConfigError(f"`{name}` must be {expected}. Found {_found(value)}.")
    number = float(value)
    inside = (number > low if low_open else number >= low) and (
        number < high if high_open else number <= high
    )
    if not (math.isfinite(number) and inside):
        raise ConfigError(f"`{name}` must be {expected}. Found {number}.")
    return number


def flag(name: str, value: object) -> bool:
    """``value``, if it is a bool."""
    if not isinstance(value, bool | np.bool_):
        raise ConfigError(f"`{name}` must be True or False. Found {_found(value)}.")
    return bool(value)


def text(name: str, value: object, allowed: Sequence[str] | None = None) -> str:
    """``value``, if it is a str (one of ``allowed`` when given)."""
    if not isinstance(value, str) or (allowed is not None and value not in allowed):
        expected = "a str" if allowed is None else f"one of {', '.join(allowed)}"
        raise ConfigError(f"`{name}` must be {expected}. Found {_found(value)}.")
    return value


def texts(name: str, value: object) -> tuple[str, ...]:
    """``value`` as a tuple, if it is a tuple or list of str (a lone str is refused: it would
    be read as its characters)."""
    if not isinstance(value, tuple | list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"`{name}` must be a tuple of str. Found {_found(value)}.")
    return tuple(value)


def path(name: str, value: object) -> Path:
    """``value`` as a Path, if it is a str or a Path."""
    if not isinstance(value, str | Path):
        raise ConfigError(f"`{name}` must be a path (str or Path). Found {type(value).__name__}.")
    return Path(value)


def paths(name: str, value: object) -> tuple[Path, ...]:
    """``value`` as a tuple of Paths, if it is a tuple or list of str or Path."""
    if not isinstance(value, tuple | list):
        raise ConfigError(f"`{name}` must be a tuple of paths. Found {type(value).__name__}.")
    return tuple(path(name, item) for item in value)


def instance(name: str, value: object, cls: type, hint: str = "") -> Any:
    """``value``, if it is a ``cls`` (``hint``: how to make one)."""
    if not isinstance(value, cls):
        article = "an" if cls.__name__[:1] in "AEIOU" else "a"
        raise ConfigError(
            f"`{name}` must be {article} {cls.__name__}{hint}. Found {type(value).__name__}."
        )
    return value


def store(config: object, values: Mapping[str, object]) -> None:
    """Put the checked ``values`` into the frozen dataclass ``config`` by field name: Python's
    own types in place of numpy's, so that the configuration writes as JSON."""
    for name, value in values.items():
        object.__setattr__(config, name, value)
