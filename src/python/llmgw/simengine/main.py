"""One sim engine process: `serve_sim` runs rank 0 (HTTP + the rendezvous) or a worker.

Rank 0 listens for HTTP first, so a supervisor's health checks get an answer (503, saying what
it waits for) from the moment the process is up; then it waits for every worker, then for the
startup delay, and only then serves. A worker has no HTTP port: it joins and holds on.
"""

from __future__ import annotations

from functools import partial

import trio

from llmgw.errors import MachineError
from llmgw.http.openai import error_body
from llmgw.http.server import bound_address, serve_http
from llmgw.log import get_logger
from llmgw.looplag import LagMonitor, serve_loop_lag
from llmgw.simengine.app import SimEngine
from llmgw.simengine.errors import RendezvousFailed, SimulatedCrash
from llmgw.simengine.options import SimOptions, format_addr
from llmgw.simengine.rendezvous import Rank0, serve_worker

log = get_logger("llmgw.sim")


async def serve_sim(options: SimOptions, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
    """Run until cancelled or until the replica fails (`ReplicaFailed`). `task_status` gets the
    HTTP address on rank 0 once it listens (not yet serving), None on a worker once joined."""
    loop_lag = LagMonitor()  # rank 0 shows it at /metrics; a worker only logs its warnings
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_loop_lag, loop_lag))
        if options.fail_after_s is not None:
            nursery.start_soon(_crash_after, options.fail_after_s)
        if options.is_worker:
            log.info(
                "sim_worker_starting",
                rank=options.node_rank,
                nnodes=options.nnodes,
                dist_init_addr=format_addr(options.dist_init_addr or ("", 0)),
                http="none (workers serve nothing)",
            )
            await nursery.start(serve_worker, options)
            task_status.started(None)
        else:
            task_status.started(await nursery.start(_serve_rank0, options, loop_lag))


async def _crash_after(seconds: float) -> None:
    await trio.sleep(seconds)
    log.error("sim_crash_simulated", after_s=seconds)
    raise SimulatedCrash(f"simulated crash after {seconds:g} s, as --fail-after-s asked")


async def _serve_rank0(
    options: SimOptions, loop_lag: LagMonitor, *, task_status: trio.TaskStatus[tuple[str, int]]
) -> None:
    engine = SimEngine(options, loop_lag=loop_lag)
    rank0 = Rank0(nnodes=options.nnodes, model=options.model, address=options.dist_init_addr or ("", 0))
    try:
        await _serve_engine(engine, rank0, options, task_status=task_status)
    finally:
        await engine.aclose()  # its JSON worker, if a large body started one


async def _serve_engine(
    engine: SimEngine, rank0: Rank0, options: SimOptions, *, task_status: trio.TaskStatus[tuple[str, int]]
) -> None:
    async with trio.open_nursery() as nursery:
        try:
            listeners = await nursery.start(
                partial(serve_http, errors=error_body), engine.handle, options.host, options.port
            )
        except OSError as exc:
            raise MachineError(
                f"cannot listen for HTTP on {format_addr((options.host, options.port))}: {exc.strerror or exc}; "
                "choose another --host/--port or stop whatever holds it"
            ) from None
        host, port = bound_address(listeners)
        log.info("sim_listening", host=host, port=port, model=options.model, nnodes=options.nnodes)
        task_status.started((host, port))
        if options.nnodes > 1:
            engine.set_waiting(rank0.describe)
            await nursery.start(rank0.serve)
            with trio.move_on_after(options.rendezvous_timeout_s):
                await rank0.complete.wait()
            if not rank0.complete.is_set():
                log.error("rendezvous_timed_out", waited_s=options.rendezvous_timeout_s, status=rank0.describe())
                raise RendezvousFailed(
                    f"not every worker joined within {options.rendezvous_timeout_s:g} s ({rank0.describe()}); "
                    "start each worker with --dist-init-addr "
                    f"{format_addr(rank0.address)} and its own --node-rank, or raise --rendezvous-timeout-s"
                )
        if options.startup_delay_s > 0:
            engine.set_waiting(lambda: f"loading the model (startup delay of {options.startup_delay_s:g} s)")
            log.info("sim_loading", startup_delay_s=options.startup_delay_s)
            await trio.sleep(options.startup_delay_s)
        engine.serving = True
        log.info("sim_serving", host=host, port=port, model=options.model, nnodes=options.nnodes)
