"""The node registry: what the control plane knows of each node, and each node's state.

Pure and synchronous: callers pass `now` and the registry never does I/O. `now` is liveness
time, `registry.clock.now()` (`llmgw.looplag.StallClock`): trio's clock (so tests run on
MockClock) less the time the control plane's loop could not run, so a stall of the control plane
(a task holding its loop, the process paused) moves every node's deadline by its length and a
heartbeat that waited in a socket buffer meanwhile is not counted as the node's silence. Every
time the registry keeps and every deadline it names is liveness time; `clock.loop_time` turns a
deadline into one for trio. Durable intent (cordon, drain, known nodes) comes from the store at
start and is mirrored here by the caller; observed state (inventory, engines) arrives with
each agent link and is never persisted.

Liveness, from the heartbeats of the agent's current process:

    joining  connected, no heartbeat yet from this agent process
    joined   a heartbeat from this agent process within the TTL
    lost     none within the TTL (or never, once the control plane has run for a TTL)
    unknown  known from before a control-plane restart, not yet reconnected, within the first TTL
             plus the reconnect grace (agents retry up to 30 s apart)

"Joined" needs a heartbeat since the agent last started: a node merely known from before, or
a cordoned node re-added, counts only once its new agent process has heartbeated.
"""

from __future__ import annotations

import attrs

from llmgw.looplag import StallClock
from llmgw.wire.agent_link import BackendSpeed, EngineStatus, Hello, Inventory, ReplicaStatus, WeightsHeld

JOINING, JOINED, LOST, UNKNOWN = "joining", "joined", "lost", "unknown"
STATES = (JOINED, JOINING, LOST, UNKNOWN)


@attrs.define(kw_only=True)
class AgentLinkRecord:
    """What the registry records of one agent link, from its hello; replaced by the next link's hello
    (a reconnect of the same agent process keeps its heartbeat)."""

    conn_id: int
    address: str
    hello: Hello
    cert_serial: int
    cert_not_after: float  # unix time
    connected_at: float
    connected: bool = True
    last_heartbeat_at: float | None = None
    # How long it may be silent before it is lost, by the heartbeat interval it was told
    # (`llmgw.server.links.heartbeats`); None: the registry's own `ttl`. A longer one told counts at
    # once, a shorter one from the next heartbeat (`told_ttl_s` until then).
    ttl_s: float | None = None
    told_ttl_s: float | None = None


@attrs.define(kw_only=True)
class Node:
    node_id: str
    cordoned: bool = False
    draining: bool = False
    address: str = ""
    link: AgentLinkRecord | None = None  # its current agent link, connected or not
    inventory: Inventory | None = None
    engines: tuple[EngineStatus, ...] = ()
    replicas: tuple[ReplicaStatus, ...] = ()  # what the agent reports running
    weights: WeightsHeld = WeightsHeld()  # what its weights cache holds, as it reports it
    speeds: tuple[BackendSpeed, ...] = ()  # each engine backend's measured speed (agent.bench), as it reports it
    # The last `llmgw ctl nodes bench` asked of it (DesiredState.bench): kept in memory only, as a
    # request is answered in minutes or not at all.
    bench_asked: str = ""


@attrs.frozen(kw_only=True)
class Transition:
    node_id: str
    old: str
    new: str


class NodeRegistry:
    def __init__(
        self,
        *,
        heartbeat_ttl_s: float,
        started_at: float,
        reconnect_grace_s: float = 0.0,
        clock: StallClock | None = None,
    ) -> None:
        self.ttl = heartbeat_ttl_s
        self.clock = clock or StallClock()  # where callers take `now`; the registry never reads it
        self.started_at = started_at
        # After a control-plane restart, agents come back on their own backoff (up to 30 s apart):
        # a node known from before is not lost until they have had that long, so a restart moves nothing.
        self.reconnect_grace = reconnect_grace_s
        self.nodes: dict[str, Node] = {}
        self._last_states: dict[str, str] = {}
        self._next_conn = 0

    # -- intent (mirrors the store) -------------------------------------------------------

    def know(self, node_id: str, *, address: str = "", cordoned: bool = False, draining: bool = False) -> Node:
        node = self.nodes.setdefault(node_id, Node(node_id=node_id))
        node.address = node.address or address
        node.cordoned, node.draining = cordoned, draining
        return node

    def forget(self, node_id: str) -> Node | None:
        self._last_states.pop(node_id, None)
        return self.nodes.pop(node_id, None)

    # -- links ----------------------------------------------------------------------------

    def connect(self, hello: Hello, *, address: str, cert_serial: int, cert_not_after: float, now: float) -> int:
        """A hello arrived on a new link; returns the connection id that later calls name."""
        self._next_conn += 1
        node = self.nodes.setdefault(hello.node_id, Node(node_id=hello.node_id))
        node.address = address
        node.inventory = hello.inventory
        node.engines = hello.engines
        node.replicas = hello.replicas
        node.weights = hello.weights
        node.speeds = hello.speeds
        old = node.link
        node.link = AgentLinkRecord(
            conn_id=self._next_conn,
            address=address,
            hello=hello,
            cert_serial=cert_serial,
            cert_not_after=cert_not_after,
            connected_at=now,
        )
        # A reconnect of the same agent process (same start time and boot) keeps its heartbeat:
        # the node did not stop being joined because a TCP connection was replaced.
        if old is not None and (old.hello.started_at, old.hello.boot_id) == (hello.started_at, hello.boot_id):
            node.link.last_heartbeat_at = old.last_heartbeat_at
            node.link.ttl_s, node.link.told_ttl_s = old.ttl_s, old.told_ttl_s
        return self._next_conn

    def heartbeat(self, node_id: str, conn_id: int, now: float) -> bool:
        """A heartbeat of the node's current link; True if it changed the node's liveness (its
        first since the agent started, or one after the node was lost): only then is there
        anything for the reconciler to look at. A joined node's heartbeats only move its
        deadline."""
        link = self._link(node_id, conn_id)
        if link is None:
            return False
        node = self.nodes[node_id]
        was = self.liveness(node, now)
        link.last_heartbeat_at = now
        if link.told_ttl_s is not None:
            link.ttl_s = link.told_ttl_s  # the agent heartbeats at what it was told from here on
        return was != JOINED

    def told(self, node_id: str, conn_id: int, ttl_s: float) -> None:
        """The node's agent was told a heartbeat interval whose time to be lost is `ttl_s`: a
        longer one counts at once, a shorter one from its next heartbeat (the agent may be
        asleep on the interval it had)."""
        link = self._link(node_id, conn_id)
        if link is None:
            return
        link.told_ttl_s = ttl_s
        if ttl_s > self._ttl(link):
            link.ttl_s = ttl_s

    def inventory_changed(self, node_id: str, conn_id: int, inventory: Inventory) -> None:
        if self._link(node_id, conn_id) is not None:
            self.nodes[node_id].inventory = inventory

    def weights_changed(self, node_id: str, conn_id: int, weights: WeightsHeld) -> bool:
        """Keep what the node's weights cache holds; True if the set of whole files changed (what
        placement reads), not only a download's progress."""
        if self._link(node_id, conn_id) is None:
            return False
        node = self.nodes[node_id]
        before = node.weights
        node.weights = weights
        return {f.sha256 for f in before.files if f.complete} != {f.sha256 for f in weights.files if f.complete}

    def engines_changed(self, node_id: str, conn_id: int, engines: tuple[EngineStatus, ...]) -> bool:
        """Keep what the node reports; True if more than an install's progress changed (worth a log line)."""
        if self._link(node_id, conn_id) is None:
            return False
        node = self.nodes[node_id]
        before = [(e.name, e.version, e.ok, e.state, e.phase) for e in node.engines]
        node.engines = engines
        return before != [(e.name, e.version, e.ok, e.state, e.phase) for e in engines]

    def speeds_changed(self, node_id: str, conn_id: int, speeds: tuple[BackendSpeed, ...]) -> bool:
        """Keep what the node measured; True if a figure placement reads changed (a backend's
        generation speed, or whether it has one), not only a measurement's progress."""
        if self._link(node_id, conn_id) is None:
            return False
        node = self.nodes[node_id]
        before = gen_speeds(node.speeds)
        node.speeds = speeds
        return before != gen_speeds(speeds)

    def ask_bench(self, node_id: str, token: str) -> bool:
        """Ask the node to measure again (its next desired state carries `token`); False if it is not known."""
        node = self.nodes.get(node_id)
        if node is None:
            return False
        node.bench_asked = token
        return True

    def replicas_changed(self, node_id: str, conn_id: int, replicas: tuple[ReplicaStatus, ...]) -> bool:
        if self._link(node_id, conn_id) is None:
            return False
        self.nodes[node_id].replicas = replicas
        return True

    def disconnect(self, node_id: str, conn_id: int) -> None:
        link = self._link(node_id, conn_id)
        if link is not None:
            link.connected = False

    def _link(self, node_id: str, conn_id: int) -> AgentLinkRecord | None:
        node = self.nodes.get(node_id)
        if node is None or node.link is None or node.link.conn_id != conn_id:
            return None  # a stale link, replaced since, or a forgotten node
        return node.link

    # -- state ----------------------------------------------------------------------------

    def _ttl(self, link: AgentLinkRecord) -> float:
        return self.ttl if link.ttl_s is None else link.ttl_s

    def ttl_of(self, node_id: str, conn_id: int) -> float:
        """How long the node of this link may be silent before it is lost (`told`)."""
        link = self._link(node_id, conn_id)
        return self.ttl if link is None else self._ttl(link)

    def liveness(self, node: Node, now: float) -> str:
        s = node.link
        if s is None:
            return LOST if now - self.started_at > self.ttl + self.reconnect_grace else UNKNOWN
        if s.last_heartbeat_at is None:
            return JOINING if s.connected and now - s.connected_at <= self._ttl(s) else LOST
        return JOINED if now - s.last_heartbeat_at <= self._ttl(s) else LOST

    def counts(self, now: float) -> dict[str, int]:
        """How many nodes are in each state now (every state named, 0 included)."""
        out = dict.fromkeys(STATES, 0)
        for node in self.nodes.values():
            out[self.liveness(node, now)] += 1
        return out

    def forming(self, now: float) -> bool:
        """Whether the cluster may still be assembling by itself: within the first TTL plus the
        reconnect grace after the control plane started, while nodes known from before may
        still come back (the window in which an absent node is `unknown`, not `lost`)."""
        return now - self.started_at <= self.ttl + self.reconnect_grace

    def transitions(self, now: float) -> list[Transition]:
        """Liveness changes since the last call, for logging and for whoever reacts to them."""
        out = []
        for node_id, node in sorted(self.nodes.items()):
            new = self.liveness(node, now)
            old = self._last_states.get(node_id, UNKNOWN)
            if new != old:
                out.append(Transition(node_id=node_id, old=old, new=new))
                self._last_states[node_id] = new
        return out

    def any_transition(self, now: float) -> bool:
        """Whether `transitions(now)` would name a change (without taking it)."""
        last = self._last_states
        return any(self.liveness(node, now) != last.get(node_id, UNKNOWN) for node_id, node in self.nodes.items())

    def next_deadline(self, now: float) -> float:
        """The earliest time a node's liveness can change without a message arriving."""
        times = [self.started_at + self.ttl + self.reconnect_grace]
        for node in self.nodes.values():
            s = node.link
            if s is not None:
                heard = s.last_heartbeat_at if s.last_heartbeat_at is not None else s.connected_at
                times.append(heard + self._ttl(s))
        future = [t for t in times if t >= now]
        return min(future) + 1e-3 if future else now + self.ttl


def gen_speeds(speeds: tuple[BackendSpeed, ...]) -> tuple[tuple[str, str, float], ...]:
    """(engine, backend, generated tokens a second) of each backend measured: what placement reads.
    A backend being measured again or waiting keeps its last figures (the agent says them)."""
    return tuple(sorted((s.engine, s.backend, s.gen_tps) for s in speeds if s.gen_tps > 0))
