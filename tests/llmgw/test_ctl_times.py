"""How `llmgw ctl` reads `--since`/`--until` (`llmgw.ctl.times`) and prints the audit log's
details (`llmgw.ctl.audit.detail_text`): pure, a fixed `now`."""

from __future__ import annotations

import pytest

from llmgw.ctl.audit import DETAIL_CHARS, detail_text
from llmgw.ctl.times import parse_time, utc_text
from llmgw.errors import UsageError

NOW = 1_765_000_000.0  # 2025-12-06 05:46:40 UTC


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("90s", NOW - 90),
        ("30m", NOW - 1800),
        ("1h", NOW - 3600),
        ("1.5h", NOW - 5400),
        ("2d", NOW - 2 * 86400),
        ("1w", NOW - 7 * 86400),
        ("2025-12-06", 1_764_979_200.0),  # midnight UTC
        ("2025-12-06T05:46:40", NOW),
        ("2025-12-06 05:46:40Z", NOW),
        ("2025-12-06T06:46:40+01:00", NOW),
    ],
)
def test_an_age_or_an_iso_time(given: str, expected: float) -> None:
    assert parse_time(given, NOW) == expected


@pytest.mark.parametrize("given", ["yesterday", "1y", "-1h", "h", "2025-13-01", ""])
def test_anything_else_says_what_is_taken(given: str) -> None:
    with pytest.raises(UsageError) as refused:
        parse_time(given, NOW, option="--until")
    assert f"--until {given!r} is not a time" in str(refused.value) and "1h" in str(refused.value)


def test_times_print_in_utc_and_details_as_words() -> None:
    assert utc_text(NOW) == "2025-12-06 05:46:40"
    assert detail_text({"models": ["a", "b"], "force": False, "n": 3, "none": None, "empty": []}) == (
        "models=a,b force=false n=3 none=null empty=[]"
    )
    assert detail_text({}) == "-"
    long = detail_text({"args": ["x" * 300]})
    assert len(long) == DETAIL_CHARS and long.endswith("…")
