"""What a control plane of a shared store says of itself and of the leader, without I/O: the
addresses it writes into the lease when it leads (`advertised`), and where a standby sends
agents and `llmgw ctl` from what it last read of the lease (`Seat.leader`). The seat's life
(standby, leader, standby) is tests/integration/test_leader_takeover.py's."""

from __future__ import annotations

from pathlib import Path

import attrs

from llmgw.config import ServerConfig, ServerSection, StoreSection
from llmgw.server.front import Bound
from llmgw.server.leadership.leader import LeaseKeeper
from llmgw.server.leadership.seat import Seat, advertised
from llmgw.server.store.lease import Holder, LeaseRow

ME = Holder(id="me", agent_url="wss://10.0.0.1:7443", admin_url="http://10.0.0.1:8080")


def config(**server) -> ServerConfig:
    return ServerConfig(server=ServerSection(**server), store=StoreSection(url="postgresql://db/llmgw"))


def test_the_addresses_come_from_the_listeners_or_advertise_or_the_keys() -> None:
    specific = config(agent_listen="10.0.0.1:7443", http_listen="10.0.0.1:8080", advertise=("cp-a.example",))
    assert advertised(specific) == ("wss://10.0.0.1:7443", "http://10.0.0.1:8080")
    everywhere = config(agent_listen="0.0.0.0:7443", http_listen="[::]:8080", advertise=("cp-a.example",))
    assert advertised(everywhere) == ("wss://cp-a.example:7443", "http://cp-a.example:8080")
    v6 = config(agent_listen="[fd00::1]:7443", http_listen="[fd00::1]:8080")
    assert advertised(v6) == ("wss://[fd00::1]:7443", "http://[fd00::1]:8080")
    given = config(agent_url="wss://cp-a.lb:443", admin_url="https://admin.example:8443")
    assert advertised(given) == ("wss://cp-a.lb:443", "https://admin.example:8443")


def test_a_port_of_the_systems_choosing_is_said_once_bound() -> None:
    zero = config(agent_listen="10.0.0.1:0", http_listen="10.0.0.1:0")
    bound = Bound(agent_address=("10.0.0.1", 41000), http_address=("10.0.0.1", 42000))
    assert advertised(zero, bound) == ("wss://10.0.0.1:41000", "http://10.0.0.1:42000")


def seat(seen: LeaseRow | None) -> Seat:
    keeper = LeaseKeeper(db=None, holder=ME, ttl_s=5.0, renew_s=1.0)  # type: ignore[arg-type] - nothing is run
    keeper.seen = seen
    return Seat(
        config=config(), state_dir=Path("/nonexistent"), config_path=None, warm=None, keeper=keeper, open_plane=None
    )  # type: ignore[arg-type]


HELD = LeaseRow(
    holder="other", agent_url="wss://10.0.0.2:7443", admin_url="http://10.0.0.2:8080", epoch=7, remaining_s=3.0
)


def test_a_standby_names_the_holder_of_a_lease_that_runs() -> None:
    leader = seat(HELD).leader()
    assert (leader.agent_url, leader.admin_url, leader.epoch) == ("wss://10.0.0.2:7443", "http://10.0.0.2:8080", 7)
    assert seat(HELD).redirect().leader == "wss://10.0.0.2:7443"


def test_a_lapsed_lease_an_unread_one_or_our_own_names_no_leader_and_asks_for_a_leases_wait() -> None:
    for seen, why in (
        (attrs.evolve(HELD, remaining_s=-0.5), "no control plane leads at the moment (a takeover is under way)"),
        (attrs.evolve(HELD, holder="me"), "no control plane leads at the moment (a takeover is under way)"),
        (None, "cannot read the lease now (the store does not answer)"),
    ):
        leader = seat(seen).leader()
        assert leader.view() is None and leader.why_none == why and leader.retry_after_s == 5.0
        assert seat(seen).redirect().leader == "" and why in seat(seen).redirect().message
