"""Large JSON bodies parsed in a worker process, so that no body holds the event loop (why, and
the one rule every body is held to, are `llmgw.http.jsonbody`'s): `JsonWorkers`, one per serving
process, parses a small body inline and hands a large one to a worker (`llmgw __json-worker`,
`worker_main`), started at the first such body, which runs the caller's projection on the parsed
value and sends back only its result. `parse_body` is a handler's way in, for a body of any size.

A projection is a module-level function `f(value, *args)`, named by reference so the worker can
import it; the same function runs inline for small bodies, so both paths give the same answers.
"""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import INLINE_MAX_BYTES, INLINE_MAX_VALUES, InvalidJson, loads, project, refuse_content_coding
from llmgw.http.messages import Request
from llmgw.log import get_logger

log = get_logger("llmgw.http")

# The worker's command word (`llmgw __json-worker`, llmgw.cli.INTERNAL_JSON_WORKER): internal,
# not listed among the commands.
WORKER_COMMAND = "__json-worker"
# A worker that grew past this after a body exits once it has answered (the next body starts a
# new one): one hostile body can make the decoder build hundreds of MB of small objects.
WORKER_MAX_RSS_BYTES = 256 << 20

_FRAME = struct.Struct(">Q")


class ParserBusy(Exception):
    """No worker could take the body in time (too many large bodies at once): a 503."""


def _reference(fn: Callable[..., Any]) -> str:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in name or "." in name:
        raise TypeError(f"a JSON projection must be a module-level function, not {fn!r}")
    return f"{module}:{name}"


def _resolve(reference: str) -> Callable[..., Any]:
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def worker_main(stdin=None, stdout=None) -> int:
    """The worker process: requests in (a frame naming the projection, its arguments and the
    body's length, then the body), frames out (the result or the error), until its input
    closes. A frame is an 8-byte length and a pickle; the parent is trusted (it started us), the
    bodies are not (they are only ever handed to `json.loads`)."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    while True:
        head = stdin.read(_FRAME.size)
        if len(head) < _FRAME.size:
            return 0
        (size,) = _FRAME.unpack(head)
        reference, args, body_size = pickle.loads(stdin.read(size))
        body = stdin.read(body_size)
        try:
            answer = ("ok", project(body, _resolve(reference), args))
        except Exception as exc:  # noqa: BLE001 - refusals are the projection's to make; a bug is sent back as one
            answer = ("error", exc)
        del body
        try:
            out = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an unpicklable error of a projection: said as text
            out = pickle.dumps(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
        stdout.write(_FRAME.pack(len(out)) + out)
        stdout.flush()
        if _rss_bytes() > WORKER_MAX_RSS_BYTES:
            return 0  # a fresh process for the next body gives the memory back


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@attrs.frozen(kw_only=True)
class WorkerOptions:
    workers: int = 1  # processes parsing large bodies at once
    max_waiting: int = 64  # bodies waiting for a worker; past it, ParserBusy at once
    wait_s: float = 5.0  # how long a body may wait for a worker
    parse_timeout_s: float = 10.0  # a body taking longer is refused, and its worker replaced


class _Worker:
    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)
        self.process: trio.Process | None = None
        self.lock = trio.Lock()
        self._buffer = bytearray()

    async def run(self, reference: str, args: Sequence[Any], body: bytes, timeout_s: float) -> tuple[str, Any]:
        if self.process is None or self.process.returncode is not None:
            await self.stop()
            self.process = await trio.lowlevel.open_process(
                [*self.command, WORKER_COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            self._buffer.clear()
        process = self.process
        assert process.stdin is not None and process.stdout is not None
        # The body follows its header as it is: not copied into a pickle.
        header = pickle.dumps((reference, tuple(args), len(body)), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with trio.fail_after(timeout_s):
                await process.stdin.send_all(_FRAME.pack(len(header)) + header)
                await process.stdin.send_all(body)
                (size,) = _FRAME.unpack(await self._read(process.stdout, _FRAME.size))
                return pickle.loads(await self._read(process.stdout, size))
        except BaseException:
            await self.stop()  # half a frame is no state to continue from
            raise

    async def _read(self, stream: trio.abc.ReceiveStream, n: int) -> bytes:
        while len(self._buffer) < n:
            data = await stream.receive_some(max(65536, n - len(self._buffer)))
            if not data:
                raise EOFError("the JSON worker exited")
            self._buffer += data
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    await pipe.aclose()


class JsonWorkers:
    """Parses bodies: inline when small, in a worker process otherwise (see the module's
    docstring). One per serving process; `aclose` stops the workers."""

    def __init__(self, command: Sequence[str] | None = None, options: WorkerOptions | None = None) -> None:
        options = options or WorkerOptions()
        if command is None:
            from llmgw.selfexec import llmgw_command

            command = llmgw_command()
        self.options = options
        self._workers = [_Worker(command) for _ in range(max(1, options.workers))]
        self._free = trio.Semaphore(len(self._workers))
        self._waiting = 0
        self.parsed_in_worker = 0  # bodies parsed by a worker, for /metrics and tests

    async def parse(self, body: bytes, fn: Callable[..., Any], *args: Any, what: str = "request body") -> Any:
        """`fn(json.loads(body), *args)`; raises what `fn` raises, `InvalidJson`, or
        `ParserBusy`."""
        if len(body) <= INLINE_MAX_BYTES:  # `inline`, its count of brackets kept for `loads`
            brackets = body.count(b"[") + body.count(b"{")
            if brackets + body.count(b",") <= INLINE_MAX_VALUES:
                return fn(loads(body, what=what, brackets=brackets), *args)
        reference = _reference(fn)
        if self._waiting >= self.options.max_waiting:
            raise ParserBusy(f"{self._waiting} large request bodies are waiting to be parsed")
        self._waiting += 1
        try:
            with trio.move_on_after(self.options.wait_s) as waited:
                await self._free.acquire()
        finally:
            self._waiting -= 1
        if waited.cancelled_caught:
            raise ParserBusy(f"no JSON worker was free within {self.options.wait_s:g} s")
        try:
            worker = next(w for w in self._workers if not w.lock.locked())
            async with worker.lock:
                try:
                    kind, value = await worker.run(reference, args, body, self.options.parse_timeout_s)
                except trio.TooSlowError:
                    raise InvalidJson(
                        f"{what} took longer than {self.options.parse_timeout_s:g} s to parse; send simpler JSON"
                    ) from None
                except (EOFError, OSError, trio.BrokenResourceError) as exc:
                    log.error("json_worker_failed", reason=str(exc) or type(exc).__name__)
                    raise ParserBusy("the JSON worker failed; the server's log says why") from None
        finally:
            self._free.release()
        self.parsed_in_worker += 1
        if kind == "error":
            raise value
        return value

    async def aclose(self) -> None:
        for worker in self._workers:
            await worker.stop()


async def parse_body(
    request: Request, workers: JsonWorkers, fn: Callable[..., Any], *args: Any, what: str = "request body"
) -> Any:
    """`fn(body as JSON, *args)` for a body of any size up to the limit, the loop never held
    long: 400 for bad JSON, 415 for a compressed body (`refuse_content_coding`), 503 when the
    parsers are all busy."""
    refuse_content_coding(request)
    body = await request.read()
    try:
        return await workers.parse(body, fn, *args, what=what)
    except InvalidJson as exc:
        raise exc.http_error() from None
    except ParserBusy as exc:
        raise HTTPError(
            503,
            f"{exc}; try again in a moment",
            kind="server_error",
            code="overloaded",
            headers=(("retry-after", "1"),),
        ) from None
