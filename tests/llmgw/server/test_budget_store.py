"""Token budgets in the store (`llmgw.server.store.budgetrows`), in both backends
(`store_backend`: the state directory's SQLite file, and a real PostgreSQL database): set, set
again with another amount (the same row), removed, and there after a restart."""

from __future__ import annotations

from llmgw.server.store.budgetrows import Budget
from testlib.stores import StoreUnderTest


def test_budgets_are_set_replaced_removed_and_survive_a_restart(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    day = Budget(scope_kind="key", scope="alice", period="day", tokens=1000, created_at=1.0)
    month = Budget(scope_kind="team", scope="red", model="chat", period="month", tokens=50_000, created_at=2.0)
    assert store.set_budget(day)
    assert store.set_budget(month)
    assert not store.set_budget(Budget(scope_kind="key", scope="alice", period="day", tokens=2000, created_at=3.0))
    store.close()
    store = store_backend.open()  # a restart
    assert store.budgets() == [
        Budget(scope_kind="key", scope="alice", period="day", tokens=2000, created_at=1.0),
        month,
    ]
    assert store.remove_budget(day.id)
    assert not store.remove_budget(day.id)
    assert [b.id for b in store.budgets()] == ["team:red:chat:month"]
    store.close()
