"""The control plane process: wires the store, the registry, the agent endpoint and the HTTP
API together, and runs them under one nursery (`serve_control_plane`).

Start-up order matters for the operator: the certificate authority is read first (a missing
CA is said before anything listens), then the store, then the listeners; `task_status` is
given the bound addresses only once both listeners accept connections.

Every background loop (rotation, liveness and reconcile, mirror fill, SIGHUP reload) runs under
`llmgw.supervision.Background`: a failure after start is logged with its traceback and the loop
started again with backoff; only a failure at start ends the process. A drain is a one-shot job
in the plane's own nursery; an unexpected failure in one becomes that drain's error.
"""

from __future__ import annotations

import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from llmgw import paths, pki
from llmgw.config import Model, ServerConfig, load_server_config
from llmgw.download import archive_cap, fetch
from llmgw.engines.wants import engines_for
from llmgw.errors import LlmgwError, MachineError
from llmgw.fabrics import FabricMap, fabric_map
from llmgw.http.listeners import ConnectionStats, Shutdown, raise_fd_limit
from llmgw.http.server import (
    HTTPError,
    Limits,
    Request,
    Response,
    StreamingResponse,
    bound_address,
    serve_http,
)
from llmgw.log import get_logger
from llmgw.metrics import Registry as MetricsRegistry
from llmgw.server import activation, enginekeys
from llmgw.server.admin import AdminAPI, is_admin_path
from llmgw.server.artifacts import Artifacts, artifacts_dir
from llmgw.server.asyncstore import AsyncStore
from llmgw.server.endpoint import AgentEndpoint
from llmgw.server.gateway.app import Gateway, GatewayOptions
from llmgw.server.gateway.keys import KeyRing
from llmgw.server.gateway.routing import Endpoint, Rotation
from llmgw.server.moves import DrainProgress, Moves
from llmgw.server.page import Page  # [i17 page hook]
from llmgw.server.registry import LOST, Node, Registry
from llmgw.server.replicas import PLAIN, REPLACED, Replicas, sealed_keys
from llmgw.server.store import UnknownNode
from llmgw.supervision import Background
from llmgw.wire import agent_link as w

log = get_logger("llmgw.server")


@attrs.frozen(kw_only=True)
class Bound:
    agent_address: tuple[str, int]
    http_address: tuple[str, int]

    @property
    def admin_url(self) -> str:
        host, port = self.http_address
        return f"http://{_url_host(host)}:{port}"


class ControlPlane:
    def __init__(self, config: ServerConfig, state_dir: Path, config_path: Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.state_dir = state_dir
        paths.check_state_dir(state_dir)  # first: private files open to others are refused before use
        self.ca = pki.load_ca(state_dir)  # then a missing authority is the first thing said
        self.ssl_context = pki.server_ssl_context(state_dir)
        self.store = AsyncStore.open(state_dir)  # checked: a damaged database stops the start here
        self.engine_keys = enginekeys.load(state_dir, sealed_keys=sealed_keys(self.store.at_open.placements))
        self.admin_token = paths.read_admin_token(paths.ensure_admin_token(state_dir))
        self.registry = Registry(
            heartbeat_ttl_s=config.server.heartbeat_ttl_s,
            started_at=trio.current_time(),
            reconnect_grace_s=config.server.reconnect_grace_s,
        )
        for row in self.store.at_open.nodes:
            self.registry.know(row.node_id, address=row.address, cordoned=row.cordoned, draining=row.draining)
        self._changed = trio.Event()
        self.connections = ConnectionStats()
        self.endpoint = AgentEndpoint(
            registry=self.registry,
            store=self.store,
            heartbeat_interval_s=config.server.heartbeat_interval_s,
            desired_state=self.desired_state,
            on_change=self._notify,
            artifact_store=Artifacts(artifacts_dir(state_dir)),
            silence_timeout_s=config.server.heartbeat_ttl_s,
            stats=self.connections,
            max_connections=config.http.max_agent_connections,
            send_timeout_s=config.http.send_timeout_s,
        )
        self.replicas = Replicas(
            self.store, self.registry, lambda: self.config.models, self.fabric_map, self.engine_keys
        )
        self._seal_engine_keys()
        self.moves = Moves(self)  # drains and spreading: replicas moved without an outage
        self._cluster_changed = trio.Event()
        self.shutdown_drain_s = 30.0  # on stop: how long requests in flight may take to finish
        self.mirror_retry_s = 600.0  # a mirror fetch that failed is tried again after this long
        self.background = Background(log)  # its `restarts` are for /metrics
        self.endpoint.on_replicas = self._replicas_reported
        self.admin = AdminAPI(self, self.admin_token)
        self._rotation_changed = trio.Event()
        self.gateway = Gateway(self, KeyRing(self.store), options=GatewayOptions.of(config.gateway))
        self.page = Page(self)  # [i17 page hook] the cluster page: sessions, history, the admin API's gate
        self._generation = 0

    def _seal_engine_keys(self) -> None:
        """Before anything runs: a database of an earlier version held engine keys in plain text;
        they are sealed in place and scrubbed from its files, with the same keys (the engines
        running with them are adopted as they are). Keys that did not open have new ones."""
        plain, replaced = self.replicas.at_open[PLAIN], self.replicas.at_open[REPLACED]
        if not plain and not replaced:
            return
        if not self.store.scrub_placements_at_start(self.replicas.rows()):
            log.warning(
                "engine_keys_scrub_incomplete",
                path=str(self.store.path),
                detail="another process reading the database kept its write-ahead log from being emptied: the old "
                "rows stay in it until the log is reused, or emptied when the last process using the database closes it; "
                "stop that process (a sqlite3 shell?)",
            )
        if plain:
            log.info(
                "engine_keys_sealed",
                replicas=plain,
                detail=f"{self.store.path} held them in plain text; sealed with "
                f"{paths.engine_keys_secret_path(self.state_dir)}, the engines keep their keys",
            )
        if replaced:
            log.warning(
                "engine_keys_replaced",
                replicas=replaced,
                detail=f"their keys do not open with {paths.engine_keys_secret_path(self.state_dir)} (sealed with "
                "another secret): new keys; their engines restart once",
            )

    # -- desired state --------------------------------------------------------------------

    def desired_state(self, node_id: str) -> w.DesiredState:
        node = self.registry.nodes.get(node_id)
        self._generation += 1
        engines = engines_for(
            self.config.engines,
            node.inventory if node else None,
            self.endpoint.artifacts.available(),
            max_archive_bytes=self.config.downloads.max_archive_bytes,
        )
        return w.DesiredState(
            generation=self._generation,
            cordoned=bool(node and node.cordoned),
            engines=engines,
            replicas=self.replicas.assignments_for(
                node_id, self.model, max_weights_bytes=self.config.downloads.max_weights_bytes
            ),
        )

    def model(self, name: str) -> Model | None:
        return next((m for m in self.config.models if m.name == name), None)

    def _replicas_reported(self, node_id: str, statuses: tuple[w.ReplicaStatus, ...]) -> None:
        self.replicas.note_statuses(node_id, statuses)
        self.moves.replicas_changed()
        self._rotation_touched()

    # -- the gateway's endpoints ----------------------------------------------------------

    def gateway_rotation(self) -> Rotation:
        """The catalog's models and, for each placed replica whose rank 0 reports ready with a
        port on a node not lost, where the gateway reaches it and with which key. A replica on
        a draining node is marked draining: no new requests while another replica can take them."""
        now = trio.current_time()
        endpoints = []
        for rid, stored in sorted(self.replicas.placed.items()):
            p = stored.placement
            rank0 = self.registry.nodes.get(p.nodes[0])
            if rank0 is None or not rank0.address or self.registry.liveness(rank0, now) == LOST:
                continue
            status = next((s for s in rank0.replicas if s.replica_id == rid and s.node_rank == 0), None)
            if status is None or status.state != w.READY or not status.port:
                continue
            draining = rid in self.moves.retiring or any(
                (n := self.registry.nodes.get(m)) is not None and n.draining for m in p.nodes
            )
            endpoints.append(
                Endpoint(
                    replica_id=rid,
                    model=p.model,
                    host=rank0.address,
                    port=status.port,
                    api_key=stored.api_key,
                    draining=draining,
                )
            )
        return Rotation(models=frozenset(m.name for m in self.config.models), endpoints=tuple(endpoints))

    def rotation_changed(self) -> trio.Event:
        """Set at the next change that may alter `gateway_rotation()`."""
        return self._rotation_changed

    def _rotation_touched(self) -> None:
        self._rotation_changed.set()
        self._rotation_changed = trio.Event()

    def _member_state(self, replica_id: str, node_id: str) -> str | None:
        node = self.registry.nodes.get(node_id)
        s = next((s for s in node.replicas if s.replica_id == replica_id), None) if node else None
        return s.state if s else None

    # -- reload ---------------------------------------------------------------------------

    async def reload(self) -> dict[str, Any]:
        """Read server.toml again; the catalog and engines change, nothing unchanged restarts.

        A bad file changes nothing: its problems are returned (and logged) and the running
        configuration stays."""
        if self.config_path is None:
            raise HTTPError(409, "this control plane was started without --config; there is no file to reload")
        new = load_server_config(self.config_path)  # ConfigError propagates to the caller
        fixed = ("server", "http", "ca", "gateway")  # read once, at start
        changed_fixed = [f"[{name}]" for name in fixed if getattr(new, name) != getattr(self.config, name)]
        if changed_fixed:
            log.warning("reload_ignores", sections=changed_fixed, fix="restart `llmgw server` for those")
        self.config = attrs.evolve(self.config, engines=new.engines, models=new.models)
        changed = self.replicas.reconcile(trio.current_time())
        for node_id in list(self.endpoint.links):
            await self.endpoint.push_desired_state(node_id)  # engines may have changed for everyone
        log.info("config_reloaded", models=[m.name for m in new.models], nodes_changed=sorted(changed))
        return {"models": [m.name for m in new.models], "nodes_changed": sorted(changed)}

    # -- drain ----------------------------------------------------------------------------

    async def serve_drains(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.moves.serve(task_status=task_status)

    async def start_drain(self, node_id: str, *, force: bool) -> DrainProgress:
        return await self.moves.start_drain(node_id, force=force)

    @property
    def drains(self) -> dict[str, DrainProgress]:
        return self.moves.drains

    # -- operator intent ------------------------------------------------------------------

    async def set_cordoned(self, node_id: str, cordoned: bool) -> None:
        known = self.registry.nodes.get(node_id)
        # The store first: a refusal changes nothing.
        await self.store.set_cordoned(node_id, cordoned, known_at=known.address if known else None)
        node = known or self.registry.know(node_id)
        node.cordoned = cordoned
        await self.endpoint.push_desired_state(node_id)

    async def remove_node(self, node_id: str) -> dict[str, Any]:
        node = self.registry.nodes.get(node_id)
        # The certificate it connected with is revoked too, even if this control plane did not issue it.
        connected = node.session.cert_serial if node is not None and node.session is not None else None
        try:
            revoked = await self.store.remove_node(node_id, also_revoke=connected)
        except UnknownNode:
            if node is None:
                raise
            revoked = []
        revoked = sorted({f"{int(serial):x}" for serial in revoked})  # hex, as openssl and the refusals print it
        closed = await self.endpoint.close_node(
            node_id, w.REVOKED, "this node was removed from the cluster and its certificate revoked"
        )
        self.registry.forget(node_id)
        log.info("node_removed", node=node_id, revoked_serials=revoked, link_closed=closed)
        self._notify()
        return {"removed": node_id, "revoked_serials": revoked, "link_closed": closed}

    # -- views ----------------------------------------------------------------------------

    def node_views(self) -> list[dict[str, Any]]:
        now = trio.current_time()
        views = [node_view(n, self.registry.liveness(n, now), now) for _, n in sorted(self.registry.nodes.items())]
        for v in views:
            drain = self.drains.get(v["id"])
            v["drain"] = drain.view() if drain else None
        return views

    def replica_views(self) -> list[dict[str, Any]]:
        """Each placed replica with what its members report, then what could not be placed."""
        reported = {(s.replica_id, node.node_id): s for node in self.registry.nodes.values() for s in node.replicas}
        out = []
        for rid, stored in sorted(self.replicas.placed.items()):
            p = stored.placement
            members = [reported.get((rid, n)) for n in p.nodes]
            states = [m.state if m else "assigned" for m in members]
            rank0 = members[0]
            out.append(
                {
                    "replica": rid,
                    "model": p.model,
                    "engine": p.engine,
                    "nodes": list(p.nodes),
                    "state": states[0] if len(set(states)) == 1 else ",".join(states),
                    "member_states": states,
                    "port": rank0.port if rank0 else 0,
                    "pids": [m.pid if m else 0 for m in members],  # per member, on its node; 0 while none runs
                    "restarts": sum(m.restarts for m in members if m),
                    "detail": "; ".join(m.detail for m in members if m and m.detail),
                    "fabric": p.fabric,
                }
            )
        for pend in self.replicas.pending:
            row = {"replica": None, "model": pend.model, "state": "pending", "detail": pend.reason, "nodes": []}
            out.extend(dict(row) for _ in range(pend.replicas))  # a row per replica held back, as ctl counts them
        return out

    async def replica_logs(self, replica_id: str, lines: int) -> dict[str, Any]:
        stored = self.replicas.placed.get(replica_id)
        if stored is None:
            known = ", ".join(sorted(self.replicas.placed)) or "none"
            raise HTTPError(
                404, f"no replica {replica_id!r} (replicas: {known}); see `llmgw ctl replicas`", kind="not_found_error"
            )
        members = []
        for rank, node_id in enumerate(stored.placement.nodes):
            reply = await self.endpoint.request_logs(node_id, replica_id, lines)
            members.append({"node": node_id, "rank": rank, "text": reply.text, "error": reply.error})
        return {"replica": replica_id, "members": members}

    def model_views(self) -> list[dict[str, Any]]:
        views = self.replica_views()
        return [
            {
                "model": m.name,
                "engine": m.engine,
                "replicas": m.replicas,
                "ready": sum(1 for v in views if v["model"] == m.name and v["state"] == w.READY),
                "pending": [v["detail"] for v in views if v["model"] == m.name and v["state"] == "pending"],
                "gpus_per_replica": m.gpus_per_replica,
                "nodes_per_replica": m.nodes_per_replica,
            }
            for m in self.config.models
        ]

    def fabric_map(self) -> FabricMap:
        """The cluster's fabrics as placement sees them: by name and identity, with notes."""
        return fabric_map({n.node_id: n.inventory.fabrics for n in self.registry.nodes.values() if n.inventory})

    def node_view(self, node_id: str) -> dict[str, Any]:
        node = self.registry.nodes[node_id]
        now = trio.current_time()
        return node_view(node, self.registry.liveness(node, now), now)

    # -- serving --------------------------------------------------------------------------

    def cluster_changed(self) -> trio.Event:
        """Set once the reconciler has looked at the next change of nodes or replicas."""
        return self._cluster_changed

    def _notify(self) -> None:
        self._changed.set()
        self._rotation_touched()

    async def serve_liveness(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Logs every node's liveness change as it happens, including losses no message announces."""
        task_status.started()
        while True:
            now = trio.current_time()
            for t in self.registry.transitions(now):
                log.info(f"node_{t.new}", node=t.node_id, was=t.old)
                self._rotation_touched()
            for node_id in sorted(self.replicas.reconcile(now)):
                await self.endpoint.push_desired_state(node_id)
            self._changed = trio.Event()
            self._cluster_changed.set()  # after the reconcile: the spreader sees its result
            self._cluster_changed = trio.Event()
            with trio.move_on_at(self.registry.next_deadline(now)):
                await self._changed.wait()

    async def serve(self, *, task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled. On cancellation requests in flight finish, for at most
        `shutdown_drain_s`, then whatever is left is cut. Meanwhile new requests get 503 with
        Retry-After — unless the listening sockets were passed to us (socket activation): then
        we stop accepting, new connections wait in the kernel's backlog for the next process,
        and each open connection gets the answer to the request it is on and then closes."""
        agent_host, agent_port = _split_hostport(self.config.server.agent_listen)
        http_host, http_port = _split_hostport(self.config.server.http_listen)
        passed = activation.take()  # sockets systemd (or whoever started us) listens on for us
        agent_sockets = activation.matching(passed, agent_host, agent_port)
        http_sockets = activation.matching(passed, http_host, http_port)
        if passed:
            log.warning(
                "activation_sockets_unused",
                sockets=activation.describe(passed),
                fix="make the .socket unit's ListenStream= match agent_listen and http_listen in server.toml",
            )
        # Shielded: cancelling the control plane must not cut the requests in flight; the drain
        # below ends this scope itself, once they finished or the deadline passed.
        http_scope = trio.CancelScope(shield=True)
        http_shutdown = Shutdown()

        async def serve_http_until_drained(*, task_status: trio.TaskStatus) -> None:
            with http_scope:
                await serve_http(
                    self.handle_http,
                    http_host,
                    http_port,
                    limits=http_limits(self.config),
                    stats=self.connections,
                    shutdown=http_shutdown,
                    sockets=http_sockets,
                    task_status=task_status,
                )

        fd_limit = raise_fd_limit()
        async with trio.open_nursery() as nursery:
            try:
                # First: the reconciler offers it placements.
                await nursery.start(self.background.run, "placements", self.replicas.saver.serve)
                await nursery.start(self.background.run, "rotation", self.gateway.serve_rotation)
                await nursery.start(self.background.run, "probes", self.gateway.serve_probes)
                await nursery.start(self.serve_drains)
                try:
                    agent_listeners = await nursery.start(
                        partial(self.endpoint.serve, sockets=agent_sockets), agent_host, agent_port, self.ssl_context
                    )
                except OSError as exc:
                    raise _cannot_listen("agent_listen", self.config.server.agent_listen, exc) from None
                try:
                    http_listeners = await nursery.start(serve_http_until_drained)
                except OSError as exc:
                    raise _cannot_listen("http_listen", self.config.server.http_listen, exc) from None
                await nursery.start(self.background.run, "liveness", self.serve_liveness)
                await nursery.start(self.background.run, "spread", self.moves.serve_spread)
                await nursery.start(self.background.run, "mirror", self.fill_mirror)
                await nursery.start(self.background.run, "page", self.page.serve)  # [i17 page hook]
                bound = Bound(agent_address=bound_address(agent_listeners), http_address=bound_address(http_listeners))
                url_file = paths.admin_url_path(self.state_dir)
                paths.write_public(url_file, bound.admin_url + "\n")  # `ctl` sends the credential there
                await nursery.start(_remove_on_exit, url_file)
                log.info(
                    "server_ready",
                    agents=f"{bound.agent_address[0]}:{bound.agent_address[1]}",
                    admin_url=bound.admin_url,
                    state_dir=str(self.state_dir),
                    nodes_known=len(self.registry.nodes),
                    open_file_limit=fd_limit,
                    socket_activation=bool(agent_sockets or http_sockets),
                )
                task_status.started(bound)
                await trio.sleep_forever()
            finally:
                with trio.move_on_after(self.shutdown_drain_s + 1) as cleanup:
                    cleanup.shield = True
                    log.info("server_draining", in_flight=sum(self.gateway.in_flight.values()))
                    if http_sockets:
                        # The sockets outlive us: new connections wait in the backlog for the
                        # next process instead of being answered 503 here.
                        http_shutdown.begin()
                    finished = await self.gateway.drain(self.shutdown_drain_s, refuse_new=not http_sockets)
                    if not finished:
                        log.warning(
                            "server_drain_timed_out",
                            in_flight=sum(self.gateway.in_flight.values()),
                            after_s=self.shutdown_drain_s,
                        )
                http_scope.cancel()

    async def fill_mirror(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Fetch every configured engine archive once into the artifacts directory, so nodes
        without internet access can install from the control plane; retried while any fails
        (every `mirror_retry_s`); returns once all are there."""
        task_status.started()
        archives = [
            a
            for source in (self.config.engines.llamacpp, self.config.engines.vllm, self.config.engines.sglang)
            if source
            for a in source.archives
        ]
        directory = artifacts_dir(self.state_dir)
        while True:
            missing = [a for a in archives if a.sha256 not in self.endpoint.artifacts.available()]
            if not missing:
                return
            for archive in missing:
                try:
                    cap = archive_cap(archive.size, self.config.downloads.max_archive_bytes)
                    await fetch(archive.url, directory / archive.sha256, sha256=archive.sha256, cap=cap)
                    log.info("mirror_fetched", url=archive.url, sha256=archive.sha256)
                    for node_id in list(self.endpoint.links):
                        await self.endpoint.push_desired_state(node_id)  # now mirrored
                except LlmgwError as exc:
                    log.warning("mirror_fetch_failed", url=archive.url, reason=str(exc), retry_in_s=self.mirror_retry_s)
            if set(a.sha256 for a in archives) <= self.endpoint.artifacts.available():
                return
            await trio.sleep(self.mirror_retry_s)

    async def handle_http(self, request: Request) -> Response | StreamingResponse:
        if is_admin_path(request.path):
            return await self.admin.handle(request)
        if request.path == "/metrics":
            # The gateway's families, then the process's own (its listeners' connections, the
            # restarts of its background loops).
            response = await self.gateway.handle(request)
            if isinstance(response, Response) and response.status == 200:
                own = self.connections.render() + _restarts_metric(self.background.restarts)
                response = attrs.evolve(response, body=response.body + own.encode())
            return response
        if request.path.startswith("/v1/") or request.path == "/health":
            return await self.gateway.handle(request)
        if Page.serves(request.path):  # [i17 page hook] the cluster page's files and /login
            return await self.page.handle(request)
        raise HTTPError(404, f"no route {request.method} {request.path}", kind="not_found_error")


def _restarts_metric(restarts: dict[str, int]) -> str:
    registry = MetricsRegistry()
    family = registry.counter(
        "llmgw_background_restarts_total",
        "Times a background loop of the control plane was started again after a failure.",
        ("task",),
    )
    for task, count in sorted(restarts.items()):
        family.inc(count, task=task)
    return registry.render()


def http_limits(config: ServerConfig) -> Limits:
    """The HTTP listener's limits from `[http]` (same names; the agents' budget is the endpoint's)."""
    return Limits(**{f.name: getattr(config.http, f.name) for f in attrs.fields(Limits)})


async def serve_control_plane(
    config: ServerConfig,
    state_dir: Path,
    config_path: Path | None = None,
    *,
    task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED,
) -> None:
    plane = ControlPlane(config, state_dir, config_path)
    async with trio.open_nursery() as nursery:
        # Before the plane says it is ready: from then on a SIGHUP must reload, not end the
        # process (its default action).
        await nursery.start(plane.background.run, "reload", serve_reload_on_sighup, plane)
        bound = await nursery.start(plane.serve)
        task_status.started(bound)


async def serve_reload_on_sighup(
    plane: ControlPlane, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """SIGHUP reads server.toml again. Each reload's failure is its own: a bad file is said, a bug
    is logged with its traceback, and the next SIGHUP is still received."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            try:
                await plane.reload()
            except (LlmgwError, HTTPError) as exc:
                log.error("reload_failed", reason=str(exc), kept="the running configuration")
            except Exception:
                log.exception("reload_failed", kept="the running configuration")


async def _remove_on_exit(path: Path, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """A stopped server leaves no admin.url behind, so `llmgw ctl` says none is running."""
    try:
        task_status.started()
        await trio.sleep_forever()
    finally:
        path.unlink(missing_ok=True)


def _cannot_listen(key: str, value: str, exc: OSError) -> MachineError:
    return MachineError(
        f"cannot listen on {value} ([server] {key}): {exc.strerror or exc}; is another llmgw server running, "
        "or is the port taken? Stop it, or set another address in server.toml"
    )


def node_view(node: Node, state: str, now: float) -> dict[str, Any]:
    s = node.session
    inv = node.inventory
    hello = s.hello if s else None
    return {
        "id": node.node_id,
        "state": state,
        "cordoned": node.cordoned,
        "draining": node.draining,
        "connected": bool(s and s.connected),
        "address": node.address,
        "agent_version": hello.agent_version if hello else None,
        "agent_started_at": hello.started_at if hello else None,
        "last_heartbeat_age_s": round(now - s.last_heartbeat_at, 3) if s and s.last_heartbeat_at is not None else None,
        "cpu": {"model": inv.cpu_model, "cores": inv.cpu_cores, "flags": list(inv.cpu_flags)} if inv else None,
        "arch": inv.arch if inv else None,
        "memory_total_bytes": inv.memory_total_bytes if inv else None,
        "gpus": [{"index": g.index, "name": g.name, "memory_total_mib": g.memory_total_mib} for g in inv.gpus]
        if inv
        else [],
        "gpu_status": inv.gpu_status if inv else None,
        "gpu_detail": inv.gpu_detail if inv else "",
        "eligibility": [{"engine": e.engine, "status": e.status, "reason": e.reason} for e in inv.engine_eligibility]
        if inv
        else [],
        "fabric_problems": list(inv.fabric_problems) if inv else [],
        "disk_free_bytes": inv.disk_free_bytes if inv else None,
        "fabrics": [{"name": f.name, "identity": f.identity, "adapters": list(f.adapters)} for f in inv.fabrics]
        if inv
        else [],
        "engines": [{"name": e.name, "version": e.version, "ok": e.ok, "detail": e.detail} for e in node.engines],
        "replicas": [{"replica": r.replica_id, "rank": r.node_rank, "state": r.state} for r in node.replicas],
        "cert_serial": f"{s.cert_serial:x}" if s else None,
        "cert_not_after": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.cert_not_after)) if s else None,
        "cert_expires_in_days": round((s.cert_not_after - time.time()) / 86400, 1) if s else None,
    }


def _split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
