"""Shared plumbing for the hardware specs: a hashable read-only mapping, field errors that can be
re-anchored to a file, and a typed reader for JSON objects.

Why a separate error subclass: ``SpecError`` formats its message eagerly, so a spec constructed from
a file would otherwise report "device 'x': field 'memory_bytes'" instead of the file path and the
full field path ("groups[0].device.memory_bytes"). ``FieldError`` keeps the bare reason so the
loader can re-raise it against the file.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

from coplan.errors import SpecError
from coplan.limits import shown

#: Matrix-unit dtypes a device may list in ``peak_flops``. fp8 covers both e4m3 and e5m2.
DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")


class FieldError(SpecError):
    """A ``SpecError`` that also keeps its unformatted ``reason`` (see module docstring)."""

    def __init__(self, source: str, field: str | None, reason: str) -> None:
        super().__init__(source, field, reason)
        self.reason = reason


def join(prefix: str, field: str | None) -> str | None:
    """Field path ``prefix.field``; either part may be empty."""
    if not prefix:
        return field
    if not field:
        return prefix
    return f"{prefix}{field}" if field.startswith("[") else f"{prefix}.{field}"


@contextmanager
def anchored(source: str, prefix: str = "") -> Iterator[None]:
    """Re-raise ``FieldError``s from the block as coming from ``source`` at ``prefix.field``."""
    try:
        yield
    except FieldError as err:
        raise FieldError(source, join(prefix, err.field), err.reason) from None


class FrozenMap(Mapping[str, float]):
    """Immutable, hashable ``str -> float`` mapping; compares equal to any mapping with the same items.

    ``types.MappingProxyType`` is not hashable, and the specs must be (they are used as dict keys and
    compared in sets, e.g. to tell whether a cluster is homogeneous).
    """

    __slots__ = ("_data", "_hash")

    def __init__(self, items: Mapping[str, float] | None = None) -> None:
        # Sorted so that repr and to_dict output are deterministic whatever the input order.
        self._data: dict[str, float] = dict(sorted((items or {}).items()))
        self._hash = hash(frozenset(self._data.items()))

    def __getitem__(self, key: str) -> float:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


def kind(value: object) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- value checks shared by __post_init__ (direct construction) and the JSON reader ---------------


def check_str(source: str, field: str, value: object, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise FieldError(source, field, f"expected a string, got {kind(value)} {_shown(value)}")
    if not allow_empty and not value.strip():
        raise FieldError(source, field, "must not be empty")
    return value


def check_number(
    source: str, field: str, value: object, *, minimum: float = 0.0, strict: bool = True
) -> float:
    """A finite real number > minimum (``strict``) or >= minimum. Booleans are rejected on purpose:
    JSON ``true`` would otherwise pass as 1."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(source, field, f"expected a number, got {kind(value)} {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        number = math.inf
    if not math.isfinite(number):
        got = repr(value) if isinstance(value, float) else shown(value)
        raise FieldError(source, field, f"must be finite, got {got}")
    if number < minimum or (strict and number == minimum):
        relation = ">" if strict else ">="
        raise FieldError(source, field, f"must be {relation} {minimum:g}, got {value!r}")
    return number


def check_int(source: str, field: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> int:
    """An integer >= minimum (and <= maximum, one of ``coplan.limits``' bounds, where given). A float
    with an integral value (``8e10`` in JSON) is accepted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(source, field, f"expected an integer, got {kind(value)} {_shown(value)}")
    if value < minimum:
        raise FieldError(source, field, f"must be >= {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise FieldError(source, field, f"must be at most {maximum:,} (coplan's bound), got {shown(value)}")
    return value


def check_choice(source: str, field: str, value: object, choices: tuple[str, ...]) -> str:
    text = check_str(source, field, value)
    if text not in choices:
        raise FieldError(source, field, f"must be one of {', '.join(choices)}; got {text!r}")
    return text


def fail(source: str, field: str | None, reason: str) -> NoReturn:
    raise FieldError(source, field, reason)


class Reader:
    """Typed access to one JSON object; every error names ``source`` and the full field path."""

    def __init__(self, data: object, source: str, path: str = "") -> None:
        if not isinstance(data, Mapping):
            fail(source, path or None, f"expected a JSON object, got {kind(data)}")
        self.data: Mapping[str, Any] = data
        self.source = source
        self.path = path

    def at(self, key: str) -> str:
        return join(self.path, key) or key

    def check_keys(self, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
        allowed = required + optional
        for key in self.data:
            if key not in allowed:
                expected = ", ".join(allowed)
                fail(self.source, self.at(str(key)), f"unknown field; expected one of: {expected}")
        for key in required:
            if key not in self.data:
                fail(self.source, self.at(key), "missing required field")

    def text(self, key: str, default: str | None = None) -> str:
        if key not in self.data and default is not None:
            return default
        return check_str(self.source, self.at(key), self.data[key], allow_empty=default is not None)

    def number(self, key: str, *, minimum: float = 0.0, strict: bool = True) -> float:
        return check_number(self.source, self.at(key), self.data[key], minimum=minimum, strict=strict)

    def integer(self, key: str, *, minimum: int = 1, maximum: int | None = None) -> int:
        return check_int(self.source, self.at(key), self.data[key], minimum=minimum, maximum=maximum)

    def numbers(self, key: str, *, minimum: float = 0.0, strict: bool = False) -> dict[str, float]:
        """A JSON object of numbers (value checks beyond type happen in the spec's __post_init__)."""
        sub = self.sub(key)
        out: dict[str, float] = {}
        for k, v in sub.data.items():
            out[k] = check_number(self.source, sub.at(k), v, minimum=minimum, strict=strict)
        return out

    def sub(self, key: str) -> Reader:
        return Reader(self.data[key], self.source, self.at(key))


def suggest(name: str, candidates: Iterable[str]) -> str:
    """``" (did you mean 'a', 'b'?)"`` for close matches of ``name``, or ``""``."""
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.5)
    return " (did you mean " + ", ".join(repr(c) for c in close) + "?)" if close else ""
