"""Where engines listen: the link's local address, known from the first connect, changes woken."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from agent.node_address import NodeAddress, address_present, local_host


@pytest.mark.trio
async def test_known_from_the_first_set_and_each_change_wakes_the_waiters() -> None:
    address = NodeAddress()
    assert address.current == ""
    woken: list[str] = []

    async def watch() -> None:
        while True:
            await address.wait_changed()
            woken.append(address.current)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await trio.testing.wait_all_tasks_blocked()
        address.set("")  # nothing known: nothing changes
        address.set("10.0.0.5")
        assert await address.wait_known() == "10.0.0.5"
        await trio.testing.wait_all_tasks_blocked()
        address.set("10.0.0.5")  # the same again: no change
        await trio.testing.wait_all_tasks_blocked()
        address.set("10.0.0.6")
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert woken == ["10.0.0.5", "10.0.0.6"]
    assert await NodeAddress("127.0.0.1").wait_known() == "127.0.0.1"


def test_local_host_of_a_connected_socket() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname(), source_address=("127.0.0.3", 0)) as client:
            assert local_host(client) == "127.0.0.3"


@pytest.mark.parametrize(
    ("host", "present"),
    [("127.0.0.1", True), ("127.0.0.200", True), ("0.0.0.0", True), ("::", True), ("192.0.2.123", False)],
)
def test_address_present(host: str, present: bool) -> None:
    # 192.0.2.0/24 is TEST-NET-1: on no machine's interface.
    assert address_present(host) is present
