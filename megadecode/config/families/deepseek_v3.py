"""deepseek_v3 / kimi_k2 config.json, read through transformers' DeepseekV3Config (its aliases and its defaults
where a field is left out; config/hf_class.py), then our checks."""

from __future__ import annotations

from ..fields import (
    common_fields,
    hf_eos,
    hf_field,
    hf_num_layers,
    hf_quantization,
    hf_rope,
    require_silu,
)
from ..hf_class import resolve
from ..model import ConfigError, ModelConfig

# The fields that set the model's size: no default, whatever DeepseekV3Config would fill in.
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "max_position_embeddings",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def parse(d: dict) -> ModelConfig:
    quant, block = hf_quantization(d, d.get("model_type"))
    L = hf_num_layers(d)
    hf_rope(d, 0)  # structure checked on what was written
    hf_eos(d)
    r = resolve(d, "DeepseekV3Config", REQUIRED)
    require_silu(r)
    c = common_fields(r, L, raw=d)
    if r.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for deepseek_v3")
    scoring = r.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"scoring_func {scoring!r} is not supported for deepseek_v3 (only 'sigmoid')")
    topk_method = r.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"topk_method {topk_method!r} is not supported (only 'noaux_tc')")
    first_dense = hf_field(r, "first_k_dense_replace", 3, type_=int)
    if first_dense < 0:
        raise ConfigError(f"first_k_dense_replace must be >= 0, got {first_dense}")
    rope_dim = hf_field(r, "qk_rope_head_dim", type_=int)
    return ModelConfig(
        family="deepseek_v3", **c, rope=hf_rope(r, rope_dim),
        num_experts=hf_field(r, "n_routed_experts", type_=int), top_k=hf_field(r, "num_experts_per_tok", type_=int),
        moe_intermediate_size=hf_field(r, "moe_intermediate_size", type_=int),
        intermediate_size=hf_field(r, "intermediate_size", type_=int),
        norm_topk_prob=bool(r.get("norm_topk_prob", True)),
        # transformers' DeepseekV3 makes every layer from `first_k_dense_replace` on a MoE layer.
        moe_layers=tuple(i >= first_dense for i in range(L)), score_func="sigmoid",
        n_group=hf_field(r, "n_group", 8, type_=int), topk_group=hf_field(r, "topk_group", 4, type_=int),
        routed_scaling_factor=float(hf_field(r, "routed_scaling_factor", 2.5, type_=float)),
        n_shared_experts=hf_field(r, "n_shared_experts", 1, type_=int),
        q_lora_rank=hf_field(r, "q_lora_rank", None, type_=int),  # null: queries projected directly
        kv_lora_rank=hf_field(r, "kv_lora_rank", type_=int),
        qk_nope_head_dim=hf_field(r, "qk_nope_head_dim", type_=int), qk_rope_head_dim=rope_dim,
        v_head_dim=hf_field(r, "v_head_dim", type_=int), rope_interleave=bool(r.get("rope_interleave", True)),
        num_kv_heads=hf_field(r, "num_key_value_heads", c["num_heads"], type_=int),
        expert_quant=quant, weight_block=block,
        # read as written: DeepseekV3Config fills in 1 where config.json leaves it out, and a checkpoint without
        # the field holds no MTP layer (Kimi K2's says 0)
        num_mtp_layers=hf_field(d, "num_nextn_predict_layers", 0, type_=int),
    )
