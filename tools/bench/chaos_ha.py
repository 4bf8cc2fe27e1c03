"""The chaos benchmark's high-availability run (`chaos.py --store postgresql[://…]`): several
control planes on one PostgreSQL store, and the faults only they survive.

The topology is issue 28's (docs/high-availability.md): two `llmgw server` processes sharing
the store (`testlib.planes`: the second holds the first's secrets, as `llmgw server add`
copies them), one standalone gateway given both (`llmgw gateway --server A --server B`), two
nodes running `llmgw agent run` on loopback, each naming both control planes, and a model `chat`
with two replicas of the sim engine. The load (`chaos_load.Load`) goes through the gateway.
The store is a PostgreSQL cluster the bench makes with `initdb` in a temporary directory and
starts itself (`--store postgresql`), or a database given by its url (`--store
postgresql://USER@HOST:PORT/DB`, empty: the bench fills it; its password from libpq's own files
or `--store-password-file`).

- leader_kill   SIGKILL the leading control plane while an operator's writes stream in (API
                keys created one after another, each acknowledgement recorded): how long
                until the standby leads (`takeover_s`, from the kill to its `leadership_taken`
                line) and until full capacity with both agents and the gateway linked to it
                (`recovery_s`); the writes acknowledged before the kill and any missing after;
                then the old leader is started again and must stand by, naming the new one.
- store_away    stop PostgreSQL (`pg_ctl stop -m fast`) for `--store-away-s` (30), only a
                cluster the bench started: both control planes must stay up and answer an
                admin write with 503 and Retry-After; then start it again: how long until one
                leads (`leads_again_s`), an admin write is acknowledged, and full capacity with
                both agents and the gateway linked to it (`recovery_s`, from the start).

Each fault's figures count every request and stream between the fault and full capacity
again (plus a few seconds), as the other faults' do.
"""

from __future__ import annotations

import contextlib
import http.client
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import trio
from bench.chaos_cluster import poll, ready_in_gateway, report
from bench.chaos_load import Load

from testlib import gatewayd
from testlib.planes import KeyWrites, Plane, Planes, at
from testlib.postgres import Database, PostgresServer, running_server

MODEL = "chat"
REPLICAS = 2
NODES = ("node-a", "node-b")
FAULTS = ("leader_kill", "store_away")
SETTLE_S = 3.0
FULL_TIMEOUT_S = 180.0
TAKEOVER_TARGET_S = 10.0
WRITES_BEFORE_KILL = 20  # admin writes acknowledged, the stream still going, when the leader is killed  # issue 28: the standby leads within this of the leader's death


def catalog(output_token_ms: int) -> str:
    return (
        f'[[models]]\nname = "{MODEL}"\nengine = "sim"\nreplicas = {REPLICAS}\n'
        f'args = ["--output-token-ms", "{output_token_ms}"]\n'
    )


@contextlib.contextmanager
def store(url: str, password_file: str) -> Iterator[tuple[Database, PostgresServer | None]]:
    """The database the control planes share: a fresh one of a PostgreSQL cluster made here
    (url "postgresql"), or the one `url` names."""
    if url == "postgresql":
        with running_server() as server:
            yield server.create_database(), server
        return
    yield Database(name="", url=url, password_file=Path(password_file) if password_file else None), None


class HABench:
    def __init__(self, planes: Planes, gateway: gatewayd.Standalone, load: Load, pg: PostgresServer | None) -> None:
        self.planes, self.gateway, self.load, self.pg = planes, gateway, load, pg
        self.results: dict[str, dict] = {}
        self.unexpected_exits: list[str] = []
        self._killed: set[int] = set()
        self.seen: set[int] = set()  # engine processes seen during the fault under way

    # -- observations -----------------------------------------------------------------------

    def engine_pids(self) -> set[int]:
        return {pid for node in NODES for pid in self.planes.cluster.engine_pids(node)}

    def full(self, leader: Plane | None = None) -> Plane | None:
        """The leader, once both replicas are in the gateway's rotation, both agents joined the
        leader (`leader`, if given) and the gateway is linked to it."""
        found = self.planes.leader()
        if found is None or (leader is not None and found is not leader):
            return None
        if ready_in_gateway(self.gateway.port, MODEL) != REPLICAS:
            return None
        nodes = self.planes.nodes(found)
        if sorted(nodes) != sorted(NODES) or any(n["state"] != "joined" for n in nodes.values()):
            return None
        try:
            return found if self.planes.gateways(found) else None
        except Exception:  # noqa: BLE001 - a leader that just stepped down: not full yet
            return None

    def watch_exits(self) -> None:
        for proc in self.planes.cluster.procs:
            if proc.returncode is not None and proc.popen.pid not in self._killed and proc.returncode != 0:
                what = f"{proc.name} (pid {proc.popen.pid}) exited {proc.returncode}"
                if what not in self.unexpected_exits:
                    self.unexpected_exits.append(what)

    def _until(self, what: str, check, timeout: float = FULL_TIMEOUT_S):
        def watched():
            self.seen.update(self.engine_pids())
            self.watch_exits()
            return check()

        return poll(what, watched, timeout, 0.1)

    # -- the faults ---------------------------------------------------------------------------

    def leader_kill(self) -> dict:
        old = self.planes.leader()
        assert old is not None and old.proc is not None
        writes = KeyWrites(self.planes, old).start()
        if not poll("admin writes acknowledged", lambda: len(writes.acked) >= WRITES_BEFORE_KILL, 60):
            writes.finish()
            return {"error": f"the leader acknowledged no admin write: {writes.ended}"}
        killed_wall, killed = time.time(), time.monotonic()
        self._killed.add(old.proc.popen.pid)
        old.proc.popen.send_signal(signal.SIGKILL)
        old.proc.popen.wait(10)
        writes.finish()  # every acknowledgement was sent by the process now dead: before the kill
        new = self._until("a new leader", self.planes.leader, 60)
        if new is None:
            return {"error": "no control plane led within 60 s of the kill"}
        takeover_s = at(new.events("leadership_taken")[-1]) - killed_wall
        full = self._until("full capacity on the new leader", lambda: self.full(new))
        recovery_s = time.monotonic() - killed if full else None
        missing = writes.missing(new)
        restarted = time.monotonic()
        try:
            self.planes.start(old, leads=False)
        except AssertionError as exc:  # it led, or exited, or never said it stands by
            return {"takeover_s": round(takeover_s, 2), "error": f"the old leader started again: {exc}"[:2000]}
        answer: list = []

        def names_the_leader() -> bool:
            # A standby knows the leader from its first look at the lease, made after it says it
            # stands by: until then it answers that it cannot tell.
            status, headers, body = self.planes.admin(old, "POST", "/admin/v1/keys", {"name": "to-the-old-leader"})
            answer[:] = [status, headers.get("retry-after"), (body or {}).get("error")]
            leader = ((body or {}).get("error", {}).get("leader") or {}).get("admin_url")
            return status == 503 and "retry-after" in headers and leader == new.admin_url

        follows = bool(poll("the old leader naming the new one", names_the_leader, 30))
        return {
            "takeover_s": round(takeover_s, 2),
            "recovery_s": round(recovery_s, 2) if recovery_s is not None else None,
            "new_leader": new.name,
            "acked_writes": len(writes.acked),
            "acked_writes_missing": len(missing),
            "old_leader_standby_s": round(time.monotonic() - restarted, 2),
            "old_leader_follows": follows,
            **({} if follows else {"old_leader_answer": answer}),
        }

    def store_away(self, away_s: float) -> dict:
        assert self.pg is not None
        stopped = time.monotonic()
        self.pg.stop("fast")
        answers: dict[str, list] = {}
        try:
            for plane in self.planes.planes:
                # Its first answer may come from the leader stepping down: ask until a standby answers.
                def refused(p: Plane = plane) -> bool:
                    try:
                        status, headers, body = self.planes.admin(p, "POST", "/admin/v1/keys", {"name": "while-away"})
                    except (OSError, http.client.HTTPException):
                        return False  # its listener closed while it steps down
                    answers[p.name] = [status, headers.get("retry-after"), (body or {}).get("error", {}).get("code")]
                    return status == 503 and "retry-after" in headers and answers[p.name][2] == "not_leader"

                self._until(f"{plane.name} refusing admin writes", refused, 30)
            time.sleep(max(0.0, away_s - (time.monotonic() - stopped)))
            self.watch_exits()
            up = all(p.proc is not None and p.proc.returncode is None for p in self.planes.planes)
        finally:
            self.pg.start()
        back = time.monotonic()
        leader = self._until("a leader again", self.planes.leader, 60)
        leads_again_s = time.monotonic() - back if leader else None
        written = None
        if leader is not None:
            status, _, _ = self.planes.admin(leader, "POST", "/admin/v1/keys", {"name": "after-the-store"})
            written = status
        full = self._until("full capacity again", lambda: self.full(leader)) if leader else None
        return {
            "away_s": round(back - stopped, 1),
            "control_planes_up": up,
            "admin_write_while_away": answers,
            "leads_again_s": round(leads_again_s, 2) if leads_again_s is not None else None,
            "admin_write_after": written,
            "recovery_s": round(time.monotonic() - back, 2) if full else None,
        }

    async def fault(self, name: str, inject) -> None:
        if not await trio.to_thread.run_sync(lambda: poll("full capacity", self.full, FULL_TIMEOUT_S)):
            self.results[name] = {"error": f"the cluster was not at full capacity within {FULL_TIMEOUT_S:g} s"}
            return
        before = await trio.to_thread.run_sync(self.engine_pids)
        self.seen = set(before)
        started = trio.current_time()
        info = await trio.to_thread.run_sync(inject)
        await trio.sleep(SETTLE_S)
        self.seen.update(await trio.to_thread.run_sync(self.engine_pids))
        self.results[name] = {
            **self.load.between(started, trio.current_time()),
            **info,
            "engine_restarts": len(self.seen - before),
        }

    async def run(self, faults: tuple[str, ...], away_s: float) -> None:
        for name in faults:
            if name == "store_away" and self.pg is None:
                self.results[name] = {"skipped": "the bench stops only a PostgreSQL it started (--store postgresql)"}
                continue
            inject = self.leader_kill if name == "leader_kill" else lambda: self.store_away(away_s)
            await self.fault(name, inject)
            print(f"chaos: {name}: {self.results[name]}", file=sys.stderr, flush=True)


def targets(results: dict) -> dict:
    met = {}
    for name in FAULTS:
        r = results.get(name, {})
        if "requests" not in r:
            continue
        met[f"{name}_no_failed_requests"] = r["failed_requests"] == 0 and r["failed_streams"] == 0
        met[f"{name}_no_engine_restarts"] = r["engine_restarts"] == 0
        met[f"{name}_recovered"] = r.get("recovery_s") is not None
    kill = results.get("leader_kill", {})
    if "takeover_s" in kill:
        met["leader_kill_takeover_within_10s"] = kill["takeover_s"] < TAKEOVER_TARGET_S
        met["leader_kill_acked_writes_kept"] = kill["acked_writes"] > 0 and kill["acked_writes_missing"] == 0
        met["leader_kill_old_leader_follows"] = kill["old_leader_follows"]
    away = results.get("store_away", {})
    if "control_planes_up" in away:
        met["store_away_control_planes_up"] = away["control_planes_up"]
        met["store_away_admin_503_with_retry_after"] = len(away["admin_write_while_away"]) == 2 and all(
            status == 503 and retry for status, retry, _ in away["admin_write_while_away"].values()
        )
        met["store_away_admin_write_after"] = away["admin_write_after"] == 201
    return met


async def main_async(args, root: Path) -> dict:
    faults = tuple(f for f in (args.faults or ",".join(FAULTS)).split(",") if f)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise SystemExit(f"unknown faults {sorted(unknown)} with --store; known: {', '.join(FAULTS)}")
    with store(args.store, args.store_password_file) as (db, pg):
        planes = Planes(
            root,
            db,
            lease_ttl_s=args.lease_ttl_s,
            lease_renew_s=args.lease_renew_s,
            reconnect_grace_s=35.0,  # the product's default: agents dial up to 30 s apart after an outage
            heartbeat_interval_s=args.heartbeat_interval_s,
            heartbeat_ttl_s=args.heartbeat_ttl_s,
        )
        try:
            await trio.to_thread.run_sync(lambda: planes.start_two_nodes(catalog(args.output_token_ms)))
            pki = await trio.to_thread.run_sync(lambda: gatewayd.issue_certificate(planes.cluster, "gw"))
            gw = gatewayd.start(planes.cluster, "gw", pki, server=planes.agent_urls)
            token = await trio.to_thread.run_sync(lambda: planes.ctl(planes[0], "keys", "create", "chaos")["token"])
            load = Load(
                "127.0.0.1",
                gw.port,
                token,
                model=MODEL,
                rate=args.rate,
                streams=args.streams,
                stream_tokens=args.stream_tokens,
            )
            bench = HABench(planes, gw, load, pg)
            async with trio.open_nursery() as nursery:
                if not await trio.to_thread.run_sync(lambda: poll("full capacity", bench.full, FULL_TIMEOUT_S)):
                    raise SystemExit("chaos: the cluster did not reach full capacity; see the logs under " + str(root))
                await nursery.start(load.run)
                await bench.run(faults, args.store_away_s)
                nursery.cancel_scope.cancel()
            bench.watch_exits()
        finally:
            await trio.to_thread.run_sync(planes.close)
    return report(
        {
            "store": "a PostgreSQL cluster made by the bench" if pg is not None else "the database given",
            "control_planes": 2,
            "gateways": "1 standalone, 1 worker",
            "nodes": len(NODES),
            "replicas": REPLICAS,
            "rate_per_s": args.rate,
            "streams": args.streams,
            "stream_tokens": args.stream_tokens,
            "output_token_ms": args.output_token_ms,
            "lease_ttl_s": args.lease_ttl_s,
            "lease_renew_s": args.lease_renew_s,
            "heartbeat_interval_s": args.heartbeat_interval_s,
            "heartbeat_ttl_s": args.heartbeat_ttl_s,
            "store_away_s": args.store_away_s,
        },
        bench,
        targets(bench.results),
    )
