"""The mirror fill: every engine archive server.toml names, and llama.cpp's source to build
from, is fetched once into the artifacts directory, so nodes without internet access install
from the control plane (which serves them, `llmgw.server.nodes.artifacts`). Archives are fetched at
start; the source (the default's, 37 MB) once a node is known, so a control plane with no node
yet downloads nothing it does not need. Agents are told as each one arrives; a fetch that failed
is tried again every `retry_s` while any is missing, and the fill returns once all are there."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from llmgw.config import ServerConfig
from llmgw.download import archive_cap, fetch
from llmgw.errors import LlmgwError
from llmgw.log import get_logger
from llmgw.server.nodes.artifacts import Artifacts

log = get_logger("llmgw.server")

RETRY_S = 600.0


async def fill_mirror(
    config: Callable[[], ServerConfig],
    artifacts: Artifacts,
    push_all: Callable[[], Awaitable[None]],
    *,
    node_known: Callable[[], Awaitable[None]] | None = None,
    retry_s: float = RETRY_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`config()` is read at each start (a restart after a reload sees its engines); `push_all`
    sends every connected node its desired state, which now names the mirrored archive;
    `node_known()` returns once the control plane knows a node (None: at once)."""
    task_status.started()
    current = config()
    engines = current.engines
    archives = [a for source in (engines.llamacpp, engines.vllm, engines.sglang) if source for a in source.archives]
    await _fill(archives, current, artifacts, push_all, retry_s)
    build = getattr(engines.llamacpp, "build", None) if engines.llamacpp.enabled and engines.llamacpp.version else None
    if build is not None and build.sha256 not in artifacts.available():
        if node_known is not None:
            await node_known()
        await _fill([build], current, artifacts, push_all, retry_s)  # the source nodes build llama.cpp from


async def _fill(archives: list, current: ServerConfig, artifacts: Artifacts, push_all, retry_s: float) -> None:
    while True:
        missing = [a for a in archives if a.sha256 not in artifacts.available()]
        if not missing:
            return
        for archive in missing:
            try:
                cap = archive_cap(archive.size, current.downloads.max_archive_bytes)
                await fetch(archive.url, artifacts.directory / archive.sha256, sha256=archive.sha256, cap=cap)
                log.info("mirror_fetched", url=archive.url, sha256=archive.sha256)
                await artifacts.refresh()  # indexed before the nodes are told
                await push_all()  # now mirrored
            except LlmgwError as exc:
                log.warning("mirror_fetch_failed", url=archive.url, reason=str(exc), retry_in_s=retry_s)
        if set(a.sha256 for a in archives) <= artifacts.available():
            return
        await trio.sleep(retry_s)
