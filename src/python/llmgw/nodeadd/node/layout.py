"""Where `llmgw node add` puts things on a node, and the files it writes there.

    /usr/local/bin/llmgw                    the release zipapp (the same file as on the control plane's download)
    /etc/llmgw/agent.toml                   the agent's configuration
    /var/lib/llmgw-agent/pki/               node.key (made there, never leaves), node.csr, node.crt, ca.crt
    /var/lib/llmgw-agent/release/           the llama.cpp archive of the release `--release` named, and a
                                            SHA256SUMS listing it (llmgw.releasefiles.NODE_RELEASE_DIR)
    /etc/systemd/system/llmgw-agent.service the unit, where systemd runs the node
    /run/llmgw-agent.pid, /var/log/llmgw-agent.log   the fallback supervisor's, where it does not
    /usr/local/share/ca-certificates/llmgw-ca.crt    the CA root, trusted system-wide (Debian, Ubuntu)
    /etc/pki/ca-trust/source/anchors/llmgw-ca.crt    the same on RHEL and its relatives

Also the decisions `identify` makes from what the node answered (`parse_probe` with the trust
stores' tools, `trust_store`): a node's answer selects a row of a fixed table or fails, and never
becomes part of a command.

Pure: rendering and deciding only, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs
import tomli_w

from llmgw import config as cfg
from llmgw.errors import MachineError
from llmgw.nodeadd import layout as machine
from llmgw.nodeadd.layout import BIN, STAGE_PREFIX, Probe
from llmgw.releasefiles import NODE_RELEASE_DIR, SUMS

__all__ = ["BIN", "STAGE_PREFIX", "Probe"]  # the toolkit's, as node add names them

CONFIG = "/etc/llmgw/agent.toml"
STATE_DIR = cfg.DEFAULT_AGENT_STATE_DIR
PKI_DIR = f"{STATE_DIR}/pki"
UNIT_NAME = "llmgw-agent.service"
UNIT = f"/etc/systemd/system/{UNIT_NAME}"
PID_FILE = "/run/llmgw-agent.pid"
LOG_FILE = "/var/log/llmgw-agent.log"
RELEASE_DIR = f"{STATE_DIR}/{NODE_RELEASE_DIR}"
RELEASE_SUMS = f"{RELEASE_DIR}/{SUMS}"

# -- the system trust store -----------------------------------------------------------------
#
# What runs as root on the node to trust the CA root system-wide comes from this table only,
# chosen by the OS family that /etc/os-release names. The node's answers select a row or
# nothing: no string the node sends becomes part of a command.


@attrs.frozen(kw_only=True)
class TrustStore:
    family: str  # as docs/node-onboarding.md names it
    ids: tuple[str, ...]  # os-release ID / ID_LIKE values of the family
    tool: str  # absolute path, where the family's package puts it
    args: tuple[str, ...]
    anchor: str  # where the family takes an extra root
    install: str  # the command that installs the tool


TRUST_STORES = (
    TrustStore(
        family="Debian, Ubuntu",
        ids=("debian", "ubuntu"),
        tool="/usr/sbin/update-ca-certificates",
        args=(),
        anchor="/usr/local/share/ca-certificates/llmgw-ca.crt",
        install="sudo apt-get install ca-certificates",
    ),
    TrustStore(
        family="RHEL, Fedora, CentOS, Rocky, AlmaLinux",
        ids=("rhel", "fedora", "centos", "rocky", "almalinux"),
        tool="/usr/bin/update-ca-trust",
        args=("extract",),
        anchor="/etc/pki/ca-trust/source/anchors/llmgw-ca.crt",
        install="sudo dnf install ca-certificates",
    ),
)


TRUST_TOOLS = tuple(t.tool for t in TRUST_STORES)
# What `identify` learns in one round trip: the toolkit's probe, and which trust tool is there.
PROBE = machine.probe_script(TRUST_TOOLS)


def parse_probe(stdout: str) -> Probe:
    """The probe's stdout, read as data (llmgw.nodeadd.layout.parse_probe): a `tool=` line counts
    only when it is one of TRUST_STORES' own paths."""
    return machine.parse_probe(stdout, TRUST_TOOLS)


def trust_store(probe: Probe, target: str) -> TrustStore:
    """The row of TRUST_STORES for the node's OS family, with its tool there; else MachineError
    naming what the node said and what the operator can do."""
    skip = (
        "or add the node with --no-system-trust: the agent trusts only its own pki/ca.crt, so the CA root then "
        "stays out of the system store and nothing else changes"
    )
    families = "; ".join(f"{t.family} ({t.tool.rsplit('/', 1)[-1]})" for t in TRUST_STORES)
    if not probe.os_id:
        raise MachineError(
            f"{target} has no readable /etc/os-release (nor /usr/lib/os-release), so llmgw cannot tell which "
            f"system trust store it has (it knows {families}); {skip}"
        )
    said = f"ID={_shown(probe.os_id)}" + (f" ID_LIKE={_shown(' '.join(probe.os_like))}" if probe.os_like else "")
    names = [probe.os_id, *probe.os_like]
    store = next((t for name in names for t in TRUST_STORES if name in t.ids), None)
    if store is None:
        raise MachineError(
            f"{target}: its os-release says {said}, and llmgw knows the system trust store only of {families}; "
            f"{skip}"
        )
    if store.tool not in probe.tools:
        raise MachineError(
            f"{target}: its os-release says {said} ({store.family}), but it has no {store.tool} to trust the "
            f"cluster's CA root system-wide; install it (`{store.install}` there) and run again, {skip}"
        )
    return store


def _shown(value: str) -> str:
    # A node's value in a message: quoted with escapes (no control characters reach the terminal), and short.
    return repr(value if len(value) <= 64 else value[:64] + "...")


def trust_commands(store: TrustStore, staged_ca: str) -> list[list[str]]:
    """The argv run as root to trust the staged CA root system-wide: all from `store`, the
    staging path from node add itself."""
    return [
        ["install", "-D", "-m", "0644", staged_ca, store.anchor],
        [store.tool, *store.args],
    ]


def agent_toml(
    *,
    server: str | tuple[str, ...],
    node_id: str,
    fabrics: Sequence[cfg.FabricDecl] = (),
    llamacpp_bin: str = "",
    vllm_bin: str = "",
    sglang_python: str = "",
    driver_paths: Mapping[str, str] = MappingProxyType({}),
    keep: cfg.AgentConfig | None = None,
) -> str:
    """The node's agent.toml; checked by the same loader the agent uses before it is shipped.
    `server`: this control plane's agent port, or every control plane's (this one first).

    `keep` is the node's agent.toml from before: the settings this add was not given (nvidia_smi,
    ib_root, sminfo unless in `driver_paths`; weights_dir, source_address) stay as they were.
    `driver_paths` (--nvidia-smi, --ib-root, --sminfo, by key) replace what was kept; a path equal
    to the default is written as no key at all, which is how a node returns to the default."""
    data: dict = {"server": list(server) if isinstance(server, tuple) else server, "node_id": node_id}
    data["state_dir"] = STATE_DIR
    defaults = cfg.AgentConfig(server=server)
    if keep is not None:
        for key in _KEPT:
            value = getattr(keep, key)
            if value != getattr(defaults, key):
                data[key] = value
    for key, value in driver_paths.items():
        data.pop(key, None)
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


# The sandboxing the agent's unit sets, and each one it does not with the reason: the unit
# carries both (as comments), docs/node-onboarding.md shows them, and a test keeps them agreeing.
HARDENING = (
    ("NoNewPrivileges", "yes"),
    ("ProtectKernelTunables", "yes"),
    ("ProtectKernelLogs", "yes"),
    ("ProtectControlGroups", "yes"),
    ("ProtectHostname", "yes"),
    ("RestrictSUIDSGID", "yes"),
    ("RestrictNamespaces", "yes"),
    ("RestrictRealtime", "yes"),
    ("LockPersonality", "yes"),
    ("SystemCallArchitectures", "native"),
    # System calls and capabilities no agent, engine, build or package install uses; a call that
    # is refused fails with EPERM rather than killing the process.
    ("SystemCallFilter", "~@clock @cpu-emulation @obsolete @reboot @swap"),
    ("SystemCallErrorNumber", "EPERM"),
    (
        "CapabilityBoundingSet",
        "~CAP_SYS_BOOT CAP_SYS_TIME CAP_WAKE_ALARM CAP_SYS_PACCT CAP_SYS_TTY_CONFIG CAP_LINUX_IMMUTABLE "
        "CAP_BLOCK_SUSPEND CAP_MAC_ADMIN CAP_MAC_OVERRIDE CAP_AUDIT_CONTROL CAP_AUDIT_READ",
    ),
    ("UMask", "0077"),
)
NOT_HARDENED = (
    ("ProtectSystem", "the agent installs infiniband-diags with apt-get or dnf where a fabric needs sminfo, "
     "which writes /usr and /etc"),
    ("ProtectHome", "pip, Hugging Face and the engines' compile caches live under root's home"),
    ("PrivateTmp", "engines outlive an agent restart (KillMode=process) and a unit's private /tmp is deleted "
     "when it stops, under the engines still using it"),
    ("PrivateDevices", "engines need the GPUs (/dev/nvidia*) and InfiniBand (/dev/infiniband)"),
    ("ProtectClock", "it implies a device allow-list, which would close /dev/nvidia* too"),
    ("ProtectKernelModules", "nvidia-smi and CUDA load the nvidia modules through nvidia-modprobe where "
     "nothing loaded them at boot"),
    ("MemoryDenyWriteExecute", "Python's cffi, CUDA's PTX JIT, Triton and torch.compile write code at run time"),
    ("RestrictAddressFamilies", "RDMA (rdma_cm, NCCL over InfiniBand) uses AF_IB and netlink families beyond "
     "AF_INET/AF_UNIX"),
    ("User", "the agent installs engines and system packages, and runs engines with the GPUs, as root"),
)  # fmt: skip


def systemd_unit(*, bin_path: str = BIN, config_path: str = CONFIG) -> str:
    hardening = "\n".join(f"{key}={value}" for key, value in HARDENING)
    not_set = "\n".join(f"#   {key}: {why}" for key, why in NOT_HARDENED)
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

# Sandboxing, as far as the agent allows (docs/node-onboarding.md, "The agent's unit").
{hardening}
# Not set, and why:
{not_set}

[Install]
WantedBy=multi-user.target
"""


def log_hint(systemd: bool) -> str:
    return f"journalctl -u {UNIT_NAME}" if systemd else LOG_FILE
