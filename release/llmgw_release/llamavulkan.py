"""The Vulkan llama.cpp archive: the CPU archive's files and llama.cpp's Vulkan module.

`llama.cpp-<version>-linux-<arch>-vulkan.tar.gz` (llmgw.llamarecipe, "the Vulkan module"): one
directory of that name holding what the CPU archive of the same CPU recipe holds, plus
libggml-vulkan.so, which llama-server loads from beside it at run time (GGML_BACKEND_DL). The
module is compiled alone in a tree configured with the CPU recipe's arguments and Vulkan on
(its target and libggml-base, which it links against: measured 271 s user and 37 s system
CPU, 2 GB of memory for its largest compile, against about 18 CPU-minutes for the CPU build); the CPU build is not repeated, its archive's files
are taken as they are.

Its headers: Debian 13's libvulkan-dev .deb, pinned in llmgw.pins, fetched once into the cache
and only its usr/include unpacked (`deb_data`: a .deb is an `ar` archive holding data.tar.xz;
read with the standard library). glslc and the loader to link against are the build machine's
(Debian 12's glslc, libvulkan-dev, spirv-headers: `needed_tools`).

The cache's rules are llamabuild's: one entry per key (`<top>-vulkan-<key>`), one build per key at
a time (its lock), the archive written whole and only after the module passed
llamacpp.check_objects (its only foreign need is the Vulkan loader, libvulkan.so.1).

Standard library only, CPython 3.9+ (see llmgw.llamarecipe).
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import time
from pathlib import Path

from llmgw import llamarecipe
from llmgw.llamarecipe import Pinned, Recipe, RecipeError, Source, Toolchain, VulkanRecipe
from llmgw_release import llamabuild, llamacpp
from llmgw_release.errors import LlamaBuildError
from llmgw_release.llamabuild import Say, stderr_say
from llmgw_release.llamacompile import compile_vulkan_module

HEADERS_PREFIX = "usr/include/"


def pinned_headers() -> Pinned:
    from llmgw import pins

    return Pinned(url=pins.VULKAN_HEADERS_URL, sha256=pins.VULKAN_HEADERS_SHA256, size=pins.VULKAN_HEADERS_SIZE)


def needed_tools(tc: Toolchain) -> dict[str, str]:
    """Beyond the CPU build's (llamabuild.needed_tools): program or path -> the Debian package."""
    return {
        llamarecipe.GLSLC: "glslc",  # compiles the shaders into the module
        f"/usr/lib/{tc.triplet}/libvulkan.so": "libvulkan-dev",  # the loader it links against
        "/usr/include/spirv/unified1/spirv.hpp": "spirv-headers",
    }


def make_recipe(source: Source, arch: str, *, this_cpu: bool = False) -> VulkanRecipe:
    """The Vulkan recipe on top of llamabuild.make_recipe's (the same `this_cpu`), with this machine's glslc."""
    cpu = llamabuild.make_recipe(source, arch, this_cpu=this_cpu)
    try:
        llamarecipe.vulkan_recipe(cpu, pinned_headers(), "")  # refuses what cannot be built, before asking glslc
    except RecipeError as exc:
        raise LlamaBuildError(str(exc)) from None
    llamabuild.check_tools(needed_tools(cpu.toolchain), f"building llama.cpp's Vulkan module for {arch}")
    glslc = llamabuild.first_line([llamarecipe.GLSLC, "--version"])
    return llamarecipe.vulkan_recipe(cpu, pinned_headers(), glslc)


# -- the headers -----------------------------------------------------------------------------


def deb_data(deb: bytes) -> tuple[str, bytes]:
    """The data.tar.* member of a .deb (an `ar` archive): its name and bytes."""
    magic = b"!<arch>\n"
    if not deb.startswith(magic):
        raise LlamaBuildError("not a .deb: no ar archive header")
    at = len(magic)
    while at + 60 <= len(deb):
        header = deb[at : at + 60]
        if header[58:60] != b"`\n":
            raise LlamaBuildError(f"not a .deb: a bad ar member header at byte {at}")
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = at + 60
        if name.startswith("data.tar"):
            return name, deb[start : start + size]
        at = start + size + (size & 1)  # members are padded to an even offset
    raise LlamaBuildError("the .deb holds no data.tar.*")


def headers_dir(root: Path, headers: Pinned) -> Path:
    """Where the headers are unpacked: a directory holding usr/include."""
    return root / "vulkan-headers" / headers.sha256[:16]


def ensure_headers(root: Path, headers: Pinned, say: Say = stderr_say) -> Path:
    """The pinned Vulkan headers, fetched and unpacked once (usr/include alone)."""
    dest = headers_dir(root, headers)
    if (dest / HEADERS_PREFIX / "vulkan" / "vulkan.hpp").is_file():
        return dest
    deb = llamabuild.fetch_pinned(
        headers, root / "vulkan-headers" / headers.name, f"the Vulkan headers: {headers.name} from Debian", say
    )
    name, data = deb_data(deb.read_bytes())
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    shutil.rmtree(part, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        members = [m for m in tar.getmembers() if _under_include(m.name) and (m.isfile() or m.isdir())]
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(part, members=members, **kwargs)  # pinned by sha256, names checked
    if not (part / HEADERS_PREFIX / "vulkan" / "vulkan.hpp").is_file():
        raise LlamaBuildError(f"{deb}'s {name} has no {HEADERS_PREFIX}vulkan/vulkan.hpp: not the Vulkan headers")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(part, dest)
    return dest


def _under_include(name: str) -> bool:
    parts = Path(name.removeprefix("./")).parts
    return len(parts) > 2 and parts[:2] == ("usr", "include") and ".." not in parts


# -- the archive -----------------------------------------------------------------------------


def entry_dir(root: Path, recipe: VulkanRecipe) -> Path:
    return root / "portable" / llamarecipe.vulkan_entry_name(recipe)


def archive_path(root: Path, recipe: VulkanRecipe) -> Path:
    return entry_dir(root, recipe) / llamacpp.archive_name(recipe.source, recipe.toolchain.arch, llamarecipe.VULKAN)


def top_dir(recipe: VulkanRecipe) -> str:
    return llamarecipe.backend_top_dir(recipe.source, recipe.toolchain.arch, llamarecipe.VULKAN)


def ensure_archive(
    recipe: VulkanRecipe, root: Path, *, jobs: int = llamabuild.DEFAULT_JOBS, say: Say = stderr_say
) -> Path:
    """The Vulkan archive from the cache, built first if it is not there (and the CPU archive it
    takes its files from, if that is not there either)."""
    path = archive_path(root, recipe)
    if path.is_file():
        return path
    cpu_archive = llamabuild.ensure_archive(recipe.cpu, root, jobs=jobs, say=say)
    entry = entry_dir(root, recipe)
    with llamabuild.locked(entry.with_name(f"{entry.name}.lock"), say, f"building {path.name}"):
        if path.is_file():
            return path
        return _build(recipe, root, cpu_archive, jobs=jobs, say=say)


def cpu_members(archive: Path, recipe: Recipe) -> list[llamacpp.Member]:
    """The files of the CPU archive, as Members (checked when that archive was built)."""
    top = llamarecipe.top_dir(recipe.source, recipe.toolchain.arch)
    members = []
    with tarfile.open(archive, "r:gz") as tar:
        infos = tar.getmembers()
        try:
            llamacpp.check_archive_names(top, infos)
        except RecipeError as exc:
            raise LlamaBuildError(f"{archive}: {exc}") from None
        for info in infos:
            name = info.name.partition("/")[2]
            if not name:
                continue
            if info.issym():
                members.append(llamacpp.Member(name=name, link=info.linkname))
            else:
                f = tar.extractfile(info)
                assert f is not None
                members.append(llamacpp.Member(name=name, data=f.read(), executable=name in llamarecipe.TARGETS))
    return members


def _build(recipe: VulkanRecipe, root: Path, cpu_archive: Path, *, jobs: int, say: Say) -> Path:
    if jobs < 1:
        raise LlamaBuildError(f"build jobs must be 1 or more, not {jobs}")
    source, arch = recipe.source, recipe.toolchain.arch
    headers = ensure_headers(root, recipe.headers, say)
    sdist = llamabuild.fetch_sdist(source, root, say)
    epoch = llamabuild.source_epoch(sdist)
    work = root / "portable" / "build" / entry_dir(root, recipe).name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    say(
        f"building llama.cpp {source.version}'s Vulkan module for linux-{arch} with {jobs} jobs (its shaders "
        "are many: measured 5 CPU-minutes, 7 minutes niced on 2 busy cores; the rest of the archive is the CPU "
        "build's)"
    )
    module, dynamic = compile_vulkan_module(recipe, sdist, epoch, work, headers, jobs=jobs, say=say)
    members = [*cpu_members(cpu_archive, recipe.cpu), module]
    try:
        llamacpp.check_members(members, llamarecipe.expected_variants(recipe.cpu))
        llamacpp.check_objects(
            arch,
            [module],
            {module.name: dynamic},
            beside=[m.name for m in members],
            system=llamacpp.VULKAN_SYSTEM,
        )
        data = llamacpp.assemble(top_dir(recipe), members, epoch)
    except RecipeError as exc:
        raise LlamaBuildError(f"{exc} (the build is kept in {work})") from None
    path = archive_path(root, recipe)
    llamabuild.store(entry_dir(root, recipe), path, recipe.as_json(), data, work)
    say(
        f"built {path} in {(time.monotonic() - started) / 60:.1f} min: {len(data) / 1e6:.1f} MB, the CPU archive's "
        f"files and {module.name} ({len(module.data or b'') / 1e6:.1f} MB)"
    )
    return path


# -- the tests' Vulkan llama-server ------------------------------------------------------------


def server_dir(root: Path, recipe: VulkanRecipe) -> Path:
    return entry_dir(root, recipe) / top_dir(recipe)


def cached_server(source: Source, root: Path) -> Path | None:
    """This machine's Vulkan llama-server from the cache, unpacked and running, or None."""
    recipe = make_recipe(source, llamabuild.this_host(), this_cpu=True)
    server = server_dir(root, recipe) / llamarecipe.SERVER
    return server if llamabuild.runs(server) and (server.parent / llamarecipe.VULKAN_MODULE).is_file() else None


def ensure_server(source: Source, root: Path, *, jobs: int = llamabuild.DEFAULT_JOBS, say: Say = stderr_say) -> Path:
    """This machine's Vulkan llama-server: the Vulkan archive on the build for this CPU, unpacked in the cache."""
    recipe = make_recipe(source, llamabuild.this_host(), this_cpu=True)
    archive = ensure_archive(recipe, root, jobs=jobs, say=say)
    server = server_dir(root, recipe) / llamarecipe.SERVER
    if llamabuild.runs(server):
        return server
    entry = entry_dir(root, recipe)
    with llamabuild.locked(entry.with_name(f"{entry.name}.lock"), say, f"unpacking {archive.name}"):
        if not llamabuild.runs(server):
            unpacked = entry / "unpacked"
            shutil.rmtree(unpacked, ignore_errors=True)
            shutil.rmtree(server.parent, ignore_errors=True)
            os.replace(llamabuild.unpack(archive, top_dir(recipe), unpacked), server.parent)
            shutil.rmtree(unpacked, ignore_errors=True)
    if not llamabuild.runs(server):
        raise LlamaBuildError(f"{server} --version fails after unpacking {archive}")
    return server
