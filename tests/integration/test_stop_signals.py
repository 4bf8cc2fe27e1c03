"""How the long-lived commands end: `llmgw server`, `llmgw agent run` and `llmgw up`, real
processes sent real signals. Ctrl-C (SIGINT) and SIGTERM stop each cleanly with status 0; a
second signal while the stop is under way cuts it short: what the process started is killed and
it exits 130."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testlib.cluster import Cluster, free_port, wait_until
from testlib.marked import MARKER_ENV, marked_pids
from testlib.proc import llmgw_env, run_llmgw

SIGNALS = [signal.SIGINT, signal.SIGTERM]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, heartbeat_interval_s=0.2, heartbeat_ttl_s=1.5)
    try:
        yield c
    finally:
        c.close()


def alive(pid: int) -> bool:
    """Running, or a zombie nobody reaped yet: gone means no /proc entry or state Z."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_server_and_agent_stop_cleanly_with_status_0(cluster: Cluster, sig: signal.Signals) -> None:
    cluster.init_ca()
    cluster.add_node("node-a")
    cluster.set_catalog('[[models]]\nname = "chat"\nengine = "sim"\n')
    server = cluster.start_server()
    agent = cluster.start_agent("node-a")
    cluster.wait_replicas("chat ready", lambda rs: [r["state"] for r in rs] == ["ready"])
    engines = cluster.engine_pids("node-a")
    assert engines

    assert agent.stop(sig) == 0, agent.tail()
    assert [e["signal"] for e in agent.events("agent_stopping")] == [sig.name], agent.tail()
    assert agent.events("agent_stopped") and not any(alive(pid) for pid in engines), agent.tail()
    assert server.stop(sig) == 0, server.tail()
    assert [e["signal"] for e in server.events("server_stopping")] == [sig.name], server.tail()
    assert server.events("server_stopped"), server.tail()


def start_up(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, dict, Path]:
    log = tmp_path / "up.log"
    state = tmp_path / "state"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "up", "--state-dir", str(state), "--port", str(free_port())]
            + ["--json", "--log-format", "json", *flags],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=llmgw_env({MARKER_ENV: str(tmp_path)}),  # inherited by every process it starts
        )
    assert proc.stdout is not None
    for line in proc.stdout:  # bounded: `up` gives up after its ready timeout
        if json.loads(line)["event"] == "ready":
            return proc, json.loads(line), log
    raise AssertionError(f"up ended before ready: {proc.wait(10)}\n{log.read_text()[-3000:]}")


def logged(log: Path, event: str) -> list[dict]:
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["event"] == event]


def test_up_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    proc, _, log = start_up(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert logged(log, "up_stopping")[0]["signal"] == "SIGTERM" and logged(log, "up_stopped")


STUBBORN_LLAMA_SERVER = """#!/bin/sh
# Answers the agent's --version check, then runs without ever serving, ignoring SIGTERM (as its
# child does): only SIGKILL ends it.
if [ "$1" = "--version" ]; then echo "version: 1 (stubborn test double)"; exit 0; fi
trap '' TERM
sleep 600 &
wait
"""


def test_a_second_ctrl_c_while_up_stops_kills_what_it_started_and_exits_130(tmp_path: Path) -> None:
    llama = tmp_path / "llama-server"
    llama.write_text(STUBBORN_LLAMA_SERVER)
    llama.chmod(0o755)
    model = tmp_path / "stubborn.gguf"
    model.write_bytes(b"GGUF")
    proc, ready, log = start_up(tmp_path, "--model", str(model), "--llama-server", str(llama))
    try:

        def stubborn_pid() -> int | None:
            done = run_llmgw("ctl", "replicas", "--json", "--state-dir", ready["state_dir"])
            pids = [p for r in json.loads(done.stdout) if r["model"] == "stubborn" for p in r["pids"]]
            return pids[0] if pids and pids[0] else None

        pid = wait_until("the stubborn engine to run", stubborn_pid)
        proc.send_signal(signal.SIGINT)
        # The stop waits up to 10 s for an engine to heed SIGTERM; this one never does.
        wait_until("up to start stopping", lambda: logged(log, "up_stopping"))
        assert alive(pid) and proc.poll() is None
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130
        assert time.monotonic() - started < 5
        wait_until("the engine to be killed", lambda: not alive(pid), timeout=5)
        [interrupted] = logged(log, "up_stop_interrupted")
        assert interrupted["signal"] == "SIGINT" and interrupted["killed_processes"] >= 2  # sh and its sleep
        assert not logged(log, "up_stopped")
    finally:
        proc.kill()
        proc.wait(10)
    assert [pid for pid in marked_pids(str(tmp_path)) if alive(pid)] == []  # nothing it started is left
