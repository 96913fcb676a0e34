"""`voom serve` through the official `openai` SDK: models, chat completions and
completions (streaming and not), usage, stop sequences, token limits, seeds, and
errors as the SDK's typed exceptions.

The fixture model is random, so texts are gibberish; what is checked is that they are
deterministic under greedy decoding and consistent across the API's ways of asking.
"""

from __future__ import annotations

import openai
import pytest

# Prompts whose greedy continuations on the fixture run past the token limits used
# here without an end-of-sequence token (each test asserts what it relies on).
CHAT_PROMPT = "Tell me a story about a cat"
TEXT_PROMPT = "The"


def chat(client, model, content=CHAT_PROMPT, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 32)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kw
    )


def test_models_list_contains_the_fixture(client, model):
    ids = [m.id for m in client.models.list()]
    assert model in ids
    m = client.models.retrieve(model)
    assert m.id == model and m.object == "model"


def test_chat_completion_is_deterministic_with_usage(client, model):
    r = chat(client, model)
    assert r.object == "chat.completion"
    assert r.model == model
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # The same request again: the same text and counts (greedy).
    r2 = chat(client, model)
    assert r2.choices[0].message.content == c.message.content
    assert r2.choices[0].finish_reason == c.finish_reason
    assert (r2.usage.prompt_tokens, r2.usage.completion_tokens) == (
        u.prompt_tokens,
        u.completion_tokens,
    )
    assert r2.id != r.id


def test_system_and_multi_turn_messages_change_the_prompt(client, model):
    base = chat(client, model, max_tokens=4)
    r = client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=4,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": CHAT_PROMPT}]},
        ],
    )
    assert r.usage.prompt_tokens > base.usage.prompt_tokens


def test_streaming_matches_non_streaming(client, model):
    full = chat(client, model)
    chunks = list(chat(client, model, stream=True))
    assert chunks, "no chunks"
    first = chunks[0]
    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert len({c.id for c in chunks}) == 1
    # Without include_usage no chunk carries usage.
    assert all(c.usage is None for c in chunks)


def test_streaming_include_usage_ends_with_a_usage_chunk(client, model):
    full = chat(client, model)
    chunks = list(chat(client, model, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.total_tokens == full.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_endpoint(client, model):
    r = client.completions.create(model=model, prompt=TEXT_PROMPT, max_tokens=20, temperature=0)
    assert r.object == "text_completion"
    c = r.choices[0]
    assert isinstance(c.text, str) and c.text
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    again = client.completions.create(model=model, prompt=TEXT_PROMPT, max_tokens=20, temperature=0)
    assert again.choices[0].text == c.text
    streamed = client.completions.create(
        model=model, prompt=TEXT_PROMPT, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text


def test_stop_sequence_cuts_the_output(client, model):
    full = chat(client, model, max_tokens=48).choices[0].message.content
    # A stop string from the middle of the greedy output: the output must end just
    # before its first occurrence.
    stop = None
    for k in range(len(full) // 3, len(full) - 3):
        cand = full[k : k + 3]
        # Printable ASCII: never part of a character still being decoded.
        if cand.strip() and cand.isascii() and cand.isprintable() and full.index(cand) > 0:
            stop = cand
            break
    assert stop is not None, f"no usable stop string in {full!r}"
    expected = full[: full.index(stop)]
    r = chat(client, model, max_tokens=48, stop=stop)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 48
    # As a list, with one that never appears; and streamed.
    r = chat(client, model, max_tokens=48, stop=["\u2603\u2603never", stop])
    assert r.choices[0].message.content == expected
    streamed = chat(client, model, max_tokens=48, stop=[stop], stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["stop"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_token_limit_gives_finish_reason_length(client, model, field):
    n = 7
    kw = {field: n}
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": CHAT_PROMPT}],
        temperature=0,
        **kw,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == n
    r = client.completions.create(model=model, prompt=TEXT_PROMPT, temperature=0, max_tokens=n)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == n


def test_equal_seeds_give_equal_samples(client, model):
    def sample(seed):
        r = chat(client, model, temperature=1.0, seed=seed, max_tokens=24)
        return r.choices[0].message.content

    a = sample(1234)
    assert sample(1234) == a
    # Different seeds sample differently (over three seeds, 24 tokens each, from a
    # random model: equal texts would mean the seed is ignored).
    assert len({a, sample(1), sample(2)}) > 1
    # Streaming samples the same way.
    streamed = chat(client, model, temperature=1.0, seed=1234, max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == a


def test_provenance_headers_and_fingerprint(client, model):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert raw.headers["x-voom-checkpoint"].startswith(model + "@")
    assert raw.headers["x-voom-profile"]
    # Every response names the backend that computed it.
    assert raw.headers["x-voom-backend"].startswith("cpu-")
    r = raw.parse()
    assert r.system_fingerprint and r.system_fingerprint.startswith("voom-")
    assert r.model_extra["voom"]["backend"] == raw.headers["x-voom-backend"]
    assert r.model_extra["voom"]["exactness_note"] is None


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_bad_requests_raise_bad_request_naming_the_field(client, model, kw, field):
    args = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    args.update(kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    assert field in e.value.message
    body = e.value.body
    assert isinstance(body, dict) and field in (body.get("param") or "")


def test_wrong_types_raise_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages="Hi",  # type: ignore[arg-type]
            max_tokens=4,
        )
    assert "messages" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hi", max_tokens=4, temperature="hot")  # type: ignore[arg-type]
    assert "temperature" in e.value.message


def test_unknown_model_raises_not_found(client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert "no-such-model" in e.value.message and model in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=4)
