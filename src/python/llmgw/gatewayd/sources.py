"""Where a worker's table comes from (`worker.Source`): the control plane over the gateway link
(`llmgw.gatewayd.link`), or a table file read at start. Either is called as
`source(sink=table, task_status=...)`."""

from __future__ import annotations

import ssl
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import trio

from llmgw.gateway.budgets import Budgets
from llmgw.gateway.usage import Usage
from llmgw.gatewayd.link import AtOnce, Load, serve_gateway_link
from llmgw.gatewayd.tablefile import TableFile, feed
from llmgw.gatewayd.worker import Source
from llmgw.wire.gateway_link import TableSink


async def serve_table_file(
    table: TableFile, path: Path, *, sink: TableSink, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Give `sink` the table read from `path`, once; nothing more comes."""
    feed(sink, table, now=trio.current_time(), path=path)
    task_status.started()


def link_source(
    server_url: str | Sequence[str],
    tls: ssl.SSLContext,
    *,
    name: str,
    instance: str,
    load: Load,
    at_once: AtOnce | None = None,
    tls_name: str = "",
    usage: Usage | None = None,
    budgets: Budgets | None = None,
) -> Source:
    """The gateway link to `server_url` (or to every control plane's, in turn), which hands each part of the table to the sink and dials
    again with backoff while the worker serves on from its last table; `load()` is what its
    heartbeats report (`GatewayWorker.load`), one sent at once when one of `at_once()` is set
    (`Gateway.at_once`: a new rotation, a request held for a model with no replica); `tls_name`:
    the name the control plane's certificate must cover, if not the host of `server_url`; `usage`:
    the worker's counts (`Gateway.usage`), which the link reports; `budgets`: the worker's token
    budgets (its table's), whose grants the link asks for and reports."""
    return partial(
        serve_gateway_link,
        server_url,
        tls,
        name=name,
        instance=instance,
        load=load,
        at_once=at_once,
        tls_name=tls_name,
        started_at=time.time(),
        usage=usage,
        budgets=budgets,
    )
