"""`llmgw doctor`: check this node, one line per check, and exit 0 (ok), 1 (warnings) or 2 (a failure).

Like `llmgw agent`, this entry starts node-side code, so it is allowed to import the `agent`
package (see src/python/llmgw/BUILD); it does so only when it runs, so `llmgw --help` does not
pay for discovery's imports. Paths and fabrics come from `--config agent.toml` when given, and
each flag wins over the file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmgw import config as cfg
from llmgw import driverpaths
from llmgw.cli import Parser, add_json_flag, fabric_arg


def configure(parser: Parser) -> None:
    parser.description = (
        "check that this node can do its job: CPU features, Python, disk, clock, what a llama.cpp build needs, "
        "GPUs and driver, vLLM, Vulkan devices, fabric manager, IMEX, GPUDirect RDMA, subnet managers, declared fabrics, the "
        "control plane. "
        "Exit status: 0 all ok, 1 warnings (or something could not be checked), 2 a failure."
    )
    add_json_flag(parser)
    parser.add_argument("--config", type=Path, metavar="AGENT_TOML", help="take paths and fabrics from agent.toml")
    parser.add_argument(
        "--fabric",
        action="append",
        type=fabric_arg,
        metavar="NAME[:ADAPTER,...]",
        help="a fabric this node is on, e.g. ib-a:mlx5_0,mlx5_1 (without adapters: the next two by name); repeatable",
    )
    parser.add_argument(
        "--server", metavar="HOST:PORT", help="the control plane's agent port: check that this node reaches it"
    )
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="CHECK[,CHECK]",
        help="run and show these checks but leave them out of the exit status (e.g. clock)",
    )
    where = parser.add_argument_group("where to look (default: agent.toml's value, else the usual place)")
    driverpaths.add_options(where, absolute=False, overrides="agent.toml")
    where.add_argument("--ip", metavar="PATH", help="the ip tool, for RoCE interfaces' networks (default /usr/sbin/ip)")
    where.add_argument(
        "--weights-dir",
        metavar="DIR",
        help="where weights go (default <state_dir>/weights, /var/lib/llmgw-agent/weights)",
    )
    where.add_argument("--proc-root", metavar="DIR", help="the proc filesystem (default /proc)")
    where.add_argument("--pci-root", metavar="DIR", help="PCI devices in sysfs (default /sys/bus/pci/devices)")
    where.add_argument(
        "--vulkaninfo", metavar="PATH", help="Vulkan's vulkaninfo, from vulkan-tools (default /usr/bin/vulkaninfo)"
    )
    where.add_argument("--dri-dir", metavar="DIR", help="where GPUs' render nodes are (default /dev/dri)")


def _server_of(url: str) -> str:
    from agent.doctor import parse_server

    host, port = parse_server(url)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run(args: argparse.Namespace) -> int:
    from agent import doctor
    from agent.discovery.snapshot import Sources, sources_from_config

    agent_cfg = cfg.load_agent_config(args.config) if args.config else None
    paths = {
        "nvidia_smi": args.nvidia_smi,
        "sminfo": args.sminfo,
        "ip": args.ip,
        "ib_root": Path(args.ib_root) if args.ib_root else None,
        "weights_dir": Path(args.weights_dir) if args.weights_dir else None,
        "proc_root": Path(args.proc_root) if args.proc_root else None,
        "pci_root": Path(args.pci_root) if args.pci_root else None,
        "vulkaninfo": args.vulkaninfo,
        "dri_dir": Path(args.dri_dir) if args.dri_dir else None,
    }
    if agent_cfg:
        sources = sources_from_config(agent_cfg, **paths)
    else:
        sources = Sources(**{k: v for k, v in paths.items() if v is not None})
    fabrics = tuple(args.fabric) if args.fabric else (agent_cfg.fabrics if agent_cfg else ())
    # With several control planes, the first agent.toml names (the others are the agent's to try).
    server = args.server or (_server_of(cfg.control_planes(agent_cfg)[0]) if agent_cfg else "")
    ignore = frozenset(name.strip() for item in args.ignore for name in item.split(",") if name.strip())
    rep = doctor.run(doctor.Request(sources=sources, fabrics=fabrics, server=server, ignore=ignore))
    if args.json:
        print(json.dumps(doctor.to_data(rep), indent=2))
    else:
        print(doctor.format_human(rep))
    return rep.exit_status
