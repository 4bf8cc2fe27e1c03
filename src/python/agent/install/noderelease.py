"""The release `llmgw node add --release` installed on this node: its llama.cpp archive.

`llmgw node add --release DIR` ships, with DIR's zipapp, DIR's llama.cpp archive for the node's
architecture, and places it under the agent's state directory (llmgw.releasefiles
NODE_RELEASE_DIR: STATE/release/) with a SHA256SUMS holding that archive's line of DIR's own
SHA256SUMS (llmgw.nodeadd.node.llama). `read` lists what is there; the agent installs such an
archive where the control plane wants that version of llama.cpp, ahead of the control plane's
own release archive and of a build (agent.engines.wanted_from), so the node runs the release its
operator named, whole, even from a control plane that serves no release.

Invariants: only names the list holds and that are llama.cpp release names (no '/', so never a
path out of the directory) are taken, with the digest the list gives; the archive is verified
against that digest before it is unpacked (the installer's `_install_archive`), so the chain of
trust is the SHA256SUMS the operator named, as for a release the control plane serves. A list
that cannot be read or parsed gives nothing (logged): the node then gets llama.cpp as it would
without it.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from llmgw.engines.wants import ReleaseArchive
from llmgw.errors import UsageError
from llmgw.log import get_logger
from llmgw.releasefiles import LLAMA_NAME, NODE_RELEASE_DIR, SUMS, UNAME, llama_binary, parse_sums

log = get_logger("llmgw.agent.install")

MAX_SUMS_BYTES = 1 << 20
SHA256_FROM = "the release node add installed (its SHA256SUMS)"  # where a digest came from, for a mismatch


@attrs.frozen(kw_only=True)
class NodeRelease:
    directory: Path
    archives: tuple[ReleaseArchive, ...] = ()

    def archive(self, version: str, arch: str) -> ReleaseArchive | None:
        """The llama.cpp archive (the CPU build) of `version` for `arch` (as `uname -m` says it), if there is one."""
        return next((a for a in self.archives if a.version == version and a.arch == arch and a.backend == "cpu"), None)

    def path(self, archive: ReleaseArchive) -> Path:
        return self.directory / archive.name  # a release name: no '/', so it stays in the directory


def read(state_dir: Path) -> NodeRelease:
    """What STATE/release holds, by its SHA256SUMS: the llama.cpp archives listed and there.
    Blocking (a directory read): call it off the event loop."""
    directory = state_dir / NODE_RELEASE_DIR
    sums_file = directory / SUMS
    try:
        with sums_file.open("rb") as f:
            text = f.read(MAX_SUMS_BYTES).decode("utf-8", "replace")
        sums = parse_sums(text, str(sums_file))
    except FileNotFoundError:
        return NodeRelease(directory=directory)
    except (OSError, UsageError) as exc:
        log.warning("node_release_unreadable", path=str(sums_file), reason=str(exc))
        return NodeRelease(directory=directory)
    found = []
    for name, digest in sorted(sums.items()):
        m = LLAMA_NAME.match(name)
        if m is None:
            continue
        try:
            size = (directory / name).stat().st_size
        except OSError:
            log.warning("node_release_missing", path=str(directory / name), listed_in=str(sums_file))
            continue
        found.append(
            ReleaseArchive(
                name=name,
                version=m["version"],
                arch=UNAME[m["arch"]],
                sha256=digest,
                binary=llama_binary(name),
                size=size,
                backend=m["backend"] or "cpu",
            )
        )
    return NodeRelease(directory=directory, archives=tuple(found))
