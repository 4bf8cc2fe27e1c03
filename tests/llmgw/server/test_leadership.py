"""The lease kept and lost, without a database or real time: `Term` on given times, and
`LeaseKeeper` against a lease in memory with a clock of its own (the database's, ahead of ours
by an hour: only its own clock judges expiry), on trio's MockClock. What the SQL does in a real
PostgreSQL is test_lease_postgres.py's."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from llmgw.server.errors import StoreUnavailable
from llmgw.server.leadership.leader import LeaseKeeper, Term, margin
from llmgw.server.store import lease
from llmgw.server.store.lease import Holder, LeaseRow

TTL, RENEW = 5.0, 1.0
A = Holder(id="a", agent_url="wss://cp-a:7443", admin_url="http://cp-a:8080")
B = Holder(id="b", agent_url="wss://cp-b:7443", admin_url="http://cp-b:8080")


# -- Term, on given times -------------------------------------------------------------------


class Times:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_term_leads_until_the_ttl_from_when_its_taking_was_sent_less_a_margin() -> None:
    times = Times()
    term = Term.taken(3, TTL, sent_at=99.0, clock=times)
    assert term.valid_until == 99.0 + TTL - margin(TTL) == 103.5
    assert term.leading()
    times.now = 103.49
    assert term.leading()
    times.now = 103.5
    assert not term.leading() and term.lost_reason == ""  # lapsed: the keeper says why when it looks


def test_a_renewal_counts_from_when_it_was_sent_and_never_shortens_the_term() -> None:
    times = Times()
    term = Term.taken(1, TTL, sent_at=100.0, clock=times)
    term.renewed(sent_at=102.0)
    assert term.valid_until == 102.0 + TTL - margin(TTL)
    term.renewed(sent_at=101.0)  # an older renewal's answer, come late
    assert term.valid_until == 102.0 + TTL - margin(TTL)


def test_a_lost_term_stays_lost_and_tells_each_listener_once_with_the_first_reason() -> None:
    times = Times()
    term = Term.taken(1, TTL, sent_at=100.0, clock=times)
    heard: list[str] = []
    term.on_lost(heard.append)
    term.lose("a write was refused")
    term.lose("the renewal failed")
    term.renewed(sent_at=100.5)  # a renewal that raced the loss changes nothing
    assert heard == ["a write was refused"] and term.lost_reason == "a write was refused"
    assert not term.leading()
    late: list[str] = []
    term.on_lost(late.append)  # a listener added after: told at once
    assert late == ["a write was refused"]


# -- LeaseKeeper against a lease in memory ----------------------------------------------------


@attrs.define
class MemoryLease:
    """The lease row and the database's clock (trio's, an hour ahead), answering the lease's
    statements as PostgreSQL would; `down` makes every statement fail as a lost database does."""

    holder: str = ""
    agent_url: str = ""
    admin_url: str = ""
    epoch: int = 0
    expires_at: float = 0.0
    down: bool = False
    schema: int = 2  # the store's schema version
    statements: list[str] = attrs.field(factory=list)

    def now(self) -> float:
        return trio.current_time() + 3600.0

    def row(self) -> tuple:
        return (self.holder, self.agent_url, self.admin_url, self.epoch, self.expires_at - self.now())

    def rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        if self.down:
            raise StoreUnavailable("postgresql://db/llmgw", "connection refused")
        now = self.now()
        if sql == lease.READ:
            self.statements.append("read")
            return [self.row()]
        if sql == lease.ACQUIRE:
            self.statements.append("acquire")
            holder, agent_url, admin_url, ttl, knows = args
            if self.expires_at > now or self.schema > knows:
                return []
            self.holder, self.agent_url, self.admin_url = holder, agent_url, admin_url
            self.epoch += 1
            self.expires_at = now + ttl
            return [self.row()]
        if sql == lease.SCHEMA:
            self.statements.append("schema")
            return [(self.schema,)]
        if sql == lease.RENEW:
            self.statements.append("renew")
            agent_url, admin_url, ttl, epoch, holder = args
            if (epoch, holder) != (self.epoch, self.holder) or self.expires_at <= now:
                return []
            self.agent_url, self.admin_url, self.expires_at = agent_url, admin_url, now + ttl
            return [(epoch,)]
        if sql == lease.RELEASE:
            self.statements.append("release")
            epoch, holder = args
            if (epoch, holder) != (self.epoch, self.holder):
                return []
            was, self.expires_at = self.expires_at, now
            return [(epoch, was - now)]
        raise AssertionError(sql)


async def on_the_loop(fn, *args):
    """Statements run on the loop: a worker thread would let the MockClock jump meanwhile."""
    await trio.lowlevel.checkpoint()
    return fn(*args)


def keeper(db: MemoryLease, holder: Holder = A, run=on_the_loop, knows: int = 2) -> LeaseKeeper:
    return LeaseKeeper(db, holder, ttl_s=TTL, renew_s=RENEW, run=run, knows=knows)


@pytest.mark.trio
async def test_a_free_lease_is_taken_at_once_as_epoch_one(autojump_clock: trio.testing.MockClock) -> None:
    db = MemoryLease()
    term = await keeper(db).acquire()
    assert term.epoch == 1 and term.leading()
    assert (db.holder, db.agent_url, db.admin_url) == ("a", "wss://cp-a:7443", "http://cp-a:8080")


@pytest.mark.trio
async def test_a_standby_waits_while_another_holds_the_lease_and_takes_it_within_a_try_of_its_expiry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    db = MemoryLease()
    leader = await keeper(db, A).acquire()
    standby = keeper(db, B)
    taken: list[Term] = []
    async with trio.open_nursery() as nursery:

        async def take() -> None:
            taken.append(await standby.acquire())

        nursery.start_soon(take)
        await trio.sleep(TTL - 0.1)
        assert taken == []
        assert standby.seen == LeaseRow(
            holder="a",
            agent_url="wss://cp-a:7443",
            admin_url="http://cp-a:8080",
            epoch=1,
            remaining_s=pytest.approx(0.1, abs=1.0),
        )
    assert trio.current_time() <= TTL + RENEW  # the lease expired at TTL; the next try took it
    [term] = taken
    assert term.epoch == 2 and db.holder == "b"
    assert leader.epoch == 1 and not leader.leading()  # the old term had lapsed by its own clock first


@pytest.mark.trio
async def test_a_kept_lease_is_renewed_every_interval_and_never_lapses(autojump_clock: trio.testing.MockClock) -> None:
    db = MemoryLease()
    k = keeper(db)
    term = await k.acquire()
    with trio.move_on_after(60):
        await k.keep(term)
    assert term.leading() and term.lost_reason == ""
    assert 55 <= db.statements.count("renew") <= 61
    assert db.expires_at - db.now() > TTL - RENEW - 0.01


@pytest.mark.trio
async def test_a_renewal_refused_because_another_took_the_lease_ends_the_term_naming_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    db = MemoryLease()
    k = keeper(db)
    term = await k.acquire()
    db.holder, db.epoch = "b", 2  # taken meanwhile (the lease had lapsed while this one was away)
    with trio.fail_after(RENEW + 0.1):
        await k.keep(term)
    assert not term.leading()
    assert term.lost_reason == "the lease of epoch 1 passed to another control plane (b) or lapsed"


@pytest.mark.trio
async def test_a_database_that_stops_answering_ends_the_term_when_it_lapses_and_not_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    db = MemoryLease()
    k = keeper(db)
    term = await k.acquire()
    lost_at: list[float] = []
    term.on_lost(lambda reason: lost_at.append(trio.current_time()))
    await trio.sleep(0.5)
    db.down = True
    await k.keep(term)
    [at] = lost_at
    assert at == pytest.approx(term.valid_until) and at == pytest.approx(TTL - margin(TTL))
    assert "no renewal of the lease of epoch 1 succeeded within its 5 s" in term.lost_reason
    assert "connection refused" in term.lost_reason


@pytest.mark.trio
async def test_one_failed_renewal_loses_nothing(autojump_clock: trio.testing.MockClock) -> None:
    db = MemoryLease()
    k = keeper(db)
    term = await k.acquire()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(k.keep, term)
        await trio.sleep(1.5)
        db.down = True
        await trio.sleep(RENEW)
        db.down = False
        await trio.sleep(3 * TTL)
        assert term.leading()
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_renewal_that_hangs_past_the_term_ends_it_at_its_end(autojump_clock: trio.testing.MockClock) -> None:
    """A process stopped in the middle of a renewal, or a database that takes the statement and
    never answers: the term ends at `valid_until` by this process's clock, whatever the thread does."""
    db = MemoryLease()

    async def hangs_after_the_first(fn, *args):
        if db.statements.count("renew") >= 1:
            db.statements.append("renew")
            await trio.sleep_forever()
        return await on_the_loop(fn, *args)

    k = keeper(db, run=hangs_after_the_first)
    term = await k.acquire()
    await k.keep(term)
    assert trio.current_time() == pytest.approx(RENEW + TTL - margin(TTL))  # renewed once, at RENEW
    assert "no renewal of the lease of epoch 1 succeeded" in term.lost_reason


@pytest.mark.trio
async def test_a_term_lost_elsewhere_ends_the_keeping(autojump_clock: trio.testing.MockClock) -> None:
    db = MemoryLease()
    k = keeper(db)
    term = await k.acquire()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(k.keep, term)
        await trio.sleep(2.5)
        term.lose("a write was refused: the lease passed to epoch 2")
        await trio.sleep(RENEW)
        assert db.statements.count("renew") == 2  # none after the loss
    assert term.lost_reason == "a write was refused: the lease passed to epoch 2"


@pytest.mark.trio
async def test_a_released_lease_is_taken_by_a_standby_at_its_next_try(autojump_clock: trio.testing.MockClock) -> None:
    db = MemoryLease()
    a, b = keeper(db, A), keeper(db, B)
    term = await a.acquire()
    taken: list[Term] = []
    async with trio.open_nursery() as nursery:

        async def take() -> None:
            taken.append(await b.acquire())

        nursery.start_soon(take)
        await trio.sleep(0.2)
        await a.release(term)
    assert trio.current_time() <= 0.2 + RENEW and [t.epoch for t in taken] == [2]
    assert (a.tries, b.tries) == (1, 2)  # b's first, refused, and the next


@pytest.mark.trio
async def test_the_holders_addresses_follow_what_it_advertises(autojump_clock: trio.testing.MockClock) -> None:
    db = MemoryLease()
    k = keeper(db)
    term = await k.acquire()
    k.advertise("wss://cp-a:17443", "http://cp-a:18080")
    with trio.move_on_after(RENEW + 0.1):
        await k.keep(term)
    assert (db.agent_url, db.admin_url) == ("wss://cp-a:17443", "http://cp-a:18080")


@pytest.mark.trio
async def test_a_standby_that_cannot_read_the_lease_knows_no_leader_and_keeps_trying(
    autojump_clock: trio.testing.MockClock,
) -> None:
    db = MemoryLease(down=True)
    k = keeper(db)
    with trio.move_on_after(3.5):
        await k.acquire()
    assert k.seen is None
    db.down = False
    term = await k.acquire()
    assert term.epoch == 1 and k.seen is not None and k.seen.holder == "a"


@pytest.mark.trio
async def test_a_store_a_newer_llmgw_migrated_is_never_led_and_it_says_so_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    db = MemoryLease(schema=3)
    old = keeper(db, A, knows=2)
    with trio.move_on_after(10 * RENEW):
        await old.acquire()
        raise AssertionError("an llmgw that knows schema 2 took the lease of a store at 3")
    assert db.epoch == 0 and db.holder == "" and old.newer_schema == 3
    assert db.statements.count("acquire") >= 9 and db.statements.count("schema") >= 9  # it kept looking
    refused = [r.llmgw_fields for r in caplog.records if r.getMessage() == "lease_refused"]
    assert len(refused) == 1 and "schema is at version 3, newer than this llmgw's 2" in refused[0]["reason"]
    newer = await keeper(db, B, knows=3).acquire()  # one that knows it leads at once
    assert newer.epoch == 1 and db.holder == "b"
