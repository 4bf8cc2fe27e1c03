"""Reading the flags an engine documents out of its `--help` text. Pure: text in, flags out.

Two layouts are known, and each engine says which it prints:

- "column0" (llama.cpp): an option line starts at column 0 with its aliases, comma-separated,
  and the description follows at column 40 or on the next lines, indented:
      -c,    --ctx-size N                     size of the prompt context (default: ...)
      -cb,   --cont-batching, -nocb, --no-cont-batching
- "argparse" (vLLM, SGLang, llmgw's own sim): an option line is indented by a few spaces
  (2 per nesting level); descriptions are indented further (24 by default); the usage block
  and free text start at column 0 or deeper, so neither is taken for an option:
        -n NNODES, --nnodes NNODES
        --enable-log-requests, --no-enable-log-requests

Both spell paired switches `--x, --no-x` or `--[no-]x`; both forms count as two flags. The
aliases given on one line form a group (`-c` and `--ctx-size` are one option), which is how an
operator's `-c` is recognised as llmgw's `--ctx-size`.
"""

from __future__ import annotations

import re

import attrs

STYLES = ("column0", "argparse")

# argparse indents options by 2 per nesting level, descriptions by up to 24 (or more).
_ARGPARSE_MAX_INDENT = 10
_TOKEN = re.compile(r"^-{1,2}[A-Za-z0-9?][A-Za-z0-9_.?-]*")
_NO_PAIR = re.compile(r"^--\[no-?\]([A-Za-z0-9][A-Za-z0-9_.-]*)")
# Where an option line's flag column ends: a run of 2+ spaces not right after a comma (llama.cpp
# pads "-c,    --ctx-size"), or the end of the line.
_GAP = re.compile(r"(?<![,\s])\s{2,}")


@attrs.frozen
class HelpFlags:
    groups: tuple[frozenset[str], ...]  # the aliases of each documented option

    @property
    def flags(self) -> frozenset[str]:
        return frozenset().union(*self.groups)

    def aliases(self, flag: str) -> frozenset[str]:
        """`flag` and every flag documented on the same line as it."""
        return frozenset({flag}).union(*(g for g in self.groups if flag in g))


def documented_flags(text: str, style: str) -> HelpFlags:
    if style not in STYLES:
        raise ValueError(f"unknown help style {style!r} (one of: {', '.join(STYLES)})")
    groups = []
    for line in text.expandtabs().splitlines():
        body = line.lstrip(" ")
        indent = len(line) - len(body)
        if not body.startswith("-"):
            continue
        if style == "column0" and indent != 0:
            continue
        if style == "argparse" and not 1 <= indent <= _ARGPARSE_MAX_INDENT:
            continue
        group = _flags_of_head(_GAP.split(body, maxsplit=1)[0])
        if group:
            groups.append(group)
    return HelpFlags(groups=tuple(groups))


def _flags_of_head(head: str) -> frozenset[str]:
    """The flags in an option line's flag column: "-h, --help, --usage" -> {-h, --help, --usage}."""
    flags = set()
    for part in head.replace(",", " ").split():
        pair = _NO_PAIR.match(part)
        if pair:
            flags.update({f"--{pair.group(1)}", f"--no-{pair.group(1)}"})
            continue
        match = _TOKEN.match(part)
        if match:
            # "--flag=VALUE" and "--flag[=VALUE]" name "--flag".
            flags.add(match.group(0).rstrip("."))
    return frozenset(flags)
