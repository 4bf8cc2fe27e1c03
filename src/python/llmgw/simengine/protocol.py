"""The rendezvous wire between the members of a sim replica. Pure: bytes in, messages out.

One JSON object per line (`\n`-terminated, at most `MAX_LINE` bytes), each with a `type`:

    worker -> rank 0   {"type": "hello", "version": 1, "rank": R, "nnodes": N, "model": M}
    rank 0 -> worker   {"type": "welcome", "joined": K, "expected": N-1}  or  {"type": "reject", "reason": ...}
    rank 0 -> worker   {"type": "ready"}                   once every worker has joined
    both ways          {"type": "ping"}                    every HEARTBEAT_S

A member that hears nothing from its peer for PEER_TIMEOUT_S (five missed heartbeats)
declares it dead, so a hung process is caught as surely as a dead one, whose kernel closes
the connection at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

VERSION = 1
MAX_LINE = 4096
HEARTBEAT_S = 1.0
PEER_TIMEOUT_S = 5.0
HELLO_TIMEOUT_S = 10.0  # a connection that says nothing is not a member

PING: dict[str, Any] = {"type": "ping"}
READY: dict[str, Any] = {"type": "ready"}


class RendezvousProtocolError(Exception):
    """The peer sent something that is not this protocol (a stray client, another program)."""


def encode(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: a line of 4,000 brackets
        raise RendezvousProtocolError(f"not a rendezvous message: {line[:80]!r}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise RendezvousProtocolError(f"not a rendezvous message: {line[:80]!r}")
    return message


class LineBuffer:
    """Splits received bytes into lines; refuses a line longer than MAX_LINE."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        *lines, rest = self._buffer.split(b"\n")
        if len(rest) > MAX_LINE:
            raise RendezvousProtocolError(f"a line longer than {MAX_LINE} bytes")
        self._buffer = bytearray(rest)
        return [bytes(line) for line in lines]


def hello(*, rank: int, nnodes: int, model: str) -> dict[str, Any]:
    return {"type": "hello", "version": VERSION, "rank": rank, "nnodes": nnodes, "model": model}


def check_hello(message: Mapping[str, Any], *, nnodes: int, model: str, joined: Mapping[int, str]) -> str | None:
    """Why rank 0 refuses this hello, or None to accept it. `joined` maps rank to address."""
    if message.get("type") != "hello":
        return f"expected a hello, got {message.get('type')!r}"
    if message.get("version") != VERSION:
        return f"rendezvous protocol version {message.get('version')!r}, rank 0 speaks {VERSION}; run the same llmgw on every member"
    rank = message.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int):
        return f"rank {rank!r} is not an integer"
    if message.get("nnodes") != nnodes:
        return (
            f"rank {rank} was started with --nnodes {message.get('nnodes')!r} and rank 0 with --nnodes {nnodes}; "
            "start every member with the same --nnodes"
        )
    if message.get("model") != model:
        return (
            f"rank {rank} serves model {message.get('model')!r} and rank 0 {model!r}; "
            "every member of a replica must be started with the same --model"
        )
    if not 1 <= rank < nnodes:
        return f"rank {rank} is out of range for --nnodes {nnodes}: workers are ranks 1..{nnodes - 1}"
    if rank in joined:
        return f"rank {rank} has already joined from {joined[rank]}; give each member its own --node-rank"
    return None


def missing_ranks(nnodes: int, joined: Mapping[int, str]) -> list[int]:
    return [r for r in range(1, nnodes) if r not in joined]
