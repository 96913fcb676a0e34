#!/usr/bin/env python3
"""A tiny random gpt-oss with the harmony chat format, for the server's tests.

gpt-oss writes its answers in OpenAI's harmony format: messages
``<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>``, reasoning on the
``analysis`` channel, the answer on ``final`` (ended by ``<|return|>``), tool calls
on ``commentary`` addressed ``to=functions.NAME`` (ended by ``<|call|>``). The
checkpoints ship the chat template that renders a conversation that way
(``chat_template.jinja``), special tokens for every marker, and
``generation_config.json`` stopping on ``<|return|>``, ``<|endoftext|>`` and
``<|call|>`` (``[200002, 199999, 200012]`` in the release; ``<|end|>`` does not stop).

This writes ``tests/fixtures/tiny_harmony/``:

- ``chat_template.jinja``: the template OpenAI published with gpt-oss-20b and
  gpt-oss-120b (Apache-2.0), committed as is (see the fixture's README.md for where
  it came from); this script only reads it.
- ``tokenizer.json``: tiny_chat's byte-level BPE (766 tokens) with the harmony markers
  as added special tokens (ids 766..), ``<|endoftext|>`` kept at 0 and ``<|startoftext|>``
  at 1; ``tokenizer_config.json`` names them (eos ``<|return|>``, as released).
- ``config.json``/``model.safetensors``: a random ``gpt_oss`` (BF16 experts in
  transformers' layout, 2 layers, sliding and full), vocabulary 776 (the
  tokenizer's 775 and padding), as ``make_gpt_oss_fixtures.py`` builds its cases.
- ``generation_config.json``: eos ``[<|return|>, <|endoftext|>, <|call|>]``.
- ``reference.json``: conversations rendered by transformers' ``apply_chat_template``
  (jinja2, the date fixed by passing ``strftime_now``) and their token ids, which
  vOOM's minijinja renderer must reproduce byte for byte.

Its output is gibberish (random weights) but deterministic under greedy decoding;
the server's tests make it structured with grammars.

Run: ``/work/venv-torch/bin/python tests/conformance/make_harmony_fixture.py``
(torch and transformers as for make_fixtures.py; committed with transformers 5.17).
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures  # noqa: E402
from make_fixtures import REPO_ROOT, CaseSpec  # noqa: E402

make_fixtures.CONFIG_CLASSES["gpt_oss"] = transformers.GptOssConfig

OUT = REPO_ROOT / "tests" / "fixtures" / "tiny_harmony"
BASE = REPO_ROOT / "tests" / "fixtures" / "tiny_chat"
# The harmony markers, in the order of their ids in the release (199998, 200002,
# 200003, 200005, 200006, 200007, 200008, 200012): here 766 onwards.
MARKERS = ["<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
VOCAB = 776
DATE = "2025-06-28"


def tokenizer_json() -> dict:
    t = json.loads((BASE / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    # tiny_chat's ChatML tokens 1 and 2 become gpt-oss's start of text and a reserved id.
    renames = {"<|im_start|>": "<|startoftext|>", "<|im_end|>": "<|reserved_200000|>"}
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    added = []
    for a in t["added_tokens"]:
        if a["content"] in ("<tool_call>", "</tool_call>"):
            continue
        a = dict(a, content=renames.get(a["content"], a["content"]))
        added.append(a)
    first = max(vocab.values()) + 1
    for i, m in enumerate(MARKERS):
        added.append({"id": first + i, "content": m, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    t["added_tokens"] = added
    return t


def tokenizer_config(tok: dict) -> dict:
    return {
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for a in tok["added_tokens"]
        },
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|return|>",
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def model_spec(ids: dict) -> CaseSpec:
    return CaseSpec(
        name="tiny_harmony",
        arch="gpt_oss",
        seed=20250805,
        covers=["gpt_oss with the harmony chat template, markers and stop tokens"],
        config={
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            "attention_bias": True,
            "tie_word_embeddings": False,
            "bos_token_id": ids["<|startoftext|>"],
            "eos_token_id": ids["<|return|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now.", "parameters": {"type": "object", "properties": {}}},
}

CONVERSATIONS = [
    {"name": "user_only", "messages": [{"role": "user", "content": "Hello!"}]},
    {
        "name": "system_and_effort",
        "messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
        "kwargs": {"reasoning_effort": "high"},
    },
    {
        "name": "identity_and_builtin_tools",
        "messages": [{"role": "user", "content": "Search it"}],
        "kwargs": {"model_identity": "You are a tiny test model.", "builtin_tools": ["browser", "python"]},
    },
    {
        "name": "tools",
        "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, TIME],
    },
    {
        "name": "history_with_reasoning_and_tool_call",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "thinking": "The user wants the weather; call the tool.",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        ],
        "tools": [WEATHER],
    },
    {
        "name": "history_with_final_answers",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "thinking": "Greet back.", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    },
]


def references(tok) -> list[dict]:
    out = []
    for c in CONVERSATIONS:
        kwargs = dict(c.get("kwargs", {}))
        text = tok.apply_chat_template(
            copy.deepcopy(c["messages"]),
            tools=c.get("tools"),
            add_generation_prompt=True,
            tokenize=False,
            strftime_now=lambda fmt: DATE,
            **kwargs,
        )
        out.append(
            {
                "name": c["name"],
                "messages": c["messages"],
                "tools": c.get("tools"),
                "kwargs": kwargs,
                "text": text,
                "ids": tok(text, add_special_tokens=False)["input_ids"],
            }
        )
    return out


def main() -> None:
    template = (OUT / "chat_template.jinja").read_text()
    tok_json = tokenizer_json()
    ids = {a["content"]: a["id"] for a in tok_json["added_tokens"]}
    assert max(ids.values()) < VOCAB
    spec = model_spec(ids)
    for f in OUT.iterdir():
        if f.name not in ("chat_template.jinja", "README.md"):
            f.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "m"
        model_dir.mkdir()
        model = make_fixtures.build_model(spec)
        model.save_pretrained(model_dir, safe_serialization=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy(model_dir / f, OUT / f)
    gen = {
        "bos_token_id": ids["<|startoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "transformers_version": transformers.__version__,
    }
    (OUT / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (OUT / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False, indent=2) + "\n")
    (OUT / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok_json), indent=2) + "\n")
    tok = transformers.AutoTokenizer.from_pretrained(OUT)
    assert tok.chat_template == template, "the template loaded is not chat_template.jinja"
    for m in MARKERS:
        assert len(tok(m, add_special_tokens=False)["input_ids"]) == 1, m
    ref = {
        "generator": {"script": "tests/conformance/make_harmony_fixture.py", "transformers": transformers.__version__},
        "date": DATE,
        "markers": {m: ids[m] for m in MARKERS},
        "renders": references(tok),
    }
    (OUT / "reference.json").write_text(json.dumps(ref, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}: " + ", ".join(f"{f.name} {f.stat().st_size}" for f in sorted(OUT.iterdir())))


if __name__ == "__main__":
    main()
