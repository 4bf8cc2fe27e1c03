"""The running control plane's store against a real database that another session locks: the
state directory's SQLite file and a real PostgreSQL database (`store_backend`), then SQLite's
damaged files.

These run on trio's real clock, on purpose: what is under test is a real lock and a real worker
thread, and "the loop is not blocked" can only be shown by a task that keeps running in real
time while the database waits. The busy timeout is made short (0.3 s) to keep them quick.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import trio

from llmgw.backoff import Backoff
from llmgw.server.errors import StoreBusy, StoreCorrupt, StoreError
from llmgw.server.store import NodeRow, Store, store_path
from llmgw.server.store.asyncstore import AsyncStore, LatestWriter
from testlib.stores import StoreUnderTest
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

BUSY_S = 0.3


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    return [r.llmgw_fields for r in caplog.records if r.getMessage() == name]


async def test_a_locked_database_fails_the_one_call_within_the_busy_timeout_while_the_loop_runs_on(
    store_backend: StoreUnderTest,
) -> None:
    store = store_backend.open_async(busy_timeout_s=BUSY_S)
    await store.saw_node("a", "127.0.0.2")
    ticks = 0
    with store_backend.write_lock():
        async with trio.open_nursery() as nursery:

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await trio.sleep(0.01)
                    ticks += 1

            nursery.start_soon(tick)
            started = trio.current_time()
            with pytest.raises(StoreBusy) as info:
                await store.set_cordoned("a", True)
            waited = trio.current_time() - started
            assert await store.is_revoked(5) is False  # reads go on: nobody waits for a writer
            nursery.cancel_scope.cancel()
    assert BUSY_S * 0.9 <= waited < BUSY_S + 1.0, waited
    # A blocked loop would not have ticked at all; a free one ticks every 10 ms or so.
    assert ticks >= 10, ticks
    message = str(info.value)
    assert f"{store_backend.where} is locked by another process ({store_backend.holders}" in message
    assert "nothing changed; try again" in message
    assert [n.cordoned for n in await store.nodes()] == [False]  # nothing changed
    await store.set_cordoned("a", True)  # the lock is gone: the same call works
    assert [n.cordoned for n in await store.nodes()] == [True]


async def test_calls_take_turns_on_the_one_connection(store_backend: StoreUnderTest) -> None:
    store = store_backend.open_async(busy_timeout_s=BUSY_S)
    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(store.saw_node, f"n{i:02d}", f"127.0.0.{i + 2}")
    assert [n.node_id for n in await store.nodes()] == [f"n{i:02d}" for i in range(50)]


async def test_nodes_seen_while_the_store_is_busy_are_written_together_each_caller_given_its_row(
    store_backend: StoreUnderTest,
) -> None:
    """Thousands of agents dialling at once: those whose sighting waits for the store's turn
    share one transaction, and each hello still gets its node's row (cordoned as stored)."""
    store = store_backend.open_async(busy_timeout_s=BUSY_S)
    await store.saw_node("n00", "127.0.0.2")
    await store.set_cordoned("n00", True)
    batches: list[list[str]] = []
    write = store._store.saw_nodes

    def counted(seen: dict[str, str]):
        batches.append(sorted(seen))
        return write(seen)

    store._store.saw_nodes = counted  # type: ignore[method-assign]
    rows: dict[str, NodeRow] = {}
    refused: list[str] = []

    async def saw(i: int) -> None:
        try:
            rows[f"n{i:02d}"] = await store.saw_node(f"n{i:02d}", f"127.0.0.{i + 2}")
        except StoreError as exc:
            refused.append(type(exc).__name__)

    async with trio.open_nursery() as nursery:
        async with store._limiter:  # the store busy with another call meanwhile
            for i in range(30):
                nursery.start_soon(saw, i)
            await trio.sleep(0.05)
    assert batches == [[f"n{i:02d}" for i in range(30)]]  # one transaction for the 30
    assert sorted(rows) == [f"n{i:02d}" for i in range(30)] and not refused
    assert rows["n00"].cordoned and not rows["n01"].cordoned and rows["n07"].address == "127.0.0.9"
    with store_backend.write_lock():  # a locked database: the batch fails, each caller is told
        async with trio.open_nursery() as nursery:
            async with store._limiter:
                for i in range(5):
                    nursery.start_soon(saw, i)
                await trio.sleep(0.05)
    assert len(batches) == 2 and refused == ["StoreBusy"] * 5


async def test_the_writer_retries_until_the_lock_goes_and_logs_once_each_way(
    store_backend: StoreUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    store = store_backend.open_async(busy_timeout_s=BUSY_S)
    writes: list[dict] = []

    async def write(value: dict[str, dict]) -> None:
        writes.append(value)
        await store.set_placements(value)

    writer = LatestWriter("placements", write, backoff=Backoff(first_s=0.01, max_s=0.05))
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.serve)
        with store_backend.write_lock():
            writer.offer({"r-0": {"v": 1}})
            await await_true(lambda: events(caplog, "store_write_failing"), "the first failure logged", timeout=5)
            writer.offer({"r-0": {"v": 2}, "r-1": {"v": 2}})  # the loop goes on changing placements
            await await_true(lambda: len(writes) >= 4, "a few more attempts", timeout=10)
            assert writer.pending
        await await_true(lambda: not writer.pending, "the write once the lock is gone", timeout=5)
        nursery.cancel_scope.cancel()
    assert await store.placements() == {"r-0": {"v": 2}, "r-1": {"v": 2}}  # the latest, not each version
    [failing] = events(caplog, "store_write_failing")
    [recovered] = events(caplog, "store_write_recovered")
    assert failing["what"] == "placements" and "is locked by another process" in failing["reason"]
    assert recovered["attempts"] == len(writes) >= 4, (recovered, len(writes))  # 3 or more refused, then one


async def test_a_stop_writes_the_latest_version_once_and_bounded(
    store_backend: StoreUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_backend.open_async(busy_timeout_s=BUSY_S)
    writer = LatestWriter(
        "placements", store.set_placements, backoff=Backoff(first_s=10.0, max_s=30.0), flush_timeout_s=2.0
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.serve)
        writer.offer({"r-0": {"v": 1}})
        nursery.cancel_scope.cancel()  # before the loop ran: only the flush can write it
    assert await store.placements() == {"r-0": {"v": 1}}

    # The lock held across the stop: the flush tries once, within its bound, and says what was lost.
    with store_backend.write_lock():
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.serve)
            writer.offer({"r-0": {"v": 2}})
            started = trio.current_time()
            nursery.cancel_scope.cancel()
        took = trio.current_time() - started
    assert took < writer.flush_timeout_s + 0.5, took
    [lost] = events(caplog, "store_write_lost")
    assert lost["what"] == "placements"
    assert await store.placements() == {"r-0": {"v": 1}}


async def test_when_each_model_entered_the_catalog_is_kept_across_restarts(store_backend: StoreUnderTest) -> None:
    """`created` of GET /v1/models: noted in memory at once, written in the background, read back
    at the next start; a model removed and added again keeps its first time."""
    from llmgw.server.state.catalogtimes import CatalogTimes

    clock = iter([100.0, 200.0, 300.0]).__next__
    store = store_backend.open_async()
    times = CatalogTimes(store.at_open.catalog, store.record_catalog, clock=clock)
    async with trio.open_nursery() as nursery:
        await nursery.start(times.writer.serve)
        assert times.note(["a", "b"]) and times.created == {"a": 100.0, "b": 100.0}
        assert not times.note(["a"])  # nothing new: nothing written
        assert times.note(["a", "c"]) and times.created["c"] == 200.0
        nursery.cancel_scope.cancel()  # the writer flushes what is pending as it stops
    store.close()
    again = store_backend.open_async()
    assert again.at_open.catalog == {"a": 100.0, "b": 100.0, "c": 200.0}
    times = CatalogTimes(again.at_open.catalog, again.record_catalog, clock=clock)
    assert not times.note(["b"]) and times.created["b"] == 100.0  # removed meanwhile, back: its first time


# -- SQLite's own: a damaged file -----------------------------------------------------------


def damage(path: Path, *, first_page: int, pages: int) -> None:
    """Overwrite `pages` pages from `first_page` (1-based, as SQLite counts) with garbage. The
    write-ahead log is folded into the file first: a page with a newer copy in the log would be
    read from there, and the damage go unseen (where that is depends on the schema's layout)."""
    with sqlite3.connect(str(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
    with open(path, "r+b") as f:
        f.seek((first_page - 1) * page_size)
        f.write(bytes((i * 7 + 13) % 256 for i in range(page_size * pages)))


def a_store_with_some_pages(state: Path) -> Path:
    store = Store.open(state)
    for i in range(300):
        store.record_issued(10**30 + i, f"node-{i % 7}", not_after=2e9)
        store.saw_node(f"node-{i:03d}", "10.0.0.1")
    del store
    return store_path(state)


async def test_a_damaged_page_stops_the_open_with_the_file_and_the_recovery(tmp_path: Path) -> None:
    path = a_store_with_some_pages(tmp_path)
    pages = path.stat().st_size // 4096
    assert pages >= 10, pages
    damage(path, first_page=pages - 4, pages=3)  # the rows' pages, after the tables' empty roots
    Store.open(tmp_path).close()  # opening alone does not notice: that is why the start checks
    with pytest.raises(StoreCorrupt) as info:
        AsyncStore.open(tmp_path)
    message = str(info.value)
    assert str(path) in message and "is damaged" in message
    assert "llmgw server backup" in message and "aside" in message
    assert "API keys" in message and "revocations" in message and "placements" in message
    assert info.value.exit_status == 1


async def test_a_file_that_is_not_a_database_is_damaged_too(tmp_path: Path) -> None:
    path = a_store_with_some_pages(tmp_path)
    damage(path, first_page=1, pages=1)
    with pytest.raises(StoreCorrupt) as info:
        AsyncStore.open(tmp_path)
    assert str(path) in str(info.value)
