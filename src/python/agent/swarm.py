"""One weights file fetched in pieces, from the nodes that hold it or are fetching it, and from
its source only by the one node the control plane's tracker names for it (the "origin").

The loop (`Swarm.run`), until every piece is in:
- every `ASK_S` it asks the tracker (`llmgw.server.links.tracker`, `Tracker.ask`): which nodes
  hold or fetch the file, which one's piece hashes to believe (the "authority": a node holding
  the whole file, verified, else the origin), and whether this node is the origin. It says which
  nodes it could not reach, so a file whose only holders are unreachable from here gets an
  origin again. A tracker that cannot be asked (a control plane gone, or one from before the
  tracker) makes this node its own origin: one more download from the source rather than none.
- every `POLL_S` it asks each peer which pieces it has (`agent.peers`), and the authority for
  their hashes too, each ask a task of its own: a peer that does not answer (its link cut: silence
  until `STALL_S`) holds up its own ask only, not the asks to the tracker nor the other peers;
- it keeps up to `MAX_INFLIGHT` piece requests going, at most `PER_PEER` to one node: the
  rarest piece first, from the node with fewest requests from here; the seed (the authority) is
  asked only for pieces no other node has, each by one fetching node in turn, so that it sends
  each piece about once and the others pass it on (`_schedule`). Each piece is checked
  against the authority's hash before it is written; a node that sends a wrong piece is named
  in the log (`weights_peer_corrupt`) and asked nothing more for this file. A node that fails
  is left alone for `UNREACHABLE_S`.
- the origin also reads the file from its source, one stream from the first piece it lacks,
  hashing each piece as it arrives (those hashes are the ones the others check against), and
  resumes where it broke off after `SOURCE_RETRY_S` when the source fails.
Pieces are synced and listed every `SYNC_S` (`agent.pieces.Part`), so a cut at any byte loses at
most that much. With every piece in, the whole file is hashed: only a file whose SHA-256 is the
catalog's becomes the file an engine sees; one that is not is discarded whole.
"""

from __future__ import annotations

import http.client
import json
import random
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import partial
from urllib.parse import quote, urlsplit

import attrs
import trio

from agent import pieces
from agent.peers import Members, Peer, PeerBusy, PeerClient, PeerCorrupt, PeerFailed, PeerUnreachable, read_into
from llmgw import weightpieces
from llmgw.download import DownloadError, Progress
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.weights")

ASK_S = 2.0
POLL_S = 0.5
MAX_INFLIGHT = 4
PER_PEER = 2
UNREACHABLE_S = 10.0
BUSY_S = 0.5
SEED_GRACE_S = 8.0
SOURCE_RETRY_S = 5.0
SYNC_S = 2.0
TRACKER_TIMEOUT_S = 10.0
SOURCE_TIMEOUT_S = 60.0


@attrs.frozen(kw_only=True)
class Answer:
    """The tracker's word on one file, for the node that asked."""

    origin: bool  # this node fetches it from its source
    authority: str  # whose piece hashes to believe ("" none yet, or this node)
    peers: tuple[Peer, ...] = ()
    members: frozenset[str] | None = None


class Tracker:
    """Asks the control plane's tracker over HTTPS with the node's certificate (blocking)."""

    def __init__(self, server_url: Callable[[], str], ssl_context: ssl.SSLContext) -> None:
        self.server_url = server_url  # wss://HOST:PORT of the control plane linked to last
        self.ssl_context = ssl_context

    def _get(self, target: str) -> dict:
        parts = urlsplit(self.server_url())
        conn = http.client.HTTPSConnection(
            parts.hostname or "", parts.port or 443, context=self.ssl_context, timeout=TRACKER_TIMEOUT_S
        )
        try:
            conn.request("GET", target, headers={"accept": "application/json"})
            response = conn.getresponse()
            body = response.read(1 << 20)
        finally:
            conn.close()
        if response.status != 200:
            raise PeerFailed(f"the tracker answered {response.status}: {body[:200]!r}")
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError(f"the tracker answered something else than an object: {body[:200]!r}")
        return data

    def members(self) -> frozenset[str]:
        """The cluster's nodes as the control plane lists them now (for `agent.peers.Members`)."""
        members = self._get(w.MEMBERS_TARGET).get("members")
        if not isinstance(members, list):
            raise ValueError(f"the tracker's members are not a list: {members!r}")
        return frozenset(str(m) for m in members)

    def ask(self, digest: str, unreachable: set[str]) -> Answer:
        target = w.PEERS_PREFIX + digest
        if unreachable:
            target += "?unreachable=" + quote(",".join(sorted(unreachable)), safe=",")
        data = self._get(target)
        here = urlsplit(self.server_url())
        return Answer(
            origin=bool(data["origin"]),
            authority=str(data.get("authority", "")),
            peers=tuple(
                # The control plane seeding the file (its weights_origin): at the agent port linked to.
                Peer(
                    node=p["node"], address=here.hostname or "", port=here.port or 443, complete=bool(p.get("complete"))
                )
                if p.get("control_plane")
                else Peer(node=p["node"], address=p["address"], port=int(p["port"]), complete=bool(p.get("complete")))
                for p in data.get("peers", ())
            ),
            members=frozenset(data["members"]) if isinstance(data.get("members"), list) else None,
        )


@attrs.define
class Peering:
    """What a node needs to fetch from the others: who to ask, how to reach them, who may ask it."""

    node_id: str
    tracker: Tracker
    client: PeerClient
    members: Members
    source_bytes: int = 0  # bytes read from sources, for the bench and the log
    peer_bytes: int = 0  # bytes received from other nodes


class Swarm:
    def __init__(
        self,
        *,
        digest: str,
        part: pieces.Part,
        url: str,
        headers: dict[str, str],
        ssl_context: ssl.SSLContext | None,
        peering: Peering,
        on_progress: Callable[[Progress], None] = lambda p: None,
    ) -> None:
        self.digest = digest
        self.part = part
        self.size = part.size
        self.url = url
        self.headers = headers
        self.ssl_context = ssl_context
        self.peering = peering
        self.on_progress = on_progress
        self.answer = Answer(origin=False, authority="")
        self.have: dict[str, frozenset[int]] = {}  # node -> pieces it has, as it last said
        self.hashes: dict[int, str] = {}  # the authority's
        self.banned: set[str] = set()
        self.unreachable: dict[str, float] = {}  # node -> until (trio time)
        self.busy: dict[str, float] = {}  # node -> until: it answered 503, asked nothing until then
        self.seen: dict[int, float] = {}  # piece -> when a node first had it, as far as this one knows
        self.from_source = 0  # pieces read from the source here
        self.from_nodes: dict[str, int] = {}  # pieces fetched from each node
        self.inflight: dict[int, str] = {}  # piece -> node ("" the source)
        self.polling: set[str] = set()  # nodes being asked which pieces they have (one ask at a time)
        self.polled_at: dict[str, float] = {}  # node -> when it was last asked
        self.source_running = False
        self.source_error = ""
        self.changed = Wakeup()  # a piece arrived, a request ended, a peer answered: schedule again
        self._stop = threading.Event()
        self._tracker_warned = False

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sync_every)
                asked_at = -float("inf")
                while self.part.missing():
                    woken = self.changed.next()  # before looking: a change meanwhile is not lost
                    now = trio.current_time()
                    if now - asked_at >= ASK_S:
                        await self._ask()
                        asked_at = now
                    self._poll(nursery)
                    if self.answer.origin and not self.source_running:
                        self.source_running = True
                        nursery.start_soon(self._source)
                    self._schedule(nursery)
                    with trio.move_on_after(POLL_S):
                        await woken.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._stop.set()
        await trio.to_thread.run_sync(self.part.sync)
        log.info(
            "weights_pieces",
            sha256=self.digest,
            from_source=self.from_source,
            from_nodes=dict(sorted(self.from_nodes.items())),
            seed=self.answer.authority,
        )

    def _wake(self) -> None:
        self.changed.fire()

    async def _sync_every(self) -> None:
        while True:
            await trio.sleep(SYNC_S)
            await trio.to_thread.run_sync(self.part.sync)

    async def _ask(self) -> None:
        now = trio.current_time()
        away = {n for n, until in self.unreachable.items() if until > now} | self.banned
        try:
            answer = await trio.to_thread.run_sync(self.peering.tracker.ask, self.digest, away)
        except (OSError, ValueError, KeyError, TypeError, PeerFailed, http.client.HTTPException) as exc:
            if not self._tracker_warned:
                self._tracker_warned = True
                log.warning(
                    "weights_tracker_unreachable",
                    sha256=self.digest,
                    reason=str(exc),
                    detail="this node fetches the file from its source itself",
                )
            answer = Answer(origin=True, authority=self.peering.node_id)
        if answer.members is not None:
            self.peering.members.ids = answer.members
        if answer.origin and not self.answer.origin:
            log.info(
                "weights_origin", sha256=self.digest, url=self.url, detail="this node fetches the file from its source"
            )
        self.answer = answer

    def _poll(self, nursery: trio.Nursery) -> None:
        """Ask each peer not asked within POLL_S (and not being asked) which pieces it has, in a
        task of its own: the loop never waits for an answer, which a peer cut off gives only when
        the client's timeout (STALL_S) ends the ask. Each answer wakes the loop."""
        now = trio.current_time()
        for peer in self.answer.peers:
            if peer.node in self.banned or self.unreachable.get(peer.node, 0) > now or peer.node in self.polling:
                continue
            if now - self.polled_at.get(peer.node, -float("inf")) < POLL_S:
                continue
            if peer.complete and peer.node in self.have and len(self.hashes) == weightpieces.piece_count(self.size):
                continue  # it has every piece, and every hash is known: nothing to ask it again
            self.polling.add(peer.node)
            self.polled_at[peer.node] = now
            nursery.start_soon(self._poll_one, peer, peer.node == self.answer.authority)

    async def _poll_one(self, peer: Peer, want_hashes: bool) -> None:
        ask = partial(self.peering.client.pieces, peer, self.digest, hashes=want_hashes)
        try:
            # Abandoned when the file is whole: a silent peer's ask ends in its thread, unwaited.
            found = await trio.to_thread.run_sync(ask, abandon_on_cancel=True)
            count = weightpieces.piece_count(self.size)
            if found.get("size") != self.size:
                raise PeerFailed(f"node {peer.node} holds {found.get('size')} bytes under this digest, not {self.size}")
            try:
                self.have[peer.node] = weightpieces.from_bitmap(found["have"], count)
            except ValueError:
                raise PeerFailed(f"node {peer.node} sent a piece bitmap that is not hex") from None
            if want_hashes and isinstance(found.get("hashes"), list):
                for i, h in enumerate(found["hashes"][:count]):
                    if isinstance(h, str) and len(h) == 64:
                        self.hashes.setdefault(i, h)
        except PeerFailed as exc:
            self._failed(peer, exc)
        finally:
            self.polling.discard(peer.node)
            self._wake()

    def _failed(self, peer: Peer, exc: Exception) -> None:
        """A node that could not be reached is left alone for UNREACHABLE_S (and the tracker told);
        one that broke off a request (closed a kept connection, cut a body) for BUSY_S."""
        now = trio.current_time()
        if self.unreachable.get(peer.node, 0) <= now:
            log.info("weights_peer_failed", sha256=self.digest, peer=peer.node, reason=str(exc))
        if isinstance(exc, PeerUnreachable):
            self.unreachable[peer.node] = now + UNREACHABLE_S
            self.have.pop(peer.node, None)
        else:
            self.busy[peer.node] = now + BUSY_S

    def _schedule(self, nursery: trio.Nursery) -> None:
        """Start piece requests: the rarest pieces first, each from the holder with the fewest
        requests from here. The seed (the authority: the origin, or a node holding the whole
        file) is asked only for what no other node has, and each such piece by one node of those
        fetching (its turn: by piece number), the others taking it from that one: so the seed
        sends each piece about once and its link is not the cluster's bottleneck (with seven
        nodes asking it for every new piece, the origin sent 80% of the bench's bytes). A piece
        its turn's node has not passed on within SEED_GRACE_S is anyone's to ask the seed for; a
        node that cannot be reached takes no turn."""
        now = trio.current_time()
        usable = {
            p.node: p
            for p in self.answer.peers
            if p.node not in self.banned
            and self.unreachable.get(p.node, 0) <= now
            and self.busy.get(p.node, 0) <= now
            and p.node in self.have
        }
        seed = self.answer.authority
        away = self.banned | {n for n, until in self.unreachable.items() if until > now}
        fetchers = sorted(
            {p.node for p in self.answer.peers if not p.complete and p.node != seed and p.node not in away}
            | {self.peering.node_id}
        )
        turn = fetchers.index(self.peering.node_id)
        load: dict[str, int] = {}
        for node in self.inflight.values():
            load[node] = load.get(node, 0) + 1
        wanted = [i for i in self.part.missing() if i not in self.inflight and i in self.hashes]
        rarity = {i: sum(1 for n in usable if i in self.have[n]) for i in wanted}
        for i in wanted:
            if rarity[i]:
                self.seen.setdefault(i, now)
        for i in sorted((i for i in wanted if rarity[i]), key=lambda i: (rarity[i], i)):
            if sum(1 for n in self.inflight.values() if n) >= MAX_INFLIGHT:
                break
            holders = [n for n in usable if i in self.have[n]]
            others = [n for n in holders if n != seed]
            if not others and i % len(fetchers) != turn and now - self.seen[i] < SEED_GRACE_S:
                continue  # another node's turn to take it from the seed: this one takes it from that one
            holders = [n for n in (others or holders) if load.get(n, 0) < PER_PEER]
            if not holders:
                continue
            random.shuffle(holders)
            node = min(holders, key=lambda n: load.get(n, 0))
            load[node] = load.get(node, 0) + 1
            self.inflight[i] = node
            nursery.start_soon(self._fetch, usable[node], i)

    async def _fetch(self, peer: Peer, index: int) -> None:
        expected = self.hashes[index]

        def blocking() -> None:
            with self.peering.client.buffer() as buffer:
                data = self.peering.client.piece(peer, self.digest, index, self.size, expected, buffer)
                if not self.part.has(index):
                    self.part.write(index, data, expected)

        try:
            await trio.to_thread.run_sync(blocking)
            self.from_nodes[peer.node] = self.from_nodes.get(peer.node, 0) + 1
            self.peering.peer_bytes += weightpieces.span(index, self.size)[1]
            self._progress()
        except PeerCorrupt as exc:
            self.banned.add(peer.node)
            log.warning(
                "weights_peer_corrupt",
                sha256=self.digest,
                peer=peer.node,
                piece=index,
                reason=str(exc),
                detail="the piece was dropped and this node asks that one nothing more for this file",
            )
        except PeerBusy:
            self.busy[peer.node] = trio.current_time() + BUSY_S  # not a failure: another node, or it again soon
        except PeerFailed as exc:
            self._failed(peer, exc)
        finally:
            self.inflight.pop(index, None)
            self._wake()

    def _progress(self) -> None:
        self.on_progress(Progress(url=self.url, done_bytes=self.part.done_bytes, total_bytes=self.size))

    # -- the source (the origin only) --------------------------------------------------------

    async def _source(self) -> None:
        try:
            while self.part.missing():
                first = self.part.missing()[0]
                try:
                    await trio.to_thread.run_sync(
                        self._stream, first, trio.lowlevel.current_trio_token(), abandon_on_cancel=True
                    )
                    self.source_error = ""
                except DownloadError as exc:
                    if not self.source_error:
                        log.warning(
                            "weights_source_failed",
                            sha256=self.digest,
                            url=self.url,
                            reason=str(exc),
                            retry_s=SOURCE_RETRY_S,
                        )
                    self.source_error = str(exc)
                    await trio.sleep(SOURCE_RETRY_S)
        finally:
            self.source_running = False

    def _stream(self, first: int, token: trio.lowlevel.TrioToken) -> None:
        """Read the source from piece `first` on (blocking), writing each piece not in yet; each
        read into one buffer (no new object per piece)."""
        start = weightpieces.span(first, self.size)[0]
        buffer = bytearray(weightpieces.piece_size(self.size))
        request = urllib.request.Request(self.url)
        for name, value in self.headers.items():
            if name.lower() == "authorization":
                request.add_unredirected_header(name, value)
            else:
                request.add_header(name, value)
        request.add_header("Range", f"bytes={start}-{self.size - 1}")
        try:
            response = urllib.request.urlopen(request, timeout=SOURCE_TIMEOUT_S, context=self.ssl_context)
        except urllib.error.HTTPError as exc:
            raise DownloadError(f"{self.url} answered HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise DownloadError(f"cannot download {self.url}: {getattr(exc, 'reason', exc)!r}") from None
        with response:
            skip = start if response.status == 200 else 0  # a source without ranges: from its start
            length = response.headers.get("content-length")
            total = (start if response.status == 206 else 0) + int(length) if length and length.isdigit() else None
            if total is not None and total != self.size:
                raise DownloadError(
                    f"{self.url} announces {total} bytes, but the catalog gives its size as {self.size}; the file at "
                    "the source changed: add the model again (`llmgw ctl models add`) to pin what is there now"
                )
            begin = index = 0 if skip else first
            try:
                while skip:
                    skip -= len(response.read(min(skip, 1 << 20)) or b"") or self._short(0)
                for index in range(begin, weightpieces.piece_count(self.size)):
                    if self._stop.is_set():
                        return
                    _, length_i = weightpieces.span(index, self.size)
                    data = read_into(response, memoryview(buffer)[:length_i])
                    self.peering.source_bytes += len(data)
                    if len(data) != length_i:
                        self._short(len(data))
                    if not self.part.has(index):
                        self.part.write(index, data, weightpieces.hash_piece(data))
                        self.from_source += 1
                        token.run_sync_soon(self._arrived)
            except (OSError, http.client.HTTPException) as exc:
                raise DownloadError(
                    f"the download of {self.url} broke off at piece {index} ({exc!r}); it resumes"
                ) from None

    def _short(self, got: int) -> int:
        raise DownloadError(f"{self.url} ended early ({got} bytes of a piece); it resumes")

    def _arrived(self) -> None:
        self._progress()
        self._wake()
