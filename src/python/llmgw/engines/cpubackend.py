"""Which CPU backend llama.cpp loaded on a node, and what it means there. Pure: text in, text out.

A llama.cpp built with `GGML_BACKEND_DL` and `GGML_CPU_ALL_VARIANTS` (the release's, and llama.cpp's
own release archives) carries one CPU backend per instruction-set level as a library beside
llama-server (`libggml-cpu-x64.so`, `-sse42`, `-haswell`, `-skylakex`, ...; `-armv8.0_1`,
`-armv8.2_2`, ... on Arm) and loads the best one the CPU reports, logging each load on standard
error as ggml-backend-reg.cpp prints it:

    load_backend: loaded CPU backend from /opt/llama.cpp-b11434-linux-amd64/libggml-cpu-haswell.so

b11434 prints that line only at its most verbose (`-lv 4`) while it serves a model, so the agent
does not wait for one: it asks the backends themselves, as llama.cpp does at start
(ggml_backend_load_best): each library exports `ggml_backend_score`, 0 where it cannot run here,
and the highest score wins. `SCORE_SCRIPT` asks them in a process of its own and `best` picks,
once the engine is checked (measured on this machine's AMD EPYC: zen4 1984, icelake 1472, haswell
64, x64 1, sapphirerapids 0 — the backend llama-server logs loading). `parse` reads the log line
where a log has it (an engine's own log at -lv 4). A build that links its one CPU backend in
(`BUILD_SHARED_LIBS=OFF`, no `GGML_BACKEND_DL`: the build on a node) has no library to ask:
`BUILT_IN`.

On x86 a variant below `haswell` means no AVX2 (`x64` is the scalar baseline): the same slow code
doctor's cpu-features check warns about, usually because a VM was given a generic CPU model. The
wording and the measured cost are doctor's, shared from here (agent.discovery.cpu imports them),
so the control plane's note (`note`) and doctor say the same thing.
"""

from __future__ import annotations

import re
from collections.abc import Collection

# (name shown to people, the kernel's flag). AVX-512 is reported but not required: many good
# hosts (AMD Zen 2/3, most desktop Intel parts) lack it, and llama.cpp is fast without it.
FEATURES = (("sse4.2", "sse4_2"), ("avx", "avx"), ("avx2", "avx2"), ("fma", "fma"), ("avx512", "avx512f"))
REQUIRED = ("sse4.2", "avx", "avx2", "fma")

# The model names QEMU gives its generic CPU models, and the models' own names.
VIRTUAL_MODELS = (
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

BUILT_IN = "built-in"  # the CPU backend is linked into llama-server: nothing is chosen at run time
NONE_LOADED = "none"  # a build of loadable backends that loaded no CPU backend: it cannot run a model
# x86 variants without AVX2 (ggml/src/CMakeLists.txt, GGML_CPU_ALL_VARIANTS), x64 the baseline.
X86_WITHOUT_AVX2 = ("x64", "sse42", "sandybridge", "ivybridge", "piledriver")
BASELINE = {"x86_64": "x64", "aarch64": "armv8.0_1"}

_LOADED = re.compile(r"^load_backend: loaded CPU backend from (?P<path>.+?)\s*$", re.M)
_LIBRARY = re.compile(r"(?:lib)?ggml-cpu(?:-(?P<variant>[^/]+?))?\.(?:so|dll|dylib)")


def parse(output: str, *, loadable: bool) -> str:
    """The CPU backend named in llama-server's output (the variant, e.g. `haswell`).

    `loadable`: the build has CPU backends as libraries beside it (libggml-cpu*.so); without one
    and without a line, it is BUILT_IN; with them and without a line, NONE_LOADED."""
    found = _LOADED.findall(output)
    if found:
        library = found[-1].replace("\\", "/").rsplit("/", 1)[-1]
        m = _LIBRARY.fullmatch(library)
        if m is None:
            return library  # a library of another name: say it as it is
        return m["variant"] or "ggml-cpu"  # libggml-cpu.so: a build of one loadable CPU backend
    return NONE_LOADED if loadable else BUILT_IN


# Asks each CPU backend beside llama-server how well it fits this CPU, as llama.cpp itself does at
# start (ggml_backend_load_best: every libggml-cpu-*.so exports `ggml_backend_score`, 0 where it
# cannot run; the highest wins). Run in a process of its own (argv: the directory), so the
# libraries are never loaded into the agent; prints "VARIANT SCORE" lines.
SCORE_SCRIPT = """
import ctypes, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("libggml-cpu*.so")):
    try:
        score = ctypes.CDLL(str(path)).ggml_backend_score
        score.restype = ctypes.c_int
        print(path.name, score())
    except (OSError, AttributeError) as exc:
        print(path.name, -1, exc)
"""


def best(score_lines: str) -> str:
    """The CPU backend llama.cpp loads, from `SCORE_SCRIPT`'s lines: the variant with the highest
    score above 0 (the first of equals, by name), or NONE_LOADED when none can run here."""
    chosen, top = NONE_LOADED, 0
    for line in score_lines.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        try:
            score = int(parts[1])
        except ValueError:
            continue
        m = _LIBRARY.fullmatch(parts[0])
        if m is not None and score > top:
            chosen, top = m["variant"] or "ggml-cpu", score
    return chosen


def virtual_model(model: str) -> str:
    """The generic virtual CPU model `model` names ("kvm64", "qemu64"), or "" for a real one."""
    for pattern, name in VIRTUAL_MODELS:
        m = pattern.search(model)
        if m:
            return name or m.group(1).lower()
    return ""


def missing_x86(flags: Collection[str]) -> tuple[str, ...]:
    """The features llama.cpp's fast x86 code needs that `flags` (the kernel's) lack."""
    have = set(flags)
    return tuple(name for name, flag in FEATURES if name in REQUIRED and flag not in have)


def note(backend: str, *, arch: str, cpu_model: str, cpu_flags: Collection[str]) -> str:
    """What an operator should know about the backend llama.cpp loaded: "" when it is a good one
    (or not known); else what it costs, the cause and the fix."""
    if backend == NONE_LOADED:
        return (
            "llama.cpp loaded no CPU backend: none of its libggml-cpu-*.so runs on this CPU or they are missing "
            "beside llama-server; reinstall the release's llama.cpp archive"
        )
    if arch not in ("x86_64", "amd64") or backend not in X86_WITHOUT_AVX2:
        return ""
    said = f"llama.cpp loaded its {backend} CPU backend, without AVX2"
    missing = missing_x86(cpu_flags)
    virtual = virtual_model(cpu_model)
    if virtual or missing:
        why = [f"the generic virtual CPU model {virtual}" if virtual else ""]
        why.append(f"it reports no {', '.join(missing).upper()}" if missing else "")
        cause = "; ".join(x for x in why if x)
        return f"{said}: this CPU hides the instructions its fast code needs ({cause}); {MEASURED}. Fix: {FIX_PROXMOX}"
    return (
        f"{said}, although this CPU reports AVX2 and FMA: the llama.cpp in use carries no backend built for them; "
        "install the release's llama.cpp archive (every CPU variant, chosen at run time)"
    )
