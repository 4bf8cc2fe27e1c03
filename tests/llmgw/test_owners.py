"""One owner per piece of state, read from the sources (their syntax trees): every wake-up is a
`Wakeup` listed in llmgw.wakeup and no event is swapped by hand; SQLite is the store's alone.
(tests/llmgw/BUILD brings every source file into the sandbox under Pants.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import trio
import trio.testing

import llmgw
from llmgw.wakeup import ONE_SHOT, WAKEUPS, Wakeup

SRC = Path(llmgw.__file__).resolve().parent.parent  # src/python


def _makes(node: ast.AST, name: str) -> bool:
    """Whether an expression makes a `name` object: `name()`, `trio.name()`, or an attrs
    factory of it (`attrs.Factory(trio.Event)`, `attrs.field(factory=Wakeup)`)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            if _is(sub.func, name):
                return True
            if any(_is(a, name) for a in sub.args) or any(
                k.arg == "factory" and _is(k.value, name) for k in sub.keywords
            ):
                return True
    return False


def _is(expr: ast.AST, name: str) -> bool:
    """`name`, or `trio.name` (a `threading.Event` is not a trio event)."""
    if isinstance(expr, ast.Name):
        return expr.id == name
    trio_attr = isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "trio"
    return trio_attr and expr.attr == name


def sources() -> list[Path]:
    files = sorted(SRC.rglob("*.py"))
    seen = {str(f.relative_to(SRC)) for f in files}
    # All of them, not only what this test imports: a scan of a few files would pass for nothing.
    assert {"llmgw/server/app.py", "llmgw/http/server.py", "agent/replica_supervisor.py", "agent/link.py"} <= seen
    return files


def made(kind: str) -> list[str]:
    """Where each `kind` ("Wakeup", "Event") is made in src/python: module.Class.attribute for an
    attribute, module.[Class.]function.name for a local; one entry per assignment."""
    found: list[str] = []
    for path in sources():
        if path.name == "wakeup.py" and path.parent.name == "llmgw":
            continue  # the implementation itself
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        _visit(ast.parse(path.read_text(), str(path)), kind, [module], None, found)
    return found


def _visit(node: ast.AST, kind: str, scope: list[str], cls: str | None, found: list[str]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            _visit(child, kind, [*scope, child.name], ".".join([*scope, child.name]), found)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            _visit(child, kind, [*scope, child.name], cls, found)
        else:
            if isinstance(child, ast.Assign | ast.AnnAssign) and child.value is not None and _makes(child.value, kind):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        found.append(f"{cls}.{t.attr}")
                    elif isinstance(t, ast.Name):
                        found.append(".".join([*scope, t.id]))
            _visit(child, kind, scope, cls, found)


def test_every_wakeup_is_listed_and_every_listed_one_exists() -> None:
    wakeups = made("Wakeup")
    assert sorted(set(wakeups)) == sorted(WAKEUPS), "llmgw.wakeup.WAKEUPS and the sources disagree"
    assert len(wakeups) == len(set(wakeups)), "a Wakeup is made twice for one attribute: it is one edge"


def test_events_are_only_one_shot_ones_made_once() -> None:
    events = made("Event")
    unknown = sorted(set(events) - set(ONE_SHOT))
    assert unknown == [], f"trio.Event made outside llmgw.wakeup's lists (a wake-up is a Wakeup): {unknown}"
    missing = sorted(set(ONE_SHOT) - set(events))
    assert missing == [], f"listed in ONE_SHOT but not made in the sources: {missing}"
    swapped = sorted({e for e in events if e in ONE_SHOT and events.count(e) > 1})
    assert swapped == [], f"one-shot events replaced after they were made (make them Wakeups): {swapped}"


@pytest.mark.trio
async def test_a_fire_while_the_waiter_looks_is_not_lost_and_an_old_fire_is_not_seen_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    wakeup = Wakeup()
    before = wakeup.next()
    wakeup.fire()  # while the waiter was still looking at the state
    assert before.is_set()
    after = wakeup.next()
    assert not after.is_set()  # that fire is spent
    woken: list[float] = []

    async def waiter() -> None:
        await wakeup.wait()
        woken.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(5)
        assert woken == []
        wakeup.fire()
    assert woken == [5.0]


def _imports(tree: ast.AST) -> set[str]:
    """The top-level packages a module imports, anywhere in it (a function's lazy import too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_the_store_is_the_one_package_that_opens_a_database() -> None:
    """The store owns its databases: sqlite3 is its SQLite backend's alone (the backup goes
    through it, `copy_database`; the server through `asyncstore`), psycopg its PostgreSQL
    backend's alone, imported lazily there (in a function): a SQLite user never loads it."""
    trees = {str(p.relative_to(SRC)): ast.parse(p.read_text(), str(p)) for p in sources()}
    assert sorted(name for name, tree in trees.items() if "sqlite3" in _imports(tree)) == [
        "llmgw/server/store/sqlite.py"
    ]
    assert sorted(name for name, tree in trees.items() if "psycopg" in _imports(tree)) == [
        "llmgw/server/store/postgres.py"
    ]
    top = ast.Module(body=trees["llmgw/server/store/postgres.py"].body, type_ignores=[])
    top.body = [n for n in top.body if not isinstance(n, ast.If)]  # `if TYPE_CHECKING:` imports nothing at run time
    assert "psycopg" not in {
        alias.name.split(".")[0] for n in top.body if isinstance(n, ast.Import) for alias in n.names
    } | {n.module.split(".")[0] for n in top.body if isinstance(n, ast.ImportFrom) and n.module}
