#!/usr/bin/env python3
"""Tiny random FP8 (e4m3, block-scaled) checkpoints with transformers references.

DeepSeek-V3/R1 and the Qwen3 ``-FP8`` releases store their linear layers' weights as
``F8_E4M3`` with one F32 ``weight_scale_inv`` per block (``quantization_config``:
``quant_method fp8``, ``fmt e4m3``, ``weight_block_size [rows, cols]``); the
embeddings, norms, routers and output head stay BF16. Each case here is built as
``make_fixtures.py`` builds its BF16 cases (same random init and ``save_pretrained``
files), then every linear weight of the layers is quantized as those releases were:
per block, ``scale = amax / 448`` in float32 and ``q = e4m3(w / scale)`` (nearest,
saturating), edge blocks partial where the block does not divide the weight. The
file keeps ``q`` and ``scale``.

The reference is transformers computing in float32 over the weights *as stored*:
each FP8 weight dequantized exactly, ``float32(e4m3(q)) * scale`` (one f32
rounding), loaded into the same architecture without a ``quantization_config``.
That is vOOM's exact mode (docs/engine.md, "Weights in low precision").
transformers' own FP8 loader is not used: on a CPU it dequantizes to BF16 (a second
rounding the release does not hold), and on a GPU it quantizes the activations to
FP8 too; neither computes over the stored weights.

Prompts, greedy runs, near-tie redraws, the uncached cross-check and the
``reference.json`` schema are ``make_fixtures.py``'s; the cases go to
``tests/fixtures/tiny_fp8/`` with their own ``index.json``.

Run: ``python3 tests/conformance/make_fp8_fixtures.py [--out tests/fixtures/tiny_fp8]``
(CPU; torch and transformers as for make_fixtures.py; the committed references were
made with torch 2.11 and transformers 5.17, the accelerator machine's).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures  # noqa: E402
from make_fixtures import REPO_ROOT, CaseSpec  # noqa: E402

E4M3_MAX = 448.0


@dataclass
class Fp8Case:
    # None: a case quantized from a fixture already made (the MTP one).
    spec: CaseSpec | None
    block: tuple[int, int]
    # quantization_config.modules_to_not_convert: these modules stay BF16.
    not_convert: list[str] = field(default_factory=list)
    # Write the scales as BF16 rather than F32 (some re-quantized uploads do).
    bf16_scales: bool = False


def quantized_names(names: list[str], not_convert: list[str]) -> list[str]:
    """The 2-D linear weights of the decoder layers that an FP8 release quantizes:
    every ``*.weight`` of a ``Linear`` under ``model.layers`` and the fused experts'
    ``gate_up_proj`` / ``down_proj`` (each expert's matrix blocked on its own), except the routers
    (``mlp.gate``), a shared expert's sigmoid gate and the modules left unconverted."""
    out = []
    for n in names:
        fused = n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        if not n.startswith("model.layers.") or not (n.endswith(".weight") or fused):
            continue
        if "norm" in n or n.endswith("mlp.gate.weight") or n.endswith("shared_expert_gate.weight"):
            continue
        # A multi-token-prediction layer's own embedding and head stay BF16.
        if n.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            continue
        if any(in_module(n, m) for m in not_convert):
            continue
        out.append(n)
    return out


def in_module(name: str, module: str) -> bool:
    """Whether tensor `name` lies in `module` (dot-separated segments, ``*`` any one)."""
    segs, pat = name.split("."), module.split(".")
    return any(
        all(p == "*" or p == s for p, s in zip(pat, segs[i : i + len(pat)]))
        for i in range(len(segs) - len(pat) + 1)
    )


def quantize(w: torch.Tensor, block: tuple[int, int], bf16_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 values and their per-block scales (F32, or BF16) of 2-D `w`."""
    rows, cols = w.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if bf16_scales:
        scale = scale.to(torch.bfloat16).float()
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(nr * br, nc * bc)[:rows, :cols].contiguous()
    return q, scale.to(torch.bfloat16) if bf16_scales else scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The stored value of every weight: float32(e4m3) times its block's scale, in f32."""
    rows, cols = q.shape
    br, bc = block
    s = scale.float().repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return q.float() * s


def case_list() -> list[Fp8Case]:
    specs = {s.name: s for s in make_fixtures.case_specs()}

    def derive(base: str, name: str, seed: int, covers: list[str], **config) -> CaseSpec:
        s = copy.deepcopy(specs[base])
        s.name, s.seed, s.covers = name, seed, covers
        s.config.update(config)
        s.eos_mode = "fixed"
        s.config["eos_token_id"] = 2
        return s

    return [
        Fp8Case(
            spec=derive(
                "qwen3_qk_norm_eos_list",
                "qwen3_fp8_partial_blocks",
                4001,
                [
                    "qwen3 (as qwen3_qk_norm_eos_list) with FP8 e4m3 linear weights, F32 weight_scale_inv",
                    "weight_block_size [24, 32]: partial edge blocks in rows (64 = 2 x 24 + 16) and columns (160 = 5 x 32 by rows of 24: down_proj)",
                    "embeddings (tied), norms BF16",
                ],
            ),
            block=(24, 32),
        ),
        Fp8Case(
            spec=derive(
                "qwen3_moe_dense_layer",
                "qwen3_moe_fp8_bf16_scales_not_convert",
                4002,
                [
                    "qwen3_moe (as qwen3_moe_dense_layer) with FP8 experts and attention, block [16, 16]",
                    "scales stored BF16",
                    "modules_to_not_convert: lm_head and model.layers.0.self_attn (stays BF16)",
                    "routers BF16; experts one tensor per expert and projection, each with its scales",
                ],
            ),
            block=(16, 16),
            not_convert=["lm_head", "model.layers.0.self_attn"],
            bf16_scales=True,
        ),
        Fp8Case(
            spec=derive(
                "qwen3_moe_fused_sparse_step",
                "qwen3_moe_fp8_fused_experts",
                4003,
                [
                    "qwen3_moe (as qwen3_moe_fused_sparse_step) with FP8 weights, block [20, 32]: a block of rows straddles the gate and up halves of gate_up_proj (48 + 48 rows)",
                    "experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]) with scales [E, ceil(2I / 20), H / 32]",
                ],
            ),
            block=(20, 32),
        ),
        Fp8Case(
            spec=derive(
                "deepseek_v3_mla_yarn",
                "deepseek_v3_fp8_mla",
                4004,
                [
                    "deepseek_v3 (as deepseek_v3_mla_yarn) with every linear weight of the layers FP8, block [16, 16]",
                    "kv_a_proj_with_mqa (24 rows) and q_b_proj (24 columns): partial edge blocks; kv_b_proj sliced per head across blocks",
                    "dense first layer, routed and shared experts FP8; router and correction bias as released (BF16, F32)",
                ],
            ),
            block=(16, 16),
        ),
    ]


def quantize_all(stored: dict, case: Fp8Case) -> tuple[list[str], dict, dict]:
    """The names quantized, the tensors to store (FP8 weights with their scales,
    the rest as they were) and every tensor's stored value in float32."""
    names = quantized_names(sorted(stored), case.not_convert)
    tensors = dict(stored)
    f32 = {n: t.float() for n, t in stored.items()}
    for n in names:
        w = stored[n]
        if w.dim() == 3:  # fused experts: each expert's matrix on its own blocks
            qs = [quantize(w[e], case.block, case.bf16_scales) for e in range(w.shape[0])]
            q = torch.stack([a for a, _ in qs])
            s = torch.stack([b for _, b in qs])
            deq = torch.stack([dequantize(a, b, case.block) for a, b in qs])
        else:
            q, s = quantize(w, case.block, case.bf16_scales)
            deq = dequantize(q, s, case.block)
        tensors[n], tensors[n + "_scale_inv"] = q, s
        f32[n] = deq
    return names, tensors, f32


def quantization_config(case: Fp8Case) -> dict:
    qc = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(case.block),
    }
    if case.not_convert:
        qc["modules_to_not_convert"] = case.not_convert
    return qc


def write_twin(twin: Path, cfg: dict, f32: dict, path: Path) -> None:
    """The float32 twin of the checkpoint at `path` in `twin`: every tensor as its
    stored value, no quantization_config."""
    shutil.copy(path / "generation_config.json", twin / "generation_config.json")
    plain = dict(cfg)
    plain.pop("quantization_config", None)
    make_fixtures.write_json_like_transformers(twin / "config.json", plain)
    safetensors.torch.save_file(
        {n: t.contiguous() for n, t in f32.items()}, twin / "model.safetensors", metadata={"format": "pt"}
    )


def run_case(case: Fp8Case, out: Path) -> dict:
    spec = case.spec
    path = out / spec.name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    model = make_fixtures.build_model(spec)
    save_kwargs = {"safe_serialization": True}
    if spec.fused_experts:
        save_kwargs["save_original_format"] = False
    model.save_pretrained(path, **save_kwargs)
    del model

    stored = make_fixtures.checkpoint_tensors(path)
    names, tensors, f32 = quantize_all(stored, case)
    for f in path.glob("*.safetensors"):
        f.unlink()
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})

    cfg = make_fixtures.read_json(path / "config.json")
    qc = quantization_config(case)
    cfg["quantization_config"] = qc
    make_fixtures.write_json_like_transformers(path / "config.json", cfg)

    # The float32 twin: the same files with every weight as stored (dequantized), no
    # quantization_config; transformers loads it as it loads any checkpoint.
    with tempfile.TemporaryDirectory() as tmp:
        write_twin(Path(tmp), cfg, f32, path)
        model = make_fixtures.load_f32(Path(tmp))
    state = model.state_dict()
    for n, v in f32.items():
        got = make_fixtures.stored_value_in_model(state, n)
        if got is None or not torch.equal(got, v):
            raise SystemExit(f"{spec.name}: the reference model's {n} is not the stored value")
    # The quantized weights really differ from their BF16 origin (the test is not
    # one of BF16 weights in disguise).
    changed = sum(int(not torch.equal(f32[n], stored[n].float())) for n in names)
    if changed != len(names):
        raise SystemExit(f"{spec.name}: {len(names) - changed} quantized weights kept their BF16 values")

    eos = spec.config["eos_token_id"]
    prompts, rejected = make_fixtures.draw_prompts(spec, model, exclude={eos})
    eos_ids = make_fixtures.eos_ids_of(model)
    records, max_uncached = make_fixtures.reference_records(spec, model, prompts, eos_ids)
    fp8_count = sum(1 for t in tensors.values() if t.dtype == torch.float8_e4m3fn)
    ref = {
        "schema_version": make_fixtures.SCHEMA_VERSION,
        "case": spec.name,
        "model_type": cfg["model_type"],
        "architectures": cfg["architectures"],
        "covers": spec.covers,
        "seed": spec.seed,
        "generator": {
            "script": "tests/conformance/make_fp8_fixtures.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "weights_dtype": "float8_e4m3fn with block scales (the rest bfloat16)",
        "reference_weights": "each FP8 weight dequantized exactly: float32(e4m3) * scale, in float32",
        "compute_dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager" if make_fixtures.routers(model) else None,
        "quantization_config": qc,
        "generation": {
            "do_sample": False,
            "max_new_tokens": make_fixtures.MAX_NEW_TOKENS,
            "eos_token_ids": eos_ids,
            "config_eos_token_id": cfg["eos_token_id"],
        },
        "min_margin_threshold": make_fixtures.MIN_MARGIN,
        "rejected_prompts": rejected,
        "min_margin": min(r["min_margin"] for r in records),
        "checks": {
            "fp8_tensors": fp8_count,
            "scale_tensors": len(names) if names else 0,
            "reference_holds_stored_values": len(f32),
            "uncached_vs_generate_max_abs_logit_diff": max_uncached,
        },
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
        "fp8_tensors": fp8_count,
        "weight_block_size": list(case.block),
        "prompt_lengths": [r["prompt_length"] for r in records],
        "min_margin": ref["min_margin"],
        "rejected_prompts": len(rejected),
    }


# The FP8 form of an MTP fixture (tests/fixtures/tiny_mtp): the decoder and its
# multi-token-prediction layer quantized alike (eh_proj included, as DeepSeek-V3's
# layer 61 is), the layer's own embedding and head BF16.
MTP_BASE = "deepseek_v3_mla_yarn_mtp"
MTP_CASE = Fp8Case(spec=None, block=(16, 16))


def run_mtp_case(out: Path) -> dict:
    """`MTP_BASE` in FP8 into `out`/`MTP_BASE`_fp8, with reference_mtp.json computed
    as make_mtp_fixtures.py computes it, over the stored values."""
    import make_mtp_fixtures as mm

    src = out / MTP_BASE
    name = f"{MTP_BASE}_fp8"
    path = out / name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    stored = make_fixtures.checkpoint_tensors(src)
    names, tensors, f32 = quantize_all(stored, MTP_CASE)
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = make_fixtures.read_json(src / "config.json")
    cfg["quantization_config"] = quantization_config(MTP_CASE)
    make_fixtures.write_json_like_transformers(path / "config.json", cfg)
    shutil.copy(src / "generation_config.json", path / "generation_config.json")
    n_layers = cfg["num_hidden_layers"]
    if not any(n.startswith(f"model.layers.{n_layers}.") for n in names):
        raise SystemExit(f"{name}: the prediction layer has no FP8 weight")
    base = make_fixtures.read_json(src / "reference_mtp.json")
    with tempfile.TemporaryDirectory() as tmp:
        twin = Path(tmp)
        write_twin(twin, cfg, f32, path)
        decoder = make_fixtures.load_f32(twin)
        cfg2 = transformers.AutoConfig.from_pretrained(twin)
        cfg2.num_hidden_layers = n_layers + 1
        full = make_fixtures.load_f32(twin, cfg2)
    state = full.state_dict()
    for n, v in f32.items():
        got = make_fixtures.stored_value_in_model(state, n)
        if got is not None and not torch.equal(got, v):
            raise SystemExit(f"{name}: the reference model's {n} is not the stored value")
    mtp = mm.Mtp(decoder, full, f32, n_layers)
    sequences = []
    for s in base["sequences"]:
        p = s["prompt_ids"]
        seq = list(p)
        with torch.no_grad():
            for _ in range(mm.NEW_TOKENS):
                logits = decoder(torch.tensor([seq]), use_cache=False).logits[0, -1]
                top = torch.topk(logits, 2)
                if float(top.values[0] - top.values[1]) < make_fixtures.MIN_MARGIN:
                    raise SystemExit(f"{name}: a near-tie in the decoder's greedy run of {p}")
                seq.append(int(top.indices[0]))
            h = decoder.model(torch.tensor([seq]), use_cache=False).last_hidden_state[0]
        drafts = [mm.drafts_at(mtp, seq, h, n) for n in range(len(p) + 1, len(seq) + 1)]
        sequences.append({"prompt_ids": p, "generated_ids": seq[len(p) :], "drafts": drafts})
    margins = [m for s in sequences for d in s["drafts"] for m in d["margins"]]
    gaps = [g for s in sequences for d in s["drafts"] for g in d["router_gaps"]]
    ref = {
        "schema_version": 1,
        "case": name,
        "base_case": MTP_BASE,
        "mtp_layer": n_layers,
        "draft_len": mm.DRAFT_LEN,
        "min_margin_threshold": make_fixtures.MIN_MARGIN,
        "min_router_gap_threshold": make_fixtures.MIN_ROUTER_GAP,
        "near_ties": {
            "margins_below": sum(m < make_fixtures.MIN_MARGIN for m in margins),
            "router_gaps_below": sum(g < make_fixtures.MIN_ROUTER_GAP for g in gaps),
            "drafted": len(margins),
        },
        "weights": "FP8 e4m3, block [16, 16], F32 scales; references over the stored values (f32)",
        "checks": {"fp8_tensors": len(names)},
        "generator": {
            "script": "tests/conformance/make_fp8_fixtures.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "sequences": sequences,
    }
    with open(path / "reference_mtp.json", "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    return ref


def main() -> None:
    import argparse
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "tiny_fp8")
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
            "script": "tests/conformance/make_fp8_fixtures.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "cases": results,
    }
    make_fixtures.write_json_like_transformers(args.out / "index.json", index)
    mtp = run_mtp_case(args.out.parent / "tiny_mtp")
    print(f"{mtp['case']:42} near ties {json.dumps(mtp['near_ties'])}")
    for r in results:
        print(f"{r['name']:42} {r['bytes'] / 1024:6.0f} KiB fp8 {r['fp8_tensors']:3d} rejected {r['rejected_prompts']:3d} margin {r['min_margin']:.3g}")


if __name__ == "__main__":
    sys.exit(main())
