#!/usr/bin/env python3
"""Tiny random hybrid linear-attention checkpoints with transformers references.

Qwen3-Next and the Qwen3.5 text models interleave Gated DeltaNet layers (a causal
depthwise convolution with a rolling state, the gated delta rule's recurrent state)
with full attention layers (output gate, partial rotary, per-head q/k norm), and
Qwen3-Next and Qwen3.5-MoE put mixtures of experts with a gated shared expert after
them. This script makes their conformance fixtures exactly as ``make_fixtures.py``
makes the others (same construction, BF16 checks, near-tie redraws, cached against
uncached cross-check, ``reference.json`` schema; see tests/conformance/README.md),
into ``tests/fixtures/tiny_hybrid/`` with its own ``index.json``.

transformers computes a prompt with the chunked form of the delta rule
(``torch_chunk_gated_delta_rule``, chunks of 64) and each decoded token with the
recurrent form: float32 either way, the two differing only by summation order, which
the margin checks cover (and the uncached check, all chunked, compares).

Run: ``python3 tests/conformance/make_hybrid_fixtures.py [--out tests/fixtures/tiny_hybrid]``
(CPU; torch and transformers as for make_fixtures.py; the committed references were
made with torch 2.11 and transformers 5.17, the accelerator machine's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures  # noqa: E402
from make_fixtures import REPO_ROOT, CaseSpec  # noqa: E402

make_fixtures.CONFIG_CLASSES.update(
    {
        "qwen3_next": transformers.Qwen3NextConfig,
        "qwen3_5_text": transformers.Qwen3_5TextConfig,
        "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
    }
)


def case_specs() -> list[CaseSpec]:
    return [
        CaseSpec(
            name="qwen3_next_moe_legacy_config",
            arch="qwen3_next",
            seed=3001,
            covers=[
                "qwen3_next: 4 layers, 3 Gated DeltaNet then 1 full attention (full_attention_interval 4)",
                "**released config form** (post-edited): top-level rope_theta and partial_rotary_factor 0.25, full_attention_interval, no layer_types",
                "DeltaNet: 2 key heads, 4 value heads (ratio 2), key head 16, value head 16, conv kernel 4; in_proj_qkvz / in_proj_ba grouped by key head",
                "attention: 4 heads / 2 kv heads, head_dim 32, output gate (q_proj twice as wide), per-head q/k norm, zero-centred (1 + w) RMSNorm",
                "8 experts, 2 per token, norm_topk_prob true, shared expert (48) with its sigmoid gate, every layer",
                "untied lm_head",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "full_attention_interval": 4,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            config_postedit="qwen3_next_legacy",
            zero_centred_norms=True,
        ),
        CaseSpec(
            name="qwen3_next_ratio1_dense_layer_tied",
            arch="qwen3_next",
            seed=3002,
            covers=[
                "qwen3_next: layer_types [linear, full, linear] (explicit, not every fourth)",
                "DeltaNet: 2 key heads, 2 value heads (ratio 1), key head 16, value head 24 (k and v sizes differ), conv kernel 3",
                "attention: 4 heads / 1 kv head, head_dim 16, partial_rotary_factor 0.5",
                "mlp_only_layers [1]: a dense MLP (96) in the full attention layer; experts: 6, 3 per token, norm_topk_prob false, shared expert 32",
                "tied embeddings",
            ],
            config={
                "vocab_size": 320,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                "linear_conv_kernel_dim": 3,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 24,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 2,
                "num_experts": 6,
                "num_experts_per_tok": 3,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
                "norm_topk_prob": False,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [1],
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
                "tie_word_embeddings": True,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            final_norm_range=make_fixtures.TIED_FINAL_NORM,
            zero_centred_norms=True,
        ),
        CaseSpec(
            name="qwen3_5_text_dense",
            arch="qwen3_5_text",
            seed=3003,
            covers=[
                "qwen3_5_text (Qwen3.5's language model): DeltaNet projections stored apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)",
                "layer_types [linear, linear, full, linear, full]",
                "DeltaNet: 2 key heads, 4 value heads (ratio 2), head 16, conv kernel 4",
                "attention: 4 heads / 2 kv heads, head_dim 32, partial_rotary_factor 0.25, interleaved M-RoPE sections (text: every section the same position)",
                "dense MLP (128) in every layer; untied",
            ],
            config={
                "vocab_size": 352,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 5,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "layer_types": [
                    "linear_attention",
                    "linear_attention",
                    "full_attention",
                    "linear_attention",
                    "full_attention",
                ],
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000000.0,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [2, 1, 1],
                    "mrope_interleaved": True,
                },
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            zero_centred_norms=True,
        ),
        CaseSpec(
            name="qwen3_5_moe_text",
            arch="qwen3_5_moe_text",
            seed=3004,
            covers=[
                "qwen3_5_moe_text (Qwen3.5-MoE's language model): DeltaNet projections stored apart",
                "4 layers, full_attention_interval 2: linear, full, linear, full",
                "DeltaNet: 1 key head, 2 value heads (ratio 2), head 16, conv kernel 4",
                "attention: 2 heads / 1 kv head, head_dim 32, partial_rotary_factor 0.25",
                "8 experts, 2 per token, shared expert 32 with its sigmoid gate, every layer; untied",
            ],
            config={
                "vocab_size": 352,
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "full_attention_interval": 2,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_num_key_heads": 1,
                "linear_num_value_heads": 2,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000000.0,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [2, 1, 1],
                    "mrope_interleaved": True,
                },
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            zero_centred_norms=True,
        ),
    ]


def main() -> None:
    results, _ = make_fixtures.generate(
        case_specs(),
        REPO_ROOT / "tests" / "fixtures" / "tiny_hybrid",
        "tests/conformance/make_hybrid_fixtures.py",
        __doc__,
    )
    for r in results:
        per = "  ".join(
            f"{x['prompt_length']}:{x['num_generated']}/{x['distinct_generated']}{'E' if x['stopped_on_eos'] else ''}/{x['min_margin']:.3g}"
            for x in r["_records"]
        )
        print(f"{r['name']:36} {r['bytes'] / 1024:6.0f} KiB rejected {r['rejected_prompts']:3d}  {per}")


if __name__ == "__main__":
    sys.exit(main())
