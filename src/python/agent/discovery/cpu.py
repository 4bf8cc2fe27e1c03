"""The CPU as /proc/cpuinfo describes it: model, logical cores, flags, and what they mean here.

llama.cpp picks its backend from the instruction set the CPU reports. A VM given Proxmox's
default CPU model (kvm64, or QEMU's qemu64) reports neither AVX, AVX2, FMA nor even SSE4.2,
and llama.cpp falls back to scalar code: everything works and every number is small. This
module names the features that matter and recognises the generic virtual models, so that
`llmgw doctor` can say so with the numbers measured on the original system.

Whether x86 features apply is decided by what cpuinfo itself looks like (x86 kernels write
`flags`, ARM kernels `Features`), not by the machine running the code, so a recorded cpuinfo
means the same thing everywhere.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from llmgw.engines import cpubackend

# What the features mean for llama.cpp, the generic virtual models and doctor's wording are shared
# with the control plane's note on the CPU backend a node loaded: llmgw.engines.cpubackend.
FEATURES = cpubackend.FEATURES
REQUIRED = cpubackend.REQUIRED
MEASURED = cpubackend.MEASURED
FIX_PROXMOX = cpubackend.FIX_PROXMOX

# Arm's own cores (implementer 0x41) by part number, for a model name ARM kernels do not write.
_ARM_PARTS = {
    "0xd0c": "Neoverse-N1",
    "0xd40": "Neoverse-V1",
    "0xd49": "Neoverse-N2",
    "0xd4f": "Neoverse-V2",
    "0xd08": "Cortex-A72",
    "0xd0b": "Cortex-A76",
}

X86 = "x86"
ARM = "arm"
OTHER = "other"


@attrs.frozen(kw_only=True)
class CpuInfo:
    model: str
    cores: int  # logical processors
    flags: tuple[str, ...] = ()  # sorted, of the first processor
    isa: str = OTHER  # X86 when cpuinfo has x86 `flags`, ARM when it has `Features`


def parse_cpuinfo(text: str) -> CpuInfo:
    model = ""
    flags: tuple[str, ...] = ()
    cores = 0
    isa = OTHER
    implementer = part = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            cores += 1
        elif key in ("model name", "Model", "cpu model", "Hardware") and not model:
            model = value
        elif key == "flags" and not flags:
            flags, isa = tuple(sorted(value.split())), X86
        elif key == "Features" and not flags:
            flags, isa = tuple(sorted(value.split())), ARM
        elif key == "CPU implementer" and not implementer:
            implementer = value
        elif key == "CPU part" and not part:
            part = value
    if not model and implementer:
        known = _ARM_PARTS.get(part) if implementer == "0x41" else None
        model = f"Arm {known}" if known else f"Arm CPU (implementer {implementer}, part {part or '?'})"
    return CpuInfo(model=model or "unknown", cores=cores, flags=flags, isa=isa)


def read_cpuinfo(proc_root: Path) -> CpuInfo | None:
    try:
        return parse_cpuinfo((proc_root / "cpuinfo").read_text(errors="replace"))
    except OSError:
        return None


def features(cpu: CpuInfo) -> dict[str, bool]:
    """The features that matter, by the names people use; empty when they do not apply (ARM)."""
    if cpu.isa != X86:
        return {}
    have = set(cpu.flags)
    return {name: flag in have for name, flag in FEATURES}


def missing_required(cpu: CpuInfo) -> tuple[str, ...]:
    return tuple(name for name, present in features(cpu).items() if name in REQUIRED and not present)


def virtual_model(cpu: CpuInfo) -> str:
    """The generic virtual CPU model this is ("kvm64", "qemu64"), or "" for a real model name."""
    return cpubackend.virtual_model(cpu.model)
