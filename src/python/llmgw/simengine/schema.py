"""One thing: the generator's walk of a schema, whose kinds call each other through one output.

Values made up for JSON schemas, deterministically: the sim engine's answer to
`response_format: json_schema` and its tool calls' arguments. Pure. Objects, arrays, branches and
scalars recurse into each other and share one output, one budget and one set of caches, so
they stay one class; what a schema object says is read and checked apart, in `schemaplans`.

`generate` walks a schema as clients send them — pydantic's `model_json_schema()` (`$defs` and
`$ref`, `anyOf` with null for `Optional`, `prefixItems` for tuples, `enum`/`const` for Enum and
Literal, `format` for datetime and UUID), the openai SDK's strict schemas, LangChain's tool
schemas — and emits the JSON text of a value that validates against it, as pieces (one output
token each; joined, they are `json.dumps(value, ensure_ascii=False)`). Every choice (a number, a
word, an enum member, a list's length) is a hash of the caller's seed and the value's ordinal,
so the same schema and seed give the same text on every run and every machine.

Where a schema leaves a choice:
- objects: every property, required or not (an optional one it cannot make is left out); an
  object with only `additionalProperties` (a `dict[str, X]`) gets one entry;
- arrays: 1 to 3 items, within minItems/maxItems (fewer when it cannot make an item past
  minItems); uniqueItems' items are kept distinct (an item that repeats is made again, up to
  2 × items + 32 tries);
- `anyOf`/`oneOf` and a list of types: the first branch it can make;
- strings: one to three words, stretched or cut to minLength/maxLength, or an example of a
  `format` from `FORMATS`;
- numbers: within minimum/maximum (exclusive or not) and multipleOf; 0..100 when unbounded.
Past `SOFT_DEPTH` nested schemas (a recursive model), or once half the pieces the caller allows
are out, it makes the smallest value instead — required properties only, minItems items, a null
or scalar branch first — and lists and objects under way take no more optional items, so a tree
that may end does end, and a large schema's value still ends within the limit where it can.

Bounds, so that a request's cost is linear in its body and its max_tokens: at most `limit`
pieces (the request's max_tokens: the text is cut there, as an engine's is, and the caller
answers finish_reason "length") and `MAX_CHARS` characters; at most `MAX_DEPTH` nested schemas
(deeper, the schema has no value the sim can find: refused); a budget of steps (alternatives
tried and dropped count), past which the text is cut as at `limit`. Each schema object's
keywords are checked once and what is computed from them is cached by identity, so a schema
used for every item of a list costs its size once.

What it cannot satisfy raises `SchemaRefused` naming the keyword and its JSON pointer in the
schema: the keywords of `schemaplans.UNSUPPORTED` (a regular expression, `not`, conditionals), keywords it
does not know (annotations and `x-` extensions aside), bounds no value meets.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote

from llmgw.simengine.errors import SchemaRefused
from llmgw.simengine.fields import show
from llmgw.simengine.schemaplans import (
    FORMATS,
    SCALARS,
    array_plan,
    check_keywords,
    number_plan,
    object_plan,
    refused,
    string_plan,
    types_of,
)
from llmgw.simengine.text import WORDS, digest_from

MAX_DEPTH = 128
SOFT_DEPTH = 16
MAX_CHARS = 256 << 10
# Steps (schemas entered, pieces emitted) per piece of the limit: a valid answer takes two or
# three; the rest is for alternatives tried and dropped.
STEPS_PER_PIECE = 3

EMPTY: dict[str, Any] = {}  # the schema `true`: one object, so caches by identity hold for it

_MASK = (1 << 64) - 1


class _Full(Exception):
    """The output reached its limit (pieces, characters or steps): it is cut here."""


class _TooDeep(Exception):
    """`MAX_DEPTH` reached: the whole schema is refused, whatever alternatives remain."""


def generate(schema: Any, seed: Any, *, limit: int) -> tuple[tuple[str, ...], bool]:
    """The pieces of a value valid for `schema` (a JSON schema as parsed from JSON), and whether
    it is whole (False: cut at `limit` pieces). `seed` is a `text.hasher`: what the choices
    derive from. `SchemaRefused` when the schema asks what the sim cannot make."""
    g = _Generator(schema, seed, limit)
    try:
        g.value(schema, "#", 0, False)
    except _Full:
        return tuple(g.out), False
    except _TooDeep as exc:
        raise exc.args[0] from None
    return tuple(g.out), True


class _Generator:
    def __init__(self, root: Any, seed: Any, limit: int) -> None:
        self.root = root
        self.seed = digest_from(seed)
        self.limit = limit
        self.half = limit // 2
        self.max_steps = STEPS_PER_PIECE * limit + 256
        self.out: list[str] = []
        self.pending = ""  # punctuation that goes before the next piece: '{', '[', ', '
        self.chars = 0
        self.steps = 0
        self.ordinal = 0
        # Caches by the identity of schema objects (all alive as long as `root`).
        self.kinds: dict[int, Any] = {}  # `kind`
        self.chosen: dict[tuple[int, bool], Any] = {}  # `first_of`
        self.plans: dict[tuple[int, str], Any] = {}  # by (identity, which plan)
        self.json_of: dict[int, str] = {}
        self.refs: dict[str, tuple[Any, str]] = {}

    # -- output ------------------------------------------------------------------------------

    def emit(self, piece: str) -> None:
        if self.pending:
            piece, self.pending = self.pending + piece, ""
        if len(self.out) >= self.limit:
            raise _Full
        self.chars += len(piece)
        if self.chars > MAX_CHARS:
            self.out.append(piece[: len(piece) - (self.chars - MAX_CHARS)])
            raise _Full
        self.out.append(piece)

    def emit_text(self, text: str) -> None:
        """JSON text as pieces: a piece per space-separated word, each with its leading space."""
        parts = text.split(" ")
        self.steps += len(parts)  # a const may be long, and emitted again after a rollback
        for i, part in enumerate(parts):
            self.emit(" " + part if i else part)

    def emit_json(self, value: Any) -> None:
        text = self.json_of.get(id(value))
        if text is None:
            text = self.json_of[id(value)] = json.dumps(value, ensure_ascii=False)
        self.emit_text(text)

    def mark(self) -> tuple[int, str, int]:
        return len(self.out), self.pending, self.chars

    def rollback(self, mark: tuple[int, str, int]) -> None:
        n, self.pending, self.chars = mark
        del self.out[n:]

    def digest(self) -> int:
        """The next choice: splitmix64 of the seed's hash and the ordinal, cheaper than a hash
        per value and as fixed across machines."""
        self.ordinal += 1
        z = (self.seed + self.ordinal * 0x9E3779B97F4A7C15) & _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    # -- schemas -----------------------------------------------------------------------------

    def value(self, schema: Any, at: str, depth: int, minimal: bool) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise _Full
        if depth > MAX_DEPTH:
            # Even the smallest value, null and scalar branches first, went this deep: the schema
            # has no end the sim can find, and trying other branches above would take forever.
            raise _TooDeep(
                refused(
                    at,
                    f"the schema nests more than {MAX_DEPTH} levels deep and no value of it ends there "
                    "(does a required property refer back to its own model, with no null alternative?)",
                )
            )
        if schema is True:
            schema = EMPTY
        elif schema is False:
            raise refused(at, "the schema `false` admits no value, and a value is needed here")
        elif not isinstance(schema, dict):
            raise refused(at, f"a schema must be an object or a boolean, got {show(schema)}")
        kind = self.kinds.get(id(schema)) or self.kind(schema, at)
        if isinstance(kind, SchemaRefused):  # it was refused before, and would be again
            raise SchemaRefused(kind.message)
        try:
            if not minimal and (depth >= SOFT_DEPTH or len(self.out) >= self.half):
                minimal = True
            if kind == "object":
                return self.object(schema, at, depth, minimal)
            if kind == "string":
                return self.string(schema, at, minimal)
            if kind == "integer" or kind == "number":
                return self.emit(self.number(schema, at, kind == "integer"))
            if kind == "$ref":
                target, target_at = self.resolve(schema["$ref"], at)
                return self.value(target, target_at, depth + 1, minimal)
            if kind == "array":
                return self.array(schema, at, depth, minimal)
            if kind == "anyOf" or kind == "oneOf":
                branches = schema[kind]
                order: Any = range(len(branches))
                if minimal:  # the branches most likely to end first; stable otherwise
                    order = self.plans.get((id(schema), "cheap"))
                    if order is None:
                        order = sorted(range(len(branches)), key=lambda i: not self.cheap(branches[i]))
                        self.plans[(id(schema), "cheap")] = order
                return self.first_of(
                    (id(schema), minimal),
                    order,
                    lambda i: self.value(branches[i], f"{at}/{kind}/{i}", depth + 1, minimal),
                )
            if kind == "enum":
                members = schema["enum"]
                return self.emit_json(members[self.digest() % len(members)])
            if kind == "const":
                return self.emit_json(schema["const"])
            if kind == "boolean":
                return self.emit("true" if self.digest() & 1 else "false")
            if kind == "null":
                return self.emit("null")
            if kind == "allOf":
                return self.value(schema["allOf"][0], f"{at}/allOf/0", depth + 1, minimal)
            types = kind  # several: the first that makes a value, null first for the smallest
            if minimal and "null" in types:
                types = ("null", *(t for t in types if t != "null"))
            return self.first_of((id(schema), minimal), types, lambda t: self.typed(t, schema, at, depth, minimal))
        except SchemaRefused as exc:
            if exc.lasting:  # the next visit of this schema is refused at once
                self.kinds[id(schema)] = exc
            raise

    def typed(self, t: str, schema: dict[str, Any], at: str, depth: int, minimal: bool) -> None:
        if t == "object":
            return self.object(schema, at, depth, minimal)
        if t == "array":
            return self.array(schema, at, depth, minimal)
        if t == "string":
            return self.string(schema, at, minimal)
        if t in ("integer", "number"):
            return self.emit(self.number(schema, at, t == "integer"))
        if t == "boolean":
            return self.emit("true" if self.digest() & 1 else "false")
        return self.emit("null")

    def first_of(self, key: tuple[int, bool], choices: Sequence[Any], attempt: Callable[[Any], None]) -> None:
        """`attempt` of the first of `choices` that makes a value; the first refusal when none
        does. The one that made a value is tried first at the next visit of the same `key` (a
        schema, and whether the value is the smallest), so a list of a thousand items does not
        fail a thousand times on a branch the sim cannot make."""
        known = self.chosen.get(key)
        first: SchemaRefused | None = None
        lasting = True
        for i in choices if known is None else (known, *choices):
            if first is not None and i == known:
                continue  # tried first, and refused
            mark = self.mark()
            try:
                attempt(i)
            except SchemaRefused as exc:
                self.rollback(mark)
                first = first or exc
                lasting = lasting and exc.lasting
                continue
            self.chosen[key] = i
            return
        assert first is not None  # a schema's branches are checked non-empty
        first.lasting = lasting
        raise first

    def kind(self, schema: dict[str, Any], at: str) -> Any:
        """How `value` makes a value of `schema`: a combinator's keyword ('$ref', 'anyOf', ...),
        'const', 'enum', its type, or a tuple of types; a `SchemaRefused` for a keyword it does
        not support or a combination it does not evaluate. Worked out once per schema object (a
        list's items may try a refused branch once per item)."""
        try:
            check_keywords(schema, at)
            kind = next((k for k in ("$ref", "allOf", "anyOf", "oneOf", "const", "enum") if k in schema), None)
            if kind is None:
                types = types_of(schema, at)
                kind = types[0] if len(types) == 1 else types
        except SchemaRefused as exc:
            kind = exc
        self.kinds[id(schema)] = kind
        return kind

    def resolve(self, ref: Any, at: str) -> tuple[Any, str]:
        """The schema a local `$ref` (a JSON pointer such as `#/$defs/Item`) points at."""
        if not isinstance(ref, str):
            raise refused(f"{at}/$ref", f"'$ref' must be a string, got {show(ref)}")
        found = self.refs.get(ref)
        if found is not None:
            return found
        if not ref.startswith("#") or (len(ref) > 1 and not ref.startswith("#/")):
            raise refused(
                f"{at}/$ref",
                f"'$ref' {show(ref)} is not supported: the sim engine follows references inside the "
                "schema only, as JSON pointers (#/$defs/NAME, #/definitions/NAME)",
            )
        node = self.root
        for token in ref[2:].split("/") if len(ref) > 1 else ():
            token = unquote(token).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise refused(f"{at}/$ref", f"'$ref' {show(ref)} points at nothing in the schema")
        self.refs[ref] = (node, ref)
        return node, ref

    def cheap(self, schema: Any) -> bool:
        """Whether a branch can end at once (null, a scalar, an object with nothing required):
        what the smallest value tries first. A guess from the branch's top, never an error."""
        for _ in range(8):
            if not isinstance(schema, dict) or "$ref" not in schema:
                break
            try:
                schema = self.resolve(schema["$ref"], "#")[0]
            except SchemaRefused:
                return False
        if schema is True:
            return True
        if not isinstance(schema, dict):
            return False
        if "const" in schema or "enum" in schema:
            return True
        t = schema.get("type")
        if isinstance(t, list):
            return any(x in SCALARS for x in t if isinstance(x, str))
        return t in SCALARS or (t == "object" and not schema.get("required")) or (t == "array" and not schema.get("minItems"))  # fmt: skip

    # -- objects -----------------------------------------------------------------------------

    def object(self, schema: dict[str, Any], at: str, depth: int, minimal: bool) -> None:
        plan = self.plans.get((id(schema), "object"))
        if plan is None:
            plan = self.plans[(id(schema), "object")] = object_plan(schema, at)
        optional_room = math.inf if plan.max_properties is None else plan.max_properties - plan.required
        self.pending += "{"
        count = optional = 0
        for entry in plan.entries:
            if entry.required:
                self.member(entry.key, entry.schema, entry.at, depth, minimal, count)
                count += 1
                continue
            # An optional property: always, unless the value is the smallest one (then only to
            # reach minProperties) or maxProperties leaves no room; left out if it cannot be made.
            smallest = minimal or len(self.out) >= self.half  # half the pieces out: finish
            if optional_room <= 0 or (smallest and plan.required + optional >= plan.min_properties):
                continue
            mark = self.mark()
            try:
                self.member(entry.key, entry.schema, entry.at, depth, minimal, count)
            except SchemaRefused:
                self.rollback(mark)
                continue
            count += 1
            optional += 1
            optional_room -= 1
        wanted = plan.min_properties - count
        if not minimal and not plan.entries and isinstance(plan.extra, dict):
            wanted = max(wanted, 1)  # a dict[str, X]: show one entry
        if plan.max_properties is not None:
            wanted = min(wanted, plan.max_properties - count)
        if wanted > 0 and plan.extra is None:
            raise refused(
                at,
                f"'minProperties' {plan.min_properties} needs more properties than 'properties' gives "
                "and 'additionalProperties': false forbids others",
            )
        used: set[str] = set()
        for i in range(max(wanted, 0)):
            name = WORDS[self.digest() % len(WORDS)]
            while name in plan.names or name in used:
                name += f"_{i}"
            used.add(name)
            key = json.dumps(name) + ": "
            self.member(key, plan.extra, plan.extra_at, depth, minimal, count)
            count += 1
        self.emit("}")

    def member(self, key: str, schema: Any, at: str, depth: int, minimal: bool, index: int) -> None:
        if index:
            self.pending += ", "
        self.emit(key)
        self.value(schema, at, depth + 1, minimal)

    # -- arrays ------------------------------------------------------------------------------

    def array(self, schema: dict[str, Any], at: str, depth: int, minimal: bool) -> None:
        plan = self.plans.get((id(schema), "array"))
        if plan is None:
            plan = self.plans[(id(schema), "array")] = array_plan(schema, at)
        n = plan.min_items if minimal else max(plan.min_items, 1 + self.digest() % 3)
        if plan.max_items is not None:
            n = min(n, plan.max_items)
        self.pending += "["
        seen: set[str] = set()
        made = attempts = 0
        # Items that repeat are made again, with other choices: a few dozen tries find every
        # member of a small enum (the steps' budget bounds what they cost).
        while made < n and attempts < (2 * n + 32 if plan.unique else n):
            if made >= plan.min_items and len(self.out) >= self.half:
                break  # half the pieces out: finish
            attempts += 1
            if made < len(plan.prefix):
                sub, sub_at = plan.prefix[made], f"{plan.prefix_at}/{made}"
            else:
                sub, sub_at = plan.rest, plan.rest_at
            optional = made >= plan.min_items
            mark = self.mark() if plan.unique or optional else (0, "", 0)
            if made:
                self.pending += ", "
            try:
                self.value(sub, sub_at, depth + 1, minimal)
            except SchemaRefused:
                if not optional:
                    raise
                self.rollback(mark)  # an item past minItems it cannot make ends the list
                break
            if plan.unique:
                item = "".join(self.out[mark[0] :])[len(mark[1]) + (2 if made else 0) :]
                if item in seen:
                    self.rollback(mark)
                    continue
                seen.add(item)
            made += 1
        if made < plan.min_items:
            raise refused(
                f"{at}/uniqueItems",
                f"'uniqueItems' with 'minItems' {plan.min_items}: the sim engine made only {made} distinct items",
                lasting=False,  # its items' choices may differ elsewhere
            )
        self.emit("]")

    # -- scalars -----------------------------------------------------------------------------

    def string(self, schema: dict[str, Any], at: str, minimal: bool) -> None:
        plan = self.plans.get((id(schema), "string"))
        if plan is None:
            plan = self.plans[(id(schema), "string")] = string_plan(schema, at)
        fmt, low, high = plan
        d = self.digest()
        if fmt is not None:
            text = FORMATS[fmt](d, WORDS[d % len(WORDS)])
            if len(text) < low or (high is not None and len(text) > high):
                raise refused(at, f"a '{fmt}' string such as {text!r} does not fit minLength {low} / maxLength {high}")
            return self.emit_text(_quoted(text))
        words = [WORDS[(d >> (7 * i)) % len(WORDS)] for i in range(1 if minimal else 1 + d % 3)]
        length = sum(map(len, words)) + len(words) - 1
        x, room = d, self.limit - len(self.out) + 1
        while length < low and len(words) <= room and length <= MAX_CHARS:
            x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)  # Knuth's MMIX LCG
            words.append(WORDS[(x >> 33) % len(WORDS)])
            length += 1 + len(words[-1])
        text = " ".join(words)
        if high is not None:
            text = text[:high]
        self.emit_text(_quoted(text))

    def number(self, schema: dict[str, Any], at: str, integer: bool) -> str:
        which = "integer" if integer else "number"
        plan = self.plans.get((id(schema), which))
        if plan is None:
            plan = self.plans[(id(schema), which)] = number_plan(schema, at, integer)
        d = self.digest()
        if plan[0] == "multiple":
            _, step, first, count = plan
            return repr(step * (first + d % count))  # an int's or a finite float's JSON
        _, low, high, low_open, high_open = plan
        f = (d % 9998 + 1) / 9999
        v = low * (1 - f) + high * f  # not low + (high - low) * f: high - low may overflow

        def inside(x: float) -> bool:
            return (x > low if low_open else x >= low) and (x < high if high_open else x <= high)

        if inside(round(v, 2)):
            v = round(v, 2)
        elif not inside(v):
            v = low if not low_open else high
            if not inside(v):
                raise refused(at, f"no number lies between {low} and {high} that the sim engine can write")
        return repr(v)


def _quoted(text: str) -> str:
    return f'"{text}"'  # what `generate` writes: words, digits and `FORMATS` need no escaping
