"""The chaos benchmark's load: a steady rate of non-streamed requests and a fixed number of
streams in flight through the gateway, each outcome recorded with when it started and ended.

The client is an ordinary HTTP/1.1 client on trio + h11 with keep-alive connections, and one
rule of its own: a request written onto a connection it *reused* that fails before any byte
of an answer is sent once more on a fresh connection (the server may close an idle
connection at any moment, RFC 9112 §9.3.1) — what browsers, curl and llmgw's own upstream
pool do. Nothing else is retried: every other error, status other than 200, stream that ends
without `data: [DONE]` (or with an error event), or answer later than the client timeout is a
failure.

Each stream is read as its client would read it (`StreamReader`, pure): its text is checked
word for word against the sim engine's deterministic answer to the same request (`expected_text`,
computed in this process with the engine's own code), the longest gap between two of its
content events is kept (the stall its client saw), and a `: llmgw migrated N` comment says it
moved to another replica on the way. Streams alternate between chat and text completions, each
with a prompt of its own and exactly `stream_tokens` tokens (`ignore_eos`), so every one lasts
`stream_tokens` times the engine's time per token.

The load's own CPU and event-loop lag are sampled (`load_cpu_share`, `load_lag_max_s`): a client
that is itself the bottleneck would show its own delays as the cluster's.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import secrets
import time
from pathlib import Path

import attrs
import h11
import trio

from llmgw.simengine import api

RECEIVE = 65536
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SAMPLE_S = 0.1  # the load's CPU and loop lag, sampled this often
_MIGRATED = re.compile(rb"^: ?llmgw migrated (\d+)")


@attrs.frozen(kw_only=True)
class Outcome:
    kind: str  # "request" or "stream"
    started: float
    ended: float
    ok: bool
    reason: str = ""
    moved: int = 0  # a stream: the migrations its comment line said (0: none)
    gap_s: float | None = None  # a stream: the longest gap between two content events
    wrong_text: str = ""  # a stream that ended well: how its text differed from the expected ("": it did not)
    rid: str = ""  # the X-Request-Id it was sent with (the gateway's log lines name it)
    times: tuple[float, ...] = ()  # a stream: when each content event came (the load's clock)


class StreamReader:
    """A streamed answer as its client sees it, fed as its bytes come (`feed`): the text of its
    content events, the longest gap between two of them, whether it moved, its `[DONE]` and any
    error event. Pure: the caller passes the time each piece arrived."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.pieces: list[str] = []
        self.times: list[float] = []  # when each piece came
        self.gap_s: float | None = None
        self.moved = 0
        self.done = False
        self.error = ""
        self.tail = b""  # the last bytes, to show in a failure's reason
        self._last_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, data: bytes, now: float) -> None:
        self.tail = (self.tail + data)[-160:]
        buf = self._buf
        start = max(0, len(buf) - 1)  # a boundary split across two pieces
        buf += data
        end = buf.rfind(b"\n\n", start)
        if end < 0:
            return
        whole = bytes(buf[:end])
        del buf[: end + 2]
        for event in whole.split(b"\n\n"):
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        for line in event.split(b"\n"):
            if line.startswith(b":"):
                if m := _MIGRATED.match(line):
                    self.moved = int(m.group(1))
                continue
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                self.error = self.error or f"an event that is not JSON: {payload[:80]!r}"
                continue
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                err = chunk["error"]
                self.error = self.error or f"error event: {err.get('message', err) if isinstance(err, dict) else err}"
                continue
            for choice in chunk.get("choices") or ():
                piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if piece:
                    if self._last_at is not None:
                        gap = now - self._last_at
                        self.gap_s = gap if self.gap_s is None or gap > self.gap_s else self.gap_s
                    self._last_at = now
                    self.pieces.append(piece)
                    self.times.append(now)


def expected_text(model: str, path: str, body: dict) -> str:
    """The sim engine's answer to `body` (its own code: `api.parse_job`, `api.answer_of`)."""
    kind: api.Kind = "chat" if path == CHAT else "completion"
    return api.answer_of(api.parse_job(kind, body, served_model=model, max_tokens_default=256)).text


def differs(got: str, want: str) -> str:
    """Where `got` first departs from `want`, in words ("": equal)."""
    if got == want:
        return ""
    g, w = got.split(" "), want.split(" ")
    at = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
    return f"{len(g)} words for {len(w)}, first different at word {at}: {' '.join(g[at : at + 4])!r} for {' '.join(w[at : at + 4])!r}"


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile `q` (0-100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class _Conn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.used = False


class _Stale(Exception):
    """A reused connection failed before any byte of the answer."""


class Load:
    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        *,
        model: str,
        rate: float,
        streams: int,
        stream_tokens: int = 60,
        spread_s: float = 0.0,
        timeout_s: float = 30.0,
    ) -> None:
        self.host, self.port, self.token, self.model = host, port, token, model
        self.rate, self.streams, self.stream_tokens, self.timeout_s = rate, streams, stream_tokens, timeout_s
        # The streams' first starts are spread over this (a stream's length), so that they do not
        # run in step: at any moment some are starting, some ending, most in the middle.
        self.spread_s = spread_s
        self.outcomes: list[Outcome] = []
        self.samples: list[tuple[float, float, float]] = []  # (time, this thread's CPU-s, loop lag)
        self.steady = trio.Event()  # every stream slot has finished one stream: the load is spread
        self._in_flight: dict[int, float] = {}  # exchanges going on: when each started
        self._ended = trio.Event()  # an exchange ended (`settle` waits on it)
        self._idle: list[_Conn] = []
        self.run_id = secrets.token_hex(3)  # in each stream's X-Request-Id: this run's, in the gateway's log
        self.wall_offset = 0.0  # the load's clock (trio's) to unix time, the processes' logs' (`run`)

    # -- one exchange ---------------------------------------------------------------------------

    async def _connect(self) -> _Conn:
        return _Conn(await trio.open_tcp_stream(self.host, self.port))

    def _request(self, path: str, body: dict, rid: str = "") -> tuple[h11.Request, bytes]:
        data = json.dumps(body).encode()
        headers = [
            ("host", "chaos"),
            ("content-type", "application/json"),
            ("authorization", f"Bearer {self.token}"),
            ("content-length", str(len(data))),
        ]
        if rid:
            headers.append(("x-request-id", rid))
        return h11.Request(method="POST", target=path, headers=headers), data

    async def _exchange(self, conn: _Conn, path: str, body: dict, on_data, rid: str = "") -> int:
        reused = conn.used
        conn.used = True
        head, data = self._request(path, body, rid)
        answered = False
        try:
            await conn.stream.send_all(
                conn.h11.send(head) + conn.h11.send(h11.Data(data=data)) + conn.h11.send(h11.EndOfMessage())
            )
            status = 0
            while True:
                event = conn.h11.next_event()
                if event is h11.NEED_DATA:
                    chunk = await conn.stream.receive_some(RECEIVE)
                    conn.h11.receive_data(chunk)
                    continue
                answered = True
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    on_data(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return status
                else:
                    raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}", 0)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            if reused and not answered:
                raise _Stale() from exc
            raise

    def _give_back(self, conn: _Conn) -> None:
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            self._idle.append(conn)
        else:
            conn.stream.socket.close()

    async def one(self, path: str, body: dict, on_data, rid: str = "") -> int:
        """One exchange with the keep-alive rule above: its status; the body's bytes to `on_data`;
        `rid`: its X-Request-Id (none: the gateway makes one)."""
        for attempt in range(2):
            conn = self._idle.pop() if self._idle and attempt == 0 else await self._connect()
            try:
                status = await self._exchange(conn, path, body, on_data, rid)
            except _Stale:
                conn.stream.socket.close()
                continue
            except BaseException:
                conn.stream.socket.close()
                raise
            self._give_back(conn)
            return status
        raise RuntimeError("unreachable")  # the second attempt is on a fresh connection: never stale

    async def _timed(self, kind: str, attempt) -> None:
        started = trio.current_time()
        extra: dict = {}
        ident = id(extra)
        self._in_flight[ident] = started
        try:
            with trio.fail_after(self.timeout_s):
                reason = await attempt(extra)
        except trio.TooSlowError:
            reason = f"no answer within {self.timeout_s:g} s"
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            del self._in_flight[ident]
            self._ended.set()
        if "times" in extra:
            extra["times"] = tuple(extra["times"])
        self.outcomes.append(
            Outcome(kind=kind, started=started, ended=trio.current_time(), ok=not reason, reason=reason, **extra)
        )

    async def settle(self, end: float) -> bool:
        """Wait until every exchange that started before `end` has ended (each is bounded by the
        client timeout), so that `between(..., end)` counts them all; False if some had not
        after the timeout and a second."""
        with trio.move_on_after(self.timeout_s + 1.0):
            while any(started < end for started in self._in_flight.values()):
                self._ended = trio.Event()
                await self._ended.wait()
            return True
        return False

    async def _plain(self, extra: dict) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        data = bytearray()
        status = await self.one(CHAT, body, data.extend)
        if status != 200:
            return f"HTTP {status}: {bytes(data[:160])!r}"
        return "" if json.loads(data)["choices"][0]["message"]["content"] else "empty answer"

    def stream_body(self, slot: int, round_: int) -> tuple[str, dict]:
        """Stream `round_` of `slot`: chat and text completions in turn, a prompt of its own."""
        body: dict = {"model": self.model, "max_tokens": self.stream_tokens, "ignore_eos": True, "stream": True}
        if slot % 2:
            return COMPLETIONS, {**body, "prompt": f"Chaos stream {slot}, round {round_}:"}
        return CHAT, {**body, "messages": [{"role": "user", "content": f"chaos stream {slot}, round {round_}"}]}

    async def _stream(self, path: str, body: dict, rid: str, extra: dict) -> str:
        reader = StreamReader()
        extra.update(rid=rid, times=reader.times)  # the times as they come, kept however it ends
        status = await self.one(path, body, lambda data: reader.feed(data, trio.current_time()), rid)
        extra.update(moved=reader.moved, gap_s=reader.gap_s)
        if status != 200:
            return f"HTTP {status}: {reader.tail[:160]!r}"
        if reader.error:
            return reader.error[:200]
        if not reader.done:
            return f"cut short: {reader.tail[-120:]!r}"
        extra["wrong_text"] = differs(reader.text, self.expected(path, body))
        return ""

    def expected(self, path: str, body: dict) -> str:
        """The text a stream asked with `body` must have: the sim engine's answer to it."""
        return expected_text(self.model, path, body)

    # -- the load -------------------------------------------------------------------------------

    async def _sample(self) -> None:
        """The load's own CPU (this thread's: the trio loop the whole load runs on) and how late
        its loop woke, every `SAMPLE_S`."""
        while True:
            before = trio.current_time()
            await trio.sleep(SAMPLE_S)
            now = trio.current_time()
            self.samples.append((now, time.thread_time(), now - before - SAMPLE_S))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: `rate` requests a second (each in its own task, so a slow answer
        does not slow the rate) and `streams` streams, each followed by the next."""

        slots_done = 0
        self.wall_offset = time.time() - trio.current_time()

        async def streamer(slot: int) -> None:
            nonlocal slots_done
            await trio.sleep(self.spread_s * slot / self.streams)
            for round_ in itertools.count():
                rid = f"chaos-{self.run_id}-s{slot}-r{round_}"
                await self._timed("stream", functools.partial(self._stream, *self.stream_body(slot, round_), rid))
                if not round_:
                    slots_done += 1
                    if slots_done == self.streams:
                        self.steady.set()

        if not self.streams:
            self.steady.set()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sample)
            for slot in range(self.streams):
                nursery.start_soon(streamer, slot)
            task_status.started()
            period = 1.0 / self.rate if self.rate > 0 else math.inf
            next_at = trio.current_time()
            while True:
                nursery.start_soon(self._timed, "request", self._plain)
                next_at += period
                await trio.sleep_until(next_at)

    def dump(self, path: Path) -> None:
        """Every stream's outcome, its tokens' times in unix time, as JSON lines (a kept run's
        `streams.jsonl`: to read beside the processes' logs, by request id)."""
        with path.open("w") as f:
            for o in self.outcomes:
                if o.kind == "stream":
                    row = attrs.asdict(o)
                    off = self.wall_offset
                    row.update(
                        started=round(o.started + off, 4),
                        ended=round(o.ended + off, 4),
                        times=[round(t + off, 4) for t in o.times],
                    )
                    f.write(json.dumps(row) + "\n")

    def between(self, start: float, end: float, fault_at: float | None = None) -> dict:
        """What ran during [start, end) — started in it, or in flight when it began (a stream
        cut by a fault started before it): counts and failures of each kind; for the streams,
        those that moved, those whose text was not the expected one, and the longest gap between
        two tokens of each (the stall its client saw: p99 and max, of the moved ones and of the
        others); the load's own CPU share and loop lag. With `fault_at` (when a kill was dealt),
        also the gap each stream had across that moment (`seam`): for a moved one, the stall
        its move cost, split into its last token to the kill and the kill to its next token."""
        window = [o for o in self.outcomes if o.started < end and o.ended >= start]
        out: dict = {}
        for kind, name in (("request", "requests"), ("stream", "streams")):
            of_kind = [o for o in window if o.kind == kind]
            failed = [o for o in of_kind if not o.ok]
            out[name] = len(of_kind)
            out[f"failed_{name}"] = len(failed)
            if failed:
                out[f"{name}_failures"] = sorted({o.reason[:200] for o in failed})[:5]
            done = [o.ended - o.started for o in of_kind if o.ok]
            out[f"{name}_slowest_s"] = round(max(done), 2) if done else None
        streams = [o for o in window if o.kind == "stream"]
        moved = [o for o in streams if o.moved]
        wrong = [o for o in streams if o.wrong_text]
        out["migrated_streams"] = len(moved)
        out["streams_wrong_text"] = len(wrong)
        if wrong:
            out["wrong_text_examples"] = sorted({o.wrong_text[:200] for o in wrong})[:5]
        for name, group in (("migration", moved), ("unmoved", [o for o in streams if not o.moved])):
            gaps = [o.gap_s for o in group if o.gap_s is not None]
            out[f"{name}_stall_p99_s"] = round(percentile(gaps, 99), 3) if gaps else None
            out[f"{name}_stall_max_s"] = round(max(gaps), 3) if gaps else None
        if fault_at is not None:
            out.update(seams(moved, [o for o in streams if not o.moved], fault_at))
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) >= 2:
            out["load_cpu_share"] = round((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]), 3)
            out["load_lag_max_s"] = round(max(s[2] for s in inside), 3)
        else:
            out["load_cpu_share"] = out["load_lag_max_s"] = None
        return out


# Tokens the killed engine wrote just before it died still reach the client after the kill, a
# few milliseconds late (the survivor's first token takes a hundred or more: detection, its slot,
# its prefill): a gap that begins this soon after the kill is still the kill's.
SEAM_GRACE_S = 0.05


def _across(times: tuple[float, ...], at: float) -> list[tuple[float, float]]:
    return [(a, b) for a, b in itertools.pairwise(times) if b > at and a < at + SEAM_GRACE_S]


def seam(times: tuple[float, ...], at: float) -> tuple[float, float] | None:
    """A stream's gap across a kill at `at` (the longest that ends after it and begins before
    `SEAM_GRACE_S` after it), as (its start to `at`, at least 0; `at` to its end); None if it
    had no token on one side of the kill."""
    gaps = _across(times, at)
    if not gaps:
        return None
    a, b = max(gaps, key=lambda g: g[1] - g[0])
    return max(0.0, at - a), b - max(a, at)


def off_seam(times: tuple[float, ...], at: float) -> float | None:
    """A stream's longest gap between two tokens other than its gap across `at` (`seam`)."""
    across = _across(times, at)
    cut = max(across, key=lambda g: g[1] - g[0]) if across else None
    gaps = [b - a for a, b in itertools.pairwise(times) if (a, b) != cut]
    return max(gaps) if gaps else None


def seams(moved: list[Outcome], others: list[Outcome], at: float) -> dict:
    """The gaps across a kill at `at` (`seam`): of the moved streams, whole (`migration_seam_*`,
    the stall the move cost its client) and split in two, and each one's longest gap elsewhere
    (`migration_off_seam_*`: the engine's own pace, before and after the move); of the others
    (the survivor's own streams), the gap across the kill."""
    split = [s for o in moved if (s := seam(o.times, at)) is not None]
    whole = [before + after for before, after in split]
    off = [g for o in moved if (g := off_seam(o.times, at)) is not None]
    across = [before + after for o in others if (s := seam(o.times, at)) is not None for before, after in (s,)]

    def p99(values: list[float]) -> float | None:
        return round(percentile(values, 99), 3) if values else None

    return {
        "migration_seam_p99_s": p99(whole),
        "migration_seam_max_s": round(max(whole), 3) if whole else None,
        "migration_seam_last_token_to_kill_p99_s": p99([b for b, _ in split]),
        "migration_seam_kill_to_next_token_p99_s": p99([a for _, a in split]),
        "migration_off_seam_p99_s": p99(off),
        "unmoved_gap_at_kill_p99_s": p99(across),
    }
