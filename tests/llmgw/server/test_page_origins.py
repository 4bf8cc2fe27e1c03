"""Which origins a cluster page session's change is taken from (`page_origins`): the addresses
server.toml gives this control plane, never a request's own `Host`."""

from __future__ import annotations

import pytest

from llmgw.config import ServerSection
from llmgw.server.admin.page import origin_of, page_origins

HOST = "cp1"  # the machine's host name


def origins(http_port: int = 8080, **server: object) -> set[str]:
    return set(page_origins(ServerSection(**server), http_port, HOST))  # type: ignore[arg-type]


def test_a_loopback_listener_is_the_machines_loopback_names_at_the_port_bound() -> None:
    assert origins(http_port=43121, http_listen="127.0.0.1:0") == {
        "http://127.0.0.1:43121",
        "http://localhost:43121",
        "http://[::1]:43121",
    }
    assert origins(http_listen="[::1]:8080") == origins(http_listen="127.0.0.1:8080")


def test_a_listener_on_one_address_is_that_address_and_the_advertised_ones_at_its_port() -> None:
    found = origins(http_listen="10.0.0.1:8080", advertise=("10.0.0.1", "LLMGW.example.internal"))
    assert found == {"http://10.0.0.1:8080", "http://llmgw.example.internal:8080"}
    assert "http://localhost:8080" not in found  # nothing on the machine's loopback answers there


@pytest.mark.parametrize("wildcard", ["0.0.0.0:8080", "[::]:8080"])
def test_a_listener_on_every_address_is_what_is_advertised_and_the_loopback_names(wildcard: str) -> None:
    # No browser can name 0.0.0.0: the operator's names for the machine are what it advertises.
    assert origins(http_listen=wildcard, advertise=("10.0.0.1", "2001:db8::7")) == {
        "http://10.0.0.1:8080",
        "http://[2001:db8::7]:8080",
        "http://127.0.0.1:8080",
        "http://localhost:8080",
        "http://[::1]:8080",
    }
    # Nothing advertised: the host name, as admin_url's default names the machine.
    assert "http://cp1:8080" in origins(http_listen=wildcard)
    assert "http://10.9.9.9:8080" not in origins(http_listen=wildcard)


def test_admin_url_and_page_origins_are_taken_as_browsers_write_them() -> None:
    found = origins(
        http_listen="127.0.0.1:8080",
        admin_url="https://LLMGW.example.com:443",
        page_origins=("http://127.0.0.1:9000", "http://tunnel.example:80"),
    )
    assert {"https://llmgw.example.com", "http://127.0.0.1:9000", "http://tunnel.example"} <= found
    assert origins(http_port=80, http_listen="10.0.0.1:80") == {"http://10.0.0.1"}  # a default port is left out


def test_an_origin_is_a_urls_scheme_host_and_port() -> None:
    assert origin_of("http://10.0.0.1:8080/admin/v1") == "http://10.0.0.1:8080"
    assert origin_of("https://[2001:DB8::1]:8443") == "https://[2001:db8::1]:8443"
    assert origin_of("HTTPS://Example.COM:443/") == "https://example.com"
    assert origin_of("http://10.0.0.1:99999") == "http://10.0.0.1:99999"  # no browser's: never a 500
