"""Refusals as log lines on a fake clock: the first of an interval one line each, the rest in one
summary logged when the interval ends with no other refusal to wake anything, and what was
counted logged when the task stops."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from llmgw.http.refusallines import REQUESTS, RefusalLines
from llmgw.http.refusals import BURST, INTERVAL_S
from llmgw.log import get_logger

pytestmark = pytest.mark.trio

log = get_logger("llmgw.test")


def lines(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == event and r.levelno >= logging.INFO]


async def test_a_burst_is_a_few_lines_and_its_summary_comes_at_the_interval_end_unprompted(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    refusals = RefusalLines("http")
    async with trio.open_nursery() as nursery:
        await nursery.start(refusals.serve)
        began = trio.current_time()
        for i in range(200):
            refusals.refused(log, "admin_credential_refused", kind="admin", peer=f"203.0.113.{i % 4}:4000{i % 10}")
            await trio.sleep(0.005)  # 200 a second
        assert len(lines(caplog, "admin_credential_refused")) == BURST
        assert lines(caplog, REQUESTS) == []  # the interval has not ended
        # No refusal comes after the burst: the summary is logged all the same, when its interval ends.
        await trio.sleep_until(began + INTERVAL_S + 0.001)
        [summary] = lines(caplog, REQUESTS)
        assert summary.levelno == logging.WARNING
        fields = summary.llmgw_fields  # type: ignore[attr-defined]
        assert fields["listener"] == "http" and fields["count"] == 200 and fields["logged_each"] == BURST
        assert fields["reasons"] == {"admin": 200} and fields["networks"] == {"203.0.113.0/24": 200}
        # The rest were logged at debug only.
        assert len([r for r in caplog.records if r.getMessage() == "admin_credential_refused"]) == 200
        nursery.cancel_scope.cancel()


async def test_what_was_counted_is_logged_when_the_task_stops_mid_interval(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    refusals = RefusalLines("http")
    with trio.move_on_after(INTERVAL_S / 2):
        async with trio.open_nursery() as nursery:
            await nursery.start(refusals.serve)
            for _ in range(BURST + 7):
                refusals.refused(log, "page_login_refused", kind="page_login", peer="198.51.100.9:1")
            await trio.sleep_forever()
    [summary] = lines(caplog, REQUESTS)
    fields = summary.llmgw_fields  # type: ignore[attr-defined]
    assert fields["count"] == BURST + 7 and fields["logged_each"] == BURST and fields["over_s"] == INTERVAL_S / 2
    assert len(lines(caplog, "page_login_refused")) == BURST
