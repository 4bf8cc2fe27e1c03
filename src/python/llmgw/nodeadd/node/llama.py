"""llama.cpp from the release `llmgw node add --release` names: the node gets that release whole.

A release directory holds, beside the zipapps, llama.cpp built for every CPU of each architecture
(`llama.cpp-bN-linux-ARCH.tar.gz`) and a SHA256SUMS listing them all. Without this, a node given
`--release DIR` by a control plane that serves no release (no `[release] dir`, a development
build) would run DIR's zipapp and then fetch llama.cpp's source and compile it (about 25
CPU-minutes), although DIR holds the archive for its architecture.

So when the node will want that archive (`wanted`: [engines.llamacpp] takes the release's,
at the archive's version, and no llama-server of the operator's is named), `choose` finds it in
the SHA256SUMS the operator named (llmgw.nodeadd.release.find_llama, which checks it here),
`ship` copies it over SSH into the stage with the zipapp and checks its sha256 there, and
`configure` places it (`place`) in the agent's release directory, /var/lib/llmgw-agent/release/,
with a SHA256SUMS holding that one line of the operator's. The agent installs it from there as
the release's archive, verifying it against that line first (agent.install.noderelease), ahead
of the control plane's release and of a build. The trust chain is the operator's SHA256SUMS
throughout: checked here, on the node after the copy, and by the agent before unpacking.

Each add makes that directory what it names: an add that ships no archive removes it, so the
node's llama.cpp follows the control plane again.
"""

from __future__ import annotations

import trio

from llmgw.nodeadd import ssh
from llmgw.nodeadd.context import SHORT_S, must, put_text
from llmgw.nodeadd.node import layout
from llmgw.nodeadd.release import Artifact, find_llama
from llmgw.nodeadd.ship import deliver
from llmgw.releasefiles import SUMS


def wanted(engines, *, llamacpp_bin: str) -> str:
    """The llama.cpp version the control plane will want from the release on this node, or ""
    when it wants none of the release's (disabled, the operator's own at version "", a source
    other than the release's, or a llama-server named for this node, which wins)."""
    source = engines.llamacpp
    if llamacpp_bin or not source.enabled or not source.version or not getattr(source, "release", False):
        return ""
    return source.version


async def choose(release: str, arch: str, version: str) -> tuple[Artifact | None, str]:
    """The archive of `version` for `arch` in the release `--release` names, checked against its
    SHA256SUMS; or (None, why not, "" when there is nothing to say)."""
    if not version:
        return None, ""
    found, why = await trio.to_thread.run_sync(find_llama, release, arch)
    if found is None:
        return None, why
    if found.version != version:
        return None, (
            f"its llama.cpp is {found.version} and the control plane wants {version}: the node takes llama.cpp "
            "from the control plane"
        )
    return found, ""


async def ship(s: ssh.SshSession, stage: str, art: Artifact) -> str:
    """`art` copied into the stage beside the zipapp, its sha256 checked on the node; in words."""
    await deliver(s, art, f"{stage}/{art.name}")
    return f"{art.name} copied over SSH too, sha256 {art.sha256[:12]} verified on the node"


async def place(s: ssh.SshSession, stage: str, art: Artifact | None) -> str:
    """The agent's release directory as this add names it: `art` (staged and checked by `ship`)
    and a SHA256SUMS listing it alone; without `art`, no such directory. What is there, in words."""
    if art is None:
        await must(s, ["rm", "-rf", "--", layout.RELEASE_DIR], sudo=True, what=f"removing {layout.RELEASE_DIR}")
        return ""
    placed = f"{layout.RELEASE_DIR}/{art.name}"
    await must(s, ["install", "-d", "-m", "0755", layout.RELEASE_DIR], sudo=True, what=f"making {layout.RELEASE_DIR}")
    await must(s, ["install", "-m", "0644", f"{stage}/{art.name}", placed], sudo=True, what=f"installing {placed}")
    await put_text(s, f"{art.sha256}  {art.name}\n", f"{stage}/{SUMS}", mode=0o644)
    await must(s, ["install", "-m", "0644", f"{stage}/{SUMS}", layout.RELEASE_SUMS], sudo=True, what="listing it")
    # What an earlier add placed there of another release goes: the list names this one alone.
    await must(
        s,
        ["find", layout.RELEASE_DIR, "-maxdepth", "1", "-type", "f", "!", "-name", art.name, "!", "-name", SUMS,
         "-delete"],
        sudo=True,
        what=f"clearing {layout.RELEASE_DIR}",
        timeout_s=SHORT_S,
    )  # fmt: skip
    return placed
