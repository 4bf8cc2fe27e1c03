"""The cluster page's feed from both ends, for tests on MockClock: `FakePlane`, a control plane as
the feed reads it (`llmgw.server.admin.pagefeed.Views`) made of plain dicts, which counts what the feed
asks of it; `Frames`, a stream's bytes cut into events; and `PageCopy`, the cluster as the page
(llmgw/page/app.js) keeps it, merged from those events the way the page merges them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmgw.fabrics import FabricMap
from llmgw.wakeup import Wakeup


class FakeLook:
    def __init__(self, plane: FakePlane, now: float) -> None:
        self.plane = plane
        self.now = now
        self.node_ids = sorted(plane.nodes)
        self.replica_ids = sorted(plane.replicas)

    def _item(self, table: dict[str, dict[str, Any]], item_id: str) -> tuple[tuple, Callable[[], dict]] | None:
        view = table.get(item_id)
        if view is None:
            return None
        self.plane.looked += 1
        as_now = dict(view)

        def make() -> dict[str, Any]:
            self.plane.made += 1
            self.plane.cpu += self.plane.cost_s
            return dict(as_now)

        return tuple(as_now.items()), make

    def node(self, node_id: str) -> tuple[tuple, Callable[[], dict]] | None:
        return self._item(self.plane.nodes, node_id)

    def replica(self, replica_id: str) -> tuple[tuple, Callable[[], dict]] | None:
        return self._item(self.plane.replicas, replica_id)

    def pending(self) -> list[dict[str, Any]]:
        return [dict(p) for p in self.plane.pending]

    def fabrics(self) -> FabricMap:
        return FabricMap(fabrics=(), notes=self.plane.notes)


class FakePlane:
    """`nodes` and `replicas` by id (each a view: flat dicts of plain values), `pending` rows;
    `change()` is what the control plane's changes do (`Changes.rotation`). `looks`: looks the
    feed took; `looked`, `made`: items it looked at and views it had made. Each view made
    advances `cpu` (the feed's `timer`) by `cost_s`."""

    def __init__(self, nodes: int = 1, *, clock: Callable[[], float] | None = None) -> None:
        self.nodes = {f"n{i:05d}": {"id": f"n{i:05d}", "state": "joined", "cordoned": False} for i in range(nodes)}
        self.replicas: dict[str, dict[str, Any]] = {}
        self.pending: list[dict[str, Any]] = []
        self.notes: tuple[str, ...] = ("a note",)
        self.looks = self.looked = self.made = 0
        self.cost_s = 0.0
        self.cpu = 0.0
        self._clock = clock or (lambda: 0.0)
        self._rotation = Wakeup()
        self._cluster = Wakeup()

    def timer(self) -> float:
        return self.cpu

    def page_look(self) -> FakeLook:
        self.looks += 1
        return FakeLook(self, self._clock())

    def model_views(self, replica_views: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        rows = replica_views or []
        return [{"model": "m", "ready": sum(1 for r in rows if r["state"] == "ready")}]

    def rotation_changed(self):
        return self._rotation.next()

    def cluster_changed(self):
        return self._cluster.next()

    def change(self) -> None:
        self._rotation.fire()


class Frames:
    """A stream's events, whatever pieces its bytes come in."""

    def __init__(self, stream: AsyncIterator[bytes]) -> None:
        self.stream = stream
        self._buffer = bytearray()
        self._searched = 0  # where the search for the end of the next event goes on from
        self.pieces = 0  # bytes objects the stream yielded

    async def next(self) -> tuple[str, Any]:
        while (end := self._buffer.find(b"\n\n", self._searched)) < 0:
            self._searched = max(0, len(self._buffer) - 1)
            self._buffer += await self.stream.__anext__()
            self.pieces += 1
        raw = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        self._searched = 0
        return parse(raw)

    async def next_data(self) -> tuple[str, Any]:
        """The next event with data (comments and `retry:` skipped)."""
        while True:
            kind, data = await self.next()
            if kind not in ("comment", "retry"):
                return kind, data


def parse(raw: bytes) -> tuple[str, Any]:
    lines = raw.decode().strip().split("\n")
    if lines[0].startswith(":"):
        return "comment", lines[0]
    if lines[0].startswith("retry:"):
        return "retry", lines[0]
    assert len(lines) == 2, lines  # one `data:` line per event
    return lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))


WHOLE = ("fabrics", "notes", "models", "keys")


class PageCopy:
    """The cluster as app.js keeps it: nodes and placed replicas by id, pending rows, the rest whole."""

    def __init__(self) -> None:
        self.version = 0
        self.nodes: dict[str, dict[str, Any]] = {}
        self.replicas: dict[str, dict[str, Any]] = {}
        self.pending: list[dict[str, Any]] = []
        self.whole: dict[str, Any] = {}

    def apply(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "cluster":
            self.nodes = {n["id"]: n for n in data["nodes"]}
            self.replicas = {r["replica"]: r for r in data["replicas"] if r["replica"] is not None}
            self.pending = [r for r in data["replicas"] if r["replica"] is None]
            self.whole = {k: data[k] for k in WHOLE}
        else:
            assert kind == "changes", kind
            assert data["base"] == self.version, (data["base"], self.version)  # the page asks again if not
            self.nodes.update((n["id"], n) for n in data["nodes"])
            for gone in data["gone_nodes"]:
                del self.nodes[gone]
            self.replicas.update((r["replica"], r) for r in data["replicas"])
            for gone in data["gone_replicas"]:
                del self.replicas[gone]
            if "pending" in data:
                self.pending = data["pending"]
            self.whole.update({k: data[k] for k in WHOLE if k in data})
        self.version = data["version"]
