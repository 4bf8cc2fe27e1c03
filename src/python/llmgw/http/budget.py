"""The body budget of a listener: the request body bytes it buffers at once, charged as they
arrive, with each owner (an API key, or a peer address) held to a share, and the oldest bodies
always able to finish (see `llmgw.http.body`'s docstring for why each rule). Used by
`llmgw.http.body.ConnectionBody`, one `Claim` per body read.

Each operation is O(log n) in the bodies waiting (a heap) or O(1); a body gives way at most once.
"""

from __future__ import annotations

import heapq
import math

import trio

from llmgw.http.errors import Abort
from llmgw.http.limits import Limits

# A body waits this long for room in the body budget before it is answered 503.
BODY_BUDGET_WAIT_S = 1.0
# The share of the budget one owner may hold at once: a quarter, or one body of the largest
# size allowed where that is more (so that such a body can always be read).
BODY_SHARE = 0.25


class BodyBudget:
    """Request body bytes buffered at once over every connection of a listener, charged as they
    arrive (`Claim.take`) and given back when their request is over (`Claim.release`); each
    owner (an API key, or a peer address) holds at most `share` of them. Bytes that do not fit
    wait, oldest claim first (`Claim.age`), up to `wait_s`, then their request is answered 503;
    meanwhile the youngest body still arriving, if younger than the waiter, gives way (the
    module's docstring), so that the oldest always finish. A newcomer waits behind older
    waiters."""

    def __init__(self, max_bytes: int, *, share: int | None = None, wait_s: float = BODY_BUDGET_WAIT_S) -> None:
        self.max_bytes = max_bytes
        self.share = max_bytes if share is None else share
        self.wait_s = wait_s
        self.used = 0
        self.refused = 0  # waited for room in vain, or gave way to an older body
        self.held: dict[str, int] = {}  # by owner; an owner holding nothing is not in it
        # Claims holding bytes and still arriving, in the order they first held some (their
        # `rank`): the last is the youngest (dicts as ordered sets).
        self._arriving: dict[Claim, None] = {}
        self._owner_arriving: dict[str, dict[Claim, None]] = {}
        self._room = _Waiters()  # waiting for the budget
        self._owner_room: dict[str, _Waiters] = {}  # waiting for their owner's share
        self._next_seq = 0
        self._next_rank = 0
        # Bytes of claims that gave way, coming back as their requests end: room already made.
        self._returning = 0
        self._owner_returning: dict[str, int] = {}

    @classmethod
    def of(cls, limits: Limits) -> BodyBudget:
        """A listener's budget: `body_budget_bytes`, an owner's share `BODY_SHARE` of it, or one
        body of the largest size allowed where that is more (so that one can always be read)."""
        budget = limits.body_budget_bytes
        return cls(budget, share=max(int(budget * BODY_SHARE), min(limits.max_body_bytes, budget)))

    def claim(self, owner: str) -> Claim:
        """A body's place in the budget, charged to `owner`; older than every claim made after."""
        self._next_seq += 1
        return Claim(self, owner, self._next_seq)

    def _blocked(self, n: int, claim: Claim) -> tuple[_Waiters, dict[Claim, None]] | None:
        """None if `n` more bytes of `claim` fit and no older claim waits before it; else where
        to wait, and the claims still arriving there whose youngest should give way (none when
        what is coming back already makes the room)."""
        owner = claim.owner
        waiters = self._owner_room.get(owner)
        held = self.held.get(owner, 0) + n
        if held > self.share or (waiters is not None and waiters.older_than(claim.age)):
            if waiters is None:
                waiters = self._owner_room[owner] = _Waiters()
            short = held - self._owner_returning.get(owner, 0) > self.share
            return waiters, self._owner_arriving.get(owner, {}) if short else {}
        if self.used + n > self.max_bytes or self._room.older_than(claim.age):
            short = self.used + n - self._returning > self.max_bytes
            return self._room, self._arriving if short else {}
        return None

    def _try_take(self, n: int, claim: Claim) -> bool:
        """Charge `n` bytes to `claim` if they fit without waiting."""
        if self._blocked(n, claim) is None:
            self._charge(n, claim)
            return True
        return False

    async def _take(self, n: int, claim: Claim) -> None:
        blocked = self._blocked(n, claim)
        if blocked is None:
            self._charge(n, claim)
            return
        with trio.move_on_after(self.wait_s):
            while blocked is not None:
                waiters, arriving = blocked
                self._youngest_gives_way(claim, arriving)
                try:
                    await waiters.wait(claim.age)
                finally:
                    if not waiters and self._owner_room.get(claim.owner) is waiters:
                        del self._owner_room[claim.owner]
                blocked = self._blocked(n, claim)
            self._charge(n, claim)
            self._wake(claim.owner)  # there may be room for the next one too
            return
        self.refused += 1
        self._wake(claim.owner)  # what this one waited for may be someone else's
        raise Abort("body_budget", 503, self._full(claim.owner), headers=(("retry-after", "1"),))

    def _youngest_gives_way(self, claim: Claim, arriving: dict[Claim, None]) -> None:
        """The youngest claim still arriving among `arriving`, if it is younger than `claim`,
        gives way (its read ends, and what it holds comes back when its request ends)."""
        if not arriving or claim.rank is None:  # holding nothing, it is the youngest
            return
        youngest = next(reversed(arriving))
        if youngest.rank > claim.rank:
            self.refused += 1
            youngest.give_way(self._full(youngest.owner) + "; an older request body needed the room")
            self._returning += youngest.returning
            self._owner_returning[youngest.owner] = self._owner_returning.get(youngest.owner, 0) + youngest.returning

    def _full(self, owner: str) -> str:
        return (
            f"the server is buffering {self.used} bytes of request bodies ({self.held.get(owner, 0)} of them "
            f"this client's, which may hold {self.share}), its limit of {self.max_bytes}; try again in a moment"
        )

    def _wake(self, owner: str) -> None:
        """The oldest waiter for the budget, and for `owner`'s share, look again."""
        if self._room:
            self._room.wake_oldest()
        waiters = self._owner_room.get(owner)
        if waiters is not None:
            waiters.wake_oldest()

    def _charge(self, n: int, claim: Claim) -> None:
        self.used += n
        self.held[claim.owner] = self.held.get(claim.owner, 0) + n
        if claim.rank is None:
            self._next_rank += 1
            claim.rank = self._next_rank
        if not claim.held and claim.arriving:
            self._arriving[claim] = None
            self._owner_arriving.setdefault(claim.owner, {})[claim] = None
        claim.held += n

    def _arrived(self, claim: Claim) -> None:
        """`claim` takes no more bytes: it no longer gives way to anyone."""
        claim.arriving = False
        self._arriving.pop(claim, None)
        mine = self._owner_arriving.get(claim.owner)
        if mine is not None:
            mine.pop(claim, None)
            if not mine:
                del self._owner_arriving[claim.owner]

    def _give(self, claim: Claim) -> None:
        if claim.arriving:
            self._arrived(claim)
        if claim.returning:
            self._returning -= claim.returning
            left = self._owner_returning[claim.owner] - claim.returning
            if left:
                self._owner_returning[claim.owner] = left
            else:
                del self._owner_returning[claim.owner]
            claim.returning = 0
        n, claim.held = claim.held, 0
        if not n:
            return
        self.used -= n
        left = self.held[claim.owner] - n
        if left:
            self.held[claim.owner] = left
        else:
            del self.held[claim.owner]
        self._wake(claim.owner)


class _Waiters:
    """Tasks waiting for room, woken oldest first (a heap by `Claim.age`, which is unique); one
    that stops waiting (its deadline, a cancellation) is dropped when it comes up."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, int], trio.Event]] = []
        self._gone: set[tuple[float, int]] = set()  # ages that stopped waiting, still in the heap

    def __bool__(self) -> bool:
        return len(self._heap) > len(self._gone)

    def older_than(self, age: tuple[float, int]) -> bool:
        """Whether a claim older than `age` waits here."""
        self._drop_gone()
        return bool(self._heap) and self._heap[0][0] < age

    async def wait(self, age: tuple[float, int]) -> None:
        event = trio.Event()
        heapq.heappush(self._heap, (age, event))
        try:
            await event.wait()
        finally:
            if not event.is_set():
                self._gone.add(age)

    def wake_oldest(self) -> None:
        self._drop_gone()
        if self._heap:
            heapq.heappop(self._heap)[1].set()

    def _drop_gone(self) -> None:
        while self._heap and self._heap[0][0] in self._gone:
            self._gone.discard(heapq.heappop(self._heap)[0])


class Claim:
    """One body's bytes in a `BodyBudget`: taken as they arrive (`take`, within `receiving`),
    no more once it has arrived (`arrived`), all given back at once (`release`). Its `rank`:
    when it first held bytes, among all claims (None before); one that must give way has its
    `receiving` scope cancelled and `gave_way` says why."""

    __slots__ = ("budget", "owner", "seq", "rank", "held", "arriving", "gave_way", "returning", "_scope")

    def __init__(self, budget: BodyBudget, owner: str, seq: int) -> None:
        self.budget, self.owner, self.seq = budget, owner, seq
        self.rank: int | None = None
        self.held = 0
        self.arriving = True
        self.gave_way = ""
        self.returning = 0  # of what it held when it gave way: on its way back
        self._scope: trio.CancelScope | None = None

    @property
    def age(self) -> tuple[float, int]:
        """Older first: by when it first held bytes, then (holding none yet) by when it was made."""
        return (math.inf if self.rank is None else self.rank, self.seq)

    async def take(self, n: int) -> None:
        await self.budget._take(n, self)

    def try_take(self, n: int) -> bool:
        """Take `n` bytes if they fit at once (no older body waits, the share and the budget have
        room): what `take` does without waiting; False, and nothing taken, where it would wait."""
        return self.budget._try_take(n, self)

    def receiving(self) -> trio.CancelScope:
        """The scope the body is read in: cancelled if it must give way."""
        self._scope = trio.CancelScope()
        return self._scope

    def give_way(self, why: str) -> None:
        self.gave_way = why
        self.returning = self.held
        self.budget._arrived(self)  # never chosen twice
        if self._scope is not None:
            self._scope.cancel()

    def arrived(self) -> None:
        self._scope = None
        self.budget._arrived(self)

    def release(self) -> None:
        self._scope = None
        self.budget._give(self)
