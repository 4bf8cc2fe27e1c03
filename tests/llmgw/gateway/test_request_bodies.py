"""What the gateway takes as a request body, as a client sees it: a compressed body is a 415
before it is read, and a body outside the one JSON rule (`llmgw.http.jsonbody.loads`) a 400 in
OpenAI's shape naming what is wrong, whether the model is routed by load or by prefix (whose
prompt the gateway reads). Sim engines in memory on MockClock (`testlib.memnet`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.wire import gateway_link as g
from testlib import memnet
from testlib.gateway import chat

UNCOMPRESSED = "send the request body uncompressed"


@pytest.mark.trio
async def test_a_compressed_body_is_415_naming_its_coding_before_it_is_read(
    tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),))
    compressed = gzip.compress(json.dumps(chat()).encode())
    status, headers, body = await gw.call(
        "POST", "/v1/chat/completions", compressed, headers={"content-encoding": "gzip"}
    )
    assert status == 415, body
    assert json.loads(body) == {
        "error": {
            "message": f"Content-Encoding 'gzip' is not supported; {UNCOMPRESSED}",
            "type": "invalid_request_error",
            "param": None,
            "code": "unsupported_content_encoding",
        }
    }
    assert headers["accept-encoding"] == "identity" and headers["x-request-id"].startswith("req_")
    assert "x-llmgw-replica" not in headers  # no engine saw it

    # Refused from the head: a body the JSON worker would parse never reaches it.
    big = b'{"pad": "' + b"x" * (1 << 20) + b'"}'
    status, _, body = await gw.call("POST", "/v1/chat/completions", big, headers={"content-encoding": "br, gzip"})
    assert status == 415 and json.loads(body)["error"]["message"].startswith("Content-Encoding 'br, gzip' is not")
    assert gw.gateway.json.parsed_in_worker == 0
    # No coding, said or not, is a body like any other.
    for said in ({"content-encoding": "identity"}, {"content-encoding": "Identity"}, {}):
        status, headers, _ = await gw.call("POST", "/v1/chat/completions", chat(), headers=said)
        assert status == 200 and headers["x-llmgw-replica"] == a.name


HI = b'{"role": "user", "content": "hi"}'
# Each was forwarded to the engine before the rule, or refused in Python's words.
REFUSED = {
    b'{"model": "chat", "messages": [' + HI + b'], "temperature": NaN}': "has NaN, which is not JSON",
    b'{"model": "chat", "messages": [' + HI + b'], "temperature": 1e999999}': "has the number 1e999999, past",
    b'{"model": "chat", "messages": [' + HI + b'], "seed": ' + b"7" * 5000 + b"}": "a number of more than 4300 digits",
    json.dumps(chat()).encode("utf-16"): "is not UTF-8 (it looks like UTF-16 or UTF-32)",
    b'{"model": "chat", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}': "a surrogate code point",
    b'{"model": "chat", "messages": [{"role": "user", "content": "\\ud800"}]}': "the lone surrogate \\ud800",
}


@pytest.mark.trio
@pytest.mark.parametrize("routing", ["least_outstanding", "prefix"])
async def test_a_body_outside_the_json_rule_is_a_400_in_our_words(
    routing: str, tmp_path: Path, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (a,) = memnet.start_sims(net, 1)
    details = (g.ModelInfo(name="chat", engine="sim", routes=(g.CHAT,), routing=routing),)
    gw = await memnet.start_gateway(nursery, tmp_path, net, (a.endpoint(),), details=details)
    for sent, says in REFUSED.items():
        status, headers, body = await gw.call("POST", "/v1/chat/completions", sent)
        error = json.loads(body)["error"]
        assert status == 400 and says in error["message"], (sent[:80], status, body)
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
        assert "sys." not in error["message"] and "x-llmgw-replica" not in headers
    # An emoji escaped as a pair is one character, and served.
    paired = b'{"model": "chat", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert (await gw.call("POST", "/v1/chat/completions", paired))[0] == 200
