"""A stand-in for vLLM's KV-cache event publisher, for the tests: the batches encoded by msgspec
(vLLM's encoder) from structs laid out as vLLM's `vllm.distributed.kv_events` declares them, and
sent as its `ZmqEventPublisher` sends them — three frames: topic, sequence (8 bytes,
big-endian), payload — by a real libzmq PUB or XPUB socket (pyzmq) bound on loopback, in a
thread of its own.

Two layouts, as vLLM has had: the batch is an array (`[ts, events, rank]`) in both; its events
are maps tagged `"type"` (vLLM 0.28 and later, SGLang 0.5.23: `BlockStored` ...) or, in older
releases (0.11, 0.20), arrays led by their kind (`OldBlockStored` ... encode so). Streams
recorded from the engines' own publisher code are in `tests/fixtures/kvevents/`.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _events(array_like: bool) -> tuple[type, type, type]:
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = None
        group_idx: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


BlockStored, BlockRemoved, AllBlocksCleared = _events(array_like=False)
OldBlockStored, OldBlockRemoved, OldAllBlocksCleared = _events(array_like=True)


def encode(events: list[Any], ts: float = 1_700_000_000.25, rank: int | None = None) -> bytes:
    return msgspec.msgpack.encode(EventBatch(ts=ts, events=events, data_parallel_rank=rank))


def stored(
    hashes: list[int | bytes], parent: int | bytes | None = None, block_size: int = 16, *, old: bool = False
) -> Any:
    tokens = [(i * 7919) % 150_000 for i in range(len(hashes) * block_size)]  # ids past 65,535 too
    return (OldBlockStored if old else BlockStored)(hashes, parent, tokens, block_size, None, "GPU")


class Publisher:
    """A libzmq publisher on 127.0.0.1 (`port`), sending what `send` is given from its own
    thread (libzmq sockets are not to be shared between threads). `xpub`: an XPUB socket, whose
    subscriptions `wait_subscribed` sees (a PUB drops what it sends before one arrives)."""

    def __init__(self, *, xpub: bool = True, topic: bytes = b"kv-events") -> None:
        self.topic = topic
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.XPUB if xpub else zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._out: queue.Queue = queue.Queue()
        self.subscriptions: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            while True:
                try:
                    frames = self._out.get_nowait()
                except queue.Empty:
                    break
                self._sock.send_multipart(frames)
            if dict(poller.poll(10)).get(self._sock):
                self.subscriptions.append(self._sock.recv())
        self._sock.close(0)
        self._ctx.term()

    def send(self, seq: int, payload: bytes) -> None:
        self._out.put([self.topic, seq.to_bytes(8, "big"), payload])

    def wait_subscribed(self, n: int = 1, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(s[:1] == b"\x01" for s in self.subscriptions) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"no subscription within {timeout_s} s: {self.subscriptions}")
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
