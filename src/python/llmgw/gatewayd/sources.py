"""Where a worker's table comes from (`worker.Source`): the control plane over the gateway link,
or a table file read at start. Either is called as `source(sink=table, task_status=...)`."""

from __future__ import annotations

import importlib
import ssl
from functools import partial
from pathlib import Path

import trio

from llmgw.gatewayd.errors import NoLinkClient
from llmgw.gatewayd.tablefile import TableFile, feed
from llmgw.gatewayd.worker import Source
from llmgw.wire.gateway_link import TableSink

LINK_MODULE = "llmgw.gatewayd.link"


async def serve_table_file(
    table: TableFile, path: Path, *, sink: TableSink, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Give `sink` the table read from `path`, once; nothing more comes."""
    feed(sink, table, now=trio.current_time(), path=path)
    task_status.started()


def link_source(server_url: str, tls: ssl.SSLContext, *, name: str, instance: str) -> Source:
    """The gateway link to `server_url`: `serve_gateway_link(server_url, tls, *, name, instance,
    sink, task_status)`, which connects, hands each frame's content to the sink, and reconnects
    with backoff while the worker serves on from its last table."""
    # LINK-MERGE: the link client is built apart (branch i27-link, `llmgw/gatewayd/link.py`).
    # Once both are merged this is `from llmgw.gatewayd.link import serve_gateway_link` at the
    # top of the module; it is imported by name until then so that this branch builds alone.
    try:
        link = importlib.import_module(LINK_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != LINK_MODULE:
            raise
        raise NoLinkClient(
            f"this llmgw has no gateway link client ({LINK_MODULE}), so --server cannot be used; serve a table "
            "file with --table-file instead, or run an llmgw that has it"
        ) from None
    return partial(link.serve_gateway_link, server_url, tls, name=name, instance=instance)
