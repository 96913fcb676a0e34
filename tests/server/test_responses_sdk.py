"""The OpenAI Responses endpoint of `voom serve` through the official `openai` SDK.

The server comes from conftest.py (VOOM_TEST_BASE_URL, without /v1, and
VOOM_TEST_MODEL, e.g. the tiny_chat fixture). The fixture's
weights are random, so texts are gibberish but deterministic at temperature 0.
"""

import json
import os

import openai
import pytest

# Set by conftest.py (which starts the server) before this module is imported: a
# missing value is an error, never a skip.
BASE_URL = os.environ["VOOM_TEST_BASE_URL"]
MODEL = os.environ["VOOM_TEST_MODEL"]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE_URL.rstrip("/") + "/v1", api_key="unused", max_retries=0)


def test_non_streaming(client):
    r = client.responses.create(
        model=MODEL, input="Say hello.", instructions="You are terse.", max_output_tokens=12, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.model == MODEL
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text
    assert r.output[0].type == "message"
    assert r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    again = client.responses.create(
        model=MODEL, input="Say hello.", instructions="You are terse.", max_output_tokens=12, temperature=0
    )
    assert again.output_text == r.output_text


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, input="Count to three.", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kwargs)
    types = []
    deltas = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        # The SDK's get_final_response() wants response.completed; a response cut by
        # max_output_tokens ends with response.incomplete (as OpenAI's does).
        final = event.response
    assert "".join(deltas) == whole.output_text
    assert final.output_text == whole.output_text
    assert final.status == whole.status
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    # create(stream=True) yields the same events, numbered in order.
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.type for e in events] == types
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_stream_final_response_when_completed(client):
    # Under a JSON schema the output completes well within the limit.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    kwargs = dict(
        model=MODEL,
        input="Answer as JSON.",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "ok", "schema": schema, "strict": True}},
    )
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == whole.output_text
    assert json.loads(final.output_text)["ok"] in (True, False)


def test_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    assert "previous_response_id" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", store=True)


def test_json_schema_output(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "word": {"type": "string", "maxLength": 8}},
        "required": ["n", "word"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL,
        input="Give a number and a word as JSON.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "pair", "schema": schema, "strict": True}},
    )
    assert r.status == "completed", r
    v = json.loads(r.output_text)
    assert set(v) == {"n", "word"} and isinstance(v["n"], int) and isinstance(v["word"], str)


def test_tool_call_round_trip(client):
    kwargs = dict(
        model=MODEL,
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=0,
    )
    first = client.responses.create(**kwargs)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id
    args = json.loads(call.arguments)
    assert isinstance(args["city"], str)
    # Streamed, the call arrives as an item with its arguments.
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [args]
    assert [o.arguments for o in final.output if o.type == "function_call"] == [call.arguments]
    # Feed the result back.
    second = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 12})},
        ],
        tools=[WEATHER],
        tool_choice="auto",
        max_output_tokens=12,
        temperature=0,
    )
    assert second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens
