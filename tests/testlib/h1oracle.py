"""What the codec's oracle tests share (tests/llmgw/h1/test_server_oracle.py for the server role,
tests/llmgw/h1/test_client_oracle.py for the client role): HTTP/1.1 messages generated from
their parts and mutated where parsers disagree, the verdict a codec and h11 are each reduced to,
where the parts of a parsed message lie in its bytes, and `judge`, which compares two verdicts
allowing exactly the differences a test's table names, each by a rule that must hold.

A verdict is a `Message` (what a parser made of the first message: its start line, its fields,
its body, whether the connection is kept, the bytes after it), `Refused` or `CLOSED` (nothing was
sent). Every parser is fed its pieces and then the connection's end, so a message that is not
whole by then is refused by both.

A table row is one of three kinds:
- stricter: h11 takes the message, ours refuses it. Its rule reads h11's parse; whenever it holds
  ours must refuse, whatever else the message holds.
- lenient: h11 refuses, ours takes it. Its rule reads our parse and says how to write the message
  so h11 takes it (`normalize`); h11's verdict on that must then be ours.
- differs: both take it, and ours differs by what `expect` says.
"""

# Over 450 lines, one thing: the oracle both roles' tests are judged by (the generator, the parts
# of a parsed message, `judge`), which they share so that the two judge alike.

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

from hypothesis import strategies as st

# -- verdicts ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Message:
    start: tuple  # (method, target, version) of a request; (the method it answers, status) of a response
    headers: tuple[tuple[bytes, bytes], ...]  # lower-case names, in order; no Content-Length (the body says it)
    body: bytes
    keep_alive: bool
    left: bytes  # what followed the message
    at_eof: bool = False  # the body ended with the connection
    # Every field as the parser gave it (Content-Length too), for the tables' rules; not compared.
    fields: tuple[tuple[bytes, bytes], ...] = dataclasses.field(default=(), compare=False)
    version: bytes = dataclasses.field(default=b"1.1", compare=False)


@dataclasses.dataclass(frozen=True)
class Refused:
    why: str = dataclasses.field(compare=False)


CLOSED = "closed"  # the connection ended before a byte of a request
Verdict = Message | Refused | str


def compared(fields: list[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    """The fields as a verdict compares them. h11 keeps one Content-Length, its list made one
    value, and lower-cases Transfer-Encoding; ours keeps what was sent. What either framing
    means is in the body and what is left after it, so Content-Length is left out and the
    coding compared in lower case."""
    return tuple(
        (name, value.lower() if name == b"transfer-encoding" else value)
        for name, value in fields
        if name != b"content-length"
    )


def tokens(message: Message, name: bytes) -> set[bytes]:
    return {t.strip(b" \t").lower() for n, v in message.fields if n == name for t in v.split(b",")}


def has(message: Message, name: bytes) -> bool:
    return any(n == name for n, _ in message.fields)


# -- where the parts of a parsed message lie ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Parts:
    """Spans of `data` (start, end): each head (start line to its empty line, informational
    heads first) and, of a chunked body, each chunk-size line (without its CRLF) and the
    trailer section (to its empty line)."""

    data: bytes
    heads: tuple[tuple[int, int], ...]
    size_lines: tuple[tuple[int, int], ...] = ()
    trailers: tuple[int, int] | None = None

    def text(self, span: tuple[int, int]) -> bytes:
        return self.data[span[0] : span[1]]

    def blocks(self) -> list[bytes]:
        """The heads and the trailer section: where field lines are."""
        return [self.text(s) for s in self.heads] + ([self.text(self.trailers)] if self.trailers else [])

    def field_lines(self) -> list[bytes]:
        """Every line of the heads but their start lines, and of the trailers, split where h11
        splits them (at LF, a CR before it dropped)."""
        lines = []
        for i, block in enumerate(self.blocks()):
            split = [line[:-1] if line.endswith(b"\r") else line for line in block.split(b"\n")]
            lines += split[1 if i < len(self.heads) else 0 :]
        return [line for line in lines if line]

    def sizes(self) -> list[bytes]:
        return [self.text(s) for s in self.size_lines]


_H11_BLANK = re.compile(rb"\n\r?\n")  # where h11 ends a head (h11/_receivebuffer.py)
_INFORMATIONAL = re.compile(rb"HTTP/[0-9]\.[0-9] 1[0-9][0-9]")


def parts(data: bytes, message: Message, *, h11_lines: bool, response: bool) -> Parts:
    """Where the parts of `message`, parsed from `data`, lie: as h11 splits lines
    (`h11_lines`: a line ends at LF) or as ours does (at CRLF, empty lines before a request
    skipped). Only for a message the parser in question took."""
    pos = 0
    if not h11_lines and not response:
        while data.startswith(b"\r\n", pos):
            pos += 2
    heads = []
    while True:
        if h11_lines:
            end = _H11_BLANK.search(data, pos).end()
        else:
            end = data.index(b"\r\n\r\n", pos) + 4
        heads.append((pos, end))
        informational = response and _INFORMATIONAL.match(data, pos) is not None
        pos = end
        if not informational:
            break
    if not has(message, b"transfer-encoding") or (response and _bodiless(message)):
        return Parts(data, tuple(heads))
    sizes = []
    while True:
        end = data.index(b"\r\n", pos)
        sizes.append((pos, end))
        size = int(re.match(rb"[0-9A-Fa-f]+", data[pos:end]).group(), 16)
        pos = end + 2
        if not size:
            break
        pos += size + 2
    if h11_lines and data.startswith((b"\n", b"\r\n"), pos):
        end = pos + (1 if data[pos] == 0x0A else 2)
    elif h11_lines:
        end = _H11_BLANK.search(data, pos).end()
    else:
        end = pos
        while True:
            line_end = data.index(b"\r\n", end)
            end, empty = line_end + 2, line_end == end
            if empty:
                break
    return Parts(data, tuple(heads), tuple(sizes), (pos, end))


def _bodiless(message: Message) -> bool:
    method, status = message.start
    return method == b"HEAD" or status in (204, 304)


def replaced(data: bytes, changes: list[tuple[int, int, bytes]]) -> bytes:
    """`data` with each span (start, end) replaced by its bytes."""
    out, at = [], 0
    for start, end, new in sorted(changes):
        out += (data[at:start], new)
        at = end
    return b"".join([*out, data[at:]])


# -- the rules the tables share ----------------------------------------------------------------

BARE_LF = re.compile(rb"(?<!\r)\n")
CONTROL_IN_VALUE = re.compile(rb"[\x01-\x08\x0e-\x1f\x7f]")  # h11 takes these in a value; NUL and \s not
BWS_BEFORE_EXTENSION = re.compile(rb"([0-9A-Fa-f]+)[ \t]+;")


def bare_lf(p: Parts) -> bool:
    return any(BARE_LF.search(block) for block in p.blocks())


def obs_fold(p: Parts) -> bool:
    return any(line[:1] in (b" ", b"\t") for line in p.field_lines())


def control_in_value(p: Parts) -> bool:
    return any(CONTROL_IN_VALUE.search(block) for block in p.blocks())


def length_digits(m: Message, limit: int) -> bool:
    return any(len(one.strip()) > limit for n, v in m.fields if n == b"content-length" for one in v.split(b","))


def chunk_size_digits(p: Parts, limit: int) -> bool:
    return any(len(re.match(rb"[0-9A-Fa-f]*", line).group()) > limit for line in p.sizes())


def cr_in_chunk_line(p: Parts) -> bool:
    return any(b"\r" in line for line in p.sizes())


def long_line(p: Parts, limit: int) -> bool:
    trailer_lines = p.text(p.trailers).split(b"\r\n") if p.trailers else []
    return any(len(line) > limit for line in [*p.sizes(), *trailer_lines])


def bws_before_extension(p: Parts) -> bool:
    return any(BWS_BEFORE_EXTENSION.match(line) for line in p.sizes())


def without_bws_before_extension(p: Parts) -> bytes:
    return replaced(p.data, [(a, b, BWS_BEFORE_EXTENSION.sub(rb"\1;", p.text((a, b)), 1)) for a, b in p.size_lines])


FRAMING_NAMES = (b"content-length", b"transfer-encoding")


def _trailer_lines(p: Parts) -> list[bytes]:
    return p.text(p.trailers).split(b"\r\n")[:-1] if p.trailers else []


def framing_in_trailers(p: Parts) -> bool:
    return any(line.partition(b":")[0].lower() in FRAMING_NAMES for line in _trailer_lines(p))


def without_framing_trailers(p: Parts) -> bytes:
    kept = [line for line in _trailer_lines(p) if line.partition(b":")[0].lower() not in FRAMING_NAMES]
    return replaced(p.data, [(*p.trailers, b"".join(line + b"\r\n" for line in kept))])


def http10_keep_alive(m: Message) -> bool:
    """Whether ours keeps an HTTP/1.0 connection (RFC 9112 §9.3): asked with `keep-alive`, no
    `close` beside it, no Transfer-Encoding (RFC 9112 §6.1: the framing may be faulty; close
    after it), and a body that did not end with the connection."""
    connection = tokens(m, b"connection")
    return (
        b"keep-alive" in connection and b"close" not in connection and not has(m, b"transfer-encoding") and not m.at_eof
    )


# -- the table and the judgement ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One deliberate difference from h11: its `name`, the `reason`, the rule saying when it
    applies (`applies(parts, message)`: h11's parse for a stricter or differing row, ours for
    a lenient one), and an `example` that shows it."""

    name: str
    reason: str
    applies: Callable[[Parts, Message], bool]
    example: bytes
    normalize: Callable[[Parts], bytes] | None = None  # lenient: the message as h11 takes it
    expect: Callable[[Message], Message] | None = None  # differs: what ours makes of it, from h11's


@dataclasses.dataclass(frozen=True)
class Table:
    stricter: tuple[Row, ...]
    lenient: tuple[Row, ...]
    differs: tuple[Row, ...]
    # (data, message, h11_lines) -> Parts: where the parts of a message lie, for this role
    parts: Callable[[bytes, Message, bool], Parts]
    # data -> h11's verdict on the whole of it (a lenient row's normalized message)
    oracle: Callable[[bytes], Verdict]


def applying(rows: tuple[Row, ...], p: Parts, message: Message) -> list[Row]:
    return [row for row in rows if row.applies(p, message)]


def judge(table: Table, data: bytes, ours: Verdict, theirs: Verdict) -> str:
    """Assert that `ours` is h11's verdict `theirs` on `data`, but for the rows of `table` that
    apply; the names of those rows (or how the two agreed), for statistics."""
    if isinstance(theirs, Message):
        strict = applying(table.stricter, table.parts(data, theirs, True), theirs)
        if strict:
            names = ", ".join(row.name for row in strict)
            assert isinstance(ours, Refused), f"h11 takes it and ours does too, but {names} says ours refuses: {ours}"
            return names
        expected, names = _expected(table, data, theirs)
        assert ours == expected, f"ours {ours}\nh11  {theirs}\nexpected by the table ({names}): {expected}"
        return names
    if isinstance(ours, Refused):
        assert theirs != CLOSED, f"h11 saw nothing sent, ours refuses: {ours}"
        return "both refuse"
    if ours == theirs:
        return "nothing sent"
    # h11 refuses what ours takes: a lenient row must say why, and how h11 would take it.
    fixed, used = data, []
    for row in table.lenient:
        p = table.parts(fixed, ours, False) if isinstance(ours, Message) else Parts(fixed, ())
        if row.applies(p, ours):
            fixed, used = row.normalize(p), [*used, row.name]
    assert used, f"h11 refuses ({theirs}) what ours takes, and no row says why: {ours}"
    again = table.oracle(fixed)
    if ours == CLOSED:
        assert again == CLOSED, f"{used}: h11 makes {again} of {fixed!r}, ours saw no request"
        return ", ".join(used)
    assert isinstance(again, Message), f"{used}: h11 still refuses {fixed!r}: {again}"
    strict = applying(table.stricter, table.parts(fixed, again, True), again)
    assert not strict, f"{used}: ours takes what {', '.join(row.name for row in strict)} says it refuses: {ours}"
    expected, names = _expected(table, fixed, again)
    assert ours == expected, f"{used}, {names}: ours {ours}\nexpected {expected}"
    return ", ".join(used)


def _expected(table: Table, data: bytes, theirs: Message) -> tuple[Message, str]:
    p = table.parts(data, theirs, True)
    rows = applying(table.differs, p, theirs)
    expected = theirs
    for row in rows:
        expected = row.expect(expected)
    return expected, ", ".join(row.name for row in rows) or "the same message"


# -- generated messages ------------------------------------------------------------------------
# Strategies are made once and reused (`ints`, `one`): one made anew at each draw is validated
# anew, which cost most of the generation's time.


@functools.cache
def ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(low, high)


@functools.cache
def one(choices: tuple) -> st.SearchStrategy:
    return st.sampled_from(choices)


ODD_PERCENT = 8  # of the places a message may go wrong, how often each does: most come out whole


def pick(draw: st.DrawFn, usual: tuple, odd: tuple = ()):
    """One of `usual`, or now and then (`ODD_PERCENT`) one of `odd`: a message with a fault at
    every place would be refused by both parsers for the first, and show nothing."""
    return draw(one(odd if odd and draw(ints(0, 99)) < ODD_PERCENT else usual))


ODD_BYTES = (b"\x00", b"\x01", b"\t", b"\x0b", b"\x0c", b"\r", b"\n", b"\x1f", b"\x7f", b"\x80", b"\xff", b" ", b":", b",", b";", b'"')  # fmt: skip


def odd_case(name: bytes, flips: int) -> bytes:
    """`name` with the case of each letter whose bit is set in `flips` turned."""
    return bytes(c ^ 0x20 if flips >> i & 1 and chr(c).isalpha() else c for i, c in enumerate(name))


def field_line(draw: st.DrawFn, name: bytes, value: bytes) -> bytes:
    """A field line as senders write it: the name in any case, the value padded or not."""
    case = draw(ints(0, 4))
    if case == 1:
        name = name.title()
    elif case == 2:
        name = name.upper()
    elif case == 3:
        name = odd_case(name, draw(ints(0, (1 << len(name)) - 1)))
    before = draw(one((b" ", b"", b"  ", b"\t", b" \t")))
    after = draw(one((b"", b"", b" ", b"\t", b" \t ")))
    return name + b":" + before + value + after


def content_lengths(draw: st.DrawFn, n: int) -> tuple[bytes, ...]:
    """Content-Length values for a body of `n` bytes: right, repeated, listed, padded, with
    leading zeros (to an oversized number of digits), conflicting, wrong, or no number."""
    d, other = b"%d" % n, b"%d" % (n + 1)
    zeros = b"0" * draw(ints(1, 22))
    usual = ((d,), (d,), (d,), (d, d), (d + b", " + d,), (d + b"," + d,), (d + b" ,\t" + d,), (d + b", " + d, d), (zeros + d,))  # fmt: skip
    odd = (
        (d, zeros + d), (d + b", " + zeros + d,), (zeros + d, zeros + d), (d, other), (d + b", " + other,), (d + b",",),
        (b"," + d,), (d + b" " + d,), (b"+" + d,), (b"-" + d,), (b"0x%x" % n,), (b"",), (other,), (b"%d" % max(0, n - 1),),
        (b"9" * 19,),
    )  # fmt: skip
    return pick(draw, usual, odd)


TRANSFER_CODINGS = ((b"chunked",), (b"Chunked",), (b"CHUNKED",), (b"chunked",))
ODD_TRANSFER_CODINGS = (
    (b"chunked", b"chunked"), (b"chunked, chunked",), (b"gzip, chunked",), (b"gzip", b"chunked"),
    (b"chunked", b"gzip"), (b"chunked, gzip",), (b"identity",), (b"chunked;q=1",), (b"chunked,",), (b"xchunked",), (b"",),
)  # fmt: skip
EXTENSIONS = (b"", b"", b"", b";a", b";a=b", b';a="x;y"', b";", b" ", b"\t")
ODD_EXTENSIONS = (b" ;a", b"\t;a", b";a\rb", b";a\x00", b";\x01")
CRLF = (b"\r\n",)
NOT_CRLF = (b"\n", b"\r", b"\r\r\n", b"")
TRAILERS = ((), (), (b"x-t: 1",), (b"x-t: 1", b"X-U:\t2 "))
ODD_TRAILERS = (
    (b"content-length: 5",), (b"Transfer-Encoding: gzip",), (b"content-length: x",), (b"x: 1", b" folded"),
    (b"bad line",), (b"x-t: \x01",), (b"x-t: a\x00",), (b"x-t: 1\n",), (b"x: " + b"t" * 4100,),
)  # fmt: skip


def chunked(draw: st.DrawFn, body: bytes) -> bytes:
    """`body` in chunks: sizes in either case, with leading zeros (some past 16 digits), with
    extensions (whitespace before them, a CR in them), sizes that are wrong, line ends that are
    not CRLF, and trailers (ordinary, framing fields, folded, bad, long)."""
    cuts = sorted(draw(ints(0, len(body))) for _ in range(draw(ints(0, 3))))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
    out = []
    for piece in [*pieces, b""]:
        size = len(piece) + (pick(draw, (0,), (-1, 1, 2)) if piece else 0)
        digits = draw(one((b"%x", b"%X"))) % size
        zeros = b"0" * pick(draw, (0, 0, 0, 1, 15), (16, 19))
        out.append(zeros + digits + pick(draw, EXTENSIONS, ODD_EXTENSIONS) + pick(draw, CRLF, NOT_CRLF))
        if piece:
            out.append(piece + pick(draw, CRLF, NOT_CRLF))
    out += [line + b"\r\n" for line in pick(draw, TRAILERS, ODD_TRAILERS)]
    out.append(pick(draw, CRLF, (b"\n", b"")))
    return b"".join(out)


MUTATIONS = ("end", "fold", "odd", "colon", "drop", "repeat", "long")


def mutated(draw: st.DrawFn, lines: list[bytes], body: bytes) -> bytes:
    """A head of `lines` (the start line first) and `body`, mutated where parsers differ: a bare
    LF or CR for a line end, obs-fold, an odd byte in a line, a space before a colon, a line
    dropped or repeated, a long one; empty lines before it; then, sometimes, a byte anywhere
    changed, added or taken away."""
    lines = list(lines)
    ends = [b"\r\n"] * (len(lines) + 1)  # the last: the empty line's
    for _ in range(pick(draw, (0,), (1, 1, 2))):
        kind = draw(one(MUTATIONS))
        i = draw(ints(0, len(lines) - 1))
        if kind == "end":
            ends[draw(ints(0, len(ends) - 1))] = draw(one((b"\n", b"\r", b"\r\r\n", b"\n\r")))
        elif kind == "fold" and i:
            lines.insert(i + 1, draw(one((b" folded", b"\tx", b" ", b"  a: b"))))
            ends.insert(i + 1, b"\r\n")
        elif kind == "odd":
            at = draw(ints(0, len(lines[i])))
            lines[i] = lines[i][:at] + draw(one(ODD_BYTES)) + lines[i][at:]
        elif kind == "colon" and i:
            lines[i] = lines[i].replace(b":", draw(one((b" :", b"\t:", b"::"))), 1)
        elif kind == "drop" and i:
            del lines[i], ends[i]
        elif kind == "repeat" and i:
            lines.insert(i, lines[i])
            ends.insert(i, b"\r\n")
        elif kind == "long":
            lines.insert(max(i, 1), b"x-long: " + b"v" * draw(ints(100, 700)))
            ends.insert(max(i, 1), b"\r\n")
    before = pick(draw, (b"",), (b"\r\n", b"\r\n\r\n", b"\n"))
    data = before + b"".join(line + end for line, end in zip(lines, ends, strict=False)) + ends[-1] + body
    if data and pick(draw, (False,), (True,)):
        at = draw(ints(0, len(data) - 1))
        data = data[:at] + draw(one((*ODD_BYTES, b"", b"a", b"0"))) + data[at + draw(ints(0, 1)) :]
    return data


FRAMINGS = ("none", "length", "length", "chunked", "chunked")
BODIES = st.binary(max_size=24)


def framed(draw: st.DrawFn, fields: list[bytes]) -> tuple[list[bytes], bytes]:
    """Field lines for a body (`fields` and framing ones, shuffled) and the body's bytes, framed
    by Content-Length, chunked, both, or neither (a response's body until the connection's end;
    after a request, the next one's bytes)."""
    body = draw(BODIES)
    framing = pick(draw, FRAMINGS, ("both",))
    fields = list(fields)
    if framing in ("length", "both"):
        fields += [field_line(draw, b"content-length", value) for value in content_lengths(draw, len(body))]
    if framing in ("chunked", "both"):
        codings = pick(draw, TRANSFER_CODINGS, ODD_TRANSFER_CODINGS)
        fields += [field_line(draw, b"transfer-encoding", value) for value in codings]
        body = chunked(draw, body)
    for i in range(len(fields) - 1, 0, -1):  # shuffled, as st.permutations would, for less
        j = draw(ints(0, i))
        fields[i], fields[j] = fields[j], fields[i]
    return fields, body


ORDINARY_FIELDS = (
    (b"content-type", b"application/json"),
    (b"x-a", b"1"),
    (b"x-a", b"two words"),
    (b"accept", b"*/*"),
    (b"x-empty", b""),
    (b"x-latin", b"caf\xe9"),
    (b"x-tab", b"a\tb"),
    (b"te", b"trailers"),
)
CONNECTIONS = (b"close", b"keep-alive", b"Keep-Alive", b"keep-alive, close", b"CLOSE", b"te, close", b"x")


def common_fields(draw: st.DrawFn) -> list[bytes]:
    """Ordinary fields and Connection ones (close, keep-alive, both, in any case, repeated)."""
    lines = [field_line(draw, *draw(one(ORDINARY_FIELDS))) for _ in range(draw(ints(0, 3)))]
    return lines + [field_line(draw, b"connection", draw(one(CONNECTIONS))) for _ in range(draw(ints(0, 2)))]


AFTER = (b"", b"", b"", b"GET / HTTP/1.1\r\nhost: a\r\n\r\n", b"xyz", b"0\r\n\r\n", b"\r\n")


def pieces(draw: st.DrawFn, data: bytes) -> list[int] | None:
    """How `data` arrives: whole, a byte at a time, or in random pieces."""
    how = draw(one(("whole", "bytes", "random")))
    if how == "whole":
        return None
    if how == "bytes":
        return [1] * len(data)
    return [draw(ints(1, 16)) for _ in range(draw(ints(0, 40)))]
