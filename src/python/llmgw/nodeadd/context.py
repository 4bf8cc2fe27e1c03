"""What every onboarding flow's steps share: the operator's `Options` (what each flow takes alike:
SSH, the control plane's files, the release, the address dialled, the join's timeout), the
`Authority` read before a machine is touched, the `Facts` the steps learn in order, and the
helpers that run a command on the machine and fail with what it said.

Each flow (llmgw.nodeadd.node, .gateway, .server) subclasses `Options` and `Facts` with its own
fields; the toolkit's steps read and write only the fields defined here. `Facts` is filled step
by step (the flow's list says in which order): a step reads only what the steps before it wrote.
Every remote command is argv, quoted by `llmgw.nodeadd.remote`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import attrs

from llmgw import config as cfg
from llmgw.ctl.client import AdminClient
from llmgw.errors import PeerError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.release import Artifact
from llmgw.pki.ca import CA, CertInfo

SHORT_S = 60  # a command that only reads or writes a file
DOCTOR_S = 180  # doctor runs nvidia-smi and sminfo, and unpacks the zipapp first
FETCH_S = 600


@attrs.frozen(kw_only=True)
class Options:
    """What the three `add` commands take alike (llmgw.nodeadd.flags builds it from their flags);
    a flow's own options subclass it."""

    target: str  # user@host
    server_config: cfg.ServerConfig
    state_dir: Path
    known_hosts: Path
    identity_files: tuple[Path, ...] | None = None
    accept_new_host_key: bool = False  # trust a host absent from known_hosts without asking
    ssh_port: int = 22
    release: str = ""
    release_via: str = ""  # "ssh", "https", or "" (the control plane's when it holds the file, else SSH)
    server_address: str = ""
    # The other control planes' agent ports (wss://HOST:PORT), when several share a store:
    # the machine names them after this one's (`--control-plane`).
    control_planes: tuple[str, ...] = ()
    reissue: bool = False
    join_timeout_s: float = 600.0


@attrs.frozen(kw_only=True)
class Authority:
    """What the control plane holds, read before the machine is touched. `admin` is the one way
    to its state: the flows never open the control plane's database."""

    ca: CA
    server_cert: CertInfo
    admin: AdminClient
    nodes: list[dict[str, Any]]


@attrs.define
class Facts:
    hostname: str = ""
    arch: str = ""  # the release's name for it (amd64, arm64)
    machine: str = ""  # as `uname -m` says it
    systemd: bool = False
    address: str = ""  # where the machine dials the control plane
    port: int = 0
    stage: str = ""
    artifact: Artifact | None = None
    installed_sha256: str = ""
    cert_pem: bytes = b""
    cert_serial: str = ""

    @property
    def server(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"wss://{host}:{self.port}"


def view_of(nodes: list[dict[str, Any]], node_id: str) -> dict[str, Any] | None:
    """The admin API's view of one node, if the control plane knows it."""
    return next((n for n in nodes if n["id"] == node_id), None)


def staged_llmgw(facts: Facts, *args: str) -> list[str]:
    """Run the staged release (as root, through sudo), unpacking into the stage, not the machine."""
    return ["env", f"SHIV_ROOT={facts.stage}/pyz", "python3", f"{facts.stage}/llmgw", *args]


def servers(opts: Options, facts: Facts) -> str | tuple[str, ...]:
    """The control plane the machine dials, then each other one `--control-plane` named, once."""
    others = tuple(u for u in opts.control_planes if u != facts.server)
    return (facts.server, *others) if others else facts.server


async def must(s: ssh.SshSession, argv: list[str], *, sudo: bool, what: str, timeout_s: float = SHORT_S) -> str:
    res = await s.run(argv, sudo=sudo, timeout_s=timeout_s)
    if res.exit_status != 0:
        raise PeerError(f"{s.target}: {what} failed ({said(res)})")
    return res.stdout


async def put_text(s: ssh.SshSession, text: str, remote: str, *, mode: int) -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-node-add-") as d:
        local = Path(d) / "file"
        local.write_text(text)
        await s.put(local, remote, mode=mode, timeout_s=SHORT_S)


def said(res: ssh.Result) -> str:
    err = res.stderr.strip() or res.stdout.strip()
    err = err[-600:] if len(err) > 600 else err
    return f"exit status {res.exit_status}" + (f": {err}" if err else "")
