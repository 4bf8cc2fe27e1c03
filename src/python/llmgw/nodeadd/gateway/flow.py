"""`llmgw gateway add`: the steps, run against one machine over SSH, in the order of `steps.STEPS`.

Node add's machinery (llmgw.nodeadd) with a gateway at the end instead of an agent: the same
SSH session and host-key questions, the same address check, the same release shipped the same
way, the same checklist, events and screens. Its invariants hold here too:

- The authority (CA, server certificate, a running control plane: its nodes and its gateways)
  is read before the machine is touched, and the control plane's state is read and written
  through its admin API only.
- Nothing is changed on the machine outside the stage until the release has run there
  (`ship.tried`). The stage is removed at the end whatever happens.
- Every remote command is argv (llmgw.nodeadd.remote quotes it).
- Running it again converges: the same files are rewritten, the zipapp replaced only when its
  sha256 differs, the key and certificate kept unless `--reissue`, and the unit restarted;
  "joined" then means the restarted gateway's workers linked with that certificate, instances
  the control plane did not list before the restart.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import attrs
import trio

from llmgw.ctl.client import AdminClient
from llmgw.nodeadd import flow, identify, ship, ssh
from llmgw.nodeadd.context import SHORT_S
from llmgw.nodeadd.flow import Emit, read_authority, remove_stage, run_step
from llmgw.nodeadd.gateway import install, layout
from llmgw.nodeadd.gateway.install import Authority, Facts, Options
from llmgw.nodeadd.questions import Questions
from llmgw.nodeadd.steps import OK, WARN

__all__ = ["Added", "Options", "add_gateway"]


@attrs.frozen(kw_only=True)
class Added:
    name: str
    server: str  # what it dials: the control plane's agent endpoint
    listen: str
    workers: str
    version: str
    cert_serial: str
    linked: str  # what the control plane listed, in words
    log: str  # where the gateway's log is, on its machine


async def add_gateway(opts: Options, *, emit: Emit, questions: Questions) -> Added:
    async with run_step(emit, "authority") as st:
        auth = await _authority(opts)
        info = auth.ca.info()
        st.ok(
            f"CA {info.common_name!r} (sha256 {info.fingerprint_sha256[:23]}...), control plane at {auth.admin.url} "
            f"with {len(auth.nodes)} node(s) and {len(auth.gateways)} gateway link(s)"
        )
    facts = Facts()
    async with AsyncExitStack() as stack:
        async with run_step(emit, "connect") as st:
            session = await stack.enter_async_context(flow.open_session(opts.base, questions))
            st.ok(f"{session.target} port {opts.base.ssh_port}, host key verified against {opts.base.known_hosts}")
        try:
            return await _on_machine(opts, session, facts, emit, auth)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(SHORT_S):
                await remove_stage(session, facts.stage)


async def _authority(opts: Options) -> Authority:
    ca, server_cert = read_authority(opts.base.state_dir)
    admin = AdminClient.locate(server=None, credential=None, state_dir=str(opts.base.state_dir))
    nodes = await trio.to_thread.run_sync(admin.nodes)
    gateways = await trio.to_thread.run_sync(admin.gateways)
    return Authority(ca=ca, server_cert=server_cert, admin=admin, nodes=nodes, gateways=gateways)


async def _on_machine(opts: Options, s: ssh.Session, facts: Facts, emit: Emit, auth: Authority) -> Added:
    async with run_step(emit, "identify") as st:
        st.say(*await install.identify(opts, s, facts, auth))

    async with run_step(emit, "address") as st:
        facts.address, facts.port = identify.agent_address(opts.base, s.target.host, auth.server_cert, who="gateway")
        st.ok(f"the gateway will dial {facts.server}, covered by the server certificate")

    async with run_step(emit, "ship") as st:
        ca_pem = auth.ca.cert_pem()
        fell_back = await ship.choose(opts.base, facts, ca_pem)
        await ship.ship(s, facts, ca_pem)
        ran = await ship.tried(s, facts)
        detail = f"{ship.ship_detail(facts, machine='machine')}; it runs there: {ran}"
        st.say(WARN if fell_back else OK, f"{detail}; {fell_back}" if fell_back else detail)

    async with run_step(emit, "install") as st:
        st.ok(await install.install(s, facts))

    async with run_step(emit, "identity") as st:
        st.ok(await install.identity(opts, s, facts, auth))

    async with run_step(emit, "configure") as st:
        st.ok(await install.configure(opts, s, facts))

    async with run_step(emit, "start") as st:
        before = install.instances(await trio.to_thread.run_sync(auth.admin.gateways), facts.name)
        await install.start(s)
        st.ok(f"started (systemctl restart {layout.UNIT_NAME}); its log: {layout.log_hint()}")

    async with run_step(emit, "join") as st:
        linked = await install.wait_for_link(opts, s, facts, auth.admin, before, progress=st.progress)
        st.ok(linked)

    assert facts.artifact is not None
    return Added(
        name=facts.name,
        server=facts.server,
        listen=opts.listen,
        workers=opts.workers,
        version=facts.artifact.version,
        cert_serial=facts.cert_serial,
        linked=linked,
        log=layout.log_hint(),
    )
