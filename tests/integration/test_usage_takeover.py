"""The usage ledger across a change of leader (issue 48): two `llmgw server` processes on one real
PostgreSQL (testlib.planes), agents with the sim, a standalone gateway given both control planes.
The gateway answers, then answers more and the leader is SIGKILLed at once (its last report
unwritten, or written and not acknowledged): the new leader's ledger holds every answer exactly
once (the gateway sends its unacknowledged report again to the new leader, which adds it only if
its sequence is not recorded), and goes on counting.

The ledger is polled in this process (the admin API call `llmgw ctl usage --key alice --by key
--json` makes, with its AdminClient): a `llmgw ctl` process a poll cost 0.2-0.3 CPU-s.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.ctl.client import AdminClient
from llmgw.errors import LlmgwError
from testlib import gatewayd
from testlib.cluster import wait_until
from testlib.planes import Plane, Planes
from testlib.postgres import Database, postgres_db, postgres_server  # noqa: F401 - fixtures
from testlib.proc import llmgw_here

COUNTED_S = 30.0


@pytest.fixture
def planes(tmp_path: Path, postgres_db: Database) -> Iterator[Planes]:  # noqa: F811 - the fixture
    p = Planes(tmp_path, postgres_db, reconnect_grace_s=40.0)
    try:
        yield p
    finally:
        p.close()


def totals(plane: Plane) -> tuple[int, int, int] | None:
    """alice's row of the ledger as `plane`'s state directory finds it (a standby followed to its
    leader), or None while there is none or no leader answers."""
    try:
        client = AdminClient.locate(server=None, credential=None, state_dir=str(plane.state))
        answer = client.request("GET", "/admin/v1/usage?group=key&key=alice")
    except LlmgwError:
        return None
    if not answer["usage"]:
        return None
    row = answer["usage"][0]
    return row["requests"], row["prompt_tokens"], row["completion_tokens"]


def test_usage_is_counted_once_across_a_change_of_leader(planes: Planes) -> None:
    a, b = planes.start_two_nodes()
    pki = gatewayd.issue_certificate(planes.cluster, "gw1")
    planes.two_ready(a)
    token = json.loads(llmgw_here("ctl", "keys", "create", "alice", "--json", "--state-dir", str(a.state)))["token"]
    gw = gatewayd.start(planes.cluster, "gw1", pki, server=planes.agent_urls)
    gw.wait_serving()
    answered = [0, 0, 0]

    def ask(n: int) -> None:
        for _ in range(n):
            status, _, body = gw.ask(token, "one two three", max_tokens=5)
            assert status == 200, body
            usage = json.loads(body)["usage"]
            answered[0] += 1
            answered[1] += usage["prompt_tokens"]
            answered[2] += usage["completion_tokens"]

    ask(5)
    wait_until("the leader's ledger to count 5", lambda: totals(a) == tuple(answered), procs=planes.procs())
    ask(3)  # and the leader killed at once: these are not in the ledger yet, or not acknowledged
    a.proc.popen.send_signal(signal.SIGKILL)
    a.proc.popen.wait(10)
    planes.wait_leads(b, timeout=30)
    wait_until(
        "the new leader's ledger to count all 8",
        lambda: totals(b) == tuple(answered),
        procs=planes.procs(),
        timeout=COUNTED_S,
        last_seen=lambda: totals(b),
    )
    time.sleep(5)  # two more report intervals: nothing comes twice
    assert totals(b) == tuple(answered)
    ask(1)
    wait_until("the new leader counting on", lambda: totals(b) == tuple(answered), procs=planes.procs())
