"""What /proc says of a process tree: the resident memory of a process, and the processes under
one (children as the kernel lists them per thread, `/proc/PID/task/TID/children`). Every read
tolerates a process that ended meanwhile: it has no memory and no children then.
"""

from __future__ import annotations

from pathlib import Path


def rss(pid: int) -> int:
    """Process `pid`'s resident set in bytes (0 once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmRSS:")), 0)


def children(pid: int) -> list[int]:
    """The processes `pid` started that are alive now, from each of its threads."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread (or the process) ended meanwhile
    return found


def descendants(pid: int) -> list[int]:
    """Every process under `pid` now: its children, theirs, ..."""
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found
