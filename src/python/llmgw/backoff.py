"""How long to wait before trying again: the one backoff policy of llmgw, and the count it runs on.

Every retry in llmgw waits by a `Backoff`: a background loop started again
(`llmgw.supervision`), the agent's link to the control plane, `llmgw agent supervise`'s child, a
replica's engine, a store write that the database refused, a sim worker joining rank 0. Each
states its own policy next to its loop; what a policy means is said once, here:

- the wait after the n-th failure that counts is `first_s * factor**(n-1)`, at most `max_s`;
- with `jitter`, a uniform draw between 0 and that ("full jitter"), so that many peers refused
  together (a control-plane restart) do not come back together;
- a failure that ends a run of `healthy_s` or more counts as the first again: a loop that ran
  for an hour and failed once is back at once;
- only failures within the last `window_s` count, and `give_up_after` of them end the trying.

A success the caller recognises by other means (the link was up) is `Failures.reset()`.

Pure: `Failures` takes the times from its caller (trio's clock, or `time.monotonic` where there
is no trio) and the random source for the jitter, so tests run it on fake times and a seeded or
scripted random source.
"""

from __future__ import annotations

import math
import random

import attrs


@attrs.frozen(kw_only=True)
class Backoff:
    """A retry policy (module docstring); frozen, so one instance may serve every user of it."""

    first_s: float = 1.0
    max_s: float = 60.0
    factor: float = 2.0
    jitter: bool = False
    healthy_s: float = math.inf  # a run at least this long was healthy: the failure ending it counts as the first
    window_s: float = math.inf  # only failures this recent count
    give_up_after: int = 0  # this many failures that count end the trying; 0: never

    def __attrs_post_init__(self) -> None:
        if self.first_s < 0 or self.max_s < self.first_s or self.factor < 1:
            raise ValueError(
                f"a backoff needs 0 <= first_s <= max_s and factor >= 1, got first_s={self.first_s}, "
                f"max_s={self.max_s}, factor={self.factor}"
            )

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """The wait after the `failures`-th failure that counts (1 for the first); `rng` draws the
        jitter, and is needed only with it."""
        # The exponent is bounded so that a long outage cannot overflow a float.
        ceiling = min(self.max_s, self.first_s * self.factor ** min(max(failures - 1, 0), 64))
        if not self.jitter:
            return ceiling
        if rng is None:
            raise TypeError("a backoff with jitter needs a random source (rng)")
        return rng.uniform(0, ceiling)


class Failures:
    """One thing's failures under a `Backoff`: note each with `failed`, then wait `delay()`, or stop
    trying once `exhausted`."""

    def __init__(self, policy: Backoff) -> None:
        self.policy = policy
        self.times: list[float] = []  # when each failure that still counts happened, oldest first

    @property
    def count(self) -> int:
        """The failures that count, as of the last `failed`."""
        return len(self.times)

    def failed(self, now: float, *, ran_s: float = 0.0) -> None:
        """A failure at `now`, ending a run of `ran_s` seconds (0: it never ran)."""
        if ran_s >= self.policy.healthy_s:
            self.times.clear()
        self.times = [t for t in self.times if now - t <= self.policy.window_s]
        self.times.append(now)

    def reset(self) -> None:
        """A success: the next failure counts as the first."""
        self.times.clear()

    @property
    def exhausted(self) -> bool:
        """Whether the failures that count reached the policy's `give_up_after`: stop trying."""
        return 0 < self.policy.give_up_after <= self.count

    def delay(self, rng: random.Random | None = None) -> float:
        """The wait before the next try, after the failures so far."""
        return self.policy.delay(self.count, rng)
