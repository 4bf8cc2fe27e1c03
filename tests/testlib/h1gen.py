"""HTTP/1.1 messages generated from their parts for the codec's oracle tests
(tests/llmgw/h1/test_server_oracle.py, test_client_oracle.py), as Hypothesis strategies: fields,
lengths, chunked bodies with their extensions and trailers, each place now and then odd
(`ODD_PERCENT`), heads mutated where parsers disagree (`mutated`), and how the bytes arrive
(`pieces`). Both roles' tests draw from here so that the two are fed alike; what they are judged
by is `testlib.h1oracle`'s.
"""

from __future__ import annotations

import functools

from hypothesis import strategies as st

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
