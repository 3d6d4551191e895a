"""deepseek_v3 / kimi_k2 config.json (DeepseekV3Config's defaults where a field is left out)."""

from __future__ import annotations

from ..fields import (
    common_fields,
    hf_field,
    hf_num_layers,
    hf_rope,
    reject_quantized,
    require_silu,
)
from ..model import ConfigError, ModelConfig


def parse(d: dict) -> ModelConfig:
    reject_quantized(d, d.get("model_type"))
    require_silu(d)
    L = hf_num_layers(d)
    c = common_fields(d, L)
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported for deepseek_v3")
    scoring = d.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"scoring_func {scoring!r} is not supported for deepseek_v3 (only 'sigmoid')")
    topk_method = d.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"topk_method {topk_method!r} is not supported (only 'noaux_tc')")
    # Defaults below are DeepseekV3Config's.
    first_dense = hf_field(d, "first_k_dense_replace", 3, type_=int)
    if first_dense < 0:
        raise ConfigError(f"first_k_dense_replace must be >= 0, got {first_dense}")
    rope_dim = hf_field(d, "qk_rope_head_dim", type_=int)
    return ModelConfig(
        family="deepseek_v3", **c, rope=hf_rope(d, rope_dim),
        num_experts=hf_field(d, "n_routed_experts", type_=int), top_k=hf_field(d, "num_experts_per_tok", type_=int),
        moe_intermediate_size=hf_field(d, "moe_intermediate_size", type_=int),
        intermediate_size=hf_field(d, "intermediate_size", type_=int),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        # transformers' DeepseekV3 makes every layer from `first_k_dense_replace` on a MoE layer.
        moe_layers=tuple(i >= first_dense for i in range(L)), score_func="sigmoid",
        n_group=hf_field(d, "n_group", 8, type_=int), topk_group=hf_field(d, "topk_group", 4, type_=int),
        routed_scaling_factor=float(hf_field(d, "routed_scaling_factor", 2.5, type_=float)),
        n_shared_experts=hf_field(d, "n_shared_experts", 1, type_=int),
        # null: queries projected directly (no low-rank q); absent: DeepseekV3Config's 1536.
        q_lora_rank=(None if "q_lora_rank" in d and d["q_lora_rank"] is None
                     else hf_field(d, "q_lora_rank", 1536, type_=int)),
        kv_lora_rank=hf_field(d, "kv_lora_rank", type_=int),
        qk_nope_head_dim=hf_field(d, "qk_nope_head_dim", type_=int), qk_rope_head_dim=rope_dim,
        v_head_dim=hf_field(d, "v_head_dim", type_=int), rope_interleave=bool(d.get("rope_interleave", True)),
        num_kv_heads=hf_field(d, "num_key_value_heads", c["num_heads"], type_=int),
    )
