"""Engines that outlive their agent: the run records, and adopting what they name.

An engine leads its own session and writes its output straight to its log file, so an agent
that is killed (SIGKILL, OOM, a crash) leaves its engines serving. For each running member the
agent keeps a record:

    STATE/run/<replica_id>-r<rank>.json     pid, process group, start time, address and port,
                                            GPUs, and a fingerprint of the assignment it runs

written when the engine starts (atomically: a temporary file renamed over it) and removed
when it stops. The agent that starts next reads them: a record whose process still runs and
is the same process is adopted (the supervisor watches it, probes it, stops it when its
assignment changes); any other record is removed and logged, and its pid is never signalled.

"The same process" is the pid, its start time in clock ticks since boot (/proc/PID/stat field
22) and the boot id: a pid reused by another process after the engine exited has another start
time, and after a reboot every record is stale. The check is made after opening a pidfd on the
pid, so the process it names cannot be replaced between the check and the watching.

An adopted process is not the agent's child: its exit status goes to whoever reaped it. Its
exit is seen through the pidfd (readable once it has exited) or, where pidfds are unavailable
(Linux before 5.3, some sandboxes), by looking at /proc every `POLL_S`.

Records hold no secret: the fingerprint is a SHA-256 over the whole assignment (its API key
included, so that a new key is a new assignment), and the file is readable by its owner only.
They decide which process groups the agent watches and signals, so STATE/run is private (0700,
the agent's own): the agent refuses to start when it is not (`llmgw.private`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import attrs
import cattrs
import trio

from agent.weights import SAFE_NAME
from llmgw import private
from llmgw.log import get_logger
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.replicas")

RECORD_VERSION = 1
POLL_S = 1.0  # how often /proc is looked at for an adopted process, without a pidfd
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

_converter = cattrs.Converter(forbid_extra_keys=True)


def fingerprint(a: w.ReplicaAssignment) -> str:
    """What makes two assignments the same for `replicas.plan`: equal fingerprints, equal
    assignments. Fields left at their defaults are left out, so that a field added to the wire
    type with a default does not make a newer agent restart the engines it adopts. `parked` is
    not what it runs but what it is asked to do now: parking or waking restarts nothing."""
    fields = attrs.asdict(a, filter=lambda att, value: value != att.default and att.name != "parked")
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@attrs.frozen(kw_only=True)
class Record:
    """One running replica member, as its agent left it."""

    version: int = RECORD_VERSION
    replica_id: str
    node_rank: int
    model: str
    engine: str
    pid: int
    pgid: int
    start_time: int  # clock ticks after boot, /proc/PID/stat field 22
    boot_id: str
    port: int
    # The address it listens on; "" in a record written before engines had their own (they
    # listened on every address then): a field with a default, so those records still read.
    host: str = ""
    gpus: tuple[int, ...] = ()
    events_port: int = 0  # where it publishes KV-cache events; 0: none (and in records written before)
    fingerprint: str
    started_at: float = 0.0  # unix time, for people reading the file or the log
    # Part of a replica over llama.cpp's RPC, whose tunnel lives in the agent that started it
    # (agent.replica_rpc): an agent adopting it stops it.
    rpc: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.replica_id, self.node_rank)

    @classmethod
    def of_child(
        cls,
        a: w.ReplicaAssignment,
        pid: int,
        *,
        port: int,
        events_port: int = 0,
        host: str = "",
        gpus: tuple[int, ...],
        fingerprint: str,
        boot_id: str,
        rpc: bool = False,
    ) -> Record | None:
        """The record of an engine just started (it leads its own process group); None if it is gone already."""
        seen = proc_stat(pid)
        if seen is None:
            return None
        return cls(
            replica_id=a.replica_id,
            node_rank=a.node_rank,
            model=a.model,
            engine=a.engine,
            pid=pid,
            pgid=pid,
            start_time=seen.start_time,
            boot_id=boot_id,
            port=port,
            events_port=events_port,
            host=host,
            gpus=gpus,
            fingerprint=fingerprint,
            started_at=time.time(),
            rpc=rpc,
        )


@attrs.frozen
class ProcStat:
    state: str  # R, S, D, Z, ...
    pgrp: int
    start_time: int


def proc_stat(pid: int, proc: Path = Path("/proc")) -> ProcStat | None:
    """What /proc says of `pid` now; None if there is no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "PID (COMM) STATE PPID PGRP ...": COMM may hold spaces and parentheses; it ends at the last ")".
    fields = text.rsplit(")", 1)[1].split()
    return ProcStat(state=fields[0], pgrp=int(fields[2]), start_time=int(fields[19]))


def read_boot_id(path: Path = BOOT_ID) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""  # then no record is ever taken for this boot's


def judge(record: Record, *, boot_id: str, seen: ProcStat | None) -> str | None:
    """Why `record` must not be adopted, or None if its process is still the engine it names. Pure."""
    if not boot_id or record.boot_id != boot_id:
        return "the machine has restarted since it was written"
    if seen is None:
        return f"pid {record.pid} is gone"
    if seen.state in ("Z", "X"):
        return f"pid {record.pid} has exited"
    if seen.start_time != record.start_time:
        return (
            f"pid {record.pid} is another process now (started at tick {seen.start_time}, the engine at "
            f"{record.start_time}); it is left alone"
        )
    if seen.pgrp != record.pgid:
        return f"pid {record.pid} is in process group {seen.pgrp}, not the engine's {record.pgid}; it is left alone"
    return None


class RunRecords:
    """The records in `STATE/run`. File names are checked plain names: nothing lands elsewhere."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def path(self, replica_id: str, rank: int) -> Path:
        return self.run_dir / f"{replica_id}-r{rank}.json"

    def write(self, record: Record) -> None:
        private.make_dir(self.run_dir, check_existing=False)  # 0700 whatever the umask; checked at start
        final = self.path(record.replica_id, record.node_rank)
        tmp = final.with_name(f".{final.name}.tmp")
        data = json.dumps(_converter.unstructure(record), indent=1, sort_keys=True).encode() + b"\n"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a temporary left by a crash keeps its mode through O_CREAT
            os.write(fd, data)
        finally:
            os.close(fd)
        # No fsync: the records matter only while this boot lasts, and a killed process loses
        # nothing the kernel has; the rename makes a reader see the old file or the new one.
        os.replace(tmp, final)

    def remove(self, replica_id: str, rank: int) -> None:
        self.path(replica_id, rank).unlink(missing_ok=True)

    def read(self) -> tuple[list[Record], list[tuple[Path, str]]]:
        """The records that parse, and the files that do not (with why)."""
        good: list[Record] = []
        bad: list[tuple[Path, str]] = []
        try:
            paths = sorted(self.run_dir.iterdir())
        except FileNotFoundError:
            return good, bad
        for path in paths:
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                bad.append((path, "an unfinished write"))
                continue
            if path.suffix != ".json":
                continue
            try:
                record = _converter.structure(json.loads(path.read_bytes()), Record)
            except (OSError, ValueError, TypeError, cattrs.BaseValidationError) as exc:
                bad.append((path, f"unreadable: {exc.__class__.__name__}"))
                continue
            if record.version != RECORD_VERSION:
                bad.append((path, f"record version {record.version}, this agent reads {RECORD_VERSION}"))
            elif not SAFE_NAME.match(record.replica_id) or path.name != self.path(*record.key).name:
                bad.append((path, "its name does not match its replica"))
            else:
                good.append(record)
        return good, bad


class Adopted:
    """A running engine that an earlier agent started: its exit is watched, its group signalled.

    `returncode` stays None: the exit status went to the process's parent (init, usually)."""

    returncode: int | None = None

    def __init__(self, record: Record, pidfd: int | None, *, poll_s: float = POLL_S) -> None:
        self.record = record
        self.pid = record.pid
        self.pgid = record.pgid
        self.exited = False
        self._pidfd = pidfd
        self._poll_s = poll_s

    @property
    def watched_by(self) -> str:
        return "pidfd" if self._pidfd is not None else "/proc"

    async def wait(self) -> None:
        """Return once the process has exited. Any number of tasks may wait at once."""
        if self.exited:
            return
        if self._pidfd is not None:
            fd = os.dup(self._pidfd)  # one per waiter: trio lets one task at a time wait on a descriptor
            try:
                await trio.lowlevel.wait_readable(fd)
            finally:
                trio.lowlevel.notify_closing(fd)
                os.close(fd)
        else:
            while judge(self.record, boot_id=self.record.boot_id, seen=proc_stat(self.pid)) is None:
                await trio.sleep(self._poll_s)
        self.exited = True

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def adopt(
    record: Record, *, boot_id: str, use_pidfd: bool = True, poll_s: float = POLL_S, proc: Path = Path("/proc")
) -> Adopted | str:
    """The record's process, ready to be watched, or why it is not the engine the record names."""
    pidfd = None
    if use_pidfd and hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(record.pid)
        except ProcessLookupError:
            return f"pid {record.pid} is gone"
        except OSError:
            pidfd = None  # no pidfds here (an old kernel, a seccomp filter): /proc is polled instead
    # After the pidfd is open: from here on it names this very process, whatever happens to the pid.
    why = judge(record, boot_id=boot_id, seen=proc_stat(record.pid, proc))
    if why is not None:
        if pidfd is not None:
            os.close(pidfd)
        return why
    return Adopted(record, pidfd, poll_s=poll_s)


def adopt_all(records: RunRecords, *, boot_id: str, use_pidfd: bool = True) -> list[Adopted]:
    """Every recorded engine that still runs; the other records are removed, each logged."""
    good, bad = records.read()
    for path, why in bad:
        log.warning("replica_record_unreadable", path=str(path), reason=why)
        path.unlink(missing_ok=True)
    adopted = []
    for record in good:
        found = adopt(record, boot_id=boot_id, use_pidfd=use_pidfd)
        if isinstance(found, str):
            log.info(
                "replica_record_stale", replica=record.replica_id, rank=record.node_rank, pid=record.pid, reason=found
            )
            records.remove(record.replica_id, record.node_rank)
            continue
        log.info(
            "replica_adopted",
            replica=record.replica_id,
            rank=record.node_rank,
            pid=record.pid,
            host=record.host or "0.0.0.0",
            port=record.port,
            running_s=round(max(0.0, time.time() - record.started_at), 1),
            watched_by=found.watched_by,
        )
        adopted.append(found)
    return adopted
