"""Fixtures of the gateway process's tests."""

from __future__ import annotations

import pytest

from testlib.gateway import Sim


@pytest.fixture
def sims():
    """`sims(n, *flags)` starts n sim engines serving "chat" and waits until they serve."""
    started: list[Sim] = []

    def start(n: int, *extra: str, model: str = "chat") -> list[Sim]:
        new = [Sim(f"{model}-{len(started) + i}", model, *extra) for i in range(n)]
        started.extend(new)
        for s in new:
            s.wait_serving()
        return new

    yield start
    for s in started:
        s.stop()
