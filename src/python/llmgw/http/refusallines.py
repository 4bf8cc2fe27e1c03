"""Refusals in the log, the trio half of `llmgw.http.refusals`: the clock, the lines, and the task
that logs each interval's summary.

Whatever a peer can repeat at will and is refused — a TLS handshake or a certificate on the
agent port, a wrong admin credential, a spent login code or a page call from elsewhere on the
HTTP port — is logged through one `RefusalLog` per listener and process: the first `BURST` of
an interval one line each, at their usual level (a single refusal can be news), the rest at
debug only, counted into one summary line per interval by reason and peer network. So 200
wrong credentials a second make a handful of lines every 10 s, not 200.

`serve_summaries` is the task that logs the summaries: it wakes when the open interval ends,
whether or not another refusal comes, so the summary of a burst is not left waiting for the
next one; and when it is cancelled (the listener or the process stops) it logs what was counted
since the last summary (`RefusalLog.flush`), so none is lost at a stop.

A kind (the summary's reason) is a word such as `admin` or `page_login`, never one that reads
as a secret's field name (`llmgw.log.redact` would hide its count).
"""

from __future__ import annotations

from typing import Any

import trio

from llmgw.http.refusals import RefusalLog, Summary
from llmgw.log import Logger, get_logger

log = get_logger("llmgw.listeners")  # where the connections' summaries have always been logged

CONNECTIONS = "connections_refused"  # the summary of connections shed, turned away or failing their handshake
REQUESTS = "requests_refused"  # the summary of requests refused for who sent them (a credential, a code, an Origin)


class RefusalLines:
    """One listener's refusals of requests in this process, as log lines (the module docstring);
    `serve` logs its summaries (`requests_refused`, with `listener`)."""

    def __init__(self, listener: str, counts: RefusalLog | None = None) -> None:
        self.listener = listener
        self.counts = counts or RefusalLog()

    def refused(
        self, logger: Logger, event: str, *, kind: str, peer: str, level: str = "warning", **fields: Any
    ) -> None:
        """Count a refusal of `peer` (an address, "HOST:PORT" or "HOST") under `kind` (the
        summary's reason), and log `event` with `fields` at `level` if it is one of the first of
        its interval, else at debug."""
        loud = self.counts.refused(trio.current_time(), kind, peer)
        getattr(logger, level if loud else "debug")(event, **fields)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_summaries(self.counts, self.listener, event=REQUESTS, task_status=task_status)


async def serve_summaries(
    counts: RefusalLog,
    listener: str,
    *,
    event: str = CONNECTIONS,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Log each summary `counts` makes, as `event` with `listener`, when its interval ends; until
    cancelled, then the refusals counted since the last one (the module docstring)."""
    task_status.started()
    try:
        while True:
            # Wakes when the open interval ends, or an interval from now when none is open (one
            # opened meanwhile ends later than that, and is waited for on the next turn).
            due = counts.next_due()
            await trio.sleep_until(trio.current_time() + counts.interval_s if due is None else due)
            log_summaries(counts.due(trio.current_time()), listener, event)
    finally:
        log_summaries(counts.flush(trio.current_time()), listener, event)


def log_summaries(summaries: list[Summary], listener: str, event: str) -> None:
    """One warning per summary: an interval of more refusals than were logged one by one."""
    for summary in summaries:
        log.warning(event, listener=listener, **summary.fields())
