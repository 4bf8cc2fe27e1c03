"""`llmgw doctor` run as a real process with fixture paths: output, --json and exit 0 / 1 / 2.

The clock, the free disk space and the service manager (systemd or not) are this machine's
own, so these tests ignore those three checks (`--ignore`, which still runs and shows them);
everything else comes from fixtures.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from testlib.hardware import FIXTURES, ib_root, nvidia_smi, sminfo, vulkaninfo
from testlib.proc import run_llmgw

REAL_MACHINE = ("--ignore", "clock,disk,service-manager")
MACHINE_CHECKS = ("clock", "disk", "service-manager")


def fixture_args(
    tmp_path: Path, *, proc: str, pci: str, gpu: str | None, ib: str, vulkan: str | None = "lavapipe"
) -> list[str]:
    return [
        "--vulkaninfo",
        vulkaninfo(vulkan),
        "--dri-dir",
        str(FIXTURES / "no-such-dir"),
        "--proc-root",
        str(FIXTURES / "proc" / proc),
        "--pci-root",
        str(FIXTURES / "pci" / pci),
        "--nvidia-smi",
        nvidia_smi(gpu),
        "--ib-root",
        str(ib_root(ib)),
        "--sminfo",
        sminfo(ib),
        "--weights-dir",
        str(tmp_path / "weights"),
        *REAL_MACHINE,
    ]


def doctor_json(*args: str) -> tuple[int, dict]:
    done = run_llmgw("doctor", "--json", *args)
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def statuses(data: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in data["checks"]}


@pytest.fixture
def control_plane() -> Iterator[str]:
    """A listening socket where the control plane's agent port would be."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def test_exit_0_on_a_healthy_gpu_node_with_two_fabrics(tmp_path: Path, control_plane: str) -> None:
    code, data = doctor_json(
        *fixture_args(tmp_path, proc="hgx-h100", pci="hgx-h100", gpu="h100", ib="two-fabrics"),
        "--fabric",
        "ib-a",
        "--fabric",
        "ib-b:mlx5_2,mlx5_3",
        "--server",
        control_plane,
    )
    counted = {n: s for n, s in statuses(data).items() if n not in MACHINE_CHECKS}
    assert set(counted.values()) == {"ok"}, data["checks"]
    assert (code, data["exit_status"], data["status"]) == (0, 0, "ok")
    assert [c["ignored"] for c in data["checks"] if c["name"] in MACHINE_CHECKS] == [True, True, True]
    assert "control-plane" in counted
    fabrics = data["inventory"]["fabrics"]
    assert [(f["name"], f["adapters"]) for f in fabrics] == [
        ("ib-a", ["mlx5_0", "mlx5_1"]),
        ("ib-b", ["mlx5_2", "mlx5_3"]),
    ]


def test_exit_1_on_a_kvm64_vm(tmp_path: Path) -> None:
    code, data = doctor_json(*fixture_args(tmp_path, proc="kvm64", pci="none", gpu=None, ib="empty"))
    assert (code, data["status"]) == (1, "warn")
    [warned] = [c for c in data["checks"] if c["status"] != "ok" and not c["ignored"]]
    assert warned["name"] == "cpu-features" and "--cpu host" in warned["fix"]
    assert statuses(data)["vllm"] == "ok"
    assert data["inventory"]["engine_eligibility"] == [
        {
            "engine": "vllm",
            "status": "not_applicable",
            "reason": "no NVIDIA GPU; vLLM runs on NVIDIA GPUs, llama.cpp serves this node",
        },
        {
            "engine": "sglang",
            "status": "not_applicable",
            "reason": "no NVIDIA GPU; SGLang runs on NVIDIA GPUs, llama.cpp serves this node",
        },
    ]


def test_exit_2_on_an_adapter_declared_under_two_fabrics(tmp_path: Path) -> None:
    code, data = doctor_json(
        *fixture_args(tmp_path, proc="xeon-host-vm", pci="none", gpu=None, ib="one-fabric"),
        "--fabric",
        "ib-a:mlx5_0,mlx5_1",
        "--fabric",
        "ib-b:mlx5_1",
    )
    assert (code, data["status"]) == (2, "fail")
    assert statuses(data)["fabrics"] == "fail"
    assert data["inventory"]["fabrics"] == []


def test_exit_2_when_nvidia_smi_fails_and_the_human_output(tmp_path: Path) -> None:
    done = run_llmgw("doctor", *fixture_args(tmp_path, proc="xeon-host-vm", pci="l4", gpu="failing", ib="empty"))
    assert done.returncode == 2, done.stderr
    lines = done.stdout.splitlines()
    [at] = [i for i, line in enumerate(lines) if line.split()[1:2] == ["nvidia-smi"]]
    assert lines[at].startswith("fail nvidia-smi ")
    assert "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver" in lines[at]
    assert lines[at + 1].split()[0] == "fix:"
    assert all(line.split()[0] in ("ok", "warn", "fail", "????", "fix:") for line in lines)


def test_config_file_values_and_flags_that_override_them(tmp_path: Path, control_plane: str) -> None:
    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text(
        f'server = "wss://{control_plane}"\n'
        f'nvidia_smi = "{nvidia_smi("l4")}"\n'
        f'ib_root = "{ib_root("two-fabrics")}"\n'
        f'sminfo = "{sminfo("two-fabrics")}"\n'
        f'weights_dir = "{tmp_path / "weights"}"\n'
        '[[fabrics]]\nname = "ib-a"\nadapters = ["mlx5_0", "mlx5_2"]\n'
    )
    args = ["--config", str(agent_toml), "--proc-root", str(FIXTURES / "proc" / "hgx-h100"), *REAL_MACHINE]
    code, data = doctor_json(*args)
    assert code == 2 and statuses(data)["fabrics"] == "fail"  # the file's fabric spans two subnet managers
    assert statuses(data)["control-plane"] == "ok"
    assert data["inventory"]["gpus"][0]["name"] == "NVIDIA L4"
    code, data = doctor_json(*args, "--fabric", "ib-a:mlx5_0,mlx5_1", "--nvidia-smi", nvidia_smi("h100"))
    assert statuses(data)["fabrics"] == "ok" and data["inventory"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"


def test_a_bad_fabric_flag_is_a_usage_error_with_the_commands_help() -> None:
    done = run_llmgw("doctor", "--fabric", "ib a:mlx5_0")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: llmgw doctor")
    assert "fabric name 'ib a' may use only letters, digits" in done.stderr


def test_an_unknown_check_to_ignore_is_a_usage_error() -> None:
    done = run_llmgw("doctor", "--ignore", "cpu")
    assert done.returncode == 2
    assert "--ignore: no check named cpu (checks: cpu-features, memory," in done.stderr


def test_vulkan_a_gpu_seen_only_as_software_warns_and_a_radv_card_is_reported(tmp_path: Path) -> None:
    dri = tmp_path / "dri"
    dri.mkdir()
    (dri / "renderD128").touch()
    args = fixture_args(tmp_path, proc="xeon-host-vm", pci="none", gpu=None, ib="empty")
    at = args.index("--dri-dir") + 1
    args[at] = str(dri)
    code, data = doctor_json(*args)
    [vk] = [c for c in data["checks"] if c["name"] == "vulkan"]
    assert (code, vk["status"]) == (1, "warn"), data["checks"]
    assert vk["detail"].startswith(f"a GPU is here ({dri / 'renderD128'}) but Vulkan sees only llvmpipe")
    assert "mesa-vulkan-drivers" in vk["fix"]
    assert data["inventory"]["vulkan_status"] == "present"
    assert [d["software"] for d in data["inventory"]["vulkan"]] == [True]

    args[args.index("--vulkaninfo") + 1] = vulkaninfo("radv")
    code, data = doctor_json(*args)
    [vk] = [c for c in data["checks"] if c["name"] == "vulkan"]
    assert (code, vk["status"]) == (0, "ok"), data["checks"]
    assert vk["detail"].startswith("AMD Radeon RX 7900 XTX (RADV NAVI31) (discrete, radv, Vulkan 1.3, 24.0 GiB)")
    radv = data["inventory"]["vulkan"][0]
    assert (radv["vendor_id"], radv["type"], radv["heaps"][0]) == (
        "0x1002",
        "discrete",
        {"size_bytes": 25753026560, "device_local": True},
    )
