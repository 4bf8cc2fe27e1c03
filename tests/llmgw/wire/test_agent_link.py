"""The agent link's messages survive the round trip; bad frames get the right error code."""

from __future__ import annotations

import json
import math

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

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
    vulkan=(
        m.VulkanDevice(
            index=0,
            name="NVIDIA L4",
            type=m.VULKAN_DISCRETE,
            vendor_id="0x10de",
            device_id="0x27b8",
            driver_id="DRIVER_ID_NVIDIA_PROPRIETARY",
            driver_name="NVIDIA",
            driver_info="550.54.15",
            driver_version="550.54.15.0",
            api_version="1.3.277",
            heaps=(m.VulkanHeap(size_bytes=24 << 30, device_local=True), m.VulkanHeap(size_bytes=16 << 30)),
        ),
        m.VulkanDevice(index=1, name="llvmpipe", type=m.VULKAN_CPU, vendor_id="0x10005", software=True),
    ),
    vulkan_status=m.VULKAN_PRESENT,
    vulkan_detail="NVIDIA L4 (discrete, NVIDIA, 1.3)",
)

HELLO_MESSAGE = HELLO = m.Hello(
    protocol_version=m.PROTOCOL_VERSION,
    node_id="node-1",
    agent_version="0.1.0",
    boot_id="b0",
    started_at=1700000000.5,
    inventory=INVENTORY,
    engines=(m.EngineStatus(name="llamacpp", version="b4000", ok=True),),
    replicas=(m.ReplicaStatus(replica_id="r1", model="sim", state="ready"),),
)

SPEED = m.BackendSpeed(
    engine="llamacpp",
    backend="cpu",
    state=m.SPEED_OK,
    prompt_tps=850.5,
    gen_tps=42.25,
    version="b11434",
    measured_at=1700000100.0,
    request="b-1",
)
FAILED_SPEED = m.BackendSpeed(
    engine="llamacpp", backend="cuda", state=m.SPEED_FAILED, device="CUDA0", detail="llama-server exited"
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
        (attrs.evolve(HELLO, speeds=(SPEED,)), m.AgentMessage),
        (m.SpeedsChanged(speeds=(SPEED, FAILED_SPEED)), m.AgentMessage),
        (m.DesiredState(generation=4, bench="b-1"), m.ServerMessage),
        (m.LinkError(code=m.REVOKED, message="x"), m.ServerMessage),
        (m.LinkError(code=m.REVOKED, message="x"), m.AgentMessage),
        (m.Redirect(leader="wss://cp-b:7443", message="the leader is cp-b"), m.ServerMessage),
        (m.Redirect(leader="", message="no control plane leads now"), m.ServerMessage),
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
    assert TYPES["speeds_changed"] is m.SpeedsChanged


def test_a_hello_without_speeds_still_parses() -> None:
    data = json.loads(encode(attrs.evolve(HELLO_MESSAGE, speeds=(SPEED,))))
    del data["speeds"]
    assert decode(json.dumps(data), m.AgentMessage).speeds == ()
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


HELLO = json.loads(
    encode(
        m.Hello(
            protocol_version=m.PROTOCOL_VERSION,
            node_id="n",
            agent_version="v",
            boot_id="b",
            started_at=1.0,
            inventory=INVENTORY,
        )
    )
)


def _with(path: str, value: object) -> str:
    frame = json.loads(json.dumps(HELLO))
    *parents, last = path.split(".")
    place = frame
    for key in parents:
        place = place[int(key)] if isinstance(place, list) else place[key]
    place[int(last) if isinstance(place, list) else last] = value
    return json.dumps(frame)  # NaN and Infinity as Python's JSON writes (and reads) them


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        (
            "inventory.cpu_cores",
            1.5,
            "expected a whole number from 0 to 2**63 - 1, got 1.5 @ hello.inventory.cpu_cores",
        ),
        ("inventory.cpu_cores", 1e300, "got 1e+300"),
        ("inventory.cpu_cores", True, "got True"),
        ("inventory.cpu_cores", "8", "got '8'"),
        ("inventory.cpu_cores", -1, "got -1"),
        ("inventory.memory_total_bytes", 2**63, "got 9223372036854775808"),
        ("inventory.gpus.0.memory_total_mib", 10**400, "(int of 401 characters as text)"),
        ("started_at", float("nan"), "expected a finite number, got nan @ hello.started_at"),
        ("started_at", float("inf"), "got inf"),
        ("started_at", 10**400, "expected a finite number"),
        ("started_at", False, "got False"),
        ("node_id", 5, "expected a string, got 5 @ hello.node_id"),
        ("inventory.engine_eligibility.0.status", None, "expected a string, got None"),
    ],
)
def test_scalars_are_taken_as_json_gives_them_and_bounded(path: str, value: object, says: str) -> None:
    with pytest.raises(WireError) as info:
        decode(_with(path, value), m.AgentMessage)
    assert info.value.code == m.BAD_MESSAGE and says in str(info.value), str(info.value)
    assert len(str(info.value)) < 400


def test_a_whole_number_is_a_float_fields_value_and_the_bounds_are_taken() -> None:
    hello = decode(_with("started_at", 3), m.AgentMessage)
    assert hello.started_at == 3.0 and isinstance(hello.started_at, float)
    hello = decode(_with("inventory.memory_total_bytes", 2**63 - 1), m.AgentMessage)
    assert hello.inventory.memory_total_bytes == 2**63 - 1
    assert decode(_with("inventory.cpu_cores", 0), m.AgentMessage).inventory.cpu_cores == 0


def _leaves(value: object):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _paths(value: object, prefix: str = ""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, f"{prefix}{k}.")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, f"{prefix}{i}.")
    if prefix:
        yield prefix[:-1]


_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([2**63 - 1, 2**63, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
_json_values = st.recursive(
    _json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
)


@settings(max_examples=200, deadline=None, database=None)
@given(path=st.sampled_from(sorted(set(_paths(HELLO)) - {"type"})), value=_json_values)
@example(path="inventory.cpu_cores", value=10**400)
@example(path="started_at", value=float("inf"))
def test_any_value_anywhere_in_a_hello_is_a_bad_message_or_in_range(path: str, value: object) -> None:
    try:
        hello = decode(_with(path, value), m.AgentMessage)
    except WireError as exc:
        assert exc.code == m.BAD_MESSAGE
        return
    for leaf in _leaves(attrs.asdict(hello)):
        if isinstance(leaf, bool) or leaf is None or isinstance(leaf, str):
            continue
        assert isinstance(leaf, (int, float)), (path, leaf)
        assert (0 <= leaf <= 2**63 - 1) if isinstance(leaf, int) else math.isfinite(leaf), (path, leaf)


def test_a_replica_detail_is_made_brief_with_the_end_of_its_engine_log() -> None:
    usage = "\n".join(f"  --option-{i} VALUE   what option {i} does" for i in range(18))
    detail = (
        "the engine exited with status 2, 3 times within 60 s; not restarted until the assignment changes. "
        f"{m.LOG_TAIL_MARK}usage: llmgw engine sim [-h]\n{usage}\n\nllmgw engine sim: error: unrecognized arguments: --bogus\n"
    )
    brief = m.brief_detail(detail)
    assert "\n" not in brief and "--option-3 " not in brief, brief
    assert brief == (
        "the engine exited with status 2, 3 times within 60 s; not restarted until the assignment changes. "
        "Its log ends: --option-16 VALUE   what option 16 does / --option-17 VALUE   what option 17 does / "
        "llmgw engine sim: error: unrecognized arguments: --bogus"
    )
    assert m.brief_detail("needs 2 GPUs; 1 of this node's 2 are free") == "needs 2 GPUs; 1 of this node's 2 are free"
