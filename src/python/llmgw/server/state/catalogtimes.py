"""When each model entered the catalog: `created` in the gateway's GET /v1/models.

The store's table is read at start (`Snapshot.catalog`); a model the catalog names that it does
not know yet — at start, or new at a reload — is noted with the time now, in memory at once
(the rotation the gateways get carries it), and written in the background (`writer`, a
`LatestWriter`: the reload does not wait on the store's thread). A model removed and added
again keeps its first time.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from llmgw.server.store.asyncstore import LatestWriter


class CatalogTimes:
    def __init__(
        self,
        known: Mapping[str, float],
        record: Callable[[dict[str, float]], Awaitable[None]],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.created: dict[str, float] = dict(known)  # read live by the gateway's rotation
        self.writer: LatestWriter[dict[str, float]] = LatestWriter("catalog", record)
        self.clock = clock

    def note(self, names: Iterable[str]) -> bool:
        """Note the names not known yet; whether there was one."""
        new = [n for n in names if n not in self.created]
        if not new:
            return False
        now = self.clock()
        self.created.update((n, now) for n in new)
        self.writer.offer(dict(self.created))
        return True
