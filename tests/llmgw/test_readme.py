"""The README: its first command starts the quickstart, and its documentation list names every
document in docs/ exactly once."""

from __future__ import annotations

import re

from testlib.proc import build_root


def readme() -> str:
    return (build_root() / "README.md").read_text()


def test_the_documentation_list_names_each_document_once() -> None:
    section = readme().split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- \[(docs/[^\]]+)\]\(\1\)", section, flags=re.M)
    assert len(listed) == len(set(listed)), listed
    assert sorted(listed) == sorted(f"docs/{p.name}" for p in (build_root() / "docs").glob("*.md"))


def test_the_first_command_is_the_checkouts_llmgw_up() -> None:
    first = re.search(r"^```\n(.*?)\n", readme(), flags=re.M).group(1)
    assert first == "./llmgw up"  # .ci/readme-quickstart runs it as written
