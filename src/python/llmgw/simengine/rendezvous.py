"""The rendezvous of a multi-node sim replica over real TCP, as a NCCL job's would be.

Rank 0 binds `--dist-init-addr` and takes one connection per worker (`Rank0.serve`); a
worker connects with backoff until its deadline, says hello with its rank, and holds the
connection (`serve_worker`). Every held connection carries heartbeats both ways
(`protocol.HEARTBEAT_S`); a peer that closes, breaks or falls silent for
`protocol.PEER_TIMEOUT_S` is a lost member, and a lost member fails the replica: the side
that notices raises `MemberLost`, which ends its process with status 3.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from llmgw.backoff import Backoff, Failures
from llmgw.errors import MachineError, find
from llmgw.log import get_logger
from llmgw.simengine import protocol
from llmgw.simengine.errors import MemberLost, RendezvousFailed
from llmgw.simengine.options import SimOptions, format_addr

log = get_logger("llmgw.sim")

JOIN_BACKOFF = Backoff(first_s=0.1, max_s=2.0)  # a worker dialling rank 0, until its deadline
_CONNECTION_FAILURES = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.TooSlowError,
    protocol.RendezvousProtocolError,
)


class Channel:
    """Rendezvous messages over one stream. One task sends at a time, one receives."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._lines = protocol.LineBuffer()
        self._pending: deque[bytes] = deque()

    async def send(self, message: Mapping[str, Any]) -> None:
        # A peer that does not read for this long is as good as hung.
        with trio.fail_after(protocol.PEER_TIMEOUT_S):
            await self.stream.send_all(protocol.encode(message))

    async def receive(self) -> dict[str, Any] | None:
        """The next message, or None when the peer has closed the connection."""
        while not self._pending:
            data = await self.stream.receive_some(protocol.MAX_LINE)
            if not data:
                return None
            self._pending.extend(self._lines.feed(data))
        return protocol.decode(self._pending.popleft())


def peer_of(stream: trio.abc.Stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
    except (OSError, AttributeError):  # AttributeError: an in-memory stream in tests
        return "?"
    return format_addr((host, port))


async def _heartbeat(channel: Channel, ready: trio.Event | None = None) -> None:
    """Send a ping every HEARTBEAT_S, and `ready` once when `ready` is set (rank 0's side)."""
    while True:
        became_ready = False
        with trio.move_on_after(protocol.HEARTBEAT_S):
            if ready is not None:
                await ready.wait()
                became_ready = True
            else:
                await trio.sleep_forever()
        if became_ready:
            ready = None
            await channel.send(protocol.READY)
        else:
            await channel.send(protocol.PING)


async def _hold(channel: Channel, who: str, ready: trio.Event | None, on_message: Callable[[dict], None]) -> None:
    """Heartbeat with the peer until it is lost; then raise `MemberLost` saying how."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_heartbeat, channel, ready)
            while True:
                with trio.move_on_after(protocol.PEER_TIMEOUT_S) as silence:
                    message = await channel.receive()
                if silence.cancelled_caught:
                    raise MemberLost(
                        f"{who} sent nothing for {protocol.PEER_TIMEOUT_S:g} s (heartbeats every "
                        f"{protocol.HEARTBEAT_S:g} s): it is hung or cut off"
                    )
                if message is None:
                    raise MemberLost(f"{who} closed the connection (its process exited or was killed)")
                on_message(message)
    except Exception as exc:  # a nursery reports its task's failure inside an exception group
        lost = find(exc, MemberLost)
        if lost is not None:
            raise lost from None
        broken = find(exc, _CONNECTION_FAILURES)
        if broken is None:
            raise
        if isinstance(broken, trio.TooSlowError):
            reason = f"it read nothing we sent for {protocol.PEER_TIMEOUT_S:g} s"
        else:
            reason = str(broken) or repr(broken)
        raise MemberLost(f"the connection to {who} broke: {reason}") from None


async def _listen(addr: tuple[str, int], what: str) -> list[trio.SocketListener]:
    try:
        return await trio.open_tcp_listeners(addr[1], host=addr[0])
    except OSError as exc:
        raise MachineError(
            f"cannot listen on {format_addr(addr)} for {what}: {exc.strerror or exc}; "
            "choose another address or port, or stop whatever holds it"
        ) from None


class Rank0:
    """Rank 0's side: who has joined (rank -> address) and when everyone has."""

    def __init__(self, *, nnodes: int, model: str, address: tuple[str, int]) -> None:
        self.nnodes = nnodes
        self.model = model
        self.address = address
        self.members: dict[int, str] = {}
        self.complete = trio.Event()
        if nnodes == 1:
            self.complete.set()

    def describe(self) -> str:
        missing = protocol.missing_ranks(self.nnodes, self.members)
        return (
            f"rendezvous at {format_addr(self.address)}: {len(self.members)} of {self.nnodes - 1} workers joined, "
            f"waiting for rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        )

    async def serve(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await _listen(self.address, "the rendezvous (--dist-init-addr)")
        host, port = listeners[0].socket.getsockname()[:2]
        log.info("rendezvous_waiting", addr=format_addr((host, port)), expected=self.nnodes - 1)
        task_status.started((host, port))
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.abc.Stream) -> None:
        """One connection: a worker's hello, then its heartbeats until it is lost."""
        addr = peer_of(stream)
        channel = Channel(stream)
        try:
            await self._member(channel, addr)
        finally:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await stream.aclose()

    async def _member(self, channel: Channel, addr: str) -> None:
        try:
            with trio.fail_after(protocol.HELLO_TIMEOUT_S):
                message = await channel.receive()
        except _CONNECTION_FAILURES as exc:
            log.warning("rendezvous_stray_connection", addr=addr, reason=str(exc) or repr(exc))
            return
        if message is None:
            return
        reason = protocol.check_hello(message, nnodes=self.nnodes, model=self.model, joined=self.members)
        if reason is not None:
            log.warning("worker_refused", addr=addr, reason=reason)
            try:
                await channel.send({"type": "reject", "reason": reason})
            except _CONNECTION_FAILURES:
                pass  # it is refused either way
            return
        rank = message["rank"]
        self.members[rank] = addr
        log.info("worker_joined", rank=rank, addr=addr, joined=len(self.members), expected=self.nnodes - 1)
        if not protocol.missing_ranks(self.nnodes, self.members):
            log.info("rendezvous_complete", members={str(r): a for r, a in sorted(self.members.items())})
            self.complete.set()
        who = f"rank {rank} ({addr})"
        try:
            await channel.send({"type": "welcome", "joined": len(self.members), "expected": self.nnodes - 1})
            await _hold(channel, who, self.complete, lambda message: None)
        except MemberLost as lost:
            log.error("worker_lost", rank=rank, addr=addr, reason=str(lost))
            raise
        except _CONNECTION_FAILURES as exc:
            log.error("worker_lost", rank=rank, addr=addr, reason=str(exc) or repr(exc))
            raise MemberLost(f"{who} was lost while joining: {exc!r}") from None


Connect = Callable[[str, int], Awaitable[trio.abc.Stream]]


async def connect_with_backoff(addr: tuple[str, int], timeout_s: float, connect: Connect = trio.open_tcp_stream):
    """A stream to rank 0, retrying refused or failed connections with exponential backoff
    (`JOIN_BACKOFF`: 0.1 s doubling to 2 s) until `timeout_s` has passed, as torch.distributed's
    store clients do: rank 0 may simply not be up yet."""
    deadline = trio.current_time() + timeout_s
    failures, last = Failures(JOIN_BACKOFF), "no attempt"
    log.info("rendezvous_connecting", addr=format_addr(addr), timeout_s=timeout_s)
    while True:
        with trio.move_on_after(max(0.0, deadline - trio.current_time())):
            try:
                return await connect(*addr)
            except OSError as exc:
                last = exc.strerror or str(exc)
        failures.failed(trio.current_time())
        delay = failures.delay()
        if trio.current_time() + delay >= deadline:
            raise RendezvousFailed(
                f"rank 0 at {format_addr(addr)} was not reachable within {timeout_s:g} s "
                f"({failures.count} attempts; last: {last}); start rank 0 with --dist-init-addr {format_addr(addr)} "
                "and check that this node can reach that address"
            )
        log.debug("rendezvous_retry", addr=format_addr(addr), attempt=failures.count, reason=last, retry_in_s=delay)
        await trio.sleep(delay)


async def serve_worker(
    options: SimOptions,
    *,
    connect: Connect = trio.open_tcp_stream,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A worker: join rank 0, then hold the connection until either side is lost. Never returns."""
    assert options.dist_init_addr is not None
    addr = format_addr(options.dist_init_addr)
    stream = await connect_with_backoff(options.dist_init_addr, options.rendezvous_timeout_s, connect)
    channel = Channel(stream)
    who = f"rank 0 ({addr})"
    try:
        try:
            await channel.send(protocol.hello(rank=options.node_rank, nnodes=options.nnodes, model=options.model))
            with trio.fail_after(protocol.PEER_TIMEOUT_S):
                reply = await channel.receive()
        except _CONNECTION_FAILURES as exc:
            raise RendezvousFailed(f"{who} did not answer this worker's hello: {exc!r}") from None
        if reply is None:
            raise RendezvousFailed(f"{who} closed the connection before answering this worker's hello")
        if reply.get("type") == "reject":
            raise RendezvousFailed(f"{who} refused rank {options.node_rank}: {reply.get('reason')}")
        if reply.get("type") != "welcome":
            raise RendezvousFailed(f"{who} answered the hello with {reply.get('type')!r}; is that an llmgw sim engine?")
        log.info(
            "rendezvous_joined",
            rank=options.node_rank,
            addr=addr,
            joined=reply.get("joined"),
            expected=reply.get("expected"),
        )
        task_status.started()

        def on_message(message: dict[str, Any]) -> None:
            if message.get("type") == "ready":
                log.info("rendezvous_complete", rank=options.node_rank, nnodes=options.nnodes)

        try:
            await _hold(channel, who, None, on_message)
        except MemberLost as lost:
            log.error("rank0_lost", addr=addr, reason=str(lost))
            raise
    finally:
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True
            await stream.aclose()
