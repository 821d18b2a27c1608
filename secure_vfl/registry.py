"""Guarded name -> object registries for the pluggable parts (datasets, methods, backends)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from secure_vfl.errors import RegistryError

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to entries where registering a name twice is an error."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; raise :class:`RegistryError` if the name is taken."""
        if name in self._entries:
            raise RegistryError(f"{self._kind} {name!r} is already registered.")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        """Return the entry for ``name``; the error lists the known names."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            raise RegistryError(
                f"unknown {self._kind} {name!r}; expected one of: {known}."
            ) from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
