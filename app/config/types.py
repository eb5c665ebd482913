"""The building blocks of every config section: strict value types and one section decorator.

A section is a frozen pydantic dataclass that refuses unknown keys. Its values are checked, never
converted: an integer key refuses 1.5, "2" and true; a number key takes an integer (30 is 30.0)
but not a string; a boolean key takes true or false only. Enums take their value ("cuda"), lists
become tuples. Serve's `key=value` strings are parsed before they get here (app/config/loading.py).
Sections stay dataclasses, so `dataclasses.replace` builds a changed copy and checks it again.
"""

from typing import Annotated, TypeVar

from pydantic import ConfigDict, Field, Strict
from pydantic.dataclasses import dataclass

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]

Count = Annotated[int, Strict(), Field(ge=1)]
"""How many of something: at least one."""
Natural = Annotated[int, Strict(), Field(ge=0)]
"""A whole number where 0 has a meaning of its own (documented per key)."""
Seconds = Annotated[float, Strict(), Field(gt=0)]
"""A duration, a period or a TTL: above 0."""
Delay = Annotated[float, Strict(), Field(ge=0)]
"""A duration where 0 means none."""
Weight = Annotated[float, Strict(), Field(ge=0)]
"""A non-negative cost weight or share of a cost."""
Share = Annotated[float, Strict(), Field(gt=0, le=1)]
"""A fraction in (0, 1]."""

SECTION = ConfigDict(extra="forbid")

T = TypeVar("T")


def section(cls: type[T]) -> type[T]:
    """A config section: frozen, keyword-only, unknown keys refused, every value validated."""
    return dataclass(frozen=True, kw_only=True, config=SECTION)(cls)


def refuse(problems: list[str]) -> None:
    """Raise one error listing every problem a section's relations found (each names its keys)."""
    if problems:
        raise ValueError("; ".join(problems))

