"""The control plane's SQLite store: what survives a restart (a new Store on the same file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.server.store import Store, UnknownNode


def reopen(store: Store) -> Store:
    store.close()
    return Store(store.path)


def test_nodes_and_their_cordons_survive_a_restart(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.saw_node("b", "127.0.0.3", now=10)
    store.saw_node("a", "127.0.0.2", now=11)
    store.saw_node("a", "127.0.0.9", now=12)
    store.set_cordoned("a", True)
    store.set_draining("b", True)
    store = reopen(store)
    a, b = store.nodes()
    assert (a.node_id, a.address, a.first_seen, a.last_seen, a.cordoned, a.draining) == (
        "a",
        "127.0.0.9",
        11,
        12,
        True,
        False,
    )
    assert (b.node_id, b.cordoned, b.draining) == ("b", False, True)


def test_cordoning_an_unknown_node_names_the_known_ones(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.saw_node("a", "x")
    with pytest.raises(UnknownNode) as info:
        store.set_cordoned("zz", True)
    assert "no node 'zz'" in str(info.value) and "known nodes: a" in str(info.value)


def test_removal_revokes_every_certificate_of_the_node_and_persists(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.saw_node("a", "x")
    store.record_certificate(111, "a", not_after=2e9)
    store.record_certificate(222, "a", not_after=2e9)
    store.record_certificate(333, "b", not_after=2e9)
    assert sorted(store.remove_node("a")) == ["111", "222"]
    store = reopen(store)
    assert store.nodes() == []
    assert store.is_revoked(111) and store.is_revoked(222)
    assert not store.is_revoked(333) and not store.is_revoked(444)
    assert sorted(store.revoked_serials()) == ["111", "222"]


def test_a_node_only_issued_a_certificate_can_be_removed(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.record_certificate(5, "never-connected", not_after=2e9)
    assert store.remove_node("never-connected") == ["5"]
    with pytest.raises(UnknownNode):
        store.remove_node("never-connected")


def test_revoking_a_serial_never_recorded(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.revoke_serial(2**150 + 7, "a")  # x509 serials exceed SQLite's integers: stored as text
    assert reopen(store).is_revoked(2**150 + 7)


def test_a_store_that_cannot_be_opened_says_where(tmp_path: Path) -> None:
    (tmp_path / "llmgw.db").mkdir()
    from llmgw.errors import MachineError

    with pytest.raises(MachineError) as info:
        Store.open(tmp_path)
    assert "llmgw.db" in str(info.value)
