"""API keys as a gateway holds them: the table of valid keys it authenticates and admits with.

A gateway never holds a token: a key is the sha256 of its token, the models it may use and its
limits (`llmgw.wire.gateway_link.GatewayKey`), as the control plane sends them (`KeysChanged`)
or, for the control plane's own gateway, as its `KeyRing` (`llmgw.server.state.keys`) hands them over.
A request's token is hashed and looked up, so no comparison runs over the secret itself, and
the hash found is checked again with `hmac.compare_digest`. A connection nearly always sends one
key: the token it sent last and its hash are kept with the connection (`Request.per_connection`,
never in a table of the process's own, so a token lives no longer than the connection that sent
it), and a token equal to it (`hmac.compare_digest`, in constant time) is not hashed again.

`KeyTable.replace` takes the whole set of valid keys each time: a key missing from it is refused
at its next request. What the table counts carries over from one set to the next: the requests
in flight of each key (a request admitted before a change leaves after it), and each key's
token bucket (refilled at the key's rate as it is then).

Limits are per key, divided among the gateway instances by the rule `llmgw.wire.gateway_link`
states (`share_of_rate`, `share_of_concurrency`): this instance is `index` of `count`
(`ShareChanged`; 0 of 1 alone, the control plane's own gateway). `TokenBucket` is pure and
takes `now` from its caller, so tests drive it with a fake clock. Nothing here is more than
O(1) per request; a new table costs O(keys).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Iterable

import attrs

from llmgw.wire.gateway_link import GatewayKey, ShareChanged, share_of_concurrency, share_of_rate

ALONE = ShareChanged(index=0, count=1)  # the whole of every limit: the only instance
_LAST_TOKEN = "llmgw.gateway.keys.last_token"  # in a connection's dict: (the token it sent last, its hash)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@attrs.define(kw_only=True)
class TokenBucket:
    """`per_minute` tokens a minute, holding at most `burst`."""

    per_minute: float
    burst: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, per_minute: float, now: float, burst: float | None = None) -> TokenBucket:
        burst = float(per_minute) if burst is None else burst
        return cls(per_minute=float(per_minute), burst=burst, tokens=burst, updated=now)

    def refit(self, per_minute: float, burst: float) -> None:
        """A new rate or burst (the key changed, or this instance's share): the tokens held stay,
        up to the new burst."""
        self.per_minute, self.burst = per_minute, burst
        self.tokens = min(self.tokens, burst)

    def take(self, now: float) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there will be."""
        per_s = self.per_minute / 60.0
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.updated) * per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / per_s


@attrs.frozen(kw_only=True)
class Limited:
    message: str
    retry_after_s: float


class KeyTable:
    """The valid keys by the hash of their tokens, and what each has in flight on this instance."""

    def __init__(
        self,
        keys: Iterable[GatewayKey] = (),
        *,
        share: ShareChanged = ALONE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.share = share
        self._by_hash: dict[str, GatewayKey] = {}
        self._buckets: dict[str, TokenBucket] = {}  # by key name
        self._in_flight: dict[str, int] = {}  # by key name; a key gone from the table still leaves
        self.replace(keys)

    def __len__(self) -> int:
        return len(self._by_hash)

    def keys(self) -> list[GatewayKey]:
        return list(self._by_hash.values())

    # -- the table's source ---------------------------------------------------------------

    def replace(self, keys: Iterable[GatewayKey]) -> None:
        """The valid keys are now exactly `keys`."""
        self._by_hash = {k.token_sha256: k for k in keys}
        names = {k.name for k in self._by_hash.values()}
        self._buckets = {name: b for name, b in self._buckets.items() if name in names}

    def set_share(self, share: ShareChanged) -> None:
        """This instance's share of every key's limits from now on (applied at each key's next request)."""
        self.share = share

    # -- requests -------------------------------------------------------------------------

    def authenticate(self, token: str, per_connection: dict | None = None) -> GatewayKey | None:
        """The valid key whose token is `token`, or None. `per_connection`: the connection's own
        dict, where the token it sent last is kept with its hash (the module's docstring)."""
        raw = token.encode()
        last = per_connection.get(_LAST_TOKEN) if per_connection is not None else None
        if last is not None and hmac.compare_digest(last[0], raw):
            digest = last[1]
        else:
            digest = hashlib.sha256(raw).hexdigest()
            if per_connection is not None:
                per_connection[_LAST_TOKEN] = (raw, digest)
        key = self._by_hash.get(digest)
        if key is None or not hmac.compare_digest(key.token_sha256, digest):
            return None
        return key

    def in_flight(self, name: str) -> int:
        return self._in_flight.get(name, 0)

    def admit(self, key: GatewayKey) -> Limited | None:
        """Count a request against the key's limits: None (admitted, `leave` when done) or why not."""
        allowed = share_of_concurrency(key.max_concurrency, self.share)
        if allowed and self._in_flight.get(key.name, 0) >= allowed:
            return Limited(message=self._concurrency_message(key, allowed), retry_after_s=1.0)
        if key.rate_per_minute:
            wait = self._bucket(key).take(self.clock())
            if wait > 0:
                return Limited(message=self._rate_message(key), retry_after_s=wait)
        self._in_flight[key.name] = self._in_flight.get(key.name, 0) + 1
        return None

    def leave(self, key: GatewayKey) -> None:
        left = self._in_flight.get(key.name, 0) - 1
        if left > 0:
            self._in_flight[key.name] = left
        else:
            self._in_flight.pop(key.name, None)

    def _bucket(self, key: GatewayKey) -> TokenBucket:
        per_minute, burst = share_of_rate(key.rate_per_minute, self.share)
        bucket = self._buckets.get(key.name)
        if bucket is None:
            bucket = self._buckets[key.name] = TokenBucket.full(per_minute, self.clock(), burst)
        elif (bucket.per_minute, bucket.burst) != (per_minute, burst):
            bucket.refit(per_minute, burst)
        return bucket

    def _concurrency_message(self, key: GatewayKey, allowed: int) -> str:
        if self.share.count <= 1:
            return f"key {key.name!r} has {allowed} requests in flight, its limit; wait for one to finish"
        return (
            f"key {key.name!r} has {allowed} requests in flight on this gateway instance, its share of the key's "
            f"limit of {key.max_concurrency} across {self.share.count} instances; wait for one to finish"
        )

    def _rate_message(self, key: GatewayKey) -> str:
        message = f"key {key.name!r} is limited to {key.rate_per_minute} requests per minute"
        if self.share.count > 1:
            per_minute, _ = share_of_rate(key.rate_per_minute, self.share)
            message += f" across {self.share.count} gateway instances ({per_minute:g} a minute on this one)"
        return message
