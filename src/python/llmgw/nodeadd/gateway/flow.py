"""`llmgw gateway add`: its steps (`steps.STEPS`), each a function over the toolkit
(llmgw.nodeadd), run against one machine over SSH by the toolkit's `run_flow`.

The same SSH session and host-key questions, the same address check, the same release shipped
the same way, the same checklist, events and screens as node add and server add, with a gateway
at the end. Invariants:

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

import attrs
import trio

from llmgw.ctl.client import AdminClient
from llmgw.nodeadd import checklist, ship
from llmgw.nodeadd.checklist import Emit, Flow, Outcome, read_authority
from llmgw.nodeadd.gateway import install, layout
from llmgw.nodeadd.gateway.install import Authority, Facts, Options
from llmgw.nodeadd.gateway.steps import STEPS
from llmgw.nodeadd.identify import agent_address
from llmgw.nodeadd.questions import Questions
from llmgw.nodeadd.steps import OK, WARN

__all__ = ["Added", "Options", "add_gateway"]


@attrs.frozen(kw_only=True)
class Added:
    name: str
    server: str  # what it dials: the control plane's agent port
    listen: str
    workers: str
    version: str
    cert_serial: str
    linked: str  # what the control plane listed, in words
    log: str  # where the gateway's log is, on its machine


@attrs.define(kw_only=True)
class GatewayRun(checklist.Run):
    opts: Options
    facts: Facts
    auth: Authority | None = None
    before: frozenset[str] = frozenset()  # the gateway's instances linked before `start`, for `join`
    linked: str = ""

    @property
    def authority(self) -> Authority:
        assert self.auth is not None
        return self.auth


async def add_gateway(opts: Options, *, emit: Emit, questions: Questions) -> Added:
    run = await checklist.run_flow(FLOW, GatewayRun(opts=opts, facts=Facts(), emit=emit, questions=questions))
    facts = run.facts
    assert facts.artifact is not None
    return Added(
        name=facts.name,
        server=facts.server,
        listen=opts.listen,
        workers=opts.workers,
        version=facts.artifact.version,
        cert_serial=facts.cert_serial,
        linked=run.linked,
        log=layout.log_hint(),
    )


async def _authority(run: GatewayRun, st: Outcome) -> None:
    ca, server_cert = read_authority(run.opts.state_dir)
    admin = AdminClient.locate(server=None, credential=None, state_dir=str(run.opts.state_dir))
    nodes = await trio.to_thread.run_sync(admin.nodes)
    gateways = await trio.to_thread.run_sync(admin.gateways)
    auth = run.auth = Authority(ca=ca, server_cert=server_cert, admin=admin, nodes=nodes, gateways=gateways)
    info = auth.ca.info()
    st.ok(
        f"CA {info.common_name!r} (sha256 {info.fingerprint_sha256[:23]}...), control plane at {auth.admin.url} "
        f"with {len(auth.nodes)} node(s) and {len(auth.gateways)} gateway link(s)"
    )


async def _identify(run: GatewayRun, st: Outcome) -> None:
    st.say(*await install.identify(run.opts, run.s, run.facts, run.authority))


async def _address(run: GatewayRun, st: Outcome) -> None:
    address = agent_address(run.opts, run.s.target.host, run.authority.server_cert, who="gateway")
    run.facts.address, run.facts.port = address
    st.ok(f"the gateway will dial {run.facts.server}, covered by the server certificate")


async def _ship(run: GatewayRun, st: Outcome) -> None:
    ca_pem = run.authority.ca.cert_pem()
    fell_back = await ship.choose(run.opts, run.facts, ca_pem)
    await ship.ship(run.s, run.facts, ca_pem)
    ran = await ship.tried(run.s, run.facts)
    detail = f"{ship.ship_detail(run.facts, machine='machine')}; it runs there: {ran}"
    st.say(WARN if fell_back else OK, f"{detail}; {fell_back}" if fell_back else detail)


async def _install(run: GatewayRun, st: Outcome) -> None:
    st.ok(await install.install(run.s, run.facts))


async def _identity(run: GatewayRun, st: Outcome) -> None:
    st.ok(await install.identity(run.opts, run.s, run.facts, run.authority))


async def _configure(run: GatewayRun, st: Outcome) -> None:
    st.ok(await install.configure(run.opts, run.s, run.facts))


async def _start(run: GatewayRun, st: Outcome) -> None:
    run.before = install.instances(await trio.to_thread.run_sync(run.authority.admin.gateways), run.facts.name)
    await install.start(run.s)
    st.ok(f"started (systemctl restart {layout.UNIT_NAME}); its log: {layout.log_hint()}")


async def _join(run: GatewayRun, st: Outcome) -> None:
    run.linked = await install.wait_for_link(
        run.opts, run.s, run.facts, run.authority.admin, run.before, progress=st.progress
    )
    st.ok(run.linked)


FLOW: Flow[GatewayRun] = Flow(
    STEPS,
    {
        "authority": _authority,
        "connect": checklist.connect,
        "identify": _identify,
        "address": _address,
        "ship": _ship,
        "install": _install,
        "identity": _identity,
        "configure": _configure,
        "start": _start,
        "join": _join,
    },
)
