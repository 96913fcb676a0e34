#!/usr/bin/env python3
"""A GGUF of one of `voom bench`'s synthetic checkpoints, for llama.cpp's
`llama-bench` in the same runs (`voom bench --llama-bench BIN --llama-gguf OUT`).

    python3 scripts/gguf-of-synthetic.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf

LLAMA_CPP_DIR is a llama.cpp source tree (its convert_hf_to_gguf.py, conversion/
and gguf-py/; nothing of it is in this repository). The conversion is llama.cpp's
own (for gpt-oss: MXFP4 experts repacked into ggml's MXFP4 blocks, the gate/up
split), run on the synthetic model's safetensors. The synthetic models have no
tokenizer, so the GGUF gets a vocabulary of placeholder tokens of the config's
size (llama-bench feeds random token ids; speed does not depend on the text).
Needs torch, numpy and safetensors (e.g. a venv with `pip install torch numpy
safetensors sentencepiece`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    llama, model, out = (Path(a) for a in sys.argv[1:])
    sys.path.insert(0, str(llama / "gguf-py"))
    sys.path.insert(0, str(llama))
    import convert_hf_to_gguf as convert  # noqa: E402  (llama.cpp's, from its tree)
    import gguf  # noqa: E402

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]

    def placeholder_vocab(self) -> None:
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("default")
        self.gguf_writer.add_token_list([f"<t{i}>" for i in range(vocab)])
        self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
        # llama.cpp wants a merges key, which an empty list does not write.
        self.gguf_writer.add_token_merges(["<t3> <t4>"])
        self.gguf_writer.add_bos_token_id(1)
        self.gguf_writer.add_eos_token_id(2)

    # Every way a model class sets its vocabulary takes the placeholder (the
    # classes, imported by the converter when it picks one, inherit these).
    from conversion.base import ModelBase, TextModel  # noqa: E402  (llama.cpp's)

    for base in (ModelBase, TextModel):
        for name in [n for n in dir(base) if n.startswith("_set_vocab_")] + ["set_vocab"]:
            setattr(base, name, placeholder_vocab)
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outfile", str(out), "--outtype", "bf16"]
    convert.main()


if __name__ == "__main__":
    main()
