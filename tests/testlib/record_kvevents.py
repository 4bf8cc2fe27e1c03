"""Records what an engine's own KV-cache event publisher sends a subscriber, byte for byte, into
`tests/fixtures/kvevents/` (the tests replay it: `tests/integration/test_kv_events.py`).

vLLM and SGLang need a GPU to serve, which these machines lack, but the code that encodes and
publishes their events is one Python module each (`vllm/distributed/kv_events.py`,
`sglang/srt/disaggregation/kv_events.py`) over msgspec and libzmq. This loads that module from
the engine's release wheel, with the few names it imports from the rest of the engine given
here (a config class, a logger, network helpers its TCP wildcard-port paths use), starts its
`ZmqEventPublisher` on loopback, connects a plain TCP socket that speaks the subscriber's side
of ZMTP (`llmgw.gateway.kvevents`' greeting and READY, then the subscription), has the
publisher publish `SCRIPT` as batches of the module's own event classes, and writes every byte
the publisher sent: libzmq's greeting and READY, then the messages. Nothing of the engines is
kept here.

    pip download --no-deps vllm==0.34.0 && unzip -j vllm-0.34.0-*.whl vllm/distributed/kv_events.py
    PYTHONPATH=src/python:tests python -m testlib.record_kvevents vllm kv_events.py \\
        tests/fixtures/kvevents/vllm-0.34.0.bin

(the same for `sglang==0.5.23`, and `vllm==0.20.0`, whose events were still arrays). It needs
msgspec and pyzmq (test-only requirements); pydantic, which SGLang's module imports for a class
the recording does not use, is stood in for when it is not installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import socket
import sys
import time
import types
from pathlib import Path
from typing import Any

from llmgw.gateway import kvevents as kv
from testlib.ports import free_port

TS = 1_764_800_000.5
BLOCK = 16


def block_hash(engine: str, n: int) -> bytes | int:
    """vLLM hashes blocks with SHA-256 (bytes); SGLang with 64-bit signed integers."""
    digest = hashlib.sha256(f"{engine}-block-{n}".encode()).digest()
    return digest if engine == "vllm" else int.from_bytes(digest[:8], "big", signed=True)


def tokens(first: int, n_blocks: int) -> list[int]:
    return [(first + i) * 7919 % 151_000 for i in range(n_blocks * BLOCK)]  # ids past 65,535 too


# A replica's cache through two conversations: (kind, block numbers, parent block number).
SCRIPT: list[list[tuple[str, list[int], int | None]]] = [
    [("stored", [0, 1, 2, 3], None)],  # a first prompt: its system prompt and question
    [("stored", [4, 5], 3), ("stored", [10, 11, 12], None)],  # its next turn; another conversation
    [("removed", [10, 11, 12], None)],  # evicted to make room
    [("stored", [6], 5)],
    [("cleared", [], None)],  # the prefix cache reset
    [("stored", [20, 21], None)],
]


def expected(engine: str) -> list[tuple[int, list[kv.Event]]]:
    """What the gateway should read from a recording of `SCRIPT`."""
    out: list[tuple[int, list[kv.Event]]] = []
    for seq, batch in enumerate(SCRIPT):
        events: list[kv.Event] = []
        for kind, blocks, parent in batch:
            hashes = tuple(block_hash(engine, n) for n in blocks)
            if kind == "stored":
                parent_hash = None if parent is None else block_hash(engine, parent)
                events.append(
                    kv.Stored(hashes=hashes, parent=parent_hash, block_size=BLOCK, tokens=BLOCK * len(blocks))
                )
            elif kind == "removed":
                events.append(kv.Removed(hashes=hashes))
            else:
                events.append(kv.Cleared())
        out.append((seq, events))
    return out


# The recordings in tests/fixtures/kvevents: (file stem, engine as `block_hash` and `expected` take it).
RECORDINGS = [("vllm-0.34.0", "vllm"), ("sglang-0.5.23", "sglang"), ("vllm-0.20.0", "vllm")]


def recording(stem: str) -> bytes:
    from testlib.proc import build_root

    return (build_root() / "tests" / "fixtures" / "kvevents" / f"{stem}.bin").read_bytes()


def handshake_length(recorded: bytes) -> int:
    """Bytes of a recording that are the publisher's greeting and READY (what it sends before
    it has the subscription)."""
    return 66 + recorded[65]


def _stand_ins(engine: str) -> None:
    """The names the engine's module imports from the rest of the engine."""

    def module(name: str, **names: Any) -> None:
        mod = types.ModuleType(name)
        mod.__dict__.update(names)
        sys.modules[name] = mod

    if engine == "vllm":

        class KVEventsConfig:
            def __init__(self, **fields: Any) -> None:
                self.__dict__.update(fields)

        def unsupported(*_: Any) -> Any:
            raise RuntimeError("the recorder binds a port of its own; tcp://*:0 is not used")

        for name in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"):
            module(name)
        module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
        module("vllm.logger", init_logger=logging.getLogger)
        module(
            "vllm.utils.network_utils",
            get_ip=unsupported,
            get_tcp_uri=unsupported,
            is_valid_ipv6_address=unsupported,
            split_zmq_path=unsupported,
        )
        module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    else:
        try:
            import pydantic  # noqa: F401
        except ImportError:
            module("pydantic", BaseModel=object)
        for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
            module(name)
        module("sglang.srt.runtime_context", get_parallel=None)
        module("sglang.srt.utils.network", NetworkAddress=None)


def load(engine: str, path: Path) -> types.ModuleType:
    _stand_ins(engine)
    spec = importlib.util.spec_from_file_location(f"recorded_{engine.replace('.', '_')}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # msgspec resolves the structs' annotations through it
    spec.loader.exec_module(mod)
    return mod


def batches(engine: str, mod: types.ModuleType) -> list[Any]:
    """`SCRIPT` as the engine's own event classes, laid out as the engine fills them."""
    out = []
    for batch in SCRIPT:
        events = []
        for kind, blocks, parent in batch:
            hashes = [block_hash(engine, n) for n in blocks]
            if kind == "stored":
                fields: dict[str, Any] = dict(
                    block_hashes=hashes,
                    parent_block_hash=None if parent is None else block_hash(engine, parent),
                    token_ids=tokens(blocks[0] * BLOCK, len(blocks)),
                    block_size=BLOCK,
                    lora_id=None,
                    medium="GPU",
                )
                if engine == "vllm" and "lora_name" in mod.BlockStored.__struct_fields__:
                    fields["lora_name"] = None
                if "group_idx" in mod.BlockStored.__struct_fields__:
                    fields["group_idx"] = 0
                events.append(mod.BlockStored(**fields))
            elif kind == "removed":
                fields = dict(block_hashes=hashes, medium="GPU")
                if "group_idx" in mod.BlockRemoved.__struct_fields__:
                    fields["group_idx"] = 0
                events.append(mod.BlockRemoved(**fields))
            else:
                events.append(mod.AllBlocksCleared())
        out.append(mod.KVEventBatch(ts=TS, events=events))
    return out


def record_once(engine: str, mod: types.ModuleType) -> bytes:
    port = free_port()
    topic = kv.TOPIC.decode()
    if engine == "vllm":  # vLLM binds only a wildcard endpoint (else it connects)
        publisher = mod.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}", topic=topic)
    else:
        publisher = mod.ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{port}", topic=topic, bind=True)
    got = bytearray()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sub:
            sub.sendall(kv.GREETING + kv.ready(b"SUB"))
            # The subscription only once the publisher's READY is in: libzmq (4.3) closes a
            # connection whose subscription arrives with the greeting and READY.
            while len(got) < 66 or len(got) < handshake_length(got):  # greeting, READY's flags and size
                chunk = sub.recv(65536)
                if not chunk:
                    raise RuntimeError(f"the publisher closed in its handshake, after {bytes(got)!r}")
                got += chunk
            sub.sendall(kv.frame(b"\x01" + kv.TOPIC))
            time.sleep(0.5)  # a PUB socket drops what it sends before the subscription is in
            for batch in batches(engine, mod):
                publisher.publish(batch)
            sub.settimeout(1.0)
            while True:
                try:
                    chunk = sub.recv(65536)
                except TimeoutError:
                    break
                if not chunk:
                    break
                got += chunk
    finally:
        publisher.shutdown()
    return bytes(got)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    engine, module_path, out = argv
    mod = load(engine, Path(module_path))
    for _ in range(5):
        recording = record_once(engine, mod)
        if recording.count(bytes([len(kv.TOPIC)]) + kv.TOPIC) == len(SCRIPT):  # every message, the first included
            Path(out).write_bytes(recording)
            print(f"{out}: {len(recording)} bytes, {len(SCRIPT)} messages")
            return 0
    print("the publisher's messages did not all arrive in five tries", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
