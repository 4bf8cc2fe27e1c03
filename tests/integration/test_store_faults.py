"""The control plane's database under faults, against a real `llmgw server` and a real agent:
another process holding SQLite's write lock (while an admin write is refused, the reconciler
places a replica, the gateway routes to it and /health answers), a damaged file, and a backup
taken while the server runs and restored with the commands docs/operations.md shows.

Each case ends with the server still serving (or, for the damaged file, refusing to start with
its own message, then starting from the restored backup).
"""

from __future__ import annotations

import http.client
import json
import re
import select
import shlex
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from llmgw.server.store.asyncstore import BUSY_TIMEOUT_S
from testlib.cluster import Cluster, wait_until
from testlib.proc import build_root, llmgw_env, run_llmgw


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0)
    try:
        yield c
    finally:
        c.close()


def joined_node(cluster: Cluster, node_id: str = "node-a") -> None:
    cluster.init_ca()
    cluster.add_node(node_id)
    cluster.start_server()
    cluster.start_agent(node_id)
    cluster.wait_nodes(f"{node_id} joined", lambda n: n.get(node_id, {}).get("state") == "joined")


def call(
    cluster: Cluster, method: str, path: str, *, token: str | None = None, timeout: float = 10
) -> tuple[int, dict[str, str], Any, float]:
    """One HTTP request to the control plane's listener: status, headers, JSON body, seconds taken.
    Admin paths carry the admin credential unless `token` is given."""
    url = urlsplit((cluster.state / "admin.url").read_text().strip())
    if token is None and path.startswith("/admin/"):
        token = (cluster.state / "admin.token").read_text().strip()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request(method, path, headers={"authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        body = response.read()
        took = time.monotonic() - started
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(body or b"null"), took
    finally:
        conn.close()


HOLD_LOCK = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()  # until the test closes our standard input
db.execute("ROLLBACK")
"""


@contextmanager
def write_lock_held_by_another_process(db: Path) -> Iterator[None]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 10)
        assert ready and holder.stdout.readline().strip() == "locked", "the lock holder did not start"
        yield
    finally:
        holder.stdin.close()
        holder.wait(10)


class HealthPoller:
    """GET /metrics every 50 ms on its own thread, recording each answer's status and latency:
    the control plane's own route, relayed to its loop by a gateway worker (`/health` is the
    worker's: it would say nothing of the control plane's loop)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.answers: list[tuple[float, int | str, float]] = []  # (when, status or error, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            at = time.monotonic()
            url = urlsplit((self.cluster.state / "admin.url").read_text().strip())
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
            try:
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                response.read()
                status = response.status
            except OSError as exc:
                status = repr(exc)
            finally:
                conn.close()
            took = time.monotonic() - at
            self.answers.append((at, status, took))
            self._stop.wait(0.05)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 1
"""


def chat(cluster: Cluster, token: str) -> tuple[int, Any]:
    url = urlsplit((cluster.state / "admin.url").read_text().strip())
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def stored_placements(db: Path) -> list[str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return [r[0] for r in conn.execute("SELECT replica_id FROM placements")]


def test_a_locked_database_fails_one_admin_write_with_503_and_the_server_serves_on(cluster: Cluster) -> None:
    joined_node(cluster)
    token = json.loads(
        cluster.llmgw("ctl", "keys", "create", "team", "--json", "--state-dir", str(cluster.state)).stdout
    )["token"]
    server = cluster.server
    db = cluster.state / "llmgw.db"
    with HealthPoller(cluster) as health:
        with write_lock_held_by_another_process(db):
            locked_at = time.monotonic()
            status, headers, body, took = call(cluster, "POST", "/admin/v1/nodes/node-a/cordon")
            assert status == 503, (status, body)
            assert headers.get("retry-after", "").isdigit() and int(headers["retry-after"]) >= 1, headers
            message = body["error"]["message"]
            assert f"{db} is locked by another process" in message and "nothing changed; try again" in message
            assert BUSY_TIMEOUT_S * 0.9 <= took < BUSY_TIMEOUT_S + 3, took  # the busy timeout, not 10 s

            ctl = cluster.llmgw("ctl", "cordon", "node-a", "--state-dir", str(cluster.state), ok=False)
            assert ctl.returncode != 0 and "is locked by another process" in ctl.stderr and "HTTP 503" in ctl.stderr

            # The reconciler places a replica meanwhile: kept in memory, served, written later.
            cluster.set_catalog(CATALOG)
            cluster.ctl("reload")
            cluster.wait_replicas(
                "chat-0 ready", lambda rs: [r["state"] for r in rs if r["model"] == "chat"] == ["ready"]
            )
            status, answer = chat(cluster, token)  # through the gateway: key and route from memory
            assert status == 200 and answer["choices"], answer
            wait_until("the failing write logged", lambda: server.events("store_write_failing"), procs=[server])
            assert stored_placements(db) == [] and not server.events("store_write_recovered")
            held_s = time.monotonic() - locked_at
            released_at = time.monotonic()
        wait_until(
            "a poll begun after the release answered",
            lambda: any(at > released_at and status == 200 for at, status, _ in health.answers),
            procs=[server],
        )
    assert held_s > 2 * BUSY_TIMEOUT_S, held_s
    during = [(status, took) for at, status, took in health.answers if locked_at <= at <= released_at]
    assert len(during) >= 10, health.answers
    assert all(status == 200 for status, _ in during), during
    assert max(took for _, took in during) < 0.5, during  # a stalled loop would take the busy timeout

    assert server.returncode is None, server.tail()
    status, _, body, _ = call(cluster, "POST", "/admin/v1/nodes/node-a/cordon")
    assert status == 200 and body["node"]["cordoned"] is True, body
    assert cluster.nodes()["node-a"]["cordoned"] is True
    wait_until("the placement written", lambda: stored_placements(db) == ["chat-0"], procs=[server])
    # The reload also names a new model, whose catalog time is written in the background too: that
    # write may fail and recover alongside (seen under load), each writer saying so once.
    failing = {e["what"]: e for e in server.events("store_write_failing")}
    recovered = {e["what"]: e for e in server.events("store_write_recovered")}
    assert set(failing) == set(recovered) and "placements" in failing and set(failing) <= {"placements", "catalog"}
    assert len(server.events("store_write_failing")) == len(failing), server.events("store_write_failing")
    assert recovered["placements"]["attempts"] >= 2, recovered
    [refused, *_] = server.events("admin_store_unavailable")
    assert "locked" in refused["reason"], refused
    assert "Traceback" not in server.log_path.read_text(), server.tail()


def operations_blocks() -> list[str]:
    """The command blocks of docs/operations.md's backup section."""
    text = (build_root() / "docs" / "operations.md").read_text()
    section = text.split("## Backing up and restoring the control plane's state", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.*?)```", section, flags=re.S)


def damage_middle_pages(db: Path) -> None:
    with sqlite3.connect(str(db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # everything in the main file, to be damaged there
        page_size, pages = (
            conn.execute("PRAGMA page_size").fetchone()[0],
            conn.execute("PRAGMA page_count").fetchone()[0],
        )
    assert pages >= 6, pages
    with open(db, "r+b") as f:
        f.seek((pages // 2 - 1) * page_size)
        f.write(bytes((i * 7 + 13) % 256 for i in range(2 * page_size)))


def test_a_backup_taken_while_the_server_runs_restores_a_damaged_database_as_the_docs_say(
    cluster: Cluster, tmp_path: Path
) -> None:
    joined_node(cluster)
    token = json.loads(
        cluster.llmgw("ctl", "keys", "create", "team", "--json", "--state-dir", str(cluster.state)).stdout
    )["token"]
    cluster.llmgw("ctl", "cordon", "node-a", "--state-dir", str(cluster.state))
    blocks = operations_blocks()
    backup_block = next(b for b in blocks if "server backup" in b)
    restore_block = next(b for b in blocks if "mv llmgw.db*" in b)  # the restore of a damaged database
    backup = tmp_path / "backups" / "llmgw-backup.db"
    backup.parent.mkdir()

    # The backup, with the command the docs show, while the server runs.
    [command] = [line for line in backup_block.splitlines() if line.strip()]
    command = command.replace("/root/llmgw-backup.db", str(backup)).replace(
        "/etc/llmgw/server.toml", str(cluster.server_config)
    )
    args = shlex.split(command)
    assert args[:4] == ["sudo", "llmgw", "server", "backup"], args
    made = cluster.llmgw(*args[2:])
    assert "1 nodes, 1 valid API keys" in made.stdout, made.stdout
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    with sqlite3.connect(f"file:{backup}?mode=ro", uri=True) as copy:
        assert copy.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        assert copy.execute("SELECT node_id, cordoned FROM nodes").fetchall() == [("node-a", 1)]
        assert copy.execute("SELECT name FROM api_keys").fetchall() == [("team",)]
    assert not list(backup.parent.glob(".*tmp")), list(backup.parent.iterdir())  # no temporary left
    again = cluster.llmgw(*args[2:], ok=False)
    assert again.returncode == 2 and "exists" in again.stderr and "--force" in again.stderr, again.stderr
    forced = cluster.llmgw(*args[2:], "--force", "--json")
    assert json.loads(forced.stdout)["nodes"] == 1

    # The server stops; its database is damaged; it refuses to start, naming the file and the way out.
    assert cluster.server.stop(signal.SIGTERM) == 0, cluster.server.tail()
    db = cluster.state / "llmgw.db"
    damage_middle_pages(db)
    refused = run_llmgw("server", "--config", str(cluster.server_config), timeout=30)
    assert refused.returncode == 1, (refused.returncode, refused.stderr)
    assert f"{db} is damaged" in refused.stderr and "llmgw server backup" in refused.stderr, refused.stderr
    assert "aside" in refused.stderr and "internal error" not in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr

    # The restore, with the commands the docs show (as root, in the state directory).
    script = restore_block.replace("/var/lib/llmgw", str(cluster.state)).replace("/root/llmgw-backup.db", str(backup))
    done = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, timeout=30, env=llmgw_env())
    assert done.returncode == 0, (script, done.stderr)
    assert (cluster.state / "damaged" / "llmgw.db").exists()

    cluster.start_server()
    nodes = cluster.wait_nodes("node-a back, still cordoned", lambda n: n.get("node-a", {}).get("state") == "joined")
    assert nodes["node-a"]["cordoned"] is True, nodes["node-a"]
    status, _, models, _ = call(cluster, "GET", "/v1/models", token=token)
    assert status == 200, models
    wait_until("the server to stay up", lambda: cluster.server.returncode is None, procs=[cluster.server])
