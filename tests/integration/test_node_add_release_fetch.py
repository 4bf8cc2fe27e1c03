"""The node fetches its release from the control plane (`llmgw node add` without `--release`),
end to end with real parts: `llmgw server` serving a release directory ([release] dir) on its
agent port, a test node in its own network namespace (testlib.netnode) downloading from there
with its python3, pinned to the cluster's CA root. Whether the file went over HTTPS or SSH is
read from both ends: the control plane's `release_served` log events (peer and file), and the
node's SFTP log (`NetNode.sftp_written`), every file SFTP opened there for writing.

And the release an operator names is the release the node gets, whole: `--release DIR` against
a control plane that serves no release (no `[release] dir`, a development build) gives the node
DIR's llama.cpp archive too, which its agent installs and runs; nothing is built there (the node
has this machine's compilers: a build would be tried, and take the test's time many times over)."""

from __future__ import annotations

import hashlib
import platform
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from llmgw import pins
from llmgw.releasefiles import ARCHES, llama_file_name
from testlib.netnode import NetNode
from testlib.nodeadd import ControlPlane
from testlib.proc import run_llmgw

# The node add tests' fixtures: release_dir, node and cp.
pytest_plugins = ("testlib.nodeadd",)

VERSION = "0.0.0-e2e"
AMD = f"llmgw-{VERSION}-linux-amd64.pyz"
ARM = f"llmgw-{VERSION}-linux-arm64.pyz"
LLAMA = llama_file_name(pins.LLAMACPP_VERSION, ARCHES[platform.machine()])
AGENT_DIR = "/var/lib/llmgw-agent"
# The operator's defaults for llama.cpp: no [engines.llamacpp] (the pinned release's, else its
# source built on the node), and a sim model to place.
SIM_ONLY = """
[[models]]
name = "sim-small"
engine = "sim"
replicas = 1
"""


def _both_arches(release: Path, into: Path) -> Path:
    """The release directory an amd64 control plane holds to add nodes of both architectures: the
    real amd64 file, and an arm64 stand-in (this machine cannot run an arm64 build) listed beside it."""
    into.mkdir()
    shutil.copy(release / AMD, into / AMD)
    with zipfile.ZipFile(into / ARM, "w") as z:
        z.writestr("__main__.py", "print('the arm64 stand-in')\n")
    (into / "SHA256SUMS").write_text(
        "".join(f"{hashlib.sha256((into / n).read_bytes()).hexdigest()}  {n}\n" for n in (AMD, ARM))
    )
    return into


def _serving(cp: ControlPlane, directory: Path) -> None:
    cp.add_config(f'[release]\ndir = "{directory}"\n')
    cp.run()


def _pyz_copies(node: NetNode) -> list[str]:
    return [p for p in node.sftp_written() if re.fullmatch(r"/tmp/llmgw-node-add\.\w+/llmgw\.llmgw-part", p)]


def _served(cp: ControlPlane) -> list[tuple[str, str]]:
    assert cp.server is not None
    return [(e["peer"], e["name"]) for e in cp.server.events("release_served")]


def test_the_node_fetches_its_release_from_the_plane_and_ssh_stays_the_fallback(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    _serving(cp, _both_arches(release_dir, tmp_path / "release"))
    rc, out, err = cp.node_add("--plain", "--accept-new-host-key")  # no --release
    assert rc == 0, out + err
    url = f"https://{node.host_addr}:7443/v1/release/{AMD}"
    assert f"fetched by the node from the control plane ({url}, checked against the CA root)" in out, out
    # The plane sent the node (its address on the link) the amd64 file, once; nothing of it went over SFTP,
    # though SFTP did write the node's other files (so its log would show a copy).
    assert _served(cp) == [(node.node_addr, AMD)]
    assert _pyz_copies(node) == [] and any(p.endswith("agent.toml.llmgw-part") for p in node.sftp_written())
    assert {n["id"]: n for n in cp.ctl("nodes")}[node.hostname]["state"] == "joined"
    assert node.read("/usr/local/bin/llmgw") == (release_dir / AMD).read_bytes()

    # --release-via ssh: copied over SFTP from the same directory, the plane not asked for the file.
    rc, out, err = cp.node_add("--plain", "--release-via", "ssh")
    assert rc == 0, out + err
    assert f"{AMD} copied over SSH" in out, out
    assert len(_pyz_copies(node)) == 1 and _served(cp) == [(node.node_addr, AMD)]


def test_a_damaged_file_on_the_plane_is_refused_by_the_node_and_never_run(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    held = _both_arches(release_dir, tmp_path / "release")
    with (held / AMD).open("ab") as f:
        f.write(b"tampered")  # SHA256SUMS still lists the released bytes
    _serving(cp, held)
    rc, out, err = cp.node_add("--plain", "--accept-new-host-key")
    assert rc != 0
    assert "failed ship" in out and "arrived with sha256" in out and "nothing ran it" in out, out
    assert "not the one its SHA256SUMS lists" in out
    assert [line.split()[1] for line in out.splitlines()][-1] == "ship"  # doctor never ran
    assert _served(cp) == [(node.node_addr, AMD)]  # it did come from the plane
    assert [p for p in node.written() if "llmgw" in p] == []  # nothing installed, nor a stage left


def test_a_plane_whose_certificate_is_not_from_the_pinned_ca_is_refused(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    _serving(cp, _both_arches(release_dir, tmp_path / "release"))
    # Another CA (with a server certificate for the same address) takes the place of the plane's on
    # disk: node add pins it, while the running plane still presents the certificate of the first.
    other = tmp_path / "other"
    other.mkdir()
    config = other / "server.toml"
    config.write_text(cp.config.read_text().replace(str(cp.state), str(other / "state")).split("[release]")[0])
    done = run_llmgw("ca", "init", "--config", str(config))
    assert done.returncode == 0, done.stderr
    for name in ("ca.crt", "ca.key", "server.crt", "server.key"):
        shutil.copy(other / "state" / "ca" / name, cp.state / "ca" / name)
    rc, out, err = cp.node_add("--plain", "--accept-new-host-key")
    assert rc != 0
    assert "failed ship" in out and "is not this control plane" in out and "--release-via ssh" in out, out
    assert _served(cp) == []
    assert [p for p in node.written() if "llmgw" in p] == []


def test_a_plane_holding_both_arches_gives_an_arm64_node_the_arm64_file(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    # The node says aarch64 to `uname -m` (a wrapper before uname on its PATH); the rest is this machine.
    node.write(
        "/usr/local/bin/uname", '#!/bin/sh\n[ "$1" = -m ] && { echo aarch64; exit 0; }\nexec /usr/bin/uname "$@"\n'
    )
    assert node.run("chmod", "755", "/usr/local/bin/uname").returncode == 0
    _serving(cp, _both_arches(release_dir, tmp_path / "release"))
    rc, out, err = cp.node_add("--plain", "--accept-new-host-key")
    assert (
        "aarch64" in out
        and f"fetched by the node from the control plane (https://{node.host_addr}:7443/v1/release/{ARM}" in out
    ), out
    assert _served(cp) == [(node.node_addr, ARM)]
    # The stand-in is not llmgw: doctor, the first thing to run it, stops the run.
    assert rc != 0 and "failed doctor" in out and "the arm64 stand-in" in out, out


@pytest.mark.release(with_llama=True)
def test_a_release_named_gives_the_node_its_llama_cpp_from_a_plane_that_serves_none(
    node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    assert (release_dir / LLAMA).is_file()  # the release holds the node's archive
    cp = ControlPlane(tmp_path / "plane", node, catalog=SIM_ONLY, llamacpp_bin=None)  # no [release] dir either
    try:
        cp.run()
        rc, out, err = cp.node_add("--plain", "--accept-new-host-key", release=release_dir)
        assert rc == 0, out + err
        digest = hashlib.sha256((release_dir / LLAMA).read_bytes()).hexdigest()
        assert f"{LLAMA} copied over SSH too, sha256 {digest[:12]} verified on the node" in out, out
        assert f"{AGENT_DIR}/release/{LLAMA}" in out  # configure placed it for the agent
        assert f"joined; llama.cpp installed and checked ({pins.LLAMACPP_VERSION})" in out, out
        # Nothing was built, nor fetched to build: the install's phases, as the join said them.
        assert not re.search(r"installing llama\.cpp.*\((fetch|configure|build)\)", out), out
        assert _served(cp) == []  # the plane holds no release, and was asked for none
        assert any(p.endswith(f"/{LLAMA}.llmgw-part") for p in node.sftp_written())
        assert node.read(f"{AGENT_DIR}/release/{LLAMA}") == (release_dir / LLAMA).read_bytes()
        assert node.read(f"{AGENT_DIR}/release/SHA256SUMS").decode() == f"{digest}  {LLAMA}\n"
        installed = f"{AGENT_DIR}/engines/llamacpp/{pins.LLAMACPP_VERSION}"
        written = node.written()
        assert f"{installed}/{LLAMA.removesuffix('.tar.gz')}/llama-server" in written
        assert not [p for p in written if p.endswith(".build.log") or "/.build-" in p or "/.downloads/" in p]
        llama = next(e for e in cp.node_view()["engines"] if e["name"] == "llamacpp")
        assert llama["ok"] and llama["version"] == pins.LLAMACPP_VERSION and llama["cpu_backend"], llama
    finally:
        cp.stop()
