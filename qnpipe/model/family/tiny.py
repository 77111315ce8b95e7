"""Tiny random models of every MoE family mlx-lm runs, built from mlx-lm's own classes.

For tests (the seam against mlx-lm's forward, convert round trips) and `qnpipe make-tiny`.
Every tensor whose default init is all zeros or a constant (norms, biases, DeepSeek-style
routers that start at zero weights) is randomised: a zero router sends every token to the same
experts with equal weights and would hide a routing bug (families.md §0 trap 4(b)).
"""

from __future__ import annotations

import copy
import importlib
import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear

from qnpipe.model.family.skeleton import top_k

# vocab_size 256 is below the committed tiny tokenizer's 1024 ids: make-tiny raises it to fit.
V = 256
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
            tie_word_embeddings=False)

# One small config per family: 2-4 layers, 8-16 experts of width 32, H=64, V=256.
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {**BASE, "model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 16,
                  "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    "qwen2_moe": {**BASE, "model_type": "qwen2_moe", "num_hidden_layers": 2, "num_experts": 16,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    "mixtral": {**BASE, "model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "gpt_oss": {**BASE, "model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 16,
                "num_experts_per_tok": 4, "intermediate_size": 64, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "deepseek_v3": {**BASE, "model_type": "deepseek_v3", "num_hidden_layers": 3, "n_routed_experts": 16,
                    "n_shared_experts": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "v_head_dim": 16,
                    "qk_nope_head_dim": 16, "num_key_value_heads": 4, "norm_topk_prob": True},
    "glm4_moe": {**BASE, "model_type": "glm4_moe", "num_hidden_layers": 3, "n_routed_experts": 16,
                 "n_shared_experts": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.5,
                 "norm_topk_prob": True, "rope_scaling": None, "use_qk_norm": True, "attention_bias": True,
                 "partial_rotary_factor": 0.5},
    "dots1": {**BASE, "model_type": "dots1", "num_hidden_layers": 3, "n_routed_experts": 16, "n_shared_experts": 1,
              "num_experts_per_tok": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
              "norm_topk_prob": True, "routed_scaling_factor": 2.0, "scoring_func": "noaux_tc"},
    "llama4": {"model_type": "llama4", "text_config": {
        **BASE, "model_type": "llama4_text", "num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 1,
        "intermediate_size": 32, "intermediate_size_mlp": 96, "interleave_moe_layer_step": 2, "attention_bias": False,
        "attention_chunk_size": 16, "rope_scaling": None, "use_qk_norm": True}},
    "minimax": {**BASE, "model_type": "minimax", "num_hidden_layers": 2, "num_local_experts": 16,
                "num_experts_per_tok": 4, "intermediate_size": 32, "shared_intermediate_size": 0, "rotary_dim": 8},
    "olmoe": {**BASE, "model_type": "olmoe", "num_hidden_layers": 2, "num_experts": 16, "num_experts_per_tok": 4,
              "intermediate_size": 32},
    "phixtral": {"model_type": "phixtral", "num_vocab": V, "model_dim": 64, "num_heads": 4, "num_layers": 2,
                 "rotary_dim": 8, "num_experts_per_tok": 2, "num_local_experts": 4},
    "nemotron_h": {**BASE, "model_type": "nemotron_h", "hybrid_override_pattern": list("M*E-E"),
                   "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
                   "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2, "mlp_bias": False,
                   "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True, "moe_intermediate_size": 32,
                   "moe_shared_expert_intermediate_size": 48, "n_group": 1, "n_routed_experts": 16,
                   "n_shared_experts": 1, "topk_group": 1, "num_experts_per_tok": 4, "norm_topk_prob": True,
                   "routed_scaling_factor": 2.0, "moe_latent_size": 32},
    "qwen3_next": {**BASE, "model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 2,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 16,
                   "num_experts_per_tok": 4, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 48,
                   "mlp_only_layers": [], "moe_intermediate_size": 32, "partial_rotary_factor": 0.25,
                   "norm_topk_prob": True},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": {
        **BASE, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, "full_attention_interval": 2,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 16, "num_experts_per_tok": 4,
        "shared_expert_intermediate_size": 48, "moe_intermediate_size": 32}},
    "ernie4_5_moe": {**BASE, "model_type": "ernie4_5_moe", "num_hidden_layers": 3, "use_bias": False,
                     "moe_num_experts": 16, "moe_k": 4, "moe_intermediate_size": 32, "moe_layer_start_index": 1,
                     "moe_num_shared_experts": 1},
    "bailing_moe": {**BASE, "model_type": "bailing_moe", "num_hidden_layers": 3, "moe_intermediate_size": 32,
                    "num_experts": 16, "num_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 4,
                    "first_k_dense_replace": 1, "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
    "granitemoe": {**BASE, "model_type": "granitemoe", "num_hidden_layers": 2, "logits_scaling": 4.0,
                   "attention_multiplier": 0.25, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                   "attention_bias": False, "num_local_experts": 8, "num_experts_per_tok": 2,
                   "intermediate_size": 32},
    "gemma4_text": {**BASE, "model_type": "gemma4_text", "num_hidden_layers": 4, "head_dim": 16,
                    "global_head_dim": 32, "num_key_value_heads": 1, "num_kv_shared_layers": 0,
                    "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": V, "sliding_window": 8,
                    "sliding_window_pattern": 2, "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
                    "moe_intermediate_size": 32, "tie_word_embeddings": True},
    "deepseek_v2": {**BASE, "model_type": "deepseek_v2", "num_hidden_layers": 3, "n_routed_experts": 16,
                    "n_shared_experts": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                    "routed_scaling_factor": 1.5, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16,
                    "v_head_dim": 16, "qk_nope_head_dim": 16, "num_key_value_heads": 4,
                    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
    "phimoe": {**BASE, "model_type": "phimoe", "num_hidden_layers": 2, "num_local_experts": 8,
               "num_experts_per_tok": 2, "intermediate_size": 32, "original_max_position_embeddings": 4096,
               "rope_scaling": None},
    "hunyuan": {**BASE, "model_type": "hunyuan", "num_hidden_layers": 4, "attention_bias": False, "moe_topk": [2, 3, 4, 2],
                "num_experts": 16, "num_shared_expert": [1, 1, 2, 1], "use_mixed_mlp_moe": True, "use_qk_norm": True,
                "use_cla": True, "cla_share_factor": 2, "moe_intermediate_size": [32, 48, 32, 64], "intermediate_size": 32,
                "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}},
    "step3p5": {**BASE, "model_type": "step3p5", "num_hidden_layers": 3, "num_attention_groups": 2,
                "intermediate_size": 96, "moe_num_experts": 16, "moe_top_k": 4, "moe_intermediate_size": 32,
                "share_expert_dim": 32, "moe_layers_enum": "1,2", "swiglu_limits": [0, 7.0, 0],
                "swiglu_limits_shared": [0, 0, 5.0], "sliding_window": 8,
                "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
    "jamba": {**BASE, "model_type": "jamba", "num_hidden_layers": 4, "attn_layer_offset": 1, "attn_layer_period": 2,
              "expert_layer_offset": 1, "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 8,
              "mamba_expand": 2, "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
    "lfm2_moe": {**BASE, "model_type": "lfm2_moe", "num_hidden_layers": 4, "moe_intermediate_size": 32,
                 "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True, "use_expert_bias": True,
                 "num_dense_layers": 1, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
                 "full_attn_idxs": [1, 3], "routed_scaling_factor": 1.5},
    "afmoe": {**BASE, "model_type": "afmoe", "num_hidden_layers": 4, "moe_intermediate_size": 32, "num_experts": 16,
              "num_experts_per_tok": 4, "num_shared_experts": 1, "num_dense_layers": 1, "n_group": 4, "topk_group": 2,
              "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "Klear": {**BASE, "model_type": "Klear", "num_hidden_layers": 3, "attention_bias": False, "mlp_only_layers": [0],
              "num_experts": 16, "num_experts_per_tok": 4, "decoder_sparse_step": 1, "n_shared_experts": 1,
              "moe_intermediate_size": 32, "norm_topk_prob": True},
    "longcat_flash": {**BASE, "model_type": "longcat_flash", "attention_method": "MLA", "zero_expert_type": "identity",
                      "ffn_hidden_size": 96, "moe_topk": 4, "expert_ffn_hidden_size": 32, "n_routed_experts": 16,
                      "zero_expert_num": 4, "num_layers": 2, "kv_lora_rank": 32, "q_lora_rank": 48,
                      "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "routed_scaling_factor": 2.0,
                      "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "attention_bias": False},
}

_MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "v_head_dim": 16, "qk_nope_head_dim": 16,
       "num_key_value_heads": 4}
# The switch-building mlx-lm model files the study had no config for (registry: model/family/registry.py).
CONFIGS.update({
 "deepseek": {**BASE, "model_type": "deepseek", "num_hidden_layers": 3, "n_routed_experts": 16, "n_shared_experts": 1,
              "num_experts_per_tok": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1},
 "deepseek_v32": {**BASE, **_MLA, "model_type": "deepseek_v32", "num_hidden_layers": 3, "n_routed_experts": 16,
                  "n_shared_experts": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                  "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                  "index_head_dim": 32, "index_n_heads": 2, "index_topk": 4},
 "glm4_moe_lite": {**BASE, **_MLA, "model_type": "glm4_moe_lite", "num_hidden_layers": 3, "n_routed_experts": 16,
                   "n_shared_experts": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                   "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8},
 "mistral4": {**BASE, **_MLA, "model_type": "mistral4", "num_hidden_layers": 3, "n_routed_experts": 16,
              "n_shared_experts": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
              "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                                  "original_max_position_embeddings": 4096}},
 "exaone_moe": {**BASE, "model_type": "exaone_moe", "num_hidden_layers": 3, "num_experts": 16,
                "num_experts_per_tok": 4, "num_shared_experts": 1, "moe_intermediate_size": 32, "sliding_window": 8,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                "is_moe_layer": [False, True, True], "n_group": 4, "topk_group": 2},
 "mellum": {**BASE, "model_type": "mellum", "num_hidden_layers": 2, "num_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 32, "norm_topk_prob": True, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0},
                                "full_attention": {"rope_theta": 1000000.0}}},
 "laguna": {**BASE, "model_type": "laguna", "num_hidden_layers": 3, "num_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "moe_router_logit_softcapping": 30.0, "moe_routed_scaling_factor": 2.0},
 "granitemoehybrid": {**BASE, "model_type": "granitemoehybrid", "num_hidden_layers": 4, "attention_bias": False,
                      "embedding_multiplier": 12.0, "attention_multiplier": 0.25, "logits_scaling": 4.0,
                      "residual_multiplier": 0.22, "layer_types": ["mamba", "attention", "mamba", "attention"],
                      "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                      "shared_intermediate_size": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
                      "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
                      "mamba_conv_bias": True, "tie_word_embeddings": False},
 "bailing_moe_linear": {**BASE, "model_type": "bailing_moe_linear", "num_hidden_layers": 4, "moe_intermediate_size": 32,
                        "num_experts": 16, "num_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 4,
                        "first_k_dense_replace": 1, "layer_group_size": 2, "group_norm_size": 2,
                        "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "n_group": 4,
                        "topk_group": 2, "routed_scaling_factor": 2.5, "use_qk_norm": True,
                        "partial_rotary_factor": 0.5},
 "bailing_hybrid": {**BASE, **_MLA, "model_type": "bailing_hybrid", "num_hidden_layers": 4, "moe_intermediate_size": 32,
                    "num_experts": 16, "num_shared_experts": 1, "num_experts_per_tok": 4, "first_k_dense_replace": 1,
                    "layer_group_size": 2, "group_norm_size": 2, "n_group": 4, "topk_group": 2,
                    "routed_scaling_factor": 2.5},
 "bailing_moe_v3": {**BASE, **_MLA, "model_type": "bailing_moe_v3", "num_hidden_layers": 4, "moe_intermediate_size": 32,
                    "moe_shared_expert_intermediate_size": 32, "num_experts": 16, "num_shared_experts": 1,
                    "num_experts_per_tok": 4, "first_k_dense_replace": 1, "layer_group_size": 2, "n_group": 4,
                    "topk_group": 2, "routed_scaling_factor": 2.5},
 "kimi_linear": {**BASE, **_MLA, "model_type": "kimi_linear", "num_hidden_layers": 4, "num_experts": 16,
                 "num_experts_per_token": 4, "num_shared_experts": 1, "moe_intermediate_size": 32,
                 "first_k_dense_replace": 1, "num_expert_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                 "model_max_length": 4096,
                 "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                                        "head_dim": 16, "short_conv_kernel_size": 4}},
 "mimo_v2_flash": {**BASE, "model_type": "mimo_v2_flash", "num_hidden_layers": 3, "num_experts_per_tok": 4,
                   "hybrid_layer_pattern": [0, 1, 0], "moe_layer_freq": [0, 1, 1],
                   "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                   "sliding_window_size": 8, "moe_intermediate_size": 32, "n_shared_experts": None,
                   "n_routed_experts": 16, "routed_scaling_factor": None, "topk_method": "noaux_tc",
                   "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                   "layernorm_epsilon": 1e-6, "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4,
                   "swa_num_key_value_heads": 2, "v_head_dim": 16, "swa_head_dim": 16, "swa_v_head_dim": 16,
                   "partial_rotary_factor": 1},
 "minimax_m3_vl": {"model_type": "minimax_m3_vl", "text_config": {
     **BASE, "model_type": "minimax_m3", "num_hidden_layers": 2, "num_local_experts": 16, "num_experts_per_tok": 4,
     "intermediate_size": 32, "dense_intermediate_size": 96, "shared_intermediate_size": 32,
     "moe_layer_freq": [0, 1]}},
 "kimi_k3": {"model_type": "kimi_k3", "text_config": {
     **BASE, **_MLA, "model_type": "kimi_linear", "num_hidden_layers": 4, "num_experts": 16,
     "num_experts_per_token": 4, "num_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
     "num_expert_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "routed_expert_hidden_size": 32,
     "latent_moe_use_norm": True,
     "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                            "head_dim": 16, "short_conv_kernel_size": 4}}},
 "deepseek_v41": {"model_type": "deepseek_v41", "vocab_size": V, "hidden_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "o_groups": 2,
                  "o_lora_rank": 32, "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4,
                  "sliding_window": 8, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "hc_mult": 2,
                  "hc_sinkhorn_iters": 3, "rms_norm_eps": 1e-6},
})

# Router tensors that default to zeros and would hide their path: filled with random values.
_RANDOMIZE = re.compile(r"(e_score_correction_bias|expert_bias|per_expert_scale)$")

QUANTS: dict[str, dict[str, Any]] = {
    "affine4": {"group_size": 32, "bits": 4, "mode": "affine"},
    "affine8": {"group_size": 64, "bits": 8, "mode": "affine"},
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
}



__all__ = ["CONFIGS", "QUANTS", "build_random", "quantize", "tiny_config", "top_k"]


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """A copy of the tiny config of `family` (a key of CONFIGS), top-level keys overridden."""
    if family not in CONFIGS:
        raise KeyError(f"no tiny config for family {family!r}; known: {', '.join(sorted(CONFIGS))}")
    return {**copy.deepcopy(CONFIGS[family]), **overrides}


def build_random(config: dict[str, Any], quant: str | None = None, seed: int = 1234) -> nn.Module:
    """mlx-lm's model of `config` with random weights (deterministic per seed), optionally quantized
    (`quant` a key of QUANTS; mxfp4 quantizes the plain and switch linears only, as mlx-lm's gpt-oss)."""
    mod = importlib.import_module(f"mlx_lm.models.{_module(config['model_type'])}")
    mx.random.seed(seed)  # before construction: the init draws its keys eagerly
    model = mod.Model(mod.ModelArgs.from_dict(copy.deepcopy(config)))
    fresh = []
    for name, p in tree_flatten(model.parameters()):
        assert isinstance(p, mx.array)
        zero = mx.issubdtype(p.dtype, mx.floating) and not bool(mx.any(p != 0))
        if zero or _RANDOMIZE.search(name) or name.endswith((".bias", "sinks")):
            fresh.append((name, (0.1 * mx.random.normal(p.shape)).astype(p.dtype)))
    model.load_weights(fresh, strict=False)
    if quant is not None:
        quantize(model, quant)
    model.eval()
    mx.eval(model.parameters())
    return model


def quantize(model: nn.Module, quant: str) -> None:
    """Quantize `model` in place as `QUANTS[quant]` says (every linear whose input fits the group)."""
    q = QUANTS[quant]

    def pred(path: str, m: nn.Module) -> bool:
        w = getattr(m, "weight", None)
        if not hasattr(m, "to_quantized") or not isinstance(w, mx.array):
            return False
        return w.shape[-1] % q["group_size"] == 0 and (
            q["mode"] == "affine" or isinstance(m, SwitchLinear | nn.Linear))

    nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q["mode"], class_predicate=pred)


def _module(model_type: str) -> str:
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type)
