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

import re
from pathlib import Path

import attrs

# (name shown to people, the kernel's flag). AVX-512 is reported but not required: many good
# hosts (AMD Zen 2/3, most desktop Intel parts) lack it, and llama.cpp is fast without it.
FEATURES = (("sse4.2", "sse4_2"), ("avx", "avx"), ("avx2", "avx2"), ("fma", "fma"), ("avx512", "avx512f"))
REQUIRED = ("sse4.2", "avx", "avx2", "fma")

# The model names QEMU gives its generic CPU models, and the models' own names.
_VIRTUAL_MODELS = (
    (re.compile(r"Common KVM processor", re.I), "kvm64"),
    (re.compile(r"Common 32-bit KVM processor", re.I), "kvm32"),
    (re.compile(r"QEMU Virtual CPU", re.I), "qemu64"),
    (re.compile(r"\b(kvm64|kvm32|qemu64|qemu32)\b", re.I), ""),
)

# Measured on the original system (node05: an 8-core VM on a Xeon E5-2680 v4, same weights and
# threads, only the CPU model changed). Quoted by doctor so the cost is a number, not a hunch.
MEASURED = (
    "measured: Qwen2.5-Coder 7B q4_K_M generates 1.33 tok/s under kvm64 against 9.88 with the host CPU, "
    "and prompt processing is 19x slower (7.6 against 143.8 tok/s)"
)
FIX_PROXMOX = (
    "give the VM the host's CPU model: on Proxmox `qm set VMID --cpu host` then stop and start the VM "
    "(a VM built by llmgw-provision-node has it: its `--cpu host` is the default); "
    "elsewhere use your hypervisor's host-passthrough CPU mode"
)

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
    for pattern, name in _VIRTUAL_MODELS:
        m = pattern.search(cpu.model)
        if m:
            return name or m.group(1).lower()
    return ""
