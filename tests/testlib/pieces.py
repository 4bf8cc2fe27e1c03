"""Bytes cut into pieces, as a peer's writes may reach a parser: for the codecs' tests
(`llmgw.h1`, both roles), which feed a message in every cut that matters."""

from __future__ import annotations


def cut(data: bytes, sizes: list[int] | None = None) -> list[bytes]:
    """`data` in pieces of `sizes` bytes in turn (default: whole), the rest in a last piece;
    no empty piece (an empty read is the end of the connection)."""
    offsets = [0]
    for size in sizes or [len(data)]:
        offsets.append(min(len(data), offsets[-1] + size))
    offsets.append(len(data))
    return [data[a:b] for a, b in zip(offsets, offsets[1:], strict=False) if b > a]
