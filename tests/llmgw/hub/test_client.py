"""llmgw.hub.client against testlib.hubserver on loopback: revisions of every kind, the files'
sizes and hashes, search, ranged reads through the CDN redirect, each of the Hub's errors as its
class with a message saying what to do, gated repositories and tokens, endpoints that are not a
Hub or not there, and a token that never reaches a message, a repr or the CDN."""

from __future__ import annotations

import hashlib
import socket
import socketserver
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw.config import Secret
from llmgw.errors import UsageError
from llmgw.hub.client import (
    GatedRepository,
    HubClient,
    HubError,
    UnknownFile,
    UnknownRepository,
    UnknownRevision,
    check_repo_id,
)
from testlib.hubrepo import HubRepo, git_oid
from testlib.hubserver import HubServer

BIG = bytes(range(256)) * 400  # 102400 bytes, LFS by its name
CONFIG = b'{"model_type": "llama"}\n'
GRANTED = "hf_granted_token_0123456789"
USER = "hf_user_token_not_granted_42"
REVOKED = "hf_revoked_token_never_known"


def repos() -> list[HubRepo]:
    plain = HubRepo("org/plain", {"README.md": b"# plain\n", "config.json": CONFIG, "m.gguf": BIG})
    plain.tag("v1")
    plain.commit({"README.md": b"# second\n", "sub/x.txt": b"x"})
    plain.open_pr({"README.md": b"# a pull request\n"})
    return [
        plain,
        HubRepo("org/gated", {"m.gguf": BIG, "a.txt": b"a"}, gated="manual", token=GRANTED),
        HubRepo("org/private", {"a.txt": b"a"}, private=True, token=GRANTED),
        HubRepo("other/plain-chat", {"b.gguf": b"b" * 10}, tags=["chat"]),
    ]


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer(repos(), users=[USER]) as server:
        yield server


def client(hub: HubServer, token: str | None = None) -> HubClient:
    return HubClient(hub.url, token=Secret(token) if token else None, timeout_s=10)


def test_a_revision_by_branch_tag_commit_and_pull_request(hub: HubServer) -> None:
    plain = hub.repos["org/plain"]
    c = client(hub)
    main = c.revision("org/plain")
    assert (main.commit, main.revision, main.gated, main.private) == (plain.branches["main"], "main", False, False)
    assert [f.path for f in main.files] == ["README.md", "config.json", "m.gguf", "sub/x.txt"]
    v1 = c.revision("org/plain", "v1")
    assert v1.commit == plain.tag_refs["v1"] != main.commit
    assert [f.path for f in v1.files] == ["README.md", "config.json", "m.gguf"]
    assert c.revision("org/plain", v1.commit).commit == v1.commit  # by its commit
    pr = c.revision("org/plain", "refs/pr/1")
    assert pr.commit == plain.branches["refs/pr/1"] and pr.commit not in (main.commit, v1.commit)
    (info,) = hub.log.requests(kind="info", revision="refs/pr/1")  # one path segment, percent-encoded
    assert info.status == 200


def test_lfs_files_have_size_and_sha256_small_files_a_blob_id_only(hub: HubServer) -> None:
    files = {f.path: f for f in client(hub).revision("org/plain", "v1").files}
    big = files["m.gguf"]
    assert (big.size, big.sha256) == (len(BIG), hashlib.sha256(BIG).hexdigest())
    config = files["config.json"]
    assert (config.size, config.sha256, config.blob_id) == (len(CONFIG), "", git_oid("blob", CONFIG))
    assert files["README.md"].sha256 == "" and files["README.md"].size == len(b"# plain\n")


def test_search_lists_matches_with_their_files(hub: HubServer) -> None:
    found = client(hub).search("plain", limit=10)
    assert [m.repo for m in found] == ["org/plain", "other/plain-chat"]
    assert found[0].files == ("README.md", "config.json", "m.gguf", "sub/x.txt")
    assert "chat" in found[1].tags
    assert [m.repo for m in client(hub).search("plain", limit=1)] == ["org/plain"]
    assert client(hub).search("nothing-like-this") == []


def test_ranged_reads_of_small_and_lfs_files(hub: HubServer) -> None:
    c = client(hub)
    commit = c.revision("org/plain", "v1").commit
    assert c.read("org/plain", commit, "config.json", length=len(CONFIG)) == CONFIG
    assert c.read("org/plain", commit, "config.json", start=2, length=5) == CONFIG[2:7]
    assert c.read("org/plain", commit, "m.gguf", start=1000, length=300) == BIG[1000:1300]
    assert c.read("org/plain", commit, "m.gguf", start=len(BIG) - 10, length=100) == BIG[-10:]  # fewer at the end
    assert c.read("org/plain", commit, "m.gguf", start=len(BIG), length=10) == b""  # past the end: 416
    assert hub.log.partial_responses == 4
    hub.faults.refuse_range("m.gguf")  # a server without ranges: the client skips to the start
    assert c.read("org/plain", commit, "m.gguf", start=70000, length=50) == BIG[70000:70050]
    cdn = hub.log.requests(kind="cdn")
    assert cdn and all(s.range is not None for s in cdn)  # the Range went through the redirect


def test_file_url_quotes_the_path() -> None:
    c = HubClient("http://127.0.0.1:9/")
    assert c.file_url("o/n", "a" * 40, "dir/a b.gguf") == f"http://127.0.0.1:9/o/n/resolve/{'a' * 40}/dir/a%20b.gguf"


def test_unknown_repository_revision_and_file(hub: HubServer) -> None:
    with pytest.raises(UnknownRepository) as anonymous:
        client(hub).revision("org/nope")
    assert "org/nope" in str(anonymous.value) and "ORG/NAME" in str(anonymous.value) and "token" in str(anonymous.value)
    with pytest.raises(UnknownRepository) as signed_in:  # 404 to a user, as the Hub
        client(hub, USER).revision("org/nope")
    assert "org/nope" in str(signed_in.value) and "llmgw ctl models search" in str(signed_in.value)
    with pytest.raises(UnknownRevision) as revision:
        client(hub).revision("org/plain", "no-such-branch")
    assert "org/plain" in str(revision.value) and "'no-such-branch'" in str(revision.value)
    assert "--revision" in str(revision.value)
    commit = client(hub).revision("org/plain").commit
    with pytest.raises(UnknownFile) as missing:
        client(hub).read("org/plain", commit, "nope.gguf", length=10)
    assert "org/plain" in str(missing.value) and "'nope.gguf'" in str(missing.value) and commit in str(missing.value)
    assert "check the path" in str(missing.value)
    assert all(issubclass(k, UsageError) for k in (UnknownRepository, UnknownRevision, UnknownFile, GatedRepository))


def test_a_private_repository_is_unknown_without_its_token(hub: HubServer) -> None:
    with pytest.raises(UnknownRepository, match="private"):
        client(hub).revision("org/private")
    assert client(hub, GRANTED).revision("org/private").commit == hub.repos["org/private"].branches["main"]


def test_a_gated_repository_without_with_a_wrong_and_with_a_valid_token(hub: HubServer) -> None:
    rev = client(hub).revision("org/gated")  # its metadata is public, as on the Hub
    assert rev.gated and [f.path for f in rev.files] == ["a.txt", "m.gguf"]
    with pytest.raises(GatedRepository) as anonymous:
        client(hub).read("org/gated", rev.commit, "m.gguf", length=10)
    assert "org/gated" in str(anonymous.value) and "--token-file" in str(anonymous.value)
    with pytest.raises(GatedRepository) as not_granted:
        client(hub, USER).read("org/gated", rev.commit, "m.gguf", length=10)
    assert "request access" in str(not_granted.value)
    with pytest.raises(GatedRepository) as revoked:  # a token the Hub does not know: refused everywhere
        client(hub, REVOKED).revision("org/plain")
    assert "refuses the token" in str(revoked.value) and "token_file" in str(revoked.value)
    assert client(hub, GRANTED).read("org/gated", rev.commit, "m.gguf", start=5, length=10) == BIG[5:15]
    assert client(hub, GRANTED).read("org/gated", rev.commit, "a.txt", length=1) == b"a"
    for message in (str(anonymous.value), str(not_granted.value), str(revoked.value)):
        assert USER not in message and REVOKED not in message and GRANTED not in message


def test_the_token_never_reaches_the_cdn_a_message_or_a_repr(hub: HubServer) -> None:
    hub.cdn_refuses_authorization = True  # as S3 refuses a presigned URL that also carries a token
    c = client(hub, GRANTED)
    rev = c.revision("org/gated")
    assert c.read("org/gated", rev.commit, "m.gguf", length=len(BIG)) == BIG
    assert hub.log.count(kind="cdn", status=206) == 1  # the CDN served it, without the token
    assert all(s.authorization is None for s in hub.log.requests(kind="cdn"))
    assert all(s.authorization == f"Bearer {GRANTED}" for s in hub.log if s.kind in ("info", "resolve"))
    assert GRANTED not in repr(c) and "set" in repr(c) and GRANTED not in repr(c.with_token(c.token))
    errors: list[Exception] = []
    for call in (
        lambda: c.revision("org/nope"),
        lambda: c.revision("org/gated", "nope"),
        lambda: c.read("org/gated", rev.commit, "nope", length=1),
        lambda: HubClient("http://127.0.0.1:1", token=Secret(GRANTED), timeout_s=5).revision("org/x"),
    ):
        with pytest.raises(Exception) as failed:
            call()
        errors.append(failed.value)
    assert all(GRANTED not in str(e) and GRANTED not in repr(e) for e in errors)


def test_a_hub_error_answer_is_a_hub_error(hub: HubServer) -> None:
    commit = client(hub).revision("org/plain").commit
    hub.faults.fail("config.json", status=503, where="resolve")
    with pytest.raises(HubError, match="503.*try again"):
        client(hub).read("org/plain", commit, "config.json", length=5)


class _Html(BaseHTTPRequestHandler):
    """A web server that is not a Hub: a page for every path (or a 404 page)."""

    status = 200

    def do_GET(self) -> None:
        body = b"<!doctype html><html><body>Welcome to nginx!</body></html>"
        self.send_response(self.status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Html404(_Html):
    status = 404


class _Garbage(socketserver.BaseRequestHandler):
    """Not HTTP at all: an SSH server's greeting."""

    def handle(self) -> None:
        self.request.recv(65536)
        self.request.sendall(b"SSH-2.0-OpenSSH_9.6\r\nProtocol mismatch.\r\n")


@pytest.fixture(params=[_Html, _Html404, _Garbage], ids=["html", "html-404", "not-http"])
def not_a_hub(request: pytest.FixtureRequest) -> Iterator[str]:
    handler = request.param
    server_class = ThreadingHTTPServer if issubclass(handler, BaseHTTPRequestHandler) else socketserver.TCPServer
    server = server_class(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,))
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_an_endpoint_that_is_not_a_hub(not_a_hub: str) -> None:
    c = HubClient(not_a_hub, timeout_s=10)
    with pytest.raises((HubError, UnknownRevision)) as revision:  # a 404 page reads as no such revision
        c.revision("org/model")
    assert not_a_hub in str(revision.value)
    with pytest.raises(HubError) as search:
        c.search("llama")
    assert not_a_hub in str(search.value)
    if isinstance(revision.value, HubError):
        assert "Hub" in str(revision.value)


def test_an_unreachable_endpoint() -> None:
    with socket.socket() as s:  # a port bound and closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = HubClient(f"http://127.0.0.1:{port}", timeout_s=5)
    for call in (lambda: c.revision("org/m"), lambda: c.search("x"), lambda: c.read("org/m", "a" * 40, "f", length=1)):
        with pytest.raises(HubError) as failed:
            call()
        assert f"cannot reach http://127.0.0.1:{port}" in str(failed.value) and "[hub] endpoint" in str(failed.value)


@pytest.mark.parametrize("name", ["org/name", "Qwen/Qwen3-0.6B-GGUF", "a_b/c.d-e"])
def test_repo_ids(name: str) -> None:
    assert check_repo_id(name) == name


@pytest.mark.parametrize(
    "name", ["", "gpt2", "org/", "/name", "a/b/c", "org/..", "../x", "org/na me", "org/n%2Fx", "o/" + "n" * 97]
)
def test_bad_repo_ids_are_refused_before_a_request(name: str) -> None:
    c = HubClient("http://127.0.0.1:1")  # nothing listens: a request would be a HubError
    with pytest.raises(UsageError, match="ORG/NAME"):
        c.revision(name)
