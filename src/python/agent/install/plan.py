"""What the agent asks an install to make, and what it made: the plan `EngineStore.ensure` takes
(`Wanted`, with its source: a prebuilt archive, a pip requirement or llama.cpp's source to build)
and its outcome (`Installed`). Plain frozen data, no I/O; agent.engines makes the plan from what
the control plane wants, agent.install.installer carries it out."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from llmgw.config import DEFAULT_BUILD_TIMEOUT_S, DEFAULT_MAX_MEMBERS, DEFAULT_MAX_UNPACKED_BYTES

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
    mirrored: bool = False  # the control plane's artifact mirror has it (by sha256)
    sha256_from: str = "server.toml"  # where the digest was read, for a mismatch's message
    local: bool = False  # `url` is a file on this node (agent.install.noderelease), verified where it is


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
class BuildSource:
    """llama.cpp's source, built here into `bin/llama-server` (agent.install.build)."""

    url: str
    sha256: str
    size: int = 0
    max_bytes: int = 0
    jobs: int = 0  # 0: from this node's cores and memory
    timeout_s: float = DEFAULT_BUILD_TIMEOUT_S
    gpu: bool = False  # the node has an NVIDIA GPU: a CUDA build where nvcc is found
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES
    max_members: int = DEFAULT_MAX_MEMBERS
    cache_dir: str = ""  # keep and reuse finished builds here ("" = none)
    mirrored: bool = False  # the control plane's artifact mirror has it (by sha256)


@attrs.frozen(kw_only=True)
class Wanted:
    """An engine the control plane wants here. No source: the operator installed it at `binary`."""

    name: str
    version: str
    source: ArchiveSource | PipSource | BuildSource | None = None
    binary: str = ""
    check_args: tuple[str, ...] = ("--version",)
    # The engine whose flags llmgw gives (llmgw.engines.check) are looked up in the installed
    # engine's help before it is offered; "": none. `help_environ` is added to the help's environment.
    flags_of: str = ""
    help_environ: tuple[tuple[str, str], ...] = ()
    # Another build of the same version ("vulkan": llama.cpp's Vulkan archive), installed in a
    # directory of its own, so that a node switching between builds installs anew; "": the plain one.
    flavor: str = ""

    @property
    def slot(self) -> str:
        """Its directory under the engine's: the version, and the flavor after it."""
        return f"{self.version}-{self.flavor}" if self.flavor else self.version


@attrs.frozen(kw_only=True)
class Installed:
    name: str
    version: str
    executable: str
    ok: bool
    detail: str = ""
    flavor: str = ""
