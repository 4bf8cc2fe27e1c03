"""A request body's memory is bounded by the configuration, not by the garbage collector (issue
42): the budget is charged for the bytes that arrived, each owner (an API key, a peer address)
holds at most its share, and whatever ends a request — the client gone at any stage, a refusal,
a bug, a deadline — leaves nothing in a reference cycle, so that reference counting alone frees
its buffers the moment it ends. The last is checked with the cyclic collector disabled and
told to keep what it finds (`gc.DEBUG_SAVEALL`): a connection served over a real socket pair
must leave no unreachable object at all.
"""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator
from functools import partial

import pytest
import trio
import trio.testing

from llmgw.http.body import BodyBudget
from llmgw.http.errors import Abort, HTTPError
from llmgw.http.limits import Limits
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.http.server import serve_connection

pytestmark = pytest.mark.trio

MIB = 1 << 20


async def handler(request: Request) -> Response | StreamingResponse:
    if request.path == "/refuse":
        raise HTTPError(403, "refused from its head")
    if request.path == "/bug":
        raise RuntimeError("a bug of the handler")
    if request.path.startswith("/key/"):
        request.body_owner = request.path
    body = await request.read()
    if request.path == "/slow":
        await trio.sleep_forever()  # until the client leaves
    if request.path == "/stream":

        async def chunks():
            for _ in range(3):
                yield b"x" * 100

        return StreamingResponse(status=200, body=chunks())
    return Response.json(200, {"size": len(body)})


@pytest.fixture
def no_automatic_collection() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        if enabled:
            gc.enable()


def unreachable(existing: set[int] = frozenset()) -> list:
    """What the cyclic collector finds unreachable now of what a connection is made of — frames,
    tracebacks, exceptions, buffers, and objects of llmgw's and trio's classes — but for the
    `existing` (ids of objects there before: an earlier test's event loop, say, which the test
    runner lets go when it likes). Kept aside to be looked at, then let go."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [o for o in gc.garbage if id(o) not in existing and _ours(o)]
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    gc.collect()
    return found


def _ours(o: object) -> bool:
    if isinstance(o, (BaseException, types.FrameType, types.TracebackType, bytearray)):
        return True
    return type(o).__module__.split(".")[0] in ("llmgw", "trio")


async def serve_one(data: bytes, *, hold_s: float = 0.05, budget: BodyBudget | None = None) -> bytes:
    """Serve one connection over a real socket pair whose client sends `data`, waits `hold_s`
    (real time: the server reads the socket), and closes; what the client was answered."""
    a, b = trio.socket.socketpair()
    client, server = trio.SocketStream(a), trio.SocketStream(b)
    answer = b""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(serve_connection, handler, server, limits=Limits(), budget=budget))
        await client.send_all(data)
        with trio.move_on_after(hold_s):
            while chunk := await client.receive_some(65536):
                answer += chunk
        await client.aclose()
    return answer


HEAD = b"POST %s HTTP/1.1\r\nhost: t\r\n"
ENDINGS = {
    "head only, 8 MiB declared": HEAD % b"/x" + b"content-length: 8000000\r\n\r\n",
    "part of a content-length body": HEAD % b"/x" + b"content-length: 8000000\r\n\r\n" + b"x" * 300_000,
    "part of a chunked body": HEAD % b"/x"
    + b"transfer-encoding: chunked\r\n\r\n"
    + b"2000\r\n"
    + b"x" * 0x2000
    + b"\r\n",
    "in the middle of a chunk": HEAD % b"/x" + b"transfer-encoding: chunked\r\n\r\n30000\r\n" + b"x" * 3000,
    "keep-alive after a finished request": HEAD % b"/x" + b"content-length: 5\r\n\r\nhello",
    "a key's body cut": HEAD % b"/key/a" + b"content-length: 8000000\r\n\r\n" + b"x" * 100_000,
    "refused from its head": HEAD % b"/refuse" + b"content-length: 8000000\r\n\r\n" + b"x" * 1000,
    "a handler's bug": HEAD % b"/bug" + b"content-length: 5\r\n\r\nhello",
    "gone while the handler works": HEAD % b"/slow" + b"content-length: 5\r\n\r\nhello",
    "a streamed answer": HEAD % b"/stream" + b"content-length: 5\r\n\r\nhello",
    "garbage": b"NOT HTTP\x00\r\n\r\n",
    "too large": HEAD % b"/x" + b"content-length: 80000000\r\n\r\n",
    "a head cut": b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-le",
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_a_request_ended_at_any_stage_leaves_no_reference_cycle(ending: str, no_automatic_collection) -> None:
    await serve_one(ENDINGS["keep-alive after a finished request"])  # what is made once, made
    unreachable()
    existing = {id(o) for o in gc.get_objects()}
    budget = BodyBudget.of(Limits())
    await serve_one(ENDINGS[ending], hold_s=0.2 if ending.startswith("gone") else 0.05, budget=budget)
    left = unreachable(existing)
    kinds = sorted({type(o).__name__ for o in left})
    assert not left, f"{len(left)} objects left in reference cycles after {ending!r}: {kinds}"
    assert budget.used == 0 and budget.held == {}


async def test_the_budget_is_charged_for_the_bytes_that_arrived_not_those_declared() -> None:
    budget = BodyBudget.of(Limits())
    a, b = trio.socket.socketpair()
    client, server = trio.SocketStream(a), trio.SocketStream(b)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(serve_connection, handler, server, budget=budget))
        await client.send_all(HEAD % b"/x" + b"content-length: 8388608\r\n\r\n" + b"x" * 10_000)
        with trio.fail_after(5):
            while budget.used < 10_000:
                await trio.sleep(0.01)
        assert budget.used == 10_000 and budget.held == {"addr:unix": 10_000}
        await client.aclose()
    assert budget.used == 0


async def test_no_owner_holds_more_than_its_share(autojump_clock: trio.testing.MockClock) -> None:
    budget = BodyBudget(1000, share=400, wait_s=1.0)
    await budget.claim("key:a").take(300)
    await budget.claim("key:a").take(100)
    with pytest.raises(Abort) as refused:
        await budget.claim("key:a").take(1)  # the youngest of its owner's: waits its second, then 503
    assert refused.value.status == 503
    assert "400 of them this client's, which may hold 400" in refused.value.message
    assert trio.current_time() == pytest.approx(1.0)
    await budget.claim("key:b").take(400)  # another owner is not held back
    await budget.claim("addr:10.0.0.1").take(200)
    assert budget.used == 1000 and budget.held == {"key:a": 400, "key:b": 400, "addr:10.0.0.1": 200}
    assert budget.refused == 1


async def test_an_owner_waiting_for_its_share_is_let_in_when_its_own_body_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = BodyBudget(1000, share=400, wait_s=5.0)
    first = budget.claim("key:a")
    await first.take(400)
    first.arrived()  # whole: it waits for its answer now, and gives way to nobody
    taken_at: list[float] = []

    async def more() -> None:
        await budget.claim("key:a").take(300)
        taken_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(more)
        await trio.sleep(2)
        other = budget.claim("key:b")
        await other.take(300)  # another owner's body coming and going frees none of a's share
        other.release()
        await trio.sleep(1)
        assert taken_at == []
        first.release()
    assert taken_at == [pytest.approx(3.0)]
    assert budget.held == {"key:a": 300} and budget.used == 300


async def test_the_youngest_body_still_arriving_gives_way_to_an_older_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = BodyBudget(1000, share=400, wait_s=5.0)
    older, younger = budget.claim("key:a"), budget.claim("key:a")
    await older.take(200)
    cancelled = []

    async def arrive_slowly() -> None:
        with younger.receiving() as scope:
            await younger.take(200)
            await trio.sleep_forever()  # until it gives way
        cancelled.append(scope.cancelled_caught)
        younger.release()  # its request ends: what it held comes back

    async with trio.open_nursery() as nursery:
        nursery.start_soon(arrive_slowly)
        await trio.sleep(1)
        await older.take(100)  # the share is full: the younger gives way, then the older takes its room
    assert cancelled == [True] and "an older request body needed the room" in younger.gave_way
    assert budget.held == {"key:a": 300} and older.held == 300 and budget.refused == 1
    assert trio.current_time() == pytest.approx(1.0)


async def test_many_bodies_arriving_at_once_never_all_wait_on_each_other(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Fifty bodies of one key, each arriving in pieces: charged as they arrive, each would hold
    a part of the share and wait for the rest, and all be refused together. The oldest (the
    first to hold bytes) finish, the youngest giving way to them."""
    budget = BodyBudget(64_000, share=16_000, wait_s=1.0)
    finished: list[int] = []
    refused: list[int] = []

    async def body(i: int, claim) -> None:
        try:
            with claim.receiving():
                for _ in range(8):  # 8,000 bytes: two fit the share
                    await claim.take(1000)
                    await trio.sleep(0.01)
            if claim.gave_way:
                refused.append(i)
                return
            claim.arrived()
            finished.append(claim.rank)
            await trio.sleep(0.5)  # answered, then its request ends
        except Abort:
            refused.append(i)
        finally:
            claim.release()

    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(body, i, budget.claim("key:a"))
    assert sorted(finished[:2]) == [1, 2] and len(finished) + len(refused) == 50
    assert budget.used == 0 and budget.held == {}


async def test_a_budget_share_is_at_least_one_body_of_the_largest_size() -> None:
    assert BodyBudget.of(Limits()).share == 16 * MIB  # a quarter of 64 MiB
    assert BodyBudget.of(Limits(max_body_bytes=32 * MIB)).share == 32 * MIB
    assert BodyBudget.of(Limits(max_body_bytes=8 * MIB, body_budget_bytes=8 * MIB)).share == 8 * MIB
