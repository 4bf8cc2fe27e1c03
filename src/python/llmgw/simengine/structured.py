"""What a request asks for beyond free text, checked and decided: tool calls (`tools`,
`tool_choice`, `parallel_tool_calls`) and the answer's shape (`response_format`). Pure.

`api.parse_job` calls `decide` where the body is parsed (in a JSON worker for a large body), so
what comes back is the answer itself, bounded by max_tokens, never the tools or the schema.

The rules, each a function of the request alone:
- Tools are called when `tools` are given and `tool_choice` is
  - "auto" (the default with tools): unless the last message is a tool's result (role "tool"),
    which gets an answer instead — in text, or in `response_format`'s shape;
  - "required": always; a named function (`{"type": "function", "function": {"name": N}}`):
    always, that one alone;
  - "none": never.
  Which: the tools the last user message names (as words: `get_weather` in "what does
  get_weather say"), in the order it names them; the first tool when it names none. Only the
  first of them when `parallel_tool_calls` is false.
- A call's arguments are a value of its function's `parameters` (`schema.generate`); its id is
  `call_` and 24 hex digits of a hash of the request and the call's position.
- `response_format` "json_object" answers `{"answer": "<the text answer>"}`; "json_schema" a value
  of its `schema`; "text" (or none) the text answer.
- Every piece of JSON is an output token: max_tokens cuts the arguments or the content where it
  falls (finish_reason "length"), as an engine's limit does. `stop` applies to content, not to
  tool calls.

A request whose tools or schema the sim cannot honour is a 400 naming the field.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import attrs

from llmgw.errors import cut
from llmgw.simengine import schema
from llmgw.simengine.errors import SchemaRefused
from llmgw.simengine.fields import bad_request, boolean, json_type, show
from llmgw.simengine.text import Completion, ToolCall, complete, cut_at_stop, hasher

# OpenAI's rule for function and schema names.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
WORD = re.compile(r"[A-Za-z0-9_-]+")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
JSON_OBJECT_HEAD = '{"answer": "'
JSON_OBJECT_TAIL = '"}'
CHOICES = ("none", "auto", "required")


@attrs.frozen(kw_only=True)
class Turn:
    """What `decide` reads of the messages."""

    last_role: str = "user"
    last_user_text: str = ""  # the content of the last message with role "user"


@attrs.frozen(kw_only=True)
class Tool:
    index: int  # in the request's `tools`
    name: str
    parameters: Any


def decide(
    kind: str,
    body: dict[str, Any],
    *,
    model: str,
    prompt_key: str,
    max_tokens: int,
    stop: Sequence[str],
    turn: Turn,
) -> Completion | None:
    """The answer when the request asks for tool calls or a JSON shape; None for plain text."""
    shape = _response_format(body.get("response_format"))
    if kind == "chat":
        for old in ("functions", "function_call"):
            if body.get(old) is not None:
                raise bad_request(
                    f"'{old}' (OpenAI's deprecated function calling) is not supported by the sim engine; "
                    "send 'tools' and 'tool_choice' instead"
                )
        tools = _tools(body.get("tools"))
        choice = _tool_choice(body.get("tool_choice"), tools)
        parallel = boolean(body, "parallel_tool_calls", default=True)
        chosen = _chosen(tools, choice, parallel, turn)
        if chosen:
            return _call(chosen, model=model, prompt_key=prompt_key, max_tokens=max_tokens)
    else:
        for name in ("tools", "tool_choice", "functions", "function_call"):
            if body.get(name) is not None:
                raise bad_request(f"'{name}' is not supported on /v1/completions; send it to /v1/chat/completions")
    if shape is None:
        return None
    return _json(shape, model=model, prompt_key=prompt_key, max_tokens=max_tokens, stop=stop)


def call_id(model: str, prompt_key: str, index: int) -> str:
    digest = hashlib.blake2b(f"{model}\0{prompt_key}\0call\0{index}".encode(), digest_size=12)
    return "call_" + digest.hexdigest()


# -- reading the fields ------------------------------------------------------------------------


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise bad_request(f"'{where}' must be 1 to 64 letters, digits, underscores or dashes, got {show(value)}")
    return value


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request(f"'tools' must be an array of tools, got {json_type(value)}")
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise bad_request(f"'tools[{i}]' must be an object, got {json_type(tool)}")
        if tool.get("type") != "function":
            raise bad_request(
                f"'tools[{i}].type' must be \"function\" (the only kind of tool the sim engine calls), "
                f"got {show(tool.get('type'))}"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"'tools[{i}].function' must be an object with a 'name', got {json_type(function)}")
        name = _name(function.get("name"), f"tools[{i}].function.name")
        if name in seen:
            raise bad_request(
                f"'tools[{i}].function.name' {name!r} is also the name of tools[{seen[name]}]; "
                "give each tool its own name"
            )
        seen[name] = i
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        elif not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise bad_request(
                f"'tools[{i}].function.parameters' must be a JSON schema of type \"object\", got {show(parameters)}"
            )
        boolean(function, "strict", f"tools[{i}].function.strict")
        tools.append(Tool(index=i, name=name, parameters=parameters))
    return tuple(tools)


def _tool_choice(value: Any, tools: Sequence[Tool]) -> str | Tool:
    """The choice: "none", "auto", "required", or the one tool named."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str) and value in CHOICES:
        if value != "none" and not tools:
            raise bad_request(f"'tool_choice' {value!r} needs 'tools': give the tools it may call, or leave it out")
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = _name(value["function"].get("name"), "tool_choice.function.name")
        for tool in tools:
            if tool.name == name:
                return tool
        names = ", ".join(t.name for t in tools[:20]) + (", ..." if len(tools) > 20 else "")
        raise bad_request(
            f"'tool_choice.function.name' {name!r} names no tool in 'tools' "
            f"({'they are: ' + names if tools else 'none are given'})"
        )
    raise bad_request(
        '\'tool_choice\' must be "none", "auto", "required" or '
        f'{{"type": "function", "function": {{"name": NAME}}}}, got {show(value)}'
    )


def _response_format(value: Any) -> Any:
    """None (text), `True` for json_object, or the json_schema's schema."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request(f"'response_format' must be an object with a 'type', got {show(value)}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return True
    if kind != "json_schema":
        raise bad_request(
            '\'response_format.type\' must be "text", "json_object" or "json_schema" '
            f"(what the sim engine makes), got {show(kind)}"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            f"'response_format.json_schema' must be an object with a 'name' and a 'schema', got {json_type(spec)}"
        )
    _name(spec.get("name"), "response_format.json_schema.name")
    boolean(spec, "strict", "response_format.json_schema.strict")
    found = spec.get("schema")
    if found is None:
        return True  # no schema: any JSON object
    if not isinstance(found, (dict, bool)):
        raise bad_request(f"'response_format.json_schema.schema' must be a JSON schema (an object), got {json_type(found)}")  # fmt: skip
    return {"schema": found}


# -- deciding ----------------------------------------------------------------------------------


def _chosen(tools: Sequence[Tool], choice: str | Tool, parallel: bool, turn: Turn) -> list[Tool]:
    if isinstance(choice, Tool):
        return [choice]
    if choice == "none" or (choice == "auto" and turn.last_role == "tool"):
        return []
    by_name = {tool.name: tool for tool in tools}
    named: dict[str, Tool] = {}
    for match in WORD.finditer(turn.last_user_text):
        tool = by_name.get(match.group())
        if tool is not None and tool.name not in named:
            named[tool.name] = tool
            if not parallel or len(named) == len(tools):
                break
    return list(named.values()) or [tools[0]]


def _call(tools: Sequence[Tool], *, model: str, prompt_key: str, max_tokens: int) -> Completion:
    calls, room, finish = [], max_tokens, "tool_calls"
    for i, tool in enumerate(tools):
        if room == 0:
            finish = "length"
            break
        seed = hasher(model, prompt_key, "tool", str(i), tool.name)
        try:
            pieces, whole = schema.generate(tool.parameters, seed, limit=room)
        except SchemaRefused as exc:
            raise bad_request(
                f"'tools[{tool.index}].function.parameters': {exc.message}; the sim engine cannot make "
                f"arguments for {cut(tool.name, 64)!r}"
            ) from None
        calls.append(ToolCall(id=call_id(model, prompt_key, i), name=tool.name, arguments=pieces))
        room -= len(pieces)
        if not whole:
            finish = "length"
            break
    return Completion(pieces=(), finish_reason=finish, tool_calls=tuple(calls))


def _json(shape: Any, *, model: str, prompt_key: str, max_tokens: int, stop: Sequence[str]) -> Completion:
    if shape is True:
        words = complete(model, prompt_key, max_tokens).pieces
        pieces: tuple[str, ...] = (JSON_OBJECT_HEAD, *words, JSON_OBJECT_TAIL)
        whole = len(pieces) <= max_tokens
        pieces = pieces[:max_tokens]
    else:
        try:
            pieces, whole = schema.generate(shape["schema"], hasher(model, prompt_key, "json"), limit=max_tokens)
        except SchemaRefused as exc:
            raise bad_request(f"'response_format.json_schema.schema': {exc.message}") from None
    kept = cut_at_stop(pieces, stop)
    if kept is not None:
        return Completion(pieces=kept, finish_reason="stop")
    return Completion(pieces=pieces, finish_reason="stop" if whole else "length")
