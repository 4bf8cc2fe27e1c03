"""The /metrics of a gateway of its own with several workers (`llmgw.gatewayd.figures`): two
`GatewayWorker`s sharing one directory as the parent gives it them, each answering /metrics with
every worker's series labelled `worker`, and no counter going back between scrapes whichever
worker answers; an ended worker's series gone; a file that is not figures left out."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.errors import MachineError
from llmgw.gatewayd import figures
from llmgw.gatewayd.figures import PUBLISH_S, SharedFigures
from llmgw.gatewayd.table import GatewayTable
from llmgw.gatewayd.worker import GatewayWorker
from llmgw.http.messages import Request
from testlib.gateway import parse_metrics

pytestmark = pytest.mark.trio

REQUESTS = "llmgw_gateway_requests_total"
HEARD = "llmgw_gateway_worker_heard_seconds"


class Clock:
    """Unix time as the figures read it, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def worker(directory: Path, index: int, clock: Clock) -> GatewayWorker:
    instance = f"w{index}-test"
    shared = SharedFigures(directory, index, instance, clock=clock)
    return GatewayWorker(GatewayTable(now=0.0), instance=instance, figures=shared)


def answer(w: GatewayWorker, n: int) -> None:
    for _ in range(n):
        w.gateway.metrics.answered("chat", 200)


async def scrape(w: GatewayWorker) -> dict[tuple[str, frozenset], float]:
    response = await w.handle(Request.of("GET", "/metrics"))
    assert response.status == 200
    return parse_metrics(response.body.decode())


def requests(figures_: dict[tuple[str, frozenset], float]) -> dict[str, float]:
    """Requests answered by each worker, as one scrape says."""
    return {
        dict(labels)["worker"]: value
        for (name, labels), value in figures_.items()
        if name == REQUESTS and ("model", "chat") in labels
    }


async def test_each_worker_answers_with_every_workers_series_and_no_counter_goes_back(tmp_path: Path) -> None:
    clock = Clock()
    a, b = worker(tmp_path, 0, clock), worker(tmp_path, 1, clock)
    for w in (a, b):  # as each does when it starts (`SharedFigures.serve`)
        await w.figures.publish(w.metric_families)  # type: ignore[union-attr]
    answer(a, 3)
    answer(b, 5)
    seen = [await scrape(a)]  # its own now, the other's as it last wrote them
    answer(b, 1)
    seen.append(await scrape(b))
    answer(a, 1)
    seen.append(await scrape(a))
    assert [requests(s) for s in seen] == [
        {"w0-test": 3},  # w1 wrote none yet: no series of that name
        {"w0-test": 3, "w1-test": 6},
        {"w0-test": 4, "w1-test": 6},
    ]
    for s in seen:
        assert {dict(labels)["worker"] for name, labels in s if name == HEARD} == {"w0-test", "w1-test"}
        assert all("worker" in dict(labels) for _, labels in s), "every series says whose it is"
    for earlier, later in zip(seen, seen[1:], strict=False):
        for key, value in earlier.items():
            if key[0].endswith(("_total", "_bucket", "_count", "_sum")):
                assert later.get(key, value) >= value, key


async def test_the_heard_seconds_say_how_old_each_workers_figures_are(tmp_path: Path) -> None:
    clock = Clock()
    a, b = worker(tmp_path, 0, clock), worker(tmp_path, 1, clock)
    await b.figures.publish(b.metric_families)  # type: ignore[union-attr]
    clock.now += 3.5
    seen = await scrape(a)
    assert seen[(HEARD, frozenset({("worker", "w0-test")}))] == 0.0
    assert seen[(HEARD, frozenset({("worker", "w1-test")}))] == 3.5


async def test_an_ended_workers_series_go_and_what_is_not_figures_is_left_out(tmp_path: Path) -> None:
    clock = Clock()
    a, b = worker(tmp_path, 0, clock), worker(tmp_path, 1, clock)
    await b.figures.publish(b.metric_families)  # type: ignore[union-attr]
    (tmp_path / "worker-7.json").write_text("{not figures")
    (tmp_path / ".worker-3.json.tmp").write_text("{}")  # a write cut short by a crash
    workers = {dict(labels)["worker"] for name, labels in await scrape(a) if name == HEARD}
    assert workers == {"w0-test", "w1-test"}
    figures.forget(tmp_path, 1)  # the parent, once worker 1 has ended
    assert {dict(labels)["worker"] for name, labels in await scrape(a) if name == HEARD} == {"w0-test"}


async def test_a_worker_writes_its_figures_as_it_starts_and_then_every_publish_interval(
    tmp_path: Path, nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    # The clock moves only when told: the files are written and read in threads, and a clock that
    # jumped whenever the loop waited for one would publish again before the first look.
    clock = Clock()
    a, b = worker(tmp_path, 0, clock), worker(tmp_path, 1, clock)
    await nursery.start(b.figures.serve, b.metric_families)  # type: ignore[union-attr]
    assert figures.file_of(tmp_path, 1).exists()
    answer(b, 2)
    assert requests(await scrape(a)) == {}  # b wrote before it answered anything
    mock_clock.jump(PUBLISH_S * 1.5)
    deadline = time.monotonic() + 10  # real seconds, for b's write in its thread
    while (seen := requests(await scrape(a))) != {"w1-test": 2} and time.monotonic() < deadline:
        await trio.testing.wait_all_tasks_blocked()
    assert seen == {"w1-test": 2}


async def test_without_a_directory_a_worker_answers_with_its_own_series_unlabelled(tmp_path: Path) -> None:
    w = GatewayWorker(GatewayTable(now=0.0), instance="w0-test")  # the control plane's workers, and tests
    answer(w, 2)
    assert (await scrape(w))[(REQUESTS, frozenset({("model", "chat"), ("status", "200")}))] == 2


async def test_a_temporary_directory_it_cannot_write_is_said_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(figures.tempfile, "tempdir", str(tmp_path / "missing"))
    with pytest.raises(MachineError) as refused:
        figures.make_dir()
    assert str(tmp_path / "missing") in str(refused.value) and "set TMPDIR" in str(refused.value)


async def test_the_directory_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(figures.tempfile, "tempdir", str(tmp_path))
    made = figures.make_dir()
    assert made.parent == tmp_path and made.stat().st_mode & 0o777 == 0o700
