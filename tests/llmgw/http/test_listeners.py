"""The connection budget and the accept loop: real sockets on loopback for what a client sees
at the cap (the connection idle longest closed for it, or a 503 at once), stand-in listeners
for what needs a fake clock (accepting paused past the overflow) or a kernel out of
descriptors."""

from __future__ import annotations

import errno
import ssl

import pytest
import trio
import trio.testing

from llmgw.errors import find
from llmgw.http import fdlimits, listeners
from llmgw.http.heard import Heard, heard_at
from llmgw.http.limits import Limits
from llmgw.http.messages import Request, Response
from llmgw.http.server import bound_address, serve_connection, serve_http

pytestmark = pytest.mark.trio


async def ok(request: Request) -> Response:
    return Response.json(200, {"path": request.path})


async def get(stream: trio.abc.Stream, path: str) -> bytes:
    """One request on a kept-alive connection, and its whole answer (small: one read)."""
    await stream.send_all(f"GET {path} HTTP/1.1\r\nhost: t\r\n\r\n".encode())
    with trio.fail_after(5):
        return await stream.receive_some(65536)


async def closed_by_server(stream: trio.abc.Stream, within_s: float) -> bool:
    with trio.move_on_after(within_s):
        return await stream.receive_some(65536) == b""
    return False


async def test_at_the_cap_the_connection_idle_longest_is_closed_for_the_newcomer(nursery: trio.Nursery) -> None:
    stats = listeners.ConnectionStats()
    bound = await nursery.start(
        lambda task_status: serve_http(
            ok, "127.0.0.1", 0, limits=Limits(max_connections=3), stats=stats, task_status=task_status
        )
    )
    host, port = bound_address(bound)
    kept = []
    for i in range(3):  # three keep-alive clients, idle after one request each
        stream = await trio.open_tcp_stream(host, port)
        assert (await get(stream, f"/k{i}")).startswith(b"HTTP/1.1 200 ")
        kept.append(stream)
    late = await trio.open_tcp_stream(host, port)
    answer = await get(late, "/late")  # at once: not left in the backlog
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"/late"' in answer
    assert await closed_by_server(kept[0], 5)  # the oldest idle one made room, quietly
    assert not await closed_by_server(kept[1], 0.2)
    # Another newcomer: the next oldest goes (the late one, idle now too, is the newest).
    later = await trio.open_tcp_stream(host, port)
    assert (await get(later, "/later")).startswith(b"HTTP/1.1 200 ")
    assert await closed_by_server(kept[1], 5)
    assert (await get(kept[2], "/still")).startswith(b"HTTP/1.1 200 ")  # the rest still serve
    assert stats.shed.get(listener="http", reason="idle") == 2
    assert stats.open.get(listener="http") == 3
    for s in [*kept, late, later]:
        await s.aclose()


async def test_a_new_connection_that_sends_nothing_is_closed_for_the_newcomer_too(nursery: trio.Nursery) -> None:
    stats = listeners.ConnectionStats()
    bound = await nursery.start(
        lambda task_status: serve_http(
            ok, "127.0.0.1", 0, limits=Limits(max_connections=2), stats=stats, task_status=task_status
        )
    )
    host, port = bound_address(bound)
    silent = [await trio.open_tcp_stream(host, port) for _ in range(2)]
    while stats.open.get(listener="http") < 2:  # both accepted (the loopback handshake is the kernel's)
        await trio.sleep(0.01)
    late = await trio.open_tcp_stream(host, port)
    assert (await get(late, "/late")).startswith(b"HTTP/1.1 200 ")
    assert await closed_by_server(silent[0], 5)
    assert not await closed_by_server(silent[1], 0.2)
    assert stats.shed.get(listener="http", reason="idle") == 1
    assert stats.aborted.get(listener="http", reason="head_timeout") == 0  # shed, not timed out
    for s in [*silent, late]:
        await s.aclose()


async def test_with_none_idle_the_newcomer_is_answered_503_at_once_and_closed(nursery: trio.Nursery) -> None:
    release = trio.Event()

    async def slow(request: Request) -> Response:
        await release.wait()
        return Response.json(200, {"path": request.path})

    stats = listeners.ConnectionStats()
    bound = await nursery.start(
        lambda task_status: serve_http(
            slow, "127.0.0.1", 0, limits=Limits(max_connections=2), stats=stats, task_status=task_status
        )
    )
    host, port = bound_address(bound)
    busy = []
    for _ in range(2):  # both places serving a request: none idle
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
        busy.append(stream)
    while stats.open.get(listener="http") < 2:
        await trio.sleep(0.01)
    late = await trio.open_tcp_stream(host, port)
    await late.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}")
    answer = b""
    with trio.fail_after(5):
        while chunk := await late.receive_some(65536):  # the answer, then the server closes
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"\r\nretry-after: 1\r\n" in head and head.endswith(b"\r\nconnection: close")
    assert b"as many connections as it may" in body
    assert stats.shed.get(listener="http", reason="busy") == 1
    release.set()
    for stream in busy:
        with trio.fail_after(5):
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
    fresh = await trio.open_tcp_stream(host, port)
    assert (await get(fresh, "/again")).startswith(b"HTTP/1.1 200 ")
    for s in [*busy, late, fresh]:
        await s.aclose()


class QueueListener(trio.abc.Listener):
    """Hands out the server ends of memory stream pairs the test makes, in order."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[trio.abc.Stream](100)
        self.waiting = 0

    def connect(self) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        self._send.send_nowait(server)
        self.waiting += 1
        return client

    async def accept(self) -> trio.abc.Stream:
        stream = await self._receive.receive()
        self.waiting -= 1
        return stream

    async def aclose(self) -> None:
        pass


async def test_past_the_overflow_accepting_pauses_and_the_backlog_holds_connections(
    autojump_clock: trio.testing.MockClock,
) -> None:
    served: list[float] = []
    refused: list[float] = []

    async def handle(stream: trio.abc.Stream) -> None:
        served.append(trio.current_time())
        await trio.sleep_forever()

    async def refuse(stream: trio.abc.Stream) -> None:
        refused.append(trio.current_time())
        await trio.sleep_forever()  # a refusal that never ends is cut at REFUSE_S

    stats = listeners.ConnectionStats()
    listener = QueueListener()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: listeners.serve_capped(
                handle, [listener], max_connections=1, overflow=1, refuse=refuse, stats=stats, listener="l"
            )
        )
        for _ in range(3):
            listener.connect()
        await trio.sleep(1)
        assert (len(served), len(refused), listener.waiting) == (1, 1, 1)  # the third waits its turn
        assert stats.at_capacity.get(listener="l") == 1
        assert stats.shed.get(listener="l", reason="busy") == 1
        await trio.sleep(listeners.REFUSE_S)  # the stuck refusal is cut: the third is taken, turned away
        assert (len(served), len(refused), listener.waiting) == (1, 2, 0)
        assert refused[1] == pytest.approx(listeners.REFUSE_S, abs=0.01)
        nursery.cancel_scope.cancel()


async def test_idle_connections_are_shed_oldest_first_and_a_stop_closes_only_the_stoppable() -> None:
    idle = listeners.IdleConnections()
    ended: list[str] = []

    async def wait(name: str, stoppable: bool, task_status: trio.TaskStatus[None]) -> None:
        with idle.waiting(peer=name, stoppable=stoppable) as scope:
            task_status.started()
            await trio.sleep_forever()
        assert scope.cancelled_caught
        ended.append(name)

    async with trio.open_nursery() as nursery:
        for name, stoppable in (("a", True), ("b", False), ("c", True), ("d", False)):
            await nursery.start(wait, name, stoppable)
        assert idle.shed_oldest() == "a"
        await trio.testing.wait_all_tasks_blocked()
        assert ended == ["a"] and len(idle) == 3
        idle.stop()
        await trio.testing.wait_all_tasks_blocked()
        assert ended == ["a", "c"]
        assert [idle.shed_oldest(), idle.shed_oldest(), idle.shed_oldest()] == ["b", "d", None]
    assert ended[:2] == ["a", "c"] and sorted(ended[2:]) == ["b", "d"]  # those two end in the same tick
    with idle.waiting(stoppable=True) as late:  # after a stop, a stoppable wait ends at once
        await trio.sleep_forever()
    assert late.cancelled_caught


async def test_a_stop_closes_idle_keep_alive_connections_but_answers_a_new_connections_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shutdown = listeners.Shutdown()
    kept, kept_server = trio.testing.memory_stream_pair()
    fresh, fresh_server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        for stream in (kept_server, fresh_server):
            nursery.start_soon(lambda s=stream: serve_connection(ok, s, shutdown=shutdown))
        assert (await get(kept, "/one")).startswith(b"HTTP/1.1 200 ")  # then idle, kept alive
        await trio.sleep(1)  # the new one: silent so far, its request perhaps on the way
        shutdown.begin()
        with trio.fail_after(1):
            assert await kept.receive_some(65536) == b""  # closed at once, quietly
        answer = await get(fresh, "/late")  # answered, and told it is the last
        assert answer.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: close\r\n" in answer
        with trio.fail_after(1):
            assert await fresh.receive_some(65536) == b""


async def test_a_budget_serves_to_its_size_then_sheds_then_is_full() -> None:
    idle = listeners.IdleConnections()
    budget = listeners.Budget(2, idle)
    assert [budget.admit()[0] for _ in range(2)] == [listeners.Admission.SERVE] * 2
    assert budget.admit() == (listeners.Admission.FULL, "")  # none waiting
    waiting = idle.scope(peer="192.0.2.9")  # one waiting, as `waiting` records it
    assert budget.admit() == (listeners.Admission.SHED, "192.0.2.9") and waiting.cancel_called
    assert budget.used == 3  # the shed one counts until it has closed
    budget.leave()
    assert budget.admit() == (listeners.Admission.FULL, "")


async def test_a_budget_that_sheds_silent_peers_keeps_one_that_was_heard_lately(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A thousand agents handshaking at once are slow to be served, not silent: the newcomer is
    # turned away (it dials again) rather than throwing away the work of one half done.
    idle = listeners.IdleConnections(reason="unproven")
    budget = listeners.Budget(2, idle, silent_s=1.0)
    heard = {"a": 0.0, "b": 0.0}
    scopes = {p: idle.scope(peer=p, heard=lambda p=p: heard[p]) for p in heard}
    assert [budget.admit()[0] for _ in range(2)] == [listeners.Admission.SERVE] * 2
    await trio.sleep(0.5)
    assert budget.admit() == (listeners.Admission.FULL, "")  # both heard within the second
    await trio.sleep(0.6)
    heard["a"] = trio.current_time()  # a's peer sent its next flight; b's said nothing
    assert budget.admit() == (listeners.Admission.SHED, "b") and scopes["b"].cancel_called
    assert not scopes["a"].cancel_called
    await trio.sleep(0.5)
    assert budget.admit() == (listeners.Admission.FULL, "")  # a: heard 0.5 s ago
    await trio.sleep(0.5)
    assert budget.admit() == (listeners.Admission.SHED, "a")
    # Without a `heard`, a wait counts from its start.
    idle.scope(peer="c")
    await trio.sleep(0.9)
    assert budget.admit() == (listeners.Admission.FULL, "")
    await trio.sleep(0.1)
    assert budget.admit() == (listeners.Admission.SHED, "c")


async def test_a_heard_connection_notes_when_its_peer_last_sent(autojump_clock: trio.testing.MockClock) -> None:
    a, b = trio.socket.socketpair()
    heard = Heard(trio.SocketStream(a))
    peer = trio.SocketStream(b)
    at = heard_at(trio.SSLStream(heard, ssl.create_default_context()))
    assert at is not None and at() == heard.heard_at == 0.0
    await trio.sleep(5)
    await peer.send_all(b"x")
    assert await heard.receive_some(10) == b"x" and at() == 5.0
    await heard.send_all(b"y")  # what this side sends is not the peer's
    assert await peer.receive_some(10) == b"y" and at() == 5.0
    assert heard_at(peer) is None
    await heard.aclose()
    await peer.aclose()


class FlakyListener(trio.abc.Listener):
    """Fails its first accepts the way a process out of descriptors does, then accepts."""

    def __init__(self, failures: list[int]) -> None:
        self.failures = failures
        self.accepted: list[trio.abc.Stream] = []

    async def accept(self) -> trio.abc.Stream:
        if self.failures:
            raise OSError(self.failures.pop(0), "simulated")
        if self.accepted:
            await trio.sleep_forever()
        client, server = trio.testing.memory_stream_pair()
        self.accepted.append(client)
        return server

    async def aclose(self) -> None:
        pass


async def test_running_out_of_descriptors_pauses_accepting_instead_of_failing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    listener = FlakyListener([errno.EMFILE, errno.ENFILE])
    handled: list[float] = []

    async def handle(stream: trio.abc.Stream) -> None:
        handled.append(trio.current_time())

    stats = listeners.ConnectionStats()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: listeners.serve_capped(handle, [listener], max_connections=10, stats=stats, listener="http")
        )
        with trio.fail_after(5):
            while not handled:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert handled[0] == pytest.approx(2 * listeners.ACCEPT_RETRY_S, abs=0.01)


async def test_an_accept_error_that_is_not_about_capacity_is_raised() -> None:
    stats = listeners.ConnectionStats()
    with pytest.raises(Exception) as raised:  # - inside the nursery's exception group
        await listeners.serve_capped(
            lambda s: None, [FlakyListener([errno.EBADF])], max_connections=10, stats=stats, listener="http"
        )
    error = find(raised.value, OSError)
    assert error is not None and error.errno == errno.EBADF


async def test_connection_caps_come_from_the_open_file_limit() -> None:
    # Agents keep a budget of their own; HTTP connections share the rest, two descriptors each.
    assert fdlimits.default_max_connections("agent", 1024) == 112
    assert fdlimits.default_max_connections("http", 1024) == 392
    # The systemd unit's LimitNOFILE=65536 leaves room for a 5,000-node cluster's agents.
    assert fdlimits.default_max_connections("agent", 65536) == 8176
    assert fdlimits.default_max_connections("http", 65536) == 28616
    assert fdlimits.default_max_connections("agent", 1 << 20) == 16384
    assert fdlimits.default_max_connections("http", 100) >= 16
