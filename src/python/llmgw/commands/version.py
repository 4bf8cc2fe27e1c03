"""`llmgw version`: what this llmgw is and what runs it."""

from __future__ import annotations

import argparse
import json

import attrs

from llmgw.cli import Parser, add_json_flag
from llmgw.version import version_info


def configure(parser: Parser) -> None:
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    info = version_info()
    if args.json:
        print(json.dumps(attrs.asdict(info), indent=2))
    else:
        print(f"llmgw {info.version} (commit {info.commit}, built {info.build_date})")
        print(f"python {info.python} on {info.architecture} ({info.python_executable})")
    return 0
