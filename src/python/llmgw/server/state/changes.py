"""The control plane's edges: what changed, for whom. Each edge is a `Wakeup` (llmgw.wakeup lists
them all), and the desired states a change asks the reconciler to push ride along with it.

Whoever changes what a node's desired state is made of says so here: `intent_changed(node)` (a
cordon, a drain: the node's own desired state changes, its assignments need not) or
`catalog_changed()` (a reload: the engines and models, so every connected node's). The
reconciler takes them at the start of its next pass (`take_pushes`) and pushes them with the
nodes whose assignments that pass changed: after a change of nodes, intent or catalog, the
reconciler alone pushes. (A move pushes the nodes of its own steps, and the mirror everyone's
once an archive arrives.)

Whoever looks over the whole cluster at each change (the reconciler's pass, the spreader, the
gateways' rotation) `rest`s after a look while changes keep coming: five thousand nodes joining
make five thousand changes, and a look over five thousand nodes at each would hold the loop for
minutes; with the rest, the changes meanwhile are taken in one look, and the looks take at most
a quarter of the loop (the rest is the agents': their handshakes and hellos).
"""

from __future__ import annotations

import trio

from llmgw.wakeup import Wakeup

# A look that took T is followed by REST_FACTOR × T of rest, at most MAX_REST_S.
REST_FACTOR = 3.0
MAX_REST_S = 1.0


async def rest(took_s: float) -> None:
    """The rest after a look over the cluster that took `took_s` (wall time, perf_counter)."""
    await trio.sleep(min(REST_FACTOR * took_s, MAX_REST_S))


class Changes:
    def __init__(self) -> None:
        # A node connected, left, reported or was removed, or its intent or the catalog changed:
        # the reconciler (`liveness`) looks again.
        self.nodes = Wakeup()
        # What `gateway_rotation()` returns may have changed: the gateway's rotation follows.
        self.rotation = Wakeup()
        # The reconciler has looked at a change and pushed its result: the spreader looks after it.
        self.settled = Wakeup()
        self._push: set[str] = set()
        self._push_everyone = False

    def node_changed(self) -> None:
        self.nodes.fire()
        self.rotation.fire()

    def intent_changed(self, node_id: str) -> None:
        """`node_id`'s desired state changed (cordon, drain): the reconciler's next pass pushes it."""
        self._push.add(node_id)
        self.node_changed()

    def catalog_changed(self) -> None:
        """The engines or models changed (a reload): the next pass pushes every connected node's."""
        self._push_everyone = True
        self.node_changed()

    def take_pushes(self) -> tuple[set[str], bool]:
        """What to push besides the nodes whose assignments change: (nodes, everyone). Taken once."""
        pushes, everyone = self._push, self._push_everyone
        self._push, self._push_everyone = set(), False
        return pushes, everyone
