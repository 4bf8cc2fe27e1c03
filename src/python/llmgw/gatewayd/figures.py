"""Every worker's figures in the /metrics of a gateway of its own (`llmgw gateway`), whichever
worker takes the scrape.

The rule is http_listen's (docs/gateway.md, `llmgw.gateway.metrics.render_by_worker`): every
family of each worker, each series labelled `worker` with the worker's instance, then
`llmgw_gateway_worker_heard_seconds`, how old each worker's figures are. With no control plane
to gather them, the workers share them through a directory the parent makes for this run
(`make_dir`: private, 0700) and passes to each (`--figures-dir`):

- each worker writes its families into `worker-I.json` (I its index: a restarted worker takes
  its place) when it starts, every `PUBLISH_S`, and again just before it answers a scrape;
  whole or not at all (a temporary file renamed over the last), one write at a time;
- the worker that answers a scrape reads every worker's file, its own just written, and renders
  them: the others' at most `PUBLISH_S` old, or as old as a stalled worker's last, which its
  `heard_seconds` says;
- the parent removes a worker's file when that worker ends (`forget`: its series go with it, as
  a closed link's do on http_listen; the worker started again is a new instance, its counters
  from zero) and the directory when it stops.

So no counter goes back between two scrapes, whichever workers answer them: a file only ever
holds figures later than the ones it replaced, and a scrape reads every file after the scrape
before it was answered, so it sees each worker's figures at least as late as that one did.

Nothing of this is on a request's path; a scrape writes one file and reads one per worker, off
the event loop (`trio.to_thread`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import cattrs
import trio

from llmgw.errors import MachineError
from llmgw.gateway.metrics import render_by_worker
from llmgw.log import get_logger
from llmgw.wire import gateway_link as g
from llmgw.wire.convert import converter

log = get_logger("llmgw.gatewayd")

PUBLISH_S = 1.0  # how old another worker's figures in a scrape may be, while it runs
_NAME = "worker-{index}.json"

Families = Callable[[], tuple[g.MetricFamily, ...]]


@attrs.frozen(kw_only=True)
class Figures:
    """One worker's, as its file holds them."""

    instance: str
    taken_at: float  # unix time
    families: tuple[g.MetricFamily, ...]


def make_dir() -> Path:
    """A new private directory (0700) for one run's figures, under the temporary directory."""
    try:
        return Path(tempfile.mkdtemp(prefix="llmgw-gateway-figures-"))
    except OSError as exc:
        raise MachineError(
            f"cannot make a directory for the workers' /metrics figures in {tempfile.gettempdir()}: "
            f"{exc.strerror or exc}; set TMPDIR to a directory this user may write"
        ) from None


def file_of(directory: Path, index: int) -> Path:
    return directory / _NAME.format(index=index)


def forget(directory: Path, index: int) -> None:
    """Worker `index` ended: its figures are no one's now."""
    file_of(directory, index).unlink(missing_ok=True)


def read_all(directory: Path) -> list[Figures]:
    """Every worker's figures in `directory`, by index; a file that went meanwhile (its worker
    ended) or that cannot be read as figures is left out."""
    found = []
    for path in sorted(directory.glob(_NAME.format(index="*")), key=_index):
        try:
            data = json.loads(path.read_bytes())
            found.append(converter.structure(data, Figures))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, TypeError, cattrs.BaseValidationError) as exc:
            log.debug("gateway_figures_unreadable", path=str(path), reason=repr(exc))
    return found


def _index(path: Path) -> tuple[int, str]:
    number = path.name.removeprefix("worker-").removesuffix(".json")
    return (int(number), "") if number.isdigit() else (-1, path.name)


def _write(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)  # whole or not at all, for a reader in another worker


class SharedFigures:
    """Worker `index`'s end of the directory (the module docstring)."""

    def __init__(self, directory: Path, index: int, instance: str, *, clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.path = file_of(directory, index)
        self.instance = instance
        self.clock = clock
        self._writing = trio.Lock()  # one write at a time: a later file never replaced by an earlier
        self._failed = ""  # the last write's error, said once

    async def publish(self, families: Families) -> None:
        """Write this worker's figures as they are now (taken once the write before has ended)."""
        async with self._writing:
            figures = Figures(instance=self.instance, taken_at=self.clock(), families=families())
            data = json.dumps(converter.unstructure(figures), separators=(",", ":")).encode()
            try:
                await trio.to_thread.run_sync(_write, self.path, data)
            except OSError as exc:
                if str(exc) != self._failed:  # said once, not every second
                    log.warning("gateway_figures_unwritten", path=str(self.path), reason=str(exc))
                self._failed = str(exc)
            else:
                self._failed = ""

    async def scrape(self, families: Families) -> str:
        """/metrics: this worker's figures written now, then every worker's read and rendered."""
        await self.publish(families)
        found = await trio.to_thread.run_sync(read_all, self.directory)
        return render_by_worker(((f.instance, f.families, f.taken_at) for f in found), self.clock())

    async def serve(self, families: Families, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write them at once, so a scrape sees every worker that serves, then every `PUBLISH_S`."""
        await self.publish(families)
        task_status.started()
        while True:
            await trio.sleep(PUBLISH_S)
            await self.publish(families)
