"""How many connections a listener may hold: the process's open-file limit, raised towards the
hard one at start, and the budgets sized from it when the configuration leaves them to us (a
listener's cap, the agent port's unproven connections, the overflow a listener turns newcomers
away with). The budgets themselves are kept by `llmgw.http.listeners` (`Budget`, `serve_capped`).
"""

from __future__ import annotations

import resource


def fd_limit() -> int:
    """This process's soft limit on open files."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit(wanted: int = 65536) -> int:
    """Raise the soft open-file limit towards the hard one (a server's connections are files;
    many systems start processes at a soft 1024); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


# Descriptors kept out of every listener's budget: the database, logs, engine and agent
# processes' pipes, trio's wakeup and signal fds, thread pools.
FD_RESERVE = 128


def default_max_connections(kind: str, limit: int | None = None) -> int:
    """A listener's connection cap when the configuration leaves it to us.

    Agents get their own budget (an eighth of the descriptors, at most 16,384 nodes: 8,176 under
    the systemd unit's LimitNOFILE=65536, room for a 5,000-node cluster) so a flood
    of HTTP clients can never lock a node out; HTTP connections share the rest by half, since
    a gateway request holds a second descriptor for its upstream connection."""
    budget = max(64, (fd_limit() if limit is None else limit) - FD_RESERVE)
    agents = max(16, min(16_384, budget // 8))
    if kind == "agent":
        return agents
    return max(16, (budget - agents) // 2)


def unproven_budget(max_agent_connections: int) -> int:
    """Agent-port connections that have not yet shown a client certificate (TLS handshake under
    way, or a peer without one fetching a release file) held at once: an eighth of the agents'
    budget, between 8 and 64. Held apart from the agents', so bare connections never crowd out
    a certified agent; small, since a real agent leaves it within a round trip or two. At most 256:
    after a cut, a thousand agents redial within the same second, and each one whose handshake
    is closed for a newcomer waits its backoff (64 turned away one in fourteen of them here)."""
    return max(8, min(256, max_agent_connections // 8))


def default_overflow(max_connections: int) -> int:
    """Connections a listener may hold past its cap only to turn them away: an eighth of the
    cap, between 8 and 256 (a refusal takes a moment, so a few turn away many)."""
    return max(8, min(256, max_connections // 8))
