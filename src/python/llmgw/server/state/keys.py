"""The control plane's side of the gateway's API keys: creating, revoking and listing them.

The store keeps each key's name, the sha256 of its token (never the token, which is shown once
at creation), the models it may use, its limits, the team it belongs to (whose usage it counts
under) and when it was revoked. `KeyRing` is the one
writer of those rows, and keeps `table` (a `llmgw.gateway.keys.KeyTable`, which the control
plane's own gateway authenticates with) equal to the valid ones: a change is written to the
store first and made in the table only once written, so a revocation takes effect on the very
next request, and when the store refuses (`StoreError`, e.g. locked by another process)
nothing changed and requests keep being authenticated from the table meanwhile. Every change
made fires `changed`, so the gateways' table follows (`llmgw.server.links.gatewaylinks` sends `valid()`
to each, as `gateway_keys()` says them).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Sequence

from llmgw.errors import shown
from llmgw.gateway.keys import KeyTable, token_hash
from llmgw.server.errors import ApiKeyError, ApiKeyExists, UnknownApiKey, UnknownTeam
from llmgw.server.store import KeyRow
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wakeup import Wakeup
from llmgw.wire.gateway_link import GatewayKey

TOKEN_PREFIX = "llmgw-"
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # matched whole (`fullmatch`)
KEY_NAME_RULE = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
# A key's models are catalog names (`llmgw.config`'s grammar for them), a key's own list bounded.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
MAX_MODELS = 256
# rate_per_minute and max_concurrency: far above what one gateway serves, far inside the 64-bit
# integers SQLite stores (a larger number would fail as the database's error, not the caller's).
MAX_LIMIT = 1_000_000_000


class KeyRing:
    def __init__(self, store: AsyncStore, *, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the table's, for its limits."""
        self.store = store
        self._valid: dict[str, KeyRow] = {r.name: r for r in store.at_open.api_keys if r.revoked_at is None}
        self.table = KeyTable(self.gateway_keys(), clock=clock)
        self.changed = Wakeup()  # a key was made or revoked (in memory: written first)

    # -- administration -------------------------------------------------------------------

    async def create(
        self,
        name: str,
        *,
        models: Sequence[str] = (),
        rate_per_minute: int = 0,
        max_concurrency: int = 0,
        team: str = "",
    ) -> tuple[KeyRow, str]:
        """A new key and its token; the token is not kept anywhere and cannot be shown again.
        `team`: the team it belongs to ("": none), which must exist (`UnknownTeam`)."""
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
        if not isinstance(team, str) or (team and not KEY_NAME.fullmatch(team)):
            raise ApiKeyError(f"team {shown(team)} is not a team's name: {KEY_NAME_RULE}")
        if team and not await self.store.has_team(team):
            known = ", ".join(t.name for t in await self.store.teams()) or "none"
            raise UnknownTeam(
                f"no team named {team!r} (teams: {known}); create it first with `llmgw ctl teams create {team}`"
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
            team=team,
        )
        if not await self.store.add_api_key(row):
            raise ApiKeyExists(
                f"a key named {name!r} exists already (revoked keys keep their names); choose another name"
            )
        self._valid[row.name] = row
        self.table.replace(self.gateway_keys())
        self.changed.fire()
        return row, token

    async def revoke(self, name: str) -> None:
        if not await self.store.revoke_api_key(name):
            known = ", ".join(r.name for r in await self.store.api_keys()) or "none"
            raise UnknownApiKey(f"no API key named {name!r} (keys: {known}); see `llmgw ctl keys list`")
        self._valid.pop(name, None)
        self.table.replace(self.gateway_keys())
        self.changed.fire()

    def valid(self) -> list[KeyRow]:
        """The valid keys, as requests are checked against them now."""
        return list(self._valid.values())

    async def rows(self) -> list[KeyRow]:
        return await self.store.api_keys()

    def gateway_keys(self) -> tuple[GatewayKey, ...]:
        """The valid keys as a gateway holds them, by name."""
        return tuple(gateway_key(r) for _, r in sorted(self._valid.items()))


def gateway_key(row: KeyRow) -> GatewayKey:
    return GatewayKey(
        name=row.name,
        token_sha256=row.token_sha256,
        models=row.models,
        rate_per_minute=row.rate_per_minute,
        max_concurrency=row.max_concurrency,
        team=row.team,
    )


def key_view(row: KeyRow) -> dict:
    return {
        "name": row.name,
        "team": row.team,
        "models": list(row.models),
        "rate_per_minute": row.rate_per_minute,
        "max_concurrency": row.max_concurrency,
        "created_at": row.created_at,
        "revoked_at": row.revoked_at,
        "token_sha256_prefix": row.token_sha256[:12],
    }
