"""The shape of a benchmark's JSON, for the smoke tests of tools/bench: every key present, of its
type, and no key the test does not know (a key renamed or dropped fails its smoke, as a key added
without the test does).

A shape is a type or a tuple of types (`isinstance`, where a bool is not a number: NUMBER,
`int` and `float` refuse True), a dict of shapes (exactly those keys; a value wrapped in
`Maybe` may be absent), `[shape]` (a list whose every item has that shape) or `MapOf(shape)` (a
dict of any string keys, every value of that shape).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

NUMBER = (int, float)
NONE = type(None)


@attrs.frozen
class Maybe:
    """A key that may be absent (present, it has `shape`)."""

    shape: Any


@attrs.frozen
class MapOf:
    """A dict of any string keys, each value of `shape`."""

    shape: Any


def problems(value: Any, shape: Any, where: str = "$") -> Iterator[str]:
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            yield f"{where}: {type(value).__name__} {value!r:.80}, not an object"
            return
        for key in sorted(value.keys() - shape.keys()):
            yield f"{where}.{key}: not expected ({value[key]!r:.80})"
        for key, inner in shape.items():
            if key in value:
                yield from problems(value[key], inner.shape if isinstance(inner, Maybe) else inner, f"{where}.{key}")
            elif not isinstance(inner, Maybe):
                yield f"{where}.{key}: missing"
    elif isinstance(shape, MapOf):
        if not isinstance(value, dict):
            yield f"{where}: {type(value).__name__} {value!r:.80}, not an object"
            return
        for key, inner in value.items():
            yield from problems(inner, shape.shape, f"{where}.{key}")
    elif isinstance(shape, list):
        if not isinstance(value, list):
            yield f"{where}: {type(value).__name__} {value!r:.80}, not a list"
            return
        for i, item in enumerate(value):
            yield from problems(item, shape[0], f"{where}[{i}]")
    else:
        types = shape if isinstance(shape, tuple) else (shape,)
        if isinstance(value, bool) and bool not in types:
            yield f"{where}: {value!r}, a bool where {'/'.join(t.__name__ for t in types)} was expected"
        elif not isinstance(value, types):
            yield f"{where}: {type(value).__name__} {value!r:.80}, not {'/'.join(t.__name__ for t in types)}"


def assert_shape(value: Any, shape: Any) -> None:
    found = list(problems(value, shape))
    assert not found, "the benchmark's JSON is not as expected:\n" + "\n".join(found)
