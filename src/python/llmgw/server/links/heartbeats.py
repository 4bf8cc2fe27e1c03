"""How often each agent heartbeats, stretched as the cluster grows (Nomad's rule), and how long
the control plane waits before it calls a silent node lost. Pure: numbers in, numbers out.

One control plane takes at most `max_rate` heartbeats a second from all its agents together
(server.toml's `heartbeat_max_rate`). Each agent is told an interval (in the Welcome, and again
in the control plane's own heartbeats whenever it changes):

    interval(n) = heartbeat_interval_s × ceil(n / (heartbeat_interval_s × heartbeat_max_rate))

(n: the agents linked), so up to `heartbeat_interval_s × heartbeat_max_rate` agents (250 at the
defaults, 5 s and 50 a second) heartbeat every `heartbeat_interval_s`, and beyond that the
interval is the shortest multiple of it that keeps the rate within the bound (10 s up to 500
agents, 20 s at 1,000, 100 s at 5,000): it changes in steps, at most once per that many agents
joining or leaving, not at each. A node's time to be
lost follows at the same ratio as configured (`heartbeat_ttl_s / heartbeat_interval_s`, six
intervals at the defaults):

    ttl(interval) = heartbeat_ttl_s × interval / heartbeat_interval_s

A node is judged by the interval it was last told, and a shorter one counts only from the first
heartbeat after it was told (the agent may be asleep on the longer one), so a change never
makes a live node lost. A link that closes is noticed at once whatever the interval; the
interval bounds only how long a node that went silent without closing (cut off, frozen) stays
joined. `heartbeat_max_rate = 0` turns stretching off: every agent heartbeats every
`heartbeat_interval_s`.
"""

from __future__ import annotations

import math

import attrs


@attrs.frozen(kw_only=True)
class HeartbeatRule:
    interval_s: float = 5.0  # the floor: server.toml's heartbeat_interval_s
    ttl_s: float = 30.0  # at the floor: heartbeat_ttl_s
    max_rate: float = 50.0  # heartbeats a second from all agents together; 0: no stretching

    def interval(self, agents: int) -> float:
        """The interval to tell each of `agents` linked agents."""
        if self.max_rate <= 0:
            return self.interval_s
        return self.interval_s * max(1, math.ceil(agents / (self.interval_s * self.max_rate)))

    def ttl(self, interval_s: float) -> float:
        """How long a node told `interval_s` may be silent before it is lost."""
        return self.ttl_s * max(interval_s, self.interval_s) / self.interval_s
