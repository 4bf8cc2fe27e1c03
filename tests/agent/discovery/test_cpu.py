"""/proc/cpuinfo as real kernels write it: host CPU, kvm64, qemu64, ARM."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.discovery import cpu
from testlib.hardware import FIXTURES


def read(case: str) -> cpu.CpuInfo:
    info = cpu.read_cpuinfo(FIXTURES / "proc" / case)
    assert info is not None
    return info


def test_a_vm_with_the_host_cpu_has_every_feature_llama_cpp_wants() -> None:
    info = read("xeon-host-vm")
    assert info.model == "Intel(R) Xeon(R) CPU E5-2680 v4 @ 2.40GHz"
    assert info.cores == 8 and info.isa == cpu.X86
    assert cpu.features(info) == {"sse4.2": True, "avx": True, "avx2": True, "fma": True, "avx512": False}
    assert cpu.missing_required(info) == ()
    assert cpu.virtual_model(info) == ""


def test_avx512_is_reported_where_there_is_one() -> None:
    assert cpu.features(read("hgx-h100"))["avx512"] is True


@pytest.mark.parametrize(("case", "model"), [("kvm64", "kvm64"), ("qemu64", "qemu64")])
def test_generic_virtual_models_hide_the_features(case: str, model: str) -> None:
    info = read(case)
    assert cpu.virtual_model(info) == model
    assert cpu.missing_required(info) == ("sse4.2", "avx", "avx2", "fma")


def test_arm_cpus_have_no_x86_features_to_miss() -> None:
    info = read("aarch64")
    assert info.isa == cpu.ARM and info.cores == 4
    assert info.model == "Arm Neoverse-N1"
    assert "asimd" in info.flags
    assert cpu.features(info) == {} and cpu.missing_required(info) == ()


def test_model_names_that_say_kvm64_are_virtual_too() -> None:
    assert cpu.virtual_model(cpu.CpuInfo(model="kvm64 (custom)", cores=1)) == "kvm64"


def test_unreadable_cpuinfo_is_none(tmp_path: Path) -> None:
    assert cpu.read_cpuinfo(tmp_path) is None
