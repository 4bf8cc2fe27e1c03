"""A minute budget of the tests' gateway key on an in-memory gateway (testlib.memnet), on a clock
that stands still (no refill), and what it has been charged: how the usage tests check that a
budget is charged what the ledger counts (test_usage_cut, test_usage_responses)."""

from __future__ import annotations

from llmgw.gateway.budgets import Budgets
from llmgw.server.state.budgets import Budget
from llmgw.wire import gateway_link as g
from testlib import memnet

BUDGET = 100_000


def with_budget(gw: memnet.MemGateway) -> Budgets:
    """A minute budget of BUDGET tokens for the gateway's key ("tests")."""
    budgets = Budgets(clock=lambda: 0.0, wall=lambda: 1_765_000_000.0)
    budget = Budget(scope_kind="key", scope="tests", period="minute", tokens=BUDGET)
    budgets.replace(g.BudgetsChanged(budgets=(budget.wire(),), version=1))
    gw.gateway.budgets = budgets
    return budgets


def charged(budgets: Budgets) -> float:
    [part] = budgets._minute.values()
    return BUDGET - part.level
