"""`llmgw doctor`: run the checks (`agent.doctor_checks`) on this node and report them.

`run(Request)` is the thin runner: discover, try the control plane, check. The exit status is
2 when anything failed, 1 when something warned or could not be checked, else 0; a check the
operator chose to ignore (`--ignore NAME`) is still run and shown but does not count.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import attrs

from agent.discovery.snapshot import Snapshot, Sources, discover
from agent.doctor_checks import FAIL, NAMES, OK, UNKNOWN, WARN, Check, Reach, run_checks
from agent.inventory import inventory_of
from llmgw.config import FabricDecl
from llmgw.errors import UsageError
from llmgw.wire import agent_link as w
from llmgw.wire.convert import converter

_RANK = {OK: 0, UNKNOWN: 1, WARN: 1, FAIL: 2}
EXIT_STATUS = {OK: 0, WARN: 1, UNKNOWN: 1, FAIL: 2}
CONNECT_TIMEOUT_S = 5.0


@attrs.frozen(kw_only=True)
class Report:
    checks: tuple[Check, ...]
    inventory: w.Inventory

    @property
    def status(self) -> str:
        counted = [c.status for c in self.checks if not c.ignored] or [OK]
        return max(counted, key=lambda s: (_RANK[s], s == WARN))

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.status]


def report(
    snap: Snapshot,
    declared: Sequence[FabricDecl] = (),
    *,
    reach: Reach | None = None,
    ignore: frozenset[str] = frozenset(),
) -> Report:
    return Report(checks=run_checks(snap, declared, reach=reach, ignore=ignore), inventory=inventory_of(snap, declared))


# -- the runner (I/O) --------------------------------------------------------------------------


def parse_server(text: str) -> tuple[str, int]:
    """HOST:PORT, [IPV6]:PORT or the agent's wss://HOST:PORT URL."""
    parts = urlsplit(text if "://" in text else f"//{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise UsageError(f"control plane address {text!r} must look like HOST:PORT (e.g. 10.0.0.1:7443)")
    return parts.hostname, port


def reach_control_plane(server: str, *, timeout_s: float = CONNECT_TIMEOUT_S) -> Reach:
    host, port = parse_server(server)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            local = s.getsockname()[0]
    except socket.gaierror as exc:
        return Reach(
            target=target,
            ok=False,
            detail=f"cannot resolve {host!r}: {exc.strerror}",
            fix="use the control plane's IP address, or fix this node's DNS",
        )
    except TimeoutError:
        return Reach(
            target=target,
            ok=False,
            detail=f"no answer from {target} in {timeout_s:g} s: something drops the packets",
            fix=f"allow TCP port {port} from this node to the control plane (firewall, security group)",
        )
    except ConnectionRefusedError:
        return Reach(
            target=target,
            ok=False,
            detail=f"{target} refuses connections: nothing listens on port {port} there",
            fix="start the control plane (`llmgw server`) and check agent_listen in its server.toml",
        )
    except OSError as exc:
        return Reach(
            target=target,
            ok=False,
            detail=f"cannot connect to {target}: {exc.strerror or exc}",
            fix="check this node's route to the control plane (`ip route get ADDRESS`)",
        )
    return Reach(target=target, ok=True, detail=f"{target} accepts connections from this node's address {local}")


@attrs.frozen(kw_only=True)
class Request:
    sources: Sources = Sources()
    fabrics: tuple[FabricDecl, ...] = ()
    server: str = ""  # HOST:PORT of the control plane's agent port; "" skips that check
    ignore: frozenset[str] = frozenset()


def run(req: Request) -> Report:
    unknown = sorted(req.ignore - set(NAMES))
    if unknown:
        raise UsageError(f"--ignore: no check named {', '.join(unknown)} (checks: {', '.join(NAMES)})")
    reach = reach_control_plane(req.server) if req.server else None
    return report(discover(req.sources), req.fabrics, reach=reach, ignore=req.ignore)


# -- output ----------------------------------------------------------------------------------

LABELS = {OK: "ok", WARN: "warn", FAIL: "fail", UNKNOWN: "????"}


def format_human(rep: Report) -> str:
    width = max(len(c.name) for c in rep.checks)
    lines = []
    for c in rep.checks:
        mark = " (ignored)" if c.ignored else ""
        lines.append(f"{LABELS[c.status]:<5}{c.name:<{width}}  {c.detail}{mark}".rstrip())
        if c.status != OK and c.fix:
            lines.append(f"{'':<5}{'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def to_data(rep: Report) -> dict:
    return {
        "status": rep.status,
        "exit_status": rep.exit_status,
        "checks": [attrs.asdict(c) for c in rep.checks],
        "inventory": converter.unstructure(rep.inventory),
    }
