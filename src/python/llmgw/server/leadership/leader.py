"""Which control plane leads, when several share one PostgreSQL store: the lease taken, kept, lost.

`Term` is one term of leading, judged without I/O: its epoch (every write of the leader carries
it, `llmgw.server.store.lease.Fence`), and until when this process may act as the leader by its
own monotonic clock (`valid_until`). A renewal that succeeded moves it to the time the renewal
was SENT plus the TTL, less a margin: the database counted the TTL from when it ran the
statement, which is later, so this process always stops believing in its lease before the
database lets another take it. `leading()` is checked synchronously wherever the leader acts
outside the store (pushing desired state, accepting a link): a process resumed after a pause
(SIGSTOP, a VM frozen) acts as leader no more from its first step, before anything else runs,
since trio's clock (CLOCK_MONOTONIC) kept counting while it was stopped. Its store writes are
refused by the database besides (the fence), which is what makes it safe whatever runs first.

A term ends for good (`lose`, with the reason) when a renewal is refused (another took the
lease), when none succeeded before `valid_until`, or when a write was refused by the fence. The
process then steps down (`llmgw.server.leadership.seat`): it stops everything a leader runs and becomes a
standby, and may take the lease again only as a new term, reading the state afresh, as a restart
would.

`LeaseKeeper` does the I/O: its own connection to the store (not the store's: a renewal never
waits behind the control plane's calls), in a worker thread, one statement at a time.
`acquire` tries every `renew_s` until the lease is taken, keeping what it last read (`seen`:
who leads, for a standby's answers), and never takes it of a store whose schema a newer llmgw
has migrated (`newer_schema`, said once); `keep` renews every `renew_s` until the term is lost;
`release` ends the lease at once when the process stops, so that a standby takes over at its
next try.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from llmgw.log import get_logger
from llmgw.server.errors import StoreError
from llmgw.server.store import lease, schema
from llmgw.server.store.lease import Holder, LeaseRow, Statements

log = get_logger("llmgw.leadership")

RELEASE_TIMEOUT_S = 2.0  # at stop: ending the lease is worth this much of the stop, no more


def new_holder_id() -> str:
    """A token naming this process in the lease (its host and pid would not survive a container)."""
    return secrets.token_hex(8)


def margin(ttl_s: float) -> float:
    """How much sooner than the database this process gives up its lease: a tenth of the TTL,
    for clocks that run at slightly different rates and a statement's time in flight."""
    return ttl_s / 10


@attrs.define(kw_only=True, eq=False)
class Term:
    """One term of leading (see the module docstring). `clock`: trio's, or a test's."""

    epoch: int
    ttl_s: float
    valid_until: float
    clock: Callable[[], float] = trio.current_time
    lost_reason: str = ""
    _on_lost: list[Callable[[str], None]] = attrs.field(factory=list)

    @classmethod
    def taken(cls, epoch: int, ttl_s: float, sent_at: float, clock: Callable[[], float] = trio.current_time) -> Term:
        """The term a taking of the lease sent at `sent_at` began."""
        return cls(epoch=epoch, ttl_s=ttl_s, valid_until=sent_at + ttl_s - margin(ttl_s), clock=clock)

    def leading(self) -> bool:
        """Whether this process may act as the leader now."""
        return not self.lost_reason and self.clock() < self.valid_until

    def renewed(self, sent_at: float) -> None:
        """A renewal sent at `sent_at` succeeded."""
        if not self.lost_reason:
            self.valid_until = max(self.valid_until, sent_at + self.ttl_s - margin(self.ttl_s))

    def on_lost(self, call: Callable[[str], None]) -> None:
        """Call `call(reason)` when the term is lost (at once if it is)."""
        if self.lost_reason:
            call(self.lost_reason)
        else:
            self._on_lost.append(call)

    def lose(self, reason: str) -> None:
        """The term is over, for `reason`; the first reason stays."""
        if self.lost_reason:
            return
        self.lost_reason = reason
        calls, self._on_lost = self._on_lost, []
        for call in calls:
            call(reason)


class LeaseKeeper:
    """The lease's statements, for one control plane (`holder`), on a connection of their own."""

    def __init__(
        self,
        db: Statements,
        holder: Holder,
        *,
        ttl_s: float,
        renew_s: float,
        clock: Callable[[], float] = trio.current_time,
        run: Callable[..., Awaitable[Any]] | None = None,
        knows: int | None = None,
    ) -> None:
        """`run(fn, *args)`: how a statement is run (default: in a worker thread, one at a time;
        tests run them on the loop, whose fake clock would otherwise jump while a thread works).
        `knows`: the newest schema this llmgw knows (default `schema.LATEST`); it takes no lease
        of a store migrated past it."""
        self.db = db
        self.holder = holder
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.clock = clock
        self.knows = schema.LATEST if knows is None else knows
        self.seen: LeaseRow | None = None  # the lease as last read; None: not read, or unreadable
        self.tries = 0  # tries at taking the lease (`acquire`), done: a standby's /metrics counts them
        self.newer_schema = 0  # the store's schema, while it is newer than this llmgw's (it cannot lead)
        self._limiter = trio.CapacityLimiter(1)
        self._run = run or self._in_thread
        self._failing = ""  # the reason the lease's statements fail, while they do

    def advertise(self, agent_url: str, admin_url: str) -> None:
        """Where this control plane is reached, now that it knows (the next taking or renewal says it)."""
        self.holder = attrs.evolve(self.holder, agent_url=agent_url, admin_url=admin_url)

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter, abandon_on_cancel=True)

    def _failed(self, what: str, exc: StoreError) -> None:
        if str(exc) != self._failing:  # once per reason, not once per try
            log.warning("lease_unreachable", doing=what, reason=str(exc))
        self._failing = str(exc)

    def _works(self) -> None:
        if self._failing:
            log.info("lease_reachable")
        self._failing = ""

    async def acquire(self) -> Term:
        """Try to take the lease every `renew_s` until it is taken; the term it began. Meanwhile
        `seen` is the lease as last read (who leads, and where). A taking whose answer was lost
        (the connection broke at its COMMIT) is not counted: the lease it took runs out, and a
        later try takes it as the term after."""
        while True:
            sent = self.clock()
            try:
                taken = await self._run(lease.acquire, self.db, self.holder, self.ttl_s, self.knows)
                self.seen = taken if taken is not None else await self._run(lease.read, self.db)
                if taken is None and not self.seen.held:
                    self._schema_is(await self._run(lease.schema_version, self.db))
            except StoreError as exc:
                self._failed("taking the lease", exc)
                self.seen = None
            else:
                self._works()
                if taken is not None:
                    self._schema_is(0)
                    return Term.taken(taken.epoch, self.ttl_s, sent, self.clock)
            finally:
                self.tries += 1
            await trio.sleep(self.renew_s)

    def _schema_is(self, version: int) -> None:
        """The store's schema as a free lease was refused at: said once while it is newer than
        this llmgw knows, which then never leads this store (a newer llmgw has migrated it)."""
        newer = version if version > self.knows else 0
        if newer and newer != self.newer_schema:
            log.error(
                "lease_refused",
                reason=f"the store's schema is at version {newer}, newer than this llmgw's {self.knows}: a newer "
                "llmgw has migrated it, and this control plane stands by without ever leading",
                fix="upgrade llmgw on this machine and restart `llmgw server`",
            )
        self.newer_schema = newer

    async def keep(self, term: Term, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew `term`'s lease every `renew_s` until it is lost: refused (another took it), or
        no renewal succeeded before its `valid_until`, or `lose` was called elsewhere (a write
        refused by the fence). Returns then, the term lost."""
        task_status.started()
        sent = self.clock()
        while term.leading():
            with trio.move_on_at(min(sent + self.renew_s, term.valid_until)):
                await trio.sleep_forever()
            if not term.leading():
                break
            sent = self.clock()
            try:
                with trio.move_on_at(term.valid_until):
                    kept = await self._run(lease.renew, self.db, self.holder, term.epoch, self.ttl_s)
                    if not kept:
                        self.seen = await self._run(lease.read, self.db)
                        who = self.seen.holder if self.seen is not None else "?"
                        term.lose(f"the lease of epoch {term.epoch} passed to another control plane ({who}) or lapsed")
                        return
                    term.renewed(sent)
                    self._works()
            except StoreError as exc:
                self._failed("renewing the lease", exc)
        overdue = self.clock() - term.valid_until
        term.lose(
            f"no renewal of the lease of epoch {term.epoch} succeeded within its {term.ttl_s:g} s"
            + (f" (this process was stopped or starved for {overdue:.1f} s past it)" if overdue > self.renew_s else "")
            + (f": {self._failing}" if self._failing else "")
        )

    async def release(self, term: Term) -> None:
        """End `term`'s lease now, bounded (the process stops); a standby takes over at its next try."""
        with trio.move_on_after(RELEASE_TIMEOUT_S) as scope:
            scope.shield = True
            try:
                left = await self._run(lease.release, self.db, self.holder, term.epoch)
            except StoreError as exc:
                log.warning("lease_not_released", epoch=term.epoch, reason=str(exc), after="it expires by itself")
                return
            if left is not None:  # a standby takes it at its next try instead of this much later
                log.info("lease_released", epoch=term.epoch, cut_short_s=round(left, 2))
