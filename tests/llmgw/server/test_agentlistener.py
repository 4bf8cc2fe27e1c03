"""The agent port's routes once TLS is done (`AgentListener.serve_peer`), over memory streams on
MockClock: its HTTP is the shared server's (a whole head past the limit is 431, as on the
gateway's port), a peer without a certificate gets the release files and nothing else, its head
is due by the handshake's deadline and until it is routed it may be closed for a newcomer; a
node's revoked certificate is refused at the mirror, and at the weights tracker as at the mirror.
The control plane as the origin of weights (`GET WEIGHTS_PREFIX + SHA256[/pieces]`) is tested on
real TLS on loopback, in-process, since one of its refusals is the handshake's (another CA's
certificate): a node gets the pieces of a file it holds, anyone else gets no byte of it, and
requests for what it does not hold are told so. The other real sockets and TLS are
tests/llmgw/server/test_agentport_budgets.py's and tests/agent/test_link.py's; the tracker's
choices, tests/llmgw/server/test_tracker.py's."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import ssl
from datetime import datetime, timedelta, timezone
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from llmgw.http.send import LINGER_S
from llmgw.pki.ca import ROLE_GATEWAY, CertInfo, cert_info, new_ca
from llmgw.pki.files import GatewayPaths, NodePaths, ca_paths, issue_gateway_to_dir, issue_to_dir, load_cert
from llmgw.pki.tls import client_ssl_context, server_ssl_context
from llmgw.pki.tlsdiag import describe_tls_failure
from llmgw.server.links.agentlistener import (
    HANDSHAKE_TIMEOUT_S,
    LISTENER,
    NO_CERTIFICATE_CLIENT,
    NO_GATEWAY_LINK,
    AgentListener,
    Place,
)
from llmgw.server.links.tracker import Tracker
from llmgw.server.nodes.artifacts import Artifacts
from llmgw.server.nodes.releases import Releases
from llmgw.server.nodes.weightsorigin import FileSource, WeightsOrigin
from llmgw.server.state.registry import NodeRegistry
from llmgw.weightpieces import hash_whole
from llmgw.wire import agent_link as w
from testlib.controlplane import hello, make_state
from testlib.httpexchange import Answered, converse, parse_answer

pytestmark = pytest.mark.trio

NOW = datetime.now(timezone.utc)
CERT = CertInfo(
    subject="CN=node-a",
    issuer="CN=llmgw",
    common_name="node-a",
    serial=0xA1,
    fingerprint_sha256="",
    not_before=NOW - timedelta(days=1),
    not_after=NOW + timedelta(days=30),
)
SUMS = "SHA256SUMS"
RELEASE = "llmgw-0.3.0-linux-amd64.pyz"
ARCHIVE = b"an engine archive" * 100


class Store:
    def __init__(self) -> None:
        self.revoked: set[int] = set()

    async def is_revoked(self, serial: int) -> bool:
        await trio.lowlevel.checkpoint()
        return serial in self.revoked


@pytest.fixture
def port(tmp_path: Path) -> AgentListener:
    return listener(tmp_path)


def listener(tmp_path: Path, origin: WeightsOrigin | None = None) -> AgentListener:
    """The agent port with its release files, its mirror holding ARCHIVE, a tracker, and
    `origin`, the control plane's own weights, if it is their origin."""
    releases = tmp_path / "release"
    releases.mkdir()
    (releases / RELEASE).write_bytes(b"zipapp")
    (releases / SUMS).write_text(f"{hashlib.sha256(b'zipapp').hexdigest()}  {RELEASE}\n")
    mirror = tmp_path / "artifacts"
    mirror.mkdir()
    (mirror / "engine.tar.gz").write_bytes(ARCHIVE)
    registry = NodeRegistry(heartbeat_ttl_s=30.0, started_at=0.0)
    return AgentListener(
        store=Store(),
        artifact_store=Artifacts(mirror),
        release_files=Releases(directory=releases, running=None),
        max_connections=4,
        weights_tracker=Tracker(registry, lambda: 1.0, origin=origin),
    )


def get(target: str) -> bytes:
    return f"GET {target} HTTP/1.1\r\nhost: cp\r\n\r\n".encode()


async def test_a_peer_without_a_certificate_gets_the_release_files_and_nothing_else(
    port: AgentListener, caplog: pytest.LogCaptureFixture
) -> None:
    answered = await converse(lambda s: port.serve_peer(s, None, "10.0.0.9"), get(f"/v1/release/{SUMS}"))
    assert answered.status == 200 and RELEASE.encode() in answered.body
    answered = await converse(lambda s: port.serve_peer(s, None, "10.0.0.9"), get(f"/v1/release/{RELEASE}"))
    assert answered.status == 200 and answered.body == b"zipapp"
    for target in ("/v1/agent", "/v1/artifacts/" + hashlib.sha256(ARCHIVE).hexdigest()):
        answered = await converse(lambda s: port.serve_peer(s, None, "10.0.0.9"), get(target))
        assert answered.status == 403 and answered.body == NO_CERTIFICATE_CLIENT.encode() + b"\n"
    assert port.stats.aborted.get(listener=LISTENER, reason="tls") == 2
    refused = [r.llmgw_fields for r in caplog.records if r.getMessage() == "agent_refused"]
    assert [r["stage"] for r in refused] == ["tls", "tls"]


async def test_a_node_gets_the_mirror_until_its_certificate_is_revoked(port: AgentListener) -> None:
    target = "/v1/artifacts/" + hashlib.sha256(ARCHIVE).hexdigest()
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(target))
    assert answered.status == 200 and answered.body == ARCHIVE
    port.store.revoked.add(CERT.serial)
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(target))
    assert answered.status == 403 and b"was revoked" in answered.body
    assert port.agents_open == 0  # each connection's place given back


async def test_a_gateway_certificate_gets_no_mirror_and_a_port_without_a_gateway_link_says_so(
    port: AgentListener,
) -> None:
    gateway = attrs.evolve(CERT, common_name="gw1", role=ROLE_GATEWAY)
    target = "/v1/artifacts/" + hashlib.sha256(ARCHIVE).hexdigest()
    answered = await converse(lambda s: port.serve_peer(s, gateway, "10.0.0.1"), get(target))
    assert answered.status == 403 and b"is not a node certificate (its role: llmgw-gateway)" in answered.body
    answered = await converse(lambda s: port.serve_peer(s, gateway, "10.0.0.1"), get("/v1/gateway"))
    assert answered.status == 404 and answered.body == NO_GATEWAY_LINK.encode() + b"\n"


async def test_a_whole_head_past_the_limit_is_431_as_on_every_port(port: AgentListener) -> None:
    head = b"GET /v1/agent HTTP/1.1\r\nhost: cp\r\nx-big: " + b"a" * port.limits.max_head_bytes + b"\r\n\r\n"
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), head)
    assert answered.status == 431, answered
    assert port.stats.aborted.get(listener=LISTENER, reason="too_large") == 1


async def test_a_peer_without_a_certificate_sends_its_head_by_the_handshakes_deadline(
    port: AgentListener, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    started = trio.current_time()
    answered = await converse(
        lambda s: port.serve_peer(s, None, "10.0.0.9", deadline=started + HANDSHAKE_TIMEOUT_S), b"GET /v1/rel"
    )
    assert answered.status == 408  # a head begun and not finished: told, then the linger
    assert HANDSHAKE_TIMEOUT_S <= trio.current_time() - started <= HANDSHAKE_TIMEOUT_S + LINGER_S
    assert port.stats.aborted.get(listener=LISTENER, reason="head_timeout") == 1
    [closed] = [r.llmgw_fields for r in caplog.records if r.getMessage() == "agent_link_closed"]
    assert closed["reason"] == "head_timeout" and closed["cn"] == "-"


async def test_a_peer_without_a_certificate_may_be_closed_for_a_newcomer_until_it_is_routed(
    port: AgentListener, autojump_clock: trio.testing.MockClock
) -> None:
    # Silent after its handshake: the oldest waiting, closed to make room.
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: port.serve_peer(server, None, "10.0.0.9", place=Place(port, unproven=False)))
        await trio.testing.wait_all_tasks_blocked()
        assert port.unproven_idle.shed_oldest() == "10.0.0.9"
    assert await client.receive_some() == b""  # closed without a word, at once
    # Routed to the release files: no longer one to close for a newcomer.
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: port.serve_peer(server, None, "10.0.0.9"))
        await client.send_all(get(f"/v1/release/{RELEASE}"))
        answer = b""
        while b"zipapp" not in answer:
            answer += await client.receive_some()
        assert port.unproven_idle.shed_oldest() is None
        nursery.cancel_scope.cancel()


SHA = "5e" * 32  # a weights file's digest, asked of the tracker


def mirror_and_tracker() -> list[str]:
    return ["/v1/artifacts/" + hashlib.sha256(ARCHIVE).hexdigest(), w.PEERS_PREFIX + SHA]


async def test_a_node_asks_the_weights_tracker_with_its_certificate(port: AgentListener) -> None:
    assert port.tracker is not None
    registry = port.tracker.registry
    for node, address in (("node-a", "10.0.0.1"), ("node-b", "10.0.0.2"), ("node-h", "10.0.0.3")):
        conn = registry.connect(hello(node), address=address, cert_serial=1, cert_not_after=2e9, now=1.0)
        registry.heartbeat(node, conn, 1.0)  # joined, serving weights; node-h holds the file whole
        held = (w.HeldFile(sha256=SHA, size=10, complete=True),) if node == "node-h" else ()
        registry.weights_changed(node, conn, w.WeightsHeld(files=held, port=7000))
    node_b = attrs.evolve(CERT, common_name="node-b", serial=0xB2)

    async def ask(cert: CertInfo, target: str) -> dict:
        answered = await converse(lambda s: port.serve_peer(s, cert, "10.0.0.1"), get(target))
        assert answered.status == 200 and answered.headers[b"content-type"].startswith(b"application/json")
        return json.loads(answered.body)

    # The asker is the one its certificate names (node-a), and node-h is its authority.
    answer = await ask(CERT, w.PEERS_PREFIX + SHA)
    assert answer == {
        "origin": False,
        "authority": "node-h",
        "peers": [{"node": "node-h", "address": "10.0.0.3", "port": 7000, "complete": True}],
        "members": ["node-a", "node-b", "node-h"],
    }
    # The nodes the asker could not reach, in the query: node-b cannot reach the holder, so it
    # fetches the file from its source.
    answer = await ask(node_b, w.PEERS_PREFIX + SHA + "?unreachable=node-h,node-x")
    assert answer["origin"] is True and answer["authority"] == "node-b"
    assert port.agents_open == 0


@pytest.mark.parametrize("target", mirror_and_tracker())
async def test_the_tracker_refuses_whom_the_mirror_refuses(port: AgentListener, target: str) -> None:
    gateway = attrs.evolve(CERT, common_name="gw1", role=ROLE_GATEWAY)
    answered = await converse(lambda s: port.serve_peer(s, gateway, "10.0.0.1"), get(target))
    assert answered.status == 403 and b"is not a node certificate (its role: llmgw-gateway)" in answered.body
    answered = await converse(lambda s: port.serve_peer(s, None, "10.0.0.9"), get(target))
    assert answered.status == 403 and answered.body == NO_CERTIFICATE_CLIENT.encode() + b"\n"
    port.store.revoked.add(CERT.serial)
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(target))
    assert answered.status == 403 and b"was revoked" in answered.body
    assert port.tracker is not None and port.tracker.files == {}  # none of them was heard
    assert port.agents_open == 0


@pytest.mark.parametrize(
    "sha",
    ["5E" * 32, "5e" * 31, "5e" * 33, "5e" * 31 + "zz", "", "../" + "5e" * 32, "%35" + "e" + "5e" * 31],
)
async def test_the_tracker_answers_a_bad_sha256_with_its_form(port: AgentListener, sha: str) -> None:
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(w.PEERS_PREFIX + sha))
    assert answered.status == 404, answered
    assert answered.body == b"ask for a file by its sha256: /v1/weights/peers/SHA256 (64 hex digits)\n"
    assert port.tracker is not None and port.tracker.files == {}


async def test_the_tracker_takes_get_only_and_a_control_plane_without_one_says_so(port: AgentListener) -> None:
    answered = await converse(
        lambda s: port.serve_peer(s, CERT, "10.0.0.1"),
        f"POST {w.PEERS_PREFIX}{SHA} HTTP/1.1\r\nhost: cp\r\ncontent-length: 0\r\n\r\n".encode(),
    )
    assert answered.status == 405 and answered.headers[b"allow"] == b"GET, HEAD"
    port.tracker = None
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(w.PEERS_PREFIX + SHA))
    assert answered.status == 404 and answered.body == b"this control plane tracks no weights\n"


# -- the control plane as the origin of weights, on real TLS ------------------------------

MIB = 1 << 20
HELD = random.Random(7).randbytes(2 * MIB + MIB // 2)  # pieces of 1 MiB: two whole, a last of half one
HELD_SHA = hashlib.sha256(HELD).hexdigest()
PIECE_1 = f"bytes={MIB}-{2 * MIB - 1}"
NOT_HELD = "no such file"  # the origin's answer to any digest it does not hold, as it is sent below
BAD_RANGE = b"ask for one piece: Range: bytes=A-B on piece boundaries\n"


@attrs.frozen(kw_only=True)
class Seeding:
    """An agent port on loopback with the control plane's TLS (a peer without a certificate let
    through to its request head, as with `[release] serve`'s default), its tracker's origin
    holding HELD whole, and the certificates its tests connect with."""

    port: AgentListener
    origin: WeightsOrigin | None
    catalog: dict[str, FileSource]  # what the origin's catalog names, by SHA-256
    address: tuple[str, int]
    ca_cert: Path
    node: NodePaths
    revoked: NodePaths  # of the cluster CA, revoked in the port's store
    gateway: GatewayPaths
    foreign: NodePaths  # a node certificate of another cluster's CA

    async def get(self, target: str, who: NodePaths | GatewayPaths | None, *headers: str) -> Answered | str:
        """One request as `who` (None: without a client certificate), read to the end of the
        connection: the answer, or the client's account of its refused handshake (and not a byte
        of an answer)."""
        if who is None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.load_verify_locations(self.ca_cert)
        else:
            context = client_ssl_context(self.ca_cert, who.cert, who.key)
        head = "".join(f"{h}\r\n" for h in (f"GET {target} HTTP/1.1", "host: cp", *headers))
        raw = bytearray()
        with trio.fail_after(10):
            stream = await trio.open_ssl_over_tcp_stream(*self.address, ssl_context=context, https_compatible=True)
            try:
                await stream.send_all(f"{head}\r\n".encode())
                while chunk := await stream.receive_some(65536):
                    raw.extend(chunk)
            except trio.BrokenResourceError as exc:
                assert not raw, raw
                return describe_tls_failure(exc, side="client") or repr(exc)
            finally:
                await trio.aclose_forcefully(stream)
        return parse_answer(bytes(raw))

    def sent_nothing_held(self, answered: Answered | str) -> None:
        """No byte of HELD's pieces in what a peer was sent, and none counted as sent."""
        raw = answered.raw if isinstance(answered, Answered) else b""
        assert all(HELD[i * MIB : i * MIB + 4096] not in raw for i in range(3))
        assert self.origin is None or self.origin.sender.sent_bytes == 0

    async def still_serves(self) -> None:
        """A node's request for a piece is answered whole, and every place is given back."""
        sent = self.origin.sender.sent_bytes
        answered = await self.get(w.WEIGHTS_PREFIX + HELD_SHA, self.node, f"range: {PIECE_1}")
        assert isinstance(answered, Answered) and answered.status == 206, answered
        assert answered.body == HELD[MIB : 2 * MIB]
        assert self.origin.sender.sent_bytes == sent + MIB
        self.quiet()

    def quiet(self) -> None:
        """Nothing left held: no connection in the agents' budget, no upload place taken."""
        assert self.port.agents_open == 0
        if self.origin is not None:
            assert self.origin.sender.uploads.value == self.origin.sender.limit


async def seeding(tmp_path: Path, nursery: trio.Nursery, *, origin: bool = True) -> Seeding:
    """The port served on 127.0.0.1 in `nursery`; `origin=False`: [downloads] weights_origin =
    "node", a tracker without an origin."""
    state = tmp_path / "cp"
    ca = make_state(state)
    source = FileSource(url="https://weights.invalid/held.gguf", size=len(HELD), name="held.gguf")
    catalog = {HELD_SHA: source}
    weights = WeightsOrigin(state / "weights", lambda: dict(catalog)) if origin else None
    if weights is not None:
        # A node asked for HELD and its download ended, as `_fetch` leaves it: the file at its
        # name, every piece's hash known. The origin's serve loop, which would fetch it, is not run.
        assert weights.want(HELD_SHA, now=0.0)
        blob = state / "weights" / HELD_SHA / source.name
        blob.parent.mkdir(parents=True)
        blob.write_bytes(HELD)
        held = weights.files[HELD_SHA]
        held.hashes, held.complete = dict(enumerate(hash_whole(blob)[0])), True
    port = listener(tmp_path, weights)
    revoked = issue_to_dir(ca, "node-r", tmp_path / "node-r", validity_days=3)
    port.store.revoked.add(cert_info(load_cert(revoked.cert)).serial)
    context = server_ssl_context(state, certificate_optional=True)
    [bound] = await nursery.start(port.serve, "127.0.0.1", 0, context)
    return Seeding(
        port=port,
        origin=weights,
        catalog=catalog,
        address=bound.transport_listener.socket.getsockname()[:2],
        ca_cert=ca_paths(state).ca_cert,
        node=issue_to_dir(ca, "node-a", tmp_path / "node-a", validity_days=3),
        revoked=revoked,
        gateway=issue_gateway_to_dir(ca, "gw1", tmp_path / "gw1", validity_days=3),
        foreign=issue_to_dir(new_ca(validity_days=3), "node-f", tmp_path / "node-f", validity_days=3),
    )


def pieces(sha: str = HELD_SHA) -> str:
    return w.WEIGHTS_PREFIX + sha + w.PIECES_SUFFIX


async def test_a_node_gets_the_pieces_of_a_file_the_control_plane_holds(tmp_path: Path, nursery: trio.Nursery) -> None:
    s = await seeding(tmp_path, nursery)
    answered = await s.get(pieces(), s.node)
    assert answered.status == 200 and answered.headers[b"content-type"] == b"application/json", answered
    # Three pieces of 1 MiB, all here: the first three bits of the map.
    assert json.loads(answered.body) == {"size": len(HELD), "piece_size": MIB, "complete": True, "have": "e0"}
    answered = await s.get(pieces() + "?hashes=1", s.node)
    assert answered.status == 200, answered
    whole = [hashlib.sha256(HELD[i * MIB : (i + 1) * MIB]).hexdigest() for i in range(3)]
    assert json.loads(answered.body)["hashes"] == whole
    assert s.origin.sender.sent_bytes == 0  # the list is no piece

    answered = await s.get(w.WEIGHTS_PREFIX + HELD_SHA, s.node, f"range: {PIECE_1}")
    assert answered.status == 206, answered
    assert answered.headers[b"content-range"] == f"bytes {MIB}-{2 * MIB - 1}/{len(HELD)}".encode()
    assert answered.body == HELD[MIB : 2 * MIB]
    # The last piece, shorter than the others.
    answered = await s.get(w.WEIGHTS_PREFIX + HELD_SHA, s.node, f"range: bytes={2 * MIB}-{len(HELD) - 1}")
    assert answered.status == 206 and answered.body == HELD[2 * MIB :], answered
    assert s.origin.sender.sent_bytes == MIB + MIB // 2
    s.quiet()


async def test_a_gateway_a_revoked_node_another_ca_and_no_certificate_get_no_byte_of_it(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="llmgw.endpoint")  # past a few, refusals are logged at debug
    s = await seeding(tmp_path, nursery)
    for target, headers in ((pieces(), ()), (w.WEIGHTS_PREFIX + HELD_SHA, (f"range: {PIECE_1}",))):
        # Refused by the same checks as the mirror and the tracker, each with its reason: 403.
        answered = await s.get(target, s.gateway, *headers)
        assert answered.status == 403, answered
        assert b"is not a node certificate (its role: llmgw-gateway)" in answered.body
        s.sent_nothing_held(answered)
        answered = await s.get(target, s.revoked, *headers)
        assert answered.status == 403 and b"was revoked" in answered.body, answered
        s.sent_nothing_held(answered)
        answered = await s.get(target, None, *headers)
        assert answered.status == 403 and answered.body == NO_CERTIFICATE_CLIENT.encode() + b"\n", answered
        s.sent_nothing_held(answered)
        # Another CA's: refused by OpenSSL in the handshake, before any request is read; the
        # client learns why from the alert.
        refused = await s.get(target, s.foreign, *headers)
        assert isinstance(refused, str), refused
        assert refused.startswith("the control plane does not trust the CA that issued this node's certificate")
        s.sent_nothing_held(refused)
    stages = [
        (r.llmgw_fields["stage"], r.llmgw_fields["reason"]) for r in caplog.records if r.getMessage() == "agent_refused"
    ]
    assert [stage for stage, _ in stages] == ["identity", "identity", "tls", "tls"] * 2
    assert stages[3][1].startswith("the connecting node's certificate was not issued by this cluster's CA")
    assert s.port.stats.aborted.get(listener=LISTENER, reason="refused") == 4
    assert s.port.stats.aborted.get(listener=LISTENER, reason="tls") == 4
    await s.still_serves()


@pytest.mark.parametrize("piece", [False, True], ids=["pieces", "piece"])
async def test_a_file_the_control_plane_does_not_hold_or_a_digest_that_is_none_is_404(
    tmp_path: Path, nursery: trio.Nursery, piece: bool
) -> None:
    s = await seeding(tmp_path, nursery)
    unnamed = hashlib.sha256(b"a file the catalog does not name").hexdigest()
    malformed = [HELD_SHA.upper(), HELD_SHA[:-2], HELD_SHA + "5e", HELD_SHA[:-2] + "zz", "", "../" + HELD_SHA]
    malformed += ["%35" + HELD_SHA[1:], HELD_SHA + "/", HELD_SHA + w.PIECES_SUFFIX + w.PIECES_SUFFIX]
    for sha in [unnamed, *malformed]:
        target = w.WEIGHTS_PREFIX + sha if piece else pieces(sha)
        answered = await s.get(target, s.node, f"range: {PIECE_1}")
        assert answered.status == 404, (sha, answered)
        assert answered.body == b"this control plane holds no such file\n", (sha, answered)
        s.sent_nothing_held(answered)
    assert unnamed not in s.origin.files  # asked for here, not fetched: only the tracker's ask starts that
    await s.still_serves()


async def test_a_range_that_is_not_one_piece_is_416(tmp_path: Path, nursery: trio.Nursery) -> None:
    s = await seeding(tmp_path, nursery)
    ranges = [
        None,  # no Range at all: the whole file is not sent either
        "bytes=0-1023",  # part of a piece
        f"bytes=1-{MIB}",  # a piece's length, off its boundary
        f"bytes=0-{2 * MIB - 1}",  # two pieces
        f"bytes=0-{MIB - 1},{MIB}-{2 * MIB - 1}",  # two ranges
        f"bytes={2 * MIB}-{3 * MIB - 1}",  # the last piece as if whole, past the end
        f"bytes={3 * MIB}-{4 * MIB - 1}",  # a piece past the end
        f"bytes={MIB}-0",  # backwards
        f"bytes=-{MIB}",  # a suffix
        f"bytes={MIB}-",  # open-ended
        "bytes=0-99999999999999999999",  # past 19 digits
        f"pieces={MIB}-{2 * MIB - 1}",  # another unit
    ]
    for value in ranges:
        headers = () if value is None else (f"range: {value}",)
        answered = await s.get(w.WEIGHTS_PREFIX + HELD_SHA, s.node, *headers)
        assert answered.status == 416 and answered.body == BAD_RANGE, (value, answered)
        s.sent_nothing_held(answered)
    s.quiet()  # no upload place taken by a refused range
    await s.still_serves()


async def test_a_control_plane_that_is_not_the_origin_says_so_to_a_node_only(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    s = await seeding(tmp_path, nursery, origin=False)
    for target in (pieces(), w.WEIGHTS_PREFIX + HELD_SHA):
        answered = await s.get(target, s.node, f"range: {PIECE_1}")
        assert answered.status == 404, answered
        assert answered.body == b'this control plane serves no weights ([downloads] weights_origin = "node")\n'
        # Whom it would refuse as origin, it refuses first.
        answered = await s.get(target, s.gateway)
        assert answered.status == 403 and b"is not a node certificate" in answered.body, answered
        answered = await s.get(target, None)
        assert answered.status == 403 and answered.body == NO_CERTIFICATE_CLIENT.encode() + b"\n", answered
    s.quiet()


async def test_a_file_the_catalog_drops_is_served_no_more_and_deleted(tmp_path: Path, nursery: trio.Nursery) -> None:
    s = await seeding(tmp_path, nursery)
    assert s.origin is not None
    # The origin's serve loop reads the catalog first thing in each pass: its second read after
    # a wake-up is the end of the pass that read it first. Each odd read runs the next pass at
    # once (not PASS_S later).
    catalog, reads, read = s.origin.catalog, [0], {2: trio.Event(), 4: trio.Event()}

    def counted() -> dict[str, FileSource]:
        reads[0] += 1
        if reads[0] % 2:
            s.origin.wake.fire()
        if reads[0] in read:
            read[reads[0]].set()
        return catalog()

    s.origin.catalog = counted
    await nursery.start(s.origin.serve)
    with trio.fail_after(10):
        await read[2].wait()
    await s.still_serves()  # named: kept and served
    assert (s.origin.directory / HELD_SHA / "held.gguf").read_bytes() == HELD
    s.catalog.clear()  # a reload took its model out
    s.origin.wake.fire()
    with trio.fail_after(10):
        await read[4].wait()
    for target in (pieces(), w.WEIGHTS_PREFIX + HELD_SHA):
        answered = await s.get(target, s.node, f"range: {PIECE_1}")
        assert answered.status == 404 and answered.body == b"this control plane holds no such file\n", answered
    assert not (s.origin.directory / HELD_SHA).exists()
    assert not s.origin.want(HELD_SHA, now=1.0)  # the tracker names it no more either
