"""`--fabric NAME[:ADAPTERS]` and the agent.toml keys discovery reads."""

from __future__ import annotations

import pytest

from llmgw import config
from llmgw.config import FabricDecl
from llmgw.errors import ConfigError


def test_a_fabric_with_and_without_adapters() -> None:
    assert config.parse_fabric_flag("ib-b:mlx5_2,mlx5_3") == FabricDecl(name="ib-b", adapters=("mlx5_2", "mlx5_3"))
    assert config.parse_fabric_flag("ib-b") == FabricDecl(name="ib-b", adapters=())


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("ib b", "fabric name 'ib b' may use only letters, digits"),
        (":mlx5_0", "fabric name '' may use only"),
        ("ib-a:", "adapters of fabric 'ib-a' must be a comma-separated list of names like mlx5_0, got ''"),
        ("ib-a:mlx5_0,,mlx5_1", "got 'mlx5_0,,mlx5_1'"),
        ("ib-a:mlx5_0,mlx5_0", "fabric 'ib-a' names an adapter twice: 'mlx5_0,mlx5_0'"),
    ],
)
def test_bad_fabric_flags_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError) as info:
        config.parse_fabric_flag(text)
    assert says in str(info.value)


def test_sminfo_and_weights_dir() -> None:
    cfg = config.agent_config_from_dict({"server": "wss://10.0.0.1:7443"})
    assert cfg.sminfo == "/usr/sbin/sminfo"
    assert config.weights_dir_of(cfg) == "/var/lib/llmgw-agent/weights"
    moved = config.agent_config_from_dict({"server": "wss://10.0.0.1:7443", "weights_dir": "/models"})
    assert config.weights_dir_of(moved) == "/models"
    with pytest.raises(ConfigError) as info:
        config.agent_config_from_dict({"server": "wss://10.0.0.1:7443", "weights_dir": "models"})
    assert info.value.problems == ["weights_dir must be an absolute path, got 'models' @ $.weights_dir"]
