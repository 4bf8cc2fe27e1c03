"""Header field lines as both roles of the codec read and write them (RFC 9112 §5, RFC 9110
§5.5), and how a peer's bytes are shown in a message (`as_text`).

Read: a block of field lines is checked for control characters in one pass (none but the CRLF
that ends each line; TAB allowed in a value), then each line is a name that is a token, `:` and
a value (no obs-fold); only a block that fails is gone through again, to say which line is
wrong. Written: a name is a token and a value holds no CR, LF or NUL (either would split the
message), the whole head checked in one pass. The names found tokens are remembered (a bounded
set), so the usual ones cost a lookup.

A message about a peer's bytes shows them as text (`as_text`), never as Python's `b'...'`.
"""

from __future__ import annotations

import re

from llmgw.errors import cut

TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # TAB is allowed; CR, LF and the rest are not
CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?")
# What no field line holds but for the CRLF that ends it: control characters but TAB, and DEL.
_NOT_IN_FIELDS = bytes(range(0x09)) + bytes(range(0x0A, 0x20)) + b"\x7f"
_SPLITTER = re.compile(rb"[\r\n\x00]")
_KNOWN_NAMES_MAX = 512
_good_names: set[bytes] = set()
SHOWN_CHARS = 40  # of a peer's value in a message
# Control characters as a message shows them: a CR or LF from the peer must not break the
# message, or the log line it becomes, in two, nor a C1 one (0x80-0x9f: CSI is 0x9b) reach a
# terminal.
_ESCAPED = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def as_text(value: bytes, limit: int = SHOWN_CHARS) -> str:
    """`value`, bytes a peer sent, as a message shows them: text as HTTP reads it (latin-1, a
    character a byte), control characters (C0, DEL, C1) written `\\xNN`, cut to `limit`
    characters with how long it was."""
    return cut(value.decode("latin-1"), limit).translate(_ESCAPED)


class FieldError(ValueError):
    """A field line that is not one (the message names it)."""


def parse_fields(block: bytes) -> list[tuple[bytes, bytes]]:
    """The fields of `block` (the field lines of a head, each ended by CRLF: what follows the
    start line, up to and with the CRLF before the empty line): (name in lower case, value
    without the whitespace around it), in order, repeats kept."""
    lines = block.split(b"\r\n")
    # Each line's CRLF and nothing else of what no field holds (one pass over the block).
    if lines.pop() or len(block) - len(block.translate(None, _NOT_IN_FIELDS)) != 2 * len(lines):
        _which_line(block)
    fields = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or (name not in _good_names and not good_name(name)):
            _which_line(block)
        fields.append((name.lower(), value.strip(b" \t")))
    return fields


def _which_line(block: bytes) -> None:
    for line in block.split(b"\r\n")[:-1]:
        name, colon, value = line.partition(b":")
        if not colon or TOKEN.fullmatch(name) is None:
            raise FieldError(f"not a header field line: '{as_text(line, 80)}'")
        if BAD_VALUE.search(value) is not None:
            raise FieldError(f"a control character in the value of the header field '{as_text(name)}'")
    raise FieldError("the header field lines do not end with CRLF")  # the callers pass whole lines


def writable(name: bytes, value: bytes) -> bool:
    """Whether a field can be written as it is: nothing in it would split the message."""
    return good_name(name) and _SPLITTER.search(value) is None


def good_name(name: bytes) -> bool:
    """Whether `name` is a token (remembered once found so, for the usual names)."""
    if name in _good_names:
        return True
    if TOKEN.fullmatch(name) is None:
        return False
    if len(_good_names) < _KNOWN_NAMES_MAX:
        _good_names.add(name)
    return True


def whole_lines(head: bytes, lines: int) -> bool:
    """Whether `head`, written as `lines` lines each ended by CRLF, is just that: no CR, LF or
    NUL in it but those line ends (a field that holds one would split the message). One pass
    over the head, however many fields it has."""
    return head.count(b"\r\n") == lines and len(head) - len(head.translate(None, b"\r\n\x00")) == 2 * lines
