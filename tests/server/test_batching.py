"""Continuous batching in `voom serve`, over the official SDKs: requests sent at
once (different prompts, lengths, sampling settings, a JSON-schema constraint, a
streamed one) get the answers they get one at a time, token for token; a client
that disconnects mid-batch does not disturb the others."""

from __future__ import annotations

import json
import threading
import urllib.request

import openai

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


def requests_mix(model: str) -> list[dict]:
    return [
        dict(model=model, messages=[{"role": "user", "content": "Hello there"}],
             max_tokens=48, temperature=0),
        dict(model=model, messages=[{"role": "user", "content": "Tell me a long story " * 6}],
             max_tokens=64, temperature=0.9, top_p=0.9, seed=3),
        dict(model=model, messages=[{"role": "user", "content": "Give JSON"}],
             max_tokens=60, temperature=0,
             response_format={"type": "json_schema",
                              "json_schema": {"name": "t", "schema": SCHEMA}}),
        dict(model=model, messages=[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Why is the sky blue?"}],
             max_tokens=30, temperature=0.7, seed=11),
        dict(model=model, messages=[{"role": "user", "content": "Count with me"}],
             max_tokens=56, temperature=0, stream=True),
    ]


def answer(client: openai.OpenAI, req: dict) -> tuple[str, str | None, int | None]:
    if req.get("stream"):
        text, finish = "", None
        for chunk in client.chat.completions.create(**req):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish, None
    r = client.chat.completions.create(**req)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens


def metric(base_url: str, name: str) -> float:
    body = urllib.request.urlopen(base_url + "/metrics").read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_concurrent_requests_get_their_solo_answers(client, base_url, model):
    reqs = requests_mix(model)
    alone = [answer(client, r) for r in reqs]
    for _ in range(2):
        got: list = [None] * len(reqs)
        errors: list = []

        def run(i: int) -> None:
            try:
                got[i] = answer(client, reqs[i])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i, (a, g) in enumerate(zip(alone, got)):
            assert g == a, f"request {i} answered otherwise beside the others"
    assert metric(base_url, "voom_batch_peak") >= 2


def test_a_client_that_leaves_mid_batch_does_not_disturb_the_others(client, base_url, model):
    reqs = requests_mix(model)[:3]
    alone = [answer(client, r) for r in reqs]
    cancelled_before = metric(base_url, "voom_requests_cancelled_total")
    # Token 12 alone leads the fixture to no end-of-sequence for 2000 tokens; 1500 of
    # them leave room in the 2048-position context for the others to join it.
    leaver = dict(model=model, prompt=[12], max_tokens=1500, temperature=0, stream=True)
    left = threading.Event()

    def leave() -> None:
        # Reads a few lines of a long stream, then closes the connection.
        req = urllib.request.Request(
            base_url + "/v1/completions",
            data=json.dumps(leaver).encode(),
            headers={"content-type": "application/json"},
        )
        r = urllib.request.urlopen(req, timeout=60)
        for _ in range(8):
            r.readline()
        r.close()
        left.set()

    got: list = [None] * len(reqs)

    def run(i: int) -> None:
        got[i] = answer(client, reqs[i])

    threads = [threading.Thread(target=leave)] + [
        threading.Thread(target=run, args=(i,)) for i in range(len(reqs))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert left.is_set()
    assert got == alone
    # It was cancelled (its client gone), not run to its end.
    assert metric(base_url, "voom_requests_cancelled_total") == cancelled_before + 1
