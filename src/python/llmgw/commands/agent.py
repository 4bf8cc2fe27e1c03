"""`llmgw agent`: the node side. The only module of llmgw that imports the `agent` package."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs

from llmgw import config as cfg
from llmgw import pki
from llmgw.cli import Parser, add_group, add_leaf
from llmgw.commands._service import run_service

DEFAULT_CONFIG = "/etc/llmgw/agent.toml"


def configure(parser: Parser) -> None:
    sub = add_group(parser, "verb")
    run = add_leaf(
        sub, "run", "run the agent: connect to the control plane and keep the node's work running", run_agent
    )
    run.add_argument("--config", default=DEFAULT_CONFIG, type=Path, help=f"agent.toml (default {DEFAULT_CONFIG})")
    for flag, key, what in (
        ("--llamacpp-bin", "llamacpp_bin", 'a llama-server you installed (used when llama.cpp\'s version is "")'),
        ("--vllm-bin", "vllm_bin", 'a vllm command you installed (used when vLLM\'s version is "")'),
        (
            "--sglang-python",
            "sglang_python",
            'the Python of your SGLang environment (used when SGLang\'s version is "")',
        ),
    ):
        run.add_argument(flag, dest=key, metavar="PATH", help=f"{what}; overrides agent.toml")
    csr = add_leaf(
        sub,
        "csr",
        "make this node's private key (kept here) and a certificate signing request for the control plane",
        run_csr,
    )
    csr.add_argument("--config", default=DEFAULT_CONFIG, type=Path, help=f"agent.toml (default {DEFAULT_CONFIG})")


def run_agent(args: argparse.Namespace) -> int:
    from agent.main import run_agent as serve

    config = cfg.load_agent_config(args.config)
    overrides = {k: getattr(args, k) for k in ("llamacpp_bin", "vllm_bin", "sglang_python") if getattr(args, k)}
    return run_service("agent", serve, attrs.evolve(config, **overrides))


def run_csr(args: argparse.Namespace) -> int:
    from agent.main import node_id_of

    config = cfg.load_agent_config(args.config)
    node_id = node_id_of(config)
    files = pki.write_node_key_and_csr(Path(config.state_dir), node_id)
    print(f"key (stays on this node): {files.key}")
    print(f"certificate signing request for node {node_id!r}: {files.csr}")
    print(f"on the control plane: llmgw ca issue {node_id} --csr node.csr --out node.crt")
    print(f"then copy node.crt to {files.cert} and the CA's ca.crt to {files.ca_cert}")
    return 0
