"""The faults of `tools/bench/chaos.py` that come through the front door, as a client would send
them: hostile clients against both ports (`hostile_clients`), a key holder's bodies built to be
slow to parse (`adversarial_bodies`), and a flood of idle connections past both listeners' caps
while an agent rejoins (`connection_flood`). Each is sent while the bench's steady load runs and
returns what it saw; the other faults, which kill or cut the cluster's processes, and the
measure of what each cost, are `chaos.py`'s.
"""

from __future__ import annotations

import threading
import time

from bench.chaos_cluster import ChaosCluster, poll

from testlib import bodies, hostile

BODY_SIZE = 8 << 20  # the adversarial bodies', at the default body limit
# The listeners' caps the bench gives the server (`chaos.catalog`): low enough for the connection
# flood to pass threefold (the load itself holds a few dozen), raised for a load of many streams
# (`http_cap`: each holds a connection, and a load past the cap would be turned away).
HTTP_CAP = 256
AGENT_CAP = 64
AGENT_UNPROVEN = 8  # the agent port's unproven budget: an eighth of AGENT_CAP
FLOOD_HOLD_S = 10.0


def http_cap(streams: int) -> int:
    """The HTTP listener's cap for a load of `streams` streams: HTTP_CAP, or twice the streams."""
    return max(HTTP_CAP, 2 * streams)


def hostile_clients(cluster: ChaosCluster, model: str) -> dict:
    """FIN and RST at every offset of a request, garbage on both ports, JSON 100,000 deep,
    slowloris and 1,000 idle connections, against the gateway and the agent port."""
    port, agent_port = cluster.http_port, cluster.agent_port
    head, body = hostile.request_bytes(
        "POST", "/v1/chat/completions", body=hostile.chat_body(model), headers=[("authorization", "Bearer x")]
    )
    done = {"connections": 0}

    def cuts() -> None:
        for offset in hostile.offsets(head, body):
            for how in ("fin", "rst"):
                hostile.cut_at("127.0.0.1", port, head + body, offset, how=how)
                done["connections"] += 1
        for _ in range(50):
            hostile.cut_at("127.0.0.1", port, b"NOT HTTP\r\n\r\n", 12, how="rst")
            hostile.cut_at("127.0.0.1", agent_port, b"\x16\x03\x01\x02\x00garbage", 10, how="fin")
            done["connections"] += 2
        deep = hostile.chat_body(model, nested=100_000)
        for _ in range(5):
            sock = hostile.connect("127.0.0.1", port)
            req_head, req_body = hostile.request_bytes("POST", "/v1/chat/completions", body=deep)
            sock.sendall(req_head + req_body)
            hostile.read_all(sock, 4096)
            sock.close()
            done["connections"] += 1

    def slow() -> None:
        hostile.trickle("127.0.0.1", port, head + body, interval_s=0.5, limit_s=15)

    threads = [threading.Thread(target=cuts)] + [threading.Thread(target=slow) for _ in range(10)]
    for t in threads:
        t.start()
    idle = hostile.idle("127.0.0.1", port, 1000)
    for t in threads:
        t.join(60)
    for s in idle:
        s.close()
    done["connections"] += 1010
    return {"hostile_connections": done["connections"], "_lasting": True}


def adversarial_bodies(cluster: ChaosCluster, token: str, model: str) -> dict:
    """The bodies built to be slow to parse (`testlib.bodies`, at BODY_SIZE), sent with `token`
    while `/health` is timed every 50 ms."""
    port = cluster.http_port
    statuses: dict[str, int] = {}
    slowest = [0.0]
    stop = threading.Event()

    def health() -> None:
        while not stop.wait(0.05):
            started = time.monotonic()
            sock = hostile.connect("127.0.0.1", port)
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: chaos\r\nconnection: close\r\n\r\n")
                hostile.read_all(sock, 65536)
            finally:
                sock.close()
            slowest[0] = max(slowest[0], time.monotonic() - started)

    watcher = threading.Thread(target=health)
    watcher.start()
    try:
        for name, make in bodies.adversarial(model, BODY_SIZE).items():
            head, body = hostile.request_bytes(
                "POST",
                "/v1/chat/completions",
                body=make(),
                headers=[("authorization", f"Bearer {token}")],
            )
            # Parsed in the gateway's JSON worker, then again in the engine's: seconds, each.
            sock = hostile.connect("127.0.0.1", port, timeout=120)
            try:
                sock.sendall(head + body)
                statuses[name] = hostile.status_of(hostile.read_all(sock, 65536))
            finally:
                sock.close()
    finally:
        stop.set()
        watcher.join(30)
    return {"bodies": statuses, "health_slowest_s": round(slowest[0], 3), "_lasting": True}


def connection_flood(cluster: ChaosCluster, spare: str, *, rejoin_timeout_s: float, cap: int = HTTP_CAP) -> dict:
    """Three times the HTTP listener's cap (`cap`) of idle connections and three times the agent port's
    unproven budget of bare ones, held FLOOD_HOLD_S, while the agent of `spare` (a node with no
    replica) is restarted: a fresh /health must be answered and the agent must rejoin."""
    port, agent_port = cluster.http_port, cluster.agent_port
    held = hostile.idle("127.0.0.1", port, 3 * cap) + hostile.idle("127.0.0.1", agent_port, 3 * AGENT_UNPROVEN)
    try:
        started = time.monotonic()
        sock = hostile.connect("127.0.0.1", port, timeout=30)
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: chaos\r\nconnection: close\r\n\r\n")
            health_status = hostile.status_of(hostile.read_all(sock, 65536))
        finally:
            sock.close()
        health_s = time.monotonic() - started
        cluster.kill_agent(spare)
        cluster.start_agent(spare)
        restarted = time.monotonic()
        rejoined = poll(
            "rejoin during the flood",
            lambda: any(n["id"] == spare and n["connected"] and n["state"] == "joined" for n in cluster.nodes()),
            rejoin_timeout_s,
        )
        rejoin_s = time.monotonic() - restarted if rejoined else None
        time.sleep(max(0.0, FLOOD_HOLD_S - (time.monotonic() - started)))
    finally:
        for s in held:
            s.close()
    return {
        "held_connections": len(held),
        "fresh_health_status": health_status,
        "fresh_health_s": round(health_s, 3),
        "spare_agent_rejoin_s": round(rejoin_s, 2) if rejoin_s is not None else None,
        "_lasting": True,
    }
