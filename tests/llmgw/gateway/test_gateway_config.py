"""server.toml's `[gateway]`: the section is the gateway's options (declared once), every key
reaches the gateway, and a bad value is refused with its path."""

from __future__ import annotations

import pytest

from llmgw import config
from llmgw.errors import ConfigError
from llmgw.gateway.app import Gateway
from testlib.endpoints import StaticEndpoints


def test_the_section_is_the_gateways_options_and_each_key_reaches_it() -> None:
    assert Gateway(StaticEndpoints(), keys=None).options == config.ServerConfig().gateway
    cfg = config.server_config_from_dict(
        {
            "gateway": {
                "connect_timeout_s": 0.5,
                "first_byte_timeout_s": 20,
                "read_timeout_s": 300,
                "probe_interval_s": 2,
                "probe_timeout_s": 1,
                "queue_timeout_s": 10,
                "max_queue": 50,
                "max_attempts": 2,
                "max_outstanding_per_replica": 8,
                "affinity_chars": 256,
                "max_idle_per_replica": 16,
            }
        }
    )
    gw = Gateway(StaticEndpoints(), keys=None, options=cfg.gateway)
    assert gw.options is cfg.gateway
    pool, router = gw.pool, gw.router
    assert (pool.connect_timeout_s, pool.first_byte_timeout_s, pool.read_timeout_s, pool.probe_timeout_s) == (
        0.5,
        20.0,
        300.0,
        1.0,
    )
    assert (pool.max_idle_per_endpoint, router.probe_interval_s, router.max_outstanding, router.affinity_chars) == (
        16,
        2.0,
        8,
        256,
    )


def test_bad_values_are_refused_each_with_its_path() -> None:
    with pytest.raises(ConfigError) as got:
        config.server_config_from_dict(
            {
                "gateway": {
                    "connect_timeout_s": 0,
                    "probe_interval_s": -1,
                    "first_byte_timeout_s": 30,
                    "read_timeout_s": 10,
                    "max_attempts": 0,
                    "max_queue": -5,
                }
            }
        )
    assert got.value.problems == [
        "must be more than 0 seconds, got 0.0 @ $.gateway.connect_timeout_s",
        "must be more than 0 seconds, got -1.0 @ $.gateway.probe_interval_s",
        "read_timeout_s (10.0) must be at least first_byte_timeout_s (30.0) @ $.gateway.read_timeout_s",
        "must be at least 1, got 0 @ $.gateway.max_attempts",
        "must not be negative, got -5 @ $.gateway.max_queue",
    ]
    with pytest.raises(ConfigError) as got:
        config.server_config_from_dict({"gateway": {"connect_timout_s": 1, "max_attempts": "3"}})
    text = str(got.value)
    assert "unknown key 'connect_timout_s'" in text and "connect_timeout_s" in text
    assert "expected int, got str '3' @ $.gateway.max_attempts" in text
