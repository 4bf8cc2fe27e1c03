"""Engine log files: what each replica member's engine printed, kept by size, read from the end.

    STATE/logs/<replica_id>-r<rank>.log       the current file
    STATE/logs/<replica_id>-r<rank>.log.1     older, .2 older still; the oldest is dropped

The engine's standard output and error are this file itself, opened with O_APPEND: the engine
writes to it directly, so its output never depends on the agent being alive (an agent that is
killed leaves its engines running, and a pipe without a reader would break their next write).
Lines the agent adds itself (process started, exited, stopped) begin with "[llmgw-agent" and
are appended to the same file; O_APPEND keeps each write whole whoever makes it.

Rotation is the agent's, by copy and truncate, since the engine's descriptor must stay valid:
older files shift up, the current one is copied to `.1` (in a thread: up to `max_bytes`), what
arrived meanwhile is copied too, and the current file is truncated; with O_APPEND the engine's
next write lands at the new end. What the engine writes between that last copy and the
truncation (microseconds) is lost: the price of rotating a file another process writes. The
agent checks the size when an engine starts or is adopted and every `CHECK_INTERVAL_S` while it
runs, so a file may pass `max_bytes` by what the engine writes in that time.

Nothing secret is written by the agent: commands are logged through `Command.for_log()`. An
engine may print what it was given all the same (SGLang logs its whole configuration, key
included, when it starts; requests at debug level hold prompts), so the files are the agent's
user's only: 0600 in a 0700 directory, tightened if an earlier agent left them looser.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import trio

from agent.weights import SAFE_NAME
from llmgw.errors import UsageError

MAX_BYTES = 10 << 20
FILES = 3  # the current file and two older ones
TAIL_BUDGET = 4 << 20  # bytes read at most to find the last lines
CHECK_INTERVAL_S = 5.0


def log_path(logs_dir: Path, replica_id: str, rank: int) -> Path:
    """The current log file of one member. `replica_id` must already be a checked plain name."""
    return logs_dir / f"{replica_id}-r{rank}.log"


class EngineLog:
    """The log files of one replica member: the engine's output descriptor, the agent's notes, rotation."""

    def __init__(self, path: Path, *, max_bytes: int = MAX_BYTES, files: int = FILES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.files = max(1, files)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _tighten(path.parent, 0o700)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(self._fd).st_mode & 0o077:
            os.fchmod(self._fd, 0o600)

    def fileno(self) -> int:
        """The descriptor to give the engine as its stdout and stderr (it keeps O_APPEND)."""
        return self._fd

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def note(self, text: str) -> None:
        """A line of the agent's own about this engine (started, exited, stopped)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.write(f"[llmgw-agent {stamp}] {text}\n".encode("utf-8", "replace"))

    def tail(self, lines: int) -> str:
        return tail_files(self.path, lines)

    def close(self) -> None:
        os.close(self._fd)

    def too_big(self) -> bool:
        return os.fstat(self._fd).st_size > self.max_bytes

    def rotate(self) -> None:
        """Rotate now, all of it in this thread (tests; `rotate_if_needed` does the copy off the loop)."""
        self._finish(self._shift_and_copy())

    async def rotate_if_needed(self) -> bool:
        """Rotate if the current file holds more than `max_bytes`; True if it did."""
        if not self.too_big():
            return False
        self._finish(await trio.to_thread.run_sync(self._shift_and_copy))
        return True

    async def serve_rotation(
        self, interval_s: float = CHECK_INTERVAL_S, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Check the size now and every `interval_s`, until cancelled."""
        task_status.started()
        while True:
            await self.rotate_if_needed()
            await trio.sleep(interval_s)

    def _shift_and_copy(self) -> int:
        """Shift the older files up and copy the current one to `.1`; the bytes copied."""
        if self.files == 1:
            return 0
        for i in range(self.files - 1, 1, -1):
            newer = _numbered(self.path, i - 1)
            if newer.exists():
                os.replace(newer, _numbered(self.path, i))  # over the oldest: it is dropped
        with self.path.open("rb") as src, open(_numbered(self.path, 1), "wb", opener=_private) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            return dst.tell()

    def _finish(self, copied: int) -> None:
        """What was written after the copy goes to `.1` too, then the current file is emptied.
        Synchronous: no note of the agent's can fall between the two."""
        if self.files > 1:
            with self.path.open("rb") as src, open(_numbered(self.path, 1), "ab", opener=_private) as dst:
                src.seek(copied)
                shutil.copyfileobj(src, dst, 1 << 20)
        os.ftruncate(self._fd, 0)


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _tighten(path: Path, mode: int) -> None:
    """Take group and other access away from a directory of ours (left looser by an earlier agent)."""
    st = os.stat(path)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(path, mode)


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
