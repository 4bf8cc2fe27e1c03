"""Engine log files: what each replica member's engine printed, kept by size, read from the end.

    STATE/logs/<replica_id>-r<rank>.log       the current file
    STATE/logs/<replica_id>-r<rank>.log.1     older, .2 older still; the oldest is dropped

The agent reads the engine's standard output and error from a pipe and writes them here, so
rotation needs nothing from the engine. Lines the agent adds itself (process started, exited,
stopped) begin with "[llmgw-agent]". Nothing secret is written by the agent: commands are
logged through `Command.for_log()`.

Writes are synchronous: a chunk of at most a pipe's worth of bytes appended to a local file
costs less than a thread hop, and the order of lines is kept.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from agent.weights import SAFE_NAME
from llmgw.errors import UsageError

MAX_BYTES = 10 << 20
FILES = 3  # the current file and two older ones
TAIL_BUDGET = 4 << 20  # bytes read at most to find the last lines


def log_path(logs_dir: Path, replica_id: str, rank: int) -> Path:
    """The current log file of one member. `replica_id` must already be a checked plain name."""
    return logs_dir / f"{replica_id}-r{rank}.log"


class EngineLog:
    """The log files of one replica member, open for appending."""

    def __init__(self, path: Path, *, max_bytes: int = MAX_BYTES, files: int = FILES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.files = max(1, files)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab")
        self._size = self._file.tell()

    def write(self, data: bytes) -> None:
        if self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        self._file.write(data)
        self._file.flush()
        self._size += len(data)

    def note(self, text: str) -> None:
        """A line of the agent's own about this engine (started, exited, stopped)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.write(f"[llmgw-agent {stamp}] {text}\n".encode("utf-8", "replace"))

    def tail(self, lines: int) -> str:
        return tail_files(self.path, lines)

    def close(self) -> None:
        self._file.close()

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.files - 1, 0, -1):
            older = _numbered(self.path, i)
            newer = _numbered(self.path, i - 1)
            if newer.exists():
                os.replace(newer, older)  # over the oldest: it is dropped
        if self.files == 1:
            self.path.unlink(missing_ok=True)
        self._file = self.path.open("ab")
        self._size = 0


def _numbered(path: Path, i: int) -> Path:
    return path if i == 0 else path.with_name(f"{path.name}.{i}")


def tail_files(path: Path, lines: int) -> str:
    """The last `lines` lines of `path` and its rotated predecessors, oldest first."""
    if lines <= 0:
        return ""
    chunks: list[bytes] = []
    newlines = 0
    budget = TAIL_BUDGET
    i = 0
    while budget > 0 and newlines <= lines:
        part = _numbered(path, i)
        if not part.exists():
            break
        data = _read_back(part, budget, lines + 1 - newlines)
        chunks.append(data)
        newlines += data.count(b"\n")
        budget -= len(data)
        i += 1
    text = b"".join(reversed(chunks)).decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


def _read_back(path: Path, budget: int, want_newlines: int) -> bytes:
    """The end of `path`: at least `want_newlines` newlines' worth if the file has them, at most `budget` bytes."""
    block = 64 << 10
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        pos, data = end, b""
        while pos > 0 and data.count(b"\n") <= want_newlines and end - pos < budget:
            step = min(block, pos, budget - (end - pos))
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    return data


def tail_replica(logs_dir: Path, replica_id: str, lines: int = 100) -> str:
    """The tail of every member's log of `replica_id` on this node (usually one), for `llmgw ctl logs`."""
    if not SAFE_NAME.match(replica_id):
        raise UsageError(f"replica id {replica_id!r} is not a plain name; see `llmgw ctl replicas` for the ids")
    found = sorted(logs_dir.glob(f"{replica_id}-r*.log"))
    found = [p for p in found if p.name[len(replica_id) + 2 : -4].isdigit()]  # not "a-r0.log" for replica "a-r0"
    if not found:
        return ""
    if len(found) == 1:
        return tail_files(found[0], lines)
    return "\n".join(f"==> {p.name} <==\n{tail_files(p, lines)}" for p in found)
