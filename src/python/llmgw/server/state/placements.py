"""The placements in memory: each placed replica as the control plane holds it (`Stored`: its
placement, its engine key in plain text and sealed, its rendezvous port, the version of its model
it runs), by replica id and indexed by node (`Placements`). `llmgw.server.state.replicas.Replicas` is their one writer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from llmgw.server.state.scheduler import Placement


@attrs.frozen(kw_only=True)
class Stored:
    placement: Placement
    api_key: str = attrs.field(repr=False)  # in memory only: the database holds `sealed_key`
    sealed_key: str = attrs.field(repr=False)
    dist_init_port: int = 0
    # The version of its model it runs (`llmgw.server.state.versions`); "" in a row written before
    # versions were kept, taken as the catalog's at the next reconcile.
    version: str = ""


class Placements(dict):
    """The placements by replica id (`Stored`), indexed by node as they change: a node's desired
    state lists its own (`on`), and with thousands of nodes joining a look over all of them for
    each made the join quadratic. Changed only by item: `placed[k] = v`, `del placed[k]`, `pop`."""

    def __init__(self, items: Iterable[tuple[str, Stored]] = ()) -> None:
        super().__init__()
        self._by_node: dict[str, set[str]] = {}
        for k, v in items:
            self[k] = v

    def on(self, node_id: str) -> set[str]:
        """The replica ids placed on `node_id` (a member on it)."""
        return self._by_node.get(node_id, set())

    def __setitem__(self, key: str, value: Stored) -> None:
        if key in self:
            self._unindex(key, self[key])
        super().__setitem__(key, value)
        for n in value.placement.nodes:
            self._by_node.setdefault(n, set()).add(key)

    def __delitem__(self, key: str) -> None:
        self._unindex(key, self[key])
        super().__delitem__(key)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            value = self[key]
            del self[key]
            return value
        if default:
            return default[0]
        raise KeyError(key)

    def _unindex(self, key: str, value: Stored) -> None:
        for n in value.placement.nodes:
            here = self._by_node.get(n)
            if here is not None:
                here.discard(key)
                if not here:
                    del self._by_node[n]

    def _unsupported(self, *args: Any, **kw: Any) -> None:
        raise TypeError("Placements change by item only (placed[k] = v, del placed[k], pop)")

    update = setdefault = popitem = clear = __ior__ = _unsupported  # type: ignore[assignment]
