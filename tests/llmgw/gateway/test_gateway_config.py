"""server.toml's `[gateway]`: the section is the gateway's options (declared once), every key
reaches the gateway, and a bad value is refused with its path."""

from __future__ import annotations

import pytest

from llmgw import config
from llmgw.errors import ConfigError
from llmgw.gateway.app import Gateway
from llmgw.gateway.routing import Rotation
from llmgw.wire.gateway_link import ModelInfo
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
                "max_idle_per_replica": 16,
                "prefix_block_chars": 128,
                "prefix_max_chars": 4096,
                "prefix_load_factor": 1.5,
                "prefix_table_entries": 1000,
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
    assert (pool.max_idle_per_endpoint, router.probe_interval_s, router.max_outstanding) == (16, 2.0, 8)
    assert (router.prefix_load_factor, router.prefix.entries) == (1.5, 1000)
    gw.apply(Rotation(models=frozenset({"m"}), endpoints=(), details=(ModelInfo(name="m", routing="prefix"),)))
    assert (gw.prefix_models.models, gw.prefix_models.block_chars, gw.prefix_models.max_blocks) == ({"m"}, 128, 32)


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
        config.server_config_from_dict(
            {"gateway": {"affinity_chars": 256, "prefix_load_factor": 0.5, "prefix_block_chars": 0}}
        )
    assert got.value.problems == [
        'affinity_chars is gone: models are routed by prefix now (each model\'s routing = "prefix", the default '
        "for llama.cpp, vLLM and SGLang; docs/gateway.md); remove this line @ $.gateway.affinity_chars",
        "must be at least 1, got 0 @ $.gateway.prefix_block_chars",
        "must be at least 1 (1: a cache-holding replica may have one request more than the least loaded), "
        "got 0.5 @ $.gateway.prefix_load_factor",
    ]
    with pytest.raises(ConfigError) as got:
        config.server_config_from_dict({"models": [{"name": "m", "engine": "sim", "routing": "random"}]})
    assert any("unknown routing 'random'" in p and p.endswith("@ $.models[0].routing") for p in got.value.problems)
    # cache_events: engines that publish them, routed by prefix.
    with pytest.raises(ConfigError) as got:
        config.server_config_from_dict(
            {
                "models": [
                    {"name": "a", "engine": "llamacpp", "source": {"path": "/m.gguf"}, "cache_events": True},
                    {
                        "name": "b",
                        "engine": "vllm",
                        "source": {"path": "/m"},
                        "cache_events": True,
                        "routing": "least_outstanding",
                    },
                    {"name": "c", "engine": "sglang", "source": {"path": "/m"}, "cache_events": True},
                ]
            }
        )
    assert [p for p in got.value.problems if "cache_events" in p] == [
        "llamacpp publishes no KV-cache events (vllm and sglang do); remove cache_events @ $.models[0].cache_events",
        'cache_events serves routing by prefix, and this model is routed by load (routing = "least_outstanding"); '
        "remove one of them @ $.models[1].cache_events",
    ]
    ok = config.server_config_from_dict(
        {"models": [{"name": "c", "engine": "sglang", "source": {"path": "/m"}, "cache_events": True}]}
    )
    assert ok.models[0].cache_events is True
    with pytest.raises(ConfigError) as got:
        config.server_config_from_dict({"gateway": {"connect_timout_s": 1, "max_attempts": "3"}})
    text = str(got.value)
    assert "unknown key 'connect_timout_s'" in text and "connect_timeout_s" in text
    assert "expected int, got str '3' @ $.gateway.max_attempts" in text
