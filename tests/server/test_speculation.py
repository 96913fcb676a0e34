"""Speculative decoding through `voom serve --prompt-lookup`, over the official SDKs:
the same requests answered by a server that drafts and one that does not get the
same text, token for token (greedy and sampled), and each response's `voom` object
says which drafter ran and what it kept."""

from __future__ import annotations

import anthropic
import openai
import pytest

# The tiny fixture's output is gibberish; a prompt that repeats itself gives prompt
# lookup something to propose, kept or not.
PASSAGE = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta"


@pytest.fixture(scope="module")
def lookup_url(start_server) -> str:
    return start_server(["--prompt-lookup", "--fixed-draft", "--max-draft", "4"])


def chat(base: str, model: str, **kw):
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    return c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Repeat: {PASSAGE}"}], **kw
    )


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 11}],
    ids=["greedy", "sampled"],
)
def test_openai_answers_are_the_plain_servers(base_url, lookup_url, model, sampling):
    plain = chat(base_url, model, max_tokens=40, **sampling)
    drafted = chat(lookup_url, model, max_tokens=40, **sampling)
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert drafted.choices[0].finish_reason == plain.choices[0].finish_reason
    assert drafted.usage.completion_tokens == plain.usage.completion_tokens
    spec = drafted.model_extra["voom"]["timings"]["speculation"]
    assert spec["drafter"] == "prompt-lookup"
    assert 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["passes"] == drafted.model_extra["voom"]["timings"]["decode_passes"]
    assert plain.model_extra["voom"]["timings"]["speculation"] is None
    # Without a drafter, a pass per id after the first.
    assert plain.model_extra["voom"]["timings"]["decode_passes"] == plain.usage.completion_tokens - 1


def test_anthropic_streamed_answers_are_the_plain_servers(base_url, lookup_url, model):
    def run(base: str) -> tuple[str, object]:
        c = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
        with c.messages.stream(
            model=model,
            max_tokens=48,
            # This SDK has dropped the parameter; the API still takes it.
            extra_body={"temperature": 0},
            messages=[{"role": "user", "content": f"Repeat: {PASSAGE}"}],
        ) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        return text, final

    plain_text, plain = run(base_url)
    text, final = run(lookup_url)
    assert text == plain_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.stop_reason == plain.stop_reason
