"""Who wakes whom inside the control plane: each edge is a `Wakeup`.

A waiter takes `wakeup.next()` *before* it looks at the state, then waits on it; whoever changes
that state calls `wakeup.fire()`, which sets the event and replaces it. So a change made while
the waiter is still looking is never lost (its event is already set), and a waiter never sees an
event that fired for a change it has already looked at.
"""

from __future__ import annotations

import attrs
import trio


class Wakeup:
    def __init__(self) -> None:
        self._event = trio.Event()

    def next(self) -> trio.Event:
        """Set at the next `fire()`."""
        return self._event

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()


@attrs.frozen
class Changes:
    """The control plane's three edges."""

    # A node connected, left, reported or was removed: the reconciler (`liveness`) looks again.
    nodes: Wakeup = attrs.field(factory=Wakeup)
    # What `gateway_rotation()` returns may have changed: the gateway's rotation follows.
    rotation: Wakeup = attrs.field(factory=Wakeup)
    # The reconciler has looked at a change and pushed its result: the spreader looks after it.
    settled: Wakeup = attrs.field(factory=Wakeup)

    def node_changed(self) -> None:
        self.nodes.fire()
        self.rotation.fire()
