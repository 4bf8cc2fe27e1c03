"""Token budgets on a gateway instance (`llmgw.gateway.budgets`), pure, and wired in memory to the
leader's book (`llmgw.server.state.budgets.BudgetBook`) with several instances and many
concurrent requests on trio's MockClock: the tokens used never pass the budget by more than one
answer per instance."""

from __future__ import annotations

import calendar
import random

import pytest
import trio
import trio.testing

from llmgw.gateway.budgets import (
    BUDGET_EXCEEDED,
    BUDGET_UNAVAILABLE,
    WANTING,
    Budgets,
    Hold,
    Refused,
    estimate,
    reserve,
)
from llmgw.server.state.budgets import Budget, BudgetBook
from llmgw.wire import gateway_link as g
from llmgw.wire.convert import decode, encode

T0 = calendar.timegm((2026, 12, 7, 10, 0, 0))
ALICE = g.GatewayKey(name="alice", token_sha256="0" * 64, team="red")
BOB = g.GatewayKey(name="bob", token_sha256="1" * 64)


def budgets_of(*budgets: Budget, count: int = 1, index: int = 0, now=lambda: 0.0) -> Budgets:
    b = Budgets(share=g.ShareChanged(index=index, count=count), clock=now, wall=lambda: T0 + now())
    b.replace(g.BudgetsChanged(budgets=tuple(x.wire() for x in budgets), version=1))
    return b


def test_a_key_without_a_budget_is_not_looked_at() -> None:
    b = budgets_of(Budget(scope_kind="team", scope="red", period="day", tokens=10))
    assert b.applies(ALICE)  # its team's
    assert not b.applies(BOB)
    assert not budgets_of().applies(ALICE)


def test_estimate_is_the_prompt_at_most_and_the_longest_answer() -> None:
    assert estimate(300, 50) == 150
    assert estimate(300, None) == 100 + 1024


def test_a_minute_budget_is_shared_and_refills() -> None:
    now = [0.0]
    b = budgets_of(Budget(scope_kind="key", scope="alice", period="minute", tokens=600), count=2, now=lambda: now[0])
    first = b.admit(ALICE, "chat", 200)
    assert isinstance(first, Hold)
    b.finish(first, 250)  # used more than it reserved: the bucket is at 300 - 250
    second = b.admit(ALICE, "chat", 100)  # 50 left: the one let through past it
    assert isinstance(second, Hold) and second.parts[0][2]
    refused = b.admit(ALICE, "chat", 10)  # the overrunning one is in flight: no other
    assert isinstance(refused, Refused)
    assert (refused.status, refused.code, refused.param) == (429, BUDGET_EXCEEDED, "key:alice::minute")
    assert "its share across 2" in refused.message
    b.finish(second, 100)  # -50 now
    now[0] = 30.0  # half a minute: 150 more at 300 a minute
    assert isinstance(b.admit(ALICE, "chat", 100), Hold)  # 100 of the 100 there
    assert isinstance(b.admit(ALICE, "chat", 100), Refused)


def test_a_day_budget_waits_for_a_grant_then_says_which_budget_is_spent() -> None:
    day = Budget(scope_kind="team", scope="red", model="chat", period="day", tokens=1000)
    b = budgets_of(day)
    assert isinstance(b.admit(ALICE, "chat", 100), Refused)  # no link: 503, not a guess
    b.set_link(True)
    assert b.admit(ALICE, "chat", 100) is WANTING
    assert isinstance(b.admit(ALICE, "other", 100), Hold)  # another model's: no budget
    (wanted,) = b.report().budgets
    assert wanted.want >= 100
    start = wanted.period_start
    b.grants_changed(g.GrantsChanged(grants=(g.BudgetGrant(budget_id=day.id, period_start=start, tokens=150),)))
    hold = b.admit(ALICE, "chat", 100)
    assert isinstance(hold, Hold)
    over = b.admit(ALICE, "chat", 100)  # 50 held: let through, the one overrunning
    assert isinstance(over, Hold) and over.parts[0][2]
    b.grants_changed(
        g.GrantsChanged(grants=(g.BudgetGrant(budget_id=day.id, period_start=start, tokens=150, exhausted=True),))
    )
    refused = b.admit(ALICE, "chat", 100, final=True)
    assert isinstance(refused, Refused)
    assert (refused.status, refused.code, refused.param) == (429, BUDGET_EXCEEDED, "team:red:chat:day")
    assert refused.resets_at == start + 86400
    assert "resets at 2026-12-08T00:00:00Z" in refused.message
    b.finish(hold, 80)
    b.finish(over, 120)
    (state,) = b.report().budgets
    assert (state.used, state.held, state.debt, state.reserved, state.granted) == (200, 0, 50, 0, 150)
    b.set_link(False)  # what it held goes, its debt stays
    (state,) = b.report().budgets
    assert (state.held, state.debt, state.granted) == (0, 50, 0)
    refused = b.admit(ALICE, "chat", 10)
    assert isinstance(refused, Refused) and refused.code == BUDGET_UNAVAILABLE and refused.status == 503


@pytest.mark.trio
async def test_reserve_gives_up_after_its_wait(autojump_clock: trio.testing.MockClock) -> None:
    day = Budget(scope_kind="key", scope="alice", period="day", tokens=1000)
    b = budgets_of(day, now=trio.current_time)
    b.set_link(True)
    began = trio.current_time()
    refused = await reserve(b, ALICE, "chat", 100, wait_s=2.0)
    assert isinstance(refused, Refused) and refused.code == BUDGET_UNAVAILABLE
    assert trio.current_time() - began == pytest.approx(2.0)


# -- several instances and the leader, in memory ---------------------------------------------

BUDGET = 200_000
INSTANCES = 4
CLIENTS = 200
MAX_PROMPT_BYTES = 600
MAX_TOKENS = 300
LONGEST = MAX_PROMPT_BYTES // 3 + MAX_TOKENS  # the longest answer: its reservation


def wire(message):
    """`message` as the link carries it: encoded and decoded (every count a whole number from 0)."""
    return decode(encode(message), g.GatewayMessage | g.ControlMessage)


class Plane:
    """The leader's book and each instance's link, with a delay each way, each message through
    the link's converter."""

    def __init__(self, book: BudgetBook, gateways: dict[str, Budgets], rng: random.Random) -> None:
        self.book, self.gateways, self.rng = book, gateways, rng

    def wall(self) -> float:
        return T0 + trio.current_time()

    async def link(self, instance: str) -> None:
        gw = self.gateways[instance]
        self.book.link_opened(instance)
        gw.set_link(True)
        while True:
            due = gw.due.next()
            report = wire(gw.report())
            await trio.sleep(self.rng.uniform(0.001, 0.02))
            self.book.report(instance, report, self.wall())
            for changed in self.book.plan(self.wall()):
                grants = wire(g.GrantsChanged(grants=self.book.grants(changed, self.wall())))
                self.gateways[changed].grants_changed(grants)
            await due.wait()


async def client(gw: Budgets, rng: random.Random, used: list[int], refusals: list[Refused]) -> None:
    for _ in range(1000):  # bounded; ends at the first refusal for the spent budget
        prompt_bytes = rng.randint(30, MAX_PROMPT_BYTES)
        outcome = await reserve(gw, ALICE, "chat", estimate(prompt_bytes, MAX_TOKENS))
        if isinstance(outcome, Refused):
            refusals.append(outcome)
            if outcome.code == BUDGET_EXCEEDED:
                return
            await trio.sleep(outcome.retry_after_s)  # as its Retry-After says
            continue
        await trio.sleep(rng.uniform(0.01, 0.5))
        tokens = rng.randint(1, prompt_bytes // 3) + rng.randint(0, MAX_TOKENS)
        used[0] += tokens
        gw.finish(outcome, tokens)


@pytest.mark.trio
async def test_several_instances_never_pass_the_budget_by_more_than_an_answer_each(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rng = random.Random(48)
    book = BudgetBook(started=T0 - 60, grace_s=10.0, hold_off_s=0.0)
    book.set_budgets([Budget(scope_kind="key", scope="alice", period="day", tokens=BUDGET)])
    gateways = {f"i{n}": budgets_of(count=INSTANCES, now=trio.current_time) for n in range(INSTANCES)}
    for gw in gateways.values():
        gw.replace(g.BudgetsChanged(budgets=tuple(b.wire() for b in book.budgets.values()), version=1))
    (account,) = book.needs_base(T0)
    book.set_base(account.budget.id, account.start, 0)
    plane = Plane(book, gateways, rng)
    used, refusals = [0], []
    with trio.fail_after(3600):
        async with trio.open_nursery() as links:
            for instance in gateways:
                links.start_soon(plane.link, instance)
            async with trio.open_nursery() as clients:
                for n in range(CLIENTS):
                    clients.start_soon(client, gateways[f"i{n % INSTANCES}"], rng, used, refusals)
            links.cancel_scope.cancel()
    exceeded = [r for r in refusals if r.code == BUDGET_EXCEEDED]
    assert len(exceeded) == CLIENTS  # every client ended on the spent budget
    assert used[0] <= BUDGET + INSTANCES * LONGEST, (used[0], BUDGET)
    assert used[0] >= BUDGET * 0.95, (used[0], BUDGET)  # and the budget was there to be spent
    assert sum(gw.report().budgets[0].used for gw in gateways.values()) == used[0]
