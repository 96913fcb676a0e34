"""gpt-oss's harmony format through the official `openai` and `anthropic` SDKs.

A second `voom serve` runs on tests/fixtures/tiny_harmony: a random-weights gpt-oss
with the published harmony chat template, its markers as special tokens and the
release's stop tokens (`<|return|>`, `<|endoftext|>`, `<|call|>`). Random weights
write no harmony of their own (and the fixture samples by default, as the release's
generation_config asks: requests whose output matters set temperature 0), so a grammar makes the output structured: forced tool
calls and JSON output (the server's own grammars), and a grammar given with the
request (vLLM's `structured_outputs`, through `extra_body`) that writes reasoning
then an answer. What each API returns must be what the forced text says.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

MODEL = "tiny-harmony"
THINK = "Let me think."
ANSWER = "Hello there."
# Reasoning on the analysis channel, then the answer on final (the engine stops on an
# end-of-sequence id once the grammar is complete).
REASON_THEN_ANSWER = (
    f'start: <|channel|> "analysis" <|message|> "{THINK}" <|end|> '
    f'<|start|> "assistant" <|channel|> "final" <|message|> "{ANSWER}"'
)
GRAMMAR = {"structured_outputs": {"grammar": REASON_THEN_ANSWER}}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(harmony_base_url):
    return openai.OpenAI(base_url=harmony_base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(harmony_base_url):
    return anthropic.Anthropic(base_url=harmony_base_url, api_key="unused", max_retries=0, timeout=120)


# --- OpenAI chat completions -----------------------------------------------------


def test_reasoning_and_content_are_apart(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=200, extra_body=GRAMMAR)
    m = r.choices[0].message
    assert m.reasoning_content == THINK
    assert m.content == ANSWER
    assert r.choices[0].finish_reason == "stop"


def test_reasoning_streams_apart(oai):
    reasoning, content, finish = "", "", None
    for chunk in oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, stream=True, extra_body=GRAMMAR
    ):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (THINK, ANSWER, "stop")


# Reasoning tokens (docs/server.md): the generated tokens of the analysis messages,
# from a message's start (the output's start, its `<|start|>`) to its `<|end|>`
# included; the answer's tokens are not among them. Greedy: the same tokens each time.
GREEDY_GRAMMAR = {"temperature": 0, "extra_body": GRAMMAR}


def chat_usage(oai, **kw):
    r = oai.chat.completions.create(model=MODEL, messages=USER, **kw)
    return r, r.usage


def streamed_chat_usage(oai, **kw):
    usage, reasoning, content = None, "", ""
    for chunk in oai.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}, **kw
    ):
        if chunk.usage is not None:
            assert usage is None and not chunk.choices
            usage = chunk.usage
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert usage is not None
    return reasoning, content, usage


def test_reasoning_tokens_in_chat_usage(oai):
    r, u = chat_usage(oai, max_tokens=200, **GREEDY_GRAMMAR)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (THINK, ANSWER)
    n = u.completion_tokens_details.reasoning_tokens
    # The header, "Let me think." and <|end|> at least; the answer's tokens are apart.
    assert 3 <= n < u.completion_tokens
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # Streamed, the last chunk's usage says the same.
    reasoning, content, su = streamed_chat_usage(oai, max_tokens=200, **GREEDY_GRAMMAR)
    assert (reasoning, content) == (THINK, ANSWER)
    assert su.completion_tokens_details.reasoning_tokens == n
    assert (su.prompt_tokens, su.completion_tokens) == (u.prompt_tokens, u.completion_tokens)
    # Cut before the reasoning's <|end|>: every token is reasoning. Just after it
    # (and the next message's <|start|>), the reasoning is all of it but one.
    r, u = chat_usage(oai, max_tokens=n - 1, **GREEDY_GRAMMAR)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.reasoning_content == THINK and not r.choices[0].message.content
    assert u.completion_tokens_details.reasoning_tokens == u.completion_tokens == n - 1
    r, u = chat_usage(oai, max_tokens=n + 1, **GREEDY_GRAMMAR)
    assert (u.completion_tokens, u.completion_tokens_details.reasoning_tokens) == (n + 1, n)
    reasoning, content, su = streamed_chat_usage(oai, max_tokens=n - 1, **GREEDY_GRAMMAR)
    assert (reasoning, content) == (THINK, "")
    assert su.completion_tokens_details.reasoning_tokens == su.completion_tokens == n - 1


def test_reasoning_tokens_are_zero_without_reasoning(oai, client, model):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    _, u = chat_usage(
        oai,
        max_tokens=50,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert u.completion_tokens > 0 and u.completion_tokens_details.reasoning_tokens == 0
    # A forced call: no analysis either.
    _, u = chat_usage(oai, max_tokens=200, temperature=0, tools=[WEATHER], tool_choice="required")
    assert u.completion_tokens > 0 and u.completion_tokens_details.reasoning_tokens == 0
    _, _, su = streamed_chat_usage(oai, max_tokens=200, temperature=0, tools=[WEATHER], tool_choice="required")
    assert su.completion_tokens_details.reasoning_tokens == 0
    # A model without a reasoning format: present, 0.
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.usage.completion_tokens_details.reasoning_tokens == 0
    r = client.responses.create(model=model, input="Hi", max_output_tokens=5, temperature=0)
    assert r.usage.output_tokens == 5 and r.usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_effort_goes_to_the_template(oai):
    out = {}
    for effort in ("low", "high", None):
        r = oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=8, temperature=0, reasoning_effort=effort
        )
        out[effort] = r.choices[0].message.content
    # "Reasoning: low" and "Reasoning: high" are different prompts (the greedy output
    # of the random model tells them apart); the template's default is medium.
    assert out["low"] != out["high"]
    assert out[None] not in (out["low"], out["high"])
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, reasoning_effort="minimal")
    assert e.value.body["param"] == "reasoning_effort"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_is_a_harmony_call(oai, choice):
    r = oai.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200, temperature=0
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER_PARAMS)
    else:
        assert choice == "required" and call.function.name == "get_time"
        jsonschema.validate(args, TIME["function"]["parameters"])


def test_forced_call_streams(oai):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oai.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0, stream=True
    ):
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMS)


def test_json_schema_output_is_the_final_answer(oai):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    r = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    m = r.choices[0].message
    jsonschema.validate(json.loads(m.content), schema)
    assert getattr(m, "reasoning_content", None) is None
    assert r.choices[0].finish_reason == "stop"


def test_history_with_reasoning_and_a_tool_result_renders(oai):
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "The user wants the weather: call the tool.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    plain = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, tools=[WEATHER])
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, tools=[WEATHER], extra_body=GRAMMAR)
    # The reasoning, the call and its result are in the prompt (the template keeps
    # the reasoning of a turn that ended in a call), and the model answers.
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert r.choices[0].message.reasoning_content == THINK
    assert r.choices[0].message.content == ANSWER


def test_bad_requests_name_their_field(oai, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=5, extra_body={"structured_outputs": {"grammar": "start: nope("}}
        )
    assert e.value.body["param"] == "structured_outputs.grammar"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=5, extra_body={"structured_outputs": {"json": {}}}
        )
    assert e.value.body["param"] == "structured_outputs.json"
    # A model without a reasoning format refuses reasoning settings.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=USER, max_tokens=5, reasoning_effort="low")
    assert e.value.body["param"] == "reasoning_effort"


def test_a_grammar_works_on_any_model(client, model):
    r = client.chat.completions.create(
        model=model, messages=USER, max_tokens=50, extra_body={"guided_grammar": 'start: "yes" | "no"'}
    )
    assert r.choices[0].message.content in ("yes", "no")


# --- Anthropic messages -----------------------------------------------------------

THINKING = {"type": "enabled", "budget_tokens": 1024}


def test_anthropic_thinking_blocks(ant):
    r = ant.messages.create(
        model=MODEL, max_tokens=2000, messages=USER, thinking=THINKING, extra_body=GRAMMAR
    )
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == THINK
    assert isinstance(r.content[0].signature, str) and r.content[0].signature
    assert r.content[1].text == ANSWER
    assert r.stop_reason == "end_turn"
    # Without thinking enabled the answer holds no thinking block.
    r = ant.messages.create(model=MODEL, max_tokens=2000, messages=USER, extra_body=GRAMMAR)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == ANSWER


def test_anthropic_thinking_streams(ant):
    with ant.messages.stream(
        model=MODEL, max_tokens=2000, messages=USER, thinking=THINKING, extra_body=GRAMMAR
    ) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "thinking_delta" in kinds and "signature_delta" in kinds and "text_delta" in kinds
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == THINK
    assert final.content[0].signature
    assert final.content[1].text == ANSWER


def test_anthropic_forced_tool_use_and_history(ant):
    tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_PARAMS}
    r = ant.messages.create(
        model=MODEL, max_tokens=200, messages=USER, tools=[tool], tool_choice={"type": "any"}
    )
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER_PARAMS)
    # The turn goes back with earlier thinking, and the tool's result.
    history = USER + [
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "Call the tool.", "signature": "x"}]
            + [b.model_dump(exclude_none=True) for b in r.content],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]},
    ]
    r2 = ant.messages.create(
        model=MODEL, max_tokens=2000, messages=history, tools=[tool], thinking=THINKING, extra_body=GRAMMAR
    )
    assert [b.type for b in r2.content] == ["thinking", "text"]
    assert r2.content[1].text == ANSWER


def test_anthropic_thinking_needs_a_reasoning_model(base_url, model):
    c = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=model, max_tokens=2000, messages=USER, thinking=THINKING)
    assert "thinking" in str(e.value)


# --- OpenAI responses -------------------------------------------------------------


def test_responses_reasoning_item(oai):
    r = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=200, reasoning={"effort": "low"}, extra_body=GRAMMAR)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THINK
    assert r.output_text == ANSWER


def test_responses_reasoning_streams(oai):
    deltas = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
    final = None
    for e in oai.responses.create(model=MODEL, input="Hi", max_output_tokens=200, stream=True, extra_body=GRAMMAR):
        if e.type in deltas:
            deltas[e.type] += e.delta
        if e.type == "response.completed":
            final = e.response
    assert deltas == {"response.reasoning_text.delta": THINK, "response.output_text.delta": ANSWER}
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THINK
    assert final.output_text == ANSWER


def test_responses_reasoning_tokens(oai):
    kw = {"model": MODEL, "input": "Hi", "max_output_tokens": 200, "temperature": 0, "extra_body": GRAMMAR}
    r = oai.responses.create(**kw)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    n = r.usage.output_tokens_details.reasoning_tokens
    assert 3 <= n < r.usage.output_tokens
    final = None
    for e in oai.responses.create(stream=True, **kw):
        if e.type == "response.completed":
            final = e.response
    assert final.usage.output_tokens_details.reasoning_tokens == n
    assert final.usage.output_tokens == r.usage.output_tokens
    # The same request through chat completions (another prompt, the same grammar)
    # counts its reasoning the same way.
    _, u = chat_usage(oai, max_tokens=200, **GREEDY_GRAMMAR)
    assert u.completion_tokens_details.reasoning_tokens > 0
