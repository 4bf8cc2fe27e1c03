"""An agent killed outright (SIGKILL) and started again adopts the engine it left running.

Real processes on loopback (`testlib.cluster`): `llmgw server`, one `llmgw agent run` and the
sim engine it starts. Under a bounded load of requests through the gateway, the agent is
SIGKILLed; its engine keeps answering (also after writing far more than a pipe holds to its
log, with no agent alive to read anything); the agent is started again and adopts the very same
process: same pid and port, `restarts` 0, no second engine, not one request failed. Then the
catalog drops the model and the restarted agent stops the engine it adopted. The same holds
under `llmgw agent supervise`, which starts a dead agent again by itself.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
from pathlib import Path

from agent.replica_logs import log_path
from testlib.cluster import Cluster, wait_until
from testlib.load import Load

CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 1
args = ["--log-level", "debug"]
"""
PIPE_BUFFER = 64 << 10  # Linux's default pipe capacity
CLIENT_TIMEOUT_S = 10.0
STOP_WAIT_S = 30.0


def post(port: int, path: str, body: bytes, token: str) -> tuple[int | str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request(
            "POST", path, body=body, headers={"authorization": f"Bearer {token}", "content-type": "application/json"}
        )
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException) as exc:
        return repr(exc), b""
    finally:
        conn.close()


def api_key(cluster: Cluster, replica_id: str) -> str:
    return cluster.engine_key(replica_id)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_killed_agent_restarted_adopts_its_engine_and_no_request_fails(tmp_path: Path) -> None:
    # A TTL longer than the agent's restart: the node must not be taken for lost meanwhile.
    cluster = Cluster(tmp_path, heartbeat_interval_s=0.5, heartbeat_ttl_s=15)
    load = None
    try:
        cluster.init_ca()
        cluster.set_catalog(CATALOG)
        files = cluster.add_node("node-a")
        server = cluster.start_server()
        first = cluster.start_agent("node-a")
        [ready] = cluster.wait_replicas("the replica ready", lambda rs: [r["state"] for r in rs] == ["ready"])
        rid, [pid], port = ready["replica"], ready["pids"], ready["port"]
        assert cluster.engine_pids("node-a") == [pid]
        record = files.state_dir / "run" / f"{rid}-r0.json"
        assert json.loads(record.read_text())["pid"] == pid
        http_port = int(server.events("server_ready")[-1]["admin_url"].rsplit(":", 1)[1])
        load = Load(port=http_port, token=cluster.ctl("keys", "create", "load")["token"]).start()
        wait_until("the load to run", lambda: load.ok >= 10, procs=cluster.latest())

        # The agent dies; its engine does not, and serves on with its log file to itself.
        first.kill()
        assert alive(pid), "the engine died with its agent"
        engine_log = log_path(files.state_dir / "logs", rid, 0)
        size = engine_log.stat().st_size
        key = api_key(cluster, rid)
        for n in range(5000):  # each request logs a sim_request line (debug): several pipes' worth
            status, body = post(port, "/v1/completions", json.dumps({"model": "chat", "prompt": "x"}).encode(), key)
            assert status == 200, (n, status, body)
            if engine_log.stat().st_size - size > 2 * PIPE_BUFFER:
                break
        assert engine_log.stat().st_size - size > 2 * PIPE_BUFFER, engine_log.stat().st_size - size
        assert alive(pid) and record.exists()
        before_restart = load.ok
        wait_until("requests through the gateway while no agent runs", lambda: load.ok >= before_restart + 5)

        # Started again, the agent adopts the engine: the same process serves, nothing restarts.
        second = cluster.start_agent("node-a")
        wait_until(
            "the adoption confirmed by the desired state",
            lambda: second.events("replica_adoption_confirmed"),
            procs=cluster.latest(),
            alive=[second],
        )
        [adopted] = second.events("replica_adopted")
        assert (adopted["replica"], adopted["pid"], adopted["port"], adopted["watched_by"]) == (rid, pid, port, "pidfd")
        [again] = cluster.wait_replicas("the replica ready again", lambda rs: [r["state"] for r in rs] == ["ready"])
        assert (again["replica"], again["pids"], again["port"], again["restarts"]) == (rid, [pid], port, 0)
        assert cluster.engine_pids("node-a") == [pid]  # no second engine for the replica
        assert not second.events("replica_starting") and not server.events("replica_placed")[1:]
        after_restart = load.ok
        wait_until("requests through the gateway after the restart", lambda: load.ok >= after_restart + 10)
        load.finish()
        assert load.failures == [], load.failures
        # `ctl logs` reads the log the engine kept writing while no agent ran.
        [member] = cluster.ctl("logs", rid, "--lines", "400")["members"]
        assert f"adopted pid {pid} (port {port})" in member["text"] and "sim_request" in member["text"]

        # An assignment change reaches the adopted engine: the model leaves the catalog, it stops.
        cluster.set_catalog("")
        cluster.ctl("reload")
        wait_until("the adopted engine stopped", lambda: not alive(pid), procs=cluster.latest())
        wait_until("its record removed", lambda: not record.exists(), procs=cluster.latest())
        [stopped] = second.events("replica_stopped")
        assert stopped["pid"] == pid and stopped["took_s"] < 5, stopped
        assert "sim_stopping signal=SIGTERM" in engine_log.read_text()  # a clean stop, not a kill
        assert cluster.engine_pids("node-a") == []
    finally:
        if load is not None:
            load.finish()
        cluster.close()


def json_events(path: Path, event: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line being written
            if record.get("event") == event:
                out.append(record)
    return out


def test_under_llmgw_agent_supervise_a_killed_agent_is_restarted_and_adopts_its_engine(tmp_path: Path) -> None:
    # The fallback supervisor (nodes without systemd) starts the agent again after it dies; the
    # engine outlives the agent there too. `llmgw agent stop` is a clean stop: the engine goes with it.
    cluster = Cluster(tmp_path, heartbeat_interval_s=0.5, heartbeat_ttl_s=15)
    try:
        cluster.init_ca()
        cluster.set_catalog(CATALOG)
        files = cluster.add_node("node-a")
        cluster.start_server()
        pid_file, agent_log = tmp_path / "agent.pid", tmp_path / "agent.log"
        supervisor = cluster.start_supervised_agent("node-a", pid_file, agent_log)
        [ready] = cluster.wait_replicas("the replica ready", lambda rs: [r["state"] for r in rs] == ["ready"])
        rid, [pid] = ready["replica"], ready["pids"]
        [started] = json_events(agent_log, "agent_started")
        os.kill(started["pid"], signal.SIGKILL)
        wait_until(
            "the agent started again, its adoption confirmed",
            lambda: json_events(agent_log, "replica_adoption_confirmed"),
            procs=[supervisor],
            alive=[supervisor],
            timeout=30,
        )
        assert [e["signal"] for e in json_events(agent_log, "agent_exited")] == ["SIGKILL"]
        assert [e["pid"] for e in json_events(agent_log, "replica_adopted")] == [pid]
        [again] = cluster.wait_replicas("the replica ready again", lambda rs: [r["state"] for r in rs] == ["ready"])
        assert (again["replica"], again["pids"], again["restarts"]) == (rid, [pid], 0)
        assert not json_events(agent_log, "replica_stopped") and alive(pid)
        # A clean stop of the supervisor stops its agent, which stops its engine.
        cluster.llmgw("agent", "stop", "--pid-file", str(pid_file))
        assert supervisor.popen.wait(STOP_WAIT_S) == 0
        assert not alive(pid), "the engine outlived a clean stop of its agent"
        assert [e["pid"] for e in json_events(agent_log, "replica_stopped")] == [pid]
        assert not (files.state_dir / "run" / f"{rid}-r0.json").exists()
    finally:
        cluster.close()
