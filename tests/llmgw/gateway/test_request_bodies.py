"""What the gateway takes as a request body, as a client sees it: a body outside the one JSON rule
(`llmgw.http.jsonbody.loads`) is a 400 in OpenAI's shape naming what is wrong, whether the model
is routed by load or by prefix (whose prompt the gateway reads). Sim engines in memory on
MockClock (`testlib.memnet`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.wire import gateway_link as g
from testlib import memnet
from testlib.gateway import chat

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
