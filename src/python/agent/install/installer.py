"""Installed engines on a node, one directory per engine version, switched atomically.

    STATE/engines/<name>/<version>/      an unpacked archive or a venv
    STATE/engines/<name>/current         symlink to the version in use
    STATE/engines/.downloads/<sha256>    verified archives (kept: a reinstall needs no network)

    STATE/engines/<name>/<version>.build.log   the last build's log (llama.cpp from source)

A new version is made in its own directory and checked to run (`--version`, or the engine's
own check, within a timeout) before `current` is switched to it with one rename, so the old
version keeps serving until the new one is known to start. A version that fails its check is
removed and reported with the engine's own output; `current` is left alone. Only the current
and the previous version are kept.

A version comes from a prebuilt archive (one server.toml names, the control plane's release, or
the release `llmgw node add --release` installed on this node: verified in place), a pip requirement, or llama.cpp's source built here (agent.install.build); a build may be kept in
a build cache and reused by an identical one. Where `Wanted.flags_of` names an engine, its whole
help is checked against the flags llmgw gives it (engine-check's check) before it is offered.
`ensure` reports its phases ("fetch", "unpack", "configure", "build", "install", "check") and
percentages, when known, to `on_progress`, at each change (the caller throttles). What it is asked
to make, and what it made, are agent.install.plan's (named here too, as its callers know them).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import secrets
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import trio

from agent.install import build as b
from agent.install.archive import Limits
from agent.install.errors import BadSource, DownloadError, EngineCheckFailed, PipInstallFailed
from agent.install.flags import HELP_TIMEOUT_S, help_run, judge_help
from agent.install.plan import ArchiveSource, BuildSource, Installed, OnProgress, PipSource, Wanted
from agent.install.toolchain import find_toolchain, which_on
from agent.install.unpack import unpack
from llmgw import llamarecipe
from llmgw.download import Progress, archive_cap, fetch, sha256_of
from llmgw.engines import cpubackend
from llmgw.log import get_logger

log = get_logger("llmgw.agent.install")

CHECK_TIMEOUT_S = 60.0
PIP_TIMEOUT_S = 3600.0
VENV_TIMEOUT_S = 300.0


async def check_runs(argv: list[str], timeout_s: float = CHECK_TIMEOUT_S, env: dict | None = None) -> str:
    """Run an engine's self-check; returns its output, raises EngineCheckFailed with it."""
    try:
        with trio.fail_after(timeout_s):
            done = await trio.run_process(
                argv, capture_stdout=True, stderr=subprocess.STDOUT, check=False, env=env, stdin=subprocess.DEVNULL
            )
    except trio.TooSlowError:
        raise EngineCheckFailed(f"`{' '.join(argv)}` did not finish within {timeout_s:g} s") from None
    except OSError as exc:
        raise EngineCheckFailed(f"`{argv[0]}` cannot be run: {exc.strerror or exc}") from None
    output = done.stdout.decode("utf-8", "replace")
    if done.returncode != 0:
        raise EngineCheckFailed(f"`{' '.join(argv)}` exited with status {done.returncode}", output)
    return output


async def _verified_here(path: Path, sha256: str, sha256_from: str) -> Path:
    """`path`, a file on this node, once its sha256 is the one `sha256_from` lists: nothing is
    unpacked from a file that is not the one listed. No copy: unpacking reads it where it is."""
    try:
        actual = await trio.to_thread.run_sync(sha256_of, path)
    except OSError as exc:
        raise BadSource(f"cannot read {path}: {exc.strerror or exc}; add the node again to place it anew") from None
    if actual != sha256:
        raise DownloadError(
            f"{path} has sha256 {actual}, but {sha256_from} says {sha256}; the file changed or was damaged on this "
            "node (nothing was installed): add the node again to place it anew"
        )
    return path


class EngineStore:
    def __init__(self, root: Path, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self.root = root
        self.ssl_context = ssl_context

    def _dir(self, name: str) -> Path:
        return self.root / name

    def current(self, name: str) -> Installed | None:
        meta = self._dir(name) / "current" / ".llmgw-installed.json"
        try:
            data = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        return Installed(
            name=name, version=data["version"], executable=data["executable"], ok=True, flavor=data.get("flavor", "")
        )

    async def ensure(
        self, wanted: Wanted, *, mirror_url: str | None = None, on_progress: OnProgress | None = None
    ) -> Installed:
        """Make `wanted` the engine in use, checked; returns it, or raises with the reason.

        `on_progress` hears each phase of an install (none when `wanted` is in use already)."""
        report = _Reporter(on_progress)
        if wanted.source is None:
            return await self._operator_installed(wanted)
        current = self.current(wanted.name)
        if current is not None and current.version == wanted.version and current.flavor == wanted.flavor:
            await check_runs([current.executable, *wanted.check_args])
            return current
        version_dir = self._dir(wanted.name) / wanted.slot
        if isinstance(wanted.source, ArchiveSource):
            executable = await self._install_archive(wanted, wanted.source, version_dir, mirror_url, report)
        elif isinstance(wanted.source, BuildSource):
            executable = await self._install_build(wanted, wanted.source, version_dir, mirror_url, report)
        else:
            executable = await self._install_pip(wanted, wanted.source, version_dir, report)
        installed = Installed(
            name=wanted.name, version=wanted.version, executable=str(executable), ok=True, flavor=wanted.flavor
        )
        meta = {"version": wanted.version, "executable": str(executable)}
        if wanted.flavor:
            meta["flavor"] = wanted.flavor
        (version_dir / ".llmgw-installed.json").write_text(json.dumps(meta))
        self._switch(wanted.name, wanted.slot)
        log.info(
            "engine_installed",
            engine=wanted.name,
            version=wanted.version,
            flavor=wanted.flavor,
            executable=str(executable),
        )
        return installed

    async def _operator_installed(self, wanted: Wanted) -> Installed:
        if not wanted.binary:
            key, flag = _OPERATOR_KEYS.get(wanted.name, (f"{wanted.name}_bin", f"--{wanted.name}-bin"))
            raise BadSource(
                f'engine {wanted.name} has version "" in server.toml (use the operator\'s install) but this node '
                f"names none: set {key} in agent.toml (`llmgw node add USER@HOST {flag} PATH` writes it), or give "
                f"[engines.{wanted.name}] a version and archives so the agent installs it"
            )
        output = await check_runs([wanted.binary, *wanted.check_args])
        version = _version_line(output)
        return Installed(name=wanted.name, version=version, executable=wanted.binary, ok=True)

    async def _fetch(
        self,
        name: str,
        url: str,
        sha256: str,
        size: int,
        max_bytes: int,
        report: _Reporter,
        sha256_from: str = "server.toml",
    ) -> Path:
        """The verified file (kept in .downloads: a reinstall needs no network)."""
        report("fetch", 0 if size else None)

        def progress(p: Progress) -> None:
            # Called from the download's thread: only the reporter's cheap bookkeeping runs there.
            total = p.total_bytes or size
            if total:
                report.from_thread("fetch", min(100, p.done_bytes * 100 // total))
            if p.total_bytes and p.done_bytes % (16 << 20) < (1 << 20):
                log.info("engine_download", engine=name, done_mib=p.done_bytes >> 20, total_mib=p.total_bytes >> 20)

        return await fetch(
            url,
            self.root / ".downloads" / sha256,
            sha256=sha256,
            cap=archive_cap(size, max_bytes),
            ssl_context=self.ssl_context,
            on_progress=progress,
            sha256_from=sha256_from,
        )

    async def _install_archive(
        self, wanted: Wanted, source: ArchiveSource, version_dir: Path, mirror_url: str | None, report: _Reporter
    ) -> Path:
        if source.local:
            archive = await _verified_here(Path(source.url), source.sha256, source.sha256_from)
        else:
            archive = await self._fetch(
                wanted.name,
                mirror_url or source.url,
                source.sha256,
                source.size,
                source.max_bytes,
                report,
                sha256_from=source.sha256_from,
            )
        staging = self._dir(wanted.name) / f".staging-{wanted.version}-{secrets.token_hex(4)}"
        try:
            limits = Limits(max_bytes=source.max_unpacked_bytes, max_members=source.max_members)
            report("unpack", None)
            await trio.to_thread.run_sync(
                functools.partial(unpack, archive, staging, limits=limits, label=source.url, engine=wanted.name)
            )
            executable = staging / source.binary
            if not executable.is_file():
                raise BadSource(
                    f"{source.url} has no {source.binary!r}; set `binary` to the engine's path inside the archive"
                )
            report("check", None)
            await check_runs([str(executable), *wanted.check_args])
            if wanted.flags_of:
                await check_flags(wanted.flags_of, str(executable), {**os.environ, **dict(wanted.help_environ)})
            if version_dir.exists():
                shutil.rmtree(version_dir)  # a leftover of an interrupted install: never the current one
            os.rename(staging, version_dir)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return version_dir / source.binary

    async def _install_build(
        self, wanted: Wanted, source: BuildSource, version_dir: Path, mirror_url: str | None, report: _Reporter
    ) -> Path:
        """Build llama-server from source here (or reuse an identical build from the cache),
        check it, and move it into `version_dir`'s bin/ (with its libraries, for the portable recipe)."""
        path = os.environ.get("PATH", os.defpath)
        os_release = b.read_text("/etc/os-release")
        toolchain = find_toolchain(which_on(path), os_release, path)  # before any download: fail fast
        cuda = source.gpu and bool(toolchain.nvcc)
        if source.gpu and not cuda:
            log.warning(
                "engine_build_cpu_only",
                engine=wanted.name,
                reason="this node has an NVIDIA GPU but no nvcc (the CUDA toolkit) on the agent's PATH or in "
                "/usr/local/cuda/bin: building for the CPU; install the toolkit for GPU offload",
            )
        arch = b.portable_arch(platform.machine(), cuda=cuda)
        recipe = None
        if arch:
            recipe = await b.portable_recipe(
                toolchain, arch, version=wanted.version, url=source.url, sha256=source.sha256
            )
        sdist = await self._fetch(
            wanted.name, mirror_url or source.url, source.sha256, source.size, source.max_bytes, report
        )
        jobs = b.job_count(
            os.cpu_count() or 1,
            b.mem_available(b.read_text("/proc/meminfo")),
            override=source.jobs,
            per_job=2 * b.GIB if cuda else b.GIB,
        )
        if recipe is not None:
            entry = llamarecipe.entry_name(recipe)
        else:
            entry = b.cache_key(
                sha256=source.sha256,
                arch=platform.machine(),
                cuda=cuda,
                args=b.configure_args(toolchain, cuda=cuda, version=wanted.version),
                cpu_flags=b.cpu_flags(b.read_text("/proc/cpuinfo")),
            )
        cached = Path(source.cache_dir) / entry if source.cache_dir else None
        directory = self._dir(wanted.name)
        token = secrets.token_hex(4)
        staging = directory / f".staging-{wanted.version}-{token}"
        work = directory / f".build-{wanted.version}-{token}"
        bin_dir = staging / "bin"
        for leftover in directory.glob(".build-*"):  # of a build whose agent was killed: hundreds of MB
            await trio.to_thread.run_sync(functools.partial(shutil.rmtree, leftover, ignore_errors=True))
        try:
            work.mkdir(parents=True)
            reused = cached is not None and (cached / b.TARGET).is_file()
            if reused:
                assert cached is not None
                log.info("engine_build_reused", engine=wanted.name, version=wanted.version, cache=str(cached))
                report("build", 100)
                files = sorted(cached.iterdir())
            else:
                request = b.BuildRequest(
                    sdist=sdist,
                    label=source.url,
                    version=wanted.version,
                    work=work,
                    log_path=directory / f"{wanted.version}.build.log",
                    toolchain=toolchain,
                    jobs=jobs,
                    timeout_s=source.timeout_s,
                    limits=Limits(max_bytes=source.max_unpacked_bytes, max_members=source.max_members),
                    os_release=os_release,
                    recipe=recipe,
                    cuda=cuda,
                )
                files = await b.build_llama_server(request, report)
            report("install", None)
            await trio.to_thread.run_sync(_copy_flat, files, bin_dir)
            report("check", None)
            # From its own directory with no LD_LIBRARY_PATH: a portable build finds its libraries by $ORIGIN.
            await check_runs([str(bin_dir / b.TARGET), *wanted.check_args])
            await check_flags(wanted.name, str(bin_dir / b.TARGET), dict(os.environ))
            if cached is not None and not reused:
                await trio.to_thread.run_sync(_keep, bin_dir, cached)
            if version_dir.exists():
                shutil.rmtree(version_dir)  # a leftover of an interrupted install: never the current one
            os.rename(staging, version_dir)
        finally:
            for leftover in (work, staging):
                if leftover.exists():
                    await trio.to_thread.run_sync(functools.partial(shutil.rmtree, leftover, ignore_errors=True))
        log.info(
            "engine_built",
            engine=wanted.name,
            version=wanted.version,
            jobs=jobs,
            cuda=cuda,
            recipe=entry if recipe is not None else "this node's",
            reused=reused,
        )
        return version_dir / "bin" / b.TARGET

    async def _install_pip(self, wanted: Wanted, source: PipSource, version_dir: Path, report: _Reporter) -> Path:
        # A venv hard-codes its own path, so it is built where it will live; `current` still
        # switches only after the check, so a half-built venv is never in use.
        if version_dir.exists():
            shutil.rmtree(version_dir)
        version_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            report("configure", None)
            try:
                await check_runs([source.python, "-m", "venv", str(version_dir)], timeout_s=VENV_TIMEOUT_S)
            except EngineCheckFailed as exc:
                hint = "; install the python3-venv package" if "ensurepip" in exc.output else ""
                raise EngineCheckFailed(
                    f"cannot make a venv for {wanted.name} with {source.python}{hint}", exc.output
                ) from None
            # pip reports no overall measure of an install of many packages: the phase alone.
            report("install", None)
            python = str(version_dir / "bin" / "python")
            try:
                await check_runs([python, "-m", "pip", *source.pip_args()], timeout_s=PIP_TIMEOUT_S)
            except EngineCheckFailed as exc:
                raise PipInstallFailed(wanted.name, source.requirement, source.index_url, exc) from None
            report("check", None)
            executable = version_dir / source.executable
            report("check", None)
            await check_runs([str(executable), *wanted.check_args])
            if wanted.flags_of:
                await check_flags(wanted.flags_of, str(executable), {**os.environ, **dict(wanted.help_environ)})
        except BaseException:
            shutil.rmtree(version_dir, ignore_errors=True)
            raise
        return executable

    def _switch(self, name: str, version: str) -> None:
        directory = self._dir(name)
        link = directory / "current"
        previous = os.readlink(link) if link.is_symlink() else None
        tmp = directory / f".current-{secrets.token_hex(4)}"
        os.symlink(version, tmp)
        os.replace(tmp, link)  # rename(2) over the old link: there is no moment without one
        keep = {version, previous, "current"}
        for child in directory.iterdir():
            # Versions are directories; a build's log (a file) stays for the operator to read.
            if child.name not in keep and not child.name.startswith(".") and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)


class _Reporter:
    """Passes (phase, percent) to `on_progress` when either changes; nothing without one."""

    def __init__(self, on_progress: OnProgress | None) -> None:
        self.on_progress = on_progress
        self.last: tuple[str, int | None] | None = None
        self.token = trio.lowlevel.current_trio_token() if on_progress else None

    def __call__(self, phase: str, percent: int | None) -> None:
        if self.on_progress is not None and (phase, percent) != self.last:
            self.last = (phase, percent)
            self.on_progress(phase, percent)

    def from_thread(self, phase: str, percent: int | None) -> None:
        """From a worker thread (the download's): run on the trio loop, without waiting for it."""
        if self.token is not None and (phase, percent) != self.last:
            try:
                self.token.run_sync_soon(self, phase, percent)
            except trio.RunFinishedError:
                pass


async def llama_cpu_backend(executable: str, timeout_s: float = CHECK_TIMEOUT_S) -> str:
    """The CPU backend llama-server loads on this machine (llmgw.engines.cpubackend): BUILT_IN for
    a build without loadable backends; else the one llama.cpp's own rule picks, asked of the
    backends beside it (`cpubackend.SCORE_SCRIPT`, in a process of its own); "" if that cannot be
    asked. (llama-server names the backend it loaded only at its most verbose, serving a model.)"""
    directory = Path(executable).parent
    if not any(directory.glob("libggml-cpu*.so")):
        return cpubackend.BUILT_IN
    try:
        output = await check_runs([sys.executable, "-I", "-c", cpubackend.SCORE_SCRIPT, str(directory)], timeout_s)
    except EngineCheckFailed as exc:
        log.warning("engine_cpu_backend_unknown", executable=executable, reason=str(exc))
        return ""
    return cpubackend.best(output)


async def check_flags(engine: str, executable: str, environ: dict[str, str]) -> None:
    """The engine's whole help documents every flag llmgw gives it (`llmgw ctl engine-check`'s
    check, run on the installed engine); EngineCheckFailed names the missing ones."""
    argv, env = help_run(engine, executable, environ)
    judge_help(engine, argv, await check_runs(argv, HELP_TIMEOUT_S, env=env))


def _copy_flat(files: list[Path], dest: Path) -> None:
    """Copy `files` into `dest` (made here) by name; a symbolic link (a library's soname link)
    stays a link."""
    dest.mkdir(parents=True)
    for f in files:
        shutil.copy2(f, dest / f.name, follow_symlinks=False)


def _keep(built: Path, cached: Path) -> None:
    """Put a checked build's directory in the cache: copied beside, then renamed (a reader sees
    all or none; of two agents keeping the same build, the first stays)."""
    tmp = cached.parent / f".{cached.name}-{secrets.token_hex(4)}"
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(built, tmp, symlinks=True)
        if not cached.exists():
            os.rename(tmp, cached)
    except OSError as exc:
        log.warning("engine_build_cache_unwritable", cache=str(cached.parent), reason=str(exc))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# agent.toml's key and node add's flag for an operator-installed engine.
_OPERATOR_KEYS = {
    "llamacpp": ("llamacpp_bin", "--llamacpp-bin"),
    "vllm": ("vllm_bin", "--vllm-bin"),
    "sglang": ("sglang_python", "--sglang-python"),
}


def _version_line(output: str) -> str:
    """What an engine's --version says its version is: the line naming it, else the first line.
    (llama-server prints `version: 4000 (abc)` and then `built with ... for ...`.)"""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return "operator-installed"
    named = next((line for line in lines if line.lower().startswith("version")), lines[0])
    return named[:80]
