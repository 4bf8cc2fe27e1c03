"""Doctor's checks over snapshots discovered from fixtures; the control plane check on loopback."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import attrs
import pytest

from agent import doctor, doctor_checks
from agent.discovery import gpus, system
from agent.discovery.snapshot import Snapshot, discover
from llmgw.config import FabricDecl
from llmgw.errors import UsageError
from llmgw.wire import agent_link as w
from llmgw.wire.convert import converter
from testlib.hardware import FIXTURES, NO_TOOL, sources

SYNCED = system.ClockInfo(now=1_790_000_000.0, synchronized=True)
GIB = 1 << 30


def systemd_dir(tmp_path: Path, *, booted: bool = True) -> Path:
    """Where discovery looks for /run/systemd/system, present or not: never this machine's own."""
    path = tmp_path / "run" / "systemd" / "system"
    if booted:
        path.mkdir(parents=True, exist_ok=True)
    return path


def snap(tmp_path: Path, *, systemd: bool = True, **kw) -> Snapshot:
    src = attrs.evolve(
        sources(weights_dir=tmp_path / "weights", **kw), systemd_dir=systemd_dir(tmp_path, booted=systemd)
    )
    return attrs.evolve(discover(src), clock=SYNCED)


def by_name(checks) -> dict[str, doctor_checks.Check]:
    return {c.name: c for c in checks}


def check(tmp_path: Path, name: str, declared=(), **kw) -> doctor_checks.Check:
    return by_name(doctor_checks.run_checks(snap(tmp_path, **kw), declared))[name]


def test_a_healthy_gpu_node_on_two_fabrics_is_all_ok(tmp_path: Path) -> None:
    s = snap(tmp_path, proc="hgx-h100", pci="hgx-h100", gpu="h100", ib="two-fabrics")
    rep = doctor.report(s, [FabricDecl(name="ib-a"), FabricDecl(name="ib-b")])
    assert [(c.name, c.status) for c in rep.checks if c.status != doctor_checks.OK] == []
    assert [c.name for c in rep.checks] == list(doctor_checks.NAMES[:-1])
    assert rep.exit_status == 0
    checks = by_name(rep.checks)
    assert checks["fabrics"].detail == (
        "ib-a = mlx5_0,mlx5_1 on ib-sm:0x0002c90300a1b2c3; ib-b = mlx5_2,mlx5_3 on ib-sm:0x98039b0300c0ffee"
    )
    assert checks["fabric-manager"].detail == "4 NVSwitches; nv-fabricmanager is running"
    assert checks["gpudirect-rdma"].detail == "nvidia_peermem loaded (mlx5_0, mlx5_1, mlx5_2, mlx5_3)"


@pytest.mark.parametrize("proc", ["kvm64", "qemu64"])
def test_a_generic_virtual_cpu_warns_with_the_measured_numbers_and_the_fix(tmp_path: Path, proc: str) -> None:
    c = check(tmp_path, "cpu-features", proc=proc)
    assert c.status == doctor_checks.WARN
    assert f"the generic virtual CPU model {proc}; no SSE4.2, AVX, AVX2, FMA" in c.detail
    assert "1.33 tok/s under kvm64 against 9.88 with the host CPU" in c.detail and "19x slower" in c.detail
    assert "`qm set VMID --cpu host`" in c.fix


def test_cpu_ok_and_arm(tmp_path: Path) -> None:
    c = check(tmp_path, "cpu-features")
    assert c.status == doctor_checks.OK
    assert c.detail == (
        "Intel(R) Xeon(R) CPU E5-2680 v4 @ 2.40GHz, 8 logical cores: sse4.2 avx avx2 fma (no avx512; not needed)"
    )
    arm = check(tmp_path, "cpu-features", proc="aarch64")
    assert arm.status == doctor_checks.OK and "not x86" in arm.detail


def test_unreadable_proc_files_are_could_not_check(tmp_path: Path) -> None:
    s = attrs.evolve(snap(tmp_path), cpu=None, memory=None, disk=None)
    checks = by_name(doctor_checks.run_checks(s))
    for name in ("cpu-features", "memory", "disk"):
        assert checks[name].status == doctor_checks.UNKNOWN
        assert checks[name].detail.startswith("could not check")


def test_python_versions(tmp_path: Path) -> None:
    s = snap(tmp_path)
    assert doctor_checks.check_python(attrs.evolve(s, python=(3, 10, 12))).status == doctor_checks.OK
    assert doctor_checks.check_python(attrs.evolve(s, python=(3, 13, 1))).status == doctor_checks.OK
    assert doctor_checks.check_python(attrs.evolve(s, python=(3, 9, 18))).status == doctor_checks.FAIL
    assert doctor_checks.check_python(attrs.evolve(s, python=(3, 14, 0))).status == doctor_checks.WARN


def test_disk_thresholds(tmp_path: Path) -> None:
    s = snap(tmp_path)
    disk = system.DiskInfo(path="/w", measured_at="/w", free_bytes=0, total_bytes=100 * GIB)
    for free, status in ((1 * GIB, doctor_checks.FAIL), (10 * GIB, doctor_checks.WARN), (50 * GIB, doctor_checks.OK)):
        c = doctor_checks.check_disk(attrs.evolve(s, disk=attrs.evolve(disk, free_bytes=free)))
        assert c.status == status
        assert c.detail.startswith(f"{free / GIB:.1f} GiB free of 100.0 GiB at /w")
        assert (c.fix != "") == (status != doctor_checks.OK)


def test_clock(tmp_path: Path) -> None:
    s = snap(tmp_path)
    assert doctor_checks.check_clock(s).status == doctor_checks.OK
    unsynced = doctor_checks.check_clock(attrs.evolve(s, clock=attrs.evolve(SYNCED, synchronized=False)))
    assert unsynced.status == doctor_checks.WARN and "timedatectl set-ntp true" in unsynced.fix
    unknown = doctor_checks.check_clock(attrs.evolve(s, clock=attrs.evolve(SYNCED, synchronized=None)))
    assert unknown.status == doctor_checks.UNKNOWN and unknown.detail.startswith("could not check")
    wrong = doctor_checks.check_clock(attrs.evolve(s, clock=system.ClockInfo(now=86400.0, synchronized=True)))
    assert wrong.status == doctor_checks.FAIL and "1970-01-02T00:00:00Z" in wrong.detail


def test_service_manager_is_ok_under_systemd_and_warns_without_it(tmp_path: Path) -> None:
    ok = check(tmp_path / "booted", "service-manager")
    assert (ok.status, ok.detail, ok.fix) == (doctor_checks.OK, "systemd", "")
    bare = check(tmp_path / "container", "service-manager", systemd=False)
    assert bare.status == doctor_checks.WARN
    assert bare.detail == (
        "no systemd here (no /run/systemd/system): `llmgw node add` runs the agent under llmgw's own supervisor "
        "(`llmgw agent supervise`), which does not start it again after a reboot"
    )
    assert bare.fix.startswith("run the node with systemd as its init, or start the agent at boot yourself: ")
    assert bare.fix.endswith(
        "llmgw agent supervise --daemon --config /etc/llmgw/agent.toml --pid-file /run/llmgw-agent.pid "
        "--log /var/log/llmgw-agent.log"
    )
    rep = doctor.report(snap(tmp_path / "container", systemd=False))
    assert (rep.status, rep.exit_status) == (doctor_checks.WARN, 1)
    assert doctor.report(snap(tmp_path / "booted")).exit_status == 0


def test_a_cpu_node_is_not_an_error_and_vllm_is_not_applicable_there(tmp_path: Path) -> None:
    checks = by_name(doctor_checks.run_checks(snap(tmp_path)))
    assert checks["nvidia-smi"].status == doctor_checks.OK
    assert checks["nvidia-smi"].detail == (
        f"no NVIDIA GPU (no nvidia-smi at {NO_TOOL}, and none on the PCI bus): a CPU node, which is not an error"
    )
    assert checks["vllm"].status == doctor_checks.OK
    assert checks["vllm"].detail.startswith("not applicable: no NVIDIA GPU")
    for name in ("fabric-manager", "imex", "gpudirect-rdma", "subnet-manager", "infiniband-diags"):
        assert checks[name].status == doctor_checks.OK and checks[name].detail.startswith("not applicable"), name


def test_nvidia_smi_missing_where_the_bus_shows_gpus_fails(tmp_path: Path) -> None:
    checks = by_name(doctor_checks.run_checks(snap(tmp_path, pci="l4")))
    assert checks["nvidia-smi"].status == doctor_checks.FAIL
    assert checks["nvidia-smi"].fix.startswith("pass --nvidia-smi PATH")
    assert checks["vllm"].status == doctor_checks.UNKNOWN


def gpu_dri(tmp_path: Path) -> Path:
    """A /dev/dri with one GPU's render node: the node has a GPU with its kernel driver."""
    dri = tmp_path / "dri"
    dri.mkdir(parents=True, exist_ok=True)
    (dri / "renderD128").touch()
    return dri


def test_vulkan_without_a_gpu_is_ok_whatever_vulkaninfo_says(tmp_path: Path) -> None:
    for case, says in [
        (None, f"no vulkaninfo at {NO_TOOL} (vulkan-tools is not installed)"),
        ("no-driver", "the Vulkan loader finds no driver"),
        ("lavapipe", "llvmpipe (LLVM 15.0.6, 256 bits) (software, llvmpipe, Vulkan 1.3): software only"),
        ("garbage", "vulkaninfo at "),
    ]:
        c = check(tmp_path, "vulkan", vulkan=case)
        assert c.status == doctor_checks.OK and c.detail.startswith(says), (case, c)
        assert c.detail.endswith(f"; no GPU here (no render node in {FIXTURES / 'no-such-dir'}), so nothing to fix")


def test_vulkan_gpus_found_are_ok(tmp_path: Path) -> None:
    c = check(tmp_path, "vulkan", vulkan="radv", dri=gpu_dri(tmp_path))
    assert c.status == doctor_checks.OK
    assert c.detail.startswith("AMD Radeon RX 7900 XTX (RADV NAVI31) (discrete, radv, Vulkan 1.3, 24.0 GiB); llvmpipe")
    c = check(tmp_path, "vulkan", vulkan="intel")  # no render node read: still what the loader lists
    assert c.status == doctor_checks.OK and c.detail.startswith("Intel(R) UHD Graphics 770 (ADL-S GT1) (integrated")


def test_vulkan_a_gpu_without_a_usable_vulkan_device_warns_with_the_fix(tmp_path: Path) -> None:
    dri = gpu_dri(tmp_path)
    node = dri / "renderD128"
    c = check(tmp_path, "vulkan", vulkan="lavapipe", dri=dri)
    assert c.status == doctor_checks.WARN
    assert (
        c.detail == f"a GPU is here ({node}) but Vulkan sees only llvmpipe (LLVM 15.0.6, 256 bits) (software, "
        "llvmpipe, Vulkan 1.3): software only, not counted as a GPU"
    )
    assert "`sudo apt-get install mesa-vulkan-drivers`" in c.fix and "render" in c.fix
    c = check(tmp_path, "vulkan", vulkan=None, dri=dri)
    assert c.status == doctor_checks.WARN and c.fix == "`sudo apt-get install vulkan-tools mesa-vulkan-drivers`"
    assert f"the node has a GPU ({node})" in c.detail
    c = check(tmp_path, "vulkan", vulkan="no-driver", dri=dri)
    assert c.status == doctor_checks.WARN and "mesa-vulkan-drivers" in c.fix
    c = check(tmp_path, "vulkan", vulkan="no-loader", dri=dri)
    assert c.status == doctor_checks.WARN and "libvulkan1" in c.fix


def test_vulkan_on_an_nvidia_node_serving_through_cuda_is_not_needed(tmp_path: Path) -> None:
    c = check(tmp_path, "vulkan", gpu="l4", vulkan=None, dri=gpu_dri(tmp_path))
    assert c.status == doctor_checks.OK and c.detail.endswith("; not needed: the NVIDIA GPUs serve through CUDA")
    c = check(tmp_path, "vulkan", gpu="l4", vulkan="nvidia")
    assert c.status == doctor_checks.OK and c.detail.startswith("NVIDIA GeForce RTX 4090 (discrete, NVIDIA")


def test_nvidia_smi_failing_fails(tmp_path: Path) -> None:
    c = check(tmp_path, "nvidia-smi", gpu="failing")
    assert c.status == doctor_checks.FAIL and "couldn't communicate with the NVIDIA driver" in c.detail


def test_vllm_ineligible_is_a_warning_with_a_reason(tmp_path: Path) -> None:
    c = check(tmp_path, "vllm", gpu="gtx1080ti")
    assert c.status == doctor_checks.WARN
    assert c.detail == (
        "not eligible: vLLM needs compute capability 7.5 or newer; NVIDIA GeForce GTX 1080 Ti (6.1) is older"
    )
    assert "llama.cpp" in c.fix


def test_fabric_manager_must_run_on_nvswitch_systems(tmp_path: Path) -> None:
    s = snap(tmp_path, proc="hgx-h100", pci="hgx-h100", gpu="h100")
    stopped = doctor_checks.check_fabric_manager(attrs.evolve(s, commands=frozenset({"systemd"})))
    assert stopped.status == doctor_checks.FAIL
    assert "4 NVSwitches and nv-fabricmanager is not running" in stopped.detail
    assert "(550.54.15)" in stopped.fix and "nvidia-fabricmanager" in stopped.fix
    assert doctor_checks.check_fabric_manager(attrs.evolve(s, commands=None)).status == doctor_checks.UNKNOWN
    assert doctor_checks.check_fabric_manager(attrs.evolve(s, pci=None)).status == doctor_checks.UNKNOWN
    pcie = snap(tmp_path, pci="l4", gpu="l4")
    assert doctor_checks.check_fabric_manager(pcie).detail == "not applicable: no NVSwitch on the PCI bus"


def test_imex_on_multi_node_nvlink(tmp_path: Path) -> None:
    s = snap(tmp_path, proc="gb200", pci="gb200", gpu="gb200")
    missing = doctor_checks.check_imex(s)
    assert missing.status == doctor_checks.FAIL and "nvidia-imex" in missing.fix
    assert doctor_checks.check_imex(attrs.evolve(s, commands=s.commands | {"nvidia-imex"})).status == doctor_checks.OK
    assert doctor_checks.check_imex(snap(tmp_path, gpu="h100")).detail.startswith("not applicable")


def test_gpudirect_rdma_where_gpus_and_adapters_meet(tmp_path: Path) -> None:
    s = snap(tmp_path, proc="hgx-h100", gpu="h100", ib="one-fabric")
    assert doctor_checks.check_gpudirect(s).status == doctor_checks.OK
    unloaded = doctor_checks.check_gpudirect(attrs.evolve(s, modules=s.modules - {"nvidia_peermem"}))
    assert unloaded.status == doctor_checks.WARN and "modprobe nvidia_peermem" in unloaded.fix
    assert doctor_checks.check_gpudirect(attrs.evolve(s, modules=None)).status == doctor_checks.UNKNOWN
    assert doctor_checks.check_gpudirect(snap(tmp_path, gpu="h100")).detail.startswith("not applicable")


def test_a_linked_port_without_a_subnet_manager_fails(tmp_path: Path) -> None:
    c = check(tmp_path, "subnet-manager", ib="sm-lid-zero")
    assert c.status == doctor_checks.FAIL
    assert c.detail.startswith("no subnet manager: mlx5_1 port 1: link up, state INIT, SM LID 0")
    assert "`sudo apt-get install opensm`" in c.fix  # debian-12 fixture: apt
    ok = check(tmp_path, "subnet-manager", ib="port-down")  # a port with no link is not this check's business
    assert ok.status == doctor_checks.OK and ok.detail == (
        "every linked InfiniBand port sees one: mlx5_0/1: LID 1 (0x0002c90300a1b2c3)"
    )


def test_infiniband_diags(tmp_path: Path) -> None:
    declared = [FabricDecl(name="ib-a")]
    missing = check(tmp_path, "infiniband-diags", declared, ib="one-fabric", sminfo_path=NO_TOOL, os_release="rocky-9")
    assert missing.status == doctor_checks.WARN
    assert "`sudo dnf install infiniband-diags`" in missing.fix and "--sminfo PATH" in missing.fix
    undeclared = check(tmp_path, "infiniband-diags", ib="one-fabric", sminfo_path=NO_TOOL)
    assert undeclared.status == doctor_checks.OK and "needed only once a fabric is declared" in undeclared.detail
    roce = check(tmp_path, "infiniband-diags", [FabricDecl(name="r")], ib="roce")
    assert roce.status == doctor_checks.OK and roce.detail.startswith("not applicable")


def test_fabrics_check(tmp_path: Path) -> None:
    island = check(tmp_path, "fabrics", ib="two-fabrics")
    assert island.status == doctor_checks.OK
    assert island.detail == (
        "none declared: this node is its own island (single-node replicas only); adapter groups here: "
        "ib-sm:0x0002c90300a1b2c3: mlx5_0,mlx5_1; ib-sm:0x98039b0300c0ffee: mlx5_2,mlx5_3"
    )
    twice = [FabricDecl(name="ib-a", adapters=("mlx5_0", "mlx5_1")), FabricDecl(name="ib-b", adapters=("mlx5_1",))]
    refused = check(tmp_path, "fabrics", twice, ib="one-fabric")
    assert refused.status == doctor_checks.FAIL and refused.detail.startswith("adapter 'mlx5_1' is under fabrics")
    unverified = check(tmp_path, "fabrics", [FabricDecl(name="ib-a")], ib="one-fabric", sminfo_path=NO_TOOL)
    assert unverified.status == doctor_checks.UNKNOWN


def test_reaching_the_control_plane(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        reach = doctor.reach_control_plane(f"127.0.0.1:{port}")
        assert reach.ok and reach.detail == f"127.0.0.1:{port} accepts connections from this node's address 127.0.0.1"
        assert doctor.reach_control_plane(f"wss://127.0.0.1:{port}").ok
    closed = doctor.reach_control_plane(f"127.0.0.1:{port}")
    assert not closed.ok and "refuses connections" in closed.detail and "llmgw server" in closed.fix
    c = doctor_checks.check_control_plane(closed)
    assert c.status == doctor_checks.FAIL and c.name == "control-plane"


@pytest.mark.parametrize("bad", ["10.0.0.1", "wss://x", "host:port", ""])
def test_a_bad_control_plane_address_is_a_usage_error(bad: str) -> None:
    with pytest.raises(UsageError):
        doctor.parse_server(bad)


def test_exit_status_and_ignored_checks(tmp_path: Path) -> None:
    s = snap(tmp_path, proc="kvm64", gpu="failing")
    rep = doctor.report(s)
    assert rep.status == doctor_checks.FAIL and rep.exit_status == 2
    rep = doctor.report(s, ignore=frozenset({"nvidia-smi", "vllm"}))
    assert rep.status == doctor_checks.WARN and rep.exit_status == 1
    assert doctor.report(s, ignore=frozenset({"nvidia-smi", "vllm", "cpu-features"})).exit_status == 0
    with pytest.raises(UsageError):
        doctor.run(doctor.Request(ignore=frozenset({"cpu"})))


def test_human_output_is_one_line_per_check_with_a_fix_line_under_problems(tmp_path: Path) -> None:
    rep = doctor.report(snap(tmp_path, proc="kvm64"), ignore=frozenset({"memory"}))
    lines = doctor.format_human(rep).splitlines()
    width = max(len(n) for n in doctor_checks.NAMES[:-1])
    assert lines[0].startswith(f"warn {'cpu-features':<{width}}  Common KVM processor")
    assert lines[1] == " " * (5 + width + 2) + "fix: " + rep.checks[0].fix
    assert lines[2].startswith("ok   memory") and lines[2].endswith("(ignored)")


def test_json_carries_the_checks_and_the_inventory(tmp_path: Path) -> None:
    rep = doctor.report(
        snap(tmp_path, proc="hgx-h100", gpu="l4", pci="l4", ib="two-fabrics"), [FabricDecl(name="ib-a")]
    )
    data = json.loads(json.dumps(doctor.to_data(rep)))
    assert data["status"] == "ok" and data["exit_status"] == 0
    assert data["checks"][0] == {
        "name": "cpu-features",
        "status": "ok",
        "detail": rep.checks[0].detail,
        "fix": "",
        "ignored": False,
    }
    inventory = converter.structure(data["inventory"], w.Inventory)
    assert inventory == rep.inventory
    assert [g.identity for g in inventory.fabric_groups] == [
        "ib-sm:0x0002c90300a1b2c3",
        "ib-sm:0x98039b0300c0ffee",
    ]
    assert gpus.vllm_eligibility(discover(sources(weights_dir=tmp_path, gpu="l4")).gpus).status == w.ELIGIBLE


NO_TOOLS = ("a C compiler (cc, gcc or clang)", "a C++ compiler (c++, g++ or clang++)", "cmake", "make (or ninja)")


def test_a_node_without_a_compiler_is_fine_where_the_release_covers_it_and_is_told_the_packages(
    tmp_path: Path,
) -> None:
    cpu_node = attrs.evolve(snap(tmp_path), build_missing=NO_TOOLS, arch="x86_64", os_family="debian")
    c = by_name(doctor_checks.run_checks(cpu_node))["llamacpp-build"]
    assert c.status == doctor_checks.OK and c.detail.startswith(
        "not applicable: llama.cpp comes prebuilt from the release"
    )
    assert "cmake" in c.detail and "`sudo apt-get install build-essential cmake`" in c.detail
    # Another architecture: the release has no llama.cpp for it, a build is needed: the packages, per OS family.
    riscv = attrs.evolve(cpu_node, arch="riscv64", os_family="rhel")
    c = by_name(doctor_checks.run_checks(riscv))["llamacpp-build"]
    assert c.status == doctor_checks.WARN and "unavailable here (the node joins without it)" in c.detail
    assert c.fix == "install them: `sudo dnf install gcc-c++ cmake make`"
    # A GPU node with nvcc: a CUDA build is what the release's CPU archive does not cover.
    gpu_node = attrs.evolve(
        snap(tmp_path, proc="hgx-h100", pci="hgx-h100", gpu="h100"),
        build_missing=("cmake",),
        nvcc="/usr/local/cuda/bin/nvcc",
        os_family="",
    )
    c = by_name(doctor_checks.run_checks(gpu_node))["llamacpp-build"]
    assert c.status == doctor_checks.WARN and "without GPU offload" in c.detail
    assert "apt-get install build-essential cmake" in c.fix and "dnf install gcc-c++ cmake make" in c.fix
    # This machine has them all.
    assert by_name(doctor_checks.run_checks(snap(tmp_path)))["llamacpp-build"].status == doctor_checks.OK


def test_discovery_looks_for_the_build_tools_on_the_path_it_is_given(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("cc", "cmake"):
        (bare / tool).write_text("#!/bin/sh\n")
        (bare / tool).chmod(0o755)
    found = discover(attrs.evolve(sources(weights_dir=tmp_path / "w"), path=str(bare)))
    assert found.build_missing == ("a C++ compiler (c++, g++ or clang++)", "make (or ninja)")
    assert found.nvcc == "" or found.nvcc.startswith("/usr/local/cuda")
