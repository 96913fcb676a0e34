#!/usr/bin/env python3
"""Qwen3.5 checkpoints in the form they are released in: the vision-language model
(`model_type` `qwen3_5` / `qwen3_5_moe`, the language model's config under
`text_config`, its weights under `model.language_model.`, a vision tower under
`model.visual.`), made from the text fixtures of `make_hybrid_fixtures.py`.

For each of `qwen3_5_text_dense` and `qwen3_5_moe_text` (tests/fixtures/tiny_hybrid):
a `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` whose
language model holds the text fixture's weights exactly and whose (tiny) vision tower
is random, saved by transformers (`save_pretrained`), then reloaded in float32; its
greedy continuations of the text fixture's prompts (text only) must be the text
fixture's reference ids, which the copy of `reference.json` then stands for. An
engine reading the language model out of the released form must give them.

Run: ``python3 tests/conformance/make_vlm_form_fixtures.py [--out tests/fixtures/tiny_hybrid]``
(CPU; torch and transformers as for make_fixtures.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import REPO_ROOT, checkpoint_tensors, read_json, write_json_like_transformers  # noqa: E402

CASES = (
    ("qwen3_5_text_dense", "qwen3_5_vlm_form", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    ("qwen3_5_moe_text", "qwen3_5_moe_vlm_form", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
)
VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 16,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "tiny_hybrid")
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    for text_case, name, config_cls, model_cls in CASES:
        src = args.out / text_case
        text_cfg = read_json(src / "config.json")
        vision = dict(VISION, out_hidden_size=text_cfg["hidden_size"])
        cfg = getattr(transformers, config_cls)(
            text_config={k: v for k, v in text_cfg.items() if k not in ("architectures", "transformers_version", "dtype")},
            vision_config=vision,
            tie_word_embeddings=text_cfg.get("tie_word_embeddings", False),
        )
        torch.manual_seed(4000)
        model = getattr(transformers, model_cls)(cfg).to(torch.float32).eval()
        text = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        state = text.state_dict()
        own = model.state_dict()
        copied = 0
        with torch.no_grad():
            for k, v in state.items():
                target = "lm_head.weight" if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)
                if target not in own:
                    raise SystemExit(f"{name}: {target} not in the vision-language model")
                own[target].copy_(v)
                copied += 1
        model = model.to(torch.bfloat16)
        path = args.out / name
        if path.exists():
            shutil.rmtree(path)
        model.save_pretrained(path, safe_serialization=True)
        # The text fixture's eos (the released files' generation config gives it).
        shutil.copy(src / "generation_config.json", path / "generation_config.json")
        reloaded = getattr(transformers, model_cls).from_pretrained(path, dtype=torch.float32).eval()
        ref = read_json(src / "reference.json")
        for p in ref["prompts"]:
            ids = torch.tensor([p["prompt_ids"]])
            out = reloaded.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=ref["generation"]["max_new_tokens"],
                pad_token_id=ref["eos_token_ids"][0] if "eos_token_ids" in ref else 2,
            )
            got = out[0, ids.shape[1]:].tolist()
            if got != p["generated_ids"]:
                raise SystemExit(f"{name}: prompt of {len(p['prompt_ids'])}: {got} != {p['generated_ids']}")
        ref["case"] = name
        ref["vlm_form"] = {
            "from": text_case,
            "model_class": model_cls,
            "language_model_tensors_copied": copied,
            "text_only_greedy_ids_equal_the_text_fixture": True,
            "vision_config": vision,
        }
        write_json_like_transformers(path / "reference.json", ref)
        stored = sorted(checkpoint_tensors(path))
        print(name, "ok:", copied, "tensors copied;", len(stored), "stored, e.g.", [s for s in stored if "visual" in s][:2], [s for s in stored if "layers.0." in s][:3])


if __name__ == "__main__":
    sys.exit(main())
