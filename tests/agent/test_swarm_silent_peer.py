"""A swarm beside a peer that never answers (its link cut: a real one answers only when the
client's socket timeout ends the ask): the file still comes from the peer that answers, and the
tracker is asked all the while. No sockets: a tracker and a peer client that answer in memory
(the one peer's asks block their worker thread until the test ends), on trio's MockClock run
faster than time (the peers' answers come from worker threads, which an autojump would outrun)."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from agent import pieces
from agent.peers import Members, Peer, PeerCorrupt, PeerFailed
from agent.swarm import ASK_S, Answer, Peering, Swarm
from llmgw import weightpieces

pytestmark = pytest.mark.trio

SIZE = 3 * weightpieces.PIECE_MIN + 999  # 4 pieces
CONTENT = bytes(range(256)) * (SIZE // 256) + bytes(SIZE % 256)
DIGEST = hashlib.sha256(CONTENT).hexdigest()
GOOD = Peer(node="good", address="127.0.0.1", port=1)
SILENT = Peer(node="silent", address="127.0.0.1", port=2)
RATE = 20.0  # the mock clock's seconds per second


def piece_hashes() -> list[str]:
    return [weightpieces.hash_piece(CONTENT[slice(*_bounds(i))]) for i in range(weightpieces.piece_count(SIZE))]


def _bounds(index: int) -> tuple[int, int]:
    start, length = weightpieces.span(index, SIZE)
    return start, start + length


class Tracker:
    """Answers every ask with `answer`; notes when each came."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.asked_at: list[float] = []

    def ask(self, digest: str, unreachable: set[str]) -> Answer:
        self.asked_at.append(trio.from_thread.run_sync(trio.current_time))  # (a worker thread)
        return self.answer


class Client:
    """`good` has every piece; an ask of `silent` blocks its thread until `release` (at most
    10 s: before the fix the loop waited for it, and the test's end with it)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.silent_asks = 0

    def pieces(self, peer: Peer, digest: str, *, hashes: bool) -> dict:
        if peer == SILENT:
            self.silent_asks += 1
            self.release.wait(10)
            raise PeerFailed("node silent broke off (TimeoutError('The read operation timed out'))")
        answer = {"size": SIZE, "have": weightpieces.bitmap(None, weightpieces.piece_count(SIZE))}
        return answer | ({"hashes": piece_hashes()} if hashes else {})

    @contextlib.contextmanager
    def buffer(self) -> Iterator[bytearray]:
        yield bytearray()

    def piece(self, peer: Peer, digest: str, index: int, size: int, expected: str, buffer: bytearray) -> bytes:
        assert peer == GOOD, f"asked {peer.node}, which listed no piece, for piece {index}"
        data = CONTENT[slice(*_bounds(index))]
        if weightpieces.hash_piece(data) != expected:
            raise PeerCorrupt(f"piece {index}")
        return data


def swarm_of(part: pieces.Part, tracker: Tracker, client: Client) -> Swarm:
    return Swarm(
        digest=DIGEST,
        part=part,
        url="http://source.invalid/m.gguf",  # never read: this node is not the origin
        headers={},
        ssl_context=None,
        peering=Peering(node_id="me", tracker=tracker, client=client, members=Members()),  # type: ignore[arg-type]
    )


async def test_a_peer_that_never_answers_holds_up_no_piece(tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    mock_clock.rate = RATE
    tracker, client = Tracker(Answer(origin=False, authority=GOOD.node, peers=(SILENT, GOOD))), Client()
    part = pieces.Part.open(tmp_path / DIGEST / "m.gguf", SIZE)
    try:
        with trio.fail_after(10 * ASK_S):
            await swarm_of(part, tracker, client).run()
        assert not part.missing() and part.sha256() == DIGEST
        assert client.silent_asks == 1  # its answer still awaited: not asked again meanwhile
    finally:
        client.release.set()
        part.close()


async def test_the_tracker_is_asked_every_ask_s_while_a_peer_stays_silent(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """No peer has a piece: the loop goes on asking the tracker (which names a new origin, or new
    peers, only to a node that asks; an origin that stops asking is replaced)."""
    mock_clock.rate = RATE
    tracker, client = Tracker(Answer(origin=False, authority="", peers=(SILENT,))), Client()
    part = pieces.Part.open(tmp_path / DIGEST / "m.gguf", SIZE)
    try:
        with trio.move_on_after(5 * ASK_S + ASK_S / 2):
            await swarm_of(part, tracker, client).run()
        assert len(tracker.asked_at) >= 5, tracker.asked_at  # at 0, 2, 4, 6, 8 and 10 s, give or take
        assert client.silent_asks == 1
    finally:
        client.release.set()
        part.close()
