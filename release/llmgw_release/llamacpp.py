"""The portable llama.cpp archive's layout and checks, decided without I/O.

One archive per architecture, `llama.cpp-<version>-linux-<arch>.tar.gz`, of what the portable
recipe's build leaves (llmgw.llamarecipe: the CMake arguments and the key, shared with a node's
own CPU build): one directory, `llama.cpp-<version>-linux-<arch>/`, and in it, flat,
`llama-server`, its shared libraries (with their soname links, every CPU variant a loadable
backend) and llama.cpp's LICENSE. The nodes rely on that layout. Built without OpenMP and
OpenSSL (see there), `SYSTEM_LIBRARIES` is all it may need from a stock Debian or Ubuntu, and
the build checks every object against it.

Here: the checks on what goes in (ELF machine, needed libraries, RUNPATH) and the archive's
bytes: sorted members, one mtime, uid/gid 0, fixed modes, gzip without a name or time, so the
same files give the same bytes. llamabuild.py and llamacompile.py do the I/O.

Standard library only, CPython 3.9+: tools/testenv/prepare.py runs the build with the
interpreter Pants runs on, before Pants starts.
"""

from __future__ import annotations

import gzip
import io
import re
import struct
import tarfile
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmgw.llamarecipe import (
    LICENSE,
    SERVER,
    SHIPPED,
    VULKAN_LOADER,
    RecipeError,
    Source,
    backend_top_dir,
    cpu_variants,
)

E_MACHINE = {"amd64": 0x3E, "arm64": 0xB7}  # ELF e_machine: EM_X86_64, EM_AARCH64

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


# -- the archive -----------------------------------------------------------------------------


# The Vulkan module needs the Vulkan loader too: the node's own (Debian's libvulkan1), which a node
# that gets the Vulkan archive has (agent: the archive is chosen only where the loader is).
VULKAN_SYSTEM = SYSTEM_LIBRARIES | {VULKAN_LOADER}


def archive_name(source: Source, arch: str, backend: str = "cpu") -> str:
    """`llama.cpp-<version>-linux-<arch>.tar.gz`; `-vulkan` before `.tar.gz` for the Vulkan build."""
    return f"{backend_top_dir(source, arch, backend)}.tar.gz"


@dataclass(frozen=True)
class Member:
    """A file of the archive's directory: `data` for a regular file, `link` for a symbolic link."""

    name: str  # flat: no "/"
    data: bytes | None = None
    link: str | None = None
    executable: bool = False


def check_members(members: Sequence[Member], variants: Sequence[str] | None = None) -> None:
    """Flat, llama-server present, at least one CPU backend (exactly `variants` where given: the
    recipe's, llmgw.llamarecipe.expected_variants), every link naming a file beside it."""
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
    built = cpu_variants(names)
    if not built:
        raise RecipeError(
            "the build made no CPU backend (libggml-cpu-<variant>.so): GGML_CPU_ALL_VARIANTS did not apply"
        )
    if variants is not None and built != sorted(variants):
        missing, extra = sorted(set(variants) - set(built)), sorted(set(built) - set(variants))
        raise RecipeError(
            f"the build's CPU backends are not the recipe's: missing {missing or 'none'}, not asked for "
            f"{extra or 'none'}; this llama.cpp source's variants differ from llmgw.llamarecipe.VARIANTS: update it"
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


def check_objects(
    arch: str,
    members: Sequence[Member],
    dynamic: Mapping[str, Mapping[str, list[str]]],
    *,
    beside: Collection[str] = (),
    system: Collection[str] = SYSTEM_LIBRARIES,
) -> None:
    """Every ELF file is for `arch`, finds its libraries by `$ORIGIN` alone (no build path, no
    RPATH), and needs nothing but the archive's own libraries (`members`, and `beside`: the
    names of those already checked) and `system` (the Vulkan module: and VULKAN_SYSTEM).
    `dynamic`: each ELF file's dynamic_section."""
    present = {m.name for m in members} | set(beside)
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
        foreign = sorted(n for n in entry.get("NEEDED", []) if n not in present and n not in system)
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
