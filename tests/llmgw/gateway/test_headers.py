"""Which header fields cross the gateway, each way (gateway/headers.py), without sockets;
tests/llmgw/gateway/test_forwarded_headers.py checks the same end to end."""

from __future__ import annotations

import os
import re

from llmgw.gateway.headers import relayed_headers, request_id, upstream_headers
from llmgw.gateway.routing import Endpoint
from llmgw.http.messages import Request

EP = Endpoint(replica_id="chat-0", model="chat", host="10.0.0.5", port=9000, api_key="engine-key")


def test_to_the_replica_repeats_stay_in_order_and_the_gateway_sets_key_and_forwarded_for() -> None:
    request = Request.of(
        "POST",
        "/v1/chat/completions",
        raw_headers=(
            (b"host", b"gw"),
            (b"authorization", b"Bearer client-key"),
            (b"x-tag", b"one"),
            (b"connection", b"keep-alive, x-secret-hop"),
            (b"x-secret-hop", b"dropped"),
            (b"transfer-encoding", b"chunked"),
            (b"x-tag", b"two"),
            (b"x-forwarded-for", b"192.0.2.1"),
            (b"content-length", b"12"),
            (b"expect", b"100-continue"),
        ),
        client="198.51.100.7:5555",
    )
    assert upstream_headers(request, EP) == [
        (b"x-tag", b"one"),
        (b"x-tag", b"two"),
        (b"authorization", b"Bearer engine-key"),  # the replica's key, never the client's
        (b"x-forwarded-for", b"192.0.2.1, 198.51.100.7"),
    ]


def test_to_the_replica_without_a_key_or_a_client_address_nothing_is_added() -> None:
    request = Request.of("POST", "/v1/completions", raw_headers=((b"x-forwarded-for", b"192.0.2.1"),), client="")
    assert upstream_headers(request, Endpoint(replica_id="r", model="m", host="h", port=1)) == [
        (b"x-forwarded-for", b"192.0.2.1")
    ]


def test_to_the_client_the_gateway_writes_its_own_framing_and_says_who_answered() -> None:
    upstream = (
        (b"content-type", b"application/json"),
        (b"content-length", b"10"),
        (b"date", b"then"),
        (b"server", b"llama"),
        (b"transfer-encoding", b"chunked"),
        (b"x-request-id", b"abc"),
    )
    # The engine's own request id is not the request's: the gateway's is.
    assert relayed_headers(upstream, replica_id="chat-0", overhead_s=0.00125, request_id="req_1") == (
        (b"content-type", b"application/json"),
        ("x-llmgw-replica", "chat-0"),
        ("x-llmgw-overhead-ms", "1.25"),
        ("x-request-id", "req_1"),
    )


def test_a_request_id_is_the_callers_when_usable_else_a_new_one_unique_in_and_across_processes() -> None:
    assert request_id("trace-1/a@b") == "trace-1/a@b"
    made = [request_id(None) for _ in range(10_000)] + [request_id("bad id"), request_id("x" * 129)]
    assert all(re.fullmatch(r"req_[0-9a-f]{24}", rid) for rid in made)
    assert len(set(made)) == len(made)
    # A forked child (a gateway's worker) does not repeat its parent's ids.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then out without running the parent's cleanup
        os.write(write, " ".join(request_id(None) for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        child = f.read().decode().split()
    parent = [request_id(None) for _ in range(100)]
    assert len(child) == 100 and not set(child) & set(parent)
