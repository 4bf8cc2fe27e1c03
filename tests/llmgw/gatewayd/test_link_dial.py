"""A gateway's link dialling a control plane it is cut off from, on MockClock: no SYN is answered
(the TCP connect hangs), so each dial is given up after TCP_CONNECT_TIMEOUT_S, said as such, and
made again after the backoff. The kernel resends a SYN 1 s and 3 s into a connect: with these
bounds a SYN goes out at least every TCP_CONNECT_TIMEOUT_S, which is how soon a gateway finds a
path that returned (docs/gateway.md: a revocation made meanwhile applies within 5 s)."""

from __future__ import annotations

import random
import ssl

import pytest
import trio
import trio.testing

from llmgw.gatewayd import link as gl
from testlib.netns import SYN_RESENDS_S
from testlib.waiting import await_true

pytestmark = pytest.mark.trio


class Links:
    """A `TableSink` that keeps only what the link says of itself."""

    def __init__(self) -> None:
        self.states: list[tuple[bool, str]] = []

    def rotation_changed(self, message: object) -> None:
        raise AssertionError("no table over a path that answers nothing")

    keys_changed = share_changed = rotation_changed

    def heard(self, now: float) -> None:
        raise AssertionError("nothing heard over a path that answers nothing")

    def link_state(self, connected: bool, detail: str) -> None:
        self.states.append((connected, detail))


async def test_a_dial_into_silence_is_given_up_after_the_tcp_timeout_and_made_again_within_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dials: list[float] = []

    async def silent(host: str, port: int) -> trio.abc.Stream:
        dials.append(trio.current_time())
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    sink = Links()
    link = gl.GatewayLink(
        target=gl.Target(host="cp", port=7443),
        tls=ssl.create_default_context(),
        name="gw1",
        instance="i1",
        sink=sink,
        rng=random.Random(7),
        connect_tcp=silent,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(link.serve)
        await await_true(lambda: len(dials) >= 12, "twelve dials", timeout=120, poll_s=0.5)
        nursery.cancel_scope.cancel()

    assert sink.states[0] == (
        False,
        "no answer from cp:7443 within 3.5 s: check the address, routes and firewalls; dialling again",
    )
    assert all(not up for up, _ in sink.states)
    gaps = [b - a for a, b in zip(dials, dials[1:], strict=False)]
    assert all(gl.TCP_CONNECT_TIMEOUT_S <= gap <= gl.TCP_CONNECT_TIMEOUT_S + gl.LINK_BACKOFF.max_s for gap in gaps)
    # The longest wait for a SYN: from the last resend within a dial to the next dial's first SYN.
    last_resend = max(s for s in SYN_RESENDS_S if s < gl.TCP_CONNECT_TIMEOUT_S)
    assert max(gap - last_resend for gap in gaps) <= 3.5
