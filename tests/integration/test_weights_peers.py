"""Weights between the nodes of a real cluster: `llmgw server`, `llmgw agent` processes (four at
first, a fifth and a sixth joining later) and sim engines, each model's one file served by a Hub
on this machine (testlib.hubserver) that the tests count and break.

A file crosses from its source once for the cluster: the node the control plane's tracker names
(the origin) reads it, the others take its pieces from the nodes that hold or fetch it
(agent.swarm). Each test adds a model of its own (a url source with its sha256 and size, engine
sim) that every node needs, by a replica each or staged to them (`ctl models stage`: the file
now, no engine), breaks one thing while the file moves, and checks that each node it expects
ends up with the file at its final name, hashed here; then it takes the model out of the catalog
(the nodes delete the file). What breaks: nothing (one download for all, each node reporting the
file and its weights port); a holder serving corrupt pieces to a node that joins later; the
origin killed mid-way; the origin partitioned mid-way; the source cut, then away, then back; a
node whose disk is too small.

One node runs in a network namespace of its own (testlib.netns), so that its link can be cut:
every node reaches the control plane, the Hub and the other nodes on the host's end of that
namespace's link (10.231.X.1, an address of this machine), the namespace's node on its own end.
Needs root (the namespace, the small disk's tmpfs), as CI runs the suite: without it, it fails
saying so. Every wait is a bounded poll; a failure shows what was last seen and the log tails.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import attrs
import pytest

from llmgw.ctl.client import AdminClient
from testlib.cluster import Cluster, ServerNet, wait_until
from testlib.hubrepo import HubRepo
from testlib.hubserver import HubServer
from testlib.netns import NetNS, preflight
from testlib.proc import tails

HOSTED = ("n1", "n2", "n3")  # agents on this machine
CUT = "n4"  # the agent in a network namespace
LATE = "n5"  # joins in the corrupt holder's test
SMALL = "n6"  # joins in the last test; its weights directory is a tmpfs too small for a file
ROTTEN = "n2"  # its copy of a file is corrupted on its disk
MIB = 1 << 20
SIZE = 24 * MIB  # 24 pieces of 1 MiB (agent.pieces)
BREAK_AT = 8 * MIB  # where the source stops or breaks: 8 whole pieces in
SMALL_DISK_MIB = 8
SETTLE_S = 60.0  # a file to every node (and a sim engine started), on a loaded 2-core machine
REPO = "llmgw-tests"


@attrs.frozen(kw_only=True)
class Weights:
    model: str
    content: bytes = attrs.field(repr=False)
    url: str

    @property
    def path(self) -> str:
        return f"{self.model}.gguf"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def size(self) -> int:
        return len(self.content)


@attrs.define
class World:
    cluster: Cluster
    hub: HubServer
    ns: NetNS
    weights_dirs: dict[str, Path]
    catalog: dict[str, tuple[Weights, int]] = attrs.field(factory=dict)  # model -> (weights, replicas)
    shared: Weights | None = None  # the first test's model, which the corrupt holder's test reuses

    # -- the catalog, through the admin API as `llmgw ctl` calls it

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        client = AdminClient.locate(server=None, credential=None, state_dir=str(self.cluster.state))
        return client.request(method, path, body)

    def weights(self, model: str) -> Weights:
        """A new file of random bytes on the Hub, for `model` alone."""
        content = os.urandom(SIZE)
        self.hub.add(HubRepo(f"{REPO}/{model}", {f"{model}.gguf": content}))
        return Weights(model=model, content=content, url=f"{self.hub.url}/{REPO}/{model}/resolve/main/{model}.gguf")

    def publish(self, w: Weights, replicas: int) -> None:
        self.catalog[w.model] = (w, replicas)
        self._reload()

    def stage(self, w: Weights, nodes: tuple[str, ...]) -> None:
        """`ctl models stage`: `nodes` download `w` now (those already holding it are not asked)."""
        staged = self.admin("POST", f"/admin/v1/models/{quote(w.model)}/stage", {"nodes": list(nodes)})
        assert set(staged["staging"]) | set(staged["holding"]) == set(nodes), staged

    def spread(self, w: Weights, nodes: tuple[str, ...]) -> None:
        """`w`'s model in the catalog (one replica: one sim engine) and staged to every node."""
        self.publish(w, replicas=1)
        self.stage(w, nodes)

    def withdraw(self, w: Weights) -> None:
        """The model leaves the catalog: its replicas stop and the nodes delete its file."""
        if self.catalog.pop(w.model, None) is not None:
            self._reload()

    def _reload(self) -> None:
        self.cluster.set_catalog(
            "".join(
                f'\n[[models]]\nname = "{w.model}"\nengine = "sim"\nreplicas = {replicas}\n'
                f'[models.source]\nurl = "{w.url}"\nsha256 = "{w.sha256}"\nsize = {w.size}\n'
                for w, replicas in self.catalog.values()
            )
        )
        self.admin("POST", "/admin/v1/reload")

    # -- the nodes

    def start(self, node: str) -> None:
        """Start `node`'s agent: the namespace's node in its namespace."""
        self.cluster.start_agent(node, prefix=["ip", "netns", "exec", self.ns.name] if node == CUT else None)

    def running(self) -> tuple[str, ...]:
        """The nodes whose agents run (the late one once its test started it), but the small disk's."""
        agents = self.cluster.agents
        return tuple(n for n in (*HOSTED, CUT, LATE) if n in agents and agents[n].returncode is None)

    def blob(self, node: str, w: Weights) -> Path:
        """Where `node` keeps `w` whole and verified (agent.weights: WEIGHTS/<sha256>/<name>)."""
        return self.weights_dirs[node] / w.sha256 / w.path

    def pieces_in(self, node: str, w: Weights) -> int:
        """The pieces of `w` that `node` has listed in its download's state (synced every 2 s), or 0."""
        try:
            state = json.loads((self.blob(node, w).parent / f".{w.path}.part.json").read_text())
        except (OSError, ValueError):
            return 0
        return len(state.get("pieces", {}))

    def holding(self, nodes: tuple[str, ...], w: Weights) -> set[str]:
        return {n for n in nodes if self.blob(n, w).is_file() and self.blob(n, w).stat().st_size == w.size}

    def wait_held(self, nodes: tuple[str, ...], w: Weights, what: str) -> None:
        """Until each of `nodes` has `w` at its final name; then each copy is hashed here."""
        wait_until(
            f"{', '.join(nodes)} to hold {w.model}'s file ({what})",
            lambda: self.holding(nodes, w) == set(nodes),
            procs=self.cluster.latest(),
            alive=[self.cluster.server, *(self.cluster.agents[n] for n in nodes)],
            timeout=SETTLE_S,
            last_seen=lambda: {n: f"{self.pieces_in(n, w)} pieces" for n in nodes if n not in self.holding(nodes, w)},
        )
        for node in nodes:
            got = sha256_of(self.blob(node, w))
            assert got == w.sha256, f"{node}'s {w.path} has sha256 {got}, not {w.sha256}\n{self.tails()}"

    def wait_pieces(self, nodes: tuple[str, ...], w: Weights, at_least: int, what: str) -> None:
        wait_until(
            f"{', '.join(nodes)} to have {at_least} pieces of {w.model}'s file ({what})",
            lambda: all(self.pieces_in(n, w) >= at_least for n in nodes),
            procs=self.cluster.latest(),
            last_seen=lambda: {n: self.pieces_in(n, w) for n in nodes},
        )

    def origins(self, w: Weights) -> list[str]:
        """The nodes whose agents logged that they fetch `w` from its source, in the order logged."""
        logged = [
            (e["ts"], p.name)
            for p in self.cluster.procs
            if p.name in self.weights_dirs
            for e in p.events("weights_origin")
            if e.get("sha256") == w.sha256
        ]
        return [name for _, name in sorted(logged)]

    def wait_joined(self, nodes: tuple[str, ...]) -> None:
        self.cluster.wait_nodes(
            f"{', '.join(nodes)} joined with the sim engine",
            lambda ns: all(n in ns and sim_ready(ns[n]) for n in nodes),
            timeout=SETTLE_S,
        )

    def tails(self) -> str:
        return tails(self.cluster.latest())


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(MIB):
            h.update(block)
    return h.hexdigest()


def sim_ready(node: dict[str, Any]) -> bool:
    return node["state"] == "joined" and any(e["name"] == "sim" and e["ok"] for e in node["engines"])


def ready_on(replicas: list[dict[str, Any]], model: str) -> set[str]:
    return {r["nodes"][0] for r in replicas if r["model"] == model and r["state"] == "ready"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    why = preflight()
    assert not why, why
    root = tmp_path_factory.mktemp("peers")
    with NetNS() as ns, HubServer(host=ns.host_addr) as hub:
        here = ns.host_addr
        cluster = Cluster(root, net=ServerNet(agent_host=here, dial_host=here, advertise=(here,)))
        world = World(cluster=cluster, hub=hub, ns=ns, weights_dirs={})
        try:
            cluster.init_ca()
            for node in (*HOSTED, CUT, LATE):
                world.weights_dirs[node] = cluster.add_node(node).state_dir / "weights"
            cluster.start_server()
            for node in (*HOSTED, CUT):
                world.start(node)
            world.wait_joined((*HOSTED, CUT))
            yield world
        finally:
            cluster.close()


def held_everywhere(world: World) -> Weights:
    """The first test's model, a replica on each first node, each holding its file whole."""
    nodes = (*HOSTED, CUT)
    if world.shared is None:
        world.shared = world.weights("a")
        world.publish(world.shared, replicas=len(nodes))
    world.wait_held(nodes, world.shared, "a replica each")
    return world.shared


# -- the tests, in the order they run: each leaves every node it started joined, its model gone --


def test_one_download_from_the_source_serves_every_node(world: World) -> None:
    nodes = (*HOSTED, CUT)
    w = held_everywhere(world)
    world.cluster.wait_replicas(
        "a replica of a ready on every node", lambda rs: ready_on(rs, "a") == set(nodes), timeout=SETTLE_S
    )
    sent = world.hub.log.bytes_sent(w.path)
    assert sent == w.size, f"the Hub sent {sent} bytes of {w.path}, not its {w.size} once\n{world.tails()}"
    assert len(world.origins(w)) == 1, f"origins: {world.origins(w)}\n{world.tails()}"
    # Each node's weights report (`ctl nodes --json`): the file whole, and the port it serves it on.
    reported = world.cluster.wait_nodes(
        "every node to report holding a's file",
        lambda ns: all(ns[n]["weights"]["files"] == 1 and not ns[n]["weights"]["downloading"] for n in nodes),
    )
    for node in nodes:
        weights = reported[node]["weights"]
        assert weights["bytes"] >= w.size and weights["port"] > 0, f"{node}: {weights}\n{world.tails()}"
    ports = [reported[n]["weights"]["port"] for n in HOSTED]
    assert len(set(ports)) == len(HOSTED), f"the nodes on this machine report one weights port: {ports}"


def test_a_holder_serving_corrupt_pieces_is_named_and_a_node_that_joins_still_gets_the_file(world: World) -> None:
    w = held_everywhere(world)
    try:
        # n2's copy rots on its disk: a byte flipped in every piece, the size kept (as do the piece
        # hashes kept beside it). Not n1's: the first node holding the file whole is the authority,
        # whose hashes a fetching node believes, and the seed, asked only for what no other node has.
        bad = world.blob(ROTTEN, w)
        with bad.open("r+b") as f:
            for offset in range(0, w.size, MIB):
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
        # A node that joins after the holders fetched their last file: they serve it all the same.
        world.start(LATE)
        world.wait_joined((LATE,))
        world.stage(w, (LATE,))
        world.wait_held((LATE,), w, "staged to the node that joined")
        named = [e for e in world.cluster.agents[LATE].events("weights_peer_corrupt") if e.get("sha256") == w.sha256]
        assert named and {e["peer"] for e in named} == {ROTTEN}, f"{named}\n{world.tails()}"
        refused = [e for n in (*HOSTED, CUT) for e in world.cluster.agents[n].events("weights_peer_refused")]
        assert not refused, f"holders refused the node that joined: {refused}\n{world.tails()}"
        sent = world.hub.log.bytes_sent(w.path)
        assert sent == w.size, f"the Hub sent {sent} bytes of {w.path}: the nodes had it\n{world.tails()}"
    finally:
        world.withdraw(w)
        world.shared = None


def test_the_origin_killed_mid_way_is_replaced_and_the_others_complete(world: World) -> None:
    nodes = world.running()
    w = world.weights("b")
    stall = world.hub.faults.stall(w.path, after=BREAK_AT)
    world.spread(w, nodes)
    try:
        stall.wait_reached()
        [origin] = world.origins(w)
        others = tuple(n for n in nodes if n != origin)
        world.wait_pieces(others, w, 4, "from the origin, before the source stopped")
        world.cluster.kill_node(origin)
        world.wait_held(others, w, f"after the origin {origin} was killed")
        successors = [n for n in world.origins(w) if n != origin]
        assert successors and successors[0] in others, f"origins: {world.origins(w)}\n{world.tails()}"
        stall.release()  # the killed origin's request: its socket is gone
        sent = world.hub.log.bytes_sent(w.path)
        assert sent <= w.size + BREAK_AT + MIB, f"the Hub sent {sent} bytes of {w.size}\n{world.tails()}"
        # The node comes back: it resumes its part from the others (still staged there), not the source.
        world.start(origin)
        world.wait_joined((origin,))
        world.wait_held((origin,), w, "after its agent restarted")
        assert world.hub.log.bytes_sent(w.path) == sent, f"the restarted {origin} went to the source\n{world.tails()}"
    finally:
        stall.release()
        world.withdraw(w)


def test_the_origin_partitioned_mid_way_is_replaced_and_the_others_complete(world: World) -> None:
    others = tuple(n for n in world.running() if n != CUT)
    w = world.weights("c")
    stall = world.hub.faults.stall(w.path, after=BREAK_AT)
    # The node in the namespace fetches first (the others take no replica), so it is the origin.
    client = AdminClient.locate(server=None, credential=None, state_dir=str(world.cluster.state))
    for node in others:
        client.cordon(node, True)
    try:
        world.publish(w, replicas=1)
        stall.wait_reached()
        assert world.origins(w) == [CUT], f"origins: {world.origins(w)}\n{world.tails()}"
        world.stage(w, others)
        world.wait_pieces(others, w, 4, f"from {CUT}, before the source stopped")
        world.ns.cut()
        world.wait_held(others, w, f"after {CUT}'s link was cut")
        successors = [n for n in world.origins(w) if n != CUT]
        assert successors and successors[0] in others, f"origins: {world.origins(w)}\n{world.tails()}"
    finally:
        world.ns.restore()
        stall.release()
        for node in others:
            client.cordon(node, False)
        world.withdraw(w)
    world.wait_joined((CUT,))


def test_a_source_cut_then_away_resumes_where_it_broke_when_it_returns(world: World) -> None:
    nodes = world.running()
    w = world.weights("e")
    cut = world.hub.faults.cut(w.path, after=BREAK_AT)
    world.spread(w, nodes)
    try:
        cut.wait_reached()
        away = world.hub.faults.fail(w.path, status=503, times=None)
        away.wait_reached(timeout=20.0)  # the origin tried again (SOURCE_RETRY_S): still away
        assert not world.holding(nodes, w), f"a node has e's file while its source is away\n{world.tails()}"
        world.hub.faults.disarm(away)
        world.wait_held(nodes, w, "after the source came back")
        sent = world.hub.log.bytes_sent(w.path)
        assert sent == w.size, f"the Hub sent {sent} bytes of {w.size}: not resumed where it broke\n{world.tails()}"
        ranges = [s.range for s in world.hub.log.requests(kind="cdn", path=w.path, status=206)]
        assert ranges == [f"bytes=0-{w.size - 1}", f"bytes={BREAK_AT}-{w.size - 1}"], f"{ranges}\n{world.tails()}"
    finally:
        world.withdraw(w)


def test_a_disk_too_small_fails_its_replica_saying_so_and_the_others_complete(world: World) -> None:
    disk = world.cluster.root / "small-disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_MIB}M", "tmpfs", str(disk)], check=True)
    try:
        world.cluster.add_node(SMALL, f'weights_dir = "{disk}"\n')
        world.weights_dirs[SMALL] = disk
        others = world.running()
        w = world.weights("f")
        try:
            world.start(SMALL)
            world.wait_joined((SMALL,))
            world.publish(w, replicas=len(others) + 1)  # one on each node, the small disk's too
            failed = wait_until(
                f"{SMALL}'s replica of f to fail",
                lambda: [e for e in world.cluster.server.events("replica_failed") if e.get("node") == SMALL],
                procs=world.cluster.latest(),
                timeout=SETTLE_S,
            )
            detail = failed[0]["detail"]
            assert f"{w.path} needs" in detail and "MiB free" in detail and str(disk) in detail, detail
            world.wait_held(others, w, f"beside {SMALL}'s full disk")
            # Nothing of it is left there, at the final name or as a part, and no engine was started.
            left = list(disk.rglob("*"))
            assert not [p for p in left if p.is_file()], f"{left}\n{world.tails()}"
            started = world.cluster.agents[SMALL].events("replica_starting")
            assert not started, f"{SMALL} started an engine: {started}\n{world.tails()}"
        finally:
            world.withdraw(w)
            world.cluster.agents[SMALL].kill()
    finally:
        subprocess.run(["umount", str(disk)], check=False)
        shutil.rmtree(disk, ignore_errors=True)
