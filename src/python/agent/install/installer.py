"""Installed engines on a node, one directory per engine version, switched atomically.

    STATE/engines/<name>/<version>/      an unpacked archive or a venv
    STATE/engines/<name>/current         symlink to the version in use
    STATE/engines/.downloads/<sha256>    verified archives (kept: a reinstall needs no network)

A new version is made in its own directory and checked to run (`--version`, or the engine's
own check, within a timeout) before `current` is switched to it with one rename, so the old
version keeps serving until the new one is known to start. A version that fails its check is
removed and reported with the engine's own output; `current` is left alone. Only the current
and the previous version are kept.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from agent.install.archive import Limits
from agent.install.errors import BadSource, EngineCheckFailed, PipInstallFailed
from agent.install.flags import HELP_TIMEOUT_S, help_run, judge_help
from agent.install.unpack import unpack
from llmgw.config import DEFAULT_MAX_MEMBERS, DEFAULT_MAX_UNPACKED_BYTES
from llmgw.download import Progress, archive_cap, fetch
from llmgw.log import get_logger

log = get_logger("llmgw.agent.install")

CHECK_TIMEOUT_S = 60.0
PIP_TIMEOUT_S = 3600.0
VENV_TIMEOUT_S = 300.0

# How an install reports where it is: (phase, percent), phase one of
# llmgw.wire.agent_link.INSTALL_PHASES, percent 0..100 or None where the phase gives no measure.
# Called synchronously from the installing task: it must not block (the agent keeps the latest
# and sends it on the link from a task of its own).
OnProgress = Callable[[str, "int | None"], None]


@attrs.frozen(kw_only=True)
class ArchiveSource:
    url: str
    sha256: str
    binary: str  # the executable's path inside the archive, e.g. "build/bin/llama-server"
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES
    max_members: int = DEFAULT_MAX_MEMBERS
    size: int = 0  # server.toml's size of the archive; 0: not given
    max_bytes: int = 0  # the cap without size or Content-Length; 0: the default (llmgw.download.archive_cap)


@attrs.frozen(kw_only=True)
class PipSource:
    requirement: str  # e.g. "vllm==0.11.0"
    executable: str  # inside the venv, e.g. "bin/vllm"
    python: str = "python3"
    index_url: str = ""  # pip's --index-url; "": pip's own (PyPI, or what the node's pip.conf says)
    extra_index_urls: tuple[str, ...] = ()

    def pip_args(self) -> list[str]:
        """`pip install`'s arguments. The node's pip configuration (/etc/pip.conf, PIP_* in the
        agent's environment) is honoured, so an operator's proxy and CA reach pip; only an index
        server.toml names is passed, and it then replaces the configured one."""
        args = ["install", "--disable-pip-version-check", "--no-input"]
        if self.index_url:
            args += ["--index-url", self.index_url]
        for url in self.extra_index_urls:
            args += ["--extra-index-url", url]
        return [*args, self.requirement]


@attrs.frozen(kw_only=True)
class Wanted:
    """An engine the control plane wants here. No source: the operator installed it at `binary`."""

    name: str
    version: str
    source: ArchiveSource | PipSource | None = None
    binary: str = ""
    check_args: tuple[str, ...] = ("--version",)
    # The engine whose flags llmgw gives (llmgw.engines.check) are looked up in the installed
    # engine's help before it is offered; "": none. `help_environ` is added to the help's environment.
    flags_of: str = ""
    help_environ: tuple[tuple[str, str], ...] = ()


@attrs.frozen(kw_only=True)
class Installed:
    name: str
    version: str
    executable: str
    ok: bool
    detail: str = ""


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
        return Installed(name=name, version=data["version"], executable=data["executable"], ok=True)

    async def ensure(
        self, wanted: Wanted, *, mirror_url: str | None = None, on_progress: OnProgress | None = None
    ) -> Installed:
        """Make `wanted` the engine in use, checked; returns it, or raises with the reason.

        `on_progress` hears each phase of an install (none when `wanted` is in use already)."""
        progress: OnProgress = on_progress or _no_progress
        if wanted.source is None:
            return await self._operator_installed(wanted)
        current = self.current(wanted.name)
        if current is not None and current.version == wanted.version:
            await check_runs([current.executable, *wanted.check_args])
            return current
        version_dir = self._dir(wanted.name) / wanted.version
        if isinstance(wanted.source, ArchiveSource):
            executable = await self._install_archive(wanted, wanted.source, version_dir, mirror_url)
        else:
            executable = await self._install_pip(wanted, wanted.source, version_dir, progress)
        installed = Installed(name=wanted.name, version=wanted.version, executable=str(executable), ok=True)
        (version_dir / ".llmgw-installed.json").write_text(
            json.dumps({"version": wanted.version, "executable": str(executable)})
        )
        self._switch(wanted.name, wanted.version)
        log.info("engine_installed", engine=wanted.name, version=wanted.version, executable=str(executable))
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

    async def _install_archive(
        self, wanted: Wanted, source: ArchiveSource, version_dir: Path, mirror_url: str | None
    ) -> Path:
        downloads = self.root / ".downloads"
        url = mirror_url or source.url

        def progress(p: Progress) -> None:
            if p.total_bytes and p.done_bytes % (16 << 20) < (1 << 20):
                log.info(
                    "engine_download", engine=wanted.name, done_mib=p.done_bytes >> 20, total_mib=p.total_bytes >> 20
                )

        archive = await fetch(
            url,
            downloads / source.sha256,
            sha256=source.sha256,
            cap=archive_cap(source.size, source.max_bytes),
            ssl_context=self.ssl_context,
            on_progress=progress,
        )
        staging = self._dir(wanted.name) / f".staging-{wanted.version}-{secrets.token_hex(4)}"
        try:
            limits = Limits(max_bytes=source.max_unpacked_bytes, max_members=source.max_members)
            await trio.to_thread.run_sync(
                functools.partial(unpack, archive, staging, limits=limits, label=source.url, engine=wanted.name)
            )
            executable = staging / source.binary
            if not executable.is_file():
                raise BadSource(
                    f"{source.url} has no {source.binary!r}; set `binary` to the engine's path inside the archive"
                )
            await check_runs([str(executable), *wanted.check_args])
            if version_dir.exists():
                shutil.rmtree(version_dir)  # a leftover of an interrupted install: never the current one
            os.rename(staging, version_dir)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return version_dir / source.binary

    async def _install_pip(self, wanted: Wanted, source: PipSource, version_dir: Path, progress: OnProgress) -> Path:
        # A venv hard-codes its own path, so it is built where it will live; `current` still
        # switches only after the check, so a half-built venv is never in use.
        if version_dir.exists():
            shutil.rmtree(version_dir)
        version_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            progress("configure", None)
            try:
                await check_runs([source.python, "-m", "venv", str(version_dir)], timeout_s=VENV_TIMEOUT_S)
            except EngineCheckFailed as exc:
                hint = "; install the python3-venv package" if "ensurepip" in exc.output else ""
                raise EngineCheckFailed(
                    f"cannot make a venv for {wanted.name} with {source.python}{hint}", exc.output
                ) from None
            # pip reports no overall measure of an install of many packages: the phase alone.
            progress("install", None)
            python = str(version_dir / "bin" / "python")
            try:
                await check_runs([python, "-m", "pip", *source.pip_args()], timeout_s=PIP_TIMEOUT_S)
            except EngineCheckFailed as exc:
                raise PipInstallFailed(wanted.name, source.requirement, source.index_url, exc) from None
            progress("check", None)
            executable = version_dir / source.executable
            await check_runs([str(executable), *wanted.check_args])
            if wanted.flags_of:
                argv, env = help_run(wanted.flags_of, str(executable), {**os.environ, **dict(wanted.help_environ)})
                judge_help(wanted.flags_of, argv, await check_runs(argv, HELP_TIMEOUT_S, env=env))
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
            if child.name not in keep and not child.name.startswith("."):
                shutil.rmtree(child, ignore_errors=True)


# agent.toml's key and node add's flag for an operator-installed engine.
_OPERATOR_KEYS = {
    "llamacpp": ("llamacpp_bin", "--llamacpp-bin"),
    "vllm": ("vllm_bin", "--vllm-bin"),
    "sglang": ("sglang_python", "--sglang-python"),
}


def _no_progress(phase: str, percent: int | None) -> None:
    pass


def _version_line(output: str) -> str:
    """What an engine's --version says its version is: the line naming it, else the first line.
    (llama-server prints `version: 4000 (abc)` and then `built with ... for ...`.)"""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return "operator-installed"
    named = next((line for line in lines if line.lower().startswith("version")), lines[0])
    return named[:80]
