"""testlib.hubserver answers as the Hugging Face Hub does: every route, Range, the Hub's errors,
the LFS redirect to a CDN that needs no Authorization, each fault a test can arm, and the
process mode. The stdlib's urllib stands in for an independent client (it follows the redirect
and must not carry an unredirected Authorization to the CDN)."""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import struct
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlsplit

import gguf
import pytest

from testlib.hubrepo import HubRepo, git_oid, lfs_pointer
from testlib.hubrepos import gguf_repo, safetensors_files, tiny_gguf
from testlib.hubserver import HubServer
from testlib.hubspec import HubProcess, write_spec

BIG = bytes(range(256)) * 1000  # 256000 bytes, an LFS file by name
CONFIG = b'{"model_type": "llama"}'
TOKEN = "hf_granted"


def repos() -> list[HubRepo]:
    plain = HubRepo("org/plain", {"README.md": b"# plain\n", "config.json": CONFIG, "m.gguf": BIG})
    plain.tag("v1")
    plain.commit({"README.md": b"# plain, second\n", "sub/dir/x.txt": b"x"})
    plain.open_pr({"README.md": b"# a pull request\n"})
    return [
        plain,
        HubRepo("org/gated", {"m.gguf": BIG, "a.txt": b"a"}, gated="manual", token=TOKEN),
        HubRepo("org/private", {"a.txt": b"a"}, private=True, token=TOKEN),
        HubRepo("other/model", {"a.txt": b"b"}, tags=["chat"]),
    ]


@pytest.fixture
def hub():
    with HubServer(repos(), users=["hf_user"]) as server:
        yield server


def request(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    """One request on a connection of its own, no redirect followed; the body read."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers or {})
    response = connection.getresponse()
    response.body = response.read()  # type: ignore[attr-defined]
    connection.close()
    return response


def api(hub: HubServer, path: str, **headers: str) -> object:
    response = request(f"{hub.url}{path}", headers=headers)
    assert response.status == 200, (response.status, response.body)  # type: ignore[attr-defined]
    return json.loads(response.body)  # type: ignore[attr-defined]


def test_model_info_at_each_kind_of_revision(hub: HubServer) -> None:
    plain = hub.repos["org/plain"]
    main, v1 = plain.branches["main"], plain.tag_refs["v1"]
    info = api(hub, "/api/models/org/plain")
    assert info["id"] == "org/plain" and info["sha"] == main and info["private"] is False and info["gated"] is False
    assert [s["rfilename"] for s in info["siblings"]] == ["README.md", "config.json", "m.gguf", "sub/dir/x.txt"]
    assert "size" not in info["siblings"][0] and info["lastModified"].endswith("Z") and "gguf" in info["tags"]
    assert api(hub, "/api/models/org/plain/revision/main") == info
    old = api(hub, f"/api/models/org/plain/revision/{v1}?blobs=true")
    assert old["sha"] == v1 and api(hub, "/api/models/org/plain/revision/v1")["sha"] == v1
    readme, config, lfs = old["siblings"]
    assert readme == {"rfilename": "README.md", "blobId": git_oid("blob", b"# plain\n"), "size": 8}
    sha256 = hashlib.sha256(BIG).hexdigest()
    assert lfs["lfs"] == {
        "sha256": sha256,
        "size": len(BIG),
        "pointerSize": len(lfs_pointer(hashlib.sha256(BIG).hexdigest(), len(BIG))),
    } and lfs["size"] == len(BIG)
    assert config["rfilename"] == "config.json" and "lfs" not in config
    assert (
        api(hub, f"/api/models/org/plain/revision/{quote('refs/pr/1', safe='')}")["sha"] == plain.branches["refs/pr/1"]
    )
    assert api(hub, "/api/models/org/gated")["gated"] == "manual"  # a gated repo's metadata is public


def test_list_models(hub: HubServer) -> None:
    found = api(hub, "/api/models?search=plain&limit=10")
    assert [m["id"] for m in found] == ["org/plain"] and "siblings" not in found[0]
    full = api(hub, "/api/models?search=org&full=true")
    assert [m["id"] for m in full] == ["org/plain", "org/gated"]  # not the private one
    assert (
        full[0]["siblings"][0] == {"rfilename": "README.md"}
        and full[0]["sha"] == hub.repos["org/plain"].branches["main"]
    )
    assert [m["id"] for m in api(hub, "/api/models?author=other")] == ["other/model"]
    assert [m["id"] for m in api(hub, "/api/models?filter=chat")] == ["other/model"]
    assert len(api(hub, "/api/models?limit=1")) == 1
    assert "org/private" in [m["id"] for m in api(hub, "/api/models", Authorization=f"Bearer {TOKEN}")]


def test_tree(hub: HubServer) -> None:
    top = api(hub, "/api/models/org/plain/tree/main")
    assert [(e["type"], e["path"]) for e in top] == [
        ("file", "README.md"),
        ("file", "config.json"),
        ("file", "m.gguf"),
        ("directory", "sub"),
    ]
    lfs = top[2]
    assert lfs["lfs"] == {
        "oid": hashlib.sha256(BIG).hexdigest(),
        "size": len(BIG),
        "pointerSize": len(lfs_pointer(hashlib.sha256(BIG).hexdigest(), len(BIG))),
    }
    assert lfs["size"] == len(BIG) and len(lfs["oid"]) == 40 and top[3]["size"] == 0
    deep = api(hub, "/api/models/org/plain/tree/main/sub?recursive=true")
    assert [e["path"] for e in deep] == ["sub/dir", "sub/dir/x.txt"]
    assert [e["path"] for e in api(hub, "/api/models/org/plain/tree/v1?recursive=true")] == [
        "README.md",
        "config.json",
        "m.gguf",
    ]
    hub.tree_page_size = 2
    url, pages, paths = f"{hub.url}/api/models/org/plain/tree/main?recursive=true", 0, []
    while url:  # as huggingface_hub's paginate: the next page is the Link header's rel="next"
        page = request(url)
        paths += [e["path"] for e in json.loads(page.body)]  # type: ignore[attr-defined]
        link = page.headers["Link"] or ""
        assert not link or link.endswith('>; rel="next"')
        url, pages = link[1 : link.find(">")], pages + 1
    assert pages == 3 and paths == ["README.md", "config.json", "m.gguf", "sub", "sub/dir", "sub/dir/x.txt"]
    missing = request(f"{hub.url}/api/models/org/plain/tree/main/nope")
    assert (missing.status, missing.headers["X-Error-Code"]) == (404, "EntryNotFound")


def test_resolve_a_small_file(hub: HubServer) -> None:
    plain = hub.repos["org/plain"]
    for method in ("HEAD", "GET"):
        response = request(f"{hub.url}/org/plain/resolve/main/config.json", method)
        assert response.status == 200
        assert response.headers["ETag"] == f'"{git_oid("blob", CONFIG)}"'
        assert response.headers["X-Repo-Commit"] == plain.branches["main"]
        assert response.headers["Content-Length"] == "23"
        assert response.body == (b"" if method == "HEAD" else CONFIG)  # type: ignore[attr-defined]
    old = request(f"{hub.url}/org/plain/resolve/{plain.tag_refs['v1']}/README.md")
    assert old.body == b"# plain\n" and old.headers["X-Repo-Commit"] == plain.tag_refs["v1"]  # type: ignore[attr-defined]
    pr = request(f"{hub.url}/org/plain/resolve/refs%2Fpr%2F1/README.md")
    assert (
        pr.body == b"# a pull request\n" and request(f"{hub.url}/org/plain/resolve/refs/pr/1/README.md").body == pr.body
    )  # type: ignore[attr-defined]
    assert request(f"{hub.url}/org/plain/resolve/main/sub/dir/x.txt").body == b"x"  # type: ignore[attr-defined]


def test_resolve_an_lfs_file_redirects_to_the_cdn(hub: HubServer) -> None:
    sha256 = hashlib.sha256(BIG).hexdigest()
    head = request(f"{hub.url}/org/plain/resolve/main/m.gguf", "HEAD")
    assert head.status == 302
    assert head.headers["X-Linked-Etag"] == f'"{sha256}"' and head.headers["X-Linked-Size"] == str(len(BIG))
    assert head.headers["X-Repo-Commit"] == hub.repos["org/plain"].branches["main"] and head.headers["ETag"]
    location = head.headers["Location"]
    assert location.startswith(f"{hub.cdn_url}/cdn/lfs/{sha256}?")  # absolute, another origin: not followed as a rename
    cdn = request(location)
    assert cdn.status == 200 and cdn.body == BIG and cdn.headers["Content-Length"] == str(len(BIG))  # type: ignore[attr-defined]
    tampered = request(location.replace("path=m.gguf", "path=x.gguf"))
    assert tampered.status == 403


def test_urllib_follows_the_redirect_without_the_token(hub: HubServer) -> None:
    """As huggingface_hub drops Authorization for the CDN's signed URL, urllib does for a header
    added unredirected; the CDN serves without it."""
    hub.cdn_refuses_authorization = True  # as S3 refuses a presigned URL with another auth
    req = urllib.request.Request(f"{hub.url}/org/gated/resolve/main/m.gguf")
    req.add_unredirected_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(req, timeout=30) as response:
        assert response.read() == BIG and urlsplit(response.url).port == urlsplit(hub.cdn_url).port
    (resolve,) = hub.log.requests(kind="resolve")
    (cdn,) = hub.log.requests(kind="cdn")
    assert resolve.authorization == f"Bearer {TOKEN}" and resolve.status == 302
    assert cdn.authorization is None and cdn.status == 200 and hub.log.bytes_sent("m.gguf") == len(BIG)
    forwarded = request(resolve_location(hub, "org/gated", "m.gguf"), headers={"Authorization": f"Bearer {TOKEN}"})
    assert forwarded.status == 400


def resolve_location(hub: HubServer, repo: str, path: str) -> str:
    return request(f"{hub.url}/{repo}/resolve/main/{path}", "HEAD", {"Authorization": f"Bearer {TOKEN}"}).headers[
        "Location"
    ]


@pytest.mark.parametrize("where", ["resolve", "cdn"])
def test_ranges(hub: HubServer, where: str) -> None:
    url = (
        f"{hub.url}/org/plain/resolve/main/README.md"
        if where == "resolve"
        else resolve_location(hub, "org/plain", "m.gguf")
    )
    body = b"# plain, second\n" if where == "resolve" else BIG
    n = len(body)
    tail = request(url, headers={"Range": "bytes=5-"})
    assert (tail.status, tail.body, tail.headers["Content-Range"]) == (206, body[5:], f"bytes 5-{n - 1}/{n}")  # type: ignore[attr-defined]
    middle = request(url, headers={"Range": "bytes=2-9"})
    assert (middle.status, middle.body, middle.headers["Content-Length"]) == (206, body[2:10], "8")  # type: ignore[attr-defined]
    assert request(url, headers={"Range": "bytes=-3"}).body == body[-3:]  # type: ignore[attr-defined]
    past = request(url, headers={"Range": f"bytes={n}-"})
    assert (past.status, past.headers["Content-Range"]) == (416, f"bytes */{n}")
    assert request(url, headers={"Range": "bytes=0-1,4-5"}).status == 200  # several ranges: the whole file
    assert hub.log.partial_responses == 3


def error(hub: HubServer, path: str, token: str | None = None, method: str = "GET") -> tuple[int, str | None, str]:
    response = request(f"{hub.url}{path}", method, {"Authorization": f"Bearer {token}"} if token else {})
    if method == "GET":
        assert json.loads(response.body)["error"] == response.headers["X-Error-Message"]  # type: ignore[attr-defined]
    return response.status, response.headers["X-Error-Code"], response.headers["X-Error-Message"]


def test_errors_as_the_hub_sends_them(hub: HubServer) -> None:
    assert error(hub, "/api/models/org/nope")[:2] == (401, "RepoNotFound")  # anonymous: 401
    assert error(hub, "/api/models/org/nope", "hf_user")[:2] == (404, "RepoNotFound")  # signed in: 404
    assert error(hub, "/org/nope/resolve/main/a.txt", method="HEAD")[:2] == (401, "RepoNotFound")
    assert error(hub, "/api/models/org/private")[:2] == (401, "RepoNotFound")  # private: as if it did not exist
    assert error(hub, "/org/private/resolve/main/a.txt", "hf_user")[:2] == (404, "RepoNotFound")
    assert (
        request(f"{hub.url}/org/private/resolve/main/a.txt", headers={"Authorization": f"Bearer {TOKEN}"}).body == b"a"
    )  # type: ignore[attr-defined]
    assert error(hub, "/api/models/org/plain/revision/nope") == (404, "RevisionNotFound", "Invalid rev id: nope")
    assert error(hub, "/org/plain/resolve/nope/README.md", method="HEAD")[:2] == (404, "RevisionNotFound")
    assert error(hub, "/org/plain/resolve/main/nope.txt") == (404, "EntryNotFound", "Entry not found")
    status, code, message = error(hub, "/org/gated/resolve/main/a.txt")
    assert (status, code) == (401, "GatedRepo") and "Please log in" in message
    status, code, message = error(hub, "/org/gated/resolve/main/a.txt", "hf_user")
    assert (status, code) == (403, "GatedRepo") and "not in the authorized list" in message
    assert error(hub, "/org/gated/resolve/main/m.gguf", "hf_user", "HEAD")[:2] == (403, "GatedRepo")
    assert (
        request(f"{hub.url}/org/gated/resolve/main/a.txt", headers={"Authorization": f"Bearer {TOKEN}"}).status == 200
    )
    # A token the Hub does not know is refused everywhere, even for a public repo, with no code.
    assert error(hub, "/api/models/org/plain", "hf_revoked") == (
        401,
        None,
        "Invalid credentials in Authorization header",
    )


def test_a_file_changed_between_two_commits() -> None:
    repo = HubRepo("org/m", {"w.gguf": b"one" * 100})
    first = repo.branches["main"]
    second = repo.commit({"w.gguf": b"two" * 100})
    assert first != second and len(second) == 40 and repo.commits[second].parent == first
    assert HubRepo("org/m", {"w.gguf": b"one" * 100}).branches["main"] == first  # ids come from the content
    with HubServer([repo]) as hub:
        old = urllib.request.urlopen(f"{hub.url}/org/m/resolve/{first}/w.gguf", timeout=30).read()
        new = urllib.request.urlopen(f"{hub.url}/org/m/resolve/main/w.gguf", timeout=30).read()
        assert (old, new) == (b"one" * 100, b"two" * 100)


def test_keep_alive_and_a_cut_closes_the_connection(hub: HubServer) -> None:
    location = resolve_location(hub, "org/plain", "m.gguf")
    hub.faults.cut("m.gguf", after=1000)
    parts = urlsplit(location)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    for _ in range(2):  # two requests on one connection
        connection.request("GET", f"{parts.path}?{parts.query}", headers={"Range": "bytes=0-9"})
        assert connection.getresponse().read() == BIG[:10]
    connection.request("GET", f"{parts.path}?{parts.query}")
    response = connection.getresponse()
    with pytest.raises(http.client.IncompleteRead) as cut:
        response.read()
    assert cut.value.partial == BIG[:1000]
    connection.close()
    assert request(location).body == BIG  # once: the next download is whole  # type: ignore[attr-defined]
    assert [s.cut for s in hub.log.requests(kind="cdn")] == [False, False, True, False]


def test_faults(hub: HubServer) -> None:
    location = resolve_location(hub, "org/plain", "m.gguf")
    sha256 = hashlib.sha256(BIG).hexdigest()
    hub.faults.cut(sha256, after=10, times=None)
    for _ in range(2):
        with pytest.raises(http.client.IncompleteRead):
            request(location)
    hub.faults.clear()
    hub.faults.corrupt("m.gguf", at=70000)
    corrupt = request(location).body  # type: ignore[attr-defined]
    assert len(corrupt) == len(BIG) and hashlib.sha256(corrupt).hexdigest() != sha256 and corrupt[70000] != BIG[70000]
    assert (
        request(location, headers={"Range": "bytes=0-99"}).body == BIG[:100]
    )  # the fault waits for a body covering 70000  # type: ignore[attr-defined]
    assert request(location).body == BIG  # type: ignore[attr-defined]
    hub.faults.fail("m.gguf", status=503)
    assert request(f"{hub.url}/org/plain/resolve/main/m.gguf", "HEAD").status == 503
    assert request(f"{hub.url}/org/plain/resolve/main/m.gguf", "HEAD").status == 302
    hub.faults.fail("README.md", status=500, where="resolve")
    assert request(f"{hub.url}/org/plain/resolve/main/README.md").status == 500
    refusal = hub.faults.refuse_range("m.gguf")
    whole = request(location, headers={"Range": "bytes=100-"})
    assert whole.status == 200 and whole.body == BIG and refusal.reached.is_set()  # type: ignore[attr-defined]
    assert hub.log.count(kind="cdn", status=503) == 0 and hub.log.count(kind="resolve", status=503) == 1


def test_a_stall_holds_the_body_until_released(hub: HubServer) -> None:
    location = resolve_location(hub, "org/plain", "m.gguf")
    stall = hub.faults.stall("m.gguf", after=5000)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(request(location).body))  # type: ignore[attr-defined]
    reader.start()
    stall.wait_reached()
    (served,) = hub.log.requests(kind="cdn")
    assert served.body_bytes == 5000 and not got
    stall.release()
    reader.join()
    assert got == [BIG] and hub.log.bytes_sent("m.gguf") == len(BIG)


def test_closing_cuts_a_stalled_body() -> None:
    hub = HubServer(repos()).start()
    location = resolve_location(hub, "org/plain", "m.gguf")
    stall = hub.faults.stall("m.gguf", after=100)
    failures: list[BaseException] = []

    def download() -> None:
        try:
            request(location)
        except (http.client.IncompleteRead, ConnectionError) as e:
            failures.append(e)

    reader = threading.Thread(target=download)
    reader.start()
    stall.wait_reached()
    hub.close()  # returns: the stalled handler's thread was ended and joined
    reader.join()
    assert len(failures) == 1 and hub.log.requests(kind="cdn")[0].cut


def test_the_makers_lay_repos_out_as_the_hub_has_them(tmp_path: Path) -> None:
    repo = gguf_repo()
    files = repo.resolve("main").files
    assert sorted(files) == [
        ".gitattributes", "README.md", "Tiny-Llama-Q4_K_M.gguf", "Tiny-Llama-Q6_K-00001-of-00002.gguf",
        "Tiny-Llama-Q6_K-00002-of-00002.gguf", "Tiny-Llama-Q8_0.gguf",
    ]  # fmt: skip
    assert files["Tiny-Llama-Q4_K_M.gguf"].content == tiny_gguf(0) and files["Tiny-Llama-Q4_K_M.gguf"].lfs
    counts = []
    for i in (1, 2):
        path = tmp_path / f"part{i}.gguf"
        path.write_bytes(files[f"Tiny-Llama-Q6_K-0000{i}-of-00002.gguf"].content)
        reader = gguf.GGUFReader(path)
        assert reader.fields["split.no"].contents() == i - 1 and reader.fields["split.count"].contents() == 2
        counts.append(len(reader.tensors))
    assert sum(counts) == reader.fields["split.tensors.count"].contents() == 21

    st = safetensors_files()
    config = json.loads(st["config.json"])
    index = json.loads(st["model.safetensors.index.json"])
    total = 0
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        data = st[name]
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        assert length % 8 == 0 and header.pop("__metadata__") == {"format": "pt"}
        end = max(t["data_offsets"][1] for t in header.values())
        assert 8 + length + end == len(data)
        for tensor, meta in header.items():
            assert index["weight_map"][tensor] == name and meta["dtype"] == "BF16"
            assert meta["data_offsets"][1] - meta["data_offsets"][0] == 2 * math.prod(meta["shape"])
            total += meta["data_offsets"][1] - meta["data_offsets"][0]
    assert index["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert (
        index["metadata"]["total_size"] == total and len(index["weight_map"]) == 2 + 9 * config["num_hidden_layers"] + 1
    )
    # A byte-level BPE tokenizer as `tokenizers` writes one: its model, a vocabulary holding
    # every byte's token, and merges made of tokens the vocabulary has.
    tok = json.loads(st["tokenizer.json"])
    model = tok["model"]
    assert model["type"] == "BPE" and tok["pre_tokenizer"]["type"] == "ByteLevel"
    assert len(set(model["vocab"].values())) == len(model["vocab"]) >= 256
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    assert all(len(pair) == 2 and all(part in model["vocab"] for part in pair) for pair in merges)


def test_as_a_process_of_its_own(tmp_path: Path) -> None:
    defined = repos()
    spec = write_spec(defined, tmp_path, users=["hf_user"], faults=[{"kind": "fail", "target": "a.txt", "status": 503}])
    with HubProcess(spec) as process:
        assert (tmp_path / "hubserver.port").read_text().strip() == process.url.rsplit(":", 1)[1]
        assert request(f"{process.url}/other/model/resolve/main/a.txt").status == 503  # the spec's fault
        info = json.loads(request(f"{process.url}/api/models/org/plain/revision/v1").body)  # type: ignore[attr-defined]
        assert info["sha"] == defined[0].tag_refs["v1"]  # the same commits as in code
        with urllib.request.urlopen(f"{process.url}/org/plain/resolve/main/m.gguf", timeout=30) as response:
            assert response.read() == BIG
        arm = urllib.request.Request(
            f"{process.url}/_hubserver/faults",
            data=json.dumps({"kind": "cut", "target": "m.gguf", "after": 10}).encode(),
        )
        assert json.load(urllib.request.urlopen(arm, timeout=30)) == {"armed": True}
        with pytest.raises(http.client.IncompleteRead):
            urllib.request.urlopen(f"{process.url}/org/plain/resolve/main/m.gguf", timeout=30).read()
        served = json.load(urllib.request.urlopen(f"{process.url}/_hubserver/log", timeout=30))
        assert [s["cut"] for s in served if s["kind"] == "cdn"] == [False, True]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{process.url}/api/models/org/private", timeout=30)
        assert refused.value.code == 401 and refused.value.headers["X-Error-Code"] == "RepoNotFound"
    assert process.process is not None and process.process.returncode == 0
