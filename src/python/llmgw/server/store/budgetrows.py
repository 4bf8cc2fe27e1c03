"""The store's calls for token budgets (issue 48): `Store` and `AsyncStore` take them in
(`BudgetCalls`, `AsyncBudgetCalls`); the table is schema 6's `budgets`
(`llmgw.server.store.schema._v6`), one row per key or team, model ('' for all) and period, its id
`SCOPE_KIND:SCOPE:MODEL:PERIOD`. What a budget has spent is the usage ledger's
(`llmgw.server.store.ledger`); what is handed out of it lives in the leader's memory
(`llmgw.server.state.budgets`), rebuilt from the ledger by a new one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs

from llmgw.wire import gateway_link as g


def budget_id(scope_kind: str, scope: str, model: str, period: str) -> str:
    return f"{scope_kind}:{scope}:{model}:{period}"


@attrs.frozen(kw_only=True)
class Budget:
    """A row of the store's `budgets` table."""

    scope_kind: str  # KEY or TEAM
    scope: str  # the key's or the team's name
    model: str = ""  # '' = every model
    period: str  # MINUTE, DAY or MONTH
    tokens: int  # prompt plus completion tokens a period
    created_at: float = 0.0

    @property
    def id(self) -> str:
        return budget_id(self.scope_kind, self.scope, self.model, self.period)

    def wire(self) -> g.GatewayBudget:
        return g.GatewayBudget(
            id=self.id,
            scope_kind=self.scope_kind,
            scope=self.scope,
            model=self.model,
            period=self.period,
            tokens=self.tokens,
        )


_COLUMNS = "scope_kind, scope, model, period, tokens, created_at"


class BudgetCalls:
    """`Store`'s budget calls (it provides `_write` and `_rows`)."""

    _write: Callable[[], contextlib.AbstractContextManager[Any]]
    _rows: Callable[..., list[tuple]]

    def budgets(self) -> list[Budget]:
        rows = self._rows(f"SELECT {_COLUMNS} FROM budgets ORDER BY id")
        return [
            Budget(scope_kind=r[0], scope=r[1], model=r[2], period=r[3], tokens=int(r[4]), created_at=r[5])
            for r in rows
        ]

    def set_budget(self, budget: Budget) -> bool:
        """Record `budget`, replacing the amount of one of the same key or team, model and period;
        True if it is new."""
        with self._write() as tx:
            found = tx.rows("SELECT tokens FROM budgets WHERE id = ?", (budget.id,))
            tx.execute(
                f"INSERT INTO budgets (id, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET tokens = excluded.tokens",
                (
                    budget.id,
                    budget.scope_kind,
                    budget.scope,
                    budget.model,
                    budget.period,
                    budget.tokens,
                    budget.created_at,
                ),
            )
        return not found

    def remove_budget(self, budget_id: str) -> bool:
        """False if there was none."""
        with self._write() as tx:
            return tx.execute("DELETE FROM budgets WHERE id = ?", (budget_id,)) > 0


class AsyncBudgetCalls:
    """`AsyncStore`'s: each call of `BudgetCalls` off the loop (it provides `_run` and `_store`)."""

    _run: Callable[..., Any]
    _store: Any

    async def budgets(self) -> list[Budget]:
        return await self._run(self._store.budgets)

    async def set_budget(self, budget: Budget) -> bool:
        return await self._run(self._store.set_budget, budget)

    async def remove_budget(self, budget_id: str) -> bool:
        return await self._run(self._store.remove_budget, budget_id)
