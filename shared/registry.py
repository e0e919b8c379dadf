"""A small generic name -> class registry (policies, predictors, transports)."""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised for a name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Maps names to classes; ``register(name)`` is a class decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name in self._items and self._items[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = cls
            cls.registry_name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def get(self, name: str) -> type[T]:
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(sorted(self._items)) or "(none)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
