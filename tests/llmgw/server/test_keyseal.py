"""Engine keys at rest: sealed in llmgw.db under the state directory's secret, so the database
files alone reveal no key; a database of an earlier version, with plain keys, is sealed in place
with the same keys and scrubbed; a lost secret is said at start with the way out."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from pathlib import Path

import pytest
import trio

from llmgw import paths, private
from llmgw.config import Model
from llmgw.errors import MachineError
from llmgw.fabrics import FabricMap
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import PLAIN, REPLACED, Replicas, sealed_keys
from llmgw.server.store import Store, keyseal
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wire import agent_link as w
from testlib.controlplane import hello

CATALOG = [Model(name="chat", engine="sim", replicas=3)]
TTL = 10.0


def joined(reg: NodeRegistry, node_id: str, now: float) -> None:
    sim = (w.EngineStatus(name="sim", version="1", ok=True),)
    conn = reg.connect(
        hello(node_id, engines=sim, memory_total_bytes=8 << 30),
        address="10.0.0.1",
        cert_serial=1,
        cert_not_after=2e9,
        now=now,
    )
    reg.heartbeat(node_id, conn, now)


def open_replicas(state: Path, reg: NodeRegistry) -> tuple[AsyncStore, Replicas]:
    """What the control plane does at start: the store, the secret, the placements."""
    store = AsyncStore.open(state)
    keys = keyseal.load(state, sealed_keys=sealed_keys(store.at_open.placements))
    return store, Replicas(store, reg, lambda: CATALOG, lambda: FabricMap(fabrics=(), notes=()), keys)


def database_bytes(state: Path) -> bytes:
    """Everything SQLite keeps on disk for the database: the file, its -wal and its -shm."""
    return b"".join(p.read_bytes() for p in paths.store_files(state) if p.exists())


def three_nodes(now: float) -> NodeRegistry:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    for n in ("a", "b", "c"):
        joined(reg, n, now)
    return reg


async def placed_and_saved(state: Path) -> dict[str, str]:
    """Three replicas placed and written to the store; their keys, as the agents are given them."""
    store, r = open_replicas(state, three_nodes(1))
    async with trio.open_nursery() as nursery:
        await nursery.start(r.saver.serve)
        r.reconcile(1)
        nursery.cancel_scope.cancel()
    keys = {a.replica_id: a.api_key for n in "abc" for a in r.assignments_for(n, lambda name: CATALOG[0])}
    assert len(keys) == 3 and all(keys.values())
    return keys


def test_a_key_opens_only_for_its_replica_and_under_its_secret() -> None:
    keys = keyseal.KeySeal(os.urandom(32))
    sealed = keys.seal("chat-0", "k-secret")
    assert keys.open("chat-0", sealed) == "k-secret"
    assert "k-secret" not in sealed and keys.seal("chat-0", "k-secret") != sealed  # a fresh nonce each time
    assert keys.open("chat-1", sealed) is None  # copied into another replica's row: it does not open
    assert keyseal.KeySeal(os.urandom(32)).open("chat-0", sealed) is None
    assert keys.open("chat-0", sealed[:-4] + "AAAA") is None and keys.open("chat-0", "garbage") is None
    assert "redacted" in repr(keys)


@pytest.mark.trio
async def test_the_database_files_alone_reveal_no_engine_key(tmp_path: Path) -> None:
    given = await placed_and_saved(tmp_path)
    raw = database_bytes(tmp_path)
    for key in given.values():
        assert key.encode() not in raw
    with sqlite3.connect(f"file:{tmp_path / 'llmgw.db'}?mode=ro", uri=True) as db:
        bodies = [json.loads(b) for (b,) in db.execute("SELECT body FROM placements")]
    assert len(bodies) == 3 and all(set(b) == {"placement", "sealed_key", "dist_init_port", "version"} for b in bodies)
    secret = paths.engine_keys_secret_path(tmp_path)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text().strip()) == 64
    # A new control plane on the same files opens the same keys: the running engines keep theirs.
    _, again = open_replicas(tmp_path, NodeRegistry(heartbeat_ttl_s=TTL, started_at=100))
    assert {k: s.api_key for k, s in again.placed.items()} == given
    assert again.at_open[PLAIN] == again.at_open[REPLACED] == []


def test_plain_keys_of_an_earlier_version_are_sealed_in_place_with_the_same_keys_and_scrubbed(tmp_path: Path) -> None:
    # An earlier version rewrote every placement, key in plain text, on each change: old rows
    # linger in the file's free space and in the write-ahead log.
    store = Store.open(tmp_path)
    legacy: dict[str, dict] = {}
    ever: list[str] = []
    for round_ in range(40):
        legacy = {
            f"chat-{i}": {
                "placement": {"replica_id": f"chat-{i}", "model": "chat", "engine": "sim", "nodes": ["a"]},
                "api_key": f"plain-key-{round_}-{i}-" + os.urandom(12).hex(),
                "dist_init_port": 0,
            }
            for i in range(3 if round_ == 39 else 1 + round_ % 30)
        }
        ever += [row["api_key"] for row in legacy.values()]
        store.set_placements(legacy)
        if round_ % 7 == 0:
            store._db.rows("PRAGMA wal_checkpoint(PASSIVE)")  # as SQLite's autocheckpoint would, now and then
    # Left open, as by a control plane that was killed: the write-ahead log keeps its frames.
    before = database_bytes(tmp_path)
    assert len([k for k in ever if k.encode() in before]) > 3, "the test needs old rows left in the files"

    astore, r = open_replicas(tmp_path, NodeRegistry(heartbeat_ttl_s=TTL, started_at=0))
    assert sorted(r.at_open[PLAIN]) == ["chat-0", "chat-1", "chat-2"] and r.at_open[REPLACED] == []
    assert {k: s.api_key for k, s in r.placed.items()} == {k: v["api_key"] for k, v in legacy.items()}
    assert astore.scrub_placements_at_start(r.rows())  # what the control plane does next, before anything runs
    raw = database_bytes(tmp_path)
    assert [k for k in ever if k.encode() in raw] == []  # none left anywhere, not even old ones
    assert b"plain-key-" not in raw
    # And the next start reads them sealed, with the same keys.
    _, again = open_replicas(tmp_path, NodeRegistry(heartbeat_ttl_s=TTL, started_at=0))
    assert again.at_open[PLAIN] == [] and {k: s.api_key for k, s in again.placed.items()} == {
        k: v["api_key"] for k, v in legacy.items()
    }


@pytest.mark.trio
async def test_a_lost_secret_stops_the_start_and_an_empty_file_says_start_over_with_new_keys(tmp_path: Path) -> None:
    given = await placed_and_saved(tmp_path)
    secret = paths.engine_keys_secret_path(tmp_path)
    secret.unlink()
    with pytest.raises(keyseal.SecretMissing) as info:
        open_replicas(tmp_path, NodeRegistry(heartbeat_ttl_s=TTL, started_at=0))
    assert f"`install -m 600 /dev/null {secret}`" in str(info.value) and "3 replica(s)" in str(info.value)
    assert not secret.exists()  # nothing made behind the operator's back
    secret.touch(mode=0o600)
    secret.chmod(0o600)
    _, r = open_replicas(tmp_path, NodeRegistry(heartbeat_ttl_s=TTL, started_at=0))
    assert sorted(r.at_open[REPLACED]) == sorted(given)
    assert all(r.placed[k].api_key != key for k, key in given.items())  # new keys: those engines restart
    assert sorted(r.placed) == sorted(given)  # in the same places
    assert len(secret.read_text().strip()) == 64 and stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_a_secret_that_is_not_one_or_is_open_to_others_is_refused(tmp_path: Path) -> None:
    secret = paths.engine_keys_secret_path(tmp_path)
    paths.write_private(secret, b"not hex\n")
    with pytest.raises(MachineError, match="is not an engine-key secret"):
        keyseal.load(tmp_path, sealed_keys=0)
    paths.write_private(secret, os.urandom(32).hex().encode())
    secret.chmod(0o644)
    with pytest.raises(private.NotPrivate, match=f"`chmod 600 {secret}`"):
        keyseal.load(tmp_path, sealed_keys=0)


def test_a_scrub_says_when_a_reader_of_another_process_keeps_the_log(tmp_path: Path) -> None:
    store = Store(tmp_path / "llmgw.db", busy_timeout_s=0.05)
    store.set_placements({"chat-0": {"api_key": "plain"}})
    reader = sqlite3.connect(str(tmp_path / "llmgw.db"), isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM placements").fetchone()  # holds a snapshot in the log
        assert store.scrub_placements({"chat-0": {"sealed_key": "x"}}) is False
        assert store.placements() == {"chat-0": {"sealed_key": "x"}}  # the replacement stands
    finally:
        reader.close()
    assert store.scrub_placements({"chat-0": {"sealed_key": "x"}}) is True
    assert b"plain" not in database_bytes(tmp_path)
