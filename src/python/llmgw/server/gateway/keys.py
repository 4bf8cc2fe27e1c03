"""Gateway API keys: who may call the gateway, for which models, how fast and how many at once.

The store keeps each key's name, the sha256 of its token (never the token, which is shown once
at creation), the models it may use, its limits and when it was revoked. `KeyRing` mirrors the
valid keys in memory, indexed by that hash: a request's token is hashed and looked up, so the
comparison never runs over the secret itself, and the stored hash is checked again with
`hmac.compare_digest`. Every change goes through the ring, so a revocation takes effect on the
very next request. A change is written to the store first and made in memory only once written:
when the store refuses (`StoreError`, e.g. locked by another process) nothing changed, and
requests keep being authenticated from memory meanwhile. Every change made fires `changed`, so
the gateways' table follows (`llmgw.server.gatewayfeed` sends `valid()` to each).

Limits are per key: a token bucket of `rate_per_minute` requests (a burst of up to one minute's
worth) and a count of requests in flight against `max_concurrency`. `TokenBucket` is pure and
takes `now` from its caller, so tests drive it with a fake clock.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable, Sequence

import attrs

from llmgw.errors import shown
from llmgw.server.asyncstore import AsyncStore
from llmgw.server.gateway.errors import ApiKeyError, ApiKeyExists, UnknownApiKey
from llmgw.server.store import KeyRow
from llmgw.wakeup import Wakeup

TOKEN_PREFIX = "llmgw-"
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # matched whole (`fullmatch`)
KEY_NAME_RULE = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
# A key's models are catalog names (`llmgw.config`'s grammar for them), a key's own list bounded.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
MAX_MODELS = 256
# rate_per_minute and max_concurrency: far above what one gateway serves, far inside the 64-bit
# integers SQLite stores (a larger number would fail as the database's error, not the caller's).
MAX_LIMIT = 1_000_000_000


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@attrs.define(kw_only=True)
class TokenBucket:
    """`rate_per_minute` tokens a minute, holding at most one minute's worth."""

    rate_per_minute: int
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate_per_minute: int, now: float) -> TokenBucket:
        return cls(rate_per_minute=rate_per_minute, tokens=float(rate_per_minute), updated=now)

    def take(self, now: float) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there will be."""
        per_s = self.rate_per_minute / 60.0
        self.tokens = min(float(self.rate_per_minute), self.tokens + max(0.0, now - self.updated) * per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / per_s


@attrs.frozen(kw_only=True)
class Limited:
    message: str
    retry_after_s: float


class KeyRing:
    def __init__(self, store: AsyncStore, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self._by_hash: dict[str, KeyRow] = {r.token_sha256: r for r in store.at_open.api_keys if r.revoked_at is None}
        self._buckets: dict[str, TokenBucket] = {}
        self._in_flight: dict[str, int] = {}
        self.changed = Wakeup()  # a key was made or revoked (in memory: written first)

    # -- administration -------------------------------------------------------------------

    async def create(
        self, name: str, *, models: Sequence[str] = (), rate_per_minute: int = 0, max_concurrency: int = 0
    ) -> tuple[KeyRow, str]:
        """A new key and its token; the token is not kept anywhere and cannot be shown again."""
        if not isinstance(name, str) or not KEY_NAME.fullmatch(name):
            raise ApiKeyError(f"key name {shown(name)} is not valid: {KEY_NAME_RULE}")
        for field, value in (("rate_per_minute", rate_per_minute), ("max_concurrency", max_concurrency)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT:
                raise ApiKeyError(
                    f"{field} must be a whole number from 0 (no limit) to {MAX_LIMIT}, got {shown(value)}"
                )
        if (
            not isinstance(models, (list, tuple))
            or len(models) > MAX_MODELS
            or not all(isinstance(m, str) and MODEL_NAME.fullmatch(m) for m in models)
        ):
            raise ApiKeyError(
                f"models must be a list of at most {MAX_MODELS} model names (letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit, 63 at most), got {shown(models)}"
            )
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        row = KeyRow(
            name=name,
            token_sha256=token_hash(token),
            models=tuple(sorted(set(models))),
            rate_per_minute=rate_per_minute,
            max_concurrency=max_concurrency,
            created_at=time.time(),
            revoked_at=None,
        )
        if not await self.store.add_api_key(row):
            raise ApiKeyExists(
                f"a key named {name!r} exists already (revoked keys keep their names); choose another name"
            )
        self._by_hash[row.token_sha256] = row
        self.changed.fire()
        return row, token

    async def revoke(self, name: str) -> None:
        if not await self.store.revoke_api_key(name):
            known = ", ".join(r.name for r in await self.store.api_keys()) or "none"
            raise UnknownApiKey(f"no API key named {name!r} (keys: {known}); see `llmgw ctl keys list`")
        self._by_hash = {h: r for h, r in self._by_hash.items() if r.name != name}
        self._buckets.pop(name, None)
        self.changed.fire()

    def valid(self) -> list[KeyRow]:
        """The valid keys, as requests are checked against them now."""
        return list(self._by_hash.values())

    async def rows(self) -> list[KeyRow]:
        return await self.store.api_keys()

    # -- requests -------------------------------------------------------------------------

    def authenticate(self, token: str) -> KeyRow | None:
        digest = token_hash(token)
        row = self._by_hash.get(digest)
        if row is None or not hmac.compare_digest(row.token_sha256, digest):
            return None
        return row

    def admit(self, row: KeyRow) -> Limited | None:
        """Count a request against the key's limits: None (admitted, `leave` when done) or why not."""
        if row.max_concurrency and self._in_flight.get(row.name, 0) >= row.max_concurrency:
            return Limited(
                message=f"key {row.name!r} has {row.max_concurrency} requests in flight, its limit; "
                "wait for one to finish",
                retry_after_s=1.0,
            )
        if row.rate_per_minute:
            now = self.clock()
            bucket = self._buckets.get(row.name)
            if bucket is None:
                bucket = self._buckets[row.name] = TokenBucket.full(row.rate_per_minute, now)
            wait = bucket.take(now)
            if wait > 0:
                return Limited(
                    message=f"key {row.name!r} is limited to {row.rate_per_minute} requests per minute",
                    retry_after_s=wait,
                )
        self._in_flight[row.name] = self._in_flight.get(row.name, 0) + 1
        return None

    def leave(self, row: KeyRow) -> None:
        left = self._in_flight.get(row.name, 0) - 1
        if left > 0:
            self._in_flight[row.name] = left
        else:
            self._in_flight.pop(row.name, None)


def key_view(row: KeyRow) -> dict:
    return {
        "name": row.name,
        "models": list(row.models),
        "rate_per_minute": row.rate_per_minute,
        "max_concurrency": row.max_concurrency,
        "created_at": row.created_at,
        "revoked_at": row.revoked_at,
        "token_sha256_prefix": row.token_sha256[:12],
    }
