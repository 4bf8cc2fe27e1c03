"""Supervised background loops (MockClock): a failure after start is logged with its traceback
and the loop restarted with a backoff that grows, is capped and resets after a healthy run; a
failure at start reaches the caller unchanged; cancellation and interrupts pass through."""

from __future__ import annotations

import logging
from itertools import pairwise

import pytest
import trio
import trio.testing

from llmgw.backoff import Backoff
from llmgw.errors import MachineError, find
from llmgw.supervision import Background

pytestmark = pytest.mark.trio


class Boom(Exception):
    pass


def failures(caplog: pytest.LogCaptureFixture, event: str = "background_task_failed") -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == event]


def fields(record: logging.LogRecord) -> dict:
    return record.llmgw_fields  # type: ignore[attr-defined]


async def test_a_loop_that_fails_after_start_is_restarted_with_a_growing_capped_backoff(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    starts: list[float] = []

    async def serve(*, task_status) -> None:
        starts.append(trio.current_time())
        task_status.started()
        await trio.sleep(0.5)
        raise Boom(f"failure {len(starts)}")

    background = Background(backoff=Backoff(first_s=1, max_s=8, healthy_s=60))
    async with trio.open_nursery() as nursery:
        await nursery.start(background.run, "loop", serve)
        with trio.move_on_after(200):
            while len(starts) < 7:
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    gaps = [round(b - a - 0.5, 6) for a, b in pairwise(starts)]
    assert gaps == [1, 2, 4, 8, 8, 8]  # doubling from first_s, capped at max_s
    assert background.restarts == {"loop": 6}
    logged = failures(caplog)
    assert len(logged) == 6  # one line per failure (the 7th run was cancelled before it failed)
    assert [fields(r)["restarts"] for r in logged[:3]] == [0, 1, 2]
    assert [fields(r)["restart_in_s"] for r in logged[:5]] == [1, 2, 4, 8, 8]
    first = logged[0]
    assert first.levelname == "ERROR" and fields(first)["task"] == "loop"
    assert first.exc_info is not None and isinstance(first.exc_info[1], Boom)  # with its traceback
    assert [fields(r)["restarts"] for r in failures(caplog, "background_task_restarted")][:2] == [1, 2]


async def test_the_backoff_starts_over_after_a_healthy_run(autojump_clock: trio.testing.MockClock) -> None:
    runs = iter([0.5, 0.5, 0.5, 61, 0.5, 0.5])  # how long each run lasts before it fails
    starts: list[float] = []

    async def serve(*, task_status) -> None:
        starts.append(trio.current_time())
        task_status.started()
        await trio.sleep(next(runs))
        raise Boom

    background = Background(backoff=Backoff(first_s=1, max_s=60, healthy_s=60))
    async with trio.open_nursery() as nursery:
        await nursery.start(background.run, "loop", serve)
        with trio.move_on_after(500):
            while len(starts) < 6:
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    durations = [0.5, 0.5, 0.5, 61, 0.5]
    gaps = [round(b - a - d, 6) for (a, b), d in zip(pairwise(starts), durations, strict=True)]
    assert gaps == [1, 2, 4, 1, 2]  # the 61 s run was healthy: the next failure waits 1 s again


async def test_a_failure_at_start_reaches_the_caller_unchanged_and_is_not_retried(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    attempts = []

    async def serve(*, task_status) -> None:
        attempts.append(1)
        raise MachineError("cannot listen on 127.0.0.1:1: address in use")

    background = Background()
    async with trio.open_nursery() as nursery:
        with pytest.raises(MachineError, match="address in use"):  # not wrapped in a group
            await nursery.start(background.run, "listener", serve)
        await trio.sleep(120)
    assert attempts == [1] and background.restarts == {"listener": 0}
    assert failures(caplog) == []


async def test_what_the_loop_reports_started_is_returned_and_a_restart_failing_at_start_is_one_more_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    attempts: list[float] = []

    async def serve(value, *, task_status) -> None:
        attempts.append(trio.current_time())
        if len(attempts) in (2, 3):
            raise Boom("fails before started on its restarts")
        task_status.started(value)
        if len(attempts) == 1:
            raise Boom("fails after start")
        await trio.sleep_forever()

    background = Background(backoff=Backoff(first_s=1, max_s=60, healthy_s=60))
    async with trio.open_nursery() as nursery:
        assert await nursery.start(background.run, "loop", serve, "ready") == "ready"
        with trio.fail_after(100):
            while len(attempts) < 4:
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert [round(b - a, 6) for a, b in pairwise(attempts)] == [1, 2, 4]
    assert background.restarts == {"loop": 3}


async def test_a_loop_that_returns_is_done_and_not_restarted(autojump_clock: trio.testing.MockClock) -> None:
    runs = []

    async def serve(*, task_status) -> None:
        runs.append(1)
        task_status.started()

    background = Background()
    async with trio.open_nursery() as nursery:
        await nursery.start(background.run, "once", serve)
        await trio.sleep(300)
    assert runs == [1] and background.restarts == {"once": 0}

    async def never_started(*, task_status) -> None:
        return

    async with trio.open_nursery() as nursery:
        with pytest.raises(RuntimeError, match="without calling task_status.started"):
            await nursery.start(background.run, "forgetful", never_started)


async def test_cancellation_passes_through_while_running_and_while_waiting_to_restart(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    cleaned = []

    async def serve(*, task_status) -> None:
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            cleaned.append(trio.current_time())

    background = Background()
    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(background.run, "loop", serve)
    assert scope.cancelled_caught and cleaned == [5]

    async def failing(*, task_status) -> None:
        task_status.started()
        raise Boom

    with trio.move_on_after(0.5) as scope:  # inside the 1 s wait before the restart
        async with trio.open_nursery() as nursery:
            await nursery.start(background.run, "failing", failing)
    assert scope.cancelled_caught and background.restarts["failing"] == 0
    assert len(failures(caplog)) == 1


async def test_a_failure_as_the_loop_is_cancelled_is_logged_and_the_cancellation_goes_on(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async def serve(*, task_status) -> None:
        async with trio.open_nursery() as inner:
            inner.start_soon(trio.sleep_forever)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                raise Boom("cleanup failed")  # the bug this test is about

    background = Background()
    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(background.run, "loop", serve)
    assert scope.cancelled_caught
    [record] = failures(caplog, "background_task_failed_while_stopping")
    assert fields(record)["task"] == "loop" and find(record.exc_info[1], Boom) is not None


async def test_keyboard_interrupt_is_not_swallowed(autojump_clock: trio.testing.MockClock) -> None:
    async def serve(*, task_status) -> None:
        task_status.started()
        await trio.sleep(1)
        raise KeyboardInterrupt

    background = Background()
    with pytest.raises(BaseException) as raised:  # a group holding the interrupt
        async with trio.open_nursery() as nursery:
            await nursery.start(background.run, "loop", serve)
    assert find(raised.value, KeyboardInterrupt) is not None
    assert background.restarts == {"loop": 0}


async def test_fields_name_the_owner_in_every_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async def serve(*, task_status) -> None:
        task_status.started()
        raise Boom

    background = Background(node="node-a")
    with trio.move_on_after(1.5):
        async with trio.open_nursery() as nursery:
            await nursery.start(background.run, "inventory", serve)
    assert [fields(r)["node"] for r in failures(caplog)] == ["node-a", "node-a"]
