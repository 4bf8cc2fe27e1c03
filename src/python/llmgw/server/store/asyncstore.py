"""The running control plane's store: the synchronous `Store`, used off the event loop.

`AsyncStore` owns one `Store` (one connection, to SQLite or PostgreSQL) and runs each call in a
worker thread through a `CapacityLimiter(1)`: one call at a time, so the connection has one user
at any moment, and the trio loop never waits on the database — neither on a disk, nor on another
process's lock, nor on the network. A caller cancelled while its call runs returns at once; the
thread finishes that one call (bounded by the busy timeout, and for PostgreSQL by libpq's
connect and TCP timeouts) and only then lets the next one have the connection.

The busy timeout is short (`BUSY_TIMEOUT_S`): while the control plane runs no other llmgw
process writes to its database (`llmgw ca issue` and `llmgw node add` go through the admin
API), and a write of another program that holds the lock for milliseconds is ridden out, as is
a slow fsync, while a lock held for longer (a `sqlite3` or `psql` shell in a transaction) fails
the one call with `StoreBusy` after 1 s instead of stalling every call queued behind it for 10.
Reads do not wait for such a lock (SQLite in WAL mode and PostgreSQL alike: readers never wait
for a writer), though one may wait, up to that second, behind a write of ours that does. A
PostgreSQL store that cannot be reached fails each call with `StoreUnavailable` (the admin API
answers 503 with Retry-After); the next call connects again. A write the leader's fence refused
(`NotLeader`: its lease passed to another control plane) is told to `on_not_leader`, on the loop,
before the caller hears of it: the control plane steps down (`llmgw.server.leadership.seat`).

`LatestWriter` is for state the loop keeps in memory and persists as a whole (the replica
placements): the loop offers each new version and goes on; `serve` writes the latest one in
the background, retrying with backoff while the database refuses, and writes it once more,
bounded, at shutdown.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import attrs
import trio

from llmgw.backoff import Backoff, Failures
from llmgw.config import StoreSection
from llmgw.log import get_logger
from llmgw.server.errors import NotLeader, StoreError
from llmgw.server.store import AuditRow, CertRow, HubModelRow, KeyRow, NodeRow, Store
from llmgw.server.store.budgetrows import AsyncBudgetCalls
from llmgw.server.store.lease import STANDBY, Fence
from llmgw.server.store.ledger import AsyncLedgerCalls
from llmgw.wakeup import Wakeup

log = get_logger("llmgw.store")

T = TypeVar("T")

BUSY_TIMEOUT_S = 1.0


@attrs.frozen(kw_only=True)
class Snapshot:
    """What the store held when the control plane opened it, read before anything runs."""

    nodes: tuple[NodeRow, ...]
    placements: dict[str, dict]
    api_keys: tuple[KeyRow, ...]
    catalog: dict[str, float] = attrs.field(factory=dict)  # when each model entered the catalog
    hub_models: tuple[HubModelRow, ...] = ()  # the models added from the Hub
    model_versions: dict[str, dict] = attrs.field(factory=dict)  # what the placements run, by MODEL@VERSION


@attrs.define
class _Sightings:
    seen: dict[str, str]  # node id -> the address it connected from
    done: trio.Event = attrs.field(factory=trio.Event)
    rows: dict[str, NodeRow] = attrs.field(factory=dict)
    error: BaseException | None = None


class AsyncStore(AsyncLedgerCalls, AsyncBudgetCalls):
    def __init__(self, store: Store, at_open: Snapshot) -> None:
        self._store = store
        self._limiter = trio.CapacityLimiter(1)
        self._held = trio.CapacityLimiter(1)  # a call made while `_limiter` is held (`saw_node`'s batch)
        self._sightings: _Sightings | None = None  # nodes seen, waiting for their batch's turn
        self.path = store.path
        self.busy_timeout_s = store.busy_timeout_s
        self.at_open = at_open
        # Told of a write the fence refused (the lease passed to another): the leader steps down.
        self.on_not_leader: Callable[[NotLeader], None] = lambda exc: None

    @classmethod
    def open(
        cls,
        state_dir: Path,
        settings: StoreSection | None = None,
        *,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        fence: Fence | None = None,
    ) -> AsyncStore:
        """Open the store `settings` (server.toml's `[store]`; None: the state directory's SQLite
        file) names, migrated to this llmgw's schema, check it (SQLite: `PRAGMA quick_check`, a
        damaged file is `StoreCorrupt`, said at start rather than at the first write that touches
        a bad page; PostgreSQL: it answers) and read what the control plane starts from.
        Synchronous: it runs before anything else does. `fence`: the lease every write checks
        (a leader's term when several control planes share the store; `Store`)."""
        store = Store.open(
            state_dir, settings, busy_timeout_s=busy_timeout_s, check_same_thread=False, server=True, fence=fence
        )
        try:
            store.check()
            at_open = Snapshot(
                nodes=tuple(store.nodes()),
                placements=store.placements(),
                api_keys=tuple(store.api_keys()),
                catalog=store.catalog_models(),
                hub_models=tuple(store.hub_models()),
                model_versions=store.model_versions(),
            )
        except BaseException:
            store.close()
            raise
        return cls(store, at_open)

    @classmethod
    def open_standby(
        cls, state_dir: Path, settings: StoreSection, *, busy_timeout_s: float = BUSY_TIMEOUT_S
    ) -> AsyncStore:
        """A standby's store: every write refused (`lease.STANDBY`), opened as it is — neither
        migrated (its leader does that) nor held to this llmgw's schema (a standby of a newer
        llmgw waits for the lease before migrating it, one of an older llmgw may outlive a
        migration; what a standby reads, the certificates' revocations, every version has) —
        and nothing read at open."""
        store = Store.open(
            state_dir,
            settings,
            busy_timeout_s=busy_timeout_s,
            check_same_thread=False,
            server=True,
            fence=STANDBY,
            migrations=False,
        )
        return cls(store, Snapshot(nodes=(), placements={}, api_keys=()))

    def close(self) -> None:
        """Close the connection (a test's, or a start that failed after opening: a running
        control plane's closes with its process)."""
        self._store.close()

    async def aclose(self) -> None:
        """Close the connection once the call in flight, if any, has finished with it (a leader
        that steps down and goes on as a standby)."""
        await trio.to_thread.run_sync(self._store.close, limiter=self._limiter)

    async def record_catalog(self, created: dict[str, float]) -> None:
        await self._run(self._store.record_catalog, created)

    async def add_hub_model(self, row: HubModelRow) -> bool:
        return await self._run(self._store.add_hub_model, row)

    async def update_hub_model(self, row: HubModelRow) -> bool:
        return await self._run(self._store.update_hub_model, row)

    async def remove_hub_model(self, name: str) -> bool:
        return await self._run(self._store.remove_hub_model, name)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter, abandon_on_cancel=True)
        except NotLeader as exc:
            self.on_not_leader(exc)
            raise

    # -- nodes ----------------------------------------------------------------------------

    async def nodes(self) -> list[NodeRow]:
        return await self._run(self._store.nodes)

    async def saw_node(self, node_id: str, address: str) -> NodeRow:
        """Record that the node connected from `address` now; its row as it is then. The nodes
        seen while the store is busy are written together, in one transaction, when its turn
        comes (thousands of agents dialling at once had a transaction each, one at a time, and
        their hellos waited past the agents' deadline for them)."""
        batch = self._sightings
        if batch is not None:  # a batch waits its turn: join it
            batch.seen[node_id] = address
            await batch.done.wait()
        else:
            batch = self._sightings = _Sightings({node_id: address})
            try:
                async with self._limiter:  # the calls before it first; the batch grows meanwhile
                    self._sightings = None  # closed: a node seen from now on starts the next
                    seen = dict(batch.seen)
                    batch.rows = await trio.to_thread.run_sync(
                        self._store.saw_nodes, seen, limiter=self._held, abandon_on_cancel=True
                    )
            except BaseException as exc:
                if self._sightings is batch:
                    self._sightings = None
                batch.error = exc if isinstance(exc, StoreError) else StoreError(f"the write was cut short: {exc!r}")
                if isinstance(exc, NotLeader):
                    self.on_not_leader(exc)
                raise
            finally:
                batch.done.set()
        if batch.error is not None:
            raise batch.error
        row = batch.rows.get(node_id)
        if row is None:
            raise StoreError(f"node {node_id}'s row was not there once written")
        return row

    async def set_cordoned(self, node_id: str, cordoned: bool, *, known_at: str | None = None) -> None:
        """`known_at`: the address of a node the caller knows, which gets a row if it has none
        (its connection was not recorded while the store was busy)."""
        await self._run(self._set_mark, self._store.set_cordoned, node_id, cordoned, known_at)

    async def set_draining(self, node_id: str, draining: bool, *, known_at: str | None = None) -> None:
        await self._run(self._set_mark, self._store.set_draining, node_id, draining, known_at)

    async def set_drained(self, node_id: str, *, known_at: str | None = None) -> None:
        """A drain's end: cordoned and no longer draining, in one write."""

        def drained() -> None:
            if known_at is not None:
                self._store.know_node(node_id, known_at)
            self._store.set_drained(node_id)

        await self._run(drained)

    def _set_mark(self, set_mark: Callable[[str, bool], None], node_id: str, on: bool, known_at: str | None) -> None:
        if known_at is not None:
            self._store.know_node(node_id, known_at)
        set_mark(node_id, on)

    async def remove_node(self, node_id: str, *, also_revoke: int | None = None) -> list[str]:
        return await self._run(lambda: self._store.remove_node(node_id, also_revoke=also_revoke))

    # -- certificates ---------------------------------------------------------------------

    async def is_revoked(self, serial: int) -> bool:
        return await self._run(self._store.is_revoked, serial)

    async def revoke_serial(self, serial: int, node_id: str) -> None:
        await self._run(self._store.revoke_serial, serial, node_id)

    async def certificate(self, serial: int) -> CertRow | None:
        return await self._run(self._store.certificate, serial)

    async def record_issued(
        self, serial: int, node_id: str, not_after: float, *, revoke_others: bool, also_revoke: Sequence[int]
    ) -> list[str]:
        """`Store.record_issued`: for the admin API, which `llmgw node add` and `llmgw ca issue` call."""
        return await self._run(
            lambda: self._store.record_issued(
                serial, node_id, not_after, revoke_others=revoke_others, also_revoke=also_revoke
            )
        )

    # -- placements -----------------------------------------------------------------------

    async def placements(self) -> dict[str, dict]:
        return await self._run(self._store.placements)

    async def set_placements(self, placements: dict[str, dict], versions: dict[str, dict] | None = None) -> None:
        await self._run(self._store.set_placements, placements, versions)

    def scrub_placements_at_start(self, placements: dict[str, dict]) -> bool:
        """Replace the placements and leave no trace of the old rows in the files
        (`Store.scrub_placements`, whose answer this is). Synchronous, like `open`: before
        anything runs."""
        scrubbed = self._store.scrub_placements(placements)
        self.at_open = attrs.evolve(self.at_open, placements=placements)
        return scrubbed

    # -- gateway API keys -----------------------------------------------------------------

    async def api_keys(self) -> list[KeyRow]:
        return await self._run(self._store.api_keys)

    async def add_api_key(self, row: KeyRow) -> bool:
        return await self._run(self._store.add_api_key, row)

    async def revoke_api_key(self, name: str) -> bool:
        return await self._run(self._store.revoke_api_key, name)

    # -- the audit log --------------------------------------------------------------------

    async def record_audit(
        self, *, actor: str, source: str, action: str, target: str = "", detail: dict | None = None
    ) -> AuditRow:
        """`Store.record_audit`: through `llmgw.server.admin.audit`, which keeps secrets out."""
        return await self._run(
            lambda: self._store.record_audit(actor=actor, source=source, action=action, target=target, detail=detail)
        )

    async def audit(self, **filters: Any) -> list[AuditRow]:
        """`Store.audit`: newest first; filters `since`, `until`, `action`, `actor`, `target`, `limit`."""
        return await self._run(lambda: self._store.audit(**filters))

    async def prune_audit(self, before: float) -> int:
        return await self._run(self._store.prune_audit, before)


WRITE_BACKOFF = Backoff(first_s=0.5, max_s=30.0)  # a write the database refused, tried again


class LatestWriter(Generic[T]):
    """Writes the latest offered version of one thing with `write`, in the background.

    `offer` never waits and never fails; `serve` writes what was offered last, skipping versions
    superseded meanwhile. While writes fail (`StoreError`) it retries by `backoff` (from 0.5 s
    doubling to 30 s, `WRITE_BACKOFF`), and logs once when writing starts failing and
    once when it works again. On cancellation it makes one last attempt, shielded and bounded
    by `flush_timeout_s`, and logs if the latest version stayed unwritten."""

    def __init__(
        self,
        what: str,
        write: Callable[[T], Awaitable[None]],
        *,
        backoff: Backoff = WRITE_BACKOFF,
        flush_timeout_s: float = BUSY_TIMEOUT_S + 1.0,
    ) -> None:
        self.what = what
        self._write = write
        self.backoff = backoff
        self.flush_timeout_s = flush_timeout_s
        self._latest: T | None = None
        self._offered = 0  # versions offered so far
        self._written = 0  # the last version written
        self.to_write = Wakeup()  # a new version was offered
        self._failing_since: float | None = None
        self._failures = 0

    @property
    def pending(self) -> bool:
        """Whether the latest version offered is not written yet."""
        return self._written < self._offered

    def offer(self, value: T) -> None:
        self._latest = value
        self._offered += 1
        self.to_write.fire()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            failures = Failures(self.backoff)
            while True:
                offered = self.to_write.next()
                if not self.pending:
                    await offered.wait()
                    continue
                if await self._write_latest():
                    failures.reset()
                else:
                    failures.failed(trio.current_time())
                    await trio.sleep(failures.delay())
        finally:
            with trio.move_on_after(self.flush_timeout_s) as flush:
                flush.shield = True
                if self.pending:
                    await self._write_latest()
            if self.pending:
                log.warning(
                    "store_write_lost",
                    what=self.what,
                    reason="the last write timed out"
                    if flush.cancelled_caught
                    else "the database refused the last write",
                    after="the next start begins from the version written before",
                )

    async def _write_latest(self) -> bool:
        version, value = self._offered, self._latest
        try:
            await self._write(value)  # type: ignore[arg-type]
        except StoreError as exc:
            self._failures += 1
            if self._failing_since is None:
                self._failing_since = trio.current_time()
                log.warning("store_write_failing", what=self.what, reason=str(exc), retry="with backoff until it works")
            return False
        self._written = max(self._written, version)
        if self._failing_since is not None:
            log.info(
                "store_write_recovered",
                what=self.what,
                failed_for_s=round(trio.current_time() - self._failing_since, 3),
                attempts=self._failures + 1,
            )
            self._failing_since, self._failures = None, 0
        return True
