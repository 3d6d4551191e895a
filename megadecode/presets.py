"""Built-in model presets, written as HF config.json dicts so they round-trip through the loader.

`tiny-*` presets are CPU-sized (tests, CI, the README's first command); their vocabulary is the
byte-level tokenizer's (256 bytes + BOS/EOS/PAD); `tiny-deepseek-v3-mtp` carries a multi-token-prediction layer.
`qwen3-30b-a3b` is the real Qwen3-30B-A3B shape.
`*-fp8` presets hold their routed experts in FP8 as an FP8 checkpoint loads (quant/fp8.py): the
quantization_config of Qwen3-30B-A3B-FP8 / DeepSeek-V3 (blocks of 128 x 128; the tiny ones 32 x 32, so that
their 32-wide experts hold whole blocks and their 40-row MLA projection a partial one).
"""

from __future__ import annotations

import copy

from .config import ConfigError, ModelConfig, config_from_hf
from .tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID

# Kimi K3's public dims (SPEC.md); bos/eos ids are Kimi K2's tokenizer's (K3's are not public).
_K3 = {
    "model_type": "kimi_k3", "vocab_size": 163840, "hidden_size": 7168, "num_attention_heads": 96,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4},
    "intermediate_size": 33792, "latent_size": 3584, "moe_intermediate_size": 3072, "num_experts": 896,
    "num_experts_per_tok": 16, "num_shared_experts": 2, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "moe_hidden_act": "situ", "attn_res_block_size": 12,
    "mla_output_gate": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585,
}

PRESETS: dict[str, dict] = {
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": BYTE_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    },
    "tiny-deepseek-v3": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": BYTE_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "intermediate_size": 96, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_interleave": True,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    },
    # Layers: 0 KDA + dense MLP, 1 KDA + MoE, 2 MLA (NoPE) + MoE, 3 KDA + MoE. Layer kinds are given the way
    # Kimi-Linear's config.json gives them (1-indexed lists in `linear_attn_config`).
    "tiny-kimi-linear": {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": BYTE_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2, 4], "num_heads": 4, "head_dim": 16,
                               "short_conv_kernel_size": 4},
        "intermediate_size": 96, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "num_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "n_shared_experts": 1, "routed_scaling_factor": 2.446, "norm_topk_prob": True,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
        "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    },
    # Layers: 0 KDA + dense SwiGLU, 1 KDA, 2 MLA (gated, NoPE), 3 KDA, 4 MLA; 1-4 LatentMoE with 16 MXFP4
    # experts (top 4, groups), SiTU-GLU. AttnRes blocks of 2 layers: {0, 1}, {2, 3}, {4}.
    "tiny-k3": {
        "model_type": "kimi_k3", "vocab_size": BYTE_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 5,
        "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16,
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention",
                        "full_attention"],
        "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4},
        "intermediate_size": 96, "first_k_dense_replace": 1, "latent_size": 32, "moe_intermediate_size": 32,
        "num_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "num_shared_experts": 2,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True, "moe_hidden_act": "situ",
        "attn_res_block_size": 2, "mla_output_gate": True,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    },
    # One K3 layer at true dims: a KDA layer (69 of K3's 93 layers are KDA) with LatentMoE (every layer but
    # layer 0 is LatentMoE), for per-layer microbenchmarks.
    "k3-layer": {**_K3, "num_hidden_layers": 1, "layer_types": ["linear_attention"], "first_k_dense_replace": 0},
    # True K3 dims, 4 layers: 3 KDA + 1 MLA (the default layer kinds), all LatentMoE with 896 MXFP4 experts.
    "k3-mini": {**_K3, "num_hidden_layers": 4, "first_k_dense_replace": 0},
    # True K3 dims, 12 layers (9 KDA + 3 MLA, the default kinds), all LatentMoE: 205.8 GB of weights by weight_bytes
    # (bf16 trunk, 4.25-bit experts), more than one H200 holds; 111.4 GB per GPU with --ep 2 (expert parallelism).
    "k3-ep": {**_K3, "num_hidden_layers": 12, "first_k_dense_replace": 0},
    # The same at 20 and 32 layers, sized for 4 and 8 GPUs (issue 18): 104.0 GB per GPU with --ep 4 (182.6 with
    # --ep 2) and 100.7 GB with --ep 8 (163.5 with --ep 4). The trunk (1.03 GB a layer) and the embedding and
    # lm_head (4.7 GB) are on every GPU, so 4 and 8 H200s hold about 5 and 4 true K3 layers each, not 8.
    "k3-ep4": {**_K3, "num_hidden_layers": 20, "first_k_dense_replace": 0},
    "k3-ep8": {**_K3, "num_hidden_layers": 32, "first_k_dense_replace": 0},
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
}




def _fp8(name: str, block: int) -> dict:
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    return {**PRESETS[name], "quantization_config": q}


# tiny-k3 with its routed experts at a record's k span (quant/mxfp4_frag.py: latent and expert intermediate multiples
# of 256), so the CuTe DSL experts (cute-latent-moe) are in scope at a tiny size: the harness's preset for them.
# Not validate/mega_gpu.py's CASES entry of the same name (latent 1056, intermediate 2080: the megakernel's chunk
# tails), which its case_config resolves first; the clash is to be renamed away with the report's next regeneration
PRESETS["tiny-k3-wide"] = {**PRESETS["tiny-k3"], "latent_size": 256, "moe_intermediate_size": 256}
PRESETS.update({"tiny-qwen3-moe-fp8": _fp8("tiny-qwen3-moe", 32), "tiny-deepseek-v3-fp8": _fp8("tiny-deepseek-v3", 32),
                "qwen3-30b-a3b-fp8": _fp8("qwen3-30b-a3b", 128)})
# tiny-deepseek-v3 with one multi-token-prediction layer after its last (model.layers.3: DeepSeek-V3's layout, a MoE
# layer), the MTP drafter's preset (megadecode/mtp.py, `--speculative mtp`)
PRESETS["tiny-deepseek-v3-mtp"] = {**PRESETS["tiny-deepseek-v3"], "num_nextn_predict_layers": 1}


def preset_hf_config(name: str) -> dict:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])


def preset_config(name: str) -> ModelConfig:
    return config_from_hf(preset_hf_config(name))
