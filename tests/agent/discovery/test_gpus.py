"""nvidia-smi's CSV from real cards, nvidia-smi failing or missing, the PCI bus, vLLM eligibility."""

from __future__ import annotations

import pytest

from agent.discovery import gpus
from agent.discovery.tools import MISSING, ToolRun
from llmgw.wire import agent_link as w
from testlib.hardware import FIXTURES, NO_TOOL, nvidia_smi

NO_PCI = gpus.NvidiaPci(gpus=0, nvswitches=0)


def probe(card: str | None, pci: gpus.NvidiaPci | None = NO_PCI) -> gpus.GpuReport:
    return gpus.probe_gpus(nvidia_smi(card), pci, timeout_s=10)


@pytest.mark.parametrize(
    ("card", "count", "name", "total", "driver", "cc", "bus"),
    [
        ("h100", 8, "NVIDIA H100 80GB HBM3", 81559, "550.54.15", "9.0", "00000000:18:00.0"),
        ("a100", 4, "NVIDIA A100-SXM4-80GB", 81920, "535.104.05", "8.0", "00000000:07:00.0"),
        ("l4", 1, "NVIDIA L4", 23034, "535.161.07", "8.9", "00000000:00:03.0"),
        ("rtx4090", 1, "NVIDIA GeForce RTX 4090", 24564, "550.67", "8.9", "00000000:01:00.0"),
        ("gb200", 4, "NVIDIA GB200", 189471, "570.124.06", "10.0", "00000008:01:00.0"),
    ],
)
def test_recorded_cards_parse(card: str, count: int, name: str, total: int, driver: str, cc: str, bus: str) -> None:
    report = probe(card)
    assert report.status == w.GPUS_PRESENT, report.detail
    assert len(report.gpus) == count
    first = report.gpus[0]
    assert (first.index, first.name, first.memory_total_mib) == (0, name, total)
    assert (first.driver_version, first.compute_capability, first.pci_bus_id) == (driver, cc, bus)
    assert first.uuid.startswith("GPU-") and 0 < first.memory_free_mib <= total
    assert [g.index for g in report.gpus] == list(range(count))
    assert report.detail == f"{count} x {name}, driver {driver}"


def test_the_csv_answers_exactly_the_question_asked() -> None:
    text = (FIXTURES / "nvidia-smi" / "l4.csv").read_text()
    assert len(text.split(",")) == len(gpus.QUERY)
    assert gpus.nvidia_smi_argv("nvidia-smi")[1] == f"--query-gpu={','.join(gpus.QUERY)}"


def test_no_nvidia_smi_and_nothing_on_the_bus_is_a_cpu_node() -> None:
    report = probe(None)
    assert report.status == w.GPUS_NONE
    assert report.detail == f"no NVIDIA GPU (no nvidia-smi at {NO_TOOL}, and none on the PCI bus)"


def test_no_nvidia_smi_with_gpus_on_the_bus_says_where_it_looked() -> None:
    report = probe(None, gpus.NvidiaPci(gpus=1, nvswitches=0))
    assert report.status == w.GPUS_NOT_FOUND
    assert report.detail == f"1 NVIDIA GPU(s) on the PCI bus but no nvidia-smi at {NO_TOOL}"
    assert report.fix.startswith("pass --nvidia-smi PATH")


def test_nvidia_smi_failing_is_an_error_with_its_message() -> None:
    report = probe("failing")
    assert report.status == w.GPUS_FAILED
    assert report.detail == (
        f"nvidia-smi at {nvidia_smi('failing')} is there but fails: it exits 9: NVIDIA-SMI has failed because it "
        "couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
    )
    assert "reboot" in report.fix


def test_no_devices() -> None:
    assert probe("no-devices").status == w.GPUS_FAILED  # exits 6
    ran = ToolRun(argv=("nvidia-smi",), outcome="ok", returncode=0, stdout="")
    assert gpus.judge(ran, NO_PCI, "nvidia-smi").status == w.GPUS_NONE
    assert gpus.judge(ran, gpus.NvidiaPci(gpus=2, nvswitches=0), "nvidia-smi").status == w.GPUS_FAILED


def test_unexpected_output_is_a_failure_not_a_crash() -> None:
    ran = ToolRun(argv=("nvidia-smi",), outcome="ok", returncode=0, stdout="0, NVIDIA L4\n")
    report = gpus.judge(ran, NO_PCI, "nvidia-smi")
    assert report.status == w.GPUS_FAILED and "line 1 has 2 fields, expected 8" in report.detail


def test_memory_not_applicable_reads_as_zero() -> None:
    [gpu] = gpus.parse_gpu_csv("0, NVIDIA GH200 480GB, GPU-1, [N/A], [N/A], 550.54.15, 9.0, 00000009:01:00.0\n")
    assert gpu.memory_total_mib == 0 and gpu.name == "NVIDIA GH200 480GB"


def test_pci_bus() -> None:
    assert gpus.read_nvidia_pci(FIXTURES / "pci" / "hgx-h100") == gpus.NvidiaPci(gpus=8, nvswitches=4)
    assert gpus.read_nvidia_pci(FIXTURES / "pci" / "l4") == gpus.NvidiaPci(gpus=1, nvswitches=0)
    assert gpus.read_nvidia_pci(FIXTURES / "pci" / "none") == NO_PCI
    assert gpus.read_nvidia_pci(FIXTURES / "no-such-dir") is None


@pytest.mark.parametrize(
    ("card", "status", "reason"),
    [
        ("h100", w.ELIGIBLE, "8 GPU(s) with compute capability 7.5 or newer, driver 550.54.15"),
        ("rtx4090", w.ELIGIBLE, "1 GPU(s) with compute capability 7.5 or newer, driver 550.67"),
        (
            "gtx1080ti",
            w.INELIGIBLE,
            "vLLM needs compute capability 7.5 or newer; NVIDIA GeForce GTX 1080 Ti (6.1) is older",
        ),
        (None, w.NOT_APPLICABLE, "no NVIDIA GPU; vLLM runs on NVIDIA GPUs, llama.cpp serves this node"),
    ],
)
def test_vllm_eligibility(card: str | None, status: str, reason: str) -> None:
    assert gpus.vllm_eligibility(probe(card)) == w.EngineEligibility(engine="vllm", status=status, reason=reason)


def test_vllm_on_a_node_whose_gpus_cannot_be_read_is_unknown_not_not_applicable() -> None:
    assert gpus.vllm_eligibility(probe("failing")).status == w.UNKNOWN
    missing = gpus.judge(ToolRun(argv=("x",), outcome=MISSING), gpus.NvidiaPci(gpus=1, nvswitches=0), "x")
    assert gpus.vllm_eligibility(missing).status == w.UNKNOWN


def test_an_old_driver_makes_vllm_ineligible() -> None:
    [gpu] = gpus.parse_gpu_csv("0, Tesla T4, GPU-1, 15360, 15000, 470.182.03, 7.5, 00000000:00:04.0\n")
    report = gpus.GpuReport(status=w.GPUS_PRESENT, detail="", gpus=(gpu,))
    e = gpus.vllm_eligibility(report)
    assert e.status == w.INELIGIBLE and e.reason.startswith("NVIDIA driver 470.182.03 is older than 525.60.13")
    assert gpus.driver_too_old(report)


def test_multi_node_nvlink_systems_are_known_by_their_gpus() -> None:
    assert gpus.multi_node_nvlink(probe("gb200").gpus)
    assert not gpus.multi_node_nvlink(probe("h100").gpus)
