"""The audit log in the store (`Store.record_audit`, `audit`, `prune_audit`), in both backends
(`store_backend`: the state directory's SQLite file, and a real PostgreSQL database)."""

from __future__ import annotations

from llmgw.server.store import Store
from llmgw.server.store.core import MAX_AUDIT_ROWS, audit_id
from testlib.stores import StoreUnderTest


def _fill(store: Store) -> None:
    for at, actor, action, target in (
        (100.0, "admin", "key.create", "ci"),
        (200.0, "page:s-0a0b0c0d", "node.cordon", "n1"),
        (300.0, "admin", "key.revoke", "ci"),
        (400.0, "page:s-0a0b0c0d", "page.login", ""),
        (500.0, "admin", "keyring.other", "ci"),  # "key" must not match it
        (600.0, "pager", "node.drain", "n2"),  # "page" must not match it
    ):
        store.record_audit(actor=actor, source="127.0.0.1", action=action, target=target, detail={"at": at}, now=at)


def test_entries_survive_a_restart_newest_first_with_their_detail(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    row = store.record_audit(
        actor="admin",
        source="10.0.0.9",
        action="key.create",
        target="ci",
        detail={"models": ["chat"], "rate_per_minute": 60},
        now=1765081234.5,
    )
    store.record_audit(actor="admin", source="10.0.0.9", action="key.revoke", target="ci", now=1765081240.0)
    store.close()
    store = store_backend.open()
    newest, first = store.audit()
    assert (newest.action, newest.detail) == ("key.revoke", {})
    assert first == row
    assert (first.at, first.actor, first.source, first.target) == (1765081234.5, "admin", "10.0.0.9", "ci")
    assert first.detail == {"models": ["chat"], "rate_per_minute": 60}
    store.close()


def test_filters_by_time_action_actor_and_target(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    _fill(store)

    def actions(**filters) -> list[str]:
        return [r.action for r in store.audit(**filters)]

    assert actions() == [
        "node.drain",
        "keyring.other",
        "page.login",
        "key.revoke",
        "node.cordon",
        "key.create",
    ]
    assert actions(since=200.0, until=400.0) == ["key.revoke", "node.cordon"]  # since inclusive, until not
    assert actions(action="key") == ["key.revoke", "key.create"]  # a family, not a prefix of words
    assert actions(action="key.create") == ["key.create"]
    assert actions(action="key.cr") == []
    assert actions(actor="page") == ["page.login", "node.cordon"]  # every page session, not "pager"
    assert actions(actor="page:s-0a0b0c0d", action="node") == ["node.cordon"]
    assert actions(target="ci", since=250.0) == ["keyring.other", "key.revoke"]
    assert actions(limit=2) == ["node.drain", "keyring.other"]
    assert len(store.audit(limit=10**9)) == 6  # bounded at MAX_AUDIT_ROWS, not refused
    store.close()


def test_pruning_forgets_what_is_older_than_the_cut(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    _fill(store)
    assert store.prune_audit(300.0) == 2
    assert [r.at for r in store.audit()] == [600.0, 500.0, 400.0, 300.0]
    assert store.prune_audit(300.0) == 0
    store.close()


def test_entries_at_the_same_microsecond_keep_apart_and_ids_sort_by_time() -> None:
    assert audit_id(1765081234.5) != audit_id(1765081234.5)
    assert audit_id(999999999.0)[:17] == "0999999999.000000"
    assert sorted([audit_id(1765081234.5), audit_id(999999999.0)])[0].startswith("0999")
    assert MAX_AUDIT_ROWS >= 1000
