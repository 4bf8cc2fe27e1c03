"""Token budgets as one gateway instance enforces them (issue 48; docs/gateway.md, "Budgets").

A budget is a key's or a team's, for one model or all, per minute, day or month
(`llmgw.wire.gateway_link.GatewayBudget`); a request counts against every budget of its key and
of its key's team, for its model and for all. Before it goes to an engine each of them reserves
an estimate of its tokens (`estimate`: the body's bytes / PROMPT_BYTES_PER_TOKEN for the prompt,
plus its `max_tokens`, or DEFAULT_COMPLETION without); when it ends, the reservation is given
back and its engine's usage (prompt plus completion tokens) is taken instead, or the reservation
itself when the usage is not known.

- A minute budget (tokens per minute) is shared as a request rate limit is: with `count`
  instances, each refills at tokens / count a minute, holding at most that (`PerMinute`).
- A day or month budget is spent from grants the control plane hands out (`Granted`; the rule is
  `llmgw.server.state.budgets`'): the instance asks for more (`want`) when what it holds cannot
  cover a reservation, and reports what it used, holds and has reserved (`report`). It spends
  grants only while its link is up: when the link goes it drops what it held (keeping a debt),
  and the control plane hands that out again once the link has been gone its grace.

The bound: when what is held cannot cover a request's reservation but something is held, one
request of the budget is let through on that instance (the overrunning answer); no other is
until it ended and more came. So an instance spends past what it was granted by at most one
answer per budget (and by what an answer's tokens pass its reservation, which the estimate
makes rare for the prompt and impossible for a completion bounded by `max_tokens`).

`Budgets` is synchronous and does no I/O; `reserve` is the request's wait for a grant. A key with
no budget costs one dict lookup per request (`applies`).
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable

import attrs
import trio

from llmgw.wakeup import Wakeup
from llmgw.wire import gateway_link as g

PROMPT_BYTES_PER_TOKEN = 3  # a token is rarely shorter than 3 bytes of a JSON body
DEFAULT_COMPLETION = 1024  # reserved for the answer of a request without max_tokens
WANT_RESERVATIONS = 8  # an instance asks for enough for this many of its latest reservation
GRANT_WAIT_S = 2.0  # how long a request waits for a grant asked for before it is refused
BUDGET_EXCEEDED, BUDGET_UNAVAILABLE = "budget_exceeded", "budget_unavailable"


def prompt_estimate(body_bytes: int) -> int:
    """A request's prompt tokens at most, from its body's size (also what the usage counts for a
    stream cut before its engine said its usage: `gateway/job.py`)."""
    return body_bytes // PROMPT_BYTES_PER_TOKEN


def estimate(body_bytes: int, max_tokens: int | None) -> int:
    """A request's reservation: its prompt at most, and its answer's longest."""
    completion = max_tokens if max_tokens is not None and max_tokens > 0 else DEFAULT_COMPLETION
    return prompt_estimate(body_bytes) + completion


def period_start(period: str, now: float) -> int:
    """The start (unix seconds, UTC) of the period holding `now`: a minute, a day from midnight,
    a month from the first at midnight."""
    t = int(now // 1)
    if period == "minute":
        return t - t % 60
    if period == "day":
        return t - t % 86400
    tm = time.gmtime(t)
    return calendar.timegm((tm.tm_year, tm.tm_mon, 1, 0, 0, 0))


def period_end(period: str, start: int) -> int:
    """When the period beginning at `start` ends (the next one's start)."""
    if period == "minute":
        return start + 60
    if period == "day":
        return start + 86400
    tm = time.gmtime(start)
    year, month = (tm.tm_year + 1, 1) if tm.tm_mon == 12 else (tm.tm_year, tm.tm_mon + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0))


def period_bounds(period: str, now: float) -> tuple[int, int]:
    start = period_start(period, now)
    return start, period_end(period, start)


def describe(budget: g.GatewayBudget) -> str:
    model = f"model {budget.model!r}" if budget.model else "all models"
    return f"{budget.scope_kind} {budget.scope!r}'s {budget.period} budget of {budget.tokens} tokens for {model}"


@attrs.frozen(kw_only=True)
class Refused:
    """Why a request may not go now: 429 `budget_exceeded` (spent, or its share of a minute's
    spent), or 503 `budget_unavailable` (no grant to be had from the control plane now)."""

    status: int
    code: str
    message: str
    param: str  # the budget's id: SCOPE_KIND:SCOPE:MODEL:PERIOD
    retry_after_s: float
    resets_at: int = 0  # unix seconds: when the period turns (day and month budgets)


@attrs.frozen
class Wanting:
    """A grant is asked for; try again once `Budgets.granted` fires."""


WANTING = Wanting()


@attrs.define(kw_only=True, eq=False)
class Granted:
    """A day or month budget on this instance, in its period."""

    budget: g.GatewayBudget
    start: int
    end: int
    used: int = 0
    held: int = 0
    reserved: int = 0
    received: int = 0  # granted on this link
    want: int = 0
    overrunning: int = 0
    exhausted: bool = False

    def use(self) -> g.BudgetUse:
        return g.BudgetUse(
            budget_id=self.budget.id,
            period_start=self.start,
            used=self.used,
            held=max(0, self.held),
            debt=max(0, -self.held),
            reserved=self.reserved,
            granted=self.received,
            want=self.want,
        )


@attrs.define(kw_only=True, eq=False)
class PerMinute:
    """A minute budget's share on this instance: a bucket of tokens that may go below 0."""

    budget: g.GatewayBudget
    per_minute: float
    level: float
    updated: float
    overrunning: int = 0

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + max(0.0, now - self.updated) * self.per_minute / 60.0)
        self.updated = now


@attrs.define(eq=False)
class Hold:
    """What one request reserved: (budget, tokens, whether it is the overrunning one) each."""

    parts: list[tuple[Granted | PerMinute, int, bool]]


class Budgets:
    """The budgets this instance enforces. `clock`: monotonic seconds (the minute buckets);
    `wall`: unix seconds (the periods)."""

    def __init__(
        self,
        *,
        share: g.ShareChanged | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.clock, self.wall = clock, wall
        self.share = share or g.ShareChanged(index=0, count=1)
        self.version = 0
        self._by_scope: dict[tuple[str, str], list[g.GatewayBudget]] = {}
        self._keys: set[str] = set()  # the keys with a budget of their own
        self._teams: set[str] = set()  # the teams with one ("" never: a key of no team)
        self._granted: dict[str, Granted] = {}  # by budget id, its current period
        self._minute: dict[str, PerMinute] = {}
        self.link_up = False
        self.granted = Wakeup()  # a grant came, or the link's state changed: waiting requests look again
        self.due = Wakeup()  # a report should go at once (more wanted, a grant reserved from)

    # -- from the control plane -----------------------------------------------------------

    def replace(self, message: g.BudgetsChanged) -> None:
        by_scope: dict[tuple[str, str], list[g.GatewayBudget]] = {}
        for b in message.budgets:
            by_scope.setdefault((b.scope_kind, b.scope), []).append(b)
        self._by_scope = by_scope
        self._keys = {scope for kind, scope in by_scope if kind == "key"}
        self._teams = {scope for kind, scope in by_scope if kind == "team"}
        self.version = message.version
        ids = {b.id: b for b in message.budgets}
        self._granted = {i: a for i, a in self._granted.items() if i in ids}
        for i, a in self._granted.items():
            a.budget = ids[i]
        self._minute = {i: m for i, m in self._minute.items() if i in ids and ids[i].tokens == m.budget.tokens}
        self.granted.fire()

    def set_share(self, share: g.ShareChanged) -> None:
        self.share = share
        for m in self._minute.values():
            m.per_minute = self._per_minute(m.budget)

    def grants_changed(self, message: g.GrantsChanged) -> None:
        for grant in message.grants:
            a = self._granted.get(grant.budget_id)
            if a is None or a.start != grant.period_start or not self.link_up:
                continue
            if grant.tokens > a.received:
                a.held += grant.tokens - a.received
                a.received = grant.tokens
                a.want = 0
            a.exhausted = grant.exhausted
        self.granted.fire()
        self.due.fire()  # what it holds changed: say so

    def set_link(self, up: bool) -> None:
        """The link came up (its grants count from 0) or went (what is held is dropped, a debt kept)."""
        if up == self.link_up:
            return
        self.link_up = up
        for a in self._granted.values():
            a.received = 0
            a.held = min(a.held, 0)
            a.exhausted = False
        self.granted.fire()
        if up:
            self.due.fire()

    def report(self) -> g.BudgetReport:
        now = self.wall()
        return g.BudgetReport(budgets=tuple(a.use() for a in self._current(now)))

    # -- requests -------------------------------------------------------------------------

    def applies(self, key: g.GatewayKey) -> bool:
        """Whether the key or its team has a budget: what a key without one costs a request."""
        return key.name in self._keys or key.team in self._teams

    def admit(self, key: g.GatewayKey, model: str, tokens: int, *, final: bool = False) -> Hold | Refused | Wanting:
        """Reserve `tokens` from every budget the request counts against: a `Hold` (`finish` it
        when the request ends), why not, or WANTING (a grant is asked for; unless `final`)."""
        budgets = [
            b
            for scope in (("key", key.name), ("team", key.team))
            for b in self._by_scope.get(scope, ())
            if not b.model or b.model == model
        ]
        hold = Hold([])
        for b in budgets:
            outcome = self._take_granted(b, tokens, final) if b.period != "minute" else self._take_minute(b, tokens)
            if not isinstance(outcome, tuple):
                self.finish(hold, None, given_back=True)
                return outcome
            hold.parts.append(outcome)
        return hold

    def finish(self, hold: Hold, used: int | None, *, given_back: bool = False) -> None:
        """The request ended having used `used` tokens (None: not known, its reservation is
        taken; `given_back`: it never went, nothing is)."""
        for part, reserved, overrun in hold.parts:
            spent = 0 if given_back else reserved if used is None else used
            if isinstance(part, Granted):
                part.reserved -= reserved
                part.held += reserved - spent
                part.used += spent
            else:
                part.refill(self.clock())
                part.level += reserved - spent
            if overrun:
                part.overrunning -= 1
        if hold.parts:
            self.granted.fire()
            self.due.fire()
        hold.parts = []

    def _take_granted(self, b: g.GatewayBudget, tokens: int, final: bool) -> tuple | Refused | Wanting:
        now = self.wall()
        a = self._account(b, now)
        if not self.link_up:
            return Refused(
                status=503,
                code=BUDGET_UNAVAILABLE,
                message=f"{describe(b)} is handed out by the control plane, which this gateway cannot reach now; "
                "try again shortly",
                param=b.id,
                retry_after_s=1.0,
                resets_at=a.end,
            )
        # A reservation is reported at once (coalesced): what the control plane hands out again
        # of a link that went is what its last report said was held, not reserved.
        if a.held >= tokens:
            a.held -= tokens
            a.reserved += tokens
            if a.held < tokens:
                self._ask(a, tokens)
            self.due.fire()
            return a, tokens, False
        if a.held > 0 and not a.overrunning:  # the one request let through past what is held
            taken = a.held
            a.held = 0
            a.reserved += taken
            a.overrunning += 1
            self._ask(a, tokens)
            self.due.fire()
            return a, taken, True
        self._ask(a, tokens)
        if a.exhausted:
            return Refused(
                status=429,
                code=BUDGET_EXCEEDED,
                message=f"{describe(b)} is spent for the {b.period} beginning {_utc(a.start)}; it resets at "
                f"{_utc(a.end)}",
                param=b.id,
                retry_after_s=max(1.0, a.end - now),
                resets_at=a.end,
            )
        if not final:
            return WANTING
        return Refused(
            status=503,
            code=BUDGET_UNAVAILABLE,
            message=f"{describe(b)}: no grant of it came from the control plane within {GRANT_WAIT_S:g} s; "
            "try again shortly",
            param=b.id,
            retry_after_s=1.0,
            resets_at=a.end,
        )

    def _ask(self, a: Granted, tokens: int) -> None:
        want = max(tokens, WANT_RESERVATIONS * tokens - max(0, a.held)) + max(0, -a.held)
        if want > a.want:
            a.want = want
            self.due.fire()

    def _take_minute(self, b: g.GatewayBudget, tokens: int) -> tuple | Refused:
        m = self._minute.get(b.id)
        now = self.clock()
        if m is None:
            per_minute = self._per_minute(b)
            m = self._minute[b.id] = PerMinute(budget=b, per_minute=per_minute, level=per_minute, updated=now)
        m.refill(now)
        if m.level >= tokens:
            m.level -= tokens
            return m, tokens, False
        if m.level > 0 and not m.overrunning:
            taken = int(m.level)
            m.level -= taken
            m.overrunning += 1
            return m, taken, True
        need = min(float(tokens), m.per_minute) - m.level
        wait = need * 60.0 / m.per_minute if m.per_minute > 0 else 60.0
        message = f"{describe(b)} is spent for now"
        if self.share.count > 1:
            message += f" on this gateway instance ({m.per_minute:g} a minute, its share across {self.share.count})"
        return Refused(
            status=429,
            code=BUDGET_EXCEEDED,
            message=message + f"; try again in {max(1, round(wait))} s",
            param=b.id,
            retry_after_s=max(1.0, wait),
        )

    def _per_minute(self, b: g.GatewayBudget) -> float:
        return b.tokens / max(1, self.share.count)

    def _account(self, b: g.GatewayBudget, now: float) -> Granted:
        a = self._granted.get(b.id)
        start, end = period_bounds(b.period, now)
        if a is None or a.start != start:
            # A new period: nothing used yet, nothing granted for it yet; the reservations of the
            # requests still in flight from the last one end there.
            a = self._granted[b.id] = Granted(budget=b, start=start, end=end)
        return a

    def _current(self, now: float) -> list[Granted]:
        return [a for a in self._granted.values() if a.start == period_bounds(a.budget.period, now)[0]]


def _utc(t: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


async def reserve(
    budgets: Budgets, key: g.GatewayKey, model: str, tokens: int, *, wait_s: float = GRANT_WAIT_S
) -> Hold | Refused:
    """`Budgets.admit`, waiting up to `wait_s` for a grant asked for."""
    deadline = trio.current_time() + wait_s
    while True:
        granted = budgets.granted.next()
        outcome = budgets.admit(key, model, tokens)
        if not isinstance(outcome, Wanting):
            return outcome
        with trio.move_on_at(deadline):
            await granted.wait()
            continue
        final = budgets.admit(key, model, tokens, final=True)
        assert not isinstance(final, Wanting)
        return final
