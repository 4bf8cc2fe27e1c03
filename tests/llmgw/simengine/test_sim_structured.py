"""Tool calls and `response_format` as the sim engine decides them (`llmgw.simengine.structured`,
through `api.parse_job`): which tools, with arguments valid for their parameters, the tool-result
turn, JSON content, max_tokens and stop, and a 400 naming the field for what it cannot do."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from llmgw.http.errors import HTTPError
from llmgw.simengine import api
from testlib import clientschemas, schemacheck

TOOLS = [clientschemas.WEATHER_TOOL, clientschemas.MULTIPLY_TOOL]
WEATHER = clientschemas.WEATHER_TOOL["function"]["parameters"]
MULTIPLY = clientschemas.MULTIPLY_TOOL["function"]["parameters"]


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "be helpful"}, {"role": "user", "content": text}]


def job(kind: api.Kind = "chat", **body: Any) -> api.Job:
    base: dict[str, Any] = {"model": "m"}
    base.update({"messages": user("hello")} if kind == "chat" else {"prompt": "hello"})
    base.update(body)
    return api.parse_job(kind, base, served_model="m", max_tokens_default=256)


def answer(**body: Any) -> api.Completion:
    return api.answer_of(job(**body))


def calls(**body: Any) -> list[tuple[str, Any]]:
    completion = answer(**body)
    assert completion.finish_reason == "tool_calls" and completion.pieces == ()
    return [(c.name, json.loads(c.arguments_text)) for c in completion.tool_calls]


def refused(kind: api.Kind = "chat", **body: Any) -> str:
    with pytest.raises(HTTPError) as info:
        job(kind, **body)
    assert info.value.status == 400 and info.value.kind == "invalid_request_error"
    return info.value.message


# -- which tools ---------------------------------------------------------------------------------


def test_auto_calls_the_first_tool_when_the_message_names_none() -> None:
    [(name, arguments)] = calls(tools=TOOLS, messages=user("what is the weather in Paris?"))
    assert name == "GetWeather" and schemacheck.problems(arguments, WEATHER) == []
    assert calls(tools=TOOLS, tool_choice="auto", messages=user("hm")) == calls(tools=TOOLS, messages=user("hm"))


def test_the_tools_the_message_names_are_called_in_parallel_in_the_order_named() -> None:
    made = calls(tools=TOOLS, messages=user("use multiply, then GetWeather, then multiply again"))
    assert [name for name, _ in made] == ["multiply", "GetWeather"]
    assert schemacheck.problems(made[0][1], MULTIPLY) == [] and schemacheck.problems(made[1][1], WEATHER) == []
    # Names are words: "multiplying" names nothing, so the first tool is called.
    assert [n for n, _ in calls(tools=TOOLS, messages=user("multiplying GetWeatherX"))] == ["GetWeather"]
    # Only the last user message counts.
    conversation = [{"role": "user", "content": "multiply"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "now"}]  # fmt: skip
    assert [n for n, _ in calls(tools=TOOLS, messages=conversation)] == ["GetWeather"]


def test_parallel_tool_calls_false_makes_one_call() -> None:
    made = calls(tools=TOOLS, parallel_tool_calls=False, messages=user("multiply and GetWeather"))
    assert [name for name, _ in made] == ["multiply"]


def test_required_and_named_choices_always_call() -> None:
    named = {"type": "function", "function": {"name": "multiply"}}
    assert [n for n, _ in calls(tools=TOOLS, tool_choice=named, messages=user("GetWeather please"))] == ["multiply"]
    assert [n for n, _ in calls(tools=TOOLS, tool_choice="required")] == ["GetWeather"]
    after = tool_result_turn()
    assert [n for n, _ in calls(tools=TOOLS, tool_choice="required", messages=after)] == ["GetWeather"]
    assert [n for n, _ in calls(tools=TOOLS, tool_choice=named, messages=after)] == ["multiply"]


def tool_result_turn(result: str = "18 degrees") -> list[dict[str, Any]]:
    call = answer(tools=TOOLS, messages=user("weather?")).tool_calls[0]
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_text}}
        ],  # fmt: skip
    }
    return [*user("weather?"), assistant, {"role": "tool", "tool_call_id": call.id, "content": result}]


def test_the_tool_result_turn_gets_a_text_answer() -> None:
    text = answer(tools=TOOLS, messages=tool_result_turn())
    assert text.tool_calls == () and text.finish_reason == "stop" and len(text.text.split()) >= 16
    assert text.text != answer(tools=TOOLS, messages=tool_result_turn("rain")).text  # the result is in the prompt
    # ... or, with a response_format, an answer in that shape.
    shaped = answer(tools=TOOLS, messages=tool_result_turn(), response_format=schema_format(clientschemas.MATH_STRICT))
    assert schemacheck.problems(json.loads(shaped.text), clientschemas.MATH_STRICT) == []


def test_none_answers_in_text() -> None:
    text = answer(tools=TOOLS, tool_choice="none")
    assert text.tool_calls == () and text.text == answer().text


def test_calls_are_deterministic_with_ids_of_their_own() -> None:
    first = answer(tools=TOOLS, messages=user("multiply GetWeather"))
    assert first == answer(tools=TOOLS, messages=user("multiply GetWeather"))
    ids = [c.id for c in first.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    other = answer(tools=TOOLS, messages=user("multiply GetWeather, please"))
    assert [c.id for c in other.tool_calls] != ids
    assert first.tokens == sum(len(c.arguments) for c in first.tool_calls)


def test_a_tool_without_parameters_gets_empty_arguments() -> None:
    bare = {"type": "function", "function": {"name": "now"}}
    assert calls(tools=[bare]) == [("now", {})]


def test_pydantic_parameters_with_nested_models_and_lists() -> None:
    order = {"type": "function", "function": {"name": "place_order", "parameters": clientschemas.ORDER}}
    [(_, arguments)] = calls(tools=[order], max_tokens=4096)
    assert schemacheck.problems(arguments, clientschemas.ORDER) == []


def test_max_tokens_cuts_the_arguments() -> None:
    cut = answer(tools=TOOLS, messages=user("GetWeather multiply"), max_tokens=3)
    assert cut.finish_reason == "length" and cut.tokens == 3
    assert [c.name for c in cut.tool_calls] == ["GetWeather"]  # the second never started


def test_the_prompt_key_holds_the_assistants_tool_calls_and_the_call_id() -> None:
    turn = tool_result_turn()
    changed = json.loads(json.dumps(turn))
    changed[2]["tool_calls"][0]["function"]["arguments"] = '{"city": "Oslo", "unit": "c"}'
    assert job(messages=turn).prompt_key != job(messages=changed).prompt_key
    other_id = json.loads(json.dumps(turn))
    other_id[3]["tool_call_id"] = "call_other"
    assert job(messages=turn).prompt_key != job(messages=other_id).prompt_key
    words = len(turn[2]["tool_calls"][0]["function"]["arguments"].split())
    assert job(messages=changed).prompt_tokens == job(messages=turn).prompt_tokens - words + 4  # arguments count


# -- response_format -------------------------------------------------------------------------------


def schema_format(s: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "Answer", "schema": s, "strict": True}}


def test_json_object_answers_an_object_holding_the_text() -> None:
    shaped = answer(response_format={"type": "json_object"})
    assert json.loads(shaped.text) == {"answer": answer().text} and shaped.finish_reason == "stop"
    assert answer(response_format={"type": "text"}) == answer()
    legacy = api.answer_of(job("completion", response_format={"type": "json_object"}))
    assert isinstance(json.loads(legacy.text)["answer"], str)


@pytest.mark.parametrize("name", ["ORDER", "NODE", "MATH_STRICT"])
def test_json_schema_answers_a_valid_value(name: str) -> None:
    s = getattr(clientschemas, name)
    for i in range(10):
        shaped = answer(messages=user(f"question {i}"), response_format=schema_format(s), max_tokens=1024)
        assert shaped.finish_reason == "stop" and schemacheck.problems(json.loads(shaped.text), s) == []


def test_json_schema_is_cut_by_max_tokens_and_by_stop() -> None:
    cut = answer(response_format=schema_format(clientschemas.ORDER), max_tokens=7)
    assert cut.finish_reason == "length" and cut.tokens == 7
    whole = answer(response_format=schema_format(clientschemas.ORDER))
    stopped = answer(response_format=schema_format(clientschemas.ORDER), stop='"created"')
    assert stopped.finish_reason == "stop" and whole.text.startswith(stopped.text) and '"created"' not in stopped.text
    assert answer(response_format={"type": "json_schema", "json_schema": {"name": "any"}}).text.startswith("{")


# -- what it cannot do ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "body", "says"),
    [
        ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "divide"}}}, "'tool_choice.function.name' 'divide' names no tool in 'tools' (they are: GetWeather, multiply)"),
        ("chat", {"tool_choice": "required"}, "'tool_choice' 'required' needs 'tools'"),
        ("chat", {"tools": TOOLS, "tool_choice": "sometimes"}, "'tool_choice' must be \"none\", \"auto\", \"required\" or"),
        ("chat", {"tools": {"multiply": {}}}, "'tools' must be an array of tools, got an object"),
        ("chat", {"tools": [{"type": "web_search"}]}, "'tools[0].type' must be \"function\""),
        ("chat", {"tools": [{"type": "function"}]}, "'tools[0].function' must be an object with a 'name'"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "'tools[0].function.name' must be 1 to 64 letters, digits, underscores or dashes, got \"get weather\""),
        ("chat", {"tools": [clientschemas.MULTIPLY_TOOL, clientschemas.MULTIPLY_TOOL]}, "'tools[1].function.name' 'multiply' is also the name of tools[0]"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "'tools[0].function.parameters' must be a JSON schema of type \"object\""),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"p": {"pattern": "x"}}, "required": ["p"]}}}]},
         "'tools[0].function.parameters': 'pattern' is not supported: it cannot make strings that match a regular expression (at #/properties/p/pattern); the sim engine cannot make arguments for 'f'"),
        ("chat", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "'parallel_tool_calls' must be true or false"),
        ("chat", {"functions": [{"name": "f"}]}, "'functions' (OpenAI's deprecated function calling) is not supported by the sim engine; send 'tools'"),
        ("completion", {"tools": TOOLS}, "'tools' is not supported on /v1/completions; send it to /v1/chat/completions"),
        ("chat", {"response_format": {"type": "xml"}}, "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\""),
        ("chat", {"response_format": "json"}, "'response_format' must be an object with a 'type'"),
        ("chat", {"response_format": {"type": "json_schema"}}, "'response_format.json_schema' must be an object with a 'name' and a 'schema'"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "'response_format.json_schema.name' must be 1 to 64 letters"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}}, "'response_format.json_schema.schema' must be a JSON schema (an object), got an array"),
        ("chat", {"response_format": schema_format({"type": "string", "format": "regex"})}, "'response_format.json_schema.schema': 'format' \"regex\" is not supported"),
        ("chat", {"response_format": schema_format({"$ref": "#/$defs/Gone"})}, "'response_format.json_schema.schema': '$ref' \"#/$defs/Gone\" points at nothing"),
        ("chat", {"messages": [{"role": "tool", "content": "18"}]}, "'messages[0].tool_call_id' must be a string, the id of the tool call this result answers"),
        ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]}, "'messages[0].tool_calls[0]' must be a tool call"),
    ],
)  # fmt: skip
def test_what_it_cannot_do_is_a_400_naming_the_field(kind: api.Kind, body: dict[str, Any], says: str) -> None:
    assert says in refused(kind, **body)


def test_a_decided_job_crosses_back_from_a_json_worker() -> None:
    # A large body is parsed in a worker process (llmgw.http.jsonworkers), which pickles the job back:
    # the answer travels with it, the tools and schemas stay behind.
    decided = job(tools=TOOLS, messages=user("multiply GetWeather"), logprobs=True)
    again = pickle.loads(pickle.dumps(decided))
    assert again == decided and again.answer is not None and len(again.answer.tool_calls) == 2
    assert (
        len(pickle.dumps(job(tools=[{"type": "function", "function": {"name": "f", "description": "d" * 100_000}}])))
        < 2000
    )
