"""What waits for a link's one writer: the messages its side has queued and not yet written.

Every sender of a link queues here (through its session, `llmgw.wire.session`); one task takes
from the front and writes. The order of taking is the order of queueing, with two rules that
keep the memory of a link bounded whatever its peer does (a peer that stops reading leaves its
frames here until the writer's deadline ends the link):

- a kind in `latest` is level-triggered: each message of it says the whole of something (the
  desired state, the set of replicas), so a newer one replaces an unsent older one, in the older
  one's place. However long the writer waits, one of each is held.
- a kind in `limits` is held at most that many times unsent; `room` says whether one more fits,
  and `put` refuses one past it (the caller's bug: it asks first, and waits or answers itself).

Anything else (the first frame, the last) is queued as it comes; there is one of each per link.
No I/O: the session encodes what is taken, the adapter writes it and wakes the writer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from typing import Any

from llmgw.wire.errors import LocalLinkError


class _Entry:
    __slots__ = ("kind", "item")

    def __init__(self, kind: type, item: Any) -> None:
        self.kind = kind
        self.item = item


class Outbox:
    def __init__(self, *, latest: Collection[type] = (), limits: Mapping[type, int] | None = None) -> None:
        self.latest = frozenset(latest)
        self.limits = dict(limits or {})
        self._queue: deque[_Entry] = deque()
        self._unsent_latest: dict[type, _Entry] = {}  # kind in `latest` -> its entry in the queue
        self._counts: dict[type, int] = {}  # kind in `limits` -> how many are queued

    def __len__(self) -> int:
        return len(self._queue)

    def room(self, kind: type) -> bool:
        """Whether a message of `kind` may be queued now without passing its limit."""
        limit = self.limits.get(kind)
        return limit is None or self._counts.get(kind, 0) < limit

    def put(self, kind: type, item: Any) -> None:
        """Queue `item` (a message, or what the session makes one from when it is taken)."""
        pending = self._unsent_latest.get(kind)
        if pending is not None:
            pending.item = item  # the newer says all the older did: it goes in the older's place
            return
        if not self.room(kind):
            raise LocalLinkError(f"{self.limits[kind]} {kind.__name__} already wait to be written; ask `room` first")
        entry = _Entry(kind, item)
        self._queue.append(entry)
        if kind in self.latest:
            self._unsent_latest[kind] = entry
        if kind in self.limits:
            self._counts[kind] = self._counts.get(kind, 0) + 1

    def unsent(self, kind: type) -> Any | None:
        """The item of a `latest` kind queued and not yet taken, if one is."""
        pending = self._unsent_latest.get(kind)
        return None if pending is None else pending.item

    def take(self) -> tuple[type, Any] | None:
        """The next (kind, item) to write, oldest first; None if nothing waits."""
        if not self._queue:
            return None
        entry = self._queue.popleft()
        if self._unsent_latest.get(entry.kind) is entry:
            del self._unsent_latest[entry.kind]
        if entry.kind in self.limits:
            self._counts[entry.kind] -= 1
        return entry.kind, entry.item

    def clear(self) -> None:
        """Drop everything unsent (the link is closing: its peer gets all of it again on reconnecting)."""
        self._queue.clear()
        self._unsent_latest.clear()
        self._counts.clear()
