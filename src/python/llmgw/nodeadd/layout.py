"""Where `llmgw node add` puts things on a node, and the files it writes there.

    /usr/local/bin/llmgw                    the release zipapp (the same file as on the control plane's download)
    /etc/llmgw/agent.toml                   the agent's configuration
    /var/lib/llmgw-agent/pki/               node.key (made there, never leaves), node.csr, node.crt, ca.crt
    /etc/systemd/system/llmgw-agent.service the unit, where systemd runs the node
    /run/llmgw-agent.pid, /var/log/llmgw-agent.log   the fallback supervisor's, where it does not
    /usr/local/share/ca-certificates/llmgw-ca.crt    the CA root, trusted system-wide (Debian, Ubuntu)
    /etc/pki/ca-trust/source/anchors/llmgw-ca.crt    the same on RHEL and its relatives

Pure: rendering only, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import tomli_w

from llmgw import config as cfg

BIN = "/usr/local/bin/llmgw"
CONFIG = "/etc/llmgw/agent.toml"
STATE_DIR = cfg.DEFAULT_AGENT_STATE_DIR
PKI_DIR = f"{STATE_DIR}/pki"
UNIT_NAME = "llmgw-agent.service"
UNIT = f"/etc/systemd/system/{UNIT_NAME}"
PID_FILE = "/run/llmgw-agent.pid"
LOG_FILE = "/var/log/llmgw-agent.log"
STAGE_PREFIX = "/tmp/llmgw-node-add."

# The system trust tool, and where it takes an extra root: the first one the node has is used.
TRUST_ANCHORS = {
    "update-ca-certificates": "/usr/local/share/ca-certificates/llmgw-ca.crt",
    "update-ca-trust": "/etc/pki/ca-trust/source/anchors/llmgw-ca.crt",
}
TRUST_ARGS = {"update-ca-certificates": (), "update-ca-trust": ("extract",)}

# What `identify` learns in one round trip. A constant script: nothing is interpolated into it.
PROBE = r"""
echo "hostname=$(uname -n)"
echo "arch=$(uname -m)"
if [ -d /run/systemd/system ]; then echo "systemd=yes"; else echo "systemd=no"; fi
for tool in update-ca-certificates update-ca-trust; do
  for dir in /usr/sbin /usr/bin /sbin /bin; do
    if [ -x "$dir/$tool" ]; then echo "trust=$dir/$tool"; break 2; fi
  done
done
"""


def parse_probe(stdout: str) -> dict[str, str]:
    facts: dict[str, str] = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("hostname", "arch", "systemd", "trust"):
            facts.setdefault(key, value.strip())
    return facts


def agent_toml(
    *,
    server: str,
    node_id: str,
    fabrics: Sequence[cfg.FabricDecl] = (),
    llamacpp_bin: str = "",
    vllm_bin: str = "",
    sglang_python: str = "",
    keep: cfg.AgentConfig | None = None,
) -> str:
    """The node's agent.toml; checked by the same loader the agent uses before it is shipped.

    `keep` is the node's agent.toml from before: the settings node add does not own (nvidia_smi,
    ib_root, sminfo, weights_dir, source_address) stay as they were."""
    data: dict = {"server": server, "node_id": node_id, "state_dir": STATE_DIR}
    if keep is not None:
        defaults = cfg.AgentConfig(server=server)
        for key in _KEPT:
            value = getattr(keep, key)
            if value != getattr(defaults, key):
                data[key] = value
    for key, value in (("llamacpp_bin", llamacpp_bin), ("vllm_bin", vllm_bin), ("sglang_python", sglang_python)):
        if value:
            data[key] = value
    if fabrics:
        data["fabrics"] = [{"name": f.name, "adapters": list(f.adapters)} for f in fabrics]
    cfg.agent_config_from_dict(data, "the agent.toml node add writes")  # raises ConfigError if wrong
    head = (
        "# Written by `llmgw node add`. Adding the node again rewrites it and keeps its settings (not its comments).\n"
    )
    return head + tomli_w.dumps(data)


_KEPT = ("nvidia_smi", "ib_root", "sminfo", "weights_dir", "source_address")


def systemd_unit(*, bin_path: str = BIN, config_path: str = CONFIG) -> str:
    return f"""\
# Written by `llmgw node add`; running it again rewrites this file.
[Unit]
Description=llmgw agent: runs this node's share of the LLM cluster
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart={bin_path} agent run --config {config_path}
Restart=always
RestartSec=2
# The agent stops its engines itself on a clean stop (SIGTERM: each engine gets SIGTERM, then
# SIGKILL after 10 s, well within TimeoutStopSec). An agent that crashes or is killed must not
# take the replicas with it: the engines keep serving and the agent started next adopts them.
# So only the agent's own process is signalled, not the rest of its control group.
KillMode=process
TimeoutStopSec=30

[Install]
WantedBy=multi-user.target
"""


def log_hint(systemd: bool) -> str:
    return f"journalctl -u {UNIT_NAME}" if systemd else LOG_FILE
