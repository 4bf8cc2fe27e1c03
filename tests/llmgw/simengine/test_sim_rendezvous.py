"""The rendezvous of a multi-node replica, both sides, over in-memory streams on a fake clock:
joining, refusals, the ready signal, and every way a member is lost (closed, hung)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.errors import find
from llmgw.simengine import protocol
from llmgw.simengine.errors import MemberLost, RendezvousFailed
from llmgw.simengine.options import SimOptions
from llmgw.simengine.rendezvous import Channel, Rank0, connect_with_backoff, serve_worker

ADDR = ("127.0.0.1", 29500)


def hello(rank: int, nnodes: int = 3, model: str = "m") -> dict[str, Any]:
    return protocol.hello(rank=rank, nnodes=nnodes, model=model)


async def join(nursery: trio.Nursery, rank0: Rank0, message: dict[str, Any]) -> Channel:
    """A fake worker's end of a connection rank 0 is serving, after sending `message`."""
    worker_end, rank0_end = trio.testing.memory_stream_pair()
    nursery.start_soon(rank0.handle, rank0_end)
    channel = Channel(worker_end)
    await channel.send(message)
    return channel


async def next_not_ping(channel: Channel) -> dict[str, Any] | None:
    while True:
        message = await channel.receive()
        if message is None or message["type"] != "ping":
            return message


def test_hello_checks() -> None:
    joined = {1: "10.0.0.2:4000"}
    check = lambda m: protocol.check_hello(m, nnodes=3, model="m", joined=joined)  # noqa: E731
    assert check(hello(2)) is None
    assert "rank 1 has already joined from 10.0.0.2:4000" in check(hello(1))
    assert "rank 3 is out of range for --nnodes 3: workers are ranks 1..2" in check(hello(3))
    assert "rank 0 is out of range" in check(hello(0))
    assert "--nnodes 4 and rank 0 with --nnodes 3" in check(hello(2, nnodes=4))
    assert "same --model" in check(hello(2, model="other"))
    assert "protocol version 9" in check({**hello(2), "version": 9})
    assert "is not an integer" in check({**hello(2), "rank": True})


def test_line_buffer_splits_and_bounds_lines() -> None:
    lines = protocol.LineBuffer()
    assert lines.feed(b'{"type":"ping"}\n{"ty') == [b'{"type":"ping"}']
    assert lines.feed(b'pe":"ready"}\n') == [b'{"type":"ready"}']
    with pytest.raises(protocol.RendezvousProtocolError):
        lines.feed(b"x" * (protocol.MAX_LINE + 1))
    with pytest.raises(protocol.RendezvousProtocolError):
        protocol.decode(b"GET / HTTP/1.1")


@pytest.mark.trio
async def test_workers_join_then_all_hear_ready_and_heartbeats(autojump_clock: trio.testing.MockClock) -> None:
    rank0 = Rank0(nnodes=3, model="m", address=ADDR)
    async with trio.open_nursery() as nursery:
        one = await join(nursery, rank0, hello(1))
        assert await one.receive() == {"type": "welcome", "joined": 1, "expected": 2}
        assert not rank0.complete.is_set() and "waiting for rank 2" in rank0.describe()
        two = await join(nursery, rank0, hello(2))
        assert await two.receive() == {"type": "welcome", "joined": 2, "expected": 2}
        assert rank0.complete.is_set() and set(rank0.members) == {1, 2}
        start = trio.current_time()
        assert await next_not_ping(one) == {"type": "ready"} == await next_not_ping(two)
        for beat in (1, 2):
            for channel in (one, two):
                assert await channel.receive() == {"type": "ping"}
                assert trio.current_time() - start == pytest.approx(beat * protocol.HEARTBEAT_S, abs=0.01)
        # Members that keep pinging stay members, however long it runs.
        for _ in range(20):
            await trio.sleep(protocol.HEARTBEAT_S)
            await one.send(protocol.PING)
            await two.send(protocol.PING)
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_duplicate_rank_is_refused_and_the_first_stays(autojump_clock: trio.testing.MockClock) -> None:
    rank0 = Rank0(nnodes=3, model="m", address=ADDR)
    async with trio.open_nursery() as nursery:
        first = await join(nursery, rank0, hello(1))
        assert (await first.receive())["type"] == "welcome"
        second = await join(nursery, rank0, hello(1))
        reply = await second.receive()
        assert reply["type"] == "reject" and "rank 1 has already joined" in reply["reason"]
        assert await second.receive() is None  # and closed
        assert list(rank0.members) == [1]
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_worker_that_closes_fails_the_replica(autojump_clock: trio.testing.MockClock) -> None:
    rank0 = Rank0(nnodes=2, model="m", address=ADDR)
    with pytest.raises(BaseException) as info:  # a nursery raises an exception group: looked into below
        async with trio.open_nursery() as nursery:
            worker = await join(nursery, rank0, hello(1, nnodes=2))
            assert await next_not_ping(worker) == {"type": "welcome", "joined": 1, "expected": 1}
            closed_at = trio.current_time()
            await worker.stream.aclose()
            await trio.sleep_forever()
    assert "rank 1 (?) closed the connection" in str(lost_in(info.value))
    assert trio.current_time() == pytest.approx(closed_at, abs=0.01)  # at once, not at a timeout


def lost_in(exc: BaseException) -> MemberLost:
    lost = find(exc, MemberLost)
    assert lost is not None, repr(exc)
    return lost  # type: ignore[return-value]


@pytest.mark.trio
async def test_worker_that_falls_silent_is_lost_after_the_peer_timeout(autojump_clock: trio.testing.MockClock) -> None:
    rank0 = Rank0(nnodes=2, model="m", address=ADDR)
    worker_end, rank0_end = trio.testing.memory_stream_pair()
    worker = Channel(worker_end)
    await worker.send(hello(1, nnodes=2))
    start = trio.current_time()
    with pytest.raises(MemberLost, match=r"sent nothing for 5 s \(heartbeats every 1 s\): it is hung"):
        await rank0.handle(rank0_end)  # the worker never pings
    assert trio.current_time() - start == pytest.approx(protocol.PEER_TIMEOUT_S, abs=0.01)


@pytest.mark.trio
async def test_stray_connections_are_dropped_without_failing(autojump_clock: trio.testing.MockClock) -> None:
    rank0 = Rank0(nnodes=2, model="m", address=ADDR)
    silent_end, rank0_end = trio.testing.memory_stream_pair()
    await rank0.handle(rank0_end)  # says nothing: dropped after HELLO_TIMEOUT_S, no failure
    assert trio.current_time() == pytest.approx(protocol.HELLO_TIMEOUT_S, abs=0.01)
    garbage_end, rank0_end = trio.testing.memory_stream_pair()
    await garbage_end.send_all(b"GET / HTTP/1.1\r\n\r\n\n")
    await rank0.handle(rank0_end)
    assert rank0.members == {} and not rank0.complete.is_set()


@pytest.mark.trio
async def test_backoff_doubles_until_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    attempts: list[float] = []

    async def refused(host: str, port: int) -> trio.abc.Stream:
        attempts.append(trio.current_time())
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(RendezvousFailed, match=r"not reachable within 5 s \(6 attempts; last: Connection refused\)"):
        await connect_with_backoff(ADDR, 5.0, refused)
    assert attempts == pytest.approx([0, 0.1, 0.3, 0.7, 1.5, 3.1])

    attempts.clear()
    stream, _ = trio.testing.memory_stream_pair()

    async def third_time_lucky(host: str, port: int) -> trio.abc.Stream:
        attempts.append(trio.current_time())
        if len(attempts) < 3:
            raise ConnectionRefusedError(111, "Connection refused")
        return stream

    start = trio.current_time()
    assert await connect_with_backoff(ADDR, 5.0, third_time_lucky) is stream
    assert [a - start for a in attempts] == pytest.approx([0, 0.1, 0.3])


def worker_options(rank: int = 1, nnodes: int = 2) -> SimOptions:
    return SimOptions(model="m", nnodes=nnodes, node_rank=rank, dist_init_addr=ADDR, rendezvous_timeout_s=30)


@pytest.mark.trio
async def test_worker_joins_a_real_rank0_and_fails_when_it_goes(autojump_clock: trio.testing.MockClock) -> None:
    rank0 = Rank0(nnodes=2, model="m", address=ADDR)
    rank0_scope = trio.CancelScope()

    async def run_rank0(stream: trio.abc.Stream) -> None:
        with rank0_scope:
            await rank0.handle(stream)

    with pytest.raises(BaseException) as info:  # a nursery raises an exception group: looked into below
        async with trio.open_nursery() as nursery:

            async def connect(host: str, port: int) -> trio.abc.Stream:
                worker_end, rank0_end = trio.testing.memory_stream_pair()
                nursery.start_soon(run_rank0, rank0_end)
                return worker_end

            await nursery.start(
                lambda task_status: serve_worker(worker_options(), connect=connect, task_status=task_status)
            )
            assert rank0.complete.is_set() and list(rank0.members) == [1]
            await trio.sleep(30)  # heartbeats keep both sides content
            rank0_scope.cancel()  # rank 0 dies: its end closes
            await trio.sleep_forever()
    assert "rank 0 (127.0.0.1:29500) closed the connection" in str(lost_in(info.value))


@pytest.mark.trio
async def test_refused_worker_exits_with_the_reason(autojump_clock: trio.testing.MockClock) -> None:
    async def connect(host: str, port: int) -> trio.abc.Stream:
        worker_end, rank0_end = trio.testing.memory_stream_pair()
        await rank0_end.send_all(protocol.encode({"type": "reject", "reason": "rank 1 has already joined"}))
        return worker_end

    with pytest.raises(RendezvousFailed, match=r"rank 0 \(127.0.0.1:29500\) refused rank 1: rank 1 has already joined"):
        await serve_worker(worker_options(), connect=connect)


@pytest.mark.trio
async def test_worker_detects_a_hung_rank0(autojump_clock: trio.testing.MockClock) -> None:
    async def connect(host: str, port: int) -> trio.abc.Stream:
        worker_end, rank0_end = trio.testing.memory_stream_pair()
        await rank0_end.send_all(protocol.encode({"type": "welcome", "joined": 1, "expected": 1}))
        connect.keep = rank0_end  # type: ignore[attr-defined]  # open, but silent from now on
        return worker_end

    start = trio.current_time()
    with pytest.raises(MemberLost, match=r"rank 0 \(127.0.0.1:29500\) sent nothing for 5 s"):
        await serve_worker(worker_options(), connect=connect)
    assert trio.current_time() - start == pytest.approx(protocol.PEER_TIMEOUT_S, abs=0.01)
    sent = connect.keep  # type: ignore[attr-defined]
    lines = [json.loads(line) for line in (await sent.receive_some(65536)).splitlines()]
    assert lines[0] == hello(1, nnodes=2) and {"type": "ping"} in lines[1:]
