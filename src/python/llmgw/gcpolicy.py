"""How often CPython's cyclic garbage collector runs in llmgw's long-lived processes (`serving`,
around every `run_service`): the youngest generation is collected every `YOUNG_THRESHOLD` net
new container objects instead of CPython's 700.

Why: a process that holds many requests open at once — a gateway relaying thousands of streams,
the sim engine producing them — allocates a little for every event and keeps it until the next
one, seconds later on a slow stream. At 700, young collections come every few milliseconds, so
nearly everything they see is still alive and is promoted, through the middle generation, to
the oldest; and once the objects promoted since the last full collection pass a quarter of
those already there, CPython scans the whole heap. Measured here (2-core VM, CPython 3.11,
5,000 streams opened 200 at a time through one gateway to a sim engine sending a token every 2 s
each, then held 60 s; `tools/bench/gateway.py` phase 4 is the same load): at 700 the gateway
spent 28 and 51 CPU seconds in the collector in two runs (of about 90 in all), the sim engine 42
of its 76; full
collections of ~550,000 objects came every few seconds, each holding the loop up to 0.7-0.9 s of
CPU time (1.3-1.9 s of wall time with other work on the machine). That is longer than the 1 s
the gateway gives an upstream connect: the replica was taken out of rotation for a pause of the
gateway's own and streams were refused with 503. At 20,000: no full collection, 1.7-2.8 CPU
seconds in the collector, the streams open in 10-13 s instead of 22, and relaying their tokens
takes 0.34-0.42 of a core instead of 0.43-0.59. Non-streamed requests at ~1,600/s (phase 5)
cost the same CPU either way, within the run-to-run noise.

Objects that die young are freed by reference counting either way, whatever the threshold, and
a young collection costs what it finds alive, so a larger threshold costs memory only for
garbage in reference cycles (at most that many objects between collections) and makes a young
collection that finds most of them alive longer (up to ~0.2-0.5 s measured while 5,000 streams
opened at once, against the 0.9 s full collections it removes). Objects made to start are left
out of collections separately, where each process has started (`gc.freeze`:
`freeze_start_objects`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

YOUNG_THRESHOLD = 20_000


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """The collector's thresholds for a serving process while inside; the ones before it after
    (so that a service run in a test's process leaves that process as it was)."""
    before = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def freeze_start_objects() -> None:
    """Leave what the process made to start (its modules, its configuration, the CA) out of every
    garbage collection from now on (`gc.freeze`): a full collection scans every object tracked, and
    with them it held the control plane's loop for about 20 ms here (measured: 22 ms of CPU with
    `[debug] measure_steps`), longer than a step may take (reliability.md). A process of its own
    only (`llmgw server`, `llmgw up`): it changes the collector for the whole process."""
    gc.freeze()
