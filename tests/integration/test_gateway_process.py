"""`llmgw gateway` itself: a real process with two workers on one port (SO_REUSEPORT), in front
of real sim engines, its table from a file (no control plane: `--table-file`). Both workers
serve; a worker killed is started again and the other serves meanwhile; /metrics, whichever
worker answers, has both workers' series labelled `worker`, no counter going back; SIGTERM or
Ctrl-C stops it with status 0, its workers drained; a parent killed outright takes its workers
with it; a port already taken is said at once."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testlib import hostile
from testlib.cluster import free_port, wait_until
from testlib.gateway import Sim, chat, parse_metrics, request
from testlib.gatewaytable import TOKEN, write_table_file
from testlib.proc import Proc

STOP_S = 30.0


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def engines() -> Iterator[list[Sim]]:
    sims = [Sim(f"chat-{i}") for i in range(2)]
    try:
        for s in sims:
            s.wait_serving()
        yield sims
    finally:
        for s in sims:
            s.stop()


def start_gateway(tmp_path: Path, engines: list[Sim], port: int, *flags: str) -> Proc:
    table = write_table_file(tmp_path / "table.json", engines)
    args = ["--log-format", "json", "gateway", "--table-file", str(table), "--listen", f"127.0.0.1:{port}", *flags]
    return Proc("gateway", args, tmp_path / "gateway.log")


def ready_pids(gw: Proc) -> list[int]:
    [ready] = wait_until("gateway ready", lambda: gw.events("gateway_ready"), alive=[gw], timeout=60)
    return [int(p) for p in ready["pids"].split(",")]


def instances(port: int, connections: int = 40) -> set[str]:
    """The workers that answered /health on `connections` fresh connections (each 200)."""
    seen = set()
    for _ in range(connections):
        status, _, body = request(port, "GET", "/health")
        assert status == 200, body
        seen.add(json.loads(body)["instance"])
    return seen


def chats(port: int, n: int) -> list[int]:
    return [request(port, "POST", "/v1/chat/completions", chat(f"q{i}"), token=TOKEN)[0] for i in range(n)]


def test_two_workers_share_the_port_and_a_killed_one_is_started_again(tmp_path: Path, engines: list[Sim]) -> None:
    port = free_port()
    gw = start_gateway(tmp_path, engines, port, "--workers", "2")
    try:
        pids = ready_pids(gw)
        assert len(pids) == 2
        first = instances(port)
        assert len(first) == 2, gw.tail()
        assert chats(port, 10) == [200] * 10

        os.kill(pids[0], signal.SIGKILL)
        wait_until("the parent saw the worker die", lambda: gw.events("gateway_worker_exited"), alive=[gw], timeout=10)
        [exited] = gw.events("gateway_worker_exited")
        assert exited["worker"] == 0 and exited["signal"] == "SIGKILL" and exited["restart_in_s"] == 1.0
        assert chats(port, 10) == [200] * 10  # the other worker serves meanwhile
        wait_until(
            "worker 0 started again", lambda: len(gw.events("gateway_worker_ready")) == 3, alive=[gw], timeout=30
        )
        again = instances(port)
        assert len(again) == 2 and len(again - first) == 1, (first, again)

        assert gw.stop(signal.SIGTERM, timeout=STOP_S) == 0, gw.tail()
        assert len(gw.events("gateway_worker_stopped")) == 2, gw.tail()
        assert gw.events("gateway_stopped"), gw.tail()
        assert not any(alive(int(e["pid"])) for e in gw.events("gateway_worker_ready"))
    finally:
        gw.kill()


def scrape(port: int) -> tuple[str, dict[tuple[str, frozenset], float]]:
    """/health then /metrics on one fresh connection: the worker that answered, and what it said."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request("GET", "/health")
        answered = json.loads(conn.getresponse().read())["instance"]
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200
        return answered, parse_metrics(response.read().decode())
    finally:
        conn.close()


def test_metrics_show_every_worker_labelled_whichever_answers_and_no_counter_goes_back(
    tmp_path: Path, engines: list[Sim]
) -> None:
    port = free_port()
    gw = start_gateway(tmp_path, engines, port, "--workers", "2")
    try:
        ready_pids(gw)
        workers = instances(port)
        assert len(workers) == 2, gw.tail()
        counted = ("_total", "_bucket", "_count", "_sum")
        answered_by, last, sent = set(), {}, 0
        for _ in range(30):
            assert chats(port, 2) == [200, 200]  # on fresh connections: to either worker
            sent += 2
            answered, figures = scrape(port)
            answered_by.add(answered)
            assert all("worker" in dict(labels) for _, labels in figures), "every series says whose it is"
            heard = {dict(labels)["worker"] for name, labels in figures if name == "llmgw_gateway_worker_heard_seconds"}
            assert heard == workers, (answered, heard)
            for key, value in figures.items():
                if key[0].endswith(counted):
                    assert value >= last.get(key, 0.0), (key, last.get(key), value, answered)
            last = {k: v for k, v in figures.items() if k[0].endswith(counted)}
        assert answered_by == workers  # scrapes answered by each worker, one series set for both

        def requests_total() -> float | None:
            _, figures = scrape(port)
            total = sum(
                v
                for (name, labels), v in figures.items()
                if name == "llmgw_gateway_requests_total" and ("status", "200") in labels
            )
            return total if total == sent else None

        # Each worker's figures are at most a second old in another's answer: soon every request is there.
        wait_until("every request counted in one scrape", requests_total, alive=[gw], timeout=10)
    finally:
        gw.kill()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_stops_the_gateway_and_its_workers_with_status_0(
    tmp_path: Path, engines: list[Sim], sig: signal.Signals
) -> None:
    port = free_port()
    gw = start_gateway(tmp_path, engines, port, "--workers", "2")
    try:
        pids = ready_pids(gw)
        assert gw.stop(sig, timeout=STOP_S) == 0, gw.tail()
        assert [e["signal"] for e in gw.events("gateway_stopping")] == [sig.name], gw.tail()
        # Each worker got SIGTERM once from its parent, not the terminal's signal too.
        assert [e["signal"] for e in gw.events("gateway_worker_stopping")] == ["SIGTERM", "SIGTERM"], gw.tail()
        assert not any(alive(pid) for pid in pids)
    finally:
        gw.kill()


def test_workers_stop_when_their_parent_is_killed(tmp_path: Path, engines: list[Sim]) -> None:
    port = free_port()
    gw = start_gateway(tmp_path, engines, port, "--workers", "2")
    try:
        pids = ready_pids(gw)
        gw.popen.kill()
        gw.popen.wait(10)
        wait_until(
            "the orphaned workers stopped", lambda: not any(alive(pid) for pid in pids), procs=[gw], timeout=STOP_S
        )
        assert len(gw.events("gateway_parent_gone")) == 2, gw.tail()
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        gw.kill()


def test_a_port_taken_by_another_program_ends_the_gateway_saying_so(tmp_path: Path, engines: list[Sim]) -> None:
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        gw = start_gateway(tmp_path, engines, port, "--workers", "2")
        started = time.monotonic()
        try:
            assert gw.popen.wait(60) == 1, gw.tail()
        finally:
            gw.kill()
    text = (tmp_path / "gateway.log").read_text()
    assert f"cannot listen on 127.0.0.1:{port} (--listen): Address already in use" in text
    assert "before it was ready to serve; its error is above" in text
    assert time.monotonic() - started < 30  # no restarts: the cause would stay


def test_hostile_peers_end_their_own_connections_and_the_gateway_serves_on(tmp_path: Path, engines: list[Sim]) -> None:
    """The standalone gateway's listener against real sockets: a request cut (FIN or RST) at
    every interesting byte, garbage, 200 idle connections and a slowloris; then it still serves."""
    port = free_port()
    gw = start_gateway(tmp_path, engines, port, "--workers", "1")
    try:
        ready_pids(gw)
        head, body = hostile.request_bytes(
            "POST",
            "/v1/chat/completions",
            body=hostile.chat_body("chat"),
            headers=[("authorization", f"Bearer {TOKEN}")],
        )
        for offset in hostile.offsets(head, body):
            for how in ("fin", "rst"):
                hostile.cut_at("127.0.0.1", port, head + body, offset, how=how)
        garbage = hostile.cut_at("127.0.0.1", port, b"\x16\x03\x01\x00\xff" + os.urandom(512), 517, how="fin")
        assert hostile.status_of(garbage) == 400, garbage[:200]
        held = hostile.idle("127.0.0.1", port, 200)
        try:
            _, took = hostile.trickle("127.0.0.1", port, head, interval_s=0.5, limit_s=3.0)
            assert took < 12.0  # cut by [http] head_timeout_s (10 s) at the latest
            assert set(chats(port, 5)) == {200}  # served while the idle ones are held
        finally:
            for sock in held:
                sock.close()
        assert set(chats(port, 5)) == {200}
        assert gw.popen.poll() is None, gw.tail()
    finally:
        gw.stop(signal.SIGTERM)
