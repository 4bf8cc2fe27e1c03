"""One compile of llama.cpp by its portable recipe (llmgw.llamarecipe), in a work directory, into
an archive's bytes: the verified source unpacked (every name checked to stay in its top
directory), the CPU variants this compiler cannot build dropped, CMake configured and run with
its output in a log and ninja's progress told, the built files collected and checked
(llamacpp.check_members, and check_objects on each ELF object's dynamic section as readelf
reads it), then the archive assembled (llamacpp.assemble).

The cache around it is `llamabuild`'s: which recipe, where its source and its archive are kept,
one build per key at a time, the archive written only whole. Here the compile alone, which leaves
its work directory as it is (a failed build is kept there to be looked at).

A rebuild is byte-identical: the build directory's path is mapped away in everything compiled
(-ffile-prefix-map, in the recipe's arguments), the compiler sees SOURCE_DATE_EPOCH, git is kept
out of the build info (llamarecipe.build_environ), and llamacpp.assemble writes the same bytes
for the same files, dated by the source (its newest file), not the clock or the llmgw commit.

Standard library only, CPython 3.9+ (see llmgw.llamarecipe).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from llmgw import llamarecipe
from llmgw.llamarecipe import Recipe, RecipeError, Source, VulkanRecipe
from llmgw_release import llamacpp
from llmgw_release.errors import LlamaBuildError

CONFIGURE_TIMEOUT_S = 900
READELF_TIMEOUT_S = 60
TAIL_LINES = 30


def compile_archive(
    recipe: Recipe, sdist: Path, epoch: int, work: Path, *, jobs: int, say: Callable[[str], None]
) -> tuple[bytes, list[llamacpp.Member]]:
    """Build `recipe` from `sdist` in `work` (empty); the archive's bytes and the files it holds."""
    source, tc = recipe.source, recipe.toolchain
    try:
        src, build = _compile(recipe, recipe.args, llamarecipe.TARGETS, sdist, epoch, work, {}, jobs, say)
        members = _collect(build / "bin", src / llamarecipe.LICENSE)
        llamacpp.check_members(members, llamarecipe.expected_variants(recipe))
        llamacpp.check_objects(tc.arch, members, {m.name: _dynamic(build / "bin" / m.name) for m in _elves(members)})
        data = llamacpp.assemble(llamarecipe.top_dir(source, tc.arch), members, epoch)
    except RecipeError as exc:
        raise LlamaBuildError(f"{exc} (the build is kept in {work})") from None
    return data, members


def compile_vulkan_module(
    recipe: VulkanRecipe, sdist: Path, epoch: int, work: Path, headers: Path, *, jobs: int, say: Callable[[str], None]
) -> tuple[llamacpp.Member, dict[str, list[str]]]:
    """Build the Vulkan module of `recipe` in `work` (empty), its headers unpacked in `headers`
    (the directory holding usr/include): the module and its dynamic section. Only its target is
    compiled (with libggml-base, which it links against; the CPU archive ships that)."""
    paths = {"vulkan_headers": str(headers)}
    try:
        _, build = _compile(recipe.cpu, recipe.args, (llamarecipe.VULKAN_TARGET,), sdist, epoch, work, paths, jobs, say)
    except RecipeError as exc:
        raise LlamaBuildError(f"{exc} (the build is kept in {work})") from None
    path = build / "bin" / llamarecipe.VULKAN_MODULE
    if not path.is_file():
        raise LlamaBuildError(f"the build made no {path} (the build is kept in {work})")
    return llamacpp.Member(name=path.name, data=path.read_bytes()), _dynamic(path)


def _compile(
    recipe: Recipe,
    args: Sequence[str],
    targets: Sequence[str],
    sdist: Path,
    epoch: int,
    work: Path,
    paths: Mapping[str, str],
    jobs: int,
    say: Callable[[str], None],
) -> tuple[Path, Path]:
    """Configure `args` (the recipe's, or more) and build `targets`; the source and build directories."""
    src = _unpack_source(sdist, recipe.source, work)
    if recipe.dropped:
        cmakelists = src / "ggml" / "src" / "CMakeLists.txt"
        cmakelists.write_text(llamarecipe.drop_variants(cmakelists.read_text(), recipe.dropped))
    toolchain = work / "toolchain.cmake"
    if recipe.toolchain_file:
        toolchain.write_text(recipe.toolchain_file)
    build = work / "build"
    filled = llamarecipe.fill(args, work=str(work), src=str(src), build=str(build), toolchain=str(toolchain), **paths)
    env = llamarecipe.build_environ(os.environ, epoch, str(work))
    _run_logged(["cmake", *filled], env, work / "configure.log", "configuring", CONFIGURE_TIMEOUT_S, say)
    _run_logged(
        ["cmake", "--build", str(build), "--target", *targets, "-j", str(jobs)],
        env,
        work / "build.log",
        "compiling",
        None,
        say,
    )
    return src, build


def _unpack_source(sdist: Path, source: Source, work: Path) -> Path:
    top = source.sdist_root
    with tarfile.open(sdist, "r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            parts = Path(m.name).parts
            if not parts or parts[0] != top or ".." in parts or Path(m.name).is_absolute():
                raise LlamaBuildError(f"{sdist}: member {m.name!r} is outside {top}/")
            if not (m.isfile() or m.isdir() or m.issym()):
                raise LlamaBuildError(f"{sdist}: member {m.name!r} is neither a file, a directory nor a link")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(work / "src", members=members, **kwargs)  # pinned by sha256, names checked above
    src = work / "src" / top / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        raise LlamaBuildError(f"{sdist} has no {top}/llama.cpp/CMakeLists.txt: not llama.cpp's source")
    return src


_NINJA = re.compile(r"^\[(\d+)/(\d+)\]")


def _run_logged(
    argv: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    doing: str,
    timeout: float | None,
    say: Callable[[str], None],
) -> None:
    """Run with output to `log`; ninja's "[n/N]" progress said every tenth."""
    deadline = None if timeout is None else time.monotonic() + timeout
    told = 0
    with log.open("w") as out:
        try:
            proc = subprocess.Popen(
                list(argv),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=dict(env),
                start_new_session=True,  # the compilers die with it, below
            )
        except OSError as exc:
            raise LlamaBuildError(f"cannot run {argv[0]}: {exc}") from None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                m = _NINJA.match(line)
                if m and int(m.group(2)):
                    tenth = int(m.group(1)) * 10 // int(m.group(2))
                    if tenth > told:
                        told = tenth
                        say(f"{doing}: {tenth * 10}% ({m.group(1)}/{m.group(2)})")
                if deadline is not None and time.monotonic() > deadline:
                    raise LlamaBuildError(f"{doing} took more than {timeout:.0f} s; its log: {log}")
            status = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if status != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:])
        raise LlamaBuildError(f"{doing} llama.cpp failed (exit {status}); the end of {log}:\n{tail}")


def _collect(bin_dir: Path, license_file: Path) -> list[llamacpp.Member]:
    if not bin_dir.is_dir():
        raise LlamaBuildError(f"the build made no {bin_dir}")
    members = []
    for name in llamarecipe.shipped(p.name for p in bin_dir.iterdir()):
        path = bin_dir / name
        if path.is_symlink():
            members.append(llamacpp.Member(name=name, link=os.readlink(path)))
        elif path.is_file():
            members.append(llamacpp.Member(name=name, data=path.read_bytes(), executable=name in llamarecipe.TARGETS))
    members.append(llamacpp.Member(name=llamarecipe.LICENSE, data=license_file.read_bytes()))
    return members


def _elves(members: Sequence[llamacpp.Member]) -> list[llamacpp.Member]:
    return [m for m in members if m.data is not None and llamacpp.elf_machine(m.data) is not None]


def _dynamic(path: Path) -> dict[str, list[str]]:
    try:
        done = subprocess.run(
            ["readelf", "-d", "-W", str(path)], capture_output=True, text=True, timeout=READELF_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlamaBuildError(f"cannot run readelf on {path}: {exc}") from None
    if done.returncode != 0:
        raise LlamaBuildError(f"readelf -d {path} failed: {done.stderr.strip()}")
    return llamacpp.dynamic_section(done.stdout)
