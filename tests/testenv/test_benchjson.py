"""testlib.benchjson, the check the benchmarks' smoke tests make of their JSON: it must fail on a
key missing, renamed or added, and on a value of the wrong type, or the smokes prove nothing."""

from __future__ import annotations

import pytest

from testlib.benchjson import NONE, NUMBER, MapOf, Maybe, assert_shape, problems

SHAPE = {
    "rps": int,
    "p50_ms": NUMBER,
    "ok": MapOf(bool),
    "runs": [{"seconds": float, "error": Maybe(str)}],
    "per_cpu_second": (int, NONE),
}
GOOD = {"rps": 10, "p50_ms": 0.5, "ok": {"a": True}, "runs": [{"seconds": 1.0}], "per_cpu_second": None}


def test_a_value_of_its_shape_passes() -> None:
    assert_shape(GOOD, SHAPE)
    assert_shape({**GOOD, "runs": [{"seconds": 1.0, "error": "x"}], "p50_ms": 1}, SHAPE)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({k: v for k, v in GOOD.items() if k != "rps"}, "$.rps: missing"),
        ({**GOOD, "rps_c64": 3}, "$.rps_c64: not expected"),
        ({**GOOD, "rps": 1.5}, "$.rps: float 1.5, not int"),
        ({**GOOD, "rps": True}, "$.rps: True, a bool"),
        ({**GOOD, "p50_ms": None}, "$.p50_ms: NoneType None, not int/float"),
        ({**GOOD, "ok": {"a": 1}}, "$.ok.a: int 1, not bool"),
        ({**GOOD, "runs": [{"seconds": 1.0}, {}]}, "$.runs[1].seconds: missing"),
        ({**GOOD, "runs": {"seconds": 1.0}}, "$.runs: dict"),
    ],
)
def test_a_key_missing_added_or_mistyped_fails(value: dict, says: str) -> None:
    found = list(problems(value, SHAPE))
    assert len(found) == 1 and found[0].startswith(says), found
    with pytest.raises(AssertionError, match="not as expected"):
        assert_shape(value, SHAPE)
