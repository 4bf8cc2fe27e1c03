"""The store's calls for who used what (issue 48): the usage ledger and the teams. `Store` and
`AsyncStore` take them in (`LedgerCalls`, `AsyncLedgerCalls`); the tables are schema 6's
(`llmgw.server.store.schema._v6`).

- `record_usage(instance, seq, rows)`: a gateway instance's report, added to `usage_hours` in the
  same transaction that records its `seq` in `usage_reports`; a report whose `seq` is not past
  the one recorded for its instance changes nothing (sent again after a reconnect or to a new
  leader: acknowledged, not counted twice). A gateway instance has one report unacknowledged at
  a time, so its sequence only rises and one row per instance is all that is kept.
- `usage(...)`: totals over a range of hours, grouped by any of key, team and model; `hour` is
  unix seconds of the hour's start (UTC), `since` and `until` cut at whole hours.
- Teams: a key belongs to one (`api_keys.team`, '' for none), named at its creation, which must
  exist then; a team is removed only while no valid key belongs to it (the ledger's rows keep
  the name of the team a key had when it was used, whatever becomes of the team).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from llmgw.server.errors import TeamExists, TeamInUse, UnknownTeam
from llmgw.wire.gateway_link import UsageRow

GROUPS = ("key", "team", "model")  # what `usage` may group by
_COLUMN = {"key": "key_name", "team": "team", "model": "model"}
# Reports older than this are forgotten with their instance (`prune_usage_reports`): an instance
# gone that long never sends them again.
REPORTS_KEPT_S = 30 * 86400


@attrs.frozen(kw_only=True)
class UsageTotal:
    """The ledger's totals for one group (a field not grouped by is "")."""

    key: str = ""
    team: str = ""
    model: str = ""
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@attrs.frozen(kw_only=True)
class TeamRow:
    name: str
    created_at: float
    keys: int = 0  # valid keys that belong to it


class LedgerCalls:
    """`Store`'s ledger and team calls (it provides `_write` and `_rows`)."""

    _write: Callable[[], contextlib.AbstractContextManager[Any]]
    _rows: Callable[..., list[tuple]]

    # -- the ledger -------------------------------------------------------------------------

    def record_usage(self, instance: str, seq: int, rows: Sequence[UsageRow], now: float | None = None) -> bool:
        """Add report `seq` of gateway `instance` to the ledger, once: True if it was added now,
        False if its `seq` was recorded already (nothing changed)."""
        now = time.time() if now is None else now
        with self._write() as tx:
            fresh = tx.execute(
                "INSERT INTO usage_reports (instance, seq, at) VALUES (?, ?, ?) "
                "ON CONFLICT (instance) DO UPDATE SET seq = excluded.seq, at = excluded.at "
                "WHERE usage_reports.seq < excluded.seq",
                (instance, seq, now),
            )
            if not fresh:
                return False
            tx.executemany(
                "INSERT INTO usage_hours (hour, key_name, team, model, requests, prompt_tokens, cached_tokens, "
                "completion_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (hour, key_name, team, model) DO UPDATE SET "
                "requests = usage_hours.requests + excluded.requests, "
                "prompt_tokens = usage_hours.prompt_tokens + excluded.prompt_tokens, "
                "cached_tokens = usage_hours.cached_tokens + excluded.cached_tokens, "
                "completion_tokens = usage_hours.completion_tokens + excluded.completion_tokens",
                [
                    (
                        r.hour,
                        r.key,
                        r.team,
                        r.model,
                        r.requests,
                        r.prompt_tokens,
                        r.cached_tokens,
                        r.completion_tokens,
                    )
                    for r in rows
                ],
            )
        return True

    def usage_report_seq(self, instance: str) -> int:
        """The last report of `instance` in the ledger (0: none)."""
        found = self._rows("SELECT seq FROM usage_reports WHERE instance = ?", (instance,))
        return int(found[0][0]) if found else 0

    def prune_usage_reports(self, before: float) -> int:
        """Forget the sequences of instances last heard of before `before`; how many."""
        with self._write() as tx:
            return tx.execute("DELETE FROM usage_reports WHERE at < ?", (before,))

    def usage(
        self,
        *,
        key: str = "",
        team: str = "",
        model: str = "",
        since: float | None = None,
        until: float | None = None,
        group: Sequence[str] = GROUPS,
    ) -> list[UsageTotal]:
        """Totals of the hours from the one holding `since` to the one before the one holding
        `until` (None: no bound), of `key`, `team` and `model` ("" any), grouped by `group` (a
        subset of GROUPS; () one total), largest first (prompt plus completion)."""
        bad = [g for g in group if g not in GROUPS]
        if bad:
            raise ValueError(f"cannot group by {bad}")
        where, args = [], []
        for field, value in (("key", key), ("team", team), ("model", model)):
            if value:
                where.append(f"{_COLUMN[field]} = ?")
                args.append(value)
        if since is not None:
            where.append("hour >= ?")
            args.append(int(since // 3600 * 3600))
        if until is not None:
            where.append("hour < ?")
            args.append(int(-(-until // 3600) * 3600))
        columns = [_COLUMN[g] for g in GROUPS if g in group]
        sums = (
            "SUM(requests), SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens), "
            "SUM(prompt_tokens) + SUM(completion_tokens)"
        )
        sql = f"SELECT {', '.join([*columns, sums])} FROM usage_hours"
        if where:
            sql += " WHERE " + " AND ".join(where)
        if columns:
            sql += f" GROUP BY {', '.join(columns)}"
        out = []
        for r in self._rows(sql, tuple(args)):
            named = dict(zip([g for g in GROUPS if g in group], r[: len(columns)], strict=True))
            counts = r[len(columns) :]
            if counts[0] is None:  # no row at all: SUM over nothing
                continue
            out.append(
                UsageTotal(
                    **named,
                    requests=int(counts[0]),
                    prompt_tokens=int(counts[1]),
                    cached_tokens=int(counts[2]),
                    completion_tokens=int(counts[3]),
                )
            )
        out.sort(key=lambda t: (-(t.prompt_tokens + t.completion_tokens), t.key, t.team, t.model))
        return out

    # -- teams ------------------------------------------------------------------------------

    def teams(self) -> list[TeamRow]:
        rows = self._rows(
            "SELECT t.name, t.created_at, "
            "(SELECT COUNT(*) FROM api_keys k WHERE k.team = t.name AND k.revoked_at IS NULL) "
            "FROM teams t ORDER BY t.name"
        )
        return [TeamRow(name=r[0], created_at=r[1], keys=int(r[2])) for r in rows]

    def add_team(self, name: str, now: float | None = None) -> None:
        """Record a new team; `TeamExists` if the name is taken."""
        with self._write() as tx:
            added = tx.execute(
                "INSERT INTO teams (name, created_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
                (name, time.time() if now is None else now),
            )
        if not added:
            raise TeamExists(f"a team named {name!r} exists already; see `llmgw ctl teams list`")

    def remove_team(self, name: str) -> None:
        """Forget a team: `UnknownTeam` if there is none of that name, `TeamInUse` (nothing
        changed) while a valid key belongs to it."""
        with self._write() as tx:
            if not tx.rows("SELECT 1 FROM teams WHERE name = ?", (name,)):
                raise UnknownTeam(f"no team named {name!r} (teams: {_names(tx)}); see `llmgw ctl teams list`")
            keys = [
                r[0]
                for r in tx.rows(
                    "SELECT name FROM api_keys WHERE team = ? AND revoked_at IS NULL ORDER BY name", (name,)
                )
            ]
            if keys:
                shown_keys = ", ".join(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")
                raise TeamInUse(
                    f"team {name!r} still has {len(keys)} valid key(s): {shown_keys}; revoke them first "
                    "(`llmgw ctl keys revoke NAME`), or keep the team"
                )
            tx.execute("DELETE FROM teams WHERE name = ?", (name,))

    def has_team(self, name: str) -> bool:
        return bool(self._rows("SELECT 1 FROM teams WHERE name = ?", (name,)))


def _names(tx: Any) -> str:
    return ", ".join(r[0] for r in tx.rows("SELECT name FROM teams ORDER BY name")) or "none"


class AsyncLedgerCalls:
    """`AsyncStore`'s: each call of `LedgerCalls` off the loop (it provides `_run` and `_store`)."""

    _run: Callable[..., Any]
    _store: Any

    async def record_usage(self, instance: str, seq: int, rows: Sequence[UsageRow]) -> bool:
        return await self._run(self._store.record_usage, instance, seq, rows)

    async def prune_usage_reports(self, before: float) -> int:
        return await self._run(self._store.prune_usage_reports, before)

    async def usage(self, **query: Any) -> list[UsageTotal]:
        return await self._run(lambda: self._store.usage(**query))

    async def teams(self) -> list[TeamRow]:
        return await self._run(self._store.teams)

    async def add_team(self, name: str) -> None:
        await self._run(self._store.add_team, name)

    async def remove_team(self, name: str) -> None:
        await self._run(self._store.remove_team, name)

    async def has_team(self, name: str) -> bool:
        return await self._run(self._store.has_team, name)


def iter_groups(group: str) -> Iterator[str]:
    """The fields of a `group` parameter ("key,model"), checked."""
    for part in (p.strip() for p in group.split(",")):
        if part:
            if part not in GROUPS:
                raise ValueError(part)
            yield part
