"""What a JSON schema says, read and checked for the generator in `schema`: the keywords it knows
(and those it refuses, with why), the `format`s it makes an example of, and what a value of one
schema object may be — an object's properties, an array's items, a string's format and length, a
number's range — as a plan. Pure; each function reads one schema object (never following a `$ref`),
and `schema` caches what it returns by that object's identity. A bad or unsupported keyword raises
`SchemaRefused` naming it and its JSON pointer.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

from llmgw.errors import cut
from llmgw.simengine.errors import SchemaRefused
from llmgw.simengine.fields import show

TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
SCALARS = frozenset({"string", "integer", "number", "boolean", "null"})
# Keywords that say nothing about which values are valid.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "$anchor",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",  # OpenAPI's, as pydantic emits beside oneOf: the branches' consts decide
        "nullable",  # OpenAPI 3.0's: it only allows more
        "contentEncoding",
        "contentMediaType",
    }
)
CONTAINERS = frozenset({"$defs", "definitions"})
OBJECT_KEYWORDS = frozenset(
    {"properties", "required", "additionalProperties", "unevaluatedProperties", "minProperties", "maxProperties"}
)
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"})
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "format"})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
SUPPORTED = (
    frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"})
    | CONTAINERS
    | OBJECT_KEYWORDS
    | ARRAY_KEYWORDS
    | STRING_KEYWORDS
    | NUMBER_KEYWORDS
)
UNSUPPORTED = {
    "pattern": "it cannot make strings that match a regular expression",
    "patternProperties": "it cannot make property names that match a regular expression",
    "propertyNames": "it does not constrain property names",
    "not": "it does not negate schemas",
    "if": "it does not evaluate conditional schemas",
    "then": "it does not evaluate conditional schemas",
    "else": "it does not evaluate conditional schemas",
    "contains": "it does not make arrays that must contain a value",
    "minContains": "it does not make arrays that must contain a value",
    "maxContains": "it does not make arrays that must contain a value",
    "dependentRequired": "it does not evaluate dependencies between properties",
    "dependentSchemas": "it does not evaluate dependencies between properties",
    "dependencies": "it does not evaluate dependencies between properties",
    "unevaluatedItems": "it does not evaluate unevaluatedItems",
    "$dynamicRef": "it follows only '$ref' to a JSON pointer in the schema",
    "$recursiveRef": "it follows only '$ref' to a JSON pointer in the schema",
    "contentSchema": "it does not make strings that hold encoded JSON",
}


def _uuid(d: int, word: str) -> str:
    h = f"{d:016x}{(d * 0x9E3779B97F4A7C15) % (1 << 64):016x}"  # version 4, RFC 4122 variant
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[d % 4]}{h[17:20]}-{h[20:32]}"


# Strings a format's checker accepts (jsonschema's, pydantic's parsers), a function of a digest.
FORMATS = {
    "date-time": lambda d, w: f"2024-{d % 12 + 1:02d}-{d % 28 + 1:02d}T{d % 24:02d}:{d % 60:02d}:00Z",
    "date": lambda d, w: f"2024-{d % 12 + 1:02d}-{d % 28 + 1:02d}",
    "time": lambda d, w: f"{d % 24:02d}:{d % 60:02d}:00Z",
    "duration": lambda d, w: f"PT{d % 59 + 1}M",
    "uuid": _uuid,
    "email": lambda d, w: f"{w}@example.com",
    "idn-email": lambda d, w: f"{w}@example.com",
    "hostname": lambda d, w: f"{w}.example.com",
    "idn-hostname": lambda d, w: f"{w}.example.com",
    "uri": lambda d, w: f"https://example.com/{w}",
    "iri": lambda d, w: f"https://example.com/{w}",
    "uri-reference": lambda d, w: f"/{w}",
    "iri-reference": lambda d, w: f"/{w}",
    "ipv4": lambda d, w: f"192.0.2.{d % 254 + 1}",
    "ipv6": lambda d, w: f"2001:db8::{d % 65535 + 1:x}",
    "binary": lambda d, w: w,  # pydantic's bytes
    "password": lambda d, w: w,  # pydantic's SecretStr
    "path": lambda d, w: f"sim/{w}.txt",  # pydantic's Path
}


@attrs.frozen
class Entry:
    name: str
    key: str  # '"name": '
    schema: Any
    at: str
    required: bool


@attrs.frozen
class ObjectPlan:
    entries: tuple[Entry, ...]
    names: frozenset[str]
    extra: Any  # the schema of other properties, or None when there may be none
    extra_at: str
    min_properties: int
    max_properties: int | None
    required: int


@attrs.frozen
class ArrayPlan:
    prefix: tuple[Any, ...]
    prefix_at: str
    rest: Any  # the schema of items past the prefix, or None when there may be none
    rest_at: str
    min_items: int
    max_items: int | None
    unique: bool


def refused(at: str, message: str, *, lasting: bool = True) -> SchemaRefused:
    return SchemaRefused(f"{message} (at {cut(at)})", lasting=lasting)


def pointer_token(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def check_keywords(schema: dict[str, Any], at: str) -> None:
    """Refuses a keyword the generator does not support, or a combination it does not evaluate."""
    for key in schema:
        if key in SUPPORTED or key in ANNOTATIONS or key.startswith("x-"):
            continue
        why = UNSUPPORTED.get(key, "it is not a JSON Schema keyword the sim engine knows")
        raise refused(f"{at}/{pointer_token(key)}", f"'{cut(key, 60)}' is not supported: {why}")
    for key in ("$ref", "allOf", "anyOf", "oneOf"):
        if key not in schema:
            continue
        beside = [k for k in schema if k != key and k not in ANNOTATIONS and k not in CONTAINERS]
        beside = [k for k in beside if not k.startswith("x-")]
        if beside:
            raise refused(
                at,
                f"'{key}' beside '{cut(beside[0], 60)}' is not supported: the sim engine takes '{key}' "
                "alone (with annotations such as title or description); move the other keywords "
                f"into the schemas '{key}' names",
            )
        if key == "$ref":
            continue
        branches = schema[key]
        if not isinstance(branches, list) or not branches:
            raise refused(f"{at}/{key}", f"'{key}' must be a non-empty array of schemas, got {show(branches)}")
        if key == "allOf" and len(branches) != 1:
            raise refused(
                f"{at}/allOf",
                f"'allOf' with {len(branches)} schemas is not supported: the sim engine takes one; "
                "merge them into one schema",
            )
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise refused(f"{at}/enum", f"'enum' must be a non-empty array, got {show(schema['enum'])}")


def types_of(schema: dict[str, Any], at: str) -> tuple[str, ...]:
    """The types a value of `schema` may have: its `type`, or the one its keywords are about."""
    t = schema.get("type")
    if t is None:  # the type the keywords present are about; a bare schema: any value, a word
        keys = schema.keys()
        inferred = next(
            (
                name
                for name, words in (
                    ("object", OBJECT_KEYWORDS),
                    ("array", ARRAY_KEYWORDS),
                    ("string", STRING_KEYWORDS),
                    ("number", NUMBER_KEYWORDS),
                )
                if not words.isdisjoint(keys)
            ),
            "string",
        )
        found = (inferred,)
    elif isinstance(t, str) and t in TYPES:
        found = (t,)
    elif isinstance(t, list) and t and all(isinstance(x, str) and x in TYPES for x in t):
        found = tuple(t)
    else:
        raise refused(f"{at}/type", f"'type' must be one of {', '.join(TYPES)} or an array of them, got {show(t)}")
    return found


def object_plan(schema: dict[str, Any], at: str) -> ObjectPlan:
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise refused(f"{at}/properties", f"'properties' must be an object of schemas, got {show(properties)}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise refused(f"{at}/required", f"'required' must be an array of property names, got {show(required)}")
    extra_key = "additionalProperties" if "additionalProperties" in schema else "unevaluatedProperties"
    extra = schema.get(extra_key, True)
    if not isinstance(extra, (bool, dict)):
        raise refused(f"{at}/{extra_key}", f"'{extra_key}' must be a schema, got {show(extra)}")
    must = dict.fromkeys(required)
    entries = [
        Entry(
            name=name,
            key=json.dumps(name, ensure_ascii=False) + ": ",
            schema=sub,
            at=f"{at}/properties/{pointer_token(name)}",
            required=name in must,
        )
        for name, sub in properties.items()
    ]
    for name in must:
        if name not in properties:
            if extra is False:
                raise refused(
                    f"{at}/required",
                    f"'required' names {cut(name, 60)!r}, which is not among 'properties' and "
                    f"'{extra_key}': false forbids; add it to 'properties'",
                )
            key = json.dumps(name, ensure_ascii=False) + ": "
            entries.append(Entry(name=name, key=key, schema=extra, at=f"{at}/{extra_key}", required=True))
    min_p = count(schema, "minProperties", at, 0)
    max_p = count(schema, "maxProperties", at, None)
    if max_p is not None and max_p < max(min_p, len(must)):
        raise refused(
            f"{at}/maxProperties",
            f"'maxProperties' {max_p} is less than 'minProperties' or the {len(must)} required properties",
        )
    return ObjectPlan(
        entries=tuple(entries),
        names=frozenset(properties) | frozenset(must),
        extra=None if extra is False else extra,
        extra_at=f"{at}/{extra_key}",
        min_properties=min_p,
        max_properties=max_p,
        required=len(must),
    )


def array_plan(schema: dict[str, Any], at: str) -> ArrayPlan:
    items = schema.get("items", True)
    if isinstance(items, list):  # draft 7's tuples: items is the prefix, additionalItems the rest
        prefix, prefix_at = items, f"{at}/items"
        rest, rest_at = schema.get("additionalItems", True), f"{at}/additionalItems"
    else:
        prefix, prefix_at = schema.get("prefixItems", []), f"{at}/prefixItems"
        rest, rest_at = items, f"{at}/items"
    if not isinstance(prefix, list):
        raise refused(prefix_at, f"'prefixItems' must be an array of schemas, got {show(prefix)}")
    if not isinstance(rest, (bool, dict)):
        raise refused(rest_at, f"'items' must be a schema, got {show(rest)}")
    min_i = count(schema, "minItems", at, 0)
    max_i = count(schema, "maxItems", at, None)
    if rest is False:
        max_i = len(prefix) if max_i is None else min(max_i, len(prefix))
    if max_i is not None and max_i < min_i:
        raise refused(
            f"{at}/minItems", f"'minItems' {min_i} is more than the array may hold ({max_i}: maxItems, or its prefixItems)"
        )  # fmt: skip
    unique = schema.get("uniqueItems", False)
    if not isinstance(unique, bool):
        raise refused(f"{at}/uniqueItems", f"'uniqueItems' must be true or false, got {show(unique)}")
    return ArrayPlan(
        prefix=tuple(prefix),
        prefix_at=prefix_at,
        rest=None if rest is False else rest,
        rest_at=rest_at,
        min_items=min_i,
        max_items=max_i,
        unique=unique,
    )


def count(schema: dict[str, Any], key: str, at: str, default: int | None) -> Any:
    value = schema.get(key, default)
    if value is default:
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise refused(f"{at}/{key}", f"'{key}' must be a whole number, 0 or more, got {show(value)}")
    return value


def string_plan(schema: dict[str, Any], at: str) -> tuple[Any, int, int | None]:
    """What a string of `schema` may be, checked: its `format` (None: words), minLength and
    maxLength (None: no bound)."""
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise refused(
            f"{at}/format",
            f"'format' {show(fmt)} is not supported: the sim engine makes {', '.join(FORMATS)}",
        )
    low, high = count(schema, "minLength", at, 0), count(schema, "maxLength", at, None)
    if high is not None and high < low:
        raise refused(f"{at}/maxLength", f"'maxLength' {high} is less than 'minLength' {low}")
    return fmt, low, high


def number_plan(schema: dict[str, Any], at: str, integer: bool) -> tuple[Any, ...]:
    """What a number of `schema` may be, checked; 0..100 where unbounded: ("multiple", step,
    first, count) — the values are step × (first .. first + count - 1) — for an integer or a
    multipleOf, else ("range", low, high, low exclusive, high exclusive)."""

    def number(key: str, allow_bool: bool = False) -> Any:
        value = schema.get(key)
        if value is None or (allow_bool and isinstance(value, bool)):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise refused(f"{at}/{key}", f"'{key}' must be a finite number, got {show(value)}")
        return value

    low, high = number("minimum"), number("maximum")
    low_open = high_open = False
    x_low, x_high = number("exclusiveMinimum", True), number("exclusiveMaximum", True)
    if x_low is True:  # draft 4: a flag on minimum
        low_open = low is not None
    elif x_low is not None and x_low is not False and (low is None or x_low >= low):
        low, low_open = x_low, True
    if x_high is True:
        high_open = high is not None
    elif x_high is not None and x_high is not False and (high is None or x_high <= high):
        high, high_open = x_high, True
    if low is None and high is None:
        low, high = 0, 100
    elif low is None:
        low = high - 100
    elif high is None:
        high = low + 100
    step = number("multipleOf")
    if step is not None:
        if step <= 0:
            raise refused(f"{at}/multipleOf", f"'multipleOf' must be more than 0, got {show(step)}")
        if integer and not float(step).is_integer():
            raise refused(
                f"{at}/multipleOf",
                f"'multipleOf' {step} on an integer is not supported: the sim engine takes a whole multipleOf there",
            )
        if float(step).is_integer():
            step = int(step)
    if integer or step is not None:
        return multiples(low, high, low_open, high_open, step or 1, integer, at)
    if low == high and (low_open or high_open) or low > high:
        raise refused(at, f"no number lies between {low} and {high} (minimum / maximum, exclusive or not)")
    return "range", low, high, low_open, high_open


def multiples(
    low: Any, high: Any, low_open: bool, high_open: bool, step: Any, integer: bool, at: str
) -> tuple[Any, ...]:
    """The multiples of `step` within the bounds (for an integer, whole ones)."""
    if isinstance(low, int) and isinstance(high, int) and isinstance(step, int):  # exact, however large
        first, last = -(-low // step), high // step
    else:
        first, last = math.ceil(low / step), math.floor(high / step)
    if first * step == low and low_open:
        first += 1
    if last * step == high and high_open:
        last -= 1
    if first > last:
        what = "integer" if integer else "number"
        multiple = f" that is a multiple of {step}" if step != 1 else ""
        raise refused(at, f"no {what}{multiple} lies between {low} and {high} (minimum / maximum, exclusive or not)")
    return "multiple", step, first, last - first + 1
