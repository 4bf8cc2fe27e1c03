"""Hostile peers against a real cluster: `llmgw server`, one `llmgw agent`, a real sim engine.

Every listener llmgw runs — the HTTP listener (gateway and admin API), the agent port (and
its artifact mirror, and the release files it serves to peers without a certificate), the sim
engine — is sent what a broken or malicious peer sends: a FIN or
an RST at many offsets of a request's head and body, in the middle of a streamed response and
of the error answer itself, garbage, a head or body trickled a byte at a time, JSON nested
100,000 deep, two thousand idle connections, and inputs once answered 500 (numbers past int64
or CPython's 4300 digits, Unicode digits, a 5,000-digit Range). After each, `assert_serving` checks that
nothing died and everything still answers: the server and agent processes run, the gateway
and the engine answer, the node stays joined, no engine restarted and no traceback was logged.

The server's deadlines are shortened in its server.toml ([http]) so a slow peer is cut in
seconds; the sim engine keeps its defaults (it is not configured by server.toml).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from testlib import hostile
from testlib.cluster import Cluster, connection_metrics, wait_until

HEAD_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
SEND_TIMEOUT_S = 3.0
CATALOG = f"""
[http]
head_timeout_s = {HEAD_TIMEOUT_S}
body_timeout_s = {BODY_TIMEOUT_S}
keepalive_timeout_s = 5.0
send_timeout_s = {SEND_TIMEOUT_S}

[[models]]
name = "sim-small"
engine = "sim"
replicas = 1
args = ["--output-token-ms", "20"]
"""
MODEL = "sim-small"
RELEASE_FILE = "llmgw-0.0.0-linux-amd64.pyz"
IDLE_CONNECTIONS = 2000


@attrs.frozen(kw_only=True)
class Live:
    cluster: Cluster
    http_port: int
    token: str
    engine_port: int
    engine_key: str

    @property
    def auth(self) -> tuple[str, str]:
        return ("authorization", f"Bearer {self.token}")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    cluster = Cluster(tmp_path_factory.mktemp("hostile"))
    try:
        cluster.init_ca()
        release = cluster.root / "release"  # the release files the server serves, to any peer
        release.mkdir()
        with (release / RELEASE_FILE).open("wb") as f:
            f.truncate(64 << 20)  # more than any socket buffer holds
        digest = hashlib.sha256((release / RELEASE_FILE).read_bytes()).hexdigest()
        (release / "SHA256SUMS").write_text(f"{digest}  {RELEASE_FILE}\n")
        cluster.set_catalog(CATALOG + f'\n[release]\ndir = "{release}"\n')
        cluster.add_node("node-a")
        server = cluster.start_server()
        cluster.start_agent("node-a")
        replicas = cluster.wait_replicas("the sim replica to serve", lambda rs: any(r["state"] == "ready" for r in rs))
        admin_url = server.events("server_ready")[0]["admin_url"]
        token = cluster.ctl("keys", "create", "hostile")["token"]
        yield Live(
            cluster=cluster,
            http_port=int(admin_url.rsplit(":", 1)[1]),
            token=token,
            engine_port=replicas[0]["port"],
            engine_key=cluster.engine_key(replicas[0]["replica"]),
        )
    finally:
        cluster.close()


def request(port: int, method: str, path: str, body: bytes = b"", headers=(), timeout: float = 5.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=dict(headers))
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def metrics(live: Live) -> dict[str, float]:
    """The connection figures: the control plane's own, and its gateway workers' added up (as
    their heartbeats said them, at most a heartbeat interval old)."""
    return connection_metrics(live.http_port)


def aborted(live: Live, listener: str, reason: str) -> float:
    return metrics(live).get(f'llmgw_connections_aborted_total{{listener="{listener}",reason="{reason}"}}', 0.0)


def assert_serving(live: Live) -> None:
    """Nothing died, and every listener still answers a well-behaved client at once."""
    cluster = live.cluster
    assert cluster.server.returncode is None, cluster.server.tail()
    assert cluster.agents["node-a"].returncode is None, cluster.agents["node-a"].tail()
    started = time.monotonic()
    status, body = request(live.http_port, "GET", "/health")
    assert status == 200, body
    status, body = request(
        live.http_port,
        "POST",
        "/v1/chat/completions",
        hostile.chat_body(MODEL),
        [live.auth, ("content-type", "application/json")],
    )
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"], body
    status, body = request(
        live.engine_port,
        "POST",
        "/v1/chat/completions",
        hostile.chat_body(MODEL),
        [("authorization", f"Bearer {live.engine_key}")],
    )
    assert status == 200, body
    assert time.monotonic() - started < 5, "answered, but slowly"
    nodes = cluster.nodes()
    assert nodes is not None and nodes["node-a"]["state"] == "joined", cluster.last_nodes
    replicas = cluster.replicas()
    assert replicas and replicas[0]["restarts"] == 0, replicas  # the engine never died
    for proc in (cluster.server, cluster.agents["node-a"]):
        assert "Traceback" not in proc.log_path.read_text(errors="replace"), proc.tail(80)


def chat_request(live: Live, *, port: int | None = None, stream: bool = False) -> tuple[bytes, bytes]:
    key = live.token if port is None else live.engine_key
    body = hostile.chat_body(MODEL, stream=stream, max_tokens=200 if stream else 16)
    return hostile.request_bytes(
        "POST", "/v1/chat/completions", body=body, headers=[("authorization", f"Bearer {key}")]
    )


@pytest.mark.parametrize("listener", ["gateway", "engine"])
def test_a_fin_or_rst_at_any_byte_of_a_request_ends_that_connection_only(live: Live, listener: str) -> None:
    port = live.http_port if listener == "gateway" else live.engine_port
    head, body = chat_request(live, port=None if listener == "gateway" else port)
    before = aborted(live, "http", "closed") + aborted(live, "http", "reset")
    cuts = hostile.offsets(head, body)
    for offset in cuts:
        for how in ("fin", "rst"):
            hostile.cut_at("127.0.0.1", port, head + body, offset, how=how)
    if listener == "gateway":
        # A FIN after the whole request is a client gone before the answer, counted too; the
        # workers' counts come with their next heartbeats.
        wait_until(
            "the workers to count every cut",
            lambda: aborted(live, "http", "closed") + aborted(live, "http", "reset") - before >= len(cuts),
            last_seen=lambda: metrics(live),
        )
    assert_serving(live)


@pytest.mark.parametrize("how", ["fin", "rst"])
@pytest.mark.parametrize("listener", ["gateway", "engine"])
def test_a_client_gone_in_the_middle_of_a_streamed_response(live: Live, listener: str, how: str) -> None:
    port = live.http_port if listener == "gateway" else live.engine_port
    head, body = chat_request(live, port=None if listener == "gateway" else port, stream=True)
    for _ in range(5):
        sock = hostile.connect("127.0.0.1", port)
        sock.sendall(head + body)
        got = b""
        while b"data:" not in got:  # the head and a first event: the stream is flowing
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        assert hostile.status_of(got) == 200, got
        if how == "rst":
            hostile.reset(sock)
        else:
            sock.close()
    assert_serving(live)


@pytest.mark.parametrize("listener", ["gateway", "engine"])
def test_a_client_gone_before_its_error_answer_is_written(live: Live, listener: str) -> None:
    """The first crash found: half a head, then FIN; the server's 400 hit a closed socket."""
    port = live.http_port if listener == "gateway" else live.engine_port
    for _ in range(30):
        hostile.cut_at("127.0.0.1", port, b"GET /health HTTP/1.1\r\nHo", 24, how="fin")
        hostile.cut_at("127.0.0.1", port, b"NOT HTTP AT ALL\r\n\r\n", 19, how="rst")
        hostile.cut_at("127.0.0.1", port, b"GET / HTTP/1.1\r\n\x00\x01\x02 garbage\r\n\r\n", 33, how="rst")
        oversized, _ = hostile.request_bytes("POST", "/v1/chat/completions", headers=[("x", "y")])
        oversized = oversized.replace(b"content-length: 0", b"content-length: 999999999")
        hostile.cut_at("127.0.0.1", port, oversized, len(oversized), how="rst")
    answer = hostile.cut_at("127.0.0.1", port, b"NOT HTTP AT ALL\r\n\r\n", 19, how="fin")
    assert hostile.status_of(answer) == 400, answer  # a client that stays to read is told why
    assert_serving(live)


def test_garbage_and_cut_handshakes_at_the_agent_port(live: Live) -> None:
    port = live.cluster.port
    tls_hello_start = bytes.fromhex("160301020001") + b"\x00" * 40  # a TLS record header, then nonsense
    for data in (b"GET / HTTP/1.1\r\n\r\n", b"\x00" * 100, tls_hello_start):
        for offset in (1, len(data) // 2, len(data)):
            for how in ("fin", "rst"):
                hostile.cut_at("127.0.0.1", port, data, offset, how=how)
    # A client with a good certificate that sends half a request head and leaves.
    files = live.cluster.nodes_files["node-a"]
    for how in ("fin", "rst"):
        sock = hostile.tls_client(
            "127.0.0.1",
            port,
            ca=str(files.pki / "ca.crt"),
            cert=str(files.pki / "node.crt"),
            key=str(files.pki / "node.key"),
        )
        sock.sendall(b"GET /v1/agent HTTP/1.1\r\nhost: x\r\nupgr")
        if how == "rst":
            hostile.reset(sock)
        else:
            sock.close()
    assert_serving(live)


def test_a_head_or_body_trickled_in_is_cut_at_its_deadline(live: Live) -> None:
    head, body = chat_request(live)
    engine_head, engine_body = chat_request(live, port=live.engine_port)
    results: dict[str, tuple[bytes, float]] = {}
    early = hostile.connect("127.0.0.1", live.http_port)
    early.sendall(head)  # the head at once; the body will come at 4 bytes a second

    jobs = {
        "head": lambda: hostile.trickle("127.0.0.1", live.http_port, head + body, interval_s=0.25, limit_s=30),
        "body": lambda: _trickle_body(early, body),
        # The sim engine keeps llmgw's default head deadline (10 s).
        "engine": lambda: hostile.trickle(
            "127.0.0.1", live.engine_port, engine_head + engine_body, interval_s=0.5, limit_s=30
        ),
    }
    threads = [threading.Thread(target=lambda k=k, job=job: results.__setitem__(k, job())) for k, job in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    answer, took = results["head"]
    assert hostile.status_of(answer) == 408 and b"request head not received within" in answer, answer
    assert HEAD_TIMEOUT_S - 0.5 < took < HEAD_TIMEOUT_S + 2, took
    answer, took = results["body"]
    assert hostile.status_of(answer) == 408 and b"request body not received within" in answer, answer
    assert took < BODY_TIMEOUT_S + 2, took
    answer, took = results["engine"]
    assert hostile.status_of(answer) == 408, answer
    assert 9 < took < 13, took
    wait_until(
        "the workers to count both timeouts",
        lambda: aborted(live, "http", "head_timeout") >= 1 and aborted(live, "http", "body_timeout") >= 1,
        last_seen=lambda: metrics(live),
    )
    assert_serving(live)


def _trickle_body(sock: socket.socket, body: bytes) -> tuple[bytes, float]:
    started = time.monotonic()
    sock.settimeout(0.25)
    answer = b""
    for i in range(len(body)):
        try:
            sock.sendall(body[i : i + 1])
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionError:
            break
        if not chunk:
            break
        answer += chunk
    sock.settimeout(5)
    answer += hostile.read_all(sock)
    sock.close()
    return answer, time.monotonic() - started


def test_json_nested_100000_deep_is_a_400_everywhere(live: Live) -> None:
    deep = hostile.chat_body(MODEL, nested=100_000)
    status, body = request(live.http_port, "POST", "/v1/chat/completions", deep, [live.auth])
    assert status == 400 and b"deeper than 64 levels" in body, body
    admin = (live.cluster.state / "admin.token").read_text().strip()
    status, body = request(
        live.http_port,
        "POST",
        "/admin/v1/keys",
        b"[" * 1000 + b"]" * 1000,
        [("authorization", f"Bearer {admin}")],
    )
    assert status == 400 and b"deeper than 64 levels" in body, body
    status, body = request(  # the admin API's bodies are small: 64 KiB at most
        live.http_port,
        "POST",
        "/admin/v1/keys",
        b"[" * 100_000 + b"]" * 100_000,
        [("authorization", f"Bearer {admin}")],
    )
    assert status == 413 and b"larger than the limit of 65536 bytes" in body, body
    status, body = request(
        live.engine_port, "POST", "/v1/chat/completions", deep, [("authorization", f"Bearer {live.engine_key}")]
    )
    assert status == 400 and b"deeper than 64 levels" in body, body
    assert_serving(live)


def test_two_thousand_idle_connections_while_requests_are_answered(live: Live) -> None:
    socks = hostile.idle("127.0.0.1", live.http_port, IDLE_CONNECTIONS)
    try:
        # While all of them are open (inside their head deadline), the gateway still answers: not
        # once the deadline has cut them (a timed bound tighter than that is the benches' business).
        started = time.monotonic()
        status, _ = request(live.http_port, "GET", "/health")
        assert status == 200 and time.monotonic() - started < HEAD_TIMEOUT_S
        deadline = time.monotonic() + HEAD_TIMEOUT_S
        while (opened := metrics(live)['llmgw_connections_open{listener="http"}']) < IDLE_CONNECTIONS:
            assert time.monotonic() < deadline, opened  # all held at once, within their head deadline
            time.sleep(0.05)
        # ... and the server reclaims them at the head deadline.
        assert all(hostile.closed_by_server(s, HEAD_TIMEOUT_S + 3) for s in socks)
    finally:
        for s in socks:
            s.close()
    assert_serving(live)


def test_idle_connections_to_the_agent_port_leave_agents_connected(live: Live) -> None:
    kinds = ('{listener="agent",reason="unproven"}', '{listener="agent",reason="busy"}')
    sheds = [f"llmgw_connections_shed_total{kind}" for kind in kinds]

    def turned_away(m: dict[str, float]) -> float:
        return sum(m.get(shed, 0.0) for shed in sheds)

    before = turned_away(metrics(live))
    socks = hostile.idle("127.0.0.1", live.cluster.port, 500)
    try:
        nodes = live.cluster.nodes()
        assert nodes is not None and nodes["node-a"]["state"] == "joined"
        # They have shown no certificate: they share the small unproven budget, where a
        # newcomer takes the place of one silent for a second, or is turned away. The server
        # takes them from its backlog as fast as it can (on a loaded machine not at once): wait,
        # bounded, until it has seen them all.
        limit = metrics(live)['llmgw_connections_unproven_limit{listener="agent"}']

        # A shed connection counts until it has closed, a moment later (listeners.Budget), so
        # the count may pass the limit by those closing meanwhile: wait for them too.
        def all_seen() -> dict[str, float] | None:
            m = metrics(live)
            done = turned_away(m) - before >= 500 - limit
            return m if done and m['llmgw_connections_unproven{listener="agent"}'] <= limit else None

        m = wait_until(
            "all 500 seen: those past the unproven limit turned away, the shed ones closed",
            all_seen,
            procs=[live.cluster.server],
            timeout=10,
            last_seen=lambda: metrics(live),
        )
        assert m['llmgw_connections_unproven{listener="agent"}'] <= limit
    finally:
        for s in socks:
            s.close()
    assert_serving(live)


def test_a_mirror_download_that_stops_reading_is_cut(live: Live, tmp_path: Path) -> None:
    archive = live.cluster.state / "artifacts" / "big.tar.gz"
    archive.parent.mkdir(exist_ok=True)
    with archive.open("wb") as f:
        f.truncate(64 << 20)  # more than any socket buffer holds
    sha = __import__("hashlib").sha256(archive.read_bytes()).hexdigest()
    files = live.cluster.nodes_files["node-a"]
    sock = hostile.tls_client(
        "127.0.0.1",
        live.cluster.port,
        ca=str(files.pki / "ca.crt"),
        cert=str(files.pki / "node.crt"),
        key=str(files.pki / "node.key"),
    )
    try:
        sock.sendall(f"GET /v1/artifacts/{sha} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        assert hostile.status_of(sock.recv(4096)) == 200
        before = aborted(live, "agent", "send_timeout")
        wait_until(  # we read nothing more
            "the download cut at its send timeout",
            lambda: aborted(live, "agent", "send_timeout") > before,
            procs=[live.cluster.server],
            timeout=SEND_TIMEOUT_S + 10,
            last_seen=lambda: metrics(live),
        )
    finally:
        sock.close()
        archive.unlink()
    assert_serving(live)


def _release_get(live: Live, target: str) -> ssl.SSLSocket:
    """A peer with no certificate (a node fetching its release) asking the agent port for `target`."""
    sock = hostile.tls_client("127.0.0.1", live.cluster.port, ca=str(live.cluster.state / "ca" / "ca.crt"))
    sock.sendall(f"GET {target} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    return sock


def test_release_downloads_by_peers_without_a_certificate_are_bounded(live: Live) -> None:
    ca = str(live.cluster.state / "ca" / "ca.crt")
    # Half a head, then gone; names that would leave the directory; what needs a certificate.
    for how in ("fin", "rst"):
        sock = hostile.tls_client("127.0.0.1", live.cluster.port, ca=ca)
        sock.sendall(b"GET /v1/release/SHA2")
        if how == "rst":
            hostile.reset(sock)
        else:
            sock.close()
    for target, status in (
        ("/v1/release/../../../etc/passwd", 404),
        ("/v1/release/%2e%2e%2fca%2fca.key", 404),
        (f"/v1/release/{RELEASE_FILE}/../../ca/ca.key", 404),
        ("/v1/artifacts/" + "0" * 64, 403),
        ("/v1/agent", 403),
        ("/v1/release/SHA256SUMS", 200),
    ):
        sock = _release_get(live, target)
        try:
            answer = sock.recv(4096)
        finally:
            sock.close()
        assert hostile.status_of(answer) == status, (target, answer)
        assert b"PRIVATE KEY" not in answer
    # As many downloads as are sent at once, none of them reading: the next is told 503; each is cut
    # at the send deadline, and a download then goes through again.
    before = aborted(live, "agent", "send_timeout")
    stalled = [_release_get(live, f"/v1/release/{RELEASE_FILE}") for _ in range(8)]  # releases.MAX_DOWNLOADS
    try:
        for sock in stalled:
            assert hostile.status_of(sock.recv(4096)) == 200
        sock = _release_get(live, f"/v1/release/{RELEASE_FILE}")
        try:
            assert hostile.status_of(sock.recv(4096)) == 503
        finally:
            sock.close()
        wait_until(
            "every stalled download cut at its send timeout",
            lambda: aborted(live, "agent", "send_timeout") >= before + len(stalled),
            procs=[live.cluster.server],
            timeout=SEND_TIMEOUT_S + 15,
            last_seen=lambda: metrics(live),
        )
    finally:
        for sock in stalled:
            sock.close()
    sock = _release_get(live, f"/v1/release/{RELEASE_FILE}")
    try:
        assert hostile.status_of(sock.recv(4096)) == 200
    finally:
        sock.close()
    assert_serving(live)


def _head(port: int, path: str, headers=()) -> tuple[int, dict[str, str], bytes]:
    """HEAD twice on one connection: the status and headers of the first, and what came after
    the second answer's head (nothing, if no body was sent)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("HEAD", path, headers=dict(headers))
        first = conn.getresponse()
        assert first.read() == b""
        conn.request("HEAD", path, headers=dict(headers))  # the connection is still in step
        second = conn.getresponse()
        assert second.status == first.status and second.read() == b""
        return first.status, {k.lower(): v for k, v in first.getheaders()}, b""
    finally:
        conn.close()


def test_head_is_answered_on_every_route(live: Live) -> None:
    admin = (live.cluster.state / "admin.token").read_text().strip()
    engine = [("authorization", f"Bearer {live.engine_key}")]
    cases = [
        (live.http_port, "/health", (), 200),
        (live.http_port, "/metrics", (), 200),
        (live.http_port, "/v1/models", [live.auth], 200),
        (live.http_port, "/v1/models", (), 401),
        (live.http_port, "/v1/chat/completions", [live.auth], 405),
        (live.http_port, "/admin/v1/nodes", [("authorization", f"Bearer {admin}")], 200),
        (live.http_port, "/admin/v1/keys", [("authorization", f"Bearer {admin}")], 200),
        (live.http_port, "/admin/v1/nodes", (), 401),
        (live.http_port, "/", (), 200),  # the cluster page
        (live.http_port, "/no/such/route", (), 404),
        (live.engine_port, "/health", (), 200),
        (live.engine_port, "/v1/models", engine, 200),
        (live.engine_port, "/v1/completions", engine, 405),
        (live.engine_port, "/nothing", (), 404),
    ]
    for port, path, headers, status in cases:
        got, answer_headers, _ = _head(port, path, headers)
        assert got == status, (port, path, got)
        if status == 200:
            assert int(answer_headers.get("content-length", "0")) > 0 or "transfer-encoding" in answer_headers
    log = live.cluster.server.log_path.read_text(errors="replace")
    assert "http_connection_failed" not in log and "http_handler_failed" not in log
    assert_serving(live)


def test_content_length_with_transfer_encoding_is_refused_and_closed(live: Live) -> None:
    smuggle = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n"
        + f"authorization: Bearer {live.token}\r\n".encode()
        + b"content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /health HTTP/1.1\r\nhost: t\r\n\r\n"
    )
    for port in (live.http_port, live.engine_port):
        sock = hostile.connect("127.0.0.1", port)
        try:
            sock.sendall(smuggle)
            answer = hostile.read_all(sock)
        finally:
            sock.close()
        assert hostile.status_of(answer) == 400 and b"both Content-Length and Transfer-Encoding" in answer
        assert answer.count(b"HTTP/1.1 ") == 1 and b"connection: close" in answer  # nothing after it was read


def _mirror_get(live: Live, target: str, range_header: str) -> bytes:
    """A node (its certificate) asking the mirror for `target` with `Range: range_header`."""
    files = live.cluster.nodes_files["node-a"]
    sock = hostile.tls_client(
        "127.0.0.1",
        live.cluster.port,
        ca=str(files.pki / "ca.crt"),
        cert=str(files.pki / "node.crt"),
        key=str(files.pki / "node.key"),
    )
    try:
        sock.sendall(f"GET {target} HTTP/1.1\r\nhost: x\r\nrange: {range_header}\r\n\r\n".encode())
        return hostile.read_all(sock)
    finally:
        sock.close()


def test_inputs_once_answered_500_are_refused_saying_what_is_accepted(live: Live) -> None:
    """What a hostile tester found answering 500, or dropping the connection with a traceback:
    an API key's limit past SQLite's integers, `lines` as '²' or 5,000 digits, a mirror `Range`
    of 5,000 digits from a node. Each is refused now, saying what is accepted, and the server
    logs no traceback (`assert_serving`)."""
    admin = ("authorization", f"Bearer {(live.cluster.state / 'admin.token').read_text().strip()}")
    body = json.dumps({"name": "x", "rate_per_minute": 18446744073709551616}).encode()
    status, answer = request(
        live.http_port, "POST", "/admin/v1/keys", body, [admin, ("content-type", "application/json")]
    )
    assert status == 400 and b"rate_per_minute must be a whole number from 0 (no limit) to 1000000000" in answer, answer
    [replica] = [r["replica"] for r in live.cluster.replicas()]
    for lines in ("%C2%B2", "9" * 5000, "0"):
        status, answer = request(
            live.http_port, "GET", f"/admin/v1/replicas/{replica}/logs?lines={lines}", headers=[admin]
        )
        assert status == 400 and b"lines must be a whole number from 1 to 10000" in answer and len(answer) < 400, answer
    status, answer = request(live.http_port, "GET", f"/admin/v1/replicas/{replica}/logs?lines=5", headers=[admin])
    assert status == 200 and json.loads(answer)["replica"] == replica, answer

    archive = live.cluster.state / "artifacts" / "range.tar.gz"
    archive.parent.mkdir(exist_ok=True)
    data = bytes(range(256)) * 64
    archive.write_bytes(data)
    target = f"/v1/artifacts/{hashlib.sha256(data).hexdigest()}"
    try:
        answer = _mirror_get(live, target, "bytes=" + "9" * 5000 + "-")
        assert hostile.status_of(answer) == 416 and f"content-range: bytes */{len(data)}".encode() in answer, answer
        answer = _mirror_get(live, target, "bytes=16000-")
        assert hostile.status_of(answer) == 206 and answer.endswith(data[16000:]), answer[:300]
        answer = _mirror_get(live, target, "bytes=\xb2-")  # not a range of ours: ignored, the whole file
        assert hostile.status_of(answer) == 200 and answer.endswith(data), answer[:300]
    finally:
        archive.unlink()
    ca = str(live.cluster.state / "ca" / "ca.crt")
    sock = hostile.tls_client("127.0.0.1", live.cluster.port, ca=ca)  # no certificate: the release route
    try:
        sock.sendall(
            f"GET /v1/release/{RELEASE_FILE} HTTP/1.1\r\nhost: x\r\nrange: bytes={'9' * 5000}-\r\n\r\n".encode()
        )
        assert hostile.status_of(sock.recv(4096)) == 200  # Range is ignored there
    finally:
        sock.close()
    assert_serving(live)
