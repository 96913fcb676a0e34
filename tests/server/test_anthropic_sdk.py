"""The Anthropic Messages endpoint of `voom serve` through the official `anthropic` SDK.

The server comes from conftest.py (VOOM_TEST_BASE_URL, without /v1, and
VOOM_TEST_MODEL, e.g. the tiny_chat fixture). The fixture's
weights are random, so texts are gibberish but deterministic at temperature 0.
"""

import json
import os

import anthropic
import pytest

# Set by conftest.py (which starts the server) before this module is imported: a
# missing value is an error, never a skip.
BASE_URL = os.environ["VOOM_TEST_BASE_URL"]
MODEL = os.environ["VOOM_TEST_MODEL"]

WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client():
    # The SDK appends /v1/messages to the base URL.
    return anthropic.Anthropic(base_url=BASE_URL.rstrip("/"), api_key="unused", max_retries=0)


def test_non_streaming(client):
    m = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system="You are terse.",
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"temperature": 0},
    )
    assert m.type == "message" and m.role == "assistant"
    assert m.id.startswith("msg_")
    assert m.model == MODEL
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0
    assert 0 < m.usage.output_tokens <= 12
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text, m
    # Greedy is deterministic.
    again = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system="You are terse.",
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"temperature": 0},
    )
    assert "".join(b.text for b in again.content if b.type == "text") == text


def test_streaming_matches_non_streaming(client):
    kwargs = dict(
        model=MODEL,
        max_tokens=10,
        messages=[{"role": "user", "content": "Count to three."}],
        extra_body={"temperature": 0},
    )
    whole = client.messages.create(**kwargs)
    types = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
        final = stream.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert types[0] == "message_start"
    assert "content_block_start" in types and "message_delta" in types
    assert types[-1] == "message_stop"


def test_stop_sequence(client):
    whole = client.messages.create(
        model=MODEL,
        max_tokens=16,
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"temperature": 0},
    )
    text = "".join(b.text for b in whole.content if b.type == "text")
    assert len(text) > 3
    stop = text[2:4]
    cut = client.messages.create(
        model=MODEL,
        max_tokens=16,
        stop_sequences=[stop],
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"temperature": 0},
    )
    assert cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content if b.type == "text") == text[: text.index(stop)]


def test_errors_are_typed(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert "messages" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL,
            max_tokens=5,
            messages=[{"role": "user", "content": "x"}],
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    assert "thinking" in str(e.value)


def test_tool_call_round_trip(client):
    first = client.messages.create(
        model=MODEL,
        max_tokens=200,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        extra_body={"temperature": 0},
    )
    assert first.stop_reason == "tool_use", first
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1
    use = uses[0]
    assert use.id.startswith("toolu_")
    assert use.name == "get_weather"
    assert isinstance(use.input, dict) and isinstance(use.input["city"], str)
    # The same call, streamed: a tool_use block whose input_json_delta parses.
    with client.messages.stream(
        model=MODEL,
        max_tokens=200,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    s_uses = [b for b in final.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in s_uses] == [(use.name, use.input)]
    assert final.stop_reason == "tool_use"
    # Feed the result back.
    second = client.messages.create(
        model=MODEL,
        max_tokens=12,
        tools=[WEATHER],
        tool_choice={"type": "auto"},
        messages=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"celsius": 12})}
                ],
            },
        ],
        extra_body={"temperature": 0},
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in second.content)
    assert second.usage.input_tokens > first.usage.input_tokens
