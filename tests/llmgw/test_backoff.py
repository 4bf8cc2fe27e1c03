"""The one backoff policy (llmgw.backoff), on fake times and a scripted random source; and every
retry in the sources waits by it."""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest

import llmgw
from llmgw.backoff import Backoff, Failures

SRC = Path(llmgw.__file__).resolve().parent.parent  # src/python


class ScriptedRandom(random.Random):
    """Draws what the script says, as a fraction of the range asked for; records the ranges."""

    def __init__(self, *fractions: float) -> None:
        super().__init__(0)
        self.fractions = list(fractions)
        self.asked: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.asked.append((a, b))
        return a + (b - a) * self.fractions.pop(0)


def waits(policy: Backoff, runs: list[float], *, gap_s: float = 1.0) -> list[float]:
    """The waits after runs of the given lengths, each failing; the clock advances by the run,
    then by the wait (or `gap_s` if there is none)."""
    now, failures, out = 0.0, Failures(policy), []
    for ran in runs:
        now += ran
        failures.failed(now, ran_s=ran)
        out.append(failures.delay())
        now += out[-1] or gap_s
    return out


def test_the_wait_grows_by_the_factor_up_to_the_cap() -> None:
    assert [Backoff(first_s=1, max_s=8).delay(n) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]
    assert [Backoff(first_s=0.5, max_s=100, factor=3).delay(n) for n in range(1, 5)] == [0.5, 1.5, 4.5, 13.5]
    assert Backoff(first_s=0, max_s=5).delay(3) == 0  # no wait at all: tests that want the restart at once


def test_a_very_long_run_of_failures_neither_overflows_nor_passes_the_cap() -> None:
    policy = Backoff(first_s=1, max_s=30)
    assert policy.delay(10_000) == 30
    assert policy.delay(0) == policy.delay(1) == 1  # "no failure yet" waits as the first


def test_jitter_draws_below_the_step_and_needs_a_random_source() -> None:
    policy = Backoff(first_s=0.5, max_s=30, jitter=True)
    rng = ScriptedRandom(0.0, 0.5, 1.0, 0.25)
    assert [policy.delay(n, rng) for n in (1, 2, 3, 8)] == [0.0, 0.5, 2.0, 7.5]
    assert rng.asked == [(0, 0.5), (0, 1.0), (0, 2.0), (0, 30)]
    with pytest.raises(TypeError, match="needs a random source"):
        policy.delay(1)


def test_jitter_with_a_seeded_source_is_reproducible_and_spread() -> None:
    policy = Backoff(first_s=1, max_s=30, jitter=True)
    first = [policy.delay(5, random.Random(7)) for _ in range(3)]
    assert first == [policy.delay(5, random.Random(7))] * 3
    draws = [policy.delay(5, r) for r in [random.Random(42)] for _ in range(200)]
    assert all(0 <= d <= 16 for d in draws) and max(draws) - min(draws) > 8  # many agents do not return together


def test_a_healthy_run_makes_the_next_failure_the_first_again() -> None:
    policy = Backoff(first_s=1, max_s=30, healthy_s=60)
    assert waits(policy, [0.25, 0.25, 0.25, 60.0, 0.25, 59.75]) == [1, 2, 4, 1, 2, 4]
    assert waits(Backoff(first_s=1, max_s=30), [0.25, 0.25, 3600.0]) == [1, 2, 4]  # without healthy_s: never


def test_only_failures_in_the_window_count_and_enough_of_them_give_up() -> None:
    policy = Backoff(first_s=1, max_s=60, window_s=600, give_up_after=5)
    failures = Failures(policy)
    for i, t in enumerate([0.0, 10.0, 20.0, 30.0]):
        failures.failed(t)
        assert not failures.exhausted and failures.delay() == 2**i
    failures.failed(40.0)
    assert failures.exhausted and failures.count == 5
    spread = Failures(policy)
    for t in (0.0, 3600.0, 7200.0, 10800.0, 14400.0):  # the same five, hours apart: each a first
        spread.failed(t)
    assert spread.count == 1 and not spread.exhausted and spread.delay() == 1
    edge = Failures(policy)
    edge.failed(0.0)
    edge.failed(600.0)  # exactly the window apart: the first still counts
    assert edge.count == 2


def test_a_success_starts_the_count_again_and_without_give_up_it_never_ends() -> None:
    failures = Failures(Backoff(first_s=0.5, max_s=30))
    for t in range(100):
        failures.failed(float(t))
    assert not failures.exhausted and failures.delay() == 30
    failures.reset()
    failures.failed(101.0)
    assert failures.count == 1 and failures.delay() == 0.5


@pytest.mark.parametrize(
    "kw",
    [{"first_s": -1}, {"first_s": 10, "max_s": 5}, {"factor": 0.5}],
    ids=["negative", "cap-below-first", "shrinks"],
)
def test_a_policy_that_cannot_back_off_is_refused(kw: dict) -> None:
    with pytest.raises(ValueError, match="0 <= first_s <= max_s and factor >= 1"):
        Backoff(**kw)


def test_defaults_retry_forever_from_1_s_to_60_s() -> None:
    policy = Backoff()
    assert (policy.first_s, policy.max_s, policy.factor, policy.jitter) == (1.0, 60.0, 2.0, False)
    assert (policy.healthy_s, policy.window_s, policy.give_up_after) == (math.inf, math.inf, 0)


# -- every retry waits by it ------------------------------------------------------------------


def _classes(path: Path) -> list[str]:
    return [n.name for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.ClassDef)]


def test_no_other_backoff_or_restart_policy_type_in_the_sources() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert any(f.name == "supervision.py" for f in files)  # the scan sees the sources
    words = ("backoff", "restartpolicy", "retrypolicy")
    found = [
        f"{f.relative_to(SRC)}: {name}"
        for f in files
        if f != SRC / "llmgw" / "backoff.py"
        for name in _classes(f)
        if any(w in name.lower() for w in words)
    ]
    assert found == [], "a retry policy of its own; wait by llmgw.backoff.Backoff instead"
