"""Weights on a node: downloaded once per node from a real HTTP server on loopback, verified,
shared by replicas; names from the control plane never leave the weights directory; a download's
progress in the words a replica's status carries to `ctl models`, `ctl replicas` and the page."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest
import trio

from agent.replica_supervisor import Supervisor
from agent.weights import BadWeightsSource, WeightsMissing, WeightsStore, describe, file_name_of, target_of
from llmgw.download import DownloadError, Progress
from llmgw.log import EventFormatter
from llmgw.selfexec import llmgw_command
from llmgw.wire import agent_link as w
from testlib.fileserver import Files, serve_files
from testlib.proc import llmgw_env

TOKEN = "hf_secret_token_5678"


@pytest.fixture
async def files(nursery: trio.Nursery) -> tuple[Files, str]:
    return await serve_files(nursery)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://h/..%2F..%2Fetc%2Fpasswd",
        "http://h/models/..",
        "http://h/models/%2E%2E",
        "http://h/models/",
        "http://h/a%00b",
        "http://h/.hidden",
        "file:///etc/passwd",
        "http://h/a%5C..%5Cb",
    ],
)
def test_hostile_file_names_are_refused(url: str, tmp_path: Path) -> None:
    with pytest.raises(BadWeightsSource):
        target_of(tmp_path, w.WeightsSource(url=url, sha256="a" * 64))


def test_a_plain_url_lands_under_its_digest(tmp_path: Path) -> None:
    digest = "ab" * 32
    # Dot segments in the URL path are the server's business; only the last segment names the file.
    for url in ("https://h/org/model.gguf?download=1", "https://h/a/../../model.gguf"):
        assert (
            target_of(tmp_path, w.WeightsSource(url=url, sha256=digest)) == tmp_path.resolve() / digest / "model.gguf"
        )
    assert file_name_of("https://h/x/Llama-3.1-8B.Q4_K_M.gguf") == "Llama-3.1-8B.Q4_K_M.gguf"


@pytest.mark.parametrize("digest", ["", "../../etc", "AB" * 31, "g" * 64, "a" * 64 + "/.."])
def test_a_digest_must_be_64_hex_digits(digest: str, tmp_path: Path) -> None:
    with pytest.raises(BadWeightsSource) as info:
        target_of(tmp_path, w.WeightsSource(url="https://h/m.gguf", sha256=digest))
    assert "is not 64 hex digits" in str(info.value)


def test_path_sources_absolute_anywhere_relative_inside(tmp_path: Path) -> None:
    assert target_of(tmp_path, w.WeightsSource(path="/models/llama")) == Path("/models/llama")
    assert target_of(tmp_path, w.WeightsSource(path="llama")) == tmp_path.resolve() / "llama"
    for hostile in ("../../etc/passwd", "a/../../b"):
        with pytest.raises(BadWeightsSource) as info:
            target_of(tmp_path, w.WeightsSource(path=hostile))
        assert "leads outside the weights directory" in str(info.value)


@pytest.mark.trio
async def test_a_path_source_must_exist(tmp_path: Path) -> None:
    store = WeightsStore(tmp_path)
    (tmp_path / "llama").mkdir()
    assert await store.prepare(w.WeightsSource(path="llama")) == str(tmp_path.resolve() / "llama")
    with pytest.raises(WeightsMissing) as info:
        await store.prepare(w.WeightsSource(path=str(tmp_path / "nope")))
    assert "does not exist on this node" in str(info.value)


# -- progress in words -----------------------------------------------------------------------

MIB = 2**20


@pytest.mark.parametrize(
    ("done", "total", "rate", "words"),
    [
        (3 * MIB, 12 * MIB, 1.5 * MIB, "downloading weights: 3 of 12 MiB (25%, 1.5 MiB/s)"),
        (3 * MIB, 12 * MIB, None, "downloading weights: 3 of 12 MiB (25%)"),  # the first look: no rate yet
        (3 * MIB, 12 * MIB, 0.0, "downloading weights: 3 of 12 MiB (25%, 0.0 MiB/s)"),  # stalled
        (3 * MIB, 12 * MIB, -2.0 * MIB, "downloading weights: 3 of 12 MiB (25%)"),  # went back (a piece dropped)
        (12 * MIB - 1, 12 * MIB, None, "downloading weights: 12 of 12 MiB (99%)"),  # 100% only once whole
        (2560 * MIB, 8192 * MIB, 112.4 * MIB, "downloading weights: 2560 of 8192 MiB (31%, 112.4 MiB/s)"),
        (3 * MIB, None, 1.5 * MIB, "downloading weights: 3 MiB (1.5 MiB/s)"),  # a size not known
        (3 * MIB, None, None, "downloading weights: 3 MiB"),
        (3 * MIB, 0, None, "downloading weights: 3 MiB"),  # 0: not known either
    ],
)
def test_a_download_is_described_in_mib_with_its_share_and_rate(
    done: int, total: int | None, rate: float | None, words: str
) -> None:
    assert describe(Progress(url="https://h/m.gguf", done_bytes=done, total_bytes=total), rate) == words


# -- downloads -------------------------------------------------------------------------------


@pytest.mark.trio
async def test_a_download_is_verified_and_done_once_with_the_token_never_logged(
    files, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server, base = files
    data = os.urandom(300_000)
    server.content["/org/m.gguf"] = data
    source = w.WeightsSource(url=f"{base}/org/m.gguf", sha256=sha(data), token=TOKEN)
    store = WeightsStore(tmp_path / "weights")
    server.release = trio.Event()
    waits: list[str] = []
    paths: list[str] = []

    async def prepare() -> None:
        paths.append(await store.prepare(source, on_wait=waits.append))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prepare)
            nursery.start_soon(prepare)
            while len(server.gets) < 1:
                await trio.sleep(0.01)
            server.release.set()
    assert paths[0] == paths[1] == str((tmp_path / "weights").resolve() / sha(data) / "m.gguf")
    assert Path(paths[0]).read_bytes() == data
    assert server.gets == ["/org/m.gguf"] and store.downloads == 1
    assert waits == ["waiting for the download of m.gguf started for another replica"]
    assert server.authorizations == [f"Bearer {TOKEN}"]
    assert TOKEN not in "\n".join(EventFormatter("json").format(r) for r in caplog.records)
    # Another call, even from a fresh store (an agent restart), reuses the verified file.
    assert await WeightsStore(tmp_path / "weights").prepare(source) == paths[0]
    assert server.gets == ["/org/m.gguf"]


@pytest.mark.trio
async def test_a_wrong_checksum_leaves_nothing_usable_and_a_changed_file_is_fetched_again(
    files, tmp_path: Path
) -> None:
    server, base = files
    server.content["/m.bin"] = b"tampered"
    store = WeightsStore(tmp_path)
    with pytest.raises(DownloadError) as info:
        await store.prepare(w.WeightsSource(url=f"{base}/m.bin", sha256=sha(b"original")))
    assert "has sha256" in str(info.value)
    assert not (tmp_path / sha(b"original") / "m.bin").exists()

    server.content["/m.bin"] = b"original"
    source = w.WeightsSource(url=f"{base}/m.bin", sha256=sha(b"original"))
    path = Path(await store.prepare(source))
    path.write_bytes(b"corrupted on disk")  # size and mtime change: checked again, fetched again
    assert Path(await store.prepare(source)).read_bytes() == b"original"
    assert server.gets.count("/m.bin") == 3


@pytest.mark.trio
async def test_two_replicas_share_one_download_and_a_bad_one_fails_with_the_reason(
    files, tmp_path: Path, nursery: trio.Nursery
) -> None:
    server, base = files
    data = os.urandom(100_000)
    server.content["/m.gguf"] = data
    sup = Supervisor(
        state_dir=tmp_path,
        weights=WeightsStore(tmp_path / "weights"),
        engine_command=lambda name: llmgw_command(),
        env=llmgw_env(),
        listen_host="127.0.0.1",
        health_interval_s=0.1,
    )
    await nursery.start(sup.serve)
    good = w.WeightsSource(url=f"{base}/m.gguf", sha256=sha(data))
    bad = w.WeightsSource(url=f"{base}/missing.gguf", sha256=sha(data))

    def member(rid: str, source: w.WeightsSource) -> w.ReplicaAssignment:
        return w.ReplicaAssignment(replica_id=rid, model="m", engine="sim", weights=source, api_key="k", nodes=("n1",))

    sup.assign((member("m-1", good), member("m-2", good), member("m-3", bad)))
    with trio.fail_after(30):
        while [s.state for s in sup.statuses()] != [w.READY, w.READY, w.FAILED]:
            await sup.wait_changed()
    assert server.gets.count("/m.gguf") == 1
    assert "/missing.gguf answered HTTP 404" in sup.statuses()[2].detail
    assert (tmp_path / "weights" / sha(data) / "m.gguf").read_bytes() == data


@pytest.mark.trio
async def test_a_node_caps_weights_at_what_the_control_plane_sent(files, tmp_path: Path) -> None:
    server, base = files
    server.streamed["/model.gguf"] = (b"x" * 65536, 64)
    store = WeightsStore(tmp_path / "weights")
    # No size: the maximum the control plane sent ([downloads].max_weights_gib, here 1 MiB).
    with pytest.raises(DownloadError, match=r"sent more than 1048576 bytes .* \[downloads\]\.max_weights_gib"):
        await store.prepare(w.WeightsSource(url=f"{base}/model.gguf", sha256="a" * 64, max_bytes=1 << 20))
    # A size: that.
    with pytest.raises(DownloadError, match="sent more than 65536 bytes, the size server.toml gives it"):
        await store.prepare(w.WeightsSource(url=f"{base}/model.gguf", sha256="a" * 64, size=65536, max_bytes=1 << 20))
    assert list((tmp_path / "weights" / ("a" * 64)).iterdir()) == []
