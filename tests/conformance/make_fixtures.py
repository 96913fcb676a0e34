#!/usr/bin/env python3
"""Generate tiny random BF16 checkpoints and Hugging Face transformers reference outputs.

Each case under ``--out`` (default ``tests/fixtures/tiny``) is a real checkpoint exactly
as ``save_pretrained(..., safe_serialization=True)`` writes it (config.json,
generation_config.json, model.safetensors or an index plus shards), plus
``reference.json``: for several token-id prompts, transformers' greedy continuation and
the float32 logits of the last prompt position, computed in float32 (eager attention)
over the BF16 weights. ``index.json`` lists the cases. The schema is in
``tests/conformance/README.md``.

Deterministic: every random draw comes from a ``torch.Generator`` or
``numpy.random.Generator`` seeded from the case's fixed seed, so a rerun with the same
torch/transformers versions writes byte-identical files.

Run: ``python3 tests/conformance/make_fixtures.py [--out tests/fixtures/tiny]`` (CPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    Glm4MoeConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

SCHEMA_VERSION = 1
# Token-for-token comparison is only well defined when the greedy choice is not a
# near-tie: a different (but equally valid) float32 summation order could flip it.
MIN_MARGIN = 1e-3
MAX_RESEEDS = 100
# Prompt lengths: a single token, a few, one past a 16-token sliding window, and long
# enough to pass original_max_position_embeddings=32 of the llama3 case many times over.
PROMPT_LENGTHS = (1, 3, 20, 200)
MAX_NEW_TOKENS = 32
# Tied models: the logit scale is embed_std * sqrt(hidden) * final norm weight, and a
# large embed_std would make the self-similarity term e_x . e_x dominate (greedy repeats
# the input token); so the embeddings stay small and the final norm weights carry the scale.
TIED_FINAL_NORM = (3.0, 9.0)
REPO_ROOT = Path(__file__).resolve().parents[2]

CONFIG_CLASSES = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "olmoe": OlmoeConfig,
    "mixtral": MixtralConfig,
    "glm4_moe": Glm4MoeConfig,
    "deepseek_v3": DeepseekV3Config,
}
# Sigmoid routers' correction bias (`e_score_correction_bias`): stored in float32 beside
# the BF16 weights, as released DeepSeek-V3 and GLM-4.5 files store it.
CORRECTION_BIAS = "e_score_correction_bias"
# Mixtures of experts: a prompt is also redrawn when a router's k-th and (k+1)-th
# probabilities are this close at any position and layer (another summation order of
# the router logits could then route the token to another expert).
MIN_ROUTER_GAP = 1e-4


@dataclass
class CaseSpec:
    name: str
    arch: str
    seed: int
    covers: list[str]
    config: dict
    # Standard deviations of the random normal init (before the BF16 cast).
    embed_std: float = 0.2
    linear_std: float = 0.25
    # Untied lm_head: sets the logit scale (std ~ lm_head_std * sqrt(hidden)), hence the
    # top-2 margins. Tied models get their scale from final_norm_range instead.
    lm_head_std: float = 1.0
    bias_std: float = 0.2
    # RMSNorm weights (layer norms and q_norm/k_norm): uniform in [lo, hi].
    norm_range: tuple[float, float] = (0.5, 1.5)
    # The final model.norm: uniform in [lo, hi].
    final_norm_range: tuple[float, float] = (0.5, 1.5)
    # "fixed": eos_token_id from `config` in both files.
    # "hit": eos chosen from a greedy continuation so that one prompt stops on it.
    # "hit_genconfig_list": config.json keeps eos A, generation_config.json gets [A, B]
    #   with B hit by one prompt (as Qwen3 releases do: generation_config wins).
    eos_mode: str = "fixed"
    # "rope_parameters" (as transformers 5 writes it) or "legacy_top_level".
    rope_form: str = "rope_parameters"
    # Post-edit Qwen2 config.json to the released-Qwen2.5 form: sliding_window set but
    # use_sliding_window false and no layer_types (transformers ignores the window).
    qwen_inactive_sliding_window: int | None = None
    max_shard_size: str | None = None
    # Extra checks that a config feature changes the output (see run_case).
    check_sliding_window_matters: bool = False
    check_llama3_scaling_matters: bool = False
    check_clip_qkv_matters: bool = False
    # Standard deviation of sigmoid routers' float32 correction bias.
    correction_bias_std: float = 0.05
    # Post-edits that must load to the same model (checked): "yarn_legacy_rope_scaling"
    # (rope_parameters -> top-level rope_theta and a `rope_scaling` with the older
    # "type" key), "drop_partial_rotary_factor" (glm4_moe's default of 0.5 applies).
    config_postedit: str | None = None
    # Save the experts fused (`mlp.experts.gate_up_proj` [E, 2I, H] and
    # `mlp.experts.down_proj` [E, H, I]: `save_pretrained(save_original_format=False)`,
    # the format transformers 5 re-saves a fused checkpoint in) instead of one tensor
    # per expert and projection.
    fused_experts: bool = False
    # Zero-centred RMSNorms (`(1 + w) * x`, Qwen3-Next and Qwen3.5): their weights are
    # drawn from the ranges above less 1, so the multipliers fall in the same ranges as
    # the other cases' (a DeltaNet layer's gated output norm, `w * x`, keeps them).
    zero_centred_norms: bool = False


def case_specs() -> list[CaseSpec]:
    return [
        CaseSpec(
            name="llama_gqa_untied",
            arch="llama",
            seed=1001,
            covers=[
                "llama",
                "gqa (4 heads / 2 kv heads)",
                "untied lm_head",
                "rope_theta inside rope_parameters (rope_type default)",
                "random RMSNorm weights",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 192,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
        ),
        CaseSpec(
            name="llama_tied_legacy_rope_eos",
            arch="llama",
            seed=1002,
            covers=[
                "llama",
                "mha (kv heads == heads)",
                "tied embeddings (no lm_head.weight in the file)",
                "legacy top-level rope_theta (no rope_parameters in config.json)",
                "stop on eos (eos chosen so that one prompt hits it)",
                "random RMSNorm weights",
            ],
            config={
                "vocab_size": 320,
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
                "tie_word_embeddings": True,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            final_norm_range=TIED_FINAL_NORM,
            rope_form="legacy_top_level",
            eos_mode="hit",
        ),
        CaseSpec(
            name="llama3_rope_one_kv_head",
            arch="llama",
            seed=1003,
            covers=[
                "llama",
                "llama3 rope scaling (factor 8, low 1, high 4, original_max_position_embeddings 32, rope_theta 500)",
                "exactly one kv head (4 heads / 1 kv head)",
                "head_dim 32 != hidden_size/num_attention_heads 16",
                "untied lm_head",
                "random RMSNorm weights",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            check_llama3_scaling_matters=True,
        ),
        CaseSpec(
            name="mistral_sliding_window",
            arch="mistral",
            seed=1004,
            covers=[
                "mistral",
                "sliding_window 16 (< prompt lengths 20 and 200; applied by transformers eager attention)",
                "gqa (4 heads / 2 kv heads)",
                "untied lm_head",
                "random RMSNorm weights",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 192,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_window": 16,
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            check_sliding_window_matters=True,
        ),
        CaseSpec(
            name="qwen2_bias_tied",
            arch="qwen2",
            seed=1005,
            covers=[
                "qwen2",
                "attention q/k/v bias (random, non-zero)",
                "gqa (4 heads / 2 kv heads)",
                "tied embeddings",
                "rope_theta 1e6 inside rope_parameters",
                "inactive sliding_window (use_sliding_window false, sliding_window 16, max_window_layers 1, no layer_types: must be ignored)",
                "random RMSNorm weights",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 192,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "tie_word_embeddings": True,
                "use_sliding_window": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            final_norm_range=TIED_FINAL_NORM,
            qwen_inactive_sliding_window=16,
        ),
        CaseSpec(
            name="qwen3_qk_norm_eos_list",
            arch="qwen3",
            seed=1006,
            covers=[
                "qwen3",
                "q_norm/k_norm per-head RMSNorm (random weights)",
                "head_dim 32 != hidden_size/num_attention_heads 16",
                "gqa (4 heads / 2 kv heads)",
                "tied embeddings",
                "eos list in generation_config.json ([A, B]) differing from config.json (A); one prompt stops on B",
                "random RMSNorm weights",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "tie_word_embeddings": True,
                "use_sliding_window": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            final_norm_range=TIED_FINAL_NORM,
            eos_mode="hit_genconfig_list",
        ),
        CaseSpec(
            name="llama_sharded",
            arch="llama",
            seed=1007,
            covers=[
                "llama",
                "sharded safetensors (model.safetensors.index.json + several shards)",
                "3 layers, hidden 128, 8 heads / 2 kv heads",
                "untied lm_head",
                "random RMSNorm weights",
            ],
            config={
                "vocab_size": 320,
                "hidden_size": 128,
                "intermediate_size": 128,
                "num_hidden_layers": 3,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            max_shard_size="200KB",
        ),
        CaseSpec(
            name="qwen3_moe_dense_layer",
            arch="qwen3_moe",
            seed=1008,
            covers=[
                "qwen3_moe",
                "8 experts, 2 per token, norm_topk_prob true (top-k weights renormalised)",
                "experts stored one tensor per expert and projection (mlp.experts.N.gate_proj)",
                "mlp_only_layers [1]: a dense MLP (intermediate_size 96) between two MoE layers",
                "q_norm/k_norm per head, head_dim 32 != hidden/heads 16",
                "gqa (4 heads / 2 kv heads), untied lm_head",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 96,
                "moe_intermediate_size": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [1],
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "tie_word_embeddings": False,
                "use_sliding_window": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
        ),
        CaseSpec(
            name="qwen3_moe_fused_sparse_step",
            arch="qwen3_moe",
            seed=1009,
            covers=[
                "qwen3_moe",
                "experts stored fused: mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]",
                "decoder_sparse_step 2: layer 0 dense, layer 1 MoE",
                "8 experts, 3 per token, norm_topk_prob false (softmax weights as they are)",
                "tied embeddings",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 128,
                "moe_intermediate_size": 48,
                "num_experts": 8,
                "num_experts_per_tok": 3,
                "norm_topk_prob": False,
                "decoder_sparse_step": 2,
                "mlp_only_layers": [],
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "tie_word_embeddings": True,
                "use_sliding_window": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            final_norm_range=TIED_FINAL_NORM,
            fused_experts=True,
        ),
        CaseSpec(
            name="olmoe_clip_qkv",
            arch="olmoe",
            seed=1010,
            covers=[
                "olmoe",
                "q_norm/k_norm over the whole q and k projections (not per head)",
                "clip_qkv 2.0 after the norms (q, k and v clamped)",
                "8 experts, 2 per token, norm_topk_prob false",
                "gqa (4 heads / 2 kv heads), untied lm_head",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 32,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "norm_topk_prob": False,
                "clip_qkv": 2.0,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "pad_token_id": 0,
            },
            check_clip_qkv_matters=True,
        ),
        CaseSpec(
            name="mixtral_block_sparse",
            arch="mixtral",
            seed=1011,
            covers=[
                "mixtral",
                "block_sparse_moe naming (experts.N.w1/w2/w3, block_sparse_moe.gate)",
                "4 experts, 2 per token, always renormalised",
                "gqa (4 heads / 2 kv heads), untied lm_head",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 48,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_window": None,
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
        ),
        CaseSpec(
            name="glm4_moe_partial_rotary_shared",
            arch="glm4_moe",
            seed=1012,
            covers=[
                "glm4_moe",
                "partial rotary (partial_rotary_factor 0.5, left to its default: the key is removed from config.json)",
                "attention_bias on q/k/v (not o), use_qk_norm (per head), head_dim 24 != hidden/heads 16",
                "first_k_dense_replace 1: layer 0 dense (intermediate_size 160), layers 1-2 MoE",
                "8 routed experts in 2 groups, topk_group 1, 2 per token: sigmoid scores, float32 correction bias",
                "1 shared expert, routed_scaling_factor 1.5, norm_topk_prob true",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 160,
                "moe_intermediate_size": 32,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "n_group": 2,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                "routed_scaling_factor": 1.5,
                "norm_topk_prob": True,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 24,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                "attention_bias": True,
                "use_qk_norm": True,
                "tie_word_embeddings": False,
                "num_mtp_layers": 0,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            config_postedit="drop_partial_rotary_factor",
        ),
        CaseSpec(
            name="deepseek_v3_mla_yarn",
            arch="deepseek_v3",
            seed=1013,
            covers=[
                "deepseek_v3",
                "multi-head latent attention: q_lora_rank 24, kv_lora_rank 16, qk_nope 8 + qk_rope 8, v_head_dim 12",
                "interleaved rope layout (rope_interleave true)",
                "yarn in rope_parameters: factor 4, original_max_position_embeddings 64, mscale = mscale_all_dim = 1 (softmax scale corrected)",
                "first_k_dense_replace 1; 8 routed experts in 4 groups, topk_group 2, 2 per token; 2 shared experts",
                "sigmoid scores with a float32 correction bias, norm_topk_prob true, routed_scaling_factor 2.5",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_shared_experts": 2,
                "n_group": 4,
                "topk_group": 2,
                "first_k_dense_replace": 1,
                "routed_scaling_factor": 2.5,
                "norm_topk_prob": True,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "q_lora_rank": 24,
                "kv_lora_rank": 16,
                "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 8,
                "v_head_dim": 12,
                "rope_interleave": True,
                "max_position_embeddings": 256,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                },
                "attention_bias": False,
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
        ),
        CaseSpec(
            name="deepseek_v3_plain_q_legacy_yarn",
            arch="deepseek_v3",
            seed=1014,
            covers=[
                "deepseek_v3",
                "q_lora_rank null (plain q_proj), rotate-half rope layout (rope_interleave false)",
                "legacy top-level rope_theta and rope_scaling {type: yarn, factor 2, mscale 0.707, mscale_all_dim 1}: attention_factor != 1",
                "attention_bias true (q_proj has none; kv_a and o do)",
                "experts stored fused (mlp.experts.gate_up_proj / down_proj)",
                "8 routed experts in 2 groups, topk_group 2, 3 per token, norm_topk_prob false; 1 shared expert; 2 dense layers first",
            ],
            config={
                "vocab_size": 384,
                "hidden_size": 64,
                "intermediate_size": 96,
                "moe_intermediate_size": 24,
                "n_routed_experts": 8,
                "num_experts_per_tok": 3,
                "n_shared_experts": 1,
                "n_group": 2,
                "topk_group": 2,
                "first_k_dense_replace": 2,
                "routed_scaling_factor": 1.0,
                "norm_topk_prob": False,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "q_lora_rank": None,
                "kv_lora_rank": 12,
                "qk_nope_head_dim": 12,
                "qk_rope_head_dim": 4,
                "v_head_dim": 8,
                "rope_interleave": False,
                "max_position_embeddings": 256,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 50000.0,
                    "factor": 2.0,
                    "original_max_position_embeddings": 128,
                    "mscale": 0.707,
                    "mscale_all_dim": 1.0,
                },
                "attention_bias": True,
                "tie_word_embeddings": False,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            fused_experts=True,
            config_postedit="yarn_legacy_rope_scaling",
        ),
    ]


# ---------------------------------------------------------------------------------------
# Model construction


def is_moe(config) -> bool:
    return bool(
        getattr(config, "num_experts", None)
        or getattr(config, "num_local_experts", None)
        or getattr(config, "n_routed_experts", None)
    )


def build_model(spec: CaseSpec) -> torch.nn.Module:
    config = CONFIG_CLASSES[spec.arch](**copy.deepcopy(spec.config))
    config._attn_implementation = "eager"
    if is_moe(config):
        # The experts' loop in the model file (a fixed order of the sums), not a
        # grouped matmul kernel.
        config._experts_implementation = "eager"
    torch.manual_seed(spec.seed)  # transformers' own init; fully overwritten below.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        # Sorted names: the draw order (hence the values) does not depend on module order.
        params = dict(model.named_parameters())  # tied lm_head appears once (as embed)
        for name in sorted(params):
            p = params[name]
            if name.endswith("norm.weight"):
                lo, hi = spec.final_norm_range if name == "model.norm.weight" else spec.norm_range
                if spec.zero_centred_norms and not name.endswith("linear_attn.norm.weight"):
                    lo, hi = lo - 1.0, hi - 1.0
                v = torch.rand(p.shape, generator=gen) * (hi - lo) + lo
            elif name.endswith(".bias"):
                v = torch.randn(p.shape, generator=gen) * spec.bias_std
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=gen) * spec.embed_std
            elif name == "lm_head.weight":
                v = torch.randn(p.shape, generator=gen) * spec.lm_head_std
            else:
                v = torch.randn(p.shape, generator=gen) * spec.linear_std
            p.copy_(v)
        # Buffers the checkpoint stores: sigmoid routers' correction bias, kept float32.
        biases = {n: b for n, b in model.named_buffers() if n.endswith(CORRECTION_BIAS)}
        values = {n: torch.randn(b.shape, generator=gen) * spec.correction_bias_std for n, b in sorted(biases.items())}
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for n, v in values.items():
            owner = model.get_submodule(n.rsplit(".", 1)[0])
            setattr(owner, CORRECTION_BIAS, torch.nn.Buffer(v.to(torch.float32)))
    return model


def load_f32(path: Path, config=None) -> torch.nn.Module:
    kwargs = {"dtype": torch.float32, "attn_implementation": "eager"}
    if config is not None:
        kwargs["config"] = config
    if is_moe(config if config is not None else AutoConfig.from_pretrained(path)):
        kwargs["experts_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    return model


# One expert's projection stored on its own, as transformers 5 saves experts by default.
EXPERT_TENSOR = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)


def stored_value_in_model(state: dict, name: str):
    """The model's value for stored tensor `name`: the same name, mixtral's
    block_sparse_moe renamed to mlp, or one expert's slice of the fused experts."""
    for n in (name, name.replace(".block_sparse_moe.", ".mlp.")):
        if n in state:
            return state[n]
    m = EXPERT_TENSOR.match(name)
    if not m:
        return None
    layer, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj in ("down_proj", "w2"):
        return state[f"{layer}.mlp.experts.down_proj"][e]
    gate_up = state[f"{layer}.mlp.experts.gate_up_proj"]
    inter = gate_up.shape[1] // 2
    return gate_up[e, :inter] if proj in ("gate_proj", "w1") else gate_up[e, inter:]


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def write_json_like_transformers(path: Path, obj: dict) -> None:
    # transformers writes config files with indent=2, sorted keys and a trailing newline.
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(safetensors.torch.load_file(f))
    return out


def verify_bf16_exact(path: Path, model: torch.nn.Module) -> int:
    """Every stored tensor is BF16 and the float32 model holds exactly its values."""
    stored = checkpoint_tensors(path)
    state = model.state_dict()
    covered = {name: torch.zeros(t.shape, dtype=torch.bool) for name, t in state.items()}
    for name, t in stored.items():
        want = torch.float32 if name.endswith(CORRECTION_BIAS) else torch.bfloat16
        if t.dtype != want:
            raise SystemExit(f"{path}: tensor {name} stored as {t.dtype}, expected {want}")
        v = stored_value_in_model(state, name)
        if v is None:
            raise SystemExit(f"{path}: stored tensor {name} not in the reloaded model")
        if not torch.equal(v, t.float()):
            raise SystemExit(f"{path}: reloaded {name} differs from the stored BF16 values")
        # Mark what it covers: the same view of a zero mask of the model's tensor.
        mask = stored_value_in_model(covered, name)
        mask.fill_(True)
    # Every model weight must come from the file (tied lm_head from embed_tokens), and
    # so must the correction biases.
    biases = [n for n in state if n.endswith(CORRECTION_BIAS)]
    if any(n not in stored for n in biases):
        raise SystemExit(f"{path}: a correction bias is not stored: {biases}")
    for name, t in state.items():
        if not bool(covered[name].all()):
            tied = name == "lm_head.weight" and model.config.tie_word_embeddings
            if not (tied and torch.equal(t, state["model.embed_tokens.weight"])):
                raise SystemExit(f"{path}: model weight {name} not loaded from the checkpoint")
    return len(stored)


# ---------------------------------------------------------------------------------------
# Generation and references


def eos_ids_of(model: torch.nn.Module) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A mixture of experts' routers (`mlp.gate`, `block_sparse_moe.gate`)."""
    return [m for n, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]


def sigmoid_router_gap(router: torch.nn.Module, logits: torch.Tensor) -> float:
    """The smallest gap that decides a group-limited sigmoid router's choice: between the
    topk_group-th and next group scores, and between the k-th and (k+1)-th choice values
    within the groups kept (inf where a choice has no runner-up)."""
    scores = logits.float().sigmoid()
    choice = scores + router.e_score_correction_bias.float()
    n, g, tg, k = choice.shape[-1], router.num_group, router.topk_group, router.top_k
    groups = choice.view(-1, g, n // g).topk(2, dim=-1)[0].sum(dim=-1)
    gap = float("inf")
    if tg < g:
        top = groups.topk(tg + 1, dim=-1).values
        gap = min(gap, float((top[:, tg - 1] - top[:, tg]).min()))
    idx = groups.topk(tg, dim=-1).indices
    mask = torch.zeros_like(groups).scatter_(1, idx, 1).bool()
    masked = choice.view(-1, g, n // g).masked_fill(~mask[..., None], float("-inf")).view(-1, n)
    if k < tg * (n // g):
        top = masked.topk(k + 1, dim=-1).values
        gap = min(gap, float((top[:, k - 1] - top[:, k]).min()))
    return gap


def greedy(model: torch.nn.Module, prompt: list[int]) -> dict:
    ids = torch.tensor([prompt], dtype=torch.long)
    # The smallest gap between a router's k-th and (k+1)-th probabilities over every
    # position and layer of the run (inf without routers, or with k = every expert).
    gap = [float("inf")]
    k = getattr(model.config, "num_experts_per_tok", None)

    def watch(module, _inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        if hasattr(module, CORRECTION_BIAS):
            gap[0] = min(gap[0], sigmoid_router_gap(module, logits))
            return
        probs = torch.softmax(logits.float(), dim=-1)
        if k is not None and probs.shape[-1] > k:
            top = torch.topk(probs, k + 1, dim=-1).values
            gap[0] = min(gap[0], float((top[..., k - 1] - top[..., k]).min()))

    hooks = [r.register_forward_hook(watch) for r in routers(model)]
    try:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=eos_ids_of(model)[0],
            )
    finally:
        for h in hooks:
            h.remove()
    new = out.sequences[0, len(prompt) :].tolist()
    # output_logits are the raw (unprocessed) float32 logits of each generated step.
    logits = [step[0].float() for step in out.logits]
    assert len(logits) == len(new), (len(logits), len(new))
    margins = []
    for step, tok in zip(logits, new):
        top = torch.topk(step, 2)
        if int(top.indices[0]) != tok:
            raise SystemExit(f"greedy token {tok} is not the argmax {int(top.indices[0])}")
        margins.append(float(top.values[0] - top.values[1]))
    return {"generated": new, "logits": logits, "margins": margins, "router_gap": gap[0]}


def uncached_check(model: torch.nn.Module, prompt: list[int], gen: dict) -> tuple[float, bool]:
    """Recompute every step's logits with one full no-cache forward over prompt+generated.

    Returns the max |difference| from the cached (generate) logits and whether the
    argmax agrees at every step: the reference does not depend on the KV-cache path.
    """
    seq = prompt + gen["generated"]
    ids = torch.tensor([seq[:-1]] if len(gen["generated"]) else [seq], dtype=torch.long)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[0].float()
    diffs, agree = 0.0, True
    for k, cached in enumerate(gen["logits"]):
        row = full[len(prompt) - 1 + k]
        diffs = max(diffs, float((row - cached).abs().max()))
        agree &= int(row.argmax()) == gen["generated"][k]
    return diffs, agree


def last_prompt_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt], dtype=torch.long), use_cache=False).logits[0, -1].float()


def f32_list(t: torch.Tensor) -> list[float]:
    """Decimals that give back the exact float32 bits whether parsed straight to f32 or to
    f64 and then cast to f32 (as serde_json does for f32 fields)."""
    out = []
    for x in t.numpy().astype(np.float32):
        # Shortest decimal that round-trips the float32 value.
        short = float(np.format_float_positional(x, unique=True, trim="-"))
        if np.float32(short) == x or (np.isnan(x) and np.isnan(short)):
            out.append(short)
        else:
            # Double rounding would bite: write the exact float32 value as a double.
            out.append(float(x))
    return out


def draw_prompts(spec: CaseSpec, model: torch.nn.Module, exclude: set[int]) -> tuple[list[dict], list[dict]]:
    """Random prompts of each length, redrawn while the greedy run has a near-tie."""
    rng = np.random.default_rng(spec.seed)
    vocab = spec.config["vocab_size"]
    allowed = np.array([t for t in range(vocab) if t not in exclude])
    chosen, rejected = [], []
    for length in PROMPT_LENGTHS:
        for attempt in range(MAX_RESEEDS):
            prompt = [int(x) for x in rng.choice(allowed, size=length)]
            g = greedy(model, prompt)
            if min(g["margins"]) >= MIN_MARGIN and g["router_gap"] >= MIN_ROUTER_GAP:
                chosen.append({"length": length, "prompt": prompt, "reseeds": attempt})
                break
            rejected.append(
                {"length": length, "min_margin": min(g["margins"])}
                | ({"min_router_gap": g["router_gap"]} if routers(model) else {})
            )
        else:
            raise SystemExit(f"{spec.name}: no prompt of length {length} without a near-tie")
    return chosen, rejected


def pick_hit_eos(spec: CaseSpec, model: torch.nn.Module, prompts: list[dict], avoid: set[int]) -> tuple[int, int]:
    """A token that the greedy continuation of one prompt produces at step >= 4, that no
    prompt contains and that the continuation has not produced before (so it stops there)."""
    in_prompts = {t for p in prompts for t in p["prompt"]}
    for p in sorted(prompts, key=lambda p: -p["length"]):
        gen = greedy(model, p["prompt"])["generated"]
        for k in range(4, len(gen) - 4):
            tok = gen[k]
            if tok not in in_prompts and tok not in avoid and tok not in gen[:k]:
                return tok, p["length"]
    raise SystemExit(f"{spec.name}: no usable eos candidate")


def postedit_config(spec: CaseSpec, path: Path) -> dict:
    """Rewrite config.json into legacy forms that released checkpoints use."""
    cfg_path = path / "config.json"
    cfg = read_json(cfg_path)
    edits = {}
    if spec.rope_form == "legacy_top_level":
        rp = cfg.pop("rope_parameters")
        assert rp["rope_type"] == "default" and set(rp) == {"rope_type", "rope_theta"}, rp
        cfg["rope_theta"] = rp["rope_theta"]
        edits["rope"] = "rope_parameters removed, top-level rope_theta written"
    if spec.config_postedit == "yarn_legacy_rope_scaling":
        rp = cfg.pop("rope_parameters")
        assert rp["rope_type"] == "yarn", rp
        cfg["rope_theta"] = rp.pop("rope_theta")
        rp.pop("rope_type")
        cfg["rope_scaling"] = {"type": "yarn", **rp}
        edits["rope"] = "rope_parameters -> top-level rope_theta and rope_scaling {type: yarn, ...}"
    if spec.config_postedit == "qwen3_next_legacy":
        # The released Qwen3-Next form: top-level rope_theta and partial_rotary_factor,
        # the layer pattern as full_attention_interval, no layer_types.
        rp = cfg.pop("rope_parameters")
        assert rp["rope_type"] == "default" and set(rp) <= {"rope_type", "rope_theta", "partial_rotary_factor"}, rp
        cfg["rope_theta"] = rp["rope_theta"]
        cfg["partial_rotary_factor"] = rp["partial_rotary_factor"]
        types = cfg.pop("layer_types")
        interval = spec.config["full_attention_interval"]
        assert types == [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(len(types))
        ], types
        cfg["full_attention_interval"] = interval
        edits["layer_types"] = (
            f"layer_types and rope_parameters removed; full_attention_interval {interval}, "
            "top-level rope_theta and partial_rotary_factor written"
        )
    if spec.config_postedit == "drop_partial_rotary_factor":
        dropped = [k for k in ("partial_rotary_factor",) if cfg.pop(k, None) is not None]
        if cfg.get("rope_parameters", {}).pop("partial_rotary_factor", None) is not None:
            dropped.append("rope_parameters.partial_rotary_factor")
        assert dropped, "no partial_rotary_factor to drop"
        edits["partial_rotary_factor"] = f"removed {dropped}: the family's default (0.5) applies"
    if spec.qwen_inactive_sliding_window is not None:
        assert cfg["use_sliding_window"] is False
        cfg["sliding_window"] = spec.qwen_inactive_sliding_window
        cfg["max_window_layers"] = 1
        cfg.pop("layer_types", None)
        edits["sliding_window"] = (
            f"sliding_window={spec.qwen_inactive_sliding_window}, use_sliding_window=false, "
            "max_window_layers=1, layer_types removed"
        )
    write_json_like_transformers(cfg_path, cfg)
    return edits


def set_eos(path: Path, config_eos: int, genconfig_eos: int | list[int]) -> None:
    cfg = read_json(path / "config.json")
    cfg["eos_token_id"] = config_eos
    write_json_like_transformers(path / "config.json", cfg)
    gc = read_json(path / "generation_config.json")
    gc["eos_token_id"] = genconfig_eos
    # A hand-written generation_config (as releases ship) is not derived from config.json.
    gc.pop("_from_model_config", None)
    write_json_like_transformers(path / "generation_config.json", gc)


def compare_models(a: torch.nn.Module, b: torch.nn.Module, prompts: list[dict]) -> float:
    diff = 0.0
    for p in prompts:
        diff = max(diff, float((last_prompt_logits(a, p["prompt"]) - last_prompt_logits(b, p["prompt"])).abs().max()))
    return diff


def reference_records(spec: CaseSpec, model: torch.nn.Module, prompts: list[dict], eos_ids: list[int]) -> tuple[list[dict], float]:
    """Each prompt's greedy run as reference.json records it, checked against one
    uncached forward; and the largest cached-against-uncached logit difference."""
    records = []
    max_uncached = 0.0
    for p in prompts:
        g = greedy(model, p["prompt"])
        first = last_prompt_logits(model, p["prompt"])
        # The recorded first-step logits are generate()'s own (cached prefill) logits.
        first_gen = g["logits"][0]
        diff, agree = uncached_check(model, p["prompt"], g)
        if not agree:
            raise SystemExit(f"{spec.name}: cached and uncached greedy disagree")
        max_uncached = max(max_uncached, diff, float((first - first_gen).abs().max()))
        gen = g["generated"]
        stopped = bool(gen) and gen[-1] in eos_ids
        top2 = torch.topk(first_gen, 2)
        records.append(
            {
                "prompt_length": p["length"],
                "prompt_ids": p["prompt"],
                "generated_ids": gen,
                "stopped_on_eos": stopped,
                "num_generated": len(gen),
                "first_step_logits": f32_list(first_gen),
                "first_step_top2": [int(top2.indices[0]), int(top2.indices[1])],
                "step_margins": g["margins"],
                "min_margin": min(g["margins"]),
                "distinct_generated": len(set(gen)),
                "reseeds": p["reseeds"],
            }
            | ({"min_router_gap": g["router_gap"]} if routers(model) else {})
        )
    return records, max_uncached


def run_case(spec: CaseSpec, out: Path) -> dict:
    path = out / spec.name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    model = build_model(spec)
    save_kwargs = {"safe_serialization": True}
    if spec.max_shard_size:
        save_kwargs["max_shard_size"] = spec.max_shard_size
    if spec.fused_experts:
        save_kwargs["save_original_format"] = False
    model.save_pretrained(path, **save_kwargs)
    # The model as built (its BF16 weights and float32 buffers, widened): the reference
    # must be what the saved files give back (a buffer saved at another precision than
    # it computed with would make the reference disagree with its own checkpoint).
    built = model.to(torch.float32).eval()
    del model
    checks: dict = {}

    # Reference as transformers wrote it, before any post-edit.
    as_written = load_f32(path)
    edits = postedit_config(spec, path)
    if edits:
        checks["config_postedits"] = edits
    model = load_f32(path)
    checks["tensors_bf16_exact"] = verify_bf16_exact(path, model)

    base_eos = spec.config["eos_token_id"]
    prompts, rejected = draw_prompts(spec, model, exclude={base_eos})
    # Every parameter and stored buffer as built, bit for bit; the buffers the model
    # derives (rotary inv_freq, which the BF16 cast rounded in the built model) as the
    # reloaded model derives them; then the same logits.
    built_state, loaded_state = built.state_dict(), model.state_dict()
    if built_state.keys() != loaded_state.keys():
        raise SystemExit(f"{spec.name}: reloaded tensors differ: {built_state.keys() ^ loaded_state.keys()}")
    for name, t in built_state.items():
        u = loaded_state[name]
        if t.dtype != u.dtype or not torch.equal(t, u):
            raise SystemExit(f"{spec.name}: {name} reloads as {u.dtype}, not the {t.dtype} values it was built with")
    derived = dict(model.named_buffers())
    with torch.no_grad():
        for name, buf in built.named_buffers():
            if name not in built_state:
                buf.copy_(derived[name])
    diff = compare_models(built, model, prompts)
    if diff != 0.0:
        raise SystemExit(f"{spec.name}: the saved files give logits {diff} away from the model built")
    checks["reference_reproduces_from_saved_files"] = {"tensors": len(built_state), "max_abs_logit_diff": diff}
    del built

    if edits:
        # The legacy config must load to the same model: same rope, same window handling.
        diff = compare_models(as_written, model, prompts)
        if diff != 0.0:
            raise SystemExit(f"{spec.name}: post-edited config.json changes the logits by {diff}")
        checks["postedit_loads_identically"] = {
            "max_abs_logit_diff": diff,
            "rope_parameters_after_load": dict(model.config.rope_parameters),
            "sliding_window_after_load": getattr(model.config, "sliding_window", None),
            "layer_types_after_load": getattr(model.config, "layer_types", None),
        }
    del as_written

    if spec.eos_mode != "fixed":
        hit, from_len = pick_hit_eos(spec, model, prompts, avoid={base_eos})
        if spec.eos_mode == "hit":
            set_eos(path, hit, hit)
        else:
            set_eos(path, base_eos, [base_eos, hit])
        checks["eos_chosen_from_prompt_length"] = from_len
        model = load_f32(path)
    eos_ids = eos_ids_of(model)
    for p in prompts:
        if set(p["prompt"]) & set(eos_ids):
            raise SystemExit(f"{spec.name}: a prompt contains eos")

    if spec.check_sliding_window_matters:
        # transformers applies the window through the sliding-window causal mask; loading
        # the same weights with the window disabled must change the long prompts' logits.
        nowin_cfg = AutoConfig.from_pretrained(path)
        nowin_cfg.sliding_window = None
        nowin = AutoModelForCausalLM.from_pretrained(
            path, config=nowin_cfg, dtype=torch.float32, attn_implementation="eager"
        )
        per_len = {}
        for p in prompts:
            d = float((last_prompt_logits(model, p["prompt"]) - last_prompt_logits(nowin, p["prompt"])).abs().max())
            per_len[str(p["length"])] = d
        if not (per_len["200"] > 1e-2 and per_len["20"] > 1e-2 and per_len["1"] == 0.0 and per_len["3"] == 0.0):
            raise SystemExit(f"{spec.name}: sliding window has no effect where it should: {per_len}")
        checks["sliding_window_effect_max_abs_logit_diff_by_prompt_length"] = per_len

    if spec.check_llama3_scaling_matters:
        plain_cfg = AutoConfig.from_pretrained(path)
        plain_cfg.rope_parameters = {"rope_type": "default", "rope_theta": plain_cfg.rope_parameters["rope_theta"]}
        plain = AutoModelForCausalLM.from_pretrained(
            path, config=plain_cfg, dtype=torch.float32, attn_implementation="eager"
        )
        per_len = {}
        for p in prompts:
            d = float((last_prompt_logits(model, p["prompt"]) - last_prompt_logits(plain, p["prompt"])).abs().max())
            per_len[str(p["length"])] = d
        if not (per_len["200"] > 1e-2 and per_len["20"] > 1e-2 and per_len["1"] == 0.0):
            raise SystemExit(f"{spec.name}: llama3 scaling has no effect: {per_len}")
        checks["llama3_scaling_effect_max_abs_logit_diff_by_prompt_length"] = per_len

    if spec.check_clip_qkv_matters:
        noclip_cfg = AutoConfig.from_pretrained(path)
        noclip_cfg.clip_qkv = None
        noclip = load_f32(path, noclip_cfg)
        per_len = {
            str(p["length"]): float(
                (last_prompt_logits(model, p["prompt"]) - last_prompt_logits(noclip, p["prompt"])).abs().max()
            )
            for p in prompts
        }
        if not all(d > 1e-2 for d in per_len.values()):
            raise SystemExit(f"{spec.name}: clip_qkv has no effect: {per_len}")
        checks["clip_qkv_effect_max_abs_logit_diff_by_prompt_length"] = per_len

    records, max_uncached = reference_records(spec, model, prompts, eos_ids)
    checks["uncached_vs_generate_max_abs_logit_diff"] = max_uncached

    cfg = read_json(path / "config.json")
    ref = {
        "schema_version": SCHEMA_VERSION,
        "case": spec.name,
        "model_type": cfg["model_type"],
        "architectures": cfg["architectures"],
        "covers": spec.covers,
        "seed": spec.seed,
        "generator": {
            "script": "tests/conformance/make_fixtures.py",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "weights_dtype": "bfloat16",
        "compute_dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager" if routers(model) else None,
        "init": {
            "embed_std": spec.embed_std,
            "linear_std": spec.linear_std,
            "lm_head_std": None if spec.config["tie_word_embeddings"] else spec.lm_head_std,
            "bias_std": spec.bias_std,
            "norm_uniform": list(spec.norm_range),
            "final_norm_uniform": list(spec.final_norm_range),
        }
        | ({"zero_centred_norms_drawn_less_1": True} if spec.zero_centred_norms else {}),
        "generation": {
            "do_sample": False,
            "max_new_tokens": MAX_NEW_TOKENS,
            "eos_token_ids": eos_ids,
            "config_eos_token_id": cfg["eos_token_id"],
        },
        "min_margin_threshold": MIN_MARGIN,
        "rejected_prompts": rejected,
        "min_margin": min(r["min_margin"] for r in records),
        "checks": checks,
        "prompts": records,
    }
    write_json_like_transformers(path / "reference.json", ref)
    files = sorted(f.name for f in path.iterdir())
    sizes = {f: (path / f).stat().st_size for f in files}
    return {
        "name": spec.name,
        "model_type": cfg["model_type"],
        "covers": spec.covers,
        "files": files,
        "bytes": sum(sizes.values()),
        "checkpoint_bytes": sum(v for k, v in sizes.items() if k.endswith(".safetensors")),
        "sharded": (path / "model.safetensors.index.json").exists(),
        "num_tensors": checks["tensors_bf16_exact"],
        "eos_token_ids": eos_ids,
        "prompt_lengths": [r["prompt_length"] for r in records],
        "min_margin": ref["min_margin"],
        "rejected_prompts": len(rejected),
        "_records": records,
    }


def generate(all_specs: list[CaseSpec], default_out: Path, script: str, doc: str) -> tuple[list[dict], Path]:
    """Parses `--out` (default `default_out`) and `--only`, makes those of
    `all_specs` asked for, and writes their `index.json` (the other cases keeping
    their entries, in `all_specs`' order); `script` is recorded as the generator.
    Returns the results and the directory."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=default_out)
    ap.add_argument("--only", nargs="*", help="generate only these case names (index.json keeps the others' entries)")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # one summation order for the references
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)

    specs = [s for s in all_specs if not args.only or s.name in args.only]
    results = [run_case(s, args.out) for s in specs]

    cases = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
    if args.only and (args.out / "index.json").exists():
        # The other cases keep their entries, in the order the specs list them.
        old = {c["name"]: c for c in read_json(args.out / "index.json")["cases"]}
        old.update({c["name"]: c for c in cases})
        order = [s.name for s in all_specs]
        cases = sorted(old.values(), key=lambda c: order.index(c["name"]) if c["name"] in order else len(order))
    index = {
        "schema_version": SCHEMA_VERSION,
        "generator": {
            "script": script,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "cases": cases,
    }
    write_json_like_transformers(args.out / "index.json", index)
    return results, args.out


def main() -> None:
    results, out = generate(case_specs(), REPO_ROOT / "tests" / "fixtures" / "tiny", "tests/conformance/make_fixtures.py", __doc__)
    print(
        f"{'case':30} {'type':8} {'KiB':>6} {'ckpt':>6} {'rej':>3} {'min_margin':>10}  per prompt: len gen distinct eos margin"
    )
    for r in results:
        per = "  ".join(
            f"{x['prompt_length']}:{x['num_generated']}/{x['distinct_generated']}{'E' if x['stopped_on_eos'] else ''}/{x['min_margin']:.3g}"
            for x in r["_records"]
        )
        print(
            f"{r['name']:30} {r['model_type']:8} {r['bytes'] / 1024:6.0f} {r['checkpoint_bytes'] / 1024:6.0f} "
            f"{r['rejected_prompts']:3d} {r['min_margin']:10.4g}  {per}"
        )
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"total {total / 1024:.0f} KiB under {out}")


if __name__ == "__main__":
    sys.exit(main())
