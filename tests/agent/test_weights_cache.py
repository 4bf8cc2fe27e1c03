"""The weights cache's size limit on a node: whole downloaded files evicted least recently used
first (last use: the digest directory's mtime, so a restarted agent keeps the order) before a
download would pass the limit and at each collect; never one a replica uses, one being prepared
or downloaded; a warning, and nothing deleted, when what is in use alone passes the limit; the
Hub links to an evicted file removed; `held()` and `cache_bytes()` as the control plane will read
them. Downloads come from testlib.fileserver on loopback; other files are made in place."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest
import trio

from agent import weights_cache as cache
from agent.weights import WeightsStore
from llmgw.wire import agent_link as w
from testlib.fileserver import Files, serve_files
from testlib.waiting import await_true

COMMIT = "c" * 40


@pytest.fixture
async def files(nursery: trio.Nursery) -> tuple[Files, str]:
    return await serve_files(nursery)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(root: Path, data: bytes, *, last_used: float, name: str = "m.gguf") -> str:
    """A downloaded file made in place, as a download leaves it, last used at `last_used`."""
    digest = sha(data)
    (root / digest).mkdir(parents=True)
    (root / digest / name).write_bytes(data)
    os.utime(root / digest, (last_used, last_used))
    return digest


def url_source(server: Files, base: str, data: bytes, name: str) -> w.WeightsSource:
    server.content[f"/{name}"] = data
    return w.WeightsSource(url=f"{base}/{name}", sha256=sha(data), size=len(data))


def hub_source(server: Files, base: str, repo: str, contents: dict[str, bytes]) -> w.WeightsSource:
    for path, data in contents.items():
        server.content[f"/{repo}/{path}"] = data
    return w.WeightsSource(
        repo=repo,
        commit=COMMIT,
        files=tuple(
            w.WeightsFile(path=p, url=f"{base}/{repo}/{p}", sha256=sha(d), size=len(d)) for p, d in contents.items()
        ),
    )


def held_digests(root: Path) -> set[str]:
    return {h.sha256 for h in cache.scan(root)}


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    return [r.llmgw_fields for r in caplog.records if r.getMessage() == name]


# -- the plan, pure ---------------------------------------------------------------------------


def held(name: str, size: int, last_used: float) -> cache.Held:
    return cache.Held(sha256=name, bytes=size, complete=True, last_used=last_used)


def test_the_plan_takes_the_least_recently_used_until_the_download_fits() -> None:
    files = [held("c", 300, 3.0), held("a", 100, 1.0), held("b", 200, 2.0)]
    assert cache.plan(files, limit=600, protected=set()).evict == ()  # fits as it is
    assert [h.sha256 for h in cache.plan(files, limit=600, protected=set(), incoming=50).evict] == ["a"]
    assert [h.sha256 for h in cache.plan(files, limit=600, protected=set(), incoming=250).evict] == ["a", "b"]
    # Protected ones are stepped over, however old; the next oldest goes instead.
    plan = cache.plan(files, limit=600, protected={"a"}, incoming=50)
    assert [h.sha256 for h in plan.evict] == ["b"] and not plan.short
    assert cache.plan(files, limit=0, protected=set(), incoming=10**12).evict == ()  # no limit


def test_the_plan_says_when_what_must_stay_alone_does_not_fit() -> None:
    files = [held("a", 100, 1.0), held("b", 200, 2.0), held("c", 300, 3.0)]
    plan = cache.plan(files, limit=250, protected={"b", "c"})
    assert [h.sha256 for h in plan.evict] == ["a"]  # what can go, goes
    assert plan.short and [h.sha256 for h in plan.kept_in_use] == ["b", "c"]


# -- the store --------------------------------------------------------------------------------


@pytest.mark.trio
async def test_least_recently_used_files_go_before_the_download_that_needs_their_room(
    files, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    server, base = files
    root = tmp_path / "weights"
    oldest = put(root, b"1" * 1000, last_used=1_000_000)
    older = put(root, b"2" * 1200, last_used=2_000_000)
    recent = put(root, b"3" * 800, last_used=3_000_000)
    store = WeightsStore(root, limit_bytes=3000)
    new = url_source(server, base, os.urandom(1500), "new.gguf")
    server.release = trio.Event()  # the body waits: what is on disk when the request arrives is seen
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.prepare, new)
        await await_true(lambda: server.gets, "the download's request")
        # 3000 held + 1500 coming: the two oldest go (2200 bytes), before a byte arrives (the new
        # file's directory is there, empty).
        assert held_digests(root) == {recent, new.sha256} and store.cache_bytes() == 800
        server.release.set()
    assert held_digests(root) == {recent, new.sha256}
    assert store.evictions == 2 and store.cache_bytes() == 2300
    evicted = events(caplog, "weights_evicted")
    assert [(e["sha256"], e["bytes"]) for e in evicted] == [(oldest, 1000), (older, 1200)]
    assert evicted[0]["last_used"] == "1970-01-12T13:46:40+00:00"


@pytest.mark.trio
async def test_files_in_use_are_never_evicted_and_are_marked_used(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    a = put(root, b"a" * 1000, last_used=1_000_000)
    b = put(root, b"b" * 1000, last_used=2_000_000)
    c = put(root, b"c" * 1000, last_used=3_000_000)
    store = WeightsStore(root, limit_bytes=500)  # not even one file fits
    using = [w.WeightsSource(url="https://h/m.gguf", sha256=a)]
    # The catalog names all three: only the limit deletes, and all but the one in use go.
    assert await store.collect({a, b, c}, using) == [b, c]
    assert held_digests(root) == {a} and store.evictions == 2
    assert (root / a).stat().st_mtime > 3_000_000  # in use: marked used now
    # No longer in use: it goes at the next collect.
    assert await store.collect({a}, []) == [a] and held_digests(root) == set()


@pytest.mark.trio
async def test_a_file_prepared_just_now_is_not_evicted_however_old_its_mark(files, tmp_path: Path) -> None:
    server, base = files
    root = tmp_path / "weights"
    store = WeightsStore(root, limit_bytes=2500)
    first = url_source(server, base, b"f" * 1000, "first.gguf")
    await store.prepare(first)
    os.utime(root / first.sha256, (1_000_000, 1_000_000))  # looks least recently used
    other = put(root, b"o" * 1000, last_used=2_000_000)
    second = url_source(server, base, b"s" * 1000, "second.gguf")
    await store.prepare(second)  # 3000 with it: one must go, and `first` is a replica's now
    assert held_digests(root) == {first.sha256, second.sha256} and other not in held_digests(root)


@pytest.mark.trio
async def test_a_file_of_a_model_being_prepared_is_not_evicted_for_its_next_file(files, tmp_path: Path) -> None:
    server, base = files
    root = tmp_path / "weights"
    one, two = b"1" * 1000, b"2" * 1000
    put(root, one, last_used=1_000_000, name="a.safetensors")  # there already, verified, oldest
    other = put(root, b"o" * 1000, last_used=2_000_000)
    source = hub_source(server, base, "org/m", {"a.safetensors": one, "b.safetensors": two})
    store = WeightsStore(root, limit_bytes=2500)
    path = Path(await store.prepare(source))
    assert held_digests(root) == {sha(one), sha(two)} and other not in held_digests(root)
    assert path.read_bytes() == one and server.gets == ["/org/m/b.safetensors"]


@pytest.mark.trio
async def test_no_limit_never_evicts(files, tmp_path: Path) -> None:
    server, base = files
    root = tmp_path / "weights"
    old = {put(root, bytes([i]) * 10_000, last_used=1_000_000 + i) for i in range(5)}
    store = WeightsStore(root)
    new = url_source(server, base, os.urandom(50_000), "new.gguf")
    await store.prepare(new)
    assert await store.collect(old | {new.sha256}, []) == []
    assert held_digests(root) == old | {new.sha256} and store.evictions == 0
    assert store.cache_bytes() == 100_000


@pytest.mark.trio
async def test_in_use_past_the_limit_is_kept_with_one_warning_and_downloads_go_on(
    files, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    server, base = files
    root = tmp_path / "weights"
    a = put(root, b"a" * 2000, last_used=1_000_000)
    b = put(root, b"b" * 2000, last_used=2_000_000)
    store = WeightsStore(root, limit_bytes=3000)  # smaller than what is in use
    using = [w.WeightsSource(url="https://h/a.gguf", sha256=d) for d in (a, b)]
    assert await store.collect({a, b}, using) == []
    assert await store.collect({a, b}, using) == []
    assert held_digests(root) == {a, b} and store.evictions == 0
    [warning] = events(caplog, "weights_cache_over_limit")  # once for the same files, not at every collect
    assert warning["limit_gib"] == round(3000 / 2**30, 3) and sorted(warning["in_use"]) == sorted([a, b])
    # A replica's new download still proceeds: the disk's free space is the only bound then.
    new = url_source(server, base, b"n" * 1000, "new.gguf")
    assert Path(await store.prepare(new)).read_bytes() == b"n" * 1000
    assert held_digests(root) == {a, b, new.sha256}
    assert len(events(caplog, "weights_cache_over_limit")) == 2  # the new file is in use too: a new set


@pytest.mark.trio
async def test_hub_links_to_evicted_files_are_removed(files, tmp_path: Path) -> None:
    server, base = files
    root = tmp_path / "weights"
    store = WeightsStore(root)
    old = hub_source(server, base, "org/old", {"m.gguf": b"o" * 1000})
    new = hub_source(server, base, "org/new", {"m.gguf": b"n" * 1000})
    await store.prepare(old)
    await store.prepare(new)
    os.utime(root / old.files[0].sha256, (1_000_000, 1_000_000))
    store.limit_bytes = 1500
    keep = {old.files[0].sha256, new.files[0].sha256}
    assert await store.collect(keep, []) == [old.files[0].sha256]
    hub = root.resolve() / "hub"
    assert not (hub / "org--old").exists()
    assert (hub / "org--new" / COMMIT / "m.gguf").read_bytes() == b"n" * 1000


@pytest.mark.trio
async def test_held_and_cache_bytes_count_every_download_and_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    done = put(root, b"d" * 700, last_used=2_000_000)
    partial = "e" * 64
    (root / partial).mkdir()
    (root / partial / "m.gguf.part").write_bytes(b"p" * 300)
    os.utime(root / partial, (1_000_000, 1_000_000))
    (root / "hub" / "org--m" / COMMIT).mkdir(parents=True)  # links only: counted where they point
    (root / "hub" / "org--m" / COMMIT / "m.gguf").symlink_to(root / done / "m.gguf")
    elsewhere = tmp_path / "operator"
    elsewhere.mkdir()
    (elsewhere / "big.gguf").write_bytes(b"x" * 5000)
    (root / ("f" * 64)).symlink_to(elsewhere)  # the operator's arrangement, never the cache's
    store = WeightsStore(root, limit_bytes=1)
    assert store.held() == [(partial, 300, False, 1_000_000.0), (done, 700, True, 2_000_000.0)]
    assert store.cache_bytes() == 1000
    assert await store.collect({done, partial, "f" * 64}, []) == [partial, done]
    assert (elsewhere / "big.gguf").exists() and store.held() == [] and store.cache_bytes() == 0


@pytest.mark.trio
async def test_a_new_store_on_the_same_directory_keeps_the_order(files, tmp_path: Path) -> None:
    server, base = files
    root = tmp_path / "weights"
    a = url_source(server, base, b"a" * 1000, "a.gguf")
    b = url_source(server, base, b"b" * 1000, "b.gguf")
    first = WeightsStore(root)
    for source in (a, b):
        await first.prepare(source)
    os.utime(root / a.sha256, (1_000_000, 1_000_000))
    os.utime(root / b.sha256, (2_000_000, 2_000_000))
    await first.prepare(a)  # used again, from disk: now the most recent
    assert server.gets == ["/a.gguf", "/b.gguf"]
    # The agent restarts with a limit that holds one of them: b, the least recently used, goes.
    again = WeightsStore(root, limit_bytes=1500)
    assert await again.collect({a.sha256, b.sha256}, []) == [b.sha256]
    assert held_digests(root) == {a.sha256}
