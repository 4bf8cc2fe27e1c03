"""NVIDIA GPUs: what nvidia-smi reports, what the PCI bus shows, and whether vLLM can run.

nvidia-smi is asked one CSV question (`QUERY`). Its absence is not by itself "no GPU": a
containerised driver install routinely puts it elsewhere, and an agent that cannot find it
looks exactly like a node with none. So the PCI bus is read as well (vendor 0x10de), and a
node whose bus shows NVIDIA GPUs while nvidia-smi is missing is reported as such, with the
flag that fixes it. The bus also shows NVSwitches, which decide whether the fabric manager
must run.

Parsing (`parse_gpu_csv`) and judging (`eligibility`, by llmgw.engines.eligibility's rules) are pure; `probe_gpus` and
`read_nvidia_pci` do the I/O.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import attrs

from agent.discovery.tools import MISSING, ToolRun, run_tool
from llmgw.engines import eligibility as rules
from llmgw.engines.eligibility import VLLM, GpuRule, version_tuple
from llmgw.wire import agent_link as w

QUERY = ("index", "name", "uuid", "memory.total", "memory.free", "driver_version", "compute_cap", "pci.bus_id")

NVIDIA_VENDOR = "0x10de"
# PCI class codes: 0x03xxxx display controllers (VGA 0x0300, 3D 0x0302); NVSwitches are
# "bridge, other" (0x0680).
_DISPLAY_CLASS = "0x03"
_NVSWITCH_CLASS = "0x0680"

# GPUs of multi-node NVLink systems (GB200 / GB300 NVL72 compute trays), where memory is shared
# across nodes through the IMEX daemon.
_MULTI_NODE_NVLINK = re.compile(r"\bGB\d00\b")


class GpuCsvError(ValueError):
    """nvidia-smi printed something that is not the CSV asked for."""


@attrs.frozen(kw_only=True)
class NvidiaPci:
    gpus: int
    nvswitches: int


@attrs.frozen(kw_only=True)
class GpuReport:
    status: str  # one of w.GPUS_*
    detail: str  # for people
    fix: str = ""  # for a status that is a problem
    nvidia_smi: str = ""
    gpus: tuple[w.Gpu, ...] = ()


def nvidia_smi_argv(nvidia_smi: str) -> list[str]:
    return [nvidia_smi, f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits"]


def _mib(value: str) -> int:
    # "[N/A]" where memory is not the GPU's own (unified memory parts) or not reported.
    return int(value) if value.isdigit() else 0


def parse_gpu_csv(text: str) -> tuple[w.Gpu, ...]:
    gpus = []
    for n, row in enumerate(csv.reader(text.splitlines(), skipinitialspace=True), start=1):
        if not row or not "".join(row).strip():
            continue
        if len(row) != len(QUERY):
            raise GpuCsvError(f"line {n} has {len(row)} fields, expected {len(QUERY)} ({','.join(QUERY)}): {row!r}")
        index, name, uuid, total, free, driver, cc, bus = (v.strip() for v in row)
        if not index.isdigit():
            raise GpuCsvError(f"line {n}: index {index!r} is not a number")
        gpus.append(
            w.Gpu(
                index=int(index),
                name=name,
                uuid=uuid,
                memory_total_mib=_mib(total),
                memory_free_mib=_mib(free),
                driver_version=driver,
                compute_capability=cc,
                pci_bus_id=bus,
            )
        )
    return tuple(gpus)


def read_nvidia_pci(pci_root: Path) -> NvidiaPci | None:
    """NVIDIA GPUs and NVSwitches on the PCI bus (/sys/bus/pci/devices); None if unreadable."""
    try:
        devices = list(os.scandir(pci_root))
    except OSError:
        return None
    gpus = nvswitches = 0
    for dev in devices:
        try:
            vendor = Path(dev.path, "vendor").read_text().strip().lower()
            klass = Path(dev.path, "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor != NVIDIA_VENDOR:
            continue
        if klass.startswith(_DISPLAY_CLASS):
            gpus += 1
        elif klass.startswith(_NVSWITCH_CLASS):
            nvswitches += 1
    return NvidiaPci(gpus=gpus, nvswitches=nvswitches)


def judge(run: ToolRun, pci: NvidiaPci | None, nvidia_smi: str) -> GpuReport:
    """What one nvidia-smi run and the PCI bus say together."""
    on_bus = pci.gpus if pci else 0
    flag = f"pass --nvidia-smi PATH (or set nvidia_smi in agent.toml) to where nvidia-smi is (now {nvidia_smi})"
    if run.outcome == MISSING:
        if on_bus:
            return GpuReport(
                status=w.GPUS_NOT_FOUND,
                detail=f"{on_bus} NVIDIA GPU(s) on the PCI bus but no nvidia-smi at {nvidia_smi}",
                fix=f"{flag}, or install the NVIDIA driver's utilities",
                nvidia_smi=nvidia_smi,
            )
        seen = "" if pci else ", which could not be read to confirm"
        return GpuReport(
            status=w.GPUS_NONE,
            detail=f"no NVIDIA GPU (no nvidia-smi at {nvidia_smi}, and none on the PCI bus{seen})",
            fix=f"if this node has NVIDIA GPUs, {flag}",
            nvidia_smi=nvidia_smi,
        )
    if not run.ok:
        return GpuReport(
            status=w.GPUS_FAILED,
            detail=f"nvidia-smi at {nvidia_smi} is there but fails: it {run.problem()}",
            fix="load the NVIDIA driver: after a driver or kernel upgrade reboot; `dmesg | grep -i nvrm` says why "
            "it did not load; the driver's user-space tools and kernel module must be the same version",
            nvidia_smi=nvidia_smi,
        )
    try:
        gpus = parse_gpu_csv(run.stdout)
    except GpuCsvError as exc:
        return GpuReport(
            status=w.GPUS_FAILED,
            detail=f"nvidia-smi at {nvidia_smi} printed what is not the CSV asked for: {exc}",
            fix="check that the path is the real nvidia-smi, and that its driver is 510 or newer",
            nvidia_smi=nvidia_smi,
        )
    if not gpus:
        if on_bus:
            return GpuReport(
                status=w.GPUS_FAILED,
                detail=f"nvidia-smi lists no GPU but the PCI bus shows {on_bus}",
                fix="the driver does not bind them: check `dmesg | grep -i nvrm` and `nvidia-smi -L`",
                nvidia_smi=nvidia_smi,
            )
        return GpuReport(status=w.GPUS_NONE, detail="no NVIDIA GPU (nvidia-smi lists none)", nvidia_smi=nvidia_smi)
    names = sorted({g.name for g in gpus})
    return GpuReport(
        status=w.GPUS_PRESENT,
        detail=f"{len(gpus)} x {', '.join(names)}, driver {gpus[0].driver_version}",
        nvidia_smi=nvidia_smi,
        gpus=gpus,
    )


def probe_gpus(nvidia_smi: str, pci: NvidiaPci | None, *, timeout_s: float) -> GpuReport:
    return judge(run_tool(nvidia_smi_argv(nvidia_smi), timeout_s=timeout_s), pci, nvidia_smi)


def driver_too_old(report: GpuReport, rule: GpuRule = VLLM) -> bool:
    return bool(report.gpus) and version_tuple(report.gpus[0].driver_version) < version_tuple(rule.min_driver)


def eligibility(report: GpuReport, rule: GpuRule) -> w.EngineEligibility:
    """`rule`'s engine on these GPUs (llmgw.engines.eligibility has the rules)."""
    return rules.judge(rule, report.status, report.gpus, report.detail)


def vllm_eligibility(report: GpuReport) -> w.EngineEligibility:
    return eligibility(report, VLLM)


def multi_node_nvlink(gpus: tuple[w.Gpu, ...]) -> bool:
    return any(_MULTI_NODE_NVLINK.search(g.name) for g in gpus)
