"""A client repeating what the HTTP port refuses — a wrong admin credential, a made-up login code —
against a real `llmgw server`, whose gateway worker relays both to the control plane: the log
has the first few one line each and then one summary per interval counting the rest, by reason
and by the client's network, however many there were; the summary comes when its interval ends,
with no further request to prompt it."""

from __future__ import annotations

import http.client
from pathlib import Path

from llmgw.http.refusals import BURST, INTERVAL_S
from testlib.cluster import Cluster, wait_until

ATTEMPTS = 200  # of each kind


def test_a_flood_of_wrong_credentials_and_login_codes_logs_a_handful_of_lines(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, server_toml="gateway_workers = 1\n", fixed_http_port=True)
    try:
        cluster.init_ca()
        server = cluster.start_server()
        conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=10)
        for i in range(ATTEMPTS):
            conn.request("GET", "/admin/v1/nodes", headers={"authorization": f"Bearer wrong-{i}"})
            answer = conn.getresponse()
            assert answer.status == 401 and b"wrong admin credential" in answer.read()
            conn.request("GET", f"/login?code=made-up-{i}")
            answer = conn.getresponse()
            assert answer.status == 401, answer.read()
            answer.read()
        conn.close()

        singles = ("admin_credential_refused", "page_login_refused")

        def summed() -> list[dict] | None:
            summaries = server.events("requests_refused")
            one_by_one = [e for e in server.events() if e.get("event") in singles]
            told = len(one_by_one) + sum(s["count"] - s["logged_each"] for s in summaries)
            return summaries if told == 2 * ATTEMPTS else None

        # Nothing more is sent: the summary is logged when its interval ends all the same.
        summaries = wait_until(
            "every refusal told, one by one or in a summary", summed, alive=[server], timeout=INTERVAL_S + 20
        )
        one_by_one = [e for e in server.events() if e.get("event") in singles]
        # 400 requests take well under an interval, or at most two: a few lines, not 400.
        assert 1 <= len(summaries) <= 2 and len(one_by_one) <= len(summaries) * BURST, (summaries, one_by_one)
        assert all(e["level"] == "warning" and e["client"].startswith("127.0.0.1:") for e in one_by_one)
        for summary in summaries:
            assert summary["level"] == "warning" and summary["listener"] == "http"
            assert set(summary["reasons"]) <= {"admin", "page_login"}
            # The relayed client's own address is counted, not the worker's on the private socket.
            assert summary["networks"] == {"127.0.0.0/24": summary["count"]}
        assert sum(s["reasons"].get("admin", 0) for s in summaries) >= ATTEMPTS - BURST
        assert sum(s["reasons"].get("page_login", 0) for s in summaries) >= ATTEMPTS - BURST
        assert not server.events("http_handler_failed"), "no refusal is a bug"
    finally:
        cluster.close()
