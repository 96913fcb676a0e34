"""Tool calls and structured output through the official `openai` SDK.

The fixture model is random, so only a grammar can make it call a tool or write JSON:
`tool_choice` "required" / a named tool and `response_format` json_schema are forced
by constrained decoding, so their outputs must parse and validate against the schema
(checked here with `jsonschema`, independently of the server's own validation).
"""

from __future__ import annotations

import json

from typing import List, Literal

import jsonschema
import openai
import pydantic
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["a", "b", "c"]},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
def schema_of(tool):
    return tool["function"]["parameters"]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_call_and_round_trip(client, model, choice):
    tools = [WEATHER, TIME]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        temperature=0,
        max_tokens=200,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    calls = c.message.tool_calls
    assert calls, c.message
    by_name = {t["function"]["name"]: t for t in tools}
    for call in calls:
        assert call.type == "function"
        assert call.id
        assert call.function.name in by_name
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schema_of(by_name[call.function.name]))
    if isinstance(choice, dict):
        assert [call.function.name for call in calls] == ["get_time"]

    # Round trip: the call and its result go back; the model answers (text or
    # another call), and the prompt grew by the call and the result.
    call = calls[0]
    history = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "sunny, 21C"})},
    ]
    r2 = client.chat.completions.create(
        model=model, messages=history, tools=tools, temperature=0, max_tokens=16
    )
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    # With tool_choice none, no call comes back.
    r3 = client.chat.completions.create(
        model=model, messages=history, tools=tools, tool_choice="none", temperature=0, max_tokens=16
    )
    assert not r3.choices[0].message.tool_calls
    assert isinstance(r3.choices[0].message.content, str)


def test_forced_tool_call_streams(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[TIME],
        tool_choice="required",
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    chunks = list(stream)
    args = {}
    names = {}
    finish = None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            if tc.function and tc.function.name:
                names[tc.index] = tc.function.name
            if tc.function and tc.function.arguments:
                args[tc.index] = args.get(tc.index, "") + tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert names and set(names.values()) == {"get_time"}
    for a in args.values():
        jsonschema.validate(json.loads(a), schema_of(TIME))
    # The arguments arrive as they are written, in several fragments, and the SDK's
    # stream helper assembles the same call as a request without streaming.
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls) > 2
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    with client.chat.completions.stream(**kwargs) as s:
        deltas = [e.arguments_delta for e in s if e.type == "tool_calls.function.arguments.delta"]
        final = s.get_final_completion()
    whole = client.chat.completions.create(**kwargs)
    assert len(deltas) > 1
    got = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert got == want
    assert "".join(deltas) == want[0][1]


def test_parallel_tool_calls_false_gives_one_call(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris and the time in UTC?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    assert len(r.choices[0].message.tool_calls or []) == 1


def test_json_schema_output_parses_and_validates(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        temperature=0,
        max_tokens=300,
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    value = json.loads(c.message.content)
    jsonschema.validate(value, PERSON)
    # Sampled (temperature 1) output is constrained just the same.
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Another person."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            temperature=1,
            seed=seed,
            max_tokens=300,
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_output_parses(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Any JSON object."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=300,
    )
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        # Cut by max_tokens: still a prefix of a JSON object.
        assert c.finish_reason == "length" and c.message.content.lstrip().startswith("{")


def test_invalid_schema_is_a_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}},
            },
            max_tokens=8,
        )
    body = e.value.body
    assert isinstance(body, dict) and (body.get("param") or "").startswith("response_format"), body


# Typed models, as agent code writes tools and output formats: the SDK turns them into
# strict JSON schemas whose nested types are `$defs` reached by `$ref`.
class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    country: Literal["NO", "FR", "JP"]


class Route(pydantic.BaseModel):
    """A trip from one place to another, through stops."""

    start: Place
    end: Place
    stops: List[Place] = pydantic.Field(max_length=2)


def test_typed_model_tool_with_nested_types(client, model):
    tool = openai.pydantic_function_tool(Route)
    assert "$defs" in tool["function"]["parameters"], tool
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Plan a trip."}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=400,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    [call] = c.message.tool_calls
    assert call.function.name == "Route"
    # The SDK parsed the arguments into the model (it raises if they do not fit).
    assert isinstance(call.function.parsed_arguments, Route), call
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_typed_model_response_format_with_nested_types(client, model):
    for seed in (1, 2):
        r = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": "A route, as JSON."}],
            response_format=Route,
            temperature=1,
            seed=seed,
            max_tokens=400,
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        assert isinstance(c.message.parsed, Route), c.message
