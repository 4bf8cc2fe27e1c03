"""JSON request bodies, parsed in time linear in their size and never holding the event loop.

CPython's `json` decoder is C and linear, and it refuses nesting deeper than the interpreter's
recursion limit with `RecursionError` (a clean error, not a crash), so it is the only parser
used: no pre-scan of our own (a regex pre-scan that restarted at each quote once took 42 s on
96 KB). What remains is time. Measured here, its worst case is about 50 ns a byte (a body of
empty arrays, every byte a new object) against 1 ns for text: an 8 MiB body can take 0.4 s,
and a thread does not help, since the decoder holds the GIL throughout. So:

- a body of at most `INLINE_MAX_BYTES` with at most `INLINE_MAX_VALUES` separators and
  openings is parsed on the loop (a few milliseconds at most; `inline`);
- a larger one is parsed in a worker process (`llmgw.http.jsonworkers.JsonWorkers`, one per
  serving process, started at the first such body) which runs the caller's *projection* on the parsed value and sends
  back only its result — the few fields the caller reads — so nothing large crosses back.

A projection is a module-level function `f(value, *args)`, named by reference so the worker
can import it; it raises `InvalidJson` (or any picklable exception, such as the HTTP layer's
`HTTPError`) to refuse the body. The same function runs inline for small bodies, so both paths
give the same answers.

Nesting deeper than `MAX_DEPTH` is refused on both paths, after parsing (the parser's own limit
protects the parse; ours keeps what handlers walk shallow). A body with at most `MAX_DEPTH`
brackets cannot nest deeper, so only one with more is walked (`depth_exceeds`), level by level
with the containers of each level picked out in C: brackets inside strings would make a count of
the bytes wrong, and a scan that skips strings in Python costs more than the walk.

One rule decides what a body may be, `loads`'s, on both paths and for every server: RFC 8259
strictly (UTF-8 only, no NaN or Infinity, no number past a double or CPython's 4300 digits, no
lone surrogate however written), checked by the decoder's hooks as it parses, not by another pass,
and refused in this API's words, never Python's.

For handlers (the gateway, the admin API, the page, the sim engine): `read_json` reads a small
body and parses it on the loop, `jsonworkers.parse_body` a body of any size through its workers; both
refuse with `HTTPError` (400 naming what is wrong, 413, 415 for a compressed body before it is
read, 503 when the parsers are all busy).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from itertools import compress
from typing import Any

from llmgw.errors import cut
from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request
from llmgw.log import get_logger

log = get_logger("llmgw.http")

INLINE_MAX_BYTES = 64 << 10
INLINE_MAX_VALUES = 4096  # commas and openings: a bound on the values the decoder makes
MAX_DEPTH = 64


class InvalidJson(ValueError):
    """The body is not JSON the caller accepts; `message` says what is wrong, for a 400. `code`
    and `param` as an OpenAI error names them: "invalid_json" for a body that is not JSON at all,
    the caller's own (with the field) for a field that is wrong."""

    def __init__(self, message: str, *, code: str = "invalid_json", param: str | None = None) -> None:
        self.message = message
        self.code = code
        self.param = param
        super().__init__(message)

    def __reduce__(self):  # raised in a JSON worker, pickled back to the parent
        return (_invalid_json, (self.message, self.code, self.param))

    def http_error(self) -> HTTPError:
        return HTTPError(400, self.message, code=self.code, param=self.param)


def _invalid_json(message: str, code: str, param: str | None) -> InvalidJson:
    return InvalidJson(message, code=code, param=param)


# -- parsing -----------------------------------------------------------------------------------


class _Refused(Exception):
    """Raised by the decoder's hooks: a value JSON has no place for (`loads` words it)."""

    def __init__(self, kind: str, text: str) -> None:
        self.kind, self.text = kind, text
        super().__init__(kind, text)


def _no_constant(text: str) -> None:
    raise _Refused("constant", text)


def _finite_float(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf - inf is nan: one comparison for both infinities
        raise _Refused("overflow", text)
    return value


# The decoder of every body. Its hooks cost nothing for a body without NaN or Infinity (the C
# scanner calls parse_constant only on those words) and a Python call per float (about 0.1 µs:
# a chat body has a few), so the rule is checked while parsing, not by another pass.
_decode = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float).decode
_CONTAINERS = frozenset((dict, list))
# A string with a lone surrogate is only made from a `\uD800`-`\uDFFF` escape (a valid pair
# becomes one character; raw surrogate bytes are refused as UTF-8): looked for only in a body
# that has such an escape, by writing the value again and encoding it as UTF-8, which refuses
# a surrogate (both C and linear: about 8 µs for a 2 KB chat body of escaped emoji). The regex
# finds the escape in 1 µs for 2 KB; `b"\\ud" in data or b"\\uD" in data` takes 3.5.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD]")
_REWRITE = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode
_BOM = "\ufeff"


def loads(data: bytes, *, what: str = "request body", brackets: int | None = None) -> Any:
    """`data` as JSON by the one rule of every body this server parses, or `InvalidJson` naming
    the problem. Linear in `len(data)`. `brackets`: the count of `[` and `{` in `data`, when the
    caller has it. The rule (RFC 8259, strictly):

    - UTF-8 only (§8.1): invalid UTF-8 is refused, UTF-8-encoded surrogates (`ED A0 80`) too, and
      UTF-16 or UTF-32 is not detected and decoded, as `json.loads` would; a UTF-8 byte order
      mark is ignored, as §8.1 lets a parser do (Windows tools write one);
    - no NaN, Infinity or -Infinity (§6), and no number too large for a double (`1e999999`),
      which Python would make infinity;
    - no integer of more than `sys.get_int_max_str_digits()` digits (CPython's bound on the
      quadratic int(); 4300);
    - no lone surrogate escaped in a string (`"\\ud800"`; §8.2 leaves it to the parser): every
      string parsed is text UTF-8 can carry, whether it came as bytes or as escapes;
    - nesting at most `MAX_DEPTH` deep;
    - an empty body is null.
    """
    try:
        text = data.decode("utf-8")  # strict: surrogates are not UTF-8
        if text[:1] == _BOM:
            text = text[1:]
        value = _decode(text) if data else None
    except RecursionError:
        raise InvalidJson(f"{what} nests arrays or objects deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError as exc:
        raise InvalidJson(_not_utf8(data, exc.start, what)) from None
    except json.JSONDecodeError as exc:
        if _looks_wide(data):
            raise InvalidJson(_not_utf8(data, 0, what)) from None
        raise InvalidJson(f"{what} is not valid JSON: {_short(str(exc))}") from None
    except _Refused as exc:
        raise InvalidJson(_refused(exc, what)) from None
    except ValueError:
        # The decoder's only other ValueError: int() past its digit limit (CPython's own words
        # tell the client to call sys.set_int_max_str_digits).
        raise InvalidJson(
            f"{what} has a number of more than {sys.get_int_max_str_digits()} digits; "
            "no field takes a number that long"
        ) from None
    # Cannot nest deeper than it has openings: the common case, counted in C.
    if brackets is None:
        brackets = data.count(b"[") + data.count(b"{")
    if brackets > MAX_DEPTH and depth_exceeds(value, MAX_DEPTH):
        raise InvalidJson(f"{what} nests arrays or objects deeper than {MAX_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(data):
        _refuse_lone_surrogate(value, what)
    return value


def _refuse_lone_surrogate(value: Any, what: str) -> None:
    written = _REWRITE(value)
    try:
        written.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidJson(
            f"{what} has a string with the lone surrogate \\u{ord(written[exc.start]):04x}, which is not a "
            "character; escape a character past U+FFFF as a pair (\\ud83d\\ude00 is U+1F600), or send it as UTF-8"
        ) from None


def _looks_wide(data: bytes) -> bool:
    """UTF-16 or UTF-32, by RFC 4627's rule (json.detect_encoding's): a byte order mark, or a NUL
    among the first four bytes (JSON text has none). For a message only."""
    return data[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in data[:4]


def _not_utf8(data: bytes, at: int, what: str) -> str:
    if _looks_wide(data):
        return f"{what} is not UTF-8 (it looks like UTF-16 or UTF-32); send JSON text in UTF-8"
    bad = bytes(data[at : at + 3])
    if bad[:1] == b"\xed" and bad[1:2] >= b"\xa0":  # ED A0..BF: U+D800..U+DFFF as CESU-8 or WTF-8 write it
        why = "a surrogate code point, which UTF-8 does not encode"
    else:
        why = "not a UTF-8 sequence"
    return f"{what} is not valid UTF-8 at byte {at} ({bad.hex(' ')}: {why}); send JSON text in UTF-8"


def _refused(exc: _Refused, what: str) -> str:
    number = cut(exc.text, 40)
    if exc.kind == "constant":
        return f"{what} has {number}, which is not JSON (RFC 8259 has no NaN or Infinity); send a number or null"
    return f"{what} has the number {number}, past the largest a double holds (about 1.8e308); send a smaller one"


def inline(data: bytes) -> bool:
    """Whether `data` is cheap enough to parse on the loop: small, and with few values. The
    decoder's cost is about 4 ns a byte plus up to 1 µs a value (an array of empty arrays is the
    worst), so both are bounded; counting separators and openings is C, a few µs at this size."""
    if len(data) > INLINE_MAX_BYTES:
        return False
    return data.count(b",") + data.count(b"[") + data.count(b"{") <= INLINE_MAX_VALUES


def depth_exceeds(value: Any, limit: int) -> bool:
    """Whether lists and dicts nest deeper than `limit` in `value` (as `json.loads` makes them:
    dicts and lists, no subclasses). Iterative, level by level: one Python step per container,
    and the values of a level sorted into containers and the rest in C (`compress`), so that a
    body's many strings and numbers cost no Python step each."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 1
    while level:
        children: list[Any] = []
        for node in level:
            children += node.values() if isinstance(node, dict) else node
        level = list(compress(children, map(_CONTAINERS.__contains__, map(type, children))))
        depth += 1
        if level and depth > limit:
            return True
    return False


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def whole(value: Any) -> Any:
    """The projection that keeps everything: for bodies whose value is small once parsed."""
    return value


def project(data: bytes, fn: Callable[..., Any], args: Sequence[Any] = ()) -> Any:
    """Parse `data` and apply the projection: what both paths run."""
    return fn(loads(data), *args)


# -- in a handler ------------------------------------------------------------------------------


def parse_json(data: bytes, *, what: str = "request body") -> Any:
    """`data` as JSON, or `HTTPError(400)` naming the problem: invalid, or nested deeper than
    `MAX_DEPTH`. Parsed on the loop: for small bodies only (`INLINE_MAX_BYTES`); a larger one
    goes through `jsonworkers.parse_body`."""
    try:
        return loads(data, what=what)
    except InvalidJson as exc:
        raise exc.http_error() from None


def refuse_content_coding(request: Request) -> None:
    """`HTTPError(415)` for a body sent with a content coding (RFC 9110 §8.4: gzip, br, ...):
    none is decoded here, and compressed bytes read as JSON would be refused as "not UTF-8",
    which sends the client looking in the wrong place. Absent or `identity` (no coding) passes.
    From the head, before the body is read; the answer says what would be accepted (RFC 9110
    §15.5.16: Accept-Encoding)."""
    if "content-encoding" not in request.headers:  # every request but a refused one: one lookup
        return
    codings = [c.strip(" \t") for value in request.header_values("content-encoding") for c in value.split(",")]
    applied = [c for c in codings if c and c.lower() != "identity"]
    if applied:
        raise HTTPError(
            415,
            f"Content-Encoding {cut(', '.join(applied), 60)!r} is not supported; send the request body uncompressed",
            code="unsupported_content_encoding",
            headers=(("accept-encoding", "identity"),),
        )


async def read_json(request: Request, *, limit: int = INLINE_MAX_BYTES, what: str = "request body") -> Any:
    """The body as JSON, for the small bodies of the admin API and the page (at most `limit`
    bytes, parsed on the loop); `HTTPError(400)` naming what is wrong, 413 past `limit`, 415 for
    a compressed body (`refuse_content_coding`)."""
    refuse_content_coding(request)
    data = await request.read(limit=min(limit, INLINE_MAX_BYTES))
    if not inline(data):
        raise HTTPError(
            413,
            f"{what} has more than {INLINE_MAX_VALUES} values; this route takes small bodies",
            code="request_too_large",
        )
    return parse_json(data, what=what)
