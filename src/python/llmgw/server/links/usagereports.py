"""The gateways' usage reports on their way into the ledger (issue 48; `llmgw.gateway.usage` counts
them, `llmgw.server.store.ledger` keeps them).

A report comes over a gateway instance's link (`GatewayFeed` hands it here: `received`), or from
the gateway on the control plane's own loop (`serve_local`). `serve` writes each with
`record_usage` off the loop (one transaction: the rows and the instance's sequence, so a report
sent again is acknowledged and not counted twice) and then acknowledges it on the link it came
by; a link closed meanwhile gets nothing, and its gateway sends the report again on its next
link. A write the store refuses is tried again with backoff while the link lasts; one the fence
refuses (this control plane leads no more) is dropped: the leader steps down, its links close,
and the gateways send their reports to the next leader. An instance has one report
unacknowledged at a time, so what waits here is one report per link. Once a day the sequences of
gateway processes not heard of for `ledger.REPORTS_KEPT_S` (30 days) are forgotten: a process
gone that long sends nothing again.
"""

from __future__ import annotations

import secrets
import time
from typing import Protocol

import trio

from llmgw.backoff import Backoff, Failures
from llmgw.gateway.usage import Usage
from llmgw.log import get_logger
from llmgw.metrics import MetricsRegistry
from llmgw.server.errors import NotLeader, StoreError
from llmgw.server.store.asyncstore import WRITE_BACKOFF, AsyncStore
from llmgw.server.store.ledger import REPORTS_KEPT_S
from llmgw.wakeup import Wakeup
from llmgw.wire import gateway_link as g

log = get_logger("llmgw.usage")

LOCAL_INTERVAL_S = 2.0  # the gateway on this loop: its counts written every this while there are some
PRUNE_EVERY_S = 86400.0  # the sequences of gateway processes gone for REPORTS_KEPT_S are forgotten this often


class Reporter(Protocol):
    """Where a report came from: an instance's link (`LinkedGateway`), told when it is in."""

    instance: str

    def acknowledge(self, seq: int) -> None: ...

    @property
    def gone(self) -> bool: ...


class UsageReports:
    def __init__(self, store: AsyncStore, *, backoff: Backoff = WRITE_BACKOFF) -> None:
        self.store = store
        self.backoff = backoff
        self._waiting: dict[int, tuple[Reporter, g.UsageReport]] = {}  # id(reporter) -> its report
        self.arrived = Wakeup()
        r = self.registry = MetricsRegistry()
        self.reports = r.counter(
            "llmgw_usage_reports_total",
            "Gateways' usage reports, by outcome: added (to the ledger), again (sent again, already in it), "
            "failed (a write the store refused; tried again).",
            ("outcome",),
        )
        self.tokens = r.counter(
            "llmgw_usage_tokens_total",
            "Tokens added to the ledger, by kind (prompt; cached, of the prompt; completion).",
            ("kind",),
        )
        self.requests = r.counter("llmgw_usage_requests_total", "Requests added to the ledger.")

    def received(self, reporter: Reporter, report: g.UsageReport) -> None:
        self._waiting[id(reporter)] = (reporter, report)
        self.arrived.fire()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        failures = Failures(self.backoff)
        prune_at = trio.current_time() + PRUNE_EVERY_S / 24  # not at once: a start is busy enough
        while True:
            arrived = self.arrived.next()
            if trio.current_time() >= prune_at:
                prune_at = trio.current_time() + PRUNE_EVERY_S
                await self._prune()
            if not self._waiting:
                with trio.move_on_at(prune_at):
                    await arrived.wait()
                continue
            key, (reporter, report) = next(iter(self._waiting.items()))
            if reporter.gone:
                del self._waiting[key]
                continue
            try:
                await self.add(reporter.instance, report)
            except NotLeader:
                self._waiting.clear()  # the next leader gets them again
                continue
            except StoreError as exc:
                failures.failed(trio.current_time())
                log.warning("usage_report_not_written", instance=reporter.instance, seq=report.seq, reason=str(exc))
                await trio.sleep(failures.delay())
                continue
            failures.reset()
            if self._waiting.get(key, (None, None))[1] is report:
                del self._waiting[key]
            if not reporter.gone:
                reporter.acknowledge(report.seq)

    async def _prune(self) -> None:
        try:
            forgotten = await self.store.prune_usage_reports(time.time() - REPORTS_KEPT_S)
        except StoreError as exc:  # the next day's try
            log.warning("usage_reports_not_pruned", reason=str(exc))
            return
        if forgotten:
            log.info("usage_reports_pruned", instances=forgotten)

    async def add(self, instance: str, report: g.UsageReport) -> bool:
        """Add `report` of `instance` to the ledger, once; whether it was added now."""
        try:
            added = await self.store.record_usage(instance, report.seq, report.rows)
        except StoreError:
            self.reports.inc(outcome="failed")
            raise
        self.reports.inc(outcome="added" if added else "again")
        if added:
            rows = report.rows
            self.requests.inc(sum(r.requests for r in rows))
            for kind, total in (
                ("prompt", sum(r.prompt_tokens for r in rows)),
                ("cached", sum(r.cached_tokens for r in rows)),
                ("completion", sum(r.completion_tokens for r in rows)),
            ):
                self.tokens.inc(total, kind=kind)
        return added

    async def serve_local(
        self,
        usage: Usage,
        *,
        interval_s: float = LOCAL_INTERVAL_S,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The gateway on this loop's counts, written every `interval_s` while there are some, and
        once more, bounded, when cancelled (a stop, after the drain)."""
        instance = "own-" + secrets.token_hex(8)  # a start is a new instance, as a gateway process's
        usage.linked = True
        task_status.started()
        try:
            while True:
                flushing = usage.flushing.next()
                await self._write_local(usage, instance)
                with trio.move_on_after(interval_s):
                    await flushing.wait()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self.backoff.first_s * 4):
                await self._write_local(usage, instance)

    async def _write_local(self, usage: Usage, instance: str) -> None:
        report = usage.report()
        if report is None:
            return
        try:
            await self.add(instance, report)
        except StoreError as exc:  # kept: the next round sends it again
            log.warning("usage_report_not_written", instance=instance, seq=report.seq, reason=str(exc))
            return
        usage.acked(report.seq)

    def render(self) -> str:
        return self.registry.render()
