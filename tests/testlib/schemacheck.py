"""A JSON Schema checker for tests, for the subset structured-output clients send (pydantic's
`model_json_schema()`, the openai SDK's strict schemas, tool parameters): written apart from the
sim engine's generator (`llmgw.simengine.schema`) so that one does not vouch for itself.
Neither `jsonschema` nor `pydantic` is in the lock.

`problems(instance, schema)` lists what is wrong, each with its place in the instance; [] when
the instance is valid. A keyword it does not know is a problem too, so a test cannot pass by a
keyword being skipped.
"""

from __future__ import annotations

import datetime
import ipaddress
import math
import re
import uuid
from typing import Any
from urllib.parse import unquote, urlparse

ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor", "deprecated",
    "readOnly", "writeOnly", "discriminator", "nullable", "contentEncoding", "contentMediaType", "$defs",
    "definitions",
}  # fmt: skip
DURATION = re.compile(r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?")


def _format_ok(fmt: str, value: str) -> bool:
    try:
        if fmt == "date-time":
            return "T" in value and datetime.datetime.fromisoformat(value).tzinfo is not None
        if fmt == "date":
            datetime.date.fromisoformat(value)
        elif fmt == "time":
            return datetime.time.fromisoformat(value).tzinfo is not None
        elif fmt == "uuid":
            uuid.UUID(value)
            return len(value) == 36
        elif fmt in ("email", "idn-email"):
            local, _, domain = value.partition("@")
            return bool(local) and "." in domain
        elif fmt in ("uri", "iri"):
            parsed = urlparse(value)
            return bool(parsed.scheme) and bool(parsed.netloc)
        elif fmt in ("uri-reference", "iri-reference"):
            urlparse(value)
        elif fmt in ("hostname", "idn-hostname"):
            return all(re.fullmatch(r"[A-Za-z0-9-]{1,63}", label) for label in value.split("."))
        elif fmt == "ipv4":
            ipaddress.IPv4Address(value)
        elif fmt == "ipv6":
            ipaddress.IPv6Address(value)
        elif fmt == "duration":
            return DURATION.fullmatch(value) is not None
        elif fmt not in ("binary", "password", "path"):
            return False
    except ValueError:
        return False
    return True


def _type_ok(t: str, value: Any) -> bool:
    if t == "object":
        return isinstance(value, dict)
    if t == "array":
        return isinstance(value, list)
    if t == "string":
        return isinstance(value, str)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "null":
        return value is None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return t == "number" or (isinstance(value, int) or float(value).is_integer())


def problems(instance: Any, schema: Any, root: Any = None, where: str = "$") -> list[str]:
    root = schema if root is None else root
    if schema is True:
        return []
    if schema is False:
        return [f"{where}: the schema false admits nothing"]
    found: list[str] = []
    for key, rule in schema.items():
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key == "$ref":
            target = root
            for token in rule[2:].split("/") if rule != "#" else ():
                token = unquote(token).replace("~1", "/").replace("~0", "~")
                target = target[int(token)] if isinstance(target, list) else target[token]
            found += problems(instance, target, root, where)
        elif key == "type":
            types = rule if isinstance(rule, list) else [rule]
            if not any(_type_ok(t, instance) for t in types):
                found.append(f"{where}: {instance!r} is not of type {rule}")
        elif key == "enum":
            if not any(instance == m and type(instance) is type(m) for m in rule):
                found.append(f"{where}: {instance!r} is not one of {rule}")
        elif key == "const":
            if instance != rule:
                found.append(f"{where}: {instance!r} is not {rule!r}")
        elif key in ("anyOf", "oneOf", "allOf"):
            passing = sum(not problems(instance, branch, root, where) for branch in rule)
            need = {"anyOf": passing >= 1, "oneOf": passing == 1, "allOf": passing == len(rule)}[key]
            if not need:
                found.append(f"{where}: {passing} of the {len(rule)} branches of {key} match")
        elif key in ("properties", "required", "additionalProperties", "minProperties", "maxProperties"):
            if isinstance(instance, dict):
                found += _object_rule(key, rule, instance, schema, root, where)
        elif key in ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"):
            if isinstance(instance, list):
                found += _array_rule(key, rule, instance, schema, root, where)
        elif key in ("minLength", "maxLength", "format"):
            if isinstance(instance, str):
                if key == "minLength" and len(instance) < rule or key == "maxLength" and len(instance) > rule:
                    found.append(f"{where}: {instance!r} breaks {key} {rule}")
                if key == "format" and not _format_ok(rule, instance):
                    found.append(f"{where}: {instance!r} is not a {rule}")
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            if _type_ok("number", instance):
                if rule is True:  # draft 4: a flag on minimum / maximum
                    rule = schema["minimum" if key == "exclusiveMinimum" else "maximum"]
                elif rule is False:
                    continue
                ok = _number_ok(key, rule, instance)
                if not ok:
                    found.append(f"{where}: {instance!r} breaks {key} {rule}")
        else:
            found.append(f"{where}: the checker does not know the keyword {key!r}")
    return found


def _number_ok(key: str, rule: Any, instance: float) -> bool:
    if key == "minimum":
        return instance >= rule
    if key == "maximum":
        return instance <= rule
    if key == "exclusiveMinimum":
        return instance > rule
    if key == "exclusiveMaximum":
        return instance < rule
    return math.isclose(instance / rule, round(instance / rule), abs_tol=1e-9)  # multipleOf


def _object_rule(key: str, rule: Any, instance: dict, schema: dict, root: Any, where: str) -> list[str]:
    if key == "properties":
        return [p for name, sub in rule.items() if name in instance for p in problems(instance[name], sub, root, f"{where}.{name}")]  # fmt: skip
    if key == "required":
        return [f"{where}: lacks the required {name!r}" for name in rule if name not in instance]
    if key == "additionalProperties":
        known = schema.get("properties", {})
        return [p for name, value in instance.items() if name not in known for p in problems(value, rule, root, f"{where}.{name}")]  # fmt: skip
    if key == "minProperties" and len(instance) < rule or key == "maxProperties" and len(instance) > rule:
        return [f"{where}: {len(instance)} properties break {key} {rule}"]
    return []


def _array_rule(key: str, rule: Any, instance: list, schema: dict, root: Any, where: str) -> list[str]:
    if key == "prefixItems":
        return [p for i, (value, sub) in enumerate(zip(instance, rule, strict=False)) for p in problems(value, sub, root, f"{where}[{i}]")]  # fmt: skip
    if key == "items" and isinstance(rule, list):  # draft 7's tuples
        return _array_rule("prefixItems", rule, instance, schema, root, where)
    if key == "additionalItems":
        skip = len(schema.get("items", []))
        return [p for i, value in enumerate(instance[skip:], skip) for p in problems(value, rule, root, f"{where}[{i}]")]  # fmt: skip
    if key == "items":
        skip = len(schema.get("prefixItems", []))
        return [p for i, value in enumerate(instance[skip:], skip) for p in problems(value, rule, root, f"{where}[{i}]")]  # fmt: skip
    if key == "minItems" and len(instance) < rule or key == "maxItems" and len(instance) > rule:
        return [f"{where}: {len(instance)} items break {key} {rule}"]
    if key == "uniqueItems" and rule:
        seen = [repr(v) for v in instance]
        if len(set(seen)) != len(seen):
            return [f"{where}: items repeat"]
    return []
