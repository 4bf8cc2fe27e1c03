"""A silent replica costs a request little: real sim engines behind the gateway, one of them
behind a link that is cut (a network namespace whose side goes down: packets vanish, nothing
answers, as when a node's cable dies), or a process stopped with SIGSTOP (its kernel still
accepts connections and data; nothing answers them).

Each test asserts a bound the old behaviour breaks: connecting waited 5 s, and a request written
onto a pooled connection to a cut node waited for its answer up to the 600 s read timeout, and
a replica that failed came back after a fixed 5 s whether or not it could be reached."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from llmgw.gateway.errors import UpstreamSilent
from llmgw.gateway.upstream import UpstreamPool
from testlib.gateway import GW, Sim, chat, parse_metrics, start_gateway
from testlib.netns import NetNS, preflight
from testlib.waiting import await_true

pytestmark = pytest.mark.trio


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[Sim]:
    """A sim engine on the far side of a link the test can cut (its own network namespace)."""
    why = preflight()
    if why:
        pytest.fail(why)  # not a skip: `./pants test` provides iproute2; root is the runner's to give
    with NetNS() as ns:
        sim = Sim("chat-remote", "chat", netns=ns)
        try:
            sim.wait_serving()
            yield sim
        finally:
            sim.stop()


def metric(gw: GW, name: str, **labels: str) -> float:
    return parse_metrics(gw.gateway.render_metrics()).get((name, frozenset(labels.items())), 0.0)


def unread(sim: Sim) -> int:
    """The bytes received by `sim`'s kernel that no process has read yet (a stopped engine's)."""
    assert sim.netns is not None
    out = sim.netns.run("ss", "-tnH", "state", "established", f"( sport = :{sim.port} )")
    return sum(int(line.split()[0]) for line in out.splitlines() if line.strip())


async def call(gw: GW, i: int, timeout: float = 10.0) -> tuple[float, int, str]:
    """(latency, status, replica) of one chat request; a client timeout is status 0."""
    started = trio.current_time()
    try:
        status, headers, _ = await gw.call("POST", "/v1/chat/completions", chat(f"q{i}"), timeout=timeout)
    except OSError:
        status, headers = 0, {}
    return trio.current_time() - started, status, headers.get("x-llmgw-replica", "")


async def test_a_request_on_a_pooled_connection_to_a_cut_node_fails_within_about_the_connect_timeout(
    remote: Sim,
) -> None:
    pool = UpstreamPool(connect_timeout_s=1.0, first_byte_timeout_s=30.0)  # the kernel must catch it, not a timer
    headers = [(b"authorization", f"Bearer {remote.key}".encode()), (b"content-type", b"application/json")]
    body = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'

    async def send():
        response = await pool.send(remote.host, remote.port, "POST", "/v1/chat/completions", headers, body)
        await response.read(1 << 20)
        await response.aclose()
        return response.status

    assert await send() == 200 and pool.idle_count(remote.host, remote.port) == 1
    await trio.to_thread.run_sync(remote.netns.cut)
    started = trio.current_time()
    with pytest.raises(UpstreamSilent, match="failed before answering: Connection timed out"):
        await send()  # written onto the pooled connection: the local kernel takes it, nothing comes back
    took = trio.current_time() - started
    # TCP_USER_TIMEOUT = the connect timeout; retransmissions at 0.2, 0.6 and 1.4 s: the 1.4 s one fails.
    assert took < 2.5, took
    assert pool.stats.reused == 1 and pool.stats.opened == 1  # silence: no second try on a fresh connection

    # A request already taken, waiting for its answer when the link goes: keepalive finds the silence.
    await trio.to_thread.run_sync(remote.netns.restore)
    slow = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
    async with trio.open_nursery() as nursery:
        failed: list[tuple[float, BaseException]] = []

        async def waiting() -> None:
            t = trio.current_time()
            try:
                r = await pool.send(remote.host, remote.port, "POST", "/v1/chat/completions", headers, slow)
                await r.aclose()
            except UpstreamSilent as exc:
                failed.append((trio.current_time() - t, exc))

        # An engine slow to answer: stopped (its kernel still acknowledges the request), then cut.
        os.kill(remote.proc.pid, signal.SIGSTOP)
        try:
            nursery.start_soon(waiting)
            # The request is written and acknowledged by the stopped engine's kernel: in its socket.
            await await_true(lambda: unread(remote) >= len(slow), "the request in the stopped engine's socket")
            await trio.to_thread.run_sync(remote.netns.cut)
            cut_at = trio.current_time()
        finally:
            os.kill(remote.proc.pid, signal.SIGCONT)
    [(took, exc)] = failed
    assert "Connection timed out" in str(exc)
    # Keepalive: idle 1 s, then a probe each second; the first unanswered one past TCP_USER_TIMEOUT
    # ends it (measured 1.5 s after the cut), long before the 30 s first-byte timeout.
    assert took < 3.0 and trio.current_time() - cut_at < 2.5


async def test_a_node_cut_off_under_steady_load_costs_no_request_and_serves_again_once_restored(
    tmp_path: Path, nursery: trio.Nursery, sims, remote: Sim
) -> None:
    (local,) = sims(1)
    gw = await start_gateway(nursery, tmp_path, (local.endpoint(), remote.endpoint()))  # default timeouts
    served = set()
    for i in range(40):  # both warm: pooled connections to each (ties between them go at random)
        _, status, replica = await call(gw, i)
        assert status == 200
        served.add(replica)
        if i >= 9 and len(served) == 2:
            break
    assert len(served) == 2, served
    # The gateway pools a connection once it has written the answer: the client may have it first.
    await await_true(
        lambda: gw.gateway.pool.idle_count(remote.host, remote.port) >= 1, "a pooled connection", timeout=5
    )

    rate, total, cut_at_n, restore_at_n = 10, 80, 20, 60  # 10 req/s for 8 s: cut at 2 s, restore at 6 s
    answers: list[tuple[float, float, int, str]] = []  # (sent at, latency, status, replica)
    marks: dict[str, float] = {}
    during_cut: dict = {}

    async def one(i: int) -> None:
        sent = trio.current_time()
        answers.append((sent, *await call(gw, i)))

    failed_probe = ("llmgw_gateway_probes_total", frozenset({("result", "failed")}))
    with trio.fail_after(40):
        async with trio.open_nursery() as load:
            for i in range(total):
                if i == cut_at_n:
                    await trio.to_thread.run_sync(remote.netns.cut)
                    marks["cut"] = trio.current_time()
                if i == restore_at_n:
                    # A probe fails at the 1 s connect timeout, begun a second after the replica
                    # went down: on a loaded machine that can come after the 60th request.
                    await await_true(
                        lambda: failed_probe in parse_metrics(gw.gateway.render_metrics()),
                        "a failed probe of the cut replica",
                        timeout=10,
                        poll_s=0.1,
                    )
                    during_cut.update(parse_metrics(gw.gateway.render_metrics()))
                    marks["down"] = gw.gateway.router.state_of(remote.endpoint()) == "down"
                    await trio.to_thread.run_sync(remote.netns.restore)
                    marks["restored"] = trio.current_time()
                load.start_soon(one, i)
                await trio.sleep(1 / rate)  # the load's pace: steady, whatever the answers do

    assert len(answers) == total and [a for a in answers if a[2] != 200] == []
    worst = max(latency for _, latency, _, _ in answers)
    # Connect timeout 1 s, silence on a pooled connection ~1.4 s, then the other replica: well
    # under the old 5 s connect timeout (and the 600 s wait on a pooled connection).
    assert worst < 3.0, sorted(latency for _, latency, _, _ in answers)[-5:]
    # Out of rotation while cut: the requests sent from 2 s after the cut to the restore went to
    # the local replica only, and the gauge said so.
    settled = [r for sent, _, _, r in answers if marks["cut"] + 2.0 < sent < marks["restored"]]
    assert len(settled) >= 15 and set(settled) == {local.name}
    assert marks["down"]
    down = frozenset({("model", "chat"), ("replica", remote.name), ("state", "down")})
    assert during_cut[("llmgw_gateway_replica_state", down)] == 1
    # Down ~1.4 s after the cut; probes each second from then, each failing at the 1 s connect timeout.
    assert during_cut[("llmgw_gateway_probes_total", frozenset({("result", "failed")}))] >= 1

    # Restored: a probe puts it back within about an interval, and it serves again.
    back = lambda: gw.gateway.router.state_of(remote.endpoint()) == "ready"  # noqa: E731
    await await_true(back, "back in rotation", changed=gw.gateway.freed.next, timeout=5)  # a probe reached it
    assert trio.current_time() - marks["restored"] < 3.0
    served = {(await call(gw, 1000 + i))[2] for i in range(20)}
    assert served == {local.name, remote.name}
    assert metric(gw, "llmgw_gateway_probes_total", result="reached") >= 1
    assert metric(gw, "llmgw_gateway_replica_down_total", model="chat", reason="connect") == 1


async def test_an_engine_that_takes_requests_and_never_answers_leaves_rotation_after_the_first_byte_timeout(
    tmp_path: Path, nursery: trio.Nursery, sims
) -> None:
    stopped, live = sims(2)
    gw = await start_gateway(
        nursery, tmp_path, (stopped.endpoint(), live.endpoint()), first_byte_timeout_s=1.0, probe_timeout_s=0.5
    )
    for i in range(6):
        assert (await call(gw, i))[1] == 200
    os.kill(stopped.proc.pid, signal.SIGSTOP)
    try:
        answers = []
        with trio.fail_after(30):
            async with trio.open_nursery() as clients:
                for c in range(4):  # 4 clients x 5 requests: someone meets the stopped engine first

                    async def client(c: int = c) -> None:
                        for i in range(5):
                            answers.append(await call(gw, 100 * c + i))

                    clients.start_soon(client)
        assert len(answers) == 20 and {status for _, status, _ in answers} == {200}
        assert {replica for _, _, replica in answers} == {live.name}
        worst = max(latency for latency, _, _ in answers)
        # First-byte timeout 1 s + a probe that gets no answer in 0.5 s, then the live engine.
        assert 1.0 <= worst < 2.5, worst
        assert gw.gateway.router.down[stopped.name].reason == "first_byte"
        assert metric(gw, "llmgw_gateway_replica_down_total", model="chat", reason="first_byte") == 1
        # Its kernel still completes TCP connects: only the probe's HTTP answer tells it is not back.
        # Two more probes (what would bring it back, were connects enough) find it still down.
        failed = metric(gw, "llmgw_gateway_probes_total", result="failed")
        await await_true(
            lambda: metric(gw, "llmgw_gateway_probes_total", result="failed") >= failed + 2, "two more probes"
        )
        assert gw.gateway.router.state_of(stopped.endpoint()) == "down"
        assert metric(gw, "llmgw_gateway_probes_total", result="reached") == 0
    finally:
        os.kill(stopped.proc.pid, signal.SIGCONT)
    back = lambda: gw.gateway.router.state_of(stopped.endpoint()) == "ready"  # noqa: E731
    await await_true(back, "back in rotation", changed=gw.gateway.freed.next, timeout=5)  # a probe reached it
    assert stopped.name in {(await call(gw, 1000 + i))[2] for i in range(20)}


async def test_a_slow_answer_is_not_silence_the_engine_answers_probes_while_it_works(
    tmp_path: Path, nursery: trio.Nursery, sims
) -> None:
    (slow,) = sims(1, "--output-token-ms", "100")
    gw = await start_gateway(nursery, tmp_path, (slow.endpoint(),), first_byte_timeout_s=0.5)
    started = trio.current_time()
    status, headers, _ = await gw.call(
        "POST", "/v1/chat/completions", chat(max_tokens=25, ignore_eos=True), timeout=20
    )  # non-streamed: the head comes after 2.5 s of tokens, five first-byte timeouts later
    assert status == 200 and headers["x-llmgw-replica"] == slow.name
    assert trio.current_time() - started >= 2.5
    assert metric(gw, "llmgw_gateway_replica_down_total", model="chat", reason="first_byte") == 0
    assert gw.gateway.router.down == {}
    assert (
        sum(v for (n, _), v in parse_metrics(gw.gateway.render_metrics()).items() if n.endswith("retries_total")) == 0
    )
