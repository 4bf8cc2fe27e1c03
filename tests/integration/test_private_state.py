"""Private is private, on a real control plane and a real agent: what `llmgw ca init`, `llmgw
server`, `llmgw agent` and `llmgw up` create under a permissive umask is 0700/0600; a private
file open to others or owned by another user (nobody, uid 65534: these tests run as root) stops
the start with the command that fixes it, and that command works; the database alone reveals no
engine key; a database of the earlier format (plain engine keys, the modes `ca init` left) is
taken over with no engine restarted; and the restore commands of docs/operations.md bring back a
working cluster after the whole state directory is lost.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import signal
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from llmgw import paths
from llmgw.server.store import keyseal, store_path
from testlib.cluster import Cluster, wait_until
from testlib.ports import free_port
from testlib.proc import build_root, llmgw_env, run_llmgw, umask

NOBODY = 65534
CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 2
"""
READY_S = 30.0

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the owner checks give files to nobody: root only")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0)
    try:
        yield c
    finally:
        c.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def modes(paths_: list[Path]) -> dict[str, str]:
    return {str(p): f"{mode(p):04o}" for p in paths_}


def settled(replicas: list[dict[str, Any]] | None) -> bool:
    placed = [r for r in replicas or [] if r["replica"] is not None]
    return len(placed) == 2 and all(set(r["member_states"]) == {"ready"} and r["port"] for r in placed)


def running_cluster(cluster: Cluster) -> list[dict[str, Any]]:
    cluster.init_ca()
    cluster.add_node("node-a")
    cluster.set_catalog(CATALOG)
    cluster.start_server()
    cluster.start_agent("node-a")
    return cluster.wait_replicas("both chat replicas ready", settled, timeout=READY_S)


def post(host: str, port: int, path: str, key: str | None, body: dict[str, Any]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        headers = {"content-type": "application/json"}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def chat_through_gateway(cluster: Cluster, token: str) -> tuple[int, Any]:
    url = urlsplit((cluster.state / "admin.url").read_text().strip())
    body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return post(url.hostname or "127.0.0.1", url.port or 80, "/v1/chat/completions", token, body)


def complete_directly(port: int, key: str | None) -> int:
    return post("127.0.0.1", port, "/v1/completions", key, {"model": "chat", "prompt": "hi", "max_tokens": 2})[0]


def database_bytes(state: Path) -> bytes:
    return b"".join(p.read_bytes() for p in paths.store_files(state) if p.exists())


def fix_command(stderr: str) -> str:
    """The command a refusal says fixes it (all of them, when there are several)."""
    found = re.search(r"fix them all with `([^`]*)`", stderr) or re.search(r"fix it with `([^`]*)`", stderr)
    assert found, stderr
    return found.group(1)


def restarts_and_pids(replicas: list[dict[str, Any]]) -> dict[str, tuple[int, list[int]]]:
    return {r["replica"]: (r["restarts"], r["pids"]) for r in replicas if r["replica"] is not None}


# -- what is created, under a permissive umask ---------------------------------------------


@pytest.mark.parametrize("mask", [0o000, 0o022])
def test_ca_init_server_and_agent_create_every_private_path_private_whatever_the_umask(
    cluster: Cluster, tmp_path: Path, mask: int
) -> None:
    with umask(mask):
        # `ca init` into a state directory whose parents do not exist yet either.
        deep = tmp_path / "deep" / "er" / "state"
        run = run_llmgw("ca", "init", "--state-dir", str(deep))
        assert run.returncode == 0, run.stderr
        running_cluster(cluster)
    for state in (deep, cluster.state):
        assert modes([state, state / "ca"]) == dict.fromkeys(map(str, [state, state / "ca"]), "0700")
        secrets_ = [state / "ca" / "ca.key", state / "ca" / "server.key", state / "admin.token"]
        secrets_ += [paths.engine_keys_secret_path(state)]
        assert modes(secrets_) == dict.fromkeys(map(str, secrets_), "0600")
        public = [state / "ca" / "ca.crt", state / "ca" / "server.crt"]
        assert modes(public) == dict.fromkeys(map(str, public), "0644")
    assert modes([deep.parent, deep.parent.parent]) == dict.fromkeys(
        map(str, [deep.parent, deep.parent.parent]), "0700"
    )
    # The running server's database, with its -wal and -shm, and what it wrote for `ctl`.
    db_files = list(paths.store_files(cluster.state))
    assert all(p.exists() for p in db_files), db_files
    assert modes(db_files) == dict.fromkeys(map(str, db_files), "0600")
    assert mode(cluster.state / "admin.url") == 0o644
    # The node: its state directory (made by `agent csr`), its key, the records of its engines.
    node = cluster.nodes_files["node-a"].state_dir
    records = sorted((node / "run").glob("*.json"))
    assert len(records) == 2, records
    assert modes([node, node / "pki", node / "run"]) == dict.fromkeys(
        map(str, [node, node / "pki", node / "run"]), "0700"
    )
    assert modes([node / "pki" / "node.key", *records]) == dict.fromkeys(
        map(str, [node / "pki" / "node.key", *records]), "0600"
    )
    # Nothing under the control plane's state directory may be changed by others.
    writable = [str(p) for p in cluster.state.rglob("*") if mode(p) & 0o022]
    assert writable == [], writable


@pytest.mark.parametrize("mask", [0o000, 0o022])
def test_llmgw_up_creates_every_private_path_private_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    state = tmp_path / "home" / "up"
    port = free_port()
    with umask(mask):
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "up", "--state-dir", str(state), "--port", str(port), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=llmgw_env(),
        )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded: `up` gives up by itself after its ready timeout
            if json.loads(line)["event"] == "ready":
                break
        else:
            raise AssertionError(f"llmgw up ended before ready: exit {proc.wait(10)}")
        dirs = [state.parent, state, state / "ca", state / "nodes", state / "nodes" / "local-1"]
        dirs += [state / "nodes" / "local-1" / "pki", state / "nodes" / "local-1" / "run"]
        assert modes(dirs) == dict.fromkeys(map(str, dirs), "0700")
        files = [state / "ca" / "ca.key", state / "ca" / "server.key", state / "admin.token", state / "up-api-key"]
        files += [paths.engine_keys_secret_path(state), state / "server.toml", *paths.store_files(state)]
        files += [
            state / "nodes" / "local-1" / "pki" / "node.key",
            *(state / "nodes" / "local-1" / "run").glob("*.json"),
        ]
        assert modes(files) == dict.fromkeys(map(str, files), "0600")
        writable = [str(p) for p in [state, *(state / "ca").rglob("*"), *state.glob("*")] if mode(p) & 0o022]
        assert writable == [], writable
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


# -- refused at start ----------------------------------------------------------------------


def test_the_server_refuses_private_files_open_to_others_or_of_another_owner_and_the_fix_it_names_works(
    cluster: Cluster,
) -> None:
    running_cluster(cluster)
    assert cluster.server.stop(signal.SIGTERM) == 0, cluster.server.tail()
    state = cluster.state
    state.chmod(0o755)
    (state / "llmgw.db").chmod(0o644)
    os.chown(state / "admin.token", NOBODY, -1)
    (state / "ca" / "server.key").chmod(0o640)
    refused = run_llmgw("server", "--config", str(cluster.server_config), timeout=30)
    assert refused.returncode == 1, (refused.returncode, refused.stderr)
    err = refused.stderr
    assert f"{state} has mode 0755 (the control plane's state directory); fix it with `chmod 700 {state}`" in err
    assert f"{state}/llmgw.db has mode 0644 (the database); fix it with `chmod 600 {state}/llmgw.db`" in err
    assert f"{state}/ca/server.key has mode 0640" in err and f"`chmod 600 {state}/ca/server.key`" in err
    assert f"{state}/admin.token has owner uid {NOBODY}" in err and f"`chown root {state}/admin.token`" in err
    assert "Traceback" not in err, err
    # The command it names, as given, fixes it all.
    fixed = subprocess.run(["sh", "-c", fix_command(err)], capture_output=True, text=True, timeout=30)
    assert fixed.returncode == 0, fixed.stderr
    cluster.start_server()
    cluster.wait_replicas("the replicas adopted after the fix", settled, timeout=READY_S)


def test_the_agent_refuses_a_key_directory_open_to_others_or_a_key_of_another_owner(cluster: Cluster) -> None:
    cluster.init_ca()
    files = cluster.add_node("node-a")
    files.pki.chmod(0o755)
    refused = run_llmgw("agent", "run", "--config", str(files.config), timeout=30)
    assert refused.returncode == 1, refused.stderr
    assert (
        f"{files.pki} has mode 0755 (the node's key directory); fix it with `chmod 700 {files.pki}`" in refused.stderr
    )
    files.pki.chmod(0o700)
    os.chown(files.pki / "node.key", NOBODY, -1)
    refused = run_llmgw("agent", "run", "--config", str(files.config), timeout=30)
    assert refused.returncode == 1, refused.stderr
    assert f"`chown root {files.pki / 'node.key'}`" in refused.stderr, refused.stderr
    (files.state_dir / "run").mkdir(mode=0o755)
    (files.state_dir / "run").chmod(0o755)
    refused = run_llmgw("agent", "run", "--config", str(files.config), timeout=30)
    assert f"`chmod 700 {files.state_dir / 'run'}`" in refused.stderr, refused.stderr


# -- engine keys ---------------------------------------------------------------------------


def test_the_database_alone_reveals_no_engine_key(cluster: Cluster) -> None:
    replicas = running_cluster(cluster)
    for r in replicas:
        key = cluster.engine_key(r["replica"])
        assert complete_directly(r["port"], key) == 200  # the key the engine was given
        assert complete_directly(r["port"], None) == 401
        assert key.encode() not in database_bytes(cluster.state), r["replica"]
        with sqlite3.connect(f"file:{store_path(cluster.state)}?mode=ro", uri=True) as db:
            dump = "\n".join(db.iterdump())
        assert key not in dump and '"api_key"' not in dump


def to_the_earlier_format(state: Path) -> list[str]:
    """What a control plane before sealed keys left: each placement with its key in plain text
    (`{"placement", "api_key", "dist_init_port"}`), no secret file, and the modes its `ca init`
    and SQLite gave (a 0755 state directory, a 0644 database). The plain keys."""
    keys = keyseal.load(state, sealed_keys=1)
    plain = []
    with sqlite3.connect(str(store_path(state))) as db:
        for rid, body in db.execute("SELECT replica_id, body FROM placements").fetchall():
            row = json.loads(body)
            row["api_key"] = keys.open(rid, row.pop("sealed_key"))
            plain.append(row["api_key"])
            db.execute("UPDATE placements SET body = ? WHERE replica_id = ?", (json.dumps(row, sort_keys=True), rid))
    paths.engine_keys_secret_path(state).unlink()
    state.chmod(0o755)
    for p in paths.store_files(state):
        if p.exists():
            p.chmod(0o644)
    return plain


def test_a_database_of_the_earlier_format_is_taken_over_with_no_engine_restarted(cluster: Cluster) -> None:
    running_cluster(cluster)
    token = cluster.ctl("keys", "create", "team")["token"]
    assert chat_through_gateway(cluster, token)[0] == 200
    before = cluster.wait_replicas("both ready", settled)
    assert cluster.server.stop(signal.SIGTERM) == 0, cluster.server.tail()
    plain = to_the_earlier_format(cluster.state)
    assert len(plain) == 2 and all(k.encode() in database_bytes(cluster.state) for k in plain)

    # The upgraded server first says what to fix in the modes the earlier version left.
    refused = run_llmgw("server", "--config", str(cluster.server_config), timeout=30)
    assert refused.returncode == 1 and "chmod 700" in refused.stderr and "chmod 600" in refused.stderr, refused.stderr
    subprocess.run(["sh", "-c", fix_command(refused.stderr)], check=True, timeout=30)
    links = len(cluster.agents["node-a"].events("link_up"))
    server = cluster.start_server()
    [sealed] = server.events("engine_keys_sealed")
    assert sorted(sealed["replicas"]) == sorted(r["replica"] for r in before if r["replica"]), sealed
    wait_until(
        "the agent back", lambda: len(cluster.agents["node-a"].events("link_up")) > links, procs=cluster.latest()
    )
    after = cluster.wait_replicas("both adopted", settled, timeout=READY_S)
    assert restarts_and_pids(after) == restarts_and_pids(before)  # the same processes: none restarted
    assert not server.events("replica_placed") and not server.events("engine_keys_replaced")
    assert chat_through_gateway(cluster, token)[0] == 200  # the gateway calls them with their old keys
    raw = database_bytes(cluster.state)
    assert [k for k in plain if k.encode() in raw] == []  # scrubbed from the files
    assert mode(paths.engine_keys_secret_path(cluster.state)) == 0o600
    assert sorted(cluster.engine_key(r["replica"]) for r in after if r["replica"]) == sorted(plain)


# -- the documented restore ----------------------------------------------------------------


def operations_blocks() -> list[str]:
    """The command blocks of docs/operations.md's backup section, in order."""
    text = (build_root() / "docs" / "operations.md").read_text()
    section = text.split("## Backing up and restoring the control plane's state", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.*?)```", section, flags=re.S)


def documented(block: str, cluster: Cluster, tmp_path: Path) -> str:
    return (
        block.replace("/var/lib/llmgw", str(cluster.state))
        .replace("/root/", f"{tmp_path}/backups/")
        .replace("/etc/llmgw/server.toml", str(cluster.server_config))
    )


def test_the_documented_backup_and_restore_bring_back_a_working_cluster_after_the_state_directory_is_lost(
    cluster: Cluster, tmp_path: Path
) -> None:
    running_cluster(cluster)
    token = cluster.ctl("keys", "create", "team")["token"]
    before = cluster.wait_replicas("both ready", settled)
    (tmp_path / "backups").mkdir(mode=0o700)
    blocks = operations_blocks()
    once = next(b for b in blocks if "tar" in b and "-cpf" in b)
    nightly = next(b for b in blocks if "server backup" in b)
    restore = next(b for b in blocks if "tar" in b and "-xpf" in b)  # after losing the state directory
    for block in (once, nightly):  # as root, as the docs say (sudo: this test runs as root)
        for line in filter(str.strip, documented(block, cluster, tmp_path).splitlines()):
            args = shlex.split(line)
            assert args[0] == "sudo", line
            if args[1] == "llmgw":
                assert cluster.llmgw(*args[2:]).returncode == 0
            else:
                subprocess.run(args[1:], check=True, timeout=60)
    assert cluster.server.stop(signal.SIGTERM) == 0, cluster.server.tail()
    subprocess.run(["rm", "-rf", str(cluster.state)], check=True)  # the disk is lost

    done = subprocess.run(
        ["bash", "-euc", documented(restore, cluster, tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    links = len(cluster.agents["node-a"].events("link_up"))
    cluster.start_server()
    wait_until(
        "the agent back", lambda: len(cluster.agents["node-a"].events("link_up")) > links, procs=cluster.latest()
    )
    after = cluster.wait_replicas("both adopted", settled, timeout=READY_S)
    assert restarts_and_pids(after) == restarts_and_pids(before)  # the restored keys open: no engine restarted
    assert chat_through_gateway(cluster, token)[0] == 200
    assert mode(cluster.state) == 0o700 and mode(paths.engine_keys_secret_path(cluster.state)) == 0o600
