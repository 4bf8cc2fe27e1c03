"""A Hub model's weights on a node, from testlib.hubserver on loopback: each file downloaded once
into WEIGHTS/<sha256>/, verified, resumed with Range after a cut anywhere, laid out as the
repository by links; unsafe names refused before a request; `collect` deleting what no one
keeps or uses; progress over all of a model's files."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from agent.weights import BadWeightsSource, WeightsStore, blob_of, check_repo_path, hub_dir_of
from llmgw.download import CHUNK, DownloadError
from llmgw.wire import agent_link as w
from testlib.hubrepo import HubRepo
from testlib.hubrepos import safetensors_files
from testlib.hubrepos import weights_source as source
from testlib.hubserver import HubServer
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

BIG = hashlib.sha256(b"seed").digest() * (3 * CHUNK // 32)  # 3 MiB: progress shows within it
SMALL = bytes(range(256)) * 64  # 16 KiB, LFS by its name
PARTS = (b"part one " * 5000, b"part two " * 4000)
TOKEN = "hf_weights_token_777"
REPO = "org/model-GGUF"
ST = "org/tiny-llama"


@pytest.fixture
def hub() -> Iterator[HubServer]:
    repos = [
        HubRepo(
            REPO,
            {
                "README.md": b"# model\n",
                "m-Q4_K_M.gguf": SMALL,
                "m-Q8_0.gguf": BIG,
                "split/m-Q6_K-00001-of-00002.gguf": PARTS[0],
                "split/m-Q6_K-00002-of-00002.gguf": PARTS[1],
            },
        ),
        HubRepo(ST, safetensors_files()),
        HubRepo("org/gated", {"m-Q4_K_M.gguf": SMALL}, gated="manual", token=TOKEN),
    ]
    with HubServer(repos) as server:
        yield server


@pytest.fixture
def store(tmp_path: Path) -> WeightsStore:
    return WeightsStore(tmp_path / "weights")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_a_gguf_is_laid_out_as_its_repository_and_its_path_returned(hub: HubServer, store: WeightsStore) -> None:
    src = source(hub, REPO, "split/m-Q6_K-00001-of-00002.gguf", "split/m-Q6_K-00002-of-00002.gguf")
    path = Path(await store.prepare(src))
    directory = store.root.resolve() / "hub" / "org--model-GGUF" / src.commit
    assert path == directory / "split" / "m-Q6_K-00001-of-00002.gguf"
    for f, data in zip(src.files, PARTS, strict=True):
        link = directory / f.path
        assert link.is_symlink() and Path(os.readlink(link)) == store.root.resolve() / sha(data) / link.name
        assert link.read_bytes() == data
    assert sorted(p.name for p in store.root.iterdir()) == sorted([sha(PARTS[0]), sha(PARTS[1]), "hub"])
    assert not list(store.root.rglob("*.part")) and not list(store.root.rglob("*.new"))
    assert store.downloads == 2 and await store.prepare(src) == str(path) and store.downloads == 2


async def test_a_directory_source_returns_the_directory(hub: HubServer, store: WeightsStore) -> None:
    content = safetensors_files()
    names = ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    src = source(hub, ST, *names, directory=True)
    path = Path(await store.prepare(src))
    assert path == store.root.resolve() / "hub" / "org--tiny-llama" / src.commit
    assert sorted(p.name for p in path.iterdir()) == sorted(names)
    assert all((path / n).read_bytes() == content[n] for n in names)
    assert hub.log.count(kind="resolve", status=200) == 2 and hub.log.count(kind="cdn", status=200) == 2


async def test_two_models_of_one_commit_keep_each_others_files(hub: HubServer, store: WeightsStore) -> None:
    """Two quantisations of one repository are two models laid out in one commit's directory:
    the second must not take the first's file away from under its replica."""
    q4, q8 = source(hub, REPO, "m-Q4_K_M.gguf"), source(hub, REPO, "m-Q8_0.gguf")
    first = Path(await store.prepare(q4))
    second = Path(await store.prepare(q8))
    assert first.parent == second.parent and first.read_bytes() == SMALL and second.read_bytes() == BIG
    assert await store.collect({q8.files[0].sha256}, []) == [sha(SMALL)]
    assert not first.exists() and not first.is_symlink() and second.read_bytes() == BIG  # the dangling link only


@pytest.mark.parametrize("offset", [0, 1, CHUNK, len(BIG) // 2, len(BIG) - 1])
async def test_a_cut_body_resumes_with_range(hub: HubServer, store: WeightsStore, offset: int) -> None:
    src = source(hub, REPO, "m-Q8_0.gguf")
    hub.faults.cut("m-Q8_0.gguf", after=offset)
    with pytest.raises(DownloadError, match="resumes next time"):
        await store.prepare(src)
    (part,) = store.root.rglob("*.part")
    assert part.stat().st_size == offset and not (store.root / "hub").exists()  # no layout before it is whole
    path = Path(await store.prepare(src))
    assert path.read_bytes() == BIG and not list(store.root.rglob("*.part"))
    assert hub.log.partial_responses == (1 if offset else 0)
    if offset:
        assert hub.log.requests(kind="cdn")[-1].range == f"bytes={offset}-"
    assert hub.log.bytes_sent("m-Q8_0.gguf") == len(BIG)  # not a byte twice


async def test_a_failed_redirect_then_a_cut_small_file(hub: HubServer, store: WeightsStore) -> None:
    config = safetensors_files()["config.json"]
    src = source(hub, ST, "config.json", "model-00001-of-00002.safetensors", directory=True)
    hub.faults.fail("model-00001-of-00002.safetensors", status=503, where="resolve")  # the redirect itself
    with pytest.raises(DownloadError, match="503"):
        await store.prepare(src)
    assert hub.log.count(kind="cdn") == 0
    (store.root / sha(config) / "config.json").unlink()  # fetch it again, cut this time
    hub.faults.cut("config.json", after=100)
    with pytest.raises(DownloadError):
        await store.prepare(src)
    path = Path(await store.prepare(src))
    assert (path / "config.json").read_bytes() == config
    resumed = hub.log.requests(kind="resolve", path="config.json", status=206)
    assert [s.range for s in resumed] == ["bytes=100-"]
    assert hub.log.bytes_sent("config.json") == 2 * len(config)  # once whole, then cut and resumed


async def test_a_corrupt_byte_is_refused_and_the_part_removed(hub: HubServer, store: WeightsStore) -> None:
    src = source(hub, REPO, "m-Q8_0.gguf")
    hub.faults.corrupt("m-Q8_0.gguf", at=12345)
    with pytest.raises(DownloadError, match="sha256"):
        await store.prepare(src)
    assert not list(store.root.rglob("*.part")) and not (store.root / sha(BIG) / "m-Q8_0.gguf").exists()
    assert not (store.root / "hub").exists()
    assert Path(await store.prepare(src)).read_bytes() == BIG


async def test_a_file_changed_on_disk_is_fetched_again(hub: HubServer, store: WeightsStore) -> None:
    src = source(hub, REPO, "m-Q4_K_M.gguf")
    path = Path(await store.prepare(src))
    blob = path.resolve()
    blob.write_bytes(b"x" * len(SMALL))
    assert Path(await store.prepare(src)).read_bytes() == SMALL and store.downloads == 2


async def test_two_prepares_sharing_a_file_download_it_once(hub: HubServer, store: WeightsStore) -> None:
    old = source(hub, REPO, "m-Q8_0.gguf")
    hub.repos[REPO].commit({"README.md": b"# changed\n"})
    new = source(hub, REPO, "m-Q8_0.gguf")
    assert old.commit != new.commit and old.files[0].sha256 == new.files[0].sha256
    stall = hub.faults.stall("m-Q8_0.gguf", after=1000)
    waiting = trio.Event()
    told: list[str] = []

    def on_wait(message: str) -> None:
        told.append(message)
        waiting.set()

    results: dict[str, str] = {}

    async def prepare(name: str, src: w.WeightsSource, tell: Callable[[str], None] | None = None) -> None:
        results[name] = await store.prepare(src, on_wait=tell)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(prepare, "old", old)
        await trio.to_thread.run_sync(stall.wait_reached)
        nursery.start_soon(prepare, "new", new, on_wait)
        await waiting.wait()
        stall.release()
    assert hub.log.count(kind="cdn") == 1 and store.downloads == 1
    assert told == ["waiting for the download of m-Q8_0.gguf started for another replica"]
    assert Path(results["old"]).read_bytes() == Path(results["new"]).read_bytes() == BIG
    assert Path(results["old"]).parent != Path(results["new"]).parent  # one directory per commit


async def test_a_gated_files_token_goes_to_the_hub_only(hub: HubServer, store: WeightsStore) -> None:
    hub.cdn_refuses_authorization = True
    with pytest.raises(DownloadError, match="401"):
        await store.prepare(source(hub, "org/gated", "m-Q4_K_M.gguf"))
    path = await store.prepare(source(hub, "org/gated", "m-Q4_K_M.gguf", token=TOKEN))
    assert Path(path).read_bytes() == SMALL
    assert [s.authorization for s in hub.log.requests(kind="resolve")][-1] == f"Bearer {TOKEN}"
    assert all(s.authorization is None for s in hub.log.requests(kind="cdn"))


def hostile(hub: HubServer, **change: object) -> w.WeightsSource:
    src = source(hub, REPO, "m-Q4_K_M.gguf")
    files = change.pop("files", src.files)
    if isinstance(files, dict):
        files = (w.WeightsFile(**{"path": "m.gguf", "url": src.files[0].url, "sha256": "a" * 64, "size": 1} | files),)
    return w.WeightsSource(**{"repo": src.repo, "commit": src.commit, "files": files} | change)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"repo": "../etc"},
        {"repo": "org/../x"},
        {"repo": "org/na/me"},
        {"repo": "org"},
        {"repo": "org/.."},
        {"repo": "/abs/x"},
        {"commit": "main"},
        {"commit": "A" * 40},
        {"commit": "a" * 39},
        {"commit": "../" + "a" * 37},
        {"files": ()},
        {"files": {"path": "../m.gguf"}},
        {"files": {"path": "a/../../m.gguf"}},
        {"files": {"path": "/etc/passwd"}},
        {"files": {"path": ".hidden"}},
        {"files": {"path": "a//b"}},
        {"files": {"path": ""}},
        {"files": {"path": "a/b/c/d/e/f.gguf"}},
        {"files": {"path": "a\\..\\b"}},
        {"files": {"sha256": "g" * 64}},
        {"files": {"sha256": "a" * 63}},
        {"files": {"sha256": "../" + "a" * 61}},
    ],
)
async def test_unsafe_names_are_refused_before_any_request(
    hub: HubServer, store: WeightsStore, change: dict[str, object]
) -> None:
    with pytest.raises(BadWeightsSource):
        await store.prepare(hostile(hub, **dict(change)))
    assert list(hub.log) == [] and not store.root.exists()


async def test_the_name_checks() -> None:
    assert check_repo_path("a/b.c/d_e-f.gguf") == ("a", "b.c", "d_e-f.gguf")
    root = Path("/w")
    f = w.WeightsFile(path="dir/m.gguf", url="http://h/x", sha256="AB" * 32, size=1)
    assert blob_of(root, f) == Path("/w") / ("ab" * 32) / "m.gguf"  # any case of hex, stored lower
    src = w.WeightsSource(repo="o/n", commit="c" * 40, files=(f,))
    assert hub_dir_of(root, src) == Path("/w/hub/o--n") / ("c" * 40)


async def test_collect_deletes_what_is_neither_kept_nor_used(hub: HubServer, store: WeightsStore) -> None:
    split = source(hub, REPO, "split/m-Q6_K-00001-of-00002.gguf", "split/m-Q6_K-00002-of-00002.gguf")
    q4 = source(hub, "org/gated", "m-Q4_K_M.gguf", token=TOKEN)
    split_path, q4_path = Path(await store.prepare(split)), Path(await store.prepare(q4))
    (store.root / ("f" * 64)).mkdir()  # a digest directory no one names
    (store.root / "notes.txt").write_text("the operator's")
    assert await store.collect(set(), [split, q4]) == ["f" * 64]  # in use: kept
    assert split_path.read_bytes() == PARTS[0] and q4_path.read_bytes() == SMALL
    kept = {f.sha256.upper() for f in split.files}  # any case
    assert await store.collect(kept, []) == [sha(SMALL)]
    assert not (store.root / "hub" / "org--gated").exists() and split_path.read_bytes() == PARTS[0]
    assert sorted(await store.collect(set(), [])) == sorted(sha(p) for p in PARTS)
    assert sorted(p.name for p in store.root.iterdir()) == ["hub", "notes.txt"]
    assert list((store.root / "hub").iterdir()) == []
    assert Path(await store.prepare(split)).read_bytes() == PARTS[0]  # and back again


async def test_collect_keeps_a_download_in_progress(hub: HubServer, store: WeightsStore) -> None:
    src = source(hub, REPO, "m-Q8_0.gguf")
    stall = hub.faults.stall("m-Q8_0.gguf", after=1000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.prepare, src)
        await trio.to_thread.run_sync(stall.wait_reached)
        # The server stopped after 1000 bytes; the download's thread writes them to its part.
        await await_true(lambda: list(store.root.rglob("*.part")), "the download's part file")
        assert await store.collect(set(), []) == [] and list(store.root.rglob("*.part"))
        stall.release()
    assert (store.root / sha(BIG) / "m-Q8_0.gguf").read_bytes() == BIG


async def test_progress_of_a_multi_file_source(hub: HubServer, store: WeightsStore) -> None:
    src = source(hub, REPO, "m-Q4_K_M.gguf", "m-Q8_0.gguf")
    assert store.progress(src) is None
    stall = hub.faults.stall("m-Q8_0.gguf", after=CHUNK + 1000)
    chunk_seen = threading.Event()

    class Watched(dict):  # the download thread's progress, seen as it is written
        def __setitem__(self, key: str, value: object) -> None:
            super().__setitem__(key, value)
            if getattr(value, "done_bytes", 0) >= CHUNK:
                chunk_seen.set()

    store._progress = Watched()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.prepare, src)
        await trio.to_thread.run_sync(chunk_seen.wait, 30)
        progress = store.progress(src)
        assert progress is not None and progress.url == REPO
        assert (progress.done_bytes, progress.total_bytes) == (len(SMALL) + CHUNK, len(SMALL) + len(BIG))
        stall.release()
    assert store.progress(src) is None


async def test_progress_between_two_files_is_not_none(hub: HubServer, store: WeightsStore) -> None:
    """The first file done, the second not through its first chunk: the source is downloading."""
    src = source(hub, REPO, "m-Q4_K_M.gguf", "m-Q8_0.gguf")
    stall = hub.faults.stall("m-Q8_0.gguf", after=1000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.prepare, src)
        await trio.to_thread.run_sync(stall.wait_reached)
        progress = store.progress(src)
        assert progress is not None and (progress.done_bytes, progress.total_bytes) == (
            len(SMALL),
            len(SMALL) + len(BIG),
        )
        stall.release()


async def test_a_tidy_up_waits_for_a_layout_half_done(
    hub: HubServer, store: WeightsStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collect while a model's directory is being laid out (its staging `.new` made, not yet
    renamed into place) must not take the `.new` for a crash's leftover: it waits for the layout
    (seen in test_hub_models: `os.replace(staging, directory)` found its staging gone)."""
    from agent import weights

    made, release = threading.Event(), threading.Event()
    real = weights._lay_out

    def lay_out_slowly(directory: Path, files: list) -> None:
        staging = directory.with_name(directory.name + ".new")
        for parts, _blob in files:  # the staging as the real one makes it, then a pause before the rest
            (staging.joinpath(*parts)).parent.mkdir(parents=True, exist_ok=True)
        made.set()
        assert release.wait(10)
        real(directory, files)

    monkeypatch.setattr(weights, "_lay_out", lay_out_slowly)
    src = source(hub, REPO, "m-Q4_K_M.gguf")
    async with trio.open_nursery() as nursery:
        prepared: list[str] = []

        async def prepare() -> None:
            prepared.append(await store.prepare(src))

        nursery.start_soon(prepare)
        await trio.to_thread.run_sync(made.wait, 10)
        collected = trio.Event()

        async def collect() -> None:
            await store.collect(set(), [])
            collected.set()

        nursery.start_soon(collect)
        with trio.move_on_after(0.3):
            await collected.wait()
        assert not collected.is_set()  # held back while the layout is half done
        release.set()
    assert Path(prepared[0]).read_bytes() == SMALL
