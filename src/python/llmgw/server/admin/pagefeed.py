"""The cluster page's feed: one look at the cluster per change, shared by every open page.

Each open page's stream (`llmgw.server.admin.events`) sends what the feed publishes: the whole cluster
once (the `cluster` event), then what changed (`changes`), nodes and replicas by id. The feed,
not each stream, does the work, so a change costs one look however many pages are open.

Invariants:

- A look is made a slice at a time (at most `SLICE` nodes or replicas, and `SLICE_S` of making
  views), with a checkpoint between slices: no step of the loop looks at more than `SLICE`
  items, however large the cluster.
- Each node's and replica's view is kept encoded with what it was made of (`clusterviews.PageLook`);
  it is made and encoded again only when that changed. A joined node's heartbeat changes
  nothing it is made of, so heartbeats alone never put a node in a frame.
- Version n's `changes` takes a page from version n-1 to n; a stream further behind, or new,
  gets version n's `cluster`, whole. A look that finds nothing changed publishes nothing.
- Looks are at least `MIN_INTERVAL_S` apart, and the feed spends at most `BUSY_SHARE` of the
  loop's time looking (the looks' CPU time), after a burst of at most `BURST_S` (a first look,
  which makes every view): with thousands of nodes the page's updates come further apart
  instead (a credit earned at `BUSY_SHARE` a second, spent by each look, waited for when spent).
- While no page is open nothing is looked at and nothing is kept; the next page to open waits
  for a fresh look.

The frames are the HTML standard's `text/event-stream`; their data is one line of JSON, made of
the kept pieces without decoding them again.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import attrs
import trio

from llmgw.fabrics import FabricMap
from llmgw.log import get_logger
from llmgw.server.errors import StoreError
from llmgw.server.state.clusterviews import Item
from llmgw.server.state.keys import key_view
from llmgw.wakeup import Wakeup, any_of

log = get_logger("llmgw.page")

MIN_INTERVAL_S = 0.25  # a burst of changes (a drain, a node joining) is one frame, not fifty
BUSY_SHARE = 0.1  # of the loop's time, at most, spent looking (measured as the looks' CPU time)
BURST_S = 1.0  # of CPU time the feed may spend at once before BUSY_SHARE holds it back
# Items looked at between checkpoints: at most SLICE, and no more once SLICE_S has passed. An item
# whose view is kept costs 2-5 µs, one made afresh 30-100 µs (a node of 8 GPUs, encoded, on a
# busy 2-core machine): a step stays well under the 20 ms no step of the loop may take.
SLICE = 200
SLICE_S = 0.004

Entry = tuple[tuple[Any, ...], bytes, Any]  # a view kept: what it was made of, encoded, its `row`
Piece = bytes | tuple[bytes, ...]  # a tuple: items of a JSON array, joined by commas when sent


class Look(Protocol):
    """One look at the cluster (`llmgw.server.state.clusterviews.PageLook`)."""

    now: float  # liveness time: the clock of the nodes' `heard_at`
    node_ids: Sequence[str]  # in the order the page lists them
    replica_ids: Sequence[str]

    def node(self, node_id: str) -> Item | None: ...
    def replica(self, replica_id: str) -> Item | None: ...
    def pending(self) -> list[dict[str, Any]]: ...
    def fabrics(self) -> FabricMap: ...  # of the nodes looked at: asked once every node was


class Views(Protocol):
    """What the feed reads of the control plane (`llmgw.server.state.clusterviews.ClusterViews`)."""

    def page_look(self) -> Look: ...
    def model_views(self, replica_views: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]: ...
    def rotation_changed(self) -> trio.Event: ...
    def cluster_changed(self) -> trio.Event: ...


@attrs.frozen(kw_only=True)
class Published:
    version: int
    now: float  # liveness time of the look
    looked_at: float  # trio's time of the look
    # The `cluster` event's data after its head (`Feed.next_for` makes that), each slice's views
    # joined only when a stream sends them: most looks are never sent whole.
    cluster: tuple[Piece, ...]
    changes: tuple[bytes, ...] | None  # the `changes` event from version - 1; None: nothing to go from


def encode(obj: Any) -> bytes:
    # One line: json.dumps never writes a newline without indent, nor a non-ASCII byte.
    return json.dumps(obj, separators=(",", ":")).encode()


async def wait_any(events: Sequence[trio.Event], timeout_s: float) -> bool:
    """Wait until any of `events` is set, for at most `timeout_s`; whether one was."""
    if any(e.is_set() for e in events):
        return True
    with trio.move_on_after(timeout_s):
        await any_of(events)
        return True
    return False


class _Slices:
    """Checkpoints between the slices of a look, and the CPU time spent in them."""

    def __init__(self, timer: Callable[[], float]) -> None:
        self.timer = timer
        self.busy = 0.0
        self.slices = 1
        self._began = timer()

    async def next(self) -> None:
        self.busy += self.timer() - self._began
        await trio.lowlevel.checkpoint()
        self.slices += 1
        self._began = self.timer()

    def done(self) -> float:
        self.busy += self.timer() - self._began
        return self.busy


@attrs.frozen(kw_only=True)
class _Seen:
    """What a look found of one kind of item."""

    items: dict[str, Entry]  # kept once the look is published
    pieces: list[tuple[bytes, ...]]  # every item's view, a slice's in each piece (joined when sent)
    changed: list[bytes]  # the views that changed
    gone: list[str]
    rows: list[Any]  # `row(view)` of each item


async def _look_at(
    kept: dict[str, Entry],
    ids: Sequence[str],
    item: Callable[[str], Item | None],
    slices: _Slices,
    row: Callable[[dict[str, Any]], Any] | None = None,
) -> _Seen:
    items: dict[str, Entry] = {}
    pieces: list[tuple[bytes, ...]] = []
    changed: list[bytes] = []
    rows: list[Any] = []
    at, count = 0, len(ids)
    while at < count:
        if at:
            await slices.next()
        these = []
        end, until = min(count, at + SLICE), time.perf_counter() + SLICE_S
        while at < end:
            item_id = ids[at]
            at += 1
            found = item(item_id)
            if found is None:
                continue  # gone since the look began
            inputs, make = found
            old = kept.get(item_id)
            if old is not None and old[0] == inputs:
                entry = old
            else:
                view = make()
                entry = (inputs, encode(view), row(view) if row is not None else None)
                changed.append(entry[1])
            items[item_id] = entry
            these.append(entry[1])
            if row is not None:
                rows.append(entry[2])
            if entry is not old and time.perf_counter() >= until:
                break  # views made afresh cost 30-100 µs each: the slice ends early
        if these:
            pieces.append(tuple(these))
    gone = [item_id for item_id in kept if item_id not in items]
    return _Seen(items=items, pieces=pieces, changed=changed, gone=gone, rows=rows)


def _model_row(view: dict[str, Any]) -> dict[str, Any]:
    """What `model_views` reads of a replica's view: its model and state, and the replica, its
    nodes and its detail for the progress line of one on its way (downloading, starting)."""
    return {k: view[k] for k in ("replica", "model", "nodes", "state", "detail")}


def _list(pieces: Sequence[Piece]) -> list[Piece]:
    """The pieces of a JSON array's items, with the commas between them."""
    out: list[Piece] = []
    for piece in pieces:
        if out:
            out.append(b",")
        out.append(piece)
    return out


WHOLE = ("fabrics", "notes", "models", "keys", "audit", "usage", "pending")  # small, sent whole when they change
# The usage ledger's totals change with every gateway's report, which is no change of the cluster:
# while a page is open they are read again this often (a look that finds nothing else changed
# costs microseconds a node and sends only them, and nothing when they did not change either).
USAGE_REFRESH_S = 10.0
AUDIT_SHOWN = 20  # the newest entries of the audit log a page shows (`llmgw ctl audit` has the rest)


class Feed:
    def __init__(
        self,
        views: Views,
        *,
        keys: Callable[[], Any] | None = None,
        audit: Callable[[int], Any] | None = None,
        usage: Callable[[], Any] | None = None,
        touched: Callable[[], trio.Event] | None = None,
        timer: Callable[[], float] = time.thread_time,
    ) -> None:
        """`keys()`: the API keys' rows (`KeyRing.rows`); `audit(n)`: the audit log's newest n
        entries, as `audit.view`s (`Page.recent_audit`); `touched()`: set at an operator's next
        change (`Page.touched`); `timer`: the CPU time a look is measured with."""
        self.views = views
        self._keys = keys
        self._audit = audit
        self._usage = usage  # the ledger's totals for the page (`Page.recent_usage`), read every USAGE_REFRESH_S
        self._touched = touched
        self._timer = timer
        self.latest: Published | None = None
        self.published = Wakeup()
        self.credit_s = BURST_S  # CPU time the feed may spend looking now; below 0, a debt
        self._credit_at = 0.0
        self.last_busy_s = 0.0  # the last look's CPU time
        self.last_slices = 0
        self._version = 0
        self._watchers = 0
        self._watchers_moved = Wakeup()
        self._nodes: dict[str, Entry] = {}  # each node's view kept, by id
        self._replicas: dict[str, Entry] = {}
        self._whole: dict[str, bytes] = {}
        self._fabrics: tuple[FabricMap, bytes, bytes] | None = None  # the last map, encoded

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """While a page's stream is open: the feed looks at the cluster only while one is."""
        self._watchers += 1
        self._watchers_moved.fire()
        try:
            yield
        finally:
            self._watchers -= 1
            self._watchers_moved.fire()

    def next_for(self, sent: int) -> tuple[int, Iterable[bytes]] | None:
        """What a stream that has sent version `sent` (0: none) sends next, and its version; None
        while there is nothing newer. The bytes are made as they are taken, a slice at a time."""
        pub = self.latest
        if pub is None or pub.version == sent:
            return None
        if sent and sent == pub.version - 1 and pub.changes is not None:
            return pub.version, pub.changes
        # The head made now: `at` and `now` say when it is sent, for the ages the page counts up
        # (the look may be minutes old: nothing changed since).
        now = pub.now + (trio.current_time() - pub.looked_at)
        head = f'event: cluster\ndata: {{"version":{pub.version},"at":{time.time()!r},"now":{now!r},'
        return pub.version, itertools.chain(
            (head.encode(),), (p if isinstance(p, bytes) else b",".join(p) for p in pub.cluster)
        )

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Started again after a failure: from nothing, so every open page gets the whole cluster.
        self._forget()
        self._credit_at = trio.current_time()
        task_status.started()
        looked_at = -math.inf
        changes: list[trio.Event] = []
        due = False  # the usage's time to be read again came
        while True:
            moved = self._watchers_moved.next()
            if not self._watchers:
                self._forget()
                await moved.wait()
                continue
            if self.latest is None or due or any(e.is_set() for e in changes):
                await trio.sleep_until(max(looked_at + MIN_INTERVAL_S, self._in_credit_at()))
                looked_at = trio.current_time()
                # Taken before the look: a change made during it wakes the next wait.
                changes = [self.views.rotation_changed(), self.views.cluster_changed()]
                if self._touched is not None:
                    changes.append(self._touched())
                await self._look()
                due = False
                continue
            due = not await wait_any([*changes, moved], USAGE_REFRESH_S if self._usage is not None else math.inf)

    def _earn(self) -> float:
        now = trio.current_time()
        self.credit_s = min(BURST_S, self.credit_s + (now - self._credit_at) * BUSY_SHARE)
        self._credit_at = now
        return now

    def _in_credit_at(self) -> float:
        """When the feed may look again: once its credit is no longer spent."""
        now = self._earn()
        return now if self.credit_s >= 0 else now - self.credit_s / BUSY_SHARE

    def _forget(self) -> None:
        self.latest = None
        self._nodes, self._replicas, self._whole, self._fabrics = {}, {}, {}, None

    async def _read_keys(self) -> bytes:
        if self._keys is None:
            return b"[]"
        try:
            return encode([key_view(r) for r in await self._keys()])
        except StoreError as exc:  # the store is away: the keys as last read, the rest goes on
            log.warning("page_feed_keys_unread", reason=str(exc))
            return self._whole.get("keys", b"[]")

    async def _read_audit(self) -> bytes:
        if self._audit is None:
            return b"[]"
        try:
            return encode(await self._audit(AUDIT_SHOWN))
        except StoreError as exc:  # as the keys: the entries as last read
            log.warning("page_feed_audit_unread", reason=str(exc))
            return self._whole.get("audit", b"[]")

    async def _read_usage(self) -> bytes:
        if self._usage is None:
            return b"null"
        try:
            return encode(await self._usage())
        except StoreError as exc:  # as the keys: the totals as last read
            log.warning("page_feed_usage_unread", reason=str(exc))
            return self._whole.get("usage", b"null")

    async def _look(self) -> None:
        keys = await self._read_keys()  # before the look is timed: the store's thread is not the loop's
        audit = await self._read_audit()
        usage = await self._read_usage()
        slices = _Slices(self._timer)
        look, looked_at = self.views.page_look(), trio.current_time()
        nodes = await _look_at(self._nodes, look.node_ids, look.node, slices)
        await slices.next()
        replicas = await _look_at(self._replicas, look.replica_ids, look.replica, slices, _model_row)
        await slices.next()
        # The fabric map (5-15 ms with 5,000 nodes when a node's fabrics changed, else the last one
        # again), then the models (5 ms with 10,000 replicas), each a slice of its own.
        fabrics = look.fabrics()
        if self._fabrics is None or self._fabrics[0] is not fabrics:
            placed = [{"name": f.name, "identity": f.identity, "nodes": list(f.nodes)} for f in fabrics.fabrics]
            self._fabrics = (fabrics, encode(placed), encode(list(fabrics.notes)))
        await slices.next()
        pending = look.pending()
        whole = {
            "fabrics": self._fabrics[1],
            "notes": self._fabrics[2],
            "models": encode(self.views.model_views([*replicas.rows, *pending])),
            "keys": keys,
            "audit": audit,
            "usage": usage,
            "pending": encode(pending),
        }
        whole_changed = [name for name in WHOLE if self._whole.get(name) != whole[name]]
        busy = slices.done()
        self.last_busy_s, self.last_slices = busy, slices.slices
        self._earn()
        self.credit_s -= busy
        changed = len(nodes.changed) + len(nodes.gone) + len(replicas.changed) + len(replicas.gone)
        # Kept only now: a look that fails before this point leaves the feed as the pages have it.
        self._nodes, self._replicas, self._whole = nodes.items, replicas.items, whole
        if self.latest is not None and not changed and not whole_changed:
            return  # nothing a page shows changed: no frame
        self._version += 1
        version, now = self._version, look.now
        rest = b",".join(b'"%s":%s' % (name.encode(), whole[name]) for name in WHOLE if name != "pending")
        pending_rows = (whole["pending"][1:-1],)  # the array's items: in `replicas`, after the placed ones
        cluster = (
            b'"nodes":[',
            *_list(nodes.pieces),
            b'],"replicas":[',
            *_list([*replicas.pieces, *([pending_rows] if pending_rows[0] else [])]),
            b"],",
            rest,
            b"}\n\n",
        )
        delta = None
        if self.latest is not None:
            head = (
                f'event: changes\ndata: {{"version":{version},"base":{version - 1},"at":{time.time()!r},"now":{now!r},'
            )
            delta = (
                head.encode(),
                b'"nodes":[' + b",".join(nodes.changed) + b'],"gone_nodes":' + encode(nodes.gone),
                b',"replicas":[' + b",".join(replicas.changed) + b'],"gone_replicas":' + encode(replicas.gone),
                *(b',"%s":%s' % (name.encode(), whole[name]) for name in whole_changed),
                b"}\n\n",
            )
        self.latest = Published(
            version=version,
            now=now,
            looked_at=looked_at,
            cluster=cluster,
            changes=delta,
        )
        self.published.fire()
