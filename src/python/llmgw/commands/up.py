"""`llmgw up`: a whole cluster on this machine in one command — the first thing to run.

One process tree: the control plane (CA and state in --state-dir), N local agents with their
own node ids, certificates and loopback addresses (127.0.0.1, 127.0.0.2, ...), a sim model with
two replicas (and, with --fabric and two or more nodes, a sim model spanning two nodes of a
simulated fabric), the gateway on localhost (one worker process, unless server.toml's
`[server] gateway_workers` says more). It prints the gateway URL, an API key, a curl
command and the `ctl` commands that operate the cluster, each working as printed (`./llmgw ...`
when run by the checkout's script, `llmgw ...` otherwise); `--json` prints one JSON object per
event instead. Ctrl-C (or SIGTERM) stops everything and exits 0; a second one during the stop
cuts it short (exit 130). Running it again reuses the state (CA, certificates, key); server.toml
changes only as the new flags say, and `up` prints what changed (`_upconfig`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from functools import partial
from pathlib import Path
from typing import Any

import trio

from llmgw import paths, private, simfabric
from llmgw.cli import Parser
from llmgw.commands import _upconfig
from llmgw.commands._service import run_service
from llmgw.config import AgentConfig, FabricDecl, load_server_config, parse_toml, server_config_from_dict
from llmgw.errors import LlmgwError, UsageError, leaves, only
from llmgw.log import get_logger
from llmgw.pki.ca import CA
from llmgw.pki.files import ca_paths, init_ca, issue_server_cert, issue_to_dir, load_ca, node_paths

log = get_logger("llmgw.up")

READY_TIMEOUT_S = 120.0
UP_GATEWAY_WORKERS = 1  # `[server] gateway_workers` when server.toml leaves it out
INVOKED_AS_ENV = "LLMGW_INVOKED_AS"  # set by the checkout's ./llmgw script: how to run this llmgw again


def default_state_dir() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "llmgw" / "up"


def configure(parser: Parser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=f"where the cluster keeps its state (default {default_state_dir()})",
    )
    parser.add_argument(
        "--port",
        type=int,
        help="the gateway's port on 127.0.0.1 (default 8080, or the port saved in --state-dir's server.toml)",
    )
    parser.add_argument(
        "--nodes", type=int, default=1, metavar="N", help="local agents to start (default 1, at most 250)"
    )
    parser.add_argument(
        "--fabric",
        metavar="NAME",
        help="put the nodes on a simulated InfiniBand fabric of this name; with 2 or more nodes, also serve "
        "sim-big, one replica across 2 nodes",
    )
    parser.add_argument(
        "--model",
        type=Path,
        metavar="FILE.gguf",
        help="also serve this GGUF file with llama.cpp (needs --llama-server or $LLMGW_LLAMA_SERVER)",
    )
    parser.add_argument(
        "--llama-server", metavar="PATH", help="the llama-server for --model (default: $LLMGW_LLAMA_SERVER)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per event on standard output")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.nodes <= 250:
        raise UsageError(f"--nodes must be between 1 and 250, got {args.nodes}")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise UsageError(f"--port must be between 1 and 65535, got {args.port}")
    if args.model is not None and not args.model.is_file():
        raise UsageError(f"--model {args.model}: no such file")
    state = (args.state_dir or default_state_dir()).resolve()
    return run_service("up", up, args, state)


def command_name() -> str:
    """How the operator runs this llmgw, so that the commands `up` prints work as printed: the
    checkout's `./llmgw` script names itself in $LLMGW_INVOKED_AS; an installed one is `llmgw`."""
    return os.environ.get(INVOKED_AS_ENV) or "llmgw"


def operate_commands(state: Path) -> list[str]:
    """The commands `up` prints for operating the cluster it started (docs/quickstart.md)."""
    prefix, where = command_name(), shlex.quote(str(state))
    return [f"{prefix} ctl nodes --state-dir {where}", f"{prefix} ctl replicas --state-dir {where}"]


class Events:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def __call__(self, event: str, text: str = "", **fields: Any) -> None:
        if self.as_json:
            print(json.dumps({"event": event, **fields}), flush=True)
        elif text:
            print(text, flush=True)


def _llama_server(args: argparse.Namespace) -> str:
    return args.llama_server or os.environ.get("LLMGW_LLAMA_SERVER", "")


def _server_toml(state: Path, args: argparse.Namespace, emit: Events) -> Path:
    """server.toml as this `up`'s flags ask (see `_upconfig`), with up.json beside it naming the
    models `up` added; rewritten, and the changes printed, only when something changed."""
    path, record = state / "server.toml", state / "up.json"
    shape = _upconfig.Shape(
        nodes=args.nodes,
        port=args.port,
        fabric=args.fabric,
        gguf=args.model.resolve() if args.model is not None else None,
        llama_server=bool(_llama_server(args)),
    )
    if path.exists():
        doc = parse_toml(path.read_text(), str(path))
        owned = _owned(record, doc)
        planned = _upconfig.update(doc, owned, shape, path)
        if not planned.changes:
            if planned.owned != owned or not record.exists():  # e.g. the operator removed one
                paths.write_private(record, (json.dumps({"models": list(planned.owned)}) + "\n").encode())
            return path
    else:
        planned = _upconfig.first(state, shape)
    server_config_from_dict(planned.doc, str(path))  # a file `up` would not start on is not written
    header = (
        f"# Written by `llmgw up`. Edit it and run `{command_name()} ctl reload --state-dir {shlex.quote(str(state))}`;\n"
        "# a later `up` changes only what its flags decide (--port, --fabric, --model), and says so.\n"
    )
    paths.write_private(path, _upconfig.render(planned.doc, header).encode())  # a model's source may hold a token
    paths.write_private(record, (json.dumps({"models": list(planned.owned)}) + "\n").encode())
    if planned.changes:
        emit(
            "config_updated",
            "\n".join([f"llmgw up: updated {path}:", *(f"  {c}" for c in planned.changes)]),
            path=str(path),
            changes=list(planned.changes),
        )
    return path


def _owned(record: Path, doc: dict[str, Any]) -> tuple[str, ...]:
    """The models an earlier `up` added, from up.json; from the catalog itself for a state
    directory from before up.json (or one whose up.json was damaged)."""
    try:
        return tuple(str(name) for name in json.loads(record.read_text())["models"])
    except (OSError, ValueError, KeyError, TypeError):
        return _upconfig.legacy_owned(doc)


def _node_config(state: Path, ca: CA, i: int, agent_port: int, args: argparse.Namespace) -> AgentConfig:
    node_id = f"local-{i + 1}"
    node_dir = state / "nodes" / node_id
    files = node_paths(node_dir)
    if not files.cert.exists():
        issue_to_dir(ca, node_id, files.dir, validity_days=365)
    extra: dict[str, Any] = {}
    if args.fabric:
        ib_root, sminfo = simfabric.write_node(node_dir / "sim-fabric", fabric=args.fabric, node=node_id, index=i)
        extra = {
            "ib_root": str(ib_root),
            "sminfo": str(sminfo),
            "fabrics": (FabricDecl(name=args.fabric, adapters=simfabric.ADAPTERS),),
        }
    llama = _llama_server(args)
    return AgentConfig(
        server=f"wss://127.0.0.1:{agent_port}",
        node_id=node_id,
        state_dir=str(node_dir),
        source_address=f"127.0.0.{i + 1}",
        llamacpp_bin=llama,
        **extra,
    )


async def up(args: argparse.Namespace, state: Path) -> None:
    from agent.main import run_agent
    from llmgw.gcpolicy import freeze_start_objects
    from llmgw.server.app import ControlPlane

    emit = Events(args.json)
    private.make_dir(state, "the state directory of `llmgw up`")  # 0700, and its missing parents
    emit("starting", f"llmgw up: state in {state}", state_dir=str(state), nodes=args.nodes)
    if not ca_paths(state).ca_key.exists():
        init_ca(state, validity_days=3650)
        issue_server_cert(load_ca(state), state, ["127.0.0.1"], validity_days=825)
        emit("ca_created", state_dir=str(state))
    ca = load_ca(state)
    paths.ensure_admin_token(state)
    config_path = _server_toml(state, args, emit)
    config = load_server_config(config_path)
    # One gateway worker unless server.toml says otherwise: a laptop's quickstart stays light.
    plane = ControlPlane.open(config, state, config_path, gateway_workers=UP_GATEWAY_WORKERS)
    api_key = await _api_key(plane, state)  # before the gateway starts: in its first table
    async with trio.open_nursery() as nursery:
        try:
            bound = await nursery.start(plane.serve)
        except Exception as exc:  # raised inside the plane's nursery: it comes in a group
            if not only(exc, LlmgwError):
                raise
            raise LlmgwError(
                f"{leaves(exc)[0]} (the gateway wants {config.server.http_listen}; pick another with --port)"
            ) from None
        emit("control_plane", admin_url=bound.admin_url, agents=f"{bound.agent_address[0]}:{bound.agent_address[1]}")
        for i in range(args.nodes):
            # The control plane watches the loop they share (`llmgw.looplag`): one ticker per process.
            await nursery.start(
                partial(run_agent, watch_loop=False), _node_config(state, ca, i, bound.agent_address[1], args)
            )
        await _wait_ready(plane, args.nodes, emit)
        freeze_start_objects()
        names = [m.name for m in plane.config.models]
        example = "sim-small" if "sim-small" in names else (names[0] if names else "sim-small")
        gateway = bound.admin_url
        operate = operate_commands(state)
        page_url = gateway + plane.page.login_path()  # [i17 page hook] one-time, read-only
        emit(
            "ready",
            "\n".join(
                [
                    f"llmgw is up: {args.nodes} node(s), gateway {gateway}",
                    f"API key: {api_key}",
                    "Try it:",
                    f"  curl -s {gateway}/v1/chat/completions -H 'Authorization: Bearer {api_key}' "
                    "-H 'Content-Type: application/json' "
                    f'-d \'{{"model": "{example}", "messages": [{{"role": "user", "content": "hello"}}]}}\'',
                    "Operate it, from another terminal:",
                    *(f"  {c}" for c in operate),
                    f"The cluster page (this URL works once; `{command_name()} ctl page --state-dir "  # [i17 page hook]
                    f"{shlex.quote(str(state))}` makes another, --actions for one that may act):",
                    f"  {page_url}",
                    "Ctrl-C stops everything.",
                ]
            ),
            gateway_url=gateway,
            admin_url=bound.admin_url,
            api_key=api_key,
            state_dir=str(state),
            operate=operate,
            page_url=page_url,  # [i17 page hook]
        )


async def _wait_ready(plane, nodes: int, emit: Events) -> None:
    from llmgw.wire import agent_link as w

    joined: set[str] = set()
    with trio.move_on_after(READY_TIMEOUT_S) as scope:
        while True:
            now = plane.registry.clock.now()
            for node_id, node in plane.registry.nodes.items():
                if node_id not in joined and plane.registry.liveness(node, now) == "joined":
                    joined.add(node_id)
                    emit("node_joined", f"node {node_id} joined", node=node_id)
            # Ready when every simulated model serves (those start in seconds); a llama.cpp model
            # may still be loading, and the gateway queues its requests meanwhile. A catalog the
            # operator edited to hold no sim model is ready when anything serves.
            ready = {v["model"] for v in plane.views.replica_views() if v["state"] == w.READY}
            sims = {m.name for m in plane.config.models if m.engine == "sim"}
            if len(joined) >= nodes and ((sims and sims <= ready) or (not sims and ready)):
                return
            await trio.sleep(0.1)
    if scope.cancelled_caught:
        raise LlmgwError(
            f"the cluster did not become ready within {READY_TIMEOUT_S:g} s; see `{operate_commands(plane.state_dir)[1]}` "
            "and the log above"
        )


async def _api_key(plane, state: Path) -> str:
    """The key `up` made for you: made once and kept (0600), so a second `up` prints it again.
    A key revoked since (or a lost file) gets a new one."""
    from llmgw.server.errors import ApiKeyExists

    path = paths.up_api_key_path(state)
    if path.exists():
        token = private.read(path, "a gateway API key").decode().strip()
        if plane.keys.table.authenticate(token) is not None:
            return token
    from llmgw.server.admin import audit

    for n in range(1, 1000):
        try:
            row, token = await plane.keys.create("llmgw-up" if n == 1 else f"llmgw-up-{n}")
            break
        except ApiKeyExists:
            continue
    await audit.record(plane.store, actor=audit.ADMIN, source="local", action="key.create", target=row.name)
    paths.write_private(path, (token + "\n").encode())
    return token
