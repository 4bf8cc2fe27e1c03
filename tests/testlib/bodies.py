"""Request bodies built to be slow to parse, at a given size: the corpus of the no-stall tests
(tests/integration/test_request_bounds.py) and of the chaos benchmark's `adversarial_bodies`.

Each is a chat request for `model` whose extra field, or whose whole shape, is one of the
inputs that make a JSON parser (or a pre-scan of one) slow: runs of escaped quotes in an
unterminated string (the body that once held the control plane 42 s at 96 KB), brackets inside
strings, nesting just under and past the limit, long strings, huge numbers, hundreds of
thousands of keys, `\\u` escapes, invalid UTF-8 at the end, a body that is not an object.
"""

from __future__ import annotations

from collections.abc import Callable


def _fill(prefix: bytes, unit: bytes, suffix: bytes, size: int) -> bytes:
    n = max(1, (size - len(prefix) - len(suffix)) // len(unit))
    return prefix + unit * n + suffix


def _keys(prefix: bytes, size: int) -> bytes:
    out, i, total = [prefix], 0, len(prefix) + 1
    while total < size - 32:
        key = b'"k%d":0,' % i
        out.append(key)
        total += len(key)
        i += 1
    return b"".join(out) + b'"end":0}'


def adversarial(model: str, size: int) -> dict[str, Callable[[], bytes]]:
    """name -> a function making that body, at most `size` bytes (made on demand: each is large)."""
    chat = b'{"model":"' + model.encode() + b'","messages":[{"role":"user","content":"hi"}],"max_tokens":4,'
    size -= 1024  # room for the prefixes and suffixes
    return {
        "escaped-quotes-unterminated": lambda: _fill(chat + b'"x":"', b'\\"', b"[" * 65, size),
        "brackets-in-a-string": lambda: _fill(chat + b'"x":"', b"[{", b'"}', size),
        "nesting-just-under-the-limit": lambda: _fill(
            chat + b'"x":[', b"[" * 62 + b"0" + b"]" * 62 + b",", b"0]}", size
        ),
        "nesting-past-the-limit": lambda: _fill(chat + b'"x":', b"[", b"", size),
        "empty-arrays": lambda: _fill(chat + b'"x":[', b"[],", b"[]]}", size),
        "a-long-string": lambda: _fill(chat + b'"x":"', b"y", b'"}', size),
        "a-huge-integer": lambda: _fill(chat + b'"x":', b"9", b"}", size),
        "a-long-float": lambda: _fill(chat + b'"x":0.', b"1", b"e5}", size),
        "many-keys": lambda: _keys(chat, size),
        "unicode-escapes": lambda: _fill(chat + b'"x":"', b"\\ud83d\\ude00", b'"}', size),
        "invalid-utf8-at-the-end": lambda: _fill(chat + b'"x":"', b"y", b'\xff\xfe"}', size),
        "not-an-object": lambda: _fill(b"[", b"0,", b"0]", size),
    }


def strategy(model: str, max_size: int):
    """A hypothesis strategy of such bodies: a chat request whose extra field is a generated
    fragment of pathological JSON (escapes, brackets, nesting, numbers, unicode, stray bytes),
    repeated to a generated size of up to `max_size`, closed properly or cut off anywhere."""
    from hypothesis import strategies as st

    pieces = st.sampled_from(
        [
            b'\\"',
            b"\\\\",
            b"[",
            b"]",
            b"{",
            b"}",
            b'"',
            b",",
            b":",
            b"0",
            b"9" * 40,
            b"1e999",
            b"-0.",
            b"\\u",
            b"\\ud83d",
            b"\\ude00",
            b"\\u0000",
            b"true",
            b"null",
            b"\xff",
            b"\xc3",
            b" ",
            b"\n",
            b"[]",
            b"{}",
            b'"k":',
            b"[[[[",
            b"]]]]",
            b'"a"',
            b"\\n",
        ]  # fmt: skip
    )
    chat = b'{"model":"' + model.encode() + b'","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"x":'

    @st.composite
    def build(draw) -> bytes:
        unit = b"".join(draw(st.lists(pieces, min_size=1, max_size=12)))
        size = draw(st.integers(min_value=len(chat) + 2, max_value=max_size))
        opener = draw(st.sampled_from([b'"', b"[", b"", b"{"]))
        closer = draw(st.sampled_from([b'"}', b"]}", b"}", b"", b'"]}']))
        body = _fill(chat + opener, unit, closer, size)[:max_size]
        if draw(st.booleans()):
            body = body[: draw(st.integers(min_value=1, max_value=len(body)))]  # cut off anywhere
        return body

    return build()
