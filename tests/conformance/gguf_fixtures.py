#!/usr/bin/env python3
"""Generate tests/fixtures/gguf/converted/: tiny GGUF files written by llama.cpp's own
converter (convert_hf_to_gguf.py), for testing vOOM's GGUF importer against llama.cpp's
tensor names, hyperparameter keys, tensor layouts and row permutations.

For each case in CASES:

1. A random-weights Hugging Face checkpoint is built with transformers
   (`XxxConfig` + `AutoModelForCausalLM.from_config`, fixed seed), cast to BF16 and saved
   with `save_pretrained` (safetensors; MoE experts in transformers' default "original"
   per-expert form, as released checkpoints store them) to <case>/hf/, together with
   tests/fixtures/tiny_chat's tokenizer (tokenizer.json, tokenizer_config.json: a 768-token
   byte-level BPE with GPT-2's pre-tokenizer regex) and a generation_config.json.
   Every parameter is redrawn from a seeded generator (the conventions of make_fixtures.py:
   normal weights, RMSNorm weights uniform in [0.5, 1.5], normal biases), so that norms and
   biases are not the constant 1 and 0 of transformers' init and a mix-up shows.
2. llama.cpp's converter is run on <case>/hf/ twice, as a subprocess:
   `--outtype bf16` -> <case>/model.bf16.gguf and `--outtype q8_0` -> <case>/model.q8_0.gguf.
   llama.cpp does not know the tiny tokenizer's pre-tokenizer hash ("BPE pre-tokenizer was
   not recognized"), so the converter runs through a wrapper (`python3 -c`, nothing
   written) that imports convert_hf_to_gguf, replaces `TextModel.get_vocab_base_pre` with
   one returning "gpt-2" (the right name for this tokenizer) and calls its main().
   No llama.cpp file is edited or copied here.
3. Every GGUF file is opened with gguf-py's GGUFReader and its listing (architecture,
   every metadata key with its type and value -- arrays by length only -- and every
   tensor's name, ggml type and shape in ggml order, ne[0] first) is printed and written to
   <case>/listing.txt.
4. The tensors are checked against the checkpoint (see `verify`): every GGUF tensor is
   one checkpoint tensor (experts: the per-expert tensors stacked on a new leading axis;
   llama's attn_q/attn_k: q_proj/k_proj with the rows of each head permuted by
   `llama_permute`) and every checkpoint tensor is used. In model.bf16.gguf the BF16
   tensors hold the checkpoint's bits and the F32 ones (norms, biases, the MoE router) its
   BF16 values widened; in model.q8_0.gguf the Q8_0 tensors are byte for byte gguf-py's
   Q8_0 quantization of those values and the F32 ones are as in the BF16 file.

Usage (from the repository root):

    python3 tests/conformance/gguf_fixtures.py --llama-cpp /path/to/llama.cpp [--out DIR] [--case NAME ...]

The llama.cpp directory must hold convert_hf_to_gguf.py, its conversion/ package and
gguf-py/ (its gguf-py comes first on the converter's sys.path). Deterministic: the same
versions of llama.cpp, torch and transformers write byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO_ROOT / "tests" / "fixtures" / "tiny_chat"
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "gguf" / "converted"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OUTTYPES = ("bf16", "q8_0")
PRE_TOKENIZER = "gpt-2"

# tiny_chat's ids: <|endoftext|> = 0 (bos and pad), <|im_end|> = 2 (eos).
VOCAB = 768
BOS, EOS, PAD = 0, 2, 0

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=PAD,
)


@dataclass
class Case:
    name: str
    config_class: type
    seed: int
    config: dict
    # Standard deviations of the normal init (before the BF16 cast), as make_fixtures.py.
    embed_std: float = 0.2
    linear_std: float = 0.25
    lm_head_std: float = 1.0
    bias_std: float = 0.2
    norm_range: tuple[float, float] = (0.5, 1.5)


CASES = [
    Case(
        name="llama",
        config_class=LlamaConfig,
        seed=2101,
        config=dict(COMMON, head_dim=16, tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    ),
    Case(
        name="qwen2",
        config_class=Qwen2Config,
        seed=2102,
        # Qwen2 has q/k/v biases (no o_proj bias) by construction.
        config=dict(COMMON, tie_word_embeddings=True, use_sliding_window=False),
    ),
    Case(
        name="qwen3",
        config_class=Qwen3Config,
        seed=2103,
        # head_dim 32 != hidden_size / heads = 16: q_proj is 128 x 64, o_proj 64 x 128.
        config=dict(COMMON, head_dim=32, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False),
    ),
    Case(
        name="qwen3_moe",
        config_class=Qwen3MoeConfig,
        seed=2104,
        config=dict(
            COMMON,
            head_dim=16,
            tie_word_embeddings=False,
            attention_bias=False,
            use_sliding_window=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
]

# The wrapper the converter runs in (argv: llama.cpp dir, then the converter's arguments).
WRAPPER = f"""
import sys
from pathlib import Path
llama_cpp = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(llama_cpp / "gguf-py"))
sys.path.insert(1, str(llama_cpp))
sys.argv = [str(llama_cpp / "convert_hf_to_gguf.py")] + sys.argv[2:]
import convert_hf_to_gguf
from conversion.base import TextModel
# The tiny tokenizer's hash is not in llama.cpp's table; it is a byte-level BPE with
# GPT-2's pre-tokenizer regex.
TextModel.get_vocab_base_pre = lambda self, tokenizer: {PRE_TOKENIZER!r}
convert_hf_to_gguf.main()
"""


def build_model(case: Case) -> torch.nn.Module:
    config = case.config_class(**case.config)
    torch.manual_seed(case.seed)  # transformers' own init; fully overwritten below.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        # Sorted names: the draw order does not depend on module order. A tied lm_head
        # appears once, as the embedding.
        params = dict(model.named_parameters())
        for name in sorted(params):
            p = params[name]
            if name.endswith("norm.weight"):
                lo, hi = case.norm_range
                v = torch.rand(p.shape, generator=gen) * (hi - lo) + lo
            elif name.endswith(".bias"):
                v = torch.randn(p.shape, generator=gen) * case.bias_std
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=gen) * case.embed_std
            elif name == "lm_head.weight":
                v = torch.randn(p.shape, generator=gen) * case.lm_head_std
            else:
                v = torch.randn(p.shape, generator=gen) * case.linear_std
            p.copy_(v)
    return model.to(torch.bfloat16)


def check_tokenizer() -> None:
    tok = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    ids = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok["added_tokens"]}
    n = max(ids) + 1
    cfg = json.loads((TOKENIZER_DIR / "config.json").read_text())
    if n > VOCAB or cfg["vocab_size"] != VOCAB:
        raise SystemExit(f"tokenizer has {n} ids, tiny_chat vocab_size {cfg['vocab_size']}, fixtures use {VOCAB}")


def write_hf(case: Case, hf_dir: Path) -> None:
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    hf_dir.mkdir(parents=True)
    model = build_model(case)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model.save_pretrained(hf_dir)  # transformers 5: always safetensors
    if not (hf_dir / "model.safetensors").is_file():
        raise SystemExit(f"{hf_dir}: save_pretrained wrote no model.safetensors")
    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / f, hf_dir / f)


def convert(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str, model_name: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(llama_cpp / "gguf-py"), str(llama_cpp)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["PYTHONHASHSEED"] = "0"
    cmd = [
        sys.executable, "-c", WRAPPER, str(llama_cpp),
        str(hf_dir), "--outfile", str(out), "--outtype", outtype, "--model-name", model_name,
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not out.is_file():
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(f"convert_hf_to_gguf failed for {hf_dir} ({outtype}), rc {r.returncode}")


def field_summary(gguf, f) -> str:
    types = [t.name for t in f.types]
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        n = len(f.data)
        if f.name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores"):
            return f"ARRAY[{types[1] if len(types) > 1 else '?'}] len {n}"
        return f"ARRAY[{types[1] if len(types) > 1 else '?'}] len {n} = {f.contents()!r}"
    v = f.contents()
    if isinstance(v, str) and len(v) > 80:
        v = v[:60] + f"... ({len(v)} chars)"
    return f"{types[0]} = {v!r}"


def listing(path: Path) -> str:
    import gguf

    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    lines = [f"== {path.name}: general.architecture = {arch!r}", f"-- metadata ({len(r.fields)} keys)"]
    for name, f in r.fields.items():
        lines.append(f"  {name}: {field_summary(gguf, f)}")
    lines.append(f"-- tensors ({len(r.tensors)}; shape in ggml order, ne[0] first)")
    for t in r.tensors:
        shape = [int(x) for x in t.shape]
        lines.append(f"  {t.name}: {t.tensor_type.name} {shape}")
    return "\n".join(lines) + "\n"


# Checkpoint name -> GGUF name (llama.cpp's tensor map, as far as these cases use it).
HF_TO_GGUF = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"blk.\1.attn_q.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"blk.\1.attn_k.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"blk.\1.attn_v.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", r"blk.\1.attn_q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", r"blk.\1.attn_k_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"blk.\1.ffn_gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"blk.\1.ffn_up.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"blk.\1.ffn_down.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"blk.\1.ffn_gate_inp.weight"),
]
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: within each head, HF's rotate-half row
    order (first half, second half) becomes interleaved pairs (0, d/2, 1, d/2+1, ...)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_tensors(case: Case, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GGUF tensors the checkpoint should become, in PyTorch (row-major) shape."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in hf.items():
        if m := EXPERT.fullmatch(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = t
            continue
        for pat, rep in HF_TO_GGUF:
            if re.fullmatch(pat, name):
                g = re.sub(pat, rep, name)
                break
        else:
            raise SystemExit(f"{case.name}: checkpoint tensor {name} has no GGUF name here")
        if case.name == "llama" and g.endswith(("attn_q.weight", "attn_q.bias")):
            t = llama_permute(t, case.config["num_attention_heads"])
        elif case.name == "llama" and g.endswith(("attn_k.weight", "attn_k.bias")):
            t = llama_permute(t, case.config["num_key_value_heads"])
        out[g] = t
    for (layer, proj), by_id in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = torch.stack([by_id[i] for i in range(len(by_id))])
    return out


def verify(case: Case, case_dir: Path) -> None:
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    hf = load_file(case_dir / "hf" / "model.safetensors")
    want = expected_tensors(case, hf)
    for t in OUTTYPES:
        r = gguf.GGUFReader(case_dir / f"model.{t}.gguf")
        got = {x.name: x for x in r.tensors}
        if set(got) != set(want):
            raise SystemExit(f"{case.name} {t}: tensors {sorted(set(got) ^ set(want))} differ from the checkpoint's")
        for name, x in got.items():
            w = want[name]
            if [int(v) for v in x.shape] != list(reversed(w.shape)):
                raise SystemExit(f"{case.name} {t} {name}: shape {list(x.shape)}, checkpoint {list(w.shape)}")
            data = np.asarray(x.data)
            if x.tensor_type == gguf.GGMLQuantizationType.F32:
                ok = np.array_equal(data.reshape(-1), w.float().numpy().reshape(-1))
            elif x.tensor_type == gguf.GGMLQuantizationType.BF16:
                ok = t == "bf16" and np.array_equal(
                    data.view(np.uint16).reshape(-1), w.view(torch.int16).numpy().view(np.uint16).reshape(-1)
                )
            elif x.tensor_type == gguf.GGMLQuantizationType.Q8_0:
                q = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
                ok = t == "q8_0" and np.array_equal(data.reshape(-1), q.reshape(-1))
            else:
                ok = False
            if not ok:
                raise SystemExit(f"{case.name} {t} {name}: {x.tensor_type.name} data differ from the checkpoint's")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source directory")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--case", action="append", choices=[c.name for c in CASES], help="only these cases")
    args = ap.parse_args()
    llama_cpp = args.llama_cpp.resolve()
    if not (llama_cpp / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{llama_cpp}: no convert_hf_to_gguf.py")
    # The reader (and Q8_0 reference) of the converter's own gguf-py.
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    check_tokenizer()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for case in CASES:
        if args.case and case.name not in args.case:
            continue
        case_dir = args.out / case.name
        hf_dir = case_dir / "hf"
        write_hf(case, hf_dir)
        text = ""
        for t in OUTTYPES:
            out = case_dir / f"model.{t}.gguf"
            if out.exists():
                out.unlink()
            convert(llama_cpp, hf_dir, out, t, f"tiny-{case.name}")
            text += listing(out)
        (case_dir / "listing.txt").write_text(text)
        verify(case, case_dir)
        print(f"### {case.name}\n{text}-- verified against hf/model.safetensors\n")


if __name__ == "__main__":
    main()
