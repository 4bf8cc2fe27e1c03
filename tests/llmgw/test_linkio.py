"""The link's trio half on memory streams and MockClock: the one writer drains a session's
outbox in order, never makes a sender wait on the peer, cuts a peer that takes nothing at its
deadline, and writes the LinkError last; the stream under the WebSocket gives read bytes again
and tells its first failure; callers waiting for replies are woken by the reply or the link's end."""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import trio
import trio.testing
import trio_websocket

from llmgw import linkio
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s
from llmgw.wire import session as ls
from llmgw.wire.convert import decode
from testlib.memlink import gated_pair, websocket_pair

pytestmark = pytest.mark.trio

SEND_TIMEOUT_S = 10.0
HELLO = w.Hello(
    protocol_version=w.PROTOCOL_VERSION,
    node_id="node-a",
    agent_version="test",
    boot_id="b",
    started_at=1.0,
    inventory=w.Inventory(hostname="a", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1),
)


def joined_server() -> tuple[s.ServerSession, list[int]]:
    """A control plane's session that took the hello; the generations of what it made."""
    made: list[int] = []

    def desired() -> w.DesiredState:
        made.append(len(made) + 1)
        return w.DesiredState(generation=made[-1])

    session = s.ServerSession("node-a", heartbeat_interval_s=5.0, desired_state=desired)
    path, headers = s.AgentSession("node-a", lambda: HELLO).upgrade_request()
    session.upgrade(
        ls.UpgradeRequest(
            method=b"GET",
            target=path.encode(),
            http_version=b"1.1",
            headers=(
                *headers,
                (b"upgrade", b"websocket"),
                (b"connection", b"upgrade"),
                (b"sec-websocket-key", b"k"),
                (b"sec-websocket-version", b"13"),
            ),
        ),
        ls.Standing(serial=1),
    )
    session.receive(HELLO)
    return session, made


async def read(ws: trio_websocket.WebSocketConnection, n: int) -> list:
    return [decode(await ws.get_message(), w.ServerMessage) for _ in range(n)]


async def test_the_writer_writes_in_the_order_queued_and_starts_once_the_first_frame_is_out(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    a, b, _, _ = gated_pair()
    agent_ws, server_ws = await websocket_pair(nursery, a, b)
    session, made = joined_server()
    session.request_logs("r1", 5)
    writer = linkio.Writer(session, send_timeout_s=SEND_TIMEOUT_S)
    firsts = []
    await nursery.start(partial(writer.serve, server_ws, on_first=lambda: firsts.append(made[:])))
    assert firsts == [[]]  # the Welcome is out; the desired state not yet made
    assert [type(m) for m in await read(agent_ws, 3)] == [w.Welcome, w.DesiredState, w.LogsRequest]
    assert writer.send(w.DesiredState(generation=7)) and not writer.send(HELLO)  # what the session allows
    assert await read(agent_ws, 1) == [w.DesiredState(generation=7)]


async def test_senders_never_wait_on_a_reader_that_takes_nothing_which_is_cut_at_the_deadline(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    a, b, _, to_agent = gated_pair()
    agent_ws, server_ws = await websocket_pair(nursery, a, b)
    session, made = joined_server()
    writer = linkio.Writer(session, send_timeout_s=SEND_TIMEOUT_S)
    to_agent.close()
    started = trio.current_time()

    async def pushes() -> None:
        await to_agent.held.wait()  # the Welcome is stuck in a buffer nobody reads
        for _ in range(1000):
            session.push()
            writer.wake()
            assert trio.current_time() == started  # no sender waits
        assert len(session.outbox) == 1  # the desired state, one, made when taken

    nursery.start_soon(pushes)
    with pytest.raises(trio.TooSlowError):
        await writer.serve(server_ws)
    assert trio.current_time() - started == pytest.approx(SEND_TIMEOUT_S)
    assert made == [] and writer.finished.is_set()


async def test_a_slow_reader_gets_the_newest_desired_state_each_time_it_takes_one(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    a, b, _, to_agent = gated_pair()
    agent_ws, server_ws = await websocket_pair(nursery, a, b)
    to_agent.delay_s = 1.0  # the agent takes one frame a second
    upgraded = to_agent.writes  # the 101
    session, made = joined_server()
    writer = linkio.Writer(session, send_timeout_s=SEND_TIMEOUT_S)
    received: list = []

    async def agent() -> None:
        while True:
            received.append(decode(await agent_ws.get_message(), w.ServerMessage))

    nursery.start_soon(agent)
    nursery.start_soon(writer.serve, server_ws)
    for _ in range(100):  # a change every 50 ms for 5 s
        session.push()
        writer.wake()
        await trio.sleep(0.05)
    last_push = trio.current_time()
    await trio.sleep(5)
    generations = [m.generation for m in received if isinstance(m, w.DesiredState)]
    assert generations == made and 4 <= len(made) <= 8, made  # one a second, not one per change
    assert to_agent.writes - upgraded == 1 + len(made)  # the Welcome, then those
    # The last was made when the writer took it, after the last change: the newest.
    assert session.outbox.room(w.DesiredState) and len(session.outbox) == 0
    assert trio.current_time() > last_push


async def test_close_writes_the_link_error_after_what_is_out_and_closes_the_websocket(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    a, b, _, _ = gated_pair()
    agent_ws, server_ws = await websocket_pair(nursery, a, b)
    session, _ = joined_server()
    writer = linkio.Writer(session, send_timeout_s=SEND_TIMEOUT_S)
    messages: list = []
    closed: list[trio_websocket.ConnectionClosed] = []

    async def agent() -> None:
        try:
            while True:
                messages.append(decode(await agent_ws.get_message(), w.ServerMessage))
        except trio_websocket.ConnectionClosed as exc:
            closed.append(exc)

    async with trio.open_nursery() as inner:
        inner.start_soon(agent)
        await nursery.start(writer.serve, server_ws)
        await writer.close("revoked", "removed", timeout_s=1.0)
        assert writer.finished.is_set() and session.done
    assert messages[-1] == w.LinkError(code="revoked", message="removed")
    assert all(not isinstance(m, w.LinkError) for m in messages[:-1])
    assert (closed[0].reason.code, closed[0].reason.reason) == (linkio.POLICY_VIOLATION, "revoked")


async def test_a_link_error_before_the_writer_runs_is_written_by_close(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    a, b, _, _ = gated_pair()
    agent_ws, server_ws = await websocket_pair(nursery, a, b)
    session = s.ServerSession("node-a", heartbeat_interval_s=5.0, desired_state=lambda: w.DesiredState(generation=1))
    writer = linkio.Writer(session, send_timeout_s=SEND_TIMEOUT_S)
    await writer.close(w.BAD_MESSAGE, "no hello", timeout_s=1.0, ws=server_ws)
    assert await read(agent_ws, 1) == [w.LinkError(code=w.BAD_MESSAGE, message="no hello")]


async def test_a_bounded_kind_waits_for_room_which_a_written_frame_makes(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    a, b, to_server, _ = gated_pair()
    agent_ws, server_ws = await websocket_pair(nursery, a, b)
    session = s.AgentSession("node-a", lambda: HELLO)
    session.start()
    writer = linkio.Writer(session, send_timeout_s=SEND_TIMEOUT_S)
    await nursery.start(writer.serve, agent_ws)
    session.receive(w.Welcome(node_id="node-a", server_version="t", heartbeat_interval_s=1.0))
    to_server.close()
    for i in range(1, s.MAX_LOGS_ASKED + 3):
        session.receive(w.LogsRequest(request_id=i, replica_id="r"))
    for i in range(1, s.MAX_LOGS_ASKED + 2):  # one is taken by the writer, then it is held
        await writer.wait_room(w.LogsReply)
        assert writer.send(w.LogsReply(request_id=i, replica_id="r"))
    await to_server.held.wait()
    with trio.move_on_after(5) as waited:
        await writer.wait_room(w.LogsReply)
    assert waited.cancelled_caught  # full while the control plane reads nothing
    to_server.open()
    await writer.wait_room(w.LogsReply)
    assert writer.send(w.LogsReply(request_id=s.MAX_LOGS_ASKED + 2, replica_id="r"))


# -- the stream under the WebSocket -------------------------------------------------------


async def test_the_stream_gives_the_bytes_already_read_first() -> None:
    a, b = trio.testing.memory_stream_pair()
    stream = linkio.LinkStream(b, prefix=b"GET / HTTP/1.1\r\n")
    await a.send_all(b"rest")
    assert await stream.receive_some(4) == b"GET "
    assert await stream.receive_some() == b"/ HTTP/1.1\r\n"
    assert await stream.receive_some() == b"rest"
    await stream.send_all(b"back")
    assert await a.receive_some() == b"back"
    assert stream.failure is None


@pytest.mark.parametrize("how", ["eof", "broken_read", "broken_write"])
async def test_the_stream_keeps_its_first_failure_and_tells_it_once(how: str) -> None:
    a, b = trio.testing.memory_stream_pair()
    told = []
    stream = linkio.LinkStream(b, on_failure=lambda: told.append(1), eof="the control plane hung up")
    if how == "eof":
        await a.aclose()
        assert await stream.receive_some() == b""
        assert (
            isinstance(stream.failure, trio.BrokenResourceError) and str(stream.failure) == "the control plane hung up"
        )
    else:
        await b.aclose()  # our own end closed under trio-websocket: ClosedResourceError
        with pytest.raises(trio.ClosedResourceError):
            await (stream.receive_some() if how == "broken_read" else stream.send_all(b"x"))
        assert isinstance(stream.failure, trio.ClosedResourceError)
    first = stream.failure
    with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
        await stream.receive_some()
    assert told == [1] and stream.failure is first


# -- replies ------------------------------------------------------------------------------


async def test_a_caller_is_woken_by_its_reply_its_deadline_or_the_links_end(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    replies = linkio.Replies()

    async def answer_later(rid: int, after: float) -> None:
        await trio.sleep(after)
        replies.give(rid, f"reply {rid}")

    nursery.start_soon(answer_later, 1, 2.0)
    replies.give(99, "nobody asked")  # dropped: no caller waits for it
    assert await replies.wait(1, 10.0) == "reply 1"
    started = trio.current_time()
    assert await replies.wait(2, 10.0) is None and trio.current_time() - started == pytest.approx(10.0)
    assert not replies.ended

    async def end_later() -> None:
        await trio.sleep(3.0)
        replies.end()

    nursery.start_soon(end_later)
    started = trio.current_time()
    assert await replies.wait(3, 10.0) is None and replies.ended
    assert trio.current_time() - started == pytest.approx(3.0)


async def test_a_long_frame_is_read_in_a_thread_and_a_short_one_on_the_loop() -> None:
    """`readable`: a frame of OFF_LOOP_BYTES or more is decoded by a thread (the loop runs on
    meanwhile), one shorter is left for `receive`; the session takes either the same."""
    session, _ = joined_server()
    threads: list[bool] = []
    decode_on = session.decode

    def decode_where(frame: str) -> ls.Decoded:
        threads.append(trio.lowlevel.in_trio_run() is False)
        return decode_on(frame)

    session.decode = decode_where  # type: ignore[method-assign]
    short = '{"type": "heartbeat", "seq": 1}'
    assert await linkio.readable(session, short) == short and threads == []
    long = '{"type": "heartbeat", "seq": 1' + " " * linkio.OFF_LOOP_BYTES + "}"
    decoded = await linkio.readable(session, long)
    assert threads == [True] and decoded == ls.Decoded(decode(short, w.AgentMessage))
