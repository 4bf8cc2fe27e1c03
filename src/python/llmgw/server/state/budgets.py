"""Token budgets on the leader: what each day or month budget has spent in its period, what is
handed out to the gateway instances and not spent yet, and what to hand out next (issue 48;
docs/gateway.md, "Budgets"). Pure: no I/O, `now` (unix seconds, UTC) from the caller.

A budget (`Budget`) is a key's or a team's, for one model or all, per minute, day or month.
A minute budget (tokens per minute) is no business of this module: every gateway instance
enforces its share of it, as of a request rate limit (`llmgw.gateway.budgets`). A day or month
budget is handed out in grants, over the gateway link (`BudgetReport` in, `GrantsChanged` out):

- Per budget and period (`Account`): `spent` is what was spent before this leader began (the
  ledger's sum, `base`, read once when the period had begun before this leader: `needs_base`),
  plus what each instance reported spending since (`Holding.used - base_used`), plus what gone
  instances spent (`settled`). `outstanding` is, per instance, its grant not spent and not
  reserved (`held`, never below 0), its reservations for the requests in flight (`reserved`),
  and what was sent on its link and is not yet in a report of it (`sent - received`).
- The invariant: grants are made only from `available = tokens - spent - outstanding`, so what
  was granted in a period never passes the budget. What is spent may, by the overrunning answers
  each instance lets through (`llmgw.gateway.budgets`: at most one per budget at a time).
- An instance reports whole and level-triggered (its `used`, `held`, `reserved`, the grants it
  received on this link, what more it wants). Its grants are per link: a gateway whose link
  goes down drops what it held (keeps its debt), and both sides count a new link's grants from 0.
  A link closed stays counted for `grace_s` (the gateway may not yet have noticed, and may come
  back); past it, what the instance spent and had reserved is settled as spent and the rest,
  its unspent grant, goes back to `available`: reclaimed.
- A leader that has just begun hands out nothing for `hold_off_s`: a gateway still linked to the
  one before it keeps spending its grant until it notices that link is gone.

Periods are UTC: a minute, a day from midnight, a month from the first at midnight.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from llmgw.gateway.budgets import period_end, period_start
from llmgw.server.store.budgetrows import Budget
from llmgw.wire import gateway_link as g

KEY, TEAM = "key", "team"
SCOPES = (KEY, TEAM)
MINUTE, DAY, MONTH = "minute", "day", "month"
PERIODS = (MINUTE, DAY, MONTH)
GRANTED = (DAY, MONTH)  # the periods handed out in grants


@attrs.define(kw_only=True)
class Holding:
    """One instance's part of one account, as its last report said and what was sent it since."""

    base_used: int = 0  # its `used` already counted in the account's `base`
    used: int = 0
    held: int = 0
    reserved: int = 0
    received: int = 0  # of this link's grants, as its last report said
    sent: int = 0  # this link's grants, all together
    want: int = 0
    closed_at: float | None = None  # when its link closed; None while linked
    told_exhausted: bool = False  # what its grants said last

    @property
    def spent(self) -> int:
        return max(0, self.used - self.base_used)

    @property
    def outstanding(self) -> int:
        return max(0, self.held) + self.reserved + max(0, self.sent - self.received)


@attrs.define(kw_only=True)
class Account:
    """One budget in one period."""

    budget: Budget
    start: int
    base: int | None  # spent before this leader began (the ledger's); None until read
    settled: int = 0  # spent by instances gone
    holdings: dict[str, Holding] = attrs.field(factory=dict)  # by instance
    # Of each instance gone: the `used` its settlement counted up to (its last report's used and
    # reserved), so that what it reports if it comes back counts from there, nothing lost.
    gone: dict[str, int] = attrs.field(factory=dict)

    @property
    def end(self) -> int:
        return period_end(self.budget.period, self.start)

    @property
    def spent(self) -> int:
        return (self.base or 0) + self.settled + sum(h.spent for h in self.holdings.values())

    @property
    def outstanding(self) -> int:
        return sum(h.outstanding for h in self.holdings.values())

    @property
    def available(self) -> int:
        return self.budget.tokens - self.spent - self.outstanding

    def view(self) -> dict:
        return {
            "period_start": self.start,
            "resets_at": self.end,
            "spent": self.spent if self.base is not None else None,
            "outstanding": self.outstanding,
            "remaining": max(0, self.budget.tokens - self.spent) if self.base is not None else None,
            "instances": len(self.holdings),
        }


class BudgetBook:
    """Every day and month budget's account in its current period, and the grants of each
    instance. `started`: when this leader began (unix seconds)."""

    def __init__(self, *, started: float, grace_s: float, hold_off_s: float) -> None:
        self.started = started
        self.grace_s = grace_s
        self.hold_off_s = hold_off_s
        self.budgets: dict[str, Budget] = {}
        self.accounts: dict[str, Account] = {}  # by budget id, the current period's
        self.linked: set[str] = set()  # the instances whose link is up

    # -- the budgets ----------------------------------------------------------------------

    def set_budgets(self, budgets: Iterable[Budget]) -> None:
        """The budgets are now exactly `budgets`; a changed amount keeps its account."""
        self.budgets = {b.id: b for b in budgets}
        self.accounts = {i: a for i, a in self.accounts.items() if i in self.budgets}
        for i, account in self.accounts.items():
            account.budget = self.budgets[i]

    def account(self, budget_id: str, now: float) -> Account | None:
        """The budget's account in the period holding `now` (a new one when its period turned)."""
        budget = self.budgets.get(budget_id)
        if budget is None or budget.period not in GRANTED:
            return None
        start = period_start(budget.period, now)
        account = self.accounts.get(budget_id)
        if account is None or account.start != start:
            # A period begun before this leader: what was spent in it before is the ledger's.
            # One begun since: all of it was spent under this leader, reported to it.
            base = None if start < self.started else 0
            account = self.accounts[budget_id] = Account(budget=budget, start=start, base=base)
        return account

    def needs_base(self, now: float) -> list[Account]:
        """The accounts whose spending before this leader is to be read from the ledger."""
        found = (self.account(i, now) for i in self.budgets)
        return [a for a in found if a is not None and a.base is None]

    def set_base(self, budget_id: str, start: int, tokens: int) -> None:
        account = self.accounts.get(budget_id)
        if account is not None and account.start == start and account.base is None:
            account.base = tokens

    # -- the links ------------------------------------------------------------------------

    def link_opened(self, instance: str) -> None:
        """A new link of `instance`: its grants count from 0 on it, on both sides."""
        self.linked.add(instance)
        for account in self.accounts.values():
            h = account.holdings.get(instance)
            if h is not None:
                # What it held it dropped when its last link went, but what it reserved since its
                # last report is not known yet: its last `held` counts until its next report.
                h.sent = h.received = 0
                h.closed_at = None

    def link_closed(self, instance: str, now: float) -> None:
        self.linked.discard(instance)
        for account in self.accounts.values():
            h = account.holdings.get(instance)
            if h is not None and h.closed_at is None:
                h.closed_at = now

    def expire(self, now: float) -> bool:
        """Reclaim the unspent grants of the instances whose link closed `grace_s` ago or more:
        what each spent and had reserved is settled as spent. Whether any was."""
        changed = False
        for account in self.accounts.values():
            gone = [
                i for i, h in account.holdings.items() if h.closed_at is not None and now - h.closed_at >= self.grace_s
            ]
            for instance in gone:
                h = account.holdings.pop(instance)
                account.settled += h.spent + h.reserved
                account.gone[instance] = h.used + h.reserved
                changed = True
        return changed

    def next_expiry(self) -> float | None:
        """When `expire` next has something to do (unix seconds), if ever."""
        times = [h.closed_at for a in self.accounts.values() for h in a.holdings.values() if h.closed_at is not None]
        return min(times) + self.grace_s if times else None

    # -- reports and grants ---------------------------------------------------------------

    def report(self, instance: str, report: g.BudgetReport, now: float) -> None:
        """An instance's report, whole: it replaces what the last one said."""
        for use in report.budgets:
            account = self.account(use.budget_id, now)
            if account is None or account.start != use.period_start:
                continue  # a budget gone, or a period that turned on one side first
            h = account.holdings.get(instance)
            if h is None:
                # Back after it was settled: from what that counted. Else its spending before its
                # first report to this leader is in the ledger's `base` when the period began
                # before this leader; if not, all of it was under this one.
                base = account.gone.pop(instance, use.used if account.start < self.started else 0)
                h = account.holdings[instance] = Holding(base_used=base)
            h.used, h.held, h.reserved, h.received, h.want = (
                use.used,
                use.held - use.debt,
                use.reserved,
                use.granted,
                use.want,
            )
            if instance in self.linked:
                h.closed_at = None

    def plan(self, now: float, budget_ids: Iterable[str] | None = None) -> set[str]:
        """Hand out what the instances want, from what is available, each grant at most an equal
        part of what is available among the instances using the budget (so that one cannot take
        it all while others wait) and never to an instance with a grant still on its way. The
        instances whose grants changed (a new grant, or the budget exhausted or no longer).
        `budget_ids`: only those (the ones a report spoke of), else every one."""
        if now < self.started + self.hold_off_s:
            return set()
        changed: set[str] = set()
        for budget_id in list(self.budgets if budget_ids is None else budget_ids):
            account = self.account(budget_id, now)
            if account is None or account.base is None:
                continue
            users = [i for i, h in account.holdings.items() if h.closed_at is None and i in self.linked]
            available = account.available
            part = max(1, available // max(1, len(users)))
            for instance in users:
                h = account.holdings[instance]
                if h.want > 0 and h.sent <= h.received and available > 0:
                    grant = min(h.want, part, available)
                    h.sent += grant
                    available -= grant
                    changed.add(instance)
            exhausted = available <= 0
            for instance in users:
                h = account.holdings[instance]
                if h.told_exhausted != exhausted:
                    h.told_exhausted = exhausted
                    changed.add(instance)
        return changed

    def grants(self, instance: str, now: float) -> tuple[g.BudgetGrant, ...]:
        """What `instance` was sent on its link in each period, and whether the budget is
        exhausted (nothing more to hand out until something is reclaimed or the period turns)."""
        out = []
        for budget_id in sorted(self.budgets):
            account = self.account(budget_id, now)
            if account is None:
                continue
            h = account.holdings.get(instance)
            if h is None:
                continue
            out.append(
                g.BudgetGrant(
                    budget_id=budget_id,
                    period_start=account.start,
                    tokens=h.sent,
                    exhausted=h.told_exhausted,
                )
            )
        return tuple(out)

    def view(self, budget_id: str, now: float) -> dict | None:
        account = self.account(budget_id, now)
        return account.view() if account is not None else None
