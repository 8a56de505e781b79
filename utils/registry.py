"""A name -> entry table with a registering decorator and a lookup that names the known choices."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

from utils.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one kind (`kind` names it in error messages), keyed by name."""

    def __init__(self, kind: str):
        self.kind = kind
        self.entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Register `entry` under `name`; a name is registered once (a second one is a programming error)."""
        if name in self.entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self.entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`: `@registry.register("name")`."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> T:
        if name not in self.entries:
            raise UserError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        return self.entries[name]

    def names(self) -> list[str]:
        return sorted(self.entries)
