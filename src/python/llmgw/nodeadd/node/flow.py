"""`llmgw node add`: its steps (`steps.STEPS`), each a function over the toolkit (llmgw.nodeadd),
run against one node over SSH by the toolkit's `run_flow`.

Invariants:

- The authority (CA, server certificate, a running control plane) is read before the node is
  touched: a missing one is said before any SSH connection is made. The control plane's state
  (its nodes, revoked serials, the serial issued) is read and written through its admin API
  only: node add never opens the control plane's database.
- Nothing is changed on the node until doctor has passed there. The release is staged in a
  private directory under /tmp, its sha256 checked on the node, and doctor run from it; the
  stage is removed at the end whatever happens.
- The release `--release` names is the one the node gets, whole: its llama.cpp archive for the
  node's architecture goes with the zipapp when the node will want it (llama.py).
- Every remote command is argv (llmgw.nodeadd.remote quotes it); stdout and stderr stay apart.
- Running it again converges: the same files are rewritten, the zipapp replaced only when its
  sha256 differs, the node's key and certificate kept unless `reissue`, and the agent restarted;
  "joined" then means a heartbeat from the restarted agent (its start time differs).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from llmgw.ctl.client import AdminClient
from llmgw.nodeadd import checklist, ship
from llmgw.nodeadd.checklist import Emit, Flow, Outcome, read_authority
from llmgw.nodeadd.context import Authority, view_of
from llmgw.nodeadd.identify import agent_address
from llmgw.nodeadd.node import doctor, identify, install, layout, llama
from llmgw.nodeadd.node.install import Facts, Options
from llmgw.nodeadd.node.steps import STEPS
from llmgw.nodeadd.questions import Questions
from llmgw.nodeadd.steps import OK, WARN

__all__ = ["Added", "Options", "add_node"]


@attrs.frozen(kw_only=True)
class Added:
    node_id: str
    server: str
    version: str
    service: str  # "systemd" or "supervisor"
    cert_serial: str
    log: str  # where the agent's log is, on the node


@attrs.define(kw_only=True)
class NodeRun(checklist.Run):
    opts: Options
    facts: Facts
    auth: Authority | None = None
    inventory: dict[str, Any] = attrs.Factory(dict)  # doctor's, for fabrics
    started_at: float | None = None  # the agent's start time before `start`, for `join`

    @property
    def authority(self) -> Authority:
        assert self.auth is not None
        return self.auth


async def add_node(opts: Options, *, emit: Emit, questions: Questions) -> Added:
    run = await checklist.run_flow(FLOW, NodeRun(opts=opts, facts=Facts(), emit=emit, questions=questions))
    facts = run.facts
    assert facts.artifact is not None
    return Added(
        node_id=facts.node_id,
        server=facts.server,
        version=facts.artifact.version,
        service="systemd" if facts.systemd else "supervisor",
        cert_serial=facts.cert_serial,
        log=layout.log_hint(facts.systemd),
    )


async def _authority(run: NodeRun, st: Outcome) -> None:
    ca, server_cert = read_authority(run.opts.state_dir)
    admin = AdminClient.locate(server=None, credential=None, state_dir=str(run.opts.state_dir))
    nodes = await trio.to_thread.run_sync(admin.nodes)
    info = ca.info()
    st.ok(
        f"CA {info.common_name!r} (sha256 {info.fingerprint_sha256[:23]}...), "
        f"control plane at {admin.url} with {len(nodes)} node(s)"
    )
    run.auth = Authority(ca=ca, server_cert=server_cert, admin=admin, nodes=nodes)


async def _identify(run: NodeRun, st: Outcome) -> None:
    st.ok(await identify.identify(run.opts, run.s, run.facts, run.authority))


async def _address(run: NodeRun, st: Outcome) -> None:
    run.facts.address, run.facts.port = agent_address(run.opts, run.s.target.host, run.authority.server_cert)
    st.ok(f"the agent will dial {run.facts.server}, covered by the server certificate")


async def _ship(run: NodeRun, st: Outcome) -> None:
    opts, facts = run.opts, run.facts
    ca_pem = run.authority.ca.cert_pem()
    fell_back = await ship.choose(opts, facts, ca_pem)
    llamacpp_bin = opts.llamacpp_bin or (facts.existing.llamacpp_bin if facts.existing else "")
    version = llama.wanted(opts.server_config.engines, llamacpp_bin=llamacpp_bin)
    facts.llama, no_llama = await llama.choose(opts.release, facts.arch, version)
    await ship.ship(run.s, facts, ca_pem)
    detail = ship.ship_detail(facts)
    if facts.llama is not None:
        detail += "; " + await llama.ship(run.s, facts.stage, facts.llama)
    elif no_llama:
        detail += f"; {no_llama}"
    if fell_back:
        st.warn(f"{detail}; {fell_back}")
    else:
        st.ok(detail)


async def _doctor(run: NodeRun, st: Outcome) -> None:
    status, text, run.inventory = await doctor.doctor(run.opts, run.s, run.facts, run.questions)
    st.say(status, text)


async def _fabrics(run: NodeRun, st: Outcome) -> None:
    st.say(*await doctor.fabrics(run.opts, run.facts, run.inventory, run.authority.nodes, run.questions))


async def _identity(run: NodeRun, st: Outcome) -> None:
    st.ok(await install.identity(run.opts, run.s, run.facts, run.authority))


async def _trust(run: NodeRun, st: Outcome) -> None:
    st.say(*await install.trust(run.s, run.facts, run.authority.ca))


async def _configure(run: NodeRun, st: Outcome) -> None:
    st.say(*await install.configure(run.opts, run.s, run.facts))


async def _start(run: NodeRun, st: Outcome) -> None:
    before = view_of(await trio.to_thread.run_sync(run.authority.admin.nodes), run.facts.node_id)
    run.started_at = before.get("agent_started_at") if before else None
    await install.start(run.s, run.facts)
    how = f"systemctl restart {layout.UNIT_NAME}" if run.facts.systemd else "llmgw agent supervise --daemon"
    st.ok(f"started ({how}); its log: {layout.log_hint(run.facts.systemd)}")


async def _join(run: NodeRun, st: Outcome) -> None:
    joined = await install.wait_for_join(
        run.opts, run.s, run.facts, run.authority.admin, run.started_at, progress=st.progress
    )
    st.say(WARN if joined.warn else OK, joined.detail)


FLOW: Flow[NodeRun] = Flow(
    STEPS,
    {
        "authority": _authority,
        "connect": checklist.connect,
        "identify": _identify,
        "address": _address,
        "ship": _ship,
        "doctor": _doctor,
        "fabrics": _fabrics,
        "identity": _identity,
        "trust": _trust,
        "configure": _configure,
        "start": _start,
        "join": _join,
    },
)
