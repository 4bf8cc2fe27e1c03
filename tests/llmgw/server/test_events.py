"""One page's stream of the cluster page's feed, on a fake plane and trio's MockClock: the whole
cluster at once, then one `changes` per burst of changes, a heartbeat when quiet, the whole
cluster again for a stream that fell behind, and an end when the session does."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.server.admin import events
from llmgw.server.admin import pagefeed as feed
from testlib.feedplane import FakePlane, Frames, PageCopy


@pytest.mark.trio
async def test_the_cluster_at_once_then_one_change_per_burst_then_heartbeats(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    plane = FakePlane(nodes=3)
    the_feed = feed.Feed(plane, timer=plane.timer)
    await nursery.start(the_feed.serve)
    frames = Frames(events.stream(the_feed))
    assert (await frames.next())[0] == "retry"
    kind, first = await frames.next()
    assert kind == "cluster" and [n["id"] for n in first["nodes"]] == ["n00000", "n00001", "n00002"]
    assert first["notes"] == ["a note"] and first["replicas"] == [] and first["keys"] == []
    page = PageCopy()
    page.apply(kind, first)
    started = trio.current_time()
    for _ in range(10):  # a burst: one look, no sooner than MIN_INTERVAL_S after the last
        plane.nodes["n00001"]["cordoned"] = True
        plane.change()
    kind, second = await frames.next()
    assert kind == "changes" and second["base"] == first["version"]
    # Only the node that changed: the others are where the page has them already.
    assert [n["id"] for n in second["nodes"]] == ["n00001"] and second["nodes"][0]["cordoned"] is True
    assert second["gone_nodes"] == [] and second["replicas"] == [] and "notes" not in second
    page.apply(kind, second)
    assert page.nodes["n00001"]["cordoned"] and len(page.nodes) == 3
    assert trio.current_time() - started >= feed.MIN_INTERVAL_S and plane.looks == 2
    quiet = trio.current_time()
    assert await frames.next() == ("comment", ": heartbeat")
    assert trio.current_time() - quiet == pytest.approx(events.HEARTBEAT_S)
    await frames.stream.aclose()


@pytest.mark.trio
async def test_a_stream_that_fell_behind_gets_the_whole_cluster_again(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    plane = FakePlane(nodes=2)
    the_feed = feed.Feed(plane, timer=plane.timer)
    await nursery.start(the_feed.serve)
    frames = Frames(events.stream(the_feed))
    _, first = await frames.next_data()
    for node in ("n00000", "n00001"):  # two versions while this client reads nothing
        plane.nodes[node]["cordoned"] = True
        plane.change()
        await the_feed.published.wait()
    assert the_feed.latest is not None and the_feed.latest.version == first["version"] + 2
    kind, data = await frames.next_data()
    assert kind == "cluster" and data["version"] == first["version"] + 2
    assert all(n["cordoned"] for n in data["nodes"])
    await frames.stream.aclose()


@pytest.mark.trio
async def test_the_stream_ends_with_the_session(autojump_clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    plane = FakePlane()
    the_feed = feed.Feed(plane, timer=plane.timer)
    await nursery.start(the_feed.serve)
    frames = Frames(events.stream(the_feed, session_expires_at=trio.current_time() + 40))
    assert (await frames.next_data())[0] == "cluster"
    rest = []
    while True:
        try:
            rest.append(await frames.next())
        except StopAsyncIteration:
            break
    assert rest[:2] == [("comment", ": heartbeat"), ("comment", ": heartbeat")]
    assert rest[-1][0] == "expired" and "llmgw ctl page" in rest[-1][1]["detail"]
    assert trio.current_time() == pytest.approx(40)
