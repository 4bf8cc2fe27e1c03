"""`llmgw node add`: the steps, run against one node over SSH, in the order of `steps.STEPS`.

This module is the order and what each step reports; the steps themselves live by group:
identify.py (identify, address), ship.py (ship, doctor, fabrics) and install.py (identity,
trust, configure, start, join), sharing context.py's `Options`, `Authority` and `Facts`.

Invariants:

- The authority (CA, server certificate, a running control plane) is read before the node is
  touched: a missing one is said before any SSH connection is made. The control plane's state
  (its nodes, revoked serials, the serial issued) is read and written through its admin API
  only: node add never opens the control plane's database.
- Nothing is changed on the node until doctor has passed there. The release is staged in a
  private directory under /tmp, its sha256 checked on the node, and doctor run from it; the
  stage is removed at the end whatever happens.
- Every remote command is argv (llmgw.nodeadd.remote quotes it); stdout and stderr stay apart.
- Running it again converges: the same files are rewritten, the zipapp replaced only when its
  sha256 differs, the node's key and certificate kept unless `reissue`, and the agent restarted;
  "joined" then means a heartbeat from the restarted agent (its start time differs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path

import attrs
import trio

from llmgw.ctl.client import AdminClient
from llmgw.errors import LlmgwError, MachineError
from llmgw.nodeadd import identify, install, layout, ship, ssh
from llmgw.nodeadd.context import SHORT_S, Authority, Facts, Options, view_of
from llmgw.nodeadd.questions import Questions
from llmgw.nodeadd.steps import FAILED, OK, PROGRESS, STARTED, WARN, Event
from llmgw.pki.ca import CA, CertInfo, cert_info
from llmgw.pki.files import ca_paths, load_ca, load_cert

__all__ = ["Added", "Options", "add_node"]

Emit = Callable[[Event], None]


@attrs.frozen(kw_only=True)
class Added:
    node_id: str
    server: str
    version: str
    service: str  # "systemd" or "supervisor"
    cert_serial: str
    log: str  # where the agent's log is, on the node


@attrs.define
class Outcome:
    step: str
    emit: Emit
    status: str = OK
    detail: str = ""

    def progress(self, detail: str) -> None:
        """What the running step is doing now (a line in --plain and --json, the detail on screen)."""
        self.emit(Event(step=self.step, status=PROGRESS, detail=detail))

    def ok(self, detail: str) -> None:
        self.status, self.detail = OK, detail

    def warn(self, detail: str) -> None:
        self.status, self.detail = WARN, detail

    def say(self, status: str, detail: str) -> None:
        """OK or WARN, as a step's helper decided."""
        self.status, self.detail = status, detail


@asynccontextmanager
async def run_step(emit: Emit, name: str) -> AsyncIterator[Outcome]:
    emit(Event(step=name, status=STARTED))
    outcome = Outcome(step=name, emit=emit)
    try:
        yield outcome
    except LlmgwError as exc:
        emit(Event(step=name, status=FAILED, detail=str(exc)))
        raise
    except (trio.Cancelled, KeyboardInterrupt):
        emit(Event(step=name, status=FAILED, detail="interrupted"))
        raise
    except BaseException as exc:
        emit(Event(step=name, status=FAILED, detail=f"internal error (a bug in llmgw): {exc!r}"))
        raise
    emit(Event(step=name, status=outcome.status, detail=outcome.detail))


async def add_node(opts: Options, *, emit: Emit, questions: Questions) -> Added:
    async with run_step(emit, "authority") as st:
        ca, server_cert = read_authority(opts.state_dir)
        admin = AdminClient.locate(server=None, credential=None, state_dir=str(opts.state_dir))
        nodes = await trio.to_thread.run_sync(admin.nodes)
        info = ca.info()
        st.ok(
            f"CA {info.common_name!r} (sha256 {info.fingerprint_sha256[:23]}...), "
            f"control plane at {admin.url} with {len(nodes)} node(s)"
        )
    auth = Authority(ca=ca, server_cert=server_cert, admin=admin, nodes=nodes)
    facts = Facts()
    async with AsyncExitStack() as stack:
        async with run_step(emit, "connect") as st:
            session = await stack.enter_async_context(open_session(opts, questions))
            st.ok(f"{session.target} port {opts.ssh_port}, host key verified against {opts.known_hosts}")
        try:
            return await _on_node(opts, session, facts, emit, questions, auth)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(SHORT_S):
                await remove_stage(session, facts.stage)


def open_session(opts: Options, questions: Questions) -> AbstractAsyncContextManager[ssh.Session]:
    """The SSH session to `opts.target`; a host absent from known_hosts is accepted by the flag or
    by the operator's answer (questions.py)."""
    return ssh.open_session(
        opts.target,
        known_hosts=opts.known_hosts,
        accept_new_host_key=opts.accept_new_host_key or (lambda fp: questions.accept_host_key(opts.target, fp)),
        client_keys=opts.identity_files,
        port=opts.ssh_port,
    )


async def _on_node(
    opts: Options, s: ssh.Session, facts: Facts, emit: Emit, questions: Questions, auth: Authority
) -> Added:
    async with run_step(emit, "identify") as st:
        st.ok(await identify.identify(opts, s, facts, auth))

    async with run_step(emit, "address") as st:
        facts.address, facts.port = identify.agent_address(opts, s.target.host, auth.server_cert)
        st.ok(f"the agent will dial {facts.server}, covered by the server certificate")

    async with run_step(emit, "ship") as st:
        ca_pem = auth.ca.cert_pem()
        fell_back = await ship.choose(opts, facts, ca_pem)
        await ship.ship(s, facts, ca_pem)
        detail = ship.ship_detail(facts)
        if fell_back:
            st.warn(f"{detail}; {fell_back}")
        else:
            st.ok(detail)

    async with run_step(emit, "doctor") as st:
        status, text, inventory = await ship.doctor(opts, s, facts, questions)
        st.say(status, text)

    async with run_step(emit, "fabrics") as st:
        status, text = await ship.fabrics(opts, facts, inventory, auth.nodes, questions)
        st.say(status, text)

    async with run_step(emit, "identity") as st:
        st.ok(await install.identity(opts, s, facts, auth))

    async with run_step(emit, "trust") as st:
        status, text = await install.trust(s, facts, auth.ca)
        st.say(status, text)

    async with run_step(emit, "configure") as st:
        status, text = await install.configure(opts, s, facts)
        st.say(status, text)

    async with run_step(emit, "start") as st:
        before = view_of(await trio.to_thread.run_sync(auth.admin.nodes), facts.node_id)
        started_at = before.get("agent_started_at") if before else None
        await install.start(s, facts)
        how = f"systemctl restart {layout.UNIT_NAME}" if facts.systemd else "llmgw agent supervise --daemon"
        st.ok(f"started ({how}); its log: {layout.log_hint(facts.systemd)}")

    async with run_step(emit, "join") as st:
        joined = await install.wait_for_join(opts, s, facts, auth.admin, started_at, progress=st.progress)
        st.say(WARN if joined.warn else OK, joined.detail)

    assert facts.artifact is not None
    return Added(
        node_id=facts.node_id,
        server=facts.server,
        version=facts.artifact.version,
        service="systemd" if facts.systemd else "supervisor",
        cert_serial=facts.cert_serial,
        log=layout.log_hint(facts.systemd),
    )


def read_authority(state_dir: Path) -> tuple[CA, CertInfo]:
    ca = load_ca(state_dir)
    paths = ca_paths(state_dir)
    if not paths.server_cert.exists():
        raise MachineError(
            f"{paths.server_cert} is missing: the control plane has no certificate for agents to check; "
            f"issue one with `llmgw ca server-cert --state-dir {state_dir} --san ADDRESS`"
        )
    return ca, cert_info(load_cert(paths.server_cert))


async def remove_stage(s: ssh.Session, stage: str) -> None:
    if not stage.startswith(layout.STAGE_PREFIX):
        return
    try:
        await s.run(["rm", "-rf", "--", stage], sudo=True, timeout_s=SHORT_S)
    except LlmgwError:
        pass  # the session is gone; the stage is under /tmp and holds nothing secret
