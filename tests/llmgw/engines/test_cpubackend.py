"""Which CPU backend llama.cpp loaded, read from what llama-server prints (recorded lines,
tests/fixtures/llamacpp/README.md), and what the control plane says of it (pure)."""

from __future__ import annotations

import pytest

from llmgw.engines import cpubackend
from testlib.proc import build_root

FIXTURES = build_root() / "tests" / "fixtures" / "llamacpp"
HOST_FLAGS = ("fpu", "sse2", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")
KVM64_FLAGS = ("fpu", "sse2", "lm")


def said(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize(
    ("fixture", "loadable", "backend"),
    [
        ("list-devices-haswell.txt", True, "haswell"),
        ("list-devices-x64.txt", True, "x64"),
        ("list-devices-arm64.txt", True, "armv8.2_2"),
        ("startup-skylakex.txt", True, "skylakex"),
        # The tests' llama-server links its CPU backend in: nothing is loaded, nothing chosen.
        ("list-devices-static.txt", False, cpubackend.BUILT_IN),
        # A build of loadable backends that loaded RPC but no CPU backend cannot run a model.
        ("rpc-no-cpu.txt", True, cpubackend.NONE_LOADED),
    ],
)
def test_the_backend_is_read_from_what_llama_server_printed(fixture: str, loadable: bool, backend: str) -> None:
    assert cpubackend.parse(said(fixture), loadable=loadable) == backend


def test_the_last_cpu_line_counts_and_other_backends_do_not() -> None:
    text = (
        "load_backend: loaded RPC backend from /x/libggml-rpc.so\n"
        "load_backend: loaded CPU backend from /x/libggml-cpu-sse42.so\r\n"  # a log read from a CRLF file
        "load_backend: loaded CPU backend from /x/libggml-cpu-icelake.so\n"
    )
    assert cpubackend.parse(text, loadable=True) == "icelake"
    one = "load_backend: loaded CPU backend from /opt/llama/libggml-cpu.so\n"  # DL, one CPU backend only
    assert cpubackend.parse(one, loadable=True) == "ggml-cpu"
    odd = "load_backend: loaded CPU backend from /opt/llama/my-cpu.so\n"
    assert cpubackend.parse(odd, loadable=True) == "my-cpu.so"


def test_a_good_backend_or_arm_or_an_unknown_one_has_no_note() -> None:
    for backend in ("haswell", "skylakex", "zen4", cpubackend.BUILT_IN, ""):
        assert cpubackend.note(backend, arch="x86_64", cpu_model="Xeon", cpu_flags=HOST_FLAGS) == ""
    assert cpubackend.note("armv8.0_1", arch="aarch64", cpu_model="Arm Neoverse-N1", cpu_flags=("asimd",)) == ""


def test_the_baseline_in_a_kvm64_vm_names_the_cause_and_doctors_fix() -> None:
    note = cpubackend.note("x64", arch="x86_64", cpu_model="Common KVM processor", cpu_flags=KVM64_FLAGS)
    assert note.startswith("llama.cpp loaded its x64 CPU backend, without AVX2: this CPU hides the instructions")
    assert "the generic virtual CPU model kvm64; it reports no SSE4.2, AVX, AVX2, FMA" in note
    assert cpubackend.MEASURED in note and note.endswith(f"Fix: {cpubackend.FIX_PROXMOX}")
    assert "`qm set VMID --cpu host`" in note
    # A named CPU model that hides AVX2 and FMA (a VM given an old model) says what it lacks.
    sandy = cpubackend.note("sandybridge", arch="x86_64", cpu_model="Intel Xeon E5-2680", cpu_flags=HOST_FLAGS[:4])
    assert "it reports no AVX2, FMA" in sandy and "generic virtual" not in sandy


def test_the_baseline_on_a_cpu_with_avx2_blames_the_build_and_none_loaded_says_reinstall() -> None:
    note = cpubackend.note("x64", arch="x86_64", cpu_model="AMD EPYC 7763", cpu_flags=HOST_FLAGS)
    assert "although this CPU reports AVX2 and FMA" in note and "release's llama.cpp archive" in note
    none = cpubackend.note(cpubackend.NONE_LOADED, arch="x86_64", cpu_model="x", cpu_flags=HOST_FLAGS)
    assert none.startswith("llama.cpp loaded no CPU backend") and "reinstall" in none


def test_doctor_and_the_note_share_their_wording() -> None:
    from agent.discovery import cpu

    assert cpu.FIX_PROXMOX is cpubackend.FIX_PROXMOX and cpu.MEASURED is cpubackend.MEASURED
    assert cpu.virtual_model(cpu.CpuInfo(model="QEMU Virtual CPU version 2.5+", cores=1)) == "qemu64"


def test_the_backend_is_the_best_scored_as_llama_cpp_picks_it() -> None:
    # Scores of an all-variants amd64 build on an AMD EPYC (Zen 4), recorded here.
    lines = "\n".join(
        [
            "libggml-cpu-alderlake.so 0",
            "libggml-cpu-haswell.so 64",
            "libggml-cpu-icelake.so 1472",
            "libggml-cpu-sapphirerapids.so 0",
            "libggml-cpu-x64.so 1",
            "libggml-cpu-zen4.so 1984",
        ]
    )
    assert cpubackend.best(lines) == "zen4"
    assert cpubackend.best("libggml-cpu-x64.so 1\nlibggml-cpu-haswell.so 0") == "x64"
    assert cpubackend.best("libggml-cpu-haswell.so 0\nlibggml-cpu-x64.so -1 cannot open") == cpubackend.NONE_LOADED
    assert cpubackend.best("garbage\n\nlibggml-cpu-a.so notanumber") == cpubackend.NONE_LOADED
