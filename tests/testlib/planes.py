"""Several `llmgw server` processes sharing one PostgreSQL store (testlib.postgres) on loopback,
one leading and the others standing by (docs/high-availability.md).

The first control plane is a `testlib.cluster.Cluster`'s own (its CA, its agents, their engines,
its `close`); every other has a state directory of its own holding the same secrets, copied from
the first as `llmgw server add` does (the CA and the server certificate, the engine-key secret,
the admin credential), its own ports and its own server.toml, the same but for those. Agents
are given every control plane's address (`add_node`); the gateway link's `--server` likewise.
"""

from __future__ import annotations

import http.client
import json
import shutil
import string
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs

from testlib.cluster import OPERATORS_LLAMACPP, Cluster, NodeFiles, free_port, wait_until
from testlib.postgres import Database
from testlib.proc import Proc

TWO_REPLICAS = """
[[models]]
name = "chat"
engine = "sim"
replicas = 2
"""
READY_S = 90.0  # two sim replicas placed, started and spread, on a loaded machine
LEASE_TTL_S = 3.0  # short, so that a takeover in a test takes seconds; renewed every LEASE_RENEW_S
LEASE_RENEW_S = 0.5


def at(event: dict[str, Any]) -> float:
    """A log line's time, in seconds since the epoch."""
    return datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()


@attrs.define
class Plane:
    name: str
    state: Path
    config: Path
    agent_port: int
    http_port: int
    proc: Proc | None = None

    @property
    def agent_url(self) -> str:
        return f"wss://127.0.0.1:{self.agent_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def events(self, event: str) -> list[dict[str, Any]]:
        return self.proc.events(event) if self.proc is not None else []


class Planes:
    def __init__(
        self,
        root: Path,
        db: Database,
        *,
        count: int = 2,
        lease_ttl_s: float = LEASE_TTL_S,
        lease_renew_s: float = LEASE_RENEW_S,
        reconnect_grace_s: float = 15.0,
        heartbeat_interval_s: float = 0.2,
        heartbeat_ttl_s: float = 3.0,
    ) -> None:
        """`db`: the store (its `password_file` may be None: libpq's own files then)."""
        root.mkdir(parents=True, exist_ok=True)
        password = f'password_file = "{db.password_file}"\n' if db.password_file is not None else ""
        store = (
            f'[store]\nurl = "{db.url}"\n{password}' f"lease_ttl_s = {lease_ttl_s}\nlease_renew_s = {lease_renew_s}\n"
        )
        self.cluster = Cluster(
            root,
            heartbeat_interval_s=heartbeat_interval_s,
            heartbeat_ttl_s=heartbeat_ttl_s,
            reconnect_grace_s=reconnect_grace_s,
            engines_toml=OPERATORS_LLAMACPP + store,
            server_toml="gateway_workers = 0\n",  # the gateway on each plane's loop: fewer processes
            fixed_http_port=True,
        )
        c = self.cluster
        self.planes = [Plane("cp-a", c.state, c.server_config, c.port, c.http_port)]
        for letter in string.ascii_lowercase[1:count]:
            self.planes.append(
                Plane(
                    f"cp-{letter}", root / f"state-{letter}", root / f"server-{letter}.toml", free_port(), free_port()
                )
            )
        self.catalog = ""

    def __getitem__(self, i: int) -> Plane:
        return self.planes[i]

    @property
    def agent_urls(self) -> list[str]:
        return [p.agent_url for p in self.planes]

    def init(self, catalog_toml: str = "") -> None:
        """The CA (in the first state directory), the catalog, and every other control plane's
        state directory and server.toml."""
        self.cluster.init_ca()
        self.set_catalog(catalog_toml)
        first = self.planes[0]
        for plane in self.planes[1:]:
            # What `llmgw server add` copies, and nothing a running server writes for itself.
            shutil.copytree(
                first.state,
                plane.state,
                ignore=shutil.ignore_patterns("admin.url", "run", "artifacts", "llmgw.db*"),
            )

    def set_catalog(self, catalog_toml: str) -> None:
        self.catalog = catalog_toml
        self.cluster.set_catalog(catalog_toml)
        first = self.planes[0]
        text = first.config.read_text()
        for plane in self.planes[1:]:
            plane.config.write_text(
                text.replace(f'state_dir = "{first.state}"', f'state_dir = "{plane.state}"')
                .replace(f"127.0.0.1:{first.agent_port}", f"127.0.0.1:{plane.agent_port}")
                .replace(f"127.0.0.1:{first.http_port}", f"127.0.0.1:{plane.http_port}")
            )

    def add_node(self, node_id: str) -> NodeFiles:
        return self.cluster.add_node(node_id, servers=self.agent_urls)

    def start(self, plane: Plane, *, leads: bool | None, prefix: list[str] | None = None) -> Proc:
        """`llmgw server` for `plane`; waits until it leads (`server_ready`) or stands by (None:
        does not wait). `prefix`: a command that runs it (`testlib.newer_llmgw.PREFIX`)."""
        assert plane.proc is None or plane.proc.returncode is not None, f"{plane.name} runs already"
        proc = plane.proc = self.cluster._spawn(
            plane.name, ["server", "--config", str(plane.config), "--log-format", "json"], prefix=prefix
        )
        if leads is None:
            return proc
        if plane is self.planes[0]:
            self.cluster.server = proc
        event = "server_ready" if leads else "server_standby"
        wait_until(f"{plane.name} {event}", lambda: proc.events(event), alive=[proc], procs=self.procs(), timeout=60)
        return proc

    def start_two_nodes(self, catalog_toml: str = TWO_REPLICAS) -> tuple[Plane, Plane]:
        """The CA and `catalog_toml`; node-a and node-b added (each naming every control plane);
        the first control plane started and leading, the second standing by, then both agents
        (not waited for)."""
        a, b = self.planes[0], self.planes[1]
        self.init(catalog_toml)
        for node in ("node-a", "node-b"):
            self.add_node(node)
        self.start(a, leads=True)
        self.start(b, leads=False)
        for node in ("node-a", "node-b"):
            self.cluster.start_agent(node)
        return a, b

    def replicas_by_id(self, plane: Plane) -> dict[str, dict[str, Any]]:
        return {r["replica"]: r for r in self.ctl(plane, "replicas") or [] if r.get("replica")}

    def two_ready(self, plane: Plane, timeout: float = READY_S) -> dict[str, dict[str, Any]]:
        """Two replicas ready, one on each node (placed, and spread if both went to one first)."""

        def ready() -> dict[str, dict[str, Any]] | None:
            found = self.replicas_by_id(plane)
            spread = sorted(n for r in found.values() for n in r["nodes"]) == ["node-a", "node-b"]
            return found if spread and all(r["state"] == "ready" for r in found.values()) else None

        return wait_until("two replicas ready, one on each node", ready, procs=self.procs(), timeout=timeout)

    def admin(
        self, plane: Plane, method: str, path: str, body: Any = None, timeout: float = 30
    ) -> tuple[int, dict[str, str], Any]:
        """One admin API call to `plane` itself, with the admin credential, as a client that
        follows nothing: (status, headers with lower-case names, the parsed body)."""
        token = (plane.state / "admin.token").read_text().strip()
        data = json.dumps(body).encode() if body is not None else None
        headers = {"authorization": f"Bearer {token}"}
        if data is not None:
            headers["content-type"] = "application/json"
        conn = http.client.HTTPConnection("127.0.0.1", plane.http_port, timeout=timeout)
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            answer = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(answer or b"null")
        finally:
            conn.close()

    def leader(self) -> Plane | None:
        """The control plane that answers the admin API as the leader now, if one does."""
        for plane in self.planes:
            if plane.proc is None or plane.proc.returncode is not None:
                continue
            try:
                if self.admin(plane, "GET", "/admin/v1/nodes", timeout=5)[0] == 200:
                    return plane
            except (OSError, http.client.HTTPException):
                continue
        return None

    def gateways(self, plane: Plane) -> list[dict[str, Any]]:
        """The gateway instances linked to the leader (`plane`'s admin API; a standby's answer followed)."""
        from llmgw.ctl.client import AdminClient

        return AdminClient.locate(server=None, credential=None, state_dir=str(plane.state)).gateways()

    def procs(self) -> list[Proc]:
        return [p.proc for p in self.planes if p.proc is not None] + list(self.cluster.agents.values())

    def ctl(self, plane: Plane, *args: str, ok: bool = True) -> Any:
        """`llmgw ctl ARGS --json` with `plane`'s state directory (a standby's answer is followed)."""
        done = self.cluster.llmgw("ctl", *args, "--json", "--state-dir", str(plane.state), ok=ok)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def nodes(self, plane: Plane) -> dict[str, dict[str, Any]]:
        """What `llmgw ctl nodes --json` says with `plane`'s state directory, by node id; {} while
        no control plane answers. Asked in this process (the waits poll it: a `llmgw ctl` process
        a poll cost ~0.15 s of CPU), with the AdminClient the command uses."""
        from llmgw.ctl.client import AdminClient
        from llmgw.errors import LlmgwError

        try:
            found = AdminClient.locate(server=None, credential=None, state_dir=str(plane.state)).nodes()
        except LlmgwError:
            return {}
        return {n["id"]: n for n in found}

    def wait_leads(self, plane: Plane, terms: int = 1, timeout: float = 60) -> float:
        """Until `plane` has taken the lease `terms` times and serves as the leader; the seconds waited."""
        started = time.monotonic()
        wait_until(
            f"{plane.name} to lead ({terms} terms)",
            lambda: len(plane.events("leadership_taken")) >= terms and len(plane.events("server_ready")) >= terms,
            alive=[plane.proc],
            procs=self.procs(),
            timeout=timeout,
        )
        return time.monotonic() - started

    def close(self) -> None:
        self.cluster.close()


class KeyWrites:
    """An operator creating API keys (`w-1`, `w-2`, ...) on one control plane, one after another,
    in a thread: the names whose creation was acknowledged (201) with their tokens. It stops at
    the first call that is not acknowledged (the control plane is gone: `ended` says how), or
    when told (`finish`)."""

    def __init__(self, planes: Planes, plane: Plane, gap_s: float = 0.05) -> None:
        self.planes, self.plane, self.gap_s = planes, plane, gap_s
        self.acked: dict[str, str] = {}
        self.ended = ""
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> KeyWrites:
        self._thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        self._thread.join(60)

    def last(self) -> str:
        """The token of the last key acknowledged."""
        return self.acked[max(self.acked, key=lambda name: int(name.split("-")[1]))]

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            name = f"w-{n}"
            try:
                status, _, body = self.planes.admin(self.plane, "POST", "/admin/v1/keys", {"name": name})
            except (OSError, http.client.HTTPException) as exc:
                self.ended = f"{name}: {exc!r}"
                return
            if status != 201:
                self.ended = f"{name}: HTTP {status} {body}"
                return
            self.acked[name] = body["token"]
            self.stop.wait(self.gap_s)

    def missing(self, plane: Plane) -> list[str]:
        """The keys acknowledged that `plane` (leading) does not list."""
        status, _, listed = self.planes.admin(plane, "GET", "/admin/v1/keys")
        assert status == 200, (status, listed)
        return sorted(set(self.acked) - {k["name"] for k in listed["keys"]})
