"""The HTTP/1.1 codec does no I/O (h11's model), so both roles are driven from memory alone: its
modules import nothing but the standard library's pure parts, attrs, llmgw's errors and each
other (the BUILD rule says the same to Pants; this says it to pytest, inside functions too)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import llmgw.h1  # (under Pants: brings the package's modules into the sandbox)

ALLOWED = {"__future__", "attrs", "llmgw.errors", "llmgw.h1"}
IO_MODULES = {"asyncio", "selectors", "socket", "ssl", "subprocess", "threading", "os", "io"}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


def refused(name: str) -> bool:
    top = name.split(".")[0]
    if any(name == a or name.startswith(a + ".") for a in ALLOWED):
        return False
    return top in IO_MODULES or top not in sys.stdlib_module_names


def test_the_codec_imports_no_io_and_nothing_of_llmgw_but_its_errors() -> None:
    files = sorted(Path(llmgw.h1.__file__).parent.rglob("*.py"))
    assert {f.name for f in files} >= {"readers.py", "server_role.py", "client_role.py"}, files
    found = {f.name: sorted(n for n in imports(f) if refused(n)) for f in files}
    assert {name: names for name, names in found.items() if names} == {}


def test_the_check_sees_an_event_loop_a_socket_and_the_http_stack(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import re\n\ndef f():\n    import trio.lowlevel\n    import socket\n    from llmgw.http import server\n"
    )
    assert sorted(n for n in imports(planted) if refused(n)) == ["llmgw.http", "socket", "trio.lowlevel"]
