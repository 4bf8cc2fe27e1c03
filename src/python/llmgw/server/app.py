"""The control plane process: its parts wired together (`ControlPlane`), what it starts from
read in order (`ControlPlane.open`), and its services started in order (`ControlPlane.serve`).

`open` does all the reading, synchronously and before anything runs: the state directory's
permissions first (private files open to others are refused before use), then the certificate
authority (a missing CA is the first thing said), the agents' TLS context, the admin credential
and this llmgw's own release file (`running_release`: what agents may fetch from the mirror) --
together `Warm`, which a standby holds ready -- then the store (checked: a damaged database
stops the start there) and the engine-key secret. The constructor takes what was opened, does
no I/O and wires the parts (`ControlPlane`'s docstring names them). Where several control planes
share a PostgreSQL store, `llmgw.server.leadership.seat` opens one only once it holds the lease.

`serve` is the root: each service is a `serve_x(..., *, task_status)` started with
`nursery.start`, so each is ready before the next starts, and `task_status` gets the bound
addresses once both ports accept connections. The last is the front on `http_listen`
(`llmgw.server.gateways.own`): the gateway's worker processes, or with `gateway_workers = 0` one
gateway worker on this loop; either way a request enters at `GatewayWorker.handle`. Every
background loop runs under `llmgw.supervision.Background`: a failure after start is logged with
its traceback and the loop started again with backoff; only a failure at start ends the process.
Drains are jobs of their own service (`llmgw.server.state.drains`). Shutdown is cancellation, of the
front first: its requests in flight finish (bounded) while the rest still runs, then the rest
stops.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from functools import partial
from pathlib import Path

import trio

from llmgw import paths
from llmgw.config import ServerConfig, storeurl
from llmgw.gcpolicy import freeze_start_objects
from llmgw.http.fdlimits import raise_fd_limit
from llmgw.http.listeners import ConnectionStats
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.http.server import bound_address
from llmgw.log import get_logger
from llmgw.looplag import LagMonitor, StallClock, StepTimer, serve_loop_lag
from llmgw.pki.ca import CA
from llmgw.releasefiles import Running
from llmgw.server import activation
from llmgw.server.admin import audit
from llmgw.server.admin.models import HubModels
from llmgw.server.admin.ownroutes import OwnRoutes, restarts_metric
from llmgw.server.admin.privatesocket import serve_admin_socket
from llmgw.server.front import Bound, cannot_listen, split_hostport
from llmgw.server.gateways.own import Gateways
from llmgw.server.gateways.workers import worker_count
from llmgw.server.leadership.leader import Term
from llmgw.server.leadership.seat import serve_seat
from llmgw.server.leadership.warm import Warm, read_warm
from llmgw.server.lifecycle import cancel_at_stop, serve_admin_url, serve_reload_on_sighup
from llmgw.server.links.agentlinks import AgentLinks
from llmgw.server.links.agentlistener import AgentListener
from llmgw.server.links.tracker import Tracker
from llmgw.server.nodes.artifacts import Artifacts, artifacts_dir
from llmgw.server.nodes.mirror import RETRY_S, fill_mirror
from llmgw.server.nodes.releases import Releases
from llmgw.server.nodes.weightsorigin import WeightsOrigin
from llmgw.server.settings import Settings
from llmgw.server.state import views
from llmgw.server.state.autoscale import (
    Autoscaler,
    initial_count,
    make_room,
    parked_count,
    parks,
    pick_to_retire,
    ready_count,
    wake,
)
from llmgw.server.state.catalogtimes import CatalogTimes
from llmgw.server.state.changes import Changes
from llmgw.server.state.desired import DesiredStates
from llmgw.server.state.drains import Drains
from llmgw.server.state.intent import NodeIntent
from llmgw.server.state.liveness import Reconciler
from llmgw.server.state.moves import Moves
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas, seal_at_start, sealed_keys
from llmgw.server.state.rollouts import Rollouts
from llmgw.server.state.staging import Staging
from llmgw.server.state.versions import engine_version
from llmgw.server.state.weights import catalog_files
from llmgw.server.store import keyseal
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.server.store.keyseal import KeySeal
from llmgw.server.store.lease import Fence
from llmgw.supervision import Background
from llmgw.wire import agent_link as w

log = get_logger("llmgw.server")


class ControlPlane:
    """The control plane's parts, each given what it needs. Each piece of state has one owner: the
    configuration `settings`, the nodes as agents report them `registry`, the operator's intent for
    them `intent`, the placements `replicas`, the reconciler `reconciler` (the one that pushes
    desired state after a change), moves and drains, the API keys `keys`. The gateways' side is
    `gateways` (their rotation `endpoints`, their link `gateway_feed`, the front); the admin API's
    and the page's is `own_routes` (its roles `views`, `operations`, `page`, `admin`)."""

    def __init__(
        self,
        config: ServerConfig,
        state_dir: Path,
        config_path: Path | None = None,
        *,
        ca: CA,
        ssl_context: ssl.SSLContext,
        store: AsyncStore,
        key_seal: KeySeal,
        admin_token: str,
        running: Running | None,
        gateway_workers: int | str = 0,
        term: Term | None = None,
        redirect: Callable[[], w.Redirect] | None = None,
    ) -> None:
        """Takes what `open` read (`running`: this llmgw's own release file, None for a
        development build); does no I/O. `gateway_workers`: how many gateway worker processes
        serve http_listen when server.toml does not say (`llmgw server`: "auto", `llmgw up`: 1;
        0, one gateway worker on this loop, is for tests and embedding). `term`: the lease this control
        plane leads by, when several share a PostgreSQL store (`llmgw.server.leadership.seat`; None: it
        leads alone); once the term is over it pushes nothing more and answers new links with
        `redirect()`, where the leader is."""
        self.term = term
        leading = term.leading if term is not None else _always
        self.settings = Settings(config, config_path)  # replaced by a reload: read `config` at each use
        self.workers = worker_count(config.server.gateway_workers, gateway_workers)  # read at start only
        self.state_dir = state_dir
        self.ca = ca
        self.ssl_context = ssl_context  # the agent port's: the server certificate, agents' CA
        self.store = store
        self.changes = Changes()
        self.staging = Staging()  # models staged to nodes ahead of their replicas (`ctl models stage`)
        # Liveness is judged on the time the loop could read its links (`llmgw.looplag`): after a
        # stall, every node's deadline moves by its length.
        clock = StallClock(hold_s=config.server.heartbeat_interval_s)
        self.loop_lag = LagMonitor()  # this process's event-loop lag, for /metrics and the log
        # Every task step timed, where server.toml's [debug] measure_steps asks (added in `serve`).
        self.step_timer = StepTimer() if config.debug.measure_steps else None
        self.registry = NodeRegistry(
            heartbeat_ttl_s=config.server.heartbeat_ttl_s,
            started_at=clock.now(),
            reconnect_grace_s=config.server.reconnect_grace_s,
            clock=clock,
        )
        for row in store.at_open.nodes:  # operator intent survives a restart; agents rebuild the rest
            self.registry.know(row.node_id, address=row.address, cordoned=row.cordoned, draining=row.draining)
        self.intent = NodeIntent(store=store, registry=self.registry, changes=self.changes)
        self.connections = ConnectionStats()
        self.agent_links = AgentLinks(
            registry=self.registry,
            store=store,
            heartbeat_interval_s=config.server.heartbeat_interval_s,
            desired_state=self.desired_state,
            on_change=self.changes.node_changed,
            on_replicas=self._replicas_reported,
            on_weights=self._weights_reported,
            silence_timeout_s=config.server.heartbeat_ttl_s,
            heartbeat_max_rate=config.server.heartbeat_max_rate,
            leading=leading,
            redirect=redirect,
        )
        # With [downloads] weights_origin = "control_plane", the control plane downloads each weights
        # file nodes need and seeds it to them (nodes without internet): the tracker names it.
        self.weights_origin = (
            WeightsOrigin(
                state_dir / "weights",
                lambda: catalog_files(
                    self.config.models, max_weights_bytes=self.config.downloads.max_weights_bytes, hub=self.config.hub
                ),
            )
            if config.downloads.weights_origin == "control_plane"
            else None
        )
        # The agent port: its TLS, budgets and routes; the links' requests go to their ends.
        self.agent_port = AgentListener(
            store=store,
            artifact_store=Artifacts(artifacts_dir(state_dir)),
            release_files=Releases(
                directory=Path(config.release.dir) if config.release.dir else None,
                running=running,
                serve=config.release.serve,
            ),
            stats=self.connections,
            limits=config.http,
            max_connections=config.http.max_agent_connections,
            agents=self.agent_links,
            mirror_changed=self.agent_links.mirror_changed,
            weights_tracker=Tracker(self.registry, lambda: self.registry.clock.now(), origin=self.weights_origin),
        )
        # The catalog as placed and routed: each model with min_replicas/max_replicas at the count
        # its load wants (the autoscaler's), the others as configured; read at each use.
        known_models = set(
            store.at_open.catalog
        )  # in the catalog before this start: one with no replica was scaled to zero
        self.autoscaler = Autoscaler(
            settings=lambda: self.config.autoscale,
            catalog=lambda: self.config.models,
            initial=lambda m: initial_count(m, self.replicas, known=m.name in known_models),
            reports=lambda: self.gateways.model_loads(),
            heard=lambda: self.gateways.reported(),
            changed=self.changes.node_changed,
            retire=lambda rid, then: self._retire_for_scale(rid, then),
            pick=lambda model: pick_to_retire(self.replicas, model, self.moves.retiring, self.gateways.outstanding),
            clock=lambda: self.registry.clock.now(),
            ready=lambda model: ready_count(self.replicas, self.registry, model),
            room=lambda model: make_room(
                model,
                replicas=self.replicas,
                policy=self.autoscaler.policy,
                catalog=self.autoscaler.models(),
                now=self.registry.clock.now(),
                outstanding=self.gateways.outstanding,
                retiring=self.moves.retiring,
            ),
            park=lambda rid, then: self._park_for_scale(rid, then),
            parks=lambda m: parks(m, self.replicas),
            parked=lambda model: parked_count(self.replicas, model),
            wake=lambda model, n: wake(self.replicas, self.changes, model, n),
        )
        models = self.autoscaler.models
        self.replicas = Replicas(
            store,
            self.registry,
            models,
            partial(views.cluster_fabrics, self.registry),
            key_seal,
            engine_version=lambda engine: engine_version(self.config.engines, engine),
        )
        self.reconciler = Reconciler(
            self.registry, self.replicas, self.changes, self.push, connected=lambda: list(self.agent_links.links)
        )
        retiring: set[str] = set()  # written by moves, read by the gateway's endpoints
        # When each model entered the catalog: the store's, and the models new since noted.
        self.catalog_times = CatalogTimes(store.at_open.catalog, store.record_catalog)
        self.catalog_times.note(m.name for m in config.models)
        # The gateways: their rotation, keys and link, and what serves http_listen (their workers, or one on this loop).
        self.gateways = Gateways(
            config,
            workers=self.workers,
            state_dir=state_dir,
            ca=ca,
            store=store,
            registry=self.registry,
            replicas=self.replicas,
            models=models,
            retiring=retiring,
            changes=self.changes,
            created=self.catalog_times.created,
            leading=leading,
            redirect=redirect,
            plane_routes=self.handle_own,
            connections=self.connections,
        )
        self.endpoints, self.keys, self.gateway_feed = self.gateways.endpoints, self.gateways.keys, self.gateways.feed
        self.gateway = self.gateways.gateway  # the gateway on this loop (`gateway_workers = 0`), else None
        self.agent_port.gateways = self.gateway_feed
        # Drains and spreading: replicas moved without an outage, one move at a time.
        self.moves = Moves(
            replicas=self.replicas,
            registry=self.registry,
            quiesce=self.gateways.quiesce,
            outstanding=self.gateways.outstanding,
            changes=self.changes,
            push=self.agent_links.push_desired_state,
            draining=lambda: self.drains.running(),
            retiring=retiring,
        )
        self.drains = Drains(registry=self.registry, intent=self.intent, replicas=self.replicas, moves=self.moves)
        # A changed model's replicas replaced one at a time, by the same moves.
        self.rollouts = Rollouts(replicas=self.replicas, moves=self.moves, registry=self.registry, changes=self.changes)
        self.background = Background(log)  # its `restarts` are for /metrics
        own_metrics = [
            self.connections.render,
            partial(restarts_metric, self.background.restarts, leading),
            lambda: self.loop_lag.render(trio.current_time()),
            self.registry.clock.render,
            self.agent_links.render_metrics,
            self.moves.render_metrics,
            self.autoscaler.render_metrics,
            self.gateways.usage.render,
        ]
        if self.step_timer is not None:
            own_metrics.append(self.step_timer.render)
        # The models added while the cluster runs (`llmgw ctl models add`): the store's, into the catalog.
        self.hub_models = HubModels(
            settings=self.settings,
            store=store,
            key_seal=key_seal,
            changes=self.changes,
            reconciler=self.reconciler,
            node_views=lambda: self.replicas.node_views(self.registry.clock.now()),
            catalog_times=self.catalog_times,
            staging=self.staging,
            retry=self.rollouts.retry,
        )
        self.hub_models.load(store.at_open.hub_models)
        self.catalog_times.note(m.name for m in self.config.models)
        # The admin API, /metrics and the cluster page, and the roles behind them.
        self._http_port = split_hostport(config.server.http_listen)[1]  # the port bound, once it is
        self.own_routes = own = OwnRoutes(
            config=lambda: self.config,
            http_port=lambda: self._http_port,
            settings=self.settings,
            store=store,
            registry=self.registry,
            replicas=self.replicas,
            intent=self.intent,
            drains=self.drains,
            reconciler=self.reconciler,
            agent_links=self.agent_links,
            gateways=self.gateways,
            releases=self.agent_port.releases,
            changes=self.changes,
            catalog_times=self.catalog_times,
            admin_token=admin_token,
            ca=ca,
            own_metrics=own_metrics,
            models=self.hub_models,
        )
        self.views, self.operations, self.page, self.admin = own.views, own.operations, own.page, own.admin
        self.views.scale_of = lambda m: self.autoscaler.policy.view(m)
        self.views.rollouts = self.rollouts.views
        self.http_refusals = own.refusals
        # What each node is told to have, and when one may build llama.cpp (the mirror's cue).
        self.desired = DesiredStates(
            config=lambda: self.config,
            registry=self.registry,
            replicas=self.replicas,
            artifacts=self.agent_port.artifacts,
            releases=self.agent_port.releases,
            changes=self.changes,
            node_coming=lambda: self.operations.node_coming,
            staging=self.staging,
        )
        self.shutdown_drain_s = 30.0  # on stop: how long requests in flight may take to finish
        self.mirror_retry_s = RETRY_S  # a mirror fetch that failed is tried again after this long

    async def _retire_for_scale(self, replica_id: str, then: Callable[[], None]) -> None:
        """A scale-down's retirement: a move's last steps (out of rotation, its requests finish,
        it stops), one at a time with the drains and spreading (`Moves.lock`)."""
        async with self.moves.lock:
            await self.moves.retire(replica_id, None, then)

    async def _park_for_scale(self, replica_id: str, then: Callable[[], None]) -> None:
        """A scale-down that parks: out of rotation, its requests finish, its engine parks."""
        async with self.moves.lock:
            await self.moves.park(replica_id, then)

    @property
    def config(self) -> ServerConfig:
        """The configuration running now (`settings.current`)."""
        return self.settings.current

    @classmethod
    def open(
        cls,
        config: ServerConfig,
        state_dir: Path,
        config_path: Path | None = None,
        *,
        gateway_workers: int | str = 0,
        warm: Warm | None = None,
        term: Term | None = None,
        redirect: Callable[[], w.Redirect] | None = None,
    ) -> ControlPlane:
        """Read what the control plane starts from, in the order the module docstring gives.
        `warm`: what a standby read already (`read_warm`); the store is read here whatever it is.
        `term`: the lease it leads by (`ControlPlane`): every write of its store checks the
        term's epoch (`llmgw.server.store.lease.Fence`), and one refused ends the term."""
        warm = warm or read_warm(config, state_dir)
        fence = Fence(epoch=term.epoch) if term is not None else None
        store = AsyncStore.open(state_dir, config.store, fence=fence)
        if term is not None:
            store.on_not_leader = lambda exc: term.lose(f"a write was refused: {exc}")
        try:
            key_seal = keyseal.load(state_dir, sealed_keys=sealed_keys(store.at_open.placements))
            plane = cls(
                config,
                state_dir,
                config_path,
                ca=warm.ca,
                ssl_context=warm.ssl_context,
                store=store,
                key_seal=key_seal,
                admin_token=warm.admin_token,
                running=warm.running,
                gateway_workers=gateway_workers,
                term=term,
                redirect=redirect,
            )
            seal_at_start(store, plane.replicas, paths.engine_keys_secret_path(state_dir))
        except BaseException:
            store.close()
            raise
        return plane

    # -- the services -----------------------------------------------------------------------

    async def serve(
        self,
        *,
        reload_on_sighup: bool = False,
        private_socket: bool = False,
        task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run until cancelled. `reload_on_sighup`: a SIGHUP reads server.toml again (`llmgw
        server`; tests running several control planes in one process leave it off).
        `private_socket`: serve `handle_own` on STATE_DIR/run/admin.sock as well, for gateway
        workers to relay to (`llmgw.server.admin.privatesocket`); always, with workers of its own.

        What serves `http_listen` (the front) is `gateway_workers` processes, or with 0 one gateway
        worker on this loop (`llmgw.server.gateways.own`). It stops first: the requests in flight finish, for at most the drain, while the rest still
        runs — the workers' links, the private socket they relay to, the cluster's view — and
        the rest stops once it has."""
        front = trio.CancelScope()
        async with trio.open_nursery() as guard:
            guard.start_soon(cancel_at_stop, front)
            with trio.CancelScope(shield=True):  # ended by `_serve` itself, once the front has stopped
                await self._serve(front, reload_on_sighup, private_socket or self.workers > 0, task_status)
            guard.cancel_scope.cancel()

    async def _serve(
        self, front: trio.CancelScope, reload_on_sighup: bool, private_socket: bool, task_status: trio.TaskStatus[Bound]
    ) -> None:
        agent_host, agent_port = split_hostport(self.config.server.agent_listen)
        # The sockets systemd (or whoever started us) listens on for us, if any.
        agent_sockets, http_sockets = activation.for_ports(
            (agent_host, agent_port), split_hostport(self.config.server.http_listen)
        )
        fd_limit = raise_fd_limit()
        run = self.background.run
        async with trio.open_nursery() as nursery:
            # The loop's ticker first: from then on a stall is noticed, and not counted as silence.
            await nursery.start(run, "loop_lag", partial(serve_loop_lag, self.loop_lag, clock=self.registry.clock))
            if self.step_timer is not None:
                trio.lowlevel.add_instrument(self.step_timer)
            # The store's writer next: the reconciler offers it placements.
            await nursery.start(run, "placements", self.replicas.saver.serve)
            await nursery.start(run, "catalog", self.catalog_times.writer.serve)
            # The reconciler: liveness changes, placements, desired state pushed.
            await nursery.start(run, "liveness", self.reconciler.serve)
            await nursery.start(self.drains.serve)  # drains asked for through the admin API
            await nursery.start(run, "spread", self.moves.serve_spread)
            await nursery.start(run, "rollouts", self.rollouts.serve)
            await nursery.start(run, "autoscale", self.autoscaler.serve)
            mirror = partial(fill_mirror, node_known=self.desired.a_node_may_build, retry_s=self.mirror_retry_s)
            await nursery.start(run, "mirror", mirror, lambda: self.config, self.agent_port.artifacts, self.push_all)
            if self.weights_origin is not None:  # the weights it seeds to nodes without internet
                await nursery.start(run, "weights_origin", self.weights_origin.serve)
            if reload_on_sighup:
                # Before the plane says it is ready: from then on a SIGHUP must reload, not end
                # the process (its default action).
                await nursery.start(run, "reload", serve_reload_on_sighup, self.operations.reload)
            await nursery.start(run, "page", self.page.serve)  # the gateway's history for the page
            await nursery.start(run, "page_feed", self.page.serve_feed)  # what open pages are sent
            keep_days = lambda: self.config.server.audit_keep_days  # noqa: E731 - as a reload leaves it
            await nursery.start(run, "audit_prune", audit.serve_pruning, self.store, keep_days)
            await nursery.start(run, "budgets", self.gateways.budgets.serve)  # loaded before gateways may connect
            await nursery.start(run, "usage_reports", self.gateways.usage.serve)  # the ledger's writer
            await nursery.start(run, "gateway_feed", self.gateway_feed.serve)  # before gateways may connect
            await nursery.start(self.http_refusals.serve)  # before a request can be refused
            try:
                agent_listeners = await nursery.start(
                    partial(self.agent_port.serve, sockets=agent_sockets), agent_host, agent_port, self.ssl_context
                )
            except OSError as exc:
                raise cannot_listen("agent_listen", self.config.server.agent_listen, exc) from None
            if private_socket:  # before the front: a gateway worker may relay to it at once
                own = partial(serve_admin_socket, limits=self.config.http, stats=self.connections)
                await nursery.start(own, self.handle_own, self.state_dir)
            agent_address = bound_address(agent_listeners)
            with front:
                async with trio.open_nursery() as serving:
                    serve_front = partial(self.gateways.serve_front, drain_s=self.shutdown_drain_s)
                    http_address = await serving.start(serve_front, agent_address, http_sockets)
                    self._http_port = http_address[1]  # the page's origins have the port bound
                    bound = Bound(agent_address=agent_address, http_address=http_address)
                    await nursery.start(serve_admin_url, self.state_dir, bound.admin_url)
                    log.info(
                        "server_ready",
                        agents=f"{bound.agent_address[0]}:{bound.agent_address[1]}",
                        admin_url=bound.admin_url,
                        state_dir=str(self.state_dir),
                        nodes_known=len(self.registry.nodes),
                        open_file_limit=fd_limit,
                        socket_activation=bool(agent_sockets or http_sockets),
                        gateway_workers=self.workers,
                    )
                    task_status.started(bound)
            nursery.cancel_scope.cancel()  # the front has stopped: now the rest

    async def handle_own(self, request: Request) -> Response | StreamingResponse:
        """The control plane's own routes (`server/admin/ownroutes.py`), on `http_listen` (from a gateway
        worker: over the private socket, or on this loop) and on its private socket."""
        return await self.own_routes.handle(request)

    # -- desired state ----------------------------------------------------------------------

    def desired_state(self, node_id: str) -> w.DesiredState:
        return self.desired.of(node_id)

    async def push(self, node_id: str) -> None:
        await self.agent_links.push_desired_state(node_id)

    async def push_all(self) -> None:
        for node_id in list(self.agent_links.links):
            await self.agent_links.push_desired_state(node_id)

    def _weights_reported(self, node_id: str, held: w.WeightsHeld) -> None:
        if self.staging.reported(node_id, held):
            self.changes.intent_changed(node_id)  # its desired state stages less now

    def _replicas_reported(self, node_id: str, statuses: tuple[w.ReplicaStatus, ...]) -> None:
        self.replicas.note_statuses(node_id, statuses)
        self.moves.replicas_changed()
        self.changes.rotation.fire()


def _always() -> bool:
    return True


async def serve_control_plane(
    config: ServerConfig,
    state_dir: Path,
    config_path: Path | None = None,
    *,
    task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`llmgw server`: the control plane opened from `state_dir`, served with the SIGHUP reload,
    its gateway one worker process per CPU unless server.toml says how many. On a PostgreSQL
    store, which several control planes may share, it leads only while it holds the lease and
    stands by otherwise (`llmgw.server.leadership.seat`); on SQLite it is the one control plane and leads."""
    if storeurl.is_postgresql(config.store.url):

        def open_plane(
            config: ServerConfig, warm: Warm, term: Term, redirect: Callable[[], w.Redirect]
        ) -> ControlPlane:
            return ControlPlane.open(
                config, state_dir, config_path, gateway_workers="auto", warm=warm, term=term, redirect=redirect
            )

        async with trio.open_nursery() as nursery:
            bound = await nursery.start(partial(serve_seat, config, state_dir, config_path, open_plane=open_plane))
            freeze_start_objects()
            task_status.started(bound)
        return
    plane = ControlPlane.open(config, state_dir, config_path, gateway_workers="auto")
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(partial(plane.serve, reload_on_sighup=True))
        freeze_start_objects()
        task_status.started(bound)
