"""Background loops that outlive their own failures, for the control plane and the agent.

A long-lived loop (`serve_x(..., *, task_status)`) runs under `Background.run`, itself started
with `nursery.start`:

- until the loop calls `task_status.started()`, it runs exactly as if started directly: a
  failure then is a start failure and reaches the caller unchanged (the process stops with its
  own message);
- once started, an exception from the loop is logged once, with its traceback, and the loop is
  started again after a backoff: 1 s, doubling up to 60 s, back to 1 s after a run that lasted
  60 s. Nothing reaches the process's nursery, and the restarts are counted by task name (for
  `/metrics`);
- cancellation passes through untouched, and so do KeyboardInterrupt and SystemExit. A loop
  that fails while it is being cancelled has its failure logged; the cancellation goes on.

A loop that returns has finished its work (filling the mirror, for one): it is not restarted.
Pure trio, with no clock of its own: tests run it on `MockClock`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from llmgw.backoff import Backoff, Failures
from llmgw.errors import only
from llmgw.log import Logger, get_logger

log = get_logger("llmgw.supervision")


# 1 s, doubling up to 60 s; a run of 60 s was healthy, and the next failure waits 1 s again.
BACKOFF = Backoff(first_s=1.0, max_s=60.0, healthy_s=60.0)


@attrs.define
class _Status:
    """The `task_status` a supervised loop gets: hands the first `started()` to the caller of
    `Background.run`, and notes when each run started."""

    caller: Any  # the caller's task status, until the loop first reports started; then None
    at: float | None = None

    def started(self, value: Any = None) -> None:
        if self.at is not None:
            raise RuntimeError("called `task_status.started()` twice on the same task status")
        self.at = trio.current_time()
        if self.caller is not None:
            caller, self.caller = self.caller, None
            caller.started(value)


class Background:
    """Runs a process's background loops, each restarted after a failure; counts the restarts.

    `fields` are added to every line it logs (the agent adds its node, since `llmgw up` runs
    several agents and a control plane in one process)."""

    def __init__(self, logger: Logger | None = None, *, backoff: Backoff = BACKOFF, **fields: Any) -> None:
        if backoff.give_up_after:
            raise ValueError("a background loop is started again however often it fails: give_up_after must be 0")
        self.log = logger or log
        self.backoff = backoff
        self.fields = fields
        self.restarts: dict[str, int] = {}  # task name -> times started again after a failure

    async def run(
        self,
        name: str,
        serve: Callable[..., Awaitable[Any]],
        *args: Any,
        task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """`await nursery.start(background.run, "name", serve_x, *args)`: start `serve_x(*args,
        task_status=...)`, return what it reports started, and keep it running (module docstring)."""
        self.restarts.setdefault(name, 0)
        caller: Any = task_status
        failures = Failures(self.backoff)
        while True:
            status = _Status(caller)
            began = trio.current_time()
            try:
                await serve(*args, task_status=status)
            except Exception:
                if status.caller is not None:
                    raise  # it never started: a start failure is the caller's
                now = trio.current_time()
                ran = now - (status.at if status.at is not None else began)
                failures.failed(now, ran_s=ran)
                delay = failures.delay()
                self.log.exception(
                    "background_task_failed",
                    task=name,
                    ran_s=round(ran, 3),
                    restarts=self.restarts[name],
                    restart_in_s=delay,
                    **self.fields,
                )
            except BaseException as exc:
                cancelled = self._cancelled_part(name, exc)
                if cancelled is None:
                    raise
                raise cancelled from None
            else:
                if status.caller is not None:
                    raise RuntimeError(f"background task {name!r} exited without calling task_status.started()")
                return  # done: its work is finished
            caller = None
            await trio.sleep(delay)
            self.restarts[name] += 1
            self.log.info("background_task_restarted", task=name, restarts=self.restarts[name], **self.fields)

    def _cancelled_part(self, name: str, exc: BaseException) -> BaseException | None:
        """What to raise instead of `exc` when it mixes a cancellation with failures of the loop
        (a loop failing as it stops): the cancellation alone, after logging the failures, since
        nobody else will see them and the process is stopping anyway. None: raise `exc` as it is
        (a cancellation, an interrupt)."""
        if only(exc, trio.Cancelled) or not only(exc, (trio.Cancelled, Exception)):
            return None
        # A group holding a Cancelled (all Exceptions would have been an ExceptionGroup, caught above).
        cancelled, _ = exc.split(trio.Cancelled)  # type: ignore[attr-defined]
        self.log.exception("background_task_failed_while_stopping", task=name, **self.fields)
        return cancelled
