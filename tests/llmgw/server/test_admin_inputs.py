"""What callers send the admin API and the cluster page, good and bad, against a real control
plane in this process. Each request goes through the HTTP server's own connection code
(`serve_connection`) over a memory stream, so a bug is answered 500 here exactly as on a socket.

First the inputs a hostile tester found answered 500, and their neighbours, each refused 400
with a message naming the input, the value (cut short when long) and what is accepted. Then
Hypothesis sends generated requests: paths with generated ids, query strings, JSON bodies of
generated shapes and values (huge integers, floats, NaN, wrong types, nesting, unicode). No
answer may be a 5xx, every refusal is a 4xx with a message, and nothing is logged as an error.
"""

from __future__ import annotations

import gzip
import json
import logging
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

import h11
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmgw import paths
from llmgw.http.openai import error_body
from llmgw.http.server import serve_connection
from llmgw.pki.ca import check_node_id
from llmgw.server.admin.api import MAX_LOG_LINES
from llmgw.server.admin.certificates import MAX_NOT_AFTER
from llmgw.server.app import ControlPlane
from llmgw.server.state.keys import MAX_LIMIT
from testlib.controlplane import make_state, serve_plane

pytestmark = pytest.mark.trio

NODE = "node-a"
KEY = "team"
# Longer than any message needs; a message echoing a whole 16 KiB path or an 8 MiB body is not.
MAX_MESSAGE_CHARS = 1500


@pytest.fixture
async def plane(tmp_path: Path, nursery: trio.Nursery) -> tuple[ControlPlane, str]:
    state = tmp_path / "cp"
    make_state(state)
    plane, _ = await serve_plane(state, nursery)
    await plane.store.saw_node(NODE, "127.0.0.5")
    plane.registry.know(NODE, address="127.0.0.5")
    await plane.keys.create(KEY)
    return plane, paths.read_admin_token(paths.admin_token_path(state))


async def exchange(
    plane: ControlPlane, method: str, target: str, body: bytes = b"", headers=(), *, token: str = ""
) -> tuple[int, dict[str, str], bytes]:
    """One request through the server's connection code; the status, headers and body (not
    read for the event feed, which never ends)."""
    client_stream, server_stream = trio.testing.memory_stream_pair()
    conn = h11.Connection(h11.CLIENT)
    sent = [("host", "127.0.0.1"), ("content-length", str(len(body))), *headers]
    if token:
        sent.append(("authorization", f"Bearer {token}"))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                partial(serve_connection, plane.gateways.in_process.worker.handle, server_stream, errors=error_body)
            )
            data = conn.send(h11.Request(method=method, target=target, headers=sent))
            data += conn.send(h11.Data(data=body)) if body else b""
            await client_stream.send_all(data + conn.send(h11.EndOfMessage()))
            status, answer_headers, answer = 0, {}, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await client_stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    answer_headers = {k.decode(): v.decode() for k, v in event.headers}
                    if answer_headers.get("content-type", "").startswith("text/event-stream"):
                        break  # the feed: it never ends
                elif isinstance(event, h11.Data):
                    answer += event.data
                else:  # the end of the answer, or of the connection
                    break
            nursery.cancel_scope.cancel()
    return status, answer_headers, answer


async def admin(plane_token, method: str, target: str, body: Any = None, raw: bytes | None = None):
    """An admin API call with the credential: the status and the decoded JSON answer (a refusal's
    message is at ["error"]["message"])."""
    plane, token = plane_token
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    status, _, answer = await exchange(plane, method, target, data, [("content-type", "application/json")], token=token)
    return status, json.loads(answer) if answer else None


def refusal(status: int, answer: Any) -> str:
    assert 400 <= status < 500, (status, answer)
    message = answer["error"]["message"]
    assert message and len(message) <= MAX_MESSAGE_CHARS, message
    return message


# -- what was found answered 500, and its neighbours -----------------------------------------

TOO_BIG = 18446744073709551616  # 2**64: past SQLite's integers


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("rate_per_minute", TOO_BIG, "18446744073709551616"),
        ("rate_per_minute", MAX_LIMIT + 1, str(MAX_LIMIT + 1)),
        ("rate_per_minute", -1, "-1"),
        ("rate_per_minute", 1.5, "1.5"),
        ("rate_per_minute", True, "True"),
        ("rate_per_minute", "60", "'60'"),
        ("max_concurrency", TOO_BIG, "18446744073709551616"),
        ("max_concurrency", 10**400, "(int of 401 characters as text)"),  # cut short
    ],
)
async def test_a_keys_limits_are_whole_numbers_up_to_the_maximum(plane, field, value, shown) -> None:
    status, answer = await admin(plane, "POST", "/admin/v1/keys", {"name": "k", field: value})
    message = refusal(status, answer)
    assert status == 400 and field in message and shown in message and f"to {MAX_LIMIT}" in message, message
    assert [r.name for r in await plane[0].keys.rows()] == [KEY]  # nothing recorded


async def test_the_limits_themselves_are_accepted(plane) -> None:
    body = {"name": "k", "models": ["chat"], "rate_per_minute": MAX_LIMIT, "max_concurrency": MAX_LIMIT}
    status, answer = await admin(plane, "POST", "/admin/v1/keys", body)
    assert status == 201 and answer["key"]["rate_per_minute"] == MAX_LIMIT, answer


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"name": "k", "models": 5}, "models must be a list of at most 256 model names"),
        ({"name": "k", "models": {"chat": 1}}, "got {'chat': 1}"),
        ({"name": "k", "models": "chat"}, "got 'chat'"),
        ({"name": "k", "models": ["bad name"]}, "got ['bad name']"),
        ({"name": "k", "models": ["m"] * 257}, "at most 256"),
        ({"name": "k\n"}, "key name 'k\\n' is not valid"),
        ({"name": "k" * 5000}, "(5000 characters)"),
        ({"name": 7}, "'name' must be a string, got 7"),
    ],
)
async def test_a_keys_name_and_models_are_checked(plane, body, says) -> None:
    status, answer = await admin(plane, "POST", "/admin/v1/keys", body)
    assert says in refusal(status, answer)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([], "the body must be a JSON object"),
        ({"node": ["a"]}, "unknown field 'node'"),
        ({"nodes": "node-a"}, "nodes must be a list of at most 10000 node ids, got 'node-a'"),
        ({"nodes": [5]}, "got [5]"),
        ({"nodes": ["bad id!"]}, "bad id!"),
        ({"wait_s": -1}, "wait_s must be a number of seconds from 0 to 600, got -1"),
        ({"wait_s": 601}, "got 601"),
        ({"wait_s": True}, "got True"),
        ({"wait_s": "5"}, "got '5'"),
    ],
)
async def test_a_bench_request_is_checked(plane, body, says) -> None:
    status, answer = await admin(plane, "POST", "/admin/v1/bench", body)
    assert status == 400 and says in refusal(status, answer)


async def test_a_bench_names_known_nodes_and_asks_none_that_is_not_connected(plane) -> None:
    status, answer = await admin(plane, "POST", "/admin/v1/bench", {"nodes": ["node-z"], "wait_s": 0})
    assert status == 404 and "no node 'node-z'" in refusal(status, answer) and NODE in refusal(status, answer)
    status, answer = await admin(plane, "POST", "/admin/v1/bench", {"nodes": [NODE], "wait_s": 5})
    assert status == 200 and answer["request"].startswith("bench-"), answer
    assert answer["nodes"] == [
        {"node": NODE, "asked": False, "error": f"node {NODE} is not connected; ask again once it is", "speeds": []}
    ]
    status, answer = await admin(plane, "POST", "/admin/v1/bench", {})
    assert status == 200 and answer["nodes"] == []  # every connected node: none


@pytest.mark.parametrize(
    "query",
    [
        "lines=%C2%B2",  # '²': str.isdigit() says yes, int() says no
        "lines=" + "9" * 5000,  # past CPython's 4300 digits for int()
        "lines=0",
        f"lines={MAX_LOG_LINES + 1}",
        "lines=-5",
        "lines=1e3",
        "lines=",
        "lines",
        "lines=%FF",
    ],
)
async def test_lines_is_a_whole_number_in_its_range(plane, query) -> None:
    status, answer = await admin(plane, "GET", f"/admin/v1/replicas/sim-0/logs?{query}")
    message = refusal(status, answer)
    assert status == 400 and message.startswith(f"lines must be a whole number from 1 to {MAX_LOG_LINES}, got ")
    assert len(message) < 300


async def test_a_good_lines_reaches_the_replica_lookup(plane) -> None:
    for query in ("", "?lines=50", f"?lines={MAX_LOG_LINES}", "?lines=0050"):
        status, answer = await admin(plane, "GET", f"/admin/v1/replicas/sim-0/logs{query}")
        assert status == 404 and "no replica 'sim-0'" in refusal(status, answer)


@pytest.mark.parametrize(
    ("method", "target", "says"),
    [
        ("GET", "/admin/v1/replicas/sim-0/logs?lines=5&lines=500", "query parameter lines is given 2 times"),
        ("GET", "/admin/v1/replicas/sim-0/logs?line=5", "has no query parameter 'line'; it takes lines: "),
        ("GET", "/admin/v1/nodes?verbose=1", "/admin/v1/nodes has no query parameter 'verbose'; it takes limit: "),
        ("POST", f"/admin/v1/nodes/{NODE}/drain?force=yes", "force must be 1 or 0 (or true or false), got 'yes'"),
        ("POST", f"/admin/v1/nodes/{NODE}/drain?forse=1", "has no query parameter 'forse'"),
        ("POST", f"/admin/v1/nodes/{NODE}/drain?force=1&force=0", "force is given 2 times"),
        ("POST", f"/admin/v1/nodes/{NODE}/cordon?force=1", "has no query parameter 'force'"),
        ("DELETE", f"/admin/v1/keys/{KEY}?all=1", "has no query parameter 'all'"),
        ("GET", "/admin/v1/events?since=0", "has no query parameter 'since'"),
        ("POST", "/admin/v1/nodes/" + "n" * 5000 + "/cordon", "(5000 characters)"),
        ("POST", "/admin/v1/nodes/node%20a/cordon", "node id 'node a' may use only letters"),
        ("POST", "/admin/v1/nodes/%C0%AF/cordon", "node id '%C0%AF' is not valid UTF-8"),
        ("POST", "/admin/v1/nodes/..%2F..%2Fetc/cordon", "node id '../../etc' may use only"),
        ("DELETE", "/admin/v1/keys/%E2%80%AE", "key name '\\u202e' is not valid"),
        ("GET", "/admin/v1/replicas/%00/logs", "replica id '\\x00' is not valid"),
        ("GET", "/admin/v1/certificates/" + "9" * 5000, "a serial is a positive whole number"),
        ("GET", f"/admin/v1/certificates/{1 << 160}", "at most 2**160 - 1"),
        ("GET", "/admin/v1/certificates/%C2%B2", "got '²'"),
        ("GET", "/admin/v1/" + "x" * 5000, "(5010 characters)"),
    ],
)
async def test_paths_and_query_parameters_are_read_strictly(plane, method, target, says) -> None:
    status, answer = await admin(plane, method, target)
    assert says in refusal(status, answer)


async def test_a_percent_encoded_node_id_is_decoded_and_a_good_force_is_taken(plane) -> None:
    status, answer = await admin(plane, "POST", "/admin/v1/nodes/node%2Da/cordon")
    assert status == 200 and answer["node"]["id"] == NODE and answer["node"]["cordoned"], answer
    status, answer = await admin(plane, "POST", f"/admin/v1/nodes/{NODE}/drain?force=true")
    assert status == 202 and answer["drain"]["node"] == NODE, answer


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"not_after": 10**400}, "'not_after' must be the certificate's expiry in seconds since 1970"),
        ({"not_after": MAX_NOT_AFTER + 1}, f"from 0 to {MAX_NOT_AFTER}"),
        ({"not_after": -1}, "got -1"),
        ({"not_after": True}, "got True"),
        ({"serial": "9" * 5000}, "'serial': a serial is a positive whole number"),
        ({"serial": str(1 << 160)}, "at most 2**160 - 1"),
        ({"serial": "0"}, "got '0'"),
        ({"serial": "%C2%B2"}, "got '%C2%B2'"),
        ({"serial": "²"}, "got '²'"),
        ({"also_revoke": ["5"] * 1001}, "'also_revoke' must be a list of at most 1000 serials"),
        ({"also_revoke": ["9" * 5000]}, "'also_revoke': a serial is"),
        ({"node_id": "n" * 50_000}, "(50000 characters)"),  # the admin API takes 64 KiB bodies at most
    ],
)
async def test_a_certificate_records_numbers_are_bounded(plane, change, says) -> None:
    body = {"serial": "5", "node_id": NODE, "not_after": 2e9, **change}
    status, answer = await admin(plane, "POST", "/admin/v1/certificates", body)
    assert says in refusal(status, answer)
    assert await plane[0].store.certificate(5) is None


async def test_a_json_number_past_4300_digits_is_a_bad_body_not_a_bug(plane) -> None:
    raw = b'{"name": "k", "rate_per_minute": ' + b"9" * 5000 + b"}"
    status, answer = await admin(plane, "POST", "/admin/v1/keys", raw=raw)
    message = refusal(status, answer)
    assert status == 400 and "request body has a number of more than 4300 digits" in message
    assert "sys." not in message  # in our words, not CPython's


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"name": "k", "rate_per_minute": NaN}', "request body has NaN, which is not JSON"),
        (b'{"name": "k", "rate_per_minute": 1e999}', "request body has the number 1e999, past the largest a double"),
        ('{"name": "k"}'.encode("utf-16"), "request body is not UTF-8 (it looks like UTF-16 or UTF-32)"),
        (b'{"name": "k\\udc00"}', "request body has a string with the lone surrogate \\udc00"),
    ],
)
async def test_a_body_outside_the_json_rule_is_refused_before_its_fields(plane, raw: bytes, says: str) -> None:
    status, answer = await admin(plane, "POST", "/admin/v1/keys", raw=raw)
    assert status == 400 and says in refusal(status, answer)
    assert [r.name for r in await plane[0].keys.rows()] == [KEY]


async def test_a_compressed_body_is_415_before_it_is_read(plane) -> None:
    cp, token = plane
    body = gzip.compress(b'{"name": "k"}')
    sent = [("content-type", "application/json"), ("content-encoding", "gzip")]
    status, headers, answer = await exchange(cp, "POST", "/admin/v1/keys", body, sent, token=token)
    error = json.loads(answer)["error"]
    assert (status, error["code"], headers["accept-encoding"]) == (415, "unsupported_content_encoding", "identity")
    assert error["message"] == "Content-Encoding 'gzip' is not supported; send the request body uncompressed"
    assert [r.name for r in await cp.keys.rows()] == [KEY]


async def test_the_page_login_takes_its_code_once_and_nothing_else(plane) -> None:
    cp, token = plane
    for target, status_wanted in (
        ("/login?code=a&code=b", 400),
        ("/login?code=a&next=%2F", 400),
        ("/login?code=" + "c" * 5000, 401),
        ("/login", 401),
        ("/?x=1", 400),
        ("/page/app.js?v=2", 400),
    ):
        status, headers, body = await exchange(cp, "GET", target)
        assert status == status_wanted, (target, status, body[:300])
        assert len(body) < 2000
    status, answer = await admin(plane, "POST", "/admin/v1/page/login", False)
    assert status == 400 and 'the body must be {"actions": true|false}' in refusal(status, answer)
    status, answer = await admin(plane, "POST", "/admin/v1/page/login")  # no body: no actions
    assert status == 201 and answer["actions"] is False


# -- generated requests ----------------------------------------------------------------------

KNOWN_IDS = [NODE, KEY, "sim-0", "5", "ghost"]
ODD_TEXT = ["²", "٣", "𝟗", "\u202e", "\x00", "../..", "%", "a/b", " ", "\ud800", "1e3", "0x10", "-1", "NaN"]


def _digits(n: int) -> str:
    return "9" * n


ids = st.one_of(
    st.sampled_from(KNOWN_IDS),
    st.sampled_from(ODD_TEXT),
    st.integers(min_value=-(2**70), max_value=2**200).map(str),
    st.integers(min_value=4000, max_value=6000).map(_digits),
    st.text(max_size=80),
)
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**300), max_value=2**300),
    st.sampled_from([2**63, 2**64, 2**160, -(2**63) - 1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=40), st.sampled_from(ODD_TEXT))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)
FIELDS = [
    "name",
    "models",
    "rate_per_minute",
    "max_concurrency",
    "serial",
    "node_id",
    "not_after",
    "revoke_others",
    "also_revoke",
    "actions",
    "nodes",
    "wait_s",
]
shaped = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
bodies = st.one_of(
    st.none(),
    shaped.map(lambda b: json.dumps(b).encode()),  # NaN and Infinity as Python writes them
    values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.integers(min_value=4000, max_value=6000).map(lambda n: b'{"rate_per_minute": ' + b"9" * n + b"}"),
)


def _encoded(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


segments = st.one_of(
    ids.map(_encoded),
    st.sampled_from(["%C2%B2", "%FF", "%2F", "%00", "%", "%zz", "..", "%2e%2e", "a%20b"]),
)
TEMPLATES = [
    "/admin/v1/nodes",
    "/admin/v1/replicas",
    "/admin/v1/models",
    "/admin/v1/reload",
    "/admin/v1/bench",
    "/admin/v1/keys",
    "/admin/v1/certificates",
    "/admin/v1/events",
    "/admin/v1/page/login",
    "/admin/v1/page/session",
    "/admin/v1/page/logout",
    "/admin/v1/nodes/{}",
    "/admin/v1/nodes/{}/cordon",
    "/admin/v1/nodes/{}/uncordon",
    "/admin/v1/nodes/{}/drain",
    "/admin/v1/replicas/{}/logs",
    "/admin/v1/keys/{}",
    "/admin/v1/certificates/{}",
    "/admin/v1/{}",
    "/login",
    "/",
    "/page/{}",
]
query_names = st.one_of(st.sampled_from(["lines", "force", "code", "x", ""]), st.text(max_size=10).map(_encoded))
query_values = st.one_of(
    ids.map(_encoded), numbers.map(lambda n: _encoded(str(n))), st.sampled_from(["1", "0", "true", "%C2%B2", ""])
)
parameters = st.tuples(query_names, st.one_of(st.none(), query_values)).map(
    lambda nv: nv[0] if nv[1] is None else f"{nv[0]}={nv[1]}"
)
queries = st.one_of(st.just(""), st.lists(parameters, max_size=4).map(lambda ps: "?" + "&".join(ps)))


@st.composite
def requests(draw) -> tuple[str, str, bytes]:
    template = draw(st.sampled_from(TEMPLATES))
    path = template.format(draw(segments)) if "{}" in template else template
    method = draw(st.sampled_from(["GET", "POST", "DELETE", "PUT"]))
    body = draw(bodies) if method in ("POST", "PUT") else b""
    return method, path + draw(queries), body or b""


def _check_answer(method: str, target: str, status: int, headers: dict[str, str], body: bytes) -> None:
    assert status < 500, (method, target, status, body[:500])
    if status < 400:
        return
    assert body, (method, target, status)
    if headers.get("content-type", "").startswith("text/html"):  # /login's refusals: a page for a person
        assert b"<p>" in body and len(body) < 2000, body[:500]
        return
    message = json.loads(body)["error"]["message"]
    assert message and len(message) <= MAX_MESSAGE_CHARS, (method, target, message[:500])


async def test_generated_requests_are_never_a_server_error(plane, caplog: pytest.LogCaptureFixture) -> None:
    cp, token = plane

    @settings(
        max_examples=200,
        deadline=None,
        database=None,  # nothing written beside the sources
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=requests())
    @example(request=("POST", "/admin/v1/keys", b'{"name": "x", "rate_per_minute": 18446744073709551616}'))
    @example(request=("GET", "/admin/v1/replicas/R/logs?lines=%C2%B2", b""))
    @example(request=("GET", "/admin/v1/replicas/R/logs?lines=" + "9" * 5000, b""))
    @example(request=("POST", "/admin/v1/certificates", b'{"serial": "5", "node_id": "n", "not_after": 1e999}'))
    @example(request=("POST", "/admin/v1/keys", b'{"name": "x", "models": 5}'))
    def one(request: tuple[str, str, bytes]) -> None:
        method, target, body = request
        headers = [("content-type", "application/json")]
        status, got, answer = trio.from_thread.run(partial(exchange, cp, method, target, body, headers, token=token))
        _check_answer(method, target, status, got, answer)

    await trio.to_thread.run_sync(one)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [(r.getMessage(), getattr(r, "llmgw_fields", {})) for r in errors[:5]]
    # What was made meanwhile is within its bounds (the store took every key it was given).
    for row in await cp.keys.rows():
        assert 0 <= row.rate_per_minute <= MAX_LIMIT and 0 <= row.max_concurrency <= MAX_LIMIT
    assert all(check_node_id(node) for node in cp.registry.nodes)  # no node made of a bad id
