#!/usr/bin/env python3
"""Tiny checkpoints with a multi-token-prediction layer, and the drafts it gives.

DeepSeek-V3 and GLM-4.5 store a multi-token-prediction (MTP) layer after the decoder's
(``num_nextn_predict_layers``; DeepSeek-V3's is ``model.layers.61``): a decoder layer
plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.{norm,head}`` and a copy of the
embedding. transformers does not run it; vLLM drafts with it. This script takes two
conformance fixtures of ``make_fixtures.py`` (``tests/fixtures/tiny``), adds a random
MTP layer stored as the decoder's layers are (same names, dtypes and expert layout,
``num_nextn_predict_layers: 1``), and computes, in float32 over the BF16 weights, the
ids the layer drafts, as vLLM's ``deepseek_mtp.py`` computes them:

- position ``i`` reads ``embed(token[i + 1])`` (zeros at position 0), normed by
  ``enorm``, joined with the decoder's hidden state at ``i`` (after its final norm)
  normed by ``hnorm``; ``eh_proj`` projects the two to the hidden width; the decoder
  layer (transformers' own module for layer ``num_hidden_layers``) follows; its output
  normed by ``shared_head.norm`` and multiplied by ``shared_head.head`` gives the
  logits of ``token[i + 2]``;
- with ``n`` ids known (the decoder has computed ``n - 1`` positions), the first draft
  is the argmax at position ``n - 2``; each further draft is the layer applied at the
  next position to the draft just made and the layer's own output state before it.

For each of the base fixture's prompts: the decoder's greedy continuation
(transformers), and at every length ``n`` of prompt plus continuation the ``K`` ids
drafted, each with its logit margin and the smallest router gap of the runs that gave
it (a near-tie could flip under another float32 summation order: the test skips ids
from the first near-tie on). Written to ``tests/fixtures/tiny_mtp/<case>/``:
the checkpoint (``config.json``, ``generation_config.json``, ``model.safetensors``)
and ``reference_mtp.json``.

Run: ``python3 tests/conformance/make_mtp_fixtures.py [--out tests/fixtures/tiny_mtp]``
(CPU; torch and transformers as for make_fixtures.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch
import transformers
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import (  # noqa: E402
    CORRECTION_BIAS,
    MIN_MARGIN,
    MIN_ROUTER_GAP,
    REPO_ROOT,
    checkpoint_tensors,
    load_f32,
    read_json,
    sigmoid_router_gap,
    stored_value_in_model,
    write_json_like_transformers,
)

# (base fixture, seed of the MTP layer's weights)
CASES = (("deepseek_v3_mla_yarn", 2101), ("glm4_moe_partial_rotary_shared", 2102))
DRAFT_LEN = 4
NEW_TOKENS = 10
NORM_RANGE = (0.5, 1.5)
LINEAR_STD = 0.25
BIAS_STD = 0.2
CORRECTION_BIAS_STD = 0.05


def mtp_tensors(base: dict[str, torch.Tensor], n_layers: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """Layer `n_layers`: the last decoder layer's tensors (names, shapes, dtypes) with
    new random values, plus the MTP parts."""
    gen = torch.Generator().manual_seed(seed)
    src, dst = f"model.layers.{n_layers - 1}.", f"model.layers.{n_layers}."
    out: dict[str, torch.Tensor] = {}
    for name in sorted(n for n in base if n.startswith(src)):
        t = base[name]
        if name.endswith(CORRECTION_BIAS):
            v = torch.randn(t.shape, generator=gen) * CORRECTION_BIAS_STD
        elif name.endswith("norm.weight"):
            v = torch.rand(t.shape, generator=gen) * (NORM_RANGE[1] - NORM_RANGE[0]) + NORM_RANGE[0]
        elif name.endswith(".bias"):
            v = torch.randn(t.shape, generator=gen) * BIAS_STD
        else:
            v = torch.randn(t.shape, generator=gen) * LINEAR_STD
        out[dst + name[len(src) :]] = v.to(t.dtype).contiguous()
    for norm in ("enorm", "hnorm"):
        v = torch.rand(hidden, generator=gen) * (NORM_RANGE[1] - NORM_RANGE[0]) + NORM_RANGE[0]
        out[f"{dst}{norm}.weight"] = v.to(torch.bfloat16)
    out[f"{dst}eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) * LINEAR_STD).to(torch.bfloat16)
    # As released checkpoints store them: copies of the decoder's head and embedding.
    out[f"{dst}shared_head.norm.weight"] = base["model.norm.weight"].clone()
    out[f"{dst}shared_head.head.weight"] = base["lm_head.weight"].clone()
    out[f"{dst}embed_tokens.weight"] = base["model.embed_tokens.weight"].clone()
    return out


class Mtp:
    """The MTP layer in float32: transformers' decoder layer and RMSNorm modules."""

    def __init__(self, decoder: torch.nn.Module, full: torch.nn.Module, stored: dict, n_layers: int):
        p = f"model.layers.{n_layers}."
        cfg = decoder.config
        norm_cls = type(decoder.model.norm)

        def norm(name):
            m = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
            with torch.no_grad():
                m.weight.copy_(stored[p + name].float())
            return m.eval()

        self.enorm, self.hnorm, self.norm = norm("enorm.weight"), norm("hnorm.weight"), norm("shared_head.norm.weight")
        self.eh_proj = stored[p + "eh_proj.weight"].float()
        self.head = stored[p + "shared_head.head.weight"].float()
        self.embed = stored[p + "embed_tokens.weight"].float()
        self.layer = full.model.layers[n_layers].eval()
        self.rotary = decoder.model.rotary_emb
        self.routers = [m for m in self.layer.modules() if hasattr(m, CORRECTION_BIAS)]

    def run(self, next_tokens: list[int], before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Positions 0..T-1 reading `next_tokens` and the states `before` ([T, hidden]):
        their output states, logits, and the smallest router gap."""
        t = len(next_tokens)
        gap = [float("inf")]

        def watch(module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            gap[0] = min(gap[0], sigmoid_router_gap(module, logits))

        hooks = [r.register_forward_hook(watch) for r in self.routers]
        try:
            with torch.no_grad():
                e = self.embed[torch.tensor(next_tokens)]
                e[0] = 0.0  # position 0 (vLLM: "masking inputs at position 0")
                x = torch.cat([self.enorm(e), self.hnorm(before)], dim=-1) @ self.eh_proj.T
                pos = torch.arange(t)[None]
                cos_sin = self.rotary(x[None], pos)
                mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
                y = self.layer(
                    x[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin, use_cache=False
                )
                y = (y[0] if isinstance(y, tuple) else y)[0]
                logits = self.norm(y) @ self.head.T
        finally:
            for h in hooks:
                h.remove()
        return y, logits, gap[0]


def greedy_ids(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


def drafts_at(mtp: Mtp, seq: list[int], hidden: torch.Tensor, n: int) -> dict:
    """What the layer drafts with `seq[:n]` known (the decoder computed n - 1 positions)."""
    ids, margins, gaps = [], [], []
    toks = seq[1:n]
    before = hidden[: n - 1]
    y, logits, gap = mtp.run(toks, before)
    for _ in range(DRAFT_LEN):
        row = logits[-1]
        top = torch.topk(row, 2)
        d = int(top.indices[0])
        ids.append(d)
        margins.append(float(top.values[0] - top.values[1]))
        gaps.append(gap)
        toks = toks + [d]
        before = torch.cat([before, y[-1:]], dim=0)
        y_all, logits, g = mtp.run(toks, before)
        # The positions before are as the decoder's states gave them; only the last
        # reads the layer's own state.
        y = y_all
        gap = min(gap, g)
    return {"context_len": n, "ids": ids, "margins": margins, "router_gaps": gaps}


def run_case(base_name: str, seed: int, out: Path) -> dict:
    src = REPO_ROOT / "tests" / "fixtures" / "tiny" / base_name
    name = f"{base_name}_mtp"
    path = out / name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    cfg = read_json(src / "config.json")
    n_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    base = checkpoint_tensors(src)
    extra = mtp_tensors(base, n_layers, hidden, seed)
    stored = {**base, **extra}
    safetensors.torch.save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    cfg.pop("num_mtp_layers", None)
    write_json_like_transformers(path / "config.json", cfg)
    shutil.copy(src / "generation_config.json", path / "generation_config.json")

    checks: dict = {}
    # The decoder as transformers loads it (the MTP layer is not its): the same
    # logits as the base fixture's.
    decoder = load_f32(path)
    original = load_f32(src)
    ref = read_json(src / "reference.json")
    prompts = [p["prompt_ids"] for p in ref["prompts"]]
    with torch.no_grad():
        diff = max(
            float((decoder(torch.tensor([p])).logits - original(torch.tensor([p])).logits).abs().max())
            for p in prompts
        )
    if diff != 0.0:
        raise SystemExit(f"{name}: the decoder's logits moved by {diff} with the MTP layer stored")
    checks["decoder_unchanged_max_abs_logit_diff"] = diff
    del original
    # Layer n_layers through transformers' own loading (its expert layout converted
    # as for any layer): a model of one more layer over the same file.
    cfg2 = AutoConfig.from_pretrained(path)
    cfg2.num_hidden_layers = n_layers + 1
    full = load_f32(path, cfg2)
    state = full.state_dict()
    layer_prefix = f"model.layers.{n_layers}."
    loaded = 0
    for tname, t in extra.items():
        v = stored_value_in_model(state, tname)
        if v is None:
            continue
        if not torch.equal(v.float(), t.float()):
            raise SystemExit(f"{name}: {tname} loads as other values")
        loaded += 1
    layer_params = [n for n in state if n.startswith(layer_prefix)]
    checks["mtp_layer_tensors_loaded_exactly"] = {"stored": loaded, "module_tensors": len(layer_params)}
    mtp = Mtp(decoder, full, {k: v for k, v in stored.items()}, n_layers)

    sequences = []
    for p in prompts:
        new = greedy_ids(decoder, p, NEW_TOKENS)
        want = next(r["generated_ids"] for r in ref["prompts"] if r["prompt_ids"] == p)[:NEW_TOKENS]
        if new != want:
            raise SystemExit(f"{name}: greedy ids {new} are not the base reference's {want}")
        seq = p + new
        with torch.no_grad():
            h = decoder.model(torch.tensor([seq]), use_cache=False).last_hidden_state[0]
        drafts = [drafts_at(mtp, seq, h, n) for n in range(len(p) + 1, len(seq) + 1)]
        sequences.append({"prompt_ids": p, "generated_ids": new, "drafts": drafts})
    margins = [m for s in sequences for d in s["drafts"] for m in d["margins"]]
    gaps = [g for s in sequences for d in s["drafts"] for g in d["router_gaps"]]
    return {
        "schema_version": 1,
        "case": name,
        "base_case": base_name,
        "mtp_layer": n_layers,
        "seed": seed,
        "draft_len": DRAFT_LEN,
        "min_margin_threshold": MIN_MARGIN,
        "min_router_gap_threshold": MIN_ROUTER_GAP,
        "near_ties": {
            "margins_below": sum(m < MIN_MARGIN for m in margins),
            "router_gaps_below": sum(g < MIN_ROUTER_GAP for g in gaps),
            "drafted": len(margins),
        },
        "checks": checks,
        "generator": {
            "script": "tests/conformance/make_mtp_fixtures.py",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "sequences": sequences,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "tiny_mtp")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    for base_name, seed in CASES:
        r = run_case(base_name, seed, args.out)
        with open(args.out / r["case"] / "reference_mtp.json", "w") as f:
            json.dump(r, f, indent=1)
            f.write("\n")
        print(r["case"], json.dumps(r["near_ties"]), json.dumps(r["checks"]))


if __name__ == "__main__":
    main()
