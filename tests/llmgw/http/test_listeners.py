"""The connection cap and the accept loop: real sockets on loopback for the cap, a stand-in
listener for the accept errors only a kernel out of descriptors would produce."""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from llmgw.errors import find
from llmgw.http import listeners
from llmgw.http import server as http

pytestmark = pytest.mark.trio


async def ok(request: http.Request) -> http.Response:
    return http.Response.json(200, {"path": request.path})


async def test_past_the_cap_new_connections_wait_in_the_backlog_until_one_ends(nursery: trio.Nursery) -> None:
    stats = listeners.ConnectionStats()
    bound = await nursery.start(
        lambda task_status: http.serve_http(
            ok, "127.0.0.1", 0, limits=http.Limits(max_connections=5), stats=stats, task_status=task_status
        )
    )
    host, port = http.bound_address(bound)
    idle = [await trio.open_tcp_stream(host, port) for _ in range(5)]
    late = await trio.open_tcp_stream(host, port)  # the kernel completes the handshake: it is in the backlog
    await late.send_all(b"GET /late HTTP/1.1\r\nhost: t\r\n\r\n")
    with trio.move_on_after(0.5):
        answer = await late.receive_some(65536)
        raise AssertionError(f"answered past the cap: {answer!r}")
    assert stats.at_capacity.get(listener="http") >= 1
    assert stats.open.get(listener="http") == 5
    await idle.pop().aclose()  # one slot frees: the waiting connection is taken and answered
    with trio.fail_after(5):
        answer = await late.receive_some(65536)
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"/late"' in answer
    for s in [*idle, late]:
        await s.aclose()


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
    assert listeners.default_max_connections("agent", 1024) == 112
    assert listeners.default_max_connections("http", 1024) == 392
    assert listeners.default_max_connections("agent", 65536) == 4096
    assert listeners.default_max_connections("http", 65536) == 30656
    assert listeners.default_max_connections("http", 100) >= 16
