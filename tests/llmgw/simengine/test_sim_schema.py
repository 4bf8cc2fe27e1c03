"""Values made up for JSON schemas (`llmgw.simengine.schema`): valid for the schemas clients send
(checked by a checker written apart, `testlib.schemacheck`), the same for the same seed, cut at
the limit, refused with the keyword and its place when the sim cannot make them, and bounded in
cost whatever the schema."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest

from llmgw.simengine import schema
from llmgw.simengine.errors import SchemaRefused
from llmgw.simengine.text import hasher
from testlib import clientschemas, schemacheck

SEEDS = [hasher("m", f"prompt {i}") for i in range(60)]


def value(s: Any, seed: Any = None, limit: int = 4096) -> Any:
    pieces, whole = schema.generate(s, seed or SEEDS[0], limit=limit)
    assert whole, f"cut at {limit} pieces: {''.join(pieces)[:200]}"
    text = "".join(pieces)
    parsed = json.loads(text)
    assert text == json.dumps(parsed, ensure_ascii=False)  # pieces join to plain JSON
    return parsed


def refusal(s: Any) -> str:
    with pytest.raises(SchemaRefused) as info:
        schema.generate(s, SEEDS[0], limit=4096)
    return info.value.message


@pytest.mark.parametrize("name", ["ORDER", "NODE", "MATH_STRICT"])
def test_values_of_client_schemas_validate(name: str) -> None:
    s = getattr(clientschemas, name)
    before = copy.deepcopy(s)
    values = [value(s, seed) for seed in SEEDS]
    for v in values:
        assert schemacheck.problems(v, s) == [], v
    assert s == before  # the request's schema is read, never changed
    assert len({json.dumps(v) for v in values}) > len(values) // 2  # the seed shows


def test_order_shows_each_kind_of_field() -> None:
    v = value(clientschemas.ORDER)
    assert set(v) == set(clientschemas.ORDER["properties"])  # optional properties too
    assert 1 <= len(v["items"]) <= 5 and all(1 <= item["quantity"] <= 100 and item["price"] > 0 for item in v["items"])
    assert v["color"] in ("red", "green", "blue") and v["speed"] in ("standard", "express")
    assert isinstance(v["pair"][0], int) and isinstance(v["pair"][1], str) and len(v["pair"]) == 2
    assert len(set(v["flags"])) == len(v["flags"]) and len(v["counts"]) == 1
    assert isinstance(v["total"], (int, float))  # the pattern-bound string branch is not taken
    assert v["pet"]["kind"] in ("cat", "dog") and len(v["billing"]["zip"]) == 5


def test_recursive_model_ends_and_grows_no_deeper_than_the_soft_depth() -> None:
    def depth(node: dict[str, Any]) -> int:
        below = [*node.get("children", []), *([node["parent"]] if node.get("parent") else [])]
        return 1 + max(map(depth, below), default=0)

    depths = [depth(value(clientschemas.NODE, seed)) for seed in SEEDS[:20]]
    assert max(depths) <= schema.SOFT_DEPTH and max(depths) >= 2  # a tree, and not an endless one


def test_same_seed_same_pieces() -> None:
    a = schema.generate(clientschemas.ORDER, hasher("m", "x"), limit=4096)
    assert a == schema.generate(copy.deepcopy(clientschemas.ORDER), hasher("m", "x"), limit=4096)
    assert a != schema.generate(clientschemas.ORDER, hasher("m", "y"), limit=4096)


def test_the_limit_cuts_the_text_and_says_so() -> None:
    full, whole = schema.generate(clientschemas.ORDER, SEEDS[1], limit=4096)
    assert whole and len(full) > 20
    cut, whole = schema.generate(clientschemas.ORDER, SEEDS[1], limit=10)
    assert not whole and len(cut) == 10
    assert cut[:5] == full[:5]  # then, half the limit out, it makes the smallest values it can
    # A list longer than the limit is cut too, not refused.
    many, whole = schema.generate({"type": "array", "items": {"type": "integer"}, "minItems": 10_000}, SEEDS[0], limit=50)  # fmt: skip
    assert not whole and len(many) == 50


def test_a_tight_limit_still_gets_a_whole_value_when_the_required_part_fits() -> None:
    # Past half the limit only what is required is made, so a tree with optional parts ends in time.
    for seed in SEEDS[:20]:
        v = value(clientschemas.NODE, seed, limit=32)
        assert schemacheck.problems(v, clientschemas.NODE) == []


@pytest.mark.parametrize(
    "s",
    [
        {"type": "integer", "minimum": -3, "maximum": 3},
        {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 13},
        {"type": "integer", "minimum": 5, "maximum": 5},
        {"type": "integer", "minimum": 10**30},
        {"type": "integer", "minimum": 1, "maximum": 50, "multipleOf": 7},
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.001},
        {"type": "number", "minimum": -1e308, "maximum": 1e308},
        {"type": "number", "minimum": 2, "maximum": 3, "multipleOf": 0.25},
        {"type": "number", "maximum": -1000.5},
        {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 2},  # draft 4
        {"type": "string", "minLength": 300},
        {"type": "string", "maxLength": 2},
        {"type": "string", "minLength": 0, "maxLength": 0},
        {"type": ["string", "null"]},
        {"type": "array", "prefixItems": [{"const": 1}, {"type": "boolean"}], "items": False},
        {"type": "array", "items": [{"type": "string"}], "additionalItems": False, "minItems": 1},  # draft 7
        {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "uniqueItems": True, "minItems": 4},
        {"type": "object", "required": ["free"]},  # a required name with no schema: any value
        {"type": "object", "minProperties": 3, "additionalProperties": {"type": "boolean"}},
        {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "maxProperties": 1},
        {"const": {"nested": ["x y", 1, None]}},
        {"enum": [[1, 2], {"a": "b"}, "words with spaces"]},
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]},  # no type: the keywords say
        {"allOf": [{"type": "object", "properties": {"n": {"type": "null"}}, "required": ["n"]}]},
        {"oneOf": [{"type": "string", "pattern": "x"}, {"type": "integer"}]},
        True,
        {},
        {"title": "anything", "x-vendor": 1},
    ]
    + [{"type": "string", "format": f} for f in schema.FORMATS],
)  # fmt: skip
def test_keywords_are_honoured(s: Any) -> None:
    for seed in SEEDS[:10]:
        v = value(s, seed)
        assert schemacheck.problems(v, s) == [], v


def test_an_optional_property_branch_or_item_it_cannot_make_is_left_out() -> None:
    s = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}, "n": {"type": "integer"}},
        "required": ["n"],
    }
    assert set(value(s)) == {"n"}
    assert isinstance(value({"anyOf": [{"not": {}}, {"type": "boolean"}]}), bool)
    assert value({"type": "array", "items": {"pattern": "x"}}) == []  # nor an item past minItems
    assert "'pattern' is not supported" in refusal({"type": "array", "items": {"pattern": "x"}, "minItems": 1})


@pytest.mark.parametrize(
    ("s", "says"),
    [
        ({"type": "string", "pattern": "^a$"}, "'pattern' is not supported: it cannot make strings that match a regular expression (at #/pattern)"),
        ({"properties": {"a": {"type": "string", "patern": "x"}}, "required": ["a"]}, "'patern' is not supported: it is not a JSON Schema keyword the sim engine knows (at #/properties/a/patern)"),
        ({"if": {}, "then": {}}, "'if' is not supported"),
        ({"not": {"type": "null"}}, "'not' is not supported"),
        ({"$ref": "https://example.com/s.json"}, "only, as JSON pointers"),
        ({"$ref": "#/$defs/Missing", "$defs": {}}, "'$ref' \"#/$defs/Missing\" points at nothing in the schema (at #/$ref)"),
        ({"$ref": "#/$defs/A", "type": "object", "$defs": {"A": {}}}, "'$ref' beside 'type' is not supported"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' with 2 schemas is not supported"),
        ({"anyOf": [{"type": "integer"}], "minimum": 3}, "'anyOf' beside 'minimum' is not supported"),
        ({"anyOf": []}, "'anyOf' must be a non-empty array of schemas"),
        ({"enum": []}, "'enum' must be a non-empty array"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer lies between 5 and 4"),
        ({"type": "integer", "minimum": 1, "maximum": 6, "multipleOf": 7}, "no integer that is a multiple of 7 lies between 1 and 6"),
        ({"type": "integer", "multipleOf": 0.5}, "'multipleOf' 0.5 on an integer is not supported"),
        ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number lies between 1 and 1"),
        ({"type": "number", "minimum": "0"}, "'minimum' must be a finite number, got \"0\""),
        ({"type": "string", "minLength": 3, "maxLength": 2}, "'maxLength' 2 is less than 'minLength' 3"),
        ({"type": "string", "format": "regex"}, "'format' \"regex\" is not supported: the sim engine makes date-time, date,"),
        ({"type": "string", "format": "uuid", "maxLength": 10}, "a 'uuid' string such as"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "'minItems' 3 is more than the array may hold (2"),
        ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "'minItems' 2 is more than the array may hold (1"),
        ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 3}, "'uniqueItems' with 'minItems' 3: the sim engine made only 2 distinct items"),
        ({"type": "object", "required": ["a"], "additionalProperties": False}, "'required' names 'a', which is not among 'properties'"),
        ({"type": "object", "minProperties": 2, "properties": {"a": {}}, "additionalProperties": False}, "'minProperties' 2 needs more properties"),
        ({"type": "object", "maxProperties": 1, "required": ["a", "b"]}, "'maxProperties' 1 is less than"),
        ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "the schema `false` admits no value, and a value is needed here (at #/properties/a)"),
        ({"type": "object", "properties": {"a": 3}, "required": ["a"]}, "a schema must be an object or a boolean, got 3"),
        ({"type": "objekt"}, "'type' must be one of object, array, string, integer, number, boolean, null"),
        ({"type": "array", "items": {"$ref": "#/$defs/Loop"}, "minItems": 1, "$defs": {"Loop": {"type": "array", "items": {"$ref": "#/$defs/Loop"}, "minItems": 1}}}, "nests more than 128 levels deep"),
        ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, "nests more than 128 levels deep"),
    ],
)  # fmt: skip
def test_what_it_cannot_make_is_refused_naming_the_keyword_and_place(s: Any, says: str) -> None:
    assert says in refusal(s)


def test_a_long_name_in_a_refusal_is_cut() -> None:
    message = refusal({"type": "object", "properties": {"k" * 10_000: {"pattern": "x"}}, "required": ["k" * 10_000]})
    assert "'pattern' is not supported" in message and len(message) < 500


@pytest.mark.parametrize(
    "s",
    [
        {"type": "array", "items": {"type": "integer"}, "minItems": 100_000},
        {"type": "array", "items": {"type": "string", "minLength": 40}, "minItems": 100_000},
        {"type": "string", "minLength": 10**9},
        # each item tries a branch it cannot make first
        {"type": "array", "minItems": 100_000, "items": {"anyOf": [{"$ref": "#/$defs/X"}, {"type": "null"}]},
         "$defs": {"X": {"type": "object", "properties": {"p": {"pattern": "x"}}, "required": ["p"]}}},
        # 2^30 ways down to a refusal
        {"$defs": {**{f"L{i}": {"anyOf": [{"$ref": f"#/$defs/L{i + 1}"}, {"$ref": f"#/$defs/L{i + 1}"}]} for i in range(30)},
                   "L30": {"pattern": "x"}}, "$ref": "#/$defs/L0"},
        # an endless tree with a choice at every level
        {"$defs": {"N": {"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#/$defs/N"}, {"$ref": "#/$defs/N"}]}}, "required": ["c"]}},
         "$ref": "#/$defs/N"},
        # a large constant in every item
        {"type": "array", "items": {"const": "x" * 100_000}, "minItems": 1000},
        {"type": "array", "items": {"const": "x " * 50_000}, "minItems": 1000},
        # uniqueItems over items that repeat
        {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "maxItems": 2},
         "uniqueItems": True, "minItems": 1000},
    ],
)  # fmt: skip
def test_cost_is_bounded_whatever_the_schema(s: Any) -> None:
    # About 15 ms each on a loaded 2-core machine; the bound leaves room for a slower one.
    start = time.process_time()
    try:
        pieces, _ = schema.generate(s, SEEDS[0], limit=4096)
        assert len(pieces) <= 4096 and sum(map(len, pieces)) <= schema.MAX_CHARS
    except SchemaRefused:
        pass
    assert time.process_time() - start < 0.25


def test_the_checker_finds_what_is_wrong() -> None:
    # The checker these tests trust is not one that passes everything.
    good = value(clientschemas.ORDER)
    assert schemacheck.problems(good, clientschemas.ORDER) == []
    for change in (
        lambda v: v.pop("billing"),
        lambda v: v["items"].clear(),
        lambda v: v["items"][0].update(quantity=0),
        lambda v: v.update(color="purple"),
        lambda v: v.update(id="not-a-uuid"),
        lambda v: v.update(flags=[1, 1]),
        lambda v: v.update(pair=[1]),
        lambda v: v["pet"].update(kind="cow"),
        lambda v: v["billing"].update(zip="123"),
        lambda v: v.update(counts={"a": "b"}),
    ):
        bad = json.loads(json.dumps(good))
        change(bad)
        assert schemacheck.problems(bad, clientschemas.ORDER) != [], bad
    assert schemacheck.problems({"a": 1}, {"type": "object", "additionalProperties": False, "properties": {}}) != []
    assert schemacheck.problems("x", {"type": "string", "pattern": "x"}) != []  # an unknown keyword is a problem
