"""The OpenAI clients users run — the official `openai` SDK, LangChain's `ChatOpenAI` and litellm —
against a real `llmgw up` (one node, the sim engine's `sim-small`), each used as its documentation
shows: plain, streamed, async, with its own exception classes and its own retries.

The sim engine's answer is a function of the model, the prompt and `max_tokens`, so every client
must come back with the same text for the same prompt, streamed or not: each test compares with
the answer fetched once with the SDK.

Every client is given the gateway's URL and key explicitly, and nothing may leave 127.0.0.0/8:
an audit hook sees every connection and name lookup this process makes through Python's
sockets, and each test fails on one to anywhere else (litellm looks up its price map's host at
import unless LITELLM_LOCAL_MODEL_COST_MAP is set).

"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import openai
import pydantic
import pytest
from langchain_openai import ChatOpenAI

from testlib.ports import free_port
from testlib.proc import run_llmgw
from testlib.up import start, stop

MODEL = "sim-small"
PROMPT = "Name three rivers of Europe."
MAX_TOKENS = 16
# Each call is bounded: a request the sim answers in milliseconds gets 30 s before the client gives up.
TIMEOUT_S = 30.0
UNSERVABLE = "sim-unservable"  # in the catalog, needing more memory than any node has: never placed

# -- nothing leaves loopback ---------------------------------------------------------------------


def _is_loopback(host: object) -> bool:
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False  # any other name: its lookup may leave the machine


OUTSIDE: list[str] = []  # connections and lookups to anywhere but loopback, in order


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple) and not _is_loopback(address[0]):  # AF_UNIX addresses are str
            OUTSIDE.append(f"connect to {address!r}")
    elif event == "socket.getaddrinfo" and args[0] is not None and not _is_loopback(args[0]):
        OUTSIDE.append(f"name lookup of {args[0]!r}")


# Installed when the module is imported, before any client is: a hook cannot be removed, and
# it only records.
sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def stays_on_loopback() -> Iterator[None]:
    before = len(OUTSIDE)
    yield
    if OUTSIDE[before:]:
        # pytest.fail, not assert: an xfail test must not take this for the feature it waits for.
        pytest.fail(f"a client reached beyond 127.0.0.0/8: {OUTSIDE[before:]}")


def test_the_loopback_guard_sees_a_lookup_of_another_host() -> None:
    # The event a lookup raises, without the lookup: proof that the guard above is armed.
    before = len(OUTSIDE)
    sys.audit("socket.getaddrinfo", "api.openai.com", 443, 0, 0, 0)
    sys.audit("socket.getaddrinfo", "127.0.0.1", 443, 0, 0, 0)
    assert OUTSIDE[before:] == ["name lookup of 'api.openai.com'"]
    del OUTSIDE[before:]


# -- the cluster ---------------------------------------------------------------------------------


KEY_NUMBERS = itertools.count(1)


class SetupFailed(Exception):
    """What a test needs of the cluster could not be made."""


@attrs.frozen(kw_only=True)
class Gateway:
    url: str  # http://127.0.0.1:PORT
    key: str  # the key `up` made, for every model, without limits
    state: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def ctl(self, *args: str) -> Any:
        done = run_llmgw("ctl", *args, "--json", "--state-dir", str(self.state))
        if done.returncode != 0:
            # Not an AssertionError: an xfail test would take a broken setup for the missing feature.
            raise SetupFailed(f"`llmgw ctl {' '.join(args)}` exited {done.returncode}:\n{done.stderr}")
        return json.loads(done.stdout)

    def new_key(self, name: str, *flags: str) -> str:
        """A new API key's token (the key named `name` and a number: names are never reused); the
        gateway honours it when `ctl keys create` returns."""
        return self.ctl("keys", "create", f"{name}-{next(KEY_NUMBERS)}", *flags)["token"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    state = tmp_path_factory.mktemp("clients") / "state"
    proc, ready = start(state, free_port())
    try:
        yield Gateway(url=ready["gateway_url"], key=ready["api_key"], state=state)
    finally:
        assert stop(proc) == 0


@attrs.define
class Attempts:
    """What one client sent and got, seen from its HTTP client's event hooks: one entry per
    attempt, so the SDK's retries are counted, with when each request went out."""

    sent: list[float] = attrs.Factory(list)  # time.monotonic() of each request
    statuses: list[int] = attrs.Factory(list)
    headers: list[dict[str, str]] = attrs.Factory(list)

    def hooks(self) -> dict[str, list[Callable[..., None]]]:
        return {"request": [self._request], "response": [self._response]}

    def _request(self, request: Any) -> None:
        self.sent.append(time.monotonic())

    def _response(self, response: Any) -> None:
        self.statuses.append(response.status_code)
        self.headers.append(dict(response.headers))

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.sent, self.sent[1:], strict=False)]


def sdk(gateway: Gateway, key: str | None = None, *, attempts: Attempts | None = None, **options: Any) -> openai.OpenAI:
    http_client = openai.DefaultHttpxClient(event_hooks=attempts.hooks()) if attempts else None
    return openai.OpenAI(
        base_url=gateway.base_url,
        api_key=key or gateway.key,
        timeout=options.pop("timeout", TIMEOUT_S),
        http_client=http_client,
        **options,
    )


def ask(client: openai.OpenAI, model: str = MODEL, **fields: Any) -> Any:
    fields.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], **fields)


@pytest.fixture(scope="module")
def answer(gateway: Gateway) -> str:
    """The sim's text for PROMPT with MAX_TOKENS, as every client must see it."""
    text = ask(sdk(gateway)).choices[0].message.content
    assert text
    return text


# -- the openai SDK ------------------------------------------------------------------------------


def test_openai_chat_answers_with_the_models_text_and_usage(gateway: Gateway, answer: str) -> None:
    completion = ask(sdk(gateway))
    assert completion.object == "chat.completion" and completion.model == MODEL
    [choice] = completion.choices
    assert choice.message.role == "assistant" and choice.message.content == answer
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_openai_stream_with_include_usage_ends_with_a_usage_chunk(gateway: Gateway, answer: str) -> None:
    whole = ask(sdk(gateway))
    chunks = list(ask(sdk(gateway), stream=True, stream_options={"include_usage": True}))
    # Every chunk but the last carries a choice and no usage; the last carries usage and no choice.
    *body, last = chunks
    assert all(c.usage is None and len(c.choices) == 1 for c in body), body
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == whole.usage.model_dump()
    assert "".join(c.choices[0].delta.content or "" for c in body) == answer
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_openai_stream_without_include_usage_has_no_usage(gateway: Gateway, answer: str) -> None:
    with ask(sdk(gateway), stream=True) as stream:
        chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer


def test_openai_async_client_answers_many_requests_at_once(gateway: Gateway, answer: str) -> None:
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key=gateway.key, timeout=TIMEOUT_S) as client:

            async def one() -> str:
                completion = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS
                )
                return completion.choices[0].message.content or ""

            async def streamed() -> str:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS, stream=True
                )
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            return await asyncio.gather(*[one() for _ in range(8)], *[streamed() for _ in range(8)])

    assert asyncio.run(main()) == [answer] * 16


def test_openai_legacy_completions_streamed_and_not_agree(gateway: Gateway) -> None:
    client = sdk(gateway)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert whole.object == "text_completion" and whole.choices[0].text
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= MAX_TOKENS
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True)
        if c.choices
    ]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].text


def test_openai_models_list_names_the_served_model(gateway: Gateway) -> None:
    models = list(sdk(gateway).models.list())
    assert MODEL in [m.id for m in models]
    assert all(m.object == "model" for m in models), models


def bad_key(gateway: Gateway) -> tuple[openai.OpenAI, Callable[[openai.OpenAI], Any]]:
    return sdk(gateway, "sk-not-a-key-of-this-gateway"), ask


def unknown_model(gateway: Gateway) -> tuple[openai.OpenAI, Callable[[openai.OpenAI], Any]]:
    return sdk(gateway), lambda c: ask(c, model="sim-nonexistent")


def model_of_the_wrong_type(gateway: Gateway) -> tuple[openai.OpenAI, Callable[[openai.OpenAI], Any]]:
    # The SDK sends what it is given; extra_body overrides its fields, as a buggy caller might.
    return sdk(gateway), lambda c: ask(c, extra_body={"model": 5})


def a_field_the_engine_refuses(gateway: Gateway) -> tuple[openai.OpenAI, Callable[[openai.OpenAI], Any]]:
    return sdk(gateway), lambda c: ask(c, n=2)  # the sim makes one choice: its own 400, relayed


def another_models_key(gateway: Gateway) -> tuple[openai.OpenAI, Callable[[openai.OpenAI], Any]]:
    return sdk(gateway, gateway.new_key("other-model-only", "--models", "sim-other")), ask


# `says`: what the message must name, so the gateway's own words reach the caller (their wording
# may change; what they name may not).
@pytest.mark.parametrize(
    ("case", "error", "status", "says"),
    [
        (bad_key, openai.AuthenticationError, 401, "API key"),
        (unknown_model, openai.NotFoundError, 404, "'sim-nonexistent'"),
        (model_of_the_wrong_type, openai.BadRequestError, 400, "model"),
        (a_field_the_engine_refuses, openai.BadRequestError, 400, "'n'"),
        (another_models_key, openai.PermissionDeniedError, 403, "'sim-small'"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_openai_raises_the_class_of_each_error_at_once(
    gateway: Gateway, case: Callable[..., Any], error: type[openai.APIStatusError], status: int, says: str
) -> None:
    client, call = case(gateway)
    attempts = Attempts()
    client = client.with_options(http_client=openai.DefaultHttpxClient(event_hooks=attempts.hooks()))
    with pytest.raises(error) as raised:
        call(client)
    assert raised.value.status_code == status
    assert says in raised.value.message, raised.value.message
    assert attempts.statuses == [status]  # a 4xx is not retried


def test_openai_retries_a_rate_limited_request_after_its_retry_after(gateway: Gateway, answer: str) -> None:
    # 30 a minute: a burst of 30, then one every 2 s, so Retry-After is 1 or 2 s and the SDK's
    # own backoff (0.375-0.5 s before its first retry) would be told apart.
    key = gateway.new_key("thirty-a-minute", "--rate-per-minute", "30")
    for _ in range(60):  # the burst, and the requests it refilled meanwhile
        attempts = Attempts()
        completion = ask(sdk(gateway, key, attempts=attempts))
        if attempts.statuses != [200]:
            break
    assert attempts.statuses == [429, 200], attempts.statuses
    assert completion.choices[0].message.content == answer
    retry_after = float(attempts.headers[0]["retry-after"])
    assert 1 <= retry_after <= 2
    [gap] = attempts.gaps()
    assert retry_after <= gap < retry_after + 2.0, (gap, retry_after)  # waited as told, and no longer

    # Without retries, the class a caller catches, with what it needs to wait itself.
    attempts = Attempts()
    with pytest.raises(openai.RateLimitError) as raised:
        ask(sdk(gateway, key, attempts=attempts, max_retries=0))
    assert attempts.statuses == [429]
    assert 1 <= float(raised.value.response.headers["retry-after"]) <= 2
    assert "30 requests per minute" in raised.value.message


# -- LangChain -----------------------------------------------------------------------------------


def chat_model(gateway: Gateway, **options: Any) -> Any:
    options.setdefault("max_tokens", MAX_TOKENS)
    options.setdefault("model", MODEL)
    return ChatOpenAI(base_url=gateway.base_url, api_key=gateway.key, timeout=TIMEOUT_S, max_retries=0, **options)


@pytest.fixture(autouse=True)
def no_langsmith(monkeypatch: pytest.MonkeyPatch) -> None:
    # LangChain sends traces to LangSmith's servers when these are set in the environment.
    for name in ("LANGCHAIN_TRACING_V2", "LANGSMITH_TRACING", "LANGCHAIN_API_KEY", "LANGSMITH_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def test_langchain_invoke_answers_with_the_models_text_and_usage(gateway: Gateway, answer: str) -> None:
    message = chat_model(gateway).invoke(PROMPT)
    assert message.content == answer
    assert message.response_metadata["model_name"] == MODEL
    assert message.usage_metadata is not None and 0 < message.usage_metadata["output_tokens"] <= MAX_TOKENS


def test_langchain_stream_adds_up_to_the_same_text_and_usage(gateway: Gateway, answer: str) -> None:
    chunks = list(chat_model(gateway, stream_usage=True).stream(PROMPT))
    assert len(chunks) > 2
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert total.content == answer
    whole = chat_model(gateway).invoke(PROMPT)
    assert total.usage_metadata == whole.usage_metadata


def test_langchain_raises_the_openai_sdks_error_classes(gateway: Gateway) -> None:
    bad_key = ChatOpenAI(model=MODEL, base_url=gateway.base_url, api_key="sk-not-a-key-of-this-gateway", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad_key.invoke(PROMPT)
    with pytest.raises(openai.NotFoundError, match="'sim-nonexistent'"):
        chat_model(gateway, model="sim-nonexistent").invoke(PROMPT)


# -- litellm -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm() -> Any:
    # Read at import: without it litellm fetches its model price map from the internet.
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm

    litellm.telemetry = False
    return litellm


def litellm_completion(litellm: Any, gateway: Gateway, key: str | None = None, **fields: Any) -> Any:
    fields.setdefault("model", MODEL)
    fields["model"] = f"openai/{fields['model']}"  # litellm's provider prefix: the OpenAI API at api_base
    return litellm.completion(
        api_base=gateway.base_url,
        api_key=key or gateway.key,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        timeout=fields.pop("timeout", TIMEOUT_S),
        **fields,
    )


def test_litellm_completion_streamed_and_not(gateway: Gateway, answer: str, litellm: Any) -> None:
    response = litellm_completion(litellm, gateway)
    assert response.choices[0].message.content == answer
    assert 0 < response.usage.completion_tokens <= MAX_TOKENS
    chunks = list(litellm_completion(litellm, gateway, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == answer
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens


@pytest.mark.parametrize(
    ("case", "error", "status", "says"),
    [
        ("bad key", "AuthenticationError", 401, "API key"),
        ("unknown model", "NotFoundError", 404, "'sim-nonexistent'"),
        ("a field the engine refuses", "BadRequestError", 400, "'n'"),
        ("over its rate", "RateLimitError", 429, "1 requests per minute"),
        # litellm's mapping for its openai provider has no class for 403 (its PermissionDeniedError
        # is other providers'): the generic APIError, with the status.
        ("another model's key", "APIError", 403, "'sim-small'"),
    ],
)
def test_litellm_maps_each_error_to_its_exception(
    gateway: Gateway, litellm: Any, case: str, error: str, status: int, says: str
) -> None:
    fields: dict[str, Any] = {"max_retries": 0}  # litellm's openai client retries a 429 by default
    if case == "bad key":
        fields["key"] = "sk-not-a-key-of-this-gateway"
    elif case == "unknown model":
        fields["model"] = "sim-nonexistent"
    elif case == "a field the engine refuses":
        fields["n"] = 2
    elif case == "over its rate":
        fields["key"] = gateway.new_key("litellm-one-a-minute", "--rate-per-minute", "1")
        litellm_completion(litellm, gateway, **fields)
    else:
        fields["key"] = gateway.new_key("litellm-other-model-only", "--models", "sim-other")
    with pytest.raises(getattr(litellm, error)) as raised:
        litellm_completion(litellm, gateway, **fields)
    assert raised.value.status_code == status
    assert says in str(raised.value), str(raised.value)


# -- after the gateway's error contract (branch i29-gw) ------------------------------------------


@pytest.mark.parametrize(
    ("case", "error", "code", "param"),
    [
        (bad_key, openai.AuthenticationError, "invalid_api_key", None),
        (unknown_model, openai.NotFoundError, "model_not_found", "model"),
        (model_of_the_wrong_type, openai.BadRequestError, "invalid_type", "model"),
        (another_models_key, openai.PermissionDeniedError, "model_not_allowed", "model"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_openai_errors_carry_openais_codes_and_a_request_id(
    gateway: Gateway, case: Callable[..., Any], error: type[openai.APIStatusError], code: str, param: str | None
) -> None:
    client, call = case(gateway)
    with pytest.raises(error) as raised:
        call(client)
    assert (raised.value.code, raised.value.param, raised.value.type) == (code, param, "invalid_request_error")
    assert raised.value.request_id


def test_openai_rate_limit_error_carries_openais_code(gateway: Gateway) -> None:
    key = gateway.new_key("one-a-minute", "--rate-per-minute", "1")
    ask(sdk(gateway, key))
    with pytest.raises(openai.RateLimitError) as raised:
        ask(sdk(gateway, key, max_retries=0))
    assert (raised.value.code, raised.value.type) == ("rate_limit_exceeded", "requests")
    assert raised.value.request_id


def test_every_answer_carries_a_request_id_and_the_callers_own_comes_back(gateway: Gateway) -> None:
    response = sdk(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS
    )
    assert response.headers.get("x-request-id")
    assert response.parse()._request_id == response.headers["x-request-id"]
    mine = sdk(gateway).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        extra_headers={"X-Request-Id": "trace-1234"},
    )
    assert mine.headers.get("x-request-id") == "trace-1234"


@pytest.fixture(scope="module")
def unservable(gateway: Gateway) -> str:
    """A model in the catalog that no node can hold (far more memory than any has), reloaded
    into the running `up`."""
    config = gateway.state / "server.toml"
    config.write_text(
        config.read_text() + f'\n[[models]]\nname = "{UNSERVABLE}"\nengine = "sim"\nmemory_gb = 1000000.0\n'
    )
    reloaded = gateway.ctl("reload")
    if UNSERVABLE not in reloaded["models"]:
        raise SetupFailed(f"`llmgw ctl reload` did not add {UNSERVABLE}: {reloaded}")
    return UNSERVABLE


def test_an_unservable_model_fails_at_once_with_the_sdks_default_retries(gateway: Gateway, unservable: str) -> None:
    attempts = Attempts()
    # Default retries (2). The timeout only bounds this test while the gateway still queues such a
    # request for 30 s; the contract is an answer well within it.
    client = sdk(gateway, attempts=attempts, timeout=2.5)
    assert client.max_retries == openai.DEFAULT_MAX_RETRIES
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as raised:
        ask(client, model=unservable)
    took = time.monotonic() - started
    assert raised.value.status_code == 503 and raised.value.code == "model_unavailable"
    assert attempts.statuses == [503]  # x-should-retry: false, so the SDK did not retry
    assert took < 2.0, took
    assert unservable in raised.value.message


def test_litellm_gets_an_unservable_model_as_service_unavailable_at_once(
    gateway: Gateway, litellm: Any, unservable: str
) -> None:
    started = time.monotonic()
    with pytest.raises(litellm.ServiceUnavailableError) as raised:
        litellm_completion(litellm, gateway, model=unservable, timeout=2.5)  # its default retries
    took = time.monotonic() - started
    assert raised.value.status_code == 503 and unservable in str(raised.value)
    assert took < 2.0, took


# -- after the sim engine's tools, response_format and logprobs (branch i29-sim) -----------------


class City(pydantic.BaseModel):
    name: str
    population: int


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_openai_parse_returns_the_pydantic_model(gateway: Gateway) -> None:
    completion = sdk(gateway).chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "A city, as JSON."}],
        response_format=City,
        max_tokens=256,
    )
    assert isinstance(completion.choices[0].message.parsed, City)


def test_openai_json_object_response_format_answers_a_json_object(gateway: Gateway) -> None:
    completion = ask(sdk(gateway), response_format={"type": "json_object"}, max_tokens=256)
    assert isinstance(json.loads(completion.choices[0].message.content or ""), dict)


def test_openai_tool_call_then_the_tool_result_turn(gateway: Gateway) -> None:
    client = sdk(gateway)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=256
    )
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"}
    assert arguments["unit"] in ("c", "f")
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3}'},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=64)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content


def test_openai_streamed_tool_call_is_assembled_by_the_sdk(gateway: Gateway) -> None:
    with sdk(gateway).chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Record Oslo."}],
        tools=[openai.pydantic_function_tool(City, name="record_city")],
        tool_choice={"type": "function", "function": {"name": "record_city"}},
        max_tokens=256,
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls, final
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "record_city" and isinstance(call.function.parsed_arguments, City)


def test_openai_logprobs_come_with_each_token(gateway: Gateway) -> None:
    completion = ask(sdk(gateway), logprobs=True, top_logprobs=2)
    assert completion.choices[0].logprobs is not None, completion
    content = completion.choices[0].logprobs.content
    assert content and "".join(t.token for t in content) == completion.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_langchain_bind_tools_gets_a_tool_call(gateway: Gateway) -> None:
    message = (
        chat_model(gateway, max_tokens=256)
        .bind_tools([WEATHER_TOOL], tool_choice="get_weather")
        .invoke("What is the weather in Oslo?")
    )
    assert message.tool_calls, message
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}


def test_langchain_json_mode_gets_a_json_object(gateway: Gateway) -> None:
    """json_mode sends `response_format: json_object`, which promises a JSON object and no shape (a
    real model follows the prompt's description of one; the sim reads no instructions): the reply
    parses as an object."""
    structured = chat_model(gateway, max_tokens=256).with_structured_output(None, method="json_mode", include_raw=True)
    result = structured.invoke("A city, as JSON with its name and population.")
    assert result["parsing_error"] is None and isinstance(result["parsed"], dict), result
    assert json.loads(result["raw"].content) == result["parsed"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_returns_the_pydantic_model(gateway: Gateway, method: str) -> None:
    structured = chat_model(gateway, max_tokens=256).with_structured_output(City, method=method, include_raw=True)
    # include_raw: a reply that does not parse comes back with the reason instead of raising.
    result = structured.invoke("A city, as JSON with its name and population.")
    assert result["parsing_error"] is None and isinstance(result["parsed"], City), result
