"""`llmgw server` on a PostgreSQL store that several control planes share: a standby until it
holds the lease, the leader while it does, a standby again once it has lost it.

    standby --(lease taken: a new term)--> leader --(term lost)--> standby --> ...

- As a standby (`llmgw.server.leadership.standby`) it serves both ports, answering agents, gateways and
  `llmgw ctl` with where the leader is, and tries to take the lease every `[store]
  lease_renew_s` (`leadership.LeaseKeeper.acquire`); what a leader reads besides the store is
  held ready (`Warm`).
- Holding the lease, it closes the standby's listeners and opens a `ControlPlane` as a restart
  would: placements, nodes, keys and catalog read from the store afresh (every write of that
  store checks the term's epoch), agents and their engines adopted as they reconnect (no replica
  is restarted), then it reconciles. `keep` renews the lease.
- The term ends (`Term.lose`: a renewal refused or overdue, a write refused by the fence): the
  control plane steps down AT ONCE, in this process. Why not exit and let systemd start it
  again: a leader that lost its lease through no fault of its own (a pause, PostgreSQL away for
  a few seconds) is a healthy process, and a restart would also drop its gateway workers'
  requests in flight and depend on an init system being there to start it again (containers,
  `llmgw server` in a shell). What must not outlive the term does not: from the moment the
  term is over the plane pushes nothing, accepts no link (it redirects), and its store writes
  are refused; its agents' and gateways' links are closed with `not_leader`, so they go to the
  next control plane; then the plane is cancelled as at a stop (its front's requests in flight
  finish, bounded) and every piece of its state goes with it. The standby that follows is
  built afresh, and so is the next term's plane: nothing of the old term's memory survives
  into the next.
- The store's schema is migrated by the leader only (`llmgw.server.store.backend.migrate`): a
  control plane of a newer llmgw started while one of an older llmgw leads stands by without
  migrating (`schema_at_start`), and migrates the store in its plane's open once it holds the
  lease, under its term's fence; one of an older llmgw never takes the lease of a store a newer
  one has migrated (`LeaseKeeper.newer_schema`), and refuses to start on one. An upgrade is
  thus: the standbys first, then the leader stopped (docs/high-availability.md, "Upgrading").
- Stopped (SIGTERM) while leading, it releases the lease, so a standby takes over at its next
  try rather than a TTL later.

SIGHUP has one receiver for the process's life: a leader reloads (`Operations.reload`), a
standby reads server.toml again and keeps it for its next term.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from llmgw import paths
from llmgw.config import ServerConfig, load_server_config
from llmgw.errors import LlmgwError
from llmgw.http.listeners import ConnectionStats
from llmgw.log import get_logger
from llmgw.server.errors import StoreError
from llmgw.server.front import Bound, split_hostport
from llmgw.server.leadership.leader import LeaseKeeper, Term, new_holder_id
from llmgw.server.leadership.standby import Leader, StandbyFront, StandbyListener, StandbyStore, serve_standby
from llmgw.server.leadership.warm import Warm, read_warm
from llmgw.server.nodes.artifacts import Artifacts, artifacts_dir
from llmgw.server.nodes.releases import Releases
from llmgw.server.store import open_backend, schema
from llmgw.server.store.asyncstore import BUSY_TIMEOUT_S, AsyncStore
from llmgw.server.store.backend import Backend, current_version, migrate
from llmgw.server.store.lease import Holder
from llmgw.wire import agent_link as w

log = get_logger("llmgw.seat")

_WILDCARDS = ("", "0.0.0.0", "::")
CLOSE_TIMEOUT_S = 10.0  # the old term's store connection, closed once its last call ended


def advertised(config: ServerConfig, bound: Bound | None = None) -> tuple[str, str]:
    """This control plane's agent port (its URL) and admin URL as others reach it: `[server] agent_url`
    and `admin_url`, else made from `advertise` (its first address) or the listener's own
    address, and the port it is bound to (`bound`) or configured with."""
    server = config.server
    fallback = server.advertise[0] if server.advertise else socket.gethostname()
    agent_host, agent_port = split_hostport(server.agent_listen)
    http_host, http_port = split_hostport(server.http_listen)
    if bound is not None:
        agent_port, http_port = bound.agent_address[1], bound.http_address[1]
    agent_url = (
        server.agent_url or f"wss://{_url_host(fallback if agent_host in _WILDCARDS else agent_host)}:{agent_port}"
    )
    admin_url = (
        server.admin_url or f"http://{_url_host(fallback if http_host in _WILDCARDS else http_host)}:{http_port}"
    )
    return agent_url, admin_url


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class LinkEnd(Protocol):
    async def close_all(self, code: str, message: str) -> int: ...


class Plane(Protocol):
    """What the seat needs of a control plane (`llmgw.server.app.ControlPlane`), which it does
    not import: the root wires them (`serve_control_plane` gives `open_plane`)."""

    config: ServerConfig
    agent_links: LinkEnd
    gateway_feed: LinkEnd

    @property
    def store(self) -> AsyncStore: ...

    @property
    def operations(self) -> Any: ...

    async def serve(self, *, task_status: trio.TaskStatus[Bound] = ...) -> None: ...


# (config, warm, term, redirect) -> a control plane opened for that term, not yet serving
OpenPlane = Callable[[ServerConfig, Warm, Term, Callable[[], w.Redirect]], Plane]


@attrs.define(kw_only=True, eq=False)
class Seat:
    """One `llmgw server` process's place among the control planes of a shared store."""

    config: ServerConfig
    state_dir: Path
    config_path: Path | None
    warm: Warm
    keeper: LeaseKeeper
    open_plane: OpenPlane
    plane: Plane | None = None  # while leading
    term: Term | None = None  # while leading
    terms: int = 0  # terms led by this process

    # -- where the leader is -----------------------------------------------------------------

    def leader(self) -> Leader:
        """The leader as the lease was last read (by this standby's tries to take it)."""
        row = self.keeper.seen
        ttl = self.config.store.lease_ttl_s
        if row is None:
            return Leader(why_none="cannot read the lease now (the store does not answer)", retry_after_s=ttl)
        if not row.held and self.keeper.newer_schema:
            why = (
                f"no control plane leads: the store's schema (version {self.keeper.newer_schema}) is newer than this "
                "control plane's llmgw, which cannot lead it; one of the newer llmgw takes the lease when it runs"
            )
            return Leader(why_none=why, retry_after_s=ttl)
        if not row.held or row.holder == self.keeper.holder.id:
            return Leader(why_none="no control plane leads at the moment (a takeover is under way)", retry_after_s=ttl)
        return Leader(agent_url=row.agent_url, admin_url=row.admin_url, epoch=row.epoch)

    def redirect(self) -> w.Redirect:
        return self.leader().redirect()

    # -- the seat's life -----------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self._serve_sighup)
            first = True
            while True:
                term = await self._stand_by(task_status if first else trio.TASK_STATUS_IGNORED)
                first = False
                await self._lead(term)

    async def _stand_by(self, task_status: trio.TaskStatus[Bound]) -> Term:
        """Serve as a standby until the lease is taken; the term it begins."""
        config = self.config
        store = StandbyStore(
            partial(AsyncStore.open_standby, self.state_dir, config.store, busy_timeout_s=BUSY_TIMEOUT_S),
            retry_s=config.store.lease_renew_s,
        )
        await store.open()
        try:
            listener = StandbyListener(
                leader=self.leader,
                heartbeat_interval_s=config.server.heartbeat_interval_s,
                store=store,
                artifact_store=Artifacts(artifacts_dir(self.state_dir)),
                release_files=Releases(
                    directory=Path(config.release.dir) if config.release.dir else None,
                    running=self.warm.running,
                    serve=config.release.serve,
                ),
                limits=config.http,
                max_connections=config.http.max_agent_connections,
            )
            front = StandbyFront(admin_token=self.warm.admin_token, leader=self.leader, tries=lambda: self.keeper.tries)
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(
                    _serve_standby_with_url,
                    config,
                    listener,
                    front,
                    self.warm,
                    self.state_dir,
                )
                self.keeper.advertise(*advertised(config, bound))
                log.info(
                    "server_standby",
                    agents=f"{bound.agent_address[0]}:{bound.agent_address[1]}",
                    admin_url=bound.admin_url,
                    state_dir=str(self.state_dir),
                    lease_ttl_s=config.store.lease_ttl_s,
                )
                task_status.started(bound)
                term = await self.keeper.acquire()
                nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT_S) as closing:
                closing.shield = True
                await store.aclose()
        return term

    async def _lead(self, term: Term) -> None:
        """Lead for `term`, until it is lost (then step down) or the process stops (then release it)."""
        self.terms += 1
        log.info("leadership_taken", epoch=term.epoch, holder=self.keeper.holder.id, terms=self.terms)
        try:
            plane = self.open_plane(self.config, self.warm, term, self.redirect)
        except StoreError as exc:
            # PostgreSQL went away between the taking and the reading: not this process's fault.
            term.lose(f"the store failed as this control plane opened it: {exc}")
            log.warning("leadership_lost", epoch=term.epoch, reason=term.lost_reason, now="a standby")
            return
        self.plane, self.term = plane, term
        stopped = False
        try:
            with trio.CancelScope() as leading:
                async with trio.open_nursery() as nursery:

                    def lost(reason: str) -> None:
                        if not leading.cancel_called:
                            nursery.start_soon(self._step_down, plane, term, leading)

                    term.on_lost(lost)
                    await nursery.start(self.keeper.keep, term)
                    bound = await nursery.start(plane.serve)
                    self.keeper.advertise(*advertised(self.config, bound))
                    await trio.sleep_forever()
        except BaseException:
            stopped = True  # cancelled from outside (the process stops), or a failure
            raise
        finally:
            self.plane, self.term = None, None
            self.config = plane.config  # a reload's, for the next term
            with trio.CancelScope(shield=True):
                if stopped and term.leading():
                    await self.keeper.release(term)
                with trio.move_on_after(CLOSE_TIMEOUT_S) as closing:
                    await plane.store.aclose()
                if closing.cancelled_caught:
                    log.warning("store_not_closed", after_s=CLOSE_TIMEOUT_S, reason="a call of the old term still runs")

    async def _step_down(self, plane: Plane, term: Term, leading: trio.CancelScope) -> None:
        log.warning("leadership_lost", epoch=term.epoch, reason=term.lost_reason, now="a standby")
        message = f"this control plane leads no more ({term.lost_reason}); the agent goes to the next control plane"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(plane.agent_links.close_all, w.NOT_LEADER, message)
            nursery.start_soon(plane.gateway_feed.close_all, w.NOT_LEADER, message)
        leading.cancel()

    async def _serve_sighup(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            task_status.started()
            async for _ in signals:
                try:
                    await self._reload()
                except LlmgwError as exc:
                    log.error("reload_failed", reason=str(exc), kept="the running configuration")
                except Exception:
                    log.exception("reload_failed", kept="the running configuration")

    async def _reload(self) -> None:
        if self.plane is not None:
            await self.plane.operations.reload()
            self.config = self.plane.config
        elif self.config_path is not None:
            self.config = load_server_config(self.config_path)
            log.info("reloaded", config=str(self.config_path), models=len(self.config.models), kept="for the next term")


async def _serve_standby_with_url(
    config: ServerConfig,
    listener: StandbyListener,
    front: StandbyFront,
    warm: Warm,
    state_dir: Path,
    *,
    task_status: trio.TaskStatus[Bound],
) -> None:
    """`serve_standby`, with admin.url written while it serves (`llmgw ctl` finds it there)."""
    url_file = paths.admin_url_path(state_dir)
    serve = partial(serve_standby, ssl_context=warm.ssl_context, stats=ConnectionStats())
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(serve, config, listener, front)
        try:
            paths.write_public(url_file, bound.admin_url + "\n")
            task_status.started(bound)
            await trio.sleep_forever()
        finally:
            url_file.unlink(missing_ok=True)


async def serve_seat(
    config: ServerConfig,
    state_dir: Path,
    config_path: Path | None = None,
    *,
    open_plane: OpenPlane,
    task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`llmgw server` on a PostgreSQL store (the module docstring): started once it serves as a
    standby (it may lead a moment later). `open_plane` opens the control plane of a term."""
    warm = read_warm(config, state_dir)
    agent_url, admin_url = advertised(config)
    lease_db = open_backend(
        state_dir, config.store, busy_timeout_s=config.store.lease_renew_s, server=True, migrations=False
    )
    try:
        schema_at_start(lease_db)
        keeper = LeaseKeeper(
            lease_db,
            Holder(id=new_holder_id(), agent_url=agent_url, admin_url=admin_url),
            ttl_s=config.store.lease_ttl_s,
            renew_s=config.store.lease_renew_s,
        )
        seat = Seat(
            config=config, state_dir=state_dir, config_path=config_path, warm=warm, keeper=keeper, open_plane=open_plane
        )
        await seat.serve(task_status=task_status)
    finally:
        lease_db.close()


def schema_at_start(db: Backend) -> None:
    """The store's schema as this control plane starts on it: a newer llmgw's is refused
    (`StoreSchemaNewer`: this process cannot lead it, nor check the certificates of what it
    would serve); one without the lease yet (a new database) is migrated now, as no control
    plane can be leading it; one behind this llmgw's is left alone, said once: it is migrated
    by this process when it takes the lease (`ControlPlane.open` under its term's fence), not
    under a leader of the older llmgw that may be running."""
    found = current_version(db)
    if found < schema.LEASED:
        migrate(db)
    elif found < schema.LATEST:
        log.warning(
            "store_schema_behind",
            store=str(db.path),
            found=found,
            latest=schema.LATEST,
            then="a control plane of an older llmgw may lead it: this one migrates it when it takes the lease",
        )
