"""The leader's grants of day and month budgets (`llmgw.server.state.budgets.BudgetBook`), pure,
with the time given: what is handed out never passes budget - spent - outstanding, a gone
instance's grant comes back after the grace, a new leader hands out nothing in its hold-off and
counts what the ledger says was spent before it."""

from __future__ import annotations

import calendar

from llmgw.gateway.budgets import period_end, period_start
from llmgw.server.state.budgets import Budget, BudgetBook
from llmgw.wire import gateway_link as g

T0 = calendar.timegm((2026, 12, 7, 10, 0, 0))
DAY = Budget(scope_kind="key", scope="alice", period="day", tokens=1000)


def use(*, used=0, held=0, reserved=0, granted=0, want=0, start=None) -> g.BudgetReport:
    return g.BudgetReport(
        budgets=(
            g.BudgetUse(
                budget_id=DAY.id,
                period_start=period_start("day", T0) if start is None else start,
                used=used,
                held=held,
                reserved=reserved,
                granted=granted,
                want=want,
            ),
        )
    )


def book(started: float = T0 - 60, **kw) -> BudgetBook:
    b = BudgetBook(started=started, grace_s=kw.pop("grace_s", 10.0), hold_off_s=kw.pop("hold_off_s", 0.0))
    b.set_budgets([DAY])
    return b


def granted(b: BudgetBook, instance: str, now: float = T0) -> int:
    return b.grants(instance, now)[0].tokens


def test_periods_are_utc_minutes_days_and_months() -> None:
    t = calendar.timegm((2026, 12, 31, 23, 59, 30))
    assert period_start("minute", t) == t - 30
    assert period_start("day", t) == calendar.timegm((2026, 12, 31, 0, 0, 0))
    assert period_start("month", t) == calendar.timegm((2026, 12, 1, 0, 0, 0))
    assert period_end("month", period_start("month", t)) == calendar.timegm((2027, 1, 1, 0, 0, 0))
    assert period_end("day", period_start("day", t)) == calendar.timegm((2027, 1, 1, 0, 0, 0))


def test_grants_never_pass_what_is_available_and_wait_for_the_last_to_arrive() -> None:
    b = book()
    for i in ("a", "b"):
        b.link_opened(i)
        b.report(i, use(want=800), T0)
    assert b.plan(T0) == set()  # the ledger's sum for the period is not known yet
    (account,) = b.needs_base(T0)
    b.set_base(DAY.id, account.start, 200)  # spent before this leader
    assert b.plan(T0) == {"a", "b"}
    assert granted(b, "a") + granted(b, "b") <= 800
    assert granted(b, "a") == 400  # an equal part each
    # A grant is on its way to "a": it is not sent another before its report says it arrived.
    b.report("a", use(want=900), T0)
    assert b.plan(T0) == set() or granted(b, "a") == 400
    b.report("a", use(granted=400, held=400, want=100), T0)
    b.report("b", use(granted=granted(b, "b"), held=granted(b, "b"), want=100), T0)
    b.plan(T0)
    assert b.accounts[DAY.id].available >= 0
    assert b.accounts[DAY.id].spent + b.accounts[DAY.id].outstanding <= DAY.tokens


def test_spending_and_exhaustion_are_said_to_each_instance() -> None:
    b = book(started=period_start("day", T0))  # the period began with this leader: nothing before it
    b.link_opened("a")
    b.report("a", use(want=5000), T0)
    assert b.plan(T0) == {"a"}
    assert granted(b, "a") == 1000
    assert b.grants("a", T0)[0].exhausted
    b.report("a", use(granted=1000, used=1000, want=500), T0)  # spent it all
    assert b.accounts[DAY.id].available == 0
    assert b.plan(T0) == set()  # told already
    assert b.view(DAY.id, T0)["remaining"] == 0


def test_a_gone_instance_is_reclaimed_after_the_grace_and_a_flap_is_not() -> None:
    b = book(started=period_start("day", T0), grace_s=10.0)
    for i in ("a", "b"):
        b.link_opened(i)
        b.report(i, use(want=1000), T0)
    b.plan(T0)
    ga, gb = granted(b, "a"), granted(b, "b")
    b.report("a", use(granted=ga, used=100, held=ga - 150, reserved=50), T0)
    b.report("b", use(granted=gb, held=gb, want=1000), T0)
    b.link_closed("a", T0 + 1)
    assert not b.expire(T0 + 5)  # within the grace: still counted
    assert b.plan(T0 + 5) == set()  # nothing more to be had, as b was told with its grant
    assert b.grants("b", T0 + 5)[0].exhausted
    assert b.expire(T0 + 11)
    account = b.accounts[DAY.id]
    assert account.settled == 150  # what it spent and had reserved
    assert account.outstanding == gb
    assert b.plan(T0 + 11) == {"b"}  # the rest of a's grant is handed out again
    assert granted(b, "b") == gb + (1000 - 150 - gb)  # all of what is left
    # A flap: b's link goes and comes back within the grace. Its grants count from 0 on the new
    # link; what it held counts until it reports (it may have reserved some since its last report).
    held = account.holdings["b"].held
    b.link_closed("b", T0 + 12)
    b.link_opened("b")
    h = account.holdings["b"]
    assert (h.sent, h.received, h.held) == (0, 0, held)
    assert b.next_expiry() is None
    b.report("b", use(granted=0, held=0, reserved=90, used=500), T0 + 13)
    assert account.outstanding == 90


def test_an_instance_back_after_its_grace_counts_from_its_settlement() -> None:
    b = book(grace_s=10.0)
    b.link_opened("a")
    b.report("a", use(want=500), T0)
    b.set_base(DAY.id, period_start("day", T0), 0)
    b.plan(T0)
    b.report("a", use(granted=500, used=100, held=300, reserved=100), T0)
    b.link_closed("a", T0 + 1)
    assert b.expire(T0 + 11)
    account = b.accounts[DAY.id]
    assert (account.spent, account.outstanding) == (200, 0)  # its 300 held came back
    # It returns: its requests in flight ended with 80 used, and it reserved 50 more after its last
    # report (from what it held; not known until now).
    b.link_opened("a")
    b.report("a", use(used=100 + 80 + 50), T0 + 20)
    assert account.spent == 100 + 80 + 50


def test_a_new_leader_holds_off_and_counts_the_ledger_and_what_instances_report_after() -> None:
    started = T0
    b = book(started=started, hold_off_s=15.0)
    b.link_opened("a")
    b.report("a", use(used=300, want=100), T0 + 1)  # 300 used under the leader before, in the ledger
    (account,) = b.needs_base(T0 + 1)
    b.set_base(DAY.id, account.start, 300)
    assert b.plan(T0 + 1) == set()  # its hold-off
    assert b.plan(T0 + 15) == {"a"}
    b.report("a", use(used=350, granted=100, held=50), T0 + 16)
    assert b.accounts[DAY.id].spent == 350  # the ledger's 300 and 50 since, not 300 twice


def test_a_period_that_turns_starts_from_nothing() -> None:
    b = book()
    b.link_opened("a")
    b.report("a", use(want=100), T0)
    b.set_base(DAY.id, period_start("day", T0), 999)
    b.plan(T0)
    tomorrow = T0 + 86400
    b.report("a", use(want=100, start=period_start("day", tomorrow)), tomorrow)
    assert b.needs_base(tomorrow) == []  # begun under this leader: nothing in the ledger before
    assert b.plan(tomorrow) == {"a"}
    assert b.grants("a", tomorrow)[0].period_start == period_start("day", tomorrow)
    assert b.accounts[DAY.id].spent == 0
