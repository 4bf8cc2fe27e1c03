"""The agent's engines: make the engines the control plane wants present and checked, and tell
it which ones this node can run.

Each wanted engine is installed (or, at version "", the operator's install is checked) by
`EngineStore.ensure`; an engine is reported ok only after it ran its self-check here, so the
node never offers an engine that cannot start. The sim engine ships inside llmgw and is
always offered once `llmgw engine sim --version` runs. Failures are reported with the
engine's own output and retried when the desired state changes or after `RETRY_S`; where this
node lacks what the engine's source needs (a compiler for a build) or no source fits it, the
engine is reported unavailable rather than failed, and retried the same way.

llama.cpp's source on this node (`wanted_from`), in order: agent.toml's llamacpp_bin; version ""
(the operator's); an archive server.toml names that fits (cuda where there is a GPU); a CUDA build
where the node has a GPU, nvcc and the rest of the toolchain; the release archive for this
architecture: the one `llmgw node add --release` installed on this node (agent.install.noderelease,
verified where it is), else the control plane's, fetched from its agent port; a build from source. Once checked, the CPU
backend it loads here is asked (`installer.llama_cpu_backend`: each backend's own score, as
llama.cpp picks) and reported with it.

While an install runs, its progress goes out in EnginesChanged (state "installing", phase and
percent), throttled by agent.progress; an engine already in use stays offered (ok) while its
next version installs, and one that is not yet usable is reported pending, not failed.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import trio

from agent.install import noderelease
from agent.install.errors import BuildToolsMissing, EngineCheckFailed, NoSourceForNode
from agent.install.installer import (
    ArchiveSource,
    BuildSource,
    EngineStore,
    PipSource,
    Wanted,
    check_runs,
    llama_cpu_backend,
)
from agent.install.toolchain import BuildTools, probe_tools, which_on
from agent.progress import Latest, serve_progress
from llmgw.config import AgentConfig
from llmgw.engines.wants import llama_backend, pick_archive, release_archive
from llmgw.errors import LlmgwError
from llmgw.log import get_logger
from llmgw.selfexec import llmgw_command
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.engines")

RETRY_S = 300.0
FLAG_CHECKED = ("vllm", "sglang")  # pip-installed engines whose help is checked before they are offered
SGLANG_CHECK = ("-c", "import sglang, sys; print(sglang.__version__)")
NO_TOOLS = BuildTools(missing=("(not looked for)",))
# Not a fault of the install: this node lacks what the engine's source needs here, or no source
# fits it. Reported as unavailable (the node serves what else it has) and tried again.
UNAVAILABLE = (BuildToolsMissing, NoSourceForNode)


def wanted_from(
    want: w.EngineWant,
    config: AgentConfig,
    arch: str,
    has_gpu: bool,
    *,
    tools: BuildTools = NO_TOOLS,
    release_base: str = "",
    node_release: noderelease.NodeRelease | None = None,
    backend: str = "cpu",
) -> Wanted:
    """The install plan for one wanted engine on this node; LlmgwError if there is none.

    `tools`: what this node has for a build (a CUDA build is chosen only where it can run);
    `release_base`: https://HOST:PORT of the control plane, where its release archives are;
    `node_release`: the release `node add --release` installed here, whose llama.cpp archive of
    the wanted version comes before the control plane's; `backend`: the llama.cpp build to take from
    the control plane's release (llmgw.engines.wants.llama_backend), its CPU build where it has no
    other (the node's own release holds the CPU build alone)."""
    if want.name == "sglang":
        check = SGLANG_CHECK
    else:
        check = ("--version",)
    if want.name == "llamacpp" and config.llamacpp_bin:
        # The operator named this node's llama-server (`node add --llamacpp-bin`): it wins over
        # what server.toml pins for every node.
        return Wanted(name=want.name, version="", binary=config.llamacpp_bin, check_args=check)
    if not want.version:
        binary = {"llamacpp": config.llamacpp_bin, "vllm": config.vllm_bin, "sglang": config.sglang_python}.get(
            want.name, ""
        )
        return Wanted(name=want.name, version="", binary=binary, check_args=check)
    if want.pip:
        executable = "bin/python" if want.name == "sglang" else f"bin/{want.name}"
        # vLLM prints no help without a device to assume: the one it will run on here.
        device = (("VLLM_TARGET_DEVICE", "cuda"),) if want.name == "vllm" and has_gpu else ()
        return Wanted(
            name=want.name,
            version=want.version,
            source=PipSource(
                requirement=want.pip,
                executable=executable,
                index_url=want.index_url,
                extra_index_urls=want.extra_index_urls,
            ),
            check_args=check,
            flags_of=want.name if want.name in FLAG_CHECKED else "",
            help_environ=device,
        )
    archive = pick_archive(want, arch, has_gpu)
    released = release_archive(want, arch, backend)
    if released is None and backend != "cpu":
        released = release_archive(want, arch)
        if released is not None:
            log.warning(
                "engine_backend_not_released",
                engine=want.name,
                backend=backend,
                reason=f"the control plane's release has no {backend} build of llama.cpp for {arch}: using its CPU build",
            )
    # The release's Vulkan build comes before the node's own release, which holds the CPU build.
    vulkan = released is not None and released.backend != "cpu"
    here = node_release.archive(want.version, arch) if node_release is not None and want.name == "llamacpp" else None
    # A CUDA build where the node has a GPU and nvcc: what no CPU archive covers. Without the
    # rest of the toolchain, the release's CPU build serves the node rather than nothing.
    cuda_build = archive is None and has_gpu and want.build is not None and bool(tools.nvcc)
    if cuda_build and (released is not None or here is not None) and not tools.complete:
        log.warning(
            "engine_cuda_build_skipped",
            engine=want.name,
            reason=f"this node has an NVIDIA GPU and nvcc but lacks {', '.join(tools.missing)} to build llama.cpp "
            "for it: using the release's CPU build; install them for GPU offload",
        )
        cuda_build = False
    if archive is None and here is not None and not cuda_build and not vulkan:
        assert node_release is not None
        return Wanted(
            name=want.name,
            version=want.version,
            source=ArchiveSource(
                url=str(node_release.path(here)),
                local=True,
                sha256=here.sha256,
                binary=here.binary,
                max_unpacked_bytes=want.max_unpacked_bytes,
                max_members=want.max_members,
                size=here.size,
                sha256_from=noderelease.SHA256_FROM,
            ),
            check_args=check,
            flags_of="llamacpp",  # as for every prebuilt llama.cpp: a renamed flag is refused here
        )
    if archive is None and released is not None and not cuda_build:
        archive = attrs.evolve(released, url=f"{release_base}{w.RELEASE_PREFIX}{released.release}")
    if archive is None and want.build is not None:
        build = want.build
        return Wanted(
            name=want.name,
            version=want.version,
            source=BuildSource(
                url=build.url,
                sha256=build.sha256,
                size=build.size,
                max_bytes=build.max_bytes,
                jobs=config.build_jobs or build.jobs,
                timeout_s=build.timeout_s,
                gpu=has_gpu,
                max_unpacked_bytes=want.max_unpacked_bytes,
                max_members=want.max_members,
                cache_dir=config.build_cache,
                mirrored=build.mirrored,
            ),
            check_args=check,
        )
    if archive is None:
        offered = ", ".join(f"{a.arch}/{a.backend}" for a in want.archives) or "none"
        raise NoSourceForNode(
            f"server.toml offers {want.name} {want.version} for {offered}, not for this node ({arch}"
            f"{', with an NVIDIA GPU' if has_gpu else ''}); add an archive for it under [engines.{want.name}]"
        )
    return Wanted(
        name=want.name,
        version=want.version,
        source=ArchiveSource(
            url=archive.url,
            sha256=archive.sha256,
            binary=archive.binary,
            max_unpacked_bytes=want.max_unpacked_bytes,
            max_members=want.max_members,
            size=archive.size,
            max_bytes=archive.max_bytes,
            mirrored=archive.mirrored,
            sha256_from="the control plane's release (its SHA256SUMS)" if archive.release else "server.toml",
        ),
        check_args=check,
        # llama.cpp's help is checked as the build's is: a prebuilt one that renamed a flag is
        # refused here, not minutes into a model load.
        flags_of=want.name if want.name == "llamacpp" else "",
        flavor="vulkan" if archive.backend == "vulkan" else "",  # beside the CPU build of its version
    )


class EngineUnavailable(LlmgwError):
    """An engine a replica needs is not usable here; `pending` if it may still be installed."""

    def __init__(self, message: str, *, pending: bool) -> None:
        self.pending = pending
        super().__init__(message)


@attrs.define
class Engines:
    """What this node offers, as the hello and EnginesChanged carry it."""

    statuses: dict[str, w.EngineStatus] = attrs.Factory(dict)
    executables: dict[str, str] = attrs.Factory(dict)  # engine -> the checked executable in use

    def vouch(self, names: Iterable[str]) -> None:
        """Offer the engines that replicas adopted from an earlier agent process run here, until
        this agent's own check replaces them: a hello without them would tell the control plane
        this node cannot run the replicas it is running, and it would move them."""
        for name in names:
            self.statuses.setdefault(
                name, w.EngineStatus(name=name, version="", ok=True, detail="runs adopted replicas; not checked yet")
            )

    def as_tuple(self) -> tuple[w.EngineStatus, ...]:
        return tuple(self.statuses[k] for k in sorted(self.statuses))

    def command_for(self, name: str) -> tuple[str, ...]:
        """The argv prefix that runs engine `name` here, or `EngineUnavailable` saying why not.

        sim runs this agent's own llmgw; the others run what `EngineStore` installed and checked
        (or the operator's binary, for version "")."""
        status = self.statuses.get(name)
        if status is not None and not status.ok and status.state == w.ENGINE_INSTALLING:
            raise EngineUnavailable(f"engine {name} is being installed on this node ({status.phase})", pending=True)
        if status is not None and not status.ok:
            raise EngineUnavailable(f"engine {name} does not run on this node: {status.detail}", pending=False)
        if name == "sim":
            return tuple(llmgw_command())
        executable = self.executables.get(name)
        if status is None or executable is None:
            raise EngineUnavailable(
                f"engine {name} is not installed on this node yet (the agent installs what server.toml names)",
                pending=True,
            )
        return (executable,)


async def check_sim(command: list[str] | None = None) -> w.EngineStatus:
    argv = [*(command or llmgw_command()), "engine", "sim", "--version"]
    try:
        output = await check_runs(argv, env={**os.environ})
    except EngineCheckFailed as exc:
        return w.EngineStatus(name="sim", version="", ok=False, detail=str(exc))
    return w.EngineStatus(name="sim", version=output.strip().split()[-1] if output.strip() else "", ok=True)


async def serve_engines(
    config: AgentConfig,
    engines: Engines,
    desired: Callable[[], w.DesiredState | None],
    changed: Callable[[], Awaitable[None]],
    send: Callable[[w.AgentMessage], Awaitable[bool]],
    inventory: Callable[[], w.Inventory],
    *,
    store: EngineStore,
    server_url: str | Callable[[], str],
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Reconcile installed engines with the desired state, forever. `server_url`: the control
    plane whose mirror and release files the engines are fetched from (wss://HOST:PORT), or
    how to know it at each pass (the one the link reached last: with several, the leader)."""
    task_status.started()
    engines.statuses["sim"] = await check_sim()
    await send(w.EnginesChanged(engines=engines.as_tuple()))
    done_generation = None
    while True:
        state = desired()
        if state is not None and state.generation != done_generation:
            url = server_url() if callable(server_url) else server_url
            await _reconcile(config, engines, state, send, inventory(), store, url)
            done_generation = state.generation
        with trio.move_on_after(RETRY_S):
            await changed()
        if all(s.ok for s in engines.statuses.values()):
            continue
        done_generation = None  # something failed: try again now or at the next change


async def _reconcile(
    config, engines: Engines, state: w.DesiredState, send, inv: w.Inventory, store: EngineStore, server_url: str
) -> None:
    host = urlsplit(server_url)
    base = f"https://{host.hostname}:{host.port}"  # the control plane's agent port: mirror and release
    tools = probe_tools(which_on(os.environ.get("PATH", os.defpath)))
    here = await trio.to_thread.run_sync(noderelease.read, Path(config.state_dir))
    for want in state.engines:
        try:
            plan = wanted_from(
                want,
                config,
                inv.arch,
                bool(inv.gpus),
                tools=tools,
                release_base=base,
                node_release=here,
                backend=llama_backend(config.llamacpp_backend, inv),
            )
            fetched = plan.source if isinstance(plan.source, (ArchiveSource, BuildSource)) else None
            mirror = f"{base}{w.ARTIFACTS_PREFIX}{fetched.sha256}" if fetched is not None and fetched.mirrored else None
            installed = await _install(engines, want, plan, store, mirror, send)
            engines.executables[want.name] = installed.executable
            backend = await llama_cpu_backend(installed.executable) if want.name == "llamacpp" else ""
            status = w.EngineStatus(
                name=want.name, version=installed.version, ok=True, state=w.ENGINE_OK, cpu_backend=backend
            )
            if backend:
                log.info("engine_cpu_backend", engine=want.name, cpu_backend=backend)
        except LlmgwError as exc:
            status = w.EngineStatus(
                name=want.name,
                version=want.version,
                ok=False,
                detail=str(exc),
                state=w.ENGINE_UNAVAILABLE if isinstance(exc, UNAVAILABLE) else w.ENGINE_FAILED,
            )
        if engines.statuses.get(want.name) != status:
            if not status.ok:  # once per change: a retry that fails the same way is no news
                log.warning("engine_unavailable", engine=want.name, version=want.version, reason=status.detail)
            engines.statuses[want.name] = status
            await send(w.EnginesChanged(engines=engines.as_tuple()))
    for name in set(engines.statuses) - {want.name for want in state.engines} - {"sim"}:
        del engines.statuses[name]  # no longer wanted here: no longer offered
        engines.executables.pop(name, None)
        await send(w.EnginesChanged(engines=engines.as_tuple()))


async def _install(engines: Engines, want: w.EngineWant, plan: Wanted, store: EngineStore, mirror, send):
    """`store.ensure(plan)`, its progress sent on the link while it runs (agent.progress)."""
    before = engines.statuses.get(want.name)
    # What the status says until the install ends: the version in use stays offered.
    settled = before if before is not None and before.state != w.ENGINE_INSTALLING else None

    async def report(phase: str, percent: int | None) -> None:
        engines.statuses[want.name] = installing(want, settled, phase, percent)
        await send(w.EnginesChanged(engines=engines.as_tuple()))

    latest = Latest()
    failed: list[Exception] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_progress, latest, report)
        try:
            installed = await store.ensure(plan, mirror_url=mirror, on_progress=latest.note)
        except Exception as exc:  # noqa: BLE001 - re-raised below as itself, not in a nursery's group
            failed.append(exc)
        nursery.cancel_scope.cancel()  # no progress report after the outcome
    if failed:
        raise failed[0]
    return installed


def installing(want: w.EngineWant, settled: w.EngineStatus | None, phase: str, percent: int | None) -> w.EngineStatus:
    """The status of `want.name` while `want.version` installs: still usable if a checked version is in use."""
    detail = f"installing {want.version}" if want.version else "checking the operator's install"
    if settled is not None and settled.ok:
        return attrs.evolve(settled, state=w.ENGINE_INSTALLING, phase=phase, percent=percent, detail=detail)
    return w.EngineStatus(
        name=want.name,
        version=want.version,
        ok=False,
        detail=detail,
        state=w.ENGINE_INSTALLING,
        phase=phase,
        percent=percent,
    )


def engine_store(config: AgentConfig, ssl_context) -> EngineStore:
    return EngineStore(Path(config.state_dir) / "engines", ssl_context=ssl_context)
