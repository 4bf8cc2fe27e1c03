"""Refused connections in the log, so that a flood of them cannot flood it too.

A listener refuses a connection when it closes it to make room (shed), turns it away at its
cap (`503`, or closed), or, at the agent port, when the peer fails the TLS handshake. Each
refusal is logged at debug level by its listener. The first `burst` of an interval are also
logged at their usual level, one line each, since a single refusal can be news (an agent whose
certificate expired); past that, `RefusalLog` counts them, and one summary per interval says
how many there were, by reason and by peer network — /24 for IPv4, /64 for IPv6, so that one
machine's or one provider's addresses make one entry, the busiest first.

The same counting serves every refusal a peer can repeat at will, on every port: the agent
port's handshakes and certificates, and the HTTP port's wrong admin credentials, login codes
and page calls (`llmgw.http.refusallines`, the trio half: the clock, the lines, and the task
that logs each summary when its interval ends, or at a stop with `flush`).

Pure: the caller passes the time (`now`) and logs what this returns; nothing here reads a
clock or does I/O, so the tests run it on plain numbers. Each call is O(1), except the one
that closes an interval, which ranks that interval's networks (at most `MAX_NETWORKS`).
"""

from __future__ import annotations

import ipaddress
from collections import Counter

import attrs

INTERVAL_S = 10.0
BURST = 5  # refusals of an interval logged one by one (at their level) before they are only counted
MAX_NETWORKS = 1024  # networks counted apart in one interval; past that, counted as OTHER
TOP_NETWORKS = 8  # networks a summary names, the busiest first
OTHER = "other"


def peer_network(peer: str) -> str:
    """The network a peer's address is counted under: its /24 (IPv4) or /64 (IPv6). `peer` is
    a host, `HOST:PORT` or `[HOST]:PORT`; anything that is no IP address is returned as it is
    (`?` when empty)."""
    host = peer
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return peer or "?"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket's IPv4 peer
    prefix = 24 if address.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


@attrs.frozen(kw_only=True)
class Summary:
    """One interval's refusals: when it began, how long it ran, how many there were, how many
    of them were logged one by one, and the counts by reason and by network (the busiest
    `TOP_NETWORKS`; the rest, and networks past `MAX_NETWORKS`, under OTHER)."""

    began: float
    span_s: float
    count: int
    logged: int
    reasons: dict[str, int]
    networks: dict[str, int]

    def fields(self) -> dict[str, object]:
        """What the summary's log line says."""
        return {
            "count": self.count,
            "logged_each": self.logged,
            "over_s": round(self.span_s, 1),
            "reasons": self.reasons,
            "networks": self.networks,
        }


class RefusalLog:
    """Counts one listener's refusals in intervals of `interval_s` (each begins at the first
    refusal after the last one ended); `refused` says whether to log a refusal one by one, and
    `due` returns the summary of an ended interval that had refusals not logged one by one."""

    def __init__(self, *, interval_s: float = INTERVAL_S, burst: int = BURST) -> None:
        self.interval_s = interval_s
        self.burst = burst
        self._began: float | None = None
        self._count = 0
        self._logged = 0
        self._reasons: Counter[str] = Counter()
        self._networks: Counter[str] = Counter()
        self._ready: list[Summary] = []

    def refused(self, now: float, reason: str, peer: str, *, loud: bool = True) -> bool:
        """Count one refusal of `peer` (an address, see `peer_network`; "" for none) for
        `reason`; True if the caller should log it on its own at its usual level (one of the
        first `burst` of its interval), False if debug is enough (the summary counts it).
        `loud=False`: one its caller logs at debug whatever this says (a connection shed);
        counted, it takes no place of the burst."""
        self._close_ended(now)
        if self._began is None:
            self._began = now
        self._count += 1
        self._reasons[reason] += 1
        if peer:  # "" for what has no peer (a listener pausing)
            network = peer_network(peer)
            if network not in self._networks and len(self._networks) >= MAX_NETWORKS:
                network = OTHER  # bounded, whatever number of addresses a flood comes from
            self._networks[network] += 1
        if loud and self._logged < self.burst:
            self._logged += 1
            return True
        return False

    def next_due(self) -> float | None:
        """When the open interval ends (its summary may be due then); None if none is open."""
        return None if self._began is None else self._began + self.interval_s

    def due(self, now: float) -> list[Summary]:
        """The summaries of the intervals ended by `now` that had refusals not logged one by
        one, each returned once."""
        self._close_ended(now)
        ready, self._ready = self._ready, []
        return ready

    def flush(self, now: float) -> list[Summary]:
        """`due`, and the open interval closed at `now` as well (its summary's span the time it
        ran): what a listener logs as it stops, so that no refusal counted is left unsaid."""
        self._close_ended(now)
        if self._began is not None:
            self._close(span_s=max(0.0, now - self._began))
        return self.due(now)

    def _close_ended(self, now: float) -> None:
        if self._began is None or now < self._began + self.interval_s:
            return
        self._close(span_s=self.interval_s)

    def _close(self, *, span_s: float) -> None:
        assert self._began is not None
        if self._count > self._logged:
            named = sorted(((k, n) for k, n in self._networks.items() if k != OTHER), key=lambda kn: -kn[1])
            networks = dict(named[:TOP_NETWORKS])
            rest = sum(self._networks.values()) - sum(networks.values())
            if rest:
                networks[OTHER] = rest
            self._ready.append(
                Summary(
                    began=self._began,
                    span_s=span_s,
                    count=self._count,
                    logged=self._logged,
                    reasons=dict(self._reasons.most_common()),
                    networks=networks,
                )
            )
        self._began = None
        self._count = 0
        self._logged = 0
        self._reasons = Counter()
        self._networks = Counter()
