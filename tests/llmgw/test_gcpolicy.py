"""The garbage collector's settings for serving processes: every long-lived llmgw process runs
with the young generation's threshold raised (`llmgw.gcpolicy`, why there), and gives the
process its thresholds back when it ends."""

from __future__ import annotations

import gc

import pytest
import trio

from llmgw import gcpolicy
from llmgw.commands._service import run_service


@pytest.fixture(autouse=True)
def thresholds_kept():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's own, whatever the test run set
    yield
    gc.set_threshold(*before)


def test_serving_raises_the_young_threshold_only_and_restores_it() -> None:
    with gcpolicy.serving():
        assert gc.get_threshold() == (gcpolicy.YOUNG_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_serving_restores_the_thresholds_when_the_service_fails() -> None:
    with pytest.raises(RuntimeError), gcpolicy.serving():
        raise RuntimeError("the service failed")
    assert gc.get_threshold() == (700, 10, 10)


def test_a_service_runs_with_the_serving_thresholds() -> None:
    seen = []

    async def serve() -> None:
        seen.append(gc.get_threshold())
        await trio.lowlevel.checkpoint()

    assert run_service("probe", serve) == 0
    assert seen == [(gcpolicy.YOUNG_THRESHOLD, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)
