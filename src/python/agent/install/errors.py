"""Errors of installing engines, by blame."""

from __future__ import annotations

from llmgw.download import DiskFull, DownloadError  # noqa: F401 - re-exported for the agent
from llmgw.errors import MachineError, PeerError, UsageError


class BadArchive(PeerError):
    """An engine archive llmgw will not unpack: the archive (where server.toml points) is to blame.

    Unreadable, or a member that is unsafe or over a cap; the message names the archive, the
    member and what the operator checks or changes in server.toml."""


class UnsafeArchive(BadArchive):
    """A member would write or point outside its directory, or is a device, FIFO, setuid file or
    a hard link to something else than a file unpacked before it."""


class ArchiveTooLarge(BadArchive):
    """The archive unpacks to more bytes or more members than its engine's cap in server.toml."""


class CannotWrite(MachineError):
    """This node could not write an archive's files (permissions, a read-only or failing disk)."""


class EngineCheckFailed(MachineError):
    """An installed engine does not run; `output` holds what it printed."""

    def __init__(self, message: str, output: str = "") -> None:
        self.output = output
        super().__init__(message + (f"; it printed: {output.strip()[-800:]}" if output.strip() else ""))


class BadSource(UsageError):
    """The configured source cannot be used as it is (no source for this architecture, bad URL)."""


class NoSourceForNode(BadSource):
    """server.toml offers this engine no archive, release archive or build that fits this node."""


class PipInstallFailed(MachineError):
    """pip could not install an engine's requirement: the message has pip's own errors, the index
    it asked and what to check."""

    def __init__(self, engine: str, requirement: str, index_url: str, failed: EngineCheckFailed) -> None:
        said = [line.strip() for line in failed.output.splitlines() if line.strip().startswith("ERROR")]
        where = index_url or "pip's default index (PyPI, unless the node's pip.conf names another)"
        fix = (
            f"check that {where} has it and its dependencies for this node's Python and architecture; an "
            f"air-gapped site sets index_url under [engines.{engine}] in server.toml to a mirror the node reaches"
        )
        text = "; ".join(said[-3:]) if said else failed.output.strip()[-600:]
        self.output = failed.output
        super().__init__(f"pip could not install {requirement} from {where}: {text or str(failed)}; {fix}")


class BuildToolsMissing(MachineError):
    """This node lacks what building llama.cpp needs (a C/C++ compiler, cmake, make or ninja); the
    message names the packages to install on this node's distribution."""


class BuildOutOfMemory(MachineError):
    """A llama.cpp build was killed for memory; the message says how many jobs ran and how to
    run fewer."""


class BuildFailed(MachineError):
    """A llama.cpp build failed otherwise (or ran past its time); the message has the last lines
    of its log and the log's path."""
