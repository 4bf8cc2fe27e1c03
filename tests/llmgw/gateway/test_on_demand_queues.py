"""Models on demand, the gateway's side: a request for a model with no replica is held in its
model's queue (bounded by the model's own `max_queue` and `queue_timeout_s`, else the
gateway's), reported at once to the control plane (`Gateway.cold`, the first of a queue), counted
in the model's load (`Gateway.model_loads`, what the heartbeats carry), answered as soon as a
replica is in rotation, and refused at once when the control plane says none can come. Sim
engines in memory on MockClock (`testlib.memnet`); `Queues` alone, with no gateway."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.gateway.queues import Queues
from llmgw.wire import gateway_link as g
from testlib import memnet
from testlib.gateway import chat

pytestmark = pytest.mark.trio

CHAT = frozenset({"chat"})


def info(name: str = "chat", **kw) -> g.ModelInfo:
    return g.ModelInfo(name=name, engine="sim", routes=(g.CHAT, g.COMPLETIONS), on_demand=True, **kw)


class Calls:
    """Requests to the gateway made in a nursery, their answers in the order they came."""

    def __init__(self, gw: memnet.MemGateway, nursery: trio.Nursery) -> None:
        self.gw, self.nursery = gw, nursery
        self.answers: list[tuple[int, dict[str, str], bytes]] = []
        self.at: list[float] = []

    def start(self, body: dict | None = None) -> None:
        async def call() -> None:
            self.answers.append(await self.gw.call("POST", "/v1/chat/completions", body or chat()))
            self.at.append(trio.current_time())

        self.nursery.start_soon(call)


def load(gw: memnet.MemGateway, model: str = "chat") -> tuple[int, int, int, float] | None:
    """(queued, in_flight, requests_total, oldest_wait_s) of `model`, None if it is not listed."""
    for m in gw.gateway.model_loads():
        if m.model == model:
            return m.queued, m.in_flight, m.requests_total, m.oldest_wait_s
    return None


def error_of(answer: tuple[int, dict[str, str], bytes]) -> dict:
    status, headers, body = answer
    err = json.loads(body)["error"]
    assert status == 503 and err["type"] == "server_error" and headers["x-request-id"], answer
    return err


async def test_a_requests_load_queued_then_in_flight_then_done(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1, output_token_ms=1000)
    gw = await memnet.start_gateway(
        nursery, tmp_path, net, (), models=frozenset({"chat", "idle"}), details=(info(),), queue_timeout_s=60
    )
    assert gw.gateway.model_loads() == ()  # nothing taken yet
    async with trio.open_nursery() as inner:
        calls = Calls(gw, inner)
        calls.start(chat(max_tokens=3))
        await trio.testing.wait_all_tasks_blocked()
        assert load(gw) == (1, 0, 1, 0.0)
        await trio.sleep(2.5)
        calls.start(chat(max_tokens=3))
        await trio.sleep(0.5)
        assert load(gw) == (2, 0, 2, 3.0)  # the oldest's wait, not the newest's
        gw.provider.set((a.endpoint(),), None, (info(),))  # its replica is ready
        await trio.sleep(1.5)  # each answer takes three tokens a second apart
        assert load(gw) == (0, 2, 2, 0.0)
    assert [answer[0] for answer in calls.answers] == [200, 200]
    assert gw.gateway.model_loads() == (g.ModelLoad(model="chat", requests_total=2),)  # "idle": never asked for

    # A request refused on its way is taken all the same (the control plane scales by demand); one
    # for a model that does not exist, or that the key may not use, is not.
    gw.provider.set((), CHAT, (info(unservable="no node has the memory"),))
    await trio.testing.wait_all_tasks_blocked()
    assert (await gw.call("POST", "/v1/chat/completions", chat()))[0] == 503
    assert (await gw.call("POST", "/v1/chat/completions", {**chat(), "model": "nope"}))[0] == 404
    _, narrow = await gw.keys.create("narrow", models=["embed"])
    assert (await gw.call("POST", "/v1/chat/completions", chat(), token=narrow))[0] == 403
    assert gw.gateway.model_loads() == (g.ModelLoad(model="chat", requests_total=3),)


async def test_the_first_request_held_for_a_model_with_no_replica_is_reported_at_once(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    (slow,) = memnet.start_sims(net, 1, first=1, output_token_ms=1000)
    gw = await memnet.start_gateway(
        nursery, tmp_path, net, (), models=CHAT, details=(info(),), queue_timeout_s=60, max_outstanding_per_replica=1
    )
    cold = gw.gateway.cold
    before = cold.next()
    async with trio.open_nursery() as inner:
        calls = Calls(gw, inner)
        calls.start()
        await trio.testing.wait_all_tasks_blocked()
        assert before.is_set()  # the first to wait
        after = cold.next()
        for _ in range(3):
            calls.start()
        await trio.testing.wait_all_tasks_blocked()
        assert gw.gateway.queued == {"chat": 4} and not after.is_set()  # the others: no news
        gw.provider.set((a.endpoint(),), None, (info(),))
    assert [answer[0] for answer in calls.answers] == [200] * 4 and not after.is_set()

    # Scaled to zero again: the next request to wait is the first again.
    gw.provider.set((), CHAT, (info(),))
    await trio.testing.wait_all_tasks_blocked()
    async with trio.open_nursery() as inner:
        calls = Calls(gw, inner)
        calls.start()
        await trio.testing.wait_all_tasks_blocked()
        assert after.is_set()
        gw.provider.set((a.endpoint(),), None, (info(),))

    # Waiting for a replica that is busy (at its cap) is no news: the model has one.
    gw.provider.set((slow.endpoint(),), None, (info(),))
    await trio.testing.wait_all_tasks_blocked()
    quiet = cold.next()
    async with trio.open_nursery() as inner:
        calls = Calls(gw, inner)
        calls.start(chat(max_tokens=3))
        await trio.sleep(0.5)
        calls.start()
        await trio.sleep(0.5)
        assert gw.gateway.queued == {"chat": 1} and not quiet.is_set()
    assert [answer[0] for answer in calls.answers] == [200, 200] and not quiet.is_set()


async def test_a_models_own_queue_bound_refuses_at_once_and_the_gateways_bounds_the_others_together(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    gw = await memnet.start_gateway(
        nursery,
        tmp_path,
        net,
        (),
        models=frozenset({"chat", "other", "third"}),
        details=(info(max_queue=3), info("other"), info("third")),
        queue_timeout_s=60,
        max_queue=2,
    )
    async with trio.open_nursery() as inner:
        calls = Calls(gw, inner)
        for _ in range(3):
            calls.start()
        calls.start({**chat(), "model": "other"})
        await trio.testing.wait_all_tasks_blocked()
        assert gw.gateway.queued == {"chat": 3, "other": 1}  # chat's own 3, past the gateway's 2
        started = trio.current_time()
        status, headers, body = await gw.call("POST", "/v1/chat/completions", chat())
        assert trio.current_time() - started < 0.01  # at once, not at the queue's timeout
        err = error_of((status, headers, body))
        assert err["code"] == "overloaded" and "the queue of 'chat' is full (3 requests)" in err["message"]
        assert headers["retry-after"] == "5"
        # The models without a bound of their own share the gateway's: chat's requests take none of it.
        calls.start({**chat(), "model": "third"})
        await trio.testing.wait_all_tasks_blocked()
        assert gw.gateway.queued == {"chat": 3, "other": 1, "third": 1}
        status, headers, body = await gw.call("POST", "/v1/chat/completions", {**chat(), "model": "other"})
        err = error_of((status, headers, body))
        assert err["code"] == "overloaded" and "the queue is full (2 requests)" in err["message"]
        assert headers["retry-after"] == "5"
        assert (load(gw), load(gw, "other")) == ((3, 0, 4, 0.0), (1, 0, 2, 0.0))  # the refused ones counted
        inner.cancel_scope.cancel()  # the held requests' clients go away
    await trio.sleep(1)  # the gateway watches for a client's departure once its handler has run a moment
    assert gw.gateway.queued == {"chat": 0, "other": 0, "third": 0} and gw.gateway.queues.shared == 0


async def test_a_models_own_queue_timeout(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    gw = await memnet.start_gateway(
        nursery,
        tmp_path,
        net,
        (),
        models=frozenset({"chat", "other"}),
        details=(info(queue_timeout_s=2.5), info("other")),
        queue_timeout_s=7,
    )
    for model, waited in (("chat", 2.5), ("other", 7)):
        started = trio.current_time()
        status, headers, body = await gw.call("POST", "/v1/chat/completions", {**chat(), "model": model})
        assert trio.current_time() - started == pytest.approx(waited)
        err = error_of((status, headers, body))
        assert (
            err["code"] == "model_not_ready" and f"no ready replica of '{model}' within {waited:g} s" in err["message"]
        )
        assert headers["retry-after"] == "5"
    assert gw.gateway.queued == {"chat": 0, "other": 0}


async def test_held_requests_are_refused_the_moment_the_model_becomes_unservable(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    gw = await memnet.start_gateway(
        nursery,
        tmp_path,
        net,
        (),
        models=frozenset({"chat", "other"}),
        details=(info(), info("other")),
        queue_timeout_s=60,
    )
    why = "its replica failed to start: engine exited with status 1"
    async with trio.open_nursery() as inner:
        calls = Calls(gw, inner)
        calls.start()
        calls.start(chat(stream=True))
        calls.start({**chat(), "model": "other"})
        await trio.sleep(4)
        failed_at = trio.current_time()
        gw.provider.set((), frozenset({"chat", "other"}), (info(unservable=why, retry_after_s=30), info("other")))
        await trio.testing.wait_all_tasks_blocked()
        assert calls.at == [failed_at, failed_at]  # at once, not at the queue's timeout
        for answer in calls.answers:
            err = error_of(answer)
            assert err["code"] == "model_unavailable" and why in err["message"]
            assert answer[1]["retry-after"] == "30" and answer[1]["x-should-retry"] == "false"
        assert gw.gateway.queued == {"chat": 0, "other": 1}  # the other model's request waits on
        inner.cancel_scope.cancel()


async def test_held_requests_and_streams_go_as_soon_as_a_replica_is_in_rotation(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (), models=CHAT, details=(info(),), queue_timeout_s=60)
    async with trio.open_nursery() as inner:
        calls = Calls(gw, inner)
        calls.start()
        calls.start(chat(stream=True))
        await trio.sleep(20)  # a cold start
        assert calls.answers == []
        ready_at = trio.current_time()
        gw.provider.set((a.endpoint(),), None, (info(),))
    assert sorted(answer[0] for answer in calls.answers) == [200, 200]
    [streamed] = [body for _, headers, body in calls.answers if headers["content-type"] == "text/event-stream"]
    assert streamed.endswith(b"data: [DONE]\n\n")
    assert all(headers["x-llmgw-replica"] == a.name for _, headers, _ in calls.answers)
    assert max(calls.at) - ready_at < 0.1
    assert all(float(headers["x-llmgw-overhead-ms"]) >= 20_000 for _, headers, _ in calls.answers)  # the wait


async def test_queues_keep_the_oldest_first_and_wake_one_models_waiters() -> None:
    queues = Queues()
    first = queues.enter("chat", 10.0, shared=False)
    second = queues.enter("chat", 12.0, shared=True)
    other = queues.enter("other", 11.0, shared=True)
    assert (queues.queued, queues.shared) == ({"chat": 2, "other": 1}, 2)
    assert (queues.oldest_wait("chat", 15.0), queues.oldest_wait("other", 15.0)) == (5.0, 4.0)
    assert queues.oldest_wait("none", 15.0) == 0.0
    chat_freed, other_freed = first.queue.freed.next(), other.queue.freed.next()
    queues.wake("chat")
    assert chat_freed.is_set() and not other_freed.is_set()  # a reply of chat's wakes chat's waiters only
    queues.wake_all()
    assert other_freed.is_set()
    queues.leave(first)  # the oldest went: the next is the oldest now
    assert (queues.oldest_wait("chat", 15.0), queues.shared) == (3.0, 2)
    queues.leave(second)
    queues.leave(other)
    assert (queues.queued, queues.shared) == ({"chat": 0, "other": 0}, 0)
    assert queues.oldest_wait("chat", 15.0) == 0.0
