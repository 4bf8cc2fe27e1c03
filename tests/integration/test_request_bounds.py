"""No request stalls the control plane, whatever its body: a real `llmgw server`, one agent and
a sim engine, sent bodies built to be slow (at the body limit) and floods of large bodies, while
`/health` is asked again and again on another connection.

What each test holds:
- every adversarial body at the limit (a fixed corpus, and generated ones) is answered (a 400,
  or the engine's answer), never a 500, and the control plane's own measure of its loop
  (`[debug] measure_steps`: the CPU time of every task step) records no step longer than 20 ms
  meanwhile,
  and `/health` answers within a second throughout, and the node stays joined with its replica
  never restarted (the control plane did not take its own stall for the node's silence);
- 200 clients without a key, each sending 8 MiB, cost the control plane almost no memory (their
  bodies are never read), and 50 with a key are held to the body budget, each answered.

The gateway runs as one worker process here (`gateway_workers = 1`: the body budget is each
worker's), so the memory measured is the control plane's and its worker's together; the loop
measured is the control plane's, which no request reaches any more (docs/gateway.md).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import attrs
import pytest
from hypothesis import HealthCheck, given, settings

from testlib import bodies
from testlib.cluster import Cluster
from testlib.procfs import children, rss

MODEL = "sim-small"
BODY_LIMIT = 8 << 20
BUDGET = 64 << 20
SERVER_TOML = "gateway_workers = 1\n"
CATALOG = f"""
[http]
body_budget_bytes = {BUDGET}

[debug]
measure_steps = true

[[models]]
name = "{MODEL}"
engine = "sim"
replicas = 1
"""
HEALTH_BOUND_S = 1.0


@attrs.frozen(kw_only=True)
class Live:
    cluster: Cluster
    http_port: int
    token: str

    def server_rss(self) -> int:
        """The control plane's RSS and its gateway worker's, together."""
        pid = self.cluster.server.popen.pid
        return sum(rss(p) for p in (pid, *children(pid)))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    cluster = Cluster(tmp_path_factory.mktemp("bounds"), server_toml=SERVER_TOML)
    try:
        cluster.init_ca()
        cluster.set_catalog(CATALOG)
        cluster.add_node("node-a")
        server = cluster.start_server()
        cluster.start_agent("node-a")
        cluster.wait_replicas("the sim replica to serve", lambda rs: any(r["state"] == "ready" for r in rs))
        admin_url = server.events("server_ready")[0]["admin_url"]
        token = cluster.ctl("keys", "create", "bounds")["token"]
        yield Live(cluster=cluster, http_port=int(admin_url.rsplit(":", 1)[1]), token=token)
    finally:
        cluster.close()


def post(port: int, body: bytes, token: str | None, timeout: float = 60.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class HealthWatch:
    """Asks `/health` on its own connection every 50 ms until stopped; the slowest answer."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.slowest = 0.0
        self.asked = 0
        self.failures: list[str] = []
        self._answered = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def more_answers(self, count: int, timeout: float = 10.0) -> None:
        """Until `count` more answers than now came: the server's loop has gone on past this."""
        with self._answered:
            target = self.asked + count
            if not self._answered.wait_for(lambda: self.asked >= target, timeout):
                raise AssertionError(f"{count} more /health answers: not within {timeout:g} s; {self.failures[-3:]}")

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            started = time.monotonic()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request("GET", "/health")
                status = conn.getresponse().status
                conn.close()
            except OSError as exc:
                self.failures.append(repr(exc))
                continue
            self.slowest = max(self.slowest, time.monotonic() - started)
            with self._answered:
                self.asked += 1
                self._answered.notify_all()
            if status != 200:
                self.failures.append(f"/health answered {status}")


CHAT = b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"hi"}],"max_tokens":4,'
ADVERSARIAL = bodies.adversarial(MODEL, BODY_LIMIT)


def long_steps(live: Live) -> int:
    """Task steps of the control plane's loop that computed for more than 20 ms since it started
    (`[debug] measure_steps`: `llmgw.looplag.StepTimer`, CPU time per step)."""
    conn = http.client.HTTPConnection("127.0.0.1", live.http_port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    for line in text.splitlines():
        if line.startswith('llmgw_event_loop_long_steps_total{over="0.02"}'):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no llmgw_event_loop_long_steps_total in /metrics")


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_a_body_built_to_be_slow_never_stalls_the_control_plane(live: Live, name: str) -> None:
    body = ADVERSARIAL[name]()
    assert len(body) <= BODY_LIMIT
    # The counter is the whole loop's: over the seconds a large body takes to parse in the worker
    # on a loaded machine, an unrelated step (a full garbage collection, the reconciler) may pass
    # 20 ms of CPU once. The body is sent a second time then: a step it causes comes again, noise
    # does not (seen twice in loaded CI runs, on the slowest body, never twice in a row).
    for _ in range(2):
        steps_before = long_steps(live)
        with HealthWatch(live.http_port) as watch:
            status, answer = post(live.http_port, body, live.token)
            watch.more_answers(3)  # the loop went on past the body: a step it caused has ended
        if long_steps(live) == steps_before:
            break
    else:
        raise AssertionError("a step held the control plane's loop for more than 20 ms, twice in a row")
    assert status in (200, 400), (status, answer[:300])
    if status == 400:
        assert json.loads(answer)["error"]["message"], answer
    assert not watch.failures, watch.failures
    assert watch.asked >= 3 and watch.slowest < HEALTH_BOUND_S, (watch.asked, watch.slowest)
    assert_healthy(live)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=bodies.strategy(MODEL, BODY_LIMIT))
def test_generated_bodies_never_stall_the_control_plane(live: Live, body: bytes) -> None:
    steps_before = long_steps(live)
    with HealthWatch(live.http_port) as watch:
        status, answer = post(live.http_port, body, live.token)
        watch.more_answers(2)  # the loop went on past the body: a step it caused has ended
    assert long_steps(live) == steps_before, "a step held the control plane's loop for more than 20 ms"
    assert status in (200, 400), (status, answer[:300])
    assert not watch.failures and watch.slowest < HEALTH_BOUND_S, (watch.failures, watch.slowest)


def assert_healthy(live: Live) -> None:
    cluster = live.cluster
    assert cluster.server.returncode is None, cluster.server.tail()
    nodes = cluster.nodes()
    assert nodes is not None and nodes["node-a"]["state"] == "joined", cluster.last_nodes
    replicas = cluster.replicas()
    assert replicas and replicas[0]["restarts"] == 0, replicas  # never taken for lost
    log = cluster.server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "node_lost" not in log, cluster.server.tail(80)


def flood(port: int, count: int, body: bytes, token: str | None, rss: Callable[[], int]) -> tuple[list, int]:
    """`count` clients at once, each sending `body`; their answers (status or the error) and the
    control plane's highest RSS seen meanwhile."""
    peak = [rss()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], rss())

    def one() -> int | str:
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        try:
            auth = f"authorization: Bearer {token}\r\n".encode() if token else b""
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n" + auth
            head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
            try:
                sock.sendall(head + body)
            except OSError:
                pass  # answered and closed before the body was all sent: read what was said
            answer = b""
            try:
                while b"\r\n" not in answer and (chunk := sock.recv(65536)):
                    answer += chunk
            except OSError as exc:
                return repr(exc)
            return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else repr(answer[:100])
        finally:
            sock.close()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=count) as pool:
            answers = list(pool.map(lambda _: one(), range(count), timeout=240))
    finally:
        done.set()
        sampler.join(5)
    return answers, peak[0]


def test_clients_without_a_key_cost_no_memory_for_their_bodies(live: Live) -> None:
    body = b"x" * (BODY_LIMIT - 1)
    before = live.server_rss()
    answers, peak = flood(live.http_port, 200, body, None, live.server_rss)
    assert answers == [401] * 200, sorted(set(map(str, answers)))
    assert peak - before < 64 << 20, f"RSS grew by {(peak - before) >> 20} MiB"
    assert_healthy(live)


def test_clients_with_a_key_are_held_to_the_body_budget(live: Live) -> None:
    pad = b'"pad":"' + b"y" * (BODY_LIMIT - 4096) + b'"}'
    body = CHAT + pad
    before = live.server_rss()
    answers, peak = flood(live.http_port, 50, body, live.token, live.server_rss)
    assert set(answers) <= {200, 503}, sorted(set(map(str, answers)))
    assert 200 in answers
    # What is buffered is the budget's; a little more for the copy each body makes on its way
    # to the JSON worker and to the engine.
    assert peak - before < BUDGET + (48 << 20), f"RSS grew by {(peak - before) >> 20} MiB"
    assert_healthy(live)
