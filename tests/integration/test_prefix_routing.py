"""Prefix routing across gateway processes: two `llmgw gateway` processes of two workers each
(SO_REUSEPORT), their tables from files (no control plane), in front of three real sim engines.
A conversation whose turns reach different gateways and workers, none sharing anything, is
answered by one replica throughout; conversations spread over the replicas; the answers and
/metrics say how each replica was chosen."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.wire.gateway_link import ModelInfo
from testlib.cluster import free_port, wait_until
from testlib.gateway import Sim, parse_metrics, request
from testlib.gatewaytable import TOKEN, write_table_file
from testlib.proc import Proc

SYSTEM = "You answer questions about rivers, briefly and in plain words. " * 20  # 1,280 bytes


@pytest.fixture
def engines() -> Iterator[list[Sim]]:
    sims = [Sim(f"chat-{i}") for i in range(3)]
    try:
        for s in sims:
            s.wait_serving()
        yield sims
    finally:
        for s in sims:
            s.stop()


def gateway(tmp_path: Path, name: str, engines: list[Sim]) -> tuple[Proc, int]:
    table = write_table_file(
        tmp_path / f"{name}.json", engines, details=(ModelInfo(name="chat", engine="sim", routing="prefix"),)
    )
    port = free_port()
    args = ["--log-format", "json", "gateway", "--table-file", str(table), "--listen", f"127.0.0.1:{port}"]
    gw = Proc(f"gateway-{name}", [*args, "--workers", "2"], tmp_path / f"{name}.log")
    wait_until("gateway ready", lambda: gw.events("gateway_ready"), alive=[gw], timeout=60)
    return gw, port


def test_a_conversation_keeps_its_replica_whichever_gateway_and_worker_takes_each_turn(
    tmp_path: Path, engines: list[Sim]
) -> None:
    gws = [gateway(tmp_path, "a", engines), gateway(tmp_path, "b", engines)]
    try:
        ports = [port for _, port in gws]
        replica_of: dict[int, set[str]] = {}
        routes: Counter[str] = Counter()
        for turn in range(4):
            for n in range(12):
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Where is river {n}?"}]
                for t in range(turn):
                    messages += [
                        {"role": "assistant", "content": f"River {n} runs east, turn {t}. " * 8},
                        {"role": "user", "content": f"And after turn {t}?"},
                    ]
                body = {"model": "chat", "messages": messages, "max_tokens": 4}
                # Each turn through the other gateway than the last, on a fresh connection (either worker).
                status, headers, answer = request(
                    ports[(n + turn) % 2], "POST", "/v1/chat/completions", body, token=TOKEN
                )
                assert status == 200, answer
                replica_of.setdefault(n, set()).add(headers["x-llmgw-replica"])
                route = headers["x-llmgw-route"]
                policy, matched, reason = route.split(";")
                assert policy == "prefix" and matched.startswith("matched=") and reason in ("hit", "hash"), route
                assert turn == 0 or reason == "hash" or int(matched.removeprefix("matched=")) > len(SYSTEM)
                routes[reason] += 1
        assert all(len(replicas) == 1 for replicas in replica_of.values()), replica_of
        assert len({r for replicas in replica_of.values() for r in replicas}) >= 2  # spread by rank
        assert routes["hit"] > 0  # some turns reached a worker that served the conversation before
        seen = Counter()
        for port in ports:
            for _ in range(8):  # a fresh connection each: both workers' series, one at a time
                status, _, text = request(port, "GET", "/metrics")
                assert status == 200
                for (name, labels), value in parse_metrics(text.decode()).items():
                    if name == "llmgw_gateway_routes_total":
                        seen[dict(labels)["route"]] = max(seen[dict(labels)["route"]], value)
        assert set(seen) <= {"prefix_hit", "prefix_hash"} and seen["prefix_hash"] > 0, seen
    finally:
        for gw, _ in gws:
            gw.stop(signal.SIGTERM)


@pytest.mark.trio
async def test_a_drain_moves_conversations_without_a_failure_and_they_stay_where_they_moved(
    tmp_path: Path, engines: list[Sim], nursery
) -> None:
    """One gateway in front of the three sims, routing by prefix; twelve conversations take
    turns, one at a time but for the round during which one replica begins to drain (as a
    rolling move marks it, still in rotation), all twelve at once. Every request is answered;
    after the drain none goes to the draining one, and every conversation keeps the replica it
    is on (a round of all twelve at once may spill some: the load bound)."""
    import trio

    from testlib.gateway import start_gateway

    eps = tuple(s.endpoint() for s in engines)
    gw = await start_gateway(nursery, tmp_path, eps)
    gw.provider.set(eps, None, (ModelInfo(name="chat", engine="sim", routing="prefix"),))
    replica_of: dict[int, list[str]] = {}
    statuses: Counter[int] = Counter()

    async def talk(n: int, turn: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Where is river {n}?"}]
        for t in range(turn):
            messages += [
                {"role": "assistant", "content": f"River {n} runs east, turn {t}. " * 8},
                {"role": "user", "content": f"And after turn {t}?"},
            ]
        status, headers, _ = await gw.call("POST", "/v1/chat/completions", {"model": "chat", "messages": messages})
        statuses[status] += 1
        replica_of.setdefault(n, []).append(headers.get("x-llmgw-replica", "?"))

    async def round_(turn: int, at_once: bool = False) -> None:
        async with trio.open_nursery() as group:
            for n in range(12):
                if at_once:
                    group.start_soon(talk, n, turn)
                else:
                    await talk(n, turn)

    await round_(0)
    await round_(1)
    drained = max({r[-1] for r in replica_of.values()}, key=lambda r: sum(v[-1] == r for v in replica_of.values()))
    moved = [n for n, r in replica_of.items() if r[-1] == drained]
    # The drain begins while a round is in flight.
    async with trio.open_nursery() as group:
        group.start_soon(round_, 2, True)
        await trio.sleep(0)
        gw.provider.set(
            tuple(s.endpoint(draining=s.name == drained) for s in engines),
            None,
            (ModelInfo(name="chat", engine="sim", routing="prefix"),),
        )
    await round_(3)
    await round_(4)
    assert statuses == Counter({200: 12 * 5})
    assert moved and all(drained not in r[3:] for r in replica_of.values())
    assert all(r[0] == r[1] and r[3] == r[4] for r in replica_of.values()), replica_of
