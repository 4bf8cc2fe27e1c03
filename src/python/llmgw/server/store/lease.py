"""The leader's lease in a PostgreSQL store shared by several control planes, and the fence every
write of the leader passes.

One row, `leader_lease` (migration 2): who holds the lease (a token naming one control plane's
term of leading), where that control plane is reached (`agent_url`, `admin_url`), the epoch, and
when the lease expires, in unix seconds of the DATABASE's clock (`clock_timestamp()`): the control
planes' own clocks decide nothing, so a machine whose clock is wrong cannot take a lease early or
keep one late.

- `acquire`: one UPDATE that succeeds only if the lease has expired (or was never taken) and
  the store's schema is not newer than the taker knows, and adds one to the epoch: every taking
  begins a new term, even by the process that held it last.
- `renew`: one UPDATE that succeeds only while the lease is still this term's (its epoch) and
  has not expired. Once it has lapsed it is gone, even if no one took it yet: the holder steps
  down, and may take it again, as a new term, reading the state afresh.
- `release`: a holder that stops ends its lease at once, so that a standby takes over at its
  next try instead of waiting out the TTL.
- `Fence.check`: the first statement of every write of a leader (`Store._write`): the lease row
  read `FOR SHARE` inside the write's transaction, and the write refused (`NotLeader`) unless
  the epoch is still this term's. The row lock makes the check and the COMMIT one step as far as
  a taking goes: `acquire`'s UPDATE waits for a write that has checked, so a write commits
  before a takeover or is refused after it, never both.

A session stopped in the middle of a write (a paused process) would hold that row lock, and the
store's write lock, for as long as it stays stopped: a running control plane's connections set
`idle_in_transaction_session_timeout` (`postgres.PostgresBackend`, `idle_timeout_s`), so
PostgreSQL ends such a session and rolls its transaction back within half a lease.

The lease's own statements run alone, in autocommit, never under the store's write lock: a
renewal does not queue behind the writes it keeps valid. `llmgw.server.leadership.leader` runs them.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from llmgw.server.errors import NotLeader
from llmgw.server.store import schema

# The database's clock as unix seconds: clock_timestamp() is the time of the statement's
# execution (now() would be its transaction's start).
NOW = "EXTRACT(EPOCH FROM clock_timestamp())"

READ = f"SELECT holder, agent_url, admin_url, epoch, expires_at - {NOW} FROM leader_lease WHERE id = 1"
SCHEMA = "SELECT COALESCE(MAX(version), 0) FROM schema_version"
ACQUIRE = (
    f"UPDATE leader_lease SET holder = ?, agent_url = ?, admin_url = ?, epoch = epoch + 1, expires_at = {NOW} + ? "
    f"WHERE id = 1 AND expires_at <= {NOW} AND ({SCHEMA}) <= ? "
    f"RETURNING holder, agent_url, admin_url, epoch, expires_at - {NOW}"
)
RENEW = (
    f"UPDATE leader_lease SET agent_url = ?, admin_url = ?, expires_at = {NOW} + ? "
    f"WHERE id = 1 AND epoch = ? AND holder = ? AND expires_at > {NOW} RETURNING epoch"
)
RELEASE = (
    f"UPDATE leader_lease AS l SET expires_at = {NOW} "
    "FROM (SELECT expires_at AS was FROM leader_lease WHERE id = 1) AS old "
    f"WHERE l.id = 1 AND l.epoch = ? AND l.holder = ? RETURNING l.epoch, old.was - {NOW}"
)
FENCE = "SELECT epoch, holder, admin_url FROM leader_lease WHERE id = 1 FOR SHARE"


class Statements(Protocol):
    """What the lease needs of a backend: one statement, its own transaction (autocommit)."""

    def rows(self, sql: str, args: Any = ()) -> list[tuple]: ...


class Tx(Protocol):
    def rows(self, sql: str, args: Any = ()) -> list[tuple]: ...


@attrs.frozen(kw_only=True)
class Holder:
    """A control plane as its lease names it: `id`, a token of this process's term (new at each
    taking is not needed: the epoch is), and where it is reached."""

    id: str
    agent_url: str
    admin_url: str


@attrs.frozen(kw_only=True)
class LeaseRow:
    """The lease as the database holds it; `remaining_s` by the database's clock (negative once
    it has expired)."""

    holder: str
    agent_url: str
    admin_url: str
    epoch: int
    remaining_s: float

    @property
    def held(self) -> bool:
        return bool(self.holder) and self.remaining_s > 0


def _row(found: tuple) -> LeaseRow:
    holder, agent_url, admin_url, epoch, remaining = found
    return LeaseRow(
        holder=holder, agent_url=agent_url, admin_url=admin_url, epoch=int(epoch), remaining_s=float(remaining)
    )


def read(db: Statements) -> LeaseRow:
    return _row(db.rows(READ)[0])


def acquire(db: Statements, holder: Holder, ttl_s: float, knows: int | None = None) -> LeaseRow | None:
    """Take the lease if it has expired and the store's schema is one this llmgw knows (at most
    version `knows`, by default `schema.LATEST`): the new term's row (its epoch one more), or
    None while another holds it or the schema is newer (`schema_version` says which: a control
    plane of an older llmgw never leads a store a newer one has migrated)."""
    knows = schema.LATEST if knows is None else knows
    found = db.rows(ACQUIRE, (holder.id, holder.agent_url, holder.admin_url, ttl_s, knows))
    return _row(found[0]) if found else None


def schema_version(db: Statements) -> int:
    return int(db.rows(SCHEMA)[0][0])


def renew(db: Statements, holder: Holder, epoch: int, ttl_s: float) -> bool:
    """Extend the lease of term `epoch` by `ttl_s` from now; False if it is no longer this
    term's or has expired (then it is lost). The holder's addresses are written again: a
    control plane that listens on a port of the system's choosing says it once it knows it."""
    return bool(db.rows(RENEW, (holder.agent_url, holder.admin_url, ttl_s, epoch, holder.id)))


def release(db: Statements, holder: Holder, epoch: int) -> float | None:
    """End term `epoch`'s lease now (a holder that stops): the seconds it had left (by the
    database's clock; what a standby would otherwise have waited), or None if it was no longer
    this term's."""
    found = db.rows(RELEASE, (epoch, holder.id))
    return max(0.0, float(found[0][1])) if found else None


@attrs.frozen(kw_only=True)
class Fence:
    """What every write of a store opened by a leader checks first: that the lease is still of
    `epoch`. `STANDBY`'s epoch is no lease's: a standby's store refuses every write."""

    epoch: int

    def check(self, tx: Tx, where: object) -> None:
        found = tx.rows(FENCE)
        epoch, _, admin_url = found[0] if found else (None, "", "")
        if epoch != self.epoch:
            raise NotLeader(where, epoch=self.epoch, found=epoch, leader_admin_url=admin_url)


STANDBY = Fence(epoch=-1)
