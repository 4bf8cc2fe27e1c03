"""The link protocol's modules do no I/O (h11's model): their syntax trees import no event loop,
socket, TLS, HTTP or WebSocket library, so the sessions can be driven from memory alone."""

from __future__ import annotations

import ast
from pathlib import Path

import llmgw.wire
import llmgw.wire.session  # (under Pants: brings the package's modules into the sandbox)

IO_MODULES = {"trio", "anyio", "asyncio", "socket", "ssl", "h11", "httpx", "trio_websocket", "wsproto", "selectors"}


def top_level_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_no_module_of_the_wire_package_imports_an_io_library() -> None:
    package = Path(llmgw.wire.__file__).parent
    files = sorted(package.rglob("*.py"))
    assert any(f.name == "session.py" for f in files), files
    found = {f.name: sorted(top_level_imports(f) & IO_MODULES) for f in files}
    assert {name: libs for name, libs in found.items() if libs} == {}


def test_the_check_sees_an_io_import(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("from __future__ import annotations\n\ndef f():\n    import trio.lowlevel\n")
    assert top_level_imports(planted) & IO_MODULES == {"trio"}
