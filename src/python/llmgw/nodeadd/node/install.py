"""What `llmgw node add` takes and learns (`Options` and `Facts`: the toolkit's and a node's own),
and its steps that change the node, after doctor has passed: `identity`, `trust`, `configure`,
`start`, and `join`, which waits for the restarted agent.

`identity` makes the node's key on the node (it never leaves it), signs its request here and
records the serial through the control plane's admin API, before the certificate is installed:
a serial the control plane did not record is never shipped, so `llmgw node remove` can revoke
every certificate a node holds. Each certificate issued for a node id revokes every other one of
that node id (identity.py says why). A certificate the node holds is kept while it fits (ours,
for this node and key, more than a week left, not revoked: llmgw.nodeadd.certs) unless `--reissue`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio
from cryptography import x509

from llmgw import config as cfg
from llmgw import driverpaths
from llmgw.ctl.client import AdminClient
from llmgw.ctl.engines import installing_text
from llmgw.errors import LlmgwError, PeerError
from llmgw.nodeadd import certs, context, service, ssh
from llmgw.nodeadd.context import DOCTOR_S, SHORT_S, Authority, must, put_text, servers, staged_llmgw, view_of
from llmgw.nodeadd.node import layout, llama
from llmgw.nodeadd.release import Artifact
from llmgw.nodeadd.steps import OK, WARN
from llmgw.pki.ca import CA, CertInfo, cert_info
from llmgw.pki.files import node_paths

POLL_S = 1.0
LOG_LINES = 15


@attrs.frozen(kw_only=True)
class Options(context.Options):
    fabrics: tuple[cfg.FabricDecl, ...] = ()
    ignore_doctor: frozenset[str] = frozenset()
    system_trust: bool = True  # also trust the CA root in the node's system store (layout.TRUST_STORES)
    llamacpp_bin: str = ""
    vllm_bin: str = ""
    sglang_python: str = ""
    # --nvidia-smi, --ib-root, --sminfo as given, by agent.toml key (llmgw.driverpaths); absolute paths
    driver_paths: dict[str, str] = attrs.field(factory=dict)


@attrs.define
class Facts(context.Facts):
    node_id: str = ""  # its hostname, checked
    trust_store: layout.TrustStore | None = None  # None: --no-system-trust
    fabrics: tuple[cfg.FabricDecl, ...] = ()
    existing: cfg.AgentConfig | None = None  # the node's agent.toml from an earlier add, if it loads
    llama: Artifact | None = None  # the llama.cpp archive of the release --release named, shipped with it

    def given_fabrics(self, opts: Options) -> tuple[cfg.FabricDecl, ...]:
        """--fabric flags, else what the node declared before: adding again does not drop them."""
        return opts.fabrics or (self.existing.fabrics if self.existing else ())


# -- identity ------------------------------------------------------------------------------


async def identity(opts: Options, s: ssh.SshSession, facts: Facts, auth: Authority) -> str:
    config_text = _agent_toml(opts, facts)
    await put_text(s, config_text, f"{facts.stage}/agent.toml", mode=0o644)
    node = node_paths(Path(layout.STATE_DIR))
    current = await s.run(["cat", "--", str(node.cert)], sudo=True, timeout_s=SHORT_S)
    held = current.stdout.encode() if current.exit_status == 0 else None
    had_key = await _has_identity(s)
    if opts.reissue:
        await must(s, ["rm", "-f", "--", str(node.key), str(node.cert)], sudo=True, what="removing the old identity")
    await must(
        s,
        staged_llmgw(facts, "agent", "csr", "--config", f"{facts.stage}/agent.toml"),
        sudo=True,
        what="making the node's key and request",
        timeout_s=DOCTOR_S,
    )
    csr_pem = (await must(s, ["cat", "--", str(node.csr)], sudo=True, what="reading the request")).encode()
    kept = None if opts.reissue else certs.fitting_cert(held, csr_pem, auth.ca, facts.node_id)
    if kept is not None and await trio.to_thread.run_sync(auth.admin.is_revoked, kept.serial):
        kept = None
    if kept is not None and held is not None:
        facts.cert_pem, facts.cert_serial = held, f"{kept.serial:x}"
        return f"kept its certificate (serial {facts.cert_serial}, until {kept.not_after:%Y-%m-%d}); --reissue makes a new key"
    days = opts.server_config.ca.node_cert_validity_days
    facts.cert_pem = auth.ca.sign_csr(csr_pem, facts.node_id, validity_days=days)
    info = cert_info(x509.load_pem_x509_certificate(facts.cert_pem))
    facts.cert_serial = f"{info.serial:x}"
    old = certs.cert_or_none(held)
    revoked = await trio.to_thread.run_sync(record, auth.admin, facts.node_id, info, old, auth.ca)
    also = ""
    if len(revoked) == 1:
        also = f"; revoked the previous one (serial {revoked[0]})"
    elif revoked:
        also = f"; revoked the previous ones (serials {', '.join(revoked)})"
    key = "a new key" if opts.reissue or not had_key else "its key"
    return f"issued CN={facts.node_id} for {key}, serial {facts.cert_serial}, until {info.not_after:%Y-%m-%d}{also}"


def _agent_toml(opts: Options, facts: Facts) -> str:
    before = facts.existing
    return layout.agent_toml(
        server=servers(opts, facts),
        node_id=facts.node_id,
        fabrics=facts.fabrics,
        llamacpp_bin=opts.llamacpp_bin or (before.llamacpp_bin if before else ""),
        vllm_bin=opts.vllm_bin or (before.vllm_bin if before else ""),
        sglang_python=opts.sglang_python or (before.sglang_python if before else ""),
        driver_paths=opts.driver_paths,
        keep=before,
    )


async def _has_identity(s: ssh.SshSession) -> bool:
    key = node_paths(Path(layout.STATE_DIR)).key
    return (await s.run(["test", "-e", str(key)], sudo=True, timeout_s=SHORT_S)).exit_status == 0


def record(admin: AdminClient, node_id: str, info: CertInfo, old: x509.Certificate | None, ca: CA) -> list[str]:
    """Have the control plane remember the new serial (so `node remove` revokes it), and revoke
    every other certificate of the node id: the one it replaces on this machine, if ours, and
    those of a machine it replaces. Returns the serials revoked, in hex. Blocking: one request."""
    return certs.record(admin, node_id, info, old, ca, revoke_others=True)


# -- trust ---------------------------------------------------------------------------------


async def trust(s: ssh.SshSession, facts: Facts, ca: CA) -> tuple[str, str]:
    node = node_paths(Path(layout.STATE_DIR))
    await put_text(s, facts.cert_pem.decode(), f"{facts.stage}/node.crt", mode=0o644)
    await put_text(s, ca.cert_pem().decode(), f"{facts.stage}/ca.crt", mode=0o644)
    for name, dest in (("node.crt", node.cert), ("ca.crt", node.ca_cert)):
        await must(
            s, ["install", "-m", "0644", f"{facts.stage}/{name}", str(dest)], sudo=True, what=f"installing {dest}"
        )
    store = facts.trust_store
    if store is None:
        return OK, (
            f"certificate and CA root installed in {node.dir}; the root is not added to the system store "
            "(--no-system-trust): the agent trusts only its own ca.crt"
        )
    tool = store.tool.rsplit("/", 1)[-1]
    for argv in layout.trust_commands(store, f"{facts.stage}/ca.crt"):
        await must(s, argv, sudo=True, what=f"running `{' '.join(argv)}`", timeout_s=DOCTOR_S)
    return OK, f"certificate and CA root installed in {node.dir}; root trusted system-wide ({store.anchor}, {tool})"


# -- configure and start -------------------------------------------------------------------


async def configure(opts: Options, s: ssh.SshSession, facts: Facts) -> tuple[str, str]:
    assert facts.artifact is not None
    await service.install_bin(s, facts)
    await must(
        s,
        ["install", "-D", "-m", "0644", f"{facts.stage}/agent.toml", layout.CONFIG],
        sudo=True,
        what=f"writing {layout.CONFIG}",
    )
    written = f"{layout.BIN} ({facts.artifact.version}), {layout.CONFIG}"
    if opts.driver_paths:
        written += f" ({driverpaths.describe(opts.driver_paths)})"
    placed = await llama.place(s, facts.stage, facts.llama)
    if placed:
        written += f", {placed}"
    if facts.systemd:
        await service.install_unit(s, facts.stage, layout.systemd_unit(), layout.UNIT, layout.UNIT_NAME)
        return OK, f"{written}, {layout.UNIT} (enabled)"
    return WARN, (
        f"{written}; no systemd on the node, so the agent runs under llmgw's own supervisor "
        f"(`llmgw agent supervise`, pid file {layout.PID_FILE}, log {layout.LOG_FILE}), which does not "
        "start it again after a reboot"
    )


async def start(s: ssh.SshSession, facts: Facts) -> None:
    if facts.systemd:
        await service.restart(s, layout.UNIT_NAME)
        return
    await must(s, stop_supervisor_argv(), sudo=True, what="stopping the running agent", timeout_s=DOCTOR_S)
    await must(
        s,
        [
            layout.BIN, "agent", "supervise", "--daemon", "--config", layout.CONFIG,
            "--pid-file", layout.PID_FILE, "--log", layout.LOG_FILE,
        ],
        sudo=True,
        what="starting the agent",
        timeout_s=DOCTOR_S,
    )  # fmt: skip


def stop_supervisor_argv() -> list[str]:
    return [layout.BIN, "agent", "stop", "--pid-file", layout.PID_FILE]


def stop_argv(systemd: bool) -> tuple[list[str], str]:
    """What stops and disables the agent for good (`llmgw node remove --ssh`), and in words."""
    if systemd:
        return ["systemctl", "disable", "--now", layout.UNIT_NAME], f"systemctl disable --now {layout.UNIT_NAME}"
    return stop_supervisor_argv(), f"llmgw agent stop --pid-file {layout.PID_FILE}"


# -- join ----------------------------------------------------------------------------------


JOINED, WAITING, BROKEN, UNAVAILABLE = "joined", "waiting", "broken", "unavailable"


@attrs.frozen(kw_only=True)
class Joined:
    """How the join ended: `detail` for the step's line; `warn` when the node joined without
    llama.cpp (unavailable there: the step warns, and the run goes on)."""

    detail: str
    warn: bool = False


def join_progress(node: dict[str, Any] | None, started_before: float | None) -> tuple[str, str]:
    """JOINED (the restarted agent heartbeated and llama.cpp is checked), WAITING (and for what),
    BROKEN (the agent said llama.cpp cannot be used: waiting longer would not change it), or
    UNAVAILABLE (joined, and this node lacks what llama.cpp's source needs, e.g. a compiler for a
    build: the node is not held back, it serves its other engines and the agent tries again)."""
    if node is None:
        return WAITING, "the control plane has not heard from the agent"
    if not node.get("connected"):
        return WAITING, f"the agent is not connected (state {node['state']})"
    if node.get("agent_started_at") == started_before:
        return WAITING, "the agent connected is the one from before the restart"
    if node["state"] != "joined":
        return WAITING, f"the agent is connected but has not sent a heartbeat (state {node['state']})"
    llama = next((e for e in node.get("engines") or () if e["name"] == "llamacpp"), None)
    if llama is None:
        return WAITING, "joined; llama.cpp is not installed yet"
    if llama.get("state") == "installing" and not llama["ok"]:
        return WAITING, f"joined; {installing_text(llama)}"
    if llama.get("state") == "unavailable":
        return UNAVAILABLE, (
            f"joined without llama.cpp: unavailable: {llama['detail']} (the agent tries again every few minutes; "
            "`llmgw ctl nodes` shows it)"
        )
    if not llama["ok"]:
        return BROKEN, f"joined, but llama.cpp cannot be used: {llama['detail']}"
    return JOINED, f"joined; llama.cpp installed and checked ({llama['version']})"


async def wait_for_join(
    opts: Options,
    s: ssh.SshSession,
    facts: Facts,
    admin: AdminClient,
    started_before: float | None,
    *,
    progress: Callable[[str], None] = lambda said: None,
    poll: Callable[[], Awaitable[list[dict[str, Any]]]] | None = None,
) -> Joined:
    """Poll the control plane until the node has joined; each new thing it says goes to `progress`.

    `join_timeout_s` counts from the last news, not from the start: a build that keeps reporting
    (llama.cpp on a small node takes minutes) is waited for, a node that says nothing new for that
    long is given up on. `poll` reads the nodes (default: the admin API, in a thread)."""
    poll = poll or partial(trio.to_thread.run_sync, admin.nodes)
    state, said = WAITING, ""
    with trio.CancelScope(deadline=trio.current_time() + opts.join_timeout_s) as quiet:
        while state == WAITING:
            node = view_of(await poll(), facts.node_id)
            before = said
            state, said = join_progress(node, started_before)
            if state in (JOINED, UNAVAILABLE):
                marks = " (cordoned: no new work until `llmgw ctl uncordon`)" if node and node.get("cordoned") else ""
                return Joined(detail=said + marks, warn=state == UNAVAILABLE)
            if state == WAITING:
                if said != before:
                    progress(said)
                    quiet.deadline = trio.current_time() + opts.join_timeout_s
                await trio.sleep(POLL_S)
    tail = await _log_tail(s, facts.systemd)
    why = said if state == BROKEN else f"did not finish joining: nothing new for {opts.join_timeout_s:g} s: {said}"
    raise PeerError(
        f"{facts.node_id} {why}. The agent's log on the node ({layout.log_hint(facts.systemd)}) says more"
        + (f"; its last lines:\n{tail}" if tail else "")
    )


async def _log_tail(s: ssh.SshSession, systemd: bool) -> str:
    argv = (
        ["journalctl", "-u", layout.UNIT_NAME, "-n", str(LOG_LINES), "--no-pager"]
        if systemd
        else ["tail", "-n", str(LOG_LINES), "--", layout.LOG_FILE]
    )
    try:
        res = await s.run(argv, sudo=True, timeout_s=SHORT_S)
    except LlmgwError:
        return ""
    return res.stdout.rstrip() if res.exit_status == 0 else ""
