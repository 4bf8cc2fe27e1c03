"""Which replica serves a request: pure routing state, no I/O, no clock of its own.

`Router` holds, per model, the endpoints in rotation (from the control plane, replaced whole
by `update`) and the requests outstanding on each (kept by `acquire`/`release`, keyed by
replica id so a count survives an update). `pick` chooses the endpoint with the fewest
outstanding requests, ties broken at random, never one already tried for this request, one
that is draining, one marked down, or one at its per-replica cap.

Invariants: an endpoint leaves rotation the moment `update` omits it or marks it draining, or
`mark_down` says a connection to it failed (until `now` passes the cooldown); requests already
on it are not touched, and their `release` still balances the count.

Prefix affinity (optional): a hash of the first `affinity_chars` characters of the prompt names
a preferred endpoint (rendezvous hashing, stable while the set changes); it is chosen when its
load is within one request of the least, so a shared prefix tends to hit a warm cache without
piling onto one replica.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Iterable

import attrs


@attrs.frozen(kw_only=True)
class Endpoint:
    replica_id: str
    model: str
    host: str
    port: int
    api_key: str = attrs.field(default="", repr=False)
    draining: bool = False

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Router:
    def __init__(
        self,
        *,
        rng: random.Random | None = None,
        affinity_chars: int = 0,
        max_outstanding: int = 0,
        down_cooldown_s: float = 5.0,
    ) -> None:
        self.rng = rng or random.Random()
        self.affinity_chars = affinity_chars
        self.max_outstanding = max_outstanding  # per replica; 0 = no cap
        self.down_cooldown_s = down_cooldown_s
        self.models: frozenset[str] = frozenset()
        self.endpoints: dict[str, tuple[Endpoint, ...]] = {}
        self.outstanding: dict[str, int] = {}
        self.down_until: dict[str, float] = {}

    def update(self, models: Iterable[str], endpoints: Iterable[Endpoint]) -> None:
        """The models served (known, even with nothing ready) and the endpoints ready now."""
        by_model: dict[str, list[Endpoint]] = {}
        for ep in endpoints:
            by_model.setdefault(ep.model, []).append(ep)
        self.models = frozenset(models) | frozenset(by_model)
        self.endpoints = {m: tuple(sorted(eps, key=lambda e: e.replica_id)) for m, eps in by_model.items()}
        live = {ep.replica_id for eps in self.endpoints.values() for ep in eps}
        self.down_until = {k: v for k, v in self.down_until.items() if k in live}

    def mark_down(self, replica_id: str, now: float) -> None:
        self.down_until[replica_id] = now + self.down_cooldown_s

    def in_rotation(self, model: str, now: float) -> list[Endpoint]:
        """The endpoints that may take a new request. A draining one does only while no other
        of its model can: a drain of a model's only replica must not be an outage while its
        replacement starts (the control plane retires it once the replacement is ready)."""
        up = [ep for ep in self.endpoints.get(model, ()) if self.down_until.get(ep.replica_id, 0.0) <= now]
        return [ep for ep in up if not ep.draining] or up

    def pick(
        self, model: str, now: float, *, exclude: Collection[str] = (), prompt: str | None = None
    ) -> Endpoint | None:
        candidates = [
            ep
            for ep in self.in_rotation(model, now)
            if ep.replica_id not in exclude
            and (self.max_outstanding <= 0 or self.outstanding.get(ep.replica_id, 0) < self.max_outstanding)
        ]
        if not candidates:
            return None
        load = {ep.replica_id: self.outstanding.get(ep.replica_id, 0) for ep in candidates}
        least = min(load.values())
        if self.affinity_chars > 0 and prompt:
            preferred = max(candidates, key=lambda ep: _affinity(prompt[: self.affinity_chars], ep.replica_id))
            if load[preferred.replica_id] <= least + 1:
                return preferred
        return self.rng.choice([ep for ep in candidates if load[ep.replica_id] == least])

    def acquire(self, ep: Endpoint) -> None:
        self.outstanding[ep.replica_id] = self.outstanding.get(ep.replica_id, 0) + 1

    def release(self, ep: Endpoint) -> None:
        left = self.outstanding.get(ep.replica_id, 0) - 1
        if left > 0:
            self.outstanding[ep.replica_id] = left
        else:
            self.outstanding.pop(ep.replica_id, None)

    def state_of(self, ep: Endpoint, now: float) -> str:
        if ep.draining:
            return "draining"
        return "down" if self.down_until.get(ep.replica_id, 0.0) > now else "ready"


def _affinity(prefix: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{replica_id}\0{prefix}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@attrs.frozen(kw_only=True)
class Rotation:
    """What an endpoint provider tells the gateway: the models it serves (a known model with
    nothing ready queues; an unknown one is a 404) and the endpoints ready now."""

    models: frozenset[str]
    endpoints: tuple[Endpoint, ...]
