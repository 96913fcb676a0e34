#!/usr/bin/env python3
"""Tiny random gpt-oss checkpoints (MXFP4 and BF16 experts) with transformers references.

gpt-oss (``model_type: gpt_oss``) is a mixture of experts in every layer with
attention sinks (one learned logit per head in each softmax), layers alternating a
sliding window and full attention, YaRN rotary, q/k/v/o biases, a router with a bias
(top-k of its logits, then a softmax over those), and experts whose ``gate_up_proj``
interleaves gate (even) and up (odd) outputs, with biases and the clamped SwiGLU
``(up + 1) * gate * sigmoid(1.702 * gate)`` (gate clamped above at 7, up within +-7).

The released checkpoints (gpt-oss-20b, gpt-oss-120b) store every expert projection as
MXFP4 (``quantization_config: {"quant_method": "mxfp4", "modules_to_not_convert":
[attention, router, embeddings, head]}``): ``{proj}_blocks`` U8 ``[E, rows, cols / 32,
16]`` (two e2m1 values a byte, the even element in the low nibble; rows are the
projection's outputs) and ``{proj}_scales`` U8 ``[E, rows, cols / 32]`` (e8m0: the
32 values of a group times 2^(scale - 127)); the rest is BF16. The BF16 uploads store
transformers' layout instead: ``gate_up_proj`` ``[E, hidden, 2I]`` and ``down_proj``
``[E, I, hidden]``, inputs first.

Each case is built as ``make_fixtures.py`` builds its BF16 cases (same random init
and ``save_pretrained`` files). The MXFP4 case then quantizes every expert
projection as the OCP MX format does: per group of 32, ``scale = floor(log2(amax)) -
2`` (e2m1's largest exponent) and each value the nearest e2m1 of ``w / 2^scale``,
saturating at 6.

The reference is transformers computing in float32 over the weights *as stored*:
each MXFP4 weight dequantized exactly, ``e2m1 * 2^(scale - 127)`` (a float32 exactly),
loaded into the same architecture without a ``quantization_config``. That is vOOM's
exact mode (docs/engine.md, "Weights in low precision"). transformers' own MXFP4 loader
on a CPU dequantizes through a BF16 table and ``ldexp`` in BF16: the same values
(every e2m1 times a power of two in BF16's range is a BF16 exactly), which this script
checks by loading the MXFP4 checkpoint through it too and comparing the expert
weights bit for bit.

Prompts, greedy runs, near-tie redraws (the router's k-th and (k+1)-th choice gap
included), the uncached cross-check and the ``reference.json`` schema are
``make_fixtures.py``'s; the cases go to ``tests/fixtures/tiny_gpt_oss/`` with their own
``index.json``. Each case also checks that the sinks, the window and the SwiGLU's clamp
change its logits (so that an engine ignoring one of them fails the test).

Run: ``python3 tests/conformance/make_gpt_oss_fixtures.py [--out tests/fixtures/tiny_gpt_oss]``
(CPU; torch and transformers as for make_fixtures.py; the committed references were
made with torch 2.11 and transformers 5.17).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures  # noqa: E402
from make_fixtures import REPO_ROOT, CaseSpec  # noqa: E402

make_fixtures.CONFIG_CLASSES["gpt_oss"] = transformers.GptOssConfig

# e2m1 values by code (bit 3 the sign), as the MX format and transformers list them.
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
GROUP = 32
EXPERT_PROJS = ("gate_up_proj", "down_proj")
NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@dataclass
class GptOssCase:
    spec: CaseSpec
    # Experts as MXFP4 blocks and scales (the released form), or BF16 as transformers
    # lays them out (the BF16 uploads).
    mxfp4: bool
    # Write config.json without what transformers fills in for gpt_oss (rope, window,
    # layer types, head_dim, attention_bias): the defaults must give the same model.
    bare_config: bool = False
    # The routers' weights are scaled by this power of two after the random init
    # (exact in BF16): logits of a few units keep the k-th and (k+1)-th choices'
    # probabilities apart, so that fewer prompts are redrawn for a near-tie there.
    router_scale: float = 0.125
    # The sinks likewise (released models learn sinks of several units, enough to
    # take a share of a long row's softmax).
    sink_scale: float = 8.0


def base_config(**over) -> dict:
    c = {
        "vocab_size": 384,
        "hidden_size": 96,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        "attention_bias": True,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    c.update(over)
    return c


def case_list() -> list[GptOssCase]:
    return [
        GptOssCase(
            spec=CaseSpec(
                name="gpt_oss_mxfp4",
                arch="gpt_oss",
                seed=5001,
                covers=[
                    "gpt_oss as released: every expert projection MXFP4 (gate_up_proj_blocks [E, 2I, H / 32, 16], _scales [E, 2I, H / 32]; down_proj likewise), the rest BF16",
                    "quantization_config mxfp4 with the released modules_to_not_convert",
                    "4 layers: sliding window 8 (layers 0, 2) and full attention (1, 3), layer_types written",
                    "attention sinks, q/k/v/o biases, 4 heads of 16 / 2 kv heads (q width 64 != hidden 96)",
                    "YaRN (factor 4 over 64 positions, truncate false), rope_theta 150000",
                    "4 experts, 2 per token: router with bias, softmax over the top 2; interleaved gate/up with biases, clamped SwiGLU",
                ],
                config=base_config(),
                linear_std=0.35,
            ),
            mxfp4=True,
        ),
        GptOssCase(
            spec=CaseSpec(
                name="gpt_oss_bf16_bare_config",
                arch="gpt_oss",
                seed=5002,
                covers=[
                    "gpt_oss with BF16 experts in transformers' layout (gate_up_proj [E, H, 2I], down_proj [E, I, H]), as the BF16 uploads store them",
                    "**bare config** (post-edited): no rope_parameters, sliding_window, layer_types, head_dim or attention_bias; transformers' defaults apply (YaRN factor 32 over 4096, theta 150000, window 128, head_dim 64)",
                    "3 layers (sliding, full, sliding); 2 heads of 64 / 1 kv head; 6 experts, 3 per token",
                ],
                config=base_config(
                    hidden_size=64,
                    intermediate_size=32,
                    num_hidden_layers=3,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                    head_dim=64,
                    num_local_experts=6,
                    num_experts_per_tok=3,
                    sliding_window=128,
                    max_position_embeddings=131072,
                    rope_parameters={
                        "rope_type": "yarn",
                        "rope_theta": 150000.0,
                        "factor": 32.0,
                        "original_max_position_embeddings": 4096,
                        "beta_fast": 32.0,
                        "beta_slow": 1.0,
                        "truncate": False,
                    },
                ),
                linear_std=0.35,
            ),
            mxfp4=False,
            bare_config=True,
        ),
    ]


# ---------------------------------------------------------------------------------------
# MXFP4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [E, R, C / 32, 16] and scales [E, R, C / 32] of `w` [E, R, C] (rows the
    outputs): per group of 32, the e8m0 exponent floor(log2(amax)) - 2 and each value
    the nearest e2m1 (ties to the smaller magnitude), saturating at 6."""
    e, r, c = w.shape
    assert c % GROUP == 0, w.shape
    g = w.float().reshape(e, r, c // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)[..., None]
    mags = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs()[..., None] - mags).abs().argmin(dim=-1)  # first minimum: smaller magnitude
    code = code | ((scaled < 0) & (code > 0)).to(torch.long) << 3
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The stored value of every weight, [E, R, C]: e2m1 * 2^(scale - 127), exact in f32."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    lo, hi = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [E, R, G, 32], even first
    vals = vals * torch.exp2(scales.float() - 127)[..., None]
    e, r, g, _ = vals.shape
    return vals.reshape(e, r, g * GROUP)


def quantize_experts(stored: dict) -> tuple[dict, dict, list[str]]:
    """The tensors to store (each expert projection as blocks and scales, the rest as
    it was), every model parameter's stored value in float32, and the names quantized."""
    tensors, f32, names = {}, {}, []
    for n, t in stored.items():
        if n.endswith(tuple(f"mlp.experts.{p}" for p in EXPERT_PROJS)):
            # transformers' parameter is [E, in, out]; the release stores outputs as rows.
            blocks, scales = quantize_mxfp4(t.float().transpose(1, 2))
            tensors[n + "_blocks"], tensors[n + "_scales"] = blocks, scales
            f32[n] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
            names.append(n)
        else:
            tensors[n] = t
            f32[n] = t.float()
    return tensors, f32, names


# ---------------------------------------------------------------------------------------
# Effects that must show in the logits


def logits_effect(model, prompts, edit) -> dict:
    """The largest |logit| change per prompt length when `edit` changes the model
    (undone afterwards)."""
    base = {str(p["length"]): make_fixtures.last_prompt_logits(model, p["prompt"]) for p in prompts}
    undo = edit(model)
    try:
        return {
            str(p["length"]): float(
                (make_fixtures.last_prompt_logits(model, p["prompt"]) - base[str(p["length"])]).abs().max()
            )
            for p in prompts
        }
    finally:
        undo()


def no_sinks(model):
    saved = [(a, a.sinks.data.clone()) for a in attentions(model)]
    for a, _ in saved:
        a.sinks.data.fill_(-float("inf"))
    return lambda: [a.sinks.data.copy_(s) for a, s in saved]


def no_window(model):
    saved = [(a, a.sliding_window) for a in attentions(model)]
    types = list(model.config.layer_types)
    model.config.layer_types = ["full_attention"] * len(types)
    for a, _ in saved:
        a.sliding_window = None

    def undo():
        model.config.layer_types = types
        for a, w in saved:
            a.sliding_window = w

    return undo


def no_clamp(model):
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    for e in experts:
        e.limit = float("inf")

    def undo():
        for e in experts:
            e.limit = 7.0

    return undo


def attentions(model):
    return [m for m in model.modules() if type(m).__name__ == "GptOssAttention"]


def check_effects(name: str, model, prompts, window: int) -> dict:
    checks = {}
    sinks = logits_effect(model, prompts, no_sinks)
    if not all(d > 1e-2 for d in sinks.values()):
        raise SystemExit(f"{name}: the sinks have no effect: {sinks}")
    checks["sinks_effect_max_abs_logit_diff_by_prompt_length"] = sinks
    clamp = logits_effect(model, prompts, no_clamp)
    if not clamp["200"] > 1e-2:
        raise SystemExit(f"{name}: the SwiGLU clamp has no effect: {clamp}")
    checks["clamp_effect_max_abs_logit_diff_by_prompt_length"] = clamp
    win = logits_effect(model, prompts, no_window)
    longer = [p["length"] for p in prompts if p["length"] > window]
    shorter = [p["length"] for p in prompts if p["length"] <= window]
    if not all(win[str(n)] > 1e-2 for n in longer) or not all(win[str(n)] == 0.0 for n in shorter):
        raise SystemExit(f"{name}: the sliding window has no effect where it should (window {window}): {win}")
    checks["sliding_window_effect_max_abs_logit_diff_by_prompt_length"] = win
    return checks


# ---------------------------------------------------------------------------------------
# Cases


def bare(cfg: dict) -> tuple[dict, list[str]]:
    """`cfg` without what transformers' GptOssConfig fills in the same way."""
    want = transformers.GptOssConfig()
    out = dict(cfg)
    dropped = []
    for key in ("rope_parameters", "sliding_window", "layer_types", "head_dim", "attention_bias", "max_position_embeddings"):
        if key in out:
            dropped.append(key)
            out.pop(key)
    rp = cfg["rope_parameters"]
    assert rp == dict(want.rope_parameters) | {"rope_theta": rp["rope_theta"]}, (rp, want.rope_parameters)
    assert cfg["sliding_window"] == want.sliding_window and cfg["head_dim"] == want.head_dim
    return out, dropped


def run_case(case: GptOssCase, out: Path) -> dict:
    spec = case.spec
    path = out / spec.name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    model = make_fixtures.build_model(spec)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.router.weight"):
                p.mul_(case.router_scale)
            if n.endswith("self_attn.sinks"):
                p.mul_(case.sink_scale)
    model.save_pretrained(path, safe_serialization=True)
    del model
    stored = make_fixtures.checkpoint_tensors(path)
    for n, t in stored.items():
        if t.dtype != torch.bfloat16:
            raise SystemExit(f"{spec.name}: {n} saved as {t.dtype}")
    cfg = make_fixtures.read_json(path / "config.json")
    checks: dict = {}
    if case.bare_config:
        cfg, dropped = bare(cfg)
        checks["config_postedits"] = {"removed": dropped}
    if case.mxfp4:
        tensors, f32, names = quantize_experts(stored)
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERT}
    else:
        tensors, f32, names = stored, {n: t.float() for n, t in stored.items()}, []
    for f in path.glob("*.safetensors"):
        f.unlink()
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    make_fixtures.write_json_like_transformers(path / "config.json", cfg)

    # The float32 twin: every weight as stored, no quantization_config.
    with tempfile.TemporaryDirectory() as tmp:
        twin = Path(tmp)
        shutil.copy(path / "generation_config.json", twin / "generation_config.json")
        plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
        make_fixtures.write_json_like_transformers(twin / "config.json", plain)
        safetensors.torch.save_file(
            {n: t.contiguous() for n, t in f32.items()}, twin / "model.safetensors", metadata={"format": "pt"}
        )
        model = make_fixtures.load_f32(twin)
    state = model.state_dict()
    if set(state) != set(f32):
        raise SystemExit(f"{spec.name}: the reference model's tensors differ: {set(state) ^ set(f32)}")
    for n, v in f32.items():
        if not torch.equal(state[n], v):
            raise SystemExit(f"{spec.name}: the reference model's {n} is not the stored value")
    checks["reference_holds_stored_values"] = len(f32)

    if case.mxfp4:
        changed = sum(int(not torch.equal(f32[n], stored[n].float())) for n in names)
        if changed != len(names):
            raise SystemExit(f"{spec.name}: {len(names) - changed} MXFP4 weights kept their BF16 values")
        checks["mxfp4_tensors"] = len(names)
        checks["transformers_mxfp4_dequantize_bits_equal"] = transformers_dequantize_matches(path, f32, names)
        scales = torch.cat([tensors[n + "_scales"].flatten() for n in names])
        checks["scale_exponents"] = sorted({int(s) - 127 for s in scales.tolist()})
    if case.bare_config:
        # The bare config loads to the same model as the written one.
        full = transformers.AutoConfig.from_pretrained(path)
        for key, want in spec.config.items():
            got = getattr(full, key, None)
            if key == "rope_parameters":
                got = dict(got)
            if got != want and key not in ("pad_token_id", "bos_token_id", "eos_token_id"):
                raise SystemExit(f"{spec.name}: the bare config gives {key} {got}, not {want}")

    eos = spec.config["eos_token_id"]
    prompts, rejected = make_fixtures.draw_prompts(spec, model, exclude={eos})
    window = model.config.sliding_window
    checks |= check_effects(spec.name, model, prompts, window)
    eos_ids = make_fixtures.eos_ids_of(model)
    records, max_uncached = make_fixtures.reference_records(spec, model, prompts, eos_ids)
    checks["uncached_vs_generate_max_abs_logit_diff"] = max_uncached
    ref = {
        "schema_version": make_fixtures.SCHEMA_VERSION,
        "case": spec.name,
        "model_type": cfg["model_type"],
        "architectures": cfg["architectures"],
        "covers": spec.covers,
        "seed": spec.seed,
        "generator": {
            "script": "tests/conformance/make_gpt_oss_fixtures.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "weights_dtype": "experts MXFP4 (e2m1 blocks, e8m0 scales), the rest bfloat16" if case.mxfp4 else "bfloat16",
        "reference_weights": "each MXFP4 weight dequantized exactly: e2m1 * 2^(scale - 127), in float32"
        if case.mxfp4
        else "the BF16 weights widened to float32",
        "compute_dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "quantization_config": cfg.get("quantization_config"),
        "init": {
            "embed_std": spec.embed_std,
            "linear_std": spec.linear_std,
            "lm_head_std": spec.lm_head_std,
            "bias_std": spec.bias_std,
            "norm_uniform": list(spec.norm_range),
            "final_norm_uniform": list(spec.final_norm_range),
        },
        "generation": {
            "do_sample": False,
            "max_new_tokens": make_fixtures.MAX_NEW_TOKENS,
            "eos_token_ids": eos_ids,
            "config_eos_token_id": cfg["eos_token_id"],
        },
        "min_margin_threshold": make_fixtures.MIN_MARGIN,
        "rejected_prompts": rejected,
        "min_margin": min(r["min_margin"] for r in records),
        "checks": checks,
        "prompts": records,
    }
    make_fixtures.write_json_like_transformers(path / "reference.json", ref)
    files = sorted(f.name for f in path.iterdir())
    sizes = {f: (path / f).stat().st_size for f in files}
    return {
        "name": spec.name,
        "model_type": cfg["model_type"],
        "covers": spec.covers,
        "files": files,
        "bytes": sum(sizes.values()),
        "mxfp4_tensors": len(names),
        "prompt_lengths": [r["prompt_length"] for r in records],
        "min_margin": ref["min_margin"],
        "rejected_prompts": len(rejected),
    }


def transformers_dequantize_matches(path: Path, f32: dict, names: list[str]) -> int:
    """Loads the MXFP4 checkpoint through transformers' own loader (on a CPU it
    dequantizes to BF16) and checks each expert weight against the exact f32 values,
    bit for bit once widened. Returns how many weights it compared."""
    q = transformers.Mxfp4Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16)
    state = model.state_dict()
    for n in names:
        got = state[n]
        if got.shape != f32[n].shape or not torch.equal(got.float(), f32[n]):
            diff = (got.float() - f32[n]).abs().max() if got.shape == f32[n].shape else got.shape
            raise SystemExit(f"{path.name}: transformers' MXFP4 dequantization of {n} differs: {diff}")
    return len(names)


def main() -> None:
    import argparse
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "tiny_gpt_oss")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_case(c, args.out) for c in case_list()]
    index = {
        "schema_version": make_fixtures.SCHEMA_VERSION,
        "generator": {
            "script": "tests/conformance/make_gpt_oss_fixtures.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "cases": results,
    }
    make_fixtures.write_json_like_transformers(args.out / "index.json", index)
    for r in results:
        print(
            f"{r['name']:32} {r['bytes'] / 1024:6.0f} KiB mxfp4 {r['mxfp4_tensors']:2d} "
            f"rejected {r['rejected_prompts']:3d} margin {r['min_margin']:.3g}"
        )


if __name__ == "__main__":
    sys.exit(main())
