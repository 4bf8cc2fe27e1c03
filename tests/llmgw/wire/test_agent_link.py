"""The agent link's messages survive the round trip; bad frames get the right error code."""

from __future__ import annotations

import json

import pytest

from llmgw.wire import agent_link as m
from llmgw.wire.convert import TYPES, decode, encode
from llmgw.wire.errors import WireError

INVENTORY = m.Inventory(
    hostname="node-1",
    os="Debian GNU/Linux 12",
    arch="x86_64",
    python="3.11.7",
    cpu_model="Intel Xeon",
    cpu_cores=8,
    cpu_flags=("avx2", "fma"),
    memory_total_bytes=32 << 30,
    gpus=(
        m.Gpu(
            index=0,
            name="NVIDIA L4",
            uuid="GPU-1",
            memory_total_mib=23034,
            memory_free_mib=22000,
            driver_version="550.54",
            compute_capability="8.9",
            pci_bus_id="00000000:00:03.0",
        ),
    ),
    fabrics=(m.Fabric(name="ib-a", identity="ib-sm:0x0002c90300a1b2c3", adapters=("mlx5_0",), kind="infiniband"),),
    kernel="6.1.0-18-amd64",
    memory_available_bytes=30 << 30,
    weights_dir="/var/lib/llmgw-agent/weights",
    disk_free_bytes=400 << 30,
    gpu_status=m.GPUS_PRESENT,
    gpu_detail="1 x NVIDIA L4, driver 550.54",
    engine_eligibility=(m.EngineEligibility(engine="vllm", status=m.ELIGIBLE, reason="1 GPU(s)"),),
    ib_adapters=(
        m.IbAdapter(
            name="mlx5_0",
            node_guid="0c42:a103:0012:3456",
            ports=(
                m.IbPort(
                    port=1,
                    state="ACTIVE",
                    phys_state="LinkUp",
                    link_layer="InfiniBand",
                    rate="200 Gb/sec (4X HDR)",
                    lid=5,
                    sm_lid=1,
                    gid_prefix="fe80:0000:0000:0000",
                    sm_guid="0x0002c90300a1b2c3",
                    identity="ib-sm:0x0002c90300a1b2c3",
                ),
            ),
        ),
    ),
    fabric_groups=(
        m.FabricGroup(identity="ib-sm:0x0002c90300a1b2c3", kind="infiniband", adapters=("mlx5_0",), detail="x"),
    ),
    fabric_problems=("fabric 'ib-b': ...; fix: ...",),
)

HELLO = m.Hello(
    protocol_version=m.PROTOCOL_VERSION,
    node_id="node-1",
    agent_version="0.1.0",
    boot_id="b0",
    started_at=1700000000.5,
    inventory=INVENTORY,
    engines=(m.EngineStatus(name="llamacpp", version="b4000", ok=True),),
    replicas=(m.ReplicaStatus(replica_id="r1", model="sim", state="ready"),),
)


@pytest.mark.parametrize(
    ("message", "side"),
    [
        (HELLO, m.AgentMessage),
        (m.Heartbeat(seq=7), m.AgentMessage),
        (m.InventoryChanged(inventory=INVENTORY), m.AgentMessage),
        (m.Welcome(node_id="node-1", server_version="0.1.0", heartbeat_interval_s=5.0), m.ServerMessage),
        (
            m.DesiredState(
                generation=3,
                cordoned=True,
                engines=(
                    m.EngineWant(
                        name="llamacpp",
                        version="b4000",
                        archives=(
                            m.EngineArchive(
                                arch="x86_64",
                                backend="cpu",
                                url="https://x/l.tgz",
                                sha256="a" * 64,
                                binary="bin/llama-server",
                                mirrored=True,
                            ),
                        ),
                    ),
                    m.EngineWant(name="vllm", version="0.11.0", pip="vllm==0.11.0"),
                ),
            ),
            m.ServerMessage,
        ),
        (
            m.EnginesChanged(
                engines=(m.EngineStatus(name="llamacpp", version="b4000", ok=False, detail="no libgomp"),)
            ),
            m.AgentMessage,
        ),
        (m.LinkError(code=m.REVOKED, message="x"), m.ServerMessage),
        (m.LinkError(code=m.REVOKED, message="x"), m.AgentMessage),
    ],
)
def test_round_trip(message: object, side: object) -> None:
    text = encode(message)
    assert TYPES[json.loads(text)["type"]] is type(message)
    assert decode(text, side) == message


def code_of(text: str, side: object = m.AgentMessage) -> str:
    with pytest.raises(WireError) as info:
        decode(text, side)
    return info.value.code


def test_type_tags_are_snake_case() -> None:
    assert TYPES["inventory_changed"] is m.InventoryChanged
    assert TYPES["link_error"] is m.LinkError


def test_a_message_for_the_other_side_is_an_unknown_type() -> None:
    assert code_of(encode(m.Welcome(node_id="n", server_version="v", heartbeat_interval_s=1))) == m.UNKNOWN_TYPE
    assert code_of('{"type": "reboot_now"}') == m.UNKNOWN_TYPE
    assert code_of('{"seq": 1}') == m.UNKNOWN_TYPE


def test_malformed_frames_are_bad_messages() -> None:
    assert code_of("not json") == m.BAD_MESSAGE
    assert code_of("[1, 2]") == m.BAD_MESSAGE
    assert code_of('{"type": "heartbeat", "seq": 1, "extra": true}') == m.BAD_MESSAGE
    assert code_of('{"type": "heartbeat"}') == m.BAD_MESSAGE


def test_an_engine_want_without_unpack_caps_gets_the_defaults() -> None:
    """An older control plane sends no caps: the agent applies server.toml's defaults."""
    old = '{"type":"desired_state","generation":1,"engines":[{"name":"llamacpp","version":"b1"}]}'
    [want] = decode(old, m.ServerMessage).engines
    assert (want.max_unpacked_bytes, want.max_members) == (8 << 30, 50_000)
    capped = m.DesiredState(generation=2, engines=(m.EngineWant(name="llamacpp", version="b1", max_members=7),))
    assert decode(encode(capped), m.ServerMessage).engines[0].max_members == 7


def test_an_engine_want_carries_a_build_source_or_none() -> None:
    """An older control plane sends no `build`: the want has none (the agent needs an archive)."""
    old = '{"type":"desired_state","generation":1,"engines":[{"name":"llamacpp","version":"b1"}]}'
    assert decode(old, m.ServerMessage).engines[0].build is None
    build = m.EngineBuild(url="https://x/src.tar.gz", sha256="a" * 64, mirrored=True, size=5, jobs=2, timeout_s=60.0)
    state = m.DesiredState(generation=2, engines=(m.EngineWant(name="llamacpp", version="b1", build=build),))
    assert decode(encode(state), m.ServerMessage).engines[0].build == build
    partial = json.loads(encode(state))
    del partial["engines"][0]["build"]["timeout_s"]
    assert decode(json.dumps(partial), m.ServerMessage).engines[0].build.timeout_s == 7200.0
