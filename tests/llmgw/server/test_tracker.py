"""The weights tracker's choices (`Tracker.ask`) over a real `NodeRegistry`, on a fake clock: who
fetches a file from its source (the origin), whose piece hashes an asker believes (the
authority), and which nodes it is told to fetch pieces from (the peers). Its route on the agent
port is tests/llmgw/server/test_agentlistener.py's; the agents asking it, tests/agent/test_swarm.py's."""

from __future__ import annotations

from llmgw.server.links.tracker import FETCHER_TTL_S, ORIGIN_TTL_S, Tracker
from llmgw.server.state.registry import JOINED, JOINING, LOST, UNKNOWN, NodeRegistry
from llmgw.wire import agent_link as w
from testlib.controlplane import hello

TTL = 100.0  # the registry's heartbeat TTL: longer than any origin's, so a node's liveness is the test's choice
SHA = "ab" * 32
OTHER = "cd" * 32
SIZE = 5 << 20


class Clock:
    """Liveness time as the tracker reads it (`registry.clock.now` in the control plane)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Cluster:
    """A registry of nodes and the tracker over it; time moves only by `advance`."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.registry = NodeRegistry(heartbeat_ttl_s=TTL, started_at=self.clock.t)
        self.tracker = Tracker(self.registry, self.clock)
        self.beating: dict[str, int] = {}  # node -> its link, for the nodes that heartbeat as time moves

    def join(
        self,
        node: str,
        *,
        port: int = 7000,
        address: str | None = None,
        held: tuple[w.HeldFile, ...] = (),
        beat: bool = True,
    ) -> int:
        """`node` connects (from `address`; by default 10.0.0.N, the Nth node), heartbeats (if
        `beat`) and reports its weights."""
        now = self.clock()
        if address is None:
            address = f"10.0.0.{len(self.registry.nodes) + 1}"
        conn = self.registry.connect(hello(node), address=address, cert_serial=1, cert_not_after=2e9, now=now)
        self.registry.weights_changed(node, conn, w.WeightsHeld(files=held, port=port))
        if beat:
            self.registry.heartbeat(node, conn, now)
            self.beating[node] = conn
        return conn

    def advance(self, seconds: float) -> None:
        """Time passes; every node still beating has heartbeated meanwhile."""
        self.clock.t += seconds
        for node, conn in self.beating.items():
            self.registry.heartbeat(node, conn, self.clock.t)

    def ask(self, asker: str, sha256: str = SHA, unreachable: frozenset[str] = frozenset()) -> dict:
        return self.tracker.ask(asker, sha256, unreachable)


def whole(sha256: str = SHA) -> tuple[w.HeldFile, ...]:
    return (w.HeldFile(sha256=sha256, size=SIZE, complete=True),)


def partial(sha256: str = SHA) -> tuple[w.HeldFile, ...]:
    return (w.HeldFile(sha256=sha256, size=SIZE // 2, complete=False),)


def peers(answer: dict) -> dict[str, bool]:
    """The peers named, and whether each holds the file whole."""
    return {p["node"]: p["complete"] for p in answer["peers"]}


def test_the_first_asker_of_a_file_no_one_holds_becomes_its_origin() -> None:
    c = Cluster()
    for node in ("a", "b", "c"):
        c.join(node)
    first = c.ask("a")
    assert first == {"origin": True, "authority": "a", "peers": [], "members": ["a", "b", "c"]}
    c.advance(1)
    second = c.ask("b")
    assert second["origin"] is False and second["authority"] == "a"
    assert second["peers"] == [{"node": "a", "address": "10.0.0.1", "port": 7000, "complete": False}]
    c.advance(1)
    # The origin asks again: still the origin, and now told of b, which fetches too.
    again = c.ask("a")
    assert again["origin"] is True and again["authority"] == "a" and peers(again) == {"b": False}
    assert c.tracker.origins_chosen == 1
    # Another file is another choice.
    assert c.ask("b", OTHER)["origin"] is True and c.tracker.origins_chosen == 2


def test_an_asker_stops_counting_as_a_peer_once_it_stops_asking() -> None:
    c = Cluster()
    for node in ("a", "b", "c"):
        c.join(node)
    c.ask("a")
    c.ask("b")
    c.advance(FETCHER_TTL_S)
    assert peers(c.ask("c")) == {"a": False, "b": False}  # b asked FETCHER_TTL_S ago: still fetching
    c.advance(0.5)
    assert peers(c.ask("c")) == {"a": False}  # b has not asked since; a is named as the origin


def test_a_node_holding_the_file_whole_is_the_authority_and_no_one_is_origin() -> None:
    c = Cluster()
    c.join("a")
    c.join("b")
    c.join("h", held=whole(), port=7001)
    answer = c.ask("a")
    assert answer["origin"] is False and answer["authority"] == "h"
    assert answer["peers"] == [{"node": "h", "address": "10.0.0.3", "port": 7001, "complete": True}]
    answer = c.ask("b")
    assert answer["origin"] is False and answer["authority"] == "h" and peers(answer) == {"a": False, "h": True}
    assert c.tracker.origins_chosen == 0
    # A node with part of the file is a peer, not an authority: someone still fetches from the source.
    c2 = Cluster()
    c2.join("a")
    c2.join("p", held=partial())
    answer = c2.ask("a")
    assert answer["origin"] is True and answer["authority"] == "a" and peers(answer) == {"p": False}


def test_of_several_holders_one_is_the_authority_for_every_asker() -> None:
    c = Cluster()
    for node in ("a", "b"):
        c.join(node)
    for node in ("h2", "h1"):
        c.join(node, held=whole())
    assert c.ask("a")["authority"] == c.ask("b")["authority"] == "h1"


def test_an_origin_that_stops_asking_is_replaced_by_the_next_asker() -> None:
    c = Cluster()
    c.join("a")
    c.join("b")
    c.ask("a")
    c.advance(ORIGIN_TTL_S)
    answer = c.ask("b")  # a asked ORIGIN_TTL_S ago: still the origin
    assert answer["origin"] is False and answer["authority"] == "a"
    c.advance(0.5)
    answer = c.ask("b")  # a has not asked for longer than ORIGIN_TTL_S
    assert answer["origin"] is True and answer["authority"] == "b"
    c.advance(1)
    assert peers(c.ask("b")) == {}  # a neither holds the file, nor asks for it, nor is the origin: not a peer
    # a comes back: b is the origin now, and a fetches from b, its authority.
    c.advance(1)
    answer = c.ask("a")
    assert answer["origin"] is False and answer["authority"] == "b" and peers(answer) == {"b": False}
    assert c.tracker.origins_chosen == 2


def test_an_origin_no_longer_joined_is_replaced() -> None:
    c = Cluster()
    c.join("a")
    c.join("b")
    c.ask("a")
    del c.beating["a"]  # a's heartbeats stop: lost after the registry's TTL
    for _ in range(int(TTL // 5) + 1):  # a keeps asking (the tracker hears it; the link's heartbeats stopped)
        c.advance(5)
        c.ask("a")
    assert c.registry.liveness(c.registry.nodes["a"], c.clock()) == LOST
    answer = c.ask("b")
    assert answer["origin"] is True and answer["authority"] == "b" and peers(answer) == {}


def test_an_origin_one_asker_cannot_reach_stays_the_origin() -> None:
    """One node's trouble reaching the origin (a busy peer, a reset) sends no second node to the
    source: an origin cut off from everyone stops heartbeating, and is replaced as not joined."""
    c = Cluster()
    for node in ("a", "b", "c"):
        c.join(node)
    c.ask("a")
    c.advance(1)
    answer = c.ask("b", unreachable=frozenset({"a"}))
    assert answer["origin"] is False and answer["authority"] == "a"
    assert peers(answer) == {"a": False}  # still named: the asker may reach it again, others may now
    c.advance(1)
    assert c.ask("c", unreachable=frozenset({"a", "b"}))["authority"] == "a"
    assert c.ask("a", unreachable=frozenset({"a"}))["origin"] is True  # naming itself changes nothing
    assert c.tracker.origins_chosen == 1


def test_a_holder_the_asker_cannot_reach_is_not_its_authority() -> None:
    c = Cluster()
    c.join("a")
    c.join("h1", held=whole())
    c.join("h2", held=whole())
    answer = c.ask("a", unreachable=frozenset({"h1"}))
    assert answer["origin"] is False and answer["authority"] == "h2"
    answer = c.ask("a", unreachable=frozenset({"h1", "h2"}))
    assert answer["origin"] is True and answer["authority"] == "a"
    assert peers(answer) == {"h1": True, "h2": True}  # still named, whole: the asker may try them again
    # Another asker that reaches them needs no origin.
    c.join("b")
    answer = c.ask("b")
    assert answer["origin"] is False and answer["authority"] == "h1"


def test_nodes_not_joined_without_a_port_or_an_address_are_never_peers() -> None:
    c = Cluster()
    c.join("a")
    c.join("no-port", held=whole(), port=0)
    c.join("no-address", held=whole(), address="")
    c.join("joining", held=whole(), beat=False)  # connected, no heartbeat yet
    c.registry.know("unknown", address="10.0.0.99")  # known from before, not reconnected
    c.registry.nodes["unknown"].weights = w.WeightsHeld(files=whole(), port=7000)
    c.join("lost", held=whole())
    del c.beating["lost"]
    c.advance(TTL / 2)
    for asker in ("no-port", "no-address", "joining", "unknown"):
        c.ask(asker)  # asking makes none of them a peer either
    c.advance(TTL / 2 + 1)
    states = {n: c.registry.liveness(node, c.clock()) for n, node in c.registry.nodes.items()}
    assert states == {
        "a": JOINED,
        "no-port": JOINED,
        "no-address": JOINED,
        "joining": LOST,  # never heartbeated within its TTL
        "unknown": LOST,
        "lost": LOST,
    }
    answer = c.ask("a")
    assert answer["peers"] == [] and answer["origin"] is True and answer["authority"] == "a"
    # Within the first TTL they are joining and unknown: not joined either.
    c2 = Cluster()
    c2.join("a")
    c2.join("joining", held=whole(), beat=False)
    c2.registry.know("unknown", address="10.0.0.99")
    c2.registry.nodes["unknown"].weights = w.WeightsHeld(files=whole(), port=7000)
    assert {n: c2.registry.liveness(node, c2.clock()) for n, node in c2.registry.nodes.items()} == {
        "a": JOINED,
        "joining": JOINING,
        "unknown": UNKNOWN,
    }
    answer = c2.ask("a")
    assert answer["peers"] == [] and answer["origin"] is True


def test_members_are_the_registrys_nodes() -> None:
    c = Cluster()
    c.join("b")
    c.join("a", beat=False)
    c.registry.know("c")
    assert c.ask("b")["members"] == ["a", "b", "c"]  # joined or not: a node removed is the one refused
    c.registry.forget("c")
    assert c.ask("b")["members"] == ["a", "b"]
